#!/usr/bin/env bash
# One command from a fresh clone: install the harness and the reference operator, run the CPU sweep through the
# real pipeline (torchrun, 2 gloo ranks, the paper's protocol with wall-clock timing, slowest-rank aggregation),
# then write the paper's tables and figures with the measured run beside them.
# Output: runs/cpu/<run-id>/ (the measured run) and runs/report/ (tables, figures); both are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"

if ! python3 -c "import torch" 2>/dev/null; then
  python3 -m pip install -q torch==2.13.0     # the CPU build; a bare "torch" pulls a multi-GB CUDA build
fi
python3 -m pip install -q -e '.[dev]'

echo "== CPU sweep: torchrun --nproc-per-node $NPROC -m gcmoe_bench sweep --gpu cpu --out runs"
python3 -m torch.distributed.run --nproc-per-node "$NPROC" -m gcmoe_bench sweep --gpu cpu --out runs
run_dir=$(ls -d runs/cpu/*/ | sort | tail -n 1)

echo "== report: the paper's Tables 5-10 and Figures 3-8, with $run_dir beside them"
python3 -m gcmoe_bench report "$run_dir" --out runs/report
echo "== regression check of the fresh run against the committed CPU baseline (CPU timings are noisy: 25% tolerance)"
python3 -m gcmoe_bench compare "$run_dir" --baseline results/baselines/cpu.csv --tolerance 0.25 || \
  echo "(a CPU speedup moved by more than 25%: CPU wall-clock timings on a loaded machine do that)"
echo "done: measured run in $run_dir, tables and figures in runs/report/"
