"""One streaming read of N bytes under the grouped GEMM's protocol (read flush, graph replay, the flush-only graph
subtracted), static ranges against chunks claimed by ticket, with and without work per chunk
(kernels/sm90/stream_read.py; docs/sm90-grouped-gemm.md, step 62): what a single launch pays over the byte floor, and
whether the CTAs' end spread costs time once a consumer's compute limits how fast a late SM can catch up.

  python scripts/stream_read_sweep.py --build-only                  # offline: the variants into the cubin cache
  python scripts/stream_read_sweep.py --mb 25,50,100,170,300,600 --json reads.json    # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "scripts")]


def tag(v) -> str:
    p = dict(v.params)
    return ("dyn" if p["dynamic"] else "static") + f"_w{p.get('work_cycles', 0)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-only", action="store_true", help="compile the variants into the cubin cache and exit")
    ap.add_argument("--mb", default="25,50,100,170,300,600", help="comma-separated read sizes, MB (1e6 bytes)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--json", help="write the rows here (refused if the file exists)")
    args = ap.parse_args()
    from gc_moe.kernels.sm90 import stream_read as sr
    from gc_moe.runtime import jit

    variants = sr.read_variants()
    if args.build_only:
        for v in variants:
            print(v.describe(), jit.build_variant(v, "sm_90a").resources.get("registers"))
        return 0
    try:
        sizes = [float(x) for x in args.mb.split(",") if x]
    except ValueError:
        raise SystemExit(f"--mb {args.mb!r}: comma-separated sizes in MB, e.g. 100,170") from None
    if not sizes or min(sizes) <= 0 or max(sizes) > 1000:
        raise SystemExit(f"--mb {args.mb!r}: sizes in (0, 1000] MB")
    if args.json and Path(args.json).exists():
        raise SystemExit(f"{args.json} exists: pass another path (results are never overwritten)")

    import torch
    from bench_grouped_gemm_sm90 import measure_read_bandwidth, stream_read_refs

    device = torch.device("cuda")
    torch.zeros(1, device=device)
    kernels = {tag(v): jit.load_kernel(v, "sm_90a") for v in variants}
    stream = torch.cuda.Stream()
    bw = measure_read_bandwidth(device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    source = torch.empty(1 << 28, dtype=torch.float32, device=device).uniform_()
    rows = []
    for mb in sizes:
        nbytes = int(mb * 1e6)
        row = {"mb": mb, "floor_us": nbytes / bw * 1e6,
               **stream_read_refs(nbytes, source, stream, flush, args.replays, args.windows, kernels)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"read_bw_bytes_per_s": bw, "rows": rows}, indent=1))
    names = list(kernels)
    print(f"\nread bandwidth (amax, 4 GiB): {bw / 1e12:.2f} TB/s; per size: us over the floor (CTAs' end spread us)")
    print(f"{'MB':>6s} {'floor':>7s} " + " ".join(f"{n:>16s}" for n in names))
    for r in rows:
        print(f"{r['mb']:6.0f} {r['floor_us']:7.1f} " + " ".join(
            f"{r[n + '_us'] - r['floor_us']:+7.1f} ({r[n + '_end_spread_us']:5.1f})" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
