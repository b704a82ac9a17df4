"""compare against a baseline file: exit codes, labels, the benchmark JSON, and the baseline writer."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from test_analysis import write_synthetic_run

from gcmoe_bench import regress


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture
def run_and_baseline(tmp_path, rng):
    run_dir = write_synthetic_run(tmp_path / "results", rng)
    baseline = regress.write_baseline(run_dir, tmp_path / "baselines" / "cpu.csv")
    return run_dir, baseline


def _console():
    return Console(file=io.StringIO(), width=200, color_system=None)


def _doctored_copy(run_dir, tmp_path, edit):
    """A copy of the run whose points.csv went through `edit` (in place, or returning the new table)."""
    copy = tmp_path / "doctored" / run_dir.name
    shutil.copytree(run_dir, copy)
    points = pd.read_csv(copy / "points.csv", dtype={"reason": str})
    edited = edit(points)
    (points if edited is None else edited).to_csv(copy / "points.csv", index=False)
    return copy


def test_baseline_file_holds_every_point_and_mean(run_and_baseline):
    run_dir, baseline = run_and_baseline
    table = pd.read_csv(baseline)
    points = pd.read_csv(run_dir / "points.csv")
    compared = points[points.operator != points.baseline]
    point_rows = table[table.kind == "point"]
    assert (
        len(point_rows) == len(compared) == 2 * (4 + 8)
    )  # 2 models x (routed gc + shared gc, gc-unfused) x 4 T
    merged = point_rows.merge(
        compared, on=["model", "suite", "operator", "tokens_per_rank"], suffixes=("", "_run")
    )
    assert len(merged) == len(point_rows)
    np.testing.assert_allclose(merged["speedup"], merged["speedup_run"], atol=1e-6)
    np.testing.assert_allclose(merged["latency_us"], merged["latency_us_run"], atol=1e-6)
    means = table[table.kind == "mean"].set_index(["model", "suite", "operator"])
    # per model (2 models x 3 suite-operator pairs) plus over both models (3 pairs)
    assert len(means) == 9
    for (suite, operator), rows in compared.groupby(["suite", "operator"]):
        assert means.loc[("all", suite, operator), "speedup"] == pytest.approx(rows.speedup.mean(), abs=1e-6)
        for model, model_rows in rows.groupby("model"):
            assert means.loc[(model, suite, operator), "speedup"] == pytest.approx(
                model_rows.speedup.mean(), abs=1e-6
            )


def test_same_run_passes_and_writes_benchmark_json(run_and_baseline, tmp_path):
    run_dir, baseline = run_and_baseline
    json_out = tmp_path / "bench" / "speedups.json"
    console = _console()
    assert regress.run_compare(run_dir, baseline, json_out=json_out, console=console) == 0
    text = console.file.getvalue()
    assert "no regression" in text and "slower" not in text.split("no regression")[0].replace("0 slower", "")

    entries = json.loads(json_out.read_text())
    table = pd.read_csv(baseline)
    assert len(entries) == len(table)
    assert all(set(e) == {"name", "unit", "value", "extra"} for e in entries)
    assert all(e["unit"] == "x speedup" and isinstance(e["value"], float) for e in entries)
    assert len({e["name"] for e in entries}) == len(entries)
    # values are the run's speedups: match them by name
    points = pd.read_csv(run_dir / "points.csv")
    by_name = {e["name"]: e["value"] for e in entries}
    for row in points[points.operator != points.baseline].itertuples():
        name = f"cpu/{row.model}/{row.suite}: {row.operator} vs {row.baseline}, {row.tokens_per_rank} tokens/rank"
        assert by_name[name] == pytest.approx(row.speedup, abs=1e-6)
    mean_names = [n for n in by_name if n.endswith("mean speedup")]
    assert len(mean_names) == 9


def test_point_slowed_beyond_tolerance_fails(run_and_baseline, tmp_path):
    run_dir, baseline = run_and_baseline

    def slow_one_point(points):
        # gc 5% slower at one point: its speedup drops by 1 - 1/1.05 = 4.8% > 3%
        at = (points.operator == "gc") & (points.suite == "routed") & (points.tokens_per_rank == 4)
        at &= points.model == "glm-5.2-mini"
        points.loc[at, "latency_us"] *= 1.05

    doctored = _doctored_copy(run_dir, tmp_path, slow_one_point)
    assert regress.run_compare(doctored, baseline, console=_console()) == 1
    comparison = regress.compare(doctored, baseline)
    slower = comparison[comparison.verdict == "slower"]
    assert len(slower) == 1
    row = slower.iloc[0]
    assert (row.kind, row.model, row.suite, row.operator, row.tokens_per_rank) == (
        "point",
        "glm-5.2-mini",
        "routed",
        "gc",
        4,
    )
    assert row.change == pytest.approx(1 / 1.05 - 1, abs=1e-5)
    # one point of four moves the model's mean by ~1.2%: within tolerance, still "same"
    assert (comparison[comparison.kind == "mean"].verdict == "same").all()
    # a looser tolerance lets the same drop pass
    assert regress.run_compare(doctored, baseline, tolerance=0.06, console=_console()) == 0


def test_drop_within_tolerance_is_same_and_gain_is_faster(run_and_baseline, tmp_path):
    run_dir, baseline = run_and_baseline

    def edit(points):
        gc = points.operator == "gc"
        points.loc[gc & (points.tokens_per_rank == 1), "latency_us"] *= 1.02  # -2%: same
        points.loc[gc & (points.tokens_per_rank == 8), "latency_us"] /= 1.10  # +10%: faster

    doctored = _doctored_copy(run_dir, tmp_path, edit)
    comparison = regress.compare(doctored, baseline)
    points = comparison[comparison.kind == "point"]
    assert (points[(points.operator == "gc") & (points.tokens_per_rank == 8)].verdict == "faster").all()
    assert (points[(points.operator == "gc") & (points.tokens_per_rank == 1)].verdict == "same").all()
    assert (points[points.operator == "gc-unfused"].verdict == "same").all()
    assert regress.run_compare(doctored, baseline, console=_console()) == 0


def test_mean_below_baseline_fails(run_and_baseline, tmp_path):
    run_dir, baseline = run_and_baseline
    # The committed baseline claims a 5% better routed mean for one model than the run (and its points) give.
    table = pd.read_csv(baseline)
    at = (table.kind == "mean") & (table.suite == "routed") & (table.model == "deepseek-v4.1-flash-mini")
    assert at.sum() == 1
    table.loc[at, "speedup"] *= 1.05
    raised = tmp_path / "raised.csv"
    table.to_csv(raised, index=False)
    comparison = regress.compare(run_dir, raised)
    assert list(comparison[comparison.verdict == "slower"].kind) == ["mean"]
    assert regress.run_compare(run_dir, raised, console=_console()) == 1

    # Every point 4% slower: the points and all the means fail.
    def slow_all(points):
        points.loc[points.operator != points.baseline, "latency_us"] *= 1.04

    doctored = _doctored_copy(run_dir, tmp_path, slow_all)
    comparison = regress.compare(doctored, baseline)
    assert (comparison.verdict == "slower").all()
    assert regress.run_compare(doctored, baseline, console=_console()) == 1


def test_missing_and_new_points(run_and_baseline, tmp_path):
    run_dir, baseline = run_and_baseline

    def drop_t8_add_t16(points):
        eight = points.tokens_per_rank == 8
        sixteen = points[eight].assign(tokens_per_rank=16, total_tokens=32)
        return pd.concat([points[~eight], sixteen], ignore_index=True)

    doctored = _doctored_copy(run_dir, tmp_path, drop_t8_add_t16)
    comparison = regress.compare(doctored, baseline)
    points = comparison[comparison.kind == "point"]
    assert (points[points.tokens_per_rank == 8].verdict == "missing").all()
    assert (points[points.tokens_per_rank == 16].verdict == "new").all()
    assert len(points[points.tokens_per_rank == 8]) == len(points[points.tokens_per_rank == 16]) == 6
    assert regress.run_compare(doctored, baseline, console=_console()) == 1
    # allowed to be partial, the run fails only if a remaining point or a mean (now over T = 1, 2, 4) is slower
    expected = int((comparison.verdict == "slower").any())
    assert regress.run_compare(doctored, baseline, allow_missing=True, console=_console()) == expected


def test_bad_inputs_are_refused(run_and_baseline, tmp_path, rng):
    run_dir, baseline = run_and_baseline
    with pytest.raises(ValueError, match="tolerance"):
        regress.compare(run_dir, baseline, tolerance=3)
    with pytest.raises(FileNotFoundError, match="baseline file not found"):
        regress.compare(run_dir, tmp_path / "none.csv")
    other_gpu = write_synthetic_run(tmp_path / "other", rng, gpu="h200")
    with pytest.raises(ValueError, match="baseline of its own GPU kind"):
        regress.compare(other_gpu, baseline)
    (tmp_path / "junk.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a baseline file"):
        regress.compare(run_dir, tmp_path / "junk.csv")
