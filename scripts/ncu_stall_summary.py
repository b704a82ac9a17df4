"""Warp-stall summary of an Nsight Compute report (run where `ncu` is installed; no GPU needed).

Per profiled kernel: duration, issue-slot and DRAM figures and the warp-state stall reasons (cycles per issued
instruction, largest first), from `ncu -i REPORT --page raw --csv`. With --source N: for the kernel at that
index (0 = the first profiled), the SASS lines with the most stall samples and their leading reasons, from the
source page (`--page source --csv --print-source sass`).

  python scripts/ncu_stall_summary.py prof/ds256.ncu-rep --source 2
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys


def ncu_csv(args: list[str]) -> list[list[str]]:
    out = subprocess.run(["ncu", *args], capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith('"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def summary(report: str, top: int) -> None:
    rows = ncu_csv(["-i", report, "--page", "raw", "--csv"])
    header, units, rows = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    stall = [n for n in header if n.startswith("smsp__average_warps_issue_stalled_") and n.endswith(
        "_per_issue_active.ratio")]
    # the first of these a report has: the share of cycles a scheduler issued an instruction
    issue = next((n for n in ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                              "sm__inst_issued.avg.pct_of_peak_sustained_active",
                              "smsp__inst_issued.avg.pct_of_peak_sustained_active") if n in col), None)
    for k, r in enumerate(rows):
        def get(name, r=r):
            return r[col[name]] if name in col else "?"
        duration = "gpu__time_duration.sum"
        unit = units[col[duration]] if duration in col else ""
        print(f"[{k}] {get('Kernel Name')[:40]} grid {get('Grid Size')} block {get('Block Size')} "
              f"dur {get(duration)} {unit}, issue active {get(issue) if issue else '?'}%, "
              f"DRAM {get('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed')}%")
        vals = []
        for n in stall:
            try:
                vals.append((float(r[col[n]].replace(",", "")), n))
            except ValueError:
                pass
        vals.sort(reverse=True)
        print("    " + ", ".join(f"{n.removeprefix('smsp__average_warps_issue_stalled_').removesuffix('_per_issue_active.ratio')}"
                                  f" {v:.2f}" for v, n in vals[:top]))


def source(report: str, index: int, top: int) -> None:
    rows = ncu_csv(["-i", report, "--page", "source", "--csv", "--print-source", "sass",
                    "--launch-skip", str(index), "--launch-count", "1"])
    # the page opens with a ("Kernel Name", name) row, then the column header
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), 0)
    header, body = rows[start], rows[start + 1:]
    col = {name: i for i, name in enumerate(header)}
    samples = next((n for n in header if n.startswith("Warp Stall Sampling (All")), None)
    reasons = [n for n in header if n.startswith(("stall_", "Stall "))]
    if samples is None:
        print("no stall sampling column; columns:", header[:20])
        return

    def num(v):
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[col[samples]]) for r in body if len(r) == len(header))
    ranked = sorted((r for r in body if len(r) == len(header)), key=lambda r: -num(r[col[samples]]))
    print(f"kernel {index}: {len(body)} SASS lines, {total:.0f} stall samples")
    for r in ranked[:top]:
        why = sorted(((num(r[col[n]]), n) for n in reasons), reverse=True)[:3]
        print(f"  {num(r[col[samples]]) / max(total, 1) * 100:5.1f}%  {r[col.get('Address', 0)]:>6}  "
              f"{r[col.get('Source', 1)][:60]:60s} " + " ".join(f"{n}={v:.0f}" for v, n in why if v))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=8, help="stall reasons per kernel (default 8)")
    ap.add_argument("--source", type=int, action="append", default=[], metavar="INDEX",
                    help="also the SASS lines with the most stall samples of the kernel at this index")
    ap.add_argument("--lines", type=int, default=30)
    args = ap.parse_args()
    summary(args.report, args.top)
    for index in args.source:
        source(args.report, index, args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
