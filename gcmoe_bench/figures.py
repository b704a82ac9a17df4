"""The paper's Figures 3-8 (latency and speedup against tokens per rank) and one figure per measured group.

Each figure has two panels sharing a log2 token axis: slowest-rank latency in microseconds (left) and speedup
over the suite's baseline (right, with the speedup = 1 line). Published curves are solid; measured curves of the
same GPU kind are dashed beside them. Figures of measured runs show the paper's speedup for the same model and
suite as a grey dotted curve, labelled with the paper's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from .analysis import PAPER_SOURCE
from .report import (
    DSV,
    GLM,
    MeasuredGroup,
    gpu_name,
    model_name,
    operator_name,
    paper_counterpart,
)

# One colour per operator family in every figure (published solid, measured dashed): baselines orange, GC-MoE
# blue, GC-MoE unfused green; anything else from the fallback cycle.
OPERATOR_COLOURS = {
    "mega": "#d95f02",
    "mega-se": "#d95f02",
    "mega-unfused": "#d95f02",
    "mega-port": "#d95f02",
    "deepgemm": "#d95f02",
    "gc": "#1b6ca8",
    "gc-se": "#1b6ca8",
    "gc-unfused": "#2ca02c",
    "reference": "#7b3294",
}
FALLBACK_COLOURS = ("#c51b7d", "#4d4d4d", "#e6ab02", "#1b9e77", "#a6761d", "#666666")
MARKERS = {
    "mega": "s",
    "mega-se": "s",
    "mega-unfused": "s",
    "mega-port": "s",
    "deepgemm": "s",
    "gc-unfused": "^",
}


class _Colours:
    """Operator -> colour, stable within one figure."""

    def __init__(self):
        self._given: dict[str, str] = {}
        self._spare = iter(FALLBACK_COLOURS * 4)

    def __call__(self, operator: str) -> str:
        if operator not in self._given:
            self._given[operator] = OPERATOR_COLOURS.get(operator) or next(self._spare)
        return self._given[operator]


@dataclass(frozen=True)
class Curve:
    suite: str
    operator: str
    label: str


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    gpu: str
    model: str
    latency: tuple[Curve, ...]
    speedup: tuple[Curve, ...]


def _routed(name, gpu, model, number):
    return FigureSpec(
        name,
        f"Figure {number}: {model_name(model)} routed-expert decode on 8×{gpu_name(gpu)}",
        gpu,
        model,
        (Curve("routed", "mega", "Mega MoE"), Curve("routed", "gc", "GC-MoE")),
        (Curve("routed", "gc", "GC-MoE vs Mega MoE"),),
    )


def _shared_b300(name, model, number):
    return FigureSpec(
        name,
        f"Figure {number}: {model_name(model)} with fused shared experts on 8×B300",
        "b300",
        model,
        (
            Curve("shared", "mega-se", "Mega MoE, fused shared"),
            Curve("shared", "gc-se", "GC-MoE, fused shared"),
        ),
        (Curve("shared", "gc-se", "GC-MoE vs Mega MoE"),),
    )


PAPER_FIGURES: tuple[FigureSpec, ...] = (
    _routed("figure3", "h20", DSV, 3),
    _routed("figure4", "b300", GLM, 4),
    _routed("figure5", "b300", DSV, 5),
    FigureSpec(
        "figure6",
        "Figure 6: DeepSeek-V4.1-Flash with shared experts on 8×H20",
        "h20",
        DSV,
        (
            Curve("shared", "mega-unfused", "mega-unfused, baseline"),
            Curve("shared-ablation", "gc-unfused", "gc-unfused"),
            Curve("shared", "gc-se", "gc-se, fused"),
        ),
        (
            Curve("shared", "gc-se", "gc-se vs mega-unfused"),
            Curve("shared-ablation", "gc-se", "gc-se vs gc-unfused, fusion ablation"),
        ),
    ),
    _shared_b300("figure7", GLM, 7),
    _shared_b300("figure8", DSV, 8),
)


def _select(points: pd.DataFrame, source, gpu, model, suite, operator) -> pd.DataFrame:
    rows = points[
        points["source"].eq(source)
        & points["gpu"].eq(gpu)
        & points["model"].eq(model)
        & points["suite"].eq(suite)
        & points["operator"].eq(operator)
        & points["status"].eq("ok")
    ]
    return rows.sort_values("tokens_per_rank")


def _new_figure(title: str):
    figure = Figure(figsize=(11, 4.8), layout="constrained")
    latency_axes, speedup_axes = figure.subplots(1, 2)
    figure.suptitle(title, fontsize=12)
    latency_axes.set_title("Slowest-rank latency (lower is better)", fontsize=10)
    latency_axes.set_ylabel("latency per invocation (µs)")
    speedup_axes.set_title("Speedup over the baseline (higher is better)", fontsize=10)
    speedup_axes.set_ylabel("speedup = baseline latency / latency (×)")
    return figure, latency_axes, speedup_axes


def _finish(figure, latency_axes, speedup_axes, tokens: list[int]):
    tokens = sorted(set(tokens)) or [1]
    for axes in (latency_axes, speedup_axes):
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(tokens))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xticklabels([str(t) for t in tokens])
        axes.set_xlabel("tokens per rank (log2 scale)")
        axes.grid(True, which="major", alpha=0.3)
    latency_axes.set_ylim(bottom=0)
    speedup_axes.axhline(1.0, color="black", linewidth=1.0, linestyle="--", label="speedup = 1 (parity)")
    low, high = speedup_axes.get_ylim()
    speedup_axes.set_ylim(min(low, 0.95), max(high, 1.05))
    entries = 0
    for axes in (latency_axes, speedup_axes):
        # below the panel, so that no legend ever hides a curve; the figure grows with the longer legend
        axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
        entries = max(entries, len(axes.get_legend_handles_labels()[0]))
    figure.set_figheight(4.0 + 0.2 * entries)
    return figure


def _save(figure: Figure, directory: Path, name: str, formats: tuple[str, ...],
          exclusive: bool = False) -> list[Path]:
    """Write `name`.<fmt> for each format; `exclusive`: a file that already exists is an error (FileExistsError),
    never overwritten."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = directory / f"{name}.{fmt}"
        # No timestamps in the files, so regenerated figures only differ when the data do.
        metadata = {"CreationDate": None} if fmt == "pdf" else {"Software": None} if fmt == "png" else None
        if exclusive:
            with path.open("xb") as f:
                figure.savefig(f, format=fmt, dpi=150, metadata=metadata)
        else:
            figure.savefig(path, dpi=150, metadata=metadata)
        paths.append(path)
    return paths


def paper_figure(spec: FigureSpec, points: pd.DataFrame) -> Figure:
    """One of Figures 3-8: published curves, plus dashed measured curves of the same GPU kind if any."""
    figure, latency_axes, speedup_axes = _new_figure(spec.title)
    colour_of = _Colours()
    tokens: list[int] = []
    for curve in spec.latency:
        rows = _select(points, PAPER_SOURCE, spec.gpu, spec.model, curve.suite, curve.operator)
        latency_axes.plot(
            rows["tokens_per_rank"],
            rows["latency_us"],
            marker=MARKERS.get(curve.operator, "o"),
            color=OPERATOR_COLOURS.get(curve.operator),
            label=f"{curve.label} (paper)",
        )
        tokens += rows["tokens_per_rank"].astype(int).tolist()
    for i, curve in enumerate(spec.speedup):
        rows = _select(points, PAPER_SOURCE, spec.gpu, spec.model, curve.suite, curve.operator)
        # two ratios of one operator (Figure 6) take the colours of their two baselines' counterparts
        colour = colour_of(curve.operator) if i == 0 else OPERATOR_COLOURS["gc-unfused"]
        speedup_axes.plot(
            rows["tokens_per_rank"], rows["speedup"], marker="o", color=colour, label=f"{curve.label} (paper)"
        )
    suites = {c.suite for c in spec.latency + spec.speedup}
    measured = points[
        points["source"].ne(PAPER_SOURCE)
        & points["gpu"].eq(spec.gpu)
        & points["model"].eq(spec.model)
        & points["suite"].isin(suites)
        & points["status"].eq("ok")
    ]
    several_suites = len(suites) > 1
    for (source, suite, operator), rows in measured.groupby(["source", "suite", "operator"], sort=True):
        rows = rows.sort_values("tokens_per_rank")
        colour = colour_of(operator)
        measured_in = f"measured {source}" + (f", {suite} suite" if several_suites else "")
        # measured lines are dashed with x markers, beside the published solid ones
        measured_style = {"linestyle": "--", "marker": "x", "color": colour}
        latency_axes.plot(rows["tokens_per_rank"], rows["latency_us"], **measured_style,
                          label=f"{operator_name(operator)} ({measured_in})")
        if not rows["operator"].eq(rows["baseline"]).all():
            speedup_axes.plot(
                rows["tokens_per_rank"], rows["speedup"], **measured_style,
                label=f"{operator_name(operator)} vs {operator_name(rows['baseline'].iloc[0])} ({measured_in})",
            )
        tokens += rows["tokens_per_rank"].astype(int).tolist()
    return _finish(figure, latency_axes, speedup_axes, tokens)


def measured_figure(group: MeasuredGroup, points: pd.DataFrame) -> Figure:
    """Latency and speedup of one measured (run, model, suite), the paper's speedup beside it for orientation."""
    title = (
        f"{model_name(group.model)}, {group.suite} suite on {gpu_name(group.gpu, group.num_ranks)} "
        f"(measured, run {group.source})"
    )
    figure, latency_axes, speedup_axes = _new_figure(title)
    tokens: list[int] = []
    colour_of = _Colours()
    for operator in group.operators:
        rows = _select(points, group.source, group.gpu, group.model, group.suite, operator)
        colour = colour_of(operator)
        name = operator_name(operator) + (", baseline" if operator == group.baseline else "")
        latency_axes.plot(
            rows["tokens_per_rank"],
            rows["latency_us"],
            marker=MARKERS.get(operator, "o"),
            color=colour,
            label=name,
        )
        if operator != group.baseline:
            speedup_axes.plot(
                rows["tokens_per_rank"],
                rows["speedup"],
                marker="o",
                color=colour,
                label=f"{operator_name(operator)} vs {operator_name(group.baseline)}",
            )
        tokens += rows["tokens_per_rank"].astype(int).tolist()
    counterpart = paper_counterpart(points, group.gpu, group.model, group.suite)
    if counterpart:
        rows = _select(
            points, PAPER_SOURCE, counterpart.gpu, counterpart.model, group.suite, counterpart.operator
        )
        other = counterpart.gpu != group.gpu or counterpart.model != group.model
        label = (
            f"paper, 8×{gpu_name(counterpart.gpu)}: {operator_name(counterpart.operator)} vs "
            f"{operator_name(rows['baseline'].iloc[0])}" + (" (other hardware or shape)" if other else "")
        )
        speedup_axes.plot(
            rows["tokens_per_rank"], rows["speedup"], linestyle=":", marker=".", color="grey", label=label
        )
    return _finish(figure, latency_axes, speedup_axes, tokens)


def write_figures(
    points: pd.DataFrame,
    directory: Path,
    groups: list[MeasuredGroup],
    formats: tuple[str, ...] = ("png", "pdf"),
) -> dict[str, list[Path]]:
    """Write Figures 3-8 and one figure per measured group; returns name -> paths written."""
    directory = Path(directory)
    written: dict[str, list[Path]] = {}
    for spec in PAPER_FIGURES:
        written[spec.name] = _save(paper_figure(spec, points), directory, spec.name, formats)
    for group in groups:
        written[group.slug] = _save(measured_figure(group, points), directory, group.slug, formats)
    return written
