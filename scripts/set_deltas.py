"""Each variant set of a grouped-GEMM bench JSON (scripts/bench_grouped_gemm_sm90.py --json) against a baseline set
of the same run, per model and token count: cold us of the point (and of W1 / W2 alone where the run timed them with
--per-role), the candidate's time minus the baseline's; then per pair the mean difference and the points where the
candidate is faster. No GPU needed.

    python scripts/set_deltas.py tagged.json --pairs tg:ws_auto,tg_pdl:ws_auto_pdl
"""

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench_grouped_gemm_sm90.py --json file")
    ap.add_argument("--pairs", required=True, help="CANDIDATE:BASELINE[,CANDIDATE:BASELINE...] set tags")
    args = ap.parse_args()
    pairs = [tuple(p.split(":", 1)) for p in args.pairs.split(",")]
    if any(len(p) != 2 or not all(p) for p in pairs):
        print(f"--pairs wants CANDIDATE:BASELINE[,...], got {args.pairs!r}", file=sys.stderr)
        return 2
    try:
        with open(args.json) as f:
            data = json.load(f)
        rows = {(r["tag"], r["model"], r["tokens"]): r for r in data["rows"]}
        bandwidth = data["read_bw_bytes_per_s"]
    except FileNotFoundError:
        print(f"{args.json}: no such file", file=sys.stderr)
        return 2
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        print(f"{args.json} is not a bench_grouped_gemm_sm90.py --json file ({exc!r}): it needs read_bw_bytes_per_s and "
              "rows with tag, model, tokens", file=sys.stderr)
        return 2
    tags = {tag for tag, _, _ in rows}
    unknown = sorted({t for pair in pairs for t in pair} - tags)
    if unknown:
        print(f"--pairs names sets the run does not have: {unknown}; it has {sorted(tags)}", file=sys.stderr)
        return 2
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s; cold us, candidate - baseline "
          "(point / W1 alone / W2 alone)")
    print(f"{'model':<22} {'T':>4} {'candidate':>10} {'baseline':>10} {'point':>14} {'W1':>14} {'W2':>14}")
    missing = 0
    for cand, base in pairs:
        deltas = {"cold_us": [], "w1_cold_us": [], "w2_cold_us": []}  # the pair's summary line
        for (tag, model, tokens), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if tag != cand:
                continue
            b = rows.get((base, model, tokens))
            if b is None:
                missing += 1
                continue
            for key, values in deltas.items():
                if key in r and key in b:
                    values.append(r[key] - b[key])
            cells = []
            for key in ("cold_us", "w1_cold_us", "w2_cold_us"):
                if key in r and key in b:
                    cells.append(f"{r[key]:6.1f} {r[key] - b[key]:+6.1f}")
                else:
                    cells.append("-")
            print(f"{model:<22} {tokens:>4} {cand:>10} {base:>10} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14}")
        points = deltas["cold_us"]
        if points:  # the mean difference and how many points the candidate is faster at (the adoption rule's inputs)
            roles = "".join(f", {role} alone {sum(v) / len(v):+.2f}" for role, v in
                            (("W1", deltas["w1_cold_us"]), ("W2", deltas["w2_cold_us"])) if v)
            print(f"{cand} - {base}: mean {sum(points) / len(points):+.2f} us over {len(points)} points, faster at "
                  f"{sum(d < 0 for d in points)}{roles}")
    if missing:
        print(f"{missing} candidate rows had no baseline row at the same point")
    return 0


if __name__ == "__main__":
    sys.exit(main())
