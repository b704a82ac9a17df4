"""SM90 FP8xFP4 grouped GEMM of the compute role: register-A WGMMA with in-register FP4 decode.

Supported: both GEMMs of a routed-expert MoE layer over tokens pre-grouped by expert.
- W1 (`role="w1"`): y = SwiGLU(W1 x) * routing weight, requantized to E4M3 with FP32 K128 scales.
- W2 (`role="w2"`): BF16 partials W2 y, one row per (top-k slot, source token) of a combine buffer.
Operands: weights in the window-repacked layout of `gc_moe.weights.sm90` (the A operand, decoded FP4 ->
E4M3 in registers, m64nNk32 WGMMA); activations E4M3 [rows, K] with FP32 K128 scales [rows, K/128]
(the B operand, staged in shared memory, N = the expert's valid tokens rounded up to 8 by zero fill).
Per-K32 weight scales and per-K128 activation scales are FMAs on the FP32 partials outside the MMA; the
opt-in `fold_scales` variant instead folds the K32 scale into the decode (an exponent add, exact inside the
weight window), so the four K32 WGMMAs of a K128 step chain into one accumulator and only the activation
scale stays an FMA.

Opt-in `ring_consumer` (docs/sm90-layer.md): W1 becomes a consumer of the layer's token ring while role1
fills it (waits for RING_READY, acquires every ring block its token tile touches, releases l1_empty_count
after its last read of the ring) and W2 scatters each row to its source rank's combine buffer through the
peer table. Default off: the default and folded variants are unchanged.

Pipelines (`warp_specialized`, the default up to bn 32): a producer warp streams each K128 step into a
ring of shared-memory stages (bulk copies of the weight tiles and scales, cp.async for the token tile,
completing on the stage's full mbarrier) while four consumer warpgroups wait on it, compute with one WGMMA
group in flight (wait_group 1) and release the stage on its empty mbarrier; no CTA barrier in the K loop.
The cp.async pipeline (bn 64, L2 hint) has every thread copy and compute, with a CTA
barrier per step. docs/sm90-grouped-gemm.md has the measurements behind the defaults.

Tuning knobs: `block_n` (tokens per CTA tile, 8/16/32/64: the token-bound BM of the paper's swapped
orientation), `stages` (K128 steps in flight; each step moves 17 KB of weights per CTA; default: the
deepest ring that fits), `ctas_per_sm`, `producer_warps`, `consumer_registers` (with a producer warpgroup: the
consumers raise their registers for a unit, `setmaxnreg`; the persistent role2 kernel's bn 32 needs it). The
halves W1 / W2 also serve `kernels.sm90.role2` (`fused_role2`) and through it the Mega MoE port's ws pipeline
(`kernels.sm90.mega_port_ws`). One CTA = 4 consumer warpgroups = 4 tiles of 64
weight rows (256 rows: 128 intermediate channels of W1, or 256 output channels of W2);
grid = (token tiles, M / 256, local experts); a CTA past its expert's token count exits at once.

Kernel parameters (all scalars, in order): see `PARAMS_W1` / `PARAMS_W2`.
"""

from dataclasses import dataclass, replace

BLOCK_N_CHOICES = (8, 16, 32, 64)
# token tiles of the table decode at two CTAs per SM only: 24 rows fit the 56 registers where 32 do not
TABLE_TWO_CTA_BLOCK_N = (24,)
# the table decode's wide token tile (one CTA per SM): a K128 step's decoded fragment feeds a chain of its first 64
# rows, then one of the rest (8-32 rows), so an expert with 65-96 rows has its weights decoded once, not twice
TABLE_WIDE_BLOCK_N = (96,)
WIDE_MAIN_N = 64  # the first chain's N at the wide tile (the waited consumer's N = 64 loop)
THREADS = 512  # the four consumer warpgroups (every thread of the cp.async pipeline)
PRODUCER_THREADS = 32  # the warp-specialized pipeline adds one producer warp after them (producer_warps)
PRODUCER_WARP_CHOICES = (1, 2, 4)  # 4 bulk-copied weight tiles per stage: one warp may take each
SMEM_LIMIT = 227 * 1024 - 1024  # dynamic shared memory per CTA on the H200 once the DSL's 1 KiB static is taken
SMEM_PER_SM = 228 * 1024  # of which the driver reserves 1 KiB per resident CTA
STAGE_TX_BYTES = 4 * 4096 + 4 * 256  # bulk-copied per K128 step: 4 weight tiles and their K32 scale bytes
# ptxas budgets a 544-thread CTA as 640 threads (whole warpgroups): 96 registers per thread, enough up to bn 32
WS_MAX_BLOCK_N = 32
WS_ENTRY_REGISTERS = 96  # what every thread of a 544..640-thread CTA gets at launch (the CTA's register pool / 640)
# consumer_registers: what the four consumer warpgroups may raise their share to once the producer warpgroup
# (producer_warps=4) has lowered its own; the pool stays 640 x 96, so the producer keeps (640 x 96 - 512 x C) / 128
CONSUMER_REGISTER_CHOICES = (104, 112)
# the mbarrier waits' suspend-time hint (ns); 0: the polling loop, the default (a 10 ms hint, CUTLASS's value,
# measured 0-1.5% slower: NANOSLEEP.SYNCS wakes on any barrier traffic, the polls stay, see step 7 of the docs)
WAIT_SUSPEND_NS = 0
TILES_PER_CTA = 4
ROWS_PER_CTA = 64 * TILES_PER_CTA
TILE_BYTES = 4096  # 64 x 128 FP4 codes
TILE_SCALE_BYTES = 256  # 64 rows x 4 K32 scale bytes
FP8_MAX = 448.0
EPILOGUE_VALUES_OFFSET = 32  # epilogue_warp's slot: two mbarriers and the 16-byte header before the values
AMAX_FLOOR = 1e-4  # formats.quantize_fp8_k128: scale = max(amax, 1e-4) / 448
# fold_scales: the A operand is value * 2^(d - FOLD_EXPONENT): the smallest code (0.5 at d = 0) is E4M3's
# smallest normal 2^-6 and the largest (6 at d = 11) is 384 <= 448, so every (code, d) is an exact E4M3 byte
FOLD_EXPONENT = 5
SCALE_BYTE_OFFSET = 6 + 127  # stored K32 scale byte = d + 6 + 127 (weights.sm90, the x64 convention)
# table_decode: the E4M3 bytes of the FP4 magnitudes times 2^(d - FOLD_EXPONENT) at d = 0, four per word: codes
# 0..3 (0, 0.5, 1, 1.5) and 4..7 (2, 3, 4, 6). A K32 block at window step d adds 8 d to every byte but code 0's
TABLE_LOW = 0x14100800
TABLE_HIGH = 0x24201C18
TABLE_STEP_LOW = 0x08080800
TABLE_STEP_HIGH = 0x08080808
# fused_role2: W2's activation scales of a token tile (rows x K128 blocks, I/128 <= 32: planning.MAX_INTERMEDIATE)
# are read once into shared memory when the tile's W1 bits are set, not one coherent load per K128 step
FUSED_MAX_K_BLOCKS = 32
FUSED_MAX_LOCAL_EXPERTS = 256  # the fused role2 scheduler's per-expert token-tile prefix lives in shared memory
FUSED_UNIT_SLOTS = 2  # the current and the next unit of a persistent role2 CTA (16 bytes each)
# W1's epilogue spills a few words (once per CTA, after the K loop; the loops themselves have no local memory: the
# bench's --sass report counts LDL / STL inside QGMMA loops) at the table decode's bn 64 in 112 registers (fit_n's
# eight N branches, or the waited consumer's carried stage and descriptor), and at bn 24 in the 56 of two CTAs per SM
TABLE64_W1_EPILOGUE_LOCAL_BYTES = 64
TWO_CTA_W1_EPILOGUE_LOCAL_BYTES = 32


# The fused halves' pipeline arithmetic (host and device: plain ints or DSL values). K128 step `step` of a
# persistent CTA (its steps count on across units) uses stage step mod stages; an mbarrier's wait on parity p
# returns once the phase of parity p completed, so the consumers wait on the full barrier with the parity of
# the step's pass over the ring, and the producer waits on the empty barrier for the previous pass.
def step_stage(step, stages):
    return step % stages


def full_parity(step, stages):
    return (step // stages) % 2


def empty_parity(step, stages):
    """The producer's wait before step `step` (>= stages) reuses its stage: the consumers' release of the
    previous pass."""
    return ((step // stages) + 1) % 2

PARAMS_W1 = (
    ("w_codes", "u64"), ("w_scales", "u64"), ("w_factor", "u64"), ("act", "u64"), ("act_scale", "u64"),
    ("expert_offsets", "u64"), ("routing_weight", "u64"), ("out", "u64"), ("out_scale", "u64"),
    ("k_blocks", "s32"), ("m_tiles", "s32"),
)
PARAMS_W2 = (
    ("w_codes", "u64"), ("w_scales", "u64"), ("w_factor", "u64"), ("act", "u64"), ("act_scale", "u64"),
    ("expert_offsets", "u64"), ("dest_row", "u64"), ("out", "u64"),
    ("k_blocks", "s32"), ("m_tiles", "s32"),
)
# ring_consumer appends these: W1 waits for the ring (control word RING_READY, l1_full_count per ring block of
# ring_block_m rows) bounded by timeout_ns and releases l1_empty_count; W2 finds each row's source rank as
# ring_source div source_rows (source_rows = capacity x topk) and its combine buffer at peers[source rank]
RING_PARAMS_W1 = (
    ("ring_ready", "u64"), ("l1_full_count", "u64"), ("l1_empty_count", "u64"),
    ("ring_block_m", "s32"), ("ring_blocks", "s32"), ("timeout_ns", "s64"),
)
RING_PARAMS_W2 = (("ring_source", "u64"), ("peers", "u64"), ("source_rows", "s32"))
# k_splits > 1 appends these (W1 or W2): each CTA's FP32 partials [unit, split, consumer thread, BN / 2] and one
# arrival counter per unit (token tile x weight-row CTA x expert; zero before the first launch, the last split
# of a unit sets it back to zero)
SPLIT_PARAMS = (("split_partials", "u64"), ("split_counts", "u64"))
# stream_k appends these: the split buffers (partials per piece: [unit + CTA, consumer thread, BN / 2]; counts per
# unit) and the local experts, whose units with tokens the CTAs share (the grid holds no unit coordinates)
STREAM_PARAMS = SPLIT_PARAMS + (("experts", "s32"),)
# tma_tokens: the grouped activations' 3-D tensor map, 128 bytes in global memory (`_token_map_args`)
TOKEN_MAP_PARAMS = (("token_map", "u64"),)
TOKEN_MAP_ROWS = 8  # the map's box: one token tile (tma_tokens is a knob of the stream-K loops, token tile 8)
# stream_k with handover appends these: the hand-over words (int32 per (expert, token tile, W2 K128 block) = W1
# weight-row CTA; zero before the first launch, a W1 + W2 pair leaves them zero), the token tiles per expert they
# are laid out for, and (W1) the permits one finished W1 unit publishes: W2's weight-row CTAs per token tile
HANDOVER_PARAMS_W1 = (("ready", "u64"), ("ready_tiles", "s32"), ("ready_readers", "s32"))
HANDOVER_PARAMS_W2 = (("ready", "u64"), ("ready_tiles", "s32"))
# a handover W2 segment's producer polls one word per K128 step with one lane each
HANDOVER_MAX_K_BLOCKS = 32
# a stream_k CTA keeps each warp's scan of the experts' units in registers (two lanes' worth of experts per lane)
STREAM_MAX_EXPERTS = 64
# persistent appends these: the local experts and the token tiles per expert of the grid of units it walks
PERSIST_PARAMS = (("experts", "s32"), ("token_tiles", "s32"))
# transposed_stores: one consumer warp's chunk of 16 tokens x 16 hidden BF16 values in shared memory
TRANSPOSE_WARP_BYTES = 16 * 16 * 2
# snake_walk: the experts' order by rows is kept for up to this many local experts (above it the natural order)
SNAKE_MAX_EXPERTS = 64
# scale_ratios: activation scales below this count as it (zero scales included), so every ratio is finite; a block
# changes by less than this x its products (< 2^19), and the sums stay inside FP32 for scales up to 2^20
SCALE_RATIO_FLOOR = 2.0 ** -64
# stream_k with trace: per CTA TRACE_SLOTS slots of two 64-bit words (mostly (%globaltimer, %clock64) events) at the
# head of the partials buffer (the pieces' partials after them): entry, after the unit scan (consumer / producer),
# then per segment (up to TRACE_SEGMENTS) its start, first full stage, end of its K loop, end of its epilogue and
# the cycles thread 0 waited for full stages and the producer for empty ones; the producer's and the consumers' end,
# the segment count and the SM the CTA ran on, and W2's: when its producer's `griddepcontrol.wait` returned (W1's,
# outside the pair kernel: when its producer's first copies were out, and three more of its producer's path to them:
# its range known, its first unit looked up, its copies' sources computed; the bench's `trace_summary` and
# `pair_trace_summary` read them). One CTA per SM only: the traced two-CTA W1 loop spilled 8 B and wrote other
# bytes than the plain loop in about one launch of eight (never root-caused; the plain two-CTA loops pass the same
# relaunch checks), so it is not built
# stream_pair with sm_weights: the per-SM weight table has one int32 per %smid below this (0: no CTA there); its two
# exclusive prefixes (weight, working SMs) live in shared memory, MAX_SM_IDS + 1 entries each
MAX_SM_IDS = 256
SM_TABLE_BYTES = -(-4 * (MAX_SM_IDS + 1) // 16) * 16
# below this many K128 steps per working SM the weighted ranges fall back to equal ones (every range nonempty: the
# host keeps the weights within SM_WEIGHT_RATIO of each other)
SM_WEIGHT_MIN_STEPS = 4
SM_WEIGHT_RATIO = 1.5
PIECE_EMPTY_BITS = -1  # ptx.PIECE_EMPTY as an int32: a tagged piece slot's empty word
# tagged_pieces: an owner loads this many pieces' slots before its K loop (4 registers each; a unit mostly has 1-2)
TAGGED_EARLY_PIECES = 2
# dynamic_tail: the last units // TAIL_UNIT_DIV units of a stream-K role leave the CTAs' static ranges and are cut
# into TAIL_CHUNKS chunks of their K128 steps each, claimed by ticket (`GemmConfig.dynamic_tail`)
TAIL_UNIT_DIV = 8
TAIL_CHUNKS = 4
TAIL_SLOT_BYTES = 16  # a stage's chunk word (its padding past the activation scales)
TRACE_SEGMENTS = 5
TRACE_SEGMENT_SLOTS = 5
TRACE_TAIL_SLOTS = 7
TRACE_SLOTS = 3 + TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + TRACE_TAIL_SLOTS
# tile_knobs's rings, per token tile (the configurations' deepest ring elsewhere): each CTA keeps its ring's stages
# requested, and beyond what the bandwidth needs that only queues every request, stores and fences included, behind
# the reads (132 SMs x 12 stages x 17.4 KB = 27.6 MB at tile 8, ~9 us at 3.14 TB/s). On an H100 tile 8's stream-K
# loops at 6 stages were 4-11 us faster at 1-8 tokens than at 12 (5 as fast, 4 and 8 slower), tile 32 at 5 3.5% faster
# than at 10, tile 64 at 6 1-2.5% than at 8; tile 96 lost with fewer, the two-CTA tiles 16 / 24 were mixed (step 65)
RING_STAGES = {8: 6, 32: 5, 64: 6}
# the cards tile_knobs knows (`card_of`): its rule is the H100's where a choice was measured on both and differed
CARDS = ("h100", "h200")
# tile 8's stream-K loops per card beyond RING_STAGES[8]: on the H200 (4.45 TB/s, 1.4x the H100's bandwidth per SM)
# the ring of 12 keeps the reads going through the CTAs' mid-range epilogues (~6 us of reads in flight, 6 stages ~3),
# and the pieces published without a fence do not pause the producer behind the SM's own reads (step 78). On the H100
# the unit epilogues' factor and per-token words load before the K loop (`lean_epilogue`: W1's whole-unit epilogue
# 0.7-1.0 -> 0.45-0.6 us, the pair 0.51 us faster on average at 1-8 tokens over four runs, step 85)
TILE8_STREAM_K = {"h100": {"max_stages": RING_STAGES[8], "lean_epilogue": True},
                  "h200": {"max_stages": 12, "tagged_pieces": True}}
# and tile 8's unit grid (two CTAs per SM, 6 stages each by default) where tile_knobs takes it: at 4 stages each
# 2-5 us faster at 8-32 tokens but DeepSeek-V4.1-Flash T=32 (+1 us; tile_knobs runs tile 16 there), at 3 mixed
UNIT_GRID_8_STAGES = 4
# tile_knobs: above this many waves of W1 units tile 8 runs the unit grid instead of the stream-K loops. Step 24 (12
# stages) found the stream-K loops 0.5-3.6% slower at 448-630 units on 132 SMs; with step 65's rings they were 1-6%
# faster at 448-704 units (3.4-5.3 waves; the unit grid at 6 stages per CTA, 2-4 us more than at its capped 4), so
# the unit grid is left for what was not measured
STREAM_K_MAX_WAVES = 5.4
K_SPLIT_CHOICES = (1, 2, 3, 4)
K_SPLIT_MAX_BLOCK_N = 16  # the calls that leave SMs idle use tiles of 8 / 16; at 32 the split epilogue spills


@dataclass(frozen=True)
class GemmConfig:
    role: str  # "w1" or "w2"
    block_n: int = 8
    stages: int | None = None  # None: 6 for the cp.async pipeline, the most that fit for warp_specialized
    swiglu_alpha: float = 1.0
    swiglu_clamp: float = 10.0
    # evict-first L2 policy on the weight copies: off by default, the DSL-assembled LDGSTS with a cache
    # policy read undefined uniform registers on the H200 (illegal instruction); see docs/sm90-grouped-gemm.md
    l2_evict_first: bool = False
    # token tiles of one weight tile as the fastest grid dimension: CTAs that read the same weights run
    # side by side, so a second token tile finds them in L2 instead of HBM
    token_tiles_fastest: bool = True
    # K32 weight scales folded into the FP4 -> E4M3 decode (exponent add): one WGMMA chain per K128 step
    # and one FP32 FMA per accumulator per K128 instead of four waited WGMMAs with scale FMAs
    fold_scales: bool = False
    # a consumer of the layer's token ring (docs/sm90-layer.md): W1 acquires ring blocks as role1 fills them
    # and releases l1_empty_count; W2 scatters to the source ranks through the peer table
    ring_consumer: bool = False
    # a producer warp streams the stages (bulk copies for weights and scales, cp.async for the tokens) through
    # mbarrier full/empty rings; the consumer warpgroups never meet at a CTA barrier in the main loop and
    # apply the activation scale once per K128 step. False: every thread copies and computes (cp.async +
    # bar.sync per step), the pipeline of bn 64 and the L2-hint variants. None: True up to bn 32 unless
    # l2_evict_first asks for the cp.async pipeline (the ring consumer's acquire and release sit outside the
    # main loop, before the producer starts and after the consumers' epilogue barrier)
    warp_specialized: bool | None = None
    # warp_specialized: CTAs that must fit one SM together (2: half the shared memory each and ptxas keeps the
    # registers near 56 per thread); more CTAs in flight per SM, and small grids spread over every SM.
    # None: 2 at bn 8 (the only token tile whose consumer fits those registers), else 1
    ctas_per_sm: int | None = None
    # warp_specialized: producer warps; the weight-tile and scale bulk copies of a stage are spread over them
    # (warp w issues tiles w, w + producer_warps, ...) and so are the token-tile copies. One warp issuing all
    # 8 bulk copies was the pipeline's bound at one CTA per SM (step 7 of docs/sm90-grouped-gemm.md)
    producer_warps: int = 1
    # CTAs take the work units that have tokens in order: CTA b of the launch runs the b-th (expert, weight-row
    # tile, token tile) with tokens, found by a warp scan over the experts' token tiles; the CTAs past the last
    # unit exit. The launch is the same size as without it (every token tile an expert could need), but the
    # working CTAs are the first of the launch, so the block scheduler spreads them over the SMs instead of
    # pairing them among CTAs that exit at once (GLM-5.2 at 1 token: 80 working CTAs of 512)
    compact_grid: bool = False
    # warp_specialized: the mbarrier waits' suspend-time hint (ns; 0 = poll, bounded by a poll count). The
    # Nsight Compute profile showed ~21 polls per consumer warp and K128 step, a third of the issued
    # instructions; a hint did not remove them and did not speed up (docs/sm90-grouped-gemm.md, step 7)
    wait_suspend_ns: int = WAIT_SUSPEND_NS
    # one half of the layer's fused role2 kernel (`kernels.sm90.role2`: W1 and W2 units of one launch, each CTA
    # taking a ticket): the body takes its unit from the ticket instead of the block index; W1 publishes each
    # finished unit in the W1-completion bitmap of its (expert, token tile), W2 waits for all of its tile's bits
    # before its first token copy and reads what W1 wrote through coherent loads
    fused_role2: bool = False
    # warp_specialized with a producer warpgroup (producer_warps=4, one CTA per SM): the consumer warpgroups raise
    # their registers to this many per thread (`setmaxnreg.inc`) for the main loop while the producer lowers its
    # own (`setmaxnreg.dec` to `producer_registers`); both return to the launch's 96 after it. None: no change.
    # Room for the persistent role2 kernel's bn 32, which spills in 96
    consumer_registers: int | None = None
    # fused_role2: threads of the CTA beside the GEMM's (the Mega MoE port's dispatch warps, after the GEMM's):
    # the GEMM's CTA-wide barriers become a named barrier over its own `threads`
    side_threads: int = 0
    # fused_role2 in a reused token ring (layer_layout.LayerShape.ring_blocks_limit): W1 reads grouped row r at
    # ring row r mod R and releases l1_empty_count by the rows of its tile in each block (role1's wait target);
    # W1's output rows (l2_act, l2_scale) are a ring of the same R rows too: W1 waits, before storing a later
    # generation, until l2_empty_count shows every W2 CTA read the previous one, and W2 reads them at r mod R
    # (role2.run_unit releases l2_empty_count). Off, the variants' code is what it was (the rows' flat index,
    # one release per CTA and block)
    ring_reuse: bool = False
    # the stand-alone W1 or W2 on the warp-specialized pipeline: K (H / 128 or I / 128 steps) split over this
    # many CTAs per (token tile, weight-row CTA, expert). Each writes its FP32 partials; the last to arrive sums
    # them in split order (the same bits whichever arrives last) and runs the role's epilogue. For calls whose
    # working CTAs leave SMs idle: one CTA's K loop (W1 32-48 steps, W2 16-18, ~0.6 us each) is the floor there
    # (docs/sm90-grouped-gemm.md, steps 10-11)
    k_splits: int = 1
    # fold_scales through a byte-permute table: per (row, K32 block) the eight magnitudes' E4M3 bytes at the
    # block's scale (two words, three integer ops), then per word of eight codes one `prmt` per four codes picks
    # the magnitudes and two masks place the signs (7 ops per 8 codes, as the unfolded decode). Needs the weights
    # in weights.sm90's "table" nibble order. The FP32 scale work left is one FMA per accumulator per K128 step,
    # and no partial buffers: room for token tiles of 64 on the warp-specialized pipeline
    table_decode: bool = False
    # table_decode: each CTA's WGMMAs take N = its token tile's rows rounded up to 8 instead of the whole tile (one
    # consumer loop per N, chosen by the rows; the accumulators past N stay zero, as zero-filled tokens would
    # leave them). Experts with fewer rows than the tile cost the tensor core and the scale FMAs only their share
    fit_n: bool = False
    # the stand-alone W1 or W2 at token tile 8 as a stream-K loop: the grid is ctas_per_sm x SMs CTAs, and CTA c
    # runs the K128 steps [c W / G, (c + 1) W / G) of the W = units x K/128 steps of the units with tokens (ordered
    # as compact_grid orders them), one unit's steps after the other on one continuing stage ring. A unit whose
    # steps lie in one CTA ends with its epilogue; the other pieces of a shared unit publish FP32 partials and go
    # on, and the unit's owner (the CTA with its first steps, at the end of its range) waits for them (bounded) and
    # adds them in CTA order (the same bits whichever arrives last) before the epilogue: the grid must be resident
    # at once (ctas_per_sm x the SMs it runs on, nothing else on them). Every SM gets the same steps whatever the
    # routing: at 1-4 tokens a CTA's whole K loop on some SMs while others idle was the time over the floor
    # (docs/sm90-grouped-gemm.md, steps 10, 11, 20-26)
    stream_k: bool = False
    # stream_k: thread 0 and the producer's first thread stamp the CTA's phases (`TRACE_SLOTS`) into the head of
    # the partials buffer: where a small call's time over the floor goes (start, unit scan, first stage, each
    # segment's K loop and epilogue, the owner's wait). A measuring variant, not the default
    trace: bool = False
    # the stand-alone W1 / W2 (warp-specialized): no global load waits after the K loop, and W1 reduces each token's
    # amax once (one thread per token, then one shared read per value) instead of in every thread for each of its
    # values (16 reads each). The epilogue's per-token words (W1's routing weights, W2's combine rows) and the
    # expert's factor: with one unit per CTA the producer stages them into shared memory with the unit's first stage;
    # in a stream_k loop each consumer thread loads its own before the segment's K loop (a few registers)
    lean_epilogue: bool = False
    # a half of the stream-K pair kernel (`kernels.sm90.stream_pair`: W1's and then W2's stream_k ranges in one
    # launch on one stage ring): the body walks its segments from a given step of the CTA's ring and hands over
    # through per-(expert, token tile, K128 block) words instead of a kernel boundary (W1 publishes each finished
    # unit, W2 waits for the units whose rows it reads)
    stream_pair: bool = False
    # stream_pair: the CTAs' ranges sized by per-SM weights (a table indexed by %smid, from each SM's measured rate)
    # instead of equal steps, so that SMs that stream slower get fewer steps and the launch's CTAs end together; a
    # CTA's place in the order is its SM's rank among the weighted SMs. Same arithmetic, other piece boundaries
    sm_weights: bool = False
    # stream_k at one CTA per SM, the stand-alone pair W1 -> W2 with the pair kernel's hand-over words: W1 adds
    # W2's weight-row CTAs per token tile to the word of each (expert, token tile, weight-row CTA) it finishes
    # (release), and W2's producer, instead of `griddepcontrol.wait` for W1's whole grid, takes one permit from
    # the word of each K128 step it reads (acquire) before copying its rows. With W2 launched programmatically, its
    # CTAs on the SMs W1 leaves first run the steps whose rows are written while W1's last CTAs still run. W1 and W2
    # must run in pairs on one word buffer (`handover_words`): W1 alone leaves them non-zero
    handover: bool = False
    # the stand-alone table decode as a persistent grid: ctas_per_sm x SMs CTAs (at most one per unit) walk the units
    # (expert, weight-row CTA, token tile) of the unit grid in turn, CTA c taking units c, c + G, ... on one stage
    # ring that runs on across units, so the producer streams the next unit's weights during this unit's last steps
    # and epilogue instead of a new CTA's start and first stages. The unit grid's CTAs spent 3-10 us per unit beyond
    # their K loops (step 41's fit: 18-35% of a role's time at 64-256 tokens). The lean epilogue's staged words take
    # two slots (by unit parity), each freed by the consumers after their epilogue. Its consumers release every stage:
    # the waited loop at every tile (the pipelined one keeps its last stages)
    persistent: bool = False
    # a hand-over W2 (stream_pair or handover): each segment's producer first looks at the segment's words once and,
    # where W1 set all of them already (every segment but a CTA's first, mostly), takes their permits with acquire
    # atomics and streams the segment's stages as the plain stream-K producer does, weights and rows together.
    # Without it every segment issues the weights of its first stages, then polls, takes the permits and fences
    # before its first row copy: the traced pair waited 1.2-2.4 us at each segment switch for that (step 45)
    words_first: bool = False
    # persistent: the CTAs walk the unit grid with its experts in decreasing row count and each round of G units in
    # alternating direction (CTA c takes position c of even rounds, G - 1 - c of odd ones), so a CTA that took one of
    # the round's largest units takes one of the next round's smallest. A unit's time grows with its rows (WGMMA's N
    # and the scale FMAs per step), and the plain walk (units c, c + G, ... in expert order) leaves the CTAs' sums of
    # unit times 8-13% over their mean at 128-256 tokens, the snake 4-5% (a model of both models' draws; docs step
    # 56). The CTA ranks the experts' counts before its first unit (SNAKE_MAX_EXPERTS at most, in shared memory)
    snake_walk: bool = False
    # persistent: the consumers keep their sums in units of the current K128 step's activation scale, so each step's
    # WGMMAs accumulate into them (no fresh chain beside the sums): before step k the sums are multiplied by
    # s_(k-1) / s_k, after the last by s_(K-1). The producer threads (one token each) load the scales (a step ahead),
    # clamp them to SCALE_RATIO_FLOOR (a zero scale would make the ratio infinite), store ratio and scale into the stage
    # and publish them with one plain arrival each on the stage's full barrier. At the wide tile this frees the 48
    # registers of the fresh chains, so its two chains go out under one wait (docs step 57)
    scale_ratios: bool = False
    # stream_pair: a warp beside the producer releases W1's hand-over words. After a unit's epilogue the consumers'
    # thread 0 only stores the count of finished units to shared memory (release, CTA scope); the publisher warp walks the CTA's W1 segments as the consumers do
    # and releases each finished unit's word (`publish_walk`). The GPU-scope release (MEMBAR.ALL.GPU, ERRBAR in the
    # SASS) then stalls that warp, not warpgroup 0 and with it the ring (the pair's W1 epilogues took 1.8-3.3 us
    # against 0.7-1.3 in the separate W1: step 46). Both halves take it (one more warp in the CTA)
    publisher_warp: bool = False
    # the lean epilogue (not stream-K, not the ring consumer) writes its outputs through shared memory with 16-byte
    # stores. W2: each consumer warp its BF16 partials through a 512-byte region of its own, 16 tokens at a time: the
    # fragments go in transposed (stmatrix, rows swizzled by half), and each lane stores one token's 8 hidden values.
    # The plain W2 issues a 2-byte store per value with its own address, each warp instruction writing half of eight
    # tokens' 32-byte sectors (26% of W2's consumer samples at GLM-5.2 T=256 sat in that epilogue, step 54). W1: the
    # CTA's E4M3 rows (block_n x 128 bytes) go to shared memory byte by byte, then each thread copies 16-byte pieces
    # of whole rows out (the plain W1 stores one byte per value: a warp instruction writes 8 bytes of 4 tokens)
    transposed_stores: bool = False
    # the lean W2's value stores (not stream-K, not the ring consumer, not with transposed_stores) load every combine
    # row of the tile from shared memory before the first store, so no store's address waits for its own load (step
    # 54's profile: the epilogue's address IMADs stalled on the shared loads just before them; docs step 55)
    early_rows: bool = False
    # the stream-K tile-8 loop issues a K128 step's four K32 WGMMAs as one group (the fragment decoded whole, one
    # wait per step) and keeps that group in flight while it scales the step before: the two-group loop waits twice
    # per step, each time for the group issued half a step earlier. Its consumers spend ~0.53-0.57 us per step
    # outside their waits (step 45-46's traces), at or over the step's share of the bandwidth on the H200 (docs
    # step 63). The two accumulator buffers alternate by step (the loop runs two steps per trip)
    step_group: bool = False
    # the stand-alone stream_k W1 / W2: a piece publishes its FP32 partials with relaxed stores and no fence into
    # slots that hold ptx.PIECE_EMPTY otherwise (no count, no barrier), and goes on; the owner loads its first
    # TAGGED_EARLY_PIECES pieces' slots before its K loop and, after it, polls (bounded) any word still empty, then
    # empties the slots again. The fenced publication (the consumers' barrier, then thread 0's GPU-scope release)
    # held a piece's whole CTA 5-7 us at the median, up to 15, on an H100 (step 63's traces): the fence waits for
    # the SM's memory traffic in flight. The split buffers start empty (`split_buffers`)
    tagged_pieces: bool = False
    # the stand-alone stream_k W2: how many of its first stages' weights its producer issues before it waits for W1's
    # grid (`griddepcontrol.wait`); None: half the ring (step 29: a whole ring of 12 left the memory idle until the
    # consumers freed stage 0). With W2 launched programmatically these bytes move during W1's last CTAs
    w2_early_stages: int | None = None
    # the stream_k W1 / W2 (the pair kernel's W1 too: stream_pair.PairConfig.quick_start): the walk's first unit
    # without a division or a serial lookup (its range and first unit as multiplies by a magic number computed while
    # the unit scan's loads are out; the producer finds the unit's expert with one ballot per 32 experts). W1's
    # producer took 1.4 us from its scan to its first copies, the memory idle meanwhile, in a dependent chain of ~300
    # instructions (step 68). The consumers keep the plain lookup (the quick one's uniform values, live across their
    # K loops, cost W2's loop 5 instructions per step)
    quick_start: bool = False
    # the warp-specialized unfolded consumer (issue_group's loops: the stream-K tile-8 loops among them) reads codes in
    # weights.sm90's "split" nibble order: five integer instructions per code word instead of the lane order's seven
    # (17 fewer per K128 step and warp on a loop of 156-161), and its two 16-byte shared loads contiguous over the
    # warp (the lane order's 32-byte stride costs two wavefronts per quarter warp). The tile-8 consumers sit near their
    # share of the bandwidth per step on the H200 (docs step 62), so a step's instructions are its time there
    split_nibbles: bool = False
    # the stream_k W1 / W2: the shared-memory base and the consumers' stage-ring bases (barriers, token-tile
    # descriptor) marked warp-uniform once, and the consumers' full-stage waits trying once before their polls'
    # counter. Without it ptxas rebuilt the base from the CTA's cluster id and the ring's bases from it in every K128
    # step: 140 -> 130 instructions per step and warp on the tile-8 loop, the consumers' own time per step 8-15% lower
    # and the pair 0.6 us faster on average at 1-8 tokens on an H100 (tile_knobs's since step 79)
    lean_ring: bool = False
    # the stand-alone stream_k W1 / W2: the producer's lane 0 copies a K128 step's token tile with one tensor-map copy
    # (a 3-D map over the grouped activations, built on the host: `_token_map_args`) instead of 64 16-byte cp.async
    # pieces from the warp; the activation scales stay cp.async. The tile's rows past the expert's count come from the
    # next rows (their columns' partials are never stored; the map zero-fills past the last row). The copies of the
    # consumers' global stores and loads (a piece's stores, the epilogues' loads) no longer share the load/store path
    # with the ring's token rows in flight (a tagged piece's three global instructions took 2.2 us median on an H100,
    # docs step 80), and the consumers' per-step proxy fence goes (the tile arrives through the async proxy)
    tma_tokens: bool = False
    # the stand-alone stream_k W1 / W2: the last units // TAIL_UNIT_DIV units (the end of the unit order) stay out of
    # the CTAs' static ranges; their K128 steps, TAIL_CHUNKS chunks per unit, go to the CTAs that finish their ranges
    # first. The producer claims a chunk by ticket (one relaxed atomic after its range's copies, then after each
    # chunk's) and writes it into the chunk's first stage, where the consumers read it; -1 ends the walk. A chunk
    # publishes its partials, and the unit's last chunk to arrive adds them in chunk order (the same bits whoever
    # arrives last) and runs the epilogue. The CTAs' end spread was 4-15 us per pair at 1-8 tokens on an H100 (the
    # latest CTA's end less the mean's, docs step 80): static ranges leave the late CTAs their work
    dynamic_tail: bool = False
    # the stand-alone stream_k W1 / W2 on the unfolded loop: the consumers load a K128 step's two scale words and its
    # activation scales once, right after its full-stage wait, and keep them in registers for its groups' scaling
    # (the last group's one step later). Without it each group loaded the words again after its WGMMAs' wait, so two
    # shared-memory latencies sat on the warp's chain in every step (7 -> 5 shared loads per step and warp), and the
    # step's stage goes back as soon as its last WGMMAs are done (nothing in it is read after them). On the H200 the
    # tile-8 loop runs behind its bytes by 0.042 us per step (docs step 82): the chain is its time there
    early_scales: bool = False
    # the stand-alone stream_k W1: the unit epilogue's amax per token goes through shared-memory max reductions into
    # one of three slot sets, the unit's index mod 3 (a CTA's epilogues are consecutive units), so one consumer
    # barrier per unit orders them before the reads; after it one thread per token zeroes the set of the unit two
    # ahead, which every warp read before that barrier. Without it a unit's epilogue meets twice (the warps' maxima
    # stored, the words free for the next unit; three times with the lean epilogue's per-token reduction) and every
    # thread loads 16 words per value: on the H200 every unit costs its CTA 0.77 us (docs step 82). On an H100 it
    # gains nothing over the lean epilogue (docs step 85)
    amax_slots: bool = False
    # the stand-alone stream_k W1 at tile 8: a warp of its own after the producer runs the unit epilogues' amax,
    # E4M3 rows and K128 scales. The consumers compute their SwiGLU values, store them into one shared-memory slot
    # (waiting only for the warp to have read the previous unit's) and arrive, with no barrier among themselves, so
    # their next unit's steps start at once and the ring keeps draining. Without it every unit's epilogue (0.45-0.6
    # us on an H100 with the lean epilogue, docs step 85; 0.77 us per unit on the H200, step 82) holds all 16
    # consumer warps behind its barriers while the producer runs out of free stages. On an H100, whose loop waits for
    # its bytes, the ring hid that already: 0.7 us slower there (docs step 86)
    epilogue_warp: bool = False

    def __post_init__(self):
        if self.role not in ("w1", "w2"):
            raise ValueError(f"role must be 'w1' or 'w2', got {self.role!r}")
        if self.block_n not in BLOCK_N_CHOICES and not (
                (self.block_n in TABLE_TWO_CTA_BLOCK_N and self.table_decode and self.ctas_per_sm in (None, 2))
                or (self.block_n in TABLE_WIDE_BLOCK_N and self.table_decode and self.ctas_per_sm in (None, 1)
                    and self.warp_specialized is not False)):
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES} (or {TABLE_TWO_CTA_BLOCK_N} with table_decode at "
                             f"two CTAs per SM, {TABLE_WIDE_BLOCK_N} with table_decode at one), got {self.block_n}")
        if self.table_decode and not self.fold_scales:
            raise ValueError("table_decode is a way of folding the K32 scales into the decode: pass fold_scales=True")
        if self.fit_n and not (self.table_decode and self.warp_specialized is not False and not self.ring_consumer
                               and self.k_splits == 1):
            raise ValueError("fit_n is a knob of the stand-alone table decode (table_decode=True, warp-specialized, "
                             "no ring consumer, no K split)")
        if self.warp_specialized is None:
            object.__setattr__(self, "warp_specialized", not self.l2_evict_first and (
                self.block_n <= WS_MAX_BLOCK_N or self.table_decode))
        if self.warp_specialized and self.block_n > WS_MAX_BLOCK_N and not self.table_decode:
            raise ValueError(f"warp_specialized needs block_n <= {WS_MAX_BLOCK_N} (or table_decode), got "
                             f"{self.block_n}: ptxas gives a 544-thread CTA 96 registers per thread and bn 64 spills "
                             "there with per-K32 scale work")
        if self.warp_specialized and self.l2_evict_first:
            raise ValueError("l2_evict_first is a knob of the cp.async pipeline: pass warp_specialized=False")
        if self.ctas_per_sm is None:
            object.__setattr__(self, "ctas_per_sm", 2 if self.warp_specialized and (
                self.block_n == 8 or self.block_n in TABLE_TWO_CTA_BLOCK_N) else 1)
        if self.producer_warps not in PRODUCER_WARP_CHOICES or (self.producer_warps > 1 and not self.warp_specialized):
            raise ValueError(f"producer_warps must be 1, or one of {PRODUCER_WARP_CHOICES} with warp_specialized; "
                             f"got {self.producer_warps}")
        if self.ctas_per_sm not in (1, 2) or (self.ctas_per_sm == 2 and not self.warp_specialized):
            raise ValueError(f"ctas_per_sm must be 1, or 2 with warp_specialized; got {self.ctas_per_sm}")
        if self.compact_grid and not self.warp_specialized:
            raise ValueError("compact_grid is a knob of the warp-specialized pipeline (the cp.async pipeline's bn 64 "
                             "has no registers left for the unit scan): pass warp_specialized=None or True")
        if self.compact_grid and not self.token_tiles_fastest:
            raise ValueError("compact_grid orders the units with token tiles fastest: token_tiles_fastest must be True")
        if self.wait_suspend_ns < 0:
            raise ValueError(f"wait_suspend_ns must be >= 0 (0: poll), got {self.wait_suspend_ns}")
        if self.fused_role2 and not (self.ring_consumer and self.warp_specialized and not self.compact_grid
                                     and self.token_tiles_fastest and not self.fold_scales):
            raise ValueError("fused_role2 is a half of the layer's role2 kernel: it needs ring_consumer=True on the "
                             "warp-specialized pipeline, unfolded scales, token tiles fastest, no compact_grid")
        if self.consumer_registers is not None and (
                self.consumer_registers not in CONSUMER_REGISTER_CHOICES or not self.warp_specialized
                or self.producer_warps != 4 or self.ctas_per_sm != 1):
            raise ValueError(f"consumer_registers {self.consumer_registers}: allowed None, or one of "
                             f"{CONSUMER_REGISTER_CHOICES} on the warp-specialized pipeline with a producer warpgroup "
                             f"(producer_warps=4) and one CTA per SM (the registers move within one CTA's pool)")
        if self.ring_reuse and not self.fused_role2:
            raise ValueError("ring_reuse is a knob of the fused role2 halves (its tickets keep the reused ring's "
                             "waits acyclic): pass fused_role2=True")
        if self.k_splits not in K_SPLIT_CHOICES or (self.k_splits > 1 and not (
                self.warp_specialized and not self.ring_consumer and not self.fused_role2
                and not self.compact_grid and not self.fold_scales and self.token_tiles_fastest
                and self.block_n <= K_SPLIT_MAX_BLOCK_N)):
            raise ValueError(f"k_splits {self.k_splits}: allowed 1, or one of {K_SPLIT_CHOICES[1:]} for the "
                             f"stand-alone W1 or W2 on the warp-specialized pipeline at token tiles up to "
                             f"{K_SPLIT_MAX_BLOCK_N} (unfolded scales, token tiles fastest, no ring, no compact grid)")
        if self.stream_k and not (self.warp_specialized and not self.ring_consumer and not self.fused_role2
                                  and not self.compact_grid and not self.fold_scales and self.token_tiles_fastest
                                  and self.k_splits == 1 and self.consumer_registers is None
                                  and self.block_n == 8):
            raise ValueError(f"stream_k is a knob of the stand-alone W1 or W2 on the warp-specialized pipeline at "
                             f"token tile 8 (unfolded scales, token tiles fastest, no ring, no compact grid, no "
                             f"k_splits, no consumer_registers; tile 16's W1 spills there); got block_n "
                             f"{self.block_n}")
        if self.trace and not self.stream_k:
            raise ValueError("trace stamps the phases of a stream_k loop: pass stream_k=True")
        if self.step_group and not (self.stream_k and self.ctas_per_sm == 1):
            raise ValueError("step_group is a knob of the stream_k loop at one CTA per SM: pass stream_k=True, "
                             "ctas_per_sm=1")
        if self.tagged_pieces and not (self.stream_k and not self.stream_pair and not self.handover):
            raise ValueError("tagged_pieces is a knob of the stand-alone stream_k W1 / W2: pass stream_k=True (not the "
                             "pair kernel's halves, not handover: their words keep the fenced publication)")
        if self.lean_ring and not (self.stream_k and not self.stream_pair):
            raise ValueError("lean_ring is a knob of the stand-alone stream_k W1 / W2 (not the pair kernel's halves)")
        if self.tma_tokens and not (self.stream_k and not self.stream_pair and not self.handover):
            raise ValueError("tma_tokens is a knob of the stand-alone stream_k W1 / W2: pass stream_k=True (not the pair "
                             "kernel's halves, not handover: their rows come as W1 publishes them)")
        if self.early_scales and not (self.stream_k and not self.stream_pair and not self.step_group
                                      and not self.fold_scales):
            raise ValueError("early_scales is a knob of the stand-alone stream_k W1 / W2's unfolded loop (not the pair "
                             "kernel's halves, not step_group or fold_scales: their steps load the scales otherwise)")
        if self.amax_slots and not (self.role == "w1" and self.stream_k and not self.stream_pair and not self.handover
                                    and not self.dynamic_tail):
            raise ValueError("amax_slots is a knob of the stand-alone stream_k W1 (role 'w1', not the pair kernel's half, "
                             "not handover, not dynamic_tail: its chunks' epilogues need not be consecutive units)")
        if self.epilogue_warp and not (self.role == "w1" and self.stream_k and not self.stream_pair
                                       and not self.handover and not self.dynamic_tail and not self.amax_slots
                                       and self.block_n == 8 and self.ctas_per_sm == 1):
            raise ValueError("epilogue_warp is a knob of the stand-alone stream_k W1 at tile 8 and one CTA per SM (role "
                             "'w1', block_n 8, not the pair kernel's half, not handover, not dynamic_tail, not "
                             "amax_slots: the warp runs the amax itself)")
        if self.dynamic_tail and not (self.stream_k and not self.stream_pair and not self.handover and not self.trace
                                      and self.producer_warps == 1):
            raise ValueError("dynamic_tail is a knob of the stand-alone stream_k W1 / W2 with one producer warp (not the "
                             "pair kernel's halves, not handover, not traced: the trace reads static segments): pass "
                             "stream_k=True")
        if self.quick_start and not (self.stream_k and not self.sm_weights):
            raise ValueError("quick_start is a knob of the stream_k W1 / W2 (the pair kernel's too, not with "
                             "sm_weights): pass stream_k=True")
        if self.w2_early_stages is not None and not (
                self.role == "w2" and self.stream_k and not self.stream_pair and not self.handover
                and self.stages is not None and 1 <= self.w2_early_stages <= self.stages):
            raise ValueError(f"w2_early_stages {self.w2_early_stages}: a knob of the stand-alone stream_k W2 (role 'w2', "
                             f"stream_k=True, not the pair's half, not handover), 1..stages ({self.stages})")
        if self.split_nibbles and not (self.warp_specialized and not self.fold_scales and not self.ring_consumer
                                       and not self.fused_role2):
            raise ValueError("split_nibbles is a knob of the warp-specialized unfolded consumer (stand-alone: no ring "
                             "consumer, no fused role2; fold_scales off)")
        if self.trace and self.ctas_per_sm != 1:
            raise ValueError(f"trace stamps a stream_k loop at one CTA per SM (the traced two-CTA W1 loop spilled and "
                             f"was not deterministic); got ctas_per_sm {self.ctas_per_sm}: pass ctas_per_sm=1")
        if self.lean_epilogue and not (self.warp_specialized and not self.ring_consumer and not self.fused_role2
                                       and self.k_splits == 1):
            raise ValueError("lean_epilogue is a knob of the stand-alone W1 / W2 (warp-specialized, no ring consumer, "
                             "no fused role2, no k_splits)")
        if self.stream_pair and not (self.stream_k and self.ctas_per_sm == 1 and self.producer_warps == 1):
            raise ValueError("stream_pair is a half of the stream-K pair kernel: stream_k=True at one CTA per SM, one "
                             "producer warp")
        if self.handover and not (self.stream_k and self.ctas_per_sm == 1 and self.producer_warps == 1
                                  and not self.stream_pair):
            raise ValueError("handover is a knob of the stand-alone stream-K W1 / W2 at one CTA per SM with one "
                             "producer warp: pass stream_k=True, ctas_per_sm=1 (the pair kernel hands over within "
                             "its launch)")
        if self.publisher_warp and not self.stream_pair:
            raise ValueError("publisher_warp is a knob of the stream-K pair kernel's halves: pass stream_pair=True")
        if self.words_first and not (self.stream_pair or self.handover):
            raise ValueError("words_first is a knob of the hand-over W2 (the pair kernel's half, stream_pair=True, or "
                             "the stand-alone stream-K W2 with handover=True)")
        if self.persistent and not (self.table_decode and self.warp_specialized and not self.ring_consumer
                                    and self.k_splits == 1 and not self.compact_grid and self.token_tiles_fastest):
            raise ValueError("persistent is a knob of the stand-alone table decode (table_decode=True, warp-specialized, "
                             "no ring consumer, no K split, no compact grid, token tiles fastest)")
        if self.snake_walk and not self.persistent:
            raise ValueError("snake_walk is an order of the persistent grid's walk: pass persistent=True")
        if self.scale_ratios and not (self.persistent and self.block_n <= self.producer_threads):
            raise ValueError("scale_ratios is a knob of the persistent grid with a producer thread per token (block_n "
                             f"<= producer threads, {self.producer_threads} here): pass persistent=True")
        if self.transposed_stores and not (self.lean_epilogue and not self.stream_k and not self.ring_consumer
                                           and not self.fused_role2):
            raise ValueError("transposed_stores is a knob of the lean epilogue (lean_epilogue=True, not stream-K, not "
                             "the ring consumer)")
        if self.early_rows and not (self.role == "w2" and self.lean_epilogue and not self.stream_k
                                    and not self.ring_consumer and not self.fused_role2 and not self.transposed_stores):
            raise ValueError("early_rows is a knob of the lean W2's value stores (role 'w2', lean_epilogue=True, not "
                             "stream-K, not the ring consumer, not transposed_stores)")
        if self.sm_weights and not (self.stream_pair and not self.trace):
            raise ValueError("sm_weights sizes the ranges of the stream-K pair kernel: pass stream_pair=True (not "
                             "traced: the trace reads the equal ranges)")
        if self.side_threads and (not self.fused_role2 or self.side_threads % 32 or self.side_threads < 0):
            raise ValueError(f"side_threads {self.side_threads}: allowed 0, or whole warps (a multiple of 32) beside "
                             f"a fused_role2 half")
        if self.stages is None:
            object.__setattr__(self, "stages", self.max_stages if self.warp_specialized else 6)
        if not 2 <= self.stages <= 16:
            raise ValueError(f"stages must be in 2..16, got {self.stages}")
        if self.smem_bytes > self.smem_limit:
            raise ValueError(f"{self.stages} stages of {self.stage_bytes} B need {self.smem_bytes} B of shared "
                             f"memory; allowed: <= {self.smem_limit} (at most {self.max_stages} stages at block_n "
                             f"{self.block_n}, {self.ctas_per_sm} CTA(s) per SM)")

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory one CTA may take so that ctas_per_sm of them fit an SM."""
        if self.ctas_per_sm == 1:
            return SMEM_LIMIT
        return SMEM_PER_SM // self.ctas_per_sm - 2 * 1024  # the driver's 1 KiB and the DSL's static 1 KiB

    @property
    def threads(self) -> int:
        return (THREADS + (self.producer_threads if self.warp_specialized else 0)
                + (PRODUCER_THREADS if self.publisher_warp or self.epilogue_warp else 0))

    @property
    def producer_threads(self) -> int:
        return PRODUCER_THREADS * self.producer_warps

    @property
    def producer_registers(self) -> int | None:
        """consumer_registers: the producer warpgroup's share of the CTA's pool during the main loop."""
        if self.consumer_registers is None:
            return None
        return (640 * WS_ENTRY_REGISTERS - THREADS * self.consumer_registers) // (32 * self.producer_warps)

    @property
    def max_stages(self) -> int:
        """The deepest ring that fits the shared memory (capped at 16)."""
        fixed = (16 * self.block_n * 4 + self.meta_bytes + (self.fused_bytes if self.fused_role2 else 0)
                 + self.sm_table_bytes + self.publish_bytes + self.tail_bytes + self.order_bytes
                 + (self.transpose_bytes + 128 if self.transposed_stores else 0)  # 128: its alignment
                 + (self.epilogue_bytes + 16 if self.epilogue_warp else 0))
        per_stage = self.stage_bytes + (16 if self.warp_specialized else 0)
        return min(16, (self.smem_limit - fixed) // per_stage)

    # shared-memory plan of one stage: [weights 4 x 4096][scales 4 x 256][B block_n x 128][act scales]
    @property
    def scale_offset(self) -> int:
        return TILES_PER_CTA * TILE_BYTES

    @property
    def b_offset(self) -> int:
        return self.scale_offset + TILES_PER_CTA * TILE_SCALE_BYTES

    @property
    def xs_offset(self) -> int:
        return self.b_offset + self.block_n * 128

    @property
    def xr_offset(self) -> int:
        """scale_ratios: the step's ratios s_(k-1) / s_k per token, after its (clamped) scales."""
        return self.xs_offset + self.block_n * 4

    @property
    def stage_bytes(self) -> int:
        return -(-(self.chunk_slot_offset + (TAIL_SLOT_BYTES if self.dynamic_tail else 0)) // 128) * 128

    @property
    def chunk_slot_offset(self) -> int:
        """dynamic_tail: the stage's chunk word (the claimed chunk whose first step the stage holds, -1: the end),
        after the activation scales."""
        return self.xs_offset + self.block_n * 4 * (2 if self.scale_ratios else 1)

    @property
    def amax_offset(self) -> int:
        return self.stages * self.stage_bytes

    @property
    def barrier_offset(self) -> int:
        """warp_specialized: the full mbarriers (one per stage), then the empty ones."""
        return self.meta_offset + self.meta_bytes

    @property
    def meta_offset(self) -> int:
        """lean_epilogue: the unit's per-token words (block_n) and the expert's factor, after the amax region."""
        return self.amax_offset + 16 * self.block_n * 4

    @property
    def meta_slot_bytes(self) -> int:
        """lean_epilogue with one unit at a time: the unit's per-token words and the expert's factor."""
        return -(-4 * (self.block_n + 1) // 16) * 16

    @property
    def meta_bytes(self) -> int:
        """lean_epilogue: one slot of staged words (persistent: two, by unit parity, and their two empty barriers)."""
        if not self.lean_epilogue or self.stream_k:
            return 0
        return 2 * self.meta_slot_bytes + 16 if self.persistent else self.meta_slot_bytes

    @property
    def sm_table_offset(self) -> int:
        """sm_weights: the two prefix tables (`load_sm_table`), after the barriers."""
        return self.ticket_offset

    @property
    def ticket_offset(self) -> int:
        """fused_role2: the unit slots (ticket, expert, weight-row CTA, token tile) thread 0 broadcasts through."""
        return self.barrier_offset + (16 * self.stages if self.warp_specialized else 0)

    @property
    def slot_barrier_offset(self) -> int:
        """fused_role2: an mbarrier per unit slot that the drawing producer thread completes once it wrote the
        slot, then one per slot that the consumer warps complete once they read it (`role2`)."""
        return self.ticket_offset + 16 * FUSED_UNIT_SLOTS

    @property
    def prefix_offset(self) -> int:
        """fused_role2: the experts' token-tile prefix (local experts + 1 words) of the persistent scheduler."""
        return self.slot_barrier_offset + 16 * FUSED_UNIT_SLOTS

    @property
    def scale_table_offset(self) -> int:
        """fused_role2 W2: the token tile's activation scales [block_n, K128 blocks] (read once per tile)."""
        return self.prefix_offset + -(-4 * (FUSED_MAX_LOCAL_EXPERTS + 1) // 16) * 16

    @property
    def fused_bytes(self) -> int:
        """fused_role2: unit slots and their barriers, the token-tile prefix, W2's scale table (independent of
        the stages)."""
        return (2 * 16 * FUSED_UNIT_SLOTS + -(-4 * (FUSED_MAX_LOCAL_EXPERTS + 1) // 16) * 16
                + 4 * self.block_n * FUSED_MAX_K_BLOCKS)

    @property
    def full_arrivals(self) -> int:
        """Arrivals that complete a stage's full barrier: the byte announcement, each producer thread's copies,
        and in a fused half producer thread 0's plain arrival (the W2 half publishes its scale stores with it);
        scale_ratios: each producer thread's plain arrival after its ratio and scale stores."""
        return (self.producer_threads * (2 if self.scale_ratios else 1) + 1 + (1 if self.fused_role2 else 0))

    @property
    def sm_table_bytes(self) -> int:
        """sm_weights: the weight prefix and the rank prefix over %smid, at `ticket_offset` (no fused role2 here)."""
        return 2 * SM_TABLE_BYTES if self.sm_weights else 0

    @property
    def publish_offset(self) -> int:
        """publisher_warp: the count of W1 units the consumers finished (thread 0 stores it, the publisher warp
        polls it), after everything else."""
        return self.ticket_offset + (self.fused_bytes if self.fused_role2 else 0) + self.sm_table_bytes

    @property
    def publish_bytes(self) -> int:
        return 16 if self.publisher_warp else 0

    @property
    def tail_offset(self) -> int:
        """dynamic_tail: the word through which consumer thread 0 tells the others that its chunk arrived last."""
        return self.publish_offset + self.publish_bytes

    @property
    def tail_bytes(self) -> int:
        return 16 if self.dynamic_tail else 0

    @property
    def order_offset(self) -> int:
        """snake_walk: the local experts in decreasing row count (one int32 each), after everything else."""
        return self.tail_offset + self.tail_bytes

    @property
    def order_bytes(self) -> int:
        return 4 * SNAKE_MAX_EXPERTS if self.snake_walk else 0

    @property
    def transpose_offset(self) -> int:
        """transposed_stores: each consumer warp's region for its 16-token chunks, after everything else."""
        return -(-(self.order_offset + self.order_bytes) // 128) * 128

    @property
    def transpose_bytes(self) -> int:
        """W1: the CTA's E4M3 rows (128 channels per token); W2: 16 tokens x 16 hidden values per consumer warp."""
        if not self.transposed_stores:
            return 0
        return self.block_n * 128 if self.role == "w1" else THREADS // 32 * TRANSPOSE_WARP_BYTES

    @property
    def epilogue_offset(self) -> int:
        """epilogue_warp: the slot the consumers hand a W1 unit to the epilogue warp through, after everything else:
        its full barrier (the 512 consumer threads' arrivals), its empty barrier (the warp's 32), the unit's header
        (first row, rows, weight-row CTA; rows -1: the CTA's last) and the SwiGLU values, 128 channels per token."""
        return -(-(self.order_offset + self.order_bytes) // 16) * 16

    @property
    def epilogue_bytes(self) -> int:
        return EPILOGUE_VALUES_OFFSET + self.block_n * 128 * 4 if self.epilogue_warp else 0

    @property
    def smem_bytes(self) -> int:
        if self.epilogue_warp:
            return self.epilogue_offset + self.epilogue_bytes
        if not self.transposed_stores:
            return self.order_offset + self.order_bytes
        return self.transpose_offset + self.transpose_bytes

    @property
    def wgmmas_per_wait(self) -> int:
        """K32 WGMMAs issued before one wait: bounded by the registers their fresh accumulators take.

        With folded scales the four K32 WGMMAs of a K128 step share one accumulator: one wait per step.
        """
        if self.fold_scales:
            return 4
        return {8: 4, 16: 4, 32: 2, 64: 1}[self.block_n]

    @property
    def pipelined(self) -> bool:
        """The consumers keep one WGMMA group in flight across scale FMAs (warp-specialized, unfolded)."""
        return self.warp_specialized and not self.fold_scales

    @property
    def table_pipelined(self) -> bool:
        """The table decode's consumers keep one K128 step's WGMMA chain in flight while they scale the step before
        (two accumulator buffers: up to bn 32, except bn 24, whose two CTAs per SM leave no registers for them; bn 64
        waits for each chain)."""
        return (self.warp_specialized and self.table_decode and self.block_n <= WS_MAX_BLOCK_N
                and self.block_n not in TABLE_TWO_CTA_BLOCK_N and not self.persistent)

    @property
    def wgmmas_per_group(self) -> int:
        """pipelined: K32 WGMMAs per group, so that a group's fresh partials take 32 registers at every bn (step_group:
        the whole K128 step, 16 at bn 8)."""
        if self.step_group:
            return 4
        return 2 if self.block_n <= 16 else 1

    @property
    def params(self):
        tail = STREAM_PARAMS if self.stream_k else SPLIT_PARAMS if self.k_splits > 1 else ()
        if self.tma_tokens:
            tail += TOKEN_MAP_PARAMS
        if self.handover:
            tail += HANDOVER_PARAMS_W1 if self.role == "w1" else HANDOVER_PARAMS_W2
        if self.persistent:
            tail += PERSIST_PARAMS
        if self.role == "w1":
            return PARAMS_W1 + (RING_PARAMS_W1 if self.ring_consumer else ()) + tail
        return PARAMS_W2 + (RING_PARAMS_W2 if self.ring_consumer else ()) + tail

    @property
    def name(self) -> str:
        s = f"sm90_grouped_gemm_{self.role}_n{self.block_n}_s{self.stages}"
        if self.role == "w1":
            s += f"_a{self.swiglu_alpha:g}_c{self.swiglu_clamp:g}"
        if self.fold_scales:
            s += "_tab" if self.table_decode else "_fold"
        if self.fit_n:
            s += "_fit"
        if self.compact_grid:
            s += "_compact"
        if self.k_splits > 1:
            s += f"_k{self.k_splits}"
        if self.stream_k:
            s += ("_skp" + ("t" if self.trace else "") + ("w" if self.sm_weights else "") if self.stream_pair
                  else "_skt" if self.trace else "_sk") + ("_ho" if self.handover else "")
            s += ("_wf" if self.words_first else "") + ("_pub" if self.publisher_warp else "")
            s += "_tag" if self.tagged_pieces else ""
            s += f"_e{self.w2_early_stages}" if self.w2_early_stages is not None else ""
            s += "_quick" if self.quick_start else ""
            s += "_lring" if self.lean_ring else ""
            s += "_tmat" if self.tma_tokens else ""
            s += "_dtail" if self.dynamic_tail else ""
            s += "_escl" if self.early_scales else ""
            s += "_amxs" if self.amax_slots else ""
            s += "_epw" if self.epilogue_warp else ""
        if self.lean_epilogue:
            s += "_lean"
        if self.persistent:
            s += "_pers" + ("_snake" if self.snake_walk else "") + ("_ratio" if self.scale_ratios else "")
        if self.transposed_stores:
            s += "_tst"
        if self.early_rows:
            s += "_early"
        if self.ring_consumer:
            s += "_ring"
        if self.fused_role2:
            s += "_fused"
        if self.warp_specialized:
            s += "_ws" if self.ctas_per_sm == 1 else f"_ws{self.ctas_per_sm}"
            if self.producer_warps != 1:
                s += f"_p{self.producer_warps}"
            if self.consumer_registers is not None:
                s += f"_r{self.consumer_registers}"
            if self.wait_suspend_ns != WAIT_SUSPEND_NS:
                s += f"_sus{self.wait_suspend_ns}"
        return s


# ---------------------------------------------------------------------------------------------- folded decode
# Plain integer arithmetic on 32-bit words (& | << >> + *, constants through `u32`): traced with u32=Uint32
# inside the kernel (ptx.decode_fp4x4_folded) and run with u32=int on torch int64 tensors by the CPU proof,
# so the emulation is the kernel's own expression, not a second copy of it.
def fold_exponent_step(scale_word, byte: int, u32=int):
    """Byte `byte` of a packed K32 scale word (d + 133, d in 0..11) -> 8 (d + 1): the E4M3 exponent-field
    add that scales a decoded code by 2^(d + 1) relative to its unscaled encoding below."""
    b = (scale_word >> (8 * byte)) & u32(0xFF)
    return (b - u32(SCALE_BYTE_OFFSET - 1)) << 3


def decode_fp4x4_folded(w, step, high: bool, u32=int):
    """The four low (or high) nibbles of w, E2M1 codes (sign, e1 e0, m), -> four E4M3 bytes of
    value * 2^(d - 5) where step = 8 (d + 1) (fold_exponent_step), d in 0..11.

    Code n with e = e1 e0 != 0 is 2^(e-1) (1 + m/2): its E4M3 byte is (e + d + 1) << 3 | m << 2, i.e. the
    magnitude bits n << 2 plus the exponent step. Code 1 (0.5, the E2M1 subnormal) is 2^(d-6), an E4M3
    normal with exponent field d + 1 and no mantissa: its m bit is dropped before the add. Code 0 stays 0
    (no add). Per byte the magnitude is at most 28 + 96 = 124, so no add carries into the sign or the next byte.
    """
    x = (w >> 4) if high else w  # the wanted nibble in bits 0..3 of each byte; bits 4..7 are masked below
    exp_nonzero = ((x >> 1) | (x >> 2)) & u32(0x01010101)  # e1 | e0 per byte
    nonzero = (x & u32(0x01010101)) | exp_nonzero  # m | e1 | e0
    magnitude = x & (u32(0x06060606) | exp_nonzero)  # m kept only where e != 0 (drops code 1's m)
    sign = (x & u32(0x08080808)) << 4
    return sign | ((magnitude << 2) + nonzero * step)


# table_decode: plain integer arithmetic as above; the byte permute comes in as `prmt(a, b, selector)` (PTX
# prmt.b32's default mode: result byte i = byte selector[4i..4i+2] of the pair (a: 0..3, b: 4..7))
def decode_table(scale_word, byte: int, u32=int, byte_of=None):
    """Byte `byte` of a packed K32 scale word (d + 133, d in 0..11) -> the block's (low, high) table words: the
    E4M3 bytes of the magnitudes 0, 0.5, 1, 1.5 / 2, 3, 4, 6 times 2^(d - 5). Per byte at most 88 + 0x24, no
    carry between bytes. byte_of(word, byte): the kernel's one-instruction byte extract for the middle bytes."""
    if byte_of is not None and byte in (1, 2):
        d = byte_of(scale_word, byte) - u32(SCALE_BYTE_OFFSET)
    else:
        d = ((scale_word >> (8 * byte)) & u32(0xFF)) - u32(SCALE_BYTE_OFFSET)
    return d * u32(TABLE_STEP_LOW) + u32(TABLE_LOW), d * u32(TABLE_STEP_HIGH) + u32(TABLE_HIGH)


def decode_fp4x8_table(w, table_lo, table_hi, prmt, u32=int):
    """A word of eight codes in weights.sm90's "table" nibble order -> (row g, row g + 8) A registers: four E4M3
    bytes each of value * 2^(d - 5), the rows' tables (decode_table) picked by the magnitude bits (bits 0..2 of
    each nibble; bit 3 cleared, else prmt would replicate a sign), the signs masked into bit 7 of each byte."""
    m = w & u32(0x77777777)
    lo = prmt(table_lo[0], table_lo[1], m) | (w & u32(0x80808080))
    hi = prmt(table_hi[0], table_hi[1], m >> 16) | ((w << 4) & u32(0x80808080))
    return lo, hi


def decode_fp4x8_split(w, u32=int):
    """A word of eight codes in weights.sm90's "split" nibble order -> (row g, row g + 8) A registers: four E4M3
    bytes each of value / 64. Row g's bits already sit where E4M3 wants them (one mask); row g + 8's bits 0..1 and
    5 move up by two, its bit 6 down by two (two shifts, a mask, a mask-and-or)."""
    return w & u32(0x9C9C9C9C), ((w & u32(0x23232323)) << 2) | ((w >> 2) & u32(0x10101010))  # no carry past bit 31


def stream_ctas(ctas: int, work: int) -> int:
    """The stream_k CTAs of a launch of `ctas` that get steps: at most one per step, so that every range is
    nonempty and a unit's pieces are consecutive CTAs (the others exit). Host ints; the kernel computes the same."""
    return min(ctas, work)


def stream_range(cta, ctas, work):
    """The K128 steps [first, end) of stream_k CTA `cta` < ctas (= stream_ctas) sharing `work` steps: at least one
    each (host ints or DSL values)."""
    return (cta * work) // ctas, ((cta + 1) * work) // ctas


def division_magic(d: int) -> int:
    """The host's ptx.division_magic: floor((2^32 - 1) / d) for d >= 1."""
    return 0xFFFFFFFF // d


def divide_by_magic(n: int, d: int, magic: int) -> int:
    """The host's ptx.divide_by_magic (the same steps): floor(n / d) for 0 <= n < 2^31, magic = division_magic(d)."""
    q = (n * magic) >> 32
    return q + 1 if n - q * d >= d else q


def stream_owner(step, ctas, work):
    """The stream_k CTA whose steps (stream_range, same ctas) hold `step` (host ints or DSL values)."""
    return ((step + 1) * ctas - 1) // work


def stream_segments(units: int, k_blocks: int, ctas: int) -> list:
    """Per CTA of a stream_k launch of `ctas` over `units` units of `k_blocks` steps: its segments as the kernel
    walks them, [(steps, kind)], kind "whole" (the unit's steps all here), "owner" (its first steps: the CTA adds the
    other pieces) or "piece"; [] for a CTA without steps."""
    work = units * k_blocks
    working = stream_ctas(ctas, work)
    return [range_segments(*stream_range(cta, working, work), k_blocks) if cta < working else []
            for cta in range(ctas)]


def range_segments(first: int, end: int, k_blocks: int) -> list:
    """The segments of the K128 steps [first, end) of a stream_k range over units of `k_blocks` steps, as the
    kernel walks them: [(steps, kind)] (`stream_segments`)."""
    segments = []
    while first < end:
        unit, k_first = divmod(first, k_blocks)
        steps = min(end - unit * k_blocks, k_blocks) - k_first
        segments.append((steps, "whole" if steps == k_blocks else "owner" if k_first == 0 else "piece"))
        first += steps
    return segments


def grid(cfg: GemmConfig, rows: int, local_experts: int, capacity: int, sms: int | None = None) -> tuple[int, int, int]:
    """Launch grid for M = rows weight rows, `capacity` = the most tokens one expert may receive; a stream_k
    variant's: ctas_per_sm x sms CTAs (the SMs of the device or green context it runs on); a persistent one's: as
    many, at most one per unit of the unit grid."""
    if rows % ROWS_PER_CTA:
        raise ValueError(f"weight rows {rows} must be a multiple of {ROWS_PER_CTA}")
    if cfg.stream_k:
        if sms is None or sms < 1:
            raise ValueError(f"a stream_k variant's grid is ctas_per_sm x SMs: pass sms >= 1, got {sms}")
        return cfg.ctas_per_sm * sms, 1, 1
    token_tiles = max(1, -(-capacity // cfg.block_n))
    if cfg.persistent:
        if sms is None or sms < 1:
            raise ValueError(f"a persistent variant's grid is ctas_per_sm x SMs: pass sms >= 1, got {sms}")
        return min(cfg.ctas_per_sm * sms, token_tiles * (rows // ROWS_PER_CTA) * local_experts), 1, 1
    if cfg.token_tiles_fastest:  # k_splits: the splits of a token tile are its neighbours in x
        return token_tiles * cfg.k_splits, rows // ROWS_PER_CTA, local_experts
    return rows // ROWS_PER_CTA, local_experts, token_tiles


# ---------------------------------------------------------------------------------------------- ring consumer (host)
def tile_rows(expert_offsets: list[int], expert: int, tile: int, block_n: int) -> tuple[int, int]:
    """(first grouped row, rows) W1's token tile `tile` of local expert `expert` reads; rows 0: the CTA exits."""
    first = expert_offsets[expert] + tile * block_n
    return first, max(0, min(block_n, expert_offsets[expert + 1] - first))


def ring_tile_waits(expert_offsets: list[int], block_n: int, block_m: int, ring_blocks: int) -> dict:
    """What each W1 token tile with rows waits for before its first copy: {(expert, tile): [(ring block,
    l1_full_count it must reach)]}, one entry per logical block of ring_block_m rows its rows touch."""
    from gc_moe.kernels.sm90 import layer_layout as ll

    waits = {}
    for expert in range(len(expert_offsets) - 1):
        tile = 0
        while True:
            first, rows = tile_rows(expert_offsets, expert, tile, block_n)
            if rows == 0:
                break
            slots = [ll.ring_slot(b, ring_blocks) for b in ll.blocks_of_tile(first, rows, block_m)]
            waits[(expert, tile)] = [(b, ll.expected_l1_full_count(g, block_m)) for b, g in slots]
            tile += 1
    return waits


def expected_l1_empty_counts(expert_offsets: list[int], block_n: int, block_m: int, ring_blocks: int,
                             weight_row_ctas: int) -> list[int]:
    """l1_empty_count per ring block once W1 ran: every CTA (token tile x weight-row CTA) adds 1 on each ring
    block its tile read; weight_row_ctas = W1 rows / 256."""
    counts = [0] * ring_blocks
    for blocks in ring_tile_waits(expert_offsets, block_n, block_m, ring_blocks).values():
        for b, _ in blocks:
            counts[b] += weight_row_ctas
    return counts


# ---------------------------------------------------------------------------------------------- kernel
@dataclass(frozen=True)
class StreamHalf:
    """The device functions of a stream_pair half (`_make_kernel`): the pair kernel calls them in order."""
    thread_coords: object
    init_stage_ring: object
    unit_table: object
    stream_walk: object
    load_sm_table: object
    sm_rank: object
    trace_slots: object
    trace_scanned: object
    trace_tail: object
    publish_walk: object


def _make_kernel(cfg: GemmConfig):
    import cutlass  # the CuTe DSL is needed to build only; launching needs the cubin and the driver
    from cutlass import Float32, Int32, Int64, Uint32, cute

    from gc_moe.kernels.sm90 import ptx

    BN = cfg.block_n
    STAGES = cfg.stages
    NSUB = BN // 8
    NP = cfg.wgmmas_per_wait
    W1 = cfg.role == "w1"
    RING = cfg.ring_consumer
    WS = cfg.warp_specialized
    PT = cfg.producer_threads
    PW = cfg.producer_warps
    B_PIECES_PER_THREAD = -(-BN * 8 // PT)  # 16-byte pieces of the token tile per producer thread
    SUSPEND = cfg.wait_suspend_ns
    FUSED = cfg.fused_role2
    REUSE = cfg.ring_reuse
    KS = cfg.k_splits
    STREAM = cfg.stream_k
    PAIR = cfg.stream_pair  # a half of the stream-K pair kernel: `stream_walk` with its hand-over words
    HANDOVER = cfg.handover  # the stand-alone stream_k pair's hand-over words (W1 publishes, W2 takes permits)
    WORDS_FIRST = cfg.words_first  # a hand-over W2 segment's words before its weights where W1 set them already
    PUBLISHER = cfg.publisher_warp  # the pair's W1 words released by a warp of their own (`publish_walk`)
    WEIGHTED = cfg.sm_weights  # its ranges by per-SM weights (`load_sm_table`, `weighted_range`, `weighted_owner`)
    LEAN = cfg.lean_epilogue  # a = (w_codes, w_scales, act, act_scale, per-token words, w_factor)
    TRACE = cfg.trace
    SPLIT = cfg.consumer_registers is not None
    PERSIST = cfg.persistent  # the table decode's persistent grid (`persistent_body`)
    SNAKE = cfg.snake_walk  # its walk: experts by decreasing rows, rounds in alternating direction
    RATIOS = cfg.scale_ratios  # its sums in units of the step's activation scale (in-place chains)
    TRANSPOSED = cfg.transposed_stores  # the lean epilogue's outputs through shared memory, 16-byte stores
    EARLY_ROWS = cfg.early_rows  # the lean W2's combine rows all loaded before its value stores
    TAGGED = cfg.tagged_pieces  # stream_k pieces published without a fence into slots that start empty
    QUICK = cfg.quick_start  # stream_k: the walk's first unit without divisions or a serial lookup
    LEAN_RING = cfg.lean_ring  # stream_k: the ring's bases warp-uniform, the consumers' waits trying first
    EARLY_SCALES = cfg.early_scales  # stream_k: a step's scales loaded once after its wait, held in registers
    AMAX_SLOTS = cfg.amax_slots  # stream_k W1: the amax per token in one of three slot sets, one barrier per unit
    EPI_WARP = cfg.epilogue_warp  # stream_k W1: the unit epilogues' amax and stores in a warp of their own
    EPI_TID = THREADS + cfg.producer_threads  # that warp's first thread
    TMA_TOKENS = cfg.tma_tokens  # stream_k: a = (..., act_scale, token_map): the token tile by one tensor-map copy
    STAGE_TX = STAGE_TX_BYTES + (BN * 128 if TMA_TOKENS else 0)  # the bytes a full barrier's phase waits for
    DYN_TAIL = cfg.dynamic_tail  # stream_k: the last units' steps in chunks claimed by ticket (`stream_walk`)
    W2_EARLY = STAGES // 2 if cfg.w2_early_stages is None else cfg.w2_early_stages  # weights before W1's grid
    # the fused W2 half reads its activation scales with coherent loads and stores them itself: one more
    # arrival on each full barrier (producer thread 0's, after the stores), which publishes them to the consumers.
    # The persistent role2 loop keeps its stage barriers across units of both halves, so the fused W1 half
    # arrives that once more too (a plain arrival after its copies)
    FULL_ARRIVALS = cfg.full_arrivals

    @cute.jit
    def issue_stage(smem, stage, kb, e, bx, tid, wg, t, row0, count, k_blocks, m_tiles, a, policy):
        w_codes, w_scales, act, act_scale = a
        sbase = smem + stage * cfg.stage_bytes
        tile = Int64((e * m_tiles + bx * TILES_PER_CTA + wg) * k_blocks + kb)
        src = w_codes + tile * TILE_BYTES + Int64(t * 32)
        dst = sbase + wg * TILE_BYTES + t * 32
        ptx.cp_async_16_weights(dst, src, policy)
        ptx.cp_async_16_weights(dst + 16, src + Int64(16), policy)
        if tid < TILES_PER_CTA * 16:
            stile = Int64((e * m_tiles + bx * TILES_PER_CTA + tid // 16) * k_blocks + kb)
            ptx.cp_async_16_weights(
                sbase + cfg.scale_offset + tid * 16, w_scales + stile * TILE_SCALE_BYTES + Int64((tid % 16) * 16),
                policy,
            )
        if tid < BN * 8:
            n_lo = tid % 8
            c = (tid // 8) % 8
            ng = tid // 64
            n = ng * 8 + n_lo
            ok = n < count
            nrow = Int64(row0) + Int64(n)
            if not ok:
                nrow = Int64(row0)
            src_b = act + nrow * Int64(k_blocks * 128) + Int64(kb * 128 + c * 16)
            nbytes = Int32(16)
            if not ok:
                nbytes = Int32(0)
            ptx.cp_async_16_zfill(sbase + cfg.b_offset + (ng * 8 + c) * 128 + n_lo * 16, src_b, nbytes)
        if tid < BN:
            ok = tid < count
            nrow = Int64(row0) + Int64(tid)
            if not ok:
                nrow = Int64(row0)
            nbytes = Int32(4)
            if not ok:
                nbytes = Int32(0)
            ptx.cp_async_4_zfill(
                sbase + cfg.xs_offset + tid * 4, act_scale + (nrow * Int64(k_blocks) + Int64(kb)) * 4, nbytes
            )

    @cute.jit
    def compute_stage(smem, stage, wg, t, warp, g, q, acc):
        sbase = smem + stage * cfg.stage_bytes
        wa = sbase + wg * TILE_BYTES + t * 32
        words = ptx.lds128(wa) + ptx.lds128(wa + 16)
        srow = sbase + cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4
        sc_lo = ptx.lds32(srow)
        sc_hi = ptx.lds32(srow + 32)
        xs = [ptx.lds_f32x2(sbase + cfg.xs_offset + (8 * i + 2 * q) * 4) for i in range(NSUB)]
        for grp in cutlass.range_constexpr(4 // NP):
            a_regs = []
            descs = []
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj
                w_k0, w_k16 = words[2 * j], words[2 * j + 1]
                a_regs += [
                    ptx.decode_fp4x4_low(w_k0), ptx.decode_fp4x4_high(w_k0),
                    ptx.decode_fp4x4_low(w_k16), ptx.decode_fp4x4_high(w_k16),
                ]
                descs.append(ptx.smem_desc_kmajor(sbase + cfg.b_offset + j * 256, 128, 1024))
            ptx.wgmma_fence()
            part = ptx.wgmma_rs_e4m3_batch(BN, a_regs, descs)
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj
                s_lo = ptx.ue8m0_byte_to_f32(sc_lo, j)
                s_hi = ptx.ue8m0_byte_to_f32(sc_hi, j)
                for i in cutlass.range_constexpr(NSUB):
                    p = part[jj * (BN // 2) + 4 * i: jj * (BN // 2) + 4 * i + 4]
                    acc[4 * i + 0] = acc[4 * i + 0] + p[0] * (s_lo * xs[i][0])
                    acc[4 * i + 1] = acc[4 * i + 1] + p[1] * (s_lo * xs[i][1])
                    acc[4 * i + 2] = acc[4 * i + 2] + p[2] * (s_hi * xs[i][0])
                    acc[4 * i + 3] = acc[4 * i + 3] + p[3] * (s_hi * xs[i][1])

    @cute.jit
    def table_fragment(sbase, a_off, s_off):
        """The thread's 16 A registers of a K128 step through the table decode: its two 16-byte loads of codes
        (table nibble order: bytes 16 t and 2048 + 16 t of its warpgroup's tile, no bank conflict), its rows' K32
        scale words (row g at s_off, row g + 8 32 bytes on) and per K32 block the two rows' tables."""
        wa = sbase + a_off
        words = ptx.lds128(wa) + ptx.lds128(wa + TILE_BYTES // 2)
        return ptx.decode_fragment_table(words, ptx.lds32(sbase + s_off), ptx.lds32(sbase + s_off + 32))

    @cute.jit
    def compute_stage_folded(smem, stage, wg, t, warp, g, q, acc):
        sbase = smem + stage * cfg.stage_bytes
        if cutlass.const_expr(cfg.table_decode):
            srow = sbase + cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4
            a_regs = table_fragment(sbase, wg * TILE_BYTES + t * 16, srow - sbase)
            descs = [ptx.smem_desc_kmajor(sbase + cfg.b_offset + j * 256, 128, 1024) for j in range(4)]
        else:
            wa = sbase + wg * TILE_BYTES + t * 32
            words = ptx.lds128(wa) + ptx.lds128(wa + 16)
            srow = sbase + cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4
            sc_lo = ptx.lds32(srow)
            sc_hi = ptx.lds32(srow + 32)
            a_regs = []
            descs = []
            for j in cutlass.range_constexpr(4):
                step_lo = ptx.fold_exponent_step(sc_lo, j)
                step_hi = ptx.fold_exponent_step(sc_hi, j)
                w_k0, w_k16 = words[2 * j], words[2 * j + 1]
                a_regs += [
                    ptx.decode_fp4x4_folded(w_k0, step_lo, False), ptx.decode_fp4x4_folded(w_k0, step_hi, True),
                    ptx.decode_fp4x4_folded(w_k16, step_lo, False), ptx.decode_fp4x4_folded(w_k16, step_hi, True),
                ]
                descs.append(ptx.smem_desc_kmajor(sbase + cfg.b_offset + j * 256, 128, 1024))
        ptx.wgmma_fence()
        part = ptx.wgmma_rs_e4m3_chain(BN, a_regs, descs)
        xs = [ptx.lds_f32x2(sbase + cfg.xs_offset + (8 * i + 2 * q) * 4) for i in range(NSUB)]
        for i in cutlass.range_constexpr(NSUB):
            for c in cutlass.range_constexpr(4):
                acc[4 * i + c] = acc[4 * i + c] + part[4 * i + c] * xs[i][c % 2]

    @cute.jit
    def stream_sources(a, e, bx, row0, count, k_blocks, m_tiles, pidx, ring_rows=None, k_first=None):
        """What a producer thread's copies read, computed once per unit (none of it changes along K): the
        CTA's weight and scale streams and strides, its 16-byte pieces of the token tile (source, bytes,
        destination offset; rows past the expert's count zero-filled) and its activation-scale words.
        ring_rows: a reused ring's rows (grouped row r lives in ring row r mod ring_rows), else None. k_first:
        the unit's first K128 step when K is split (k_splits), else None (step 0). tma_tokens: the token tile's
        sources are (the tensor map a[4], the tile's first row, the first K128 step) instead of the pieces."""
        w_codes, w_scales, act, act_scale = a[:4]
        first_row = Int64(row0)
        if cutlass.const_expr(ring_rows is not None):
            first_row = Int64(row0 % ring_rows)  # a tile's rows are < ring_rows: one wrap at most
        first_tile = Int64((e * m_tiles + bx * TILES_PER_CTA) * k_blocks)
        w_src = w_codes + first_tile * TILE_BYTES
        s_src = w_scales + first_tile * TILE_SCALE_BYTES
        tile_stride = Int64(k_blocks) * TILE_BYTES  # between the CTA's 4 weight tiles at one K step
        scale_stride = Int64(k_blocks) * TILE_SCALE_BYTES
        row_bytes = Int64(k_blocks * 128)
        b_src, b_bytes, b_dst = [], [], []
        for r in cutlass.range_constexpr(0 if TMA_TOKENS else B_PIECES_PER_THREAD):
            idx = pidx + PT * r
            n_lo = idx % 8
            c = (idx // 8) % 8
            ng = idx // 64
            n = ng * 8 + n_lo
            nrow = first_row + Int64(n)
            nbytes = Int32(16)
            if n >= count:
                nrow = first_row
                nbytes = Int32(0)
            if cutlass.const_expr(ring_rows is not None):
                if nrow >= Int64(ring_rows):
                    nrow = nrow - Int64(ring_rows)
            b_src.append(act + nrow * row_bytes + Int64(c * 16))
            b_bytes.append(nbytes)
            b_dst.append(cfg.b_offset + (ng * 8 + c) * 128 + n_lo * 16)
        x_src, x_bytes = [], []
        for r in cutlass.range_constexpr(-(-BN // PT)):
            n = pidx + PT * r
            nrow = first_row + Int64(n)
            nbytes = Int32(4)
            if n >= count:
                nrow = first_row
                nbytes = Int32(0)
            if cutlass.const_expr(ring_rows is not None):
                if nrow >= Int64(ring_rows):
                    nrow = nrow - Int64(ring_rows)
            x_src.append(act_scale + nrow * Int64(k_blocks) * 4)
            x_bytes.append(nbytes)
        if cutlass.const_expr(k_first is not None):  # this split's K128 steps start at k_first
            w_src = w_src + Int64(k_first) * TILE_BYTES
            s_src = s_src + Int64(k_first) * TILE_SCALE_BYTES
            b_src = [src + Int64(k_first) * 128 for src in b_src]
            x_src = [src + Int64(k_first) * 4 for src in x_src]
        rows_in = (b_src, b_bytes, b_dst)
        if cutlass.const_expr(TMA_TOKENS):
            rows_in = (a[4], Int32(row0), Int32(0) if k_first is None else Int32(k_first))
        return (w_src, s_src, tile_stride, scale_stride), rows_in, (x_src, x_bytes)

    @cute.jit
    def copy_token_scales(sbase, kb, x_src, x_bytes, pidx):
        """Stage kb's activation scales (one 4-byte cp.async per token row, zero-filled past the count)."""
        for r in cutlass.range_constexpr(-(-BN // PT)):
            if pidx + PT * r < BN:
                ptx.cp_async_4_zfill(sbase + cfg.xs_offset + (pidx + PT * r) * 4, x_src[r] + Int64(kb * 4),
                                     x_bytes[r])

    @cute.jit
    def token_row(row0, n, count):
        """The grouped row of the tile's token n, or row0 past the tile's count (a valid address whose value is not
        used: zero-filled copies, epilogue values that are never stored)."""
        nrow = Int64(row0) + Int64(n)
        if n >= count:
            nrow = Int64(row0)
        return nrow

    @cute.jit
    def stage_epilogue_words(words, w_factor, e, row0, count, smem, pidx, meta=None):
        """lean_epilogue: before the unit's first stage is announced, the producer threads copy the tile's per-token
        words (4 bytes per grouped row from `words`: W1's routing weights, W2's combine rows; zero past the count)
        and the expert's factor into the shared words at cfg.meta_offset. They complete with the thread's first
        stage (its cp.async arrival on that full barrier tracks every copy it issued before), which every consumer
        thread waits for before its first step. meta: where the words go (persistent: the unit's slot), else
        cfg.meta_offset."""
        if cutlass.const_expr(meta is None):
            meta = smem + cfg.meta_offset
        for r in cutlass.range_constexpr(-(-BN // PT)):
            n = pidx + PT * r
            if n < BN:
                nbytes = Int32(4)
                if n >= count:
                    nbytes = Int32(0)
                ptx.cp_async_4_zfill(meta + n * 4, words + token_row(row0, n, count) * 4, nbytes)
        if pidx == 0:
            ptx.cp_async_4_zfill(meta + BN * 4, w_factor + Int64(e) * 4, Int32(4))

    @cute.jit
    def weights_then_words(smem, k_steps, base, weights, ready_words, pidx, mine):
        """A hand-over W2 segment's producer while W1 may still run: the weights of its first stages (up to half the
        ring) as the consumers free them, then the segment's words (bounded polls, one permit per lane, a fence).
        Returns those stages' count: their rows are still to be copied."""
        w_src, s_src, tile_stride, scale_stride = weights
        early = k_steps
        if early > STAGES // 2:
            early = Int32(STAGES // 2)
        for kb in cutlass.range(early):
            step = base + kb
            if step >= STAGES:
                ptx.mbarrier_wait(smem + cfg.barrier_offset + (STAGES + step % STAGES) * 8,
                                  empty_parity(step, STAGES), suspend_ns=SUSPEND)
            issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, step % STAGES)
        # the producer warp's own named barrier, not bar.warp.sync: with bar.warp.sync here ptxas kept the ring's
        # stage index in vector registers in every K loop of the kernel (docs/sm90-grouped-gemm.md, step 40); a
        # bar.sync among the warp's 32 threads orders their memory accesses as well
        ptx.named_barrier_sync(ptx.PRODUCER_WARP_BARRIER, 32)  # the vote inside wants the whole warp
        ptx.take_permits_warp(ready_words + Int64(pidx) * 4, mine)
        ptx.named_barrier_sync(ptx.PRODUCER_WARP_BARRIER, 32)  # every lane's acquire before any lane's copies
        return early

    @cute.jit
    def produce(a, e, bx, row0, count, k_blocks, m_tiles, smem, pidx, ksplit=None, base=None, trace_seg=None,
                ready_words=None, wait_stamp=None, chunk=None):
        """The producer warp(s): per K128 step wait for the stage to be empty; pidx 0 announces the bulk bytes and
        issues the 8 bulk copies (4 weight tiles, their scale bytes: addresses from warp-uniform values, so
        ptxas issues them without a per-pidx loop); every pidx copies its 16-byte pieces of the token tile
        (cp.async, rows past the expert's count zero-filled) and its activation scales, then arrives on full.
        pidx: the thread's index among the producer threads (one or more warps). ksplit: (first K128 step, steps)
        of a split unit (k_splits, stream_k), else None (all k_blocks). base: a stream_k CTA's steps before this
        unit (its stages and phases run on across units; the caller waits for the copies at the end), else None.
        trace_seg (a traced stream_k segment's slots): pidx 0 stores the cycles it waited for empty stages.

        A stream_k W2's first segment (base 0) issues the weights of its first stages (up to half the ring), then
        waits for the grids it depends on (`griddepcontrol.wait`: W1 when launched with
        launch_w2(programmatic=True); at once otherwise) before it copies any row of W1's output.

        The pair kernel's W2 half (ready_words: the hand-over words of this segment's K128 steps, one per step) does
        that at every segment: the weights of its first steps (up to half the ring) go out as their stages free,
        then lane kb polls word kb until W1's unit kb of this token tile has published its rows (bounded), takes
        one permit (the words return to zero by the launch's end) and the warp acquires (one fence), then the
        rows follow. words_first: the segment's words first, once; where all are set, each lane takes its permit
        with an acquire atomic and the weights and rows go out together, stage by stage. chunk (dynamic_tail): the
        claimed chunk this segment is, which pidx 0 writes into its first stage's chunk word before the stage's
        byte announcement (whose release publishes it to the consumers' wait)."""
        k_first, k_steps = (None, k_blocks) if ksplit is None else ksplit
        waited = Int32(0)
        weights, rows_in, scales_in = stream_sources(a, e, bx, row0, count, k_blocks, m_tiles, pidx,
                                                     k_first=k_first)
        w_src, s_src, tile_stride, scale_stride = weights
        x_src, x_bytes = scales_in
        if cutlass.const_expr(trace_seg is not None and W1 and base is not None and not PAIR):  # noqa: SIM102
            if pidx == 0 and base == 0:  # the CTA's first copies' sources are known: the tail's slot 6
                ptx.stamp_times(trace_seg + Int64(16 * (TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + 6)))
        early = Int32(0)  # steps whose weights went out before the wait
        if cutlass.const_expr(LEAN and not STREAM and not PERSIST):  # persistent: per unit slot (`persistent_body`)
            stage_epilogue_words(a[4], a[5], e, row0, count, smem, pidx)
        if cutlass.const_expr((PAIR or HANDOVER) and not W1):
            # lane kb: step kb's word (one producer warp, at most 32 K128 steps: the host checks); the acquire
            # leaves no L1 line from before it, so the scales' cached copies below read what W1 wrote
            mine = Int32(0)
            if pidx < k_steps:
                mine = Int32(1)
            if cutlass.const_expr(WORDS_FIRST):
                ptx.named_barrier_sync(ptx.PRODUCER_WARP_BARRIER, 32)  # the vote inside wants the whole warp
                taken = ptx.try_take_permits_warp(ready_words + Int64(pidx) * 4, mine)
                ptx.named_barrier_sync(ptx.PRODUCER_WARP_BARRIER, 32)  # every lane's acquire before any copies
                if taken == 0:  # W1 still runs: the weights of the first stages go out while it finishes
                    early = weights_then_words(smem, k_steps, base, weights, ready_words, pidx, mine)
                # else W1 set them already: every stage below goes out with its rows (early stays 0)
            else:
                early = weights_then_words(smem, k_steps, base, weights, ready_words, pidx, mine)
            if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
                if pidx == 0 and wait_stamp != 0:  # the walk's first segment: when its rows could go out
                    ptx.stamp_times(wait_stamp)
            for kb in cutlass.range(early):
                copy_stage_inputs(smem, kb, (base + kb) % STAGES, rows_in, scales_in, pidx)
        if cutlass.const_expr(STREAM and not W1 and base is not None and not PAIR and not HANDOVER):  # noqa: SIM102
            if base == 0:  # the CTA's first steps: stages 0.., no empty waits
                # half the ring: stage 0 completes only once the weights ahead of its rows have landed, and a full
                # ring of them left the memory idle until the consumers freed stage 0 (W2 alone ~3 us slower)
                early = k_steps
                if early > W2_EARLY:
                    early = Int32(W2_EARLY)
                for kb in cutlass.range(early):
                    issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, kb)
                ptx.griddepcontrol_wait()
                if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
                    if pidx == 0:  # segment 0's slots: the tail's last slot is TRACE_SEGMENTS segments and 3 slots on
                        ptx.stamp_times(trace_seg + Int64(16 * (TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + 3)))
                for kb in cutlass.range(early):
                    copy_stage_inputs(smem, kb, kb, rows_in, scales_in, pidx)
        scale_next = Float32(0.0)  # scale_ratios: this thread's token's scale of the step to come (loaded a step ahead)
        scale_prev = Float32(0.0)
        if cutlass.const_expr(RATIOS):  # noqa: SIM102 (a trace-time branch around a device one)
            if pidx < BN and x_bytes[0] != 0:
                scale_next = ptx.ldg_f32(x_src[0])
        for kb in cutlass.range(early, k_steps):
            step = kb if cutlass.const_expr(base is None) else base + kb
            stage = step % STAGES
            full = smem + cfg.barrier_offset + stage * 8
            sbase = smem + stage * cfg.stage_bytes
            if step >= STAGES:
                if cutlass.const_expr(trace_seg is not None):
                    waited = waited + ptx.mbarrier_wait_cycles(full + STAGES * 8, empty_parity(step, STAGES))
                else:
                    ptx.mbarrier_wait(full + STAGES * 8, empty_parity(step, STAGES), suspend_ns=SUSPEND)
            if cutlass.const_expr(chunk is not None):  # noqa: SIM102 (a trace-time branch around a device one)
                if pidx == 0 and kb == 0:  # a tail chunk's first stage names it (a chunk never starts at base 0)
                    ptx.sts_s32(sbase + cfg.chunk_slot_offset, chunk)
            issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, stage)
            copy_token_rows(smem, kb, rows_in, pidx, stage)
            if cutlass.const_expr(RATIOS):
                scale_prev = stage_scale_ratio(sbase, kb, pidx, scale_next, scale_prev)
                if pidx < BN and x_bytes[0] != 0 and kb + 1 < k_steps:
                    scale_next = ptx.ldg_f32(x_src[0] + Int64((kb + 1) * 4))
                ptx.mbarrier_arrive(full)  # publishes the stores (release); the copies arrive below
            else:
                for r in cutlass.range_constexpr(-(-BN // PT)):
                    if pidx + PT * r < BN:
                        ptx.cp_async_4_zfill(sbase + cfg.xs_offset + (pidx + PT * r) * 4,
                                             x_src[r] + Int64(kb * 4), x_bytes[r])
            ptx.cp_async_mbarrier_arrive_noinc(full)
            if cutlass.const_expr(trace_seg is not None and W1 and base is not None and not PAIR):  # noqa: SIM102
                if pidx == 0 and base == 0 and kb == 0:  # the CTA's first copies are out: the tail's last slot
                    ptx.stamp_times(trace_seg + Int64(16 * (TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + 3)))
        if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if pidx == 0:
                ptx.stg_s64(trace_seg + Int64(72), Int64(waited))
        if cutlass.const_expr(base is None):
            ptx.cp_async_wait_all()  # the warp leaves only once its last copies have landed

    @cute.jit
    def produce_fused(a, e, bx, row0, count, k_blocks, m_tiles, smem, pidx, ready, base):
        """A fused half's producer for one unit of the persistent role2 loop. The unit's K128 steps are the
        CTA's steps base .. base + k_blocks - 1: stage = step mod STAGES, and the stage barriers' phases run on
        across units, so this unit's copies go out while the consumers still finish the previous unit (no
        drain between units). Lane 0 of each producer warp waits for the unit's input (W1: the ring blocks of
        its token tile, acquired; W2: all I/128 W1-completion bits of its tile, polled relaxed, then one
        fence) and the warp's lanes copy the token rows after it; the weights of the first stages go out
        before that wait, except in the CTA's first W1 unit. W2 reads the tile's activation
        scales once into a table (coherent loads: W1 wrote them during this kernel) and stores each stage's.
        Producer thread 0 adds one plain arrival per stage (the fused halves' barriers count it)."""
        ring_rows = None
        if cutlass.const_expr(REUSE):
            if cutlass.const_expr(W1):
                ring_rows = ready[0][3] * ready[0][4]  # ring_block_m x ring_blocks
            else:
                ring_rows = ready[4]  # W1's output rows form a ring of the same rows
        weights, rows_in, scales_in = stream_sources(a, e, bx, row0, count, k_blocks, m_tiles, pidx, ring_rows)
        w_src, s_src, tile_stride, scale_stride = weights
        x_src, x_bytes = scales_in
        base = cute.arch.make_warp_uniform(base)  # read from shared memory; keeps stage addresses uniform
        empty0 = smem + cfg.barrier_offset + STAGES * 8
        # the weights of the unit's first stages go out as those stages free (the previous unit's last steps),
        # before the input wait: they depend on neither role1 nor W1, and the SM's weight stream goes on while
        # the wait's round trips run. Not in the CTA's first W1 unit: there the ring may still be filling, and
        # every CTA's first stages at once would compete with role1's pulls for the memory system
        prefetched = k_blocks
        if prefetched > STAGES:
            prefetched = Int32(STAGES)
        if cutlass.const_expr(W1):
            if base == 0:
                prefetched = Int32(0)
        for kb in cutlass.range(prefetched):
            step = base + kb
            if step >= STAGES:
                ptx.mbarrier_wait(empty0 + step_stage(step, STAGES) * 8, empty_parity(step, STAGES),
                                  suspend_ns=SUSPEND)
            issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, step_stage(step, STAGES))
        if pidx % 32 == 0:
            if cutlass.const_expr(W1):
                ring, rows, started = ready
                ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns = ring[:6]
                ring_protocol.acquire_ring_rows(ring_ready, l1_full_count, row0, rows, ring_block_m, ring_blocks,
                                                started, timeout_ns)
            else:
                # relaxed polls with a back-off (an acquire per poll would keep invalidating the SM's L1), then
                # one fence makes it an acquire
                done_mask, all_bits, started, timeout_ns = ready[:4]
                ptx.wait_all_bits_relaxed_gpu(done_mask, all_bits, started, timeout_ns)
        ptx.warp_sync()  # the warp's copies of the unit's rows follow its lane 0's acquire
        for kb in cutlass.range(prefetched):
            copy_token_rows(smem, kb, rows_in, pidx, step_stage(base + kb, STAGES))
        table = smem + cfg.scale_table_offset
        if cutlass.const_expr(not W1):
            if pidx < 32:
                # producer warp 0 reads the tile's scales once: rows [row0, row0 + tile rows) x k_blocks are one
                # contiguous run of l2_scale, 8 coherent loads per lane in flight at a time
                tile_rows = count
                if tile_rows > BN:
                    tile_rows = Int32(BN)
                total = tile_rows * k_blocks
                first = a[3] + Int64(row0) * Int64(k_blocks) * 4  # a = (w_codes, w_scales, act, act_scale)
                if cutlass.const_expr(REUSE):
                    first = a[3] + Int64(row0 % ring_rows) * Int64(k_blocks) * 4
                base_word = Int32(0)
                while base_word < total:
                    vals = []
                    for j in cutlass.range_constexpr(8):
                        v = Float32(0.0)
                        if base_word + pidx + 32 * j < total:
                            word = Int64(base_word + pidx + 32 * j)
                            if cutlass.const_expr(REUSE):  # the run may wrap at the ring's end
                                if (row0 % ring_rows) + (base_word + pidx + 32 * j) // k_blocks >= ring_rows:
                                    word = word - Int64(ring_rows) * Int64(k_blocks)
                            v = ptx.ld_relaxed_gpu_f32(first + word * 4)
                        vals.append(v)
                    for j in cutlass.range_constexpr(8):
                        if base_word + pidx + 32 * j < total:
                            ptx.sts_f32(table + (base_word + pidx + 32 * j) * 4, vals[j])
                    base_word = base_word + 256
                ptx.warp_sync()
        for kb in cutlass.range(k_blocks):
            step = base + kb
            stage = step_stage(step, STAGES)
            full = smem + cfg.barrier_offset + stage * 8
            sbase = smem + stage * cfg.stage_bytes
            if kb >= prefetched:
                if step >= STAGES:
                    ptx.mbarrier_wait(empty0 + stage * 8, empty_parity(step, STAGES), suspend_ns=SUSPEND)
                issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, stage)
                copy_token_rows(smem, kb, rows_in, pidx, stage)
            if cutlass.const_expr(W1):
                copy_token_scales(sbase, kb, x_src, x_bytes, pidx)
                if pidx == 0:
                    ptx.mbarrier_arrive(full)
            else:
                if pidx < BN:  # the scale lanes, all in producer warp 0 (BN <= 32): the table's row pidx
                    xv = Float32(0.0)
                    if pidx < count:
                        xv = ptx.lds_f32(table + (pidx * k_blocks + kb) * 4)
                    ptx.sts_f32(sbase + cfg.xs_offset + pidx * 4, xv)
                ptx.warp_sync()  # before thread 0's release of the stores
                if pidx == 0:
                    ptx.mbarrier_arrive(full)
            ptx.cp_async_mbarrier_arrive_noinc(full)

    @cute.jit
    def stage_scale_ratio(sbase, kb, pidx, scale, scale_prev):
        """scale_ratios: token pidx's step-kb scale, clamped to SCALE_RATIO_FLOOR (rows past the count: the floor),
        and its ratio to the step before (1 at the first step: the sums are zero) into the stage. Returns the clamped
        scale, the next step's `scale_prev`."""
        clamped = scale
        if clamped < Float32(SCALE_RATIO_FLOOR):
            clamped = Float32(SCALE_RATIO_FLOOR)
        ratio = Float32(1.0)
        if kb > 0:
            ratio = scale_prev * ptx.rcp_approx_f32(clamped)
        if pidx < BN:
            ptx.sts_f32(sbase + cfg.xs_offset + pidx * 4, clamped)
            ptx.sts_f32(sbase + cfg.xr_offset + pidx * 4, ratio)
        return clamped

    @cute.jit
    def copy_stage_inputs(smem, kb, stage, rows_in, scales_in, pidx):
        """Step kb's token rows and activation scales into stage `stage` (cp.async), then this thread's arrival
        on its full barrier once they land: what a step whose weights went out earlier still needs."""
        x_src, x_bytes = scales_in
        copy_token_rows(smem, kb, rows_in, pidx, stage)
        for r in cutlass.range_constexpr(-(-BN // PT)):
            if pidx + PT * r < BN:
                ptx.cp_async_4_zfill(smem + stage * cfg.stage_bytes + cfg.xs_offset + (pidx + PT * r) * 4,
                                     x_src[r] + Int64(kb * 4), x_bytes[r])
        ptx.cp_async_mbarrier_arrive_noinc(smem + cfg.barrier_offset + stage * 8)

    @cute.jit
    def copy_token_rows(smem, kb, rows_in, pidx, stage=None):
        """Stage kb's token tile: 16-byte cp.async pieces (rows past the count zero-filled; rows_in: `stream_sources`'s
        sources, bytes and destinations), or with tma_tokens one tensor-map copy by pidx 0 (rows_in: the map, the
        tile's first row, the unit's first K128 step) that completes on the stage's full barrier. stage: the ring stage
        when it is not kb mod STAGES (the fused halves' steps continue across units)."""
        if cutlass.const_expr(stage is None):
            stage = kb % STAGES
        sbase = smem + stage * cfg.stage_bytes
        if cutlass.const_expr(TMA_TOKENS):
            token_map, first_row, k_first = rows_in
            if pidx == 0:  # box (16 bytes, 8 rows, 8 K chunks of 16): the core-matrix order the descriptor reads
                ptx.tensor_copy_3d_g2s(sbase + cfg.b_offset, token_map, Int32(0), first_row, (k_first + kb) * 8,
                                       smem + cfg.barrier_offset + stage * 8)
            return
        b_src, b_bytes, b_dst = rows_in
        k_off = Int64(kb * 128)
        for r in cutlass.range_constexpr(B_PIECES_PER_THREAD):
            if cutlass.const_expr(BN * 8 % PT == 0):
                ptx.cp_async_16_zfill(sbase + b_dst[r], b_src[r] + k_off, b_bytes[r])
            elif pidx + PT * r < BN * 8:
                ptx.cp_async_16_zfill(sbase + b_dst[r], b_src[r] + k_off, b_bytes[r])

    @cute.jit
    def issue_weights(smem, kb, w_src, s_src, tile_stride, scale_stride, pidx, stage=None):
        """Stage kb's bulk copies (4 weight tiles, their K32 scale bytes), announced on its full barrier."""
        if cutlass.const_expr(stage is None):
            stage = kb % STAGES
        full = smem + cfg.barrier_offset + stage * 8
        sbase = smem + stage * cfg.stage_bytes
        if pidx == 0:
            # the stage's bytes announced once; another warp's copies may land first (the tx count goes
            # negative until then, and the phase still waits for this arrival)
            ptx.mbarrier_arrive_expect_tx(full, STAGE_TX)
        w_k = w_src + Int64(kb) * TILE_BYTES
        s_k = s_src + Int64(kb) * TILE_SCALE_BYTES
        for i in cutlass.range_constexpr(TILES_PER_CTA):
            if pidx == 32 * (i % PW):  # lane 0 of warp i mod PW: addresses stay warp-uniform
                ptx.bulk_copy_g2s(sbase + i * TILE_BYTES, w_k + Int64(i) * tile_stride, TILE_BYTES, full)
                ptx.bulk_copy_g2s(sbase + cfg.scale_offset + i * TILE_SCALE_BYTES, s_k + Int64(i) * scale_stride,
                                  TILE_SCALE_BYTES, full)

    # pipelined consumer (warp_specialized, unfolded): the K32 blocks of a step go out in groups of PNP
    # WGMMAs whose fresh partials (32 registers per group at every bn) alternate between two buffers; group i
    # is issued before the scale FMAs of group i - 1 (wait_group 1), so the tensor core runs while the
    # warpgroup decodes and scales, also across K128 steps
    PNP = cfg.wgmmas_per_group
    GROUPS = 4 // PNP
    NIBBLES_SPLIT = cfg.split_nibbles  # (SPLIT is the consumer_registers split)
    PER = PNP * (BN // 2)

    @cute.jit
    def issue_group(wa, desc_lo, grp, buf, pending=1):
        """wa: the thread's A fragment in the stage; desc_lo: the low word of the descriptor of the stage's token
        tile (ptx.smem_desc_kmajor_lo), advanced by 16 per K32 block (256 bytes). Returns once at most `pending`
        groups are in flight."""
        # the group's own 8 x PNP bytes of the thread's A fragment (fewer live registers than the whole step)
        # (split_nibbles: the thread's words 0..3 at wa, 4..7 at wa + 2048, weights.sm90's thread halves)
        half = TILE_BYTES // 2 if cutlass.const_expr(NIBBLES_SPLIT) else 16
        if cutlass.const_expr(PNP == 4):
            words = ptx.lds128(wa) + ptx.lds128(wa + half)
        elif cutlass.const_expr(PNP == 2):
            words = ptx.lds128(wa + half * grp)
        else:
            words = ptx.lds64(wa + half * (grp // 2) + 8 * (grp % 2))
        a_regs = []
        descs = []
        for jj in cutlass.range_constexpr(PNP):
            j = grp * PNP + jj
            w_k0, w_k16 = words[2 * jj], words[2 * jj + 1]
            if cutlass.const_expr(NIBBLES_SPLIT):
                a_regs += [*ptx.decode_fp4x8_split(w_k0), *ptx.decode_fp4x8_split(w_k16)]
            else:
                a_regs += [
                    ptx.decode_fp4x4_low(w_k0), ptx.decode_fp4x4_high(w_k0),
                    ptx.decode_fp4x4_low(w_k16), ptx.decode_fp4x4_high(w_k16),
                ]
            descs.append(ptx.smem_desc_kmajor_from_lo(desc_lo + j * 16, 1024))
        ptx.wgmma_fence()
        out = ptx.wgmma_rs_e4m3_issue(BN, a_regs, descs, [buf[r] for r in range(PER)], pending)
        for r in cutlass.range_constexpr(PER):
            buf[r] = out[r]

    @cute.jit
    def finish_group(srow, grp, buf, tsum, words=None):
        """tsum (+)= P_j s_j for the K32 blocks of group `grp` (their WGMMAs have completed); srow: the thread's
        row g scale word in the stage (row g + 8's is 32 bytes on); words: those two words already loaded
        (early_scales), srow unused."""
        if cutlass.const_expr(words is not None):
            sc_lo, sc_hi = words
        else:
            sc_lo = ptx.lds32(srow)
            sc_hi = ptx.lds32(srow + 32)
        for jj in cutlass.range_constexpr(PNP):
            j = grp * PNP + jj
            s_lo = ptx.ue8m0_byte_to_f32(sc_lo, j)
            s_hi = ptx.ue8m0_byte_to_f32(sc_hi, j)
            for r in cutlass.range_constexpr(BN // 2):
                s_row = s_lo if r % 4 < 2 else s_hi  # fragment regs 2, 3 of each 8-token block: row g + 8
                if j == 0:
                    tsum[r] = buf[jj * (BN // 2) + r] * s_row
                else:
                    tsum[r] = tsum[r] + buf[jj * (BN // 2) + r] * s_row

    @cute.jit
    def finish_step(xs, tsum, acc, n=BN, first=0, held=None):
        """acc += tsum x the step's activation scales for n tokens from token `first` (a multiple of 8: the wide tile's
        second chain starts at 64); xs: the thread's column pair q in the stage's scales; held: those scales already
        loaded (early_scales: a register tensor, pair i at 2 i, 2 i + 1; `first` 0), xs unused."""
        for i in cutlass.range_constexpr(n // 8):
            if cutlass.const_expr(held is not None):
                xv = (held[2 * i], held[2 * i + 1])
            else:
                xv = ptx.lds_f32x2(xs + (first + 8 * i) * 4)
            for c in cutlass.range_constexpr(4):
                k = 4 * (first // 8 + i) + c
                acc[k] = acc[k] + tsum[4 * i + c] * xv[c % 2]

    @cute.jit
    def rescale(xs, acc, n=BN):
        """scale_ratios: acc x the stage's per-token factors at `xs` (the thread's column pair) for n tokens."""
        for i in cutlass.range_constexpr(n // 8):
            xv = ptx.lds_f32x2(xs + 8 * i * 4)
            for c in cutlass.range_constexpr(4):
                acc[4 * i + c] = acc[4 * i + c] * xv[c % 2]

    @cute.jit
    def wide_tail_descs(desc_lo):
        """The wide tile's rows past 64: the four K32 descriptors of the token tile's groups 8.. (8 KB further)."""
        return [ptx.smem_desc_kmajor_from_lo(desc_lo + j * 16 + (WIDE_MAIN_N // 8) * 1024 // 16, 1024) for j in range(4)]

    @cute.jit
    def next_stage(stage, phase):
        """The ring position after (stage, phase): an add and a compare at the wrap, no division."""
        stage = stage + 1
        if stage == STAGES:
            stage = Int32(0)
            phase = phase ^ 1
        return stage, phase

    @cute.jit
    def ring_position(base):
        """(stage, parity) of a unit's first K128 step: 0, 0 for a CTA of one unit, else those of step `base` of a
        persistent CTA (warp-uniform: the stage addresses and descriptors derived from it stay in uniform registers)."""
        stage = Int32(0)
        phase = Int32(0)
        if cutlass.const_expr(base is not None):
            base = cute.arch.make_warp_uniform(base)
            stage = step_stage(base, STAGES)
            phase = full_parity(base, STAGES)
        return stage, phase

    @cute.jit
    def table_offsets(wg, t, warp, g, q):
        """A table-decode consumer thread's stage offsets, computed once: its codes (table nibble order), its row g
        scale word, its activation-scale column pair."""
        return (wg * TILE_BYTES + t * 16, cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4,
                cfg.xs_offset + 2 * q * 4)

    @cute.jit
    def hold_step_scales(sbase, s_off, x_off, words, xs):
        """early_scales: the thread's two scale words and its activation-scale column pairs of the stage at `sbase`
        into slots 0, 1 of `words` and 0 .. BN // 4 - 1 of `xs`, the previous step's moved to the slots after them
        first (its last group is scaled after this step's first group is issued)."""
        for r in cutlass.range_constexpr(2):
            words[2 + r] = words[r]
        for r in cutlass.range_constexpr(BN // 4):
            xs[BN // 4 + r] = xs[r]
        words[0] = ptx.lds32(sbase + s_off)
        words[1] = ptx.lds32(sbase + s_off + 32)
        for i in cutlass.range_constexpr(BN // 8):
            xv = ptx.lds_f32x2(sbase + x_off + 8 * i * 4)
            xs[2 * i] = xv[0]
            xs[2 * i + 1] = xv[1]

    @cute.jit
    def consume_pipelined(k_blocks, smem, wg, t, warp, g, q, acc, base=None, trace_seg=None):
        """base: the fused halves' first step of the unit (their stages and phases run on across units); None:
        the unit's steps start at stage 0, phase 0. trace_seg (a traced stream_k segment's slots): thread 0 stamps
        the time its first stage was full and stores the cycles it waited for full stages.

        The loop's bookkeeping is kept out of the issue-bound step: the stage and its parity are carried (an add
        and a compare at the wrap, not a division by STAGES per step), the descriptors' low word advances by the
        stage stride, and the thread's fragment, scale-row and activation-scale offsets are computed once."""
        bufs = (cute.make_rmem_tensor((PER,), Float32), cute.make_rmem_tensor((PER,), Float32))
        tsum = cute.make_rmem_tensor((BN // 2,), Float32)
        for r in cutlass.range_constexpr(PER):
            bufs[0][r] = Float32(0.0)
            bufs[1][r] = Float32(0.0)
        for r in cutlass.range_constexpr(BN // 2):
            tsum[r] = Float32(0.0)
        bar0 = smem + cfg.barrier_offset
        if cutlass.const_expr(LEAN_RING):
            bar0 = cute.arch.make_warp_uniform(bar0)
        a_off = wg * TILE_BYTES + t * 32
        if cutlass.const_expr(NIBBLES_SPLIT):
            # wg x 4096 + 16 t as 16 x (the consumer thread's index) + a uniform part: without that ptxas rebuilt
            # the sum from the thread index every step (four instructions against one)
            a_off = cute.arch.make_warp_uniform(wg * (TILE_BYTES // 2)) + (wg * 128 + t) * 16
        s_off = cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4
        x_off = cfg.xs_offset + 2 * q * 4
        desc0 = ptx.smem_desc_kmajor_lo(smem + cfg.b_offset, 128)  # stage 0's token tile
        if cutlass.const_expr(LEAN_RING):
            desc0 = cute.arch.make_warp_uniform(desc0)
        # base (the fused halves: from shared memory, the unit slot) is marked warp-uniform: without it 8 R2UR and ~6
        # more instructions per K128 step, on a loop that is issue-bound at bn 8 / 16
        stage, phase = ring_position(base)
        if cutlass.const_expr(GROUPS == 1):  # step_group: the step's chain is the group, buffers alternate by step
            consume_step_groups(k_blocks, smem, stage, phase, a_off, s_off, x_off, desc0, wg, t, bufs, tsum, acc, base,
                                trace_seg)
            return
        # early_scales: the step's scale words (slots 0, 1; the previous step's 2, 3) and activation scales (slots
        # 0 .. BN / 4 - 1; the previous step's after them), loaded once after the step's wait
        held_w = cute.make_rmem_tensor((4,), Uint32)
        held_x = cute.make_rmem_tensor((BN // 2,), Float32)
        if cutlass.const_expr(EARLY_SCALES):
            for r in cutlass.range_constexpr(4):
                held_w[r] = Uint32(0)
            for r in cutlass.range_constexpr(BN // 2):
                held_x[r] = Float32(0.0)
        waited = Int32(0)
        if cutlass.const_expr(trace_seg is not None):
            waited = ptx.mbarrier_wait_cycles(bar0 + stage * 8, phase)
        else:
            ptx.mbarrier_wait(bar0 + stage * 8, phase, suspend_ns=SUSPEND, first_try=LEAN_RING)
        if cutlass.const_expr(not TMA_TOKENS):  # the token tile came through cp.async (generic proxy)
            ptx.fence_proxy_async_shared()
        if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if wg == 0 and t == 0:
                ptx.stamp_times(trace_seg + Int64(16))
        sbase = smem + stage * cfg.stage_bytes
        desc_lo = desc0 + stage * (cfg.stage_bytes // 16)
        first_w = None
        if cutlass.const_expr(EARLY_SCALES):
            hold_step_scales(sbase, s_off, x_off, held_w, held_x)
            first_w = (held_w[0], held_w[1])
        for grp in cutlass.range_constexpr(GROUPS):
            issue_group(sbase + a_off, desc_lo, grp, bufs[grp % 2])
            if cutlass.const_expr(grp > 0):
                finish_group(sbase + s_off, grp - 1, bufs[(grp - 1) % 2], tsum, first_w)
        for kb in cutlass.range(1, k_blocks):
            prev = stage
            pbase = sbase
            stage, phase = next_stage(stage, phase)
            sbase = smem + stage * cfg.stage_bytes
            desc_lo = desc0 + stage * (cfg.stage_bytes // 16)
            if cutlass.const_expr(trace_seg is not None):
                waited = waited + ptx.mbarrier_wait_cycles(bar0 + stage * 8, phase)
            else:
                ptx.mbarrier_wait(bar0 + stage * 8, phase, suspend_ns=SUSPEND, first_try=LEAN_RING)
            if cutlass.const_expr(not TMA_TOKENS):  # the token tile came through cp.async (generic proxy)
                ptx.fence_proxy_async_shared()
            step_w = step_prev_w = step_prev_x = None  # early_scales: this step's words, the previous step's scales
            if cutlass.const_expr(EARLY_SCALES):
                hold_step_scales(sbase, s_off, x_off, held_w, held_x)
                step_w, step_prev_w = (held_w[0], held_w[1]), (held_w[2], held_w[3])
                step_prev_x = [held_x[BN // 4 + r] for r in range(BN // 4)]
            for grp in cutlass.range_constexpr(GROUPS):
                issue_group(sbase + a_off, desc_lo, grp, bufs[grp % 2])
                if cutlass.const_expr(grp == 0 and EARLY_SCALES):
                    # step kb - 1's WGMMAs are done and its scales are in registers: its stage goes back first
                    ptx.warp_sync()
                    if t % 32 == 0:
                        ptx.mbarrier_arrive(bar0 + (STAGES + prev) * 8)
                    finish_group(pbase + s_off, GROUPS - 1, bufs[(GROUPS - 1) % 2], tsum, step_prev_w)
                    finish_step(pbase + x_off, tsum, acc, held=step_prev_x)
                elif cutlass.const_expr(grp == 0):
                    # step kb - 1 is complete: its last group, its activation scales, then its stage goes back
                    finish_group(pbase + s_off, GROUPS - 1, bufs[(GROUPS - 1) % 2], tsum)
                    finish_step(pbase + x_off, tsum, acc)
                    ptx.warp_sync()
                    if t % 32 == 0:
                        ptx.mbarrier_arrive(bar0 + (STAGES + prev) * 8)
                else:
                    finish_group(sbase + s_off, grp - 1, bufs[(grp - 1) % 2], tsum, step_w)
        last = bufs[(GROUPS - 1) % 2]
        out = ptx.wgmma_wait_tied([last[r] for r in range(PER)], 0)
        for r in cutlass.range_constexpr(PER):
            last[r] = out[r]
        last_w = last_x = None
        if cutlass.const_expr(EARLY_SCALES):
            last_w = (held_w[0], held_w[1])
            last_x = [held_x[r] for r in range(BN // 4)]
        finish_group(sbase + s_off, GROUPS - 1, last, tsum, last_w)
        finish_step(sbase + x_off, tsum, acc, held=last_x)
        if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if wg == 0 and t == 0:
                ptx.stg_s64(trace_seg + Int64(64), Int64(waited))
        if cutlass.const_expr(base is not None):
            # the unit's last stage goes back too (the next unit's steps reuse it; a one-unit kernel never does)
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(bar0 + (STAGES + stage) * 8)

    @cute.jit
    def step_group_step(smem, stage, phase, cur, prev, a_off, s_off, x_off, desc0, t, tsum, acc, waited):
        """step_group: wait for the next stage, issue its step's chain into `cur` (returning once the chain before it,
        in `prev`, has completed), scale `prev` into acc and release its stage. Returns the (stage, phase) just
        issued and `waited` plus the cycles this wait took (traced loops; else unchanged)."""
        bar0 = smem + cfg.barrier_offset
        prev_stage = stage
        stage, phase = next_stage(stage, phase)
        waited = stage_wait(bar0 + stage * 8, phase, waited)
        if cutlass.const_expr(not TMA_TOKENS):  # the token tile came through cp.async (generic proxy)
            ptx.fence_proxy_async_shared()
        issue_group(smem + stage * cfg.stage_bytes + a_off, desc0 + stage * (cfg.stage_bytes // 16), 0, cur)
        pbase = smem + prev_stage * cfg.stage_bytes
        finish_group(pbase + s_off, 0, prev, tsum)
        finish_step(pbase + x_off, tsum, acc)
        ptx.warp_sync()
        if t % 32 == 0:
            ptx.mbarrier_arrive(bar0 + (STAGES + prev_stage) * 8)
        return stage, phase, waited

    @cute.jit
    def stage_wait(full, phase, waited):
        """Wait for a full stage; a traced loop (TRACE) adds the cycles it took to `waited`."""
        if cutlass.const_expr(TRACE):
            waited = waited + ptx.mbarrier_wait_cycles(full, phase)
        else:
            ptx.mbarrier_wait(full, phase, suspend_ns=SUSPEND)
        return waited

    @cute.jit
    def consume_step_groups(k_blocks, smem, stage, phase, a_off, s_off, x_off, desc0, wg, t, bufs, tsum, acc, base,
                            trace_seg):
        """consume_pipelined with step_group: step kb's four WGMMAs go into one buffer of two and stay in flight
        while the step before is scaled, two steps per trip; an even count's first step runs alone first."""
        bar0 = smem + cfg.barrier_offset
        waited = stage_wait(bar0 + stage * 8, phase, Int32(0))
        if cutlass.const_expr(not TMA_TOKENS):  # the token tile came through cp.async (generic proxy)
            ptx.fence_proxy_async_shared()
        if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if wg == 0 and t == 0:
                ptx.stamp_times(trace_seg + Int64(16))
        if k_blocks % 2 == 0:  # the first step alone (issued and waited here), then an odd count as below
            sbase = smem + stage * cfg.stage_bytes
            issue_group(sbase + a_off, desc0 + stage * (cfg.stage_bytes // 16), 0, bufs[1])
            first = ptx.wgmma_wait_tied([bufs[1][r] for r in range(PER)], 0)
            for r in cutlass.range_constexpr(PER):
                bufs[1][r] = first[r]
            finish_group(sbase + s_off, 0, bufs[1], tsum)
            finish_step(sbase + x_off, tsum, acc)
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(bar0 + (STAGES + stage) * 8)
            stage, phase = next_stage(stage, phase)
            waited = stage_wait(bar0 + stage * 8, phase, waited)
            if cutlass.const_expr(not TMA_TOKENS):  # the token tile came through cp.async (generic proxy)
                ptx.fence_proxy_async_shared()
        issue_group(smem + stage * cfg.stage_bytes + a_off, desc0 + stage * (cfg.stage_bytes // 16), 0, bufs[0])
        for _trip in cutlass.range((k_blocks - 1) // 2):
            stage, phase, waited = step_group_step(smem, stage, phase, bufs[1], bufs[0], a_off, s_off, x_off, desc0,
                                                   t, tsum, acc, waited)
            stage, phase, waited = step_group_step(smem, stage, phase, bufs[0], bufs[1], a_off, s_off, x_off, desc0,
                                                   t, tsum, acc, waited)
        # the last step (buffer 0) completes, then its scaling
        done = ptx.wgmma_wait_tied([bufs[0][r] for r in range(PER)], 0)
        for r in cutlass.range_constexpr(PER):
            bufs[0][r] = done[r]
        sbase = smem + stage * cfg.stage_bytes
        finish_group(sbase + s_off, 0, bufs[0], tsum)
        finish_step(sbase + x_off, tsum, acc)
        if cutlass.const_expr(trace_seg is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if wg == 0 and t == 0:
                ptx.stg_s64(trace_seg + Int64(64), Int64(waited))
        if cutlass.const_expr(base is not None):
            # the unit's last stage goes back too (the next unit's steps reuse it; a one-unit kernel never does)
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(bar0 + (STAGES + stage) * 8)

    @cute.jit
    def consume_folded(k_blocks, smem, wg, t, warp, g, q, acc):
        """A folded-scale consumer warpgroup: per K128 step wait for the stage, compute (one chained WGMMA
        group, waited at once), release it (one arrival per warp)."""
        for kb in cutlass.range(k_blocks):
            stage = kb % STAGES
            full = smem + cfg.barrier_offset + stage * 8
            ptx.mbarrier_wait(full, (kb // STAGES) % 2, suspend_ns=SUSPEND)
            ptx.fence_proxy_async_shared()  # the token tile came through cp.async (generic proxy)
            compute_stage_folded(smem, stage, wg, t, warp, g, q, acc)
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(full + STAGES * 8)

    @cute.jit
    def waited_fragment(smem, stage, phase, a_off, s_off, desc0):
        """A waited table consumer's step: wait for stage `stage` to be full, decode its A fragment; returns (the stage's
        base, the fragment, its token tile's descriptors' low word, the four K32 descriptors of the first 64 rows)."""
        ptx.mbarrier_wait(smem + cfg.barrier_offset + stage * 8, phase, suspend_ns=SUSPEND)
        ptx.fence_proxy_async_shared()  # the token tile came through cp.async (generic proxy)
        sbase = smem + stage * cfg.stage_bytes
        a_regs = table_fragment(sbase, a_off, s_off)
        desc_lo = desc0 + stage * (cfg.stage_bytes // 16)
        return sbase, a_regs, desc_lo, [ptx.smem_desc_kmajor_from_lo(desc_lo + j * 16, 1024) for j in range(4)]

    @cute.jit
    def consume_table_waited(k_blocks, smem, wg, t, warp, g, q, acc, n=BN, base=None):
        """The table decode's consumer that waits for each step's chain (N = n; tiles 24 and 64 have no registers for a
        second chain buffer), with the pipelined consumers' bookkeeping: stage and parity carried (no division per
        step), the token tile's descriptor advanced by the stage stride, the thread's offsets computed once. base: a
        persistent CTA's steps before this unit (its stages and phases run on across units), else None."""
        bar0 = smem + cfg.barrier_offset
        a_off, s_off, x_off = table_offsets(wg, t, warp, g, q)
        desc0 = ptx.smem_desc_kmajor_lo(smem + cfg.b_offset, 128)  # stage 0's token tile
        stage, phase = ring_position(base)
        for kb in cutlass.range(k_blocks):
            sbase, a_regs, desc_lo, descs = waited_fragment(smem, stage, phase, a_off, s_off, desc0)
            n_main = min(n, WIDE_MAIN_N)
            if cutlass.const_expr(RATIOS):  # the sums to this step's scale, then its products straight into them
                rescale(sbase + x_off + BN * 4, acc, n)
                ptx.wgmma_fence()
                chains = [(n_main, descs)]
                if cutlass.const_expr(n > WIDE_MAIN_N):  # the wide tile's rows past 64 under the same wait
                    chains.append((n - WIDE_MAIN_N, wide_tail_descs(desc_lo)))
                out = ptx.wgmma_rs_e4m3_accumulate(chains, a_regs, [acc[r] for r in range(n // 2)])
                for r in cutlass.range_constexpr(n // 2):
                    acc[r] = out[r]
                if kb == k_blocks - 1:  # the last step's scale, read before the stage is released
                    rescale(sbase + x_off, acc, n)
            else:
                ptx.wgmma_fence()
                part = ptx.wgmma_rs_e4m3_chain(n_main, a_regs, descs)
                finish_step(sbase + x_off, part, acc, n_main)
                if cutlass.const_expr(n > WIDE_MAIN_N):  # the wide tile's rows past 64: the same A fragment
                    ptx.wgmma_fence()  # the FMAs above read registers the tail chain may write
                    part = ptx.wgmma_rs_e4m3_chain(n - WIDE_MAIN_N, a_regs, wide_tail_descs(desc_lo))
                    finish_step(sbase + x_off, part, acc, n - WIDE_MAIN_N, WIDE_MAIN_N)
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(bar0 + (STAGES + stage) * 8)
            stage, phase = next_stage(stage, phase)

    @cute.jit
    def table_issue(smem, stage, a_off, s_off, desc0, buf, n):
        """Decode stage `stage`'s fragment and issue its four chained WGMMAs (N = n) into `buf`; returns once at
        most this chain is in flight (the one before it has completed)."""
        sbase = smem + stage * cfg.stage_bytes
        a_regs = table_fragment(sbase, a_off, s_off)
        desc_lo = desc0 + stage * (cfg.stage_bytes // 16)
        descs = [ptx.smem_desc_kmajor_from_lo(desc_lo + j * 16, 1024) for j in range(4)]
        ptx.wgmma_fence()
        out = ptx.wgmma_rs_e4m3_chain_issue(n, a_regs, descs, [buf[r] for r in range(n // 2)], 1)
        for r in cutlass.range_constexpr(n // 2):
            buf[r] = out[r]

    @cute.jit
    def table_step(smem, stage, phase, cur, prev, a_off, s_off, x_off, desc0, t, acc, n):
        """One K128 step of the pipelined table consumer: wait for the next stage, issue its chain into `cur`,
        then scale the previous step's chain (`prev`, complete now) into acc and release its stage. Returns the
        (stage, phase) just consumed."""
        bar0 = smem + cfg.barrier_offset
        prev_stage = stage
        stage, phase = next_stage(stage, phase)
        ptx.mbarrier_wait(bar0 + stage * 8, phase, suspend_ns=SUSPEND)
        ptx.fence_proxy_async_shared()  # the token tile came through cp.async (generic proxy)
        table_issue(smem, stage, a_off, s_off, desc0, cur, n)
        finish_step(smem + prev_stage * cfg.stage_bytes + x_off, prev, acc, n)
        ptx.warp_sync()
        if t % 32 == 0:
            ptx.mbarrier_arrive(bar0 + (STAGES + prev_stage) * 8)
        return stage, phase

    @cute.jit
    def consume_table_pipelined(k_blocks, smem, wg, t, warp, g, q, acc, n=BN):
        """A table-decode consumer warpgroup with one chain (N = n) in flight: step kb's chain goes into buffer
        kb mod 2 (the loop runs two steps per trip so each buffer stays in its registers), and step kb - 1's FP32
        scaling and stage release follow its issue."""
        bufs = (cute.make_rmem_tensor((n // 2,), Float32), cute.make_rmem_tensor((n // 2,), Float32))
        for r in cutlass.range_constexpr(n // 2):
            bufs[0][r] = Float32(0.0)
            bufs[1][r] = Float32(0.0)
        a_off, s_off, x_off = table_offsets(wg, t, warp, g, q)
        desc0 = ptx.smem_desc_kmajor_lo(smem + cfg.b_offset, 128)  # stage 0's token tile
        stage = Int32(0)
        phase = Int32(0)
        ptx.mbarrier_wait(smem + cfg.barrier_offset, phase, suspend_ns=SUSPEND)
        ptx.fence_proxy_async_shared()
        table_issue(smem, stage, a_off, s_off, desc0, bufs[0], n)
        for kb in cutlass.range(1, k_blocks, 2):
            stage, phase = table_step(smem, stage, phase, bufs[1], bufs[0], a_off, s_off, x_off, desc0, t, acc, n)
            if kb + 1 < k_blocks:
                stage, phase = table_step(smem, stage, phase, bufs[0], bufs[1], a_off, s_off, x_off, desc0, t, acc,
                                          n)
        # the last chain (step k_blocks - 1, in buffer (k_blocks - 1) mod 2) completes, then its scaling
        done = ptx.wgmma_wait_tied([bufs[0][r] for r in range(n // 2)] + [bufs[1][r] for r in range(n // 2)], 0)
        for r in cutlass.range_constexpr(n // 2):
            bufs[0][r] = done[r]
            bufs[1][r] = done[n // 2 + r]
        if k_blocks % 2 == 1:
            finish_step(smem + stage * cfg.stage_bytes + x_off, bufs[0], acc, n)
        else:
            finish_step(smem + stage * cfg.stage_bytes + x_off, bufs[1], acc, n)

    @cute.jit
    def consume_fitted(consume, k_blocks, smem, wg, t, warp, g, q, acc, count, base=None):
        """fit_n: run `consume` with N = the tile's rows (count, capped at the tile) rounded up to 8, one compiled
        loop per N (WGMMA's N is part of the instruction); without fit_n, N = the tile."""
        if cutlass.const_expr(not cfg.fit_n and base is None):
            consume(k_blocks, smem, wg, t, warp, g, q, acc)
        elif cutlass.const_expr(not cfg.fit_n):
            consume(k_blocks, smem, wg, t, warp, g, q, acc, BN, base)
        else:
            consume_n(consume, 1, (count + 7) // 8, k_blocks, smem, wg, t, warp, g, q, acc, base)

    @cute.jit
    def consume_n(consume, c, groups, k_blocks, smem, wg, t, warp, g, q, acc, base=None):
        """fit_n's branches as one if / else chain: N = 8 c when groups == c, the tile's N for the last. Each
        branch writes every accumulator (the zeros past N after its loop, the ones it sums into before), so no
        value from before the branch lives through a loop (zeros kept from before spilled at bn 64)."""
        if cutlass.const_expr(c == NSUB):
            fitted_loop(consume, c, k_blocks, smem, wg, t, warp, g, q, acc, base)
        else:
            if groups == c:
                fitted_loop(consume, c, k_blocks, smem, wg, t, warp, g, q, acc, base)
            else:
                consume_n(consume, c + 1, groups, k_blocks, smem, wg, t, warp, g, q, acc, base)

    @cute.jit
    def fitted_loop(consume, c, k_blocks, smem, wg, t, warp, g, q, acc, base=None):
        for i in cutlass.range_constexpr(4 * c):
            acc[i] = Float32(0.0)
        if cutlass.const_expr(base is None):
            consume(k_blocks, smem, wg, t, warp, g, q, acc, 8 * c)
        else:
            consume(k_blocks, smem, wg, t, warp, g, q, acc, 8 * c, base)
        if cutlass.const_expr(4 * c < BN // 2):
            # the tokens past N, as zero-filled rows would give: a zero that depends on the loop's result, else
            # the compiler sets these before the loop and ptxas re-zeroes them in every step (8-12 CS2R per K128
            # step of the fitted loops)
            zero = ptx.zero_after(acc[0])
            for i in cutlass.range_constexpr(4 * c, BN // 2):
                acc[i] = zero

    @cute.jit
    def thread_coords(tid):
        """A consumer thread's place: warpgroup (its 64-row weight tile), thread in the warpgroup, warp in the
        warpgroup, and the WGMMA fragment's row group g (lane / 4) and column pair q (lane % 4)."""
        lane = tid % 32
        return tid // 128, tid % 128, (tid % 128) // 32, lane // 4, lane % 4

    @cute.jit
    def init_stage_ring(smem, tid):
        """Thread 0 initializes the stage ring's full and empty barriers; then the CTA meets (warp-specialized)."""
        if tid == 0:
            for st in cutlass.range_constexpr(STAGES):
                ptx.mbarrier_init(smem + cfg.barrier_offset + st * 8, FULL_ARRIVALS)
                ptx.mbarrier_init(smem + cfg.barrier_offset + (STAGES + st) * 8, THREADS // 32)
            if cutlass.const_expr(PUBLISHER):  # the units the consumers finished so far (thread 0 counts them)
                ptx.sts_s32(smem + cfg.publish_offset, Int32(0))
            if cutlass.const_expr(EPI_WARP):  # the hand-over slot: full on the consumers' arrivals, empty on the warp's
                ptx.mbarrier_init(smem + cfg.epilogue_offset, THREADS)
                ptx.mbarrier_init(smem + cfg.epilogue_offset + 8, 32)
            ptx.fence_mbarrier_init()
        if cutlass.const_expr(AMAX_SLOTS):  # noqa: SIM102 (a trace-time branch around a device one)
            if tid < 3 * BN:  # the three amax slot sets start at zero (the max of non-negative values)
                ptx.sts_f32(smem + cfg.amax_offset + tid * 4, Float32(0.0))
        ptx.gemm_barrier(cfg)

    @cute.jit
    def main_loop_ws(a, e, bx, row0, count, k_blocks, m_tiles, smem, acc, w_factor, epilogue, ksplit=None):
        tid = cute.arch.thread_idx()[0]
        wg, t, warp, g, q = thread_coords(tid)
        init_stage_ring(smem, tid)
        if tid >= THREADS:
            # consumer_registers: the producer's registers go to the consumers for the unit (main loop and
            # epilogue). The producer takes its back only where it has more to run (the fused role2 kernel's
            # next unit: `role2` after its draw); a kernel of one unit lets it exit with fewer
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_decrease(cfg.producer_registers)
            produce(a, e, bx, row0, count, k_blocks, m_tiles, smem, tid - THREADS, ksplit)
        else:
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_increase(cfg.consumer_registers)
            if cutlass.const_expr(cfg.pipelined):
                consume_pipelined(k_blocks if ksplit is None else ksplit[1], smem, wg, t, warp, g, q, acc)
            elif cutlass.const_expr(cfg.table_pipelined):
                consume_fitted(consume_table_pipelined, k_blocks, smem, wg, t, warp, g, q, acc, count)
            elif cutlass.const_expr(cfg.table_decode):
                consume_fitted(consume_table_waited, k_blocks, smem, wg, t, warp, g, q, acc, count)
            else:
                consume_fitted(consume_folded, k_blocks, smem, wg, t, warp, g, q, acc, count)
            if cutlass.const_expr(epilogue is not None):
                # inside the consumers' branch: ptxas allocates a region reached from both branches within the
                # entry's 96 registers, so an epilogue after the branches merge would not get the split's
                epilogue[0](tid, wg, warp, g, q, weight_factor(w_factor, e, smem), acc, *epilogue[1])
            if cutlass.const_expr(SPLIT):  # the registers go back to the pool; the producer may take its own
                cute.arch.setmaxregister_decrease(WS_ENTRY_REGISTERS)
        return tid, wg, warp, g, q

    @cute.jit
    def fused_unit(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, ready, epilogue, side, base):
        """One unit of the persistent role2 loop, for one side of the warp-specialized split: side "producer"
        (the producer warps' copies) or "consumer" (WGMMA, then the epilogue). The loop (`role2`) initializes
        the stage barriers once, sets the registers of each side and hands each side its units; base: the
        CTA's K128 steps before this unit."""
        tid = cute.arch.thread_idx()[0]
        if cutlass.const_expr(side == "producer"):
            produce_fused(a, e, bx, row0, count, k_blocks, m_tiles, smem, tid - THREADS, ready, base)
        else:
            wg, t, warp, g, q = thread_coords(tid)
            acc = cute.make_rmem_tensor((BN // 2,), Float32)
            for i in cutlass.range_constexpr(BN // 2):
                acc[i] = Float32(0.0)
            consume_pipelined(k_blocks, smem, wg, t, warp, g, q, acc, base)
            epilogue[0](tid, wg, warp, g, q, weight_factor(w_factor, e), acc, *epilogue[1])

    @cute.jit
    def consumer_sync():
        """The epilogue's barrier among the 512 consumer threads (the producer warp is not in it)."""
        if cutlass.const_expr(WS):
            ptx.named_barrier_sync(1, THREADS)
        else:
            ptx.barrier_sync()

    @cute.jit
    def main_loop(a, e, bx, row0, count, k_blocks, m_tiles, smem, acc):
        tid = cute.arch.thread_idx()[0]
        wg, t, warp, g, q = thread_coords(tid)
        policy = ptx.evict_first_policy() if cfg.l2_evict_first else None
        for s in cutlass.range_constexpr(STAGES - 1):
            if s < k_blocks:
                issue_stage(smem, s, s, e, bx, tid, wg, t, row0, count, k_blocks, m_tiles, a, policy)
            ptx.cp_async_commit()
        for kb in cutlass.range(k_blocks):
            ptx.cp_async_wait(STAGES - 2)
            ptx.barrier_sync()
            nk = kb + STAGES - 1
            if nk < k_blocks:
                issue_stage(smem, nk % STAGES, nk, e, bx, tid, wg, t, row0, count, k_blocks, m_tiles, a, policy)
            ptx.cp_async_commit()
            if cutlass.const_expr(cfg.fold_scales):
                compute_stage_folded(smem, kb % STAGES, wg, t, warp, g, q, acc)
            else:
                compute_stage(smem, kb % STAGES, wg, t, warp, g, q, acc)
        return tid, wg, warp, g, q

    @cute.jit
    def tile_product(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, acc, epilogue=None, ksplit=None):
        """The tile's FP32 products into `acc` (both GEMMs), and the expert's weight factor to apply.
        epilogue: (function, its arguments after (tid, wg, warp, g, q, factor, acc)) that the consumers run
        inside their branch of the warp-specialized split (consumer_registers: in the registers they took),
        else None: the caller runs it."""
        if cutlass.const_expr(not cfg.fit_n):  # fit_n's branches set every accumulator themselves
            for i in cutlass.range_constexpr(BN // 2):
                acc[i] = Float32(0.0)
        if cutlass.const_expr(WS):
            tid, wg, warp, g, q = main_loop_ws(a, e, bx, row0, count, k_blocks, m_tiles, smem, acc, w_factor,
                                               epilogue, ksplit)
        else:
            tid, wg, warp, g, q = main_loop(a, e, bx, row0, count, k_blocks, m_tiles, smem, acc)
        return tid, wg, warp, g, q, weight_factor(w_factor, e, smem)

    @cute.jit
    def tile_with_epilogue(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, epilogue, fused_args=None,
                           ksplit=None):
        """The tile's product and its epilogue ((function, arguments after (tid, wg, warp, g, q, factor, acc))):
        one side of a fused half's unit (fused_args = (its input wait, side, first K128 step): `fused_unit`),
        or the whole CTA (the warp-specialized producer warp has no outputs)."""
        if cutlass.const_expr(FUSED):
            ready, side, base = fused_args
            fused_unit(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, ready, epilogue, side, base)
        else:
            acc = cute.make_rmem_tensor((BN // 2,), Float32)
            tid, wg, warp, g, q, factor = tile_product(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem,
                                                       acc, epilogue if SPLIT else None, ksplit)
            if cutlass.const_expr(not SPLIT):
                if tid < THREADS:
                    epilogue[0](tid, wg, warp, g, q, factor, acc, *epilogue[1])

    @cute.jit
    def weight_factor(w_factor, e, smem=None, meta=None):
        """The expert's compensating factor (weights.sm90), times what the folded decode leaves out (lean_epilogue:
        the copy the producer staged in shared memory, from `smem`, or the persistent unit's slot `meta`)."""
        if cutlass.const_expr(LEAN and not STREAM and meta is not None):
            factor = ptx.lds_f32(meta + BN * 4)
        elif cutlass.const_expr(LEAN and not STREAM and smem is not None):
            factor = ptx.lds_f32(smem + cfg.meta_offset + BN * 4)
        else:
            factor = ptx.ldg_f32(w_factor + Int64(e) * 4)
        if cutlass.const_expr(cfg.fold_scales):
            factor = factor * Float32(2.0**FOLD_EXPONENT)  # the folded decode carries 2^-5 (exact)
        return factor

    if RING:
        from gc_moe.kernels.sm90 import dispatch as ring_protocol  # the ring's wait and release helpers

    @cute.jit
    def compact_unit(expert_offsets, coherent: cutlass.Constexpr):
        """(expert, weight-row tile, token tile) of this CTA under compact_grid: CTA b (linear index of the
        (token tiles, M/256, experts) launch) takes the b-th unit with tokens, units ordered by expert, then
        weight-row tile, then token tile. Every warp scans the experts' unit counts itself (32 per pass: an
        inclusive warp scan, then the lane whose range holds b is found by ballot). Expert -1: no unit."""
        gx, gy, gz = cute.arch.grid_dim()
        tx, ty, tz = cute.arch.block_idx()
        b = Int32(tx) + Int32(gx) * (Int32(ty) + Int32(gy) * Int32(tz))
        lane = cute.arch.thread_idx()[0] % 32
        carry = Int32(0)
        found_e = Int32(-1)
        found_start = Int32(0)
        found_tiles = Int32(1)
        for c in cutlass.range((Int32(gz) + 31) // 32):
            e = c * 32 + lane
            tiles = Int32(0)
            if e < Int32(gz):
                if cutlass.const_expr(coherent):
                    cnt = ptx.ld_global_s32(expert_offsets + Int64(e) * 4 + 4) - ptx.ld_global_s32(
                        expert_offsets + Int64(e) * 4)
                else:
                    cnt = ptx.ldg_s32(expert_offsets + Int64(e) * 4 + 4) - ptx.ldg_s32(expert_offsets + Int64(e) * 4)
                tiles = (cnt + (BN - 1)) // BN
            units = tiles * Int32(gy)
            incl = units
            for d in cutlass.range_constexpr(5):
                up = ptx.shfl_up_s32(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            start = carry + incl - units
            hit = Int32(0)
            if b >= start and b < start + units:
                hit = Int32(1)
            src = ptx.highest_bit(ptx.ballot(hit))
            if src >= 0:
                found_e = ptx.shfl_idx_s32(e, src)
                found_start = ptx.shfl_idx_s32(start, src)
                found_tiles = ptx.shfl_idx_s32(tiles, src)
            carry = carry + ptx.shfl_idx_s32(incl, Int32(31))
        r = b - found_start
        return found_e, r // found_tiles, r % found_tiles

    @cute.jit
    def unit_table(expert_offsets, experts, gy):
        """A stream_k warp's scan of the units with tokens, read once per CTA and kept in registers: per pass of 32
        experts (lane + 32 c) the inclusive unit prefix, the expert's units, first row and rows; and the units in
        all. Looking a unit up (`unit_lookup`) then needs no memory access: the producer's switch to its next unit
        does not wait for a global load round trip with the ring drained (step 21)."""
        lane = cute.arch.thread_idx()[0] % 32
        carry = Int32(0)
        table = []
        for c in cutlass.range_constexpr(STREAM_MAX_EXPERTS // 32):
            e = c * 32 + lane
            first = Int32(0)
            rows = Int32(0)
            if e < experts:
                first = ptx.ldg_s32(expert_offsets + Int64(e) * 4)
                rows = ptx.ldg_s32(expert_offsets + Int64(e) * 4 + 4) - first
            units = ((rows + (BN - 1)) // BN) * gy
            incl = units
            for d in cutlass.range_constexpr(5):
                up = ptx.shfl_up_s32(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            table.append((carry + incl, units, first, rows))
            carry = carry + ptx.shfl_idx_s32(incl, Int32(31))
        return table, carry

    @cute.jit
    def unit_lookup(table, b):
        """(expert, weight-row tile, token tile, the tile's first row, its rows from there) of unit b (`unit_table`;
        units ordered by expert, then weight-row tile, then token tile)."""
        found_e = Int32(0)
        found_start = Int32(0)
        found_first = Int32(0)
        found_rows = Int32(0)
        found_tiles = Int32(1)
        for c in cutlass.range_constexpr(STREAM_MAX_EXPERTS // 32):
            incl, units, first, rows = table[c]
            hit = Int32(0)
            if b >= incl - units and b < incl:
                hit = Int32(1)
            src = ptx.highest_bit(ptx.ballot(hit))
            if src >= 0:
                found_e = c * 32 + src
                found_start = ptx.shfl_idx_s32(incl - units, src)
                found_first = ptx.shfl_idx_s32(first, src)
                found_rows = ptx.shfl_idx_s32(rows, src)
                found_tiles = (found_rows + (BN - 1)) // BN
        r = b - found_start
        bz = r % found_tiles
        return found_e, r // found_tiles, bz, found_first + bz * BN, found_rows - bz * BN

    @cute.jit
    def unit_lookup_quick(table, b):
        """quick_start, the producer's: `unit_lookup` without its serial passes. The units are numbered expert after
        expert, so unit b's expert is the count of experts whose inclusive unit prefix is at most b (the experts before
        it, empty ones included): one ballot per pass of 32, both at once, then one shuffle of each value from that
        lane. The expert's token tiles are mostly one (a stream-K tile of 8 rows), which needs no division. The
        results are warp-uniform: the producer's bulk copies take them from uniform registers."""
        before = Int32(0)
        for c in cutlass.range_constexpr(STREAM_MAX_EXPERTS // 32):
            passed = Int32(0)
            if table[c][0] <= b:
                passed = Int32(1)
            before = before + ptx.popc(ptx.ballot(passed))
        e = cute.arch.make_warp_uniform(before)
        src = e % 32
        start, first, rows = table[0][0] - table[0][1], table[0][2], table[0][3]
        for c in cutlass.range_constexpr(1, STREAM_MAX_EXPERTS // 32):
            if e >= c * 32:  # the pass holding expert e: its lane's values (a select per lane, before one shuffle)
                start, first, rows = table[c][0] - table[c][1], table[c][2], table[c][3]
        start = cute.arch.make_warp_uniform(ptx.shfl_idx_s32(start, src))
        first = cute.arch.make_warp_uniform(ptx.shfl_idx_s32(first, src))
        rows = cute.arch.make_warp_uniform(ptx.shfl_idx_s32(rows, src))
        tiles = (rows + (BN - 1)) // BN
        r = b - start
        bx = r
        bz = Int32(0)
        if tiles != 1:
            bx = r // tiles
            bz = r - bx * tiles
        return e, bx, bz, first + bz * BN, rows - bz * BN

    @cute.jit
    def swiglu_value(acc, factor, i, c, rw):
        """A consumer thread's W1 value of token 8 i + 2 q + c: SwiGLU (clamped gate and up, fast sigmoid) of its
        gate and up accumulators times the expert's factor, times the token's routing weight `rw`."""
        gate = ptx.fmin(acc[4 * i + c] * factor, Float32(cfg.swiglu_clamp))
        up = ptx.fmax(ptx.fmin(acc[4 * i + 2 + c] * factor, Float32(cfg.swiglu_clamp)), Float32(-cfg.swiglu_clamp))
        return gate * ptx.fast_sigmoid(gate * Float32(cfg.swiglu_alpha)) * up * rw

    @cute.jit
    def w1_post(tid, wg, warp, g, q, factor, acc, smem, row0, count, rows, bx, m_tiles, routing_weight, out,
                out_scale, ring, done_mask, words=None, meta=None, posted=None):
        """epilogue_warp: a consumer thread's part of a W1 unit epilogue (`w1_epilogue`'s arguments; `posted`: the
        units this CTA handed over before). Its two SwiGLU values go to the slot once the epilogue warp has read the
        previous unit's (the empty barrier's phase posted - 1), thread 0 writes the header, and every thread
        arrives on the full barrier: no barrier among the consumers. Token n's values are a row of 128 channels,
        their 16-byte groups XOR-swizzled by 8 x ((n // 2) % 4) channels so a warp's stores (its 8 channels at 4
        column pairs q) fall in distinct banks."""
        slot = smem + cfg.epilogue_offset
        if posted > 0:
            ptx.mbarrier_wait(slot + 8, (posted - 1) % 2, suspend_ns=SUSPEND)
        channel = wg * 32 + warp * 8 + g
        for c in cutlass.range_constexpr(2):
            n = 2 * q + c
            if cutlass.const_expr(words is not None):  # loaded before the K loop (lean stream_k)
                rw = words[c]
            else:
                rw = ptx.ldg_f32(routing_weight + token_row(row0, n, count) * 4)
            ptx.sts_f32(slot + EPILOGUE_VALUES_OFFSET + n * 512 + (channel ^ (8 * q)) * 4,
                        swiglu_value(acc, factor, 0, c, rw))
        if tid == 0:
            ptx.sts_s32(slot + 16, row0)
            ptx.sts_s32(slot + 20, count)
            ptx.sts_s32(slot + 24, bx)
        ptx.mbarrier_arrive(slot)

    @cute.jit
    def w1_post_end(tid, smem, posted):
        """epilogue_warp: the consumers' last hand-over, rows -1 (the CTA's units are done)."""
        slot = smem + cfg.epilogue_offset
        if posted > 0:
            ptx.mbarrier_wait(slot + 8, (posted - 1) % 2, suspend_ns=SUSPEND)
        if tid == 0:
            ptx.sts_s32(slot + 20, Int32(-1))
        ptx.mbarrier_arrive(slot)

    @cute.jit
    def w1_epilogue_warp(smem, m_tiles, out, out_scale, lane):
        """epilogue_warp: the warp that finishes the W1 units the consumers hand over (`w1_post`), one at a time
        until the last hand-over: per token the amax of its 128 values (four per lane, then the warp's maximum),
        the E4M3 codes (one 4-byte store per lane: 128 bytes per token row) and the K128 scale, as `w1_epilogue`
        computes them (the same bits); then every lane's arrival on the empty barrier gives the slot back."""
        slot = smem + cfg.epilogue_offset
        inter = m_tiles * 32
        taken = Int32(0)
        more = Int32(1)
        while more == 1:
            ptx.mbarrier_wait(slot, taken % 2, suspend_ns=SUSPEND)
            count = ptx.lds_s32(slot + 20)
            if count < 0:
                more = Int32(0)
            else:
                row0 = ptx.lds_s32(slot + 16)
                bx = ptx.lds_s32(slot + 24)
                # every token's loads, maxima and shuffle rounds side by side, the stores after them: eight
                # independent chains instead of eight in a row behind each token's store branch
                vals = [ptx.lds_f32x4(slot + EPILOGUE_VALUES_OFFSET + n * 512 + ((4 * lane) ^ (8 * ((n // 2) % 4))) * 4)
                        for n in range(BN)]
                ms = [ptx.fmax(ptx.fmax(ptx.fabs(v[0]), ptx.fabs(v[1])), ptx.fmax(ptx.fabs(v[2]), ptx.fabs(v[3])))
                      for v in vals]
                for d in cutlass.range_constexpr(5):
                    ms = [ptx.fmax(m, ptx.shfl_xor_f32(m, 1 << d)) for m in ms]
                for n in cutlass.range_constexpr(BN):
                    v = vals[n]
                    amax = ptx.fmax(ms[n], Float32(AMAX_FLOOR))
                    inv = Float32(FP8_MAX) * ptx.fast_reciprocal(amax)
                    codes = [v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv]
                    if n < count:
                        nrow = Int64(row0) + Int64(n)
                        ptx.stg_e4m3x4(out + nrow * Int64(inter) + Int64(bx * 128 + 4 * lane), codes)
                        if lane == 0:
                            ptx.stg_f32(out_scale + (nrow * Int64(inter // 128) + Int64(bx)) * 4,
                                        amax * Float32(1.0 / FP8_MAX))
                ptx.mbarrier_arrive(slot + 8)
                taken = taken + 1

    @cute.jit
    def w1_epilogue(tid, wg, warp, g, q, factor, acc, smem, row0, count, rows, bx, m_tiles, routing_weight, out,
                    out_scale, ring, done_mask, words=None, meta=None, amax_unit=None):
        """A consumer thread's W1 epilogue: SwiGLU x routing weight, the amax of the CTA's 128 channels, E4M3
        rows with FP32 K128 scales; the ring consumer releases its ring blocks, the fused half its bit.
        amax_slots: `amax_unit` (the unit's index) picks the slot set of its amax."""
        if cutlass.const_expr(RING):
            ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns = ring[:6]
        inter = m_tiles * 32
        channel = bx * 128 + wg * 32 + warp * 8 + g
        hv = cute.make_rmem_tensor((BN // 4,), Float32)
        amax_at = smem + cfg.amax_offset  # the token amax words the reads below take (per token)
        if cutlass.const_expr(AMAX_SLOTS):
            amax_at = smem + cfg.amax_offset + (amax_unit % 3) * (BN * 4)
        for i in cutlass.range_constexpr(NSUB):
            for c in cutlass.range_constexpr(2):
                n = 8 * i + 2 * q + c
                nrow = token_row(row0, n, count)
                if cutlass.const_expr(RING):
                    rw = ptx.ld_global_f32(routing_weight + nrow * 4)
                elif cutlass.const_expr(words is not None):  # loaded before the K loop (lean stream_k)
                    rw = words[2 * i + c]
                elif cutlass.const_expr(LEAN and meta is not None):  # the persistent unit's slot
                    rw = ptx.lds_f32(meta + n * 4)
                elif cutlass.const_expr(LEAN):  # staged by the producer (zero past the count: h is zero there too)
                    rw = ptx.lds_f32(smem + cfg.meta_offset + n * 4)
                else:
                    rw = ptx.ldg_f32(routing_weight + nrow * 4)
                h = swiglu_value(acc, factor, i, c, rw)
                hv[2 * i + c] = h
                m = ptx.fabs(h)
                m = ptx.fmax(m, ptx.shfl_xor_f32(m, 4))
                m = ptx.fmax(m, ptx.shfl_xor_f32(m, 8))
                m = ptx.fmax(m, ptx.shfl_xor_f32(m, 16))
                if g == 0:
                    if cutlass.const_expr(AMAX_SLOTS):
                        ptx.red_max_shared_nonneg_f32(amax_at + n * 4, m)
                    else:
                        ptx.sts_f32(smem + cfg.amax_offset + ((wg * 4 + warp) * BN + n) * 4, m)
        out_first = Int64(row0)
        if cutlass.const_expr(REUSE):
            # W1's output rows are a ring too: before this unit stores a later generation of them, every W2 CTA
            # that read the previous one has released it (thread 0 acquires; the barrier below orders the stores)
            l2_empty_count, l2_readers = ring[6], ring[7]
            out_rows = ring_block_m * ring_blocks
            out_first = Int64(row0 % out_rows)
            if tid == 0:
                block = row0 // ring_block_m
                while block <= (row0 + rows - 1) // ring_block_m:
                    generation = block // ring_blocks
                    if generation > 0:
                        ring_protocol.wait_at_least(l2_empty_count + Int64(block - generation * ring_blocks) * 4,
                                                    generation * l2_readers, cute.arch.globaltimer(), timeout_ns,
                                                    False)
                    block = block + 1
        consumer_sync()
        if cutlass.const_expr(AMAX_SLOTS):  # noqa: SIM102 (a trace-time branch around a device branch)
            # the set of the unit two ahead was the CTA's previous unit's: every warp read it before the barrier
            # above, and writes it next after the following unit's barrier, which this thread reaches after this
            if tid < BN:
                ptx.sts_f32(smem + cfg.amax_offset + ((amax_unit + 2) % 3) * (BN * 4) + tid * 4, Float32(0.0))
        if cutlass.const_expr(RING):  # noqa: SIM102 (a trace-time branch around a device branch)
            # every read of the tile's ring rows (copies, scales, routing weights) precedes the
            # barrier above: release the blocks so role1 may refill them (a later generation)
            if tid == 0:
                block = row0 // ring_block_m
                while block <= (row0 + rows - 1) // ring_block_m:
                    generation = block // ring_blocks
                    released = Int32(1)
                    if cutlass.const_expr(REUSE):
                        # the rows of the tile in this block: role1's wait counts rows (layer_layout.l1_readers)
                        first = block * ring_block_m
                        if first < row0:
                            first = row0
                        end = (block + 1) * ring_block_m
                        if end > row0 + rows:
                            end = row0 + rows
                        released = end - first
                    ring_protocol.atom_add_release_gpu(
                        l1_empty_count + Int64(block - generation * ring_blocks) * 4, released)
                    block = block + 1
        put_rows = None
        if cutlass.const_expr(TRANSPOSED):
            # row n's 16-byte pieces swizzled by (n // 2) % 8 = (4 i + q) % 8, so the four rows (tokens 2q + c) a
            # store instruction writes fall in distinct banks: row 8 i + c's byte at put_rows[i % 2] + (8 i + c) x 128
            put_even = smem + cfg.transpose_offset + q * 256 + ((wg * 32 + warp * 8 + g) ^ (q * 16))
            put_rows = (put_even, put_even ^ 64)
        if cutlass.const_expr(LEAN and not AMAX_SLOTS):
            # one thread per token reduces the 16 warps' maxima into the token's first slot (its column is read by
            # it alone), then every thread reads one word per value
            if tid < BN:
                token_amax = Float32(0.0)
                for p in cutlass.range_constexpr(16):
                    token_amax = ptx.fmax(token_amax, ptx.lds_f32(smem + cfg.amax_offset + (p * BN + tid) * 4))
                ptx.sts_f32(smem + cfg.amax_offset + tid * 4, token_amax)
            consumer_sync()
        for i in cutlass.range_constexpr(NSUB):
            for c in cutlass.range_constexpr(2):
                n = 8 * i + 2 * q + c
                amax = Float32(0.0)
                if cutlass.const_expr(LEAN or AMAX_SLOTS):
                    amax = ptx.lds_f32(amax_at + n * 4)
                else:
                    for p in cutlass.range_constexpr(16):
                        amax = ptx.fmax(amax, ptx.lds_f32(smem + cfg.amax_offset + (p * BN + n) * 4))
                amax = ptx.fmax(amax, Float32(AMAX_FLOOR))
                inv = Float32(FP8_MAX) * ptx.fast_reciprocal(amax)
                if cutlass.const_expr(TRANSPOSED):
                    # the token's row in shared memory (every row of the tile: those past the count stay there)
                    ptx.sts_e4m3((put_rows[i % 2]) + (8 * i + c) * 128, hv[2 * i + c] * inv)
                    if n < count:  # noqa: SIM102 (a device branch around a device branch, as below)
                        if tid < 4:
                            ptx.stg_f32(out_scale + ((out_first + Int64(n)) * Int64(inter // 128) + Int64(bx)) * 4,
                                        amax * Float32(1.0 / FP8_MAX))
                elif n < count:
                    nrow = out_first + Int64(n)
                    if cutlass.const_expr(REUSE):
                        if nrow >= Int64(out_rows):
                            nrow = nrow - Int64(out_rows)
                    ptx.stg_e4m3(out + nrow * Int64(inter) + Int64(channel), hv[2 * i + c] * inv)
                    if tid < 4:
                        ptx.stg_f32(out_scale + (nrow * Int64(inter // 128) + Int64(bx)) * 4,
                                    amax * Float32(1.0 / FP8_MAX))
        if cutlass.const_expr(TRANSPOSED):
            consumer_sync()  # every warp's channels of the rows before any thread's copy
            w1_copy_rows(tid, smem + cfg.transpose_offset, out + out_first * Int64(inter) + Int64(bx * 128), inter,
                         count)
        if cutlass.const_expr(FUSED):
            # every consumer's stores of this unit precede the barrier; thread 0's release of bit bx
            # (W2's K128 block bx) then carries them to whoever acquires the word
            consumer_sync()
            if tid == 0:
                ptx.red_or_release_gpu_u64(done_mask, Int64(1) << Int64(bx))
        if cutlass.const_expr((STREAM or PERSIST) and not AMAX_SLOTS):
            # every consumer warp has read the amax words before the CTA's next unit writes them: a warp may run a
            # unit shorter than the ring from stages already full and reach that epilogue while another still
            # reads these (the fused half's barrier above does the same for its units)
            consumer_sync()

    @cute.jit
    def w1_copy_rows(tid, rows_at, first, inter, count):
        """transposed_stores: the tile's E4M3 rows from shared memory to their 128 channels at `first` (row 0's),
        eight threads per row, a 16-byte piece each (rows up to the count and the tile)."""
        rows = count
        if rows > BN:  # a unit's count is the expert's rows from its first on
            rows = Int32(BN)
        for k in cutlass.range_constexpr(-(-BN * 8 // THREADS)):
            idx = tid + k * THREADS
            n = idx // 8
            piece = idx % 8
            if n < rows:
                ptx.stg128(first + Int64(n) * Int64(inter) + Int64(piece * 16),
                           ptx.lds128(rows_at + n * 128 + (piece ^ ((n // 2) % 8)) * 16))

    @cute.jit
    def split_unit(ks_index, k_blocks, m_tiles, e, bx, bz):
        """A split CTA's K128 steps (first, count) and its unit (token tile x weight-row CTA x expert), the index of
        its partials and arrival count."""
        k_first = (ks_index * k_blocks) // KS
        tiles = Int32(cute.arch.grid_dim()[0]) // KS
        unit = (e * (m_tiles // TILES_PER_CTA) + bx) * tiles + bz
        return (k_first, ((ks_index + 1) * k_blocks) // KS - k_first), unit

    # a stream_k owner's pieces fit one stage of the ring this many at a time (BN / 2 FP32 per consumer thread
    # each): its producer copies them there (`stage_pieces`) as its K loop ends, more go the consumers' way
    STAGED_PIECES = cfg.stage_bytes // (THREADS * (BN // 2) * 4)

    @cute.jit
    def owner_pieces(unit, k_blocks, ctas, work, smem=None, wmode=None):
        """A shared unit's owner CTA and its piece count (the owner's own included). wmode (sm_weights): 1 where
        the ranges follow the weights (`weighted_owner` over the table in `smem`), 0 where they are equal."""
        if cutlass.const_expr(wmode is None):
            first_cta = stream_owner(unit * k_blocks, ctas, work)
            return first_cta, stream_owner((unit + 1) * k_blocks - 1, ctas, work) - first_cta + 1
        first_cta = stream_owner(unit * k_blocks, ctas, work)
        last_cta = stream_owner((unit + 1) * k_blocks - 1, ctas, work)
        if wmode == 1:
            first_cta = weighted_owner(smem, unit * k_blocks, work)
            last_cta = weighted_owner(smem, (unit + 1) * k_blocks - 1, work)
        return first_cta, last_cta - first_cta + 1

    @cute.jit
    def load_sm_table(weights, smem, tid):
        """sm_weights, consumer warp 0: the per-SM weights (`weights[smid]`, int32, 0 where no CTA of the launch runs)
        as two exclusive prefixes over %smid in shared memory, the weight before each SM (where its range starts)
        and the weighted SMs before it (its rank); entry MAX_SM_IDS holds the totals. Before the ring's barrier."""
        if tid < 32:
            wbase = smem + cfg.sm_table_offset
            rbase = wbase + SM_TABLE_BYTES
            carry_w = Int32(0)
            carry_r = Int32(0)
            for c in cutlass.range_constexpr(MAX_SM_IDS // 32):
                i = c * 32 + tid
                w = ptx.ldg_s32(weights + Int64(i) * 4)
                r = Int32(0)
                if w > 0:
                    r = Int32(1)
                incl_w = w
                incl_r = r
                for d in cutlass.range_constexpr(5):
                    up_w = ptx.shfl_up_s32(incl_w, 1 << d)
                    up_r = ptx.shfl_up_s32(incl_r, 1 << d)
                    if tid >= (1 << d):
                        incl_w = incl_w + up_w
                        incl_r = incl_r + up_r
                ptx.sts_s32(wbase + i * 4, carry_w + incl_w - w)
                ptx.sts_s32(rbase + i * 4, carry_r + incl_r - r)
                carry_w = carry_w + ptx.shfl_idx_s32(incl_w, Int32(31))
                carry_r = carry_r + ptx.shfl_idx_s32(incl_r, Int32(31))
            if tid == 0:
                ptx.sts_s32(wbase + MAX_SM_IDS * 4, carry_w)
                ptx.sts_s32(rbase + MAX_SM_IDS * 4, carry_r)

    @cute.jit
    def sm_rank(smem, smid):
        """sm_weights: (this SM's rank among the weighted SMs, their count); the rank is the count where the SM has
        no weight (its CTA then gets no steps)."""
        wbase = smem + cfg.sm_table_offset
        rbase = wbase + SM_TABLE_BYTES
        n = ptx.lds_s32(rbase + MAX_SM_IDS * 4)
        rank = ptx.lds_s32(rbase + smid * 4)
        if ptx.lds_s32(rbase + smid * 4 + 4) == rank:  # weight 0: no steps
            rank = n
        return rank, n

    @cute.jit
    def weighted_range(smem, smid, work):
        """sm_weights: the K128 steps [start, end) of the SM `smid`: its share of `work` by weight."""
        wbase = smem + cfg.sm_table_offset
        total = Int64(ptx.lds_s32(wbase + MAX_SM_IDS * 4))
        first = Int64(work) * Int64(ptx.lds_s32(wbase + smid * 4)) // total
        end = Int64(work) * Int64(ptx.lds_s32(wbase + smid * 4 + 4)) // total
        return Int32(first), Int32(end)

    @cute.jit
    def weighted_owner(smem, step, work):
        """sm_weights: the rank of the SM whose weighted range holds `step`: the largest smid s whose range starts
        at or before it (floor(work W_s / W) <= step, i.e. work W_s < (step + 1) W: no division), which has a
        weight (an SM without one starts where the next does)."""
        wbase = smem + cfg.sm_table_offset
        total = Int64(ptx.lds_s32(wbase + MAX_SM_IDS * 4))
        limit = Int64(step + 1) * total
        lo = Int32(0)
        for bit in cutlass.range_constexpr(7, -1, -1):  # MAX_SM_IDS = 2^8
            if Int64(work) * Int64(ptx.lds_s32(wbase + (lo + (1 << bit)) * 4)) < limit:
                lo = lo + (1 << bit)
        return ptx.lds_s32(wbase + SM_TABLE_BYTES + lo * 4)

    @cute.jit
    def stage_pieces(smem, split, unit, first_cta, pieces, step, pidx):
        """A stream_k owner's producer after its last copies: the pieces' partials into the stage of the CTA's
        step `step` (the one after its last), announced on that stage's full barrier like a K128 step. Lane 0 of
        each producer warp acquires the unit's count first (bounded); the pieces were mostly done long before,
        so the owner's epilogue then reads them from shared memory instead of waiting for a round trip."""
        split_partials, split_counts = split
        stage = step % STAGES
        full = smem + cfg.barrier_offset + stage * 8
        if step >= STAGES:
            ptx.mbarrier_wait(full + STAGES * 8, empty_parity(step, STAGES), suspend_ns=SUSPEND)
        if pidx % 32 == 0:
            ptx.wait_at_least_acquire_gpu(split_counts + Int64(unit) * 4, pieces - 1)
        if cutlass.const_expr(PAIR):
            # the lanes' copies after their lane 0's acquire: in the pair kernel a bar.warp.sync here (with both
            # walks) kept the ring's stage index in vector registers in every K loop (step 40); the plain stream-K
            # loops keep their uniform registers with it, and lose them without it
            ptx.named_barrier_sync(ptx.PRODUCER_WARP_BARRIER, 32)
        else:
            ptx.warp_sync()  # the lanes' copies after their lane 0's acquire
        piece_bytes = THREADS * (BN // 2) * 4
        sbase = smem + stage * cfg.stage_bytes
        for p in cutlass.range(1, pieces):
            src = split_partials + (Int64(unit) + Int64(first_cta + p)) * piece_bytes
            dst = sbase + (p - 1) * piece_bytes
            for c in cutlass.range_constexpr(piece_bytes // 16 // PT):
                off = (c * PT + pidx) * 16
                ptx.cp_async_16_zfill(dst + off, src + Int64(off), Int32(16))
        ptx.cp_async_mbarrier_arrive_noinc(full)
        if pidx == 0:
            ptx.mbarrier_arrive(full)  # the byte announcement's arrival (no bytes: the copies are cp.async)

    @cute.jit
    def piece_slot(split_partials, unit, cta, tid):
        """tagged_pieces: consumer thread `tid`'s slot of piece unit + cta (BN / 2 FP32 words, 16 bytes)."""
        return split_partials + ((Int64(unit) + Int64(cta)) * THREADS + Int64(tid)) * ((BN // 2) * 4)

    @cute.jit
    def early_pieces(split_partials, unit, k_blocks, k_first, steps, ctas, work, tid, chunk=None):
        """tagged_pieces, before a segment's K loop: an owner's first TAGGED_EARLY_PIECES pieces' slots, loaded now
        (the pieces are the first segments of the CTAs after it, mostly published long before its last segment);
        zeros for a segment that is no owner and past its pieces. `stream_epilogue` checks them."""
        owner = Int32(0)
        if k_first == 0 and steps < k_blocks:
            owner = Int32(1)
        if cutlass.const_expr(chunk is not None):  # noqa: SIM102 (a trace-time branch around a device one)
            if chunk >= 0:  # dynamic_tail: a chunk is no owner
                owner = Int32(0)
        first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work)
        early = []
        for j in cutlass.range_constexpr(TAGGED_EARLY_PIECES):
            take = Int32(0)
            if owner == 1 and j + 1 < pieces:
                take = Int32(1)
            early.append(ptx.ld_piece_v4_if(piece_slot(split_partials, unit, first_cta + j + 1, tid), take))
        return early

    @cute.jit
    def stream_epilogue(tid, wg, warp, g, q, factor, acc, smem, split, unit, cta, ctas, work, k_blocks, k_first,
                        whole, next_step, *rest, wmode=None, early=None):
        """A stream_k segment's consumer thread: a whole unit (whole = 1) goes to the role's epilogue (`rest`: its
        arguments). A shared unit is finished by its owner, the CTA with its first steps (k_first = 0: the last
        segment of that CTA's range, while the other pieces are the first segments of the CTAs after it). The
        others publish their partials as piece unit + cta (`stream_sizes`) and go on without waiting (one thread's
        release after the consumers' barrier); the owner adds their partials in CTA order to its own (the same bits
        whichever arrives last) and runs the epilogue: from the stage of its step `next_step` where its producer
        put them (up to STAGED_PIECES pieces), else after thread 0's bounded wait for their arrivals. Needs every
        CTA of the grid resident at once (the launch's ctas_per_sm x SMs). tagged_pieces: the pieces' slots
        instead (`early`: the owner's first pieces' words as loaded before its K loop; `piece_slot`)."""
        split_partials, split_counts = split
        per = BN // 2
        last = Float32(1.0)
        if cutlass.const_expr(TAGGED):
            if whole == 0:
                first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
                if k_first != 0:
                    ptx.st_piece_v4(piece_slot(split_partials, unit, cta, tid), [acc[i] for i in range(per)])
                    last = Float32(0.0)
                else:  # the pieces in CTA order, as the fenced owner adds them (the same bits)
                    for j in cutlass.range_constexpr(TAGGED_EARLY_PIECES):
                        if j + 1 < pieces:
                            theirs = ptx.settle_piece_v4(piece_slot(split_partials, unit, first_cta + j + 1, tid),
                                                         early[j])
                            for i in cutlass.range_constexpr(per):
                                acc[i] = acc[i] + theirs[i]
                    for p in cutlass.range(TAGGED_EARLY_PIECES + 1, pieces):
                        at = piece_slot(split_partials, unit, first_cta + p, tid)
                        theirs = ptx.settle_piece_v4(at, ptx.ld_piece_v4_if(at, Int32(1)))
                        for i in cutlass.range_constexpr(per):
                            acc[i] = acc[i] + theirs[i]
        elif whole == 0:
            first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
            count_word = split_counts + Int64(unit) * 4
            if k_first != 0:
                mine = split_partials + ((Int64(unit) + Int64(cta)) * THREADS + Int64(tid)) * (per * 4)
                for i in cutlass.range_constexpr(per):
                    ptx.stg_f32(mine + Int64(i * 4), acc[i])
                consumer_sync()
                if tid == 0:
                    ptx.red_add_release_gpu_s32(count_word, Int32(1))
                last = Float32(0.0)
            elif pieces - 1 <= STAGED_PIECES:
                stage = next_step % STAGES
                ptx.mbarrier_wait(smem + cfg.barrier_offset + stage * 8, full_parity(next_step, STAGES),
                                  suspend_ns=SUSPEND)
                if tid == 0:
                    ptx.st_relaxed_gpu_s32(count_word, Int32(0))  # every producer warp acquired it: reset
                theirs = smem + stage * cfg.stage_bytes + tid * (per * 4)
                for p in cutlass.range(1, pieces):
                    for i in cutlass.range_constexpr(per):
                        acc[i] = acc[i] + ptx.lds_f32(theirs + (p - 1) * (THREADS * per * 4) + i * 4)
                # the stage is the CTA's last: no release (the next launch sets the barriers up again); the pair
                # kernel's W1 releases it after the epilogue's last barrier (`stream_walk`), W2's steps go on there
            else:
                if tid == 0:
                    ptx.wait_at_least_acquire_gpu(count_word, pieces - 1)
                    ptx.st_relaxed_gpu_s32(count_word, Int32(0))  # ready for the next launch
                consumer_sync()  # thread 0's acquire before every thread's loads of the partials
                for p in cutlass.range(1, pieces):
                    theirs = split_partials + ((Int64(unit) + Int64(first_cta + p)) * THREADS + Int64(tid)) * (per * 4)
                    for i in cutlass.range_constexpr(per):
                        acc[i] = acc[i] + ptx.ld_relaxed_gpu_f32(theirs + Int64(i * 4))
        if last > Float32(0.5):
            if cutlass.const_expr(W1 and EPI_WARP):  # the values to the epilogue warp, which finishes the unit
                w1_post(tid, wg, warp, g, q, factor, acc, *rest)
            elif cutlass.const_expr(W1):
                w1_epilogue(tid, wg, warp, g, q, factor, acc, *rest)
            else:
                w2_epilogue(tid, wg, warp, g, q, factor, acc, *rest)

    @cute.jit
    def early_epilogue_words(words_src, w_factor, e, row0, count, q):
        """lean_epilogue in a stream_k segment: the expert's factor and the thread's per-value words (W1's routing
        weights, W2's combine rows; a token past the count reads row0's, unused) loaded before the K loop, so the
        epilogue after it does not wait for global memory."""
        factor = weight_factor(w_factor, e)
        words = []
        for i in cutlass.range_constexpr(NSUB):
            for c in cutlass.range_constexpr(2):
                nrow = token_row(row0, 8 * i + 2 * q + c, count)
                if cutlass.const_expr(W1):
                    words.append(ptx.ldg_f32(words_src + nrow * 4))
                else:
                    words.append(ptx.ldg_s32(words_src + nrow * 4))
        return factor, words

    @cute.jit
    def tail_units_of(units, k_blocks):
        """dynamic_tail: how many of the last units go to the chunks: units // TAIL_UNIT_DIV, none where the static
        ranges would leave a CTA of the grid without a step."""
        tail = units // TAIL_UNIT_DIV
        if (units - tail) * k_blocks < Int32(cute.arch.grid_dim()[0]):
            tail = Int32(0)
        return tail

    @cute.jit
    def claim_chunk(ticket, pidx):
        """dynamic_tail, the producer warp: lane 0 draws the next chunk (a relaxed atomic: the ticket only hands out
        work), the warp takes its value."""
        c = Int32(0)
        if pidx == 0:
            c = ptx.atom_add_relaxed_gpu_s32(ticket, Int32(1))
        return cute.arch.make_warp_uniform(ptx.shfl_idx_s32(c, Int32(0)))

    @cute.jit
    def end_chunks(smem, step, pidx):
        """dynamic_tail, the producer warp after its last chunk: the stage of step `step` says -1 (no more chunks)
        and completes its phase without bytes (each producer thread's arrival and pidx 0's in place of the byte
        announcement)."""
        stage = step % STAGES
        full = smem + cfg.barrier_offset + stage * 8
        if step >= STAGES:
            ptx.mbarrier_wait(full + STAGES * 8, empty_parity(step, STAGES), suspend_ns=SUSPEND)
        if pidx == 0:
            ptx.sts_s32(smem + stage * cfg.stage_bytes + cfg.chunk_slot_offset, Int32(-1))
        ptx.mbarrier_arrive(full)
        if pidx == 0:
            ptx.mbarrier_arrive(full)

    @cute.jit
    def next_chunk(smem, step):
        """dynamic_tail, the consumers: the chunk the stage of step `step` holds once it is full (-1: the end)."""
        stage = step % STAGES
        ptx.mbarrier_wait(smem + cfg.barrier_offset + stage * 8, full_parity(step, STAGES), suspend_ns=SUSPEND)
        # one word for every thread: marked warp-uniform, the chunk's steps and the ring's position stay uniform
        return cute.arch.make_warp_uniform(ptx.lds_s32(smem + stage * cfg.stage_bytes + cfg.chunk_slot_offset))

    @cute.jit
    def chunk_steps(c, per_unit, k_blocks, static_units):
        """dynamic_tail: chunk c's (unit, first K128 step, steps): its unit's steps in per_unit parts of nearly
        equal length (per_unit <= k_blocks: every part has a step)."""
        rel = c // per_unit
        part = c - rel * per_unit
        k_first = part * k_blocks // per_unit
        return static_units + rel, k_first, (part + 1) * k_blocks // per_unit - k_first

    @cute.jit
    def chunk_epilogue(tid, wg, warp, g, q, factor, acc, smem, split, unit, c, first_chunk, per_unit, units,
                       grid_ctas, *rest):
        """dynamic_tail, a chunk's consumer thread: its partials into piece units + CTAs + c; after the consumers'
        barrier thread 0 counts the arrival (acquire and release: the partials of the chunks before it) and tells the
        others whether it was the unit's last; the last adds the unit's chunks' partials in chunk order (the same bits
        whoever arrives last) and runs the role's epilogue. The count returns to zero for the next launch (tagged_pieces:
        and the chunks' slots to empty)."""
        split_partials, split_counts = split
        per = BN // 2
        count_word = split_counts + Int64(unit) * 4
        # piece units + CTAs + k of this thread: chunk0 + k x stride
        chunk0 = split_partials + ((Int64(units) + Int64(grid_ctas)) * THREADS + Int64(tid)) * (per * 4)
        stride = Int64(THREADS * per * 4)
        mine = chunk0 + Int64(c) * stride
        for i in cutlass.range_constexpr(per):
            ptx.stg_f32(mine + Int64(i * 4), acc[i])
        consumer_sync()
        if tid == 0:
            last = Int32(0)
            if ptx.atom_add_acq_rel_gpu_s32(count_word, Int32(1)) == per_unit - 1:
                last = Int32(1)
                ptx.st_relaxed_gpu_s32(count_word, Int32(0))  # ready for the next launch
            ptx.sts_s32(smem + cfg.tail_offset, last)
        consumer_sync()  # thread 0's acquire (and its word) before every thread's loads of the partials
        if ptx.lds_s32(smem + cfg.tail_offset) == 1:
            for i in cutlass.range_constexpr(per):
                acc[i] = Float32(0.0)
            for k in cutlass.range(per_unit):
                at = chunk0 + Int64(first_chunk + k) * stride
                for i in cutlass.range_constexpr(per):
                    acc[i] = acc[i] + ptx.ld_relaxed_gpu_f32(at + Int64(i * 4))
                if cutlass.const_expr(TAGGED):  # every piece slot empty when the launch ends (tagged_pieces)
                    ptx.empty_piece_v4(at)
            if cutlass.const_expr(W1):
                w1_epilogue(tid, wg, warp, g, q, factor, acc, *rest)
            else:
                w2_epilogue(tid, wg, warp, g, q, factor, acc, *rest)

    @cute.jit
    def stream_body(a, w_factor, expert_offsets, k_blocks, m_tiles, experts, split, role_args, handover=None):
        """A stream_k CTA (GemmConfig.stream_k): its share of the steps of the units with tokens, unit after unit
        on one stage ring (initialized once; `base` counts the CTA's steps). The producer warp and the consumer
        warpgroups walk the same segments (unit, first step, steps), each side on its own (`stream_walk`).
        role_args: W1's (routing_weight, out, out_scale), W2's (dest_row, out). With trace, thread 0 and the
        producer's first thread stamp the phases (`TRACE_SLOTS`) at the head of the partials buffer. handover:
        W1's (ready words, token tiles per expert in them, permits per finished unit), W2's (ready words, token
        tiles per expert) (`GemmConfig.handover`)."""
        tid = cute.arch.thread_idx()[0]
        if cutlass.const_expr(W1):
            # a W2 launched programmatically after this grid may start its CTAs (and their weight stages) as SMs
            # free up; it waits for this grid's completion before reading its output (`produce`)
            ptx.griddepcontrol_launch_dependents()
        coords = thread_coords(tid)
        cta = Int32(cute.arch.block_idx()[0])
        trace = Int64(0)
        if cutlass.const_expr(TRACE):
            trace, split = trace_slots(split, cta, tid)
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        if cutlass.const_expr(LEAN_RING):  # held once, not rebuilt from the CTA's cluster id in every K128 step
            smem = cute.arch.make_warp_uniform(smem)
        init_stage_ring(smem, tid)
        if cutlass.const_expr(TMA_TOKENS):  # noqa: SIM102 (a trace-time branch around a device one)
            if tid == THREADS:  # the producer thread that issues every copy through the map (its pidx 0)
                ptx.tensor_map_acquire(a[4])
        if cutlass.const_expr(EPI_WARP):
            if tid >= EPI_TID:
                w1_epilogue_warp(smem, m_tiles, role_args[1], role_args[2], tid % 32)
            else:
                stream_role(a, w_factor, expert_offsets, k_blocks, m_tiles, experts, split, role_args, handover, tid,
                            coords, cta, smem, trace)
        else:
            stream_role(a, w_factor, expert_offsets, k_blocks, m_tiles, experts, split, role_args, handover, tid,
                        coords, cta, smem, trace)

    @cute.jit
    def stream_role(a, w_factor, expert_offsets, k_blocks, m_tiles, experts, split, role_args, handover, tid, coords,
                    cta, smem, trace):
        """A stream_k CTA's producer warp and consumer warpgroups (`stream_body`): the unit scan, the walk."""
        magic = None
        if cutlass.const_expr(QUICK):  # the range's divisor's multiplier while the scan's loads are out
            magic = ptx.division_magic(Int32(cute.arch.grid_dim()[0]))
        table, units = unit_table(expert_offsets, experts, m_tiles // TILES_PER_CTA)
        if cutlass.const_expr(TRACE):
            trace_scanned(trace, tid)
        base, segment = stream_walk(a, w_factor, table, units, k_blocks, m_tiles, split, role_args, tid, coords,
                                    cta, smem, Int32(0), trace, pair=handover, magic=magic)
        if tid >= THREADS:
            ptx.cp_async_wait_all()  # the warp leaves only once its last copies have landed
        if cutlass.const_expr(TRACE):
            trace_tail(trace, tid, segment)

    @cute.jit
    def rank_experts(expert_offsets, experts, smem, tid):
        """snake_walk, before the CTA's first unit: the local experts in decreasing row count (ties by index) at
        cfg.order_offset, thread e placing expert e by counting the experts ahead of it. The counts pass through the
        amax region, which only W1's epilogues use. Above SNAKE_MAX_EXPERTS nothing is written (natural order). The
        stage ring's initial barrier publishes the order."""
        counts = smem + cfg.amax_offset
        if experts <= SNAKE_MAX_EXPERTS:
            if tid < experts:
                ptx.sts_s32(counts + tid * 4, ptx.ldg_s32(expert_offsets + Int64(tid) * 4 + 4)
                            - ptx.ldg_s32(expert_offsets + Int64(tid) * 4))
            ptx.gemm_barrier(cfg)
            if tid < experts:
                mine = ptx.lds_s32(counts + tid * 4)
                ahead = Int32(0)
                for j in cutlass.range(experts, unroll=4):
                    other = ptx.lds_s32(counts + j * 4)
                    if other > mine or (other == mine and j < tid):
                        ahead = ahead + 1
                ptx.sts_s32(smem + cfg.order_offset + ahead * 4, tid)

    @cute.jit
    def persistent_unit(expert_offsets, b, token_tiles, gy, experts=None, smem=None):
        """(expert, weight-row CTA, token tile, the tile's first row, its rows from there) of unit b of the unit grid
        (token tiles fastest, then weight-row CTAs, then experts: the launch grid's order, so the CTAs that run side
        by side read the same weights); rows <= 0 for a tile past the expert's rows. snake_walk: the experts in
        the ranked order, and rows 0 for a position past the grid (an odd round's mirror of a partial round)."""
        bz = b % token_tiles
        rest = b // token_tiles
        bx = rest % gy
        e = rest // gy
        if cutlass.const_expr(SNAKE):
            past = e >= experts
            if past:
                e = experts - 1
            if experts <= SNAKE_MAX_EXPERTS:
                e = ptx.lds_s32(smem + cfg.order_offset + e * 4)
        off0 = ptx.ldg_s32(expert_offsets + Int64(e) * 4)
        count = ptx.ldg_s32(expert_offsets + Int64(e) * 4 + 4) - off0 - bz * BN
        if cutlass.const_expr(SNAKE):  # noqa: SIM102 (a trace-time branch around a device one)
            if past:
                count = Int32(0)
        return e, bx, bz, off0 + bz * BN, count

    @cute.jit
    def walk_position(b, cta, ctas):
        """The unit a persistent CTA takes at plain position b = r * G + cta: b itself, or with snake_walk in odd
        rounds the mirror r * G + G - 1 - cta."""
        u = b
        if cutlass.const_expr(SNAKE):  # noqa: SIM102 (a trace-time branch around a device one)
            if (b // ctas) % 2 == 1:
                u = b + ctas - 1 - 2 * cta
        return u

    @cute.jit
    def persistent_body(a, w_factor, expert_offsets, k_blocks, m_tiles, experts, token_tiles, role_args):
        """A persistent CTA (GemmConfig.persistent): units c, c + G, ... of the unit grid (G CTAs), each unit's K128
        steps numbered on from the previous one's on one stage ring (`base`), so the producer streams the next unit
        while the consumers finish this one. Producer and consumers walk the same units, each side on its own.
        role_args: W1's (routing_weight, out, out_scale), W2's (dest_row, out). lean_epilogue: unit j's words go to
        slot j mod 2; the producer stages unit j's once the consumers have left unit j - 2's epilogue (the slot's
        empty barrier: one arrival per consumer warp)."""
        tid = cute.arch.thread_idx()[0]
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        meta_bar = smem + cfg.meta_offset + 2 * cfg.meta_slot_bytes  # lean: the two slots' empty barriers
        if cutlass.const_expr(LEAN):  # noqa: SIM102 (a trace-time branch around a device one)
            if tid == 0:  # fenced and met by init_stage_ring
                ptx.mbarrier_init(meta_bar, THREADS // 32)
                ptx.mbarrier_init(meta_bar + 8, THREADS // 32)
        if cutlass.const_expr(SNAKE):
            rank_experts(expert_offsets, experts, smem, tid)
        init_stage_ring(smem, tid)
        gy = m_tiles // TILES_PER_CTA
        units = token_tiles * gy * experts
        ctas = Int32(cute.arch.grid_dim()[0])
        b = Int32(cute.arch.block_idx()[0])  # this round's position in the plain walk
        cta = b
        limit = units + cta if cutlass.const_expr(SNAKE) else units  # the snake: rounds while r * G < units
        base = Int32(0)
        done = Int32(0)  # units with rows this CTA has walked
        if tid >= THREADS:
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_decrease(cfg.producer_registers)
            pidx = tid - THREADS
            while b < limit:
                e, bx, _, row0, count = persistent_unit(expert_offsets, walk_position(b, cta, ctas), token_tiles, gy,
                                                        experts, smem)
                if count > 0:
                    if cutlass.const_expr(LEAN):
                        slot = done % 2
                        if done >= 2:  # the slot's previous unit (done - 2): every consumer warp left its epilogue
                            ptx.mbarrier_wait(meta_bar + slot * 8, (done // 2 - 1) % 2, suspend_ns=SUSPEND)
                        stage_epilogue_words(a[4], a[5], e, row0, count, smem, pidx,
                                             smem + cfg.meta_offset + slot * cfg.meta_slot_bytes)
                    produce(a, e, bx, row0, count, k_blocks, m_tiles, smem, pidx, None, base)
                    base = base + k_blocks
                    done = done + 1
                b = b + ctas
            ptx.cp_async_wait_all()  # the warp leaves only once its last copies have landed
        else:
            if cutlass.const_expr(SPLIT):
                cute.arch.setmaxregister_increase(cfg.consumer_registers)
            wg, t, warp, g, q = thread_coords(tid)
            acc = cute.make_rmem_tensor((BN // 2,), Float32)
            while b < limit:
                e, bx, _, row0, count = persistent_unit(expert_offsets, walk_position(b, cta, ctas), token_tiles, gy,
                                                        experts, smem)
                if count > 0:
                    meta = None
                    if cutlass.const_expr(LEAN):
                        meta = smem + cfg.meta_offset + (done % 2) * cfg.meta_slot_bytes
                    if cutlass.const_expr(not cfg.fit_n):
                        for i in cutlass.range_constexpr(BN // 2):
                            acc[i] = Float32(0.0)
                    consume_fitted(consume_table_waited, k_blocks, smem, wg, t, warp, g, q, acc, count, base)
                    factor = weight_factor(w_factor, e, smem, meta)
                    if cutlass.const_expr(W1):
                        routing_weight, out, out_scale = role_args
                        w1_epilogue(tid, wg, warp, g, q, factor, acc, smem, row0, count, count, bx, m_tiles,
                                    routing_weight, out, out_scale, None, None, None, meta)
                    else:
                        dest_row, out = role_args
                        w2_epilogue(tid, wg, warp, g, q, factor, acc, row0, count, bx, m_tiles, dest_row, out, None,
                                    smem, None, meta)
                    if cutlass.const_expr(LEAN):  # this warp's reads of the slot are done: the producer may refill it
                        ptx.warp_sync()
                        if t % 32 == 0:
                            ptx.mbarrier_arrive(meta_bar + (done % 2) * 8)
                    base = base + k_blocks
                    done = done + 1
                b = b + ctas

    @cute.jit
    def trace_slots(split, cta, tid):
        """trace: (CTA `cta`'s slots at the head of the partials buffer, the split buffers past the launch's slots);
        thread 0 stamps the entry."""
        trace = split[0] + Int64(cta) * (TRACE_SLOTS * 16)
        split = (split[0] + Int64(cute.arch.grid_dim()[0]) * (TRACE_SLOTS * 16), split[1])
        if tid == 0:
            ptx.stamp_times(trace)
        return trace, split

    @cute.jit
    def trace_scanned(trace, tid):
        """trace: the unit scan's end, thread 0's and the producer's."""
        if tid == 0:
            ptx.stamp_times(trace + Int64(16))
        if tid == THREADS:
            ptx.stamp_times(trace + Int64(32))

    @cute.jit
    def trace_tail(trace, tid, segment):
        """trace: the producer's and the consumers' end, the segments walked and the SM."""
        tail = trace + Int64(48 + 16 * TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS)
        if tid == THREADS:
            ptx.stamp_times(tail)
        if tid == 0:
            ptx.stamp_times(tail + Int64(16))
            ptx.stg_s64(tail + Int64(32), Int64(segment))
            ptx.stg_s64(tail + Int64(40), Int64(ptx.sm_id()))  # where it ran: is the end spread per SM?

    @cute.jit
    def walk_range(units, k_blocks, cta, smem, smid, magic=None):
        """A stream_k CTA's K128 steps [s, end) of this role's work, the working CTAs, the work, and the weighted
        mode (sm_weights: 1 where the ranges follow the weights, 0 where they are equal; None without). quick_start
        (magic: ptx.division_magic of the grid's CTAs): also the unit of step s, its range's bounds and that unit as
        multiplies by the magic (the same quotients as stream_range and s // k_blocks: floor(floor(x) / k) =
        floor(x / k)) wherever every CTA of the grid works."""
        ctas = Int32(cute.arch.grid_dim()[0])
        work = units * k_blocks
        s = Int32(0)
        end = Int32(0)
        if cutlass.const_expr(QUICK):
            units = cute.arch.make_warp_uniform(units)
            work = units * k_blocks
            grid_ctas = ctas
            first_unit = Int32(0)
        wmode = None
        if cutlass.const_expr(WEIGHTED):
            ctas = ptx.lds_s32(smem + cfg.sm_table_offset + SM_TABLE_BYTES + MAX_SM_IDS * 4)  # the weighted SMs
            wmode = Int32(0)
            if work >= SM_WEIGHT_MIN_STEPS * ctas:
                wmode = Int32(1)
            if work < ctas:
                ctas = work
            if cta < ctas:
                if wmode == 1:
                    s, end = weighted_range(smem, smid, work)
                else:
                    s, end = stream_range(cta, ctas, work)
        else:
            if work < ctas:  # stream_ctas: one step at least per working CTA
                ctas = work
            if cutlass.const_expr(QUICK and magic is not None):
                if cta < ctas:
                    if ctas == grid_ctas:
                        s = ptx.divide_by_magic(cta * work, ctas, magic)
                        end = ptx.divide_by_magic((cta + 1) * work, ctas, magic)
                        first_unit = ptx.divide_by_magic(cta * units, ctas, magic)
                    else:  # fewer steps than CTAs: another divisor
                        s, end = stream_range(cta, ctas, work)
                        first_unit = s // k_blocks
                return s, end, ctas, work, wmode, first_unit
            if cta < ctas:
                s, end = stream_range(cta, ctas, work)
        return s, end, ctas, work, wmode

    @cute.jit
    def w1_word(pair, e, bz, bx, m_tiles):
        """The hand-over word of W1 unit (expert e, token tile bz, weight-row CTA bx): pair = (words, token tiles
        per expert, readers)."""
        return pair[0] + ((Int64(e) * Int64(pair[1]) + Int64(bz)) * Int64(m_tiles // TILES_PER_CTA) + Int64(bx)) * 4

    @cute.jit
    def publish_walk(table, units, k_blocks, m_tiles, pair, tid, cta, smem, smid=None):
        """publisher_warp, the pair's W1 half: the warp beside the producer walks the CTA's segments as the
        consumers do (`stream_walk`) and, for each that finishes a unit (a whole unit or an owner), waits until the
        consumers' thread 0 has counted it (a shared word it stores with release after the consumers' epilogue
        barrier, so their stores are ordered before; an acquire poll, bounded) and releases the unit's word: one
        permit per W2 unit that reads it. A count, not a barrier's phase: the consumers may run ahead by any
        number of units."""
        s, end = walk_range(units, k_blocks, cta, smem, smid)[:2]
        published = Int32(0)
        while s < end:
            unit = s // k_blocks
            k_first = s - unit * k_blocks
            k_end = end - unit * k_blocks
            if k_end > k_blocks:  # noqa: PLR1730 (device values: min() would compare them at trace time)
                k_end = k_blocks
            if k_first == 0:
                e, bx, bz, _, _ = unit_lookup(table, unit)  # the whole warp (its ballots)
                if tid % 32 == 0:
                    ptx.wait_shared_at_least_acquire_cta(smem + cfg.publish_offset, published + 1)
                    ptx.red_add_release_gpu_s32(w1_word(pair, e, bz, bx, m_tiles), pair[2])
                published = published + 1
            s = s + k_end - k_first

    @cute.jit
    def stream_walk(a, w_factor, table, units, k_blocks, m_tiles, split, role_args, tid, coords, cta, smem, base,
                    trace, pair=None, smid=None, magic=None):
        """The segments of a stream_k CTA's range over this role's units (`unit_table`), its steps numbered from
        `base` on the CTA's stage ring; returns (base after them, segments walked). pair (a half of the stream-K
        pair kernel, `kernels.sm90.stream_pair`): W1's (ready words, token tiles per expert in them, W2's weight-row
        CTAs per token tile: the readers of each word), W2's (ready words, token tiles per expert). sm_weights: `cta`
        is the SM's rank (`sm_rank`), `smid` its SM: the range is its weighted share (`weighted_range`) wherever
        every weighted SM gets SM_WEIGHT_MIN_STEPS or more, else an equal one by rank."""
        wg, t, warp, g, q = coords
        static_units = units
        if cutlass.const_expr(DYN_TAIL):  # the static ranges end before the last units (`tail_units`)
            static_units = units - tail_units_of(units, k_blocks)
        if cutlass.const_expr(QUICK):  # the first segment's unit without a division
            s, end, ctas, work, wmode, walk_unit = walk_range(static_units, k_blocks, cta, smem, smid, magic)
        else:
            s, end, ctas, work, wmode = walk_range(static_units, k_blocks, cta, smem, smid)
        producer_path = None  # traced W1 (not the pair kernel's half): the tail's slots 4 and 5 of its producer's path
        if cutlass.const_expr(TRACE and W1 and not PAIR):
            producer_path = trace + Int64(48 + 16 * (TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + 4))
            if tid == THREADS:
                ptx.stamp_times(producer_path)
        segment = Int32(0)
        if cutlass.const_expr(PUBLISHER and W1):
            published = Int32(0)  # the units this CTA finished so far: the count thread 0 stores
        if cutlass.const_expr(EPI_WARP):
            posted = Int32(0)  # the units the consumers handed to the epilogue warp so far
        acc = cute.make_rmem_tensor((BN // 2,), Float32)
        chunk = Int32(-1)  # dynamic_tail: the chunk the segment is (-1: a segment of the static range)
        if cutlass.const_expr(DYN_TAIL):
            tail_units = units - static_units
            per_unit = Int32(TAIL_CHUNKS)
            if k_blocks < TAIL_CHUNKS:
                per_unit = k_blocks
            chunks = tail_units * per_unit
            ticket = split[1] + Int64(units) * 4
            grid_ctas = Int32(cute.arch.grid_dim()[0])
        while s < end:
            if cutlass.const_expr(QUICK):
                unit = walk_unit
                if segment > 0:  # past the chain to the first copies
                    unit = s // k_blocks
            else:
                unit = s // k_blocks
            k_first = s - unit * k_blocks
            k_end = end - unit * k_blocks
            if k_end > k_blocks:
                k_end = k_blocks
            steps = k_end - k_first
            if cutlass.const_expr(DYN_TAIL):  # noqa: SIM102 (a trace-time branch around a device one)
                if chunk >= 0:  # past the static range: the claimed chunk's unit and steps
                    unit, k_first, steps = chunk_steps(chunk, per_unit, k_blocks, static_units)
            if cutlass.const_expr(QUICK):  # the producer's (its bulk copies' addresses), the consumers' as before
                e, bx, bz, row0, count = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
                if tid >= THREADS:
                    e, bx, bz, row0, count = unit_lookup_quick(table, unit)
                else:
                    e, bx, bz, row0, count = unit_lookup(table, unit)
            else:
                e, bx, bz, row0, count = unit_lookup(table, unit)
            staged = Int32(0)  # the pair's W1 owner: its pieces took one more stage of the ring
            # (dynamic_tail: so does a fenced owner's, the tail's chunks come after it)
            if cutlass.const_expr(PAIR):  # noqa: SIM102 (a trace-time branch around a device one)
                if k_first == 0 and steps < k_blocks:
                    first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
                    if pieces - 1 <= STAGED_PIECES:
                        staged = Int32(1)
            if cutlass.const_expr(DYN_TAIL and not TAGGED):  # noqa: SIM102 (a trace-time branch around a device one)
                if k_first == 0 and steps < k_blocks and chunk < 0:
                    first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
                    if pieces - 1 <= STAGED_PIECES:
                        staged = Int32(1)
            seg_stamps = trace
            if cutlass.const_expr(TRACE):
                # a traced segment's slots (the segments past TRACE_SEGMENTS share the last ones)
                seg_bytes = 16 * TRACE_SEGMENT_SLOTS
                seg_stamps = trace + Int64(48 + seg_bytes * (TRACE_SEGMENTS - 1))
                if segment < TRACE_SEGMENTS:
                    seg_stamps = trace + Int64(48) + Int64(segment) * seg_bytes
            if tid >= THREADS:
                if cutlass.const_expr(TRACE and W1 and not PAIR):  # noqa: SIM102 (a trace-time branch)
                    if tid == THREADS and segment == 0:
                        ptx.stamp_times(producer_path + Int64(16))
                ready = None
                if cutlass.const_expr((PAIR or HANDOVER) and not W1):  # the W1 units whose rows this segment reads
                    ready = pair[0] + ((Int64(e) * Int64(pair[1]) + Int64(bz)) * Int64(k_blocks) + Int64(k_first)) * 4
                wait_stamp = None
                if cutlass.const_expr((PAIR or HANDOVER) and TRACE and not W1):  # the tail's last slot, segment 0
                    wait_stamp = Int64(0)
                    if segment == 0:
                        wait_stamp = trace + Int64(48 + 16 * (TRACE_SEGMENT_SLOTS * TRACE_SEGMENTS + 3))
                produce(a, e, bx, row0, count, k_blocks, m_tiles, smem, tid - THREADS, (k_first, steps), base,
                        trace_seg=seg_stamps if cutlass.const_expr(TRACE) else None, ready_words=ready,
                        wait_stamp=wait_stamp, chunk=chunk if cutlass.const_expr(DYN_TAIL) else None)
                if cutlass.const_expr(not TAGGED and DYN_TAIL):
                    if k_first == 0 and steps < k_blocks and chunk < 0:  # an owner (a chunk is none)
                        first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
                        if pieces - 1 <= STAGED_PIECES:
                            stage_pieces(smem, split, unit, first_cta, pieces, base + steps, tid - THREADS)
                elif cutlass.const_expr(not TAGGED):  # noqa: SIM102 (a trace-time branch around a device one)
                    if k_first == 0 and steps < k_blocks:  # an owner (the CTA's last segment)
                        first_cta, pieces = owner_pieces(unit, k_blocks, ctas, work, smem, wmode)
                        if pieces - 1 <= STAGED_PIECES:
                            stage_pieces(smem, split, unit, first_cta, pieces, base + steps, tid - THREADS)
            else:
                if cutlass.const_expr(TRACE):  # noqa: SIM102 (a trace-time branch around a device one)
                    if tid == 0:
                        ptx.stamp_times(seg_stamps)
                for i in cutlass.range_constexpr(BN // 2):
                    acc[i] = Float32(0.0)
                words = None
                if cutlass.const_expr(LEAN):  # the epilogue's loads go out now and land during the K loop
                    factor, words = early_epilogue_words(role_args[0], w_factor, e, row0, count, q)
                early = None
                if cutlass.const_expr(TAGGED):
                    early = early_pieces(split[0], unit, k_blocks, k_first, steps, ctas, work, tid,
                                         chunk if cutlass.const_expr(DYN_TAIL) else None)
                consume_pipelined(steps, smem, wg, t, warp, g, q, acc, base,
                                  trace_seg=seg_stamps if cutlass.const_expr(TRACE) else None)
                if cutlass.const_expr(TRACE):  # noqa: SIM102 (a trace-time branch around a device one)
                    if tid == 0:
                        ptx.stamp_times(seg_stamps + Int64(32))
                whole = Int32(0)
                if steps == k_blocks:  # a unit's steps are consecutive: all of them means its first too
                    whole = Int32(1)
                if cutlass.const_expr(not LEAN):
                    factor = weight_factor(w_factor, e)
                if cutlass.const_expr(W1):
                    routing_weight, out, out_scale = role_args
                    rest = (smem, row0, count, count, bx, m_tiles, routing_weight, out, out_scale, None, None, words)
                    if cutlass.const_expr(AMAX_SLOTS):  # the unit picks the epilogue's amax slot set
                        rest = rest + (None, unit)
                    if cutlass.const_expr(EPI_WARP):  # the hand-overs before this one pick the slot's phases
                        rest = rest + (None, posted)
                else:
                    dest_row, out = role_args
                    rest = (row0, count, bx, m_tiles, dest_row, out, None, None, words)
                if cutlass.const_expr(DYN_TAIL):
                    if chunk >= 0:
                        chunk_epilogue(tid, wg, warp, g, q, factor, acc, smem, split, unit, chunk,
                                       (unit - static_units) * per_unit, per_unit, units, grid_ctas, *rest)
                    else:
                        stream_epilogue(tid, wg, warp, g, q, factor, acc, smem, split, unit, cta, ctas, work,
                                        k_blocks, k_first, whole, base + steps, *rest, wmode=wmode, early=early)
                else:
                    stream_epilogue(tid, wg, warp, g, q, factor, acc, smem, split, unit, cta, ctas, work, k_blocks,
                                    k_first, whole, base + steps, *rest, wmode=wmode, early=early)
                if cutlass.const_expr((PAIR or HANDOVER) and W1):  # noqa: SIM102 (a trace-time branch)
                    if k_first == 0:  # a whole unit or an owner: the unit's output rows are written
                        consumer_sync()  # every thread's stores (and reads of the staged pieces) before thread 0's
                        if tid == 0:
                            if cutlass.const_expr(PUBLISHER):  # the publisher warp releases the word
                                # the count of finished units, released at CTA scope: the consumers' stores thread 0
                                # observed through their barrier go before it (a wait here, even one never taken,
                                # cost every K loop of the pair its uniform registers)
                                ptx.st_release_cta_shared_s32(smem + cfg.publish_offset, published + 1)
                            else:
                                # one permit per W2 unit that reads them
                                ptx.red_add_release_gpu_s32(w1_word(pair, e, bz, bx, m_tiles), pair[2])
                            if staged == 1:  # the owner's pieces' stage, for every consumer warp (a warp's own
                                # release inside the epilogue's branches cost the K loops their uniform registers)
                                ptx.mbarrier_arrive_count(smem + cfg.barrier_offset
                                                          + (STAGES + (base + steps) % STAGES) * 8, THREADS // 32)
                if cutlass.const_expr(DYN_TAIL and not TAGGED and not PAIR):  # noqa: SIM102 (a trace-time branch)
                    if staged == 1:  # the owner's pieces' stage goes back before the tail's chunks reuse it
                        consumer_sync()  # every thread's reads of the staged pieces before the release
                        if tid == 0:
                            ptx.mbarrier_arrive_count(smem + cfg.barrier_offset
                                                      + (STAGES + (base + steps) % STAGES) * 8, THREADS // 32)
                if cutlass.const_expr(PUBLISHER and W1):  # noqa: SIM102 (a trace-time branch)
                    if k_first == 0:
                        published = published + 1
                if cutlass.const_expr(EPI_WARP):  # noqa: SIM102 (a trace-time branch)
                    if k_first == 0:  # a whole unit or an owner: its epilogue was handed over (a piece's is not)
                        posted = posted + 1
                if cutlass.const_expr(TRACE):  # noqa: SIM102 (a trace-time branch around a device one)
                    if tid == 0:
                        ptx.stamp_times(seg_stamps + Int64(48))
            base = base + steps + staged
            s = s + steps
            segment = segment + 1
            if cutlass.const_expr(DYN_TAIL):  # noqa: SIM102 (a trace-time branch around a device one)
                if s >= end and tail_units > 0:  # the static range (or the chunk) done: the next chunk, if any
                    if tid >= THREADS:
                        pidx = tid - THREADS
                        chunk = claim_chunk(ticket, pidx)
                        if chunk >= chunks:
                            # each CTA draws past the chunks once: the launch's last draw returns the ticket to zero
                            if pidx == 0 and chunk == chunks + grid_ctas - 1:
                                ptx.st_relaxed_gpu_s32(ticket, Int32(0))
                            end_chunks(smem, base, pidx)
                            chunk = Int32(-1)
                    else:
                        chunk = next_chunk(smem, base)
                    if chunk >= 0:
                        s = Int32(0)
                        end = Int32(1)
        if cutlass.const_expr(EPI_WARP):  # noqa: SIM102 (a trace-time branch around a device one)
            if tid < THREADS:  # the epilogue warp may leave once it has finished the last unit
                w1_post_end(tid, smem, posted)
        return base, segment

    @cute.jit
    def split_epilogue(tid, wg, warp, g, q, factor, acc, smem, split_partials, split_counts, unit, ks_index, *rest):
        """A split unit's consumer thread (k_splits): its FP32 partials to split_partials[unit, ks_index, tid]; the
        CTA whose arrival completes the unit's count sums every split's partials in split order (the same bits
        whichever arrives last), sets the count back to zero and runs the role's epilogue (`rest`: its
        arguments)."""
        per = BN // 2
        mine = split_partials + ((Int64(unit) * KS + Int64(ks_index)) * THREADS + Int64(tid)) * (per * 4)
        for i in cutlass.range_constexpr(per):
            ptx.stg_f32(mine + Int64(i * 4), acc[i])
        consumer_sync()
        flag = smem + cfg.amax_offset
        if tid == 0:
            # one thread publishes and acquires for the CTA (the barriers order the others' stores before its
            # release and their loads after its acquire); a fence in every consumer thread cost a membar and an L1
            # invalidation each (step 22)
            ptx.fence_acq_rel_gpu()
            arrived = ptx.atom_add_acq_rel_gpu_s32(split_counts + Int64(unit) * 4, Int32(1))
            last = Float32(0.0)
            if arrived == KS - 1:
                last = Float32(1.0)
                ptx.st_relaxed_gpu_s32(split_counts + Int64(unit) * 4, Int32(0))  # ready for the next launch
            ptx.sts_f32(flag, last)
        consumer_sync()
        last = ptx.lds_f32(flag)
        consumer_sync()  # every thread read the flag before the epilogue reuses the word
        if last > Float32(0.5):
            # the other splits' partials: published before their arrivals, acquired by thread 0 before the barrier
            for i in cutlass.range_constexpr(per):
                acc[i] = Float32(0.0)
            for sp in cutlass.range_constexpr(KS):
                theirs = split_partials + ((Int64(unit) * KS + Int64(sp)) * THREADS + Int64(tid)) * (per * 4)
                for i in cutlass.range_constexpr(per):
                    acc[i] = acc[i] + ptx.ld_relaxed_gpu_f32(theirs + Int64(i * 4))
            if cutlass.const_expr(W1):
                w1_epilogue(tid, wg, warp, g, q, factor, acc, *rest)
            else:
                w2_epilogue(tid, wg, warp, g, q, factor, acc, *rest)

    @cute.jit
    def w2_epilogue(tid, wg, warp, g, q, factor, acc, row0, count, bx, m_tiles, dest_row, out, ring, smem=None,
                    words=None, meta=None):
        """A consumer thread's W2 epilogue: BF16 partials to each row's combine row (the ring consumer's: in the
        source rank's buffer; lean_epilogue: the combine rows the producer staged at `smem`, or the thread's own
        loaded before the K loop, `words`)."""
        if cutlass.const_expr(TRANSPOSED):
            words_at = meta if cutlass.const_expr(meta is not None) else smem + cfg.meta_offset
            w2_transposed_stores(tid, wg, warp, factor, acc, count, bx, m_tiles, out, words_at,
                                 smem + cfg.transpose_offset)
        else:
            hidden = m_tiles * 64
            h_row = bx * ROWS_PER_CTA + wg * 64 + warp * 16 + g
            staged = []
            if cutlass.const_expr(EARLY_ROWS):
                # every combine row first (the words past the count are zeros, stage_epilogue_words: safe to load)
                words_at = meta if cutlass.const_expr(meta is not None) else smem + cfg.meta_offset
                staged = [ptx.lds_s32(words_at + (8 * i + 2 * q + c) * 4) for i in range(NSUB) for c in range(2)]
            for i in cutlass.range_constexpr(NSUB):
                for c in cutlass.range_constexpr(2):
                    n = 8 * i + 2 * q + c
                    if n < count:
                        if cutlass.const_expr(FUSED):  # role1 wrote it during this kernel
                            d = ptx.ld_relaxed_gpu_s32(dest_row + (Int64(row0) + Int64(n)) * 4)
                        elif cutlass.const_expr(words is not None):
                            d = words[2 * i + c]
                        elif cutlass.const_expr(EARLY_ROWS):
                            d = staged[2 * i + c]
                        elif cutlass.const_expr(LEAN and meta is not None):  # the persistent unit's slot
                            d = ptx.lds_s32(meta + n * 4)
                        elif cutlass.const_expr(LEAN):
                            d = ptx.lds_s32(smem + cfg.meta_offset + n * 4)
                        else:
                            d = ptx.ldg_s32(dest_row + (Int64(row0) + Int64(n)) * 4)
                        if cutlass.const_expr(RING):
                            # the row's source rank owns the combine buffer: its peer offset moves the address
                            ring_source, peers, source_rows = ring
                            if cutlass.const_expr(FUSED):
                                source = ptx.ld_relaxed_gpu_s32(ring_source + (Int64(row0) + Int64(n)) * 4)
                            else:
                                source = ptx.ldg_s32(ring_source + (Int64(row0) + Int64(n)) * 4)
                            source = source // source_rows
                            base = out + ptx.ldg_s64(peers + Int64(source) * 8) \
                                + (Int64(d) * Int64(hidden) + Int64(h_row)) * 2
                        else:
                            base = out + (Int64(d) * Int64(hidden) + Int64(h_row)) * 2
                        ptx.stg_bf16(base, acc[4 * i + c] * factor)
                        ptx.stg_bf16(base + Int64(16), acc[4 * i + 2 + c] * factor)

    @cute.jit
    def w2_transposed_stores(tid, wg, warp, factor, acc, count, bx, m_tiles, out, words_at, region):
        """transposed_stores: the warp's partials 16 tokens at a time through its region (16 rows of 32 bytes, a
        token's 16 hidden values each): stmatrix writes the four 8x8 fragments of two token groups transposed, the
        row's two 16-byte halves swapped in rows 4-7 of each group (a matrix's eight rows then fall in distinct
        banks), and lane l stores hidden half l // 16 of token l % 16 with one 16-byte store to its combine row."""
        hidden = m_tiles * 64
        lane = tid % 32
        buf = region + (wg * 4 + warp) * TRANSPOSE_WARP_BYTES
        # stmatrix: lane 8 j + c names row c of matrix j (token group j // 2, hidden half j % 2)
        matrix = lane // 8
        put_token = 8 * (matrix // 2) + lane % 8
        put_at = buf + put_token * 32 + 16 * ((matrix % 2) ^ ((put_token // 4) % 2))
        token = lane % 16
        half = lane // 16
        take_at = buf + token * 32 + 16 * (half ^ ((token // 4) % 2))
        h_col = Int64(bx * ROWS_PER_CTA + wg * 64 + warp * 16 + 8 * half)
        rows = count
        if rows > BN:  # a unit's count is the expert's rows from its first on; an odd last group's partner is past BN
            rows = Int32(BN)
        chunks = (NSUB + 1) // 2
        for ch in cutlass.range_constexpr(chunks):
            if 16 * ch < count:
                words = []
                for sub in cutlass.range_constexpr(2):
                    for h in cutlass.range_constexpr(2):
                        i = 2 * ch + sub
                        if cutlass.const_expr(i < NSUB):
                            words.append(ptx.pack_bf16x2(acc[4 * i + 2 * h] * factor, acc[4 * i + 2 * h + 1] * factor))
                        else:  # an odd last token group: its partner's rows are past block_n (never stored)
                            words.append(Uint32(0))
                ptx.stmatrix_x4_trans(put_at, words)
                ptx.warp_sync()  # every lane's fragments before any lane's row
                n = 16 * ch + token
                if n < rows:
                    d = ptx.lds_s32(words_at + n * 4)
                    ptx.stg128(out + (Int64(d) * Int64(hidden) + h_col) * 2, ptx.lds128(take_at))
                if cutlass.const_expr(ch + 1 < chunks):
                    ptx.warp_sync()  # every lane's row read before the next chunk's fragments

    if W1:
        @cute.jit
        def w1_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, routing_weight, out, out_scale,
                    k_blocks, m_tiles, ring, fused=None, split=None):
            """fused: (expert, weight-row CTA, token tile, started, this token tile's W1-completion word, side,
            base) of the fused role2 kernel's unit (it waited for RING_READY already): `fused_unit`'s side and
            first K128 step. split (k_splits > 1): (split_partials, split_counts)."""
            if cutlass.const_expr(FUSED):
                ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns = ring[:6]
                e, bx, bz, started, done_mask, side, base = fused
            else:
                bx, e, bz = cute.arch.block_idx()
                done_mask = None
            if cutlass.const_expr(cfg.token_tiles_fastest and not FUSED):
                bz, bx, e = cute.arch.block_idx()
            ks_index = Int32(0)
            if cutlass.const_expr(KS > 1):  # the splits of a token tile are neighbours in x
                ks_index = Int32(bz) % KS
                bz = Int32(bz) // KS
            if cutlass.const_expr(RING and not FUSED):
                # role1 writes expert_offsets while this kernel may already run: wait for its release, then
                # read them (and every ring word below) with coherent loads, not the read-only path
                ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns = ring[:6]
                started = cute.arch.globaltimer()
                if cute.arch.thread_idx()[0] == 0:
                    ring_protocol.wait_at_least(ring_ready, Int32(1), started, timeout_ns, False)
                ptx.barrier_sync()
            if cutlass.const_expr(cfg.compact_grid):
                e, bx, bz = compact_unit(expert_offsets, RING)
            count = Int32(0)
            off0 = Int32(0)
            if e >= 0:
                if cutlass.const_expr(RING):
                    off0 = ptx.ld_global_s32(expert_offsets + Int64(e) * 4)
                    count = ptx.ld_global_s32(expert_offsets + Int64(e) * 4 + 4) - off0 - bz * BN
                else:
                    off0 = ptx.ldg_s32(expert_offsets + Int64(e) * 4)
                    count = ptx.ldg_s32(expert_offsets + Int64(e) * 4 + 4) - off0 - bz * BN
            if count > 0:
                row0 = off0 + bz * BN
                if cutlass.const_expr(RING):
                    rows = count
                    if rows > BN:  # a DSL value: Python min() cannot trace it
                        rows = Int32(BN)
                    if cutlass.const_expr(not FUSED):  # the fused producer acquires them itself
                        if cute.arch.thread_idx()[0] == 0:
                            ring_protocol.acquire_ring_rows(ring_ready, l1_full_count, row0, rows, ring_block_m,
                                                            ring_blocks, started, timeout_ns)
                        ptx.gemm_barrier(cfg)  # every thread's copies of the tile's rows follow thread 0's acquire
                if cutlass.const_expr(not RING):
                    rows = count  # only the ring consumer's release reads it
                smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
                epilogue = (w1_epilogue, (smem, row0, count, rows, bx, m_tiles, routing_weight, out, out_scale, ring,
                                          done_mask))
                fused_args = ((ring, rows, started), side, base) if cutlass.const_expr(FUSED) else None
                ksplit = None
                if cutlass.const_expr(KS > 1):
                    ksplit, unit = split_unit(ks_index, k_blocks, m_tiles, e, bx, bz)
                    epilogue = (split_epilogue, (smem, split[0], split[1], unit, ks_index, *epilogue[1]))
                a = (w_codes, w_scales, act, act_scale) + ((routing_weight, w_factor) if LEAN else ())
                tile_with_epilogue(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, epilogue, fused_args,
                                   ksplit)

        if cutlass.const_expr(STREAM and HANDOVER):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, split_partials: Int64, split_counts: Int64, experts: Int32,
                       ready: Int64, ready_tiles: Int32, ready_readers: Int32):
                stream_body((w_codes, w_scales, act, act_scale), w_factor, expert_offsets, k_blocks, m_tiles, experts,
                            (split_partials, split_counts), (routing_weight, out, out_scale),
                            handover=(ready, ready_tiles, ready_readers))
        elif cutlass.const_expr(PERSIST):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, experts: Int32, token_tiles: Int32):
                persistent_body((w_codes, w_scales, act, act_scale, routing_weight, w_factor), w_factor, expert_offsets,
                                k_blocks, m_tiles, experts, token_tiles, (routing_weight, out, out_scale))
        elif cutlass.const_expr(STREAM and TMA_TOKENS):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, split_partials: Int64, split_counts: Int64, experts: Int32,
                       token_map: Int64):
                stream_body((w_codes, w_scales, act, act_scale, token_map), w_factor, expert_offsets, k_blocks,
                            m_tiles, experts, (split_partials, split_counts), (routing_weight, out, out_scale))
        elif cutlass.const_expr(STREAM):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, split_partials: Int64, split_counts: Int64, experts: Int32):
                stream_body((w_codes, w_scales, act, act_scale), w_factor, expert_offsets, k_blocks, m_tiles, experts,
                            (split_partials, split_counts), (routing_weight, out, out_scale))
        elif cutlass.const_expr(KS > 1):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, split_partials: Int64, split_counts: Int64):
                w1_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, routing_weight, out, out_scale,
                        k_blocks, m_tiles, None, split=(split_partials, split_counts))
        elif cutlass.const_expr(RING):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32, ring_ready: Int64, l1_full_count: Int64,
                       l1_empty_count: Int64, ring_block_m: Int32, ring_blocks: Int32, timeout_ns: Int64):
                w1_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, routing_weight, out, out_scale,
                        k_blocks, m_tiles,
                        (ring_ready, l1_full_count, l1_empty_count, ring_block_m, ring_blocks, timeout_ns))
        else:
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, routing_weight: Int64, out: Int64, out_scale: Int64,
                       k_blocks: Int32, m_tiles: Int32):
                w1_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, routing_weight, out, out_scale,
                        k_blocks, m_tiles, None)
    else:
        @cute.jit
        def w2_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, dest_row, out, k_blocks, m_tiles,
                    ring, fused=None, split=None):
            """fused: (expert, weight-row CTA, token tile, started, the token tile's W1-completion word, the
            bound on waits, side, base) of the fused role2 kernel's unit: role1 and W1 write what this reads while
            it runs, so every such read is coherent, and the producer waits for all I/128 bits of the word.
            split (k_splits > 1): (split_partials, split_counts)."""
            ready = None
            if cutlass.const_expr(FUSED and REUSE):  # and the ring rows of W1's output
                e, bx, bz, started, done_mask, timeout_ns, side, base, l2_rows = fused
                ready = (done_mask, (Int64(1) << Int64(k_blocks)) - Int64(1), started, timeout_ns, l2_rows)
            elif cutlass.const_expr(FUSED):
                e, bx, bz, started, done_mask, timeout_ns, side, base = fused
                ready = (done_mask, (Int64(1) << Int64(k_blocks)) - Int64(1), started, timeout_ns)
            else:
                bx, e, bz = cute.arch.block_idx()
            if cutlass.const_expr(cfg.token_tiles_fastest and not FUSED):
                bz, bx, e = cute.arch.block_idx()
            ks_index = Int32(0)
            if cutlass.const_expr(KS > 1):  # the splits of a token tile are neighbours in x
                ks_index = Int32(bz) % KS
                bz = Int32(bz) // KS
            if cutlass.const_expr(cfg.compact_grid):
                e, bx, bz = compact_unit(expert_offsets, False)
            count = Int32(0)
            off0 = Int32(0)
            if e >= 0:
                if cutlass.const_expr(FUSED):
                    off0 = ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(e) * 4)
                    count = ptx.ld_relaxed_gpu_s32(expert_offsets + Int64(e) * 4 + 4) - off0 - bz * BN
                else:
                    off0 = ptx.ldg_s32(expert_offsets + Int64(e) * 4)
                    count = ptx.ldg_s32(expert_offsets + Int64(e) * 4 + 4) - off0 - bz * BN
            if count > 0:
                row0 = off0 + bz * BN
                smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
                epilogue = (w2_epilogue, (row0, count, bx, m_tiles, dest_row, out, ring) + ((smem,) if LEAN else ()))
                fused_args = (ready, side, base) if cutlass.const_expr(FUSED) else None
                ksplit = None
                if cutlass.const_expr(KS > 1):
                    ksplit, unit = split_unit(ks_index, k_blocks, m_tiles, e, bx, bz)
                    epilogue = (split_epilogue, (smem, split[0], split[1], unit, ks_index, *epilogue[1]))
                a = (w_codes, w_scales, act, act_scale) + ((dest_row, w_factor) if LEAN else ())
                tile_with_epilogue(a, w_factor, e, bx, row0, count, k_blocks, m_tiles, smem, epilogue, fused_args,
                                   ksplit)

        if cutlass.const_expr(STREAM and HANDOVER):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       split_partials: Int64, split_counts: Int64, experts: Int32, ready: Int64, ready_tiles: Int32):
                stream_body((w_codes, w_scales, act, act_scale), w_factor, expert_offsets, k_blocks, m_tiles, experts,
                            (split_partials, split_counts), (dest_row, out), handover=(ready, ready_tiles))
        elif cutlass.const_expr(PERSIST):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       experts: Int32, token_tiles: Int32):
                persistent_body((w_codes, w_scales, act, act_scale, dest_row, w_factor), w_factor, expert_offsets,
                                k_blocks, m_tiles, experts, token_tiles, (dest_row, out))
        elif cutlass.const_expr(STREAM and TMA_TOKENS):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       split_partials: Int64, split_counts: Int64, experts: Int32, token_map: Int64):
                stream_body((w_codes, w_scales, act, act_scale, token_map), w_factor, expert_offsets, k_blocks,
                            m_tiles, experts, (split_partials, split_counts), (dest_row, out))
        elif cutlass.const_expr(STREAM):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       split_partials: Int64, split_counts: Int64, experts: Int32):
                stream_body((w_codes, w_scales, act, act_scale), w_factor, expert_offsets, k_blocks, m_tiles, experts,
                            (split_partials, split_counts), (dest_row, out))
        elif cutlass.const_expr(KS > 1):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       split_partials: Int64, split_counts: Int64):
                w2_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, dest_row, out, k_blocks,
                        m_tiles, None, split=(split_partials, split_counts))
        elif cutlass.const_expr(RING):
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64, k_blocks: Int32, m_tiles: Int32,
                       ring_source: Int64, peers: Int64, source_rows: Int32):
                w2_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, dest_row, out, k_blocks,
                        m_tiles, (ring_source, peers, source_rows))
        else:
            @cute.kernel
            def kernel(w_codes: Int64, w_scales: Int64, w_factor: Int64, act: Int64, act_scale: Int64,
                       expert_offsets: Int64, dest_row: Int64, out: Int64,
                       k_blocks: Int32, m_tiles: Int32):
                w2_body(w_codes, w_scales, w_factor, act, act_scale, expert_offsets, dest_row, out, k_blocks,
                        m_tiles, None)

    if FUSED:  # a half of the fused role2 kernel: kernels.sm90.role2 calls the body for the units it draws
        return w1_body if W1 else w2_body
    if PAIR:  # a half of the stream-K pair kernel: kernels.sm90.stream_pair sets the ring up and walks both halves
        return StreamHalf(thread_coords, init_stage_ring, unit_table, stream_walk, load_sm_table, sm_rank,
                          trace_slots, trace_scanned, trace_tail, publish_walk)
    return kernel


# ---------------------------------------------------------------------------------------------- build
def launch_register_bounds(cfg: GemmConfig) -> dict:
    """The launch's `.minnctapersm` where the registers need it: ctas_per_sm > 1 (ptxas budgets the registers for
    that many CTAs per SM), or consumer_registers (ptxas honours setmaxnreg only when the entry's register count
    follows from the launch bounds: one CTA of 640 threads -> 96 per thread)."""
    if cfg.ctas_per_sm > 1:
        return {"min_blocks_per_mp": cfg.ctas_per_sm, "preferred_smem_carveout": 100}
    if cfg.consumer_registers is not None:
        return {"min_blocks_per_mp": 1}
    return {}


def _host_launcher(cfg: GemmConfig, kernel):
    """The DSL host function that launches `kernel` with the parameters of `cfg.params` (one per variant kind:
    the DSL needs each scalar named in the signature)."""
    from cutlass import Int32, Int64, cute

    launch = {"grid": (1, 1, 1), "block": (cfg.threads, 1, 1), "smem": cfg.smem_bytes}
    launch.update(launch_register_bounds(cfg))
    if cfg.role == "w1" and cfg.handover:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32, ready: Int64,
                 ready_tiles: Int32, ready_readers: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, p0, p1, experts, ready, ready_tiles,
                   ready_readers).launch(**launch)
    elif cfg.role == "w1" and cfg.persistent:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, experts: Int32, token_tiles: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, experts, token_tiles).launch(**launch)
    elif cfg.role == "w1" and cfg.tma_tokens:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32, token_map: Int64):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, p0, p1, experts, token_map).launch(**launch)
    elif cfg.role == "w1" and cfg.stream_k:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, p0, p1, experts).launch(**launch)
    elif cfg.role == "w1" and cfg.k_splits > 1:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, p0, p1).launch(**launch)
    elif cfg.role == "w1" and cfg.ring_consumer:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32, r0: Int64, r1: Int64, r2: Int64, block_m: Int32,
                 blocks: Int32, timeout_ns: Int64):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles, r0, r1, r2, block_m, blocks,
                   timeout_ns).launch(**launch)
    elif cfg.role == "w1":
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 a8: Int64, k_blocks: Int32, m_tiles: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, k_blocks, m_tiles).launch(
                **launch)
    elif cfg.handover:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32, ready: Int64,
                 ready_tiles: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, p0, p1, experts, ready, ready_tiles).launch(
                **launch)
    elif cfg.persistent:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, experts: Int32, token_tiles: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, experts, token_tiles).launch(**launch)
    elif cfg.tma_tokens:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32, token_map: Int64):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, p0, p1, experts, token_map).launch(**launch)
    elif cfg.stream_k:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64, experts: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, p0, p1, experts).launch(**launch)
    elif cfg.k_splits > 1:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, p0: Int64, p1: Int64):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, p0, p1).launch(**launch)
    elif cfg.ring_consumer:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32, r0: Int64, r1: Int64, source_rows: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles, r0, r1, source_rows).launch(**launch)
    else:
        @cute.jit
        def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64,
                 k_blocks: Int32, m_tiles: Int32):
            kernel(a0, a1, a2, a3, a4, a5, a6, a7, k_blocks, m_tiles).launch(
                **launch)
    return host


def build_gemm(arch: str = "sm_90a", role: str = "w1", block_n: int = 8, stages: int | None = None,
               swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0, l2_evict_first: bool = False,
               token_tiles_fastest: bool = True, fold_scales: bool = False, ring_consumer: bool = False,
               warp_specialized: bool | None = None, ctas_per_sm: int | None = None, producer_warps: int = 1,
               wait_suspend_ns: int = WAIT_SUSPEND_NS, compact_grid: bool = False,
               consumer_registers: int | None = None, k_splits: int = 1, table_decode: bool = False,
               fit_n: bool = False, stream_k: bool = False, trace: bool = False, lean_epilogue: bool = False,
               handover: bool = False, persistent: bool = False,
               words_first: bool = False, snake_walk: bool = False, scale_ratios: bool = False,
               transposed_stores: bool = False, early_rows: bool = False, step_group: bool = False,
               tagged_pieces: bool = False, w2_early_stages: int | None = None, quick_start: bool = False,
               split_nibbles: bool = False, lean_ring: bool = False, tma_tokens: bool = False,
               dynamic_tail: bool = False, early_scales: bool = False, amax_slots: bool = False,
               epilogue_warp: bool = False):
    """The runtime's builder: a CompileRequest for one variant (compile-time params only; no GPU needed)."""
    from cutlass import Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 grouped GEMM is built for sm_90a only, not {arch!r}")
    cfg = GemmConfig(role, block_n, stages, swiglu_alpha, swiglu_clamp, l2_evict_first, token_tiles_fastest,
                     fold_scales, ring_consumer, warp_specialized, ctas_per_sm, producer_warps,
                     compact_grid=compact_grid, wait_suspend_ns=wait_suspend_ns,
                     consumer_registers=consumer_registers, k_splits=k_splits, table_decode=table_decode,
                     fit_n=fit_n, stream_k=stream_k, trace=trace, lean_epilogue=lean_epilogue, handover=handover,
                     persistent=persistent, words_first=words_first, snake_walk=snake_walk,
                     scale_ratios=scale_ratios, transposed_stores=transposed_stores, early_rows=early_rows,
                     step_group=step_group, tagged_pieces=tagged_pieces, w2_early_stages=w2_early_stages,
                     quick_start=quick_start, split_nibbles=split_nibbles, lean_ring=lean_ring,
                     tma_tokens=tma_tokens, dynamic_tail=dynamic_tail, early_scales=early_scales,
                     amax_slots=amax_slots, epilogue_warp=epilogue_warp)
    kernel = _make_kernel(cfg)
    host = _host_launcher(cfg, kernel)
    args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in cfg.params)
    return CompileRequest(host, args, LaunchShape(block=(cfg.threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes))


def variant(role: str, block_n: int, stages: int | None = None, swiglu_alpha: float = 1.0,
            swiglu_clamp: float = 10.0, l2_evict_first: bool = False, token_tiles_fastest: bool = True,
            fold_scales: bool = False, ring_consumer: bool = False, warp_specialized: bool | None = None,
            ctas_per_sm: int | None = None, producer_warps: int = 1, wait_suspend_ns: int = WAIT_SUSPEND_NS,
            compact_grid: bool = False, consumer_registers: int | None = None, k_splits: int = 1,
            table_decode: bool = False, fit_n: bool = False, stream_k: bool = False, trace: bool = False,
            lean_epilogue: bool = False, handover: bool = False,
            persistent: bool = False, words_first: bool = False, snake_walk: bool = False,
            scale_ratios: bool = False, transposed_stores: bool = False, early_rows: bool = False,
            step_group: bool = False, tagged_pieces: bool = False, max_stages: int | None = None,
            w2_early_stages: int | None = None, quick_start: bool = False, split_nibbles: bool = False,
            lean_ring: bool = False, tma_tokens: bool = False, dynamic_tail: bool = False,
            early_scales: bool = False, amax_slots: bool = False, epilogue_warp: bool = False):
    """The runtime KernelVariant of one configuration (what the registry and the benchmark build).

    Defaults: the warp-specialized pipeline with the deepest ring that fits up to bn 32 (also as the ring
    consumer); bn 64 and l2_evict_first run on the cp.async pipeline (6 stages unless `stages` says otherwise).
    max_stages caps the ring at that many stages where it would be deeper (sets may name it at every tile)."""
    from gc_moe.runtime.jit import KernelVariant

    table_decode = table_decode and fold_scales  # a way of folding: sets may name it with the fold off
    fit_n = fit_n and table_decode  # likewise a knob of the table decode
    ws_default = GemmConfig(role, block_n, l2_evict_first=l2_evict_first, ring_consumer=ring_consumer,
                            warp_specialized=warp_specialized, fold_scales=fold_scales,
                            table_decode=table_decode).warp_specialized
    if not ws_default:
        producer_warps = 1  # a knob of the warp-specialized pipeline: a variant set may ask for it at every bn
        compact_grid = False  # likewise (the cp.async pipeline's bn 64 has no registers left for the scan)
        consumer_registers = None
    if block_n > K_SPLIT_MAX_BLOCK_N or not ws_default:
        k_splits = 1  # a knob of the stand-alone GEMM at tiles 8 / 16 (warp-specialized): sets may name it everywhere
    stream_k = stream_k and block_n == 8 and ws_default and not fold_scales and k_splits == 1  # likewise, at tile 8
    trace = trace and stream_k
    handover = handover and stream_k  # a knob of the stream-K loops: sets may name it everywhere
    words_first = words_first and handover and role == "w2"  # a knob of the hand-over W2: likewise
    if (trace or handover) and ctas_per_sm is None:
        ctas_per_sm = 1  # the only traced loop (GemmConfig.trace), the only handover one
    if (table_decode and block_n > WS_MAX_BLOCK_N and ws_default and consumer_registers is None
            and ctas_per_sm in (None, 1)):
        # the table decode's bn 64 on the warp-specialized pipeline: W1's epilogue spills in the launch's 96
        # registers, so the consumers take 112 from a producer warpgroup (W2 likewise, one shape for both roles).
        # scale_ratios: 104 (no fresh chains beside the sums), the producer's 64 hold its scales a step ahead (its
        # 32 spilled at tile 96)
        producer_warps = 4
        consumer_registers = min(CONSUMER_REGISTER_CHOICES) if scale_ratios and persistent \
            else max(CONSUMER_REGISTER_CHOICES)
        ratio_registers = consumer_registers == min(CONSUMER_REGISTER_CHOICES)
    else:
        ratio_registers = False
    cfg = GemmConfig(role, block_n, stages, l2_evict_first=l2_evict_first, fold_scales=fold_scales,
                     ring_consumer=ring_consumer, warp_specialized=warp_specialized, ctas_per_sm=ctas_per_sm,
                     producer_warps=producer_warps, wait_suspend_ns=wait_suspend_ns, compact_grid=compact_grid,
                     consumer_registers=consumer_registers, k_splits=k_splits, table_decode=table_decode,
                     fit_n=fit_n, stream_k=stream_k, trace=trace, handover=handover, words_first=words_first)
    # a knob of the stand-alone kernels: sets may name it everywhere
    lean_epilogue = lean_epilogue and cfg.warp_specialized and not ring_consumer and cfg.k_splits == 1
    if lean_epilogue:
        cfg = replace(cfg, lean_epilogue=True)
    # a knob of the lean epilogue (not stream-K): sets may name it everywhere (not W1 at tile 24, where its copy
    # spills 8 bytes in two CTAs' registers)
    transposed_stores = transposed_stores and lean_epilogue and not stream_k and (role, block_n) != ("w1", 24)
    if transposed_stores:  # the deepest ring again (its region may take a stage)
        cfg = replace(cfg, transposed_stores=True, stages=stages)
    # a knob of the lean W2's value stores: sets may name it everywhere
    early_rows = early_rows and lean_epilogue and role == "w2" and not stream_k and not transposed_stores
    if early_rows:
        cfg = replace(cfg, early_rows=True)
    # a knob of the stand-alone table decode: sets may name it everywhere (not at tile 24, where the waited loop of a
    # persistent CTA spills inside the loop in two CTAs' registers)
    persistent = (persistent and cfg.table_decode and cfg.warp_specialized and not ring_consumer
                  and cfg.k_splits == 1 and not compact_grid and token_tiles_fastest
                  and block_n not in TABLE_TWO_CTA_BLOCK_N)
    snake_walk = snake_walk and persistent  # an order of the persistent walk: sets may name it everywhere
    scale_ratios = scale_ratios and persistent and block_n <= cfg.producer_threads  # likewise
    if ratio_registers and not scale_ratios:  # the knob did not apply: the plain tile's split of the registers
        consumer_registers = max(CONSUMER_REGISTER_CHOICES)
        cfg = replace(cfg, consumer_registers=consumer_registers)
    if persistent:  # the deepest ring again (two slots of staged words may take a stage)
        cfg = replace(cfg, persistent=True, snake_walk=snake_walk, scale_ratios=scale_ratios, stages=stages)
    # a knob of the stream-K loop at one CTA per SM: sets may name it everywhere
    step_group = step_group and stream_k and cfg.ctas_per_sm == 1
    if step_group:
        cfg = replace(cfg, step_group=True)
    tagged_pieces = tagged_pieces and stream_k and not handover  # likewise, where the fenced words do not stay
    if tagged_pieces:
        cfg = replace(cfg, tagged_pieces=True)
    quick_start = quick_start and stream_k  # a knob of the stand-alone stream-K loops: sets may name it everywhere
    if quick_start:
        cfg = replace(cfg, quick_start=True)
    lean_ring = lean_ring and stream_k  # likewise
    if lean_ring:
        cfg = replace(cfg, lean_ring=True)
    tma_tokens = tma_tokens and stream_k and not handover  # likewise, where the rows do not come by words
    if tma_tokens:
        cfg = replace(cfg, tma_tokens=True)
    # likewise, where the walk is the stand-alone one with one producer warp and no trace
    dynamic_tail = dynamic_tail and stream_k and not handover and not trace and producer_warps == 1
    if dynamic_tail:
        cfg = replace(cfg, dynamic_tail=True)
    # likewise, where the stand-alone walk runs the unfolded loop with its groups (not step_group's, not the tables)
    early_scales = early_scales and stream_k and not cfg.step_group and not fold_scales
    if early_scales:
        cfg = replace(cfg, early_scales=True)
    # likewise, at W1's stand-alone walk where its epilogues are consecutive units (not the tail's chunks)
    amax_slots = amax_slots and role == "w1" and stream_k and not handover and not dynamic_tail
    if amax_slots:
        cfg = replace(cfg, amax_slots=True)
    # likewise, at W1's stand-alone walk on tile 8 at one CTA per SM (its epilogues' values fit one slot), where the
    # amax is not the slot sets'
    epilogue_warp = (epilogue_warp and role == "w1" and stream_k and not handover and not dynamic_tail
                     and not amax_slots and block_n == 8 and cfg.ctas_per_sm == 1)
    if epilogue_warp:  # the deepest ring again (the slot may take a stage)
        cfg = replace(cfg, epilogue_warp=True, stages=stages)
    # a knob of the warp-specialized unfolded consumer, stand-alone, at tile 8 and not with step_group (W1 at tile 16
    # and the one-group step spill 8-32 bytes with it): sets may name it everywhere
    split_nibbles = (split_nibbles and cfg.warp_specialized and not fold_scales and not ring_consumer
                     and block_n == 8 and not step_group)
    if split_nibbles:
        cfg = replace(cfg, split_nibbles=True)
    if max_stages is not None:  # a cap on the configuration's ring (its deepest one where `stages` is None)
        if max_stages < 2:
            raise ValueError(f"max_stages {max_stages}: allowed >= 2 (a ring of at least two stages)")
        if cfg.stages > max_stages:
            cfg = replace(cfg, stages=max_stages)
    # a knob of the stand-alone stream-K W2 (sets may name it everywhere), at most the ring
    if w2_early_stages is not None and role == "w2" and stream_k and not handover:
        cfg = replace(cfg, w2_early_stages=min(w2_early_stages, cfg.stages))
    else:
        w2_early_stages = None
    params = {"role": role, "block_n": block_n, "stages": cfg.stages}
    if ctas_per_sm is not None and ctas_per_sm != GemmConfig(role, block_n, fold_scales=fold_scales,
                                                            ring_consumer=ring_consumer,
                                                            warp_specialized=warp_specialized,
                                                            table_decode=table_decode).ctas_per_sm:
        params["ctas_per_sm"] = ctas_per_sm  # named when it is not the default for the configuration
    if producer_warps != 1:
        params["producer_warps"] = producer_warps
    if cfg.warp_specialized and wait_suspend_ns != WAIT_SUSPEND_NS:
        params["wait_suspend_ns"] = wait_suspend_ns  # named when not the default (the polling loop: 0)
    if not cfg.warp_specialized:  # named when off: a launch rebuilds the config from these parameters
        params["warp_specialized"] = False
    if l2_evict_first:
        params["l2_evict_first"] = True
    if not token_tiles_fastest:
        params["token_tiles_fastest"] = False
    if fold_scales:  # only named when on: the default variants keep their parameters (and cache keys)
        params["fold_scales"] = True
    if table_decode:
        params["table_decode"] = True
    if fit_n:
        params["fit_n"] = True
    if compact_grid:
        params["compact_grid"] = True
    if consumer_registers is not None:
        params["consumer_registers"] = consumer_registers
    if cfg.k_splits > 1:
        params["k_splits"] = cfg.k_splits
    if stream_k:
        params["stream_k"] = True
    if trace:
        params["trace"] = True
    if lean_epilogue:
        params["lean_epilogue"] = True
    if handover:
        params["handover"] = True
    if words_first:
        params["words_first"] = True
    if persistent:
        params["persistent"] = True
    if snake_walk:
        params["snake_walk"] = True
    if scale_ratios:
        params["scale_ratios"] = True
    if transposed_stores:
        params["transposed_stores"] = True
    if early_rows:
        params["early_rows"] = True
    if step_group:
        params["step_group"] = True
    if tagged_pieces:
        params["tagged_pieces"] = True
    if w2_early_stages is not None:
        params["w2_early_stages"] = cfg.w2_early_stages
    if quick_start:
        params["quick_start"] = True
    if split_nibbles:
        params["split_nibbles"] = True
    if lean_ring:
        params["lean_ring"] = True
    if tma_tokens:
        params["tma_tokens"] = True
    if dynamic_tail:
        params["dynamic_tail"] = True
    if early_scales:
        params["early_scales"] = True
    if amax_slots:
        params["amax_slots"] = True
    if epilogue_warp:
        params["epilogue_warp"] = True
    # the 16-byte cp.async pieces of the token tile (with tma_tokens only a fenced owner's staged pieces use them)
    promises = ("wgmma.mma_async.sync.aligned.m64n",) + (() if tma_tokens else ("cp.async.cg.shared.global",))
    if cfg.warp_specialized:
        promises += ("cp.async.bulk.shared::cluster.global.mbarrier", "mbarrier.try_wait.parity")
    if cfg.table_decode:
        promises += ("prmt.b32",)
    if cfg.k_splits > 1:  # the partials' publication and the last split's acquire
        promises += ("fence.acq_rel.gpu", "atom.acq_rel.gpu.global.add", "ld.relaxed.gpu.global")
    if stream_k:  # the pieces' release, the owner's bounded acquire, its loads of the partials; W1 lets a
        # programmatic W2 start, W2's producer waits for W1's grid before reading its rows
        promises += (("st.relaxed.gpu.global.v4.b32", "ld.relaxed.gpu.global.v4", "nanosleep") if tagged_pieces
                     else ("red.release.gpu.global.add", "ld.acquire.gpu.global", "ld.relaxed.gpu.global"))
        promises += ("griddepcontrol.launch_dependents" if role == "w1" else
                     "red.relaxed.gpu.global.add" if handover else "griddepcontrol.wait",)
    if tma_tokens:  # the token tile through the map, its bytes acquired once
        promises += ("cp.async.bulk.tensor.3d.shared::cluster.global", "fence.proxy.tensormap::generic.acquire")
    if amax_slots:  # W1's amax per token reduced in shared memory
        promises += ("red.shared.max.u32",)
    if dynamic_tail:  # the chunks' tickets, the last chunk's arrival
        promises += ("atom.relaxed.gpu.global.add", "atom.acq_rel.gpu.global.add")
    if words_first:  # the segment's permits taken at once where W1 set its words already
        promises += ("atom.acquire.gpu.global.add",)
    if transposed_stores:  # W2's fragments transposed by stmatrix, W1's bytes stored one by one; 16-byte stores out
        promises += ("st.global.v4.b32", "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" if role == "w2"
                     else "st.shared.b8")
    extra_sources = ("gc_moe.kernels.sm90.ptx",)
    if ring_consumer:
        params["ring_consumer"] = True
        if role == "w1":  # the bounded acquire waits and the l1_empty_count release
            promises += ("ld.acquire.gpu", "atom.release.gpu.global.add", "nanosleep", "trap")
        extra_sources += ("gc_moe.kernels.sm90.dispatch", "gc_moe.kernels.sm90.layer_layout")
    if role == "w1":
        params.update(swiglu_alpha=swiglu_alpha, swiglu_clamp=swiglu_clamp)
    return KernelVariant.make(
        "sm90.grouped_gemm", __name__, "build_gemm", params, promises=promises,
        local_bytes_budget=_local_bytes_budget(role, block_n, table_decode),
        extra_sources=extra_sources,
    )


def _local_bytes_budget(role: str, block_n: int, table_decode: bool) -> int:
    """Local memory a variant may take: W1's epilogue where it spills after the loop (tile 24 at two CTAs per SM, the
    table decode's 64 and 96; see the constants)."""
    if role != "w1":
        return 0
    if block_n in TABLE_TWO_CTA_BLOCK_N:
        return TWO_CTA_W1_EPILOGUE_LOCAL_BYTES
    return TABLE64_W1_EPILOGUE_LOCAL_BYTES if table_decode and block_n in (64,) + TABLE_WIDE_BLOCK_N else 0


def block_n_choices(**knobs) -> tuple[int, ...]:
    """The token tiles a configuration is built at: BLOCK_N_CHOICES, TABLE_TWO_CTA_BLOCK_N for the table decode at
    two CTAs per SM, TABLE_WIDE_BLOCK_N for it at one (sets reach it with max_block_n=96)."""
    table = knobs.get("fold_scales") and knobs.get("table_decode")
    two_cta_table = table and knobs.get("ctas_per_sm") == 2
    wide = table and knobs.get("ctas_per_sm") in (None, 1) and knobs.get("warp_specialized") is not False
    return tuple(sorted(BLOCK_N_CHOICES + (TABLE_TWO_CTA_BLOCK_N if two_cta_table else ())
                        + (TABLE_WIDE_BLOCK_N if wide else ())))


def variant_set(k_splits: int = 1, w2_k_splits: int = 1, max_block_n: int = max(BLOCK_N_CHOICES), **knobs):
    """One configuration at both roles and every token tile it is built at (block_n_choices) up to max_block_n,
    default SwiGLU (alpha 1, clamp 10). k_splits splits W1's K and w2_k_splits W2's (at the tiles that take it,
    `variant`)."""
    return [variant(role, bn, k_splits=k_splits if role == "w1" else w2_k_splits, **knobs)
            for role in ("w1", "w2") for bn in block_n_choices(**knobs) if bn <= max_block_n]


def all_variants():
    """Every variant CI builds (the registry's list), each once: the default set (warp-specialized up to bn 32,
    the cp.async pipeline at bn 64), the opt-in folded-scale set, the ring-consumer set, the cp.async
    pipeline at every bn (the ring consumer's arithmetic without the ring: its byte-for-byte reference), the
    compact ring consumer at bn 8, the K splits, the stream-K loops and the folded scales' table decode
    (warp-specialized at every bn, with the lean epilogue at the tiles tile_knobs runs it at, and the wide tile)."""
    out, seen = [], set()
    # the layer's compact ring consumer runs at one token per rank only: token tile 8 (layer.plan_call)
    compact_ring = [variant(role, 8, ring_consumer=True, compact_grid=True) for role in ("w1", "w2")]
    # W1 and W2 with K split over 2-4 CTAs at tiles 8 / 16 (opt-in: for calls whose working CTAs leave SMs idle)
    split_k = [variant(role, bn, k_splits=ks) for role in ("w1", "w2") for ks in K_SPLIT_CHOICES[1:]
               for bn in BLOCK_N_CHOICES if bn <= K_SPLIT_MAX_BLOCK_N]
    # the stream-K loops at token tile 8, one and two CTAs per SM (opt-in: the small calls' balance, step 21), and
    # the traced one at one CTA per SM (a measuring variant)
    stream_k = [variant(role, 8, stream_k=True, ctas_per_sm=ctas) for role in ("w1", "w2") for ctas in (1, 2)]
    stream_k += [variant(role, 8, stream_k=True, ctas_per_sm=1, trace=True) for role in ("w1", "w2")]
    # the stand-alone pair's hand-over words (W2 takes W1's rows per K128 step), plain and traced
    stream_k += [variant(role, 8, stream_k=True, ctas_per_sm=1, handover=True, trace=trace)
                 for role in ("w1", "w2") for trace in (False, True)]
    # its W2 taking a segment's words before the segment's weights where W1 set them already (step 45)
    stream_k += [variant("w2", 8, stream_k=True, ctas_per_sm=1, handover=True, trace=trace, words_first=True)
                 for trace in (False, True)]
    for v in (variant_set() + variant_set(fold_scales=True) + variant_set(ring_consumer=True)
              + variant_set(warp_specialized=False) + compact_ring + split_k + stream_k
              + variant_set(fold_scales=True, table_decode=True)
              # the table decode fits two CTAs per SM up to token tile 16 (bn 8 is at two by default)
              + [variant(role, 16, fold_scales=True, table_decode=True, ctas_per_sm=2) for role in ("w1", "w2")]
              # N fitted to each tile's rows, at the tiles tile_knobs runs with the table decode; 24-row tiles (two
              # CTAs per SM) with and without it
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, ctas_per_sm=2 if bn == 16 else None)
                 for role in ("w1", "w2") for bn in (16, 24, 32, 64)]
              + [variant(role, 24, fold_scales=True, table_decode=True) for role in ("w1", "w2")]
              # the epilogue's words staged by the producer and W1's amax reduced once per token, at the table tiles
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                         ctas_per_sm=2 if bn == 16 else None)
                 for role in ("w1", "w2") for bn in (16, 24, 32, 64)]
              + [variant(role, 8, stream_k=True, ctas_per_sm=1, trace=trace, lean_epilogue=True)
                 for role in ("w1", "w2") for trace in (False, True)]
              # the wide tile (65-96 rows: one decode for a chain of 64 rows and one of the rest), with fitted N
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=lean)
                 for role in ("w1", "w2") for bn in TABLE_WIDE_BLOCK_N for lean in (False, True)]
              # the persistent grids with the waited loop (where `variant` takes the knob; at tile 8 too, two CTAs per
              # SM: the tile-8 unit grid's WGMMAs are serialized, the persistent table decode's are not)
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                         persistent=True, ctas_per_sm=2 if bn == 16 else None)
                 for role in ("w1", "w2") for bn in (16, 24, 32, 64) + TABLE_WIDE_BLOCK_N]
              + [variant(role, 8, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True, persistent=True)
                 for role in ("w1", "w2")]
              # their walk with the experts by decreasing rows, rounds in alternating direction, at the tiles
              # tile_knobs runs persistent
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                         persistent=True, snake_walk=True)
                 for role in ("w1", "w2") for bn in (32, 64) + TABLE_WIDE_BLOCK_N]
              # and their sums kept in units of the step's activation scale (in-place chains)
              + [variant(role, bn, fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                         persistent=True, scale_ratios=True)
                 for role in ("w1", "w2") for bn in (32, 64) + TABLE_WIDE_BLOCK_N]
              # the epilogues' outputs through shared memory, at tile_knobs's tiles from 16 rows
              + [variant(role, bn, **{**tile_knobs(bn)[1], "transposed_stores": True})
                 for role in ("w1", "w2") for bn in (16, 24, 32, 64) + TABLE_WIDE_BLOCK_N if (role, bn) != ("w1", 24)]
              # and at the persistent tiles as the unit grid (its epilogue's region used once per CTA; the GPU test
              # compares both walks)
              + [variant(role, bn, **{**tile_knobs(bn)[1], "persistent": False, "transposed_stores": True})
                 for role in ("w1", "w2") for bn in (32, 64) + TABLE_WIDE_BLOCK_N]
              # the lean W2's value stores with every combine row loaded first
              + [variant("w2", bn, **{k: x for k, x in tile_knobs(bn)[1].items() if k != "transposed_stores"},
                         early_rows=True) for bn in (16, 24, 32, 64) + TABLE_WIDE_BLOCK_N]
              # the stream-K loops with a K128 step's WGMMAs as one group (one wait per step), plain and lean
              + [variant(role, 8, stream_k=True, ctas_per_sm=1, step_group=True, lean_epilogue=lean)
                 for role in ("w1", "w2") for lean in (False, True)]
              + [variant(role, 8, stream_k=True, ctas_per_sm=1, step_group=True, trace=True) for role in ("w1", "w2")]
              # tile_knobs's sets at their capped rings (RING_STAGES), and tiles 32 / 64 capped as a unit grid
              + [variant(role, tile_knobs(cap)[0], **tile_knobs(cap)[1])
                 for role in ("w1", "w2") for cap in (1, 9, 17, 25, 33, 65)]
              + [variant(role, bn, **{**tile_knobs(bn)[1], "persistent": False})
                 for role in ("w1", "w2") for bn in (32, 64)]
              # the H200's tile-8 loops (TILE8_STREAM_K), plain and traced
              + [variant(role, 8, **{**tile_knobs(1, card="h200")[1], **knobs}) for role in ("w1", "w2")
                 for knobs in ({}, {"trace": True})]
              + [variant(role, 8, max_stages=UNIT_GRID_8_STAGES, split_nibbles=split) for role in ("w1", "w2")
                 for split in (False, True)]  # tile_knobs's unit grid (split) and its lane baseline
              # the stream-K pieces published without a fence (plain, lean, traced, with step_group)
              + [variant(role, 8, stream_k=True, ctas_per_sm=1, tagged_pieces=True, **knobs)
                 for role in ("w1", "w2")
                 for knobs in ({}, {"lean_epilogue": True}, {"trace": True}, {"step_group": True})]
              # the stream-K loops at tile_knobs's ring, its quick start traced and with the hand-over words, and
              # the plain walk (plain, traced, with the words: the quick start's baseline)
              + [variant(role, 8, **{**tile_knobs(1)[1], **knobs}) for role in ("w1", "w2")
                 for knobs in ({"trace": True}, {"handover": True}, {"quick_start": False},
                               {"quick_start": False, "trace": True}, {"quick_start": False, "handover": True})]
              # tile_knobs's tile-8 loops (stream-K, plain and traced) on the lane order: the split order's baseline
              + [variant(role, 8, **{**tile_knobs(1)[1], **knobs, "split_nibbles": False}) for role in ("w1", "w2")
                 for knobs in ({}, {"trace": True})]
              # each card's tile-8 loops without lean_ring (its baseline, step 79), and the H200's traced
              + [variant(role, 8, **{**tile_knobs(1, card=card)[1], **knobs, "lean_ring": False})
                 for role in ("w1", "w2") for card, knobs in (("h100", {}), ("h200", {}), ("h200", {"trace": True}))]
              # each card's tile-8 loops with the token tile through a tensor map (step 80), plain and traced
              + [variant(role, 8, **{**tile_knobs(1, card=card)[1], **knobs, "tma_tokens": True})
                 for role in ("w1", "w2") for card in CARDS for knobs in ({}, {"trace": True})]
              # each card's tile-8 loops with the last units' steps in chunks claimed by ticket (step 81)
              + [variant(role, 8, **{**tile_knobs(1, card=card)[1], "dynamic_tail": True})
                 for role in ("w1", "w2") for card in CARDS]
              # each card's tile-8 loops with a step's scales held from its wait (step 83), plain and traced
              + [variant(role, 8, **{**tile_knobs(1, card=card)[1], **knobs, "early_scales": True})
                 for role in ("w1", "w2") for card in CARDS for knobs in ({}, {"trace": True})]
              # each card's tile-8 loops with W1's amax in rotating slot sets (step 84), with and without the lean
              # epilogue's early loads, and the lean epilogue alone (W2 takes only that), plus the traced pair
              + [variant(role, 8, **{**tile_knobs(1, card=card)[1], **knobs})
                 for role in ("w1", "w2") for card in CARDS
                 for knobs in ({"amax_slots": True}, {"lean_epilogue": True},
                               {"lean_epilogue": True, "amax_slots": True},
                               {"lean_epilogue": True, "amax_slots": True, "trace": True},
                               {"lean_epilogue": True, "trace": True})]
              # each card's tile-8 W1 with its unit epilogues in a warp of their own (step 86), plain and traced
              + [variant("w1", 8, **{**tile_knobs(1, card=card)[1], **knobs, "epilogue_warp": True})
                 for card in CARDS for knobs in ({}, {"trace": True})]):
        if v.describe() not in seen:
            seen.add(v.describe())
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------------- launch
def _check_cuda(what: str, t, dtype, shape=None):
    if not t.is_cuda or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous CUDA {dtype} tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def ring_args_w1(ws, shape, timeout_s: float = 3600.0) -> list:
    """The ring-consumer W1's extra arguments (`RING_PARAMS_W1`) from a layer workspace and its
    `layer_layout.LayerShape`: RING_READY, the ring signals, BM, B, the bounded waits' limit."""
    from gc_moe.kernels.sm90 import layer_layout as ll
    from gc_moe.runtime.launch import i32, i64, ptr

    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    if shape.ring_reuse:
        raise ValueError(f"a ring of {shape.ring_blocks} blocks reused within a replay (pool {shape.pool_blocks}) is "
                         f"read by the fused role2 kernel only (role2.Role2Config(ring_reuse=True)); the two-node "
                         f"W1 reads grouped rows by their flat index")
    return [ptr(ws.control.data_ptr() + 4 * ll.RING_READY), ptr(ws.l1_full_count), ptr(ws.l1_empty_count),
            i32(shape.block_m), i32(shape.ring_blocks), i64(int(timeout_s * 1e9))]


def ring_args_w2(ws, shape) -> list:
    """The ring-consumer W2's extra arguments (`RING_PARAMS_W2`): ring_source, the peer table, C k."""
    from gc_moe.runtime.launch import i32, ptr

    return [ptr(ws.ring_source), ptr(ws.peers), i32(shape.capacity * shape.topk)]


def _check_ring_args(cfg: GemmConfig, kernel, ring_args) -> list:
    extra = RING_PARAMS_W1 if cfg.role == "w1" else RING_PARAMS_W2
    if cfg.ring_consumer and len(ring_args) != len(extra):
        raise ValueError(f"{kernel.name} is a ring consumer: pass ring_args ({[n for n, _ in extra]}), "
                         f"got {len(ring_args)} values")
    if not cfg.ring_consumer and ring_args:
        raise ValueError(f"{kernel.name} is not a ring consumer: ring_args must be empty")
    return list(ring_args)


def nibble_order(cfg: GemmConfig) -> str:
    """The weights.sm90 nibble order a configuration reads its codes in: "table" with table_decode, "split" with
    split_nibbles, else "lane"."""
    return "table" if cfg.table_decode else "split" if cfg.split_nibbles else "lane"


def _check_nibble_order(cfg: GemmConfig, kernel, mat) -> None:
    """A kernel reads its codes in one nibble order (`nibble_order`): the matrix must hold them so."""
    want = nibble_order(cfg)
    have = getattr(mat, "nibble_order", "lane")
    if have != want:
        raise ValueError(f"{kernel.name} reads weights in the {want!r} nibble order, the matrix has {have!r}: "
                         f"weights.sm90.with_nibble_order(mat, {want!r})")


def card_of(device_name: str) -> str:
    """The tile_knobs card of a CUDA device name ('NVIDIA H200' -> 'h200'); 'h100' for every other Hopper part
    (the rule measured on the H100 is the conservative one: shallower rings)."""
    return "h200" if "h200" in device_name.lower() else "h100"


def tile_knobs(capacity: int, w1_units: int | None = None, sms: int | None = None,
               wide_tile: bool = True, two_cta_tiles: bool = True, card: str = "h100") -> tuple[int, dict]:
    """(token tile, knobs) of the stand-alone W1 / W2 for a call whose busiest expert has `capacity` rows, as
    measured fastest on the H200 (docs/sm90-grouped-gemm.md, steps 12-16, 24): up to 8 rows tile 8 as stream-K
    loops at one CTA per SM (`stream_k`: every SM gets the same K128 steps; against the grid of units at two CTAs per
    SM 5-41% faster at 1 token, -4..+10% at 2-8, step 24; it replaces the per-call CTAs-per-SM and K-split rules),
    except where W1's units with tokens (token tiles x 2I/256, `w1_units`, when the caller knows them and the
    `sms`) exceed STREAM_K_MAX_WAVES waves of the SMs (past what was measured: the default grid, two CTAs per SM,
    there); beyond, the table decode with N fitted to
    each tile's rows (`fit_n`: 3-11% faster than the whole tile): up to 16 rows at tile 16 and two CTAs per SM
    (13-16% faster than one: twice the warps per SM to hide latency with), up to 24 at tile 24, two CTAs per SM
    (5-8% faster than tile 32), up to 32 at tile 32, beyond with 64-token tiles (the weights decoded once per 64
    tokens: 20-35% faster than two or three 32-token tiles). Knobs past tile 8 need weights in the table nibble
    order (`weights.sm90.with_nibble_order`); stream_k needs its grid resident at once (`GemmConfig.stream_k`).
    The table tiles run the lean epilogue (no global load after the K loop, W1's amax once per token: 1.4-4.2%
    faster at 64-256 tokens, step 33 as measured); wide_tile: 65-96 rows at the wide tile (TABLE_WIDE_BLOCK_N: one
    decode of the weights per K128 step for both chains) instead of two 64-token tiles (GLM-5.2 at 256 tokens 11%
    faster, 13.5% with the lean epilogue, step 34); False keeps tile 64 there. two_cta_tiles=False: 9-32 rows at tile 32
    (one CTA per SM) instead of tiles 16 / 24 at two: the choice measured against the serialized pipelined loop, open
    again with the loops of steps 43-44. Tiles 32, 64 and 96 run as a persistent grid (`persistent`: one CTA per SM
    walks the units on a stage ring that runs on across them; at tiles 64 / 96 2.8-4.2% faster on the H100 at both
    models' 128-256 tokens and 1.8-6.5% on the H200, steps 50 and 54; at tile 32 with the waited loop instead of the
    serialized pipelined one, 4.1% faster on the H200 at both models, step 54; at tile 16 it is 2-5% slower, at 24 it
    is not built); the wide tile with `transposed_stores` and `scale_ratios` (3.3% faster at GLM-5.2 T=256 on the
    H100, step 61; at tiles 32 / 64 the two were within +-1.2%, so they stay off there). The rings of tile 8 (both
    grids), 32 and 64 are capped (`max_stages`: RING_STAGES, UNIT_GRID_8_STAGES; step 65: a deeper ring only queues
    every request behind the reads). The stream-K loops start quickly (`quick_start`: W1's producer 0.4 us sooner at
    its first copies, the pair 0.5 us faster on average at 1-8 tokens over six runs on three H100s, steps 69 / 71).
    Tile 8 reads its codes in the "split" nibble order (`split_nibbles`: its consumers 6-16% less busy per K128 step,
    the pair 0.16-0.56 us faster on average at 1-8 tokens over four runs on two H100s, step 72). card (`card_of`):
    the card whose measurements set tile 8's stream-K ring, pieces and epilogue (TILE8_STREAM_K: on the H200 12
    stages and the pieces published without a fence, step 78; on the H100 the lean epilogue, step 85). The
    stream-K loops hold their ring's bases warp-uniform (`lean_ring`: 130 instructions per K128 step instead of 140,
    the pair 0.6 us faster on average at 1-8 tokens over two runs on an H100 and the H200's rule 1.6 us faster there,
    step 79)."""
    if capacity < 0:
        raise ValueError(f"capacity {capacity}: allowed >= 0 (the most rows one local expert holds)")
    if card not in CARDS:
        raise ValueError(f"card {card!r}: allowed one of {CARDS} (grouped_gemm.card_of names a device's)")
    if capacity <= 8:
        if w1_units is not None and sms and w1_units > STREAM_K_MAX_WAVES * sms:
            return 8, {"max_stages": UNIT_GRID_8_STAGES, "split_nibbles": True}
        return 8, {"stream_k": True, "ctas_per_sm": 1, **TILE8_STREAM_K[card], "quick_start": True,
                   "split_nibbles": True, "lean_ring": True}
    table = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    persistent = {**table, "persistent": True}
    if capacity <= 32 and not two_cta_tiles:
        return 32, {**persistent, "max_stages": RING_STAGES[32]}
    if capacity <= 16:
        return 16, {**table, "ctas_per_sm": 2}
    if capacity <= 24:
        return 24, {**table, "ctas_per_sm": 2}
    if capacity <= 32:  # the persistent grid's waited loop, not the pipelined one ptxas serializes (step 54)
        return 32, {**persistent, "max_stages": RING_STAGES[32]}
    if wide_tile and 64 < capacity <= max(TABLE_WIDE_BLOCK_N):
        # its epilogues' outputs through shared memory and its sums in units of the step's scale (both chains under
        # one wait): 3.3% faster at GLM-5.2 T=256 on the H100, four runs (steps 57-59, docs step 61)
        return max(TABLE_WIDE_BLOCK_N), {**persistent, "transposed_stores": True, "scale_ratios": True}
    return 64, {**persistent, "max_stages": RING_STAGES[64]}


def split_sizes(cfg: GemmConfig, launch_grid) -> tuple[int, int]:
    """(FP32 partials, arrival counts) a split launch of this grid needs: one count per unit (token tile x
    weight-row CTA x expert), block_n / 2 partials per consumer thread and split."""
    units = (launch_grid[0] // cfg.k_splits) * launch_grid[1] * launch_grid[2]
    return units * cfg.k_splits * THREADS * (cfg.block_n // 2), units


def stream_sizes(cfg: GemmConfig, rows: int, local_experts: int, capacity: int, sms: int) -> tuple[int, int]:
    """(FP32 partials, arrival counts) a stream_k launch needs: one piece per (unit, CTA) sharing steps, numbered
    unit + CTA (a CTA's units are consecutive and the CTAs' ranges ordered, so the number is unique and below
    units + CTAs), of block_n / 2 partials per consumer thread; one count per unit that may have tokens.
    dynamic_tail: after them one piece per tail chunk (numbered units + CTAs + chunk with the call's units), and
    after the counts the chunks' ticket (at the call's units)."""
    units = max(1, -(-capacity // cfg.block_n)) * (rows // ROWS_PER_CTA) * local_experts
    ctas = grid(cfg, rows, local_experts, capacity, sms)[0]
    trace_words = ctas * TRACE_SLOTS * 4 if cfg.trace else 0  # the traced phases ahead of the partials
    chunks = units // TAIL_UNIT_DIV * TAIL_CHUNKS if cfg.dynamic_tail else 0
    return trace_words + (units + ctas + chunks) * THREADS * (cfg.block_n // 2), units + (1 if cfg.dynamic_tail else 0)


def device_sms(device) -> int:
    """The SM count of a CUDA device (a stream_k grid's size when the caller names none)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def split_buffers(kernel, mat, capacity: int, device, sms: int | None = None):
    """(split_partials, split_counts) for a kernel with k_splits > 1 or stream_k at this matrix and capacity
    (stream_k: and `sms`, default the device's SMs, as its launches must use): FP32 partials (k_splits: [unit,
    split, consumer thread, block_n / 2]; stream_k: `stream_sizes`) and int32 counts [unit], zeroed (the kernel
    keeps them zero between launches; tagged_pieces: the partials hold ptx.PIECE_EMPTY instead, and the kernel
    leaves them so). None for a kernel without splits."""
    import torch

    cfg = GemmConfig(**dict(kernel.entry.variant.params))
    if cfg.stream_k:
        partials, units = stream_sizes(cfg, mat.rows, mat.num_experts, capacity, sms or device_sms(device))
    elif cfg.k_splits == 1:
        return None
    else:
        partials, units = split_sizes(cfg, grid(cfg, mat.rows, mat.num_experts, capacity))
    if cfg.tagged_pieces:  # every piece slot empty (the kernel empties what it fills)
        partials_buf = torch.full((partials,), PIECE_EMPTY_BITS, dtype=torch.int32, device=device).view(torch.float32)
    else:
        partials_buf = torch.zeros(partials, dtype=torch.float32, device=device)
    return partials_buf, torch.zeros(units, dtype=torch.int32, device=device)


def _split_args(cfg: GemmConfig, kernel, mat, capacity: int, sms: int, k: int, split) -> list:
    """The split launch's extra arguments (`SPLIT_PARAMS`, or `STREAM_PARAMS` for stream_k) after checking `split`
    against the grid and K."""
    import torch

    from gc_moe.runtime.launch import i32, ptr

    if cfg.stream_k:
        if mat.num_experts > STREAM_MAX_EXPERTS:
            raise ValueError(f"{kernel.name} is a stream-K loop for at most {STREAM_MAX_EXPERTS} local experts, "
                             f"got {mat.num_experts}: use a variant without stream_k")
        need, units = stream_sizes(cfg, mat.rows, mat.num_experts, capacity, sms)
        if split is None or split[0].dtype != torch.float32 or split[0].numel() < need or not split[0].is_cuda \
                or split[1].dtype != torch.int32 or split[1].numel() < units or not split[1].is_cuda:
            raise ValueError(f"{kernel.name} is a stream-K loop over {sms} SMs: pass split=split_buffers(kernel, "
                             f"mat, capacity, device, sms) (float32 partials >= {need}, int32 counts >= {units}, "
                             f"zeroed)")
        return [ptr(split[0]), ptr(split[1]), i32(mat.num_experts)]
    launch_grid = grid(cfg, mat.rows, mat.num_experts, capacity, sms)  # sms: a persistent grid's
    if cfg.k_splits > k // 128:
        raise ValueError(f"{kernel.name} splits K in {cfg.k_splits}, but K = {k} has {k // 128} K128 steps; "
                         f"allowed: at least one step per split")
    if cfg.k_splits == 1:
        if split is not None:
            raise ValueError(f"{kernel.name} does not split K: pass split=None")
        return []
    need, units = split_sizes(cfg, launch_grid)
    if split is None or split[0].dtype != torch.float32 or split[0].numel() < need or not split[0].is_cuda \
            or split[1].dtype != torch.int32 or split[1].numel() < units or not split[1].is_cuda:
        raise ValueError(f"{kernel.name} splits K in {cfg.k_splits}: pass split=split_buffers(kernel, mat, "
                         f"capacity, device) (float32 partials >= {need}, int32 counts >= {units}, zeroed)")
    return [ptr(split[0]), ptr(split[1])]


def handover_words(experts: int, capacity: int, inter: int, device, block_n: int = 8):
    """The hand-over words of a handover W1 + W2 pair (`GemmConfig.handover`): int32 [experts, token tiles at
    `capacity`, inter / 128], zeroed (each pair leaves them zero). One buffer for both launches of a pair."""
    import torch

    return torch.zeros(experts * max(1, -(-capacity // block_n)) * (inter // 128), dtype=torch.int32, device=device)


def _handover_args(cfg: GemmConfig, kernel, experts: int, capacity: int, inter: int, hidden: int, ready) -> list:
    """A launch's `HANDOVER_PARAMS_W1` / `_W2` after checking `ready` (`handover_words`); [] without handover."""
    import torch

    from gc_moe.runtime.launch import i32, ptr

    if not cfg.handover:
        if ready is not None:
            raise ValueError(f"{kernel.name} has no hand-over words (handover=False): pass ready=None")
        return []
    if inter // 128 > HANDOVER_MAX_K_BLOCKS:
        raise ValueError(f"{kernel.name} hands over at most {HANDOVER_MAX_K_BLOCKS} K128 blocks of W2 (a producer "
                         f"lane polls each), got inter {inter} ({inter // 128} blocks): use a variant without handover")
    tiles = max(1, -(-capacity // cfg.block_n))
    need = experts * tiles * (inter // 128)
    if ready is None or ready.dtype != torch.int32 or ready.numel() < need or not ready.is_cuda:
        raise ValueError(f"{kernel.name} hands W1's rows over through words: pass ready=handover_words({experts}, "
                         f"{capacity}, {inter}, device) (int32 >= {need}, zeroed, the same buffer for W1 and W2)")
    if cfg.role == "w1":
        return [ptr(ready), i32(tiles), i32(hidden // ROWS_PER_CTA)]  # permits: W2's weight-row CTAs per tile
    return [ptr(ready), i32(tiles)]


def _persist_args(cfg: GemmConfig, experts: int, capacity: int) -> list:
    """A persistent variant's trailing arguments (PERSIST_PARAMS): the unit grid's experts and token tiles."""
    from gc_moe.runtime.launch import i32

    if not cfg.persistent:
        return []
    return [i32(experts), i32(max(1, -(-capacity // cfg.block_n)))]


# tma_tokens: the tensor maps of the activation buffers launched so far, {(device, address, rows, K): the map's 128
# bytes on that device}; one per buffer and shape, so a captured graph's launch keeps the map it was captured with
_TOKEN_MAPS: dict = {}


def token_map_spec(address: int, rows: int, k: int):
    """The tensor map request behind `token_map` for fp8 activations [rows, k] at `address` (checked: k a multiple of
    128, rows >= 1; the driver's own constraints by TiledTensorMapSpec.validate)."""
    from gc_moe.runtime.launch import TiledTensorMapSpec

    if k % 128 or k <= 0 or rows < 1:
        raise ValueError(f"token_map: activations [{rows}, {k}]; allowed rows >= 1 and K a positive multiple of 128")
    spec = TiledTensorMapSpec("uint8", address, (16, rows, k // 16), (k, 16), (16, TOKEN_MAP_ROWS, 8),
                              swizzle="none", l2_promotion="128B")
    spec.validate()
    return spec


def token_map(act):
    """The 3-D tensor map a tma_tokens kernel copies its token tiles through, for grouped activations `act` (fp8
    [R, K], K a multiple of 128): dims (16 bytes, R rows, K / 16 chunks of 16 bytes) with strides (K, 16) bytes and a
    box of (16, 8, 8), so one copy lands a K128 step of 8 rows in the core-matrix order the WGMMA descriptor reads
    (chunk-major: chunk c of row n at c x 128 + n x 16); rows past R are zero-filled. Encoded on the host the first
    time a buffer is launched and kept on the device (128 bytes, 64-byte aligned), so that first launch must not be
    under CUDA-graph capture (the host-to-device copy cannot be captured)."""
    import torch

    from gc_moe.runtime.launch import encode_tiled_tensor_map

    rows, k = act.shape
    key = (act.device.index, act.data_ptr(), rows, k)
    held = _TOKEN_MAPS.get(key)
    if held is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a tma_tokens kernel needs the tensor map of its activations [{rows}, {k}] at "
                               f"{act.data_ptr():#x}, and it cannot be made under graph capture: launch once on this "
                               f"buffer before capturing, or call grouped_gemm.token_map(act) first")
        data = encode_tiled_tensor_map(token_map_spec(act.data_ptr(), rows, k)).data
        held = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(act.device)
        if held.data_ptr() % 64:
            raise RuntimeError(f"the tensor map's device copy at {held.data_ptr():#x} is not 64-byte aligned")
        _TOKEN_MAPS[key] = held
    return held


def _token_map_args(cfg: GemmConfig, act) -> list:
    """A tma_tokens launch's TOKEN_MAP_PARAMS (the map's device address); [] without the knob."""
    from gc_moe.runtime.launch import ptr

    if not cfg.tma_tokens:
        return []
    return [ptr(token_map(act))]


def w1_launch(kernel, mat, act, act_scale, expert_offsets, routing_weight, out, out_scale, capacity,
              ring_args=(), split=None, sms=None, ready=None):
    """(grid, arguments) of one W1 launch or graph node; see `launch_w1`. split: `split_buffers(...)` for a
    kernel with k_splits > 1 or stream_k; sms: a stream_k grid's SMs (default: act's device's); ready: a
    handover variant's `handover_words(...)`."""
    import torch

    from gc_moe.runtime.launch import i32, ptr

    if not mat.gate_up_interleaved:
        raise ValueError("launch_w1 needs the W1 matrix (gate/up interleaved), got a W2 matrix")
    rows, hidden, inter = act.shape[0], mat.cols, mat.rows // 2
    _check_cuda("act", act, torch.float8_e4m3fn, (rows, hidden))
    _check_cuda("act_scale", act_scale, torch.float32, (rows, hidden // 128))
    _check_cuda("expert_offsets", expert_offsets, torch.int32, (mat.num_experts + 1,))
    _check_cuda("routing_weight", routing_weight, torch.float32, (rows,))
    _check_cuda("out", out, torch.float8_e4m3fn, (rows, inter))
    _check_cuda("out_scale", out_scale, torch.float32, (rows, inter // 128))
    cfg = GemmConfig(**dict(kernel.entry.variant.params))
    if cfg.role != "w1":
        raise ValueError(f"launch_w1 needs a w1 kernel variant, got {kernel.name}")
    _check_nibble_order(cfg, kernel, mat)
    extra = _check_ring_args(cfg, kernel, ring_args)
    sms = sms or (device_sms(act.device) if cfg.stream_k or cfg.persistent else None)
    g = grid(cfg, mat.rows, mat.num_experts, capacity, sms)
    extra = extra + _split_args(cfg, kernel, mat, capacity, sms, hidden, split)
    extra = extra + _handover_args(cfg, kernel, mat.num_experts, capacity, inter, hidden, ready)
    extra = extra + _persist_args(cfg, mat.num_experts, capacity) + _token_map_args(cfg, act)
    return g, [
        ptr(mat.codes), ptr(mat.scales), ptr(mat.factor), ptr(act), ptr(act_scale), ptr(expert_offsets),
        ptr(routing_weight), ptr(out), ptr(out_scale), i32(hidden // 128), i32(mat.rows // 64)] + extra


def launch_w1(kernel, mat, act, act_scale, expert_offsets, routing_weight, out, out_scale, capacity, stream,
              ring_args=(), split=None, sms=None, ready=None):
    """W1 + SwiGLU + routing weight + FP8 requant over grouped rows. `kernel`: a loaded w1 variant.

    mat: weights.sm90.Sm90Matrix (gate/up interleaved); act fp8 [R, H]; act_scale f32 [R, H/128];
    expert_offsets int32 [E+1] (rows of expert e: [off[e], off[e+1])); routing_weight f32 [R];
    out fp8 [R, I]; out_scale f32 [R, I/128]; capacity: the most rows one expert may hold;
    ring_args: `ring_args_w1(...)` for a ring-consumer variant, else empty; split: `split_buffers(...)` for a
    variant with k_splits > 1 or stream_k, else None; sms: a stream_k grid's SMs (default: the device's);
    ready: a handover variant's `handover_words(...)`, the buffer its W2 launch gets too.
    """
    from gc_moe.runtime.launch import launch

    g, args = w1_launch(kernel, mat, act, act_scale, expert_offsets, routing_weight, out, out_scale, capacity,
                        ring_args, split, sms, ready)
    return launch(kernel, g, args, stream)


def w2_launch(kernel, mat, act, act_scale, expert_offsets, dest_row, out, capacity, ring_args=(), split=None,
              sms=None, ready=None):
    """(grid, arguments) of one W2 launch or graph node; see `launch_w2`. split: `split_buffers(...)` for a
    kernel with k_splits > 1 or stream_k; sms: a stream_k grid's SMs (default: act's device's); ready: a handover
    variant's `handover_words(...)`, its W1's."""
    import torch

    from gc_moe.runtime.launch import i32, ptr

    rows, inter, hidden = act.shape[0], mat.cols, mat.rows
    _check_cuda("act", act, torch.float8_e4m3fn, (rows, inter))
    _check_cuda("act_scale", act_scale, torch.float32, (rows, inter // 128))
    _check_cuda("expert_offsets", expert_offsets, torch.int32, (mat.num_experts + 1,))
    _check_cuda("dest_row", dest_row, torch.int32, (rows,))
    _check_cuda("out", out, torch.bfloat16)
    if out.shape[1] != hidden:
        raise ValueError(f"out must be [P, {hidden}], got {tuple(out.shape)}")
    cfg = GemmConfig(**dict(kernel.entry.variant.params))
    if cfg.role != "w2":
        raise ValueError(f"launch_w2 needs a w2 kernel variant, got {kernel.name}")
    _check_nibble_order(cfg, kernel, mat)
    extra = _check_ring_args(cfg, kernel, ring_args)
    sms = sms or (device_sms(act.device) if cfg.stream_k or cfg.persistent else None)
    g = grid(cfg, mat.rows, mat.num_experts, capacity, sms)
    extra = extra + _split_args(cfg, kernel, mat, capacity, sms, inter, split)
    extra = extra + _handover_args(cfg, kernel, mat.num_experts, capacity, inter, hidden, ready)
    extra = extra + _persist_args(cfg, mat.num_experts, capacity) + _token_map_args(cfg, act)
    return g, [
        ptr(mat.codes), ptr(mat.scales), ptr(mat.factor), ptr(act), ptr(act_scale), ptr(expert_offsets),
        ptr(dest_row), ptr(out), i32(inter // 128), i32(mat.rows // 64)] + extra


def launch_w2(kernel, mat, act, act_scale, expert_offsets, dest_row, out, capacity, stream, ring_args=(),
              split=None, sms=None, programmatic=False, ready=None):
    """W2 over grouped rows: out[dest_row[r], :] = BF16(W2 act[r]). `kernel`: a loaded w2 variant.

    act fp8 [R, I] + act_scale f32 [R, I/128] (W1's outputs); dest_row int32 [R]; out bf16 [P, H]
    (a ring consumer: the local combine buffer, rows go to peers[ring_source div C k] + it);
    ring_args: `ring_args_w2(...)` for a ring-consumer variant, else empty; split: `split_buffers(...)` for a
    variant with k_splits > 1 or stream_k, else None; sms: a stream_k grid's SMs (default: the device's).
    programmatic: a stream_k W2 only, launched right after its W1 in the same stream: it starts as W1's CTAs
    leave their SMs and streams its first weight stages before it waits for W1's grid (programmatic dependent
    launch; the W1 stream_k loop signals at its start); a handover variant (ready: its W1's `handover_words`)
    takes its rows per K128 step as W1 publishes them instead of waiting for W1's grid.
    """
    from gc_moe.runtime.launch import launch

    if programmatic and not GemmConfig(**dict(kernel.entry.variant.params)).stream_k:
        raise ValueError(f"{kernel.name} cannot be launched programmatically: only the stream_k W2 waits for its "
                         f"W1 grid (griddepcontrol.wait) before reading its rows; pass programmatic=False")
    g, args = w2_launch(kernel, mat, act, act_scale, expert_offsets, dest_row, out, capacity, ring_args, split,
                        sms, ready)
    return launch(kernel, g, args, stream, programmatic=programmatic)
