"""The partition-size and overlap ablations of GC-MoE, from several sweep runs.

Each run directory is one setting: a sweep with ``--dispatch-sms N`` (the dispatch-partition request) and / or
``--overlap on|off`` (dispatch and W1 as concurrent graph roots, or W1 after dispatch). Its points.csv rows carry
the setting (``dispatch_sm_request``, ``overlap``) and, for GC-MoE on a kernel backend, the partition it actually
ran on (``comm_sms``, ``compute_sms``); rows of runs written before those columns existed take the request and
the overlap from env.json's profile (such runs had no overlap switch: on) and the partition from the row's note.

`run_ablation` groups the ok rows of every run by (model, suite, operator, tokens per rank) and setting, and
writes into one output directory:

- partition.{md,csv}: per setting (overlap, dispatch request, communication / compute SMs) the mean latency over
  the runs of that setting, per token count, and the speedup against dispatch request 4 (latency at request 4 /
  latency, same overlap): above 1 is faster than request 4;
- overlap.{md,csv}: per setting and token count, the latency with the overlap on and off and off / on (above 1:
  the overlap saves that much);
- partition-latency.{png,pdf}: latency against communication SMs, one panel per model, one curve per token
  count (overlap off dashed); requests that give the same partition (2 and 4 on an H200) are one point there,
  their mean.

Runs that cannot be compared are refused: different GPU kinds or devices, rank counts, L2 modes, or a model name
with different shapes. Nothing is ever overwritten: if any output file exists, nothing is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import results
from .report import DECIMALS, SUITE_NAMES, _fmt, gpu_name, model_name, operator_name

REFERENCE_REQUEST = 4  # the operator's SM90 default: speedups are against it
KEY = ["model", "suite", "operator", "tokens_per_rank"]
SETTING = ["overlap", "dispatch_sm_request", "comm_sms", "compute_sms"]
REQUIRED_COLUMNS = ("gpu", "model", "suite", "tokens_per_rank", "num_ranks", "hidden", "intermediate", "operator",
                    "latency_us", "status")
# what makes two runs' rows of one model comparable (beside the GPU, the rank count and the L2 mode)
SHAPE_COLUMNS = ("hidden", "intermediate", "num_experts", "topk", "num_shared_experts")
PARTITION_CSV_COLUMNS = SETTING + KEY + ["latency_us", "runs", "run_ids", "speedup_vs_request_4"]
OVERLAP_CSV_COLUMNS = ["model", "suite", "operator", "dispatch_sm_request", "comm_sms", "compute_sms",
                       "tokens_per_rank", "latency_on_us", "latency_off_us", "off_over_on", "runs_on", "runs_off"]
FIGURE_NAME = "partition-latency"
FIGURE_FORMATS = ("png", "pdf")


class AblationError(ValueError):
    """Runs that cannot be compared, or output that would overwrite a file."""


@dataclass
class Run:
    path: Path
    env: dict[str, Any]
    points: pd.DataFrame  # its ok rows, settings filled

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class AblationFiles:
    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)

    def all_paths(self) -> list[Path]:
        return self.tables + self.figures


# ---------------------------------------------------------------------------------------------------------------
# Loading and checking runs
# ---------------------------------------------------------------------------------------------------------------


def load_run(run_dir: Path) -> Run:
    """A sweep run's env.json and ok points, each row with its setting (see the module docstring)."""
    run_dir = Path(run_dir)
    env = results.RunWriter(run_dir).read_env()  # RunDirError when it is not a run directory
    path = run_dir / "points.csv"
    if not path.is_file():
        raise FileNotFoundError(f"points.csv of run {run_dir} not found (was the sweep interrupted before its first "
                                f"point?)")
    points = pd.read_csv(path, keep_default_na=False, na_values=[""])
    missing = [c for c in REQUIRED_COLUMNS if c not in points.columns]
    if missing:
        raise AblationError(f"{path} lacks columns {missing}: not a points.csv of a sweep run")
    profile = env.get("profile") or {}
    for column in SHAPE_COLUMNS + ("l2_mode", "reason"):
        if column not in points.columns:
            points[column] = np.nan
    if "dispatch_sm_request" not in points.columns:  # written before the setting columns existed
        points["dispatch_sm_request"] = profile.get("dispatch_sm_request")
    if "overlap" not in points.columns:
        points["overlap"] = profile.get("overlap", "on")
    if "comm_sms" not in points.columns or "compute_sms" not in points.columns:
        parts = [results.partition_from_note(r if isinstance(r, str) else "") for r in points["reason"]]
        points["comm_sms"] = [p[0] if p else np.nan for p in parts]
        points["compute_sms"] = [p[1] if p else np.nan for p in parts]
    for column in ("dispatch_sm_request", "comm_sms", "compute_sms"):
        points[column] = pd.to_numeric(points[column], errors="coerce").astype("Int64")
    points["overlap"] = points["overlap"].fillna("on").astype(str)
    ok = points["status"].fillna("ok").eq("ok") & pd.to_numeric(points["latency_us"], errors="coerce").gt(0)
    points = points[ok].copy()
    points["latency_us"] = points["latency_us"].astype(float)
    points["source"] = run_dir.name
    return Run(run_dir, env, points.reset_index(drop=True))


def _describe(values) -> str:
    return ", ".join(str(v) for v in values)


def check_comparable(runs: list[Run]) -> None:
    """Raise AblationError naming the runs and the difference when they do not measure one GPU kind, device,
    rank count, L2 mode, and the same shape for every model name they share."""
    if not runs:
        raise AblationError("no run directory given")
    seen: dict[Path, str] = {}
    for run in runs:
        resolved = run.path.resolve()
        if resolved in seen:
            raise AblationError(f"{run.path} is given twice: each run counts once in the means")
        seen[resolved] = run.name
    first = runs[0]

    def one(run: Run, what: str, values) -> tuple:
        values = tuple(sorted({str(v) for v in values if not (isinstance(v, float) and math.isnan(v))}))
        if len(values) > 1:
            raise AblationError(f"run {run.path} mixes {what}s {_describe(values)}; an ablation compares runs of one")
        return values

    def same(what: str, get) -> None:
        want = get(first)
        for run in runs[1:]:
            got = get(run)
            if got != want:
                raise AblationError(f"runs of different {what}s cannot be compared: {first.path} has "
                                    f"{_describe(want) or 'none'}, {run.path} has {_describe(got) or 'none'}")

    same("GPU kind", lambda r: one(r, "GPU kind", r.points["gpu"]) or (str((r.env.get("profile") or {}).get("gpu")),))
    same("device", lambda r: tuple(sorted({str(g) for g in r.env.get("gpus") or []})))
    same("rank count", lambda r: one(r, "rank count", r.points["num_ranks"]) or (str(r.env.get("world_size")),))
    same("L2 mode", lambda r: one(r, "L2 mode", r.points["l2_mode"]))
    shapes: dict[str, tuple[tuple, Run]] = {}
    for run in runs:
        for model, rows in run.points.groupby("model"):
            for shape in rows[list(SHAPE_COLUMNS)].drop_duplicates().itertuples(index=False):
                shape = tuple(None if pd.isna(v) else int(v) for v in shape)
                if model not in shapes:
                    shapes[model] = (shape, run)
                    continue
                want, where = shapes[model]
                differs = [f"{c} {a} vs {b}" for c, a, b in zip(SHAPE_COLUMNS, want, shape)
                           if a is not None and b is not None and a != b]
                if differs:
                    raise AblationError(f"model {model!r} has different shapes in {where.path} and {run.path} "
                                        f"({', '.join(differs)}): runs of different models cannot be compared")


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------


def setting_means(points: pd.DataFrame) -> pd.DataFrame:
    """Mean latency per (model, suite, operator, tokens) and setting, over the runs of that setting."""
    columns = KEY + SETTING + ["latency_us", "runs", "run_ids"]
    if points.empty:
        return pd.DataFrame(columns=columns)
    grouped = points.groupby(KEY + SETTING, dropna=False, sort=False)
    means = grouped.agg(latency_us=("latency_us", "mean"), runs=("source", "nunique"),
                        run_ids=("source", lambda s: ";".join(sorted(set(s)))))
    return means.reset_index()[columns]


def _sorted(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Sorted by `by`, overlap "on" before "off", missing requests / partitions last."""
    if "overlap" in by:
        frame = frame.assign(_off=frame["overlap"].ne("on"))
        by = ["_off" if c == "overlap" else c for c in by]
    ordered = frame.sort_values(by, kind="stable", na_position="last")
    return ordered.drop(columns=[c for c in ("_off",) if c in ordered.columns]).reset_index(drop=True)


def partition_table(points: pd.DataFrame) -> pd.DataFrame:
    """Long table: one row per (setting, model, suite, operator, tokens): mean latency, runs, and the speedup
    against dispatch request 4 at the same overlap (empty where request 4 was not measured)."""
    means = setting_means(points)
    at_reference = means[means["dispatch_sm_request"].eq(REFERENCE_REQUEST).fillna(False)]
    reference = at_reference.groupby(KEY + ["overlap"], dropna=False)["latency_us"].mean().rename("_reference")
    means = means.join(reference, on=KEY + ["overlap"])
    means["speedup_vs_request_4"] = means["_reference"] / means["latency_us"]
    means = means.drop(columns="_reference")
    ordered = _sorted(means, ["model", "suite", "operator", "overlap", "dispatch_sm_request", "comm_sms",
                              "compute_sms", "tokens_per_rank"])
    return ordered[PARTITION_CSV_COLUMNS]


def overlap_table(points: pd.DataFrame) -> pd.DataFrame:
    """Long table: one row per (model, suite, operator, partition setting, tokens) measured with the overlap on
    and off: both mean latencies and off / on."""
    means = setting_means(points)
    pair_key = KEY + ["dispatch_sm_request", "comm_sms", "compute_sms"]
    on = means[means["overlap"].eq("on")].drop(columns=["overlap", "run_ids"])
    off = means[means["overlap"].eq("off")].drop(columns=["overlap", "run_ids"])
    pairs = on.merge(off, on=pair_key, suffixes=("_on", "_off"))
    pairs = pairs.rename(columns={"latency_us_on": "latency_on_us", "latency_us_off": "latency_off_us"})
    pairs["off_over_on"] = pairs["latency_off_us"] / pairs["latency_on_us"]
    return _sorted(pairs, ["model", "suite", "operator", "dispatch_sm_request", "comm_sms", "compute_sms",
                           "tokens_per_rank"])[OVERLAP_CSV_COLUMNS]


def _int(value) -> str:
    return "–" if value is None or pd.isna(value) else str(int(value))


def _markdown_table(headers: list[str], rows: list[list[str]], text_columns: int) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join(["---"] * text_columns + ["---:"] * (len(headers) - text_columns)) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _section(model: str, suite: str, operator: str) -> str:
    return f"## {model_name(model)}, {SUITE_NAMES.get(suite, suite)}, {operator_name(operator)}"


def _runs_line(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        settings = run.points[["dispatch_sm_request", "overlap"]].drop_duplicates()
        described = "; ".join(f"request {_int(r.dispatch_sm_request)}, overlap {r.overlap}"
                              for r in settings.itertuples(index=False))
        parts.append(f"{run.name} ({described or 'no ok rows'})")
    return "Runs: " + ", ".join(parts) + "."


def _title(runs: list[Run]) -> str:
    gpu = str(runs[0].points["gpu"].iloc[0]) if not runs[0].points.empty else str(
        (runs[0].env.get("profile") or {}).get("gpu", "?"))
    ranks = runs[0].env.get("world_size")
    return f"GC-MoE on {gpu_name(gpu, int(ranks) if ranks else None)}"


def partition_markdown(table: pd.DataFrame, runs: list[Run]) -> str:
    explanation = ("Mean latency per invocation (µs; each run's slowest-rank median, averaged over the runs of "
                   "one setting) per dispatch-partition request, with the communication / compute SMs the operator "
                   f"ran on (– where its note does not say). `vs {REFERENCE_REQUEST}` = latency at request "
                   f"{REFERENCE_REQUEST} / latency at the same overlap: above 1 is faster than request "
                   f"{REFERENCE_REQUEST}.")
    lines = [f"# Partition-size ablation: {_title(runs)}", "", explanation, "", _runs_line(runs), ""]
    if table.empty:
        return "\n".join(lines + ["No ok point in these runs.", ""])
    tokens = sorted(table["tokens_per_rank"].unique())
    headers = ["Overlap", "Request", "Comm SMs", "Compute SMs", "Runs"] + [f"T={t} (µs)" for t in tokens] + [
        f"T={t} vs {REFERENCE_REQUEST}" for t in tokens]
    for (model, suite, operator), group in table.groupby(["model", "suite", "operator"], sort=False):
        rows = []
        for setting, cells in group.groupby(SETTING, dropna=False, sort=False):
            by_tokens = cells.set_index("tokens_per_rank")
            runs_here = len({r for ids in cells["run_ids"] for r in ids.split(";")})
            row = [str(setting[0]), _int(setting[1]), _int(setting[2]), _int(setting[3]), str(runs_here)]
            row += [_fmt(by_tokens["latency_us"].get(t), DECIMALS["latency_us"]) for t in tokens]
            row += [_fmt(by_tokens["speedup_vs_request_4"].get(t), DECIMALS["speedup"]) for t in tokens]
            rows.append(row)
        lines += [_section(model, suite, operator), ""] + _markdown_table(headers, rows, 1) + [""]
    return "\n".join(lines)


def overlap_markdown(table: pd.DataFrame, runs: list[Run]) -> str:
    explanation = ("Mean latency per invocation (µs) with dispatch and W1 as concurrent graph roots (on) and "
                   "with W1 after dispatch (off), at the same partition; off/on above 1 is what the overlap saves.")
    lines = [f"# Overlap ablation: {_title(runs)}", "", explanation, "", _runs_line(runs), ""]
    if table.empty:
        missing = ("No point was measured with the overlap both on and off at one partition setting: add a run "
                   "with `--overlap off` beside one with the overlap on.")
        return "\n".join(lines + [missing, ""])
    headers = ["Request", "Comm SMs", "Compute SMs", "Tokens/rank", "On (µs)", "Off (µs)", "Off/on"]
    for (model, suite, operator), group in table.groupby(["model", "suite", "operator"], sort=False):
        rows = [[_int(r.dispatch_sm_request), _int(r.comm_sms), _int(r.compute_sms), _int(r.tokens_per_rank),
                 _fmt(r.latency_on_us, DECIMALS["latency_us"]), _fmt(r.latency_off_us, DECIMALS["latency_us"]),
                 _fmt(r.off_over_on, DECIMALS["speedup"])] for r in group.itertuples(index=False)]
        lines += [_section(model, suite, operator), ""] + _markdown_table(headers, rows, 0) + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The figure
# ---------------------------------------------------------------------------------------------------------------


def partition_figure(table: pd.DataFrame, title: str):
    """Latency against communication SMs (the dispatch request where the partition is not recorded): one panel
    per model, one curve per token count (and suite / operator where there are several), overlap off dashed."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    plotted = table.assign(x=table["comm_sms"].fillna(table["dispatch_sm_request"]))
    plotted = plotted[plotted["x"].notna()]
    models = list(dict.fromkeys(table["model"])) or ["(none)"]
    figure = Figure(figsize=(max(7.5, 5.5 * len(models)), 5.0), layout="constrained")
    axes_list = figure.subplots(1, len(models), squeeze=False)[0]
    figure.suptitle(title, fontsize=12)
    tokens = sorted(table["tokens_per_rank"].unique())
    colours = colormaps["viridis"]
    several_suites = table["suite"].nunique() > 1
    several_operators = table["operator"].nunique() > 1
    entries = 0
    for axes, model in zip(axes_list, models):
        rows = plotted[plotted["model"].eq(model)]
        axes.set_title(model_name(model), fontsize=10)
        axes.set_xlabel("communication-partition SMs (dispatch request where not recorded)")
        axes.set_ylabel("latency per invocation (µs)")
        axes.grid(True, alpha=0.3)
        if rows.empty:
            axes.text(0.5, 0.5, "no dispatch request or partition recorded", ha="center", va="center",
                      transform=axes.transAxes)
            continue
        rows = rows.assign(_off=rows["overlap"].ne("on"))
        for (suite, operator, t, _, overlap), curve in rows.groupby(["suite", "operator", "tokens_per_rank", "_off",
                                                                     "overlap"], sort=True):
            curve = curve.groupby("x")["latency_us"].mean().sort_index()
            label = f"T={t}" + (f", {suite}" if several_suites else "") + (
                f", {operator_name(operator)}" if several_operators else "") + (
                ", overlap off" if overlap == "off" else "")
            colour = colours(tokens.index(t) / max(len(tokens) - 1, 1) * 0.9)
            axes.plot(curve.index.astype(float), curve.to_numpy(), color=colour, label=label,
                      linestyle="--" if overlap == "off" else "-", marker="x" if overlap == "off" else "o")
        ticks = sorted(rows["x"].astype(int).unique())
        axes.set_xticks(ticks, [str(x) for x in ticks])
        axes.set_ylim(bottom=0)
        axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
        entries = max(entries, len(axes.get_legend_handles_labels()[0]))
    figure.set_figheight(4.5 + 0.12 * entries)
    return figure


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def output_paths(out: Path) -> list[Path]:
    out = Path(out)
    tables = [out / f"{name}.{suffix}" for name in ("partition", "overlap") for suffix in ("md", "csv")]
    return tables + [out / f"{FIGURE_NAME}.{fmt}" for fmt in FIGURE_FORMATS]


def _free_directory(out: Path) -> Path:
    for n in range(2, 1000):
        candidate = out.with_name(f"{out.name}-{n}")
        if not any(p.exists() for p in output_paths(candidate)):
            return candidate
    return out.with_name(f"{out.name}-new")


def _write_exclusive(path: Path, text: str) -> None:
    with path.open("x", encoding="utf-8", newline="") as f:
        f.write(text)


def run_ablation(run_dirs: list[Path], out: Path) -> AblationFiles:
    """Read the runs, check they compare, and write the two tables (Markdown + CSV) and the figure into `out`.
    Raises AblationError before writing anything when an output file exists or the runs do not compare."""
    out = Path(out)
    taken = [p for p in output_paths(out) if p.exists()]
    if taken:
        raise AblationError(f"{out} already holds {', '.join(p.name for p in taken)}: the ablation never overwrites "
                            f"results; choose another --out (e.g. {_free_directory(out)}) or move those files")
    runs = [load_run(Path(d)) for d in run_dirs]
    check_comparable(runs)
    points = pd.concat([run.points for run in runs], ignore_index=True)
    partition, overlap = partition_table(points), overlap_table(points)
    out.mkdir(parents=True, exist_ok=True)
    paths = output_paths(out)
    files = AblationFiles()
    for table, markdown, md_path, csv_path in (
            (partition, partition_markdown(partition, runs), paths[0], paths[1]),
            (overlap, overlap_markdown(overlap, runs), paths[2], paths[3])):
        _write_exclusive(md_path, markdown)
        _write_exclusive(csv_path, table.to_csv(index=False, float_format="%.6f"))
        files.tables += [md_path, csv_path]
    from .figures import _save  # matplotlib only here

    figure = partition_figure(partition, f"Partition-size ablation, {_title(runs)}\nlatency against "
                                         f"communication SMs")
    files.figures = _save(figure, out, FIGURE_NAME, FIGURE_FORMATS, exclusive=True)
    return files
