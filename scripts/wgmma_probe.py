"""Cycles per K128 step of the grouped GEMM's consumer work on one SM, in parts (kernels/sm90/wgmma_probe.py).

  python scripts/wgmma_probe.py --build-only          # offline: compile the probe's variants into the cubin cache
  python scripts/wgmma_probe.py --json probe.json     # on the GPU: measure them and print the table

Per token tile N and warpgroups (1 and 4): cycles per step of the chain alone (four m64nNk32 WGMMAs, wait, N/2
FP32 multiply-adds), of the chain after the table decode, and of the decode alone; then, at 4 warpgroups, where the
decode-and-chain step falls between the sum of its parts (no overlap between warpgroups) and their maximum (full
overlap); also with the warpgroups' halves taking turns at the tensor cores (`pingpong`, at 2 and 4 warpgroups) and
in the operator's in-place form (`inplace`). One CTA, one SM, no global memory: the consumer's own costs, not the
pipeline's. Then the split probe:
two decoder warpgroups beside four chain warpgroups with no dependency between them, the chains register-A or
shared-A (the decoders storing E4M3): what a kernel that takes the decode off the chains' warps could reach.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator")]


def timed(params: dict, wg: int) -> bool:
    """Whether warpgroup `wg` of a probe configuration runs steps (a split probe's role switched off does not)."""
    split = params.get("split", 0)
    if not split:
        return True
    return params["decode"] if wg < split else params["chain"]


def measure(variants, steps: int, repeats: int) -> list[dict]:
    import torch
    from gc_moe.kernels.sm90 import wgmma_probe as wp
    from gc_moe.runtime import jit
    from gc_moe.runtime.launch import i32, launch, ptr

    torch.zeros(1, device="cuda")  # a current context before the first driver-level load
    stream = torch.cuda.current_stream()
    out = torch.zeros(wp.OUT_BYTES // 8 + 1, dtype=torch.int64, device="cuda")
    rows = []
    for v in variants:
        params = dict(v.params)
        kernel = jit.load_kernel(v, "sm_90a")
        per_step = []
        for r in range(repeats + 1):  # the first launch warms the instruction caches
            out.fill_(-1)
            launch(kernel, (1, 1, 1), [ptr(out), i32(steps)], stream)
            torch.cuda.synchronize()
            cycles = [c for wg, c in enumerate(out.cpu()[0:2 * params["warpgroups"]:2].tolist())
                      if timed(params, wg)]
            if min(cycles) <= 0:
                raise SystemExit(f"{v.describe()}: a warpgroup stored no cycles ({cycles})")
            if r:
                per_step.append(max(cycles) / steps)
        per_step.sort()
        rows.append({**params, "cycles_per_step": per_step[len(per_step) // 2], "spread": per_step[-1] - per_step[0]})
        print(f"{v.describe():70s} {rows[-1]['cycles_per_step']:8.1f} cycles per step", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Per N and warpgroups: chain alone, decode + chain, and at 4 warpgroups where that lies between the parts' sum
    and maximum (overlap 0: the sum, 1: the maximum)."""
    rows = [r for r in rows if not r.get("split") and not r.get("sync")]  # split_table's, sync_table's

    def get(n, wgs, decode, chain, skew=False, wide=False, pingpong=False, inplace=False):
        for r in rows:
            if ((r["warpgroups"], r["decode"], r["chain"], r.get("skew", False), r.get("wide", False),
                 r.get("pingpong", False), r.get("inplace", False)) == (wgs, decode, chain, skew, wide, pingpong,
                                                                        inplace)
                    and (r["n"] == n or not chain)):
                return r["cycles_per_step"]
        return float("nan")

    lines = ["| N | warpgroups | decode alone | chain alone | decode + chain | sum | max | overlap |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ns = sorted({r["n"] for r in rows if r["chain"]})
    for wgs in sorted({r["warpgroups"] for r in rows}):
        for n in ns:
            for skew, wide, pingpong, inplace in ((False, False, False, False), (True, False, False, False),
                                                  (False, True, False, False), (False, False, True, False),
                                                  (False, False, False, True), (False, False, True, True)):
                d, c = get(n, wgs, True, False), get(n, wgs, False, True, wide=wide)
                both = get(n, wgs, True, True, skew, wide, pingpong, inplace)
                if math.isnan(both):  # no such variant (skewed: N = 64 and 96 at four warpgroups only; wide: 96)
                    continue
                total, top = d + c, max(d, c)
                overlap = (total - both) / (total - top) if total > top else float("nan")
                label = (f"{n}{' skewed' if skew else ''}{' wide (64 + 32)' if wide else ''}"
                         f"{' ping-pong' if pingpong else ''}{' in place' if inplace else ''}")
                lines.append(f"| {label} | {wgs} | {d:.0f} | {c:.0f} | {both:.0f} | {total:.0f} "
                             f"| {top:.0f} | {overlap:.2f} |")
    return "\n".join(lines)


def sync_table(rows: list[dict]) -> str:
    """The operator's per-step synchronization around the decode-and-chain step at four warpgroups: cycles per step
    plain, with the arrival alone, with the stage wait and arrival, with those and the proxy fence, and with the wait
    issued under the chain ("early"); the differences are what each costs."""
    def get(n, sync):
        for r in rows:
            if (r["n"], r["warpgroups"], r.get("sync", ""), r["decode"], r["chain"]) == (n, 4, sync, True, True) \
                    and not (r.get("split") or r.get("skew") or r.get("wide") or r.get("pingpong")
                             or r.get("inplace")):
                return r["cycles_per_step"]
        return float("nan")

    header = ("| N | plain | + arrival | + wait and arrival | + proxy fence | wait under the chain, arrival "
              "| arrival cost | wait cost | fence cost | early wait cost |")
    lines = [header, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted({r["n"] for r in rows if r.get("sync")}):
        plain, arrive, wait, fence, early = (get(n, s) for s in ("", "arrive", "wait", "fence", "early"))
        lines.append(f"| {n} | {plain:.0f} | {arrive:.0f} | {wait:.0f} | {fence:.0f} | {early:.0f} | {arrive - plain:.0f} "
                     f"| {wait - arrive:.0f} | {fence - wait:.0f} | {early - arrive:.0f} |")
    lines += ["", "Every lane arriving (barriers counting 32) against lane 0 after a warp sync:", "",
              "| N | plain | + arrival, lane 0 | + arrival, every lane | + wait, lane 0 | + wait, every lane |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted({r["n"] for r in rows if r.get("sync") in ("arrive_all", "wait_all")}):
        cells = " | ".join(f"{get(n, s):.0f}" for s in ("", "arrive", "arrive_all", "wait", "wait_all"))
        lines.append(f"| {n} | {cells} |")
    return "\n".join(lines)


def split_table(rows: list[dict]) -> str:
    """The split probe (decoders beside chain warpgroups, no dependency): per N and A source the decoders' and the
    chains' cycles per step alone and together (the slower role's), and the overlap as in `table`."""
    def get(key, decode, chain):
        for r in rows:
            if r.get("split") and split_key(r) == key and (r["decode"], r["chain"]) == (decode, chain):
                return r["cycles_per_step"]
        return float("nan")

    def split_key(r):
        return r["n"], r["split"], r["warpgroups"] - r["split"], r["shared_a"]

    lines = [("| N | decoder warpgroups | chain warpgroups | chains' A | decoders alone | chains alone | together | sum "
              "| max | overlap |"),
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in sorted({split_key(r) for r in rows if r.get("split")}):
        d, c, both = get(key, True, False), get(key, False, True), get(key, True, True)
        total, top = d + c, max(d, c)
        overlap = (total - both) / (total - top) if total > top else float("nan")
        n, decoders, chains, shared_a = key
        lines.append(f"| {n} | {decoders} | {chains} | {'shared (SS)' if shared_a else 'registers (RS)'} | {d:.0f} "
                     f"| {c:.0f} | {both:.0f} | {total:.0f} | {top:.0f} | {overlap:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-only", action="store_true", help="compile the variants into the cubin cache and exit")
    ap.add_argument("--steps", type=int, default=4096, help="K128 steps per warpgroup and launch")
    ap.add_argument("--repeats", type=int, default=5, help="launches per variant (the median is kept)")
    ap.add_argument("--json", default=None, help="where the rows go")
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"--steps {args.steps} and --repeats {args.repeats}: both must be at least 1")

    from gc_moe.kernels.sm90 import wgmma_probe as wp
    from gc_moe.runtime import jit

    variants = wp.probe_variants()
    if args.build_only:
        for v in variants:
            jit.build_variant(v, "sm_90a")
        print(f"{len(variants)} probe variants in the cache ({os.environ.get('GC_MOE_CACHE_DIR') or 'default dir'})")
        return
    rows = measure(variants, args.steps, args.repeats)
    print(table(rows))
    if any(r.get("split") for r in rows):
        print(split_table(rows))
    if any(r.get("sync") for r in rows):
        print(sync_table(rows))
    if args.json:
        import torch

        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "steps": args.steps,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
