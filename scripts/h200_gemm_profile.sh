#!/usr/bin/env bash
# Nsight Compute profile of the SM90 grouped GEMM (W1 and W2 of one point, the second eager launch) at a few
# points, in one bounded device call. Per point: the full section set, the details page as text and the SASS
# source page (per-instruction stall samples) as CSV; everything packed into $OUT/prof.tgz.
#   PROFILE_POINTS="deepseek-v4.1-flash:16 glm-5.2:1"  (model:tokens per rank; default below)
#   PROFILE_ARGS="--one-cta"                            (extra bench options: which variant set runs)
# Needs the cubin cache built offline (python scripts/bench_grouped_gemm_sm90.py --build-only) carried along.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT/prof"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
POINTS=${PROFILE_POINTS:-deepseek-v4.1-flash:16 deepseek-v4.1-flash:64 deepseek-v4.1-flash:256 glm-5.2:1}
NCU=${NCU:-ncu}
for p in $POINTS; do
  m=${p%%:*}; t=${p##*:}; name="$m-T$t${PROFILE_TAG:+-$PROFILE_TAG}"
  echo "=== $name"
  # every kernel of ours is named kernel_cutlass_kernel_*; torch's set-up kernels are not profiled
  timeout 240 "$NCU" --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 2 --set full \
    -f -o "$OUT/prof/$name" python scripts/bench_grouped_gemm_sm90.py --profile --models "$m" --tokens "$t" \
    ${PROFILE_ARGS:-} --json "$OUT/prof/$name.json" > "$OUT/prof/$name.log" 2>&1
  echo "rc $?"
  "$NCU" -i "$OUT/prof/$name.ncu-rep" --page details > "$OUT/prof/$name.details.txt" 2>&1
  "$NCU" -i "$OUT/prof/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/prof/$name.sass.csv" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
    "$OUT/prof/$name.details.txt" | head -40
done
tar czf "$OUT/prof.tgz" -C "$OUT" prof
ls -la "$OUT"
