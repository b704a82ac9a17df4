"""Format round trips against bytes and words worked out by hand (docs/formats.md walks through the same examples)."""

import math

import pytest
import torch
from gc_moe import formats as f

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def u8(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8).tolist() if t.dtype != torch.uint8 else t.reshape(-1).tolist()


# ----------------------------------------------------------------------------------------------- UE8M0
@pytest.mark.parametrize(
    "amax, fmt_max, byte",
    [
        (448.0, 448.0, 127),  # exactly 1.0
        (449.0, 448.0, 128),  # just above 1.0 rounds up to 2
        (896.0, 448.0, 128),  # exactly 2.0
        (1.0, 448.0, 119),  # 1/448 = 2^-8.81 -> 2^-8
        (0.0, 448.0, 105),  # floored at 1e-4: 1e-4/448 = 2^-22.1 -> 2^-22
        (6.0, 6.0, 127),
        (0.0, 6.0, 112),  # 1e-4/6 = 2^-15.9 -> 2^-15
        (3e38, 448.0, 247),  # 6.7e35 = 2^119.0x -> 2^120
    ],
)
def test_ue8m0_from_amax_hand_values(amax, fmt_max, byte):
    assert f.ue8m0_from_amax(torch.tensor([amax]), fmt_max).tolist() == [byte]


def test_ue8m0_decode_is_exact_at_the_ends():
    got = f.ue8m0_to_float(torch.tensor([0, 1, 127, 128, 254], dtype=torch.uint8))
    assert got.tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]


def test_pack_ue8m0_is_little_endian():
    words = f.pack_ue8m0(torch.tensor([[1, 2, 3, 4, 0x7F, 0x80, 0x77, 0x69]], dtype=torch.uint8))
    assert words.tolist() == [[0x04030201, 0x6977807F]]
    assert f.unpack_ue8m0(words).tolist() == [[1, 2, 3, 4, 0x7F, 0x80, 0x77, 0x69]]


def test_unpack_ue8m0_reads_mn_major_strides():
    words = torch.tensor([[0x04030201, 0x08070605], [0x0C0B0A09, 0x100F0E0D]], dtype=torch.int32)
    mn_major = torch.empty_strided((2, 2), (1, 2), dtype=torch.int32)
    mn_major.copy_(words)
    assert f.unpack_ue8m0(mn_major).tolist() == [list(range(1, 9)), list(range(9, 17))]


# ----------------------------------------------------------------------------------------------- FP8 + UE8M0/32
def fp8_example_row() -> torch.Tensor:
    """Four K32 blocks with amax 448, 896, 1 and 0 -> scale bytes 0x7F, 0x80, 0x77, 0x69."""
    x = torch.zeros(1, 128)
    x[0, 0:3] = torch.tensor([448.0, -1.0, 0.5])
    x[0, 32:34] = torch.tensor([896.0, 3.0])
    x[0, 64:66] = torch.tensor([1.0, -0.1])
    return x


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ue8m0_hand_example(device):
    q, sf = f.quantize_fp8_ue8m0(fp8_example_row().to(device))
    assert q.shape == (1, 128) and q.dtype == torch.float8_e4m3fn
    assert sf.shape == (1, 1) and sf.dtype == torch.int32
    assert sf.cpu().tolist() == [[0x6977807F]]
    want = [0] * 128
    # 448 -> 0x7E (max normal), -1 -> 0xB8, 0.5 -> 0x30; 896/2 = 448 -> 0x7E, 3/2 = 1.5 -> 0x3C;
    # 1*256 = 256 -> 0x78, -0.1*256 = -25.6 -> -26 = -1.625*2^4 -> 0xDD
    want[0:3], want[32:34], want[64:66] = [0x7E, 0xB8, 0x30], [0x7E, 0x3C], [0x78, 0xDD]
    assert u8(q.cpu()) == want
    back = f.dequantize_fp8_ue8m0(q, sf).cpu()
    expect = torch.zeros(1, 128)
    expect[0, 0:3] = torch.tensor([448.0, -1.0, 0.5])
    expect[0, 32:34] = torch.tensor([896.0, 3.0])
    expect[0, 64:66] = torch.tensor([1.0, -26.0 / 256])
    assert torch.equal(back, expect)


def test_fp8_ue8m0_random_round_trip_matches_independent_scales():
    torch.manual_seed(1)
    x = torch.randn(6, 3, 256) * torch.logspace(-3, 3, 6).view(6, 1, 1)
    q, sf = f.quantize_fp8_ue8m0(x)
    assert q.shape == x.shape and sf.shape == (6, 3, 2)
    blocks = x.view(6, 3, 8, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exponents = torch.tensor([math.ceil(math.log2(a)) for a in (amax / 448.0).reshape(-1).tolist()])
    scale = torch.pow(2.0, exponents.double()).float().view(6, 3, 8, 1)
    expect = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(f.dequantize_fp8_ue8m0(q, sf), expect.view_as(x))
    assert f.unpack_ue8m0(sf).view(-1).tolist() == (exponents + 127).tolist()
    # round to nearest in E4M3 (3 mantissa bits) loses at most 2^-4 of each value, plus subnormal spacing
    assert bool(
        (
            (f.dequantize_fp8_ue8m0(q, sf) - x).abs()
            <= x.abs() / 16 + scale.view(6, 3, 8).repeat_interleave(32, -1) * 2.0**-10
        ).all()
    )


# ----------------------------------------------------------------------------------------------- FP4 + UE8M0/32
def fp4_example_row() -> torch.Tensor:
    w = torch.zeros(1, 128)
    w[0, 0:8] = torch.tensor([0.75, 1.25, -0.25, 5.0, 2.9, -6.0, 0.2, -1.75])  # amax 6 -> scale 1 (0x7F)
    w[0, 32:34] = torch.tensor([12.0, -3.0])  # amax 12 -> scale 2 (0x80)
    w[0, 64:66] = torch.tensor([0.3, -0.1])  # 0.3/6 = 0.05 -> scale 2^-4 (0x7B)
    return w  # block 3 all zero: 1e-4/6 -> 2^-15 (0x70)


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_ue8m0_hand_example(device):
    packed, sf = f.quantize_fp4_ue8m0(fp4_example_row().to(device))
    assert packed.shape == (1, 64) and packed.dtype == torch.int8
    assert sf.cpu().tolist() == [[0x707B807F]]
    want = [0] * 64
    # codes: 0.75 -> 1 (tie to the smaller magnitude 0.5), 1.25 -> 2 (tie -> 1.0), -0.25 -> 0 (no -0 code),
    # 5.0 -> 6 (tie -> 4), 2.9 -> 5 (3.0), -6 -> 0xF, 0.2 -> 0, -1.75 -> 0xB (tie -> -1.5); low nibble first
    want[0:4] = [0x21, 0x60, 0xF5, 0xB0]
    want[16] = 0xB7  # 12/2 = 6 -> 7, -3/2 = -1.5 -> 0xB
    want[32] = 0xB6  # 0.3*16 = 4.8 -> 6 (4.0), -0.1*16 = -1.6 -> 0xB (-1.5)
    assert u8(packed.cpu()) == want
    assert packed.cpu().view(-1)[:4].tolist() == [33, 96, -11, -80]
    back = f.dequantize_fp4_ue8m0(packed, sf).cpu()
    expect = torch.zeros(1, 128)
    expect[0, 0:8] = torch.tensor([0.5, 1.0, 0.0, 4.0, 3.0, -6.0, 0.0, -1.5])
    expect[0, 32:34] = torch.tensor([12.0, -3.0])
    expect[0, 64:66] = torch.tensor([0.25, -0.09375])
    assert torch.equal(back, expect)


def test_fp4_codes_cover_every_midpoint_and_saturate():
    v = torch.tensor([0.25, 0.26, 0.75, 0.76, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 9.0, -9.0, -0.1, -0.0])
    assert f.fp4_codes_from_float(v).tolist() == [0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 7, 7, 15, 0, 0]
    assert f.fp4_codes_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]


def test_pack_unpack_fp4_nibble_order():
    codes = torch.tensor([[1, 2, 0xF, 0, 7, 8]], dtype=torch.uint8)
    packed = f.pack_fp4(codes)
    assert u8(packed) == [0x21, 0x0F, 0x87]
    assert torch.equal(f.unpack_fp4(packed), codes)


def _nearest_e2m1_independent(v: torch.Tensor) -> torch.Tensor:
    """Brute force over the magnitude grid, ties to the smaller magnitude, sign kept only for nonzero."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    dist = (v.abs().unsqueeze(-1) - grid).abs()
    mag = grid[dist.argmin(-1)]  # argmin returns the first (smaller) grid point on a tie
    return torch.where(v < 0, -mag, mag)


def test_fp4_random_round_trip_matches_independent_quantizer():
    torch.manual_seed(2)
    w = torch.randn(3, 5, 256) * torch.logspace(-4, 2, 5).view(1, 5, 1)
    w[0, 0, :32] = 0.0
    packed, sf = f.quantize_fp4_ue8m0(w)
    assert packed.shape == (3, 5, 128) and sf.shape == (3, 5, 2)
    blocks = w.view(3, 5, 8, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exponents = torch.tensor([math.ceil(math.log2(a)) for a in (amax / 6.0).reshape(-1).tolist()])
    scale = torch.pow(2.0, exponents.double()).float().view(3, 5, 8, 1)
    expect = _nearest_e2m1_independent(blocks / scale) * scale
    assert torch.equal(f.dequantize_fp4_ue8m0(packed, sf), expect.view_as(w))
    assert f.unpack_ue8m0(sf).view(-1).tolist() == (exponents + 127).tolist()


# ----------------------------------------------------------------------------------------------- FP8 + FP32/128
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_k128_hand_example(device):
    x = torch.zeros(3, 256)
    x[0, 0:2] = torch.tensor([448.0, -1.0])  # scale 1.0
    x[0, 128:130] = torch.tensor([896.0, 3.0])  # scale 2.0 -> 448 (0x7E), 1.5 (0x3C)
    x[1, 0:2] = torch.tensor([0.7, -0.35])  # scale 0.7/448, 0.7 -> 448, -0.35 -> -224 (0xF6)
    q, sf = f.quantize_fp8_k128(x.to(device))
    assert sf.dtype == torch.float32 and sf.shape == (3, 2) and sf.is_contiguous()
    inv448 = torch.tensor(1.0) / torch.tensor(
        448.0
    )  # a scale is amax times the float32 reciprocal, as on a GPU
    floor = torch.tensor(1e-4) * inv448
    expect_sf = torch.stack(
        [
            torch.tensor([1.0, 2.0]),
            torch.stack([torch.tensor(0.7) * inv448, floor]),
            torch.stack([floor, floor]),
        ]
    )
    assert torch.equal(sf.cpu(), expect_sf)
    assert u8(q.cpu()[0, [0, 1, 128, 129]]) == [0x7E, 0xB8, 0x7E, 0x3C]
    assert u8(q.cpu()[1, [0, 1]]) == [0x7E, 0xF6]
    back = f.dequantize_fp8_k128(q, sf).cpu()
    assert torch.equal(back[0], x[0])
    assert torch.equal(back[1, :2], torch.stack([448.0 * expect_sf[1, 0], -224.0 * expect_sf[1, 0]]))
    assert not bool(back[1, 2:].any()) and not bool(back[2].any())


def test_scales_use_the_float32_reciprocal_like_deepgemm_on_a_gpu():
    """0.1/448 and 0.1*fl32(1/448) differ in the last bit; DeepGEMM's GPU quantizer produces the latter."""
    x = torch.zeros(1, 128)
    x[0, 0] = 0.1
    _, sf = f.quantize_fp8_k128(x)
    assert sf[0, 0].view(torch.int32) == (torch.tensor(0.1) * (torch.tensor(1.0) / 448.0)).view(torch.int32)
    assert sf[0, 0].view(torch.int32) == (torch.tensor(0.1) / 448.0).view(torch.int32) + 1


def test_fp8_k128_power_of_two_scales():
    x = torch.zeros(1, 128)
    # 0.7/448 = 2^-9.3 -> 2^-9: 0.7*512 = 358.4 -> 352, 0.1*512 = 51.2 -> 52
    x[0, :2] = torch.tensor([0.7, 0.1])
    q, sf = f.quantize_fp8_k128(x, power_of_two_scales=True)
    assert sf.tolist() == [[2.0**-9]]
    assert f.dequantize_fp8_k128(q, sf)[0, :2].tolist() == [352 / 512, 52 / 512]


# ----------------------------------------------------------------------------------------------- FP8 128x128 blocks
def test_fp8_block128_hand_example_and_packed_rows():
    w = torch.zeros(200, 256)
    w[5, 7] = 448.0  # block (0,0): scale 1 (0x7F)
    w[100, 130] = -1.0  # block (0,1): scale 2^-8 (0x77)
    w[150, 3] = 2.0  # block (1,0), rows 128..199 padded with zeros: 2/448 -> 2^-7 (0x78)
    q, sf = f.quantize_fp8_block128(w)  # block (1,1) all zero: 2^-22 (0x69)
    assert q.shape == (200, 256) and sf.shape == (2, 2)
    assert sf.tolist() == [[1.0, 2.0**-8], [2.0**-7, 2.0**-22]]
    assert u8(q[[5, 100, 150], [7, 130, 3]]) == [0x7E, 0xF8, 0x78]  # 448, -256, 256
    assert torch.equal(f.dequantize_fp8_block128(q, sf), w)
    words = f.expand_block_scales_to_rows(sf, 200)
    assert words.shape == (200, 1)
    assert words[:128].view(-1).tolist() == [0x0000777F] * 128  # bytes [0x7F, 0x77, pad 0, pad 0]
    assert words[128:].view(-1).tolist() == [0x00006978] * 72


# ----------------------------------------------------------------------------------------------- MoE and shared weights
def test_quantize_moe_weights_shapes_and_per_expert_bytes():
    torch.manual_seed(3)
    e, i, h = 3, 128, 256
    w1, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    (l1, l1_sf), (l2, l2_sf) = f.quantize_moe_weights(w1, w2)
    assert (l1.shape, l1_sf.shape, l2.shape, l2_sf.shape) == (
        (e, 2 * i, h // 2),
        (e, 2 * i, h // 128),
        (e, h, i // 2),
        (e, h, i // 128),
    )
    assert (l1.dtype, l1_sf.dtype, l2.dtype, l2_sf.dtype) == (
        torch.int8,
        torch.int32,
        torch.int8,
        torch.int32,
    )
    for expert in range(e):  # stacking is per expert: each slice equals quantizing that expert alone
        for got, want in zip((l1[expert], l1_sf[expert]), f.quantize_fp4_ue8m0(w1[expert]), strict=True):
            assert torch.equal(got, want)
        for got, want in zip((l2[expert], l2_sf[expert]), f.quantize_fp4_ue8m0(w2[expert]), strict=True):
            assert torch.equal(got, want)
    d1, d2 = f.dequantize_moe_weights((l1, l1_sf), (l2, l2_sf))
    assert torch.equal(d1, f.dequantize_fp4_ue8m0(l1, l1_sf))
    assert torch.equal(d2, f.dequantize_fp4_ue8m0(l2, l2_sf))
    # MXFP4 keeps every value within half a grid step (at most 1 unit of scale) and the scale is <= amax/3
    assert float((d1 - w1).abs().max()) <= float(w1.abs().max()) / 3
    assert float((d2 - w2).abs().max()) <= float(w2.abs().max()) / 3


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)])
def test_shared_expert_weights(recipe):
    torch.manual_seed(4)
    w1, w2 = torch.randn(512, 256), torch.randn(256, 256)
    shared = f.quantize_shared_expert_weights(w1, w2, recipe)
    assert shared.recipe == recipe and shared.hidden == 256 and shared.intermediate == 256
    d1, d2 = shared.dequantize()
    if recipe == (1, 1, 32):
        assert shared.w1_sf.shape == (512, 2) and shared.w1_sf.dtype == torch.int32
        assert torch.equal(d1, f.dequantize_fp8_ue8m0(*f.quantize_fp8_ue8m0(w1)))
        assert shared.packed_row_scales()[1] is shared.w2_sf
    else:
        assert shared.w1_sf.shape == (4, 2) and shared.w1_sf.dtype == torch.float32
        assert torch.equal(d2, f.dequantize_fp8_block128(*f.quantize_fp8_block128(w2)))
        p1, p2 = shared.packed_row_scales()
        assert p1.shape == (512, 1) and p2.shape == (256, 1)
        row_bytes = f.unpack_ue8m0(p1)[:, :2].float()
        assert torch.equal(torch.pow(2.0, row_bytes - 127), shared.w1_sf.repeat_interleave(128, 0))
    assert float(((d1 - w1).abs() / w1.abs().amax()).max()) < 2**-4


# ----------------------------------------------------------------------------------------------- devices
@pytest.mark.gpu
def test_cuda_bytes_equal_cpu_bytes():
    torch.manual_seed(5)
    x = torch.randn(16, 512) * 3
    for quantize in (f.quantize_fp8_ue8m0, f.quantize_fp4_ue8m0, f.quantize_fp8_k128):
        cpu_q, cpu_sf = quantize(x)
        gpu_q, gpu_sf = quantize(x.cuda())
        assert torch.equal(cpu_q.view(torch.uint8), gpu_q.cpu().view(torch.uint8))
        assert torch.equal(cpu_sf, gpu_sf.cpu())
    packed, sf = f.quantize_fp4_ue8m0(x)
    assert torch.equal(
        f.dequantize_fp4_ue8m0(packed.cuda(), sf.cuda()).cpu(), f.dequantize_fp4_ue8m0(packed, sf)
    )


# ----------------------------------------------------------------------------------------------- errors
def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiple of 128"):
        f.quantize_fp8_ue8m0(torch.randn(2, 96))
    with pytest.raises(ValueError, match="inf or NaN"):
        f.quantize_fp4_ue8m0(torch.full((1, 128), float("nan")))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        f.quantize_fp8_ue8m0(torch.ones(1, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        f.dequantize_fp8_ue8m0(
            torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.int32)
        )
    with pytest.raises(TypeError, match="int32"):
        f.dequantize_fp4_ue8m0(torch.zeros(1, 64, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="4-bit"):
        f.pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="recipe"):
        f.quantize_shared_expert_weights(torch.randn(256, 128), torch.randn(128, 128), (1, 1, 128))
    with pytest.raises(ValueError, match="w2"):
        f.quantize_moe_weights(torch.randn(2, 256, 128), torch.randn(2, 128, 256))
    with pytest.raises(ValueError, match="power of two"):
        f.expand_block_scales_to_rows(torch.tensor([[0.3]]), 128)
