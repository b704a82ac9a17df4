"""The measurement protocol of Section 6.1, applied identically to every operator.

One point of one operator:

1. capture one invocation in a CUDA graph (adapters that synchronize with the host inside a call run eagerly);
2. ``warmup + measured`` windows; before each: flush the last-level cache (write a buffer >= 2x its size),
   synchronize the device, and enter a barrier with every other rank, so all ranks start the window together;
3. a window replays the invocation ``replays`` times between two CUDA events (wall clock on CPU);
   per-invocation latency = window time / replays;
4. each rank keeps the median over its measured windows; the point's latency is the maximum over ranks (the
   slowest rank), its spread the max - min of the rank medians.

L2 regime: with ``l2 = "flush"`` only the first replay of a window starts cold, the other replays find whatever the
previous replay left in L2, so the number is a mostly-warm steady state (exactly the paper's protocol). With
``l2 = "rotate"`` the graph holds invocations on several cloned input sets (weights included) whose combined size
exceeds twice the cache, and consecutive replays cycle through them, so every replay starts cold.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from gcmoe_bench.distributed import DistContext
from gcmoe_bench.operators import Invocation
from gcmoe_bench.profiles import ProtocolSpec

DEFAULT_CPU_CACHE_BYTES = 32 << 20


class WindowTimer(Protocol):
    """Times one window: start() right before the first replay, stop() -> seconds after the last one."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallClockTimer:
    def __init__(self) -> None:
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class CudaEventTimer:
    """Two CUDA events on the current stream; stop() waits for the end event."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def last_level_cache_bytes(device: torch.device) -> int:
    """L2 size of a GPU; the CPU's last-level cache (from sysfs), or 32 MiB when it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    for index in range(4, -1, -1):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if path.is_file():
            text = path.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            return int(text.rstrip("KMG")) * scale
    try:
        return int(os.sysconf("SC_LEVEL3_CACHE_SIZE")) or DEFAULT_CPU_CACHE_BYTES
    except (ValueError, OSError):
        return DEFAULT_CPU_CACHE_BYTES


class CacheFlusher:
    """Writes a buffer of ``nbytes`` (>= 2x the cache) so no line of the previous window survives in the cache."""

    def __init__(self, device: torch.device, nbytes: int):
        self.nbytes = nbytes
        self._buffer = torch.empty(max(nbytes // 4, 1), dtype=torch.int32, device=device)
        self._value = 0

    def flush(self) -> None:
        self._value ^= 1  # a changing value: no layer may skip the write as a no-op
        self._buffer.fill_(self._value)


def rotation_copies(cache_bytes: int, input_set_bytes: int, replays: int) -> int:
    """Input sets to cycle through so that each replay starts cold: the *other* copies together must exceed twice
    the cache. Rounded up to a divisor of ``replays`` so every window replays each copy equally often."""
    needed = max(2, math.ceil(2 * cache_bytes / max(input_set_bytes, 1)) + 1)
    divisors = [d for d in range(1, replays + 1) if replays % d == 0]
    return next((d for d in divisors if d >= needed), replays)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Runner:
    """Runs ``replays`` invocations per call: graph replays of captured copies, or direct calls."""

    run: Callable[[int], None]  # run(replays)
    timing: str  # "cuda-graph", "cuda-eager" or "wall-clock"


def make_runner(invocations: Sequence[Invocation], device: torch.device) -> Runner:
    """Capture the copies (one invocation each, in sequence) in one CUDA graph when they allow it."""
    copies = len(invocations)
    if device.type == "cuda" and all(getattr(i, "capturable", True) for i in invocations):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up outside the capture, as CUDA graphs require
            for _ in range(3):
                for invocation in invocations:
                    invocation()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for invocation in invocations:
                invocation()
        synchronize(device)

        def replay_graph(replays: int) -> None:
            for _ in range(replays // copies):
                graph.replay()

        runner = Runner(replay_graph, "cuda-graph")
        runner.graph = graph  # keep the graph (and its memory pool) alive with the runner
        return runner

    def call_directly(replays: int) -> None:
        for i in range(replays):
            invocations[i % copies]()

    return Runner(call_directly, "cuda-eager" if device.type == "cuda" else "wall-clock")


@dataclass
class Measurement:
    """One point of one operator, every rank's windows included (identical on every rank)."""

    window_us: list[list[float]]  # [rank][window] per-invocation latency, warmup windows first
    warmup_windows: int
    rank_medians_us: list[float]
    latency_us: float  # slowest rank's median
    spread_us: float  # max - min of the rank medians
    timing: str
    copies: int
    note: str = ""


def aggregate(window_us: list[list[float]], warmup_windows: int) -> tuple[list[float], float, float]:
    """Per-rank median over the measured windows, the slowest rank's median, and the spread of the medians."""
    medians = [statistics.median(w[warmup_windows:]) for w in window_us]
    return medians, max(medians), max(medians) - min(medians)


def measure(
    invocations: Sequence[Invocation],
    ctx: DistContext,
    spec: ProtocolSpec,
    *,
    flusher: CacheFlusher,
    timer: WindowTimer | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> Measurement:
    """Run the protocol for one operator on this rank (a collective: every rank calls it for the same point and
    operator). ``invocations`` holds one invocation, or the rotation copies of ``--l2 rotate``."""
    return measure_many({"operator": invocations}, ctx, spec, flusher=flusher, timer=timer,
                        on_window=on_window)["operator"]


def measure_many(
    invocation_sets: dict[str, Sequence[Invocation]],
    ctx: DistContext,
    spec: ProtocolSpec,
    *,
    flusher: CacheFlusher,
    timer: WindowTimer | None = None,
    on_window: Callable[[int, int], None] | None = None,
) -> dict[str, Measurement]:
    """Run the protocol for several operators of one point with their windows interleaved: window w of every
    operator, in order, before window w + 1 of any. Each window is exactly the single-operator window (flush,
    synchronize, barrier, replays); interleaving only makes slow drifts of the machine (another process, clocks)
    fall on every operator alike instead of on whichever operator ran while they lasted."""
    device = ctx.device
    replays = spec.replays_per_window
    for name, invocations in invocation_sets.items():
        if replays % len(invocations):
            raise ValueError(f"{name}: {len(invocations)} rotation copies do not divide {replays} replays per window; "
                             f"allowed: a replay count that is a multiple of {len(invocations)}")
    error = None
    runners: dict[str, Runner] = {}
    try:
        for name, invocations in invocation_sets.items():
            runners[name] = make_runner(invocations, device)
    except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: every rank must hear about it
        error = f"preparing the timed call failed: {type(exc).__name__}: {exc}"
    ctx.check_in(error)
    timer = timer or (CudaEventTimer() if device.type == "cuda" else WallClockTimer())
    windows = spec.warmup_windows + spec.measured_windows
    total = windows * len(runners)
    mine: dict[str, list[float]] = {name: [] for name in runners}
    done = 0
    for window in range(windows):
        for name, runner in runners.items():
            flusher.flush()
            synchronize(device)
            ctx.check_in(error)  # the barrier: all ranks enter the window together (and stop together on failure)
            try:
                timer.start()
                runner.run(replays)
                seconds = timer.stop()
            except Exception as exc:  # noqa: BLE001 - every rank must hear about any failure
                error = f"window {window} failed: {type(exc).__name__}: {exc}"
                ctx.check_in(error)
            mine[name].append(seconds * 1e6 / replays)
            done += 1
            if on_window:
                on_window(done, total)
    ctx.check_in(None)  # matches a rank that failed in the last window, before the gathers below
    measurements = {}
    for name, runner in runners.items():
        window_us = ctx.gather_floats(mine[name])
        medians, latency, spread = aggregate(window_us, spec.warmup_windows)
        invocations = invocation_sets[name]
        measurements[name] = Measurement(
            window_us=window_us, warmup_windows=spec.warmup_windows, rank_medians_us=medians, latency_us=latency,
            spread_us=spread, timing=runner.timing, copies=len(invocations),
            note=getattr(invocations[0], "note", ""))
    return measurements
