"""The measuring probe of the grouped GEMM's consumer work (kernels/sm90/wgmma_probe.py): its configurations and
what its binaries must hold (the decode's byte permutes, the chains it times, no serialized WGMMA, no spill)."""

import re

import pytest
from gc_moe.kernels.sm90 import wgmma_probe as wp


def test_probe_configurations_and_errors():
    for n, wgs in ((12, 4), (128, 1), (64, 0), (64, 5)):
        with pytest.raises(ValueError, match="wgmma probe"):
            wp.variant(n, wgs)
    variants = wp.probe_variants()
    # per warpgroup count: the decode alone, and at each N the chain with and without it
    assert len(variants) == len({v.describe() for v in variants}) == 2 * (1 + 2 * len(wp.N_CHOICES)) + 2
    b, a, total = wp.smem_layout(96, 4)
    assert (b, a) == (0, 96 * 128) and total == a + 4 * 2 * (wp.A_TILE_BYTES + wp.SCALE_TILE_BYTES) <= 227 * 1024


def test_probe_binaries_hold_what_they_time(tmp_path):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for v in (wp.variant(64, 4), wp.variant(96, 1), wp.variant(8, 4, decode=False), wp.variant(64, 1, chain=False),
              wp.variant(96, 4, skew=True)):
        params = dict(v.params)
        entry = jit.build_variant(v, "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        n = params["n"]
        chains = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3", ptx))
        # four K32 WGMMAs per step (the compiler may unroll the chain-only loop: whole chains still)
        assert (chains > 0 and chains % 4 == 0) if params["chain"] else chains == 0, v.describe()
        # the table decode's 16 byte permutes: the fragment before the loop, and each step's with decode
        assert len(re.findall(r"\bprmt\.b32\b", ptx)) >= 16 * (1 + params["decode"]), v.describe()
        assert entry.resources["frame_bytes"] == 0, v.describe()
        assert entry.launch.block == (128 * params["warpgroups"], 1, 1)
