"""The SM90 layer through `gc_moe.fp8_fp4_gc_moe` on an sm_90 GPU (the `sm90` backend), at the H200 profile's
per-rank slices of both models: fresh random weights and inputs, y poisoned with NaN, every element finite,
cosine and processed difference against the float32 reference (routed, and with the shared expert fused as
role4 nodes); the unfused path's separate shared-expert launch; graph replays bit-equal to the eager call; the
bounded wait. Skipped without an sm_90 GPU or without the layer's cubins (the reason says which)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

OPERATOR_DIR = Path(__file__).resolve().parents[2] / "operator"


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU, this one is {torch.cuda.get_device_capability()}"
    from gc_moe import api

    backend = api.registered_backends().get("sm90")
    if backend is None:
        return "the sm90 backend is not registered"
    return backend.unavailable_reason(torch.device("cuda"), "sm90")


SKIP = _skip_reason()
needs_sm90 = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


@pytest.fixture(scope="module", params=["glm-5.2", "deepseek-v4.1-flash"])
def api_layer(request):
    from gc_moe.kernels.sm90 import layer_checks as lc

    layer = lc.ApiLayer(lc.SLICES[request.param], torch.device("cuda"), seed=23, backend="sm90")
    yield layer
    layer.buffer.destroy()


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256])
def test_layer_matches_the_float32_reference(api_layer, num_tokens):
    from gc_moe.kernels.sm90 import layer_checks as lc

    assert api_layer.buffer.backend == "sm90"
    r = lc.check_point(api_layer, num_tokens, seed=num_tokens * 31 + int(time.time()) % 1000)  # fresh inputs
    assert r["nonfinite"] == 0, r
    assert r["cosine"] >= 0.97, r
    assert r["processed_diff"] <= 0.002, r
    control = api_layer.control()
    assert control["arrival_errors"] == 0 and control["ring_overflows"] == 0, control


@needs_sm90
@pytest.mark.parametrize("num_tokens,ctas_per_sm", [(1, 1), (8, 1), (64, 1), (256, 1), (2, 2), (8, 2)])
def test_fused_role2_writes_what_the_two_gemm_nodes_write(api_layer, num_tokens, ctas_per_sm):
    """Role2 as one kernel (one, or at bn 8 two persistent CTAs per SM) against W1 and W2 as two graph nodes on
    the same staged inputs: the same tiles and arithmetic, so y is bit-equal (each into its own NaN-poisoned
    output)."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    layer = api_layer.buffer.extras["sm90_layer"]
    default, default_ctas = layer.role2_nodes, layer.role2_ctas
    try:
        layer.role2_nodes, layer.role2_ctas = 1, ctas_per_sm
        r = lc.check_point(api_layer, num_tokens, seed=num_tokens * 53 + int(time.time()) % 1000)
        fused = r.pop("y")
        assert r["nonfinite"] == 0 and r["cosine"] >= 0.97, r
        layer.role2_nodes = 2
        two = torch.full_like(fused, float("nan"))
        api_layer.call(two, num_tokens)
        torch.cuda.synchronize()
    finally:
        layer.role2_nodes, layer.role2_ctas = default, default_ctas
    assert torch.equal(fused.view(torch.int16), two.view(torch.int16))
    control = api_layer.control()
    assert control["arrival_errors"] == 0 and control["ring_overflows"] == 0, control


@needs_sm90
def test_zero_tokens_then_tokens(api_layer):
    """A call with no tokens still runs the whole protocol (and flips the parity); the next call is exact."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    before = api_layer.control()["replays"]
    y = torch.empty(0, api_layer.slice.hidden, dtype=torch.bfloat16, device="cuda")
    api_layer.call(y, 0)
    r = lc.check_point(api_layer, 8, seed=404)
    assert api_layer.control()["replays"] == before + 2
    assert r["nonfinite"] == 0 and r["cosine"] >= 0.97 and r["processed_diff"] <= 0.002, r


def assert_replays_equal_the_eager_call(layer, num_tokens: int, seed: int, replays: int) -> None:
    """An eager call on fresh inputs, then `replays` replays of its captured graph: every replay's y bit-equal to
    the eager y, one more eager call too, every call finalized once, no arrival error or ring overflow."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    r = lc.check_point(layer, num_tokens, seed=seed)
    rep = lc.replay_check(layer, r.pop("y"), num_tokens, replays=replays)
    assert rep["mismatched_replays"] == 0 and rep["eager_after_mismatch"] == 0, rep
    assert rep["replays_added"] == replays + 1 and rep["arrival_errors_added"] == 0, rep
    assert rep["ring_overflows_added"] == 0, rep


@needs_sm90
def test_graph_replays_equal_the_eager_call(api_layer):
    assert_replays_equal_the_eager_call(api_layer, 64, seed=909, replays=1000)


@needs_sm90
def test_bounded_wait_traps_after_its_timeout():
    from gc_moe.kernels.sm90 import layer_checks as lc

    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from gc_moe.kernels.sm90.layer_checks import bounded_wait_probe as b; b(1.0)"],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(OPERATOR_DIR)})
    elapsed = time.perf_counter() - started
    assert proc.returncode == lc.BOUNDED_WAIT_EXIT, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert elapsed < 60, elapsed


@pytest.fixture(scope="module", params=["glm-5.2", "deepseek-v4.1-flash"])
def shared_layer(request):
    from gc_moe.kernels.sm90 import layer_checks as lc

    layer = lc.ApiLayer(lc.SLICES[request.param], torch.device("cuda"), seed=29, backend="sm90", shared=True)
    yield layer
    layer.buffer.destroy()


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_fused_shared_expert_matches_the_float32_reference(shared_layer, num_tokens):
    from gc_moe.kernels.sm90 import layer_checks as lc

    assert shared_layer.buffer.backend == "sm90" and shared_layer.buffer.extras["sm90_layer"].shared is not None
    r = lc.check_point(shared_layer, num_tokens, seed=num_tokens * 37 + int(time.time()) % 1000)
    assert r["nonfinite"] == 0 and r["cosine"] >= 0.99 and r["processed_diff"] <= 0.002, r


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_fused_nodes_with_the_shared_expert_write_what_the_separate_nodes_write(shared_layer, num_tokens):
    """Role2 and role4 each as one kernel (role2_nodes 1, role4_fused) against W1 / W2 nodes for both
    (role2_nodes 2, role4 not fused): y bit-equal on the same staged inputs."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    layer = shared_layer.buffer.extras["sm90_layer"]
    default = layer.role2_nodes
    try:
        layer.role2_nodes, layer.role4_fused = 1, True
        r = lc.check_point(shared_layer, num_tokens, seed=num_tokens * 59 + int(time.time()) % 1000)
        fused = r.pop("y")
        assert r["nonfinite"] == 0 and r["cosine"] >= 0.99, r
        layer.role2_nodes, layer.role4_fused = 2, False
        two = torch.full_like(fused, float("nan"))
        shared_layer.call(two, num_tokens)
        torch.cuda.synchronize()
    finally:
        layer.role2_nodes, layer.role4_fused = default, False
    assert torch.equal(fused.view(torch.int16), two.view(torch.int16))


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_role4_before_and_after_role2_write_what_role4_beside_writes(shared_layer, num_tokens):
    """The shared expert (fused) before role2 (role2 waits on role4: four nodes) and after it, against role4's
    W1 / W2 beside role2: y bit-equal on the same staged inputs, and replays of the four-node graph too."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    layer = shared_layer.buffer.extras["sm90_layer"]
    saved = layer.role2_nodes, layer.role4_fused, layer.role4_order
    try:
        layer.role2_nodes, layer.role4_fused, layer.role4_order = 2, False, "beside"
        r = lc.check_point(shared_layer, num_tokens, seed=num_tokens * 61 + int(time.time()) % 1000)
        beside = r.pop("y")
        assert r["nonfinite"] == 0 and r["cosine"] >= 0.99, r
        for order in ("before", "after"):
            layer.role2_nodes, layer.role4_fused, layer.role4_order = "auto", True, order
            y = torch.full_like(beside, float("nan"))
            shared_layer.call(y, num_tokens)
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), beside.view(torch.int16)), order
        layer.role4_order = "before"
        rep = lc.replay_check(shared_layer, beside, num_tokens, replays=200)
        assert rep["mismatched_replays"] == 0 and rep["eager_after_mismatch"] == 0, rep
    finally:
        layer.role2_nodes, layer.role4_fused, layer.role4_order = saved


@needs_sm90
def test_fused_shared_graph_replays_equal_the_eager_call(shared_layer):
    assert_replays_equal_the_eager_call(shared_layer, 8, seed=808, replays=1000)


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_separate_shared_expert_launch(api_layer, num_tokens):
    from gc_moe.kernels.sm90 import layer_checks as lc

    r = lc.check_separate_shared(api_layer, num_tokens, seed=4242 + num_tokens)
    assert r["nonfinite"] == 0 and r["cosine"] >= 0.99 and r["processed_diff"] <= 0.002, r


# ------------------------------------------------------------------------------------------------ ring reuse
SMALL_RING_BLOCKS = 6  # layer_layout.min_reuse_ring_blocks(8): every generation of a 256-token call goes round


def _small_ring_twin(layer, shared: bool = False, seed: int = 23):
    """A second layer on the same weights whose token ring has SMALL_RING_BLOCKS blocks (GC_MOE_RING_BLOCKS)."""
    from gc_moe.kernels.sm90 import layer as sm90_layer
    from gc_moe.kernels.sm90 import layer_checks as lc

    saved = os.environ.get(sm90_layer.RING_BLOCKS_ENV)
    os.environ[sm90_layer.RING_BLOCKS_ENV] = str(SMALL_RING_BLOCKS)
    try:
        twin = lc.ApiLayer(layer.slice, layer.device, seed=seed, backend="sm90", shared=shared,
                           weights=(layer.l1, layer.l2))
    finally:
        if saved is None:
            del os.environ[sm90_layer.RING_BLOCKS_ENV]
        else:
            os.environ[sm90_layer.RING_BLOCKS_ENV] = saved
    inner = twin.buffer.extras["sm90_layer"]
    assert inner.shape.ring_blocks == SMALL_RING_BLOCKS and inner.shape.ring_reuse, inner.shape
    assert f"ring {SMALL_RING_BLOCKS} of " in inner.settings_note()
    return twin


@pytest.fixture(scope="module")
def small_ring_layer(api_layer):
    twin = _small_ring_twin(api_layer)
    yield twin
    twin.buffer.destroy()


@needs_sm90
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256])
def test_a_reused_ring_writes_what_the_pool_sized_ring_writes(api_layer, small_ring_layer, num_tokens):
    """The same inputs through a 6-block ring (role1 waits for W1's row releases, W1 reads ring rows by modulo,
    its tickets tile by tile; up to 43 generations per block at 256 tokens) and through the pool-sized ring: y
    bit-equal (the same tiles and arithmetic), against the reference, the protocol counters clean."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    seed = num_tokens * 67 + int(time.time()) % 1000
    pool = lc.check_point(api_layer, num_tokens, seed=seed).pop("y")
    r = lc.check_point(small_ring_layer, num_tokens, seed=seed)
    small = r.pop("y")
    assert r["nonfinite"] == 0 and r["cosine"] >= 0.97 and r["processed_diff"] <= 0.002, r
    assert torch.equal(small.view(torch.int16), pool.view(torch.int16))
    control = small_ring_layer.control()
    assert control["arrival_errors"] == 0 and control["ring_overflows"] == 0, control


@needs_sm90
def test_reused_ring_graph_replays_equal_the_eager_call(small_ring_layer):
    assert_replays_equal_the_eager_call(small_ring_layer, 256, seed=1256, replays=300)


@needs_sm90
@pytest.mark.parametrize("num_tokens", [8, 256])
def test_a_reused_ring_with_the_shared_expert(shared_layer, num_tokens):
    """With the shared expert: role2 runs as the fused kernel on the reused ring (beside role4), the default
    layer as its W1 / W2 nodes: y bit-equal."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    twin = _small_ring_twin(shared_layer, shared=True, seed=29)
    try:
        seed = num_tokens * 71 + int(time.time()) % 1000
        pool = lc.check_point(shared_layer, num_tokens, seed=seed).pop("y")
        r = lc.check_point(twin, num_tokens, seed=seed)
        small = r.pop("y")
        assert r["nonfinite"] == 0 and r["cosine"] >= 0.99, r
        assert torch.equal(small.view(torch.int16), pool.view(torch.int16))
    finally:
        twin.buffer.destroy()
