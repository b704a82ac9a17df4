"""Figures 3-8 and the measured figures: written in every format, and drawn from the right numbers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_analysis import PAPER, write_synthetic_run

from gcmoe_bench import figures, report

DSV = "deepseek-v4.1-flash"


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture(scope="module")
def paper_points():
    return report.collect_points([])


def _lines(axes):
    return {line.get_label(): line for line in axes.get_lines()}


def test_paper_figures_written_as_png_and_pdf(tmp_path, paper_points):
    written = figures.write_figures(paper_points, tmp_path, groups=[])
    assert list(written) == [f"figure{n}" for n in range(3, 9)]
    for name, paths in written.items():
        assert [p.name for p in paths] == [f"{name}.png", f"{name}.pdf"]
        png, pdf = (p.read_bytes() for p in paths)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
        assert pdf.startswith(b"%PDF") and len(pdf) > 10_000
    # no timestamps inside: redrawing gives the same bytes, so committed figures change only with the data
    spec = figures.PAPER_FIGURES[3]
    again = figures._save(
        figures.paper_figure(spec, paper_points), tmp_path / "again", spec.name, ("png", "pdf")
    )
    for first, second in zip(written[spec.name], again, strict=True):
        assert first.read_bytes() == second.read_bytes(), first.name


def test_figure_reads_at_a_glance(paper_points):
    spec = figures.PAPER_FIGURES[0]
    figure = figures.paper_figure(spec, paper_points)
    latency_axes, speedup_axes = figure.axes
    for axes in (latency_axes, speedup_axes):
        assert axes.get_xscale() == "log" and axes.xaxis.get_transform().base == 2
        assert "tokens per rank" in axes.get_xlabel()
        assert axes.get_legend() is not None
        assert list(axes.get_xticks()) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert "(µs)" in latency_axes.get_ylabel() and "(×)" in speedup_axes.get_ylabel()
    parity = _lines(speedup_axes)["speedup = 1 (parity)"]
    assert set(parity.get_ydata()) == {1.0}
    assert "8×H20" in figure._suptitle.get_text()


def test_figure_curves_are_the_paper_numbers(paper_points):
    latencies = pd.read_csv(PAPER / "latency_tables.csv")
    h20 = latencies[(latencies.gpu == "h20") & (latencies.suite == "routed")].sort_values("tokens_per_rank")
    figure = figures.paper_figure(figures.PAPER_FIGURES[0], paper_points)
    latency_lines, speedup_lines = (_lines(axes) for axes in figure.axes)
    np.testing.assert_array_equal(latency_lines["Mega MoE (paper)"].get_xdata(), h20.tokens_per_rank)
    np.testing.assert_array_equal(latency_lines["Mega MoE (paper)"].get_ydata(), h20.baseline_us)
    np.testing.assert_array_equal(latency_lines["GC-MoE (paper)"].get_ydata(), h20.operator_us)
    np.testing.assert_allclose(
        speedup_lines["GC-MoE vs Mega MoE (paper)"].get_ydata(), h20.baseline_us / h20.operator_us, rtol=1e-12
    )
    # Figure 6: three latency curves, the two ratios of gc-se
    figure6 = figures.paper_figure(figures.PAPER_FIGURES[3], paper_points)
    latency_lines, speedup_lines = (_lines(axes) for axes in figure6.axes)
    assert len([k for k in latency_lines if k.endswith("(paper)")]) == 3
    ablation = latencies[latencies.suite == "shared-ablation"].sort_values("tokens_per_rank")
    np.testing.assert_allclose(
        speedup_lines["gc-se vs gc-unfused, fusion ablation (paper)"].get_ydata(),
        ablation.baseline_us / ablation.operator_us,
        rtol=1e-12,
    )


def test_measured_runs_add_curves_and_figures(tmp_path, rng):
    h20 = write_synthetic_run(
        tmp_path / "results",
        rng,
        gpu="h20",
        run_id="h20-run",
        models={DSV: (5120, 2304, 384, 6)},
        suites={"routed": ("mega-port", ["gc"])},
        tokens=(1, 8, 64),
        num_ranks=8,
    )
    cpu = write_synthetic_run(tmp_path / "results", rng, run_id="cpu-run")
    files = report.run_report([h20, cpu], tmp_path / "out", figure_formats=("png",))
    assert len(files.figures) == 6 + 1 + 4  # the paper's, the H20 group, 2 models x 2 suites on CPU
    for paths in files.figures.values():
        assert len(paths) == 1 and paths[0].suffix == ".png" and paths[0].stat().st_size > 20_000
    assert (tmp_path / "out" / "figures" / "measured-h20-h20-run-deepseek-v4.1-flash-routed.png").is_file()

    points = report.collect_points([h20])
    measured = pd.read_csv(h20 / "points.csv").set_index(["operator", "tokens_per_rank"])
    figure3 = figures.paper_figure(figures.PAPER_FIGURES[0], points)
    latency_lines, speedup_lines = (_lines(axes) for axes in figure3.axes)
    dashed = latency_lines["GC-MoE (measured h20-run)"]
    assert dashed.get_linestyle() == "--"
    np.testing.assert_array_equal(dashed.get_xdata(), [1, 8, 64])
    np.testing.assert_array_equal(dashed.get_ydata(), measured.xs("gc")["latency_us"].to_numpy())
    np.testing.assert_allclose(
        speedup_lines["GC-MoE vs Mega (SM90 port) (measured h20-run)"].get_ydata(),
        measured.xs("gc")["speedup"].to_numpy(),
        rtol=1e-12,
    )
    # Figures of other GPUs stay as published
    figure4 = figures.paper_figure(figures.PAPER_FIGURES[1], points)
    assert not any("measured" in label for label in _lines(figure4.axes[0]))


def test_measured_figure_of_another_gpu_shows_the_paper_for_orientation(tmp_path, rng):
    run_dir = write_synthetic_run(
        tmp_path / "results",
        rng,
        gpu="h200",
        run_id="h200-run",
        models={"glm-5.2": (6144, 2048, 256, 8)},
        suites={"routed": ("mega-port", ["gc"])},
        tokens=(1, 2, 4),
        num_ranks=1,
    )
    points = report.collect_points([run_dir])
    (group,) = report.measured_groups(points)
    figure = figures.measured_figure(group, points)
    assert "1×H200" in figure._suptitle.get_text() and "measured" in figure._suptitle.get_text()
    speedup_lines = _lines(figure.axes[1])
    paper_label = "paper, 8×B300: GC-MoE vs Mega (other hardware or shape)"
    assert paper_label in speedup_lines
    assert speedup_lines[paper_label].get_linestyle() == ":"
    measured = pd.read_csv(run_dir / "points.csv")
    np.testing.assert_allclose(
        speedup_lines["GC-MoE vs Mega (SM90 port)"].get_ydata(),
        measured[measured.operator == "gc"]["speedup"],
    )
