"""The command line: every command explains its options; errors are clear and exit non-zero."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from gcmoe_bench import gate as gate_module
from gcmoe_bench.cli import app

COMMANDS = {
    "sweep": ["--gpu", "--layout", "--models", "--tokens", "--suite", "--out", "--skip-gate", "--l2", "--resume",
              "--windows", "--warmup", "--replays", "--dispatch-sms", "--overlap", "--operators"],
    "ablation": ["RUN_DIR...", "--out"],
    "accuracy": ["--gpu", "--models", "--operators", "--cases", "--out", "--into"],
    "report": ["RUN_DIR...", "--out", "--figures-out", "--format", "--no-figures"],
    "compare": ["RUN_DIR", "--baseline", "--tolerance", "--json", "--allow-missing", "--write-baseline"],
    "gate": ["--min-free-mib", "--samples", "--span", "--max-utilization"],
    "env": ["--json"],
    "build": ["--arch", "--profile", "--layout"],
}
runner = CliRunner()


def invoke(args: list[str]):
    return runner.invoke(app, args, env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


def test_top_level_help_lists_every_command():
    result = invoke(["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_of_each_command_names_every_option(command):
    result = invoke([command, "--help"])
    assert result.exit_code == 0, result.output
    for option in COMMANDS[command]:
        assert option in result.output, f"{command} --help lacks {option}"


def test_sweep_errors_are_clear():
    result = invoke(["sweep"])
    assert result.exit_code == 2 and "name a profile with --gpu; available: b300, cpu, h20, h200" in result.output
    result = invoke(["sweep", "--gpu", "a100"])
    assert result.exit_code == 2 and "no sweep profile" in result.output
    result = invoke(["sweep", "--gpu", "h20", "--models", "glm-5.2"])
    assert result.exit_code == 2 and "--models 'glm-5.2' is not in profile 'h20'" in result.output
    result = invoke(["sweep", "--gpu", "cpu", "--tokens", "1,two"])
    assert result.exit_code == 2 and "--tokens takes integers" in result.output
    result = invoke(["sweep", "--gpu", "cpu", "--l2", "warm"])
    assert result.exit_code == 2 and "l2 = 'warm'; allowed: flush, rotate" in result.output


def test_sweep_ablation_options_are_checked_before_anything_runs(tmp_path):
    for args, message in (
        (["--dispatch-sms", "0"], "--dispatch-sms 0; allowed: an integer >= 1"),
        (["--overlap", "maybe"], "--overlap 'maybe'; allowed: on, off"),
        (["--operators", "gc,mega"], ("--operators mega not in the suites routed, shared of profile 'cpu'; "
                                      "allowed: reference, gc, gc-unfused")),
        (["--suite", "routed", "--operators", "gc-unfused"], "--operators gc-unfused not in the suites routed"),
        (["--operators", "gc-unfused"], "suite 'routed' has none of them"),
    ):
        result = invoke(["sweep", "--gpu", "cpu", "--out", str(tmp_path), *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output
    result = invoke(["sweep", "--gpu", "cpu", "--dispatch-sms", "two"])
    assert result.exit_code == 2 and "Invalid value for '--dispatch-sms'" in result.output
    assert not any(tmp_path.iterdir())  # nothing was measured or written
    for flag in (["--dispatch-sms", "8"], ["--overlap", "off"], ["--operators", "gc"]):
        result = invoke(["sweep", "--resume", str(tmp_path), *flag])
        assert result.exit_code == 2 and "leave out" in result.output and "--dispatch-sms, --overlap" in " ".join(
            result.output.split()), result.output


def test_bad_paths_and_arch_exit_2_with_one_line(tmp_path):
    missing = tmp_path / "no-such-run"
    baseline = tmp_path / "no-such-baseline.csv"
    for args, message in (
        (["report", str(missing), "--out", str(tmp_path / "report")], f"points.csv of run {missing} not found"),
        (["compare", str(missing), "--baseline", str(baseline)], f"baseline file not found: {baseline}"),
        (["build", "--arch", "sm_80", "--profile", "h200"], "unknown arch 'sm_80': allowed sm_90a"),
        (["sweep", "--resume", str(missing)], f"--resume {missing}: no such directory"),
        (["sweep", "--resume", str(tmp_path)], f"--resume {tmp_path} has no env.json"),
        (["accuracy", "--into", str(missing)], f"--into {missing}: no such directory"),
        (["ablation", str(missing), "--out", str(tmp_path / "ablation")], f"{missing} has no env.json"),
    ):
        result = invoke(args)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output, result.output


class IdleOrBusyNvml:
    def __init__(self, busy_gpu: int | None):
        self.busy_gpu = busy_gpu

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlDeviceGetCount(self): return 2
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return "NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 35 if h == self.busy_gpu else 0})()

    def nvmlDeviceGetComputeRunningProcesses(self, h): return []

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"free": random.randint(100_000, 140_000) << 20})()


@pytest.mark.parametrize("busy_gpu", [None, 1])
def test_gate_command(monkeypatch, busy_gpu):
    now = [0.0]
    monkeypatch.setattr(gate_module, "_load_nvml", lambda: IdleOrBusyNvml(busy_gpu))
    monkeypatch.setattr(gate_module.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(gate_module.time, "monotonic", lambda: now[0])
    result = invoke(["gate"])
    if busy_gpu is None:
        assert result.exit_code == 0 and "gate passed" in result.output and now[0] == pytest.approx(10.0)
    else:
        assert result.exit_code == 1 and "GPU 1 (NVIDIA H200): busy, utilization reached 35%" in result.output


def test_env_prints_versions_and_the_runtime_description():
    result = invoke(["env", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["packages"]["torch"] and "commit" in info["git"] and "gc_moe.runtime" in info
