"""Role3 of the SM90 GC-MoE layer: finalize in the compute partition, after roles 1 and 2 (Algorithm 1, 10-11).

Grid: any number of CTAs (min(compute SMs, 64) at decode sizes), 256 threads. Per replay:

1. block 0, thread 0 publishes combine readiness to every peer: `fence.acq_rel.sys` (this rank's role2
   scatters precede it), then `red.release.sys` +1 on each peer's combine_ready[parity]; every rank does it,
   also one with no tokens;
2. block 0 consumes this parity's receive counts: each (source rank, local expert) word must show
   `dispatch_ctas` contributors in its high word (the arrival check; a mismatch adds to ARRIVAL_ERRORS), the
   low words add to RECEIVED_ROWS, and the word is cleared; it resets the ring signals (l1_full_count,
   l1_empty_count, l2_empty_count, role2's W1-completion words w1_done_mask) and role1's grid-sync and RING_READY
   words;
3. every CTA acquires combine_ready[parity] >= P (bounded by `timeout_ns`, then `trap`), then combines: for
   each token and 8-column chunk, the BF16 partials of its valid top-k slots (topk_idx >= 0) in slot order,
   then lane k (the shared expert) when `combine_lanes` = k + 1, accumulated in FP32, stored as BF16 into y;
   the loads of LANES_PER_PASS lanes go out together before any add;
4. the last CTA to finish (a departure counter, no grid-wide wait) clears combine_ready[parity], counts the
   replay and flips RECV_PARITY with release, so the next replay's role1 publishes into the other parity.

Kernel parameters (all scalars, in order): `PARAMS`. Host side (no DSL needed): `PARAMS`, `variant`,
`finalize_args`, `combine_reference`.
"""

from __future__ import annotations

THREADS = 256
LANES_PER_PASS = 9  # combine lanes whose loads one pass issues together: k = 8 routed slots and the shared lane
DEFAULT_TIMEOUT_S = 3600.0

PARAMS = (
    ("topk_idx", "u64"), ("combine", "u64"), ("y", "u64"), ("recv_count", "u64"),
    ("l1_full_count", "u64"), ("l1_empty_count", "u64"), ("l2_empty_count", "u64"), ("w1_done_mask", "u64"),
    ("combine_ready", "u64"), ("control", "u64"), ("peers", "u64"),
    ("num_tokens", "s32"), ("num_ranks", "s32"), ("local_experts", "s32"), ("topk", "s32"), ("hidden", "s32"),
    ("capacity", "s32"), ("combine_lanes", "s32"), ("ring_blocks", "s32"), ("w1_done_words", "s32"),
    ("dispatch_ctas", "s32"), ("timeout_ns", "s64"),
)
_WORKSPACE_POINTERS = [name for name, kind in PARAMS if kind == "u64" and name != "y"]

PROMISES = (
    "red.release.sys.global.add",  # combine readiness on every peer
    "fence.acq_rel.sys",
    "ld.acquire.sys",  # readiness wait
    "atom.acq_rel.gpu.global.add",  # departure counter
    "st.release.gpu",  # parity flip
    "nanosleep",
    "trap",  # bounded wait ends in a trap
    "cvt.rn.bf16x2.f32",  # FP32 accumulation back to BF16
)


def variant():
    """The runtime KernelVariant (one binary for every shape)."""
    from gc_moe.runtime.jit import KernelVariant

    return KernelVariant.make("sm90.finalize", __name__, "build_finalize", {}, promises=PROMISES,
                              local_bytes_budget=0, extra_sources=("gc_moe.kernels.sm90.ptx",
                                                                   "gc_moe.kernels.sm90.dispatch",
                                                                   "gc_moe.kernels.sm90.layer_layout"))


def finalize_args(ws, shape, y, num_tokens: int, dispatch_ctas: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Kernel arguments in `PARAMS` order; y: bf16 [>= num_tokens, H], contiguous, on the workspace's device."""
    import torch

    from gc_moe.runtime.launch import i32, i64, ptr

    if not 0 <= num_tokens <= shape.capacity:
        raise ValueError(f"num_tokens {num_tokens} outside 0..capacity={shape.capacity}")
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != shape.hidden or y.shape[0] < num_tokens \
            or not y.is_contiguous():
        raise ValueError(f"y: {y.dtype} {list(y.shape)}; allowed: contiguous bfloat16 [>= {num_tokens}, "
                         f"{shape.hidden}]")
    if dispatch_ctas < 1:
        raise ValueError(f"dispatch_ctas {dispatch_ctas}; allowed: >= 1 (the dispatch grid of every rank)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    ptrs = {name: ptr(getattr(ws, name)) for name in _WORKSPACE_POINTERS}
    ptrs["y"] = ptr(y)
    args = [ptrs[name] for name, kind in PARAMS if kind == "u64"]
    args += [i32(num_tokens), i32(shape.num_ranks), i32(shape.local_experts), i32(shape.topk), i32(shape.hidden),
             i32(shape.capacity), i32(shape.combine_lanes), i32(shape.ring_blocks), i32(ws.w1_done_mask.numel()),
             i32(dispatch_ctas),
             i64(int(timeout_s * 1e9))]
    return args


def combine_reference(combine, topk_idx, num_tokens: int, shared: bool):
    """Host twin of the combine: combine bf16 [lanes, C, H], topk_idx int64 [C, k] -> bf16 [num_tokens, H]
    (FP32 sum of the valid slots in slot order, the shared lane last)."""
    import torch

    k = topk_idx.shape[1]
    acc = torch.zeros(num_tokens, combine.shape[2], dtype=torch.float32, device=combine.device)
    for j in range(k):
        valid = (topk_idx[:num_tokens, j] >= 0)[:, None]
        acc = torch.where(valid, acc + combine[j, :num_tokens].float(), acc)
    if shared:
        acc = acc + combine[k, :num_tokens].float()
    return acc.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------- device code
try:
    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, cute
except ImportError:
    cute = None

if cute is not None:
    from gc_moe.kernels.sm90.dispatch import (
        atom_add_acq_rel_gpu,
        atom_add_s32,
        bar_sync,
        fence_sys,
        ld_s32,
        ld_s64,
        ld_s64_sys,
        red_release_sys,
        st_release_gpu,
        st_s32,
        st_s64,
        wait_at_least,
    )
    from gc_moe.kernels.sm90.layer_layout import (
        ARRIVAL_ERRORS,
        DISPATCH_SYNC,
        FINALIZE_DONE,
        RECEIVED_ROWS,
        RECV_PARITY,
        REPLAYS,
        RING_READY,
    )
    from gc_moe.kernels.sm90.ptx import asm

    def ldg_v4(addr: Int64) -> list:
        return asm("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [addr])

    def ldg_nc_s64(addr: Int64) -> Int64:
        """A read-only input (topk_idx: the caller wrote it before the call) through the non-coherent path."""
        return asm("ld.global.nc.b64 $0, [$1];", [Int64], [addr])

    def stg_v4(addr: Int64, w: list) -> None:
        asm("st.global.v4.b32 [$0], {$1, $2, $3, $4};", [], [addr] + list(w))

    def bf16_lo(w: Uint32) -> Float32:
        return asm("mov.b32 $0, $1;", [Float32], [w << 16])

    def bf16_hi(w: Uint32) -> Float32:
        return asm("mov.b32 $0, $1;", [Float32], [w & Uint32(0xFFFF0000)])

    def pack_bf16x2(lo: Float32, hi: Float32) -> Uint32:
        return asm("cvt.rn.bf16x2.f32 $0, $1, $2;", [Uint32], [hi, lo])

    @cute.kernel
    def finalize_kernel(topk_idx: Int64, combine: Int64, y: Int64, recv_count: Int64, l1_full_count: Int64,
                        l1_empty_count: Int64, l2_empty_count: Int64, w1_done_mask: Int64, combine_ready: Int64,
                        control: Int64, peers: Int64, num_tokens: Int32, num_ranks: Int32, local_experts: Int32,
                        topk: Int32, hidden: Int32, capacity: Int32, combine_lanes: Int32, ring_blocks: Int32,
                        w1_done_words: Int32, dispatch_ctas: Int32, timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        nblocks = cute.arch.grid_dim()[0]
        started = cute.arch.globaltimer()
        parity = ld_s32(control + Int64(4 * RECV_PARITY))
        ready = combine_ready + Int64(parity) * 4

        # 1-2. bookkeeping in block 0
        if bid == 0:
            if tid == 0:
                fence_sys()
                r = Int32(0)
                while r < num_ranks:
                    red_release_sys(ready + ld_s64(peers + Int64(r) * 8), Int32(1))
                    r = r + 1
            counts = recv_count + Int64(parity * num_ranks * local_experts) * 8
            bad = Int32(0)
            rows = Int32(0)
            i = tid
            while i < num_ranks * local_experts:
                packed = ld_s64_sys(counts + Int64(i) * 8)
                if Int32(packed >> 32) != dispatch_ctas:
                    bad = bad + 1
                rows = rows + Int32(packed & Int64(0xFFFFFFFF))
                st_s64(counts + Int64(i) * 8, Int64(0))
                i = i + THREADS
            if bad != 0:
                atom_add_s32(control + Int64(4 * ARRIVAL_ERRORS), bad)
            if rows != 0:
                atom_add_s32(control + Int64(4 * RECEIVED_ROWS), rows)
            b = tid
            while b < ring_blocks:
                st_s32(l1_full_count + Int64(b) * 4, Int32(0))
                st_s32(l1_empty_count + Int64(b) * 4, Int32(0))
                st_s32(l2_empty_count + Int64(b) * 4, Int32(0))
                b = b + THREADS
            w = tid
            while w < w1_done_words:
                st_s64(w1_done_mask + Int64(w) * 8, Int64(0))
                w = w + THREADS
            if tid == 0:
                st_s32(control + Int64(4 * DISPATCH_SYNC), Int32(0))
                st_s32(control + Int64(4 * RING_READY), Int32(0))

        # 3. every peer's partials for this rank have landed, then the combine
        if tid == 0:
            wait_at_least(ready, num_ranks, started, timeout_ns, True)
        bar_sync()
        chunks = hidden // 8
        lane_rows = Int64(capacity) * Int64(hidden)
        item = bid * THREADS + tid
        while item < num_tokens * chunks:
            t = item // chunks
            c = item - t * chunks
            acc = cute.make_rmem_tensor((8,), Float32)
            for q in cutlass.range_constexpr(8):
                acc[q] = Float32(0.0)
            column = Int64(t) * Int64(hidden) + Int64(c * 8)
            first = Int32(0)
            while first < combine_lanes:
                # a pass issues its lanes' loads (slot ids and partials) before adding any: one round trip
                # per pass, not two per lane; a lane past combine_lanes re-reads the last one, unused
                ids, parts = [], []
                for p in cutlass.range_constexpr(LANES_PER_PASS):
                    lane = min(first + p, combine_lanes - 1)  # branch-free, so the loads stay together
                    slot = min(lane, topk - 1)  # the shared lane has no slot id (the one read is unused)
                    ids.append(ldg_nc_s64(topk_idx + Int64(t * topk + slot) * 8))
                    parts.append(ldg_v4(combine + (Int64(lane) * lane_rows + column) * 2))
                for p in cutlass.range_constexpr(LANES_PER_PASS):
                    j = first + p
                    keep = Uint32(0)  # an invalid lane adds +0.0: bit-exact, acc (from +0.0) is never -0.0
                    if j < combine_lanes:  # the shared lane (j = k) is always valid
                        keep = Uint32(0xFFFFFFFF)
                    if j < topk:
                        if Int32(ids[p]) < 0:
                            keep = Uint32(0)
                    for q in cutlass.range_constexpr(4):
                        w = parts[p][q] & keep
                        acc[2 * q] = acc[2 * q] + bf16_lo(w)
                        acc[2 * q + 1] = acc[2 * q + 1] + bf16_hi(w)
                first = first + LANES_PER_PASS
            stg_v4(y + column * 2, [pack_bf16x2(acc[2 * q], acc[2 * q + 1]) for q in range(4)])
            item = item + nblocks * THREADS

        # 4. the last CTA out flips the parity for the next replay
        bar_sync()
        if tid == 0:
            fence_sys()
            done = atom_add_acq_rel_gpu(control + Int64(4 * FINALIZE_DONE), Int32(1))
            if done == nblocks - 1:
                st_s32(ready, Int32(0))  # this parity's next use is two replays away
                atom_add_s32(control + Int64(4 * REPLAYS), Int32(1))
                st_s32(control + Int64(4 * FINALIZE_DONE), Int32(0))
                st_release_gpu(control + Int64(4 * RECV_PARITY), parity ^ 1)

    @cute.jit
    def _launch_finalize(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                         a8: Int64, a9: Int64, a10: Int64, num_tokens: Int32, num_ranks: Int32,
                         local_experts: Int32, topk: Int32, hidden: Int32, capacity: Int32, combine_lanes: Int32,
                         ring_blocks: Int32, w1_done_words: Int32, dispatch_ctas: Int32, timeout_ns: Int64):
        finalize_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, num_tokens, num_ranks, local_experts, topk,
                        hidden, capacity, combine_lanes, ring_blocks, w1_done_words, dispatch_ctas,
                        timeout_ns).launch(
            # `.minnctapersm 1`: without launch bounds ptxas keeps this kernel near 34 registers and issues the
            # combine's lane loads one after the other; with them it keeps a pass's 9 loads in flight (90)
            grid=(1, 1, 1), block=(THREADS, 1, 1), min_blocks_per_mp=1)

    def build_finalize(arch: str = "sm_90a"):
        from gc_moe.runtime.jit import CompileRequest, LaunchShape

        if arch != "sm_90a":
            raise ValueError(f"the SM90 finalize is built for sm_90a only, not {arch!r}")
        args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in PARAMS)
        return CompileRequest(_launch_finalize, args, LaunchShape(block=(THREADS, 1, 1)))
