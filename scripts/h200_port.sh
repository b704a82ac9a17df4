#!/usr/bin/env bash
# The SM90 Mega MoE port on the H200, both pipelines (cp_async, ws): its GPU tests (both pipelines against the
# float32 reference, graph replays bit-equal), then `device_check` per pipeline (correctness at CHECK_TOKENS and
# the cold latency against the bandwidth floor at TIME_TOKENS). Logs and JSON under OUT; a short table last.
#
#   OUT=<logs> bash scripts/h200_port.sh [tests] [cp_async] [ws]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-port-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
CHECK_TOKENS=${CHECK_TOKENS:-1,8,64,256}
TIME_TOKENS=${TIME_TOKENS:-1,2,4,8,16,32,64,128,256}
steps=${*:-tests cp_async ws}
TAIL_LINES=24
source scripts/steps.sh
for s in $steps; do
  case $s in
    tests) run tests "${TESTS_LIMIT:-240}" python -m pytest -q -x -m gpu -p no:cacheprovider \
             tests/baselines/test_mega_port_sm90.py ;;
    cp_async|ws) run "$s" "${CHECK_LIMIT:-200}" env GCMOE_MEGA_PORT_PIPELINE="$s" python -m \
                   baselines.mega_moe.port_sm90.device_check --tokens "$CHECK_TOKENS" --time "$TIME_TOKENS" \
                   --repeats 10 --json "$OUT/$s.json" ;;
    *) echo "unknown step $s (allowed: tests cp_async ws)"; exit 2 ;;
  esac
done
print_steps
