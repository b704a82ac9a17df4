"""Role4 of the SM90 GC-MoE layer: the shared expert, FP8 weights x the layer's FP8 activations (sm_90a).

    y_shared[t] = W2s requant(SwiGLU(W1s x_t))        for t < num_tokens

Two kernels, one binary each for every token count (num_tokens, strides and shapes are kernel parameters):

- W1 (`role="w1"`): h = W1s x over the public buffer's activations read in place (`x` E4M3 [C, H] with
  `x_sf` int32 [C, H/128] of packed UE8M0 per 32, Listing 1's bytes: no conversion pass), SwiGLU with
  alpha and clamp (kernel parameters), requantized to E4M3 with one FP32 scale per K128 block of the
  intermediate (amax / 448, the routed path's form) into `act` [C, Is] + `act_scale` [C, Is/128].
- W2 (`role="w2"`): BF16 rows W2s act into a caller-given output with a row stride (elements): the layer
  points it at combine lane k (`combine[k]`, rows = local tokens, stride H), the unfused path at a plain
  [T, H] BF16 tensor.

MMA: `wgmma.mma_async m64nNk32 .e4m3.e4m3` with BOTH operands from shared memory: the weight tile (64 rows,
K-major) is A, the tokens (N = block_n, zero-filled past num_tokens) are B; no FP4 decode. Two pipelines
(PIPELINES): "ws", the default (AUTO_PIPELINE), a producer warp moving the packed weights (`pack_weights`) with
bulk copies and the token rows with cp.async into an mbarrier ring that the 4 consumer warpgroups drain; and
"cp.async", every thread copying 16-byte pieces, a CTA barrier per stage (bn 64, and the first version). Scales are FMAs on the FP32
partials outside the MMA, per K32 block: weight scale (recipe (1,1,32): UE8M0 per row and K32; recipe
(1,128,128): the FP32 power of two of the row's 128x128 block) times the token's scale (W1: UE8M0 per K32 of
x_sf; W2: the FP32 K128 scale W1 wrote).

CTA = 512 threads = 4 warpgroups on ONE 64-row weight tile; warpgroup w takes the K128 blocks kb = 4 i + w
(a pipeline stage holds 4 K128 blocks), the four partials are summed through shared memory at the end, so a
decode-sized GEMM spreads over rows x K splits instead of needing many token tiles. W1's tile rows interleave
gate and up: tile row 16 v + r (r < 8) is gate channel 32 m + 8 v + r, row 16 v + 8 + r its up channel, so
one thread holds both halves of SwiGLU. Grid = (token tiles, k_splits, weight tiles): the token tiles of one
weight tile run side by side (they share its weights through L2).

Cross-CTA fixup (no waits, no co-residency needed): a K128 scale of the intermediate spans 128 channels = 4
W1 weight tiles, and `k_splits` > 1 splits K over CTAs. Each CTA of such a group writes its FP32 partial
tile to `scratch`, `fence.acq_rel.gpu`, and adds 1 to its group's counter (`atom.acq_rel.gpu`); the CTA that
arrives last sums the group's partials in a fixed order (deterministic), runs the epilogue (W1: SwiGLU,
amax over the 128 channels, E4M3 + scale; W2: BF16 rows) and resets the counter to 0 for the next replay.
W2 with k_splits = 1 stores straight from registers.

Host API (no DSL needed; the layer backend calls these):

    kernels = load("sm_90a", recipe)              # {(role, block_n): LoadedKernel} for one shared recipe
    plan = plan_launch(num_tokens, hidden, inter, num_sms)          # block_n, k_splits, token tiles
    ws = SharedExpertWorkspace.allocate(hidden, inter, capacity, device)   # act, act_scale, scratch, counters
    nodes = launch_args(kernels, weights, x, x_sf, out, out_row_stride, num_tokens, ws, plan=plan,
                        alpha=1.0, clamp=10.0)    # [(name, kernel, grid, args)] for W1 then W2
    launch(stream, nodes)                          # eager: W1 then W2 on one stream
    w1_node, w2_node = add_to_graph(graph, context, nodes, depends_on=())   # W2 depends on W1

`out` may be any BF16 address range with rows num_tokens x hidden at `out_row_stride` elements (combine lane k:
`ws_layer.combine[topk]`, stride H). `counters` must be zero before the first launch (allocate() does it);
launches that share a workspace must be serialized (stream order or graph edges), as for the layer workspace.
"""

from dataclasses import dataclass

THREADS = 512
WARPGROUPS = 4
TILE_ROWS = 64  # weight rows per CTA (one m64 WGMMA tile)
K128 = 128
A_BLOCK_BYTES = TILE_ROWS * K128  # one warpgroup's K128 block of the weight tile, E4M3
CHANNELS_PER_SCALE = 128  # intermediate channels per FP32 K128 scale of W1's output
W1_TILES_PER_GROUP = CHANNELS_PER_SCALE // 32  # W1 weight tiles hold 32 channels (gate + up rows)
BLOCK_N_CHOICES = (8, 16, 32, 64)
RECIPES = {(1, 1, 32): "k32", (1, 128, 128): "block128"}
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # formats.quantize_fp8_k128: scale = max(amax, 1e-4) / 448
# stages in flight per block_n: every stage moves 4 x 8 KB of weights; the count fills ~200 KB of shared memory
STAGES = {8: 5, 16: 5, 32: 4, 64: 3}
SMEM_LIMIT = 227 * 1024
# The two pipelines. "cp.async": every thread copies 16-byte pieces of the stage, a CTA barrier per stage (the
# first version; bn 64 and the fused role4 kernel keep it). "ws" (warp-specialized): one producer warp fills a
# ring of stages, each completing on its "full" mbarrier: the weight tile's K128 blocks and their scale words as
# ONE bulk copy each from the packed weights (`pack_weights`: tile-contiguous, already in the WGMMA operand's
# core-matrix order), the token rows as 16-byte cp.async; the 4 consumer warpgroups wait on "full", compute and
# release the stage on its "empty" mbarrier: no CTA barrier per stage, nothing for the consumers to issue.
PIPELINES = ("cp.async", "ws")
WS_BLOCK_N = (8, 16, 32)  # bn 64 needs 128 registers per thread: 544 threads do not fit the register file
# two warp-specialized CTAs per SM where 3 stages of the tile fit half an SM's shared memory (bn 8: 3 x 38 KB)
# and the registers fit 1088 threads (42-52 per thread): twice the K splits, so a CTA's neighbour streams while it
# waits, and the fused kernel's W2 CTAs can start beside W1 CTAs
TWO_CTA_BLOCK_N = (8,)
TWO_CTA_STAGES = 3
PRODUCER_THREADS = 32

PARAMS_W1 = (
    ("w", "u64"), ("w_sf", "u64"), ("x", "u64"), ("x_sf", "u64"), ("act", "u64"), ("act_scale", "u64"),
    ("scratch", "u64"), ("counters", "u64"),
    ("num_tokens", "s32"), ("k_blocks", "s32"), ("inter", "s32"), ("k_splits", "s32"),
    ("alpha", "f32"), ("clamp", "f32"),
)
PARAMS_W2 = (
    ("w", "u64"), ("w_sf", "u64"), ("act", "u64"), ("act_scale", "u64"), ("out", "u64"),
    ("scratch", "u64"), ("counters", "u64"),
    ("num_tokens", "s32"), ("k_blocks", "s32"), ("out_row_stride", "s32"), ("k_splits", "s32"),
)


@dataclass(frozen=True)
class SharedConfig:
    role: str  # "w1" or "w2"
    block_n: int = 8
    recipe: str = "k32"  # "k32" = (1,1,32), "block128" = (1,128,128)
    pipeline: str = "cp.async"  # or "ws" (PIPELINES)
    ctas_per_sm: int = 1  # 2: the warp-specialized pipeline at TWO_CTA_BLOCK_N, TWO_CTA_STAGES stages

    def __post_init__(self):
        if self.role not in ("w1", "w2"):
            raise ValueError(f"role must be 'w1' or 'w2', got {self.role!r}")
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {self.block_n}")
        if self.recipe not in RECIPES.values():
            raise ValueError(f"recipe must be one of {sorted(RECIPES.values())}, got {self.recipe!r}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.pipeline == "ws" and self.block_n not in WS_BLOCK_N:
            raise ValueError(f"the warp-specialized pipeline runs block_n {WS_BLOCK_N}, got {self.block_n}")
        if self.ctas_per_sm not in (1, 2) or (self.ctas_per_sm == 2 and (
                self.pipeline != "ws" or self.block_n not in TWO_CTA_BLOCK_N)):
            raise ValueError(f"ctas_per_sm {self.ctas_per_sm}; allowed: 1, or 2 on the warp-specialized pipeline "
                             f"at block_n {TWO_CTA_BLOCK_N}")

    @property
    def ws(self) -> bool:
        return self.pipeline == "ws"

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory one CTA may take so that ctas_per_sm of them fit an SM (228 KB, less the
        driver's and the DSL's static 1 KB per CTA)."""
        return SMEM_LIMIT if self.ctas_per_sm == 1 else 228 * 1024 // 2 - 2 * 1024

    @property
    def launch_bounds(self) -> dict:
        """The launch's `.minnctapersm` and shared-memory carveout where two CTAs must share an SM."""
        return {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100} if self.ctas_per_sm == 2 else {}

    @property
    def threads(self) -> int:
        """The CTA: 4 consumer warpgroups, and the producer warp with the warp-specialized pipeline."""
        return THREADS + (PRODUCER_THREADS if self.ws else 0)

    @property
    def stages(self) -> int:
        return TWO_CTA_STAGES if self.ctas_per_sm == 2 else STAGES[self.block_n]

    # one stage: [A 4 x 8 KB][B 4 x block_n x 128][weight scale words 4 x 64][token scale words 4 x block_n]
    @property
    def b_offset(self) -> int:
        return WARPGROUPS * A_BLOCK_BYTES

    @property
    def ws_offset(self) -> int:
        return self.b_offset + WARPGROUPS * self.block_n * K128

    @property
    def xs_offset(self) -> int:
        return self.ws_offset + WARPGROUPS * TILE_ROWS * 4

    @property
    def stage_bytes(self) -> int:
        return -(-(self.xs_offset + WARPGROUPS * self.block_n * 4) // 128) * 128

    @property
    def flag_offset(self) -> int:
        """A word past the pipeline: the fixup's "this CTA arrived last" flag."""
        return self.stages * self.stage_bytes

    @property
    def barrier_offset(self) -> int:
        """The warp-specialized ring's mbarriers (full, then empty, 8 bytes each), past the flag words."""
        return self.flag_offset + 128

    @property
    def smem_bytes(self) -> int:
        return self.barrier_offset + (-(-2 * self.stages * 8 // 128) * 128 if self.ws else 0)

    # epilogue, after the pipeline drained: the 3 partials of warpgroups 1..3, then the amax table
    @property
    def reduce_bytes(self) -> int:
        return (WARPGROUPS - 1) * TILE_ROWS * self.block_n * 4

    @property
    def amax_offset(self) -> int:
        return self.reduce_bytes

    @property
    def wgmmas_per_wait(self) -> int:
        """K32 WGMMAs in flight into fresh accumulators before one wait (bounded by registers)."""
        return {8: 4, 16: 4, 32: 2, 64: 1}[self.block_n]

    @property
    def params(self):
        return PARAMS_W1 if self.role == "w1" else PARAMS_W2

    @property
    def name(self) -> str:
        return (f"sm90_shared_expert_{self.role}_n{self.block_n}_{self.recipe}" + ("_ws" if self.ws else "")
                + ("2" if self.ctas_per_sm == 2 else ""))


def recipe_name(recipe) -> str:
    recipe = tuple(recipe)
    if recipe not in RECIPES:
        raise ValueError(f"shared-expert recipe {recipe} is not supported; allowed: {sorted(RECIPES)}")
    return RECIPES[recipe]


# ---------------------------------------------------------------------------------------------- host arithmetic
def w1_tile_row_to_weight_row(tile: int, row: int, inter: int) -> int:
    """W1 weight row held by row `row` (0..63) of weight tile `tile`: gate/up interleaved per 8 rows."""
    v, hi, r = row // 16, (row // 8) % 2, row % 8
    return 32 * tile + 8 * v + r + hi * inter


def super_steps(k_blocks: int) -> int:
    """Pipeline steps over K: each covers 4 K128 blocks (one per warpgroup)."""
    return -(-k_blocks // WARPGROUPS)


def split_range(k_blocks: int, k_splits: int, split: int) -> range:
    """The pipeline steps split `split` of `k_splits` runs (possibly none)."""
    steps = super_steps(k_blocks)
    per = -(-steps // k_splits)
    return range(min(steps, split * per), min(steps, (split + 1) * per))


@dataclass(frozen=True)
class LaunchPlan:
    block_n: int
    token_tiles: int
    k_splits_w1: int
    k_splits_w2: int
    pipeline: str = "cp.async"
    ctas_per_sm: int = 1


# "auto": the warp-specialized pipeline at every token count (32-token tiles above 32 tokens): on the H200 it was
# 33-40% faster than the cp.async pipeline at 1-32 tokens and 25-40% faster than its 64-token tiles at 64-256
# (docs/sm90-layer.md)
AUTO_PIPELINE = "ws"
AUTO_CTAS_PER_SM = 1  # "auto" CTAs per SM at TWO_CTA_BLOCK_N on the warp-specialized pipeline


def plan_launch(num_tokens: int, hidden: int, inter: int, num_sms: int = 132, max_tokens: int | None = None,
                pipeline: str = "auto", ctas_per_sm: int | str = "auto"):
    """The pipeline ("auto": AUTO_PIPELINE, or one of PIPELINES), block_n = the smallest of its choices >= the
    tokens (the largest beyond: 32 on "ws", 64 on "cp.async"), token tiles for `max_tokens` (default: num_tokens),
    CTAs per SM ("auto": AUTO_CTAS_PER_SM where the tile builds that way, else 1), and per GEMM the most K splits
    that keep every CTA in one wave of ctas_per_sm CTAs on each of `num_sms` SMs."""
    if num_tokens < 0 or hidden % 128 or inter % 128 or hidden < 128 or inter < 128:
        raise ValueError(f"tokens {num_tokens} >= 0, hidden {hidden} and inter {inter} multiples of 128 needed")
    tokens = max(1, max_tokens if max_tokens is not None else num_tokens)
    if tokens < num_tokens:
        raise ValueError(f"max_tokens {max_tokens} < num_tokens {num_tokens}")
    if pipeline == "auto":
        pipeline = AUTO_PIPELINE
    choices = WS_BLOCK_N if pipeline == "ws" else BLOCK_N_CHOICES
    block_n = next((b for b in choices if b >= tokens), choices[-1])
    token_tiles = -(-tokens // block_n)

    if ctas_per_sm == "auto":
        ctas_per_sm = AUTO_CTAS_PER_SM if pipeline == "ws" and block_n in TWO_CTA_BLOCK_N else 1
    slots = num_sms * ctas_per_sm

    def splits(rows, k):
        ctas = rows // TILE_ROWS * token_tiles
        return max(1, min(slots // ctas, super_steps(k // 128))) if ctas <= slots else 1

    SharedConfig("w1", block_n, pipeline=pipeline, ctas_per_sm=ctas_per_sm)  # the error names what is allowed
    return LaunchPlan(block_n, token_tiles, splits(2 * inter, hidden), splits(hidden, inter), pipeline, ctas_per_sm)


# ---------------------------------------------------------------------------------------------- packed weights
@dataclass(frozen=True)
class PackedSharedWeights:
    """The shared expert's weights as the warp-specialized pipeline reads them: per 64-row weight tile (W1's rows
    in the gate/up interleave of `w1_tile_row_to_weight_row`) and K128 block, 8 KB of E4M3 in the WGMMA
    operand's core-matrix order (8 rows x 16 bytes per 128-byte core matrix, K-adjacent cores 128 bytes apart,
    8-row groups 1 KB apart) and the 64 rows' scale words (the k32 recipe's packed UE8M0 int32, the block128
    recipe's FP32 bits of the row's 128 x 128 block); [tiles, K/128, 8192] uint8 and [tiles, K/128, 64] int32."""
    w1: object
    w1_sf: object
    w2: object
    w2_sf: object
    source: tuple  # (data_ptr of w1, w1_sf, w2, w2_sf): the weights these were packed from


def _pack_gemm(w, w_sf, row_of, block128: bool):
    import torch

    rows, k = w.shape
    tiles, kb = rows // TILE_ROWS, k // K128
    order = torch.tensor([row_of(m, r) for m in range(tiles) for r in range(TILE_ROWS)], device=w.device)
    codes = w.view(torch.uint8)[order].view(tiles, 8, 8, kb, 8, 16)  # [tile, row group, row, kb, chunk, 16]
    codes = codes.permute(0, 3, 1, 4, 2, 5).contiguous().view(tiles, kb, A_BLOCK_BYTES)
    sf = w_sf[order // 128] if block128 else w_sf[order]  # [rows in tile order, kb]
    sf = sf.contiguous().view(torch.int32).view(tiles, TILE_ROWS, kb).transpose(1, 2).contiguous()
    return codes, sf


def pack_weights(weights) -> PackedSharedWeights:
    """`weights` (formats.SharedExpertWeights) packed for the warp-specialized pipeline (once per weight set, on
    the weights' device; it only moves bytes)."""
    inter = weights.intermediate
    block128 = recipe_name(weights.recipe) == "block128"
    w1, w1_sf = _pack_gemm(weights.w1, weights.w1_sf, lambda m, r: w1_tile_row_to_weight_row(m, r, inter), block128)
    w2, w2_sf = _pack_gemm(weights.w2, weights.w2_sf, lambda m, r: m * TILE_ROWS + r, block128)
    source = tuple(t.data_ptr() for t in (weights.w1, weights.w1_sf, weights.w2, weights.w2_sf))
    return PackedSharedWeights(w1, w1_sf, w2, w2_sf, source)


def grid(role: str, plan: LaunchPlan, hidden: int, inter: int) -> tuple[int, int, int]:
    rows = 2 * inter if role == "w1" else hidden
    return plan.token_tiles, plan.k_splits_w1 if role == "w1" else plan.k_splits_w2, rows // TILE_ROWS


def scratch_floats(role: str, plan: LaunchPlan, hidden: int, inter: int) -> int:
    """FP32 partial tiles of one launch: one per CTA (TILE_ROWS x block_n), when its group has > 1 CTA."""
    tt, s, tiles = grid(role, plan, hidden, inter)
    if role == "w2" and s == 1:
        return 0
    return tt * s * tiles * TILE_ROWS * plan.block_n


def counter_words(role: str, plan: LaunchPlan, hidden: int, inter: int) -> int:
    tt, _, tiles = grid(role, plan, hidden, inter)
    return tt * (tiles // W1_TILES_PER_GROUP if role == "w1" else tiles)


def fixup_group_size(role: str, plan: LaunchPlan) -> int:
    """CTAs whose partials one fixup sums: W1 4 tiles x k splits (one K128 scale), W2 the k splits."""
    return W1_TILES_PER_GROUP * plan.k_splits_w1 if role == "w1" else plan.k_splits_w2


def workspace_sizes(hidden: int, inter: int, capacity: int, num_sms: int = 132) -> tuple[int, int]:
    """(scratch floats, counter words) enough for every plan of 1..capacity tokens, W1 and W2 together
    (W2's regions follow W1's)."""
    plans = {plan_launch(t, hidden, inter, num_sms, pipeline=p, ctas_per_sm=c) for t in range(1, capacity + 1)
             for p in PIPELINES for c in (1, 2) if c == 1 or (p == "ws" and t <= max(TWO_CTA_BLOCK_N))}
    scratch = max(scratch_floats("w1", p, hidden, inter) + scratch_floats("w2", p, hidden, inter) for p in plans)
    counters = max(counter_words("w1", p, hidden, inter) + counter_words("w2", p, hidden, inter) for p in plans)
    return scratch, counters


class SharedExpertWorkspace:
    """The shared expert's device buffers: the requantized intermediate and the fixup's scratch/counters."""

    def __init__(self, hidden, inter, capacity, act, act_scale, scratch, counters, num_sms, sync=None):
        self.hidden, self.inter, self.capacity, self.num_sms = hidden, inter, capacity, num_sms
        self.act, self.act_scale, self.scratch, self.counters = act, act_scale, scratch, counters
        self.sync = sync  # the fused kernel's ticket and hand-over words (SYNC_WORDS int32, zero between launches)

    @classmethod
    def allocate(cls, hidden: int, inter: int, capacity: int, device, num_sms: int = 132):
        import torch

        scratch, counters = workspace_sizes(hidden, inter, capacity, num_sms)
        return cls(hidden, inter, capacity,
                   torch.empty(capacity, inter, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(capacity, inter // 128, dtype=torch.float32, device=device),
                   torch.empty(max(1, scratch), dtype=torch.float32, device=device),
                   torch.zeros(max(1, counters), dtype=torch.int32, device=device), num_sms,
                   torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device))


# ---------------------------------------------------------------------------------------------- device helpers
def _device_helpers():
    """This kernel's inline-PTX building blocks (one short PTX sequence each), built when the DSL is present.
    Global addresses travel as Int64, shared addresses as Int32 (the .shared window)."""
    from types import SimpleNamespace

    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    kinds = {Int32: "r", Uint32: "r", Float32: "f", Int64: "l"}

    @dsl_user_op
    def asm(text, outs, ins, *, loc=None, ip=None):
        values = [v.ir_value(loc=loc, ip=ip) for v in ins]
        constraints = ",".join(["=" + kinds[t] for t in outs] + [kinds[type(v)] for v in ins])
        kw = {"has_side_effects": True, "is_align_stack": False, "asm_dialect": llvm.AsmDialect.AD_ATT,
              "loc": loc, "ip": ip}
        if not outs:
            llvm.inline_asm(None, values, text, constraints, **kw)
            return None
        if len(outs) == 1:
            return outs[0](llvm.inline_asm(outs[0].mlir_type, values, text, constraints, **kw))
        struct = llvm.StructType.get_literal([t.mlir_type for t in outs])
        res = llvm.inline_asm(struct, values, text, constraints, **kw)
        return [t(llvm.extractvalue(t.mlir_type, res, [i], loc=loc, ip=ip)) for i, t in enumerate(outs)]

    h = SimpleNamespace(asm=asm)
    # copies: 16 / 4 bytes global -> shared, bytes past src_bytes zero-filled
    h.cp_async_16_zfill = lambda dst, src, n: asm("cp.async.cg.shared.global [$0], [$1], 16, $2;", [], [dst, src, n])
    h.cp_async_4_zfill = lambda dst, src, n: asm("cp.async.ca.shared.global [$0], [$1], 4, $2;", [], [dst, src, n])
    h.cp_async_commit = lambda: asm("cp.async.commit_group;", [], [])
    h.cp_async_wait = lambda pending: asm(f"cp.async.wait_group {pending};", [], [])
    # cp.async lands through the generic proxy, WGMMA reads its operands through the async proxy
    h.fence_proxy_async = lambda: asm("fence.proxy.async.shared::cta;", [], [])
    h.barrier_sync = lambda: asm("bar.sync 0;", [], [])
    # shared / global loads and stores
    h.lds32 = lambda a: asm("ld.shared.b32 $0, [$1];", [Uint32], [a])
    h.lds_s32 = lambda a: asm("ld.shared.b32 $0, [$1];", [Int32], [a])
    h.lds_f32 = lambda a: asm("ld.shared.f32 $0, [$1];", [Float32], [a])
    h.sts_f32 = lambda a, v: asm("st.shared.f32 [$0], $1;", [], [a, v])
    h.sts_s32 = lambda a, v: asm("st.shared.b32 [$0], $1;", [], [a, v])
    h.stg_f32 = lambda a, v: asm("st.global.f32 [$0], $1;", [], [a, v])
    h.stg_f32_cg = lambda a, v: asm("st.global.cg.f32 [$0], $1;", [], [a, v])
    h.stg_e4m3 = lambda a, v: asm(
        "{\n.reg .b16 t;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 t, z, $1;\nst.global.b8 [$0], t;\n}", [], [a, v])
    h.stg_bf16 = lambda a, v: asm("{\n.reg .b16 t;\ncvt.rn.bf16.f32 t, $1;\nst.global.b16 [$0], t;\n}", [], [a, v])
    # other CTAs' partials of this launch: coherent at gpu scope (not the read-only path)
    h.ld_relaxed_f32 = lambda a: asm("ld.relaxed.gpu.global.f32 $0, [$1];", [Float32], [a])
    h.fence_gpu = lambda: asm("fence.acq_rel.gpu;", [], [])
    h.atom_add_acq_rel = lambda a, v: asm("atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", [Int32], [a, v])
    h.st_relaxed_s32 = lambda a, v: asm("st.relaxed.gpu.global.b32 [$0], $1;", [], [a, v])
    # math
    h.bits_f32 = lambda v: asm("mov.b32 $0, $1;", [Float32], [v])
    # byte `byte` of a packed UE8M0 word as 2^(b - 127): the byte becomes the exponent field
    h.ue8m0_f32 = lambda word, byte: h.bits_f32(((word >> (8 * byte)) & Uint32(0xFF)) << 23)
    h.fast_sigmoid = lambda x: asm(  # 1 / (1 + 2^(-x log2 e)) on the approximate ex2 / rcp units
        "{\n.reg .f32 t;\nmul.f32 t, $1, 0fBFB8AA3B;\nex2.approx.ftz.f32 t, t;\n"
        "add.f32 t, t, 0f3F800000;\nrcp.approx.ftz.f32 $0, t;\n}", [Float32], [x])
    h.rcp = lambda a: asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [a])
    h.fmax = lambda a, b: asm("max.f32 $0, $1, $2;", [Float32], [a, b])
    h.fmin = lambda a, b: asm("min.f32 $0, $1, $2;", [Float32], [a, b])
    h.fabs = lambda a: asm("abs.f32 $0, $1;", [Float32], [a])
    h.shfl_xor_f32 = lambda v, m: asm(f"shfl.sync.bfly.b32 $0, $1, {m}, 31, -1;", [Float32], [v])
    # WGMMA: shared-memory descriptor without swizzle (start, K-direction core stride, M/N-direction stride)

    def smem_desc(addr, lbo, sbo):
        lo = ((addr >> 4) & Int32(0x3FFF)) | Int32((lbo >> 4) << 16)
        return Int64(lo) & Int64(0xFFFFFFFF) | Int64((sbo >> 4) << 32)

    h.smem_desc = smem_desc
    h.wgmma_fence = lambda: asm("wgmma.fence.sync.aligned;", [], [])
    # the warp-specialized pipeline's ring: mbarriers (shared addresses), bulk copies completing on them
    h.mbarrier_init = lambda a, count: asm(f"mbarrier.init.shared::cta.b64 [$0], {count};", [], [a])
    h.fence_mbarrier_init = lambda: asm("fence.mbarrier_init.release.cluster;", [], [])
    h.mbarrier_arrive = lambda a: asm("mbarrier.arrive.shared::cta.b64 _, [$0];", [], [a])
    h.arrive_expect_tx = lambda a, n: asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", [], [a, n])
    h.bulk_g2s = lambda dst, src, n, bar: asm(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];", [],
        [dst, src, n, bar])
    h.cp_async_arrive_noinc = lambda a: asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", [], [a])
    h.cp_async_wait_all = lambda: asm("cp.async.wait_all;", [], [])
    h.warp_sync = lambda: asm("bar.warp.sync -1;", [], [])
    h.consumer_sync = lambda: asm(f"bar.sync 1, {THREADS};", [], [])  # the 4 consumer warpgroups only
    # wait for the phase of parity `parity`; trap after 2^26 polls (each try_wait suspends for a while) instead of
    # hanging when a copy never lands
    h.mbarrier_wait = lambda a, parity: asm(
        "{\n.reg .pred done, more;\n.reg .b32 tries;\nmov.b32 tries, 0;\n"
        "WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n@done bra.uni DONE;\n"
        "add.s32 tries, tries, 1;\nsetp.lt.s32 more, tries, 67108864;\n@more bra.uni WAIT;\ntrap;\n"
        "DONE:\n}", [], [a, parity])
    return h


# ---------------------------------------------------------------------------------------------- kernel
def _make_kernel(cfg: SharedConfig, body_only: bool = False):
    import cutlass  # the CuTe DSL is needed to build only; launching needs the cubin and the driver
    from cutlass import Float32, Int32, Int64, cute

    ptx = _device_helpers()

    BN = cfg.block_n
    STG = cfg.stages
    NSUB = BN // 8
    NP = cfg.wgmmas_per_wait
    HALF = BN // 2  # accumulator floats per thread (m64nBN fragment)
    W1 = cfg.role == "w1"
    BLOCK128 = cfg.recipe == "block128"

    def wgmma_ss_batch(a_descs, b_descs):
        """len(a_descs) shared-A/shared-B m64nBNk32 E4M3 WGMMAs into fresh accumulators, commit, wait."""
        count = len(a_descs)
        lines = ["{", ".reg .pred fresh;", f"setp.ne.b32 fresh, ${count * HALF + 2 * count}, 0;"]
        for i in range(count):
            d = ", ".join(f"${i * HALF + r}" for r in range(HALF))
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{BN}k32.f32.e4m3.e4m3 {{{d}}}, "
                         f"${count * HALF + i}, ${count * HALF + count + i}, fresh, 1, 1;")
        lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
        return ptx.asm("\n".join(lines), [Float32] * (HALF * count), list(a_descs) + list(b_descs) + [Int32(0)])

    if W1:
        def weight_row(tile, r, inter):  # gate/up interleaved per 8 rows (w1_tile_row_to_weight_row)
            return 32 * tile + 8 * (r // 16) + r % 8 + ((r // 8) % 2) * inter
    else:
        def weight_row(tile, r, inter):
            return tile * TILE_ROWS + r

    @cute.jit
    def issue_stage(smem, stage, step, tid, tile, row0, count, k_blocks, inter, a):
        w, w_sf, x, x_sf = a
        sbase = smem + stage * cfg.stage_bytes
        # weights: thread (row r, 16-byte chunk c) of every warpgroup's K128 block; 8 rows x 16 B per core matrix
        r = (tid // 64) * 8 + tid % 8
        c = (tid // 8) % 8
        grow = weight_row(tile, r, inter)
        for i in cutlass.range_constexpr(WARPGROUPS):
            kb = step * WARPGROUPS + i
            if kb < k_blocks:
                src = w + Int64(grow) * Int64(k_blocks * 128) + Int64(kb * 128 + c * 16)
                ptx.cp_async_16_zfill(sbase + i * A_BLOCK_BYTES + ((r // 8) * 8 + c) * 128 + (r % 8) * 16, src,
                                      Int32(16))
        # tokens: BN rows x 8 chunks per warpgroup block, rows past the valid tokens zero-filled
        for m in cutlass.range_constexpr(-(-(WARPGROUPS * BN * 8) // THREADS)):
            b = tid + m * THREADS
            if b < WARPGROUPS * BN * 8:
                i = b // (BN * 8)
                n = ((b // 64) % NSUB) * 8 + b % 8
                cc = (b // 8) % 8
                kb = step * WARPGROUPS + i
                if kb < k_blocks:
                    nrow = Int64(row0) + Int64(n)
                    nbytes = Int32(16)
                    if n >= count:
                        nrow = Int64(row0)
                        nbytes = Int32(0)
                    ptx.cp_async_16_zfill(
                        sbase + cfg.b_offset + i * BN * 128 + ((n // 8) * 8 + cc) * 128 + (n % 8) * 16,
                        x + nrow * Int64(k_blocks * 128) + Int64(kb * 128 + cc * 16), nbytes)
        # scale words: 64 weight rows and BN tokens per warpgroup block
        if tid < WARPGROUPS * TILE_ROWS:
            i = tid // TILE_ROWS
            kb = step * WARPGROUPS + i
            if kb < k_blocks:
                srow = weight_row(tile, tid % TILE_ROWS, inter)
                if cutlass.const_expr(BLOCK128):
                    srow = srow // 128
                ptx.cp_async_4_zfill(sbase + cfg.ws_offset + tid * 4,
                                     w_sf + (Int64(srow) * Int64(k_blocks) + Int64(kb)) * 4, Int32(4))
        if tid < WARPGROUPS * BN:
            i = tid // BN
            n = tid % BN
            kb = step * WARPGROUPS + i
            if kb < k_blocks:
                nrow = Int64(row0) + Int64(n)
                nbytes = Int32(4)
                if n >= count:
                    nrow = Int64(row0)
                    nbytes = Int32(0)
                ptx.cp_async_4_zfill(sbase + cfg.xs_offset + tid * 4,
                                     x_sf + (nrow * Int64(k_blocks) + Int64(kb)) * 4, nbytes)

    @cute.jit
    def compute_stage(smem, stage, wg, warp, g, q, acc):
        sbase = smem + stage * cfg.stage_bytes
        wrow = sbase + cfg.ws_offset + (wg * TILE_ROWS + 16 * warp + g) * 4
        sw_lo = ptx.lds32(wrow)
        sw_hi = ptx.lds32(wrow + 32)
        xrow = sbase + cfg.xs_offset + (wg * BN + 2 * q) * 4  # token 8 i + 2 q (+1): read per use, few registers
        for grp in cutlass.range_constexpr(4 // NP):
            a_descs = []
            b_descs = []
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj
                a_descs.append(ptx.smem_desc(sbase + wg * A_BLOCK_BYTES + j * 256, 128, 1024))
                b_descs.append(ptx.smem_desc(sbase + cfg.b_offset + wg * BN * 128 + j * 256, 128, 1024))
            ptx.wgmma_fence()
            part = wgmma_ss_batch(a_descs, b_descs)
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj
                if cutlass.const_expr(BLOCK128):
                    s_lo = ptx.bits_f32(sw_lo)
                    s_hi = ptx.bits_f32(sw_hi)
                else:
                    s_lo = ptx.ue8m0_f32(sw_lo, j)
                    s_hi = ptx.ue8m0_f32(sw_hi, j)
                for i in cutlass.range_constexpr(NSUB):
                    if cutlass.const_expr(W1):  # UE8M0 per K32 of the public buffer's x_sf
                        x0 = ptx.ue8m0_f32(ptx.lds32(xrow + 32 * i), j)
                        x1 = ptx.ue8m0_f32(ptx.lds32(xrow + 32 * i + 4), j)
                    else:  # FP32 per K128, W1's requantized intermediate
                        x0 = ptx.lds_f32(xrow + 32 * i)
                        x1 = ptx.lds_f32(xrow + 32 * i + 4)
                    p = part[jj * HALF + 4 * i: jj * HALF + 4 * i + 4]
                    acc[4 * i + 0] = acc[4 * i + 0] + p[0] * (s_lo * x0)
                    acc[4 * i + 1] = acc[4 * i + 1] + p[1] * (s_lo * x1)
                    acc[4 * i + 2] = acc[4 * i + 2] + p[2] * (s_hi * x0)
                    acc[4 * i + 3] = acc[4 * i + 3] + p[3] * (s_hi * x1)

    @cute.jit
    def split_steps(split, k_blocks, k_splits):
        """(first pipeline step, steps) of this CTA's K split."""
        steps = (k_blocks + WARPGROUPS - 1) // WARPGROUPS
        per = (steps + k_splits - 1) // k_splits
        first = split * per
        last = first + per
        if last > steps:  # noqa: PLR1730 (a DSL value: Python min() cannot trace it)
            last = steps
        n_steps = last - first
        if n_steps < 0:
            n_steps = Int32(0)
        return first, n_steps

    @cute.jit
    def sum_warpgroups(smem, wg, t, acc, sync):
        """Warpgroups 1-3 hand their partial tile to warpgroup 0 through shared memory (the ring's, drained:
        `sync` is the barrier of the threads that computed), which adds them in a fixed order."""
        if wg > 0:
            for i in cutlass.range_constexpr(HALF):
                ptx.sts_f32(smem + (((wg - 1) * HALF + i) * 128 + t) * 4, acc[i])
        sync()
        if wg == 0:
            for w in cutlass.range_constexpr(WARPGROUPS - 1):
                for i in cutlass.range_constexpr(HALF):
                    acc[i] = acc[i] + ptx.lds_f32(smem + ((w * HALF + i) * 128 + t) * 4)

    @cute.jit
    def tile_product_cp(a, tile, split, row0, count, k_blocks, inter, k_splits, smem, acc):
        """This CTA's K range of the 64 x BN tile (the cp.async pipeline), summed over the 4 warpgroups into
        warpgroup 0's `acc`."""
        tid = cute.arch.thread_idx()[0]
        wg = tid // 128
        t = tid % 128
        warp = t // 32
        lane = tid % 32
        g = lane // 4
        q = lane % 4
        for i in cutlass.range_constexpr(HALF):
            acc[i] = Float32(0.0)
        first, n_steps = split_steps(split, k_blocks, k_splits)
        for s in cutlass.range_constexpr(STG - 1):
            if s < n_steps:
                issue_stage(smem, s, first + s, tid, tile, row0, count, k_blocks, inter, a)
            ptx.cp_async_commit()
        for it in cutlass.range(n_steps):
            ptx.cp_async_wait(STG - 2)
            ptx.fence_proxy_async()  # this thread's landed copies, visible to the WGMMAs after the barrier
            ptx.barrier_sync()
            nk = it + STG - 1
            if nk < n_steps:
                issue_stage(smem, nk % STG, first + nk, tid, tile, row0, count, k_blocks, inter, a)
            ptx.cp_async_commit()
            if (first + it) * WARPGROUPS + wg < k_blocks:  # warpgroup-uniform: WGMMA is warpgroup-collective
                compute_stage(smem, it % STG, wg, warp, g, q, acc)
        ptx.cp_async_wait(0)
        ptx.barrier_sync()  # the pipeline is drained: its shared memory is reused below
        sum_warpgroups(smem, wg, t, acc, ptx.barrier_sync)
        return tid, wg, t, warp, g, q

    @cute.jit
    def stage_weights(it, first, k_blocks, smem, bar, w_src, s_src, lane):
        """Lane 0: announce stage it's bulk bytes on its full barrier and copy the tile's K128 blocks and their
        scale words into it (one bulk copy each)."""
        if lane == 0:
            stage = it % STG
            full = bar + stage * 8
            sbase = smem + stage * cfg.stage_bytes
            blocks = k_blocks - (first + it) * WARPGROUPS
            if blocks > WARPGROUPS:
                blocks = Int32(WARPGROUPS)
            ptx.arrive_expect_tx(full, blocks * (A_BLOCK_BYTES + TILE_ROWS * 4))
            ptx.bulk_g2s(sbase, w_src + Int64(it) * (WARPGROUPS * A_BLOCK_BYTES), blocks * A_BLOCK_BYTES, full)
            ptx.bulk_g2s(sbase + cfg.ws_offset, s_src + Int64(it) * (WARPGROUPS * TILE_ROWS * 4),
                         blocks * (TILE_ROWS * 4), full)

    @cute.jit
    def gate_wait(gate, lane):
        """The fused role4 kernel's W2 gate, in the producer warp: lane 0 acquires SYNC_W1_DONE = every W1 CTA
        (bounded, then trap), counts this CTA past it and, the last W2 CTA past, resets the words; the warp's
        token copies (W1's output) follow the warp barrier."""
        from gc_moe.kernels.sm90 import dispatch as ring_protocol
        from gc_moe.kernels.sm90 import ptx as sm90_ptx

        sync, w1_ctas, w2_ctas, timeout_ns = gate
        if lane == 0:
            ring_protocol.wait_at_least(sync + SYNC_W1_DONE * 4, w1_ctas, cute.arch.globaltimer(), timeout_ns, False)
            passed = sm90_ptx.atom_add_relaxed_gpu_s32(sync + SYNC_W2_PASSED * 4, Int32(1))
            if passed == w2_ctas - 1:  # every W2 CTA is past its wait: the words are free for the next launch
                sm90_ptx.st_relaxed_gpu_s32(sync + SYNC_W1_DONE * 4, Int32(0))
                sm90_ptx.st_relaxed_gpu_s32(sync + SYNC_W2_PASSED * 4, Int32(0))
        ptx.warp_sync()

    @cute.jit
    def produce(a, tile, first, n_steps, row0, count, k_blocks, smem, lane, gate=None):
        """The producer warp: per stage wait for it to be empty; lane 0 announces the stage's bulk bytes and
        copies the tile's K128 blocks and their scale words (one bulk copy each, from the packed weights); every
        lane copies its 16-byte pieces of the token rows and its token-scale words (cp.async, rows past the
        valid tokens zero-filled), then arrives on the stage's full barrier once they landed. gate: (sync words,
        W1 CTAs, W2 CTAs, timeout) of the fused kernel's W2 half: the first stages' weights go out, then the
        gate's wait, then the token rows."""
        wp, wsp, tok, tok_sf = a
        bar = smem + cfg.barrier_offset
        block0 = Int64(tile) * Int64(k_blocks) + Int64(first * WARPGROUPS)
        w_src = wp + block0 * A_BLOCK_BYTES
        s_src = wsp + block0 * (TILE_ROWS * 4)
        row_bytes = Int64(k_blocks * 128)
        n_lo = lane % 8
        c_lo = lane // 8
        d_lane = c_lo * 128 + n_lo * 16
        # piece r of the lane (r < BN): b = lane + 32 r of the stage's 4 x BN x 8 pieces -> K128 block
        # i = 32 r // (8 BN), token n = 8 ((r // 2) mod NSUB) + lane % 8, 16-byte chunk 4 (r % 2) + lane // 8
        rows_src = []
        rows_bytes = []
        for ns in cutlass.range_constexpr(NSUB):
            nrow = Int64(row0) + Int64(ns * 8 + n_lo)
            nbytes = Int32(16)
            if ns * 8 + n_lo >= count:
                nrow = Int64(row0)
                nbytes = Int32(0)
            rows_src.append(tok + nrow * row_bytes + Int64(first * WARPGROUPS * 128 + c_lo * 16))
            rows_bytes.append(nbytes)
        # scale word r2 of the lane: b = lane + 32 r2 of the stage's 4 x BN words -> block b // BN, token b % BN
        xs_src = []
        xs_bytes = []
        xs_block = []
        for r2 in cutlass.range_constexpr(NSUB):
            b = lane + 32 * r2
            nrow = Int64(row0) + Int64(b % BN)
            nbytes = Int32(4)
            if b % BN >= count:
                nrow = Int64(row0)
                nbytes = Int32(0)
            xs_src.append(tok_sf + (nrow * Int64(k_blocks) + Int64(first * WARPGROUPS + b // BN)) * 4)
            xs_bytes.append(nbytes)
            xs_block.append(b // BN)
        if cutlass.const_expr(gate is not None):
            # the weights of the first stages do not depend on the gate: they stream while it waits
            for it0 in cutlass.range_constexpr(STG):
                if it0 < n_steps:
                    stage_weights(it0, first, k_blocks, smem, bar, w_src, s_src, lane)
            gate_wait(gate, lane)
        for it in cutlass.range(n_steps):
            stage = it % STG
            full = bar + stage * 8
            sbase = smem + stage * cfg.stage_bytes
            if it >= STG:
                ptx.mbarrier_wait(bar + (STG + stage) * 8, ((it // STG) + 1) % 2)
            blocks = k_blocks - (first + it) * WARPGROUPS
            if blocks > WARPGROUPS:
                blocks = Int32(WARPGROUPS)
            if cutlass.const_expr(gate is None):
                stage_weights(it, first, k_blocks, smem, bar, w_src, s_src, lane)
            else:
                if it >= STG:
                    stage_weights(it, first, k_blocks, smem, bar, w_src, s_src, lane)
            for r in cutlass.range_constexpr(BN):
                i = 32 * r // (8 * BN)
                ns = (r // 2) % NSUB
                if i < blocks:
                    ptx.cp_async_16_zfill(
                        sbase + cfg.b_offset + i * BN * 128 + (ns * 8 + 4 * (r % 2)) * 128 + d_lane,
                        rows_src[ns] + Int64(it * (WARPGROUPS * 128) + i * 128 + (r % 2) * 64), rows_bytes[ns])
            for r2 in cutlass.range_constexpr(NSUB):
                if xs_block[r2] < blocks:
                    ptx.cp_async_4_zfill(sbase + cfg.xs_offset + (lane + 32 * r2) * 4,
                                         xs_src[r2] + Int64(it * WARPGROUPS * 4), xs_bytes[r2])
            ptx.cp_async_arrive_noinc(full)
        ptx.cp_async_wait_all()  # the warp leaves only once its last copies have landed

    @cute.jit
    def consume(first, n_steps, k_blocks, smem, wg, warp, g, q, lane, acc):
        """A consumer warpgroup: per stage wait for it to be full, compute its K128 block of the stage, release
        the stage (one arrival per warp)."""
        bar = smem + cfg.barrier_offset
        for it in cutlass.range(n_steps):
            stage = it % STG
            ptx.mbarrier_wait(bar + stage * 8, (it // STG) % 2)
            ptx.fence_proxy_async()  # the token rows came through cp.async (generic proxy)
            if (first + it) * WARPGROUPS + wg < k_blocks:  # warpgroup-uniform: WGMMA is warpgroup-collective
                compute_stage(smem, stage, wg, warp, g, q, acc)
            ptx.warp_sync()
            if lane == 0:
                ptx.mbarrier_arrive(bar + (STG + stage) * 8)

    @cute.jit
    def tile_product_ws(a, tile, split, row0, count, k_blocks, inter, k_splits, smem, acc, gate=None):
        """This CTA's K range of the 64 x BN tile (the warp-specialized pipeline), summed over the 4 consumer
        warpgroups into warpgroup 0's `acc`. The producer warp returns after its copies (tid >= THREADS: the
        caller's epilogue is the consumers' alone)."""
        tid = cute.arch.thread_idx()[0]
        wg = tid // 128
        t = tid % 128
        warp = t // 32
        lane = tid % 32
        g = lane // 4
        q = lane % 4
        for i in cutlass.range_constexpr(HALF):
            acc[i] = Float32(0.0)
        first, n_steps = split_steps(split, k_blocks, k_splits)
        bar = smem + cfg.barrier_offset
        if tid == 0:
            for st in cutlass.range_constexpr(STG):
                ptx.mbarrier_init(bar + st * 8, PRODUCER_THREADS + 1)  # each lane's copies + the byte count
                ptx.mbarrier_init(bar + (STG + st) * 8, THREADS // 32)  # each consumer warp
            ptx.fence_mbarrier_init()
        ptx.barrier_sync()
        if tid >= THREADS:
            produce(a, tile, first, n_steps, row0, count, k_blocks, smem, lane, gate)
        else:
            consume(first, n_steps, k_blocks, smem, wg, warp, g, q, lane, acc)
            ptx.consumer_sync()  # every stage is consumed: the ring's shared memory is reused below
            sum_warpgroups(smem, wg, t, acc, ptx.consumer_sync)
        return tid, wg, t, warp, g, q

    tile_product = tile_product_ws if cfg.ws else tile_product_cp
    # the epilogue's barrier: the consumers only when a producer warp shares the CTA
    epilogue_sync = ptx.consumer_sync if cfg.ws else ptx.barrier_sync

    @cute.jit
    def arrive_last(tid, wg, t, acc, scratch, slot, counter, group):
        """Warpgroup 0 stores this CTA's partial tile in its scratch slot; returns 1 in the CTA that arrives
        last at `counter` (which it resets), else 0. The slot layout is [accumulator index][thread]."""
        if wg == 0:
            for i in cutlass.range_constexpr(HALF):
                ptx.stg_f32_cg(scratch + ((Int64(slot) * HALF + i) * 128 + t) * 4, acc[i])
            ptx.fence_gpu()
        epilogue_sync()
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        if tid == 0:
            old = ptx.atom_add_acq_rel(counter, Int32(1))
            last = Int32(0)
            if old == group - 1:
                last = Int32(1)
                ptx.st_relaxed_s32(counter, Int32(0))  # every CTA of the group arrived: ready for the next launch
            ptx.sts_s32(smem + cfg.flag_offset, last)
        epilogue_sync()
        is_last = ptx.lds_s32(smem + cfg.flag_offset)
        if is_last == 1:
            ptx.fence_gpu()
        return is_last

    @cute.jit
    def sum_slots(acc, scratch, first_slot, slot_stride, k_splits, t):
        for i in cutlass.range_constexpr(HALF):
            acc[i] = Float32(0.0)
        for s in cutlass.range(k_splits):
            slot = first_slot + s * slot_stride
            for i in cutlass.range_constexpr(HALF):
                acc[i] = acc[i] + ptx.ld_relaxed_f32(scratch + ((Int64(slot) * HALF + i) * 128 + t) * 4)

    if W1:
        @cute.jit
        def w1_finish(act, act_scale, scratch, counters, inter, k_splits, alpha, clamp, tt, split, tile, token_tiles,
                      count, row0, smem, acc, tid, wg, t, warp, g, q):
            """The consumers' part after the tile product: the fixup group's arrival, then (its last CTA) SwiGLU,
            the amax over the 128 channels of the group and the E4M3 rows with their scale."""
            group = tile // W1_TILES_PER_GROUP
            slot = (tile * k_splits + split) * token_tiles + tt
            is_last = arrive_last(tid, wg, t, acc, scratch, slot, counters + Int64(group * token_tiles + tt) * 4,
                                  W1_TILES_PER_GROUP * k_splits)
            if is_last == 1:
                # warpgroup v takes weight tile 4 group + v: 32 channels of this K128 scale group
                my_tile = group * W1_TILES_PER_GROUP + wg
                sum_slots(acc, scratch, my_tile * k_splits * token_tiles + tt, token_tiles, k_splits, t)
                channel = my_tile * 32 + warp * 8 + g
                hv = cute.make_rmem_tensor((BN // 4,), Float32)
                for i in cutlass.range_constexpr(NSUB):
                    for c in cutlass.range_constexpr(2):
                        n = 8 * i + 2 * q + c
                        gate = ptx.fmin(acc[4 * i + c], clamp)
                        up = ptx.fmax(ptx.fmin(acc[4 * i + 2 + c], clamp), -clamp)
                        h = gate * ptx.fast_sigmoid(gate * alpha) * up
                        hv[2 * i + c] = h
                        m = ptx.fabs(h)
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 4))
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 8))
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 16))
                        if g == 0:
                            ptx.sts_f32(smem + cfg.amax_offset + ((wg * 4 + warp) * BN + n) * 4, m)
                epilogue_sync()
                for i in cutlass.range_constexpr(NSUB):
                    for c in cutlass.range_constexpr(2):
                        n = 8 * i + 2 * q + c
                        amax = Float32(0.0)
                        for p in cutlass.range_constexpr(16):
                            amax = ptx.fmax(amax, ptx.lds_f32(smem + cfg.amax_offset + (p * BN + n) * 4))
                        amax = ptx.fmax(amax, Float32(AMAX_FLOOR))
                        inv = Float32(FP8_MAX) * ptx.rcp(amax)
                        if n < count:
                            nrow = Int64(row0) + Int64(n)
                            ptx.stg_e4m3(act + nrow * Int64(inter) + Int64(channel), hv[2 * i + c] * inv)
                            if tid < 4:
                                ptx.stg_f32(act_scale + (nrow * Int64(inter // 128) + Int64(group)) * 4,
                                            amax * Float32(1.0 / FP8_MAX))

        @cute.jit
        def w1_body(w, w_sf, x, x_sf, act, act_scale, scratch, counters, num_tokens, k_blocks, inter, k_splits,
                    alpha, clamp, tt, split, tile, token_tiles):
            count = num_tokens - tt * BN
            if count > 0:
                row0 = tt * BN
                smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
                acc = cute.make_rmem_tensor((HALF,), Float32)
                tid, wg, t, warp, g, q = tile_product((w, w_sf, x, x_sf), tile, split, row0, count, k_blocks,
                                                      inter, k_splits, smem, acc)
                rest = (act, act_scale, scratch, counters, inter, k_splits, alpha, clamp, tt, split, tile,
                        token_tiles, count, row0, smem, acc, tid, wg, t, warp, g, q)
                if cutlass.const_expr(cfg.ws):
                    if tid < THREADS:  # the producer warp is done
                        w1_finish(*rest)
                else:
                    w1_finish(*rest)

        @cute.kernel
        def kernel(w: Int64, w_sf: Int64, x: Int64, x_sf: Int64, act: Int64, act_scale: Int64, scratch: Int64,
                   counters: Int64, num_tokens: Int32, k_blocks: Int32, inter: Int32, k_splits: Int32,
                   alpha: Float32, clamp: Float32):
            tt, split, tile = cute.arch.block_idx()
            token_tiles, _, _ = cute.arch.grid_dim()
            w1_body(w, w_sf, x, x_sf, act, act_scale, scratch, counters, num_tokens, k_blocks, inter, k_splits,
                    alpha, clamp, tt, split, tile, Int32(token_tiles))
        body = w1_body
    else:
        @cute.jit
        def store_rows(acc, out, out_row_stride, tile, row0, count, warp, g, q):
            h_row = tile * TILE_ROWS + warp * 16 + g
            for i in cutlass.range_constexpr(NSUB):
                for c in cutlass.range_constexpr(2):
                    n = 8 * i + 2 * q + c
                    if n < count:
                        base = out + ((Int64(row0) + Int64(n)) * Int64(out_row_stride) + Int64(h_row)) * 2
                        ptx.stg_bf16(base, acc[4 * i + c])
                        ptx.stg_bf16(base + Int64(16), acc[4 * i + 2 + c])

        @cute.jit
        def w2_finish(out, scratch, counters, out_row_stride, k_splits, tt, split, tile, token_tiles, count, row0,
                      acc, tid, wg, t, warp, g, q):
            """The consumers' part after the tile product: BF16 rows straight from registers, or through the
            fixup group's last CTA when K is split."""
            if k_splits == 1:
                if wg == 0:
                    store_rows(acc, out, out_row_stride, tile, row0, count, warp, g, q)
            else:
                slot = (tile * k_splits + split) * token_tiles + tt
                is_last = arrive_last(tid, wg, t, acc, scratch, slot,
                                      counters + Int64(tile * token_tiles + tt) * 4, k_splits)
                if is_last == 1:  # noqa: SIM102 (device branches: the DSL traces no `and` of DSL values)
                    if wg == 0:
                        sum_slots(acc, scratch, tile * k_splits * token_tiles + tt, token_tiles, k_splits, t)
                        store_rows(acc, out, out_row_stride, tile, row0, count, warp, g, q)

        @cute.jit
        def w2_body(w, w_sf, act, act_scale, out, scratch, counters, num_tokens, k_blocks, out_row_stride, k_splits,
                    tt, split, tile, token_tiles, gate=None):
            count = num_tokens - tt * BN
            if count > 0:
                row0 = tt * BN
                smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
                acc = cute.make_rmem_tensor((HALF,), Float32)
                if cutlass.const_expr(gate is None):
                    tid, wg, t, warp, g, q = tile_product((w, w_sf, act, act_scale), tile, split, row0, count,
                                                          k_blocks, Int32(0), k_splits, smem, acc)
                else:  # the fused kernel's W2 half: the producer waits for W1 after the first stages' weights
                    tid, wg, t, warp, g, q = tile_product((w, w_sf, act, act_scale), tile, split, row0, count,
                                                          k_blocks, Int32(0), k_splits, smem, acc, gate)
                rest = (out, scratch, counters, out_row_stride, k_splits, tt, split, tile, token_tiles, count, row0,
                        acc, tid, wg, t, warp, g, q)
                if cutlass.const_expr(cfg.ws):
                    if tid < THREADS:  # the producer warp is done
                        w2_finish(*rest)
                else:
                    w2_finish(*rest)

        @cute.kernel
        def kernel(w: Int64, w_sf: Int64, act: Int64, act_scale: Int64, out: Int64, scratch: Int64,
                   counters: Int64, num_tokens: Int32, k_blocks: Int32, out_row_stride: Int32, k_splits: Int32):
            tt, split, tile = cute.arch.block_idx()
            token_tiles, _, _ = cute.arch.grid_dim()
            w2_body(w, w_sf, act, act_scale, out, scratch, counters, num_tokens, k_blocks, out_row_stride, k_splits,
                    tt, split, tile, Int32(token_tiles))
        body = w2_body

    if body_only:  # a half of the fused role4 kernel (`_make_fused_kernel`)
        return body
    return kernel


# ---------------------------------------------------------------------------------------------- build
def _host_launcher(cfg: SharedConfig, kernel):
    from cutlass import Float32, Int32, Int64, cute

    launch = {"grid": (1, 1, 1), "block": (cfg.threads, 1, 1), "smem": cfg.smem_bytes, **cfg.launch_bounds}
    if cfg.role == "w1":
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 num_tokens: Int32, k_blocks: Int32, inter: Int32, k_splits: Int32, alpha: Float32, clamp: Float32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, num_tokens, k_blocks, inter, k_splits, alpha, clamp).launch(
                **launch)
    else:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64,
                 num_tokens: Int32, k_blocks: Int32, out_row_stride: Int32, k_splits: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, num_tokens, k_blocks, out_row_stride, k_splits).launch(**launch)
    return host


def build_shared_expert(arch: str = "sm_90a", role: str = "w1", block_n: int = 8, recipe: str = "k32",
                        pipeline: str = "cp.async", ctas_per_sm: int = 1):
    """The runtime's builder: a CompileRequest for one variant (no GPU needed)."""
    from cutlass import Float32, Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 shared-expert kernels are built for sm_90a only, not {arch!r}")
    cfg = SharedConfig(role, block_n, recipe, pipeline, ctas_per_sm)
    if cfg.smem_bytes > cfg.smem_limit:
        raise ValueError(f"{cfg.name}: {cfg.smem_bytes} bytes of shared memory exceed {cfg.smem_limit}")
    host = _host_launcher(cfg, _make_kernel(cfg))
    args = tuple(Int64(0) if kind == "u64" else Float32(1.0) if kind == "f32" else Int32(1) for _, kind in cfg.params)
    return CompileRequest(host, args, LaunchShape(block=(cfg.threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes))


# ---------------------------------------------------------------------------------------------- fused (role4 as one node)
# W1 and W2 in one launch: the layer graph's fourth node. CTAs draw tickets (W1's CTAs first, token tiles
# fastest as the grids), so a W2 CTA waits only for W1 CTAs already drawn by resident CTAs; every W1 CTA adds 1
# to SYNC_W1_DONE with release once its share (and, for a group's last CTA, the requantized rows) is stored;
# W2's CTAs acquire SYNC_W1_DONE = all W1 CTAs before their first copy (act and act_scale are then complete, so
# no cached line of this kernel can be stale), and the last of them to get there resets the words.
FUSED_PARAMS = (
    ("w1", "u64"), ("w1_sf", "u64"), ("w2", "u64"), ("w2_sf", "u64"), ("x", "u64"), ("x_sf", "u64"),
    ("act", "u64"), ("act_scale", "u64"), ("out", "u64"), ("scratch1", "u64"), ("counters1", "u64"),
    ("scratch2", "u64"), ("counters2", "u64"), ("sync", "u64"),
    ("num_tokens", "s32"), ("hidden_blocks", "s32"), ("inter_blocks", "s32"), ("out_row_stride", "s32"),
    ("k_splits_w1", "s32"), ("k_splits_w2", "s32"), ("token_tiles", "s32"), ("alpha", "f32"), ("clamp", "f32"),
    ("timeout_ns", "s64"),
)
SYNC_TICKET, SYNC_W1_DONE, SYNC_W2_PASSED = 0, 1, 2
SYNC_WORDS = 4


def fused_ctas(plan, hidden: int, inter: int) -> tuple[int, int]:
    """(W1 CTAs, W2 CTAs) of the fused launch: the two grids' sizes."""
    a, b, c = grid("w1", plan, hidden, inter)
    d, e, f = grid("w2", plan, hidden, inter)
    return a * b * c, d * e * f


def _make_fused_kernel(block_n: int, recipe: str, pipeline: str = "cp.async", ctas_per_sm: int = 1):
    import cutlass
    from cutlass import Float32, Int32, Int64, cute

    from gc_moe.kernels.sm90 import dispatch as ring_protocol
    from gc_moe.kernels.sm90 import ptx

    # the halves' barriers around the bodies are CTA-wide (bar.sync 0): with the warp-specialized pipeline the
    # producer warp, back from its copies, meets the consumers there
    cfg1 = SharedConfig("w1", block_n, recipe, pipeline, ctas_per_sm)
    cfg2 = SharedConfig("w2", block_n, recipe, pipeline, ctas_per_sm)
    assert cfg1.smem_bytes == cfg2.smem_bytes and cfg1.flag_offset == cfg2.flag_offset
    w1_body, w2_body = _make_kernel(cfg1, True), _make_kernel(cfg2, True)
    TICKET = cfg1.flag_offset + 4  # past the fixup's flag word

    @cute.jit
    def pass_gate(sync, w1_ctas, w2_ctas, timeout_ns):
        """A W2 CTA's thread: acquire SYNC_W1_DONE = every W1 CTA (bounded, then trap), count this CTA past it
        and, the last W2 CTA past, reset the words for the next launch."""
        ring_protocol.wait_at_least(sync + SYNC_W1_DONE * 4, w1_ctas, cute.arch.globaltimer(), timeout_ns, False)
        passed = ptx.atom_add_relaxed_gpu_s32(sync + SYNC_W2_PASSED * 4, Int32(1))
        if passed == w2_ctas - 1:  # every W2 CTA is past its wait: the words are free for the next launch
            ptx.st_relaxed_gpu_s32(sync + SYNC_W1_DONE * 4, Int32(0))
            ptx.st_relaxed_gpu_s32(sync + SYNC_W2_PASSED * 4, Int32(0))

    @cute.kernel
    def kernel(w1: Int64, w1_sf: Int64, w2: Int64, w2_sf: Int64, x: Int64, x_sf: Int64, act: Int64,
               act_scale: Int64, out: Int64, scratch1: Int64, counters1: Int64, scratch2: Int64, counters2: Int64,
               sync: Int64, num_tokens: Int32, hidden_blocks: Int32, inter_blocks: Int32, out_row_stride: Int32,
               k_splits_w1: Int32, k_splits_w2: Int32, token_tiles: Int32, alpha: Float32, clamp: Float32,
               timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        inter = inter_blocks * 128
        w1_ctas = token_tiles * k_splits_w1 * (2 * inter // TILE_ROWS)
        w2_ctas = token_tiles * k_splits_w2 * (hidden_blocks * 128 // TILE_ROWS)
        if tid == 0:
            drawn = ptx.atom_add_relaxed_gpu_s32(sync + SYNC_TICKET * 4, Int32(1))
            if drawn == w1_ctas + w2_ctas - 1:  # every ticket of this launch is drawn
                ptx.st_relaxed_gpu_s32(sync + SYNC_TICKET * 4, Int32(0))
            ring_protocol.sts(smem + TICKET, drawn)
        ptx.barrier_sync()
        unit = ring_protocol.lds(smem + TICKET)
        if unit < w1_ctas:
            tt = unit % token_tiles
            rest = unit // token_tiles
            w1_body(w1, w1_sf, x, x_sf, act, act_scale, scratch1, counters1, num_tokens, hidden_blocks, inter,
                    k_splits_w1, alpha, clamp, tt, rest % k_splits_w1, rest // k_splits_w1, token_tiles)
            ptx.barrier_sync()  # every store of this CTA precedes thread 0's release
            if tid == 0:
                ring_protocol.fence_gpu()
                ring_protocol.atom_add_release_gpu(sync + SYNC_W1_DONE * 4, Int32(1))
        else:
            u = unit - w1_ctas
            tt = u % token_tiles
            rest = u // token_tiles
            w2_args = (w2, w2_sf, act, act_scale, out, scratch2, counters2, num_tokens, inter_blocks, out_row_stride,
                       k_splits_w2, tt, rest % k_splits_w2, rest // k_splits_w2, token_tiles)
            if cutlass.const_expr(cfg1.ws):
                if num_tokens - tt * block_n > 0:
                    # the producer warp passes the gate after its first stages' weights (they stream meanwhile)
                    w2_body(*w2_args, gate=(sync, w1_ctas, w2_ctas, timeout_ns))
                else:  # a token tile without tokens runs no body, but passes the gate (it resets the words)
                    if tid == 0:
                        pass_gate(sync, w1_ctas, w2_ctas, timeout_ns)
            else:
                if tid == 0:
                    pass_gate(sync, w1_ctas, w2_ctas, timeout_ns)
                ptx.barrier_sync()
                w2_body(*w2_args)

    launch = {"grid": (1, 1, 1), "block": (cfg1.threads, 1, 1), "smem": cfg1.smem_bytes, **cfg1.launch_bounds}

    @cute.jit
    def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64, a8: Int64,
             a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, num_tokens: Int32, hidden_blocks: Int32,
             inter_blocks: Int32, out_row_stride: Int32, k_splits_w1: Int32, k_splits_w2: Int32,
             token_tiles: Int32, alpha: Float32, clamp: Float32, timeout_ns: Int64):
        kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, num_tokens, hidden_blocks,
               inter_blocks, out_row_stride, k_splits_w1, k_splits_w2, token_tiles, alpha, clamp,
               timeout_ns).launch(**launch)

    return host, cfg1


def build_shared_fused(arch: str = "sm_90a", block_n: int = 8, recipe: str = "k32", pipeline: str = "cp.async",
                       ctas_per_sm: int = 1):
    """The runtime's builder of the fused role4 kernel (no GPU needed)."""
    from cutlass import Float32, Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 shared-expert kernels are built for sm_90a only, not {arch!r}")
    host, cfg = _make_fused_kernel(block_n, recipe, pipeline, ctas_per_sm)
    args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Float32(1.0) if kind == "f32"
                 else Int32(1) for _, kind in FUSED_PARAMS)
    return CompileRequest(host, args, LaunchShape(block=(cfg.threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes))


def fused_variant(block_n: int, recipe: str = "k32", pipeline: str = "cp.async", ctas_per_sm: int = 1):
    """The runtime KernelVariant of the fused role4 kernel (W1 and W2 in one launch)."""
    from gc_moe.runtime.jit import KernelVariant

    cfg = SharedConfig("w1", block_n, recipe, pipeline, ctas_per_sm)
    params = {"block_n": block_n, "recipe": recipe, "pipeline": pipeline}
    if ctas_per_sm != 1:  # the one-CTA variants keep their parameters (and cache keys)
        params["ctas_per_sm"] = ctas_per_sm
    return KernelVariant.make(
        "sm90.shared_fused", MODULE, "build_shared_fused", params,
        promises=PROMISES_W1 + ("cvt.rn.bf16.f32", "atom.release.gpu.global.add", "ld.acquire.gpu", "trap")
        + (PROMISES_WS if cfg.ws else ()),
        # bn 64 (128 registers, the cap of 512 threads): one 4-byte value on the stack, stored before W2's K loop
        # and loaded after it (SASS checked), never inside a K loop
        local_bytes_budget=8 if block_n == 64 else 0,
        extra_sources=("gc_moe.kernels.sm90.ptx", "gc_moe.kernels.sm90.dispatch",
                                             "gc_moe.kernels.sm90.layer_layout"))


MODULE = "gc_moe.kernels.sm90.shared_expert"  # by name: also when this file runs as __main__ (the timing)
PROMISES = ("wgmma.mma_async.sync.aligned.m64n", "cp.async.cg.shared.global", "atom.acq_rel.gpu.global.add",
            "fence.acq_rel.gpu", "ld.relaxed.gpu.global.f32")
PROMISES_W1 = PROMISES + ("cvt.rn.satfinite.e4m3x2.f32", "ex2.approx")
PROMISES_W2 = PROMISES + ("cvt.rn.bf16.f32",)


PROMISES_WS = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
               "cp.async.mbarrier.arrive.noinc.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64")


def variant(role: str, block_n: int, recipe: str = "k32", pipeline: str = "cp.async", ctas_per_sm: int = 1):
    """The runtime KernelVariant of one configuration (what the registry builds and `load` loads)."""
    from gc_moe.runtime.jit import KernelVariant

    cfg = SharedConfig(role, block_n, recipe, pipeline, ctas_per_sm)
    promises = PROMISES_W1 if role == "w1" else PROMISES_W2
    params = {"role": role, "block_n": block_n, "recipe": recipe, "pipeline": pipeline}
    if ctas_per_sm != 1:  # the one-CTA variants keep their parameters (and cache keys)
        params["ctas_per_sm"] = ctas_per_sm
    return KernelVariant.make(
        "sm90.shared_expert", MODULE, "build_shared_expert", params,
        promises=promises + (PROMISES_WS if cfg.ws else ()), local_bytes_budget=0)


def all_variants():
    """Both roles of both pipelines (every block_n each builds), and the fused kernel, both shared recipes."""
    return ([variant(role, bn, recipe) for recipe in ("k32", "block128") for role in ("w1", "w2")
             for bn in BLOCK_N_CHOICES]
            + [variant(role, bn, recipe, "ws") for recipe in ("k32", "block128") for role in ("w1", "w2")
               for bn in WS_BLOCK_N]
            + [fused_variant(bn, recipe) for recipe in ("k32", "block128") for bn in BLOCK_N_CHOICES]
            + [fused_variant(bn, recipe, "ws") for recipe in ("k32", "block128") for bn in WS_BLOCK_N]
            + [variant(role, bn, recipe, "ws", 2) for recipe in ("k32", "block128") for role in ("w1", "w2")
               for bn in TWO_CTA_BLOCK_N]
            + [fused_variant(bn, recipe, "ws", 2) for recipe in ("k32", "block128") for bn in TWO_CTA_BLOCK_N])


# ---------------------------------------------------------------------------------------------- launch
def load(arch: str = "sm_90a", recipe=(1, 1, 32), cache_dir=None) -> dict:
    """{(role, block_n): LoadedKernel} of one shared recipe from the cubin cache (build them first): roles "w1",
    "w2" (the cp.async pipeline), "w1_ws", "w2_ws" (warp-specialized), "fused" and "fused_ws"."""
    from gc_moe.runtime import jit

    name = recipe_name(recipe)
    kernels = {(role, bn): jit.load_kernel(variant(role, bn, name), arch, cache_dir)
               for role in ("w1", "w2") for bn in BLOCK_N_CHOICES}
    kernels.update({(f"{role}_ws", bn): jit.load_kernel(variant(role, bn, name, "ws"), arch, cache_dir)
                    for role in ("w1", "w2") for bn in WS_BLOCK_N})
    kernels.update({("fused", bn): jit.load_kernel(fused_variant(bn, name), arch, cache_dir) for bn in BLOCK_N_CHOICES})
    kernels.update({("fused_ws", bn): jit.load_kernel(fused_variant(bn, name, "ws"), arch, cache_dir)
                    for bn in WS_BLOCK_N})
    kernels.update({(f"{role}_ws2", bn): jit.load_kernel(variant(role, bn, name, "ws", 2), arch, cache_dir)
                    for role in ("w1", "w2") for bn in TWO_CTA_BLOCK_N})
    kernels.update({("fused_ws2", bn): jit.load_kernel(fused_variant(bn, name, "ws", 2), arch, cache_dir)
                    for bn in TWO_CTA_BLOCK_N})
    return kernels


def _check_cuda(what, t, dtype, shape=None):
    if not t.is_cuda or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous CUDA {dtype} tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def launch_args(kernels: dict, weights, x, x_sf, out, out_row_stride: int, num_tokens: int, ws,
                plan: LaunchPlan | None = None, alpha: float = 1.0, clamp: float | None = 10.0,
                packed: PackedSharedWeights | None = None) -> list:
    """[(name, kernel, grid, args)] of the W1 and W2 launches (graph nodes or eager launches).

    weights: formats.SharedExpertWeights of the kernels' recipe; x float8_e4m3fn [C, H], x_sf int32 [C, H/128]
    (rows >= num_tokens, read in place); out: a BF16 tensor (or its element address range) receiving rows
    0..num_tokens-1 at `out_row_stride` elements; ws: SharedExpertWorkspace; plan: plan_launch(...) (default:
    the plan for num_tokens on ws.num_sms SMs); clamp None = no clamp; packed: `pack_weights(weights)`, needed
    when the plan's pipeline is "ws" (the kernels read the packed weights and the scale words from it).
    """
    import torch

    from gc_moe.runtime.launch import f32, i32, ptr

    hidden, inter = weights.hidden, weights.intermediate
    name = recipe_name(weights.recipe)
    if (ws.hidden, ws.inter) != (hidden, inter):
        raise ValueError(f"workspace for H={ws.hidden}, Is={ws.inter}; the weights are H={hidden}, Is={inter}")
    if not 0 <= num_tokens <= min(ws.capacity, x.shape[0]):
        raise ValueError(f"num_tokens {num_tokens}; allowed: 0..min(workspace capacity {ws.capacity}, "
                         f"x rows {x.shape[0]})")
    if hidden % 128 or inter % 128:
        raise ValueError(f"H = {hidden} and Is = {inter} must be multiples of 128")
    _check_cuda("x", x, torch.float8_e4m3fn, (x.shape[0], hidden))
    _check_cuda("x_sf", x_sf, torch.int32, (x.shape[0], hidden // 128))
    for what, t in (("w1", weights.w1), ("w2", weights.w2), ("w1_sf", weights.w1_sf), ("w2_sf", weights.w2_sf)):
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"shared-expert {what} must be a contiguous CUDA tensor")
    if out.dtype != torch.bfloat16 or not out.is_cuda:
        raise ValueError(f"out must be a CUDA bfloat16 tensor, got {out.dtype} on {out.device}")
    if out_row_stride < hidden or (num_tokens and out.numel() < (num_tokens - 1) * out_row_stride + hidden):
        raise ValueError(f"out must hold {num_tokens} rows of {hidden} at row stride {out_row_stride} "
                         f"(>= H), got {out.numel()} elements")
    plan = plan or plan_launch(max(1, num_tokens), hidden, inter, ws.num_sms)
    if plan.token_tiles * plan.block_n < num_tokens:
        raise ValueError(f"plan covers {plan.token_tiles * plan.block_n} tokens < num_tokens {num_tokens}")
    need_scratch = scratch_floats("w1", plan, hidden, inter) + scratch_floats("w2", plan, hidden, inter)
    need_counters = counter_words("w1", plan, hidden, inter) + counter_words("w2", plan, hidden, inter)
    if need_scratch > ws.scratch.numel() or need_counters > ws.counters.numel():
        raise ValueError(f"plan {plan} needs {need_scratch} scratch floats and {need_counters} counters, the "
                         f"workspace has {ws.scratch.numel()} and {ws.counters.numel()}")
    src = weights
    suffix = ""
    if plan.pipeline == "ws":
        if packed is None:
            raise ValueError("the warp-specialized pipeline reads packed weights: pass packed=pack_weights(weights)")
        if packed.source != tuple(t.data_ptr() for t in (weights.w1, weights.w1_sf, weights.w2, weights.w2_sf)):
            raise ValueError("packed was not packed from these weights (pack_weights(weights) again)")
        src, suffix = packed, "_ws" + ("2" if plan.ctas_per_sm == 2 else "")
    k1, k2 = kernels[("w1" + suffix, plan.block_n)], kernels[("w2" + suffix, plan.block_n)]
    for k, role in ((k1, "w1"), (k2, "w2")):
        params = dict(k.entry.variant.params)
        if (params["role"] != role or params["recipe"] != name or params.get("pipeline", "cp.async") != plan.pipeline
                or params.get("ctas_per_sm", 1) != plan.ctas_per_sm):
            raise ValueError(f"kernel {k.name} is not the {role} kernel of recipe {weights.recipe} on the "
                             f"{plan.pipeline} pipeline")
    scratch2 = ws.scratch.data_ptr() + 4 * scratch_floats("w1", plan, hidden, inter)
    counters2 = ws.counters.data_ptr() + 4 * counter_words("w1", plan, hidden, inter)
    clamp_value = float("inf") if clamp is None else float(clamp)
    w1_args = [ptr(src.w1), ptr(src.w1_sf), ptr(x), ptr(x_sf), ptr(ws.act), ptr(ws.act_scale),
               ptr(ws.scratch), ptr(ws.counters), i32(num_tokens), i32(hidden // 128), i32(inter),
               i32(plan.k_splits_w1), f32(alpha), f32(clamp_value)]
    w2_args = [ptr(src.w2), ptr(src.w2_sf), ptr(ws.act), ptr(ws.act_scale), ptr(out), ptr(scratch2),
               ptr(counters2), i32(num_tokens), i32(inter // 128), i32(out_row_stride), i32(plan.k_splits_w2)]
    return [("shared_w1", k1, grid("w1", plan, hidden, inter), w1_args),
            ("shared_w2", k2, grid("w2", plan, hidden, inter), w2_args)]


def fused_launch_args(kernels: dict, weights, x, x_sf, out, out_row_stride: int, num_tokens: int, ws,
                      plan: LaunchPlan | None = None, alpha: float = 1.0, clamp: float | None = 10.0,
                      timeout_s: float = 3600.0, packed: PackedSharedWeights | None = None) -> list:
    """[(name, kernel, grid, args)] of the fused launch (one node: W1 and W2 in one kernel, see FUSED_PARAMS);
    kernels: `load(...)`'s dict (its ("fused", block_n) entries); the rest as `launch_args`, whose checks apply."""
    from gc_moe.runtime.launch import i64, ptr

    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    if ws.sync is None:
        raise ValueError("the workspace has no sync words: allocate it with SharedExpertWorkspace.allocate")
    plan = plan or plan_launch(max(1, num_tokens), weights.hidden, weights.intermediate, ws.num_sms)
    (_, _, _, a1), (_, _, _, a2) = launch_args(kernels, weights, x, x_sf, out, out_row_stride, num_tokens, ws,
                                               plan=plan, alpha=alpha, clamp=clamp, packed=packed)
    kernel = kernels[("fused_ws" + ("2" if plan.ctas_per_sm == 2 else "") if plan.pipeline == "ws" else "fused",
                      plan.block_n)]
    params = dict(kernel.entry.variant.params)
    if params["recipe"] != recipe_name(weights.recipe) or params.get("pipeline", "cp.async") != plan.pipeline:
        raise ValueError(f"kernel {kernel.name} is not the fused kernel of recipe {weights.recipe} on the "
                         f"{plan.pipeline} pipeline")
    # W1's (w, w_sf, x, x_sf, act, act_scale, scratch, counters, tokens, H/128, Is, splits, alpha, clamp) and
    # W2's (w, w_sf, act, act_scale, out, scratch, counters, tokens, Is/128, stride, splits) in FUSED_PARAMS order
    from gc_moe.runtime.launch import i32

    args = [a1[0], a1[1], a2[0], a2[1], a1[2], a1[3], a1[4], a1[5], a2[4], a1[6], a1[7], a2[5], a2[6], ptr(ws.sync),
            a1[8], a1[9], a2[8], a2[9], a1[11], a2[10], i32(plan.token_tiles), a1[12], a1[13],
            i64(int(timeout_s * 1e9))]
    n1, n2 = fused_ctas(plan, weights.hidden, weights.intermediate)
    return [("shared", kernel, (n1 + n2, 1, 1), args)]


def launch(stream, nodes: list) -> None:
    """Eager launches of `launch_args(...)`'s nodes in order on one stream."""
    from gc_moe.runtime.launch import launch as launch_kernel

    for _, kernel, g, args in nodes:
        launch_kernel(kernel, g, args, stream)


def add_to_graph(graph, context, nodes: list, depends_on=()) -> list:
    """Add the nodes to a `runtime.graph.ChildGraph` in `context`: W1 after `depends_on`, W2 after W1.
    Returns the graph nodes (the last one is what the finalize node depends on)."""
    added = []
    for name, kernel, g, args in nodes:
        added.append(graph.add_kernel(name, kernel, g, args, context, depends_on=added[-1:] or list(depends_on)))
    return added


# ---------------------------------------------------------------------------------------------- host twin
def emulate(weights, x, x_sf, num_tokens: int, alpha: float = 1.0, clamp: float | None = 10.0):
    """The kernels' data flow in float32 torch (any device): W1 weight tiles of interleaved gate/up rows
    (`w1_tile_row_to_weight_row`), SwiGLU per channel, the amax of each 128-channel group of 4 tiles, E4M3
    with FP32 K128 scales, then W2. Returns (act fp8 [T, Is], act_scale f32 [T, Is/128], y f32 [T, H]).
    The K order of the sums differs from the kernels' (FP32 rounding only); `split_range` covers the rest."""
    import torch

    from gc_moe.formats import dequantize_fp8_ue8m0

    w1, w2 = weights.dequantize()
    inter = weights.intermediate
    xf = dequantize_fp8_ue8m0(x[:num_tokens], x_sf[:num_tokens])
    tiles = 2 * inter // TILE_ROWS
    rows = torch.tensor([w1_tile_row_to_weight_row(m, r, inter) for m in range(tiles) for r in range(TILE_ROWS)],
                        device=w1.device)
    acc = (xf @ w1[rows].T).view(num_tokens, tiles, 4, 2, 8)  # [T, tile, 16-row group v, gate/up, r]
    gate, up = acc[..., 0, :], acc[..., 1, :]  # channel 32 tile + 8 v + r
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    h = (gate * torch.sigmoid(alpha * gate) * up).reshape(num_tokens, inter)
    amax = h.abs().view(num_tokens, inter // CHANNELS_PER_SCALE, CHANNELS_PER_SCALE).amax(-1).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    act = (h.view(num_tokens, -1, CHANNELS_PER_SCALE) / scale[..., None]).view(num_tokens, inter)
    act = act.to(torch.float8_e4m3fn)
    mid = (act.float().view(num_tokens, -1, CHANNELS_PER_SCALE) * scale[..., None]).view(num_tokens, inter)
    return act, scale, mid @ w2.T


# ---------------------------------------------------------------------------------------------- device timing
MODELS = {  # shared-expert shapes of gcmoe_bench/data/models.csv: (H, Is = I x shared experts, recipe)
    "deepseek-v4.1-flash": (5120, 2304, (1, 1, 32)),
    "glm-5.2": (6144, 2048, (1, 128, 128)),
}


def random_inputs(hidden: int, inter: int, recipe, capacity: int, seed: int = 0, device="cuda"):
    """(SharedExpertWeights, x fp8 [C, H], x_sf int32 [C, H/128]) from seeded normal floats."""
    import torch

    from gc_moe.formats import quantize_fp8_ue8m0, quantize_shared_expert_weights

    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(2 * inter, hidden, generator=gen, device=device) * hidden**-0.5
    w2 = torch.randn(hidden, inter, generator=gen, device=device) * inter**-0.5
    weights = quantize_shared_expert_weights(w1, w2, recipe)
    x, x_sf = quantize_fp8_ue8m0(torch.randn(capacity, hidden, generator=gen, device=device) * 2.0)
    return weights, x, x_sf


def read_bandwidth_gbs(gib: int = 4, reps: int = 5) -> float:
    """Read bandwidth of torch.amax over a `gib` GiB BF16 tensor (median of `reps`), GB/s."""
    import torch

    t = torch.ones(gib * (1 << 30) // 2, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.amax(t)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del t
    times = sorted(times[1:])
    return gib * (1 << 30) / (times[len(times) // 2] * 1e-3) / 1e9


def graph_us(fn, stream, reps: int, windows: int = 5) -> float:
    """Microseconds per call of `fn` (stream work only): `reps` calls captured in one CUDA graph, the median of
    `windows` timed replays (no host launch inside the timing)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    times = []
    for _ in range(windows + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            graph.replay()
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    times = sorted(times[1:])
    return times[len(times) // 2]


def bench(tokens=(1, 8, 64, 256), reps: int = 30, split_overrides=((None, None),),
          pipelines=PIPELINES) -> list:
    """Latency per token count for both models' shared experts, per pipeline where the token tile allows it, with
    the bytes/floor figures: bytes = FP8 weights + scales read once, floor = bytes / amax read bandwidth. Timed as
    CUDA graphs of `reps` x [L2 flush, W1, W2] minus the same of [flush] (W1 alone likewise), so no host launch is
    inside the timing; the flush READS 512 MB (a write flush would leave ~50 MB of dirty lines whose write-back
    lands in W1's time)."""
    import torch

    from gc_moe.runtime.launch import launch as launch_kernel

    torch.zeros(1, device="cuda")
    bandwidth = read_bandwidth_gbs()
    flush = torch.ones(256 << 20, dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    rows = []
    for model, (hidden, inter, recipe) in MODELS.items():
        kernels = load("sm_90a", recipe)
        cap = max(tokens)
        weights, x, x_sf = random_inputs(hidden, inter, recipe, cap, seed=1)
        packed = pack_weights(weights)
        nbytes = sum(t.numel() * t.element_size() for t in (weights.w1, weights.w1_sf, weights.w2, weights.w2_sf))
        ws = SharedExpertWorkspace.allocate(hidden, inter, cap, "cuda")
        out = torch.empty(cap, hidden, dtype=torch.bfloat16, device="cuda")
        for t in tokens:
            for pipeline, ctas in ((p, c) for p in pipelines for c in (1, 2) if c == 1 or p == "ws"):
                base = plan_launch(t, hidden, inter, pipeline=pipeline)  # "ws": 32-token tiles above 32 tokens
                if ctas == 2:
                    if base.block_n not in TWO_CTA_BLOCK_N:
                        continue
                    base = plan_launch(t, hidden, inter, pipeline=pipeline, ctas_per_sm=2)
                for s1, s2 in split_overrides:
                    plan = LaunchPlan(base.block_n, base.token_tiles, s1 or base.k_splits_w1, s2 or base.k_splits_w2,
                                      pipeline, base.ctas_per_sm)
                    need = sum(scratch_floats(r, plan, hidden, inter) for r in ("w1", "w2"))
                    if need > ws.scratch.numel():  # a forced-split plan: more partial tiles
                        ws.scratch = torch.empty(need, dtype=torch.float32, device="cuda")
                    need = sum(counter_words(r, plan, hidden, inter) for r in ("w1", "w2"))
                    if need > ws.counters.numel():
                        ws.counters = torch.zeros(need, dtype=torch.int32, device="cuda")
                    nodes = launch_args(kernels, weights, x, x_sf, out, hidden, t, ws, plan=plan, packed=packed)
                    def flush_only():
                        flush.amax()

                    def flush_w1(nodes=nodes):
                        flush.amax()
                        launch_kernel(nodes[0][1], nodes[0][2], nodes[0][3], stream)

                    def flush_w1_w2(nodes=nodes):
                        flush_w1(nodes)
                        launch_kernel(nodes[1][1], nodes[1][2], nodes[1][3], stream)

                    base_us = graph_us(flush_only, stream, reps)
                    w1_us = graph_us(flush_w1, stream, reps) - base_us
                    med = graph_us(flush_w1_w2, stream, reps) - base_us
                    floor = nbytes / (bandwidth * 1e9) * 1e6
                    rows.append({
                        "model": model, "tokens": t, "block_n": plan.block_n,
                        "pipeline": pipeline + ("2" if plan.ctas_per_sm == 2 else ""),
                        "k_splits": (plan.k_splits_w1, plan.k_splits_w2), "default_plan": (s1, s2) == (None, None),
                        "bytes": nbytes, "bandwidth_gbs": round(bandwidth, 1), "floor_us": round(floor, 2),
                        "us": round(med, 2), "w1_us": round(w1_us, 2), "w2_us": round(med - w1_us, 2),
                        "pct_of_bw": round(100 * floor / med, 1),
                    })
    return rows


def profile_launches(model: str, num_tokens: int, launches: int = 3, pipeline: str = "auto") -> None:
    """W1 then W2 of one model's shared expert at `num_tokens`, `launches` times eagerly (for a profiler: the
    kernels are the only `kernel_cutlass` launches of the process)."""
    import torch

    hidden, inter, recipe = MODELS[model]
    torch.zeros(1, device="cuda")
    kernels = load("sm_90a", recipe)
    weights, x, x_sf = random_inputs(hidden, inter, recipe, max(num_tokens, 1), seed=1)
    ws = SharedExpertWorkspace.allocate(hidden, inter, max(num_tokens, 1), "cuda")
    out = torch.empty(max(num_tokens, 1), hidden, dtype=torch.bfloat16, device="cuda")
    plan = plan_launch(max(num_tokens, 1), hidden, inter, pipeline=pipeline)
    nodes = launch_args(kernels, weights, x, x_sf, out, hidden, num_tokens, ws, plan=plan,
                        packed=pack_weights(weights) if plan.pipeline == "ws" else None)
    stream = torch.cuda.current_stream()
    for _ in range(launches):
        launch(stream, nodes)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(description="Latency of the shared-expert kernels on a GPU (both models).")
    p.add_argument("out", nargs="?", default=os.environ.get("OUT"), help="folder for shared_expert_bench.json")
    p.add_argument("--profile", default="", help="model:tokens: only launch W1 -> W2 three times (for ncu)")
    p.add_argument("--pipeline", default="auto", help="with --profile: auto, cp.async or ws")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    args = p.parse_args()
    if args.profile:
        model, tokens = args.profile.split(":")
        profile_launches(model, int(tokens), pipeline=args.pipeline)
        raise SystemExit(0)
    results = bench(tuple(int(t) for t in args.tokens.split(",")))
    print("model tokens bn pipeline splits(w1,w2) bytes floor_us us w1_us w2_us %bw")
    for r in results:
        print(r["model"], r["tokens"], r["block_n"], r["pipeline"], r["k_splits"], r["bytes"], r["floor_us"],
              r["us"], r["w1_us"], r["w2_us"], r["pct_of_bw"])
    if args.out:
        with open(os.path.join(args.out, "shared_expert_bench.json"), "w") as f:
            json.dump(results, f, indent=1)
