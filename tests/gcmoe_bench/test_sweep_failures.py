"""A failing sweep never exits silently: one line on stderr naming the error, the traceback in the run
directory's error-rank<r>.log (or after the line when no run directory exists yet), env.json marked failed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from gcmoe_bench import sweep as sweep_module
from gcmoe_bench.cli import app

PROFILE = """
gpu = "tiny"
description = "one tiny model"
device = "cpu"
tokens_per_rank = [1]
capacity = 4
timeout_s = 60

[protocol]
warmup_windows = 0
measured_windows = 1
replays_per_window = 1
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
operators = ["gc"]
"""


@pytest.fixture
def one_rank_env(monkeypatch):
    """A one-rank job's variables, restored after the test (init_distributed fills in what is missing)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


def test_an_exception_inside_the_sweep_is_printed_and_its_traceback_logged(tmp_path, monkeypatch, one_rank_env):
    marker = f"forced failure {uuid.uuid4().hex}"

    def failing_plan(profile, finished):
        raise RuntimeError(marker)

    monkeypatch.setattr(sweep_module, "_plan", failing_plan)
    profile = tmp_path / "tiny.toml"
    profile.write_text(PROFILE)
    result = CliRunner().invoke(app, ["sweep", "--gpu", str(profile), "--out", str(tmp_path / "out")],
                                env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert result.exit_code == 1
    (run_dir,) = (tmp_path / "out" / "tiny").iterdir()
    log = run_dir / "error-rank0.log"
    line = f"[rank 0/1] error: RuntimeError: {marker} (traceback: {log})"
    assert line in result.stderr.splitlines()
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "failing_plan" in text and marker in text
    env = json.loads((run_dir / "env.json").read_text())
    assert env["status"] == "failed" and env["error"] == f"RuntimeError: {marker}"


def test_a_job_that_cannot_be_joined_says_why_with_the_traceback(tmp_path):
    """The variables of another one-rank job leaked into this process's environment (as a test process that
    initialized torch.distributed passes to its children): its store's port is taken, so joining fails before
    any run directory exists; the line and the traceback go to stderr."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        profile = tmp_path / "tiny.toml"
        profile.write_text(PROFILE)
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
        env.pop("TORCHELASTIC_RUN_ID", None)
        done = subprocess.run([sys.executable, "-m", "gcmoe_bench", "sweep", "--gpu", str(profile), "--out",
                               str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env,
                              check=False)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    first = next(i for i, text in enumerate(lines) if text.startswith("[gcmoe-bench] error: "))
    assert str(port) in lines[first] or "address" in lines[first].lower(), lines[first]
    assert "Traceback (most recent call last)" in done.stderr[done.stderr.index(lines[first]):]
    assert not (tmp_path / "out").exists()  # it failed before any run directory
