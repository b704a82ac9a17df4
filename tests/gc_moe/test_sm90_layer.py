"""The sm90 backend and the SM90 layer's host side (CPU): registration, selection, the reasons it gives, the
token-tile plan, the kernels it loads, weight and option checks, and the harness adapter's backend notes."""

from __future__ import annotations

import pytest
import torch
from gc_moe import api
from gc_moe.kernels.sm90 import backend as sm90_backend
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.kernels.sm90 import layer as sm90_layer
from gc_moe.planning import GcMoeConstraintError

GLM = {"num_experts": 32, "num_ranks": 1, "topk": 8, "hidden": 6144, "intermediate": 2048, "capacity": 256}
DSV = {"num_experts": 48, "num_ranks": 1, "topk": 6, "hidden": 5120, "intermediate": 2304, "capacity": 256}


# ------------------------------------------------------------------------------------------------ registration
def test_registered_for_sm90_with_its_layout_and_above_the_reference():
    backends = api.registered_backends()
    b = backends["sm90"]
    assert b.archs == ("sm90",) and b.weight_layout == "sm90"
    assert b.priority > backends[api.REFERENCE].priority
    assert "gc_moe.kernels.sm90.backend" in api._OPTIONAL_BACKEND_MODULES


def test_not_picked_on_cpu():
    assert api.select_backend("cpu").name == api.REFERENCE
    with pytest.raises(RuntimeError, match=r"serves \('sm90',\), this device is cpu"):
        api.select_backend("cpu", "sm90")
    reason = sm90_backend.unavailable_reason(torch.device("cpu"), None)
    assert reason and "sm_90" in reason and "compute capability 9.0" in reason


def test_unavailable_without_cubins_or_dsl_names_the_build_command(tmp_path, monkeypatch):
    from gc_moe.runtime import jit

    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))  # an empty cache
    monkeypatch.setattr(jit, "dsl_available", lambda: False)
    monkeypatch.setattr(sm90_backend, "_kernel_reason_cache", {})
    monkeypatch.setattr(sm90_backend.importlib.util, "find_spec", lambda name: object())  # bindings "present"
    reason = sm90_backend.unavailable_reason(torch.device("cuda", 0), "sm90")
    assert reason is not None
    assert f"{len(sm90_layer.kernel_variants())} of its kernels are not in the cubin cache {tmp_path}" in reason
    assert "gcmoe-bench build --arch sm_90a --profile h200" in reason


def test_unavailable_without_the_driver_bindings(monkeypatch):
    monkeypatch.setattr(sm90_backend.importlib.util, "find_spec", lambda name: None)
    assert "cuda-bindings" in sm90_backend.unavailable_reason(torch.device("cuda", 0), "sm90")


def test_available_when_the_dsl_can_build_what_the_cache_lacks(tmp_path, monkeypatch):
    from gc_moe.runtime import jit

    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "dsl_available", lambda: True)
    monkeypatch.setattr(sm90_backend, "_kernel_reason_cache", {})
    monkeypatch.setattr(sm90_backend.importlib.util, "find_spec", lambda name: object())
    assert sm90_backend.unavailable_reason(torch.device("cuda", 0), "sm90") is None


# ------------------------------------------------------------------------------------------------ supported shapes
@pytest.mark.parametrize("shape", [GLM, DSV], ids=["glm", "deepseek"])
def test_both_model_slices_are_supported(shape):
    assert sm90_layer.unsupported_reasons(**shape, activation_alpha=1.0, activation_clamp=10.0) == []


@pytest.mark.parametrize("change, expected", [
    ({"hidden": 6144 + 128}, "a multiple of 256"),
    ({"intermediate": 2048 + 64}, "a multiple of 128"),
    ({"num_experts": 4096}, "at most 2048"),
    ({"num_experts": 33, "num_ranks": 2}, "a multiple of the rank count"),
    ({"topk": 32, "num_shared_experts": 1}, "at most 32 combine lanes"),
    ({"activation_alpha": 1.5}, "alpha 1; allowed: 1"),
    ({"activation_clamp": None}, "clamp 10; allowed: 10"),
    ({"activation_clamp": 7.0}, "activation_clamp 7.0"),
])
def test_unsupported_configurations_say_what_is_allowed(change, expected):
    reasons = sm90_layer.unsupported_reasons(**{**GLM, **change})
    assert any(expected in r for r in reasons), reasons


def test_shared_experts_declined_while_their_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(sm90_layer, "shared_expert_unavailable_reason", lambda: "no role4 cubins here")
    reasons = sm90_layer.unsupported_reasons(**GLM, num_shared_experts=1)
    assert reasons == [("num_shared_experts 1: no role4 cubins here; allowed: 0 (the reference backend serves shared "
                        "experts: get_symm_buffer_for_gc_moe(..., backend='reference'))")]
    monkeypatch.setattr(sm90_layer, "shared_expert_unavailable_reason", lambda: None)
    assert sm90_layer.unsupported_reasons(**GLM, num_shared_experts=1) == []


def test_shared_expert_reason_names_the_build_command_or_the_missing_module(tmp_path, monkeypatch):
    from gc_moe.runtime import jit

    monkeypatch.setattr(jit, "dsl_available", lambda: False)
    monkeypatch.setattr(sm90_layer, "_shared_reason_cache", {})
    reason = sm90_layer.shared_expert_unavailable_reason(tmp_path)
    assert "shared-expert kernels are not in the cubin cache" in reason and "gcmoe-bench build --arch sm_90a" in reason
    monkeypatch.setattr(jit, "dsl_available", lambda: True)
    monkeypatch.setattr(sm90_layer, "_shared_reason_cache", {})
    assert sm90_layer.shared_expert_unavailable_reason(tmp_path) is None
    monkeypatch.setattr(sm90_layer, "SHARED_EXPERT_MODULE", "gc_moe.kernels.sm90.no_such_shared_expert")
    assert "is not part of this build" in sm90_layer.shared_expert_unavailable_reason(tmp_path)


def test_check_shared_weights():
    from gc_moe.formats import quantize_shared_expert_weights

    shape = sm90_layer.layer_shape(1, 2, 1, 256, 128, 4, num_shared_experts=1)
    good = quantize_shared_expert_weights(torch.randn(256, 256) / 16, torch.randn(256, 128) / 11)
    sm90_layer.check_shared_weights(shape, good, torch.device("cpu"))
    wide = quantize_shared_expert_weights(torch.randn(512, 256) / 16, torch.randn(256, 256) / 16)
    with pytest.raises(ValueError, match="Is=256; allowed: H=256, Is=128"):
        sm90_layer.check_shared_weights(shape, wide, torch.device("cpu"))
    with pytest.raises(TypeError, match="SharedExpertWeights"):
        sm90_layer.check_shared_weights(shape, (good.w1, good.w2), torch.device("cpu"))


def test_allocate_refuses_shared_experts_with_a_constraint_error_naming_the_reference(monkeypatch):
    monkeypatch.setattr(sm90_layer, "shared_expert_unavailable_reason", lambda: "role4 cubins missing")
    buffer = api.GcMoeBuffer(group=None, num_experts=32, capacity=256, topk=8, hidden=6144, intermediate=2048,
                             mma_type="fp8xfp4", num_shared_experts=1, device=torch.device("cpu"), rank=0,
                             world_size=1, backend="sm90", x=None, x_sf=None, topk_idx=None, topk_weights=None)
    with pytest.raises(GcMoeConstraintError, match="sm90 backend: num_shared_experts 1: role4 cubins missing.*"
                                                   "backend='reference'"):
        sm90_backend.allocate(buffer)


def test_layer_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="allowed: an sm_90 CUDA device"):
        sm90_layer.Sm90Layer(sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256), device="cpu")


# ------------------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("shape, tokens, block_n", [
    # DeepSeek slice: m = T 6 / 48; target m + sqrt(m): 0.48, 2, 10.8, 37.7 -> 8, 8, 16, 64, capped at 32
    (DSV, 1, 8), (DSV, 8, 8), (DSV, 64, 16), (DSV, 256, 32),
    # GLM slice: m = T 8 / 32; target 0.75, 3.4, 20, 72 -> 8, 8, 32, 64, capped at 32
    (GLM, 1, 8), (GLM, 8, 8), (GLM, 64, 32), (GLM, 256, 32),
])
def test_token_tile_by_hand(shape, tokens, block_n):
    s = sm90_layer.layer_shape(1, shape["num_experts"], shape["topk"], shape["hidden"], shape["intermediate"], 256)
    plan = sm90_layer.plan_call(s, tokens)
    assert (plan.block_n, plan.expert_rows_bound) == (block_n, tokens)  # P = 1: an expert gets each token once


def test_plan_bounds_and_errors():
    s1 = sm90_layer.layer_shape(1, 16, 4, 1024, 256, 32)
    assert sm90_layer.plan_call(s1, 0) == sm90_layer.CallPlan(0, 8, 1)  # no tokens: one (empty) token tile
    s2 = sm90_layer.layer_shape(2, 16, 4, 1024, 256, 32)
    assert sm90_layer.plan_call(s2, 3).expert_rows_bound == 64  # P > 1: every rank's capacity, C P
    with pytest.raises(ValueError, match="allowed: 0 to capacity=32"):
        sm90_layer.plan_call(s1, 33)


def test_ring_blocks_of_the_layer_shape():
    s = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256)
    assert s.block_m == sm90_layer.RING_BLOCK_M == 8
    assert s.max_rows == 256 * 8 and s.ring_blocks == 256 and s.ring_rows == 2048


def test_w1_grid_follows_the_plan_not_the_capacity():
    """At 1 token per rank the W1 grid has one token tile, not capacity / block_n mostly empty CTAs."""
    cfg = gg.GemmConfig("w1", 8, ring_consumer=True)
    assert gg.grid(cfg, 2 * 2048, 32, sm90_layer.plan_call(sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256), 1)
                   .expert_rows_bound) == (1, 16, 32)


def test_kernel_variants_are_ring_consumers_at_every_tile():
    vs = sm90_layer.kernel_variants()
    names = [v.name for v in vs]
    assert names[:2] == ["sm90.dispatch", "sm90.finalize"]
    fused = [dict(v.params) for v in vs if v.name == "sm90.role2"]
    assert sorted((p["block_n"], p.get("ctas_per_sm", 1), p.get("ring_reuse", False)) for p in fused) == sorted(
        (bn, ctas, reuse) for bn, ctas in [(8, 1), (8, 2), (16, 1), (32, 1)] for reuse in (False, True))
    assert all((p["swiglu_alpha"], p["swiglu_clamp"]) == (1.0, 10.0) for p in fused)
    gemms = [dict(v.params) for v in vs[2:] if v.name == "sm90.grouped_gemm"]
    assert len(gemms) + len(fused) == len(vs) - 2
    assert sorted((p["role"], p["block_n"], p.get("compact_grid", False)) for p in gemms) == sorted(
        [(r, bn, False) for r in ("w1", "w2") for bn in (8, 16, 32)])
    assert all(p["ring_consumer"] for p in gemms)
    # every token tile of the layer runs the warp-specialized pipeline (a variant names the knob only when off)
    assert all("warp_specialized" not in p for p in gemms)
    assert all(gg.GemmConfig(p["role"], p["block_n"], ring_consumer=True).warp_specialized for p in gemms)
    assert all((p["swiglu_alpha"], p["swiglu_clamp"]) == (1.0, 10.0) for p in gemms if p["role"] == "w1")
    from gc_moe.kernels.registry import variants_for_profile  # the profile build makes all of them

    built = {v.describe() for v in variants_for_profile("sm_90a", {})}
    assert {v.describe() for v in vs} <= built


def test_timeout_from_env():
    assert sm90_layer.timeout_from_env({}) == 3600.0
    assert sm90_layer.timeout_from_env({sm90_layer.TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(ValueError, match=sm90_layer.TIMEOUT_ENV):
            sm90_layer.timeout_from_env({sm90_layer.TIMEOUT_ENV: bad})


# ------------------------------------------------------------------------------------------------ overlap switch
def test_overlap_from_env():
    assert sm90_layer.overlap_from_env({}) is True
    assert sm90_layer.overlap_from_env({sm90_layer.OVERLAP_ENV: ""}) is True
    assert sm90_layer.overlap_from_env({sm90_layer.OVERLAP_ENV: "1"}) is True
    assert sm90_layer.overlap_from_env({sm90_layer.OVERLAP_ENV: "0"}) is False
    for bad in ("on", "off", "true", "2", " 1"):
        with pytest.raises(ValueError, match=r"GC_MOE_OVERLAP_ROOTS=.*allowed: 1 .* or 0 "):
            sm90_layer.overlap_from_env({sm90_layer.OVERLAP_ENV: bad})


def test_layer_checks_the_overlap_switch_before_touching_a_device(monkeypatch):
    shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256)
    with pytest.raises(TypeError, match="overlap_roots 'no'; allowed: True, False or None"):
        sm90_layer.Sm90Layer(shape, device="cpu", overlap_roots="no")
    monkeypatch.setenv(sm90_layer.OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match="GC_MOE_OVERLAP_ROOTS='yes'"):
        sm90_layer.Sm90Layer(shape, device="cpu")
    monkeypatch.setenv(sm90_layer.OVERLAP_ENV, "0")  # a valid switch: the next check (the device) speaks
    with pytest.raises(ValueError, match="allowed: an sm_90 CUDA device"):
        sm90_layer.Sm90Layer(shape, device="cpu")


def test_w1_dependencies():
    dispatch_node = object()
    assert sm90_layer.w1_dependencies(dispatch_node, True) == []
    assert sm90_layer.w1_dependencies(dispatch_node, False) == [dispatch_node]


class _RecordingGraph:
    """Stands in for runtime.graph.ChildGraph: records each node's context and dependencies."""

    def __init__(self):
        self.nodes = {}

    def add_kernel(self, name, kernel, grid, args, context, depends_on=()):
        self.nodes[name] = (context, [n for n in depends_on])
        return name


def _graph_of(monkeypatch, overlap_roots: bool, role2_nodes=1, num_tokens: int = 8, timing_nodes=None,
              shared: bool = False, role4_order: str = "beside", role4_fused: bool = False) -> dict:
    """build_graph of a layer without a GPU: kernels, launch arguments and the graph are stand-ins; `shared`: the
    layer has a shared expert (role4: W1 -> W2 nodes, or one node with `role4_fused`)."""
    from types import SimpleNamespace
    from unittest import mock

    from gc_moe.kernels.sm90 import dispatch, finalize
    from gc_moe.runtime import graph

    monkeypatch.setattr(graph, "ChildGraph", _RecordingGraph)
    for module, names in ((dispatch, ("dispatch_args",)), (finalize, ("finalize_args",)),
                          (gg, ("ring_args_w1", "ring_args_w2"))):
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, **k: ())
    monkeypatch.setattr(gg, "w1_launch", lambda *a, **k: (1, ()))
    monkeypatch.setattr(gg, "w2_launch", lambda *a, **k: (1, ()))
    layer = object.__new__(sm90_layer.Sm90Layer)
    layer.shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256)
    layer.ws, layer.rank, layer.timeout_s, layer.shared = mock.MagicMock(), 0, 1.0, None
    layer.parts = SimpleNamespace(comm_context="comm", compute_context="compute",
                                  describe=lambda: {"comm_sms": 4, "compute_sms": 128})
    layer.k_dispatch = layer.k_finalize = "kernel"
    layer.dispatch_ctas, layer.finalize_ctas = 4, 64
    layer.gemm_kernels = lambda block_n: ("w1 kernel", "w2 kernel")
    layer.overlap_roots = overlap_roots
    layer.role2_nodes, layer.role4_fused, layer.role2_tile = role2_nodes, role4_fused, "auto"
    layer.role4_order = role4_order
    monkeypatch.setattr(sm90_layer.role2, "role2_launch", lambda *a, **k: (1, ()))
    layer.role2_kernel = lambda block_n, ctas_per_sm=1: "role2 kernel"
    layer.role2_ctas = 1
    layer.timing_nodes = timing_nodes
    if shared:
        from gc_moe.kernels.sm90 import shared_expert

        def nodes(*a, fused=False, **k):
            return [("shared", "k", 1, ())] if fused else [("shared_w1", "k", 1, ()), ("shared_w2", "k", 1, ())]
        layer.shared = SimpleNamespace(nodes=nodes, se=shared_expert)
    return layer.build_graph(None, num_tokens, None, None, shared="weights" if shared else None).nodes


def test_graph_edges_follow_the_overlap_switch(monkeypatch):
    on = _graph_of(monkeypatch, True, role2_nodes=2)
    assert on == {"dispatch": ("comm", []), "w1": ("compute", []), "w2": ("compute", ["w1"]),
                  "finalize": ("compute", ["dispatch", "w2"])}
    off = _graph_of(monkeypatch, False, role2_nodes=2)
    assert off == {**on, "w1": ("compute", ["dispatch"])}  # the only change: W1 after dispatch


def test_fused_role2_makes_a_three_node_graph(monkeypatch):
    on = _graph_of(monkeypatch, True)
    assert on == {"dispatch": ("comm", []), "role2": ("compute", []), "finalize": ("compute", ["dispatch", "role2"])}
    off = _graph_of(monkeypatch, False)
    assert off == {**on, "role2": ("compute", ["dispatch"])}
    for t in (1, 2, 64, 256):  # the default: the three-node graph at every token count
        assert _graph_of(monkeypatch, True, "auto", num_tokens=t) == on
    assert set(_graph_of(monkeypatch, True, 2, num_tokens=2)) == {"dispatch", "w1", "w2", "finalize"}


def test_default_fused_tile_and_ctas_per_call():
    """The fused kernel's (token tile, CTAs per SM) per call under the defaults: tile 8 wherever the plan's tile
    is at most 16 (two CTAs per SM from 2 tokens), the plan's 32 above, at both models' per-rank shapes."""
    for experts, hidden, inter in ((256, 6144, 2048), (384, 4096, 2048)):
        shape = sm90_layer.layer_shape(1, experts // 8, 8, hidden, inter, 256)
        seen = {}
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            plan_bn = sm90_layer.plan_call(shape, t).block_n
            bn = sm90_layer.role2_block_n(plan_bn)
            seen[t] = (bn, sm90_layer.role2_ctas_per_sm(sm90_layer.role2_ctas_from_env({}), bn, t))
            assert bn == (8 if plan_bn <= 16 else 32), (t, plan_bn)
        assert seen[1] == (8, 1) and seen[2] == (8, 2) and seen[256] == (32, 1)
        assert all(c == (2 if bn == 8 else 1) for t, (bn, c) in seen.items() if t > 1)


def test_timing_graphs_keep_the_named_nodes(monkeypatch):
    """What a harness times to split the layer: dispatch -> finalize, or finalize alone, whatever role2's form."""
    for overlap in (True, False):
        for nodes in (1, 2, "auto"):
            assert _graph_of(monkeypatch, overlap, nodes, timing_nodes=("dispatch", "finalize")) == {
                "dispatch": ("comm", []), "finalize": ("compute", ["dispatch"])}
            assert _graph_of(monkeypatch, overlap, nodes, timing_nodes=("finalize",)) == {
                "finalize": ("compute", [])}
    assert _graph_of(monkeypatch, True, 2, timing_nodes=sm90_layer.TIMING_NODES) == _graph_of(monkeypatch, True, 2)
    for bad in (("dispatch",), ("role2", "finalize"), ("finalize", "w1")):
        with pytest.raises(ValueError, match=r"timing_nodes .*allowed: None or a subset"):
            _graph_of(monkeypatch, True, timing_nodes=bad)


def test_role2_nodes_from_env_and_argument(monkeypatch):
    assert sm90_layer.role2_nodes_from_env({}) == "auto"
    assert sm90_layer.role2_nodes_from_env({sm90_layer.ROLE2_ENV: "auto"}) == "auto"
    assert sm90_layer.role2_nodes_from_env({sm90_layer.ROLE2_ENV: "1"}) == 1
    assert sm90_layer.role2_nodes_from_env({sm90_layer.ROLE2_ENV: "2"}) == 2
    assert [sm90_layer.role2_fused("auto", t) for t in (0, 1, 2, 256)] == [True] * 4  # three nodes everywhere
    # beside the shared expert: fused at 1 token, W1 -> W2 from 2 (role4 would wait for the persistent kernel)
    assert [sm90_layer.role2_fused("auto", t, shared=True) for t in (0, 1, 2, 256)] == [True, True, False, False]
    assert sm90_layer.role2_fused(1, 256, shared=True) and not sm90_layer.role2_fused(2, 1, shared=True)
    assert sm90_layer.role2_fused(1, 256) and not sm90_layer.role2_fused(2, 1) and not sm90_layer.role2_fused(2, 64)
    for bad in ("0", "3", "fused", " 1"):
        with pytest.raises(ValueError, match=r"GC_MOE_ROLE2_NODES=.*allowed: auto .* 1 .* or 2 "):
            sm90_layer.role2_nodes_from_env({sm90_layer.ROLE2_ENV: bad})
    shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256)
    with pytest.raises(ValueError, match="role2_nodes 3; allowed: 'auto'"):
        sm90_layer.Sm90Layer(shape, device="cpu", role2_nodes=3)
    with pytest.raises(TypeError, match="role4_fused 1; allowed: True, False or None"):
        sm90_layer.Sm90Layer(shape, device="cpu", role4_fused=1)


def test_role4_switch_reads_the_environment():
    assert sm90_layer.role4_fused_from_env({}) is False
    assert sm90_layer.role4_fused_from_env({sm90_layer.ROLE4_ENV: ""}) is False
    assert sm90_layer.role4_fused_from_env({sm90_layer.ROLE4_ENV: "0"}) is False
    assert sm90_layer.role4_fused_from_env({sm90_layer.ROLE4_ENV: "1"}) is True
    for bad in ("yes", "2", "true"):
        with pytest.raises(ValueError, match=r"GC_MOE_ROLE4_FUSED=.*allowed: 0 .* or 1 "):
            sm90_layer.role4_fused_from_env({sm90_layer.ROLE4_ENV: bad})


def test_role4_order_sets_the_shared_expert_s_edges(monkeypatch):
    """Role4 beside role2 (a third root), before it (role2 waits on role4: with the fused role4 and role2 the
    paper's four-node graph) or after it; finalize after everything; the timing graphs may leave role4 out."""
    beside = _graph_of(monkeypatch, True, "auto", num_tokens=8, shared=True)
    assert beside == {"dispatch": ("comm", []), "w1": ("compute", []), "w2": ("compute", ["w1"]),
                      "shared_w1": ("compute", []), "shared_w2": ("compute", ["shared_w1"]),
                      "finalize": ("compute", ["dispatch", "w2", "shared_w2"])}
    before = _graph_of(monkeypatch, True, "auto", num_tokens=8, shared=True, role4_order="before", role4_fused=True)
    assert before == {"dispatch": ("comm", []), "shared": ("compute", []), "role2": ("compute", ["shared"]),
                      "finalize": ("compute", ["dispatch", "role2", "shared"])}
    assert _graph_of(monkeypatch, False, 1, shared=True, role4_order="before", role4_fused=True)["role2"] == (
        "compute", ["dispatch", "shared"])
    after = _graph_of(monkeypatch, True, "auto", num_tokens=8, shared=True, role4_order="after", role4_fused=True)
    assert after == {"dispatch": ("comm", []), "role2": ("compute", []), "shared": ("compute", ["role2"]),
                     "finalize": ("compute", ["dispatch", "role2", "shared"])}
    two = _graph_of(monkeypatch, True, "auto", num_tokens=8, shared=True, role4_order="before")
    assert two["shared_w2"] == ("compute", ["shared_w1"]) and two["role2"] == ("compute", ["shared_w2"])
    # the default: before at 1 token (five nodes: role4 as W1 -> W2, then the fused role2), beside above
    assert _graph_of(monkeypatch, True, "auto", num_tokens=1, shared=True, role4_order="auto") == {
        "dispatch": ("comm", []), "shared_w1": ("compute", []), "shared_w2": ("compute", ["shared_w1"]),
        "role2": ("compute", ["shared_w2"]), "finalize": ("compute", ["dispatch", "role2", "shared_w2"])}
    assert _graph_of(monkeypatch, True, "auto", num_tokens=2, shared=True, role4_order="auto") == _graph_of(
        monkeypatch, True, "auto", num_tokens=2, shared=True, role4_order="beside")
    assert _graph_of(monkeypatch, True, "auto", num_tokens=0, shared=True, role4_order="before") == {
        "dispatch": ("comm", []), "role2": ("compute", []), "finalize": ("compute", ["dispatch", "role2"])}
    for order in sm90_layer.ROLE4_ORDERS:
        assert _graph_of(monkeypatch, True, "auto", shared=True, role4_order=order,
                         timing_nodes=("role4", "finalize")) in (
            {"shared_w1": ("compute", []), "shared_w2": ("compute", ["shared_w1"]),
             "finalize": ("compute", ["shared_w2"])},)
        assert "shared_w1" not in _graph_of(monkeypatch, True, "auto", shared=True, role4_order=order,
                                            timing_nodes=("dispatch", "role2", "finalize"))


def test_role4_order_reads_the_environment_and_picks_role2_s_form():
    assert sm90_layer.role4_order_from_env({}) == "auto"
    # auto: before role2 at 1 token per rank (where it measured faster), beside above
    assert [sm90_layer.role4_order_at("auto", t) for t in (0, 1, 2, 256)] == ["before", "before", "beside", "beside"]
    assert [sm90_layer.role4_order_at("after", t) for t in (1, 256)] == ["after", "after"]
    for order in sm90_layer.ROLE4_ORDERS:
        assert sm90_layer.role4_order_from_env({sm90_layer.ROLE4_ORDER_ENV: order}) == order
    for bad in ("first", "1", "Before"):
        with pytest.raises(ValueError, match=r"GC_MOE_ROLE4_ORDER=.*allowed: auto .* beside .* before .* or after "):
            sm90_layer.role4_order_from_env({sm90_layer.ROLE4_ORDER_ENV: bad})
    # only beside role4 does "auto" keep W1 -> W2 from 2 tokens: before or after it, nothing waits for the
    # persistent kernel's SMs
    for order in ("before", "after"):
        assert all(sm90_layer.role2_fused("auto", t, True, order) for t in (1, 2, 8, 256))
    shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256)
    with pytest.raises(ValueError, match="role4_order 'first'; allowed: one of"):
        sm90_layer.Sm90Layer(shape, device="cpu", role4_order="first")


def test_settings_note():
    from types import SimpleNamespace

    assert sm90_layer.settings_note(4, 128, True) == \
        "partition comm/compute 4/128 SMs; overlap on; role2 one fused node (W1 and W2 nodes beside the shared " \
        "expert from 2 tokens per rank)"
    layer = object.__new__(sm90_layer.Sm90Layer)
    layer.parts = SimpleNamespace(describe=lambda: {"comm_sms": 12, "compute_sms": 120})
    layer.overlap_roots, layer.role2_nodes, layer.role4_fused, layer.role2_tile = False, 2, False, "auto"
    layer.role2_ctas, layer.role4_order = 1, "auto"
    layer.shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256, ring_blocks="auto")
    assert layer.settings_note() == "partition comm/compute 12/120 SMs; overlap off; role2 W1 and W2 nodes"
    layer.role4_fused = True
    assert layer.settings_note().endswith("role2 W1 and W2 nodes; role4 one fused node")
    layer.role4_order = "before"
    assert layer.settings_note().endswith("role2 W1 and W2 nodes; role4 one fused node; role4 before role2")
    layer.shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256, ring_blocks=6)
    assert layer.settings_note().endswith("role4 before role2; ring 6 of 256 blocks, reused")


# ------------------------------------------------------------------------------------------------ weights
def _small_sm90_weights(experts=2, hidden=256, intermediate=128):
    from gc_moe.cases import random_moe_weights
    from gc_moe.weights import sm90 as weights_sm90

    l1, l2 = random_moe_weights(experts, hidden, intermediate, seed=1)
    return l1, l2, weights_sm90.transform(l1, l2)


def test_check_weights_accepts_the_layers_experts_and_refuses_others():
    l1, l2, mats = _small_sm90_weights()
    shape = sm90_layer.layer_shape(1, 2, 1, 256, 128, 4)
    sm90_layer.check_weights(shape, mats.l1, mats.l2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"w1: 2 experts of \[256, 256\].*allowed: this rank's 4 experts"):
        sm90_layer.check_weights(sm90_layer.layer_shape(1, 4, 1, 256, 128, 4), mats.l1, mats.l2, torch.device("cpu"))
    with pytest.raises(ValueError, match="interleaved"):
        sm90_layer.check_weights(shape, mats.l2, mats.l2, torch.device("cpu"))
    with pytest.raises(TypeError, match="Sm90Matrix"):
        sm90_layer.check_weights(shape, l1, l2, torch.device("cpu"))
    with pytest.raises(ValueError, match="the layer's device cuda:0"):
        sm90_layer.check_weights(shape, mats.l1, mats.l2, torch.device("cuda", 0))


def test_run_refuses_canonical_weights_and_other_activations():
    l1, l2, _ = _small_sm90_weights()
    w1, w2 = api.transform_weights_for_gc_moe(l1, l2, arch="sm90")
    assert sm90_backend._matrices(w1, w2) == (w1[0], w2[0])
    with pytest.raises(ValueError, match="the sm90 backend reads 'sm90'"):
        sm90_backend._matrices(tuple(l1), tuple(l2))
    buffer = api.GcMoeBuffer(group=None, num_experts=2, capacity=4, topk=1, hidden=256, intermediate=128,
                             mma_type="fp8xfp4", num_shared_experts=0, device=torch.device("cpu"), rank=0,
                             world_size=1, backend="sm90", x=None, x_sf=None, topk_idx=None, topk_weights=None)
    options = {"activation_alpha": 1.0, "activation_clamp": 5.0, "shared_weights": None}
    with pytest.raises(GcMoeConstraintError, match="activation_clamp 5.0"):
        sm90_backend.run(None, w1, w2, buffer, 1, options)


# ------------------------------------------------------------------------------------------------ the harness adapter
def _tiny_workload(shared: int):
    from gcmoe_bench.models import ModelShape
    from gcmoe_bench.workloads import build_weights, build_workload

    tiny = ModelShape(name="tiny", base="glm-5.2", hidden=256, intermediate=128, num_experts=8, topk=2,
                      num_shared_experts=1, shared_k_group=128, capacity=8)
    weights = build_weights(tiny, 1, 0, shared_experts=shared, seed=0)
    return build_workload(tiny, 3, 1, 0, shared_experts=shared, weights=weights, seed=1)


def test_adapter_on_cpu_says_reference_and_is_not_capturable():
    from gcmoe_bench.operators import get_operator

    inv = get_operator("gc").prepare(_tiny_workload(0), None)
    assert inv.note == "gc_moe backend: reference" and inv.capturable is False


def test_adapter_runs_a_declined_configuration_on_the_reference_and_says_why(monkeypatch):
    """A kernel backend that declines a configuration: the adapter uses the reference backend, its note names
    the backend that declined and its reason, and the output is the reference's."""
    from gcmoe_bench.operators import get_operator

    def refuse(buffer):
        raise GcMoeConstraintError(["fake backend: shared experts are not built"])

    api.registered_backends()
    fake = api.Backend(name="fake", archs=(None,), weight_layout="canonical", unavailable_reason=lambda d, a: None,
                       allocate=refuse, run=lambda *a: None, priority=100)
    monkeypatch.setitem(api._BACKENDS, "fake", fake)
    workload = _tiny_workload(1)
    inv = get_operator("gc").prepare(workload, None)
    assert inv.capturable is False
    assert inv.note.startswith("gc_moe backend: reference; fake declined: ")
    assert "shared experts are not built" in inv.note
    inv()
    from gc_moe.reference import moe_reference

    w = workload.weights
    want = moe_reference(workload.x, workload.x_sf, workload.topk_idx, workload.topk_weights, w.l1, w.l2,
                         shared_weights=w.shared)
    assert torch.equal(inv.output, want)


def test_adapter_unfused_note_names_the_reference_shared_expert_under_a_kernel_backend(monkeypatch):
    """Under a kernel backend without a separate shared-expert launch, the unfused note says the shared expert
    is the float32 reference and why; under the reference backend the note stays the backend's."""
    from gcmoe_bench.operators import get_operator

    inv = get_operator("gc-unfused").prepare(_tiny_workload(1), None)
    assert inv.note == "gc_moe backend: reference" and inv.capturable is False

    def allocate(buffer):
        return {**api._reference_allocate(buffer), "extras": {}}

    fake = api.Backend(name="fake", archs=(None,), weight_layout="canonical", unavailable_reason=lambda d, a: None,
                       allocate=allocate, run=api._reference_run, priority=100)
    monkeypatch.setitem(api._BACKENDS, "fake", fake)
    inv = get_operator("gc-unfused").prepare(_tiny_workload(1), None)
    assert inv.note.startswith("gc_moe backend: fake; shared expert: float32 reference, added after the routed call")
    assert "gc_moe.kernels.fake.backend does not import" in inv.note and inv.capturable is False


def test_adapter_note_names_the_partition_and_the_overlap_under_the_sm90_backend(monkeypatch):
    """Under the sm90 backend the gc note ends with the layer's partition and overlap switch, which the sweep
    turns into its comm_sms / compute_sms / overlap columns."""
    from types import SimpleNamespace

    from gcmoe_bench.operators import get_operator
    from gcmoe_bench.results import partition_from_note

    layer = object.__new__(sm90_layer.Sm90Layer)
    layer.parts = SimpleNamespace(describe=lambda: {"comm_sms": 4, "compute_sms": 128})
    layer.overlap_roots, layer.role2_nodes, layer.role4_fused, layer.role2_tile = True, 1, False, "auto"
    layer.role2_ctas, layer.role4_order = 2, "auto"
    layer.shape = sm90_layer.layer_shape(1, 32, 8, 6144, 2048, 256, ring_blocks="auto")

    def allocate(buffer):
        return {**api._reference_allocate(buffer), "extras": {"sm90_layer": layer}}

    fake = api.Backend(name="sm90", archs=(None,), weight_layout="canonical", unavailable_reason=lambda d, a: None,
                       allocate=allocate, run=api._reference_run, priority=100)
    monkeypatch.setitem(api._BACKENDS, "sm90", fake)
    inv = get_operator("gc").prepare(_tiny_workload(0), None)
    assert inv.note == "gc_moe backend: sm90; partition comm/compute 4/128 SMs; overlap on; role2 one fused node"
    layer.role2_nodes = 2
    assert get_operator("gc").prepare(_tiny_workload(0), None).note.endswith("role2 W1 and W2 nodes")
    assert partition_from_note(inv.note) == (4, 128)


def test_adapter_reuses_one_weight_transform_per_weight_set():
    from gcmoe_bench import operators

    l1, l2, _ = _small_sm90_weights()
    first = operators._weights_for(api, "sm90", l1, l2)
    assert operators._weights_for(api, "sm90", l1, l2) is first
    assert api.weight_layouts.layout_of(first[0]) == "sm90"
    assert operators._weights_for(api, api.REFERENCE, l1, l2) == (tuple(l1), tuple(l2))


# ------------------------------------------------------------------------------------------------ fused role2 scheduler
def test_role2_tickets_cover_every_unit_with_rows_once_w1_first():
    from gc_moe.kernels.sm90 import role2

    rows = [0, 17, 3, 0, 40, 8]  # rows per local expert; token tile 8
    tiles = [-(-r // 8) for r in rows]
    prefix = [0]
    for t in tiles:
        prefix.append(prefix[-1] + t)
    w1_ctas, w2_ctas = 3, 2
    units = [role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas) for t in range(prefix[-1] * (w1_ctas + w2_ctas) + 4)]
    drawn = [u for u in units if u is not None]
    assert units[len(drawn):] == [None] * 4  # the final draws of the launch
    expected = [(role, e, bx, bz) for role, ctas in (("w1", w1_ctas), ("w2", w2_ctas)) for e in range(len(rows))
                for bx in range(ctas) for bz in range(tiles[e])]
    assert drawn == expected  # every unit once; W1 first; expert by expert, token tiles fastest
    assert role2.launch_ctas(8, 128, 10_000) == 128 and role2.launch_ctas(16, 128, 5) == 5
    with pytest.raises(ValueError, match="allowed: \\(8, 16, 32\\)"):
        role2.Role2Config(64)


def test_role2_at_bn32_splits_the_registers_with_a_producer_warpgroup():
    from gc_moe.kernels.sm90 import role2

    cfg = role2.Role2Config(32)
    assert (cfg.producer_warps, cfg.consumer_registers) == (4, 112)
    half = cfg.half("w1")
    assert half.threads == 640 and half.producer_registers == 32
    assert 128 * half.producer_registers + 512 * half.consumer_registers == 640 * gg.WS_ENTRY_REGISTERS
    assert gg.launch_register_bounds(half) == {"min_blocks_per_mp": 1}  # setmaxnreg needs the entry's count
    for bn in (8, 16):
        small = role2.Role2Config(bn)
        assert (small.producer_warps, small.consumer_registers) == (1, None)
        assert "consumer_registers" not in dict(role2.variant(bn).params)  # their cache keys stay as measured
    assert dict(role2.variant(32).params)["consumer_registers"] == 112


def test_role2_at_two_ctas_per_sm_is_opt_in_at_bn8():
    from gc_moe.kernels.sm90 import role2

    two = role2.Role2Config(8, ctas_per_sm=2)
    assert two.half("w1").ctas_per_sm == two.half("w2").ctas_per_sm == 2
    assert gg.launch_register_bounds(two.half("w1"))["min_blocks_per_mp"] == 2
    assert 2 * (two.half("w1").smem_bytes + 1024) <= 228 * 1024  # two CTAs (each with its reserved KB) fit an SM
    assert dict(role2.variant(8, ctas_per_sm=2).params)["ctas_per_sm"] == 2
    assert "ctas_per_sm" not in dict(role2.variant(8).params)  # the measured variants keep their cache keys
    for bn in (16, 32):
        with pytest.raises(ValueError, match=r"ctas_per_sm 2 at block_n .*allowed: 1, or 2 at block_n in \(8,\)"):
            role2.Role2Config(bn, ctas_per_sm=2)
    with pytest.raises(ValueError, match="ctas_per_sm 3"):
        role2.Role2Config(8, ctas_per_sm=3)
    assert role2.launch_ctas(8, 128, 10_000, ctas_per_sm=2) == 256 and role2.launch_ctas(8, 128, 100, 2) == 100
    # the layer's choice per call: one CTA per SM at 1 token and wherever the tile has no two-CTA build
    assert sm90_layer.role2_ctas_from_env({}) == 2
    assert sm90_layer.role2_ctas_from_env({sm90_layer.ROLE2_CTAS_ENV: "1"}) == 1
    assert sm90_layer.role2_ctas_from_env({sm90_layer.ROLE2_CTAS_ENV: "2"}) == 2
    for bad in ("0", "3", "two"):
        with pytest.raises(ValueError, match="GC_MOE_ROLE2_CTAS_PER_SM=.*allowed: 2 .* or 1 "):
            sm90_layer.role2_ctas_from_env({sm90_layer.ROLE2_CTAS_ENV: bad})
    assert [sm90_layer.role2_ctas_per_sm(2, 8, t) for t in (0, 1, 2, 16)] == [1, 1, 2, 2]
    assert sm90_layer.role2_ctas_per_sm(2, 16, 64) == 1 and sm90_layer.role2_ctas_per_sm(1, 8, 8) == 1
    assert sm90_layer.settings_note(4, 128, True, 1, role2_ctas=2).endswith("role2 one fused node")  # the default
    assert sm90_layer.settings_note(4, 128, True, 1, role2_ctas=1).endswith(
        "role2 one fused node (fused kernel at one CTA per SM)")
    assert sm90_layer.settings_note(4, 128, True, 2, role2_ctas=1).endswith("role2 W1 and W2 nodes")


def test_role2_block_n_from_env():
    assert sm90_layer.role2_block_n_from_env({}) == "auto"
    assert sm90_layer.role2_block_n_from_env({sm90_layer.ROLE2_BLOCK_N_ENV: "auto"}) == "auto"
    assert sm90_layer.role2_block_n_from_env({sm90_layer.ROLE2_BLOCK_N_ENV: "32"}) == 32
    for bad in ("64", "x", "0"):
        with pytest.raises(ValueError, match="GC_MOE_ROLE2_BLOCK_N.*allowed: auto"):
            sm90_layer.role2_block_n_from_env({sm90_layer.ROLE2_BLOCK_N_ENV: bad})
    # tile 8 up to a plan tile of 16 (two CTAs per SM there), else the plan's, at most 32
    assert [sm90_layer.role2_block_n(b) for b in (8, 16, 32, 64)] == [8, 8, 32, 32]
    assert sm90_layer.role2_block_n(8, 32) == 32 and sm90_layer.role2_block_n(16, 16) == 16


def test_settings_note_names_a_fixed_fused_tile():
    note = sm90_layer.settings_note(4, 128, True, 1, False, 32)
    assert note == "partition comm/compute 4/128 SMs; overlap on; role2 one fused node (fused token tile 32)"
    assert "tile" not in sm90_layer.settings_note(4, 128, True, 1, False)


def test_shared_pipeline_reads_the_environment():
    assert sm90_layer.shared_pipeline_from_env({}) == "auto"
    for value in ("auto", "cp.async", "ws"):
        assert sm90_layer.shared_pipeline_from_env({sm90_layer.SHARED_PIPELINE_ENV: value}) == value
    for bad in ("tma", "WS", "1"):
        with pytest.raises(ValueError, match=r"GC_MOE_SHARED_PIPELINE=.*allowed: auto .* cp.async .* or ws "):
            sm90_layer.shared_pipeline_from_env({sm90_layer.SHARED_PIPELINE_ENV: bad})


def test_shared_expert_packs_each_weight_set_once_and_again_when_it_changes():
    """The packed copy follows the weight set: reused while the same SharedExpertWeights lives unmodified, packed
    anew after an in-place change or for another weight set (also one allocated where a freed one was)."""
    from collections import OrderedDict

    from gc_moe.kernels.sm90 import shared_expert

    se = object.__new__(sm90_layer.SharedExpert)
    se.se, se._packed, se.pipeline, se.ctas_per_sm = shared_expert, OrderedDict(), "auto", "auto"
    weights, _, _ = shared_expert.random_inputs(256, 128, (1, 1, 32), 2, seed=1, device="cpu")
    first = se.packed(weights)
    assert se.packed(weights) is first and se.graph_key(weights) == se.graph_key(weights)
    weights.w2.view(torch.uint8)[0, 0] ^= 1  # an in-place change of the weights
    second = se.packed(weights)
    assert second is not first and not torch.equal(second.w2, first.w2)
    other, _, _ = shared_expert.random_inputs(256, 128, (1, 1, 32), 2, seed=2, device="cpu")
    assert se.packed(other) is not second
    se.pipeline = "cp.async"
    assert se.graph_key(weights) == ()


def test_shared_ctas_per_sm_reads_the_environment():
    assert sm90_layer.shared_ctas_from_env({}) == "auto"
    assert [sm90_layer.shared_ctas_from_env({sm90_layer.SHARED_CTAS_ENV: v}) for v in ("auto", "1", "2")] == [
        "auto", 1, 2]
    with pytest.raises(ValueError, match=r"GC_MOE_SHARED_CTAS_PER_SM='3'; allowed: auto .* 1 or 2"):
        sm90_layer.shared_ctas_from_env({sm90_layer.SHARED_CTAS_ENV: "3"})
