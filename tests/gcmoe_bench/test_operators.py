"""The operator registry: names, availability reasons, and outputs of the CPU-runnable adapters."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from gcmoe_bench.accuracy import unquantized_forward
from gcmoe_bench.models import ModelShape
from gcmoe_bench.operators import REGISTRY, get_operator, operator_names
from gcmoe_bench.workloads import build_weights, build_workload, stable_seed

TINY = ModelShape(name="tiny", base="deepseek-v4.1-flash", hidden=256, intermediate=128, num_experts=8, topk=3,
                  num_shared_experts=1, shared_k_group=32, capacity=8)


@pytest.fixture(scope="module")
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def test_registry_names_and_roles():
    assert operator_names() == ["reference", "gc", "gc-unfused", "mega-port", "deepgemm"]
    assert {n: a.role for n, a in REGISTRY.items()} == {
        "reference": "reference", "gc": "operator", "gc-unfused": "operator", "mega-port": "baseline",
        "deepgemm": "baseline"}
    with pytest.raises(KeyError, match="unknown operator 'mega'; known: reference, gc"):
        get_operator("mega")


def test_pending_baselines_say_why_they_are_skipped():
    ok, reason = get_operator("mega-port").available(torch.device("cpu"))
    assert not ok and reason == "mega-port needs a CUDA GPU (sm_90a); this run is on cpu"
    ok, reason = get_operator("deepgemm").available(torch.device("cpu"))
    assert not ok and reason == ("deepgemm: needs a CUDA GPU (SM100 (compute capability 10.x): fp8_fp4_mega_moe; "
                                 "SM90 (compute capability 9.0): fp8_mega_moe); this run is on cpu")


@pytest.mark.parametrize("shared", [0, 1])
def test_gc_and_reference_agree_with_an_unquantized_forward(group, shared):
    seed = torch.randint(0, 1 << 20, ()).item()  # fresh inputs every run
    weights = build_weights(TINY, 1, 0, shared_experts=1, seed=seed)
    workload = build_workload(TINY, 5, 1, 0, shared_experts=shared, weights=weights, seed=seed)
    outputs = {}
    for name in ("reference", "gc", "gc-unfused"):
        adapter = get_operator(name)
        assert adapter.available(workload.device) == (True, "")
        invocation = adapter.prepare(workload, group)
        invocation.output.fill_(float("nan"))
        invocation()
        assert invocation.output.shape == (5, TINY.hidden) and invocation.output.dtype == torch.bfloat16
        assert bool(torch.isfinite(invocation.output).all())
        outputs[name] = invocation.output.float()
    # the public API on CPU runs the reference backend: the same numbers
    torch.testing.assert_close(outputs["gc"], outputs["reference"], rtol=0, atol=0)
    # unfused adds the shared expert separately: equal up to one extra bf16 rounding of the sum
    torch.testing.assert_close(outputs["gc-unfused"], outputs["reference"], rtol=2e-2, atol=2e-2)
    # an independent forward on unquantized weights (FP8 x FP4 quantization error only)
    from gc_moe import cases

    x_float = cases.random_hidden_states(5, TINY.hidden, seed=stable_seed(seed, TINY.name, "activations", 5, 0))
    y = unquantized_forward(x_float, workload.topk_idx, workload.topk_weights, TINY,
                            expert_seed=stable_seed(seed, TINY.name, "experts"),
                            shared_seed=stable_seed(seed, TINY.name, "shared") if shared else None).float()
    cosine = torch.nn.functional.cosine_similarity(y.flatten(), outputs["gc"].flatten(), dim=0)
    assert cosine > 0.95
