"""The protocol's CUDA path: graph capture, CUDA-event windows, L2 flush and rotation (needs a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gcmoe_bench.profiles import ProtocolSpec

pytestmark = pytest.mark.gpu

# what makes gcmoe_bench (and torch.distributed's env:// rendezvous) believe it is a rank of a running job
JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID")


class MatmulInvocation:
    capturable = True

    def __init__(self, n: int):
        self.a = torch.randn(n, n, device="cuda")
        self.b = torch.randn(n, n, device="cuda")
        self.output = torch.empty(n, n, device="cuda")
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1  # counts host-side calls: under a graph only warmup and capture call it
        torch.matmul(self.a, self.b, out=self.output)


@pytest.fixture(scope="module")
def ctx():
    import socket

    from gcmoe_bench import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {name: os.environ.get(name) for name in JOB_VARIABLES}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    c = distributed.init_distributed("cuda", 120.0)
    distributed.bind_device(c)
    yield c
    distributed.shutdown()
    for name, value in saved.items():  # later tests' child processes must not join this finished job
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_graph_windows_time_the_replays(ctx):
    from gcmoe_bench import protocol

    inv = MatmulInvocation(1024)
    spec = ProtocolSpec(warmup_windows=2, measured_windows=5, replays_per_window=20)
    flusher = protocol.CacheFlusher(ctx.device, 2 * protocol.last_level_cache_bytes(ctx.device))
    m = protocol.measure([inv], ctx, spec, flusher=flusher)
    assert m.timing == "cuda-graph" and inv.calls == 4  # 3 warmup calls + 1 captured, then only replays
    torch.testing.assert_close(inv.output, inv.a @ inv.b)
    # 2 * 1024^3 FLOP per call: between 1 us and 10 ms on any CUDA GPU
    assert len(m.window_us[0]) == 7 and all(1.0 < w < 10_000 for w in m.window_us[0])
    assert m.latency_us == m.rank_medians_us[0] and m.spread_us == 0


def test_rotation_replays_every_copy(ctx):
    from gcmoe_bench import protocol

    copies = [MatmulInvocation(256) for _ in range(4)]
    spec = ProtocolSpec(warmup_windows=1, measured_windows=2, replays_per_window=8, l2="rotate")
    for inv in copies:
        inv.output.zero_()
    m = protocol.measure(copies, ctx, spec, flusher=protocol.CacheFlusher(ctx.device, 1 << 20))
    assert m.copies == 4 and m.timing == "cuda-graph"
    for inv in copies:
        torch.testing.assert_close(inv.output, inv.a @ inv.b)


def test_h200_profile_sweep_on_one_gpu(tmp_path):
    """The h200 profile at one token count, windows shortened: gc through the public API, every baseline measured
    or skipped with its reason."""
    # a one-rank job of its own: the ctx fixture's job variables (its store's port is still in use while the
    # module runs) made this child try to host that store again and fail before the sweep began
    env = {name: value for name, value in os.environ.items() if name not in JOB_VARIABLES}
    env["COLUMNS"] = "200"
    done = subprocess.run(
        [sys.executable, "-m", "gcmoe_bench", "sweep", "--gpu", "h200", "--skip-gate", "--models",
         "deepseek-v4.1-flash", "--tokens", "4", "--windows", "3", "--warmup", "1", "--replays", "10", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=500, env=env, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}"
    (run_dir,) = (tmp_path / "h200").iterdir()
    import csv

    with (run_dir / "points.csv").open() as f:
        points = list(csv.DictReader(f))
    by_op = {(p["suite"], p["operator"]): p for p in points}
    assert by_op["routed", "gc"]["status"] == "ok" and float(by_op["routed", "gc"]["latency_us"]) > 0
    assert by_op["routed", "gc"]["num_experts"] == "48" and by_op["routed", "gc"]["num_ranks"] == "1"
    # the baselines run where they can and otherwise say why (the port's cubins, the deep_gemm package)
    assert {op for _, op in by_op} == {"gc", "gc-unfused", "mega-port", "deepgemm"}
    for p in points:
        if p["status"] == "ok":
            assert float(p["latency_us"]) > 0
        else:
            assert p["status"] == "skipped", p
            assert p["reason"].startswith((f"{p['operator']}: ", "prepare: OperatorUnavailable: ")), p
