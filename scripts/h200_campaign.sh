#!/usr/bin/env bash
# The H200 campaign in bounded steps, for one GPU: the full sweep (both models' per-rank slices, routed and
# shared suites, the paper's protocol with the idle gate on), the 47-case accuracy suite, the two ablations
# (dispatch partition size, overlap on/off) and the P = 2 protocol check on one GPU.
#
#   OUT=<logs> RESULTS=<results root> bash scripts/h200_campaign.sh [sweep] [accuracy] [ablation] [p2] [gputests]
#
# Every sweep writes a new RESULTS/h200/<run-id>/ (never overwritten). `accuracy` writes into the newest sweep
# run of RESULTS/h200 (or ACCURACY_INTO). Logs go to OUT; at the end RESULTS/h200 and the logs are packed into
# OUT/results.tgz and OUT/logs.tgz, and a short table of the steps is printed last.
# Needs the cubin cache (.cubin-cache, built offline with `gcmoe-bench build --arch sm_90a --profile h200`).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-campaign-out}; RESULTS=${RESULTS:-results}; mkdir -p "$OUT/logs" "$RESULTS"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
steps=${*:-sweep accuracy ablation p2}
ABLATION_TOKENS=${ABLATION_TOKENS:-1,8,64,256}
ABLATION_REQUESTS=${ABLATION_REQUESTS:-2 4 8 16 32}
# the ablations compare settings with each other: fewer windows than the sweep (recorded in env.json)
ABLATION_PROTOCOL=${ABLATION_PROTOCOL:---warmup 3 --windows 10}
DEADLINE_S=${DEADLINE_S:-570}  # the whole script: a step is cut to what is left, and skipped under 30 s
START=$(date +%s)
declare -a NAMES RCS SECS

pack() {  # after every step, so a cut-off call still brings back what finished
  [ -d "$RESULTS/h200" ] && tar czf "$OUT/results.tgz" -C "$RESULTS" h200 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$OUT" logs
}

step() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  local left=$(( DEADLINE_S - (t0 - START) - 15 ))
  if [ "$left" -lt 30 ]; then
    echo "=== $name skipped: ${left}s left of DEADLINE_S=$DEADLINE_S"; NAMES+=("$name"); RCS+=("skip"); SECS+=(0); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  NAMES+=("$name"); RCS+=("$rc"); SECS+=("$(( $(date +%s) - t0 ))")
  tail -n 8 "$OUT/logs/$name.log"
  pack
}

newest_run() { ls -1d "$RESULTS"/h200/2*/ 2>/dev/null | sort | tail -n 1; }  # run ids only (not report/, ablation/)

nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$OUT/logs/gpu.txt" 2>&1
for s in $steps; do
  case $s in
    sweep)
      step sweep "${SWEEP_LIMIT:-560}" torchrun --nproc-per-node 1 -m gcmoe_bench sweep --gpu h200 --out "$RESULTS" ;;
    accuracy)
      into=${ACCURACY_INTO:-$(newest_run)}
      step accuracy "${ACCURACY_LIMIT:-420}" torchrun --nproc-per-node 1 -m gcmoe_bench accuracy --gpu h200 \
        --operators "${ACCURACY_OPERATORS:-gc,gc-unfused,mega-port}" ${ACCURACY_MODELS:+--models "$ACCURACY_MODELS"} --into "$into" ;;
    ablation)
      for r in $ABLATION_REQUESTS; do
        step "partition-$r" "${ABLATION_LIMIT:-150}" torchrun --nproc-per-node 1 -m gcmoe_bench sweep --gpu h200 \
          --suite routed --operators gc --tokens "$ABLATION_TOKENS" --dispatch-sms "$r" $ABLATION_PROTOCOL --out "$RESULTS"
      done
      step overlap-off "${ABLATION_LIMIT:-150}" torchrun --nproc-per-node 1 -m gcmoe_bench sweep --gpu h200 \
        --suite routed --operators gc --tokens "$ABLATION_TOKENS" --overlap off $ABLATION_PROTOCOL --out "$RESULTS" ;;
    p2)
      step p2 "${P2_LIMIT:-240}" env TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 GC_MOE_WAIT_TIMEOUT_S=60 \
        torchrun --nproc-per-node 2 scripts/device_layer_p2.py --out "$OUT/logs/p2.json" ;;
    gputests)
      step gputests "${TESTS_LIMIT:-300}" python -m pytest -q -m gpu -p no:cacheprovider ${GPUTESTS:-tests} ;;
    *) echo "unknown step $s (allowed: sweep accuracy ablation p2 gputests)"; exit 2 ;;
  esac
done
pack
echo; printf '%-14s %5s %7s\n' step rc seconds
for i in "${!NAMES[@]}"; do printf '%-14s %5s %7s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"; done
