import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gc_moe import api
from gc_moe.cases import make_routing, random_activations, random_moe_weights, random_shared_expert_weights
from gc_moe.formats import dequantize_fp4_ue8m0, dequantize_fp8_ue8m0
from gc_moe.planning import GcMoeConstraintError
from gc_moe.reference import moe_reference

HIDDEN, INTER, EXPERTS, TOPK, CAPACITY = 256, 128, 8, 3, 16


def inputs(tokens, seed, num_experts=EXPERTS, topk=TOPK, **routing):
    x, x_sf = random_activations(tokens, HIDDEN, seed=seed)
    idx, w = make_routing("uniform", tokens, num_experts, topk, seed=seed, **routing)
    return x, x_sf, idx, w


def listing1(buffer, w1, w2, x, x_sf, idx, weights, **kwargs):
    """Listing 1 of the paper, verbatim but for the inputs."""
    tokens = x.shape[0]
    buffer.x[:tokens].copy_(x)
    buffer.x_sf[:tokens].copy_(x_sf)
    buffer.topk_idx[:tokens].copy_(idx)
    buffer.topk_weights[:tokens].copy_(weights)
    y = torch.empty((tokens, HIDDEN), dtype=torch.bfloat16, device=x.device)
    api.fp8_fp4_gc_moe(
        y,
        w1,
        w2,
        buffer,
        recipe=(1, 1, 32),
        activation="swiglu",
        activation_alpha=1.0,
        activation_clamp=10.0,
        **kwargs,
    )
    return y


def naive_layer(x, x_sf, idx, weights, l1, l2, clamp=10.0, shared=None):
    """Per-token, per-slot float32 loop written from Eq. (1), independent of gc_moe.reference."""
    xf = dequantize_fp8_ue8m0(x, x_sf)
    w1, w2 = dequantize_fp4_ue8m0(*l1), dequantize_fp4_ue8m0(*l2)
    y = torch.zeros(x.shape[0], HIDDEN)

    def ffn(row, a, b):
        gate, up = (a @ row).split(a.shape[0] // 2)
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return b @ (gate * torch.sigmoid(gate) * up)

    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= 0:
                y[t] += weights[t, j] * ffn(xf[t], w1[e], w2[e])
        if shared is not None:
            s1, s2 = shared.dequantize()
            y[t] += ffn(xf[t], s1, s2)
    return y


@pytest.fixture(scope="module")
def moe_weights():
    return random_moe_weights(EXPERTS, HIDDEN, INTER, seed=11)


# ----------------------------------------------------------------------------------------------- Listing 1 on CPU
def test_listing1_on_cpu_matches_the_reference_and_a_naive_loop(moe_weights):
    l1, l2 = moe_weights
    buffer = api.get_symm_buffer_for_gc_moe(
        None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu", mma_type="fp8xfp4"
    )
    assert buffer.backend == "reference" and buffer.world_size == 1 and buffer.device == torch.device("cpu")
    assert buffer.x.shape == (CAPACITY, HIDDEN) and buffer.x.dtype == torch.float8_e4m3fn
    assert buffer.x_sf.shape == (CAPACITY, HIDDEN // 128) and buffer.x_sf.dtype == torch.int32
    assert buffer.topk_idx.shape == (CAPACITY, TOPK) and buffer.topk_weights.dtype == torch.float32
    w1, w2 = api.transform_weights_for_gc_moe(l1, l2)
    assert w1.layout == "canonical"
    x, x_sf, idx, weights = inputs(11, seed=3, valid_slots=(1, TOPK))  # some -1 slots too
    assert bool((idx == -1).any())
    y = listing1(buffer, w1, w2, x, x_sf, idx, weights)
    expected = moe_reference(x, x_sf, idx, weights, l1, l2, activation_alpha=1.0, activation_clamp=10.0)
    assert torch.equal(y, expected)
    naive = naive_layer(x, x_sf, idx, weights, l1, l2)
    assert torch.allclose(y.float(), naive, rtol=1e-2, atol=1e-2 * float(naive.abs().max()))
    assert float(y.float().abs().max()) > 0.05  # a real signal, not an all-zero output


@pytest.mark.parametrize("arch", ["sm103", "sm90"])
def test_arch_layouts_run_unchanged_through_the_reference(moe_weights, arch):
    l1, l2 = moe_weights
    buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu")
    x, x_sf, idx, weights = inputs(9, seed=4)
    canonical = listing1(buffer, *api.transform_weights_for_gc_moe(l1, l2), x, x_sf, idx, weights)
    w1, w2 = api.transform_weights_for_gc_moe(l1, l2, arch=arch)
    assert (w1.layout, w2.layout) == (arch, arch)
    assert torch.equal(listing1(buffer, w1, w2, x, x_sf, idx, weights), canonical)


def test_num_tokens_and_empty_calls(moe_weights):
    l1, l2 = moe_weights
    buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu")
    x, x_sf, idx, weights = inputs(CAPACITY, seed=5)
    full = listing1(buffer, l1, l2, x, x_sf, idx, weights)
    y = torch.full((CAPACITY, HIDDEN), 7.0, dtype=torch.bfloat16)
    api.fp8_fp4_gc_moe(y, l1, l2, buffer, num_tokens=6)
    assert torch.equal(y[:6], full[:6]) and bool((y[6:] == 7.0).all())
    empty = torch.empty((0, HIDDEN), dtype=torch.bfloat16)
    api.fp8_fp4_gc_moe(empty, l1, l2, buffer)


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)])
def test_shared_expert_through_the_api(moe_weights, recipe):
    l1, l2 = moe_weights
    shared = random_shared_expert_weights(HIDDEN, INTER, seed=12, recipe=recipe)
    buffer = api.get_symm_buffer_for_gc_moe(
        None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, num_shared_experts=1, device="cpu"
    )
    x, x_sf, idx, weights = inputs(7, seed=6)
    y = listing1(buffer, l1, l2, x, x_sf, idx, weights, shared_weights=shared)
    assert torch.equal(y, moe_reference(x, x_sf, idx, weights, l1, l2, shared_weights=shared))
    naive = naive_layer(x, x_sf, idx, weights, l1, l2, shared=shared)
    assert torch.allclose(y.float(), naive, rtol=1e-2, atol=1e-2 * float(naive.abs().max()))


# ----------------------------------------------------------------------------------------------- 2 ranks, gloo
def _ep_worker(rank, world, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from gc_moe.cases import local_experts

        l1, l2 = random_moe_weights(
            EXPERTS, HIDDEN, INTER, seed=11, experts=local_experts(EXPERTS, world, rank)
        )
        buffer = api.get_symm_buffer_for_gc_moe(dist.group.WORLD, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER)
        assert (buffer.rank, buffer.world_size, buffer.local_experts) == (rank, world, EXPERTS // world)
        w1, w2 = api.transform_weights_for_gc_moe(l1, l2, arch="sm103")
        tokens = (5, 0)[rank]  # rank 1 sends nothing but still serves its experts
        x, x_sf, idx, weights = inputs(tokens, seed=20 + rank, num_ranks=world, source_rank=rank)
        y = listing1(buffer, w1, w2, x, x_sf, idx, weights)
        torch.save({"y": y, "x": x, "x_sf": x_sf, "idx": idx, "w": weights}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_listing1_expert_parallel_over_two_gloo_ranks(moe_weights, tmp_path):
    init_file, result_file = tmp_path / "init", tmp_path / "result"
    mp.spawn(_ep_worker, args=(2, str(init_file), str(result_file)), nprocs=2, join=True)
    l1, l2 = moe_weights  # all experts in one process: the single-process reference is the oracle
    r0, r1 = (torch.load(f"{result_file}.{r}") for r in (0, 1))
    assert r1["y"].shape == (0, HIDDEN)
    owners = set((r0["idx"][r0["idx"] >= 0] // (EXPERTS // 2)).tolist())
    assert owners == {0, 1}  # rank 0's tokens really travel to rank 1
    expected = moe_reference(r0["x"], r0["x_sf"], r0["idx"], r0["w"], l1, l2)
    assert torch.equal(r0["y"], expected)  # same float32 partials, same combine order: bit for bit


# ----------------------------------------------------------------------------------------------- validation
@pytest.fixture
def ready(moe_weights):
    l1, l2 = moe_weights
    buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu")
    x, x_sf, idx, weights = inputs(4, seed=8)
    buffer.x[:4].copy_(x), buffer.x_sf[:4].copy_(x_sf), buffer.topk_idx[:4].copy_(idx)
    buffer.topk_weights[:4].copy_(weights)
    return buffer, l1, l2, torch.empty((4, HIDDEN), dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"recipe": (1, 128, 128)}, ValueError, r"recipe: got \(1, 128, 128\); allowed: \(1, 1, 32\)"),
        ({"recipe": "k32"}, ValueError, r"recipe: got 'k32'; allowed: \(1, 1, 32\)"),
        ({"activation": "gelu"}, ValueError, r"activation: got 'gelu'; allowed: \('swiglu',\)"),
        ({"activation_alpha": -1.0}, ValueError, "activation_alpha: got -1.0; allowed: a finite number > 0"),
        (
            {"activation_clamp": float("nan")},
            ValueError,
            "activation_clamp: got nan; allowed: a finite number > 0",
        ),
        ({"fast_math": 1}, TypeError, "fast_math: got 1; allowed: True or False"),
        ({"num_tokens": 17}, GcMoeConstraintError, "num_tokens <= capacity: got num_tokens=17"),
        (
            {"num_tokens": 5},
            ValueError,
            r"y: torch.bfloat16 \[4, 256\]; allowed: torch.bfloat16 \[>= 5, 256\]",
        ),
        (
            {"y": torch.empty((4, HIDDEN))},
            ValueError,
            r"y: torch.float32 \[4, 256\]; allowed: torch.bfloat16",
        ),
        (
            {"y": torch.empty((4, 128), dtype=torch.bfloat16)},
            ValueError,
            r"allowed: torch.bfloat16 \[>= 4, 256\]",
        ),
        ({"y": torch.empty(4, dtype=torch.bfloat16)}, ValueError, "y: got torch.Size"),
        ({"y": torch.empty((4, HIDDEN), dtype=torch.bfloat16, device="meta")}, ValueError, "y: on meta"),
        ({"shared_weights": "s"}, ValueError, "given, but the buffer was made with num_shared_experts=0"),
        ({"buffer": object()}, TypeError, "buffer: got object; allowed: a live buffer"),
    ],
)
def test_operator_arguments_are_validated(ready, change, error, message):
    buffer, l1, l2, y = ready
    args = {"y": y, "w1": l1, "w2": l2, "buffer": buffer, **change}
    with pytest.raises(error, match=message):
        api.fp8_fp4_gc_moe(**args)


def test_weights_are_validated(ready):
    buffer, l1, l2, y = ready
    with pytest.raises(ValueError, match=r"4 experts, H=256, I=128 on cpu; allowed: this rank's 8 experts"):
        api.fp8_fp4_gc_moe(y, (l1[0][:4], l1[1][:4]), (l2[0][:4], l2[1][:4]), buffer)
    with pytest.raises(TypeError, match=r"l1_weights scales: dtype torch.int64; allowed: torch.int32"):
        api.fp8_fp4_gc_moe(y, (l1[0], l1[1].long()), l2, buffer)
    with pytest.raises(ValueError, match=r"l2_weights data: shape \[8, 256, 32\]; allowed: \[8, 256, 64\]"):
        api.fp8_fp4_gc_moe(y, l1, (l2[0][..., :32], l2[1]), buffer)
    w1, w2 = api.transform_weights_for_gc_moe(l1, l2, arch="sm103")
    with pytest.raises(ValueError, match="look swapped"):
        api.fp8_fp4_gc_moe(y, w2, w1, buffer)
    with pytest.raises(ValueError, match="already in the 'sm103' layout"):
        api.transform_weights_for_gc_moe(w1, w2)
    with pytest.raises(ValueError, match=r"arch: got 'sm80'; allowed: None \(from the device\) or one of"):
        api.transform_weights_for_gc_moe(l1, l2, arch="sm80")
    # a bare tensor is not a (data, scales) pair: its torch `.layout` must not be taken for a weight layout tag
    with pytest.raises(TypeError, match=r"l1_weights: expected a \(int8 data, int32 scales\) pair, got Tensor"):
        api.transform_weights_for_gc_moe(l1[0], l2)


def test_shared_weights_required_when_the_buffer_has_them(moe_weights):
    l1, l2 = moe_weights
    buffer = api.get_symm_buffer_for_gc_moe(
        None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, num_shared_experts=1, device="cpu"
    )
    y = torch.empty((2, HIDDEN), dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="shared_weights: got None; the buffer was made with num_shared_experts=1"
    ):
        api.fp8_fp4_gc_moe(y, l1, l2, buffer)
    wrong = random_shared_expert_weights(512, INTER, seed=1)
    with pytest.raises(ValueError, match="shared_weights: hidden 512 on cpu; allowed: hidden 256 on cpu"):
        api.fp8_fp4_gc_moe(y, l1, l2, buffer, shared_weights=wrong)


def test_routing_ids_are_validated(ready):
    buffer, l1, l2, y = ready
    buffer.topk_idx[1, 0] = EXPERTS
    with pytest.raises(
        ValueError, match=r"buffer.topk_idx: expert ids in \[-?\d+, 8\]; allowed: -1 \(no expert\)"
    ):
        api.fp8_fp4_gc_moe(y, l1, l2, buffer)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"hidden": 384}, GcMoeConstraintError, "H mod 256 = 0: got hidden=384"),
        ({"intermediate": 8192}, GcMoeConstraintError, "got intermediate=8192"),
        ({"topk": 33}, GcMoeConstraintError, "k + 1[shared] <= 32: got topk=33"),
        ({"capacity": 0}, GcMoeConstraintError, "capacity: got 0"),
        ({"num_shared_experts": 2}, GcMoeConstraintError, "num_shared_experts: got 2"),
        ({"mma_type": "fp8xfp8"}, ValueError, r"mma_type: got 'fp8xfp8'; allowed: \('fp8xfp4',\)"),
        ({"backend": "sm99"}, ValueError, r"unknown backend 'sm99'; registered: \[.*'reference'"),
    ],
)
def test_buffer_arguments_are_validated(kwargs, error, message):
    args = {
        "group": None,
        "num_experts": EXPERTS,
        "capacity": CAPACITY,
        "topk": TOPK,
        "hidden": HIDDEN,
        "intermediate": INTER,
        "device": "cpu",
        **kwargs,
    }
    with pytest.raises(error) as info:
        api.get_symm_buffer_for_gc_moe(**args)
    assert message in str(info.value) or info.match(message)


# ----------------------------------------------------------------------------------------------- backends
def test_device_arch_and_default_selection():
    assert api.device_arch("cpu") is None
    assert api.select_backend("cpu").name == "reference"


def test_a_kernel_backend_plugs_in_behind_the_same_api(moe_weights):
    l1, l2 = moe_weights
    calls = []

    def allocate(buffer):
        views = api._reference_allocate(buffer)
        return {**views, "extras": {"ring_blocks": 11}}

    def run(y_rows, w1, w2, buffer, num_tokens, options):
        calls.append((w1.layout, num_tokens, options["recipe"], options["activation_clamp"]))
        y_rows.fill_(1.0)

    fake = api.Backend(
        name="fake-sm103",
        archs=(None,),
        weight_layout="sm103",
        unavailable_reason=lambda d, a: None,
        allocate=allocate,
        run=run,
        priority=10,
    )
    api.register_backend(fake)
    try:
        buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu")
        assert buffer.backend == "fake-sm103" and buffer.extras == {"ring_blocks": 11}
        w1, w2 = api.transform_weights_for_gc_moe(l1, l2)  # arch from the device -> the backend's layout
        assert w1.layout == "sm103"
        y = torch.zeros((3, HIDDEN), dtype=torch.bfloat16)
        api.fp8_fp4_gc_moe(y, w1, w2, buffer, activation_clamp=None)
        assert calls == [("sm103", 3, (1, 1, 32), None)] and bool((y == 1).all())
        with pytest.raises(
            ValueError, match="in the 'canonical' layout but the 'fake-sm103' backend reads 'sm103'"
        ):
            api.fp8_fp4_gc_moe(y, l1, l2, buffer)
        forced = api.get_symm_buffer_for_gc_moe(
            None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, backend="reference", device="cpu"
        )
        assert forced.backend == "reference"
    finally:
        api._BACKENDS.pop("fake-sm103")
    assert api.select_backend("cpu").name == "reference"


def test_an_unavailable_backend_says_why():
    fake = api.Backend(
        name="needs-gpu",
        archs=("sm90",),
        weight_layout="sm90",
        unavailable_reason=lambda d, a: "no cubins",
        allocate=api._reference_allocate,
        run=lambda *a: None,
        priority=10,
    )
    api.register_backend(fake)
    try:
        assert api.select_backend("cpu").name == "reference"
        with pytest.raises(
            RuntimeError, match=r"backend 'needs-gpu' cannot run on cpu: it serves \('sm90',\)"
        ):
            api.select_backend("cpu", "needs-gpu")
    finally:
        api._BACKENDS.pop("needs-gpu")


@pytest.mark.gpu
def test_listing1_on_a_gpu_matches_the_cpu_run(moe_weights):
    l1, l2 = moe_weights
    cuda = torch.device("cuda", torch.cuda.current_device())
    buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER)
    assert buffer.device == cuda
    arch = api.device_arch(cuda)
    assert buffer.backend == api.select_backend(cuda).name
    gpu_l1, gpu_l2 = (tuple(t.to(cuda) for t in pair) for pair in (l1, l2))
    w1, w2 = api.transform_weights_for_gc_moe(gpu_l1, gpu_l2)
    assert w1.layout == api.registered_backends()[buffer.backend].weight_layout
    x, x_sf, idx, weights = inputs(10, seed=9)
    y = listing1(buffer, w1, w2, *(t.to(cuda) for t in (x, x_sf, idx, weights)))
    expected = moe_reference(x, x_sf, idx, weights, l1, l2)
    assert y.device == cuda and arch in (None, "sm90", "sm103")
    if buffer.backend == api.REFERENCE:  # the same float32 math on another device
        assert torch.allclose(
            y.cpu().float(), expected.float(), rtol=1e-2, atol=1e-2 * float(expected.abs().max())
        )
    else:  # a kernel backend: FP8 tensor-core sums and the FP8 requantization between W1 and W2
        from gc_moe import metrics

        assert torch.isfinite(y).all()
        assert metrics.cosine(y.cpu(), expected) >= 0.999
        assert metrics.processed_diff(y.cpu(), expected) <= metrics.THRESHOLDS.processed_diff


def test_missing_sm90_transform_is_named(moe_weights, monkeypatch):
    monkeypatch.setitem(sys.modules, "gc_moe.weights.sm90", None)
    with pytest.raises(NotImplementedError, match=r"SM90 MXFP4 window repack \(gc_moe.weights.sm90\)"):
        api.transform_weights_for_gc_moe(*moe_weights, arch="sm90")


def test_buffer_destroy_releases_views():
    buffer = api.get_symm_buffer_for_gc_moe(None, EXPERTS, CAPACITY, TOPK, HIDDEN, INTER, device="cpu")
    buffer.destroy()
    assert buffer.x is None
    with pytest.raises(TypeError, match="allowed: a live buffer"):
        api.fp8_fp4_gc_moe(torch.empty((1, HIDDEN), dtype=torch.bfloat16), None, None, buffer)


LISTING1_SCRIPT = """
import torch, gc_moe
from gc_moe.cases import make_routing, random_activations, random_moe_weights
from gc_moe.reference import moe_reference
l1_weights, l2_weights = random_moe_weights(8, 256, 128, seed=1)
x_fp8, x_sf = random_activations(5, 256, seed=2)
topk_idx, topk_weights = make_routing("uniform", 5, 8, 2, seed=3)
tokens, hidden = 5, 256
group = None
buffer = gc_moe.get_symm_buffer_for_gc_moe(group, 8, 16, 2, 256, 128, mma_type='fp8xfp4')
dev = buffer.device  # CUDA where there is a GPU, else CPU
x_fp8, x_sf, topk_idx, topk_weights = (t.to(dev) for t in (x_fp8, x_sf, topk_idx, topk_weights))
l1_weights, l2_weights = (tuple(t.to(dev) for t in pair) for pair in (l1_weights, l2_weights))
w1, w2 = gc_moe.transform_weights_for_gc_moe(l1_weights, l2_weights)
buffer.x[:tokens].copy_(x_fp8)
buffer.x_sf[:tokens].copy_(x_sf)
buffer.topk_idx[:tokens].copy_(topk_idx)
buffer.topk_weights[:tokens].copy_(topk_weights)
y = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=x_fp8.device)
gc_moe.fp8_fp4_gc_moe(y, w1, w2, buffer, recipe=(1, 1, 32), activation='swiglu',
                      activation_alpha=1.0, activation_clamp=10.0)
want = moe_reference(x_fp8, x_sf, topk_idx, topk_weights, l1_weights, l2_weights)
assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max())), (y, want)
print("listing1-ok", sorted(gc_moe.__all__))
"""


def test_listing1_verbatim_through_the_package_namespace():
    # a fresh interpreter: `import gc_moe` must expose Listing 1 (under pytest, tests/gc_moe can shadow the name)
    repo = Path(__file__).resolve().parents[2]  # the package from this tree, not the tests/gc_moe folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(repo / "operator"), str(repo)))}
    out = subprocess.run(
        [sys.executable, "-c", LISTING1_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "listing1-ok" in out.stdout and "fp8_fp4_gc_moe" in out.stdout
