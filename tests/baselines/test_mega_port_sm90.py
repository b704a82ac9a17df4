"""SM90 Mega MoE port: offline build + PTX checks and host arithmetic (CPU); against the float32 reference (GPU)."""

import re

import pytest
import torch
from gc_moe.kernels.sm90 import mega_port as mp

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


# --------------------------------------------------------------------------------------------- offline build
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    cache = tmp_path_factory.mktemp("cubins")
    return {v: jit.build_variant(v, "sm_90a", cache_dir=cache) for v in host.all_variants()}


def _body(entry):
    return entry.ptx_path.read_text()


def test_builds_offline_with_register_a_wgmma_and_no_local_memory(built):
    assert len(built) == len(mp.BLOCK_N_CHOICES)
    for variant, entry in built.items():
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


def test_ptx_has_the_hand_over_protocol(built):
    for variant, entry in built.items():
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
    ws = host.PortWorkspace(*[FakeTensor((256 * k,), torch.int32) for _ in range(11)])
    args = host.kernel_args(ws, FakeTensor((t, 6144), torch.float8_e4m3fn), FakeTensor((t, 48), torch.int32),
                            FakeTensor((t, k), torch.int64), FakeTensor((t, k), torch.float32), FakeWeights(),
                            FakeTensor((t, 6144), torch.bfloat16))
    assert [a.size for a in args] == [8 if kind in ("u64", "s64") else 4 for _, kind in mp.PARAMS]
    assert len(natural_layout(args)) == len(mp.PARAMS)
    with pytest.raises(ValueError, match="the workspace holds"):
        host.kernel_args(ws, FakeTensor((300, 6144), torch.float8_e4m3fn), FakeTensor((300, 48), torch.int32),
                         FakeTensor((300, k), torch.int64), FakeTensor((300, k), torch.float32), FakeWeights(),
                         FakeTensor((300, 6144), torch.bfloat16))


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("model", list(device_check.MODELS))
def test_port_matches_float32_reference_at_the_model_slices(model, tokens):
    p = device_check.check_point(model, tokens, seed=1000 + tokens)
    assert p.finite, "an element of y was not written (poisoned with NaN)"
    assert p.replay_equal, "a CUDA-graph replay differs from the eager call"
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", mp.BLOCK_N_CHOICES)
def test_port_with_empty_slots_at_every_block_n(block_n):
    p = device_check.check_point("deepseek-v4.1-flash", 24, seed=77, block_n=block_n, empty_slots=True)
    assert p.finite and p.replay_equal, p
    assert p.cosine >= device_check.COSINE_MIN and p.processed_diff <= device_check.PROCESSED_DIFF_MAX, p
