"""The idle-GPU gate against a faked NVML: pass, busy, low memory, compute processes, too few samples."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from gcmoe_bench.gate import MIB, GateError, run_gate


class FakeNvml:
    """NVML with scripted per-sample readings: readings[gpu][sample] = (util %, processes, free MiB)."""

    def __init__(self, readings: list[list[tuple[int, int, float]]], names: list[str] | None = None):
        self.readings = readings
        self.names = names or [f"NVIDIA H200 #{i}" for i in range(len(readings))]
        self.calls = {i: 0 for i in range(len(readings))}
        self.initialized = self.shut_down = False

    def nvmlInit(self):
        self.initialized = True

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode()  # older bindings return bytes

    def _now(self, h):
        return self.readings[h][min(self.calls[h], len(self.readings[h]) - 1)]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._now(h)[0], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=1000 + p) for p in range(self._now(h)[1])]

    def nvmlDeviceGetMemoryInfo(self, h):
        free = self._now(h)[2]
        self.calls[h] += 1  # the last reading of a sample: advance to the next sample
        return SimpleNamespace(free=int(free * MIB), total=int(141 * 1024 * MIB), used=0)


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def idle(samples: int, free: float = 140_000.0) -> list[tuple[int, int, float]]:
    return [(0, 0, free - random.random() * 1000) for _ in range(samples)]


def gate(nvml: FakeNvml, **kw):
    clock = FakeClock()
    return run_gate(nvml=nvml, sleep=clock.sleep, clock=clock, **kw), clock


def test_idle_gpus_pass_over_three_samples_spanning_ten_seconds():
    nvml = FakeNvml([idle(3) for _ in range(8)])
    report, clock = gate(nvml)
    assert report.passed and report.samples == 3 and report.span_s == pytest.approx(10.0)
    assert clock.sleeps == [5.0, 5.0]  # evenly spread samples
    assert all(c == 3 for c in nvml.calls.values()) and nvml.shut_down
    gpus = report.to_dict()["gpus"]
    assert [g["name"] for g in gpus] == nvml.names
    for g, readings in zip(gpus, nvml.readings):
        assert g["min_free_mib"] == pytest.approx(min(r[2] for r in readings), abs=1e-3)


def test_busy_gpu_fails_naming_it():
    readings = [idle(3) for _ in range(4)]
    readings[2][1] = (7, 0, 140_000.0)  # one sample of GPU 2 shows 7% utilization
    with pytest.raises(GateError) as err:
        gate(FakeNvml(readings))
    message = str(err.value)
    assert "GPU 2 (NVIDIA H200 #2): busy, utilization reached 7%" in message
    assert "GPU 0" not in message and "GPU 1" not in message and "GPU 3" not in message
    assert err.value.report is not None and not err.value.report.passed


def test_low_free_memory_fails_with_the_amount():
    readings = [idle(3), idle(3)]
    readings[1][2] = (0, 0, 40_000.0)
    with pytest.raises(GateError, match=r"GPU 1 \(NVIDIA H200 #1\): only 40000 MiB free \(needs >= 51200 MiB\)"):
        gate(FakeNvml(readings))
    # a lower floor lets the same readings pass
    report, _ = gate(FakeNvml(readings), min_free_mib=30_000)
    assert report.passed


def test_compute_process_fails():
    readings = [idle(3)]
    readings[0][0] = (0, 2, 140_000.0)
    with pytest.raises(GateError, match=r"GPU 0 .*2 compute process\(es\) running"):
        gate(FakeNvml(readings))


def test_too_few_samples_or_too_short_a_span_fail():
    with pytest.raises(GateError, match="too few samples: 2 over 10.0 s"):
        gate(FakeNvml([idle(2)]), samples=2)
    with pytest.raises(GateError, match=r"too few samples: 3 over 4.0 s.*at least 3 samples spanning at least 10 s"):
        gate(FakeNvml([idle(3)]), span_s=4.0)


def test_every_failure_is_listed():
    readings = [idle(3), idle(3)]
    readings[0][0] = (50, 1, 100.0)
    with pytest.raises(GateError) as err:
        gate(FakeNvml(readings))
    failures = err.value.report.failures
    assert len(failures) == 3 and all(f.startswith("GPU 0") for f in failures)


def test_no_gpu_is_an_error():
    with pytest.raises(GateError, match="sees no GPU"):
        gate(FakeNvml([]))
