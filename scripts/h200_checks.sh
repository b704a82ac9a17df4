#!/usr/bin/env bash
# One batched H200 call: every step bounded by its own timeout, logs under $OUT (default ./device-out),
# a short table last. Steps are named on the command line (default: all, in this order):
#   gemm     grouped GEMM bench: SASS, correctness, timing, default vs folded scales
#   layer    roles 1-3 as one graph at P=1 (stand-in and kernel role2), 1,000 replays
#   gputests every GPU-marked pytest test
#   deepgemm sgl-deep-gemm wheels under .whl/dg*/ (with .whl/tvm/): import, then the adapter's GPU tests
#   p2       P = 2 on the one GPU as two processes (scripts/device_layer_p2.py; P2_SHAPES, default small)
#   portshared  the port's shared suite: its GPU tests with the shared-expert kernel, the device check --shared
#   accuracy the 47-case suite with gc, gc-unfused and mega-port (ACC_MODELS, ACC_CASES narrow it), into $OUT
# Needs the cubin cache (.cubin-cache, built offline: scripts/bench_grouped_gemm_sm90.py --build-only and
# `gcmoe-bench build --arch sm_90a --profile h200`) carried along.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
export PYTHONUNBUFFERED=1  # a step stopped by its timeout still leaves its output in the log
steps=${*:-gemm layer gputests deepgemm}
declare -A RC SECS

step() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.log"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?; SECS[$name]=$(( $(date +%s) - t0 ))
  tail -n 25 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
for s in $steps; do
  case $s in
    gemm) step gemm "${GEMM_LIMIT:-150}" python scripts/bench_grouped_gemm_sm90.py --sass --check --time --fold-scales \
            --tokens "${GEMM_TOKENS:-1,4,16,64,128,256}" --windows 3 --replays 10 --json "$OUT/gemm.json" ;;
    layer) step layer "${LAYER_LIMIT:-100}" python scripts/device_layer_proof.py --replays "${LAYER_REPLAYS:-1000}" \
            --role2 both --out "$OUT/layer" ;;
    gputests) step gputests "${TESTS_LIMIT:-180}" python -m pytest -q -m gpu -p no:cacheprovider \
            --junitxml="$OUT/gputests.xml" tests ;;
    deepgemm)
      for d in .whl/dg*/; do
        v=$(basename "$d"); site=/tmp/site-$v
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$d"/*.whl .whl/tvm/*.whl > "$OUT/$v-install.log" 2>&1
        PYTHONPATH="$site:$PYTHONPATH" step "$v" "${DG_LIMIT:-120}" bash -c \
          'python -c "import deep_gemm, torch; print(deep_gemm.__file__, getattr(deep_gemm, \"__version__\", \"?\"))" && python -m pytest -q -m gpu -p no:cacheprovider tests/baselines'
      done ;;
    p2) step p2 "${P2_LIMIT:-360}" env TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
          GC_MOE_WAIT_TIMEOUT_S="${P2_WAIT:-60}" python -m torch.distributed.run --standalone --nproc-per-node 2 \
          scripts/device_layer_p2.py \
          --shapes "${P2_SHAPES:-small}" --tokens "${P2_TOKENS:-1,8,64}" --replays "${P2_REPLAYS:-200}" --out "$OUT/p2.json" ;;
    portshared) step portshared "${PORT_LIMIT:-240}" bash -c 'python -m pytest -q -m gpu -p no:cacheprovider -k shared \
          tests/baselines/test_mega_port_sm90.py && python -m baselines.mega_moe.port_sm90.device_check \
          --tokens 1,8,64,256 --shared --json "$0/port_shared.json"' "$OUT" ;;
    accuracy) step accuracy "${ACC_LIMIT:-540}" python -m gcmoe_bench accuracy --gpu h200 \
          --operators "${ACC_OPERATORS:-gc,gc-unfused,mega-port}" ${ACC_MODELS:+--models "$ACC_MODELS"} \
          ${ACC_CASES:+--cases "$ACC_CASES"} --out "$OUT" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
echo; printf '%-12s %5s %6s\n' step rc seconds
for s in "${!RC[@]}"; do printf '%-12s %5s %6s\n' "$s" "${RC[$s]}" "${SECS[$s]}"; done
