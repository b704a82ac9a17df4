"""Quantized formats shared by GC-MoE and the Mega MoE baseline (byte-compatible with DeepGEMM).

| tensor            | dtype / shape                              | meaning                                            |
| ----------------- | ------------------------------------------ | -------------------------------------------------- |
| x                 | float8_e4m3fn [T, H]                       | FP8 E4M3 activations                               |
| x_sf              | int32 [T, H/128]                           | UE8M0 per-32 scales, 4 bytes packed little-endian  |
| x (SM90 internal) | float8_e4m3fn [T, H] + float32 [T, H/128]  | E4M3FN with contiguous FP32 per-128 scales         |
| L1 weights        | int8 [E, 2I, H/2] + int32 [E, 2I, H/128]   | FP4 E2M1, 2 per byte (low nibble first), UE8M0/32  |
| L2 weights        | int8 [E, H, I/2] + int32 [E, H, I/128]     | same, down projection                              |
| shared weights    | float8_e4m3fn + UE8M0/32 or fp32 128x128   | recipe (1,1,32) or (1,128,128)                     |

A UE8M0 byte e means 2^(e - 127). Byte g of an int32 scale word covers values [32*(4*w+g), 32*(4*w+g)+32).
All functions are vectorized torch and run on CPU and CUDA tensors.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
SF_BLOCK = 32  # values per UE8M0 scale along K
SF_PER_WORD = 4  # UE8M0 bytes packed into one int32
K128 = SF_BLOCK * SF_PER_WORD

# E2M1 code -> value; bit 3 is the sign, bits 2..0 index the magnitude.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32)
# Midpoints between consecutive magnitudes: round to nearest, ties to the even code (DeepGEMM's rounding).
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)


def _check_last_dim(t: torch.Tensor, multiple: int, what: str) -> None:
    if t.shape[-1] % multiple != 0:
        raise ValueError(f"{what}: last dimension {t.shape[-1]} must be a multiple of {multiple}")


# ----------------------------------------------------------------------------------------------- UE8M0
def ue8m0_from_amax(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Smallest power-of-two scale s with amax / s <= fmt_max, as UE8M0 bytes (uint8). amax == 0 maps to 2^-127."""
    amax = amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    exp = torch.ceil(torch.log2(amax / fmt_max)).clamp(-127, 127)
    return (exp + 127).to(torch.uint8)


def ue8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8) -> float32 2^(e-127), exact (2^-127 is a float32 denormal)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)


def pack_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G] (G a multiple of 4) -> int32 [..., G/4], byte g of a word = e[4w+g] (little-endian)."""
    if e.dtype != torch.uint8:
        raise TypeError(f"pack_ue8m0 wants uint8 exponent bytes, got {e.dtype}")
    _check_last_dim(e, SF_PER_WORD, "pack_ue8m0")
    return e.contiguous().view(torch.int32)


def unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 4W], the inverse of pack_ue8m0."""
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_ue8m0 wants int32 words, got {words.dtype}")
    return words.contiguous().view(torch.uint8)


def expand_scales(scales: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Repeat per-block scales [..., k/block] along the last dim to [..., k]."""
    return scales.repeat_interleave(block, dim=-1)[..., :k]


# ----------------------------------------------------------------------------------------------- FP4 E2M1
def fp4_codes_from_float(v: torch.Tensor) -> torch.Tensor:
    """float values already divided by their scale -> E2M1 codes (uint8 0..15), round to nearest even."""
    mag = v.abs().clamp_max(FP4_E2M1_MAX)
    idx = torch.bucketize(mag, _E2M1_MIDPOINTS.to(v.device), right=False)
    # ties go to the even code: bucketize(right=False) sends a value equal to a midpoint to the lower code
    tie = torch.isin(mag, _E2M1_MIDPOINTS.to(v.device))
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    sign = (v < 0) & (idx > 0)
    return (idx + 8 * sign.to(idx.dtype)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> int8 [..., K/2], element 2i in the low nibble, 2i+1 in the high nibble."""
    _check_last_dim(codes, 2, "pack_fp4")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., K/2] -> uint8 codes [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.long()]


def quantize_fp4_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (int8 [..., N, K/2], int32 [..., N, K/128]): MXFP4 with UE8M0 per-32 scales."""
    _check_last_dim(w, K128, "quantize_fp4_ue8m0 (K)")
    blocks = w.float().unflatten(-1, (-1, SF_BLOCK))
    e = ue8m0_from_amax(blocks.abs().amax(-1), FP4_E2M1_MAX)
    codes = fp4_codes_from_float(blocks / ue8m0_to_float(e).unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), pack_ue8m0(e)


def dequantize_fp4_ue8m0(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(int8 [..., N, K/2], int32 [..., N, K/128]) -> float32 [..., N, K], exact."""
    vals = fp4_codes_to_float(unpack_fp4(packed))
    scale = ue8m0_to_float(unpack_ue8m0(sf))
    return vals * expand_scales(scale, SF_BLOCK, vals.shape[-1])


# ----------------------------------------------------------------------------------------------- FP8 E4M3
def quantize_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (float8_e4m3fn [..., K], int32 [..., K/128]): UE8M0 scale per 32 values along K."""
    _check_last_dim(x, K128, "quantize_fp8_ue8m0 (K)")
    blocks = x.float().unflatten(-1, (-1, SF_BLOCK))
    e = ue8m0_from_amax(blocks.abs().amax(-1), FP8_E4M3_MAX)
    q = (blocks / ue8m0_to_float(e).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.flatten(-2).to(torch.float8_e4m3fn), pack_ue8m0(e)


def dequantize_fp8_ue8m0(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    scale = ue8m0_to_float(unpack_ue8m0(sf))
    return x.float() * expand_scales(scale, SF_BLOCK, x.shape[-1])
