"""SM90 window repack: round trips, the x64 decode convention, the lane order, the window bound."""

import pytest
import torch
from gc_moe import weights as weight_layouts
from gc_moe.formats import (
    E2M1_VALUES,
    dequantize_fp4_ue8m0,
    pack_fp4,
    pack_ue8m0,
    quantize_fp4_ue8m0,
    unpack_ue8m0,
)
from gc_moe.weights import sm90


def _random_mxfp4(e, rows, cols, gen, exp_lo=118, exp_hi=124):
    packed = torch.randint(-128, 128, (e, rows, cols // 2), dtype=torch.int8, generator=gen)
    exps = torch.randint(exp_lo, exp_hi, (e, rows, cols // 32), dtype=torch.uint8, generator=gen)
    return packed, pack_ue8m0(exps)


def test_decode_bit_trick_is_value_over_64_for_every_code():
    """(n & 8) << 4 | (n & 7) << 2 read as E4M3FN is E2M1 value(n) / 64, for all 16 codes."""
    n = torch.arange(16, dtype=torch.uint8)
    e4m3 = (((n & 8) << 4) | ((n & 7) << 2)).view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3, E2M1_VALUES / 64)
    assert sm90.X64_EXPONENT == 6


def test_w1_row_order_by_hand():
    order = sm90.w1_row_order(64)
    # tile 0, warp 0: rows 0..7 gate channels 0..7, rows 8..15 up channels 64..71
    assert order[:16].tolist() == list(range(8)) + list(range(64, 72))
    # tile 0, warp 1: gate 8..15, up 72..79; tile 1 starts at channel 32
    assert order[16:32].tolist() == list(range(8, 16)) + list(range(72, 80))
    assert order[64:72].tolist() == list(range(32, 40))
    assert sorted(order.tolist()) == list(range(128))


def test_lane_order_by_hand():
    """Thread 37 (warp 1, group 1, quad 1), word 2j+h, byte b: low nibble A[17, 32j+16h+4+b], high A[25, ...]."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (1, 64, 128), dtype=torch.uint8, generator=gen)
    sf = pack_ue8m0(torch.full((1, 64, 4), 127, dtype=torch.uint8))
    mat = sm90.repack_matrix(pack_fp4(codes), sf, gate_up=False)
    tile = mat.codes[0, 0, 0]
    for j in range(4):
        for h in range(2):
            for b in range(4):
                byte = int(tile[37 * 32 + (2 * j + h) * 4 + b])
                k = 32 * j + 16 * h + 4 + b
                assert byte & 0xF == int(codes[0, 17, k])
                assert byte >> 4 == int(codes[0, 25, k])


@pytest.mark.parametrize("gate_up", [False, True])
def test_round_trip_and_dequant_exact_inside_window(gate_up):
    gen = torch.Generator().manual_seed(11)
    packed, sf = _random_mxfp4(3, 256, 512, gen, exp_lo=115, exp_hi=127)  # span 11: inside the window
    mat = sm90.repack_matrix(packed, sf, gate_up=gate_up)
    back = sm90.inverse_matrix(mat)
    assert torch.equal(back[0], packed) and torch.equal(back[1], sf)
    ref = dequantize_fp4_ue8m0(packed, sf)
    if gate_up:
        ref = ref[:, sm90.w1_row_order(128)]
    assert torch.equal(sm90.dequantize_matrix(mat), ref)
    assert int(mat.scales.max()) - sm90.X64_EXPONENT - sm90.UE8M0_BIAS <= sm90.WINDOW_STEPS


def test_window_shift_outside_window_is_bounded():
    """Blocks more than 11 exponent steps below the expert's largest are shifted to the base: error measured."""
    gen = torch.Generator().manual_seed(5)
    packed, _ = _random_mxfp4(2, 64, 256, gen)
    exps = torch.full((2, 64, 8), 124, dtype=torch.uint8)
    exps[0, :5, 2] = 100  # 24 steps below: codes shift by 2^-13 (all to zero)
    exps[0, 7, 3] = 111  # 13 steps below: shift by 2^-2
    exps[1, 9, 1] = 112  # 12 steps below: shift by 2^-1
    sf = pack_ue8m0(exps)
    mat = sm90.repack_matrix(packed, sf, gate_up=False)
    exact = dequantize_fp4_ue8m0(packed, sf)
    got = sm90.dequantize_matrix(mat)
    base_scale = 2.0 ** (124 - sm90.WINDOW_STEPS - 127)
    err = (got - exact).abs()
    # inside the window: exact; a shifted value rounds to the E2M1 grid at the base scale (spacing <= 1 there)
    inside = torch.ones_like(err, dtype=torch.bool)
    inside[0, :5, 64:96] = False
    inside[0, 7, 96:128] = False
    inside[1, 9, 32:64] = False
    assert torch.equal(err[inside], torch.zeros_like(err[inside]))
    assert float(err.max()) <= 0.5 * base_scale
    assert float(err.max()) > 0  # the shift really was lossy here
    # the inverse returns what the kernel computes with: dequant(inverse) == dequantize_matrix exactly
    back = sm90.inverse_matrix(mat)
    assert torch.equal(dequantize_fp4_ue8m0(*back), got)
    assert int(unpack_ue8m0(back[1])[0, 7, 3]) == 124 - sm90.WINDOW_STEPS


def test_shift_lut_by_hand():
    codes = torch.arange(16, dtype=torch.uint8)
    one = sm90.shift_codes_down(codes, torch.ones(16, dtype=torch.int64))
    # 0,.5,1,1.5,2,3,4,6 halved -> 0, .25->0 and .75->.5 (midpoints go to the smaller magnitude), .5, 1, 1.5, 2, 3
    assert E2M1_VALUES[one.long()][:8].tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 3.0]
    assert E2M1_VALUES[one.long()][8:].tolist() == [0.0, 0.0, -0.5, -0.5, -1.0, -1.5, -2.0, -3.0]
    two = sm90.shift_codes_down(torch.arange(8, dtype=torch.uint8), torch.full((8,), 2))
    # quartered: 0, .125, .25, .375, .5, .75, 1, 1.5 -> 0, 0, 0, .5, .5, .5, 1, 1.5
    assert E2M1_VALUES[two.long()].tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("hidden,inter", [(5120, 2304), (6144, 2048)], ids=["deepseek-v4.1-flash", "glm-5.2"])
def test_round_trip_at_model_shapes(hidden, inter):
    gen = torch.Generator().manual_seed(hidden)
    w1 = torch.randn(1, 2 * inter, hidden, generator=gen) * 0.02
    w2 = torch.randn(1, hidden, inter, generator=gen) * 0.02
    l1, l2 = quantize_fp4_ue8m0(w1), quantize_fp4_ue8m0(w2)
    packed = sm90.transform(l1, l2)
    assert packed.l1.codes.shape == (1, 2 * inter // 64, hidden // 128, 4096)
    assert packed.l2.scales.shape == (1, hidden // 64, inter // 128, 64, 4)
    (b1, s1), (b2, s2) = sm90.inverse(packed)
    assert torch.equal(b1, l1[0]) and torch.equal(s1, l1[1])
    assert torch.equal(b2, l2[0]) and torch.equal(s2, l2[1])


def test_dispatcher_round_trip():
    gen = torch.Generator().manual_seed(2)
    l1, l2 = _random_mxfp4(2, 128, 256, gen), _random_mxfp4(2, 256, 64 * 2, gen)
    w1, w2 = weight_layouts.transform(l1, l2, "sm90")
    assert weight_layouts.layout_of(w1) == "sm90"
    c1, c2 = weight_layouts.to_canonical(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(c1 + c2, l1 + l2))


def test_bad_shapes_are_named():
    gen = torch.Generator().manual_seed(1)
    packed, sf = _random_mxfp4(1, 64, 256, gen)
    with pytest.raises(ValueError, match="multiple of 64"):
        sm90.repack_matrix(packed[:, :32], sf[:, :32], gate_up=False)
    with pytest.raises(ValueError, match="scales must be int32"):
        sm90.repack_matrix(packed, sf[:, :, :1], gate_up=False)
    with pytest.raises(ValueError, match="codes must be int8"):
        sm90.repack_matrix(packed.view(torch.uint8), sf, gate_up=False)
    with pytest.raises(ValueError, match="multiple of 128"):
        sm90.repack_matrix(packed[..., :32], sf[..., :1], gate_up=False)
