"""Role1 of the SM90 GC-MoE layer: dispatch in the communication partition (Algorithm 1, steps 1-3).

One CTA per communication SM (default 4 on SM90), 512 threads (16 pulling warps). Per replay:

1. count: every CTA counts its share of the (token, slot) assignments per global expert in shared memory;
2. publish locally: one packed `atom.global.add.u64` of (1 << 32) | count per expert on send_count (also for
   count 0, so the high word counts contributors); the old low word is the CTA's first position in that
   expert's list;
3. routing entries: a second scan writes token * k + slot to the owner's src_index[this rank, local expert,
   position] through the peer table (`peers`: peer base - local base per rank; world size 1 is rank 0 itself);
4. grid sync over the dispatch grid only (arrival counter in `control`, reset by role3);
5. block 0 stores each expert's packed count to its owner's recv_count[parity, this rank, local expert],
   clears send_count, then the tag-1 barrier: `red.release.sys` on every peer's tag1_arrive[phase], an
   acquire wait for P arrivals bounded by `timeout_ns` (then `trap`), reset of its own arrival word and
   a flip of the persistent phase; a second grid sync;
6. every CTA scans the received counts (experts in order, source ranks in order) into grouped-row offsets;
   block 0 writes expert_offsets [e + 1] and releases RING_READY; then each warp pulls grouped rows (16 bytes
   per lane per step, all loads of up to 16 steps issued before the first conversion): the routing entry, the
   source token's FP8 row and scales from the source rank, converted to the ring's E4M3 + FP32 K128 format
   into ring row r mod R, its routing weight, destination row and source word (pool-sized, at r); after the row
   lands (warp sync) lane 0 adds 1 to the ring block's l1_full_count with `atom.add.release.gpu` (the last
   row also the padding of its partial block). A block is full when it reads BM (generation + 1). In a reused
   ring (`l1_readers` > 0) lane 0 first waits, bounded, until the block's l1_empty_count shows that W1 read
   its previous generation (`layer_layout.l1_empty_target`).

Activation format. The public buffer keeps Listing 1's bytes on every arch: x E4M3 [C, H] with packed UE8M0
per-32 scales x_sf int32 [C, H/128]. The ring holds what the SM90 grouped GEMM reads: E4M3 with one FP32 scale
per K128 block. The pull converts: scale = 2^(max of the block's four exponents - 127), and each K32 group's
bytes are rescaled by 2^(its exponent - the maximum) (E4M3 -> f16 -> f32, exact multiply, one RNE rounding back
to E4M3). The result is exact unless a value falls below E4M3's subnormal step at the K128 scale (then the
error is at most half that step, the resolution a K128 quantization has anyway). `convert_k32_to_k128` is the
host twin.

Kernel parameters (all scalars, in order): `PARAMS`. Host side (no DSL needed): `PARAMS`, `variant`,
`dispatch_args`, `convert_k32_to_k128`, `reference_dispatch` (the host twin of the ring role1 fills).
"""

from __future__ import annotations

THREADS = 512
WARPS = THREADS // 32
# the pull's steps (16 bytes per lane, 512 per warp) whose loads one pass issues before converting any:
# 12 steps = 6 KB of a row per warp in flight (H <= 6144 in one pass), 60 registers of words and bytes, so the
# kernel fits the 128 registers of 16 warps per SM: the pull is bound by the bytes in flight per SM
PULL_PASS_STEPS = 12
MAX_EXPERTS = 2048  # shared-memory count and prefix arrays
SMEM_BYTES = 4 * MAX_EXPERTS + 4 * (MAX_EXPERTS + 1) + 4  # counts/cursors, grouped-row prefix, rounded
DEFAULT_TIMEOUT_S = 3600.0

PARAMS = (
    ("x", "u64"), ("x_sf", "u64"), ("topk_idx", "u64"), ("topk_weights", "u64"),
    ("send_count", "u64"), ("recv_count", "u64"), ("src_index", "u64"),
    ("ring_act", "u64"), ("ring_scale", "u64"), ("routing_weight", "u64"), ("dest_row", "u64"),
    ("ring_source", "u64"), ("expert_offsets", "u64"), ("l1_full_count", "u64"), ("l1_empty_count", "u64"),
    ("tag1_arrive", "u64"), ("control", "u64"), ("peers", "u64"),
    ("num_tokens", "s32"), ("rank", "s32"), ("num_ranks", "s32"), ("num_experts", "s32"), ("topk", "s32"),
    ("hidden", "s32"), ("capacity", "s32"), ("block_m", "s32"), ("ring_blocks", "s32"), ("pool_blocks", "s32"),
    ("l1_readers", "s32"), ("timeout_ns", "s64"),
)
_POINTER_REGIONS = [name for name, kind in PARAMS if kind == "u64"]

PROMISES = (
    "atom.global.add.u64",  # packed per-expert publish
    "atom.shared.add",  # per-CTA counting and cursors
    "red.release.sys.global.add",  # tag-1 arrival on every peer
    "ld.acquire.sys",  # tag-1 wait
    "atom.release.gpu.global.add",  # grid-sync arrival and l1_full_count release
    "ld.acquire.gpu",  # grid-sync wait
    "fence.acq_rel.sys",
    "nanosleep",
    "trap",  # bounded waits end in a trap
    "cvt.rn.f16x2.e4m3x2",  # K32 -> K128 conversion of the pulled bytes
    "cvt.rn.satfinite.e4m3x2.f32",
)


def variant():
    """The runtime KernelVariant (one binary for every shape: shapes are kernel parameters)."""
    from gc_moe.runtime.jit import KernelVariant

    return KernelVariant.make("sm90.dispatch", __name__, "build_dispatch", {}, promises=PROMISES,
                              local_bytes_budget=0, extra_sources=("gc_moe.kernels.sm90.ptx",
                                                                   "gc_moe.kernels.sm90.layer_layout"))


def consumer_probe_variant():
    """A proof kernel of the ring's consumer side (`acquire_ring_rows`, what role2 adds): one CTA per (token
    tile, local expert) waits for its rows and records them; the device proof runs it concurrently with role1."""
    from gc_moe.runtime.jit import KernelVariant

    return KernelVariant.make("sm90.ring_consumer_probe", __name__, "build_ring_consumer_probe", {},
                              promises=("ld.acquire.gpu", "nanosleep", "trap"), local_bytes_budget=0,
                              extra_sources=("gc_moe.kernels.sm90.ptx", "gc_moe.kernels.sm90.layer_layout"))


def expected_probe_rows(expert_offsets: list[int], tile_rows: int, ring_rows: int) -> list[int]:
    """What the consumer probe leaves in `seen` [ring_rows]: at each tile's first grouped row, its row count."""
    seen = [0] * ring_rows
    for j in range(len(expert_offsets) - 1):
        first, end = expert_offsets[j], expert_offsets[j + 1]
        while first < end:
            seen[first] = min(tile_rows, end - first)
            first += tile_rows
    return seen


def dispatch_args(ws, shape, num_tokens: int, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Kernel arguments in `PARAMS` order from a workspace (an object with one tensor per region) and its
    `layer_layout.LayerShape` (a reused ring makes role1 wait for W1's releases: `l1_readers`)."""
    from gc_moe.kernels.sm90 import layer_layout as ll
    from gc_moe.runtime.launch import i32, i64, ptr

    if not 0 <= num_tokens <= shape.capacity:
        raise ValueError(f"num_tokens {num_tokens} outside 0..capacity={shape.capacity}")
    if not 0 <= rank < shape.num_ranks:
        raise ValueError(f"rank {rank} outside 0..{shape.num_ranks - 1}")
    if shape.num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts {shape.num_experts}; allowed: at most {MAX_EXPERTS}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    args = [ptr(getattr(ws, name)) for name in _POINTER_REGIONS]
    args += [i32(num_tokens), i32(rank), i32(shape.num_ranks), i32(shape.num_experts), i32(shape.topk),
             i32(shape.hidden), i32(shape.capacity), i32(shape.block_m), i32(shape.ring_blocks),
             i32(shape.pool_blocks), i32(ll.l1_readers(shape) if shape.ring_reuse else 0), i64(int(timeout_s * 1e9))]
    return args


def convert_k32_to_k128(x, x_sf):
    """Host twin of the pull's conversion: (E4M3 [N, H], packed UE8M0 per-32 int32 [N, H/128]) ->
    (E4M3 [N, H], FP32 [N, H/128]) with scale 2^(block max exponent - 127) per K128 block."""
    import torch

    n, h = x.shape
    if x.dtype != torch.float8_e4m3fn or x_sf.dtype != torch.int32 or tuple(x_sf.shape) != (n, h // 128) or h % 128:
        raise ValueError(f"need x float8_e4m3fn [N, H] (H % 128 == 0) and x_sf int32 [N, H/128]; got {x.dtype} "
                         f"{tuple(x.shape)}, {x_sf.dtype} {tuple(x_sf.shape)}")
    exps = x_sf.contiguous().view(torch.uint8).view(n, h // 128, 4).to(torch.int32)  # little-endian bytes
    emax = exps.amax(dim=2)
    shift = (exps - emax[..., None]).to(torch.float32).exp2()  # 2^(e_j - emax) <= 1, exact
    values = x.float().view(n, h // 128, 4, 32) * shift[..., None]
    return values.view(n, h).to(torch.float8_e4m3fn), (emax - 127).to(torch.float32).exp2()


def reference_dispatch(shape, owner: int, xs, x_sfs, topk_idxs, topk_weights):
    """Host twin of what role1 leaves on rank `owner`: the grouped rows in the canonical order (experts, then
    source ranks, then token * k + slot ascending; the kernel's order within one (expert, source) segment is
    not fixed). Inputs are per source rank (lists of tensors). Returns a dict with expert_offsets int32 [e + 1],
    ring_act E4M3 [N, H], ring_scale f32 [N, H/128], routing_weight f32 [N], dest_row int32 [N],
    ring_source int32 [N], l1_full_count int32 [ring blocks]."""
    import torch

    from gc_moe.kernels.sm90 import layer_layout as ll

    offsets, segments = ll.grouped_layout(topk_idxs, shape, owner)
    k = shape.topk
    src_rank, token, slot = [], [], []
    for le in range(shape.local_experts):
        for src in range(shape.num_ranks):
            for entry in segments[(le, src)][1]:
                src_rank.append(src)
                token.append(entry // k)
                slot.append(entry % k)
    n, h = len(token), shape.hidden
    if n > shape.pool_rows:
        raise ValueError(f"{n} grouped rows exceed the pool's {shape.pool_rows}")
    act = torch.empty(n, h, dtype=torch.float8_e4m3fn)
    scale = torch.empty(n, h // 128, dtype=torch.float32)
    weight = torch.empty(n, dtype=torch.float32)
    for src in range(shape.num_ranks):
        rows = [i for i in range(n) if src_rank[i] == src]
        if not rows:
            continue
        toks = torch.tensor([token[i] for i in rows])
        a, s = convert_k32_to_k128(xs[src][toks].cpu(), x_sfs[src][toks].cpu())
        act[rows], scale[rows] = a, s
        weight[rows] = topk_weights[src].cpu()[toks, torch.tensor([slot[i] for i in rows])]
    return {
        "expert_offsets": torch.tensor(offsets, dtype=torch.int32),
        "ring_act": act, "ring_scale": scale, "routing_weight": weight,
        "dest_row": torch.tensor([ll.dest_row(t, j, shape) for t, j in zip(token, slot)], dtype=torch.int32),
        "ring_source": torch.tensor([ll.ring_source(r, t, j, shape) for r, t, j in zip(src_rank, token, slot)],
                                    dtype=torch.int32),
        "l1_full_count": torch.tensor(ll.l1_full_counts_after_dispatch(n, shape), dtype=torch.int32),
    }


# ------------------------------------------------------------------------------------------------- device code
try:
    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, cute
except ImportError:  # runtime-only machines: the host side above is all they need
    cute = None

if cute is not None:
    from gc_moe.kernels.sm90.layer_layout import (
        BARRIER_PHASE,
        DISPATCH_SYNC,
        RECV_PARITY,
        RING_OVERFLOWS,
        RING_READY,
    )
    from gc_moe.kernels.sm90.ptx import asm

    # ---- memory-model helpers (addresses are Int64 global / Int32 shared)
    def ld_s32(addr: Int64) -> Int32:
        return asm("ld.relaxed.gpu.global.b32 $0, [$1];", [Int32], [addr])

    def ld_s32_sys(addr: Int64) -> Int32:
        """A word a peer wrote (ordered by an earlier system-scope acquire)."""
        return asm("ld.relaxed.sys.global.b32 $0, [$1];", [Int32], [addr])

    def ld_s64(addr: Int64) -> Int64:
        return asm("ld.relaxed.gpu.global.b64 $0, [$1];", [Int64], [addr])

    def ld_s64_sys(addr: Int64) -> Int64:
        return asm("ld.relaxed.sys.global.b64 $0, [$1];", [Int64], [addr])

    def ldg_u32(addr: Int64) -> Uint32:
        return asm("ld.global.b32 $0, [$1];", [Uint32], [addr])

    def ldg_f32(addr: Int64) -> Float32:
        return asm("ld.global.f32 $0, [$1];", [Float32], [addr])

    def st_s32(addr: Int64, v: Int32) -> None:
        asm("st.relaxed.gpu.global.b32 [$0], $1;", [], [addr, v])

    def st_s32_sys(addr: Int64, v: Int32) -> None:
        asm("st.relaxed.sys.global.b32 [$0], $1;", [], [addr, v])

    def st_s64(addr: Int64, v: Int64) -> None:
        asm("st.relaxed.gpu.global.b64 [$0], $1;", [], [addr, v])

    def st_s64_sys(addr: Int64, v: Int64) -> None:
        asm("st.relaxed.sys.global.b64 [$0], $1;", [], [addr, v])


    def stg_f32(addr: Int64, v: Float32) -> None:
        asm("st.global.f32 [$0], $1;", [], [addr, v])

    def ld_acquire_gpu(addr: Int64) -> Int32:
        return asm("ld.acquire.gpu.global.b32 $0, [$1];", [Int32], [addr])

    def ld_acquire_sys(addr: Int64) -> Int32:
        return asm("ld.acquire.sys.global.b32 $0, [$1];", [Int32], [addr])

    def st_release_gpu(addr: Int64, v: Int32) -> None:
        asm("st.release.gpu.global.b32 [$0], $1;", [], [addr, v])

    def atom_add_release_gpu(addr: Int64, v: Int32) -> Int32:
        return asm("atom.release.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def atom_add_acq_rel_gpu(addr: Int64, v: Int32) -> Int32:
        return asm("atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def atom_add_s32(addr: Int64, v: Int32) -> None:
        asm("red.relaxed.gpu.global.add.s32 [$0], $1;", [], [addr, v])

    def atom_add_u64(addr: Int64, v: Int64) -> Int64:
        return asm("atom.global.add.u64 $0, [$1], $2;", [Int64], [addr, v])

    def red_release_sys(addr: Int64, v: Int32) -> None:
        asm("red.release.sys.global.add.s32 [$0], $1;", [], [addr, v])

    def fence_sys() -> None:
        asm("fence.acq_rel.sys;", [], [])

    def fence_gpu() -> None:
        asm("fence.acq_rel.gpu;", [], [])

    def lds(addr: Int32) -> Int32:
        return asm("ld.shared.b32 $0, [$1];", [Int32], [addr])

    def sts(addr: Int32, v: Int32) -> None:
        asm("st.shared.b32 [$0], $1;", [], [addr, v])

    def atom_shared_add(addr: Int32, v: Int32) -> Int32:
        return asm("atom.shared.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def bar_sync() -> None:
        asm("bar.sync 0;", [], [])

    def warp_sync() -> None:
        asm("bar.warp.sync -1;", [], [])

    def shfl_up(v: Int32, delta: int) -> Int32:
        return asm(f"shfl.sync.up.b32 $0, $1, {delta}, 0, -1;", [Int32], [v])

    def trap() -> None:
        asm("trap;", [], [])

    def backoff() -> None:
        asm("nanosleep.u32 64;", [], [])

    @cute.jit
    def wait_at_least(addr: Int64, target: Int32, started: Int64, timeout_ns: Int64, system_scope: cutlass.Constexpr):
        """Acquire-spin until the word at `addr` >= target; trap once `timeout_ns` passed since `started`."""
        if cutlass.const_expr(system_scope):
            seen = ld_acquire_sys(addr)
        else:
            seen = ld_acquire_gpu(addr)
        while seen < target:
            if cute.arch.globaltimer() - started > timeout_ns:
                trap()
            backoff()
            if cutlass.const_expr(system_scope):
                seen = ld_acquire_sys(addr)
            else:
                seen = ld_acquire_gpu(addr)

    @cute.jit
    def grid_sync(control: Int64, target: Int32, started: Int64, timeout_ns: Int64):
        """Barrier over this kernel's grid: every CTA adds 1, waits for `target` arrivals (bounded)."""
        bar_sync()
        if cute.arch.thread_idx()[0] == 0:
            fence_sys()  # this CTA's peer stores are ordered before the arrival, whoever passes on
            atom_add_release_gpu(control + Int64(4 * DISPATCH_SYNC), Int32(1))
            wait_at_least(control + Int64(4 * DISPATCH_SYNC), target, started, timeout_ns, False)
        bar_sync()

    def ld_16_bytes(addr: Int64) -> list:
        """16 bytes of a source row (four words), issued without waiting: a pass issues all of its loads first."""
        return asm("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [addr])

    def convert_store_16_bytes(words: list, addr_out: Int64, multiplier: Float32) -> None:
        """Multiply each of 16 E4M3 bytes by a power of two (<= 1), round once back to E4M3 (RNE, saturating:
        `cvt.rn.satfinite`) and store them; E4M3 -> f16 -> f32 are exact."""
        body = ["{", ".reg .b32 w<4>;", ".reg .b16 lo, hi, a, b, c, d;", ".reg .b32 h01, h23;",
                ".reg .f32 fa, fb, fc, fd;", "mov.b32 w0, $0;", "mov.b32 w1, $1;", "mov.b32 w2, $2;",
                "mov.b32 w3, $3;"]
        for q in range(4):
            body += [f"mov.b32 {{lo, hi}}, w{q};", "cvt.rn.f16x2.e4m3x2 h01, lo;", "cvt.rn.f16x2.e4m3x2 h23, hi;",
                     "mov.b32 {a, b}, h01;", "mov.b32 {c, d}, h23;",
                     "cvt.f32.f16 fa, a;", "cvt.f32.f16 fb, b;", "cvt.f32.f16 fc, c;", "cvt.f32.f16 fd, d;",
                     "mul.f32 fa, fa, $5;", "mul.f32 fb, fb, $5;", "mul.f32 fc, fc, $5;", "mul.f32 fd, fd, $5;",
                     "cvt.rn.satfinite.e4m3x2.f32 lo, fb, fa;", "cvt.rn.satfinite.e4m3x2.f32 hi, fd, fc;",
                     f"mov.b32 w{q}, {{lo, hi}};"]
        body += ["st.global.v4.b32 [$4], {w0, w1, w2, w3};", "}"]
        asm("\n".join(body), [], [*words, addr_out, multiplier])

    def imax(a: Int32, b: Int32) -> Int32:
        return asm("max.s32 $0, $1, $2;", [Int32], [a, b])

    def bits_to_f32(bits: Int32) -> Float32:
        return asm("mov.b32 $0, $1;", [Float32], [bits])

    @cute.kernel
    def dispatch_kernel(x: Int64, x_sf: Int64, topk_idx: Int64, topk_weights: Int64, send_count: Int64,
                        recv_count: Int64, src_index: Int64, ring_act: Int64, ring_scale: Int64,
                        routing_weight: Int64, dest_row: Int64, ring_source: Int64, expert_offsets: Int64,
                        l1_full_count: Int64, l1_empty_count: Int64, tag1_arrive: Int64, control: Int64,
                        peers: Int64, num_tokens: Int32, rank: Int32, num_ranks: Int32, num_experts: Int32,
                        topk: Int32, hidden: Int32, capacity: Int32, block_m: Int32, ring_blocks: Int32,
                        pool_blocks: Int32, l1_readers: Int32, timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        nblocks = cute.arch.grid_dim()[0]
        started = cute.arch.globaltimer()
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint())
        counts = smem  # int32 [MAX_EXPERTS]: counts, then this CTA's cursor per expert
        prefix = smem + 4 * MAX_EXPERTS  # int32 [E + 1]: first grouped row of (local expert, source rank)
        local_experts = num_experts // num_ranks
        entries = capacity * topk
        assignments = num_tokens * topk
        stride = nblocks * THREADS
        # read now, used after the grid syncs: the previous replay's role3 flipped RECV_PARITY and its role1
        # flipped BARRIER_PHASE, and only this kernel's block 0 writes the phase, after reading it
        parity = ld_s32(control + Int64(4 * RECV_PARITY))
        phase = ld_s32(control + Int64(4 * BARRIER_PHASE))

        # 1. count this CTA's assignments per global expert
        g = tid
        while g < num_experts:
            sts(counts + 4 * g, Int32(0))
            g = g + THREADS
        bar_sync()
        a = bid * THREADS + tid
        while a < assignments:
            ge = Int32(ld_s64(topk_idx + Int64(a) * 8))
            if ge >= 0 and ge < num_experts:  # ids outside 0..E-1 (e.g. -1) route nowhere
                atom_shared_add(counts + 4 * ge, Int32(1))
            a = a + stride
        bar_sync()
        # 2. packed publish on the local send counter; the old low word is this CTA's first position
        g = tid
        while g < num_experts:
            c = lds(counts + 4 * g)
            old = atom_add_u64(send_count + Int64(g) * 8, (Int64(1) << 32) | Int64(c))
            sts(counts + 4 * g, Int32(old & Int64(0xFFFFFFFF)))
            g = g + THREADS
        bar_sync()
        # 3. routing entries to their owners
        a = bid * THREADS + tid
        while a < assignments:
            ge = Int32(ld_s64(topk_idx + Int64(a) * 8))
            if ge >= 0 and ge < num_experts:  # ids outside 0..E-1 (e.g. -1) route nowhere
                pos = atom_shared_add(counts + 4 * ge, Int32(1))
                owner = ge // local_experts
                le = ge - owner * local_experts
                peer = ld_s64(peers + Int64(owner) * 8)
                slot = Int64((rank * local_experts + le) * entries + pos)
                st_s32_sys(src_index + peer + slot * 4, a)
            a = a + stride
        # 4. grid sync over the dispatch grid
        grid_sync(control, nblocks, started, timeout_ns)
        # 5. block 0: counts to their owners, then the tag-1 barrier
        if bid == 0:
            g = tid
            while g < num_experts:
                packed = ld_s64(send_count + Int64(g) * 8)
                owner = g // local_experts
                le = g - owner * local_experts
                peer = ld_s64(peers + Int64(owner) * 8)
                st_s64_sys(recv_count + peer + Int64((parity * num_ranks + rank) * local_experts + le) * 8, packed)
                st_s64(send_count + Int64(g) * 8, Int64(0))
                g = g + THREADS
            bar_sync()
            if tid == 0:
                fence_sys()
                r = Int32(0)
                while r < num_ranks:
                    red_release_sys(tag1_arrive + ld_s64(peers + Int64(r) * 8) + Int64(phase) * 4, Int32(1))
                    r = r + 1
                wait_at_least(tag1_arrive + Int64(phase) * 4, num_ranks, started, timeout_ns, True)
                st_s32(tag1_arrive + Int64(phase) * 4, Int32(0))  # this phase's next use is two barriers away
                st_s32(control + Int64(4 * BARRIER_PHASE), phase ^ 1)
        grid_sync(control, 2 * nblocks, started, timeout_ns)

        # 6a. grouped-row prefix over (local expert, source rank): every thread stages receive counts into
        # shared memory (one load round trip for the CTA), then warp 0 scans them in place, one chunk per lane
        segments = local_experts * num_ranks
        i = tid
        while i < segments:
            le = i // num_ranks
            src = i - le * num_ranks
            sts(prefix + 4 * i, Int32(ld_s64_sys(recv_count + Int64((parity * num_ranks + src) * local_experts
                                                                    + le) * 8) & Int64(0xFFFFFFFF)))
            i = i + THREADS
        bar_sync()
        if tid < 32:
            chunk = (segments + 31) // 32
            lo = tid * chunk
            total = Int32(0)
            i = lo
            while i < lo + chunk and i < segments:
                total = total + lds(prefix + 4 * i)
                i = i + 1
            inclusive = total
            for d in (1, 2, 4, 8, 16):
                up = shfl_up(inclusive, d)
                if tid >= d:
                    inclusive = inclusive + up
            run = inclusive - total
            i = lo
            while i < lo + chunk and i < segments:
                count = lds(prefix + 4 * i)
                sts(prefix + 4 * i, run)
                run = run + count
                i = i + 1
            if tid == 31:
                sts(prefix + 4 * segments, inclusive)
        bar_sync()
        received = lds(prefix + 4 * segments)
        ring_rows = ring_blocks * block_m
        pool_rows = pool_blocks * block_m
        rows = received
        rows = min(rows, pool_rows)  # never write past the pool; role3's output shows the loss, RING_OVERFLOWS counts it
        tail = rows % block_m
        if bid == 0:
            le = tid
            while le <= local_experts:
                start = lds(prefix + 4 * le * num_ranks)
                start = min(start, rows)
                st_s32(expert_offsets + Int64(le) * 4, start)
                le = le + THREADS
            bar_sync()
            if tid == 0:
                if received > pool_rows:
                    atom_add_s32(control + Int64(4 * RING_OVERFLOWS), Int32(1))
                st_release_gpu(control + Int64(4 * RING_READY), Int32(1))  # after the block's offsets (bar.sync)

        # 6b. pull: one grouped row per warp at a time
        warp = tid // 32
        lane = tid % 32
        k_blocks = hidden // 128
        r = bid * WARPS + warp
        while r < rows:
            lo = Int32(0)
            hi = segments
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if lds(prefix + 4 * mid) <= r:
                    lo = mid
                else:
                    hi = mid
            le = lo // num_ranks
            src = lo - le * num_ranks
            entry = ld_s32_sys(src_index + Int64((src * local_experts + le) * entries + r - lds(prefix + 4 * lo)) * 4)
            token = entry // topk
            slot = entry - token * topk
            peer = ld_s64(peers + Int64(src) * 8)
            x_row = x + peer + Int64(token) * Int64(hidden)
            sf_row = x_sf + peer + Int64(token) * Int64(k_blocks * 4)
            ring_r = r % ring_rows
            dst = ring_act + Int64(ring_r) * Int64(hidden)
            if l1_readers > 0:
                # a reused ring: the block's previous generation must have been read by every W1 CTA of its tiles
                generation = (r // block_m) // ring_blocks
                if lane == 0 and generation > 0:
                    wait_at_least(l1_empty_count + Int64((r // block_m) % ring_blocks) * 4, generation * l1_readers,
                                  started, timeout_ns, False)
                warp_sync()
            # 16 bytes per lane: a warp step covers 4 K128 blocks (8 lanes each, 2 lanes per K32 group). A pass
            # issues the loads of PULL_PASS_STEPS steps (the scale words and the bytes) before it converts and
            # stores any of them, so a row costs one load latency per pass, not two per step
            sub = lane % 8
            group = sub // 2
            first = Int32(0)
            while first * 4 < k_blocks:
                words, data = [], []
                for j in cutlass.range_constexpr(PULL_PASS_STEPS):
                    kb = lane // 8 + 4 * (first + j)
                    if kb >= k_blocks:  # past the row: load the pass's first block again, store nothing
                        kb = lane // 8 + 4 * first
                    words.append(ldg_u32(sf_row + Int64(kb) * 4))
                    data.append(ld_16_bytes(x_row + Int64(kb * 128 + 16 * sub)))
                for j in cutlass.range_constexpr(PULL_PASS_STEPS):
                    kb = lane // 8 + 4 * (first + j)
                    if kb < k_blocks:
                        word = words[j]
                        e0 = Int32(word & Uint32(0xFF))
                        e1 = Int32((word >> 8) & Uint32(0xFF))
                        e2 = Int32((word >> 16) & Uint32(0xFF))
                        e3 = Int32(word >> 24)
                        emax = imax(imax(e0, e1), imax(e2, e3))
                        shift = emax - Int32((word >> (8 * group)) & Uint32(0xFF))
                        if shift > 126:
                            shift = Int32(126)
                        multiplier = bits_to_f32((127 - shift) << 23)  # 2^-(emax - this group's exponent)
                        convert_store_16_bytes(data[j], dst + Int64(kb * 128 + 16 * sub), multiplier)
                        if sub == 0:
                            stg_f32(ring_scale + (Int64(ring_r) * Int64(k_blocks) + Int64(kb)) * 4,
                                    bits_to_f32(emax << 23))
                first = first + PULL_PASS_STEPS
            if lane == 0:
                stg_f32(routing_weight + Int64(r) * 4, ldg_f32(topk_weights + peer + Int64(entry) * 4))
                st_s32(dest_row + Int64(r) * 4, slot * capacity + token)
                st_s32(ring_source + Int64(r) * 4, (src * capacity + token) * topk + slot)
            warp_sync()  # the whole row precedes lane 0's release
            if lane == 0:
                landed = Int32(1)
                if r == rows - 1 and tail != 0:
                    # the padding of the last partial block goes with its last row: released earlier, it would
                    # count toward the block's previous generation in a reused ring
                    landed = landed + block_m - tail
                atom_add_release_gpu(l1_full_count + Int64((r // block_m) % ring_blocks) * 4, landed)
            r = r + nblocks * WARPS

    @cute.jit
    def acquire_ring_rows(ring_ready: Int64, l1_full_count: Int64, first: Int32, rows: Int32, block_m: Int32,
                          ring_blocks: Int32, started: Int64, timeout_ns: Int64):
        """The consumer side of the ring, for role2 (thread 0 calls it, then the CTA syncs): wait for RING_READY,
        then for every logical block holding grouped rows [first, first + rows) until its ring block's
        l1_full_count reaches BM (generation + 1). Bounded by `timeout_ns` since `started`, then traps."""
        wait_at_least(ring_ready, Int32(1), started, timeout_ns, False)
        if rows > 0:
            block = first // block_m
            while block <= (first + rows - 1) // block_m:
                generation = block // ring_blocks
                wait_at_least(l1_full_count + Int64(block - generation * ring_blocks) * 4,
                              block_m * (generation + 1), started, timeout_ns, False)
                block = block + 1

    @cute.kernel
    def ring_consumer_probe_kernel(ring_ready: Int64, l1_full_count: Int64, expert_offsets: Int64, seen: Int64,
                                   block_m: Int32, ring_blocks: Int32, tile_rows: Int32, timeout_ns: Int64):
        """How role2 uses `acquire_ring_rows`: one CTA per (token tile, local expert); it writes the rows it may
        read (a test double of the grouped GEMM's W1 tile loop)."""
        tile, expert, _ = cute.arch.block_idx()
        started = cute.arch.globaltimer()
        if cute.arch.thread_idx()[0] == 0:
            wait_at_least(ring_ready, Int32(1), started, timeout_ns, False)
            off0 = ld_s32(expert_offsets + Int64(expert) * 4)
            count = ld_s32(expert_offsets + Int64(expert) * 4 + 4) - off0 - tile * tile_rows
            if count > 0:
                if count > tile_rows:  # noqa: PLR1730 (a DSL value: Python min() cannot trace it)
                    count = tile_rows
                acquire_ring_rows(ring_ready, l1_full_count, off0 + tile * tile_rows, count, block_m, ring_blocks,
                                  started, timeout_ns)
                st_s32(seen + Int64(off0 + tile * tile_rows) * 4, count)
        bar_sync()

    @cute.jit
    def _launch_ring_consumer_probe(a0: Int64, a1: Int64, a2: Int64, a3: Int64, block_m: Int32, ring_blocks: Int32,
                                    tile_rows: Int32, timeout_ns: Int64):
        ring_consumer_probe_kernel(a0, a1, a2, a3, block_m, ring_blocks, tile_rows, timeout_ns).launch(
            grid=(1, 1, 1), block=(128, 1, 1))

    def build_ring_consumer_probe(arch: str = "sm_90a"):
        from gc_moe.runtime.jit import CompileRequest, LaunchShape

        args = (Int64(0), Int64(0), Int64(0), Int64(0), Int32(8), Int32(1), Int32(8), Int64(1))
        return CompileRequest(_launch_ring_consumer_probe, args, LaunchShape(block=(128, 1, 1)))

    @cute.jit
    def _launch_dispatch(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                         a8: Int64, a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, a14: Int64,
                         a15: Int64, a16: Int64, a17: Int64, num_tokens: Int32, rank: Int32, num_ranks: Int32,
                         num_experts: Int32, topk: Int32, hidden: Int32, capacity: Int32, block_m: Int32,
                         ring_blocks: Int32, pool_blocks: Int32, l1_readers: Int32, timeout_ns: Int64):
        dispatch_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, num_tokens,
                        rank, num_ranks, num_experts, topk, hidden, capacity, block_m, ring_blocks, pool_blocks,
                        l1_readers, timeout_ns).launch(
            grid=(1, 1, 1), block=(THREADS, 1, 1), smem=SMEM_BYTES, min_blocks_per_mp=1)

    def build_dispatch(arch: str = "sm_90a"):
        from gc_moe.runtime.jit import CompileRequest, LaunchShape

        if arch != "sm_90a":
            raise ValueError(f"the SM90 dispatch is built for sm_90a only, not {arch!r}")
        args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in PARAMS)
        return CompileRequest(_launch_dispatch, args, LaunchShape(block=(THREADS, 1, 1), dynamic_smem_bytes=SMEM_BYTES))
