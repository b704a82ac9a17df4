"""Read a grouped-GEMM bench JSON (scripts/bench_grouped_gemm_sm90.py) for the two questions of its unit-cost runs
(docs/sm90-grouped-gemm.md, steps 32-36). No GPU needed.

- `fit`: per set, base model and token count, each role's cold time at several K with the same units (the bench's
  `--shape`: hidden or inter changed, routing the same) fitted as rounds x (per-unit + steps x per-step), rounds = the
  units over the resident CTAs (SMs x CTAs per SM), steps = K / 128: is a kernel's time over the floor per unit
  (fill, epilogue, launch) or per K128 step (the loop)?
- `spread`: per traced stream-K kernel, whether the late CTAs sit on the same SMs launch after launch (each SM's end
  after the launch's median end, correlated between the launches): a static per-SM weighting of the ranges helps
  only then; a dynamic tail helps either way. And the pair traces (W1 -> W2 on one timer), if any, and where both
  roles were traced in the same launches whether an SM's W2 ends late because its W1 did (each launch's correlation
  of the SMs' W1 and W2 ends, and the slope of W2's on W1's): W2 ranges that follow W1's finish order pay only then.

- `over-read`: per set, each role's cold time over one stream read of the role's own bytes (the bench's
  `--per-role --read-ref` rows) fitted over its points as a fixed cost per role + per K128 step x steps per CTA +
  per unit x units per CTA: what a stream-K kernel adds to a plain read of what it reads, split into its launch, its
  loop's rate and its units' epilogues (docs step 82).

- `weights`: each SM's streaming rate over the traced launches, as the JSON the bench's `--sm-weights` reads (the
  stream-K pair kernel's ranges sized by them).

    python scripts/analyze_unit_costs.py fit unit-costs.json [--sms 132]
    python scripts/analyze_unit_costs.py spread trace.json
    python scripts/analyze_unit_costs.py over-read reads.json [--sms 132] [--max-tokens 8]
    python scripts/analyze_unit_costs.py weights trace.json > sm-rates.json
"""

import argparse
import json
import math
import statistics
import sys

ROWS_PER_CTA = 256  # weight rows of one unit (grouped_gemm.ROWS_PER_CTA)


def ctas_per_sm(row: dict) -> int:
    """Resident CTAs per SM of the row's kernels: the knobs name it where it is not one (tile 8's grid, tiles 16 / 24)."""
    knobs = row.get("knobs") or {}
    if "ctas_per_sm" in knobs:
        return int(knobs["ctas_per_sm"])
    return 2 if row["block_n"] == 8 and not knobs.get("stream_k") else 1


def role_shape(row: dict, role: str) -> tuple[int, int]:
    """(units, K128 steps) of one role at the row's point."""
    hidden, inter = row["hidden"], row["inter"]
    tiles = {int(bn): n for bn, n in row["tiles"].items()}[row["block_n"]]  # JSON keys are strings
    if role == "w1":
        return tiles * (2 * inter // ROWS_PER_CTA), hidden // 128
    return tiles * (hidden // ROWS_PER_CTA), inter // 128


def fit(rows: list, sms: int = 132) -> list:
    """Per (set, base slice, tokens, role): least squares of time / rounds = per_unit + steps x per_step over the
    rows at different K (the base slice and its --shape variants: the same statistics, their own routing, so each
    row's rounds are its own). Returns dicts with the fit, its largest relative residual and the share of the time
    the per-step term takes at the largest K."""
    groups = {}
    for r in rows:
        if "hidden" not in r or r.get("cold_us") is None:
            continue
        for role in ("w1", "w2"):
            t = r.get(f"{role}_cold_us")
            if t is None or not math.isfinite(t):
                continue
            units, steps = role_shape(r, role)
            rounds = math.ceil(units / (sms * ctas_per_sm(r)))
            key = (r["tag"], r.get("base", r["model"]), r["tokens"], role)
            groups.setdefault(key, []).append((steps, t / rounds, t, rounds, r["model"], units))
    out = []
    for (tag, base, tokens, role), pts in sorted(groups.items()):
        if len({p[0] for p in pts}) < 2:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        per_step = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        per_unit = my - per_step * mx
        resid = max(abs(per_unit + per_step * x - y) / y for x, y in zip(xs, ys))
        top = max(pts)
        out.append({"set": tag, "base": base, "tokens": tokens, "role": role, "units": sorted({p[5] for p in pts}),
                    "rounds": sorted({p[3] for p in pts}), "models": sorted({p[4] for p in pts}),
                    "per_unit_us": round(per_unit, 2),
                    "per_step_us": round(per_step, 3), "max_residual": round(resid, 3),
                    "step_share_at_full_k": round(per_step * top[0] / top[1], 2)})
    return out


def over_read(rows: list, sms: int = 132, max_tokens: int = 8) -> list:
    """Per set: least squares of (role alone - stream read of the role's bytes) = fixed[role] + per_step x steps per
    CTA + per_unit x units per CTA over every point up to max_tokens with both times whose kernels ran the stream-K
    grid (one CTA per SM; the row's knobs say stream_k). Returns one dict per set with the terms, the points and the
    largest residual; sets whose points do not separate the terms (fewer than the terms, or dependent) are left out."""
    import numpy as np

    sets = {}
    for r in rows:
        if r.get("tokens", 0) > max_tokens or "hidden" not in r or not (r.get("knobs") or {}).get("stream_k"):
            continue  # (the model is the stream-K grid's: other grids' rows are left out)
        for role in ("w1", "w2"):
            t, read = r.get(f"{role}_cold_us"), r.get(f"{role}_stream_read_us")
            if t is None or read is None or not (math.isfinite(t) and math.isfinite(read)):
                continue
            units, steps = role_shape(r, role)
            sets.setdefault(r["tag"], []).append((role, steps * units / sms, units / sms, t - read, r["model"],
                                                  r["tokens"]))
    out = []
    for tag, pts in sorted(sets.items()):
        roles = sorted({p[0] for p in pts})
        xs = np.array([[1.0 if p[0] == role else 0.0 for role in roles] + [p[1], p[2]] for p in pts])
        ys = np.array([p[3] for p in pts])
        coef, _, rank, _ = np.linalg.lstsq(xs, ys, rcond=None)
        if rank < xs.shape[1]:
            continue
        resid = ys - xs @ coef
        out.append({"set": tag, "points": len(pts),
                    "fixed_us": {role: round(float(coef[i]), 2) for i, role in enumerate(roles)},
                    "per_step_us": round(float(coef[-2]), 4), "per_unit_us": round(float(coef[-1]), 3),
                    "max_abs_residual_us": round(float(np.abs(resid).max()), 2),
                    "over_read_us": {f"{p[4]} T={p[5]} {p[0]}": round(p[3], 1) for p in pts}})
    return out


def pearson(a: list, b: list) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else float("nan")


def spread_persistence(runs: list) -> dict:
    """runs: a traced kernel's launches, each [[SM, start, end, steps], ...] (the bench's `ctas_by_sm_runs`). Each
    SM's lateness = its CTA's end minus the launch's median end; returns the launches' end spreads, the mean
    correlation of lateness between pairs of launches (SMs present in both), and the SMs late in every launch."""
    late = []
    for run in runs:
        med = statistics.median(c[2] for c in run)
        late.append({c[0]: c[2] - med for c in run})
    pairs = []
    for i in range(len(late)):
        for j in range(i + 1, len(late)):
            common = sorted(set(late[i]) & set(late[j]))
            if len(common) > 2:
                pairs.append(pearson([late[i][s] for s in common], [late[j][s] for s in common]))
    spreads = [round(max(c[2] for c in run) - min(c[2] for c in run), 2) for run in runs]
    quarter = [sorted(d, key=d.get)[-max(1, len(d) // 4):] for d in late]  # each launch's latest quarter of SMs
    always = sorted(set.intersection(*map(set, quarter))) if quarter else []
    return {"launches": len(runs), "end_spreads_us": spreads,
            "lateness_correlation": round(statistics.fmean(pairs), 2) if pairs else None,
            "late_in_every_launch": always}


def finish_order(w1_runs: list, w2_runs: list) -> dict:
    """The same launches' W1 and W2 traces (`ctas_by_sm_runs`, one CTA per SM): per launch the correlation of each
    SM's W1 end with its W2 end, and the least-squares slope of W2's end on W1's (1: W2 ends as late as W1 did)."""
    corr, slope = [], []
    for run1, run2 in zip(w1_runs, w2_runs):
        end1, end2 = {c[0]: c[2] for c in run1}, {c[0]: c[2] for c in run2}
        common = sorted(set(end1) & set(end2))
        if len(common) < 3:
            continue
        a, b = [end1[s] for s in common], [end2[s] for s in common]
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        var = sum((x - ma) ** 2 for x in a)
        corr.append(round(pearson(a, b), 2))
        slope.append(round(sum((x - ma) * (y - mb) for x, y in zip(a, b)) / var, 2) if var else float("nan"))
    return {"launches": len(corr), "w1_w2_end_correlation": corr, "w2_on_w1_end_slope": slope}


def spread(rows: list) -> list:
    out = []
    for r in rows:
        for role, tr in (r.get("trace") or {}).items():
            runs = tr.get("ctas_by_sm_runs")
            if runs:
                out.append({"set": r["tag"], "model": r["model"], "tokens": r["tokens"], "role": role,
                            **spread_persistence(runs)})
        both = [((r.get("trace") or {}).get(role) or {}).get("ctas_by_sm_runs") for role in ("w1", "w2")]
        if all(both):
            out.append({"set": r["tag"], "model": r["model"], "tokens": r["tokens"], "role": "w1->w2",
                        **finish_order(*both)})
        if r.get("pair_trace"):
            p = {k: v for k, v in r["pair_trace"].items() if k != "runs"}
            out.append({"set": r["tag"], "model": r["model"], "tokens": r["tokens"], "role": "pair", **p})
    return out


def load_rows(path: str) -> list:
    """The rows of a bench JSON, or of a bench log (one JSON row per line: what a run cut short by its time bound
    left, since the JSON is written at the end)."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)["rows"]
    except ValueError:
        return [json.loads(line) for line in text.splitlines() if line.startswith('{"tag"')]


def sm_rates(rows: list) -> dict:
    """{%smid: K128 steps per us} over every traced stream-K launch of the rows (each CTA's steps over its span from
    start to end, summed per SM): the rates `kernels.sm90.stream_pair.sm_weight_table` turns into the sm_weights
    variant's table. Only launches whose CTAs covered the same SMs count (the whole device)."""
    steps, span, sets = {}, {}, []
    for r in rows:
        for tr in (r.get("trace") or {}).values():
            for run in tr.get("ctas_by_sm_runs") or []:
                sets.append(frozenset(c[0] for c in run))
                for sm, start, end, n in run:
                    steps[sm] = steps.get(sm, 0) + n
                    span[sm] = span.get(sm, 0.0) + (end - start)
    if not sets:
        return {}
    common = frozenset.intersection(*sets)
    return {sm: round(steps[sm] / span[sm], 4) for sm in sorted(common) if span[sm] > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("fit", "spread", "weights", "over-read"),
                    help="fit: per-unit / per-step costs; spread: late SMs and the pair's hand-over; weights: each "
                         "SM's rate as JSON for the bench's --sm-weights; over-read: each stream-K kernel's time over a "
                         "stream read of its bytes, per launch, K128 step and unit")
    ap.add_argument("json", help="a bench JSON (its rows), or the log of a bench run cut short (its row lines)")
    ap.add_argument("--sms", type=int, default=132, help="the SMs the kernels ran on (rounds of units)")
    ap.add_argument("--max-tokens", type=int, default=8, help="over-read: the largest token count fitted (the "
                    "stream-K points)")
    args = ap.parse_args()
    rows = load_rows(args.json)
    if args.what == "weights":
        rates = sm_rates(rows)
        if not rates:
            print(f"no traced stream-K launches with per-CTA SM lists in {args.json} (--trace with a traced set)")
            return 1
        print(json.dumps(rates))
        return 0
    if args.what == "over-read":
        results = over_read(rows, args.sms, args.max_tokens)
        if not results:
            print(f"nothing to fit in {args.json}: no set with W1 / W2 times and stream reads of their bytes at four "
                  "points or more (--per-role --read-ref)")
            return 1
        for res in results:
            print(json.dumps(res))
        return 0
    results = fit(rows, args.sms) if args.what == "fit" else spread(rows)
    if not results:
        print(f"nothing to {args.what} in {args.json}: "
              + ("no rows with W1 / W2 times at two K or more (--per-role with --shape)" if args.what == "fit"
                 else "no traced rows (--trace with a traced set)"))
        return 1
    for res in results:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
