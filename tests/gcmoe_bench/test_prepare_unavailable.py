"""An operator whose prepare raises OperatorUnavailable is a recorded skip on every rank, not the end of the run.

A driver script registers a fake adapter ``flaky`` (the reference operator, except that prepare raises on a chosen
rank and token count) and then runs the ordinary command line, under torchrun with two gloo ranks or alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gcmoe_bench.test_sweep import TINY_PROFILE, check_points_against_raw, rows

DRIVER = '''
import os
from gcmoe_bench import operators
from gcmoe_bench.cli import main

FAIL_RANK = int(os.environ["FLAKY_FAIL_RANK"])
FAIL_TOKENS = {int(t) for t in os.environ["FLAKY_FAIL_TOKENS"].split(",")}
CRASH = os.environ.get("FLAKY_CRASH") == "1"  # raise a plain error instead: a defect, which must stop the run


class FlakyAdapter(operators.ReferenceAdapter):
    name = "flaky"
    role = "operator"

    def prepare(self, workload, group):
        if workload.rank == FAIL_RANK and workload.tokens_per_rank in FAIL_TOKENS:
            if CRASH:
                raise ValueError(f"flaky crashed at T={workload.tokens_per_rank}")
            raise operators.OperatorUnavailable(f"no buffer for T={workload.tokens_per_rank} on this rank")
        return super().prepare(workload, group)


operators.REGISTRY["flaky"] = FlakyAdapter()
main()
'''

TWO_SUITES = TINY_PROFILE.split("[[suites]]")[0] + """
[[suites]]
name = "routed"
baseline = "reference"
operators = ["flaky", "gc"]

[[suites]]
name = "flaky-base"
baseline = "flaky"
operators = ["gc"]
"""


def run_driver(tmp_path: Path, args: list[str], *, ranks: int | None, fail_rank: int, fail_tokens: str,
               crash: bool = False) -> subprocess.CompletedProcess:
    driver = tmp_path / "flaky_driver.py"
    driver.write_text(DRIVER)
    launcher = [sys.executable, str(driver)]
    if ranks:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    str(driver)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "FLAKY_FAIL_RANK": str(fail_rank),
           "FLAKY_FAIL_TOKENS": fail_tokens, "FLAKY_CRASH": "1" if crash else "0"}
    return subprocess.run(launcher + args, capture_output=True, text=True, timeout=150, env=env, check=False)


def by_key(points: list[dict[str, str]]) -> dict[tuple[str, int, str], dict[str, str]]:
    return {(p["suite"], int(p["tokens_per_rank"]), p["operator"]): p for p in points}


@pytest.mark.parametrize("interleave", [False, True])
def test_one_rank_failing_to_prepare_skips_the_operator_on_both_ranks(tmp_path, interleave):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TWO_SUITES.replace("[protocol]\n", f"[protocol]\ninterleave = {str(interleave).lower()}\n"))
    out = tmp_path / "results"
    done = run_driver(tmp_path, ["sweep", "--gpu", str(profile), "--out", str(out), "--suite", "routed"],
                      ranks=2, fail_rank=1, fail_tokens="3")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (out / "tiny").iterdir()
    points = check_points_against_raw(run_dir, 2)  # every measured number recomputed from raw.csv
    got = by_key(points)
    assert sorted(got) == sorted(("routed", t, op) for t in (1, 3) for op in ("reference", "flaky", "gc"))
    skipped = got[("routed", 3, "flaky")]
    assert skipped["status"] == "skipped"
    assert skipped["reason"] == "rank 1: prepare: OperatorUnavailable: no buffer for T=3 on this rank"
    assert skipped["latency_us"] == "" and skipped["speedup"] == ""
    # the same operator at the other point, and the other operators at this one, are measured as usual
    for key in (("routed", 1, "flaky"), ("routed", 1, "gc"), ("routed", 3, "gc"), ("routed", 3, "reference")):
        assert got[key]["status"] == "ok" and float(got[key]["latency_us"]) > 0 and got[key]["speedup"]
    assert not [r for r in rows(run_dir / "raw.csv") if r["operator"] == "flaky" and r["tokens_per_rank"] == "3"]
    assert json.loads((run_dir / "env.json").read_text())["status"] == "complete"
    assert "skip glm-tiny routed T=3 flaky: rank 1: prepare: OperatorUnavailable" in done.stderr


def test_skipped_baseline_leaves_speedups_empty_and_resume_treats_skips_as_finished(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TWO_SUITES)
    out = tmp_path / "results"
    done = run_driver(tmp_path, ["sweep", "--gpu", str(profile), "--out", str(out), "--suite", "flaky-base"],
                      ranks=None, fail_rank=0, fail_tokens="1,3")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (out / "tiny").iterdir()
    points = check_points_against_raw(run_dir, 1)
    got = by_key(points)
    assert sorted(got) == sorted(("flaky-base", t, op) for t in (1, 3) for op in ("flaky", "gc"))
    for tokens in (1, 3):
        base, gc = got[("flaky-base", tokens, "flaky")], got[("flaky-base", tokens, "gc")]
        why = f"prepare: OperatorUnavailable: no buffer for T={tokens} on this rank"
        assert base["status"] == "skipped" and base["reason"] == why
        assert gc["status"] == "ok" and float(gc["latency_us"]) > 0 and gc["speedup"] == ""
        assert gc["reason"] == f"gc_moe backend: reference; no speedup: baseline flaky skipped ({why})"

    # interrupt: gc's T=3 row is lost; the resumed run must not prepare flaky again (here that would crash)
    lines = (run_dir / "points.csv").read_text().splitlines(keepends=True)
    kept = [line for line in lines if not (line.split(",")[3] == "3" and ",gc," in line)]
    assert len(kept) == len(lines) - 1
    (run_dir / "points.csv").write_text("".join(kept))
    resumed = run_driver(tmp_path, ["sweep", "--resume", str(run_dir)], ranks=None, fail_rank=0,
                         fail_tokens="1,3", crash=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = rows(run_dir / "points.csv")
    assert len(after) == len(lines) - 1  # lines counted the header
    check_points_against_raw(run_dir, 1)
    gc3 = by_key(after)[("flaky-base", 3, "gc")]
    assert gc3["status"] == "ok" and gc3["speedup"] == ""
    assert gc3["reason"] == ("gc_moe backend: reference; no speedup: baseline flaky skipped "
                             "(prepare: OperatorUnavailable: no buffer for T=3 on this rank)")


def test_any_other_prepare_error_still_stops_every_rank(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text(TWO_SUITES)
    out = tmp_path / "results"
    done = run_driver(tmp_path, ["sweep", "--gpu", str(profile), "--out", str(out), "--suite", "routed"],
                      ranks=2, fail_rank=1, fail_tokens="1", crash=True)
    assert done.returncode != 0
    failure = "flaky: prepare failed at glm-tiny T=1: ValueError: flaky crashed at T=1"
    assert f"[rank 1/2] error: RuntimeError: {failure}" in done.stderr
    assert f"[rank 0/2] error: stopping because another rank failed (rank 1: {failure})" in done.stderr
    (run_dir,) = (out / "tiny").iterdir()
    assert not (run_dir / "points.csv").exists() or not rows(run_dir / "points.csv")
    env = json.loads((run_dir / "env.json").read_text())
    assert env["status"] == "failed" and env["error"].startswith("RemoteRankError: stopping because another rank")
    assert failure in (run_dir / "error-rank1.log").read_text()  # the failing rank's traceback


def test_accuracy_records_an_operator_one_rank_cannot_prepare_as_skipped(tmp_path):
    done = run_driver(tmp_path, ["accuracy", "--gpu", "cpu", "--models", "deepseek-v4.1-flash-mini", "--cases",
                                 "boundary_t3", "--operators", "flaky,gc", "--out", str(tmp_path)],
                      ranks=2, fail_rank=1, fail_tokens="3")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "cpu").iterdir()
    got = rows(run_dir / "accuracy.csv")
    assert [(r["shared_experts"], r["operator"]) for r in got] == [(s, op) for s in ("0", "1") for op in ("flaky", "gc")]
    for r in got:
        if r["operator"] == "flaky":
            assert r["status"] == "skipped" and r["cosine"] == ""
            assert r["reason"] == "rank 1: prepare: OperatorUnavailable: no buffer for T=3 on this rank"
        else:
            assert r["status"] == "ok" and r["passed"] == "true"
