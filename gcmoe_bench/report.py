"""The paper's Tables 5-10 (Markdown, LaTeX booktabs, CSV) and Figures 3-8, from results/paper/ and measured runs.

`run_report` is the whole job: it reads the published points (results/paper/) and any measured run directories,
writes one file set per table, the figures (figures.py), the suite means, and an index `report.md`.

Where a measured run has the same GPU kind, model and suite as a paper table, its numbers sit beside the
published ones in that table (headers say "measured <run-id>"). Every measured (run, model, suite) also gets a
table and a figure of its own, with the paper's speedup for the same model and suite beside it, labelled with the
paper's GPU (for an H200 run: the 8xH20 Hopper numbers where the paper has them, else 8xB300).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis
from .analysis import PAPER_SOURCE

MODEL_NAMES = {"glm-5.2": "GLM-5.2", "deepseek-v4.1-flash": "DeepSeek-V4.1-Flash"}
OPERATOR_NAMES = {
    "mega": "Mega",
    "gc": "GC-MoE",
    "mega-se": "Mega-se",
    "mega-port": "Mega (SM90 port)",
    "deepgemm": "Mega (DeepGEMM)",
    "reference": "reference (FP32)",
}
GPU_NAMES = {"h20": "H20", "b300": "B300", "h200": "H200", "cpu": "CPU"}
SUITE_NAMES = {
    "routed": "routed experts",
    "shared": "with shared experts",
    "shared-ablation": "fusion ablation",
}
# The paper GPU whose numbers stand beside a measured run of a GPU kind the paper did not measure.
PAPER_COUNTERPART_ORDER = ("h20", "b300")
# Printed decimals per field, as in the paper.
DECIMALS = {"latency_us": 3, "speedup": 4, "tflops": 3, "hbm_gbps": 1, "nvlink_gbps": 3}
UNITS = {"latency_us": "µs", "speedup": "×", "tflops": "TFLOPS", "hbm_gbps": "GB/s", "nvlink_gbps": "GB/s"}


def model_name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def operator_name(operator: str) -> str:
    return OPERATOR_NAMES.get(operator, operator)


def gpu_name(gpu: str, num_ranks: int | None = None) -> str:
    name = GPU_NAMES.get(gpu, gpu.upper())
    if gpu == "cpu" and num_ranks:
        return f"{num_ranks} CPU rank{'s' if num_ranks > 1 else ''}"
    return f"{num_ranks}×{name}" if num_ranks else name


# ---------------------------------------------------------------------------------------------------------------
# Table specifications
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One numeric column: `field` of `operator` in `suite` (on `gpu`, for `model` if fixed) from `source`."""

    header: str
    field: str
    suite: str
    operator: str
    source: str = PAPER_SOURCE
    gpu: str | None = None  # None: the table's GPU
    model: str | None = None  # None: the row's model

    @property
    def is_speedup(self) -> bool:
        return self.field == "speedup"


@dataclass(frozen=True)
class TableSpec:
    """A table: rows are (model, tokens per rank) for `models`, columns are `columns`."""

    name: str  # file stem
    title: str
    caption: str
    gpu: str
    models: tuple[str, ...]
    columns: tuple[Column, ...]
    model_rows: bool = True  # rows span the models (False: columns name their model)
    total_tokens: bool = True


def _latency(op, suite, header=None, **kw):
    return Column(header or f"{operator_name(op)} (µs)", "latency_us", suite, op, **kw)


def _speedup(op, suite, header="Speedup", **kw):
    return Column(header, "speedup", suite, op, **kw)


DSV, GLM = "deepseek-v4.1-flash", "glm-5.2"

PAPER_TABLES: tuple[TableSpec, ...] = (
    TableSpec(
        "table5",
        "Table 5",
        "Decode latency and speedup, DeepSeek-V4.1-Flash on 8×H20 (routed experts). "
        "Slowest-rank median per-invocation latency under CUDA Graph replay.",
        "h20",
        (DSV,),
        (_latency("mega", "routed"), _latency("gc", "routed"), _speedup("gc", "routed")),
        model_rows=False,
    ),
    TableSpec(
        "table6",
        "Table 6",
        "Decode latency and speedup, 8×B300 (routed experts), both models. Slowest-rank median latency.",
        "b300",
        (GLM, DSV),
        (_latency("mega", "routed"), _latency("gc", "routed"), _speedup("gc", "routed")),
    ),
    TableSpec(
        "table7",
        "Table 7",
        "Decode latency, fused shared experts, DeepSeek-V4.1-Flash on 8×H20. gc-se: GC-MoE with fusion; "
        "gc-unfused: the shared expert run separately; mega-unfused: baseline. Ratios are against gc-se.",
        "h20",
        (DSV,),
        (
            _latency("gc-se", "shared", "gc-se (µs)"),
            _latency("gc-unfused", "shared-ablation", "gc-unfused (µs)"),
            _speedup("gc-se", "shared-ablation", "unfused/se"),
            _latency("mega-unfused", "shared", "mega-unfused (µs)"),
            _speedup("gc-se", "shared", "mega/se"),
        ),
        model_rows=False,
        total_tokens=False,
    ),
    TableSpec(
        "table8",
        "Table 8",
        "Decode latency and speedup with fused shared experts, 8×B300. The baseline is Mega MoE in its fused "
        "shared-expert mode. Slowest-rank median latency.",
        "b300",
        (GLM, DSV),
        (
            _latency("mega-se", "shared", "Mega-se (µs)"),
            _latency("gc-se", "shared", "GC-MoE (µs)"),
            _speedup("gc-se", "shared"),
        ),
    ),
    TableSpec(
        "table9",
        "Table 9",
        "Effective throughput and analytic bandwidth models, DeepSeek-V4.1-Flash on 8×H20, aggregate over eight "
        "GPUs. TFLOPS counts routed matmul work only; HBM is the expert weight+scale working-set model; NVLink is "
        "the one-way assignment payload model. Computed from the latencies of Table 5; the HBM and NVLink counts "
        "are those the published Table 9 implies (results/paper/routing_counts.csv).",
        "h20",
        (DSV,),
        (
            Column("TFLOPS Mega", "tflops", "routed", "mega"),
            Column("TFLOPS GC", "tflops", "routed", "gc"),
            Column("HBM Mega (GB/s)", "hbm_gbps", "routed", "mega"),
            Column("HBM GC (GB/s)", "hbm_gbps", "routed", "gc"),
            Column("NVLink Mega (GB/s)", "nvlink_gbps", "routed", "mega"),
            Column("NVLink GC (GB/s)", "nvlink_gbps", "routed", "gc"),
        ),
        model_rows=False,
        total_tokens=False,
    ),
    TableSpec(
        "table10",
        "Table 10",
        "Effective TFLOPS (routed matmul work only, aggregate over eight GPUs), 8×B300, routed experts. "
        "Computed from the latencies of Table 6.",
        "b300",
        (GLM, DSV),
        (
            Column("GLM-5.2 Mega", "tflops", "routed", "mega", model=GLM),
            Column("GLM-5.2 GC", "tflops", "routed", "gc", model=GLM),
            Column("DSV4.1-Flash Mega", "tflops", "routed", "mega", model=DSV),
            Column("DSV4.1-Flash GC", "tflops", "routed", "gc", model=DSV),
        ),
        model_rows=False,
        total_tokens=False,
    ),
)


# ---------------------------------------------------------------------------------------------------------------
# Built tables and their writers
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Table:
    """A filled table: `body` has key columns (model, tokens_per_rank, total_tokens) then one column per header;
    `summary` rows carry a label and the speedup columns' means."""

    spec: TableSpec
    body: pd.DataFrame
    summary: list[tuple[str, dict[str, tuple[float, int]]]] = field(default_factory=list)
    """(label, {header: (value, points)}); `points` differs from the label's count only for partial columns."""

    @property
    def key_headers(self) -> list[str]:
        keys = (["Model"] if self.spec.model_rows else []) + ["Tokens/rank"]
        return keys + (["Total tokens"] if self.spec.total_tokens else [])

    def value_headers(self) -> list[str]:
        return [c.header for c in self.spec.columns]

    def formatted_rows(self) -> list[list[str]]:
        rows = []
        for _, row in self.body.iterrows():
            keys = ([model_name(row["model"])] if self.spec.model_rows else []) + [
                str(int(row["tokens_per_rank"]))
            ]
            if self.spec.total_tokens:
                keys.append(_fmt_int(row["total_tokens"]))
            rows.append(keys + [_fmt(row[c.header], DECIMALS[c.field]) for c in self.spec.columns])
        return rows

    def formatted_summary(self) -> list[list[str]]:
        pad = len(self.key_headers) - 1
        rows = []
        for label, values in self.summary:
            label_count = _label_count(label)
            cells = []
            for column in self.spec.columns:
                if column.header not in values:
                    cells.append("–")
                    continue
                value, count = values[column.header]
                text = _fmt(value, DECIMALS["speedup"])
                cells.append(text if count == label_count else f"{text} (n={count})")
            rows.append([label] + [""] * pad + cells)
        return rows

    # Markdown ----------------------------------------------------------------------------------------------
    def to_markdown(self) -> str:
        headers = self.key_headers + self.value_headers()
        lines = [f"**{self.spec.title}.** {self.spec.caption}", ""]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append(
            "| "
            + " | ".join(
                ["---"] * (len(self.key_headers) - 1) + ["---:"] * (len(headers) - len(self.key_headers) + 1)
            )
            + " |"
        )
        for row in self.formatted_rows() + self.formatted_summary():
            lines.append("| " + " | ".join(row) + " |")
        return "\n".join(lines) + "\n"

    # LaTeX booktabs -----------------------------------------------------------------------------------------
    def to_latex(self) -> str:
        headers = self.key_headers + self.value_headers()
        align = "l" * (len(self.key_headers) - 1) + "r" * (len(headers) - len(self.key_headers) + 1)
        lines = [
            "% requires \\usepackage{booktabs}",
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{_latex_escape(self.spec.caption)}}}",
            f"\\label{{tab:{self.spec.name}}}",
            f"\\begin{{tabular}}{{{align}}}",
            "\\toprule",
            " & ".join(_latex_escape(h) for h in headers) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(_latex_escape(v) for v in row) + " \\\\" for row in self.formatted_rows()]
        if self.summary:
            lines.append("\\midrule")
            lines += [" & ".join(_latex_escape(v) for v in row) + " \\\\" for row in self.formatted_summary()]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"

    # CSV ----------------------------------------------------------------------------------------------------
    def to_frame(self) -> pd.DataFrame:
        """Numbers at full precision: `row` is "point" for the body and the summary label for summary rows."""
        body = self.body.assign(row="point")
        frame = body[["row", "model", "tokens_per_rank", "total_tokens"] + self.value_headers()]
        summary = [
            {"row": label, **{h: value for h, (value, _) in values.items()}} for label, values in self.summary
        ]
        if summary:
            frame = pd.concat([frame, pd.DataFrame(summary)], ignore_index=True)
        return frame.astype({"tokens_per_rank": "Int64", "total_tokens": "Int64"})


def _fmt(value, decimals: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{decimals}f}"


def _label_count(label: str) -> int:
    """The point count a summary label states, "(9 points)" -> 9."""
    return int(label.rsplit("(", 1)[1].split(" ")[0])


def _fmt_int(value) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else str(int(value))


_LATEX_REPLACEMENTS = {
    "\\": "\\textbackslash{}",
    "&": "\\&",
    "%": "\\%",
    "$": "\\$",
    "#": "\\#",
    "_": "\\_",
    "{": "\\{",
    "}": "\\}",
    "~": "\\textasciitilde{}",
    "^": "\\textasciicircum{}",
    "µ": "$\\mu$",
    "×": "$\\times$",
    "–": "--",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_REPLACEMENTS.get(ch, ch) for ch in str(text))


# ---------------------------------------------------------------------------------------------------------------
# Filling tables
# ---------------------------------------------------------------------------------------------------------------


def build_table(spec: TableSpec, points: pd.DataFrame) -> Table:
    """Fill `spec` from analysed points (analysis.analyze output, paper and measured concatenated)."""
    rows: dict[tuple[str, int], dict] = {}
    for column in spec.columns:
        gpu = column.gpu or spec.gpu
        models = (column.model,) if column.model else spec.models
        for model in models:
            wanted = points.loc[
                points["source"].eq(column.source)
                & points["gpu"].eq(gpu)
                & points["model"].eq(model)
                & points["suite"].eq(column.suite)
                & points["operator"].eq(column.operator)
                & points["status"].eq("ok")
            ]
            for _, point in wanted.iterrows():
                row_model = model if spec.model_rows else ""
                key = (row_model, int(point["tokens_per_rank"]))
                entry = rows.setdefault(
                    key,
                    {
                        "model": model if spec.model_rows else "",
                        "tokens_per_rank": key[1],
                        "total_tokens": np.nan,
                    },
                )
                if np.isnan(entry["total_tokens"]):
                    entry["total_tokens"] = point["total_tokens"]
                entry[column.header] = point[column.field]
    order = {m: i for i, m in enumerate(spec.models)}
    body = pd.DataFrame(
        sorted(rows.values(), key=lambda r: (order.get(r["model"], -1), r["tokens_per_rank"]))
    )
    if body.empty:
        body = pd.DataFrame(columns=["model", "tokens_per_rank", "total_tokens"])
    for column in spec.columns:
        if column.header not in body.columns:
            body[column.header] = np.nan
    table = Table(spec, body.reset_index(drop=True))
    table.summary = _speedup_summary(table)
    return table


def _speedup_summary(table: Table) -> list[tuple[str, dict[str, str]]]:
    """Arithmetic and geometric means of each speedup column, per model and (for several models) overall."""
    speedup_columns = [c for c in table.spec.columns if c.is_speedup]
    if not speedup_columns or table.body.empty:
        return []
    groups: list[tuple[str, pd.DataFrame]] = []
    if table.spec.model_rows and table.body["model"].nunique() > 1:
        groups += [
            (model_name(m), table.body[table.body["model"].eq(m)])
            for m in table.spec.models
            if table.body["model"].eq(m).any()
        ]
        groups.append(("overall", table.body))
    else:
        groups.append(("", table.body))
    summary = []
    first = speedup_columns[0].header
    for kind, reducer in (("Mean speedup", np.mean), ("Geometric mean speedup", analysis.geometric_mean)):
        for name, rows in groups:
            label = f"{kind}{': ' + name if name else ''} ({int(rows[first].notna().sum())} points)"
            values = {}
            for column in speedup_columns:
                ratios = rows[column.header].dropna().to_numpy()
                if ratios.size:
                    values[column.header] = (float(reducer(ratios)), int(ratios.size))
            summary.append((label, values))
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Measured runs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredGroup:
    """One (run, gpu, model, suite) of measured points."""

    source: str
    gpu: str
    model: str
    suite: str
    num_ranks: int
    operators: tuple[str, ...]  # the baseline first
    baseline: str
    throughput: bool  # routed suite with the counts the models need

    @property
    def slug(self) -> str:
        return f"measured-{self.gpu}-{self.source}-{self.model}-{self.suite}"


def measured_groups(points: pd.DataFrame) -> list[MeasuredGroup]:
    groups = []
    measured = points[points["source"].ne(PAPER_SOURCE) & points["status"].eq("ok")]
    for (source, gpu, model, suite), rows in measured.groupby(analysis.SUITE_KEY, sort=True):
        baseline = rows["baseline"].iloc[0]
        others = sorted(set(rows["operator"]) - {baseline})
        throughput = suite == "routed" and rows["assignments"].notna().all()
        groups.append(
            MeasuredGroup(
                source,
                gpu,
                model,
                suite,
                int(rows["num_ranks"].max()),
                (baseline, *others),
                baseline,
                throughput,
            )
        )
    return groups


@dataclass(frozen=True)
class PaperCounterpart:
    """The published curve that stands beside a measured group: the paper's `operator` on `gpu` for `model`."""

    gpu: str
    model: str
    operator: str


def paper_counterpart(points: pd.DataFrame, gpu: str, model: str, suite: str) -> PaperCounterpart | None:
    """The published speedup to show beside a measured (gpu, model, suite), or None.

    The paper's model is the measured one or the one it derives from by name ("glm-5.2" for "glm-5.2-slice");
    its GPU is the measured GPU if the paper has it, else the first of PAPER_COUNTERPART_ORDER that has the model
    and suite. CPU runs time CPU code and get no counterpart."""
    if gpu == "cpu":
        return None
    paper = points[points["source"].eq(PAPER_SOURCE) & points["suite"].eq(suite)]
    paper = paper[paper["operator"].ne(paper["baseline"])]
    derived = [m for m in paper["model"].unique() if model == m or model.startswith((m + "-", m + "/"))]
    if not derived:
        return None
    paper_model = max(derived, key=len)
    for candidate in (gpu, *PAPER_COUNTERPART_ORDER):
        rows = paper[paper["gpu"].eq(candidate) & paper["model"].eq(paper_model)]
        if not rows.empty:
            return PaperCounterpart(candidate, paper_model, rows["operator"].iloc[0])
    return None


def measured_table(group: MeasuredGroup, points: pd.DataFrame) -> TableSpec:
    columns = [
        Column(f"{operator_name(op)} (µs)", "latency_us", group.suite, op, source=group.source)
        for op in group.operators
    ]
    columns += [
        Column(f"Speedup {operator_name(op)}", "speedup", group.suite, op, source=group.source)
        for op in group.operators[1:]
    ]
    if group.throughput:
        for fieldname, label in (
            ("tflops", "TFLOPS"),
            ("hbm_gbps", "HBM (GB/s)"),
            ("nvlink_gbps", "NVLink (GB/s)"),
        ):
            values = points.loc[
                points["source"].eq(group.source)
                & points["model"].eq(group.model)
                & points["suite"].eq(group.suite),
                fieldname,
            ]
            # a model with nothing to show (no counts, or no NVLink traffic on one GPU) gets no columns
            if not values.fillna(0).ne(0).any():
                continue
            columns += [
                Column(f"{label} {operator_name(op)}", fieldname, group.suite, op, source=group.source)
                for op in group.operators
            ]
    counterpart = paper_counterpart(points, group.gpu, group.model, group.suite)
    note = ""
    if counterpart:
        label = f"Speedup, paper 8×{gpu_name(counterpart.gpu)}"
        columns.append(
            Column(
                label,
                "speedup",
                group.suite,
                counterpart.operator,
                gpu=counterpart.gpu,
                model=counterpart.model,
            )
        )
        if counterpart.gpu != group.gpu or counterpart.model != group.model:
            note = (
                f" The last column is the paper's published speedup of {operator_name(counterpart.operator)} on "
                f"8×{gpu_name(counterpart.gpu)} for {model_name(counterpart.model)}, same suite: different "
                "hardware or shape, shown for orientation only."
            )
    caption = (
        f"Measured decode latency and speedup, {model_name(group.model)}, "
        f"{SUITE_NAMES.get(group.suite, group.suite)} on {gpu_name(group.gpu, group.num_ranks)} "
        f"(run {group.source}); baseline {operator_name(group.baseline)}. Slowest-rank median latency." + note
    )
    return TableSpec(
        group.slug,
        f"Measured {group.source}",
        caption,
        group.gpu,
        (group.model,),
        tuple(columns),
        model_rows=False,
    )


def with_measured_columns(spec: TableSpec, points: pd.DataFrame) -> TableSpec:
    """Add, beside a paper table's columns, the same quantities from every measured run of the table's GPU."""
    measured = points[
        points["source"].ne(PAPER_SOURCE) & points["gpu"].eq(spec.gpu) & points["status"].eq("ok")
    ]
    extra: list[Column] = []
    suites = list(dict.fromkeys(c.suite for c in spec.columns))
    for source in sorted(measured["source"].unique()):
        rows = measured[measured["source"].eq(source) & measured["model"].isin(spec.models)]
        for suite in suites:
            suite_rows = rows[rows["suite"].eq(suite)]
            if suite_rows.empty:
                continue
            baseline = suite_rows["baseline"].iloc[0]
            operators = [baseline] + sorted(set(suite_rows["operator"]) - {baseline})
            fields = [c.field for c in spec.columns if c.suite == suite]
            column_models = [c.model for c in spec.columns if c.model] or [None]
            for model in dict.fromkeys(column_models):
                prefix = f"measured {source}" + (f" {model_name(model)}" if model else "")
                for fieldname in dict.fromkeys(f for f in fields if f != "speedup"):
                    unit = (
                        f" ({UNITS[fieldname]})"
                        if fieldname in ("latency_us", "hbm_gbps", "nvlink_gbps")
                        else ""
                    )
                    label = {
                        "latency_us": "",
                        "tflops": " TFLOPS",
                        "hbm_gbps": " HBM",
                        "nvlink_gbps": " NVLink",
                    }[fieldname]
                    extra += [
                        Column(
                            f"{prefix} {operator_name(op)}{label}{unit}",
                            fieldname,
                            suite,
                            op,
                            source=source,
                            model=model,
                        )
                        for op in operators
                    ]
                if "speedup" in fields:
                    extra += [
                        Column(
                            f"{prefix} speedup {operator_name(op)}/{operator_name(baseline)}",
                            "speedup",
                            suite,
                            op,
                            source=source,
                            model=model,
                        )
                        for op in operators[1:]
                    ]
    if not extra:
        return spec
    caption = spec.caption + ' Columns headed "measured <run>" are this project\'s measurements.'
    return replace(spec, columns=spec.columns + tuple(extra), caption=caption)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ReportFiles:
    """What `run_report` wrote: every table's files, every figure, the means CSV and the index."""

    index: Path
    tables: dict[str, list[Path]] = field(default_factory=dict)
    figures: dict[str, list[Path]] = field(default_factory=dict)
    means: Path | None = None
    points: Path | None = None

    def all_paths(self) -> list[Path]:
        paths = [self.index] + [p for ps in self.tables.values() for p in ps]
        paths += [p for ps in self.figures.values() for p in ps]
        return paths + [p for p in (self.means, self.points) if p is not None]


def collect_points(run_dirs: list[Path], paper_dir: Path | None = None) -> pd.DataFrame:
    """The paper's points and every run's points, analysed (speedups and throughput models)."""
    frames = [analysis.load_paper_points(paper_dir)]
    seen = set()
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        if run_dir.name in seen or run_dir.name == PAPER_SOURCE:
            raise ValueError(
                f"two runs share the id {run_dir.name!r} (or it is the reserved {PAPER_SOURCE!r})"
            )
        seen.add(run_dir.name)
        frames.append(analysis.load_run_points(run_dir))
    points = pd.concat(frames, ignore_index=True)
    points, _ = analysis.analyze(points)
    return points


def run_report(
    run_dirs: list[Path],
    out: Path,
    paper_dir: Path | None = None,
    figures_out: Path | None = None,
    figure_formats: tuple[str, ...] = ("png", "pdf"),
    with_figures: bool = True,
) -> ReportFiles:
    """Write the paper's Tables 5-10 and Figures 3-8, with measured runs beside or after them.

    :param run_dirs: measured run directories (results/<gpu>/<run-id>/, each with points.csv); empty for the
        paper reproduction alone. A run of a GPU the paper measured (h20, b300) fills columns beside the
        published ones; every run also gets its own table and figure per model and suite.
    :param out: output directory (created): tables/<name>.{md,tex,csv}, means.csv (every suite mean, arithmetic
        and geometric), points.csv (every analysed point), report.md (an index with all tables inline).
    :param paper_dir: the published CSVs (default: the project's results/paper/).
    :param figures_out: where figures go (default: <out>/figures).
    :param figure_formats: image formats per figure, any matplotlib knows (default png and pdf).
    :param with_figures: False writes the tables only.
    :return: a ReportFiles listing every path written.
    """
    out = Path(out)
    tables_dir = out / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    points = collect_points(list(run_dirs), paper_dir)
    means = analysis.suite_means(points)

    files = ReportFiles(index=out / "report.md")
    specs = [with_measured_columns(spec, points) for spec in PAPER_TABLES]
    groups = measured_groups(points)
    specs += [measured_table(group, points) for group in groups]
    tables = [build_table(spec, points) for spec in specs]
    for table in tables:
        paths = [tables_dir / f"{table.spec.name}.{suffix}" for suffix in ("md", "tex", "csv")]
        paths[0].write_text(table.to_markdown(), encoding="utf-8")
        paths[1].write_text(table.to_latex(), encoding="utf-8")
        table.to_frame().to_csv(paths[2], index=False)
        files.tables[table.spec.name] = paths

    files.means = out / "means.csv"
    means.to_csv(files.means, index=False, float_format="%.6f")
    files.points = out / "points.csv"
    points.to_csv(files.points, index=False)

    if with_figures:
        from . import figures  # matplotlib only when figures are wanted

        figures_dir = Path(figures_out) if figures_out is not None else out / "figures"
        files.figures = figures.write_figures(points, figures_dir, groups, formats=tuple(figure_formats))

    files.index.write_text(_index_markdown(files, tables, means, out), encoding="utf-8")
    return files


def _index_markdown(files: ReportFiles, tables: list[Table], means: pd.DataFrame, out: Path) -> str:
    sources = sorted(set(means["source"]) - {PAPER_SOURCE})
    lines = [
        "# GC-MoE reproduction report",
        "",
        "Published numbers from the paper (results/paper/)"
        + (f" and measured runs: {', '.join(sources)}." if sources else "; no measured run given."),
        "Speedup = baseline latency / operator latency per point; means are arithmetic means of the per-point",
        "ratios, geometric means beside them. Throughput models as in the paper's Section 6.4.",
        "",
        "## Suite means",
        "",
        "| Source | GPU | Suite | Model | Operator | Baseline | Points | Mean | Geomean | Min | Max | Faster |",
        "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for _, m in means.iterrows():
        lines.append(
            f"| {m['source']} | {gpu_name(m['gpu'])} | {m['suite']} | {model_name(m['model'])} | "
            f"{operator_name(m['operator'])} | {operator_name(m['baseline'])} | {m['points']} | "
            f"{m['mean_speedup']:.4f} | {m['geomean_speedup']:.4f} | {m['min_speedup']:.4f} | "
            f"{m['max_speedup']:.4f} | {m['faster_points']}/{m['points']} |"
        )
    lines += ["", "## Tables", ""]
    for table in tables:
        lines += [table.to_markdown(), ""]
    if files.figures:
        from .figures import PAPER_FIGURES

        titles = {spec.name: spec.title for spec in PAPER_FIGURES}
        lines += ["## Figures", ""]
        for name, paths in files.figures.items():
            image = next((p for p in paths if p.suffix == ".png"), paths[0])
            others = ", ".join(f"[{p.suffix[1:]}]({_relative(p, out)})" for p in paths if p != image)
            lines += [
                f"![{name}]({_relative(image, out)})",
                "",
                f"*{titles.get(name, name)}*" + (f" ({others})" if others else ""),
                "",
            ]
    return "\n".join(lines)


def _relative(path: Path, start: Path) -> str:
    import os

    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()
