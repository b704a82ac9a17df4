"""The DeepGEMM Mega MoE adapters against a fake ``deep_gemm`` that records every call (CPU), and a real run (GPU).

The fake follows DeepGEMM's Python API (deep_gemm/mega/__init__.py): a symmetric buffer whose views are the
inputs, weight transforms, and the kernel entry point; it records what it is given so each test checks the
shapes, dtypes, values and options the adapter hands over.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from gc_moe import cases, formats, metrics, reference

from baselines.mega_moe import deepgemm

H, I, E, K, T, CAPACITY = 256, 128, 8, 3, 5, 16  # tiny layer: 2I and H are whole 128-blocks


class FakeBuffer:
    """The views DeepGEMM's SymmBuffer exposes (x_sf int32 per 32 on SM100; float32 per 128 on sgl's SM90)."""

    def __init__(self, group, num_experts, num_max_tokens, num_topk, hidden, intermediate, *,
                 sf_dtype=torch.int32, num_shared_experts=0):
        self.group, self.num_experts, self.num_topk = group, num_experts, num_topk
        self.num_max_tokens_per_rank = num_max_tokens
        sf_cols = hidden // 128
        self.x = torch.zeros(num_max_tokens, hidden, dtype=torch.float8_e4m3fn)
        self.x_sf = torch.zeros(num_max_tokens, sf_cols, dtype=sf_dtype)
        self.topk_idx = torch.zeros(num_max_tokens, num_topk, dtype=torch.int64)
        self.topk_weights = torch.zeros(num_max_tokens, num_topk, dtype=torch.float32)
        self.num_shared_experts = num_shared_experts
        if num_shared_experts:  # MN-major, as the builds with a fused shared expert slice it
            self.shared_l1_acts_sf = torch.empty_strided((num_max_tokens, sf_cols), (1, num_max_tokens),
                                                         dtype=torch.int32).zero_()


def fake_deep_gemm(*, fused_shared: bool, sm90: bool = False, version: str = "9.9.9") -> types.ModuleType:
    module = types.ModuleType("deep_gemm")
    module.__version__ = version
    module.calls = []

    def record(name, *args, **kwargs):
        module.calls.append((name, args, kwargs))

    if fused_shared:
        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                         intermediate_hidden, num_shared_experts=0, use_fp8_dispatch=None,
                                         mma_type="fp8xfp4", activation="swiglu"):
            record("buffer", group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                   num_shared_experts=num_shared_experts)
            module.buffer = FakeBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                       intermediate_hidden, num_shared_experts=num_shared_experts)
            return module.buffer

        def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None, shared_l2_weights=None,
                             cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32), activation="swiglu",
                             activation_clamp=None, fast_math=True):
            record("fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=shared_l1_weights,
                   shared_l2_weights=shared_l2_weights, recipe=recipe, activation=activation,
                   activation_clamp=activation_clamp, fast_math=fast_math)
            y.fill_(1.0)
    else:
        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                         intermediate_hidden, use_fp8_dispatch=True, activation="swiglu"):
            record("buffer", group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
            module.buffer = FakeBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                       intermediate_hidden, sf_dtype=torch.float32 if sm90 else torch.int32)
            return module.buffer

        def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                             recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
            record("fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer, recipe=recipe, activation=activation,
                   activation_clamp=activation_clamp, fast_math=fast_math)
            y.fill_(1.0)

    def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu"):
        record("transform", l1_weights, l2_weights)
        return ("transformed-l1", l1_weights), ("transformed-l2", l2_weights)

    module.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe
    module.fp8_fp4_mega_moe = fp8_fp4_mega_moe
    module.transform_weights_for_mega_moe = transform_weights_for_mega_moe
    if sm90:
        def transform_weights_for_mega_moe_sm90(l1_weights, l2_weights):
            record("transform_sm90", l1_weights, l2_weights)
            return ("sm90-l1", l1_weights), ("sm90-l2", l2_weights)

        def fp8_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                         recipe=(128, 128, 128), activation="swiglu", activation_clamp=None, fast_math=True):
            record("fp8_mega_moe", y, l1_weights, l2_weights, sym_buffer, recipe=recipe, activation=activation,
                   activation_clamp=activation_clamp, fast_math=fast_math)
            y.fill_(2.0)

        module.transform_weights_for_mega_moe_sm90 = transform_weights_for_mega_moe_sm90
        module.fp8_mega_moe = fp8_mega_moe
    return module


def calls_named(module, name):
    return [c for c in module.calls if c[0] == name]


@pytest.fixture
def install(monkeypatch):
    """Put a fake deep_gemm in sys.modules and pretend the (CPU) device is a GPU of a given capability."""

    def _install(module, capability):
        monkeypatch.setitem(sys.modules, "deep_gemm", module)
        monkeypatch.setattr(deepgemm, "device_capability", lambda device: capability)
        monkeypatch.setattr(deepgemm, "device_name", lambda device: "Fake GPU")
        monkeypatch.setattr(deepgemm, "kernel_for", _kernel_for_any_device)
        return module

    return _install


def _kernel_for_any_device(device):
    capability = deepgemm.device_capability(device)
    return next((k for k in deepgemm.KERNELS if k.supports_capability(capability)), None)


# the real kernels' buffer layout needs 16-byte rows in every TMA-loaded view: hidden % 512 == 0 (FP32 scale per
# 128 values) and intermediate % 256 == 0 (sgl-deep-gemm's SM90 L2 activation scale per 64 values); the tiny CPU
# shape trips `num_bytes % 16 == 0` in its layout (seen on an H200, 2026-12-02)
GPU_SHAPE = {"hidden": 512, "intermediate": 256, "experts": 8, "topk": 4, "tokens": 5, "capacity": 16}


def make_inputs(*, shared_recipe=None, clamp=10.0, shape=None):
    shape = shape or {"hidden": H, "intermediate": I, "experts": E, "topk": K, "tokens": T, "capacity": CAPACITY}
    h, i, e, k, t = (shape[n] for n in ("hidden", "intermediate", "experts", "topk", "tokens"))
    seed = int(torch.randint(0, 1 << 30, ()))  # fresh inputs every run
    l1, l2 = cases.random_moe_weights(e, h, i, seed=seed)
    x, x_sf = cases.random_activations(t, h, seed=seed + 1)
    topk_idx, topk_weights = cases.make_routing("uniform", t, e, k, seed=seed + 2)
    shared = None
    if shared_recipe is not None:
        shared = cases.random_shared_expert_weights(h, i, seed=seed + 3, recipe=shared_recipe)
    return deepgemm.MegaMoeInputs(x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights, l1_weights=l1,
                                  l2_weights=l2, num_experts=e, num_max_tokens_per_rank=shape["capacity"],
                                  activation_clamp=clamp, shared_weights=shared)


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def is_mn_major(scales: torch.Tensor) -> bool:
    """Rows (MN) fastest within each expert: the last two dimensions are a transposed contiguous matrix."""
    return scales.transpose(-1, -2).is_contiguous() and scales.stride(-2) == 1


def assert_staged(buffer, x, x_sf, inputs):
    assert_bytes_equal(buffer.x[:T], x)
    assert_bytes_equal(buffer.x_sf[:T], x_sf)
    assert torch.equal(buffer.topk_idx[:T], inputs.topk_idx)
    assert torch.equal(buffer.topk_weights[:T], inputs.topk_weights)
    assert buffer.x[T:].view(torch.uint8).eq(0).all()  # rows past T untouched


# ----------------------------------------------------------------------------------------------- SM100 kernel
def test_sm100_routed_passes_gc_moe_operands_unchanged(install):
    dg = install(fake_deep_gemm(fused_shared=True), (10, 3))
    inputs = make_inputs()
    group = object()
    call = deepgemm.prepare(inputs, group)

    (_, args, kwargs), = calls_named(dg, "buffer")
    assert args == (group, E, CAPACITY, K, H, I) and kwargs == {"num_shared_experts": 0}  # routed only
    (_, (l1, l2), _), = calls_named(dg, "transform")
    for (values, scales), (want_values, want_scales) in ((l1, inputs.l1_weights), (l2, inputs.l2_weights)):
        assert_bytes_equal(values, want_values)
        assert torch.equal(scales, want_scales)  # the same words ...
        assert is_mn_major(scales)  # ... MN-major, as DeepGEMM's SM100 kernels read them
    assert_staged(dg.buffer, inputs.x, inputs.x_sf, inputs)

    assert not calls_named(dg, "fp8_fp4_mega_moe")  # preparing launches nothing
    call.output.fill_(float("nan"))
    call.run()
    (_, args, kwargs), = calls_named(dg, "fp8_fp4_mega_moe")
    y, w1, w2, buffer = args
    assert y is call.output and y.shape == (T, H) and y.dtype == torch.bfloat16
    assert w1 == ("transformed-l1", l1) and w2 == ("transformed-l2", l2) and buffer is dg.buffer
    assert kwargs == {"shared_l1_weights": None, "shared_l2_weights": None, "recipe": (1, 1, 32),
                      "activation": "swiglu", "activation_clamp": 10.0, "fast_math": True}
    assert bool(call.output.eq(1.0).all()) and call.capturable
    assert call.note == "deep_gemm 9.9.9 fp8_fp4_mega_moe"


@pytest.mark.parametrize("recipe", [formats.RECIPE_K32, formats.RECIPE_BLOCK128])
def test_sm100_fuses_the_shared_expert_in_per_32_format(install, recipe):
    dg = install(fake_deep_gemm(fused_shared=True), (10, 0))
    inputs = make_inputs(shared_recipe=recipe)
    call = deepgemm.prepare(inputs, object())
    (_, _, kwargs), = calls_named(dg, "buffer")
    assert kwargs == {"num_shared_experts": 1}
    shared_transform = calls_named(dg, "transform")[1]
    (s1, s1_sf), (s2, s2_sf) = shared_transform[1]
    shared = inputs.shared_weights
    for values, scales, want_values, rows in ((s1, s1_sf, shared.w1, 2 * I), (s2, s2_sf, shared.w2, H)):
        assert_bytes_equal(values, want_values)  # FP8 values unchanged
        assert scales.dtype == torch.int32 and scales.shape == (rows, values.shape[1] // 128)
        assert is_mn_major(scales)
    # the per-32 scales describe exactly the same weights as the shared expert's own recipe
    w1, w2 = shared.dequantize()
    torch.testing.assert_close(formats.dequantize_fp8_ue8m0(s1, s1_sf.contiguous()), w1, rtol=0, atol=0)
    torch.testing.assert_close(formats.dequantize_fp8_ue8m0(s2, s2_sf.contiguous()), w2, rtol=0, atol=0)
    assert torch.equal(dg.buffer.shared_l1_acts_sf[:T], inputs.x_sf)
    assert_staged(dg.buffer, inputs.x, inputs.x_sf, inputs)

    call.run()
    (_, _, kwargs), = calls_named(dg, "fp8_fp4_mega_moe")
    assert kwargs["shared_l1_weights"] == ("transformed-l1", (s1, s1_sf))
    assert kwargs["shared_l2_weights"] == ("transformed-l2", (s2, s2_sf))
    assert call.note == "deep_gemm 9.9.9 fp8_fp4_mega_moe, shared expert fused"


def test_sm100_without_fused_mode_adds_the_shared_expert_separately(install):
    dg = install(fake_deep_gemm(fused_shared=False), (10, 0))
    inputs = make_inputs(shared_recipe=formats.RECIPE_K32, clamp=None)
    call = deepgemm.prepare(inputs, object())
    (_, _, kwargs), = calls_named(dg, "buffer")
    assert kwargs == {}
    call.run()
    (_, _, kwargs), = calls_named(dg, "fp8_fp4_mega_moe")
    assert "shared_l1_weights" not in kwargs and kwargs["activation_clamp"] is None
    # the fake kernel wrote 1.0; the shared expert alone is the reference layer with every route empty
    no_routes = torch.full_like(inputs.topk_idx, -1)
    shared_only = reference.moe_reference(inputs.x, inputs.x_sf, no_routes, torch.zeros_like(inputs.topk_weights),
                                          inputs.l1_weights, inputs.l2_weights, activation_clamp=None,
                                          shared_weights=inputs.shared_weights).float()
    got = call.output.float() - 1.0
    assert metrics.cosine(got, shared_only) > 0.999  # bf16 GEMMs against the float32 reference
    assert "shared expert separate" in call.note and "num_shared_experts" in call.note


# ----------------------------------------------------------------------------------------------- SM90 kernel
def test_sm90_requantizes_weights_to_fp8_blocks_and_activations_per_128(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True, version="0.2.1"), (9, 0))
    inputs = make_inputs()
    call = deepgemm.prepare(inputs, "group")
    (_, args, _), = calls_named(dg, "buffer")
    assert args == ("group", E, CAPACITY, K, H, I)
    assert not calls_named(dg, "transform")
    (_, (l1, l2), _), = calls_named(dg, "transform_sm90")
    for (values, scales), (fp4, fp4_sf), (n, k) in ((l1, inputs.l1_weights, (2 * I, H)),
                                                   (l2, inputs.l2_weights, (H, I))):
        assert values.dtype == torch.float8_e4m3fn and values.shape == (E, n, k)
        assert scales.dtype == torch.float32 and scales.shape == (E, n // 128, k // 128)
        for e in range(E):  # every weight the same number as the MXFP4 original
            torch.testing.assert_close(formats.dequantize_fp8_block128(values[e], scales[e]),
                                       formats.dequantize_fp4_ue8m0(fp4[e], fp4_sf[e]), rtol=0, atol=0)
    buffer = dg.buffer
    assert buffer.x_sf.dtype == torch.float32
    original = formats.dequantize_fp8_ue8m0(inputs.x, inputs.x_sf)
    staged = formats.dequantize_fp8_k128(buffer.x[:T], buffer.x_sf[:T])
    # one FP8 rounding at the per-128 scale: within half an E4M3 step (2^-4 relative) plus the scale's floor
    bound = original.abs() * 2.0 ** -4 + buffer.x_sf[:T].repeat_interleave(128, dim=1) * 2.0 ** -9
    assert bool(((staged - original).abs() <= bound).all())
    assert torch.equal(buffer.topk_idx[:T], inputs.topk_idx)
    assert torch.equal(buffer.topk_weights[:T], inputs.topk_weights)

    call.run()
    (_, args, kwargs), = calls_named(dg, "fp8_mega_moe")
    assert args[0] is call.output and args[1] == ("sm90-l1", l1) and args[2] == ("sm90-l2", l2)
    assert kwargs == {"recipe": (128, 128, 128), "activation": "swiglu", "activation_clamp": 10.0,
                      "fast_math": True}
    assert not calls_named(dg, "fp8_fp4_mega_moe")
    assert bool(call.output.eq(2.0).all())
    assert call.note == "deep_gemm 0.2.1 fp8_mega_moe (FP8 weights, recipe (128, 128, 128); symmetric buffer)"


def test_sm90_shared_expert_runs_beside_the_kernel(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True), (9, 0))
    inputs = make_inputs(shared_recipe=formats.RECIPE_BLOCK128)
    call = deepgemm.prepare(inputs, "group")
    call.run()
    assert len(calls_named(dg, "fp8_mega_moe")) == 1
    separate = deepgemm.SeparateSharedExpert(inputs)()
    torch.testing.assert_close(call.output.float(), (separate.float() + 2.0).bfloat16().float(), rtol=0, atol=0)
    assert "shared expert separate" in call.note


def test_inputs_are_checked_with_the_allowed_shapes():
    inputs = make_inputs()
    with pytest.raises(ValueError, match=r"T = 5 tokens; allowed: 1..4"):
        deepgemm.MegaMoeInputs(**{**inputs.__dict__, "num_max_tokens_per_rank": 4})
    with pytest.raises(ValueError, match=r"l2 values must be \(8, 256, 64\)"):
        deepgemm.MegaMoeInputs(**{**inputs.__dict__, "l2_weights": (inputs.l2_weights[0][:, :, :32],
                                                                       inputs.l2_weights[1])})
    with pytest.raises(ValueError, match=r"x_sf must be int32 \[T, H/128\]"):
        deepgemm.MegaMoeInputs(**{**inputs.__dict__, "x_sf": inputs.x_sf.float()})


def test_staging_rejects_a_buffer_view_of_another_layout():
    inputs = make_inputs()
    buffer = FakeBuffer(None, E, CAPACITY, K, H, I)
    buffer.x_sf = torch.zeros(CAPACITY, H // 32, dtype=torch.int32)  # one word per 32 values: not this layout
    with pytest.raises(ValueError, match=r"view x_sf is torch.int32 \(16, 8\); the inputs need torch.int32 \[>= 5, 2\]"):
        deepgemm.stage_inputs(buffer, inputs.x, inputs.x_sf, inputs.topk_idx, inputs.topk_weights)


# ----------------------------------------------------------------------------------------------- skip reasons
def test_reason_on_cpu_names_both_kernels():
    ok, reason = deepgemm.available(torch.device("cpu"))
    assert not ok and reason == ("needs a CUDA GPU (SM100 (compute capability 10.x): fp8_fp4_mega_moe; "
                                 "SM90 (compute capability 9.0): fp8_mega_moe); this run is on cpu")


def test_reasons_for_a_gpu_of_another_architecture(install):
    install(fake_deep_gemm(fused_shared=True, sm90=True), (12, 0))
    cuda = torch.device("cuda")
    assert deepgemm.available(cuda) == (False, (
        "needs SM100 (compute capability 10.x): fp8_fp4_mega_moe; SM90 (compute capability 9.0): fp8_mega_moe; "
        "this GPU is sm_120 (Fake GPU)"))
    assert deepgemm.FP8_FP4_MEGA_MOE.available(cuda) == (
        False, "fp8_fp4_mega_moe needs SM100 (compute capability 10.x); this GPU is sm_120 (Fake GPU)")
    assert deepgemm.FP8_MEGA_MOE_SM90.available(cuda) == (
        False, "fp8_mega_moe needs SM90 (compute capability 9.0); this GPU is sm_120 (Fake GPU)")


def test_each_kernel_names_the_architecture_it_needs(install):
    install(fake_deep_gemm(fused_shared=True, sm90=True), (9, 0))
    cuda = torch.device("cuda")
    assert deepgemm.FP8_FP4_MEGA_MOE.available(cuda) == (
        False, "fp8_fp4_mega_moe needs SM100 (compute capability 10.x); this GPU is sm_90 (Fake GPU)")
    assert deepgemm.available(cuda) == (True, "")  # the SM90 anchor runs here
    install(fake_deep_gemm(fused_shared=True, sm90=True), (10, 3))
    assert deepgemm.FP8_MEGA_MOE_SM90.available(cuda) == (
        False, "fp8_mega_moe needs SM90 (compute capability 9.0); this GPU is sm_103 (Fake GPU)")
    assert deepgemm.available(cuda) == (True, "")


def test_reason_when_the_package_is_missing(install, monkeypatch):
    install(None, (9, 0))  # None in sys.modules: the import fails as for an absent package
    assert deepgemm.available(torch.device("cuda")) == (
        False, "deep_gemm is not installed (pip package sgl-deep-gemm)")
    with pytest.raises(RuntimeError, match="deep_gemm is not installed"):
        deepgemm.prepare(make_inputs(), None)


def test_reason_carries_the_import_error_text(install, monkeypatch, tmp_path):
    package = tmp_path / "deep_gemm"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureD1Ev')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install(None, (10, 0))
    monkeypatch.delitem(sys.modules, "deep_gemm")
    assert deepgemm.available(torch.device("cuda")) == (False, (
        "deep_gemm fails to import: ImportError: _C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureD1Ev"))


def test_reason_when_the_installed_version_lacks_the_entry_point(install):
    module = fake_deep_gemm(fused_shared=False, version="0.1.0")  # no SM90 Mega MoE in it
    install(module, (9, 0))
    assert deepgemm.available(torch.device("cuda")) == (
        False, "deep_gemm 0.1.0 lacks fp8_mega_moe, transform_weights_for_mega_moe_sm90")


def test_alpha_other_than_one_is_refused(install):
    install(fake_deep_gemm(fused_shared=True), (10, 0))
    inputs = deepgemm.MegaMoeInputs(**{**make_inputs().__dict__, "activation_alpha": 1.702})
    with pytest.raises(ValueError, match=r"silu\(gate\) \* up \(activation_alpha = 1\); this model has "
                                         r"activation_alpha = 1.702"):
        deepgemm.prepare(inputs, None)


def test_registry_adapter_wires_to_this_module(monkeypatch):
    from gcmoe_bench.operators import get_operator

    adapter = get_operator("deepgemm")
    assert adapter.role == "baseline"
    ok, reason = adapter.available(torch.device("cpu"))
    assert not ok and reason == "deepgemm: " + deepgemm.available(torch.device("cpu"))[1]
    monkeypatch.setattr(deepgemm, "available", lambda device: (False, "sentinel reason"))
    assert adapter.available(torch.device("cpu")) == (False, "deepgemm: sentinel reason")


# ----------------------------------------------------------------------------------------------- real runs
@pytest.mark.gpu
def test_real_kernel_matches_the_reference_on_this_gpu():
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())  # init_process_group's device_id needs an index
    ok, reason = deepgemm.available(device)
    if not ok:
        pytest.skip(reason)
    inputs = make_inputs(shape=GPU_SHAPE)
    moved = deepgemm.MegaMoeInputs(**{
        **inputs.__dict__,
        **{name: getattr(inputs, name).to(device) for name in ("x", "x_sf", "topk_idx", "topk_weights")},
        "l1_weights": tuple(t.to(device) for t in inputs.l1_weights),
        "l2_weights": tuple(t.to(device) for t in inputs.l2_weights),
    })
    owned = not dist.is_initialized()
    if owned:
        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        try:
            call = deepgemm.prepare(moved, dist.group.WORLD)
        except deepgemm.BufferSetupFailed as exc:  # the installed version's limitation, as the harness skips it
            pytest.skip(f"the installed deep_gemm cannot set up its buffer: {exc}")
        call.output.fill_(float("nan"))
        call.run()
        torch.cuda.synchronize()
        expected = reference.moe_reference(inputs.x, inputs.x_sf, inputs.topk_idx, inputs.topk_weights,
                                           inputs.l1_weights, inputs.l2_weights, activation_clamp=10.0).float()
        got = call.output.float().cpu()
        assert bool(torch.isfinite(got).all())
        assert metrics.cosine(got, expected) > 0.999, call.note
    finally:
        if owned:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- buffer setup
@pytest.mark.parametrize("capability, sm90", [((10, 0), False), ((9, 0), True)])
def test_a_failing_buffer_allocator_is_a_setup_failure_naming_version_and_error(install, capability, sm90):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=sm90, version="0.2.0"), capability)
    message = f"tensor does not have a device ({torch.randint(0, 1 << 30, ()).item()})"

    def broken_allocator(*args, **kwargs):
        raise RuntimeError(message)

    dg.get_symm_buffer_for_mega_moe = broken_allocator
    with pytest.raises(deepgemm.BufferSetupFailed) as caught:
        deepgemm.prepare(make_inputs(), "group")
    assert str(caught.value) == f"deep_gemm 0.2.0 broken_allocator failed: RuntimeError: {message}"
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_sm90_without_any_allocator_is_a_setup_failure(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True, version="0.2.0"), (9, 0))
    del dg.get_symm_buffer_for_mega_moe
    with pytest.raises(deepgemm.BufferSetupFailed, match=r"^deep_gemm 0.2.0 has no symmetric-buffer allocator "
                                                          r"for fp8_mega_moe \(get_symm_buffer_for_sm90_mega_moe"):
        deepgemm.prepare(make_inputs(), "group")


def test_adapter_turns_a_setup_failure_into_operator_unavailable_and_nothing_else(monkeypatch):
    from gcmoe_bench.operators import OperatorUnavailable, get_operator

    adapter = get_operator("deepgemm")
    inputs = make_inputs()
    w = types.SimpleNamespace(l1=inputs.l1_weights, l2=inputs.l2_weights, shared=None)
    model = types.SimpleNamespace(num_experts=E, capacity=CAPACITY, activation_alpha=1.0, activation_clamp=10.0)
    workload = types.SimpleNamespace(x=inputs.x, x_sf=inputs.x_sf, topk_idx=inputs.topk_idx,
                                     topk_weights=inputs.topk_weights, weights=w, model=model, shared_experts=0)

    def setup_fails(inputs, group):
        raise deepgemm.BufferSetupFailed("deep_gemm 0.2.0 get_symm_buffer_for_mega_moe failed: RuntimeError: x")

    monkeypatch.setattr(deepgemm, "prepare", setup_fails)
    with pytest.raises(OperatorUnavailable) as caught:
        adapter.prepare(workload, "group")
    assert str(caught.value) == "deepgemm: deep_gemm 0.2.0 get_symm_buffer_for_mega_moe failed: RuntimeError: x"

    def bug(inputs, group):
        raise ValueError("a defect, not a limitation")

    monkeypatch.setattr(deepgemm, "prepare", bug)
    with pytest.raises(ValueError, match="a defect, not a limitation"):  # not turned into a skip
        adapter.prepare(workload, "group")


# ----------------------------------------------------------------------------------------------- SM90 at one rank
class OneRankGroup:
    def __init__(self, size=1):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def fake_native_sm90(module, alignment=8):
    """The two `_C` functions the plain buffer uses: the token alignment and the size + slicer of the layout."""
    module.native_calls = []

    def get_symm_buffer_size_for_sm90_mega_moe(num_ranks, num_experts, num_max_tokens, num_topk, hidden,
                                               intermediate, use_fp8_dispatch, activation):
        module.native_calls.append((num_ranks, num_experts, num_max_tokens, num_topk, hidden, intermediate,
                                    use_fp8_dispatch, activation))
        parts = ((num_max_tokens * hidden, torch.uint8, (num_max_tokens, hidden)),
                 (num_max_tokens * hidden // 128 * 4, torch.float32, (num_max_tokens, hidden // 128)),
                 (num_max_tokens * num_topk * 8, torch.int64, (num_max_tokens, num_topk)),
                 (num_max_tokens * num_topk * 4, torch.float32, (num_max_tokens, num_topk)),
                 (64, torch.uint8, (64,)))

        def slice_input_buffers(buffer):
            views, at = [], 0
            for nbytes, dtype, shape in parts:
                views.append(buffer[at:at + nbytes].view(dtype).view(shape))
                at += nbytes
            return views

        return sum(p[0] for p in parts), slice_input_buffers

    module._C = types.SimpleNamespace(get_token_alignment_for_mega_moe=lambda: alignment,
                                      get_symm_buffer_size_for_sm90_mega_moe=get_symm_buffer_size_for_sm90_mega_moe)


def test_sm90_one_rank_falls_back_to_a_plain_buffer_when_the_symmetric_allocator_fails(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True, version="0.2.2"), (9, 0))
    fake_native_sm90(dg, alignment=8)
    message = f"tensor does not have a device ({torch.randint(0, 1 << 30, ()).item()})"

    def symmetric_allocator(*args, **kwargs):
        raise RuntimeError(message)

    dg.get_symm_buffer_for_sm90_mega_moe = symmetric_allocator
    inputs = make_inputs()
    call = deepgemm.prepare(inputs, OneRankGroup())
    capacity = -(-CAPACITY // 8) * 8
    assert dg.native_calls == [(1, E, capacity, K, H, I, True, "swiglu")]
    call.run()
    (_, args, _), = calls_named(dg, "fp8_mega_moe")
    buffer = args[3]
    assert isinstance(buffer, deepgemm.Sm90PlainBuffer)
    assert buffer.handle.buffer_ptrs == [buffer.buffer.data_ptr()] and buffer.group.rank() == 0
    assert buffer.num_max_tokens_per_rank == capacity and buffer.num_experts == E and buffer.num_topk == K
    # the inputs were staged into the plain allocation's own bytes, through the package's views
    x, x_sf = deepgemm.activations_for_buffer(inputs.x, inputs.x_sf, torch.float32)
    assert_bytes_equal(buffer.buffer[:T * H].view(torch.float8_e4m3fn).view(T, H), x)
    assert_bytes_equal(buffer.x_sf[:T], x_sf)
    assert torch.equal(buffer.topk_idx[:T], inputs.topk_idx)
    assert bool(call.output.eq(2.0).all())
    assert call.note.endswith(f"plain world-size-1 buffer (deep_gemm 0.2.2 symmetric_allocator failed: "
                              f"RuntimeError: {message}))")


def test_sm90_several_ranks_keep_the_symmetric_allocator_failure(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True, version="0.2.2"), (9, 0))
    fake_native_sm90(dg)

    def symmetric_allocator(*args, **kwargs):
        raise RuntimeError("no device")

    dg.get_symm_buffer_for_sm90_mega_moe = symmetric_allocator
    with pytest.raises(deepgemm.BufferSetupFailed, match=r"^deep_gemm 0.2.2 symmetric_allocator failed: "
                                                          r"RuntimeError: no device$"):
        deepgemm.prepare(make_inputs(), OneRankGroup(size=2))
    assert dg.native_calls == []  # no plain buffer for a job with peers


def test_setup_failure_keeps_the_first_line_of_a_native_error(install):
    dg = install(fake_deep_gemm(fused_shared=False, sm90=True, version="0.2.2"), (9, 0))

    def native_allocator(*args, **kwargs):
        raise RuntimeError("tensor does not have a device\nException raised from device_default at TensorImpl.h\n"
                           "frame #0: c10::Error::Error(...)")

    dg.get_symm_buffer_for_sm90_mega_moe = native_allocator
    with pytest.raises(deepgemm.BufferSetupFailed) as caught:
        deepgemm.prepare(make_inputs(), "group")
    assert str(caught.value) == ("deep_gemm 0.2.2 native_allocator failed: RuntimeError: tensor does not have a "
                                 "device")
