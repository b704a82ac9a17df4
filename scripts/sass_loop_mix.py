"""Where a grouped GEMM K loop's cycles go, from its SASS (no GPU needed): per innermost QGMMA loop the instructions of
one trip (one K128 step) by the pipe that runs them, and what a scheduler (SM sub-partition) spends per step at the
consumer warps it holds, beside the tensor core's cycles at the loop's N and the memory's cycles for the step's bytes.

  python scripts/sass_loop_mix.py w1 64 fold_scales=True,table_decode=True,fit_n=True,lean_epilogue=True

Throughputs per SM and clock (CUDA C programming guide, compute capability 9.0): FP32 multiply-add 128 (a warp
instruction takes one cycle of its sub-partition's FMA pipe), 32-bit integer logic, shift, compare and byte permute
64 (two cycles of the ALU pipe), integer multiply-add 64 (two cycles of the FMA pipe's heavy half); one instruction
issued per scheduler and cycle. The tensor core's dense FP8 rate: 1979 TFLOP/s on 132 SMs at 1.98 GHz, ~3786
multiply-adds per SM and cycle. A model for predictions, not a measurement: the loop's latencies and the
warps' overlap decide how much of the larger of these a step takes.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "scripts")]

ALU = {"LOP3", "SHF", "PRMT", "ISETP", "LEA", "IADD3", "SEL", "SHL", "SHR", "BFE", "BFI", "FLO", "POPC", "VIADD"}
FMA_HEAVY = {"IMAD", "IMUL"}
FP32 = {"FFMA", "FMUL", "FADD", "FMNMX"}
MAC_PER_SM_CLOCK = 1979e12 / 2 / (132 * 1.98e9)


def opcode(text: str) -> str:
    text = re.sub(r"^(@!?U?P\w+\s+)", "", text.strip())
    return text.split()[0].split(".")[0] if text else ""


def step_costs(body: list[str], warps: int, steps: int = 1) -> dict:
    """Per scheduler and K128 step at `warps` consumer warps per scheduler: issue, ALU-pipe and FMA-pipe cycles of a
    loop trip of `steps` K128 steps."""
    ops = collections.Counter(opcode(t) for t in body)
    alu = sum(n for op, n in ops.items() if op in ALU)
    heavy = sum(n for op, n in ops.items() if op in FMA_HEAVY)
    fp32 = sum(n for op, n in ops.items() if op in FP32)
    return {"instructions": len(body) / steps, "ops": ops, "issue": warps * len(body) / steps,
            "alu_pipe": warps * 2 * alu / steps, "fma_pipe": warps * (2 * heavy + fp32) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=("w1", "w2"))
    ap.add_argument("block_n", type=int)
    ap.add_argument("knobs", nargs="?", default="", help="KNOB=VALUE[,KNOB=VALUE...] as grouped_gemm.variant takes them")
    ap.add_argument("--warps", type=int, default=4, help="consumer warps per scheduler (16 per CTA, one CTA per SM: 4)")
    ap.add_argument("--ctas", type=int, default=1, help="CTAs per SM (the tensor core's work per step scales with it)")
    ap.add_argument("--bw", type=float, default=4.4, help="read bandwidth, TB/s (the memory's cycles per step)")
    ap.add_argument("--clock", type=float, default=1.98, help="SM clock, GHz")
    ap.add_argument("--ops", action="store_true", help="also each loop's instruction counts by opcode")
    args = ap.parse_args()

    import bench_grouped_gemm_sm90 as bench
    from gc_moe.kernels.sm90 import grouped_gemm as gg
    from gc_moe.runtime import jit
    from sass_diff import cuobjdump

    knobs = bench.parse_extra_set(f"loop:{args.knobs}", {})["loop"] if args.knobs else {}
    variant = gg.variant(args.role, args.block_n, **knobs)
    entry = jit.find_entry(variant, "sm_90a")
    if entry is None:
        raise SystemExit(f"{variant.describe()} is not in the cubin cache: build it first (gcmoe-bench build)")
    sass = subprocess.run([cuobjdump(), "-sass", str(entry.cubin_path)], capture_output=True, text=True,
                          check=True).stdout
    inner = bench.innermost_mma_loops(sass.splitlines())
    step_bytes = gg.STAGE_TX_BYTES * args.ctas
    memory = step_bytes / (args.bw * 1e12 / 132) * args.clock * 1e9
    print(f"{variant.describe()}\nper scheduler and K128 step ({args.warps} consumer warps each, {args.ctas} CTA(s) "
          f"per SM); memory: {step_bytes} B per SM at {args.bw} TB/s = {memory:.0f} cycles")
    print(f"{'N':>4s} {'instr':>5s} {'issue':>5s} {'ALU':>5s} {'FMA':>5s} {'tensor':>6s}  largest")
    for body in inner:
        # a trip's K128 steps: one full-barrier wait each (the pipelined loops run two steps per trip)
        steps = max(1, sum("SYNCS.PHASECHK" in t for t in body))
        shapes = [int(m.group(1)) for t in body for m in [re.search(r"QGMMA\.64x(\d+)x32", t)] if m]
        n = sum(shapes) // (4 * steps)  # a step's chains: four K32 WGMMAs each (the wide tile: two chains)
        tensor = 4 * args.ctas * 4 * 64 * n * 32 / MAC_PER_SM_CLOCK  # four consumer warpgroups per CTA
        c = step_costs(body, args.warps, steps)
        worst = max(("issue", c["issue"]), ("ALU", c["alu_pipe"]), ("FMA", c["fma_pipe"]), ("tensor", tensor),
                    ("memory", memory), key=lambda kv: kv[1])
        print(f"{n:4d} {c['instructions']:5.0f} {c['issue']:5.0f} {c['alu_pipe']:5.0f} {c['fma_pipe']:5.0f} "
              f"{tensor:6.0f}  {worst[0]}")
        if args.ops:
            print("     " + ", ".join(f"{op} {k}" for op, k in c["ops"].most_common()))


if __name__ == "__main__":
    main()
