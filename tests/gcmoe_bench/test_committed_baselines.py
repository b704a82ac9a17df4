"""The committed measured runs against their committed CI baselines, through the real `compare` command.

Every baseline file under results/baselines/ must accept the run it was made from and reject a copy of that run
whose first compared point was slowed beyond the tolerance."""

from __future__ import annotations

import json
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
    # one dashboard entry per baseline row, each value the run's own speedup (the baseline was made from it)
    entries = {e["name"]: e["value"] for e in json.loads(json_out.read_text())}
    table = pd.read_csv(baseline)
    assert len(entries) == len(table)
    for row in table.itertuples():
        where = f"{row.gpu}/{row.model}/{row.suite}: {row.operator} vs {row.baseline}"
        name = f"{where}, {int(row.tokens_per_rank)} tokens/rank" if row.kind == "point" else f"{where}, mean speedup"
        assert entries[name] == pytest.approx(row.speedup, abs=1e-6), name


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
    doctored_point = points.loc[row]
    slower = [line for line in result.output.splitlines() if line.rstrip(" │").endswith("slower")]
    assert any(doctored_point.model in line and f" {doctored_point.tokens_per_rank} " in line for line in slower), (
        result.output)
