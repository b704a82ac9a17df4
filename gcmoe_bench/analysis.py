"""Speedups, suite means and the throughput models of Section 6.4, over published and measured points.

Everything here works on one "long" table: one row per (source, gpu, model, suite, tokens_per_rank, operator),
where `source` is "paper" for the published numbers (results/paper/) or a measured run's id. Measured runs are
read from their `points.csv` (columns in docs/ARCHITECTURE.md); the paper's latency tables are reshaped into the
same columns so that one code path computes every speedup, mean and model.

Conventions (Section 6.1 and 6.4):
- speedup = baseline latency / operator latency, per point; 1.0 for the suite's baseline itself;
- a suite's mean is the arithmetic mean of the per-point ratios (not the ratio of means); the geometric mean
  is reported beside it;
- effective TFLOPS = 6 x assignments x H x I / slowest-rank latency, aggregate over ranks (routed-expert
  matmul work only: two GEMMs, W1 of 2I x H and W2 of H x I, two flops per multiply-add);
- HBM working-set GB/s = the owners' unique active experts' FP4 W1 + W2 bytes plus their packed UE8M0 scales,
  each counted once, / latency;
- NVLink payload GB/s = (H + H/32 + 2H) bytes (FP8 token, its packed scales, the BF16 partial sent back) per
  assignment whose expert lives on another rank, / latency.
Units: latencies in microseconds, TFLOPS = 1e12 flop/s, GB/s = 1e9 byte/s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

PAPER_SOURCE = "paper"

# The paper's published CSVs live in the project's results/paper/.
PAPER_DIR = Path(__file__).resolve().parent.parent / "results" / "paper"

# Columns a measured run's points.csv must carry for the analysis (the rest of ARCHITECTURE.md's columns are
# optional here: counts left empty only blank the matching throughput model).
REQUIRED_POINT_COLUMNS = (
    "gpu",
    "model",
    "suite",
    "tokens_per_rank",
    "num_ranks",
    "hidden",
    "intermediate",
    "operator",
    "baseline",
    "latency_us",
)
OPTIONAL_POINT_COLUMNS = (
    "total_tokens",
    "num_experts",
    "topk",
    "num_shared_experts",
    "rank_medians_us",
    "spread_us",
    "speedup",
    "assignments",
    "remote_assignments",
    "hbm_working_set_bytes",
    "l2_mode",
    "status",
    "reason",
)
POINT_KEY = ["source", "gpu", "model", "suite", "tokens_per_rank"]
SUITE_KEY = ["source", "gpu", "model", "suite"]

# Bytes one routed (token, expert) assignment moves over NVLink one way: the FP8 token (H), its UE8M0 scales
# (one byte per 32 values, H/32) and the BF16 partial output returned to the source rank (2H).
NVLINK_BYTES_PER_HIDDEN = 3 + 1 / 32
# Published digits of the latency tables: microseconds to three decimals.
PAPER_LATENCY_DECIMALS = 3


# ---------------------------------------------------------------------------------------------------------------
# Throughput models (scalars or arrays alike)
# ---------------------------------------------------------------------------------------------------------------


def expert_weight_bytes(hidden, intermediate):
    """HBM bytes of one routed expert as the operator reads them: FP4 W1 [2I, H] and W2 [H, I] (half a byte per
    value) plus their packed UE8M0 scales (one byte per 32 values along K)."""
    values = 3 * np.asarray(hidden, dtype=np.float64) * np.asarray(intermediate, dtype=np.float64)
    return values / 2 + values / 32


def nvlink_bytes_per_assignment(hidden):
    """One-way NVLink payload of one remote assignment: (H + H/32 + 2H) bytes."""
    return NVLINK_BYTES_PER_HIDDEN * np.asarray(hidden, dtype=np.float64)


def effective_tflops(assignments, hidden, intermediate, latency_us):
    """Routed-expert matmul work 6 x assignments x H x I over the slowest-rank latency, in TFLOPS."""
    flops = (
        6 * np.asarray(assignments, dtype=np.float64) * np.asarray(hidden, dtype=np.float64) * intermediate
    )
    return flops / (np.asarray(latency_us, dtype=np.float64) * 1e6)


def hbm_working_set_gbps(working_set_bytes, latency_us):
    """HBM working-set bandwidth model: the active experts' weight + scale bytes over the latency, in GB/s."""
    return np.asarray(working_set_bytes, dtype=np.float64) / (np.asarray(latency_us, dtype=np.float64) * 1e3)


def nvlink_payload_gbps(remote_assignments, hidden, latency_us):
    """NVLink payload bandwidth model: remote assignments x (H + H/32 + 2H) bytes over the latency, in GB/s."""
    payload = np.asarray(remote_assignments, dtype=np.float64) * nvlink_bytes_per_assignment(hidden)
    return payload / (np.asarray(latency_us, dtype=np.float64) * 1e3)


def infer_routing_counts(hbm_gbps, nvlink_gbps, latency_us, hidden, intermediate):
    """Invert the HBM and NVLink models: the (active experts, remote assignments) implied by published bandwidths.

    The paper does not publish its routing; its Table 9 bandwidths and latencies pin down the counts it used
    (they come out as integers, identical for both operators). Returns two float arrays: round them yourself
    after checking they are integral."""
    latency_us = np.asarray(latency_us, dtype=np.float64)
    active_experts = np.asarray(hbm_gbps) * latency_us * 1e3 / expert_weight_bytes(hidden, intermediate)
    remote = np.asarray(nvlink_gbps) * latency_us * 1e3 / nvlink_bytes_per_assignment(hidden)
    return active_experts, remote


# ---------------------------------------------------------------------------------------------------------------
# Loading points
# ---------------------------------------------------------------------------------------------------------------


def _read_csv(path: Path, what: str) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return pd.read_csv(path)


def load_paper_points(paper_dir: Path | None = None) -> pd.DataFrame:
    """The paper's latency tables (Tables 5-8) as long points, with shapes from models.csv.

    Each published row (a baseline and an operator at one point) becomes two rows. Assignments are the full
    top-k, T x P x k; active experts and remote assignments come from routing_counts.csv where the paper's
    Table 9 implies them (H20 routed), and stay empty elsewhere."""
    paper_dir = Path(paper_dir) if paper_dir is not None else PAPER_DIR
    latencies = _read_csv(paper_dir / "latency_tables.csv", "the paper's latency tables")
    models = _read_csv(paper_dir / "models.csv", "the paper's model configurations")
    models = models.rename(columns={"experts": "num_experts", "shared_experts": "num_shared_experts"})
    unknown = set(latencies["model"]) - set(models["model"])
    if unknown:
        raise ValueError(f"latency_tables.csv names models missing from models.csv: {sorted(unknown)}")

    shared = ["gpu", "model", "suite", "tokens_per_rank", "total_tokens", "baseline"]
    baseline_rows = latencies[shared + ["baseline_us"]].assign(operator=latencies["baseline"])
    baseline_rows = baseline_rows.rename(columns={"baseline_us": "latency_us"})
    operator_rows = latencies[shared + ["operator", "operator_us"]].rename(
        columns={"operator_us": "latency_us"}
    )
    points = pd.concat([baseline_rows, operator_rows], ignore_index=True)
    repeated = points.duplicated(["gpu", "model", "suite", "tokens_per_rank", "operator"])
    if repeated.any():
        raise ValueError(f"latency_tables.csv lists a point twice: {points[repeated].iloc[0].to_dict()}")
    points = points.merge(
        models[["model", "hidden", "intermediate", "num_experts", "topk", "num_shared_experts"]], on="model"
    )
    points["num_ranks"] = points["total_tokens"] // points["tokens_per_rank"]
    points["assignments"] = points["total_tokens"] * points["topk"]
    points["source"] = PAPER_SOURCE
    points["status"] = "ok"

    counts_path = paper_dir / "routing_counts.csv"
    points["remote_assignments"] = np.nan
    points["hbm_working_set_bytes"] = np.nan
    if counts_path.is_file():
        counts = pd.read_csv(counts_path)
        points = points.drop(columns=["remote_assignments", "hbm_working_set_bytes"]).merge(
            counts[["gpu", "model", "suite", "tokens_per_rank", "active_experts", "remote_assignments"]],
            on=["gpu", "model", "suite", "tokens_per_rank"],
            how="left",
        )
        points["hbm_working_set_bytes"] = points["active_experts"] * expert_weight_bytes(
            points["hidden"], points["intermediate"]
        )
        points = points.drop(columns=["active_experts"])
    return add_speedups(_order(points))


def load_run_points(run_dir: Path) -> pd.DataFrame:
    """A measured run's points.csv as long points (source = the run directory's name).

    Rows whose status is not "ok" are kept but carry no latency-derived numbers. The speedup is recomputed
    from the latencies (the recorded one is kept as `speedup_recorded` when present)."""
    run_dir = Path(run_dir)
    points = _read_csv(run_dir / "points.csv", f"points.csv of run {run_dir}")
    missing = [c for c in REQUIRED_POINT_COLUMNS if c not in points.columns]
    if missing:
        raise ValueError(
            f"{run_dir / 'points.csv'} lacks columns {missing}; a run's points.csv needs "
            f"{list(REQUIRED_POINT_COLUMNS)} (see docs/ARCHITECTURE.md)"
        )
    for column in OPTIONAL_POINT_COLUMNS:
        if column not in points.columns:
            points[column] = np.nan
    points["status"] = points["status"].fillna("ok").astype(str)
    if "speedup" in points.columns:
        points = points.rename(columns={"speedup": "speedup_recorded"})
    points["source"] = run_dir.name
    if "total_tokens" not in points or points["total_tokens"].isna().any():
        points["total_tokens"] = points["tokens_per_rank"] * points["num_ranks"]
    return add_speedups(_order(points))


def _order(points: pd.DataFrame) -> pd.DataFrame:
    return points.sort_values(POINT_KEY + ["operator"], kind="stable").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------
# Speedups, means, throughput
# ---------------------------------------------------------------------------------------------------------------


def add_speedups(points: pd.DataFrame) -> pd.DataFrame:
    """Add `speedup` = latency of the point's baseline operator / this row's latency.

    The baseline row of every point must be present and "ok"; a point whose baseline was skipped gets NaN
    speedups. Raises ValueError when a suite names no single baseline or a row lacks its baseline."""
    points = points.copy()
    ok = points["status"].eq("ok") & points["latency_us"].gt(0)
    baselines_per_suite = points.groupby(SUITE_KEY)["baseline"].nunique()
    mixed = baselines_per_suite[baselines_per_suite > 1]
    if not mixed.empty:
        raise ValueError(f"each suite needs one baseline operator; these name several: {list(mixed.index)}")
    is_baseline_row = points["operator"].eq(points["baseline"])
    base = points[is_baseline_row & ok].set_index(POINT_KEY)["latency_us"]
    if base.index.has_duplicates:
        raise ValueError(
            "a point has two rows for its baseline operator: " + str(base.index[base.index.duplicated()][0])
        )
    keys = pd.MultiIndex.from_frame(points[POINT_KEY])
    base_latency = base.reindex(keys).to_numpy()
    lacking = (
        ~is_baseline_row
        & points["baseline"].notna()
        & ~keys.isin(points[is_baseline_row].set_index(POINT_KEY).index)
    )
    if lacking.any():
        first = points[lacking].iloc[0]
        raise ValueError(
            f"no row for baseline operator {first['baseline']!r} at {dict(first[POINT_KEY])}: every point needs "
            "its suite's baseline measured beside the operators"
        )
    points["speedup"] = np.where(ok, base_latency / points["latency_us"].to_numpy(), np.nan)
    return points


def geometric_mean(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0 or (values <= 0).any():
        return float("nan")
    return float(np.exp(np.log(values).mean()))


def suite_means(points: pd.DataFrame, overall_label: str = "all") -> pd.DataFrame:
    """Mean speedup of every operator over its suite's baseline, per model and over all models of a suite.

    Returns columns source, gpu, suite, model (or `overall_label` for the all-models mean, present only when a
    suite has more than one model), operator, baseline, points, mean_speedup (arithmetic mean of the per-point
    ratios), geomean_speedup, min_speedup, max_speedup, faster_points (ratios above 1)."""
    rows = points[points["operator"].ne(points["baseline"]) & points["speedup"].notna()]
    groups = []
    for model_level in ("model", "overall"):
        key = ["source", "gpu", "suite", "operator", "baseline"] + (
            ["model"] if model_level == "model" else []
        )
        for values, group in rows.groupby(key, sort=False):
            entry = dict(zip(key, values))
            if model_level == "overall":
                if group["model"].nunique() < 2:
                    continue
                entry["model"] = overall_label
            ratios = group["speedup"].to_numpy()
            entry.update(
                points=len(ratios),
                mean_speedup=float(ratios.mean()),
                geomean_speedup=geometric_mean(ratios),
                min_speedup=float(ratios.min()),
                max_speedup=float(ratios.max()),
                faster_points=int((ratios > 1).sum()),
            )
            groups.append(entry)
    columns = [
        "source",
        "gpu",
        "suite",
        "model",
        "operator",
        "baseline",
        "points",
        "mean_speedup",
        "geomean_speedup",
        "min_speedup",
        "max_speedup",
        "faster_points",
    ]
    means = pd.DataFrame(groups, columns=columns)
    # stable order: per source, GPU, suite and operator, each model then the all-models mean
    overall = means["model"].eq(overall_label)
    means = means.assign(_overall=overall).sort_values(
        ["source", "gpu", "suite", "operator", "_overall", "model"], kind="stable"
    )
    return means.drop(columns="_overall").reset_index(drop=True)


def add_throughput(points: pd.DataFrame) -> pd.DataFrame:
    """Add `tflops`, `hbm_gbps` and `nvlink_gbps` (the Section 6.4 models); NaN where a count is missing."""
    points = points.copy()
    ok = points["status"].eq("ok")
    latency = points["latency_us"].where(ok)
    points["tflops"] = effective_tflops(
        points["assignments"], points["hidden"], points["intermediate"], latency
    )
    points["hbm_gbps"] = hbm_working_set_gbps(points["hbm_working_set_bytes"], latency)
    points["nvlink_gbps"] = nvlink_payload_gbps(points["remote_assignments"], points["hidden"], latency)
    return points


def analyze(points: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Speedups and throughput per point, and the suite means: the whole analysis in one call."""
    points = add_throughput(add_speedups(points))
    return points, suite_means(points)
