"""SM90 Mega MoE port: offline build + PTX checks and host arithmetic (CPU); against the float32 reference (GPU)."""

import re
from types import SimpleNamespace

import pytest
import torch
from gc_moe.kernels.sm90 import mega_port as mp
from gc_moe.kernels.sm90 import mega_port_ws as kws

from baselines.mega_moe import port_sm90
from baselines.mega_moe.port_sm90 import device_check, host


# --------------------------------------------------------------------------------------------- host arithmetic
def test_config_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="block_n must be one of"):
        mp.PortConfig(block_n=12)
    with pytest.raises(ValueError, match="stages must be in"):
        mp.PortConfig(stages=1)
    with pytest.raises(ValueError, match="multiple of 256"):
        host.check_shape(320, 2048, 4, 8)
    with pytest.raises(ValueError, match="multiple of 128"):
        host.check_shape(6144, 2000, 4, 8)
    with pytest.raises(ValueError, match="local experts"):
        host.check_shape(6144, 2048, mp.MAX_LOCAL_EXPERTS + 1, 8)


def test_shared_memory_plan_fits_the_sm_and_keeps_wgmma_alignment():
    for bn in mp.BLOCK_N_CHOICES:
        cfg = mp.PortConfig(bn, host.BUILT_STAGES)
        assert cfg.b_offset % 128 == 0 and cfg.stage_bytes % 128 == 0
        assert cfg.amax_offset == cfg.stages * cfg.stage_bytes
        assert cfg.table_offset >= cfg.amax_offset + 16 * bn * 4
        assert cfg.smem_bytes + 1024 <= 227 * 1024  # the DSL adds 1 KiB of static shared memory


def test_block_n_follows_rows_per_expert():
    assert host.choose_block_n(1, 8, 32) == 8  # 0.25 rows per expert
    assert host.choose_block_n(8, 8, 32) == 8  # 2: N 8 measured faster
    assert host.choose_block_n(16, 8, 32) == 8  # 4
    assert host.choose_block_n(64, 6, 48) == 16  # 8: N 16 measured faster
    assert host.choose_block_n(256, 6, 48) == 16  # 32: the largest built N
    assert all(host.choose_block_n(t, 8, 32) in mp.BLOCK_N_CHOICES for t in range(1, 257))


def test_work_items_by_hand():
    # experts with 0, 1, 16 and 17 rows at N 16: 0 + 1 + 1 + 2 token tiles
    assert host.work_items([0, 1, 16, 17], 16, 6144, 2048) == (16 * 4, 24 * 4)
    assert host.work_items([0, 0], 8, 5120, 2304) == (0, 0)


def test_control_words_do_not_overlap():
    singles = [mp.ROUTING_READY, mp.TAG1_ARRIVE, mp.TAG2_ARRIVE, mp.W2_DONE, mp.FINISH]
    assert len(set(singles)) == len(singles) and max(singles) < mp.ROWS_READY
    assert mp.W1_DONE == mp.ROWS_READY + mp.MAX_LOCAL_EXPERTS
    assert mp.CONTROL_WORDS == mp.W1_DONE + mp.MAX_LOCAL_EXPERTS


def test_registry_builds_every_port_variant():
    from gc_moe.kernels import registry

    names = {v.describe() for v in registry.variants_for_profile("sm_90a", {})}
    assert {v.describe() for v in host.all_variants()} <= names
    assert not [v for v in registry.variants_for_profile("sm_100a", {}) if v.name == "mega_port.sm90"]


def test_unavailable_on_cpu_says_why():
    ok, reason = port_sm90.available(torch.device("cpu"))
    assert not ok and "needs a CUDA GPU" in reason


def test_adapter_reports_the_port_reason(monkeypatch):
    from gcmoe_bench.operators import get_operator

    ok, reason = get_operator("mega-port").available(torch.device("cpu"))
    assert not ok and reason == "mega-port needs a CUDA GPU (sm_90a); this run is on cpu"
    # on a GPU the port's own reason, prefixed
    monkeypatch.setattr(port_sm90, "_capability", lambda device: (10, 3))
    ok, reason = get_operator("mega-port").available(torch.device("cuda", 0))
    assert not ok and reason == "mega-port: the SM90 Mega MoE port needs sm_90a (H20/H200); this GPU is sm_103"


# --------------------------------------------------------------------------------------------- shared expert
def _port_inputs(tokens=2, hidden=256, inter=128, experts=2, alpha=1.0, clamp=10.0, recipe=(1, 1, 32), shared=True):
    """Small CPU MegaMoeInputs with real quantized weights (and a shared expert in `recipe`)."""
    from gc_moe import cases

    from baselines.mega_moe.deepgemm import MegaMoeInputs

    l1, l2 = cases.random_moe_weights(experts, hidden, inter, seed=5)
    x, x_sf = cases.random_activations(tokens, hidden, seed=6)
    idx, wts = cases.make_routing("uniform", tokens, experts, 1, seed=7)
    sw = cases.random_shared_expert_weights(hidden, inter, seed=8, recipe=recipe) if shared else None
    return MegaMoeInputs(x=x, x_sf=x_sf, topk_idx=idx, topk_weights=wts, l1_weights=l1, l2_weights=l2,
                         num_experts=experts, num_max_tokens_per_rank=8, activation_alpha=alpha,
                         activation_clamp=clamp, shared_weights=sw)


def test_shared_expert_kernel_reason_says_why_not(monkeypatch):
    from gc_moe.kernels.sm90 import layer as sm90_layer

    monkeypatch.setattr(sm90_layer, "shared_expert_unavailable_reason", lambda cache_dir=None: None)
    assert port_sm90.shared_expert_kernel_reason(_port_inputs()) is None
    assert port_sm90.shared_expert_kernel_reason(_port_inputs(recipe=(1, 128, 128))) is None
    assert port_sm90.shared_expert_kernel_reason(_port_inputs(shared=False)) == "no shared expert"
    assert port_sm90.shared_expert_kernel_reason(_port_inputs(alpha=1.702)) == (
        "its cubins are built for SwiGLU alpha 1, clamp 10; this model has alpha 1.702, clamp 10.0")
    assert "clamp None" in port_sm90.shared_expert_kernel_reason(_port_inputs(clamp=None))
    monkeypatch.setattr(sm90_layer, "shared_expert_unavailable_reason",
                        lambda cache_dir=None: "16 shared-expert kernels are not in the cubin cache /c")
    assert port_sm90.shared_expert_kernel_reason(_port_inputs()) == (
        "16 shared-expert kernels are not in the cubin cache /c")


def test_shared_expert_note_names_what_ran():
    assert port_sm90.shared_expert_note(132, None) == (
        "shared expert separate: the SM90 shared-expert kernel (W1 then W2 on all 132 SMs), added to the kernel's "
        "output")
    assert port_sm90.shared_expert_note(132, "no cubins") == (
        "shared expert separate: bf16 torch GEMMs on dequantized FP8 weights, added to the kernel's output (the "
        "SM90 shared-expert kernel cannot run here: no cubins)")


def _fake_port_prepare(monkeypatch, launches: list):
    """port_sm90.prepare without a GPU: availability, the kernel load, its arguments and launch are stand-ins;
    the routed launch appends "routed" to `launches`."""
    from gc_moe.runtime import jit

    monkeypatch.setattr(port_sm90, "available", lambda device: (True, ""))
    kernel = SimpleNamespace(entry=SimpleNamespace(launch=SimpleNamespace(block=(512, 1, 1))))
    monkeypatch.setattr(jit, "load_kernel", lambda variant, arch: kernel)
    monkeypatch.setattr(host, "kernel_args", lambda *a, **k: [])
    monkeypatch.setattr(host, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(host, "launch", lambda *a, **k: launches.append("routed"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def test_prepare_launches_the_shared_expert_kernel_after_the_routed_one(monkeypatch):
    launches = []
    _fake_port_prepare(monkeypatch, launches)
    monkeypatch.setattr(port_sm90, "shared_expert_kernel_reason", lambda inputs: None)
    seen = {}

    def fake_kernel(inputs, x, x_sf, output, sms):
        seen["sms"], seen["x"] = sms, x

        def run():
            launches.append("shared")
            output.add_(1.0)

        return run, ("kept",)

    monkeypatch.setattr(port_sm90, "_shared_expert_kernel", fake_kernel)
    inputs = _port_inputs()
    call = port_sm90.prepare(inputs, None)
    assert call.capturable and "kept" in call.keep_alive
    assert call.note.endswith("shared expert separate: the SM90 shared-expert kernel (W1 then W2 on all 132 SMs), "
                              "added to the kernel's output")
    assert seen["sms"] == 132 and torch.equal(seen["x"].view(torch.uint8), inputs.x.view(torch.uint8))
    call.output.zero_()
    call.run()
    assert launches == ["routed", "shared"] and bool((call.output == 1).all())


def test_prepare_falls_back_to_bf16_gemms_and_says_why(monkeypatch):
    from gc_moe import reference

    launches = []
    _fake_port_prepare(monkeypatch, launches)
    monkeypatch.setattr(port_sm90, "shared_expert_kernel_reason", lambda inputs: "no shared-expert cubins")
    inputs = _port_inputs()
    call = port_sm90.prepare(inputs, None)
    assert call.note.endswith("(the SM90 shared-expert kernel cannot run here: no shared-expert cubins)")
    call.output.zero_()
    call.run()
    assert launches == ["routed"]
    alone = reference.moe_reference(inputs.x, inputs.x_sf, torch.full_like(inputs.topk_idx, -1),
                                    torch.zeros_like(inputs.topk_weights), inputs.l1_weights, inputs.l2_weights,
                                    shared_weights=inputs.shared_weights)
    torch.testing.assert_close(call.output.float(), alone.float(), rtol=2e-2, atol=2e-2)


def test_prepare_falls_back_when_the_kernel_cannot_be_loaded(monkeypatch):
    from gc_moe.runtime import jit

    _fake_port_prepare(monkeypatch, [])
    monkeypatch.setattr(port_sm90, "shared_expert_kernel_reason", lambda inputs: None)

    def missing(*a, **k):
        raise jit.KernelNotBuiltError("shared_expert.sm90 w1 is not in the cubin cache")

    monkeypatch.setattr(port_sm90, "_shared_expert_kernel", missing)
    call = port_sm90.prepare(_port_inputs(), None)
    assert call.note.endswith("(the SM90 shared-expert kernel cannot run here: KernelNotBuiltError: "
                              "shared_expert.sm90 w1 is not in the cubin cache)")


def test_adapter_skips_a_rank_without_tokens():
    from gcmoe_bench.models import ModelShape
    from gcmoe_bench.operators import OperatorUnavailable, get_operator
    from gcmoe_bench.workloads import build_weights, build_workload

    tiny = ModelShape(name="tiny", base="deepseek-v4.1-flash", hidden=256, intermediate=128, num_experts=2, topk=1,
                      num_shared_experts=1, shared_k_group=32, capacity=8)
    import dataclasses

    workload = build_workload(tiny, 1, 1, 0, shared_experts=0, weights=build_weights(tiny, 1, 0, shared_experts=0,
                                                                                     seed=1), seed=1)
    workload = dataclasses.replace(workload, tokens_per_rank=0, x=workload.x[:0], x_sf=workload.x_sf[:0],
                                   topk_idx=workload.topk_idx[:0], topk_weights=workload.topk_weights[:0])
    with pytest.raises(OperatorUnavailable, match="mega-port: no tokens on this rank"):
        get_operator("mega-port").prepare(workload, None)


# --------------------------------------------------------------------------------------------- offline build
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    cache = tmp_path_factory.mktemp("cubins")
    return {v: jit.build_variant(v, "sm_90a", cache_dir=cache) for v in host.all_variants()}


def _body(entry):
    return entry.ptx_path.read_text()


def _cp_async(built):
    return {v: e for v, e in built.items() if v.name == "mega_port.sm90"}


def _ws(built):
    return {v: e for v, e in built.items() if v.name == "mega_port_ws.sm90"}


def test_builds_offline_with_register_a_wgmma_and_no_local_memory(built):
    assert len(_cp_async(built)) == len(mp.BLOCK_N_CHOICES)
    for variant, entry in _cp_async(built).items():
        bn = dict(variant.params)["block_n"]
        ptx = _body(entry)
        mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, "
                         rf"\{{([^}}]*)\}}", ptx)
        assert len(mma) == 4 and all(len(a.split(",")) == 4 for a in mma), variant.describe()  # one pipeline
        assert not re.search(r"\b(ld|st)\.local\b", ptx), variant.describe()
        res = entry.resources
        assert res["frame_bytes"] == 0 and res["registers"] <= 128, res
        assert [size for _, size in res["params"]] == [8 if kind in ("u64", "s64") else 4 for _, kind in mp.PARAMS]
        assert entry.launch.block == (mp.THREADS, 1, 1)
        assert entry.launch.dynamic_smem_bytes == mp.PortConfig(bn, host.BUILT_STAGES).smem_bytes


def test_ws_pipeline_builds_on_the_persistent_gemm_loop(built):
    """The ws pipeline: role2's persistent loop (producer warp(s), mbarrier ring, bulk copies, W1-completion bits)
    between the port's phases; registers split at bn 32; stack within its budget (outside the K loops: SASS)."""
    ws = _ws(built)
    assert sorted(dict(v.params)["block_n"] for v in ws) == list(kws.BLOCK_N_CHOICES)
    for variant, entry in ws.items():
        bn = dict(variant.params)["block_n"]
        cfg = kws.PortWsConfig(bn)
        ptx = _body(entry)
        for promise in ("cp.async.bulk.shared::cluster.global.mbarrier", "mbarrier.try_wait.parity",
                        "red.release.gpu.global.or.b64", "red.release.sys.global.add", "cvt.rn.f16x2.e4m3x2",
                        f"m64n{bn}k32.f32.e4m3.e4m3"):
            assert promise in ptx, (variant.describe(), promise)
        assert ("setmaxnreg.inc.sync.aligned.u32" in ptx) == (bn == 32), variant.describe()
        # dispatch warps beside the loop at bn 8 / 16: the loop's CTA barriers leave them out
        assert cfg.dispatch_warps == (3 if bn < 32 else 0) and cfg.threads == 640
        assert (f"bar.sync 2, {cfg.gemm_threads};" in ptx) == (cfg.dispatch_warps > 0), variant.describe()
        res = entry.resources
        assert res["frame_bytes"] <= kws.LOCAL_BYTES_BUDGET[bn] and res["registers"] <= 96, res
        assert [size for _, size in res["params"]] == [8 if kind in ("u64", "s64") else 4 for _, kind in kws.PARAMS]
        assert entry.launch.block == (cfg.threads, 1, 1) and entry.launch.dynamic_smem_bytes == cfg.smem_bytes


def test_ws_config_bounds_the_dispatch_warps():
    assert kws.PortWsConfig(8, dispatch_warps=0).threads == 544
    with pytest.raises(ValueError, match="dispatch_warps 4 at block_n 16: allowed 0..3"):
        kws.PortWsConfig(16, dispatch_warps=4)
    with pytest.raises(ValueError, match="dispatch_warps 1 at block_n 32: allowed 0..0"):
        kws.PortWsConfig(32, dispatch_warps=1)
    assert dict(host.variant_ws(16).params)["dispatch_warps"] == 3


def test_ws_kernel_args_and_workspace():
    ws = host.PortWorkspace.allocate(256, 8, 512, 256, 4, "cpu")
    assert ws.l1_full_count.shape == (kws.ring_blocks(256, 8),) == (256,)
    assert ws.w1_done_mask.shape == (4, kws.mask_stride(256)) == (4, 32)
    assert ws.control.numel() >= kws.CONTROL_WORDS
    assert host.choose_block_n_ws(1, 8, 32) == 8 and host.choose_block_n_ws(256, 8, 32) == 32
    assert host.pipeline_from_env({}) == "auto" and host.pipeline_from_env({host.PIPELINE_ENV: "ws"}) == "ws"
    with pytest.raises(ValueError, match="GCMOE_MEGA_PORT_PIPELINE='tma'; allowed: auto, cp_async, ws"):
        host.pipeline_from_env({host.PIPELINE_ENV: "tma"})
    # auto: ws where its token tile is 32 (GLM-5.2's slice from 64 tokens, DeepSeek's from 128), cp_async below
    assert [host.resolve_pipeline("auto", t, 8, 32) for t in (1, 32, 64, 256)] == ["cp_async"] * 2 + ["ws"] * 2
    assert [host.resolve_pipeline("auto", t, 6, 48) for t in (64, 128)] == ["cp_async", "ws"]
    assert host.resolve_pipeline("cp_async", 256, 8, 32) == "cp_async"
    with pytest.raises(ValueError, match="allowed: at most 4096"):
        host.check_shape(6144, 8192, 32, 8, "ws")


def test_ptx_has_the_hand_over_protocol(built):
    for variant, entry in _cp_async(built).items():
        ptx = _body(entry)
        counts = {m: ptx.count(m) for m in ("ld.acquire.gpu.global.b32", "ld.acquire.sys.global.b32",
                                             "st.release.gpu.global.b32", "red.release.gpu.global.add.s32",
                                             "atom.release.gpu.global.add.s32", "red.release.sys.global.add.s32",
                                             "atom.acq_rel.gpu.global.add.s32", "trap;", "cvt.rn.f16x2.e4m3x2")}
        assert all(counts.values()), (variant.describe(), counts)
        # every bounded wait traps: one acquire per wait site (gpu: routing, rows, W1 done, W2 done; sys: tag 1,
        # tag 2), each with its re-load in the spin loop
        assert counts["ld.acquire.gpu.global.b32"] >= 8 and counts["ld.acquire.sys.global.b32"] >= 4, counts
        # the W1 / W2 hand-over releases and the ROWS_READY release come after a fence
        assert ptx.count("fence.acq_rel.gpu") >= 3


def test_kernel_args_follow_the_parameter_table():
    from gc_moe.runtime.launch import natural_layout

    class FakeTensor:
        def __init__(self, shape, dtype):
            self.shape, self.dtype, self.is_cuda = tuple(shape), dtype, True

        def data_ptr(self):
            return 4096

        def is_contiguous(self):
            return True

    class FakeMatrix:
        def __init__(self, rows, cols, experts):
            self.rows, self.cols, self.num_experts = rows, cols, experts
            self.codes = self.scales = self.factor = FakeTensor((1,), torch.uint8)

    class FakeWeights:
        l1, l2 = FakeMatrix(4096, 6144, 32), FakeMatrix(6144, 2048, 32)

    t, k = 3, 8
    ws = host.PortWorkspace(*[FakeTensor((256 * k,), torch.int32) for _ in range(11)],
                            FakeTensor((256,), torch.int32), FakeTensor((256,), torch.int32),
                            FakeTensor((32, 32), torch.int64))
    args = host.kernel_args(ws, FakeTensor((t, 6144), torch.float8_e4m3fn), FakeTensor((t, 48), torch.int32),
                            FakeTensor((t, k), torch.int64), FakeTensor((t, k), torch.float32), FakeWeights(),
                            FakeTensor((t, 6144), torch.bfloat16))
    assert [a.size for a in args] == [8 if kind in ("u64", "s64") else 4 for _, kind in mp.PARAMS]
    assert len(natural_layout(args)) == len(mp.PARAMS)
    args_ws = host.kernel_args(ws, FakeTensor((t, 6144), torch.float8_e4m3fn), FakeTensor((t, 48), torch.int32),
                               FakeTensor((t, k), torch.int64), FakeTensor((t, k), torch.float32), FakeWeights(),
                               FakeTensor((t, 6144), torch.bfloat16), pipeline="ws")
    assert [a.size for a in args_ws] == [8 if kind in ("u64", "s64") else 4 for _, kind in kws.PARAMS]
    with pytest.raises(ValueError, match="the workspace holds"):
        host.kernel_args(ws, FakeTensor((300, 6144), torch.float8_e4m3fn), FakeTensor((300, 48), torch.int32),
                         FakeTensor((300, k), torch.int64), FakeTensor((300, k), torch.float32), FakeWeights(),
                         FakeTensor((300, 6144), torch.bfloat16))


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", host.PIPELINES + ("auto",))
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("model", list(device_check.MODELS))
def test_port_matches_float32_reference_at_the_model_slices(model, tokens, pipeline, monkeypatch):
    monkeypatch.setenv(host.PIPELINE_ENV, pipeline)
    p = device_check.check_point(model, tokens, seed=1000 + tokens)
    _, _, experts, topk = device_check.MODELS[model]
    assert ("ws pipeline" in p.note) == (host.resolve_pipeline(pipeline, tokens, topk, experts) == "ws"), p.note
    assert p.finite, "an element of y was not written (poisoned with NaN)"
    assert p.replay_equal, "a CUDA-graph replay differs from the eager call"
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("model", list(device_check.MODELS))
def test_port_with_its_shared_expert_kernel_matches_the_reference(model, tokens):
    """The shared suite's call: the port, then the SM90 shared-expert kernel (the model's recipe), added; against
    the float32 reference with the shared expert; a graph replay equals the eager call."""
    p = device_check.check_point(model, tokens, seed=2000 + tokens, shared=True)
    assert "the SM90 shared-expert kernel (W1 then W2 on all" in p.note, p.note
    assert p.finite and p.replay_equal, p
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p


@pytest.mark.gpu
def test_port_with_bf16_shared_expert_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(port_sm90, "shared_expert_kernel_reason", lambda inputs: "forced by the test")
    p = device_check.check_point("deepseek-v4.1-flash", 8, seed=2100, shared=True)
    assert p.note.endswith("(the SM90 shared-expert kernel cannot run here: forced by the test)"), p.note
    assert p.finite and p.replay_equal, p
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", mp.BLOCK_N_CHOICES)
def test_port_with_empty_slots_at_every_block_n(block_n):
    p = device_check.check_point("deepseek-v4.1-flash", 24, seed=77, block_n=block_n, empty_slots=True)
    assert p.finite and p.replay_equal, p
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p


def test_device_check_names_the_pipeline_each_timed_point_runs(monkeypatch):
    """The timing table's pipeline column is the one `prepare` picks: auto's choice, or the environment's."""
    monkeypatch.delenv(host.PIPELINE_ENV, raising=False)
    assert device_check._pipeline("glm-5.2", 1) == "cp_async"
    assert device_check._pipeline("glm-5.2", 256) == "ws" and device_check._block_n("glm-5.2", 256) == 32
    monkeypatch.setenv(host.PIPELINE_ENV, "ws")
    assert device_check._pipeline("deepseek-v4.1-flash", 1) == "ws"
    monkeypatch.setenv(host.PIPELINE_ENV, "cp_async")
    assert device_check._pipeline("glm-5.2", 256) == "cp_async"
