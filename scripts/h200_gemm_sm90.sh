#!/usr/bin/env bash
# The SM90 grouped GEMM's device checks in one bounded call (logs under $OUT, default ./device-out):
#   tests   the GPU-marked tests of tests/gc_moe/test_kernels_sm90_grouped_gemm.py (every pipeline, bn, k)
#   bench   scripts/bench_grouped_gemm_sm90.py --sass --check --time, default variants beside the cp.async
#           pipeline (--baseline), token tiles up to bn 32 ($GEMM_TOKENS, $GEMM_ARGS add options)
#   bench2  the default set with two producer warps (separate process: tag ws_p2)
#   bench64 the same default set with token tiles up to bn 64 at $GEMM64_TOKENS (time only)
# Needs the cubin cache built offline (python scripts/bench_grouped_gemm_sm90.py --build-only) copied to the GPU machine.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
steps=${*:-tests bench bench64}
declare -A RC SECS

step() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?; SECS[$name]=$(( $(date +%s) - t0 ))
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for s in $steps; do
  case $s in
    tests) step tests "${TESTS_LIMIT:-120}" python -m pytest -q -m gpu -p no:cacheprovider -rf \
             tests/gc_moe/test_kernels_sm90_grouped_gemm.py ;;
    bench) step bench "${BENCH_LIMIT:-150}" python scripts/bench_grouped_gemm_sm90.py --sass --check --time --baseline \
             --tokens "${GEMM_TOKENS:-1,4,16,64,128,256}" --windows 3 --replays 10 --json "$OUT/gemm.json" ${GEMM_ARGS:-} ;;
    bench2) step bench2 "${BENCH2_LIMIT:-90}" python scripts/bench_grouped_gemm_sm90.py --check --time --producer-warps 2 \
             --tag ws_p2 --tokens "${GEMM_TOKENS:-1,4,16,64,128,256}" --windows 3 --replays 10 --json "$OUT/gemm_p2.json" ;;
    bench64) step bench64 "${BENCH64_LIMIT:-60}" python scripts/bench_grouped_gemm_sm90.py --time --max-block-n 64 \
             --tokens "${GEMM64_TOKENS:-64,128,256}" --windows 3 --replays 10 --json "$OUT/gemm64.json" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
for s in $steps; do
  echo "--- $s: rc ${RC[$s]} in ${SECS[$s]} s"; grep -v "^sm90.grouped_gemm\[" "$OUT/$s.log" | tail -n 40
done
