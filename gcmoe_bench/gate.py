"""The idle-GPU gate (Section 6.1): every local GPU idle before a sweep creates any CUDA context.

Idle means, in every sample: 0% utilization (configurable ceiling), no compute processes, and at least
``min_free_mib`` MiB free; over at least three NVML samples spanning at least ten seconds. NVML reads these
without creating a CUDA context, which is why the gate runs first. ``nvml`` is injectable so tests can fake it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
MIN_SAMPLES = 3
MIN_SPAN_S = 10.0


class GateError(RuntimeError):
    """A GPU is not idle (or could not be observed long enough); the message names the GPU and the reason."""

    def __init__(self, message: str, report: GateReport | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class GpuObservation:
    index: int
    name: str
    utilization_percent: list[int] = field(default_factory=list)
    compute_processes: list[int] = field(default_factory=list)  # count per sample
    free_mib: list[float] = field(default_factory=list)


@dataclass
class GateReport:
    passed: bool
    samples: int
    span_s: float
    gpus: list[GpuObservation]
    failures: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "samples": self.samples,
            "span_s": round(self.span_s, 3),
            "failures": self.failures,
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "max_utilization_percent": max(g.utilization_percent, default=None),
                    "max_compute_processes": max(g.compute_processes, default=None),
                    "min_free_mib": min(g.free_mib, default=None),
                }
                for g in self.gpus
            ],
        }


def _load_nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # nvidia-ml-py provides the module pynvml
        raise GateError(f"the idle gate needs NVML: install nvidia-ml-py ({exc})") from exc
    return pynvml


def _name(nvml: Any, handle: Any) -> str:
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else str(name)


def observe_gpus(
    *,
    samples: int = MIN_SAMPLES,
    span_s: float = MIN_SPAN_S,
    nvml: Any = None,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
    devices: list[int] | None = None,
) -> tuple[list[GpuObservation], float]:
    """Sample every local GPU ``samples`` times, evenly over ``span_s`` seconds; returns the observations and the
    span the samples really covered."""
    nvml = nvml or _load_nvml()
    sleep, clock = sleep or time.sleep, clock or time.monotonic
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise GateError(f"NVML did not initialize ({exc}); is an NVIDIA driver installed?") from exc
    try:
        count = nvml.nvmlDeviceGetCount()
        indices = list(range(count)) if devices is None else devices
        if not indices:
            raise GateError("NVML sees no GPU on this host; run the CPU profile (--gpu cpu) instead")
        handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        gpus = {i: GpuObservation(index=i, name=_name(nvml, h)) for i, h in handles.items()}
        interval = span_s / (samples - 1) if samples > 1 else 0.0
        first = last = clock()
        for s in range(samples):
            if s:
                sleep(interval)
            last = clock()
            for i, handle in handles.items():
                gpu = gpus[i]
                gpu.utilization_percent.append(int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                gpu.compute_processes.append(len(nvml.nvmlDeviceGetComputeRunningProcesses(handle)))
                gpu.free_mib.append(nvml.nvmlDeviceGetMemoryInfo(handle).free / MIB)
        return list(gpus.values()), last - first
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown must not hide the gate's verdict
            nvml.nvmlShutdown()


def evaluate(
    gpus: list[GpuObservation],
    span_s: float,
    *,
    min_free_mib: float = 51200,
    max_utilization_percent: int = 0,
    min_samples: int = MIN_SAMPLES,
    min_span_s: float = MIN_SPAN_S,
) -> GateReport:
    """Judge observations: one failure line per GPU and reason."""
    failures: list[str] = []
    samples = min((len(g.utilization_percent) for g in gpus), default=0)
    if samples < min_samples or span_s < min_span_s:
        failures.append(
            f"too few samples: {samples} over {span_s:.1f} s; the gate needs at least {min_samples} samples "
            f"spanning at least {min_span_s:.0f} s"
        )
    for g in gpus:
        label = f"GPU {g.index} ({g.name})"
        busy = [u for u in g.utilization_percent if u > max_utilization_percent]
        if busy:
            failures.append(f"{label}: busy, utilization reached {max(busy)}% (allowed: <= {max_utilization_percent}%)")
        if any(g.compute_processes):
            failures.append(f"{label}: {max(g.compute_processes)} compute process(es) running (allowed: none)")
        low = [f for f in g.free_mib if f < min_free_mib]
        if low:
            failures.append(f"{label}: only {min(low):.0f} MiB free (needs >= {min_free_mib:.0f} MiB)")
    return GateReport(passed=not failures, samples=samples, span_s=span_s, gpus=gpus, failures=failures)


def run_gate(
    *,
    min_free_mib: float = 51200,
    samples: int = MIN_SAMPLES,
    span_s: float = MIN_SPAN_S,
    max_utilization_percent: int = 0,
    nvml: Any = None,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> GateReport:
    """Observe and judge; raises GateError (listing every failing GPU and reason) unless every GPU is idle."""
    gpus, observed_span = observe_gpus(samples=samples, span_s=span_s, nvml=nvml, sleep=sleep, clock=clock)
    report = evaluate(gpus, observed_span, min_free_mib=min_free_mib,
                      max_utilization_percent=max_utilization_percent)
    if not report.passed:
        raise GateError("idle-GPU gate failed:\n  " + "\n  ".join(report.failures), report)
    return report
