#!/usr/bin/env bash
# Nsight Compute profile of the shared expert's W1 and W2 (role4, `kernels/sm90/shared_expert.py`) at a few
# points, in one bounded device call: the third eager W1 -> W2 of `python -m gc_moe.kernels.sm90.shared_expert
# --profile model:tokens`, the full section set (ncu flushes the caches before each kernel), the details page as
# text and the SASS source page as CSV; everything packed into $OUT/shared-prof.tgz.
#   PROFILE_POINTS="glm-5.2:1 deepseek-v4.1-flash:8"   (model:tokens; default below)
# Needs the cubin cache built offline (gcmoe-bench build --arch sm_90a --profile h200) copied to the GPU machine.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT/shared-prof"
export PYTHONPATH="$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache}
NCU=${NCU:-ncu}
for p in ${PROFILE_POINTS:-glm-5.2:1 deepseek-v4.1-flash:8}; do
  name="shared-${p%%:*}-T${p##*:}"; dir="$OUT/shared-prof"
  echo "=== $name"
  timeout 200 "$NCU" --clock-control none -k regex:kernel_cutlass --launch-skip 4 --launch-count 2 --set full \
    -f -o "$dir/$name" python -m gc_moe.kernels.sm90.shared_expert --profile "$p" > "$dir/$name.log" 2>&1
  echo "rc $?"
  "$NCU" -i "$dir/$name.ncu-rep" --page details > "$dir/$name.details.txt" 2>&1
  "$NCU" -i "$dir/$name.ncu-rep" --page source --csv --print-source sass > "$dir/$name.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Block Limit" \
    "$dir/$name.details.txt" | head -30
done
tar czf "$OUT/shared-prof.tgz" -C "$OUT" shared-prof
