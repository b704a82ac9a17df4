"""End to end on CPU: torchrun with two gloo ranks at tiny shapes, then resume of an interrupted run."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gcmoe_bench.results import POINT_COLUMNS, RAW_COLUMNS

TINY_PROFILE = """
gpu = "tiny"
description = "two tiny models for tests"
device = "cpu"
tokens_per_rank = [1, 3]
capacity = 4
timeout_s = 60

[protocol]
warmup_windows = 1
measured_windows = 3
replays_per_window = 2
flush_bytes = 1048576

[[models]]
base = "glm-5.2"
name = "glm-tiny"
hidden = 256
intermediate = 128
experts = 8
topk = 2

[[suites]]
name = "routed"
baseline = "reference"
operators = ["gc", "mega-port"]

[[suites]]
name = "shared"
shared_experts = 1
baseline = "reference"
operators = ["gc-unfused"]
"""
WARMUP, MEASURED, RANKS_TORCHRUN = 1, 3, 2


def run_cli(args: list[str], *, torchrun: int | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "gcmoe_bench"]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}",
                    "-m", "gcmoe_bench"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run(launcher + args, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def check_points_against_raw(run_dir: Path, ranks: int) -> list[dict[str, str]]:
    """Every ok point's numbers recomputed from raw.csv: per-rank medians of the measured windows, their max."""
    points, raw = rows(run_dir / "points.csv"), rows(run_dir / "raw.csv")
    assert list(points[0]) == list(POINT_COLUMNS) and list(raw[0]) == list(RAW_COLUMNS)
    by_key: dict[tuple, dict[int, list[tuple[int, float]]]] = {}
    for r in raw:
        key = (r["model"], r["suite"], int(r["tokens_per_rank"]), r["operator"])
        by_key.setdefault(key, {}).setdefault(int(r["rank"]), []).append((int(r["window"]), float(r["latency_us"])))
    assert len(raw) == len({(r["model"], r["suite"], r["tokens_per_rank"], r["operator"], r["rank"], r["window"])
                               for r in raw}), "a raw row is duplicated"
    latency = {}
    for p in points:
        key = (p["model"], p["suite"], int(p["tokens_per_rank"]), p["operator"])
        if p["status"] != "ok":
            assert key not in by_key
            continue
        per_rank = by_key[key]
        assert sorted(per_rank) == list(range(ranks))
        medians = []
        for rank in range(ranks):
            windows = sorted(per_rank[rank])
            assert [w for w, _ in windows] == list(range(WARMUP + MEASURED))
            medians.append(statistics.median(v for w, v in windows if w >= WARMUP))
        assert float(p["latency_us"]) == pytest.approx(max(medians), rel=1e-9)
        assert float(p["spread_us"]) == pytest.approx(max(medians) - min(medians), rel=1e-6, abs=1e-9)
        assert [float(m) for m in p["rank_medians_us"].split(";")] == pytest.approx(medians, abs=1e-3)
        latency[key] = max(medians)
    for p in points:
        key = (p["model"], p["suite"], int(p["tokens_per_rank"]), p["operator"])
        base = (*key[:3], p["baseline"])
        if p["status"] == "ok" and base in latency:
            assert float(p["speedup"]) == pytest.approx(latency[base] / latency[key], rel=1e-9)
        elif p["status"] == "ok":  # the baseline was skipped at this point: no speedup, and the row says why
            assert p["speedup"] == "" and f"no speedup: baseline {p['baseline']} skipped" in p["reason"]
    return points


def test_torchrun_sweep_on_two_gloo_ranks(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_PROFILE.replace("[protocol]\n", "[protocol]\ninterleave = true\n"))
    out = tmp_path / "results"
    done = run_cli(["sweep", "--gpu", str(profile), "--out", str(out)], torchrun=RANKS_TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (out / "tiny").iterdir()
    points = check_points_against_raw(run_dir, RANKS_TORCHRUN)
    # routed: reference, gc, mega-port; shared: reference, gc-unfused; at T = 1 and 3
    assert len(points) == 10
    assert [p["operator"] for p in points[:3]] == ["reference", "gc", "mega-port"]
    for p in points:
        tokens = int(p["tokens_per_rank"])
        assert int(p["total_tokens"]) == 2 * tokens and p["num_ranks"] == "2" and p["l2_mode"] == "flush"
        assert int(p["assignments"]) == 2 * tokens * 2  # uniform routing fills every top-2 slot
        assert 0 <= int(p["remote_assignments"]) <= int(p["assignments"])
        unique = int(p["hbm_working_set_bytes"]) / (3 * 256 * 128 * 17 // 32)
        assert unique == int(unique) and 1 <= unique <= min(8, 2 * tokens * 2)
        if p["operator"] == "mega-port":
            assert p["status"] == "skipped" and "needs a CUDA GPU" in p["reason"]
        else:
            assert p["status"] == "ok" and float(p["latency_us"]) > 0
            assert p["reason"] == ("" if p["operator"] == "reference" else "gc_moe backend: reference")
    env = json.loads((run_dir / "env.json").read_text())
    assert env["command"].startswith("torchrun --nproc-per-node 2 -m gcmoe_bench sweep --gpu")
    assert env["world_size"] == 2 and env["status"] == "complete" and env["profile"]["gpu"] == "tiny"
    assert env["gate"].startswith("not applicable") and {"commit", "dirty"} <= set(env["git"])
    assert env["packages"]["torch"] and len(env["ranks"]) == 2
    assert "glm-tiny routed T=1 gc:" in done.stderr  # rank 0's progress lines


def test_resume_measures_only_what_is_missing_and_never_overwrites(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_PROFILE)
    out = tmp_path / "results"
    args = ["sweep", "--gpu", str(profile), "--out", str(out), "--suite", "routed"]
    first = run_cli(args)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (out / "tiny").iterdir()
    # interrupt: the T=3 points rows are lost, their raw rows stay behind
    lines = (run_dir / "points.csv").read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.split(",")[3] != "3"]  # column 3: tokens_per_rank
    assert len(kept) == len(lines) - 3
    (run_dir / "points.csv").write_text("".join(kept))

    bad = run_cli(["sweep", "--resume", str(run_dir), "--tokens", "1"])
    assert bad.returncode == 2 and "--resume continues a run with the profile recorded" in bad.stderr

    resumed = run_cli(["sweep", "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: dropped 8 raw rows" in resumed.stderr  # T=3 reference + gc, one rank x 4 windows each
    after = (run_dir / "points.csv").read_text().splitlines(keepends=True)
    assert after[: len(kept)] == kept  # finished points untouched
    assert len(after) == len(lines)
    check_points_against_raw(run_dir, 1)
    env = json.loads((run_dir / "env.json").read_text())
    assert len(env["resumed"]) == 1 and env["status"] == "complete"

    again = run_cli(args)  # a fresh sweep never touches the first run
    assert again.returncode == 0
    assert len(list((out / "tiny").iterdir())) == 2 and (run_dir / "points.csv").read_text().splitlines(
        keepends=True) == after


def test_accuracy_command_writes_accuracy_csv(tmp_path):
    done = run_cli(["accuracy", "--gpu", "cpu", "--models", "deepseek-v4.1-flash-mini", "--cases",
                    "boundary_t3,asym_idle_odd_ranks", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "cpu").iterdir()
    got = rows(run_dir / "accuracy.csv")
    # 2 cases x (routed, shared) x (gc, gc-unfused)
    assert [(r["case"], r["shared_experts"], r["operator"]) for r in got] == [
        (case, shared, op) for case in ("boundary_t3", "asym_idle_odd_ranks") for shared in ("0", "1")
        for op in ("gc", "gc-unfused")]
    for r in got:
        assert r["status"] == "ok" and r["passed"] == "true"
        assert float(r["cosine"]) >= (0.99 if r["shared_experts"] == "1" else 0.97)
        assert float(r["processed_diff"]) <= 0.002
        if r["operator"] == "gc":  # the public API on CPU is the reference backend: bit-identical
            assert float(r["max_abs_err"]) == 0.0
    env = json.loads((run_dir / "env.json").read_text())
    assert env["all_passed"] is True and env["command"].startswith("python -m gcmoe_bench accuracy")


def test_rotate_mode_cycles_cloned_input_sets(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_PROFILE)
    done = run_cli(["sweep", "--gpu", str(profile), "--out", str(tmp_path), "--suite", "routed", "--tokens", "1",
                    "--l2", "rotate", "--replays", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "tiny").iterdir()
    raw = rows(run_dir / "raw.csv")
    # a tiny input set is far below twice any cache: every replay of a window gets its own copy
    assert raw and all(r["l2_mode"] == "rotate" and r["copies"] == "4" for r in raw)
    assert {r["operator"] for r in raw} == {"reference", "gc"}
    assert all(p["l2_mode"] == "rotate" for p in rows(run_dir / "points.csv"))


def test_accuracy_into_an_existing_sweep_run(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_PROFILE)
    sweep = run_cli(["sweep", "--gpu", str(profile), "--out", str(tmp_path), "--suite", "routed", "--tokens", "1",
                     "--windows", "1", "--warmup", "0", "--replays", "1"])
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    (run_dir,) = (tmp_path / "tiny").iterdir()
    points_before = (run_dir / "points.csv").read_text()
    first = run_cli(["accuracy", "--into", str(run_dir), "--cases", "boundary_t3"])
    assert first.returncode == 0, first.stderr[-3000:]
    got = rows(run_dir / "accuracy.csv")
    assert [(r["model"], r["case"], r["operator"]) for r in got] == [("glm-tiny", "boundary_t3", op)
                                                                     for _ in range(2) for op in ("gc", "gc-unfused")]
    env = json.loads((run_dir / "env.json").read_text())
    assert env["accuracy"]["all_passed"] is True and env["status"] == "complete"
    assert (run_dir / "points.csv").read_text() == points_before
    second = run_cli(["accuracy", "--into", str(run_dir), "--cases", "boundary_t3"])
    assert second.returncode == 1 and "already has an accuracy.csv" in second.stderr
    assert rows(run_dir / "accuracy.csv") == got


def test_dispatch_request_reaches_the_runtime(monkeypatch):
    from gcmoe_bench.profiles import load_profile
    from gcmoe_bench.sweep import DISPATCH_ENV_VARS, apply_dispatch_request

    for name in DISPATCH_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    apply_dispatch_request(load_profile("cpu"))  # no request: the runtime keeps its defaults
    assert not any(name in os.environ for name in DISPATCH_ENV_VARS)
    for gpu, request in (("b300", "16"), ("h20", "4")):
        apply_dispatch_request(load_profile(gpu))
        assert [os.environ[name] for name in DISPATCH_ENV_VARS] == [request, request]


def test_overlap_switch_reaches_the_runtime(monkeypatch):
    from gcmoe_bench.profiles import apply_overrides, load_profile
    from gcmoe_bench.sweep import OVERLAP_ENV_VAR, apply_overlap

    monkeypatch.delenv(OVERLAP_ENV_VAR, raising=False)
    apply_overlap(load_profile("h200"))  # the default: on, said explicitly so the run records what it ran
    assert os.environ[OVERLAP_ENV_VAR] == "1"
    apply_overlap(apply_overrides(load_profile("h200"), overlap="off"))
    assert os.environ[OVERLAP_ENV_VAR] == "0"


def test_ablation_options_are_recorded_in_every_row_and_reused_by_resume(tmp_path):
    """--operators, --dispatch-sms and --overlap: only the named operators are measured (no baseline, so no
    speedup, and the rows say why), every row carries the request and the switch, env.json's profile records
    all three, and --resume of an interrupted run measures the rest with the recorded settings."""
    profile = tmp_path / "tiny.toml"
    profile.write_text(TINY_PROFILE)
    out = tmp_path / "results"
    done = run_cli(["sweep", "--gpu", str(profile), "--out", str(out), "--suite", "routed", "--operators", "gc",
                    "--dispatch-sms", "8", "--overlap", "off", "--windows", "2", "--warmup", "0", "--replays", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (out / "tiny").iterdir()
    points, raw = rows(run_dir / "points.csv"), rows(run_dir / "raw.csv")
    assert [(p["suite"], p["tokens_per_rank"], p["operator"]) for p in points] == [
        ("routed", "1", "gc"), ("routed", "3", "gc")]
    for r in points + raw:
        assert (r["dispatch_sm_request"], r["overlap"], r["comm_sms"], r["compute_sms"]) == ("8", "off", "", "")
    for p in points:
        assert p["status"] == "ok" and p["speedup"] == ""
        assert p["reason"] == ("gc_moe backend: reference; no speedup: baseline reference not measured "
                               "(not among --operators)")
    env = json.loads((run_dir / "env.json").read_text())
    assert (env["profile"]["dispatch_sm_request"], env["profile"]["overlap"], env["profile"]["only_operators"]) == (
        8, "off", ["gc"])
    lines = (run_dir / "points.csv").read_text().splitlines(keepends=True)
    (run_dir / "points.csv").write_text("".join(lines[:-1]))  # T=3 lost: an interrupted run
    resumed = run_cli(["sweep", "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = rows(run_dir / "points.csv")
    assert [(p["tokens_per_rank"], p["operator"], p["dispatch_sm_request"], p["overlap"]) for p in again] == [
        ("1", "gc", "8", "off"), ("3", "gc", "8", "off")]
    assert {(r["tokens_per_rank"], r["dispatch_sm_request"], r["overlap"]) for r in rows(run_dir / "raw.csv")} == {
        ("1", "8", "off"), ("3", "8", "off")}
