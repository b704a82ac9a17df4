"""The committed measured runs against their committed CI baselines, through the real `compare` command.

Every baseline file under results/baselines/ must accept the run it was made from and reject a copy of that run
whose first compared point was slowed beyond the tolerance."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from gcmoe_bench.cli import app

ROOT = Path(__file__).resolve().parents[2]
BASELINES = sorted((ROOT / "results" / "baselines").glob("*.csv"))


def _run_of(baseline: Path) -> Path:
    table = pd.read_csv(baseline)
    runs = set(table["run"].dropna())
    assert len(runs) == 1, f"{baseline.name} mixes runs {sorted(runs)}"
    gpu = table["gpu"].iloc[0]
    run_dir = ROOT / "results" / gpu / runs.pop()
    assert (run_dir / "points.csv").is_file() and (run_dir / "env.json").is_file(), run_dir
    return run_dir


def test_a_cpu_baseline_is_committed():
    assert any(b.stem == "cpu" for b in BASELINES), "results/baselines/cpu.csv is what CI compares against"


@pytest.mark.parametrize("baseline", BASELINES, ids=lambda p: p.stem)
def test_committed_run_passes_its_baseline(baseline, tmp_path):
    run_dir = _run_of(baseline)
    json_out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["compare", str(run_dir), "--baseline", str(baseline), "--json", str(json_out)])
    assert result.exit_code == 0, result.output
    assert json_out.stat().st_size > 0


@pytest.mark.parametrize("baseline", BASELINES, ids=lambda p: p.stem)
def test_doctored_run_fails_its_baseline(baseline, tmp_path):
    run_dir = _run_of(baseline)
    doctored = tmp_path / run_dir.name
    shutil.copytree(run_dir, doctored)
    points = pd.read_csv(doctored / "points.csv", dtype={"reason": str})
    compared = points.index[(points.operator != points.baseline) & (points.status == "ok")]
    row = compared[0]
    points.loc[row, "speedup"] = points.loc[row, "speedup"] * 0.9  # 10% slower than the committed run
    points.loc[row, "latency_us"] = points.loc[row, "latency_us"] / 0.9
    points.to_csv(doctored / "points.csv", index=False)
    result = CliRunner().invoke(app, ["compare", str(doctored), "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "slower" in result.output
