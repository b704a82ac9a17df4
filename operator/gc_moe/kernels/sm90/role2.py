"""Role2 of the SM90 GC-MoE layer as one kernel: W1 and W2 of the ring-consumer grouped GEMM in one launch.

The paper's compute node (Algorithm 1, role2; Section 4.3): the grouped GEMM consumes the token ring while role1
fills it and drives W2 by the W1-completion bitmap, so the layer graph has three nodes (dispatch, role2,
finalize), four with the shared expert. The two GEMMs are the halves of `grouped_gemm` (`GemmConfig.fused_role2`);
this module only decides which unit each CTA runs and how the halves hand over:

- **persistent CTAs and compact tickets**: one CTA per compute SM (`launch_ctas`; two at bn 8 with
  `ctas_per_sm=2`, opt-in). After RING_READY, warp 0 of
  each CTA builds the experts' token-tile prefix in shared memory; tickets (`atom.add` on the control word
  ROLE2_TICKET) number only the units with rows, W1's (expert, weight-row CTA, token tile fastest) before W2's
  in the same order (`unit_of_ticket` is the host twin); in a reused ring (`ring_reuse`) both go tile by tile
  (expert, token tile, weight-row CTA fastest) and W2's tiles trail W1's by `w2_lag_tiles`, so the units that
  free a ring block (W1 for the token ring, W2 for W1's output rows) come before those that wait for its next
  generation. The producer draws the CTA's next unit after its
  last copy. A W2 unit waits only for W1 units with smaller tickets, each held by a resident CTA that runs it
  (or runs an earlier W1 unit first, which waits for nothing but role1), so the waits cannot deadlock. The draw
  that completes the launch's count (units + one final draw per CTA) resets the word for the next launch.
- **one pipeline across units**: the stage barriers are set up once; a unit's K128 steps are the CTA's steps
  base .. base + k - 1 (`grouped_gemm.step_stage` / `full_parity` / `empty_parity`), so the producer loop and
  the consumer loop run on without re-initializing anything. Units pass from the producer to the consumers
  through two slots, each with a full barrier (the drawing thread wrote it) and an empty one (every consumer
  warp read it): `unit_slot` / `slot_full_parity` / `slot_empty_parity`. The producer streams the next unit
  while the consumers finish the current one (docs/sm90-layer.md, "Role2's stages run on across units": 3%
  faster than a barrier between units at 32-token tiles, 5-12% slower at 8 / 16, where the old loop's lead has
  no measured cause yet).
- **W1 -> W2**: W1 unit (expert e, weight-row CTA bx, token tile bz) writes 128 intermediate channels, exactly
  K128 block bx of W2's input rows, then (after a consumer barrier) sets bit bx of the word
  `w1_done_mask[e, bz]` with release. A W2 unit of (e, bz) issues the bulk copies of its first weight stages at
  once (weights do not depend on W1), acquires until all I/128 bits of the word are set, then copies W1's rows
  and reads their scales, routing destinations and sources with coherent loads (they were written during this
  kernel, so neither the non-coherent path nor an L1 line may serve them). Role3 (finalize) clears the words for
  the next replay.
- the layer runs this kernel at 1 token per rank (`layer.role2_fused`); docs/sm90-layer.md has the measurements.

Kernel parameters (all scalars, in order): `PARAMS`. Host side (no DSL needed): `PARAMS`, `Role2Config`,
`variant`, `units`, `launch_ctas`, `unit_of_ticket`, `role2_launch`.
"""


from dataclasses import dataclass

from gc_moe.kernels.sm90 import grouped_gemm as gg

PARAMS = (
    ("w1_codes", "u64"), ("w1_scales", "u64"), ("w1_factor", "u64"),
    ("w2_codes", "u64"), ("w2_scales", "u64"), ("w2_factor", "u64"),
    ("ring_act", "u64"), ("ring_scale", "u64"), ("expert_offsets", "u64"), ("routing_weight", "u64"),
    ("l2_act", "u64"), ("l2_scale", "u64"), ("dest_row", "u64"), ("combine", "u64"),
    ("ring_ready", "u64"), ("l1_full_count", "u64"), ("l1_empty_count", "u64"),
    ("ring_source", "u64"), ("peers", "u64"), ("w1_done_mask", "u64"), ("ticket", "u64"),
    ("hidden_blocks", "s32"), ("w1_row_tiles", "s32"), ("inter_blocks", "s32"), ("w2_row_tiles", "s32"),
    ("ring_block_m", "s32"), ("ring_blocks", "s32"), ("source_rows", "s32"), ("local_experts", "s32"),
    ("mask_stride", "s32"), ("timeout_ns", "s64"),
    ("l2_empty_count", "u64"),  # last: the pool ring's variants never read it (their code is unchanged)
)
# stack bytes per thread a variant may use, never inside a K loop (SASS checked): bn 8 and 16 use none; bn 32
# spills 88 bytes: the W1 epilogue's 64-bit rows of its routing-weight loop (live across its barrier) in the
# consumers' 112 registers, and unit values of the producer's loop and draw in its 32; stored and loaded once per
# unit
LOCAL_BYTES_BUDGET = {8: 16, 16: 16, 32: 96}
BLOCK_N_CHOICES = (8, 16, 32)  # token tiles of the persistent kernel
# bn 32 spills 128 bytes per thread in the 96 registers a 544-thread CTA gets (both halves, the loop and the
# scheduler): there the producer is a warpgroup that lends the consumers registers for the main loop
SPLIT_BLOCK_N = {32: (4, 112)}  # block_n -> (producer_warps, consumer_registers)
# token tiles whose kernel also builds at two CTAs per SM (bn 8: 56 registers, no stack, 6 stages); the layer's
# default from 2 tokens per rank (GC_MOE_ROLE2_CTAS_PER_SM, docs/sm90-layer.md)
TWO_CTA_BLOCK_N = (8,)
# ring_reuse: the ring's block rows (the layer's RING_BLOCK_M), fixed at build time so that W2's l2_empty release
# over the blocks of its tile unrolls: a loop there costs the consumers' K loop its uniform registers (SASS: 156 ->
# 167 instructions per K128 step at bn 8)
REUSE_BLOCK_M = 8
MAX_INTER_BLOCKS = gg.FUSED_MAX_K_BLOCKS  # W2's K128 blocks = W1 units per token tile: a bit each, a table row


# The unit slots' handshake (host and device: plain ints or DSL values). Unit u (the CTA's u-th draw, from 0)
# goes into slot u mod 2; the drawing producer thread completes the slot's full barrier once it wrote it (the
# first draw too), so every thread waits for unit u with the parity of the slot's (u // 2)-th phase; the 16
# consumer warps complete the slot's empty barrier once they read it, and the producer waits for that (the
# reading of unit u - 2) before it draws unit u >= 2 into the same slot.
def unit_slot(unit):
    return unit % gg.FUSED_UNIT_SLOTS


def slot_full_parity(unit):
    return (unit // gg.FUSED_UNIT_SLOTS) % 2


def slot_empty_parity(unit):
    return ((unit // gg.FUSED_UNIT_SLOTS) + 1) % 2


@dataclass(frozen=True)
class Role2Config:
    block_n: int = 8
    swiglu_alpha: float = 1.0
    swiglu_clamp: float = 10.0
    producer_warps: int | None = None  # None: 4 where the registers are split (SPLIT_BLOCK_N), else 1
    consumer_registers: int | None = None  # None: SPLIT_BLOCK_N's where it names the token tile
    side_threads: int = 0  # threads of the CTA beside the loop's (the Mega MoE port's dispatch warps)
    ctas_per_sm: int = 1  # 2: two persistent CTAs per SM (TWO_CTA_BLOCK_N only)
    # a reused token ring (layer_layout.LayerShape.ring_reuse): tickets tile by tile with W2 a lag behind W1, ring
    # rows by modulo (the token ring and W1's output rows), l1_empty_count / l2_empty_count released by rows (role1
    # / W1 wait on them)
    ring_reuse: bool = False

    def half(self, role: str) -> gg.GemmConfig:
        """The grouped GEMM configuration of one half (both halves share stages, threads and shared memory). One
        persistent CTA per SM by default: the layer runs this kernel at 1 token per rank, where one CTA per SM
        measured 99.1 / 87.7 us (GLM-5.2 / DeepSeek) against 117.5 / 107.1 with two at bn 8 (docs/sm90-layer.md);
        two (`ctas_per_sm`) at bn 8 for more tokens, opt-in."""
        return gg.GemmConfig(role, self.block_n, swiglu_alpha=self.swiglu_alpha, swiglu_clamp=self.swiglu_clamp,
                             ring_consumer=True, warp_specialized=True, producer_warps=self.producer_warps,
                             ctas_per_sm=self.ctas_per_sm, fused_role2=True, consumer_registers=self.consumer_registers,
                             side_threads=self.side_threads, ring_reuse=self.ring_reuse)

    def __post_init__(self):
        split = SPLIT_BLOCK_N.get(self.block_n, (1, None))
        if self.producer_warps is None:
            object.__setattr__(self, "producer_warps", split[0])
        if self.consumer_registers is None and self.producer_warps == split[0]:
            object.__setattr__(self, "consumer_registers", split[1])
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n {self.block_n}: the persistent role2 kernel is built at {BLOCK_N_CHOICES} (bn 64 "
                             f"needs more registers than a consumer can get); allowed: {BLOCK_N_CHOICES}")
        if self.ctas_per_sm not in (1, 2) or (self.ctas_per_sm == 2 and self.block_n not in TWO_CTA_BLOCK_N):
            raise ValueError(f"ctas_per_sm {self.ctas_per_sm} at block_n {self.block_n}; allowed: 1, or 2 at block_n "
                             f"in {TWO_CTA_BLOCK_N} (the registers of two CTAs per SM)")
        w1, w2 = self.half("w1"), self.half("w2")
        if (w1.stages, w1.threads, w1.smem_bytes, w1.ctas_per_sm) != (w2.stages, w2.threads, w2.smem_bytes,
                                                                      w2.ctas_per_sm):
            raise AssertionError(f"role2 halves differ: {w1} / {w2}")


def units(block_n: int, hidden: int, intermediate: int, local_experts: int, expert_rows_bound: int) -> dict:
    """The most units one call can have: W1 units, W2 units (token tiles x weight-row CTAs x experts each)."""
    token_tiles = max(1, -(-expert_rows_bound // block_n))
    w1 = token_tiles * (2 * intermediate // gg.ROWS_PER_CTA) * local_experts
    w2 = token_tiles * (hidden // gg.ROWS_PER_CTA) * local_experts
    return {"token_tiles": token_tiles, "w1": w1, "w2": w2}


def launch_ctas(block_n: int, compute_sms: int, max_units: int, ctas_per_sm: int = 1) -> int:
    """Persistent CTAs of the launch: as many as the compute partition holds at once, never more than units."""
    return max(1, min(max_units, compute_sms * Role2Config(block_n, ctas_per_sm=ctas_per_sm).half("w1").ctas_per_sm))


def w2_lag_tiles(ring_blocks, ring_block_m, block_n):
    """How many token tiles the W2 units trail the W1 units by in a reused ring (host and device: plain ints or
    DSL values). A W1 unit that stores a later generation of its rows waits for the W2 units of the tiles over
    the same ring block a ring length before; at least (B - 1) BM - 2 BN + 2 rows, so ceil of that / BN tiles,
    lie between those and it, so with this lag they hold smaller tickets and the waits stay acyclic. A
    pool-sized ring gives a lag past the last tile: every W2 unit after every W1 unit. At most 0 means 0, and a
    call whose rows fit the ring (no later generation) takes every W2 unit after every W1 unit too
    (`effective_lag`)."""
    gap = (ring_blocks - 1) * ring_block_m - 2 * block_n + 2
    return (gap + block_n - 1) // block_n


def effective_lag(lag: int, tiles: int, rows: int, ring_rows: int) -> int:
    """Host twin of the draw's lag for one call: `lag` clamped to 0 .. tiles, all tiles when no row of the call
    goes round the ring (nothing then waits on W2)."""
    return tiles if rows <= ring_rows else max(0, min(lag, tiles))


def unit_of_ticket(ticket: int, prefix: list[int], w1_ctas: int, w2_ctas: int, ring_reuse: bool = False,
                   lag: int | None = None):
    """Host twin of the scheduler: ticket -> ("w1" | "w2", expert, weight-row CTA, token tile), or None past the
    last unit. prefix[e] = token tiles with rows of the experts before e (prefix[-1]: all of them); units of a
    role run expert by expert, within an expert weight-row CTA by weight-row CTA, token tiles fastest; with
    `ring_reuse` W1's run token tile by token tile, weight-row CTAs fastest (grouped-row order)."""
    tiles = prefix[-1]
    if ticket >= tiles * (w1_ctas + w2_ctas):
        return None
    if ring_reuse:  # tile by tile (weight-row CTAs fastest), W2's tiles `lag` tiles behind W1's
        d = max(0, min(tiles if lag is None else lag, tiles))
        head, both, mid = d * w1_ctas, w1_ctas + w2_ctas, (tiles - d) * (w1_ctas + w2_ctas)
        if ticket < head:
            role, j, x = "w1", ticket // w1_ctas, ticket % w1_ctas
        elif ticket < head + mid:
            k, r = divmod(ticket - head, both)
            role, j, x = ("w1", d + k, r) if r < w1_ctas else ("w2", k, r - w1_ctas)
        else:
            role, j, x = "w2", tiles - d + (ticket - head - mid) // w2_ctas, (ticket - head - mid) % w2_ctas
        e = max(k for k in range(len(prefix) - 1) if prefix[k] <= j)
        return role, e, x, j - prefix[e]
    role, ctas, u = ("w1", w1_ctas, ticket) if ticket < tiles * w1_ctas else ("w2", w2_ctas, ticket - tiles * w1_ctas)
    j = u // ctas
    e = max(k for k in range(len(prefix) - 1) if prefix[k] <= j)
    te = prefix[e + 1] - prefix[e]
    local = u - prefix[e] * ctas
    return role, e, local // te, local % te


def variant(block_n: int, swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0, producer_warps: int | None = None,
            consumer_registers: int | None = None, ctas_per_sm: int = 1, ring_reuse: bool = False):
    """The runtime KernelVariant of the fused role2 kernel at one token tile."""
    from gc_moe.runtime.jit import KernelVariant

    cfg = Role2Config(block_n, swiglu_alpha, swiglu_clamp, producer_warps, consumer_registers,
                      ctas_per_sm=ctas_per_sm, ring_reuse=ring_reuse)  # validates
    params = {"block_n": block_n, "swiglu_alpha": swiglu_alpha, "swiglu_clamp": swiglu_clamp}
    if ctas_per_sm != 1:  # the one-CTA variants keep their measured parameters (and cache keys)
        params["ctas_per_sm"] = ctas_per_sm
    if cfg.producer_warps != 1:
        params["producer_warps"] = cfg.producer_warps
    if cfg.consumer_registers is not None:
        params["consumer_registers"] = cfg.consumer_registers
    if ring_reuse:  # named only when on: the pool-sized ring's variants keep their parameters
        params["ring_reuse"] = True
    promises = ("wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.shared::cluster.global.mbarrier",
                "mbarrier.try_wait.parity", "atom.relaxed.gpu.global.add", "red.release.gpu.global.or.b64",
                "ld.relaxed.gpu.global", "fence.acq_rel.gpu", "trap")
    return KernelVariant.make("sm90.role2", __name__, "build_role2", params, promises=promises,
                              local_bytes_budget=LOCAL_BYTES_BUDGET[block_n],
                              extra_sources=("gc_moe.kernels.sm90.grouped_gemm", "gc_moe.kernels.sm90.ptx",
                                             "gc_moe.kernels.sm90.dispatch", "gc_moe.kernels.sm90.layer_layout"))


def role2_launch(kernel, l1, l2, ws, shape, expert_rows_bound: int, timeout_s: float, compute_sms: int) -> tuple:
    """(grid, arguments) of the role2 node from the layer workspace `ws` (layer_layout regions) and its
    `layer_layout.LayerShape`; l1 / l2: this rank's SM90 matrices (weights.sm90.Sm90Matrix); compute_sms: the
    SMs of the partition it runs in (the persistent CTAs fill it once)."""
    from gc_moe.kernels.sm90 import layer_layout as ll
    from gc_moe.runtime.launch import i32, i64, ptr

    cfg = Role2Config(**dict(kernel.entry.variant.params))
    h, i, e = shape.hidden, shape.intermediate, shape.local_experts
    if i // 128 > MAX_INTER_BLOCKS:
        raise ValueError(f"intermediate {i}: W2's {i // 128} K128 blocks exceed the {MAX_INTER_BLOCKS} a "
                         f"W1-completion word and W2's scale table hold; allowed: at most {128 * MAX_INTER_BLOCKS}")
    if e > gg.FUSED_MAX_LOCAL_EXPERTS:
        raise ValueError(f"{e} local experts; allowed: at most {gg.FUSED_MAX_LOCAL_EXPERTS} (the scheduler's "
                         f"token-tile prefix lives in shared memory; role2_nodes=2 serves more)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    if cfg.ring_reuse and shape.block_m != REUSE_BLOCK_M:
        raise ValueError(f"ring block of {shape.block_m} rows; the ring_reuse variants are built for "
                         f"{REUSE_BLOCK_M}-row blocks (REUSE_BLOCK_M)")
    if shape.ring_reuse and not cfg.ring_reuse:
        raise ValueError(f"the ring has {shape.ring_blocks} blocks for a pool of {shape.pool_blocks} (reused within a "
                         f"replay); this role2 kernel reads grouped rows by their flat index: load its ring_reuse "
                         f"variant (role2.variant(..., ring_reuse=True))")
    n = units(cfg.block_n, h, i, e, expert_rows_bound)
    mask_stride = ws.w1_done_mask.shape[1]
    if n["token_tiles"] > mask_stride:
        raise ValueError(f"{n['token_tiles']} token tiles per expert exceed the W1-completion words per expert "
                         f"({mask_stride}): expert_rows_bound {expert_rows_bound} is above the workspace's")
    control = ws.control.data_ptr()
    args = [ptr(l1.codes), ptr(l1.scales), ptr(l1.factor), ptr(l2.codes), ptr(l2.scales), ptr(l2.factor),
            ptr(ws.ring_act), ptr(ws.ring_scale), ptr(ws.expert_offsets), ptr(ws.routing_weight),
            ptr(ws.l2_act), ptr(ws.l2_scale), ptr(ws.dest_row), ptr(ws.combine),
            ptr(control + 4 * ll.RING_READY), ptr(ws.l1_full_count), ptr(ws.l1_empty_count),
            ptr(ws.ring_source), ptr(ws.peers), ptr(ws.w1_done_mask), ptr(control + 4 * ll.ROLE2_TICKET),
            i32(h // 128), i32(2 * i // 64), i32(i // 128), i32(h // 64),
            i32(shape.block_m), i32(shape.ring_blocks), i32(shape.capacity * shape.topk),
            i32(e), i32(mask_stride), i64(int(timeout_s * 1e9)), ptr(ws.l2_empty_count)]
    return (launch_ctas(cfg.block_n, compute_sms, n["w1"] + n["w2"], cfg.ctas_per_sm), 1, 1), args


# ------------------------------------------------------------------------------------------------- device code
def _make_kernel(cfg: Role2Config):
    """The role2 kernel (host launcher) and its GEMM half's configuration."""
    from cutlass import Int32, Int64, cute

    half1 = cfg.half("w1")
    run_units = make_unit_loop(cfg)

    @cute.kernel
    def kernel(w1_codes: Int64, w1_scales: Int64, w1_factor: Int64, w2_codes: Int64, w2_scales: Int64,
               w2_factor: Int64, ring_act: Int64, ring_scale: Int64, expert_offsets: Int64, routing_weight: Int64,
               l2_act: Int64, l2_scale: Int64, dest_row: Int64, combine: Int64, ring_ready: Int64,
               l1_full_count: Int64, l1_empty_count: Int64, ring_source: Int64, peers: Int64, w1_done_mask: Int64,
               ticket: Int64, hidden_blocks: Int32, w1_row_tiles: Int32, inter_blocks: Int32, w2_row_tiles: Int32,
               ring_block_m: Int32, ring_blocks: Int32, source_rows: Int32, local_experts: Int32,
               mask_stride: Int32, timeout_ns: Int64, l2_empty_count: Int64):
        run_units(w1_codes, w1_scales, w1_factor, w2_codes, w2_scales, w2_factor, ring_act, ring_scale,
                  expert_offsets, routing_weight, l2_act, l2_scale, dest_row, combine, ring_ready, l1_full_count,
                  l1_empty_count, ring_source, peers, w1_done_mask, ticket, hidden_blocks, w1_row_tiles,
                  inter_blocks, w2_row_tiles, ring_block_m, ring_blocks, source_rows, local_experts, mask_stride,
                  timeout_ns, l2_empty_count)

    launch = {"grid": (1, 1, 1), "block": (half1.threads, 1, 1), "smem": half1.smem_bytes}
    launch.update(gg.launch_register_bounds(half1))

    @cute.jit
    def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64, a8: Int64,
             a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, a14: Int64, a15: Int64, a16: Int64,
             a17: Int64, a18: Int64, a19: Int64, a20: Int64, hidden_blocks: Int32, w1_row_tiles: Int32,
             inter_blocks: Int32, w2_row_tiles: Int32, ring_block_m: Int32, ring_blocks: Int32, source_rows: Int32,
             local_experts: Int32, mask_stride: Int32, timeout_ns: Int64, a21: Int64):
        kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
               hidden_blocks, w1_row_tiles, inter_blocks, w2_row_tiles, ring_block_m, ring_blocks, source_rows,
               local_experts, mask_stride, timeout_ns, a21).launch(**launch)

    return host, half1


def make_unit_loop(cfg: Role2Config):
    """The persistent scheduler and unit loop of role2 as one device function (`run_units`, parameters as the
    kernel's `PARAMS`): the role2 kernel is just this; the SM90 Mega MoE port runs it after its dispatch phase.
    Every CTA of the launch must call it once (the ticket word's reset counts one final draw per CTA)."""
    import cutlass
    from cutlass import Int32, Int64, cute

    from gc_moe.kernels.sm90 import dispatch as ring_protocol
    from gc_moe.kernels.sm90 import ptx

    half1, half2 = cfg.half("w1"), cfg.half("w2")
    w1_body = gg._make_kernel(half1)
    w2_body = gg._make_kernel(half2)

    STAGES = half1.stages
    # both halves run on one ring of stages and one set of barriers
    assert (half1.stages, half1.stage_bytes, half1.barrier_offset, half1.full_arrivals) == (
        half2.stages, half2.stage_bytes, half2.barrier_offset, half2.full_arrivals)
    BN = cfg.block_n
    SPLIT = half1.consumer_registers is not None
    REUSE = cfg.ring_reuse
    SPAN = -(-(BN - 1) // REUSE_BLOCK_M) + 1  # ring blocks a token tile can touch (the W2 release is unrolled)

    @cute.jit
    def build_prefix(expert_offsets, local_experts, prefix, lane):
        """Warp 0: prefix[e] = token tiles with rows of the experts before e (an inclusive warp scan per 32
        experts, carried across chunks); role1 wrote the offsets during this kernel: coherent loads."""
        carry = Int32(0)
        if lane == 0:
            ring_protocol.sts(prefix, Int32(0))
        for c in cutlass.range((local_experts + 31) // 32):
            e = c * 32 + lane
            tiles = Int32(0)
            if e < local_experts:
                rows = ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(e) * 4 + 4) - ptx.ld_relaxed_gpu_s32(
                    expert_offsets + Int64(e) * 4)
                tiles = (rows + (BN - 1)) // BN
            incl = tiles
            for d in cutlass.range_constexpr(5):
                up = ptx.shfl_up_s32(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            if e < local_experts:
                ring_protocol.sts(prefix + (e + 1) * 4, carry + incl)
            carry = carry + ptx.shfl_idx_s32(incl, Int32(31))
        ptx.warp_sync()

    @cute.jit
    def draw_unit(ticket, prefix, local_experts, w1_ctas, w2_ctas, launch_ctas, slot, lag=None):
        """Thread 0: the next ticket -> (role word, expert, weight-row CTA, token tile) into `slot`; expert -1
        once every unit is drawn. The role word is below the W1 units' count for a W1 unit. The draw that
        completes the launch's count (units + one final draw per CTA) resets the word for the next launch.
        lag (ring reuse): (w2_lag_tiles, this call's grouped rows, the ring's rows); the W2 units of token tile j
        follow the W1 units of tile j + lag (`unit_of_ticket`, `effective_lag`)."""
        tiles = ring_protocol.lds(prefix + local_experts * 4)
        w1_units = tiles * w1_ctas
        units = tiles * (w1_ctas + w2_ctas)
        drawn = ptx.atom_add_relaxed_gpu_s32(ticket, Int32(1))
        if drawn == units + launch_ctas - 1:
            ptx.st_relaxed_gpu_s32(ticket, Int32(0))
        e = Int32(-1)
        bx = Int32(0)
        bz = Int32(0)
        role = drawn
        if drawn < units:
            ctas = w1_ctas
            u = drawn
            if drawn >= w1_units:
                ctas = w2_ctas
                u = drawn - w1_units
            j = u // ctas
            x = Int32(0)
            if cutlass.const_expr(REUSE):
                # tile by tile, W2's tiles `lag` tiles behind W1's: (tile, weight-row CTA) of this ticket
                d, call_rows, ring_rows = lag
                if d > tiles or call_rows <= ring_rows:  # no row goes round: every W2 unit after every W1 unit
                    d = tiles
                if d < 0:
                    d = Int32(0)
                head = d * w1_ctas
                both = w1_ctas + w2_ctas
                middle = (tiles - d) * both
                role = Int32(0)
                if drawn < head:
                    j = drawn // w1_ctas
                    x = drawn - j * w1_ctas
                elif drawn < head + middle:
                    k = (drawn - head) // both
                    r = drawn - head - k * both
                    if r < w1_ctas:
                        j = d + k
                        x = r
                    else:
                        role = units
                        j = k
                        x = r - w1_ctas
                else:
                    role = units
                    j = tiles - d + (drawn - head - middle) // w2_ctas
                    x = drawn - head - middle - (j - tiles + d) * w2_ctas
            lo = Int32(0)
            hi = local_experts
            while hi - lo > 1:  # the last expert whose prefix is <= j (it has tiles: its next prefix is > j)
                mid = (lo + hi) // 2
                if ring_protocol.lds(prefix + mid * 4) <= j:
                    lo = mid
                else:
                    hi = mid
            e = lo
            first = ring_protocol.lds(prefix + e * 4)
            te = ring_protocol.lds(prefix + (e + 1) * 4) - first
            local = u - first * ctas
            bx = local // te
            bz = local - bx * te
            if cutlass.const_expr(REUSE):
                bz = j - first
                bx = x
        ring_protocol.sts(slot, role)
        ring_protocol.sts(slot + 4, e)
        ring_protocol.sts(slot + 8, bx)
        ring_protocol.sts(slot + 12, bz)

    @cute.jit
    def run_unit(side, slot, slot_empty, e, started, base, weights, tensors, ring, w2_ring, dims, sched):
        """One side's part of the unit in `slot` (expert e; slot_empty: the slot's empty barrier, which the
        consumer warps complete once they read it): a W1 unit if its ticket is below the W1 units' count, else
        a W2 unit. Returns the CTA's K128 steps after it."""
        w1_codes, w1_scales, w1_factor, w2_codes, w2_scales, w2_factor = weights
        ring_act, ring_scale, expert_offsets, routing_weight, l2_act, l2_scale, dest_row, combine = tensors
        hidden_blocks, w1_row_tiles, inter_blocks, w2_row_tiles = dims
        prefix, local_experts, w1_ctas, w1_done_mask, mask_stride, timeout_ns = sched
        drawn = ring_protocol.lds(slot)
        bx = ring_protocol.lds(slot + 8)
        bz = ring_protocol.lds(slot + 12)
        if cutlass.const_expr(side == "consumer"):
            ptx.warp_sync()
            if cute.arch.thread_idx()[0] % 32 == 0:
                ptx.mbarrier_arrive(slot_empty)
        else:
            started = cute.arch.globaltimer()  # the producer's bounded waits count from the unit's start
        done_mask = w1_done_mask + (Int64(e) * Int64(mask_stride) + Int64(bz)) * 8
        if drawn < ring_protocol.lds(prefix + local_experts * 4) * w1_ctas:
            w1_body(w1_codes, w1_scales, w1_factor, ring_act, ring_scale, expert_offsets, routing_weight,
                    l2_act, l2_scale, hidden_blocks, w1_row_tiles, ring, (e, bx, bz, started, done_mask, side, base))
            base = base + hidden_blocks
        elif cutlass.const_expr(REUSE):
            ring_block_m, ring_blocks, l2_empty_count = ring[3], ring[4], ring[6]
            w2_body(w2_codes, w2_scales, w2_factor, l2_act, l2_scale, expert_offsets, dest_row, combine,
                    inter_blocks, w2_row_tiles, w2_ring, (e, bx, bz, started, done_mask, timeout_ns, side, base,
                                                          ring_block_m * ring_blocks))
            base = base + inter_blocks
            if cutlass.const_expr(side == "consumer"):
                if cute.arch.thread_idx()[0] == 0:
                    # thread 0 passed every stage's full barrier of the unit, so its copies of W1's rows have
                    # landed: release them to the W1 units of their next generation, by rows (a tile touches at
                    # most SPAN blocks: unrolled, one modulo)
                    off0 = ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(e) * 4)
                    row0 = off0 + bz * BN
                    end = ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(e) * 4 + 4)
                    if end > row0 + BN:
                        end = row0 + BN
                    block0 = row0 // ring_block_m
                    slot0 = block0 % ring_blocks
                    for i in cutlass.range_constexpr(SPAN):
                        first = (block0 + i) * ring_block_m
                        if first < row0:
                            first = row0
                        last = (block0 + i + 1) * ring_block_m
                        if last > end:
                            last = end
                        slot_i = slot0 + i
                        if slot_i >= ring_blocks:
                            slot_i = slot_i - ring_blocks
                        if last > first:
                            ring_protocol.atom_add_release_gpu(l2_empty_count + Int64(slot_i) * 4, last - first)
        else:
            w2_body(w2_codes, w2_scales, w2_factor, l2_act, l2_scale, expert_offsets, dest_row, combine,
                    inter_blocks, w2_row_tiles, w2_ring, (e, bx, bz, started, done_mask, timeout_ns, side, base))
            base = base + inter_blocks
        return base

    @cute.jit
    def run_units(w1_codes, w1_scales, w1_factor, w2_codes, w2_scales, w2_factor, ring_act, ring_scale,
                  expert_offsets, routing_weight, l2_act, l2_scale, dest_row, combine, ring_ready, l1_full_count,
                  l1_empty_count, ring_source, peers, w1_done_mask, ticket, hidden_blocks, w1_row_tiles,
                  inter_blocks, w2_row_tiles, ring_block_m, ring_blocks, source_rows, local_experts, mask_stride,
                  timeout_ns, l2_empty_count=None):
        tid = cute.arch.thread_idx()[0]
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        slots = smem + half1.ticket_offset
        slot_full = smem + half1.slot_barrier_offset  # [slot]: the drawing thread wrote it
        slot_empty = slot_full + 8 * gg.FUSED_UNIT_SLOTS  # [slot]: every consumer warp read it
        prefix = smem + half1.prefix_offset
        started = cute.arch.globaltimer()
        ctas = Int32(cute.arch.grid_dim()[0])
        w1_ctas = w1_row_tiles // gg.TILES_PER_CTA
        w2_ctas = w2_row_tiles // gg.TILES_PER_CTA
        lag = None
        if cutlass.const_expr(REUSE):
            lag = w2_lag_tiles(ring_blocks, ring_block_m, Int32(BN))
        if tid < 32:
            if tid == 0:
                ring_protocol.wait_at_least(ring_ready, Int32(1), started, timeout_ns, False)
            ptx.warp_sync()
            build_prefix(expert_offsets, local_experts, prefix, tid)
            if tid == 0:
                # the barriers live for the whole loop: the stages' phases run on across units
                for st in cutlass.range_constexpr(STAGES):
                    ptx.mbarrier_init(smem + half1.barrier_offset + st * 8, half1.full_arrivals)
                    ptx.mbarrier_init(smem + half1.barrier_offset + (STAGES + st) * 8, gg.THREADS // 32)
                for sl in cutlass.range_constexpr(gg.FUSED_UNIT_SLOTS):
                    ptx.mbarrier_init(slot_full + sl * 8, 1)
                    ptx.mbarrier_init(slot_empty + sl * 8, gg.THREADS // 32)
                ptx.fence_mbarrier_init()
                first_lag = None
                if cutlass.const_expr(REUSE):  # thread 0 acquired RING_READY: the call's rows are visible
                    first_lag = (lag, ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(local_experts) * 4),
                                 ring_blocks * ring_block_m)
                draw_unit(ticket, prefix, local_experts, w1_ctas, w2_ctas, ctas, slots, first_lag)
                ptx.mbarrier_arrive(slot_full)
        ptx.gemm_barrier(half1)
        ring = (ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns)
        if cutlass.const_expr(REUSE):  # W1 waits on W2's releases of its output rows: BM rows x W2 CTAs each
            ring = ring + (l2_empty_count, ring_block_m * w2_ctas)
        weights = (w1_codes, w1_scales, w1_factor, w2_codes, w2_scales, w2_factor)
        tensors = (ring_act, ring_scale, expert_offsets, routing_weight, l2_act, l2_scale, dest_row, combine)
        w2_ring = (ring_source, peers, source_rows)
        dims = (hidden_blocks, w1_row_tiles, inter_blocks, w2_row_tiles)
        sched = (prefix, local_experts, w1_ctas, w1_done_mask, mask_stride, timeout_ns)
        if tid >= gg.THREADS:
            # the producer side: each unit's copies, then (lane 0 of producer warp 0) the next draw, into the
            # other slot once every consumer warp read what it held; then every producer thread reads it
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_decrease(half1.producer_registers)
            it = Int32(0)
            base = Int32(0)  # the CTA's K128 steps so far: every unit's stage and phase follow from it
            draw_lag = None
            if cutlass.const_expr(REUSE):  # after the barrier that followed thread 0's acquire of RING_READY
                draw_lag = (lag, ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(local_experts) * 4),
                            ring_blocks * ring_block_m)
            ptx.mbarrier_wait(slot_full, slot_full_parity(it))
            e = ring_protocol.lds(slots + 4)
            while e >= 0:
                base = run_unit("producer", slots + unit_slot(it) * 16, slot_empty + unit_slot(it) * 8, e, started,
                                base, weights, tensors, ring, w2_ring, dims, sched)
                it = it + 1
                if tid == gg.THREADS:
                    if it >= gg.FUSED_UNIT_SLOTS:
                        ptx.mbarrier_wait(slot_empty + unit_slot(it) * 8, slot_empty_parity(it))
                    draw_unit(ticket, prefix, local_experts, w1_ctas, w2_ctas, ctas, slots + unit_slot(it) * 16,
                              draw_lag)
                    ptx.mbarrier_arrive(slot_full + unit_slot(it) * 8)
                ptx.mbarrier_wait(slot_full + unit_slot(it) * 8, slot_full_parity(it))
                e = ring_protocol.lds(slots + unit_slot(it) * 16 + 4)
            ptx.cp_async_wait_all()  # the producer leaves only once its last copies have landed
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_increase(gg.WS_ENTRY_REGISTERS)
        else:
            # the consumer side: each unit's WGMMAs and epilogue as the producer fills the stages; a unit's slot
            # goes back once every consumer warp read it
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_increase(half1.consumer_registers)
            it = Int32(0)
            base = Int32(0)
            ptx.mbarrier_wait(slot_full, slot_full_parity(it))
            e = ring_protocol.lds(slots + 4)
            while e >= 0:
                base = run_unit("consumer", slots + unit_slot(it) * 16, slot_empty + unit_slot(it) * 8, e, started,
                                base, weights, tensors, ring, w2_ring, dims, sched)
                it = it + 1
                ptx.mbarrier_wait(slot_full + unit_slot(it) * 8, slot_full_parity(it))
                e = ring_protocol.lds(slots + unit_slot(it) * 16 + 4)
            if cutlass.const_expr(SPLIT):  # the registers go back to the pool
                cute.arch.setmaxregister_decrease(gg.WS_ENTRY_REGISTERS)
        # every thread is done with the barriers: thread 0 retires them (the shared memory may serve as plain
        # data after the loop, the Mega MoE port's phases)
        ptx.gemm_barrier(half1)
        if tid == 0:
            for st in cutlass.range_constexpr(2 * STAGES):
                ptx.mbarrier_inval(smem + half1.barrier_offset + st * 8)
            for sl in cutlass.range_constexpr(2 * gg.FUSED_UNIT_SLOTS):
                ptx.mbarrier_inval(slot_full + sl * 8)
        ptx.gemm_barrier(half1)

    return run_units


def build_role2(arch: str = "sm_90a", block_n: int = 8, swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0,
                producer_warps: int | None = None, consumer_registers: int | None = None, ctas_per_sm: int = 1,
                ring_reuse: bool = False):
    """The runtime's builder: a CompileRequest for one variant (no GPU needed)."""
    from cutlass import Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 role2 kernel is built for sm_90a only, not {arch!r}")
    host, half = _make_kernel(Role2Config(block_n, swiglu_alpha, swiglu_clamp, producer_warps, consumer_registers,
                                          ctas_per_sm=ctas_per_sm, ring_reuse=ring_reuse))
    args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in PARAMS)
    return CompileRequest(host, args, LaunchShape(block=(half.threads, 1, 1), dynamic_smem_bytes=half.smem_bytes))
