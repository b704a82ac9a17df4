"""CI regression tracking: compare a run's speedups with a committed baseline file.

A baseline file (results/baselines/<gpu>.csv, written by `write_baseline`) holds one row per measured point
(`kind` = "point": the operator's speedup over its suite's baseline at one token count) and one per suite mean
(`kind` = "mean": the arithmetic mean of those ratios, per model and, for suites of several models, over all
models as model "all"). `run_compare` recomputes the same numbers from a run directory and labels each one:

- "slower":  current < baseline x (1 - tolerance)  -> a regression, exit code 1;
- "faster":  current > baseline x (1 + tolerance);
- "same":    otherwise;
- "missing": in the baseline but not measured (or not "ok") in the run -> a regression unless allowed;
- "new":     measured in the run but absent from the baseline (reported, never a failure).

Speedups, not latencies, are compared: a ratio of two operators measured in one run on one machine cancels most
of the machine's speed, so a baseline stays meaningful across runners of the same GPU kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from . import analysis

BASELINE_COLUMNS = [
    "kind",
    "gpu",
    "model",
    "suite",
    "operator",
    "baseline",
    "tokens_per_rank",
    "points",
    "speedup",
    "latency_us",
    "run",
]
MATCH_KEY = ["kind", "gpu", "model", "suite", "operator", "baseline", "tokens_per_rank"]
VERDICT_STYLES = {
    "same": "white",
    "faster": "green",
    "slower": "bold red",
    "missing": "bold red",
    "new": "cyan",
}
EXIT_OK, EXIT_REGRESSION = 0, 1


def run_speedups(run_dir: Path) -> pd.DataFrame:
    """The run's per-point speedups and suite means in the baseline file's columns."""
    points = analysis.load_run_points(Path(run_dir))
    ok = points[points["status"].eq("ok") & points["speedup"].notna()]
    compared = ok[ok["operator"].ne(ok["baseline"])]
    rows = compared.assign(kind="point", points=1, run=Path(run_dir).name)
    rows = rows[BASELINE_COLUMNS].copy()
    means = analysis.suite_means(ok)
    mean_rows = means.assign(
        kind="mean",
        tokens_per_rank=np.nan,
        speedup=means["mean_speedup"],
        latency_us=np.nan,
        run=Path(run_dir).name,
    )[BASELINE_COLUMNS]
    table = pd.concat([rows, mean_rows], ignore_index=True)
    return table.astype({"tokens_per_rank": "Int64", "points": "Int64"})


def write_baseline(run_dir: Path, path: Path) -> Path:
    """Write the baseline file `path` (CSV, overwritten if present) from the run in `run_dir`.

    :param run_dir: a measured run directory (results/<gpu>/<run-id>/) whose points.csv has at least one
        operator besides each suite's baseline.
    :param path: where to write it, conventionally results/baselines/<gpu>.csv.
    :return: the path written.
    """
    table = run_speedups(run_dir)
    if table.empty:
        raise ValueError(
            f"run {run_dir} has no ok point of an operator besides its suite's baseline to track"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False, float_format="%.6f")
    return path


def read_baseline(path: Path) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"baseline file not found: {path} (write one with `gcmoe-bench compare RUN_DIR --baseline FILE --write-baseline`)")
    table = pd.read_csv(path)
    missing = [c for c in MATCH_KEY + ["speedup"] if c not in table.columns]
    if missing:
        raise ValueError(
            f"{path} is not a baseline file: it lacks columns {missing}; expected {BASELINE_COLUMNS}"
        )
    bad_kinds = set(table["kind"]) - {"point", "mean"}
    if bad_kinds:
        raise ValueError(f"{path}: unknown kind(s) {sorted(bad_kinds)}; allowed: point, mean")
    return table.astype({"tokens_per_rank": "Int64"})


def compare(run_dir: Path, baseline: Path, tolerance: float = 0.03) -> pd.DataFrame:
    """Match the run's speedups and means with the baseline file's and label each same/faster/slower/missing/new.

    Returns the key columns plus baseline_speedup, current_speedup, change (current / baseline - 1) and verdict."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must lie in [0, 1) (a fraction, 0.03 = 3%); got {tolerance}")
    reference = read_baseline(baseline)
    current = run_speedups(run_dir)
    run_gpus, baseline_gpus = set(current["gpu"]), set(reference["gpu"])
    if run_gpus and baseline_gpus and not run_gpus & baseline_gpus:
        raise ValueError(
            f"baseline {baseline} is for GPU kind(s) {sorted(baseline_gpus)} but run {run_dir} measured "
            f"{sorted(run_gpus)}: compare a run with the baseline of its own GPU kind"
        )
    merged = reference[MATCH_KEY + ["speedup"]].merge(
        current[MATCH_KEY + ["speedup"]],
        on=MATCH_KEY,
        how="outer",
        suffixes=("_baseline", "_current"),
        indicator=True,
    )
    merged = merged.rename(
        columns={"speedup_baseline": "baseline_speedup", "speedup_current": "current_speedup"}
    )
    merged["change"] = merged["current_speedup"] / merged["baseline_speedup"] - 1
    verdict = np.select(
        [
            merged["_merge"].eq("left_only"),
            merged["_merge"].eq("right_only"),
            merged["current_speedup"] < merged["baseline_speedup"] * (1 - tolerance),
            merged["current_speedup"] > merged["baseline_speedup"] * (1 + tolerance),
        ],
        ["missing", "new", "slower", "faster"],
        default="same",
    )
    merged["verdict"] = verdict
    merged = merged.drop(columns="_merge")
    order = {"point": 0, "mean": 1}
    merged = merged.sort_values(
        ["kind", "gpu", "suite", "model", "operator", "tokens_per_rank"],
        key=lambda s: s.map(order) if s.name == "kind" else s,
        na_position="last",
    )
    return merged.reset_index(drop=True)


def benchmark_json(comparison: pd.DataFrame, tolerance: float) -> list[dict]:
    """The run's numbers as github-action-benchmark `customBiggerIsBetter` entries: [{name, unit, value, extra}]."""
    entries = []
    for _, row in comparison[comparison["current_speedup"].notna()].iterrows():
        entries.append(
            {
                "name": _entry_name(row),
                "unit": "x speedup",
                "value": round(float(row["current_speedup"]), 6),
                "extra": (
                    f"baseline {row['baseline_speedup']:.4f}, {row['verdict']} at tolerance {tolerance:.1%}"
                    if pd.notna(row["baseline_speedup"])
                    else "no baseline yet (new)"
                ),
            }
        )
    return entries


def _entry_name(row) -> str:
    where = f"{row['gpu']}/{row['model']}/{row['suite']}: {row['operator']} vs {row['baseline']}"
    if row["kind"] == "mean":
        return f"{where}, mean speedup"
    return f"{where}, {int(row['tokens_per_rank'])} tokens/rank"


def print_comparison(comparison: pd.DataFrame, tolerance: float, console: Console) -> None:
    """One line per point and mean: baseline and current speedup, relative change, verdict (coloured)."""
    gpus = ", ".join(sorted(comparison["gpu"].dropna().unique()))
    table = Table(title=f"{gpus}: speedups against the baseline file (tolerance {tolerance:.1%})")
    table.add_column("model", overflow="fold")
    table.add_column("suite", overflow="fold")
    table.add_column("operator vs baseline", overflow="fold")
    table.add_column("tokens/rank", justify="right")
    table.add_column("baseline", justify="right")
    table.add_column("current", justify="right")
    table.add_column("change", justify="right")
    table.add_column("verdict")
    for _, row in comparison.iterrows():
        style = VERDICT_STYLES[row["verdict"]]
        table.add_row(
            row["model"],
            row["suite"],
            f"{row['operator']} vs {row['baseline']}",
            "mean" if row["kind"] == "mean" else str(int(row["tokens_per_rank"])),
            _number(row["baseline_speedup"]),
            _number(row["current_speedup"]),
            "" if pd.isna(row["change"]) else f"{row['change']:+.2%}",
            f"[{style}]{row['verdict']}[/{style}]",
        )
    console.print(table)


def _number(value) -> str:
    return "–" if pd.isna(value) else f"{value:.4f}"


def run_compare(
    run_dir: Path,
    baseline: Path,
    tolerance: float = 0.03,
    json_out: Path | None = None,
    allow_missing: bool = False,
    console: Console | None = None,
) -> int:
    """Compare a run's per-point speedups and suite means with a baseline file; return the exit code.

    :param run_dir: the measured run directory (results/<gpu>/<run-id>/ with points.csv).
    :param baseline: the baseline file to compare with, conventionally results/baselines/<gpu>.csv
        (written by write_baseline).
    :param tolerance: allowed relative drop, a fraction: a point or mean whose speedup falls below
        baseline x (1 - tolerance) is "slower" and fails the comparison; above baseline x (1 + tolerance) it is
        "faster"; in between "same". Default 0.03 (3%).
    :param json_out: if given, write the run's speedups there as github-action-benchmark `customBiggerIsBetter`
        JSON ([{name, unit, value, extra}]), which benchmark dashboards plot over time.
    :param allow_missing: do not fail when a baseline point or mean is absent from the run (a partial sweep).
    :param console: rich console for the table (default: stdout).
    :return: 0 when nothing regressed, 1 when a point or a mean is slower (or missing, unless allowed).
    """
    if console is None:
        console = Console()
        if not console.is_terminal:
            console.width = max(console.width, 140)  # CI logs: one line per row rather than folded cells
    comparison = compare(run_dir, baseline, tolerance)
    print_comparison(comparison, tolerance, console)
    if json_out is not None:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(benchmark_json(comparison, tolerance), indent=2) + "\n", encoding="utf-8"
        )
    failing = {"slower"} | (set() if allow_missing else {"missing"})
    counts = comparison["verdict"].value_counts()
    summary = ", ".join(f"{counts.get(v, 0)} {v}" for v in ("same", "faster", "slower", "missing", "new"))
    regressed = comparison["verdict"].isin(failing).any()
    if regressed:
        console.print(f"[bold red]regression[/bold red]: {summary}")
        return EXIT_REGRESSION
    console.print(f"[green]no regression[/green]: {summary}")
    return EXIT_OK
