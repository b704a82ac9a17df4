"""scripts/device_layer_p2.py (P = 2 on one GPU as two processes) on the CPU: its arguments, the import without a
GPU, the reasons it writes when P = 2 cannot be set up, and its whole flow as a CPU dry run (two gloo ranks, the
API's reference backend) so that the GPU run starts from a script that works."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_layer_p2.py"


@pytest.fixture(scope="module")
def p2():
    spec = importlib.util.spec_from_file_location("device_layer_p2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no GPU, no torch.distributed: the import alone must work
    return module


def test_arguments(p2):
    args = p2.parse_args(["--out", "x/p2.json"])
    assert args.shape_list == ["small"] and args.token_list == [1, 8, 64] and args.replays == 200
    assert args.backend == "gloo" and not args.cpu_dry_run
    args = p2.parse_args(["--shapes", "small,glm-5.2", "--tokens", "1,64", "--backend", "nccl", "--replays", "5"])
    assert args.shape_list == ["small", "glm-5.2"] and args.token_list == [1, 64] and args.backend == "nccl"
    assert p2.SHAPES["small"] == (16, 4, 1024, 256, 64)
    assert p2.rank_path(Path("o/p2.json"), 1) == Path("o/p2.rank1.json")
    for bad in (["--shapes", "tiny"], ["--tokens", "0"], ["--tokens", "65"], ["--tokens", "a"], ["--replays", "0"],
                ["--backend", "mpi"]):
        with pytest.raises(SystemExit):
            p2.parse_args(bad)


def test_point_verdict(p2):
    good = {"error": None, "accuracy_passed": True, "nonfinite": 0, "mismatched_replays": 0,
            "eager_after_mismatch": 0, "arrival_errors_added": 0, "ring_overflows_added": 0, "replays_added": 201}
    assert p2.point_passes(good, 200)
    for key, value in (("replays_added", 200), ("mismatched_replays", 1), ("arrival_errors_added", 1),
                       ("accuracy_passed", False), ("error", "RuntimeError: trap"), ("nonfinite", 3)):
        assert not p2.point_passes({**good, key: value}, 200), key


def test_environment_defaults_keep_what_was_given(p2, monkeypatch):
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.setenv("GC_MOE_WAIT_TIMEOUT_S", "20")
    given = p2.setup_environment()
    assert given["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] is None
    assert os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["GC_MOE_WAIT_TIMEOUT_S"] == "20"  # a given limit stays


def _run(tmp_path, extra, ranks):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    launcher = [sys.executable, str(SCRIPT)]
    if ranks:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    str(SCRIPT)]
    out = tmp_path / "p2.json"
    done = subprocess.run(launcher + ["--out", str(out)] + extra, capture_output=True, text=True, timeout=240,
                          env=env, check=False)
    return done, out


def test_without_torchrun_it_writes_why(tmp_path):
    done, out = _run(tmp_path, [], ranks=None)
    assert done.returncode == 2, done.stderr[-2000:]
    summary = json.loads(out.read_text())
    (error,) = summary["setup_errors"]
    assert error["stage"] == "environment" and "needs 2 processes under torchrun" in error["error"]
    assert "P = 2 on one GPU: FAIL" in done.stdout


@pytest.mark.slow
def test_two_ranks_without_a_gpu_agree_on_the_reason(tmp_path):
    done, out = _run(tmp_path, [], ranks=2)
    assert done.returncode != 0
    summary = json.loads(out.read_text())
    assert summary["exit_status"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert [(e["stage"], e["error"]) for e in summary["setup_errors"]] == [
        ("device", "RuntimeError: torch sees no CUDA GPU")] * 2
    assert json.loads((tmp_path / "p2.rank1.json").read_text())["stage"] == "done"


@pytest.mark.slow
def test_cpu_dry_run_of_the_whole_flow(tmp_path):
    done, out = _run(tmp_path, ["--cpu-dry-run", "--tokens", "1,8"], ranks=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["passed"] and summary["cpu_dry_run"] and not summary["setup_errors"]
    points = [p for r in summary["ranks"] for p in r["points"]]
    assert sorted((p["rank"], p["tokens"]) for p in points) == [(0, 1), (0, 8), (1, 1), (1, 8)]
    for p in points:  # the reference backend is the reference: exact, and half the traffic crosses ranks
        assert p["passed"] and p["cosine"] == pytest.approx(1.0) and p["processed_diff"] == 0.0
        assert p["rows"] == 4 * p["tokens"]
        assert 0 <= p["remote_rows"] <= p["rows"]
    assert "P = 2 CPU dry run (the API's reference backend: no kernels): PASS" in done.stdout
