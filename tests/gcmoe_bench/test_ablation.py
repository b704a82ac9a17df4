"""The partition-size and overlap ablations from synthetic sweep runs (written with results.RunWriter, the format
a sweep writes): the tables' numbers, the figure, never overwriting, and runs that cannot be compared."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from gcmoe_bench import ablation
from gcmoe_bench.cli import app
from gcmoe_bench.results import POINT_COLUMNS, SETTING_COLUMNS, RunWriter, _append_rows

TOKENS = (1, 8)
# (request, overlap) -> (comm SMs, compute SMs) of a 132-SM H200 at alignment 8
PARTITION = {2: (4, 128), 4: (4, 128), 8: (12, 120), 16: (20, 112), 32: (36, 96)}


def latency(request: int, overlap: str, tokens: int, model: str = "glm-tiny") -> float:
    """A made-up but distinct latency per setting, so that every mean and ratio is checkable."""
    return 100.0 + 2 * tokens + {2: 9, 4: 10, 8: 6, 16: 7, 32: 20}[request] + (30 if overlap == "off" else 0) + (
        5 if model != "glm-tiny" else 0)


def make_run(root, name, request, overlap, *, gpu="h200", device="NVIDIA H200", hidden=256, ranks=1, l2="flush",
             models=("glm-tiny",), offset=0.0, columns=POINT_COLUMNS, baseline_row=True):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    writer = RunWriter(run_dir)
    writer.write_env({"gpus": [device] * ranks, "world_size": ranks, "status": "complete",
                      "profile": {"gpu": gpu, "dispatch_sm_request": request, "overlap": overlap}})
    comm, compute = PARTITION[request]
    note = f"gc_moe backend: sm90; partition comm/compute {comm}/{compute} SMs; overlap {overlap}"
    rows = []
    for model in models:
        for tokens in TOKENS:
            shape = {"gpu": gpu, "model": model, "suite": "routed", "tokens_per_rank": tokens,
                     "total_tokens": tokens * ranks, "num_ranks": ranks, "hidden": hidden, "intermediate": 128,
                     "num_experts": 8, "topk": 2, "num_shared_experts": 0, "baseline": "mega-port", "l2_mode": l2,
                     "dispatch_sm_request": request, "overlap": overlap}
            if baseline_row:
                rows.append({**shape, "operator": "mega-port", "latency_us": 500.0, "status": "ok", "reason": ""})
            rows.append({**shape, "operator": "gc", "latency_us": latency(request, overlap, tokens, model) + offset,
                         "status": "ok", "reason": note, "comm_sms": comm, "compute_sms": compute})
            rows.append({**shape, "operator": "deepgemm", "status": "skipped", "reason": "not installed"})
    _append_rows(writer.points_path, columns, rows)
    return run_dir


def read_csv(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    made = [make_run(root, f"req{r}", r, "on") for r in (2, 4, 8, 16, 32)]
    made.append(make_run(root, "req4-again", 4, "on", offset=2.0))  # a repeat: means over the runs of a setting
    made.append(make_run(root, "req4-off", 4, "off"))
    made.append(make_run(root, "req8-off", 8, "off"))
    return made


def test_tables_figure_and_markdown(runs, tmp_path):
    out = tmp_path / "ablation"
    files = ablation.run_ablation(runs, out)
    assert [p.name for p in files.all_paths()] == ["partition.md", "partition.csv", "overlap.md", "overlap.csv",
                                                   "partition-latency.png", "partition-latency.pdf"]
    assert all(p.stat().st_size > 0 for p in files.all_paths())
    assert (out / "partition-latency.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "partition-latency.pdf").read_bytes()[:4] == b"%PDF"

    partition = read_csv(out / "partition.csv")
    assert list(partition[0]) == ablation.PARTITION_CSV_COLUMNS
    gc = {(r["overlap"], int(r["dispatch_sm_request"]), int(r["tokens_per_rank"])): r
          for r in partition if r["operator"] == "gc"}
    assert len(gc) == 7 * len(TOKENS)  # five requests on, two off
    for (overlap, request, tokens), row in gc.items():
        assert (int(row["comm_sms"]), int(row["compute_sms"])) == PARTITION[request]
        want = latency(request, overlap, tokens) + (1.0 if (overlap, request) == ("on", 4) else 0.0)
        assert float(row["latency_us"]) == pytest.approx(want, abs=1e-6)
        assert int(row["runs"]) == (2 if (overlap, request) == ("on", 4) else 1)
        reference = latency(4, overlap, tokens) + (1.0 if overlap == "on" else 0.0)
        assert float(row["speedup_vs_request_4"]) == pytest.approx(reference / want, abs=1e-6)
    assert gc["on", 4, 1]["run_ids"] == "req4;req4-again"
    # the baseline is measured too: no partition, the same request and overlap as its run
    base = [r for r in partition if r["operator"] == "mega-port"]
    assert base and all(r["comm_sms"] == "" and r["compute_sms"] == "" for r in base)
    assert not any(r["operator"] == "deepgemm" for r in partition)  # skipped rows have no latency

    overlap = read_csv(out / "overlap.csv")
    assert list(overlap[0]) == ablation.OVERLAP_CSV_COLUMNS
    pairs = {(int(r["dispatch_sm_request"]), int(r["tokens_per_rank"])): r for r in overlap if r["operator"] == "gc"}
    assert set(pairs) == {(r, t) for r in (4, 8) for t in TOKENS}
    for (request, tokens), row in pairs.items():
        on = latency(request, "on", tokens) + (1.0 if request == 4 else 0.0)
        off = latency(request, "off", tokens)
        assert (float(row["latency_on_us"]), float(row["latency_off_us"])) == pytest.approx((on, off), abs=1e-6)
        assert float(row["off_over_on"]) == pytest.approx(off / on, abs=1e-6)

    md = (out / "partition.md").read_text()
    assert md.startswith("# Partition-size ablation: GC-MoE on 1×H200")
    assert "## glm-tiny, routed experts, GC-MoE" in md
    assert "| Overlap | Request | Comm SMs | Compute SMs | Runs | T=1 (µs) | T=8 (µs) | T=1 vs 4 | T=8 vs 4 |" in md
    assert f"| on | 8 | 12 | 120 | 1 | {latency(8, 'on', 1):.3f} | {latency(8, 'on', 8):.3f} |" in md
    assert "| on | 4 | 4 | 128 | 2 | 113.000 | 127.000 | 1.0000 | 1.0000 |" in md  # (112, 126) and 2 more
    omd = (out / "overlap.md").read_text()
    assert f"| 8 | 12 | 120 | 1 | {latency(8, 'on', 1):.3f} | {latency(8, 'off', 1):.3f} |" in omd


def test_never_overwrites(runs, tmp_path):
    out = tmp_path / "ablation"
    ablation.run_ablation(runs[:2], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ablation.AblationError, match=r"already holds partition.md, .*never overwrites.*ablation-2"):
        ablation.run_ablation(runs, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # one file in the way is enough: nothing at all is written
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "overlap.csv").write_text("mine\n")
    with pytest.raises(ablation.AblationError, match="already holds overlap.csv"):
        ablation.run_ablation(runs, lone)
    assert [p.name for p in lone.iterdir()] == ["overlap.csv"] and (lone / "overlap.csv").read_text() == "mine\n"


@pytest.mark.parametrize("change, message", [
    ({"gpu": "h20", "device": "NVIDIA H20"}, "runs of different GPU kinds cannot be compared: .* has h200, .* has h20"),
    ({"device": "NVIDIA H200 NVL"}, "runs of different devices cannot be compared"),
    ({"hidden": 512}, r"model 'glm-tiny' has different shapes in .* \(hidden 256 vs 512\): runs of different models"),
    ({"ranks": 2}, "runs of different rank counts cannot be compared"),
    ({"l2": "rotate"}, "runs of different L2 modes cannot be compared: .* has flush, .* has rotate"),
])
def test_runs_that_cannot_be_compared_are_refused(runs, tmp_path, change, message):
    other = make_run(tmp_path / "other", "odd", 8, "on", **change)
    out = tmp_path / "ablation"
    with pytest.raises(ablation.AblationError, match=message):
        ablation.run_ablation([runs[0], other], out)
    assert not out.exists()


def test_the_same_run_twice_and_other_models_alongside(runs, tmp_path):
    with pytest.raises(ablation.AblationError, match="is given twice"):
        ablation.run_ablation([runs[0], runs[0]], tmp_path / "a")
    # a run that adds another model (its shape its own) is fine: each model gets its own section
    wider = make_run(tmp_path / "other", "two-models", 16, "on", models=("glm-tiny", "dsv-tiny"))
    ablation.run_ablation([runs[1], wider], tmp_path / "b")
    md = (tmp_path / "b" / "partition.md").read_text()
    assert "## dsv-tiny, routed experts, GC-MoE" in md and "## glm-tiny, routed experts, GC-MoE" in md
    assert "No point was measured with the overlap both on and off" in (tmp_path / "b" / "overlap.md").read_text()


def test_runs_written_before_the_setting_columns(tmp_path):
    """Older points.csv files: the request and the overlap come from env.json's profile (on: there was no switch),
    the partition from the gc row's note; runs without the baseline (--operators gc) are fine."""
    old_columns = tuple(c for c in POINT_COLUMNS if c not in SETTING_COLUMNS)
    old = make_run(tmp_path, "old", 4, "on", columns=old_columns)
    env = json.loads((old / "env.json").read_text())
    del env["profile"]["overlap"]
    (old / "env.json").write_text(json.dumps(env))
    new = make_run(tmp_path, "new", 16, "on", baseline_row=False)
    ablation.run_ablation([old, new], tmp_path / "out")
    rows = [r for r in read_csv(tmp_path / "out" / "partition.csv") if r["operator"] == "gc"]
    got = {(r["overlap"], r["dispatch_sm_request"], r["comm_sms"], r["compute_sms"]) for r in rows}
    assert got == {("on", "4", "4", "128"), ("on", "16", "20", "112")}
    row16 = next(r for r in rows if r["dispatch_sm_request"] == "16" and r["tokens_per_rank"] == "1")
    assert float(row16["speedup_vs_request_4"]) == pytest.approx(latency(4, "on", 1) / latency(16, "on", 1))


def test_cli(runs, tmp_path):
    runner = CliRunner()
    env = {"COLUMNS": "250", "NO_COLOR": "1"}
    out = tmp_path / "ablation"
    done = runner.invoke(app, ["ablation", *map(str, runs), "--out", str(out)], env=env)
    assert done.exit_code == 0, done.output
    assert f"written: {out / 'partition.md'}" in done.output and (out / "partition-latency.pdf").is_file()
    again = runner.invoke(app, ["ablation", *map(str, runs), "--out", str(out)], env=env)
    assert again.exit_code == 2 and "never overwrites" in again.output and "Traceback" not in again.output
    h20 = make_run(tmp_path / "other", "h20", 4, "on", gpu="h20", device="NVIDIA H20")
    mixed = runner.invoke(app, ["ablation", str(runs[0]), str(h20), "--out", str(tmp_path / "mixed")], env=env)
    assert mixed.exit_code == 2 and "runs of different GPU kinds cannot be compared" in mixed.output
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    missing = runner.invoke(app, ["ablation", str(empty), "--out", str(tmp_path / "x")], env=env)
    assert missing.exit_code == 2 and "has no env.json" in missing.output
