#!/usr/bin/env bash
# Where the grouped GEMM's time over its floor goes, and the prepared candidates against the default, in bounded
# steps (logs under $OUT, default ./device-out; docs/sm90-grouped-gemm.md steps 32-36):
#   tests   GPU tests of everything opt-in and unmeasured: the lean epilogue, the wide tile, the stream-K pair
#           kernel, the programmatic W2 pair, the traced stream-K loops (with the pair's hand-over stamps) and the
#           persistent grid
#   pair    1-8 tokens: ws_auto_pdl (the programmatic W2) against the pair kernel (W1 and W2 in one stream-K launch,
#           `pair`, with the lean epilogue `pair_lean`, and `ws_auto_pair`: tile_knobs's choice with the pair kernel
#           where it picks stream-K, the candidate default), each checked; after `trace` in the same run also
#           `pair_w`, its ranges sized by the SMs' rates the traces measured, and `ws_auto_ho`: ws_auto_pdl with the
#           hand-over words (W2 takes W1's rows per K128 step as W1 publishes them, GemmConfig.handover), and `t8p`:
#           the table decode at tile 8 as a persistent grid (two CTAs per SM; the tile-8 unit grid ws_auto runs at 8
#           tokens has its WGMMAs serialized by ptxas, this one not); `pair_wf` and `ws_auto_hof`: the pair kernel
#           and ws_auto_ho with W2's segments taking their hand-over words before their weights (words_first);
#           `pair_pub` / `pair_pubwf`: the pair with W1's words released by a warp of their own (publisher_warp)
#   shapes  64-256 tokens: ws_auto (tile_knobs's default) and `pers` (the persistent grid, GemmConfig.persistent,
#           with the waited loop at every table tile but 24), also with tile 32 for 9-32 rows instead of tiles 16 / 24
#           at two CTAs per SM (`pers32`), per role at both models and at half / quarter K (--shape: the same
#           statistics, fewer K128 steps), so each kernel's time fits rounds x (per-unit + steps x per-step)
#           (scripts/analyze_unit_costs.py fit)
#   trace   1 and 8 tokens: the traced stream-K loops, with and without the lean epilogue's early loads: per CTA its
#           SM, start and end, three launches each (does the end spread sit on the same SMs every launch?
#           scripts/analyze_unit_costs.py spread), the traced pair with the programmatic W2 (skt1p): where the
#           pair loses time between W1's streaming and W2's (pair_trace), the same with the hand-over words (skt1h,
#           skt1hf with words_first) and the traced pair kernel (pair_t, pair_tf with words_first, pair_tpubwf with
#           both steps 45-46)
#   candidates  16-256 tokens: `snake` (tile_knobs's choice with the persistent grid's snake walk,
#           GemmConfig.snake_walk), `ratio` (with its sums kept in units of the step's scale, GemmConfig.scale_ratios),
#           `both`, `tst` (the epilogues' outputs through shared memory, GemmConfig.transposed_stores) and `early`
#           (W2's combine rows loaded before its stores, GemmConfig.early_rows) against ws_auto in one run (docs
#           steps 55-59)
#   combos  64-256 tokens, twice: `tst`, `ratio`, `tr` (both), `trs` (both with the snake walk) and `snake` against
#           ws_auto (the candidates step's winners on an H100, docs step 61)
#   table   every token count 1-256 at both models: the default (`ws_auto`, `ws_auto_pdl`) beside the candidates for
#           it (the pair kernel `ws_auto_pair` and `ws_auto_pairx` with words_first and publisher_warp, `snake`, `ratio`), and `unit`
#           (tile_knobs without its persistent grid at tiles 32 / 64 / 96: the same-run baseline of that default),
#           `t32` (9-32 rows at the persistent tile 32 instead of tiles 16 / 24 at two CTAs per SM: the H200's 64-128
#           token points at tile 24 sit at 78%), the issue's table per model from one run, with a stream read of each
#           point's bytes (--read-ref)
#   reads   1-8, 64 and 256 tokens: each kernel alone (--per-role) beside one stream-read launch of its own bytes
#           and of the pair's (--read-ref: kernels/sm90/stream_read.py, static ranges and chunks claimed by ticket):
#           what each GEMM kernel adds over a plain streaming read of what it reads (docs step 62)
#   group   1-8 tokens: ws_auto and ws_auto_pdl against `sg` / `sg_pdl`, the stream-K loops with a K128 step's four
#           WGMMAs as one group (GemmConfig.step_group: one wait per step), each kernel alone beside a stream read of
#           its bytes (docs step 63)
#   gtrace  1 and 8 tokens: the traced stream-K loops with and without step_group (their consumers' time per K128
#           step outside the waits, the quantity that decides the H200's 1-8 token points; docs step 63)
#   tagged  1-8 tokens: ws_auto / ws_auto_pdl against `tg` / `tg_pdl`, the stream-K pieces published without a fence
#           (GemmConfig.tagged_pieces), and `sgtg_pdl` (with step_group) beside `sg_pdl`, each kernel alone beside a
#           stream read of its bytes (docs step 64)
#   ttrace  1 and 8 tokens: the traced stream-K loops with and without tagged_pieces (the pieces' epilogue, the
#           owners' and the CTAs' end spread; docs step 64)
#   stages  1-8 tokens, twice: the stream-K loops (W2 programmatic) with rings of 8, 7, 6, 5 and 4 stages against
#           12 (`sk12p`), and 6 with tagged_pieces or step_group: how deep the ring must be (docs step 65)
#   rings   16-256 tokens, twice: tile_knobs's sets with every ring capped at 6, 5, 4 and 3 stages (max_stages)
#           against ws_auto_pdl (docs step 65)
#   rings16 24-128 tokens, twice: tile_knobs's sets with every ring capped at 4 and 3 stages, for the points at the
#           two-CTA tiles 16 / 24 (the rows' block_n; docs step 65)
#   u8rings 8-32 tokens: the tile-8 unit grid (two CTAs per SM, 6 stages each: tile_knobs's choice where W1's units
#           pass STREAM_K_MAX_WAVES) at 4 and 3 stages per CTA
#   waves   8 tokens at the models' shapes and wider W1s (more units per expert): tile_knobs's choice (the unit grid
#           past STREAM_K_MAX_WAVES waves of W1 units) against the stream-K loops at 6 stages, twice (docs step 65)
#   early   1-8 tokens, twice: the programmatic W2 issuing 2, 4 or all 6 of its first stages' weights before it waits
#           for W1's grid (GemmConfig.w2_early_stages; tile_knobs's W2 issues half its ring, 3) against ws_auto_pdl
#           (docs step 66)
#   strace  1 and 8 tokens: the traced stream-K loops at 12, 6 and 4 stages (first stage, pieces, waits per step)
#   quick   1-8 tokens, twice: ws_auto_pdl (tile_knobs's stream-K loops start quickly since step 69,
#           GemmConfig.quick_start) against `pw`, the same with the plain walk, each kernel alone too, and the pair
#           kernel with W1's quick start (`pairq`, PairConfig.quick_start) against `ws_auto_pair`; then the traced
#           loops at 6 stages with and without it (`qtrace`: the producer's path from its scan to its first copies)
#   split   1-8 tokens, twice: ws_auto_pdl (tile 8 on the "split" nibble order since step 72, GemmConfig.split_nibbles:
#           five instructions per code word instead of seven, conflict-free code loads) against `lane`, the same on the
#           lane order, each kernel alone too, and `ws_auto_pair` against the pair kernel on the lane order
#           (`lanepair`); then the traced loops at 6 stages without and with it (`strace2`: the time per K128 step and
#           its waits; docs step 72)
#   ring8   1-8 tokens, twice: tile_knobs's tile 8 (W2 programmatic) on each card's rule (`h100r`: 6 stages, fenced
#           pieces; `h200r`: 12 stages, the pieces published without a fence) beside the run's card's (ws_auto_pdl),
#           and at 12 stages fenced, 8 and 6 tagged: the H200's tile-8 choice (docs steps 77-78)
#   tmat    1-8 tokens, twice: each card's tile-8 rule (W2 programmatic) with the token tile through a tensor map
#           (`h100t`, `h200t`: GemmConfig.tma_tokens) beside without (`h100r`, `h200r`); then the traced loops of
#           both at 1 and 8 tokens (`tmtrace.json`: the epilogues' times). `python scripts/set_deltas.py
#           tmat-N.json --pairs h100t:h100r,h200t:h200r`
#   dyn     1-8 tokens, twice: each card's tile-8 rule (W2 programmatic) with the last units' K128 steps in chunks the
#           CTAs done with their ranges claim by ticket (`h100d`, `h200d`: GemmConfig.dynamic_tail) beside without
#           (`h100r`, `h200r`). `python scripts/set_deltas.py dyn-N.json --pairs h100d:h100r,h200d:h200r`
#   escl    1-8 tokens, twice: each card's tile-8 rule (W2 programmatic) with a K128 step's scales loaded once after
#           its wait (`h100e`, `h200e`: GemmConfig.early_scales) beside without (`h100r`, `h200r`); then the traced
#           loops of both rules with and without it (`etrace.json`: the consumers' time per step). `python
#           scripts/set_deltas.py escl-N.json --pairs h100e:h100r,h200e:h200r` (docs step 83)
#   amax    1-8 tokens, twice: each card's tile-8 rule (W2 programmatic) with W1's unit epilogue taking its amax per
#           token through shared-memory max reductions into rotating slot sets, one consumer barrier per unit instead
#           of two or three (`h100a`, `h200a`: GemmConfig.amax_slots), with the lean epilogue's loads before the K loop
#           (`h100l`, `h200l`; since step 85 the H100's rule has it, so `h100l` is `h100r` there), both (`h100la`,
#           `h200la`), beside neither (`h100r`, `h200r`); then the traced loops
#           with the lean epilogue with and without the slots (`atrace.json`: the epilogues' times). `python
#           scripts/set_deltas.py amax-N.json --pairs h200a:h200r,h200l:h200r,h200la:h200r,h200la:h200l` (docs step 84)
#   epw     1-8 tokens, twice: each card's tile-8 rule (W2 programmatic) with W1's unit epilogues in a warp of their
#           own, the consumers handing their SwiGLU values over through one shared-memory slot (`h100w`, `h200w`:
#           GemmConfig.epilogue_warp) beside without (`h100r`, `h200r`); then the traced loops of both rules with and
#           without it (`wtrace.json`: the consumers' epilogue times). `python scripts/set_deltas.py epw-N.json --pairs
#           h100w:h100r,h200w:h200r` (docs step 86)
#   lean    1-8 tokens, twice: tile_knobs's tile 8 (W2 programmatic; its ring's bases held warp-uniform and the
#           consumers' waits trying first since step 79, GemmConfig.lean_ring: 130 instructions per K128 step and warp
#           instead of 140) against the same without it (`nolr`), and on each card's rule (`h100r` / `h100nolr`,
#           `h200r` / `h200nolr`); then the traced loops with and without it on both rules (`ltrace`: the consumers'
#           time per step and their waits; docs step 79)
#   cold    1 and 8 tokens: the traced stream-K loops at 6 stages after the flush and right after the same launch
#           (--trace-warm; warm only for shapes below the L2's size), W1's first stage split at its producer's
#           first copies: what W1's first 2.8 us after its scan wait for (docs step 68)
#   probe   one SM's consumer work in parts (kernels/sm90/wgmma_probe.py: the table decode alone, the chain alone and
#           both, at 1 and 4 warpgroups and N = 8-96): how much a scheduler overlaps one warpgroup's decode with another's
#           chain
#   ncu     Nsight Compute of ws_auto at GLM-5.2 T=128 (tile 64): warp stalls per kernel and per SASS line
#   ncu8    the same at DeepSeek-V4.1-Flash T=8 (tile_knobs's tile-8 stream-K W1 and W2 on the run's card): where the
#           consumers of the 1-8 token loops stall, per SASS line (ncu8-summary.txt)
# For GPU runs of at most 10 minutes each: `trace pair` (<= 540 s: the 1-8 token default), `tests ncu` (<= 540 s) and
# `shapes` (<= 420 s: the 64-256 token levers), in that order.
# Needs the cubin cache of every set named here, built offline first (`bash scripts/h200_gemm_unit_costs.sh build`
# on the build machine, no GPU: the bench's --build-only with the same --auto-set / --extra-set) and copied to the GPU machine.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache} GC_MOE_WAIT_TIMEOUT_S=${GC_MOE_WAIT_TIMEOUT_S:-30}
source scripts/steps.sh
steps=${*:-trace pair tests ncu shapes}
BENCH=scripts/bench_grouped_gemm_sm90.py
# tile 8 for the `ring8` step (W2 programmatic): each card's rule (tile_knobs card=, TILE8_STREAM_K: the H100's 6
# stages and fenced pieces, the H200's 12 and tagged) beside the run's own (ws_auto_pdl), 12 stages fenced, 8 and 6 tagged
RING8_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h200r:card='h200',pdl=True"
RING8_SETS="$RING8_SETS --auto-set s12:max_stages=12,tagged_pieces=False,pdl=True"
RING8_SETS="$RING8_SETS --auto-set s8tg:max_stages=8,tagged_pieces=True,pdl=True --auto-set tg6:max_stages=6,tagged_pieces=True,pdl=True"
# the `lean` step: both cards' tile-8 rules without lean_ring; its traced loops (the H200's and the H100's ring and pieces)
LEAN_SETS="--auto-set nolr:lean_ring=False,pdl=True --auto-set h100r:card='h100',pdl=True"
LEAN_SETS="$LEAN_SETS --auto-set h100nolr:card='h100',lean_ring=False,pdl=True --auto-set h200r:card='h200',pdl=True"
LEAN_SETS="$LEAN_SETS --auto-set h200nolr:card='h200',lean_ring=False,pdl=True"
H2T="stream_k=True,ctas_per_sm=1,trace=True,quick_start=True,split_nibbles=True,max_stages=12,tagged_pieces=True"
H1T="stream_k=True,ctas_per_sm=1,trace=True,quick_start=True,split_nibbles=True,max_stages=6"
LEAN_TRACE="--extra-set h2t:$H2T --extra-set h2lt:$H2T,lean_ring=True --extra-set h1t:$H1T --extra-set h1lt:$H1T,lean_ring=True"
# the `tmat` step: each card's tile-8 rule with its token tile through a tensor map (tma_tokens) beside without, and
# the traced loops of both (the epilogues' times are what it is for)
TMAT_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h100t:card='h100',tma_tokens=True,pdl=True"
TMAT_SETS="$TMAT_SETS --auto-set h200r:card='h200',pdl=True --auto-set h200t:card='h200',tma_tokens=True,pdl=True"
TMAT_TRACE="--extra-set h1lt:$H1T,lean_ring=True --extra-set h1tt:$H1T,lean_ring=True,tma_tokens=True"
TMAT_TRACE="$TMAT_TRACE --extra-set h2lt:$H2T,lean_ring=True --extra-set h2tt:$H2T,lean_ring=True,tma_tokens=True"
# the `dyn` step: each card's tile-8 rule with the last units' steps claimed by ticket (dynamic_tail) beside without
DYN_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h100d:card='h100',dynamic_tail=True,pdl=True"
DYN_SETS="$DYN_SETS --auto-set h200r:card='h200',pdl=True --auto-set h200d:card='h200',dynamic_tail=True,pdl=True"
# the `escl` step: each card's tile-8 rule with a step's scales held from its wait (early_scales) beside without, and
# the traced loops of both
ESCL_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h100e:card='h100',early_scales=True,pdl=True"
ESCL_SETS="$ESCL_SETS --auto-set h200r:card='h200',pdl=True --auto-set h200e:card='h200',early_scales=True,pdl=True"
ESCL_TRACE="--extra-set h2lt:$H2T,lean_ring=True --extra-set h2et:$H2T,lean_ring=True,early_scales=True"
ESCL_TRACE="$ESCL_TRACE --extra-set h1lt:$H1T,lean_ring=True --extra-set h1et:$H1T,lean_ring=True,early_scales=True"
# the `amax` step: each card's tile-8 rule with W1's amax in rotating slot sets (amax_slots), with the lean epilogue's
# early loads (lean_epilogue), both, beside neither; the traced loops with the lean epilogue with and without the slots
AMAX_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h100a:card='h100',amax_slots=True,pdl=True"
AMAX_SETS="$AMAX_SETS --auto-set h100l:card='h100',lean_epilogue=True,pdl=True"
AMAX_SETS="$AMAX_SETS --auto-set h100la:card='h100',lean_epilogue=True,amax_slots=True,pdl=True"
AMAX_SETS="$AMAX_SETS --auto-set h200r:card='h200',pdl=True --auto-set h200a:card='h200',amax_slots=True,pdl=True"
AMAX_SETS="$AMAX_SETS --auto-set h200l:card='h200',lean_epilogue=True,pdl=True"
AMAX_SETS="$AMAX_SETS --auto-set h200la:card='h200',lean_epilogue=True,amax_slots=True,pdl=True"
AMAX_TRACE="--extra-set h2lt:$H2T,lean_ring=True,lean_epilogue=True"
AMAX_TRACE="$AMAX_TRACE --extra-set h2at:$H2T,lean_ring=True,lean_epilogue=True,amax_slots=True"
AMAX_TRACE="$AMAX_TRACE --extra-set h1lt:$H1T,lean_ring=True,lean_epilogue=True"
AMAX_TRACE="$AMAX_TRACE --extra-set h1at:$H1T,lean_ring=True,lean_epilogue=True,amax_slots=True"
# the `epw` step: each card's tile-8 rule with W1's unit epilogues in a warp of their own, beside without; traced
EPW_SETS="--auto-set h100r:card='h100',pdl=True --auto-set h100w:card='h100',epilogue_warp=True,pdl=True"
EPW_SETS="$EPW_SETS --auto-set h200r:card='h200',pdl=True --auto-set h200w:card='h200',epilogue_warp=True,pdl=True"
EPW_TRACE="--extra-set h2lt:$H2T,lean_ring=True --extra-set h2wt:$H2T,lean_ring=True,epilogue_warp=True"
EPW_TRACE="$EPW_TRACE --extra-set h1lt:$H1T,lean_ring=True,lean_epilogue=True"
EPW_TRACE="$EPW_TRACE --extra-set h1wt:$H1T,lean_ring=True,lean_epilogue=True,epilogue_warp=True"
AUTO="--auto-set pers:persistent=True --auto-set pers32:persistent=True,two_cta=False"
T8P="t8p:fold_scales=True,table_decode=True,fit_n=True,lean_epilogue=True,persistent=True,max_block_n=8"
HOF="ws_auto_hof:handover=True,words_first=True,pdl=True"
SKT1HF="skt1hf:stream_k=True,ctas_per_sm=1,trace=True,handover=True,words_first=True,pdl=True"
SETS="$AUTO --auto-set lean_pdl:lean_epilogue=True,pdl=True --auto-set ws_auto_ho:handover=True,pdl=True --extra-set $T8P
  --auto-set $HOF --extra-set $SKT1HF
  --extra-set skt1h:stream_k=True,ctas_per_sm=1,trace=True,handover=True,pdl=True
  --extra-set skt1:stream_k=True,ctas_per_sm=1,trace=True
  --extra-set skt1l:stream_k=True,ctas_per_sm=1,trace=True,lean_epilogue=True
  --extra-set skt1p:stream_k=True,ctas_per_sm=1,trace=True,pdl=True"
SHAPES="--shape glm-h3072=glm-5.2:hidden=3072 --shape glm-h1536=glm-5.2:hidden=1536
  --shape glm-i1024=glm-5.2:inter=1024 --shape glm-i512=glm-5.2:inter=512
  --shape ds-h2560=deepseek-v4.1-flash:hidden=2560 --shape ds-i1152=deepseek-v4.1-flash:inter=1152"
MODELS=glm-5.2,glm-h3072,glm-h1536,glm-i1024,glm-i512,deepseek-v4.1-flash,ds-h2560,ds-i1152
for s in $steps; do
  case $s in
    # shellcheck disable=SC2086
    build) run build 1200 python $BENCH --build-only $SETS
           run build-sets 600 python $BENCH --build-only --auto-ctas --pdl --auto-set snake:snake_walk=True \
             --auto-set ratio:scale_ratios=True --auto-set both:snake_walk=True,scale_ratios=True \
             --auto-set tst:transposed_stores=True --auto-set early:early_rows=True \
             --auto-set unit:persistent=False --auto-set ws_auto_pair:pair=True \
             --auto-set ws_auto_pairx:pair=True,words_first=True,publisher_warp=True \
             --auto-set tr:transposed_stores=True,scale_ratios=True \
             --auto-set trs:transposed_stores=True,scale_ratios=True,snake_walk=True --auto-set sg:step_group=True \
             --auto-set t32:two_cta=False --auto-set tg:tagged_pieces=True \
             --auto-set sgtg:step_group=True,tagged_pieces=True \
             --extra-set skt1t:stream_k=True,ctas_per_sm=1,trace=True,tagged_pieces=True \
             --extra-set sk8p:stream_k=True,ctas_per_sm=1,stages=8 --extra-set sk6p:stream_k=True,ctas_per_sm=1,stages=6 \
             --extra-set sk4p:stream_k=True,ctas_per_sm=1,stages=4 --extra-set sk7p:stream_k=True,ctas_per_sm=1,stages=7 \
             --extra-set sk5p:stream_k=True,ctas_per_sm=1,stages=5 \
             --extra-set sg6p:stream_k=True,ctas_per_sm=1,stages=6,step_group=True \
             --auto-set r6:max_stages=6 --auto-set r5:max_stages=5 --auto-set r4:max_stages=4 \
             --auto-set e2:w2_early_stages=2 --auto-set e4:w2_early_stages=4 --auto-set e6:w2_early_stages=6 \
             --auto-set r3:max_stages=3 --extra-set u8:max_block_n=8 --extra-set u8r4:max_block_n=8,max_stages=4 \
             --extra-set u8r3:max_block_n=8,max_stages=3 \
             --extra-set sk6tp:stream_k=True,ctas_per_sm=1,stages=6,tagged_pieces=True \
             --extra-set skt6:stream_k=True,ctas_per_sm=1,trace=True,stages=6 \
             --extra-set skt4:stream_k=True,ctas_per_sm=1,trace=True,stages=4 \
             --auto-set pw:quick_start=False,pdl=True --auto-set pairq:pair=True,quick_start=True \
             --extra-set skq6:stream_k=True,ctas_per_sm=1,trace=True,stages=6,quick_start=True \
             --auto-set lane:split_nibbles=False,pdl=True --auto-set lanepair:pair=True,split_nibbles=False \
             --extra-set sks6:stream_k=True,ctas_per_sm=1,trace=True,stages=6,quick_start=True,split_nibbles=True \
             --tokens 1,2,4,8,16,32,64,128,256
           run build-ring8 600 python $BENCH --build-only --auto-ctas --pdl $RING8_SETS --tokens 1,2,4,8
           run build-lean 600 python $BENCH --build-only --auto-ctas --pdl $LEAN_SETS --tokens 1,2,4,8
           run build-ltrace 600 python $BENCH --build-only $LEAN_TRACE --tokens 1,8
           run build-tmat 600 python $BENCH --build-only --auto-ctas --pdl $TMAT_SETS --tokens 1,2,4,8
           run build-tmtrace 600 python $BENCH --build-only $TMAT_TRACE --tokens 1,8
           run build-dyn 600 python $BENCH --build-only --auto-ctas --pdl $DYN_SETS --tokens 1,2,4,8
           run build-escl 600 python $BENCH --build-only --auto-ctas --pdl $ESCL_SETS --tokens 1,2,4,8
           run build-etrace 600 python $BENCH --build-only $ESCL_TRACE --tokens 1,8
           run build-amax 600 python $BENCH --build-only --auto-ctas --pdl $AMAX_SETS --tokens 1,2,4,8
           run build-atrace 600 python $BENCH --build-only $AMAX_TRACE --tokens 1,8
           run build-epw 600 python $BENCH --build-only --auto-ctas --pdl $EPW_SETS --tokens 1,2,4,8
           run build-wtrace 600 python $BENCH --build-only $EPW_TRACE --tokens 1,8
           run build-probe 120 python scripts/wgmma_probe.py --build-only ;;
    probe) run probe 120 python scripts/wgmma_probe.py --json "$OUT/probe.json"
           TAIL_LINES=16 tail -n 16 "$OUT/probe.log" ;;
    tests) run tests 300 python -m pytest -q -m gpu tests/gc_moe/test_kernels_sm90_grouped_gemm.py \
             -k "lean or programmatic or traced or wide or stream_pair or handover or persistent or snake or ratio \
                 or transposed or early_rows or step_group or tagged or quick_start or split_nibbles" ;;
    # shellcheck disable=SC2086
    shapes) run shapes 420 python $BENCH --check --time --auto-ctas --per-role $AUTO \
             $SHAPES --models $MODELS --tokens 64,128,256 --windows 5 --replays 10 --json "$OUT/unit-costs.json" ;;
    candidates) run candidates 240 python $BENCH --check --time --auto-ctas --auto-set snake:snake_walk=True \
             --auto-set ratio:scale_ratios=True --auto-set both:snake_walk=True,scale_ratios=True \
             --auto-set tst:transposed_stores=True --auto-set early:early_rows=True \
             --tokens 16,32,64,128,256 --windows 5 --replays 10 --json "$OUT/candidates.json" ;;
    combos) for r in 1 2; do  # twice: the 1-3% effects against the run's spread
              run combos$r 240 python $BENCH --check --time --auto-ctas --auto-set tst:transposed_stores=True \
                --auto-set ratio:scale_ratios=True --auto-set tr:transposed_stores=True,scale_ratios=True \
                --auto-set trs:transposed_stores=True,scale_ratios=True,snake_walk=True --auto-set snake:snake_walk=True \
                --tokens 64,128,256 --windows 5 --replays 10 --json "$OUT/combos$r.json"
            done ;;
    group) run group 240 python $BENCH --check --time --auto-ctas --pdl --per-role --read-ref \
             --auto-set sg:step_group=True --auto-set sg_pdl:step_group=True,pdl=True \
             --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/group.json" ;;
    gtrace) run gtrace 200 python $BENCH --check --time --per-role --trace \
              --extra-set skt1:stream_k=True,ctas_per_sm=1,trace=True \
              --extra-set skt1g:stream_k=True,ctas_per_sm=1,trace=True,step_group=True \
              --tokens 1,8 --windows 3 --replays 10 --json "$OUT/gtrace.json" ;;
    tagged) run tagged 240 python $BENCH --check --time --auto-ctas --pdl --per-role --read-ref \
              --auto-set tg:tagged_pieces=True --auto-set tg_pdl:tagged_pieces=True,pdl=True \
              --auto-set sg_pdl:step_group=True,pdl=True --auto-set sgtg_pdl:step_group=True,tagged_pieces=True,pdl=True \
              --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/tagged.json" ;;
    ttrace) run ttrace 200 python $BENCH --check --time --per-role --trace \
              --extra-set skt1:stream_k=True,ctas_per_sm=1,trace=True \
              --extra-set skt1t:stream_k=True,ctas_per_sm=1,trace=True,tagged_pieces=True \
              --tokens 1,8 --windows 3 --replays 10 --json "$OUT/ttrace.json" ;;
    stages) for r in 1 2; do  # twice: the 1-3 us effects against the run's spread
              run stages$r 240 python $BENCH --check --time --per-role \
                --extra-set sk12p:stream_k=True,ctas_per_sm=1,pdl=True \
                --extra-set sk8p:stream_k=True,ctas_per_sm=1,stages=8,pdl=True \
                --extra-set sk7p:stream_k=True,ctas_per_sm=1,stages=7,pdl=True \
                --extra-set sk6p:stream_k=True,ctas_per_sm=1,stages=6,pdl=True \
                --extra-set sk5p:stream_k=True,ctas_per_sm=1,stages=5,pdl=True \
                --extra-set sk4p:stream_k=True,ctas_per_sm=1,stages=4,pdl=True \
                --extra-set sk6tp:stream_k=True,ctas_per_sm=1,stages=6,tagged_pieces=True,pdl=True \
                --extra-set sg6p:stream_k=True,ctas_per_sm=1,stages=6,step_group=True,pdl=True \
                --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/stages$r.json"
            done ;;
    rings) for r in 1 2; do  # every tile's ring capped (GemmConfig stages; tiles 16 / 24 hold 5 at two CTAs per SM)
             run rings$r 300 python $BENCH --check --time --auto-ctas --pdl \
               --auto-set r6:max_stages=6,pdl=True --auto-set r5:max_stages=5,pdl=True \
               --auto-set r4:max_stages=4,pdl=True --auto-set r3:max_stages=3,pdl=True \
               --tokens 16,32,64,128,256 --windows 5 --replays 10 --json "$OUT/rings$r.json"
           done ;;
    rings16) for r in 1 2; do  # the two-CTA tiles 16 / 24 (5 stages each) at 4 and 3: the points that land there
               run rings16-$r 300 python $BENCH --check --time --auto-ctas --pdl \
                 --auto-set r4:max_stages=4,pdl=True --auto-set r3:max_stages=3,pdl=True \
                 --tokens 24,32,40,48,64,80,96,128 --windows 5 --replays 10 --json "$OUT/rings16-$r.json"
             done ;;
    u8rings) run u8rings 240 python $BENCH --check --time --pdl --extra-set u8:max_block_n=8 \
               --extra-set u8r4:max_block_n=8,max_stages=4 --extra-set u8r3:max_block_n=8,max_stages=3 \
               --tokens 8,16,32 --windows 5 --replays 10 --json "$OUT/u8rings.json" ;;
    waves) for r in 1 2; do  # tile 8 past STREAM_K_MAX_WAVES: tile_knobs's unit grid against the stream-K loops
             run waves$r 240 python $BENCH --check --time --pdl \
               --extra-set sk6p:stream_k=True,ctas_per_sm=1,stages=6,pdl=True \
               --shape ds-i2816=deepseek-v4.1-flash:inter=2816 --shape glm-i2560=glm-5.2:inter=2560 \
               --shape glm-i3072=glm-5.2:inter=3072 \
               --models deepseek-v4.1-flash,ds-i2816,glm-5.2,glm-i2560,glm-i3072 --tokens 8 --windows 5 --replays 10 \
               --json "$OUT/waves$r.json"
           done ;;
    early) for r in 1 2; do  # the programmatic W2's weights issued before W1's grid completes
             run early$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role \
               --auto-set e2:w2_early_stages=2,pdl=True --auto-set e4:w2_early_stages=4,pdl=True \
               --auto-set e6:w2_early_stages=6,pdl=True \
               --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/early$r.json"
           done ;;
    strace) run strace 200 python $BENCH --check --time --per-role --trace \
              --extra-set skt1:stream_k=True,ctas_per_sm=1,trace=True \
              --extra-set skt6:stream_k=True,ctas_per_sm=1,trace=True,stages=6 \
              --extra-set skt4:stream_k=True,ctas_per_sm=1,trace=True,stages=4 \
              --tokens 1,8 --windows 3 --replays 10 --json "$OUT/strace.json" ;;
    quick) for r in 1 2; do  # tile_knobs's default (the quick start) against the plain walk, W2 programmatic
             run quick$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role \
               --auto-set pw:quick_start=False,pdl=True --auto-set ws_auto_pair:pair=True \
               --auto-set pairq:pair=True,quick_start=True --tokens 1,2,4,8 --windows 5 --replays 10 \
               --json "$OUT/quick$r.json"
           done
           run qtrace 200 python $BENCH --check --time --per-role --trace \
             --extra-set skt6:stream_k=True,ctas_per_sm=1,trace=True,stages=6 \
             --extra-set skq6:stream_k=True,ctas_per_sm=1,trace=True,stages=6,quick_start=True \
             --tokens 1,8 --windows 3 --replays 10 --json "$OUT/qtrace.json" ;;
    # shellcheck disable=SC2086
    ring8) for r in 1 2; do  # the H200's tile-8 ring and pieces (docs step 77)
             run ring8-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $RING8_SETS \
               --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/ring8-$r.json"
           done ;;
    lean) for r in 1 2; do  # the ring's bases warp-uniform, the waits trying first (docs step 79)
            run lean-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $LEAN_SETS \
              --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/lean-$r.json"
          done
          run ltrace 200 python $BENCH --check --time --per-role --trace $LEAN_TRACE \
            --tokens 1,8 --windows 3 --replays 10 --json "$OUT/ltrace.json" ;;
    # shellcheck disable=SC2086
    tmat) for r in 1 2; do  # the token tile through a tensor map (docs step 80)
            run tmat-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $TMAT_SETS \
              --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/tmat-$r.json"
          done
          run tmtrace 200 python $BENCH --check --time --per-role --trace $TMAT_TRACE \
            --tokens 1,8 --windows 3 --replays 10 --json "$OUT/tmtrace.json" ;;
    dyn) for r in 1 2; do  # the last units' steps in chunks claimed by ticket (docs step 81)
           run dyn-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $DYN_SETS \
             --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/dyn-$r.json"
         done ;;
    # shellcheck disable=SC2086
    escl) for r in 1 2; do  # a step's scales loaded once after its wait (docs step 83)
            run escl-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $ESCL_SETS \
              --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/escl-$r.json"
          done
          run etrace 200 python $BENCH --check --time --per-role --trace $ESCL_TRACE \
            --tokens 1,8 --windows 3 --replays 10 --json "$OUT/etrace.json" ;;
    # shellcheck disable=SC2086
    amax) for r in 1 2; do  # W1's amax in rotating slot sets, the lean epilogue's early loads (docs step 84)
            run amax-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $AMAX_SETS \
              --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/amax-$r.json"
          done
          run atrace 200 python $BENCH --check --time --per-role --trace $AMAX_TRACE \
            --tokens 1,8 --windows 3 --replays 10 --json "$OUT/atrace.json" ;;
    # shellcheck disable=SC2086
    epw) for r in 1 2; do  # W1's unit epilogues in a warp of their own (docs step 86)
           run epw-$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role $EPW_SETS \
             --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/epw-$r.json"
         done
         run wtrace 200 python $BENCH --check --time --per-role --trace $EPW_TRACE \
           --tokens 1,8 --windows 3 --replays 10 --json "$OUT/wtrace.json" ;;
    # shellcheck disable=SC2086
    split) for r in 1 2; do  # tile 8 on the split nibble order (17 fewer instructions per step) against the lane one
             run split$r 240 python $BENCH --check --time --auto-ctas --pdl --per-role \
               --auto-set lane:split_nibbles=False,pdl=True --auto-set ws_auto_pair:pair=True \
               --auto-set lanepair:pair=True,split_nibbles=False --tokens 1,2,4,8 --windows 5 --replays 10 \
               --json "$OUT/split$r.json"
           done
           run strace2 200 python $BENCH --check --time --per-role --trace \
             --extra-set skq6:stream_k=True,ctas_per_sm=1,trace=True,stages=6,quick_start=True \
             --extra-set sks6:stream_k=True,ctas_per_sm=1,trace=True,stages=6,quick_start=True,split_nibbles=True \
             --tokens 1,8 --windows 3 --replays 10 --json "$OUT/strace2.json" ;;
    cold) run cold 200 python $BENCH --check --time --per-role --trace --trace-warm \
            --extra-set skt6:stream_k=True,ctas_per_sm=1,trace=True,stages=6 \
            --tokens 1,8 --windows 3 --replays 10 --json "$OUT/cold.json" ;;
    reads) run reads 240 python $BENCH --check --time --auto-ctas --pdl --per-role --read-ref \
             --auto-set ws_auto_pair:pair=True --tokens 1,2,4,8,64,256 --windows 5 --replays 10 --json "$OUT/reads.json" ;;
    table) run table 300 python $BENCH --check --time --auto-ctas --pdl --auto-set unit:persistent=False \
             --auto-set snake:snake_walk=True --auto-set ratio:scale_ratios=True --auto-set t32:two_cta=False \
             --auto-set ws_auto_pair:pair=True --auto-set ws_auto_pairx:pair=True,words_first=True,publisher_warp=True \
             --tokens 1,2,4,8,16,32,64,128,256 --windows 5 --replays 10 --read-ref --json "$OUT/table.json" ;;
    ncu) run ncu 240 ncu --clock-control none -k regex:kernel_cutlass --launch-skip 10 --launch-count 2 --set full \
           -f -o "$OUT/glm128" python $BENCH --profile --auto-ctas --models glm-5.2 --tokens 128
         # one summary file (what comes back from a GPU run is limited in file count): kernels, then each one's lines
         { python scripts/ncu_stall_summary.py "$OUT/glm128.ncu-rep"
           python scripts/ncu_stall_summary.py "$OUT/glm128.ncu-rep" --source 0 | grep -v '^\['
           python scripts/ncu_stall_summary.py "$OUT/glm128.ncu-rep" --source 1 | grep -v '^\['; } \
           > "$OUT/ncu-summary.txt" 2>&1
         head -c 1200 "$OUT/ncu-summary.txt" ;;
    # shellcheck disable=SC2046
    ncu8) run ncu8 240 ncu --clock-control none -k regex:kernel_cutlass --launch-skip 10 --launch-count 2 --set full \
           -f -o "$OUT/ds8" python $BENCH --profile --auto-ctas --models deepseek-v4.1-flash --tokens 8
         { python scripts/ncu_stall_summary.py "$OUT/ds8.ncu-rep"
           python scripts/ncu_stall_summary.py "$OUT/ds8.ncu-rep" --source 0 --lines 45 | grep -v '^\['
           python scripts/ncu_stall_summary.py "$OUT/ds8.ncu-rep" --source 1 --lines 45 | grep -v '^\['; } \
           > "$OUT/ncu8-summary.txt" 2>&1
         head -c 1200 "$OUT/ncu8-summary.txt" ;;
    pair) run pair 240 python $BENCH --check --time --auto-ctas --pdl --pair \
            --auto-set lean_pdl:lean_epilogue=True,pdl=True --auto-set ws_auto_pair:pair=True \
            --auto-set ws_auto_ho:handover=True,pdl=True --auto-set "$HOF" --extra-set "$T8P" \
            --auto-set ws_auto_pairx:pair=True,words_first=True,publisher_warp=True \
            $([ -s "$OUT/sm-rates.json" ] && echo --sm-weights "$OUT/sm-rates.json") \
            --tokens 1,2,4,8 --windows 5 --replays 10 --json "$OUT/pair.json" ;;
    trace) run trace 300 python $BENCH --check --time --auto-ctas --pdl --pair --per-role --trace \
             --extra-set skt1:stream_k=True,ctas_per_sm=1,trace=True \
             --extra-set skt1l:stream_k=True,ctas_per_sm=1,trace=True,lean_epilogue=True \
             --extra-set skt1p:stream_k=True,ctas_per_sm=1,trace=True,pdl=True \
             --extra-set skt1h:stream_k=True,ctas_per_sm=1,trace=True,handover=True,pdl=True \
             --extra-set "$SKT1HF" \
             --tokens 1,8 --windows 5 --replays 10 --json "$OUT/trace.json"
           # each SM's rate for the pair step's pair_w (run `trace pair` in one call)
           python scripts/analyze_unit_costs.py weights "$OUT/trace.json" > "$OUT/sm-rates.json" 2>&1 \
             || rm -f "$OUT/sm-rates.json" ;;
    *) echo "unknown step $s (build, tests, pair, shapes, candidates, combos, table, probe, trace, ncu, group, gtrace,"\
            "tagged, ttrace, stages, rings, rings16, u8rings, waves, early, strace, reads, split, quick, cold, ring8, lean,"\
            "tmat, dyn, escl, amax, epw, ncu8)"
       exit 2 ;;
  esac
done
if [ -f "$OUT/unit-costs.json" ]; then
  python - "$OUT/unit-costs.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"read bandwidth {d['read_bw_bytes_per_s'] / 1e12:.2f} TB/s; per set: cold us (W1 / W2 alone)")
points = {}
for r in d["rows"]:
    if r["tag"] in ("ws_auto", "lean", "wide", "wide_lean"):
        points.setdefault((r["model"], r["tokens"]), {})[r["tag"]] = r
for (model, tokens), sets in points.items():
    cells = [f"{t} {r['cold_us']:.1f} ({r.get('w1_cold_us', 0):.1f} / {r.get('w2_cold_us', 0):.1f})"
             + ("" if r.get("ok", True) else " FAILED") for t, r in sets.items()]
    any_row = next(iter(sets.values()))
    print(f"{model:20s} T={tokens:3d} bn {any_row['block_n']:2d} floor {any_row['floor_us']:6.1f}  " + "  ".join(cells))
PY
fi
for f in "$OUT/pair.json" "$OUT/trace.json"; do
  [ -f "$f" ] || continue
  python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]}: cold us at 1-8 tokens; the traced pair's hand-over (us, median / max)")
for r in d["rows"]:
    if r["tag"] in ("ws_auto", "ws_auto_pdl", "lean_pdl", "ws_auto_ho", "ws_auto_hof", "ws_auto_pair",
                    "ws_auto_pairx", "pair", "pair_lean", "pair_wf", "pair_pub", "pair_pubwf", "pair_w", "t8p"):
        print(f"{r['model']:20s} T={r['tokens']} {r['tag']:12s} {r.get('cold_us', 0):6.1f} floor {r.get('floor_us', 0):6.1f}")
    w2 = (r.get("trace") or {}).get("w2")
    if w2:  # a traced W2: its segment switches' waits (median / max), end spread and span; W1's epilogues, span
        w1 = r["trace"]["w1"]
        print(f"{r['model']:20s} T={r['tokens']} {r['tag']:12s} W2 switch wait {w2['switch_wait_us']} end spread "
              f"{w2['end_spread_us']} span {w2['span_us']}; W1 epilogue whole {w1['epilogue_whole_us']} owner "
              f"{w1['epilogue_owner_us']} span {w1['span_us']}")
    p = r.get("pair_trace")
    if p:
        print(f"{r['model']:20s} T={r['tokens']} pair: W1 ends {p['w1_first_end_us']}-{p['w1_last_end_us']}, W2 start "
              f"after own SM {p['w2_start_after_own_sm_w1_us']}, wait done {p['w2_wait_done_after_w1_us']}, first stage "
              f"{p['w2_first_stage_after_w1_us']} after W1, W2 end spread {p['w2_end_spread_us']}, span {p['span_us']}")
PY
done
# the two questions: per-unit or per-step (fit), static or random late SMs and the pair's hand-over (spread)
# (from the step's log when its time bound cut it short before the JSON was written)
for pair in "shapes unit-costs fit" "trace trace spread"; do
  # shellcheck disable=SC2086
  set -- $pair
  src="$OUT/$2.json"; [ -f "$src" ] || src="$OUT/$1.log"
  [ -f "$src" ] && python scripts/analyze_unit_costs.py "$3" "$src" > "$OUT/$3.txt" 2>&1
done
for f in "$OUT/fit.txt" "$OUT/spread.txt"; do [ -f "$f" ] && cut -c1-230 "$f" | head -40; done
print_steps
