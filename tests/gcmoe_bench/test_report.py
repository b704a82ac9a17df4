"""run_report: the paper's Tables 5-10 in Markdown, LaTeX and CSV, read back and checked against the paper's CSVs,
and measured runs placed beside the published numbers or in tables of their own."""

from __future__ import annotations

import statistics

import numpy as np
import pandas as pd
import pytest
from test_analysis import LATENCY_HALF_UNIT, PAPER, write_synthetic_run

from gcmoe_bench import report

PAPER_TABLES = ["table5", "table6", "table7", "table8", "table9", "table10"]
FULL_MODELS = {"glm-5.2": (6144, 2048, 256, 8), "deepseek-v4.1-flash": (5120, 2304, 384, 6)}
PAPER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture(scope="module")
def paper_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper-report")
    return out, report.run_report([], out, with_figures=False)


@pytest.fixture(scope="module")
def latencies():
    return pd.read_csv(PAPER / "latency_tables.csv")


def _csv(out, name):
    return pd.read_csv(out / "tables" / f"{name}.csv")


def _body(frame):
    return frame[frame["row"] == "point"].reset_index(drop=True)


def _summary(frame, label_start):
    rows = frame[frame["row"].str.startswith(label_start)]
    assert len(rows) == 1, (label_start, list(frame["row"]))
    return rows.iloc[0]


def _published(latencies, gpu, suite, model):
    rows = latencies[(latencies.gpu == gpu) & (latencies.suite == suite) & (latencies.model == model)]
    return rows.sort_values("tokens_per_rank").reset_index(drop=True)


def test_paper_report_writes_every_table_in_three_formats(paper_report):
    out, files = paper_report
    assert list(files.tables) == PAPER_TABLES
    for name in PAPER_TABLES:
        for suffix in ("md", "tex", "csv"):
            path = out / "tables" / f"{name}.{suffix}"
            assert path.is_file() and path.stat().st_size > 200, path
    assert files.figures == {}
    assert (out / "report.md").is_file() and (out / "means.csv").is_file() and (out / "points.csv").is_file()
    assert set(files.all_paths()) >= {out / "report.md", out / "means.csv"}


def test_table5_csv_holds_the_published_latencies_and_speedups(paper_report, latencies):
    out, _ = paper_report
    table = _csv(out, "table5")
    body = _body(table)
    published = _published(latencies, "h20", "routed", "deepseek-v4.1-flash")
    assert list(body["tokens_per_rank"]) == list(PAPER_TOKENS)
    np.testing.assert_array_equal(body["total_tokens"], published["total_tokens"])
    np.testing.assert_array_equal(body["Mega (µs)"], published["baseline_us"])
    np.testing.assert_array_equal(body["GC-MoE (µs)"], published["operator_us"])
    np.testing.assert_allclose(
        body["Speedup"], published["baseline_us"] / published["operator_us"], rtol=1e-12
    )
    np.testing.assert_allclose(body["Speedup"], published["speedup_published"], atol=1.0001e-4)
    mean = _summary(table, "Mean speedup")["Speedup"]
    assert mean == pytest.approx(
        statistics.fmean(published["baseline_us"] / published["operator_us"]), rel=1e-12
    )
    assert round(mean, 4) == 1.1881
    geomean = _summary(table, "Geometric mean")["Speedup"]
    assert geomean == pytest.approx(
        statistics.geometric_mean(published["baseline_us"] / published["operator_us"])
    )


@pytest.mark.parametrize(
    "name, suite, baseline_header", [("table6", "routed", "Mega (µs)"), ("table8", "shared", "Mega-se (µs)")]
)
def test_b300_tables_per_model_and_overall_means(paper_report, latencies, name, suite, baseline_header):
    out, _ = paper_report
    table = _csv(out, name)
    body = _body(table)
    means = pd.read_csv(PAPER / "published_means.csv")
    means = means[(means.gpu == "b300") & (means.suite == suite)].set_index("model")["mean_speedup"]
    assert len(body) == 18
    for model, label in (("glm-5.2", "GLM-5.2"), ("deepseek-v4.1-flash", "DeepSeek-V4.1-Flash")):
        rows = body[body.model == model].reset_index(drop=True)
        published = _published(latencies, "b300", suite, model)
        np.testing.assert_array_equal(rows["tokens_per_rank"], published["tokens_per_rank"])
        np.testing.assert_array_equal(rows[baseline_header], published["baseline_us"])
        np.testing.assert_array_equal(rows["GC-MoE (µs)"], published["operator_us"])
        assert round(_summary(table, f"Mean speedup: {label} (9 points)")["Speedup"], 4) == means[model]
    assert round(_summary(table, "Mean speedup: overall (18 points)")["Speedup"], 4) == means["all"]


def test_table7_shared_expert_columns(paper_report, latencies):
    out, _ = paper_report
    table = _csv(out, "table7")
    body = _body(table)
    shared = _published(latencies, "h20", "shared", "deepseek-v4.1-flash")
    ablation = _published(latencies, "h20", "shared-ablation", "deepseek-v4.1-flash")
    np.testing.assert_array_equal(body["gc-se (µs)"], shared["operator_us"])
    np.testing.assert_array_equal(body["mega-unfused (µs)"], shared["baseline_us"])
    np.testing.assert_array_equal(body["gc-unfused (µs)"], ablation["baseline_us"])
    np.testing.assert_allclose(body["unfused/se"], ablation["speedup_published"], atol=1.0001e-4)
    np.testing.assert_allclose(body["mega/se"], shared["speedup_published"], atol=1.0001e-4)
    mean = _summary(table, "Mean speedup")
    assert (round(mean["unfused/se"], 4), round(mean["mega/se"], 4)) == (1.0307, 1.1880)


def _printed_tolerance(published, latency_us, decimals):
    # a model value ~ 1 / latency: the latency's rounding moves it by value * half-unit / latency
    return published * LATENCY_HALF_UNIT / (latency_us - LATENCY_HALF_UNIT) + 0.5 * 10.0**-decimals + 1e-9


def test_table9_and_table10_match_the_published_throughput(paper_report, latencies):
    out, _ = paper_report
    body9 = _body(_csv(out, "table9")).set_index("tokens_per_rank")
    published9 = pd.read_csv(PAPER / "throughput_h20.csv").set_index("tokens_per_rank")
    h20 = _published(latencies, "h20", "routed", "deepseek-v4.1-flash").set_index("tokens_per_rank")
    columns9 = {"TFLOPS": ("tflops", 3), "HBM": ("hbm_gbps", 1), "NVLink": ("nvlink_gbps", 3)}
    checked = 0
    for t in PAPER_TOKENS:
        for header, (prefix, decimals) in columns9.items():
            for operator, label, latency_col in (
                ("mega", "Mega", "baseline_us"),
                ("gc", "GC", "operator_us"),
            ):
                column = [c for c in body9.columns if c.startswith(f"{header} {label}")]
                assert len(column) == 1
                value, expected = body9.loc[t, column[0]], published9.loc[t, f"{prefix}_{operator}"]
                assert abs(value - expected) <= _printed_tolerance(
                    expected, h20.loc[t, latency_col], decimals
                )
                checked += 1
    assert checked == 54

    body10 = _body(_csv(out, "table10")).set_index("tokens_per_rank")
    published10 = pd.read_csv(PAPER / "tflops_b300.csv").set_index("tokens_per_rank")
    for model, label, prefix in (
        ("glm-5.2", "GLM-5.2", "glm"),
        ("deepseek-v4.1-flash", "DSV4.1-Flash", "dsv"),
    ):
        b300 = _published(latencies, "b300", "routed", model).set_index("tokens_per_rank")
        for t in PAPER_TOKENS:
            for operator, name, latency_col in (("mega", "Mega", "baseline_us"), ("gc", "GC", "operator_us")):
                value, expected = (
                    body10.loc[t, f"{label} {name}"],
                    published10.loc[t, f"{prefix}_tflops_{operator}"],
                )
                assert abs(value - expected) <= _printed_tolerance(expected, b300.loc[t, latency_col], 3)


def test_markdown_and_latex_read_back(paper_report, latencies):
    out, _ = paper_report
    published = _published(latencies, "h20", "routed", "deepseek-v4.1-flash")
    lines = [line for line in (out / "tables" / "table5.md").read_text().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["Tokens/rank", "Total tokens", "Mega (µs)", "GC-MoE (µs)", "Speedup"]
    assert set(cells[1][1:]) == {"---:"}
    body = cells[2:11]
    for row, expected in zip(body, published.itertuples(), strict=True):
        assert row == [
            str(expected.tokens_per_rank),
            str(expected.total_tokens),
            f"{expected.baseline_us:.3f}",
            f"{expected.operator_us:.3f}",
            f"{expected.baseline_us / expected.operator_us:.4f}",
        ]
    assert cells[11][0] == "Mean speedup (9 points)" and cells[11][-1] == "1.1881"
    assert cells[12][0].startswith("Geometric mean") and len(cells) == 13

    tex = (out / "tables" / "table6.tex").read_text()
    for rule in ("\\toprule", "\\midrule", "\\bottomrule", "\\begin{tabular}{llrrrr}"):
        assert rule in tex
    rows = [line for line in tex.splitlines() if line.endswith("\\\\")]
    assert len(rows) == 1 + 18 + 6
    assert rows[0].startswith("Model & Tokens/rank & Total tokens & Mega ($\\mu$s)")
    glm16 = _published(latencies, "b300", "routed", "glm-5.2").iloc[4]
    expected_row = (
        f"GLM-5.2 & 16 & 128 & {glm16.baseline_us:.3f} & {glm16.operator_us:.3f} & "
        f"{glm16.baseline_us / glm16.operator_us:.4f} \\\\"
    )
    assert expected_row in rows
    assert "Mean speedup: overall (18 points) &  &  & -- & -- & 1.1059 \\\\" in rows


def test_index_and_means(paper_report):
    out, _ = paper_report
    index = (out / "report.md").read_text()
    for number in range(5, 11):
        assert f"**Table {number}.**" in index
    means = pd.read_csv(out / "means.csv")
    published = pd.read_csv(PAPER / "published_means.csv")
    merged = published.merge(means, on=["gpu", "suite", "model"], suffixes=("_published", ""))
    assert len(merged) == len(published)
    np.testing.assert_allclose(merged["mean_speedup"].round(4), merged["mean_speedup_published"], atol=1e-12)
    assert "no measured run given" in index


# ------------------------------------------------------------------------------------------------------------
# Measured runs
# ------------------------------------------------------------------------------------------------------------


def test_measured_h20_run_sits_beside_the_published_table(tmp_path, rng):
    run_dir = write_synthetic_run(
        tmp_path / "results",
        rng,
        gpu="h20",
        run_id="h20-run",
        models={"deepseek-v4.1-flash": FULL_MODELS["deepseek-v4.1-flash"]},
        suites={"routed": ("mega-port", ["gc"])},
        tokens=(1, 4, 16, 64, 512),
        num_ranks=8,
    )
    files = report.run_report([run_dir], tmp_path / "out", with_figures=False)
    measured = pd.read_csv(run_dir / "points.csv").set_index(["operator", "tokens_per_rank"])
    table = _csv(tmp_path / "out", "table5")
    body = _body(table).set_index("tokens_per_rank")
    # published rows stay, measured columns fill their tokens; 512 tokens/rank is measured only
    assert list(body.index) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert np.isnan(body.loc[512, "Mega (µs)"]) and np.isnan(body.loc[2, "measured h20-run GC-MoE (µs)"])
    for t in (1, 4, 16, 64, 512):
        assert (
            body.loc[t, "measured h20-run Mega (SM90 port) (µs)"]
            == measured.loc[("mega-port", t), "latency_us"]
        )
        assert body.loc[t, "measured h20-run GC-MoE (µs)"] == measured.loc[("gc", t), "latency_us"]
        assert body.loc[t, "measured h20-run speedup GC-MoE/Mega (SM90 port)"] == pytest.approx(
            measured.loc[("gc", t), "speedup"], rel=1e-12
        )
    mean = _summary(table, "Mean speedup")
    assert mean["measured h20-run speedup GC-MoE/Mega (SM90 port)"] == pytest.approx(
        measured.xs("gc")["speedup"].mean(), rel=1e-12
    )
    md = (tmp_path / "out" / "tables" / "table5.md").read_text()
    assert "(n=5)" in md  # the measured mean covers 5 points, the label's 9 are the paper's
    # Table 9 gains measured throughput columns, from the run's own counts
    body9 = _body(_csv(tmp_path / "out", "table9")).set_index("tokens_per_rank")
    gc16 = measured.loc[("gc", 16)]
    assert body9.loc[16, "measured h20-run GC-MoE TFLOPS"] == pytest.approx(
        6 * gc16.assignments * 5120 * 2304 / (gc16.latency_us * 1e6)
    )
    assert body9.loc[16, "measured h20-run GC-MoE NVLink (GB/s)"] == pytest.approx(
        gc16.remote_assignments * 15520 / (gc16.latency_us * 1e3)
    )
    assert "measured-h20-h20-run-deepseek-v4.1-flash-routed" in files.tables
    # B300 tables are untouched by an H20 run
    assert not any(c.startswith("measured") for c in _csv(tmp_path / "out", "table6").columns)


def test_measured_h200_run_gets_its_own_tables_with_the_paper_beside(tmp_path, rng):
    run_dir = write_synthetic_run(
        tmp_path / "results",
        rng,
        gpu="h200",
        run_id="h200-run",
        models=FULL_MODELS,
        suites={"routed": ("mega-port", ["gc"]), "shared": ("mega-port", ["gc", "gc-unfused"])},
        tokens=PAPER_TOKENS,
        num_ranks=1,
    )
    files = report.run_report([run_dir], tmp_path / "out", with_figures=False)
    names = [n for n in files.tables if n.startswith("measured")]
    assert len(names) == 4
    measured = pd.read_csv(run_dir / "points.csv")
    paper = report.analysis.load_paper_points()
    for model in FULL_MODELS:
        table = _csv(tmp_path / "out", f"measured-h200-h200-run-{model}-routed")
        body = _body(table).set_index("tokens_per_rank")
        rows = measured[(measured.model == model) & (measured.suite == "routed")].set_index(
            ["operator", "tokens_per_rank"]
        )
        np.testing.assert_array_equal(body["GC-MoE (µs)"], rows.xs("gc")["latency_us"])
        np.testing.assert_allclose(body["Speedup GC-MoE"], rows.xs("gc")["speedup"], rtol=1e-12)
        assert body["total_tokens"].tolist() == list(PAPER_TOKENS)  # one rank
        assert not any("NVLink" in c for c in body.columns)  # one GPU moves nothing over NVLink
        assert any(c.startswith("TFLOPS") for c in body.columns)
        # beside it: the paper's H20 curve where the paper has the model on H20, else B300
        paper_gpu = "h20" if model == "deepseek-v4.1-flash" else "b300"
        header = f"Speedup, paper 8×{paper_gpu.upper()}"
        published = paper[
            (paper.gpu == paper_gpu)
            & (paper.model == model)
            & (paper.suite == "routed")
            & (paper.operator == "gc")
        ].set_index("tokens_per_rank")["speedup"]
        np.testing.assert_allclose(body[header], published.loc[list(PAPER_TOKENS)], rtol=1e-12)
        md = (tmp_path / "out" / "tables" / f"measured-h200-h200-run-{model}-routed.md").read_text()
        assert "1×H200" in md and "orientation only" in md
    shared = _body(_csv(tmp_path / "out", "measured-h200-h200-run-glm-5.2-shared"))
    assert {"Speedup GC-MoE", "Speedup gc-unfused", "gc-unfused (µs)"} <= set(shared.columns)


def test_cpu_run_has_no_paper_counterpart_and_ids_must_differ(tmp_path, rng):
    run_dir = write_synthetic_run(tmp_path / "results", rng)
    files = report.run_report([run_dir], tmp_path / "out", with_figures=False)
    measured_names = [n for n in files.tables if n.startswith("measured")]
    assert len(measured_names) == 4
    for name in measured_names:
        assert not any(c.startswith("Speedup, paper") for c in _csv(tmp_path / "out", name).columns)
    with pytest.raises(ValueError, match="share the id"):
        report.run_report([run_dir, run_dir], tmp_path / "again", with_figures=False)


def test_committed_reproduction_is_current(paper_report):
    """docs/paper/tables and figures/ are what `gcmoe-bench report --out docs/paper --figures-out figures` writes."""
    out, _ = paper_report
    root = PAPER.parent.parent
    for name in PAPER_TABLES:
        for suffix in ("md", "tex", "csv"):
            committed = root / "docs" / "paper" / "tables" / f"{name}.{suffix}"
            generated = out / "tables" / f"{name}.{suffix}"
            assert committed.read_text() == generated.read_text(), f"regenerate {committed}"
    for number in range(3, 9):
        for suffix in ("png", "pdf"):
            assert (root / "figures" / f"figure{number}.{suffix}").stat().st_size > 10_000
