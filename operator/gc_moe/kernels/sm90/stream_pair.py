"""W1 and W2 of the stand-alone grouped GEMM as one stream-K launch: the pair kernel.

At 1-8 tokens per rank the stream-K loops (`grouped_gemm.GemmConfig.stream_k`) stream the weights at the read
bandwidth, and what is over the byte floor is per launch: each kernel's start (unit scan, first stage), its tail
(owners' combine, the CTAs' end spread) and the boundary between W1 and W2, which the programmatic W2 launch only
partly hides (docs/sm90-grouped-gemm.md, steps 27-30). Here every CTA (one per SM) walks its W1 range and then
its W2 range on one stage ring that runs on across both (`grouped_gemm.StreamHalf`), so:

- **no boundary**: W2's weights are independent of W1, so a CTA's producer streams its first W2 stages as soon as
  its last W1 copies are out, while the slower SMs still finish W1 (the memory does not idle between the two;
  an SM that streams slower stays behind through both, which the sm_weights variant's ranges address);
- **the W1-completion words** (the paper's bitmap, counted): W1 unit (e, weight-row CTA x, token tile z) writes
  exactly K128 block x of W2's input rows of tile z; its whole-unit or owner epilogue, after a consumer barrier,
  adds R = H / 256 (W2's weight-row CTAs per token tile: every W2 unit of the tile reads block x once) to the word
  `ready[e, z, x]` with release. A W2 segment's producer issues the weights of its first steps, then lane k polls
  the word of its step k (relaxed, bounded), takes one permit back (red.add -1) and the warp fences (acquire)
  before any row copy: the words are zero again when the launch ends, so replays need no clearing;
- **no deadlock**: the grid is resident at once (one CTA per SM), every CTA finishes its W1 range before any W2
  wait, and W1 waits only for W1 pieces.

Variants: plain, `lean_epilogue`, `sm_weights` (ranges by per-SM weights), `words_first` (W2's segments take their
words before their weights where W1 set them already), `publisher_warp` (W1's words released by a warp of their
own, not by the consumers' thread 0) and `trace` (a measuring variant).
Kernel parameters (in order): `PARAMS`. Host side (no DSL needed): `PairConfig`, `variant`, `all_variants`,
`pair_buffers`, `pair_launch`, `launch_pair`, `sm_weight_table`, and the host twins `weighted_ranges`,
`weighted_segments`, `hand_over_balance`.
"""

import math
from dataclasses import dataclass

from gc_moe.kernels.sm90 import grouped_gemm as gg

PARAMS = (
    ("w1_codes", "u64"), ("w1_scales", "u64"), ("w1_factor", "u64"), ("act", "u64"), ("act_scale", "u64"),
    ("expert_offsets", "u64"), ("routing_weight", "u64"), ("mid", "u64"), ("mid_scale", "u64"),
    ("w2_codes", "u64"), ("w2_scales", "u64"), ("w2_factor", "u64"), ("dest_row", "u64"), ("out", "u64"),
    ("w1_partials", "u64"), ("w1_counts", "u64"), ("w2_partials", "u64"), ("w2_counts", "u64"), ("ready", "u64"),
    ("hidden_blocks", "s32"), ("w1_m_tiles", "s32"), ("inter_blocks", "s32"), ("w2_m_tiles", "s32"),
    ("experts", "s32"), ("ready_tiles", "s32"),
    ("sm_weights", "u64"),  # the sm_weights variant's int32 per %smid (`sm_weight_table`); 0 for the others
)
# a W2 segment's producer polls one hand-over word per K128 step with one lane each
MAX_INTER_BLOCKS = 32
BLOCK_N = 8  # the stream-K loops' token tile
TRACE_LOCAL_BYTES = 16  # stack the traced variant may take, never inside a K loop (SASS checked: none now)


@dataclass(frozen=True)
class PairConfig:
    swiglu_alpha: float = 1.0
    swiglu_clamp: float = 10.0
    # each segment's epilogue words (the expert's factor, W1's routing weights, W2's combine rows) loaded before its
    # K loop, W1's amax reduced once per token (`grouped_gemm.GemmConfig.lean_epilogue`)
    lean_epilogue: bool = False
    # the CTAs' ranges sized by per-SM weights (`grouped_gemm.GemmConfig.sm_weights`, the table from
    # `sm_weight_table`) rather than equal: the same arithmetic with other piece boundaries (other last bits)
    sm_weights: bool = False
    # each half stamps its phases into the head of its partials buffer as the traced stream-K loops do
    # (`grouped_gemm.GemmConfig.trace`; W2's "start" is its walk's, its wait the first segment's hand-over): where the
    # pair's time over the floor goes. A measuring variant
    trace: bool = False
    # W2's segments take their hand-over words before their weights where W1 set them already (every segment but a
    # CTA's first, mostly; `grouped_gemm.GemmConfig.words_first`): no wait for the rows at a segment switch (step 45)
    words_first: bool = False
    # W1's hand-over words released by an 18th warp instead of the consumers' thread 0, whose GPU-scope release
    # stalled warpgroup 0 and the ring after every finished unit (`grouped_gemm.GemmConfig.publisher_warp`, step 46)
    publisher_warp: bool = False
    # the ring both halves share: tile 8's stream-K depth (`grouped_gemm.RING_STAGES`, step 65) unless named
    stages: int | None = None
    # W1's walk starts quickly (`grouped_gemm.GemmConfig.quick_start`: its producer's path to its first copies by
    # multiplies and a ballot lookup, step 69); W2's walk starts under W1's last units. Not with sm_weights
    quick_start: bool = False
    # both halves read their codes in the "split" nibble order (`grouped_gemm.GemmConfig.split_nibbles`: 17 fewer
    # instructions per K128 step and warp, conflict-free code loads)
    split_nibbles: bool = False

    def half(self, role: str) -> gg.GemmConfig:
        """The stream-K loop of one role as a half of the pair (one CTA per SM; both halves share the ring)."""
        return gg.GemmConfig(role, BLOCK_N, swiglu_alpha=self.swiglu_alpha, swiglu_clamp=self.swiglu_clamp,
                             warp_specialized=True, ctas_per_sm=1, stream_k=True, stream_pair=True,
                             lean_epilogue=self.lean_epilogue, sm_weights=self.sm_weights, trace=self.trace,
                             words_first=self.words_first, publisher_warp=self.publisher_warp,
                             stages=self.stages if self.stages is not None else gg.RING_STAGES[BLOCK_N],
                             quick_start=self.quick_start and role == "w1", split_nibbles=self.split_nibbles)

    def __post_init__(self):
        w1, w2 = self.half("w1"), self.half("w2")
        same = ("stages", "stage_bytes", "barrier_offset", "full_arrivals", "threads", "b_offset", "xs_offset",
                "scale_offset")
        if any(getattr(w1, f) != getattr(w2, f) for f in same):
            raise AssertionError(f"the pair's halves differ in their ring: {w1} / {w2}")


def variant(swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0, lean_epilogue: bool = False,
            sm_weights: bool = False, trace: bool = False, words_first: bool = False, publisher_warp: bool = False,
            stages: int | None = None, quick_start: bool = False, split_nibbles: bool = False):
    """The runtime KernelVariant of the pair kernel (stages: its ring, None for tile 8's adopted depth)."""
    from gc_moe.runtime.jit import KernelVariant

    cfg = PairConfig(swiglu_alpha, swiglu_clamp, lean_epilogue, sm_weights, trace, words_first, publisher_warp,
                     stages, quick_start, split_nibbles)  # validates
    params = {"swiglu_alpha": swiglu_alpha, "swiglu_clamp": swiglu_clamp, "stages": cfg.half("w1").stages}
    if lean_epilogue:  # named only when on: the plain variant keeps its parameters (and cache key)
        params["lean_epilogue"] = True
    if sm_weights:
        params["sm_weights"] = True
    if trace:
        params["trace"] = True
    if words_first:
        params["words_first"] = True
    if publisher_warp:
        params["publisher_warp"] = True
    if quick_start:
        params["quick_start"] = True
    if split_nibbles:
        params["split_nibbles"] = True
    promises = ("wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.shared::cluster.global.mbarrier",
                "mbarrier.try_wait.parity", "red.release.gpu.global.add", "red.relaxed.gpu.global.add",
                "ld.relaxed.gpu.global", "fence.acq_rel.gpu", "trap")
    if words_first:
        promises += ("atom.acquire.gpu.global.add",)
    # the traced variant keeps the halves' trace addresses across both walks: 8 B spilled outside the K loops
    return KernelVariant.make("sm90.stream_pair", __name__, "build_pair", params, promises=promises,
                              local_bytes_budget=TRACE_LOCAL_BYTES if trace else 0,
                              extra_sources=("gc_moe.kernels.sm90.grouped_gemm", "gc_moe.kernels.sm90.ptx"))


def all_variants():
    return [variant(), variant(lean_epilogue=True), variant(sm_weights=True), variant(trace=True),
            variant(words_first=True), variant(trace=True, words_first=True), variant(publisher_warp=True),
            variant(words_first=True, publisher_warp=True), variant(trace=True, words_first=True, publisher_warp=True),
            # W1's walk starting quickly (plain, traced, with both of the hand-over's knobs)
            variant(quick_start=True), variant(quick_start=True, trace=True),
            variant(quick_start=True, words_first=True, publisher_warp=True),
            # both halves on the "split" nibble order (plain, traced, with the quick start, with both of the
            # hand-over's knobs): the pair of tile_knobs's sets, whose tile-8 loops read that order
            variant(split_nibbles=True), variant(split_nibbles=True, trace=True),
            variant(split_nibbles=True, quick_start=True),
            variant(split_nibbles=True, words_first=True, publisher_warp=True)]


def build_pair(arch: str = "sm_90a", swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0,
               lean_epilogue: bool = False, sm_weights: bool = False, trace: bool = False,
               words_first: bool = False, publisher_warp: bool = False, stages: int | None = None,
               quick_start: bool = False, split_nibbles: bool = False):
    """The runtime's builder: a CompileRequest for the pair kernel (no GPU needed)."""
    from cutlass import Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 stream-K pair kernel is built for sm_90a only, not {arch!r}")
    host, half = _make_kernel(PairConfig(swiglu_alpha, swiglu_clamp, lean_epilogue, sm_weights, trace,
                                         words_first, publisher_warp, stages, quick_start, split_nibbles))
    args = tuple(Int64(0) if kind == "u64" else Int32(1) for _, kind in PARAMS)
    return CompileRequest(host, args, LaunchShape(block=(half.threads, 1, 1), dynamic_smem_bytes=half.smem_bytes))


# ------------------------------------------------------------------------------------------------- host side
def ready_words(local_experts: int, capacity: int, inter: int) -> int:
    """Hand-over words of a launch: one per (expert, token tile, W2 K128 block)."""
    return local_experts * max(1, -(-capacity // BLOCK_N)) * (inter // 128)


def sm_weight_table(rates: dict, ratio: float = gg.SM_WEIGHT_RATIO) -> list[int]:
    """The per-SM weights of the sm_weights variant from each SM's measured streaming rate ({%smid: K128 steps per
    us}, e.g. from the stream-K trace's per-CTA lists): int32 per %smid below MAX_SM_IDS, the mean 1000, clamped so
    that the largest is at most `ratio` times the smallest (every weighted range stays nonempty), 0 where no rate
    is named (no CTA of the launch runs there). The table names exactly the SMs the launch runs on."""
    if not rates:
        raise ValueError("sm_weight_table needs at least one SM's rate")
    bad = {k: v for k, v in rates.items() if not 0 <= int(k) < gg.MAX_SM_IDS or not v > 0}
    if bad:
        raise ValueError(f"rates {bad}: allowed %smid in 0..{gg.MAX_SM_IDS - 1} with a positive rate")
    mean = sum(rates.values()) / len(rates)
    # around the mean, hi / lo <= ratio after rounding
    lo, hi = math.ceil(2000 / (1 + ratio)), math.floor(2000 * ratio / (1 + ratio))
    table = [0] * gg.MAX_SM_IDS
    for smid, rate in rates.items():
        table[int(smid)] = min(hi, max(lo, round(1000 * rate / mean)))
    return table


def weighted_ranges(table: list[int], work: int) -> list[tuple[int, int]]:
    """Host twin of `grouped_gemm`'s weighted ranges: per rank (the weighted SMs in %smid order) its K128 steps
    [first, end) of `work`, or the equal ranges by rank where some SM would get fewer than SM_WEIGHT_MIN_STEPS."""
    smids = [i for i, w in enumerate(table) if w > 0]
    n, total = len(smids), sum(table)
    if work < gg.SM_WEIGHT_MIN_STEPS * n:
        ctas = gg.stream_ctas(n, work)
        return [gg.stream_range(r, ctas, work) if r < ctas else (0, 0) for r in range(n)]
    prefix = [sum(table[:i]) for i in range(gg.MAX_SM_IDS + 1)]
    return [(work * prefix[i] // total, work * prefix[i + 1] // total) for i in smids]


def weighted_segments(units: int, k_blocks: int, table: list[int]) -> list:
    """`grouped_gemm.stream_segments` for the weighted ranges: per rank its [(steps, kind)]."""
    return [gg.range_segments(first, end, k_blocks) for first, end in weighted_ranges(table, units * k_blocks)]


def hand_over_balance(counts: list[int], hidden: int, inter: int, sms: int, table: list[int] | None = None) -> dict:
    """Host twin of the hand-over words for one launch: {word index: value at the launch's end} after every W1 unit
    (whole or owner) added its readers and every W2 segment took one permit per K128 step it covers, with the units
    ordered and indexed as the kernel does (`grouped_gemm.unit_table` / `unit_lookup`, `stream_range`, or the
    weighted ranges of `table`). Every value is 0 when the readers per word (H / 256) match the W2 segments that
    read it. Raises if a W2 segment would wait for a word no W1 unit publishes."""
    tiles = [-(-c // BLOCK_N) for c in counts]
    ready_tiles = max(1, max(tiles, default=0))
    k2, w1_ctas, w2_ctas = inter // 128, 2 * inter // gg.ROWS_PER_CTA, hidden // gg.ROWS_PER_CTA

    def units_of(row_ctas):  # unit -> (expert, weight-row CTA, token tile): expert, then weight-row CTA, then tile
        return [(e, x, z) for e, te in enumerate(tiles) for x in range(row_ctas) for z in range(te)]
    words = {}
    for e, x, z in units_of(w1_ctas):  # each W1 unit is finished once (a whole unit or its owner)
        key = (e * ready_tiles + z) * w1_ctas + x
        words[key] = words.get(key, 0) + w2_ctas
    published = set(words)
    w2_units = units_of(w2_ctas)
    work = len(w2_units) * k2
    if table is None:
        starts = [gg.stream_range(c, gg.stream_ctas(sms, work), work)[0] if c < gg.stream_ctas(sms, work) else 0
                  for c in range(sms)]
        walks = gg.stream_segments(len(w2_units), k2, sms)
    else:
        starts = [first for first, _ in weighted_ranges(table, work)]
        walks = weighted_segments(len(w2_units), k2, table)
    for cta, segments in enumerate(walks):
        s = starts[cta]
        for steps, _ in segments:
            unit, k_first = divmod(s, k2)
            e, _, z = w2_units[unit]
            for kb in range(k_first, k_first + steps):
                key = (e * ready_tiles + z) * k2 + kb
                if key not in published:
                    raise AssertionError(f"W2 unit {unit} step {kb} waits for word {key}, which no W1 unit publishes")
                words[key] -= 1
            s += steps
    return words


def pair_buffers(l1, l2, capacity: int, device, sms: int | None = None, sm_weights: list[int] | None = None) -> dict:
    """What a pair launch needs beside its tensors, zeroed (the kernel leaves them zero): each half's split
    buffers (`grouped_gemm.stream_sizes` at `sms`, default the device's SMs, with room for the traced variant's
    slots ahead of the partials) and the hand-over words; with `sm_weights` the sm_weights variant's table."""
    import torch

    have = gg.device_sms(device)
    sms = sms or have
    if not 1 <= sms <= have:
        raise ValueError(f"sms {sms}: the pair kernel's CTAs (one per SM) must all be resident at once; allowed 1.."
                         f"{have} (this device's SMs, or fewer for a green context's partition)")
    cfg = PairConfig(trace=True)  # room for the traced variant's slots too (~64 KB a half): one set of buffers
    out = {}
    for role, mat in (("w1", l1), ("w2", l2)):
        partials, units = gg.stream_sizes(cfg.half(role), mat.rows, mat.num_experts, capacity, sms)
        out[role] = (torch.zeros(partials, dtype=torch.float32, device=device),
                     torch.zeros(units, dtype=torch.int32, device=device))
    out["ready"] = torch.zeros(ready_words(l1.num_experts, capacity, l2.cols), dtype=torch.int32, device=device)
    out["sms"] = sms
    if sm_weights is not None:  # the sm_weights variant's table (`sm_weight_table`), checked here, not per launch
        weighted = [w for w in sm_weights if w > 0]
        if len(sm_weights) != gg.MAX_SM_IDS or min(sm_weights) < 0 or len(weighted) != sms \
                or max(weighted) > gg.SM_WEIGHT_RATIO * min(weighted):
            raise ValueError(f"sm_weights must be {gg.MAX_SM_IDS} int32 per %smid, >= 0, positive for exactly the "
                             f"launch's {sms} SMs and within {gg.SM_WEIGHT_RATIO}x of each other "
                             f"(sm_weight_table); got {len(weighted)} positive of {len(sm_weights)}")
        out["sm_weights"] = torch.tensor(sm_weights, dtype=torch.int32, device=device)
    return out


def pair_launch(kernel, l1, l2, act, act_scale, expert_offsets, routing_weight, mid, mid_scale, dest_row, out,
                capacity: int, buffers: dict):
    """(grid, arguments) of one pair launch or graph node; see `launch_pair`."""
    import torch

    from gc_moe.runtime.launch import i32, i64, ptr

    if not l1.gate_up_interleaved or l2.gate_up_interleaved:
        raise ValueError("the pair kernel needs l1 = the W1 matrix (gate/up interleaved) and l2 = the W2 matrix")
    hidden, inter, experts = l1.cols, l1.rows // 2, l1.num_experts
    if (l2.rows, l2.cols, l2.num_experts) != (hidden, inter, experts):
        raise ValueError(f"W2 must be [{experts}, {hidden}, {inter}] for this W1, got "
                         f"[{l2.num_experts}, {l2.rows}, {l2.cols}]")
    if inter // 128 > MAX_INTER_BLOCKS:
        raise ValueError(f"intermediate {inter}: W2's {inter // 128} K128 steps exceed the {MAX_INTER_BLOCKS} hand-over "
                         f"words one producer warp polls; allowed: intermediate <= {128 * MAX_INTER_BLOCKS}")
    if experts > gg.STREAM_MAX_EXPERTS:
        raise ValueError(f"{experts} local experts; the stream-K loops take at most {gg.STREAM_MAX_EXPERTS}")
    if capacity < 1:
        raise ValueError(f"capacity {capacity}: the most rows one expert may hold must be >= 1")
    rows = act.shape[0]
    gg._check_cuda("act", act, torch.float8_e4m3fn, (rows, hidden))
    gg._check_cuda("act_scale", act_scale, torch.float32, (rows, hidden // 128))
    gg._check_cuda("expert_offsets", expert_offsets, torch.int32, (experts + 1,))
    gg._check_cuda("routing_weight", routing_weight, torch.float32, (rows,))
    gg._check_cuda("mid", mid, torch.float8_e4m3fn, (rows, inter))
    gg._check_cuda("mid_scale", mid_scale, torch.float32, (rows, inter // 128))
    gg._check_cuda("dest_row", dest_row, torch.int32, (rows,))
    gg._check_cuda("out", out, torch.bfloat16)
    if out.shape[1] != hidden:
        raise ValueError(f"out must be [P, {hidden}], got {tuple(out.shape)}")
    cfg = PairConfig(**dict(kernel.entry.variant.params))
    for role, mat in (("w1", l1), ("w2", l2)):
        gg._check_nibble_order(cfg.half(role), kernel, mat)
    sms = buffers["sms"]
    split = {}
    for role, mat in (("w1", l1), ("w2", l2)):
        need, units = gg.stream_sizes(cfg.half(role), mat.rows, experts, capacity, sms)
        part, counts = buffers[role]
        if part.numel() < need or counts.numel() < units:
            raise ValueError(f"the pair's {role} split buffers hold {part.numel()} partials / {counts.numel()} counts, "
                             f"this call needs {need} / {units}: pair_buffers(l1, l2, capacity, device, sms) with this "
                             f"capacity")
        split[role] = (part, counts)
    words = ready_words(experts, capacity, inter)
    if buffers["ready"].numel() < words:
        raise ValueError(f"the pair's hand-over words hold {buffers['ready'].numel()}, this call needs {words}: "
                         f"pair_buffers(l1, l2, capacity, device, sms) with this capacity")
    if cfg.sm_weights and "sm_weights" not in buffers:
        raise ValueError(f"{kernel.name} sizes its ranges by per-SM weights: pair_buffers(..., sm_weights="
                         f"sm_weight_table(rates)) with the rates of the SMs it runs on")
    table = ptr(buffers["sm_weights"]) if cfg.sm_weights else i64(0)
    args = [ptr(l1.codes), ptr(l1.scales), ptr(l1.factor), ptr(act), ptr(act_scale), ptr(expert_offsets),
            ptr(routing_weight), ptr(mid), ptr(mid_scale), ptr(l2.codes), ptr(l2.scales), ptr(l2.factor),
            ptr(dest_row), ptr(out), ptr(split["w1"][0]), ptr(split["w1"][1]), ptr(split["w2"][0]),
            ptr(split["w2"][1]), ptr(buffers["ready"]),
            i32(hidden // 128), i32(l1.rows // 64), i32(inter // 128), i32(hidden // 64), i32(experts),
            i32(max(1, -(-capacity // BLOCK_N))), table]
    return (sms, 1, 1), args


def launch_pair(kernel, l1, l2, act, act_scale, expert_offsets, routing_weight, mid, mid_scale, dest_row, out,
                capacity: int, buffers: dict, stream):
    """W1 (+ SwiGLU, routing weight, FP8 requant into mid / mid_scale) and then W2 (BF16 rows out[dest_row[r]])
    over grouped rows in one launch; the tensors as `grouped_gemm.launch_w1` / `launch_w2` take them (weights in
    the "lane" nibble order, "split" with split_nibbles), `buffers` from `pair_buffers` (its SMs: the launch's CTAs,
    all resident at once)."""
    from gc_moe.runtime.launch import launch

    g, args = pair_launch(kernel, l1, l2, act, act_scale, expert_offsets, routing_weight, mid, mid_scale, dest_row,
                          out, capacity, buffers)
    return launch(kernel, g, args, stream)


# ------------------------------------------------------------------------------------------------- device code
def _make_kernel(cfg: PairConfig):
    """The pair kernel's host launcher and its W1 half's configuration (the launch shape)."""
    import cutlass
    from cutlass import Int32, Int64, cute

    from gc_moe.kernels.sm90 import ptx

    half1 = cfg.half("w1")
    w1, w2 = gg._make_kernel(half1), gg._make_kernel(cfg.half("w2"))
    rows_per_unit = gg.TILES_PER_CTA  # 64-row weight tiles per CTA: m_tiles // this = weight-row CTAs

    @cute.kernel
    def kernel(w1_codes: Int64, w1_scales: Int64, w1_factor: Int64, act: Int64, act_scale: Int64,
               expert_offsets: Int64, routing_weight: Int64, mid: Int64, mid_scale: Int64, w2_codes: Int64,
               w2_scales: Int64, w2_factor: Int64, dest_row: Int64, out: Int64, w1_partials: Int64,
               w1_counts: Int64, w2_partials: Int64, w2_counts: Int64, ready: Int64, hidden_blocks: Int32,
               w1_m_tiles: Int32, inter_blocks: Int32, w2_m_tiles: Int32, experts: Int32, ready_tiles: Int32,
               sm_weights: Int64):
        tid = cute.arch.thread_idx()[0]
        coords = w1.thread_coords(tid)
        cta = Int32(cute.arch.block_idx()[0])
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        smid = None
        if cutlass.const_expr(cfg.sm_weights):
            w1.load_sm_table(sm_weights, smem, tid)  # read after the ring's barrier below
        split1, split2 = (w1_partials, w1_counts), (w2_partials, w2_counts)
        trace1, trace2 = Int64(0), Int64(0)
        if cutlass.const_expr(cfg.trace):  # each half's slots at the head of its partials buffer
            trace1, split1 = w1.trace_slots(split1, cta, tid)
            trace2, split2 = w2.trace_slots(split2, cta, gg.THREADS + 1)  # W2's entry is stamped at its walk
        w1.init_stage_ring(smem, tid)
        if cutlass.const_expr(cfg.sm_weights):
            smid = ptx.sm_id()
            cta, _ = w1.sm_rank(smem, smid)  # the CTA's place in the order: its SM's rank by weight
        magic = None
        if cutlass.const_expr(cfg.quick_start):  # W1's range divisor's multiplier while the scan's loads are out
            magic = ptx.division_magic(Int32(cute.arch.grid_dim()[0]))
        table1, units1 = w1.unit_table(expert_offsets, experts, w1_m_tiles // rows_per_unit)
        if cutlass.const_expr(cfg.trace):
            w1.trace_scanned(trace1, tid)
        tensors = (w1_codes, w1_scales, w1_factor, act, act_scale, expert_offsets, routing_weight, mid, mid_scale,
                   w2_codes, w2_scales, w2_factor, dest_row, out, ready)
        sizes = (hidden_blocks, w1_m_tiles, inter_blocks, w2_m_tiles, experts, ready_tiles)
        if cutlass.const_expr(cfg.publisher_warp):
            if tid >= half1.threads - gg.PRODUCER_THREADS:  # the publisher warp: W1's words, nothing else
                w1.publish_walk(table1, units1, hidden_blocks, w1_m_tiles,
                                (ready, ready_tiles, w2_m_tiles // rows_per_unit), tid, cta, smem, smid)
            else:
                walk_both(tensors, sizes, table1, units1, tid, coords, cta, smem, smid, (split1, trace1),
                          (split2, trace2), magic)
        else:
            walk_both(tensors, sizes, table1, units1, tid, coords, cta, smem, smid, (split1, trace1),
                      (split2, trace2), magic)

    @cute.jit
    def walk_both(tensors, sizes, table1, units1, tid, coords, cta, smem, smid, w1_split, w2_split, magic=None):
        """The consumers and the producer: the CTA's W1 range, then its W2 range, on one ring."""
        (w1_codes, w1_scales, w1_factor, act, act_scale, expert_offsets, routing_weight, mid, mid_scale,
         w2_codes, w2_scales, w2_factor, dest_row, out, ready) = tensors
        hidden_blocks, w1_m_tiles, inter_blocks, w2_m_tiles, experts, ready_tiles = sizes
        split1, trace1 = w1_split
        split2, trace2 = w2_split
        base, segments1 = w1.stream_walk((w1_codes, w1_scales, act, act_scale), w1_factor, table1, units1,
                                         hidden_blocks, w1_m_tiles, split1, (routing_weight, mid, mid_scale), tid,
                                         coords, cta, smem, Int32(0), trace1,
                                         pair=(ready, ready_tiles, w2_m_tiles // rows_per_unit), smid=smid,
                                         magic=magic)
        if cutlass.const_expr(cfg.trace):
            w1.trace_tail(trace1, tid, segments1)
            if tid == 0:
                ptx.stamp_times(trace2)  # W2's walk begins (thread 0 is past W1's last epilogue)
        # W2's table only now: kept across the W1 walk it cost the loops their uniform registers and spilled (96
        # per thread); its loads hit the L1 / L2 lines W1's scan brought in, while the ring still holds W1's last
        # stages for the consumers
        table2, units2 = w2.unit_table(expert_offsets, experts, w2_m_tiles // rows_per_unit)
        if cutlass.const_expr(cfg.trace):
            w2.trace_scanned(trace2, tid)
        base, segments2 = w2.stream_walk((w2_codes, w2_scales, mid, mid_scale), w2_factor, table2, units2,
                                         inter_blocks, w2_m_tiles, split2, (dest_row, out), tid, coords, cta, smem,
                                         base, trace2, pair=(ready, ready_tiles), smid=smid)
        if tid >= gg.THREADS:
            ptx.cp_async_wait_all()  # the producer leaves only once its last copies have landed
        if cutlass.const_expr(cfg.trace):
            w2.trace_tail(trace2, tid, segments2)

    launch = {"grid": (1, 1, 1), "block": (half1.threads, 1, 1), "smem": half1.smem_bytes}
    launch.update(gg.launch_register_bounds(half1))

    @cute.jit
    def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64, a8: Int64,
             a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, a14: Int64, a15: Int64, a16: Int64,
             a17: Int64, a18: Int64, hidden_blocks: Int32, w1_m_tiles: Int32, inter_blocks: Int32,
             w2_m_tiles: Int32, experts: Int32, ready_tiles: Int32, sm_weights: Int64):
        kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, hidden_blocks,
               w1_m_tiles, inter_blocks, w2_m_tiles, experts, ready_tiles, sm_weights).launch(**launch)

    return host, half1
