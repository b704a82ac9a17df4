"""Which CTAs of a traced stream-K launch end late, read from a benchmark JSON the bench wrote with --trace (no GPU):
per traced set, point and kernel, the CTAs grouped by the epilogues their range runs (whole or owned units, from
grouped_gemm.stream_segments), each group's mean end after the median CTA's end over the traced launches, and the
last CTA's end after the median one. Stream-K shares the K128 steps equally, not the epilogues (docs step 77).

  python scripts/trace_end_by_epilogues.py results.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "scripts")]


def kernel_segments(gg, row: dict, role: str, ctas: int) -> list:
    """The stream-K walk of one kernel of a traced point: its CTAs' [(steps, kind)] as the kernel ran them."""
    tiles = int(row["tiles"][str(row["block_n"])])
    rows, k_blocks = (2 * row["inter"], row["hidden"] // 128) if role == "w1" else (row["hidden"], row["inter"] // 128)
    return gg.stream_segments(tiles * (rows // gg.ROWS_PER_CTA), k_blocks, ctas)


def late_groups(gg, bench, row: dict, role: str) -> dict | None:
    """{"groups": {epilogues: [CTAs, mean end after the median, us]}, "last_us": the last end after the median} over
    the traced launches of one kernel of a row, or None where the row has no per-CTA trace of it."""
    trace = (row.get("trace") or {}).get(role) or {}
    runs = trace.get("ctas_by_sm_runs")
    if not runs:
        return None
    ctas = len(runs[0])
    segments = [s for s in kernel_segments(gg, row, role, ctas) if s]
    if len(segments) != ctas or [sum(n for n, _ in s) for s in segments] != [c[3] for c in runs[0]]:
        raise SystemExit(f"{row['tag']} {row['model']} T={row['tokens']} {role}: the traced steps per CTA are not the "
                         "walk's (another grid or unit count than this script computes)")
    sums, lasts = {}, []
    for run in runs:
        ends_ns = [c[2] * 1e3 for c in run]
        for n, (count, mean_us) in bench.end_by_epilogues(segments, range(ctas), ends_ns).items():
            sums.setdefault(n, [count, []])[1].append(mean_us)
        lasts.append((max(ends_ns) - statistics.median(ends_ns)) / 1e3)
    return {"groups": {n: [count, round(statistics.fmean(v), 2)] for n, (count, v) in sorted(sums.items())},
            "last_us": round(statistics.fmean(lasts), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="benchmark JSONs written with --trace")
    args = ap.parse_args()

    import bench_grouped_gemm_sm90 as bench
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    print("| set | model | tokens | kernel | CTAs by epilogues: count, mean end after the median (us) | gap, us | "
          "last after the median, us |")
    print("| --- | --- | ---: | --- | --- | ---: | ---: |")
    for path in args.json:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            for role in ("w1", "w2"):
                got = late_groups(gg, bench, row, role)
                if got is None:
                    continue
                groups = got["groups"]
                most, fewest = groups[max(groups)], groups[min(groups)]
                gap = most[1] - fewest[1] if len(groups) > 1 else 0.0
                cells = ", ".join(f"{n}: {c} CTAs {m:+.2f}" for n, (c, m) in groups.items())
                print(f"| `{row['tag']}` | {row['model']} | {row['tokens']} | {role.upper()} | {cells} | {gap:+.2f} | "
                      f"{got['last_us']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
