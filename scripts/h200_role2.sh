#!/usr/bin/env bash
# The fused role2 kernel on the H200: the layer's GPU tests (fused against W1 and W2 nodes bit for bit, the
# float32 reference, 1,000 graph replays), the backend check through the public API (points, 1,000 replays
# each, 100,000 replays of one point, latency per call) with role2 as the fused kernel at every token count
# (GC_MOE_ROLE2_NODES=1; `bn32`: the same with the fused kernel's token tile fixed at 32, GC_MOE_ROLE2_BLOCK_N;
# `ctas2`: the same without the 100,000-replay point (two fused-kernel CTAs per SM at bn 8 from 2 tokens, the
# default, named: GC_MOE_ROLE2_CTAS_PER_SM=2); `ctas1`: one fused CTA per SM at every tile),
# and the latency with role2 as W1 and W2 nodes (GC_MOE_ROLE2_NODES=2) beside it. The
# role4 steps check the shared suite through the public API with the shared expert as one fused kernel
# (GC_MOE_ROLE4_FUSED=1) and time it (`role4`), and time it as W1 and W2 nodes (`role4off`). `parts` splits
# the default layer's time by differences (as built, role2 after dispatch, without role2); `orders` times the
# shared layer with role4 beside, before and after role2 (fused and as nodes) and role4 alone. TESTS names the
# GPU test files. Logs and JSON under OUT; a short table last.
#
#   OUT=<logs> bash scripts/h200_role2.sh [tests] [backend] [bn32] [ctas2] [ctas1] [nodes2] [role4] [role4off] [parts] [orders]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-role2-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache} GC_MOE_WAIT_TIMEOUT_S=${GC_MOE_WAIT_TIMEOUT_S:-30}
steps=${*:-tests backend nodes2}
source scripts/steps.sh
for s in $steps; do
  case $s in
    tests) run tests "${TESTS_LIMIT:-220}" python -m pytest -q -x -m gpu -p no:cacheprovider \
             ${TESTS:-tests/gc_moe/test_sm90_layer_gpu.py} ;;
    backend) run backend "${BACKEND_LIMIT:-260}" env GC_MOE_ROLE2_NODES=1 python scripts/device_layer_backend.py \
               --skip "${BACKEND_SKIP:-bounded}" --out "$OUT/backend" ;;
    bn32) run bn32 "${BACKEND_LIMIT:-260}" env GC_MOE_ROLE2_NODES=1 GC_MOE_ROLE2_BLOCK_N=32 python \
            scripts/device_layer_backend.py --skip "${BACKEND_SKIP:-bounded}" --out "$OUT/bn32" ;;
    ctas2) run ctas2 "${BACKEND_LIMIT:-260}" env GC_MOE_ROLE2_NODES=1 GC_MOE_ROLE2_CTAS_PER_SM=2 python \
             scripts/device_layer_backend.py --skip "${BACKEND_SKIP:-bounded,long}" --out "$OUT/ctas2" ;;
    ctas1) run ctas1 "${BACKEND_LIMIT:-260}" env GC_MOE_ROLE2_NODES=1 GC_MOE_ROLE2_CTAS_PER_SM=1 python \
             scripts/device_layer_backend.py --skip "${BACKEND_SKIP:-bounded,long}" --out "$OUT/ctas1" ;;
    nodes2) run nodes2 "${NODES2_LIMIT:-100}" env GC_MOE_ROLE2_NODES=2 python scripts/device_layer_backend.py \
              --skip points,shared,long,bounded --out "$OUT/nodes2" ;;
    role4) run role4 "${ROLE4_LIMIT:-200}" env GC_MOE_ROLE4_FUSED=1 python scripts/device_layer_backend.py \
             --skip long,bounded --replays "${ROLE4_REPLAYS:-300}" \
             --latency-tokens 1,8,64,256 --out "$OUT/role4" ;;
    role4off) run role4off "${ROLE4_LIMIT:-200}" env GC_MOE_ROLE4_FUSED=0 python scripts/device_layer_backend.py \
                --skip points,long,bounded \
                --latency-tokens 1,8,64,256 --out "$OUT/role4off" ;;
    parts) run parts "${PARTS_LIMIT:-150}" python scripts/device_layer_backend.py \
             --skip points,shared,long,bounded,latency --parts-tokens "${PARTS_TOKENS:-1,2,4,8,16,32,64,128,256}" \
             --out "$OUT/parts" ;;
    orders) run orders "${ORDERS_LIMIT:-200}" python scripts/device_layer_backend.py \
              --skip points,long,bounded,latency --orders-tokens "${ORDERS_TOKENS:-1,2,4,8,16,32,64,128,256}" \
              --out "$OUT/orders" ;;
    *) echo "unknown step $s (allowed: tests backend bn32 ctas2 ctas1 nodes2 role4 role4off parts orders)"; exit 2 ;;
  esac
done
print_steps
