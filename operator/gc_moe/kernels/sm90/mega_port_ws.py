"""The SM90 Mega MoE port on the warp-specialized grouped GEMM (the `mega-port` baseline's `ws` pipeline).

One persistent cooperative kernel on every SM (sm_90a, CuTe DSL), the phases of `mega_port` with its GEMM phase
replaced by GC-MoE's persistent role2 loop, so inside each CTA a producer warp (a warpgroup at bn 32) streams the
weights with bulk copies and the token tiles with cp.async through an mbarrier ring while four consumer warpgroups
decode FP4 and run register-A WGMMA, and a scheduler hands out work by tickets (Figure 1(a)'s load, MMA and
scheduler roles; the arithmetic is GC-MoE's grouped GEMM, so the two operators differ in structure only):

1. routing (CTA 0), as `mega_port`: counts, grouped-row offsets, each row's routing entry; the tag-1 barrier;
   then the last partial ring block's count is padded (BM - tail) and ROUTING_READY released, which is also the
   ring-ready word of the GEMM loop.
2. dispatch, one grouped row per warp at a time, as `mega_port`: the token's E4M3 row converted to one FP32 scale
   per K128 block, its routing weight, combine row and source; then +1 with release on the row's ring block
   (`l1_full_count`, blocks of RING_BLOCK_M rows), where the GEMM's W1 units acquire them. At bn 8 / 16 three
   dispatch warps per CTA (`dispatch_warps`) pull all rows while the CTA's other warps already run phase 3
   (Figure 1(a)'s dispatch warps beside the GEMM roles); at bn 32, where the GEMM takes all 640 threads' registers,
   every warp pulls its share first and then enters phase 3.
3. GEMMs: `role2.make_unit_loop` over the GEMM's warps (tickets over the units with rows, W1's before W2's; a W1
   unit acquires its ring blocks, a W2 unit its token tile's W1-completion word), its CTA barriers a named barrier
   that leaves the dispatch warps out.
4. combine: every CTA past the loop adds 1 to GEMM_DONE (release) and waits for all of them (acquire); CTA 0
   clears the ring counts and the W1-completion words (nobody reads them any more); the top-k sum of `mega_port`.
5. tail, as `mega_port`: FINISH; the last CTA runs the tag-2 barrier and clears the control words.

What stays different from Figure 1(a): the dispatch warps idle once every row is pulled (no token of a later
layer to fetch), the epilogue is the consumer warpgroups' (no separate epilogue warps), and at bn 32 dispatch
is a phase.
Every wait is bounded by `timeout_ns` and ends in `trap`. P = 1 (the peer table carries the tag barriers).
"""

from dataclasses import dataclass

from gc_moe.kernels.sm90 import mega_port as port
from gc_moe.kernels.sm90 import role2

RING_BLOCK_M = 8  # grouped rows per ring block (the smallest token tile: the first block fills soonest)
BLOCK_N_CHOICES = role2.BLOCK_N_CHOICES
MAX_LOCAL_EXPERTS = port.MAX_LOCAL_EXPERTS
# stack bytes per thread, never inside a K loop (SASS checked): the GEMM loop's own, plus values of the unit
# loop the phases around it keep (stored once per unit or once per launch)
LOCAL_BYTES_BUDGET = {8: 16, 16: 32, 32: 96}

# control words (int32) of the workspace
ROUTING_READY = port.ROUTING_READY  # also the GEMM loop's ring-ready word
TAG1_ARRIVE = port.TAG1_ARRIVE
TAG2_ARRIVE = port.TAG2_ARRIVE
GEMM_DONE = 3  # CTAs past the GEMM loop
FINISH = port.FINISH
TICKET = 5  # the GEMM loop's ticket counter (it resets itself)
CONTROL_WORDS = 8

PARAMS = (
    ("x", "u64"), ("x_sf", "u64"), ("topk_idx", "u64"), ("topk_weights", "u64"),
    ("w1_codes", "u64"), ("w1_scales", "u64"), ("w1_factor", "u64"),
    ("w2_codes", "u64"), ("w2_scales", "u64"), ("w2_factor", "u64"),
    ("g_act", "u64"), ("g_scale", "u64"), ("g_weight", "u64"), ("g_dest", "u64"), ("g_src", "u64"),
    ("mid", "u64"), ("mid_scale", "u64"), ("partials", "u64"), ("y", "u64"),
    ("expert_offsets", "u64"), ("control", "u64"), ("peers", "u64"),
    ("l1_full_count", "u64"), ("l1_empty_count", "u64"), ("w1_done_mask", "u64"),
    ("num_tokens", "s32"), ("topk", "s32"), ("local_experts", "s32"), ("expert_base", "s32"),
    ("hidden", "s32"), ("intermediate", "s32"), ("num_ranks", "s32"), ("capacity", "s32"),
    ("ring_blocks", "s32"), ("mask_stride", "s32"), ("timeout_ns", "s64"),
)

PROMISES = (
    "wgmma.mma_async.sync.aligned.m64n",  # register-A E4M3 WGMMA
    "cp.async.bulk.shared::cluster.global.mbarrier",  # the producer's weight copies
    "mbarrier.try_wait.parity",  # the stage ring
    "red.release.gpu.global.or.b64",  # W1-completion bits
    "atom.release.gpu.global.add",  # ring block releases
    "st.release.gpu",  # ROUTING_READY
    "red.release.sys.global.add",  # tag-1 / tag-2 arrivals on the peers
    "ld.acquire.sys",  # tag-1 / tag-2 waits
    "cvt.rn.f16x2.e4m3x2",  # K32 -> K128 conversion of the pulled rows
    "trap",  # bounded waits end in a trap
)


# dispatch warps beside the GEMM loop where the registers allow them: the GEMM's 544 threads count as 640 for
# ptxas anyway, so 3 more warps cost nothing at bn 8 / 16; bn 32 already fills 640 (its producer warpgroup lends
# the consumers registers, which warps outside a warpgroup could not), so there the dispatch stays a phase
DISPATCH_WARPS = {8: 3, 16: 3, 32: 0}


@dataclass(frozen=True)
class PortWsConfig:
    block_n: int = 16  # tokens per unit (the WGMMA N)
    swiglu_alpha: float = 1.0
    swiglu_clamp: float = 10.0
    # warps after the GEMM loop's that pull the grouped rows while the loop runs (0: every warp pulls its share
    # first, then enters the loop). None: DISPATCH_WARPS
    dispatch_warps: int | None = None

    def __post_init__(self):
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {self.block_n}")
        if self.dispatch_warps is None:
            object.__setattr__(self, "dispatch_warps", DISPATCH_WARPS[self.block_n])
        gemm = role2.Role2Config(self.block_n).half("w1").threads
        if not (isinstance(self.dispatch_warps, int) and 0 <= self.dispatch_warps
                and -(-(gemm + 32 * self.dispatch_warps) // 128) * 128 <= 640):
            raise ValueError(f"dispatch_warps {self.dispatch_warps} at block_n {self.block_n}: allowed 0.."
                             f"{(640 - gemm) // 32} (the CTA stays within 640 threads, 96 registers each)")

    @property
    def loop(self) -> role2.Role2Config:
        return role2.Role2Config(self.block_n, self.swiglu_alpha, self.swiglu_clamp,
                                 side_threads=32 * self.dispatch_warps)

    @property
    def gemm_threads(self) -> int:
        return self.loop.half("w1").threads

    @property
    def threads(self) -> int:
        return self.gemm_threads + 32 * self.dispatch_warps

    @property
    def smem_bytes(self) -> int:
        return self.loop.half("w1").smem_bytes

    @property
    def routing_bytes(self) -> int:
        """CTA 0's routing tables (counts [E], offsets [E + 1]) at the start of shared memory, in the first
        stage: the GEMM loop touches the stages only after the CTA's routing and dispatch are done."""
        return 4 * (2 * MAX_LOCAL_EXPERTS + 1)


def ring_blocks(capacity: int, topk: int) -> int:
    """Ring blocks covering every grouped row one launch can have (C k rows; no block is reused in a launch)."""
    return max(1, -(-capacity * topk // RING_BLOCK_M))


def mask_stride(capacity: int) -> int:
    """W1-completion words per expert: one per token tile of the smallest tile over C rows (a token meets an
    expert at most once)."""
    return max(1, -(-capacity // min(BLOCK_N_CHOICES)))


# ---------------------------------------------------------------------------------------------- device code
def _make_kernel(cfg: PortWsConfig):
    import cutlass  # the DSL is needed to build only
    from cutlass import Float32, Int32, Int64, cute

    ptx = port._device_helpers()
    phase = port._phase_helpers(ptx)
    run_units = role2.make_unit_loop(cfg.loop)
    threads = cfg.threads
    warps = threads // 32
    gemm_warps = cfg.gemm_threads // 32
    side = cfg.dispatch_warps  # dispatch warps beside the loop (0: every warp dispatches, then loops)
    pullers = side if side else warps  # warps of a CTA that pull rows
    assert cfg.routing_bytes <= cfg.loop.half("w1").stage_bytes

    @cute.kernel
    def kernel(x: Int64, x_sf: Int64, topk_idx: Int64, topk_weights: Int64,
               w1_codes: Int64, w1_scales: Int64, w1_factor: Int64,
               w2_codes: Int64, w2_scales: Int64, w2_factor: Int64,
               g_act: Int64, g_scale: Int64, g_weight: Int64, g_dest: Int64, g_src: Int64,
               mid: Int64, mid_scale: Int64, partials: Int64, y: Int64,
               expert_offsets: Int64, control: Int64, peers: Int64,
               l1_full_count: Int64, l1_empty_count: Int64, w1_done_mask: Int64,
               num_tokens: Int32, topk: Int32, local_experts: Int32, expert_base: Int32,
               hidden: Int32, intermediate: Int32, num_ranks: Int32, capacity: Int32,
               ring_blocks: Int32, mask_stride: Int32, timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        cta = cute.arch.block_idx()[0]
        ctas = cute.arch.grid_dim()[0]
        warp_id = tid // 32
        lane = tid % 32
        started = cute.arch.globaltimer()
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        counts = smem
        offsets = counts + 4 * MAX_LOCAL_EXPERTS
        assignments = num_tokens * topk
        ring_ready = control + Int64(4 * ROUTING_READY)

        # ---------------------------------------------------------------- 1. routing (CTA 0) + tag-1 barrier
        if cta == 0:
            e = tid
            while e < local_experts:
                phase.sts_s32(counts + 4 * e, Int32(0))
                e = e + threads
            ptx.barrier_sync()
            a = tid
            while a < assignments:
                le = Int32(phase.ldg_s64_nc(topk_idx + Int64(a) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    phase.atom_shared_add(counts + 4 * le, Int32(1))
                a = a + threads
            ptx.barrier_sync()
            if tid == 0:
                run = Int32(0)
                for le in cutlass.range(local_experts):
                    phase.st_relaxed(expert_offsets + Int64(le) * 4, run)
                    c = phase.lds_s32(counts + 4 * le)
                    phase.sts_s32(counts + 4 * le, run)  # from here on: the expert's next free grouped row
                    run = run + c
                phase.st_relaxed(expert_offsets + Int64(local_experts) * 4, run)
                phase.sts_s32(offsets, run)
            ptx.barrier_sync()
            a = tid
            while a < assignments:
                le = Int32(phase.ldg_s64_nc(topk_idx + Int64(a) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    row = phase.atom_shared_add(counts + 4 * le, Int32(1))
                    phase.st_relaxed(g_src + Int64(row) * 4, a)
                a = a + threads
            ptx.barrier_sync()
            if tid == 0:
                phase.tag_barrier(control, TAG1_ARRIVE, peers, num_ranks, started, timeout_ns)
                rows = phase.lds_s32(offsets)
                tail = rows % RING_BLOCK_M
                if tail != 0:  # a full block reads RING_BLOCK_M: the last partial one is padded
                    phase.atom_release_gpu(l1_full_count + Int64(rows // RING_BLOCK_M) * 4, RING_BLOCK_M - tail)
                phase.fence_gpu()
                phase.st_release_gpu(ring_ready, Int32(1))
        if tid == 0:
            phase.wait_at_least(ring_ready, Int32(1), started, timeout_ns, False)
            phase.sts_s32(offsets, phase.ld_relaxed(expert_offsets + Int64(local_experts) * 4))
        ptx.barrier_sync()
        total_rows = phase.lds_s32(offsets)
        ptx.barrier_sync()  # every thread read the table before the GEMM loop may reuse the stage

        # ---------------------------------------------------------------- 2. dispatch: one grouped row per warp
        # (the dispatch warps beside the loop, or every warp before it)
        h_blocks = hidden // 128
        puller = warp_id
        if cutlass.const_expr(side):
            puller = warp_id - gemm_warps
        row = cta * pullers + puller
        if puller < 0:
            row = total_rows  # a GEMM warp: its loop runs meanwhile
        while row < total_rows:
            a = phase.ld_relaxed(g_src + Int64(row) * 4)
            token = a // topk
            slot = a - token * topk
            phase.pull_row_k128(x, x_sf, g_act, g_scale, token, row, hidden, h_blocks, lane)
            if lane == 0:
                ptx.stg_f32(g_weight + Int64(row) * 4, ptx.ldg_f32(topk_weights + Int64(a) * 4))
                phase.st_relaxed(g_dest + Int64(row) * 4, slot * num_tokens + token)
            phase.warp_sync()  # the whole row precedes lane 0's release
            if lane == 0:
                phase.atom_release_gpu(l1_full_count + Int64(row // RING_BLOCK_M) * 4, Int32(1))
            row = row + ctas * pullers

        # ---------------------------------------------------------------- 3. GEMMs: the persistent unit loop
        # g_src holds routing entries (< C k = source_rows): every row's source is this rank, whose combine
        # buffer is `partials` itself (peers[0] = 0 at P = 1)
        if warp_id < gemm_warps:
            run_units(w1_codes, w1_scales, w1_factor, w2_codes, w2_scales, w2_factor, g_act, g_scale,
                      expert_offsets, g_weight, mid, mid_scale, g_dest, partials, ring_ready, l1_full_count,
                      l1_empty_count, g_src, peers, w1_done_mask, control + Int64(4 * TICKET), h_blocks,
                      2 * intermediate // 64, intermediate // 128, hidden // 64, Int32(RING_BLOCK_M), ring_blocks,
                      capacity * topk, local_experts, mask_stride, timeout_ns)

        # ---------------------------------------------------------------- 4. combine (after every CTA's loop)
        # what the phases after the loop need is read again, not kept in registers across it (the loop's
        # consumers need all they can get); their waits count from here
        tid = cute.arch.thread_idx()[0]
        cta = cute.arch.block_idx()[0]
        started = cute.arch.globaltimer()
        ptx.barrier_sync()
        if tid == 0:
            phase.fence_gpu()
            phase.red_release_gpu(control + Int64(4 * GEMM_DONE), Int32(1))
            phase.wait_at_least(control + Int64(4 * GEMM_DONE), ctas, started, timeout_ns, False)
        ptx.barrier_sync()
        if cta == 0:  # overlapped with the combine: no one reads the ring counts or W1 words any more
            b = tid
            while b < ring_blocks:
                phase.st_relaxed(l1_full_count + Int64(b) * 4, Int32(0))
                phase.st_relaxed(l1_empty_count + Int64(b) * 4, Int32(0))
                b = b + threads
            w = tid
            while w < local_experts * mask_stride:
                phase.st_relaxed(w1_done_mask + Int64(w) * 8, Int32(0))
                phase.st_relaxed(w1_done_mask + Int64(w) * 8 + 4, Int32(0))
                w = w + threads
        per_token = hidden // 8
        unit = cta * threads + tid
        out = cute.make_rmem_tensor((8,), Float32)
        while unit < num_tokens * per_token:
            token = unit // per_token
            col = (unit - token * per_token) * 8
            for i in cutlass.range_constexpr(8):
                out[i] = Float32(0.0)
            for s in cutlass.range(topk):
                le = Int32(phase.ldg_s64_nc(topk_idx + (Int64(token) * Int64(topk) + Int64(s)) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    phase.combine_add8(out, partials + ((Int64(s) * Int64(num_tokens) + Int64(token))
                                                        * Int64(hidden) + Int64(col)) * 2)
            phase.store_bf16x8(y + (Int64(token) * Int64(hidden) + Int64(col)) * 2, out)
            unit = unit + ctas * threads

        # ---------------------------------------------------------------- 5. tail: tag-2 barrier, clean
        ptx.barrier_sync()
        if tid == 0:
            phase.fence_gpu()
            arrived = phase.atom_acq_rel_gpu(control + Int64(4 * FINISH), Int32(1))
            if arrived == ctas - 1:  # the last CTA: every other one is past all its waits
                phase.tag_barrier(control, TAG2_ARRIVE, peers, num_ranks, started, timeout_ns)
                for word in (ROUTING_READY, TAG1_ARRIVE, TAG2_ARRIVE, GEMM_DONE, FINISH):
                    phase.st_relaxed(control + Int64(4 * word), Int32(0))

    launch = {"grid": (1, 1, 1), "block": (threads, 1, 1), "smem": cfg.smem_bytes}
    launch.update(role2.gg.launch_register_bounds(cfg.loop.half("w1")))

    @cute.jit
    def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64, a8: Int64,
             a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, a14: Int64, a15: Int64, a16: Int64,
             a17: Int64, a18: Int64, a19: Int64, a20: Int64, a21: Int64, a22: Int64, a23: Int64, a24: Int64,
             num_tokens: Int32, topk: Int32, local_experts: Int32, expert_base: Int32, hidden: Int32,
             intermediate: Int32, num_ranks: Int32, capacity: Int32, ring_blocks: Int32, mask_stride: Int32,
             timeout_ns: Int64):
        kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
               a21, a22, a23, a24, num_tokens, topk, local_experts, expert_base, hidden, intermediate, num_ranks,
               capacity, ring_blocks, mask_stride, timeout_ns).launch(**launch)

    return host


def build_port_ws(arch: str = "sm_90a", block_n: int = 16, swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0,
                  dispatch_warps: int | None = None):
    """The runtime's builder: a CompileRequest for one variant (no GPU needed)."""
    from cutlass import Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 Mega MoE port is built for sm_90a only, not {arch!r}")
    cfg = PortWsConfig(block_n, swiglu_alpha, swiglu_clamp, dispatch_warps)
    host = _make_kernel(cfg)
    args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in PARAMS)
    return CompileRequest(host, args, LaunchShape(block=(cfg.threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes))
