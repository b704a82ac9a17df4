"""The protocol on two real gloo ranks (spawned processes): windows, per-rank medians, slowest-rank max,
and failures that stop every rank with a clear message instead of hanging."""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import time

import pytest
import torch.multiprocessing as mp

from gcmoe_bench.profiles import ProtocolSpec
from gcmoe_bench.protocol import CacheFlusher, aggregate, rotation_copies

WARMUP, MEASURED, REPLAYS = 3, 7, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedTimer:
    """Returns the scripted window durations (seconds) in order, as CUDA events or a wall clock would."""

    def __init__(self, seconds: list[float]):
        self.seconds = list(seconds)
        self.starts = 0

    def start(self) -> None:
        self.starts += 1

    def stop(self) -> float:
        return self.seconds.pop(0)


class CountingInvocation:
    def __init__(self, fail_at_call: int | None = None):
        self.calls = 0
        self.fail_at_call = fail_at_call

    def __call__(self) -> None:
        self.calls += 1
        if self.fail_at_call is not None and self.calls == self.fail_at_call:
            raise RuntimeError("operator exploded")


def _init(rank: int, port: int, timeout_s: float = 60.0):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from gcmoe_bench.distributed import init_distributed

    return init_distributed("cpu", timeout_s)


def measure_worker(rank: int, port: int, scripts: list[list[float]], out_dir: str) -> None:
    from gcmoe_bench import distributed, protocol

    ctx = _init(rank, port)
    timer = ScriptedTimer(scripts[rank])
    invocation = CountingInvocation()
    spec = ProtocolSpec(warmup_windows=WARMUP, measured_windows=MEASURED, replays_per_window=REPLAYS)
    m = protocol.measure([invocation], ctx, spec, flusher=CacheFlusher(ctx.device, 1 << 16),
                         timer=timer)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"window_us": m.window_us, "medians": m.rank_medians_us, "latency": m.latency_us,
                   "spread": m.spread_us, "timing": m.timing, "calls": invocation.calls,
                   "starts": timer.starts}, f)
    distributed.shutdown()


def test_slowest_rank_aggregation_across_two_gloo_ranks(tmp_path):
    windows = WARMUP + MEASURED
    # fresh random window times; rank 1 is made the slow one in the measured windows only
    scripts = [[random.uniform(1e-4, 5e-4) for _ in range(windows)] for _ in range(2)]
    scripts[1] = [s * (1.0 if w < WARMUP else 1.5) for w, s in enumerate(scripts[1])]
    scripts[0][0] = 1.0  # a huge warmup window must not count
    mp.spawn(measure_worker, args=(free_port(), scripts, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == {**results[1], "calls": results[0]["calls"], "starts": results[0]["starts"]}
    expected_windows = [[s * 1e6 / REPLAYS for s in script] for script in scripts]
    expected_medians = [statistics.median(w[WARMUP:]) for w in expected_windows]
    for r, got in enumerate(results):
        for got_rank, want_rank in zip(got["window_us"], expected_windows, strict=True):
            assert got_rank == pytest.approx(want_rank)
        assert got["medians"] == pytest.approx(expected_medians)
        assert got["latency"] == pytest.approx(max(expected_medians))
        assert got["spread"] == pytest.approx(max(expected_medians) - min(expected_medians))
        assert got["timing"] == "wall-clock"
        assert got["calls"] == windows * REPLAYS and got["starts"] == windows


def failing_worker(rank: int, port: int, out_dir: str, where: str) -> None:
    from gcmoe_bench import distributed, protocol
    from gcmoe_bench.distributed import RemoteRankError

    ctx = _init(rank, port, timeout_s=90.0)
    started = time.monotonic()
    outcome = "no error"
    try:
        if where == "prepare":
            ctx.check_in("prepare failed: bad shape" if rank == 1 else None)
        else:
            fail_at = 2 * REPLAYS + 1 if rank == 1 else None  # rank 1 fails in its third window
            spec = ProtocolSpec(warmup_windows=1, measured_windows=4, replays_per_window=REPLAYS)
            protocol.measure([CountingInvocation(fail_at)], ctx, spec, 
                             flusher=CacheFlusher(ctx.device, 1 << 16))
    except RemoteRankError as exc:
        outcome = f"remote: {exc}"
    except RuntimeError as exc:
        outcome = f"own: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test in the file below
        outcome = f"unexpected {type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - started:.1f}\n{outcome}")
    distributed.shutdown()  # as the harness does: a gloo group left open aborts at exit once the peer is gone


@pytest.mark.parametrize("where", ["prepare", "window"])
def test_a_failure_on_one_rank_stops_every_rank_with_its_message(tmp_path, where):
    mp.spawn(failing_worker, args=(free_port(), str(tmp_path), where), nprocs=2, join=True)
    seconds0, outcome0 = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    seconds1, outcome1 = (tmp_path / "rank1.txt").read_text().split("\n", 1)
    expected = "bad shape" if where == "prepare" else "window 2 failed: RuntimeError: operator exploded"
    assert outcome1.startswith("own: ") and expected in outcome1
    assert outcome0.startswith("remote: stopping because another rank failed (rank 1: ") and expected in outcome0
    assert float(seconds0) < 60 and float(seconds1) < 60  # told, well before the 90 s timeout


def test_aggregate_and_rotation_by_hand():
    windows = [[9.0, 1.0, 3.0, 2.0], [0.5, 4.0, 4.0, 5.0], [7.0, 2.0, 2.5, 3.0]]
    medians, latency, spread = aggregate(windows, warmup_windows=1)
    assert medians == [2.0, 4.0, 2.5] and latency == 4.0 and spread == 2.0
    # 60 MB L2, 641 MB per copy (GLM-5.2 per-rank slice): two copies already keep every replay cold
    assert rotation_copies(60 << 20, 641 << 20, 100) == 2
    # 50 MB L2, 11 MB per copy: 11 copies needed, 20 is the next divisor of 100
    assert rotation_copies(50 << 20, 11 << 20, 100) == 20
    # more copies needed than replays: every replay its own copy
    assert rotation_copies(64 << 20, 1 << 20, 10) == 10


def test_flush_writes_the_whole_buffer_each_time():
    import torch

    f = CacheFlusher(torch.device("cpu"), 1 << 20)
    f.flush()
    first = f._buffer.clone()
    f.flush()
    assert f._buffer.numel() * 4 == 1 << 20
    assert bool((first != f._buffer).all())  # every element rewritten with a new value


class OneRank:
    """The two collectives measure_many needs, for one rank without a process group."""

    device = __import__("torch").device("cpu")

    def check_in(self, error=None):
        if error:
            raise RuntimeError(error)

    def gather_floats(self, values):
        return [list(values)]


def test_interleaved_windows_alternate_operators_and_keep_their_own_times():
    from gcmoe_bench.protocol import measure_many

    order: list[str] = []

    class Logged:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            order.append(self.name)

    windows = 2 + 3
    # scripted window times, consumed in call order: window w of A, then window w of B, ...
    script = [random.uniform(1e-4, 1e-3) for _ in range(2 * windows)]
    spec = ProtocolSpec(warmup_windows=2, measured_windows=3, replays_per_window=2)
    got = measure_many({"A": [Logged("A")], "B": [Logged("B")]}, OneRank(), spec,
                       flusher=CacheFlusher(OneRank.device, 1 << 12), timer=ScriptedTimer(script))
    assert order == ["A", "A", "B", "B"] * windows  # window by window, each window its 2 replays
    for k, name in enumerate("AB"):
        mine = [s * 1e6 / 2 for s in script[k::2]]
        assert got[name].window_us[0] == pytest.approx(mine)
        assert got[name].latency_us == pytest.approx(statistics.median(mine[2:]))
