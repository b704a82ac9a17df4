"""The grouped GEMM's table per model from a benchmark JSON (`bench_grouped_gemm_sm90.py --json`), as the SM90 GEMM's
target asks for it: tokens, active experts, bytes, floor, measured, % of the read bandwidth, effective TFLOP/s, and the
registers and stack bytes (spills) of the kernels that ran, read from the cubin cache's compile report.

  python scripts/gemm_issue_table.py results/h100/gemm/step51-table.json            # the default sets per point
  python scripts/gemm_issue_table.py table.json --sets ws_auto,ws_auto_pair          # the fastest of these per point

Per point the row is the fastest (cold time) of the named sets present; its kernels are found again from the row's
knobs (the pair kernel where the row says stream_pair, else W1 and W2 at the row's token tile and knobs) in the cubin
cache (GC_MOE_CACHE_DIR) the run used, built there only where the CuTe DSL is installed (no GPU needed); a kernel
the cache lacks on a machine without the DSL is named in its cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator")]

DEFAULT_SETS = "ws_auto,ws_auto_pdl,ws_auto_pair"  # tile_knobs's choice, with W2 programmatic, with the pair kernel


def row_variants(row: dict) -> list:
    """The kernel variants a benchmark row ran (from its knobs)."""
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    knobs = dict(row.get("knobs") or {})
    if knobs.pop("stream_pair", False):
        from gc_moe.kernels.sm90 import stream_pair

        pair = {k: v for k, v in knobs.items() if k in ("lean_epilogue", "words_first", "publisher_warp")}
        return [stream_pair.variant(**pair)]
    knobs = {k: v for k, v in knobs.items() if k not in ("pair", "wide", "two_cta")}
    return [gg.variant(role, row["block_n"], **knobs) for role in ("w1", "w2")]


def resources(variants) -> str:
    """'registers / stack bytes' per variant, from the cache (W1, W2; or the pair kernel)."""
    from gc_moe.runtime import jit

    out = []
    for v in variants:
        try:  # the cache's entry; built only where the CuTe DSL is installed (the GPU machine has none)
            res = jit.get_entry(v, "sm_90a").resources
        except jit.KernelNotBuiltError:
            out.append("not in the cubin cache")
            continue
        raised = dict(v.params).get("consumer_registers")  # setmaxnreg in the K loop: the launch's count is lower
        out.append(f"{res.get('registers', '?')}{f' (consumers {raised})' if raised else ''} / "
                   f"{res.get('frame_bytes', '?')}")
    return ", ".join(out)


def tables(data: dict, sets: list[str], report=resources) -> str:
    """One markdown table per model: per token count the fastest checked row of `sets` (report: its kernels'
    registers and stack bytes)."""
    best = {}
    for r in data["rows"]:
        if r.get("tag") not in sets or not r.get("ok", False):
            continue
        key = (r["model"], r["tokens"])
        if key not in best or r["cold_us"] < best[key]["cold_us"]:
            best[key] = r
    # the run's same-bytes reads (bench --read-ref): the stream-read kernel over each point's bytes under the same
    # protocol, static ranges / chunks claimed by ticket
    read_ref = any("stream_read_us" in r for r in best.values())
    out = [f"Read bandwidth measured in the same run: {data['read_bw_bytes_per_s'] / 1e12:.2f} TB/s; cold times "
           "(after a read flush of the L2)." + (" `read us`: one stream-read launch over the same bytes, same "
                                                  "protocol (static ranges / chunks claimed by ticket)."
                                                  if read_ref else "") + "\n"]
    for model in sorted({m for m, _ in best}):
        out += [f"{model}:\n",
                "| tokens/rank | active experts | MB | floor us | " + ("read us | " if read_ref else "")
                + "measured us | % of bw | TFLOP/s | set | tile | registers / stack bytes (W1, W2 or the pair kernel) |",
                "| ---: | ---: | ---: | ---: | " + ("---: | " if read_ref else "") + "---: | ---: | ---: | --- | ---: | --- |"]
        for tokens in sorted(t for m, t in best if m == model):
            r = best[(model, tokens)]
            read = ""
            if read_ref:
                read = (f"{r['stream_read_us']:.1f} / {r['stream_read_dyn_us']:.1f} | " if "stream_read_us" in r
                        else "- | ")
            out.append(f"| {tokens} | {r['active']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {read}"
                       f"{r['cold_us']:.1f} | {r['bw_pct']:.1f} | {r['tflops']:.1f} | `{r['tag']}` | {r['block_n']} "
                       f"| {report(row_variants(r))} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench_grouped_gemm_sm90.py --json file")
    ap.add_argument("--sets", default=DEFAULT_SETS, help=f"comma-separated set tags to pick from (default {DEFAULT_SETS})")
    args = ap.parse_args()
    path = Path(args.json)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a bench_grouped_gemm_sm90.py --json output)")
    data = json.loads(path.read_text())
    sets = [s for s in args.sets.split(",") if s]
    if not any(r.get("tag") in sets for r in data.get("rows", [])):
        raise SystemExit(f"{path}: no rows of the sets {sets}; it has {sorted({r.get('tag') for r in data['rows']})}")
    print(tables(data, sets))


if __name__ == "__main__":
    main()
