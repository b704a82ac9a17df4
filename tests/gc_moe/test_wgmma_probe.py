"""The measuring probe of the grouped GEMM's consumer work (kernels/sm90/wgmma_probe.py): its configurations and
what its binaries must hold (the decode's byte permutes, the chains it times, no serialized WGMMA, no spill)."""

import re

import pytest
from gc_moe.kernels.sm90 import wgmma_probe as wp


def test_probe_configurations_and_errors():
    for n, wgs in ((12, 4), (128, 1), (64, 0), (64, 5)):
        with pytest.raises(ValueError, match="wgmma probe"):
            wp.variant(n, wgs)
    # split: both roles at least one warpgroup, both dividing the step's four row blocks, the chains' accumulators
    # within their registers; shared_a only with split
    for n, wgs, split in ((64, 4, 4), (64, 6, 3), (64, 7, 2), (96, 3, 1), (64, 4, 0)):
        with pytest.raises(ValueError, match="wgmma probe"):
            wp.variant(n, wgs, split=split, shared_a=True)
    wp.variant(96, 5, split=1, shared_a=True)
    variants = wp.probe_variants()
    # per warpgroup count: the decode alone, and at each N the chain with and without it; two skewed; the split
    # configurations with each role alone and both
    assert len(variants) == len({v.describe() for v in variants}) == 2 * (1 + 2 * len(wp.N_CHOICES)) + 2 + 2 + 3 * len(
        wp.SPLITS) + 1 + 4 * len(wp.PINGPONG_N) + 4 + 6 * len(wp.SYNC_N)
    # sync: the plain decode-and-chain step only
    for kwargs in ({"sync": "membar"}, {"sync": "wait", "wide": True, "n": 96}, {"sync": "fence", "pingpong": True}):
        with pytest.raises(ValueError, match="wgmma probe: sync"):
            wp.variant(kwargs.pop("n", 64), 4, **kwargs)
    # pingpong: two halves of an even number of warpgroups, each with decode and chain, without split or wide
    for kwargs in ({"warpgroups": 3}, {"warpgroups": 6, "split": 2}, {"warpgroups": 4, "n": 96, "wide": True}):
        with pytest.raises(ValueError, match="pingpong takes turns"):
            wp.variant(kwargs.pop("n", 64), kwargs.pop("warpgroups"), pingpong=True, **kwargs)
    for n, split in ((64, 0), (96, 1)):  # wide: the N = 96 tile's two chains, without split
        with pytest.raises(ValueError, match="wide is the N = 96"):
            wp.variant(n, 5 if split else 4, split=split, shared_a=bool(split), wide=True)
    b, a, blocks, total = wp.smem_layout(96, 6)
    assert (b, a) == (0, 96 * 128) and blocks >= a + 6 * 2 * (wp.A_TILE_BYTES + wp.SCALE_TILE_BYTES)
    assert blocks % 1024 == 0 and total == blocks + 4 * wp.A_BLOCK_BYTES <= 227 * 1024


def test_probe_binaries_hold_what_they_time(tmp_path):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for v in (wp.variant(64, 4), wp.variant(96, 1), wp.variant(8, 4, decode=False), wp.variant(64, 1, chain=False),
              wp.variant(96, 4, skew=True), wp.variant(96, 4, wide=True)):
        params = dict(v.params)
        entry = jit.build_variant(v, "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        n = params["n"]
        if params.get("wide"):  # a chain of 64 rows and one of 32 per step
            assert len(re.findall(r"m64n64k32\.f32\.e4m3", ptx)) == len(re.findall(r"m64n32k32\.f32\.e4m3", ptx)) > 0
            n = 64
        chains = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3", ptx))
        # four K32 WGMMAs per step (the compiler may unroll the chain-only loop: whole chains still)
        assert (chains > 0 and chains % 4 == 0) if params["chain"] else chains == 0, v.describe()
        # the table decode's 16 byte permutes: the fragment before the loop, and each step's with decode
        assert len(re.findall(r"\bprmt\.b32\b", ptx)) >= 16 * (1 + params["decode"]), v.describe()
        assert entry.resources["frame_bytes"] == 0, v.describe()
        assert entry.launch.block == (128 * params["warpgroups"], 1, 1)


def test_split_probe_binaries_hold_what_they_time(tmp_path):
    """The split probe's shared-A chains read A through a descriptor (no A registers), its decoders store the decoded
    words (16-byte shared stores, a proxy fence) and the two roles move the register pool between them."""
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for n, split, wgs, shared_a in wp.SPLITS:
        v = wp.variant(n, wgs, split=split, shared_a=shared_a)
        entry = jit.build_variant(v, "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, (\S+)", ptx)
        assert mma and len(mma) % 4 == 0
        assert all(a.startswith("{") != shared_a for a in mma)  # register A: a brace list; shared A: a descriptor
        assert ("st.shared.v4.b32" in ptx and "fence.proxy.async.shared::cta" in ptx) == shared_a
        assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
        assert entry.resources["frame_bytes"] == 0 and len(re.findall(r"\bprmt\.b32\b", ptx)) >= 16


def test_pingpong_probe_takes_turns_around_each_chain(tmp_path):
    """Each step of a ping-pong half: its turn waited for (bar.sync), the chain issued with one group left in flight,
    the other half's turn handed over (bar.arrive), then the wait for the chain; on both barriers, never spilled."""
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for n, wgs, inplace in ((96, 4, False), (32, 2, False), (96, 4, True)):
        entry = jit.build_variant(wp.variant(n, wgs, pingpong=True, inplace=inplace), "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        threads = 128 * wgs
        for barrier in wp.PINGPONG_BARRIERS:
            assert f"bar.sync {barrier}, {threads};" in ptx and f"bar.arrive {barrier}, {threads};" in ptx
        step = re.search(r"bar\.sync [12], \d+;(.*?)bar\.arrive [12], \d+;(.*?)wait_group\.sync\.aligned 0;", ptx, re.DOTALL)
        assert step and "wait_group.sync.aligned 1;" in step.group(1), "the chain is issued, not waited, before the hand-over"
        assert len(re.findall(rf"m64n{n}k32\.f32\.e4m3\.e4m3", step.group(1))) == 4
        assert entry.resources["frame_bytes"] == 0


def test_sync_probe_waits_and_fences_every_step(tmp_path):
    """The sync probe's loop: an mbarrier wait at each step's start, the proxy fence after it only with "fence", and a
    lane-0 arrival after the chain; the step's work as in the plain probe, never spilled."""
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for n, sync in ((32, "wait"), (96, "fence")):
        entry = jit.build_variant(wp.variant(n, 4, sync=sync), "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        loop = re.search(r"mbarrier\.try_wait\.parity\.shared::cta\.b64(.*?)mbarrier\.arrive\.shared::cta\.b64", ptx,
                         re.DOTALL)
        assert loop, "a wait, then the step, then the arrival"
        assert ("fence.proxy.async.shared::cta" in loop.group(1)) == (sync == "fence")
        assert len(re.findall(rf"m64n{n}k32\.f32\.e4m3\.e4m3", loop.group(1))) == 4
        assert len(re.findall(r"\bprmt\.b32\b", loop.group(1))) >= 16
        assert entry.resources["frame_bytes"] == 0
    # early: the chain issued (one group left in flight), the next step's wait, then the chain's wait and the arrival
    entry = jit.build_variant(wp.variant(64, 4, sync="early"), "sm_90a", cache_dir=tmp_path)
    ptx = entry.ptx_path.read_text()
    step = re.search(r"m64n64k32\.f32\.e4m3\.e4m3(.*?)wait_group\.sync\.aligned 1;(.*?)mbarrier\.try_wait\.parity"
                     r"(.*?)wait_group\.sync\.aligned 0;(.*?)mbarrier\.arrive\.shared::cta\.b64", ptx, re.DOTALL)
    assert step and "fence.proxy.async" not in step.group(3)
    assert entry.resources["frame_bytes"] == 0
    # every lane: no warp sync before the arrival, the barriers counting 32
    entry = jit.build_variant(wp.variant(32, 4, sync="wait_all"), "sm_90a", cache_dir=tmp_path)
    ptx = entry.ptx_path.read_text()
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 32;", ptx) and "bar.warp.sync" not in ptx
    assert "mbarrier.try_wait.parity" in ptx and entry.resources["frame_bytes"] == 0
