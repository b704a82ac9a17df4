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
Scales follow DeepGEMM's quantizers as they run on a GPU: the block amax is floored at 1e-4, multiplied by
the float32 reciprocal of the format maximum and rounded up to a power of two (exponent byte clamped to [1, 254]). FP4 rounds to the nearest
E2M1 value with ties going to the smaller magnitude. docs/formats.md has the full tables and worked bytes.
All functions are vectorized torch and run on CPU and CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
SF_BLOCK = 32  # values per UE8M0 scale along K
SF_PER_WORD = 4  # UE8M0 bytes packed into one int32
K128 = SF_BLOCK * SF_PER_WORD
BLOCK128 = 128  # rows and columns of one (1, 128, 128) shared-weight scale block
# DeepGEMM floors every block amax here before deriving its scale, so all-zero blocks get a finite scale.
AMAX_FLOOR = 1e-4
RECIPE_K32 = (1, 1, 32)
RECIPE_BLOCK128 = (1, 128, 128)
SHARED_RECIPES = (RECIPE_K32, RECIPE_BLOCK128)

# E2M1 code -> value; bit 3 is the sign, bits 2..0 index the magnitude.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32)
# Midpoints between consecutive magnitudes. A magnitude's code is the number of midpoints strictly below it,
# so an exact midpoint rounds to the smaller magnitude (DeepGEMM's rounding, not IEEE ties-to-even).
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
# packed byte -> (value of the low nibble, value of the high nibble): one gather decodes two weights.
_E2M1_BYTE_PAIRS = torch.stack(
    (E2M1_VALUES[torch.arange(256) & 0xF], E2M1_VALUES[torch.arange(256) >> 4]), -1
)


# ----------------------------------------------------------------------------------------------- checks
def _check_last_dim(t: torch.Tensor, multiple: int, what: str) -> None:
    if t.dim() == 0 or t.shape[-1] % multiple != 0:
        last = t.shape[-1] if t.dim() else "none (a scalar)"
        raise ValueError(f"{what}: last dimension {last} must be a multiple of {multiple}")


def _check_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, got {t.dtype}")


def _check_float_input(x: torch.Tensor, what: str) -> None:
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{what} quantizes float32/bfloat16/float16 tensors, got {x.dtype}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: input has inf or NaN entries; only finite values can be quantized")


def _check_scale_shape(values: torch.Tensor, k: int, sf: torch.Tensor, per_scale: int, what: str) -> None:
    want = (*values.shape[:-1], k // per_scale)
    if tuple(sf.shape) != want:
        raise ValueError(
            f"{what}: scales have shape {tuple(sf.shape)}, expected {want} "
            f"(one per {per_scale} values of the {k} along the last dimension)"
        )


# ----------------------------------------------------------------------------------------------- UE8M0
def _amax_to_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """max(amax, 1e-4) / fmt_max the way DeepGEMM's quantizers get it on a GPU.

    They divide a CUDA tensor by a Python number, which PyTorch's CUDA kernel evaluates as a multiplication
    by the float32 reciprocal (a true division differs in the last bit for about half of all inputs).
    Doing the same on every device gives DeepGEMM's GPU bytes on CPU too.
    """
    reciprocal = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(fmt_max, dtype=torch.float32))
    return amax.float().clamp_min(AMAX_FLOOR) * reciprocal


def ue8m0_from_amax(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Block amax -> UE8M0 bytes (uint8): the power of two at or above max(amax, 1e-4) / fmt_max.

    The ceiling is taken on the float32 bits of the quotient (exponent, plus one if any mantissa bit is set),
    exactly as DeepGEMM's `ceil_to_ue8m0`; the byte is clamped to [1, 254] (2^-126 .. 2^127).
    """
    sf = _amax_to_scale(amax, fmt_max)
    bits = sf.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.clamp(1, 254).to(torch.uint8)


def ue8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8) -> float32 2^(e-127), exact (byte 0 is the denormal 2^-127)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)


def pack_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G] (G a multiple of 4) -> int32 [..., G/4], byte g of a word = e[4w+g] (little-endian)."""
    _check_dtype(e, torch.uint8, "pack_ue8m0 input (UE8M0 exponent bytes)")
    _check_last_dim(e, SF_PER_WORD, "pack_ue8m0")
    return e.contiguous().view(torch.int32)


def unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 4W], the inverse of pack_ue8m0 (any strides, e.g. DeepGEMM's MN-major)."""
    _check_dtype(words, torch.int32, "unpack_ue8m0 input (packed UE8M0 words)")
    return words.contiguous().view(torch.uint8)


def expand_scales(scales: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Repeat per-block scales [..., k/block] along the last dim to [..., k]."""
    return scales.repeat_interleave(block, dim=-1)[..., :k]


def _apply_block_scales(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """values [..., K] * scales [..., K/block] broadcast per block, without materializing expanded scales."""
    return (values.unflatten(-1, (-1, block)) * scales.unsqueeze(-1)).flatten(-2)


# ----------------------------------------------------------------------------------------------- FP4 E2M1
def fp4_codes_from_float(v: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale -> E2M1 codes (uint8 0..15).

    Nearest magnitude, exact midpoints to the smaller one, |v| > 6 saturates to 6; values that round to
    zero get code 0 whatever their sign (no negative-zero code), as DeepGEMM's `_quantize_to_fp4_e2m1`.
    """
    idx = torch.bucketize(v.abs(), _E2M1_MIDPOINTS.to(v.device), right=False)
    negative = (v < 0) & (idx > 0)
    return (idx + 8 * negative.to(idx.dtype)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> int8 [..., K/2], element 2i in the low nibble, 2i+1 in the high nibble."""
    _check_last_dim(codes, 2, "pack_fp4")
    c = codes.to(torch.uint8)
    if c.numel() and int(c.max()) > 15:
        raise ValueError(f"pack_fp4: codes must be 4-bit (0..15), got a maximum of {int(c.max())}")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., K/2] -> uint8 codes [..., K]."""
    _check_dtype(packed, torch.int8, "unpack_fp4 input (packed FP4 bytes)")
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.long()]


def quantize_fp4_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (int8 [..., N, K/2], int32 [..., N, K/128]): MXFP4 with UE8M0 per-32 scales."""
    _check_float_input(w, "quantize_fp4_ue8m0")
    _check_last_dim(w, K128, "quantize_fp4_ue8m0 (K)")
    blocks = w.float().unflatten(-1, (-1, SF_BLOCK))
    e = ue8m0_from_amax(blocks.abs().amax(-1), FP4_E2M1_MAX)
    codes = fp4_codes_from_float(blocks * (1.0 / ue8m0_to_float(e)).unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), pack_ue8m0(e)


def dequantize_fp4_ue8m0(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(int8 [..., N, K/2], int32 [..., N, K/128]) -> float32 [..., N, K], exact."""
    _check_dtype(packed, torch.int8, "dequantize_fp4_ue8m0 weights (packed FP4)")
    _check_dtype(sf, torch.int32, "dequantize_fp4_ue8m0 scales (packed UE8M0)")
    k = packed.shape[-1] * 2
    _check_scale_shape(packed, k, sf, K128, "dequantize_fp4_ue8m0")
    pairs = _E2M1_BYTE_PAIRS.to(packed.device)[packed.view(torch.uint8).long()]  # [..., K/2, 2]
    return _apply_block_scales(pairs.flatten(-2), ue8m0_to_float(unpack_ue8m0(sf)), SF_BLOCK)


# ----------------------------------------------------------------------------------------------- FP8 E4M3, UE8M0 per 32
def quantize_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (float8_e4m3fn [..., K], int32 [..., K/128]): UE8M0 scale per 32 values along K."""
    _check_float_input(x, "quantize_fp8_ue8m0")
    _check_last_dim(x, K128, "quantize_fp8_ue8m0 (K)")
    blocks = x.float().unflatten(-1, (-1, SF_BLOCK))
    e = ue8m0_from_amax(blocks.abs().amax(-1), FP8_E4M3_MAX)
    q = blocks * (1.0 / ue8m0_to_float(e)).unsqueeze(-1)  # |q| <= 448 by construction of the scale
    return q.flatten(-2).to(torch.float8_e4m3fn), pack_ue8m0(e)


def dequantize_fp8_ue8m0(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(float8_e4m3fn [..., K], int32 [..., K/128]) -> float32 [..., K], exact."""
    _check_dtype(x, torch.float8_e4m3fn, "dequantize_fp8_ue8m0 values")
    _check_dtype(sf, torch.int32, "dequantize_fp8_ue8m0 scales (packed UE8M0)")
    _check_scale_shape(x, x.shape[-1], sf, K128, "dequantize_fp8_ue8m0")
    return _apply_block_scales(x.float(), ue8m0_to_float(unpack_ue8m0(sf)), SF_BLOCK)


# ----------------------------------------------------------------------------------------------- FP8 E4M3FN, FP32 per 128
def quantize_fp8_k128(
    x: torch.Tensor, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (float8_e4m3fn [..., K], float32 [..., K/128]): the SM90 path's activation format.

    The scale of each 128-value block is max(amax, 1e-4) * fl32(1/448) (DeepGEMM's `per_token_cast_to_fp8`
    with gran_k=128, as evaluated on a GPU); with power_of_two_scales it is rounded up to a power of two
    (its use_ue8m0=True).
    The scale tensor is contiguous with K fastest (row-major), not DeepGEMM's MN-major TMA layout.
    """
    _check_float_input(x, "quantize_fp8_k128")
    _check_last_dim(x, K128, "quantize_fp8_k128 (K)")
    blocks = x.float().unflatten(-1, (-1, K128))
    amax = blocks.abs().amax(-1)
    if power_of_two_scales:
        sf = ue8m0_to_float(ue8m0_from_amax(amax, FP8_E4M3_MAX))
    else:
        sf = _amax_to_scale(amax, FP8_E4M3_MAX)
    q = blocks * (1.0 / sf).unsqueeze(-1)
    return q.flatten(-2).to(torch.float8_e4m3fn), sf.contiguous()


def dequantize_fp8_k128(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(float8_e4m3fn [..., K], float32 [..., K/128]) -> float32 [..., K]."""
    _check_dtype(x, torch.float8_e4m3fn, "dequantize_fp8_k128 values")
    _check_dtype(sf, torch.float32, "dequantize_fp8_k128 scales")
    _check_scale_shape(x, x.shape[-1], sf, K128, "dequantize_fp8_k128")
    return _apply_block_scales(x.float(), sf, K128)


# ----------------------------------------------------------------------------------------------- FP8, 128x128 blocks
def quantize_fp8_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (float8_e4m3fn [N, K], float32 [ceil(N/128), K/128]) with power-of-two block scales.

    One scale per 128x128 block (rows padded with zeros up to a multiple of 128), as DeepGEMM's
    `per_block_cast_to_fp8(w, use_ue8m0=True)`; every scale is UE8M0-representable.
    """
    _check_float_input(w, "quantize_fp8_block128")
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block128 wants a 2-D weight [N, K], got shape {tuple(w.shape)}")
    _check_last_dim(w, BLOCK128, "quantize_fp8_block128 (K)")
    n, k = w.shape
    row_blocks = -(-n // BLOCK128)
    padded = torch.zeros(row_blocks * BLOCK128, k, dtype=torch.float32, device=w.device)
    padded[:n] = w.float()
    tiles = padded.view(row_blocks, BLOCK128, k // BLOCK128, BLOCK128)
    sf = ue8m0_to_float(ue8m0_from_amax(tiles.abs().amax(dim=(1, 3)), FP8_E4M3_MAX))
    q = tiles * (1.0 / sf)[:, None, :, None]
    return q.view(-1, k)[:n].to(torch.float8_e4m3fn), sf


def dequantize_fp8_block128(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(float8_e4m3fn [N, K], float32 [ceil(N/128), K/128]) -> float32 [N, K], exact."""
    _check_dtype(w, torch.float8_e4m3fn, "dequantize_fp8_block128 values")
    _check_dtype(sf, torch.float32, "dequantize_fp8_block128 scales")
    if w.dim() != 2:
        raise ValueError(f"dequantize_fp8_block128 wants a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    want = (-(-n // BLOCK128), k // BLOCK128)
    if k % BLOCK128 or tuple(sf.shape) != want:
        raise ValueError(
            f"dequantize_fp8_block128: weight {tuple(w.shape)} needs K % 128 == 0 and scales of "
            f"shape {want}, got {tuple(sf.shape)}"
        )
    row_scales = sf.repeat_interleave(BLOCK128, dim=0)[:n]
    return _apply_block_scales(w.float(), row_scales, BLOCK128)


def expand_block_scales_to_rows(sf: torch.Tensor, rows: int) -> torch.Tensor:
    """Block scales float32 [ceil(rows/128), K/128] -> int32 [rows, ceil(K/512)]: one packed row per output row.

    This is the form the (1, 128, 128) recipe stages: byte g of word w holds the UE8M0 exponent of K128
    block 4w+g (the MMA's scale selector is the K128 block index modulo 4); padding bytes are 0.
    """
    _check_dtype(sf, torch.float32, "expand_block_scales_to_rows scales")
    if sf.dim() != 2 or sf.shape[0] != -(-rows // BLOCK128):
        raise ValueError(
            f"expand_block_scales_to_rows: scales {tuple(sf.shape)} do not cover {rows} rows "
            f"in blocks of 128 (expected {-(-rows // BLOCK128)} block rows)"
        )
    bits = sf.contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any() | (bits <= 0).any()):
        raise ValueError("expand_block_scales_to_rows: every scale must be a positive power of two (UE8M0)")
    exponents = (bits >> 23).to(torch.uint8).repeat_interleave(BLOCK128, dim=0)[:rows]
    pad = -exponents.shape[1] % SF_PER_WORD
    exponents = torch.nn.functional.pad(exponents, (0, pad), value=0)
    return pack_ue8m0(exponents)


# ----------------------------------------------------------------------------------------------- MoE weights
def quantize_moe_weights(
    w1: torch.Tensor, w2: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Float expert weights -> DeepGEMM's FP4 tuples.

    w1 [E, 2I, H] (rows [gate; up]) and w2 [E, H, I] ->
    l1_weights = (int8 [E, 2I, H/2], int32 [E, 2I, H/128]), l2_weights = (int8 [E, H, I/2], int32 [E, H, I/128]).
    Experts are quantized one at a time so the float32 temporaries stay one expert large.
    """
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"quantize_moe_weights wants w1 [E, 2I, H] and w2 [E, H, I], got {tuple(w1.shape)} "
            f"and {tuple(w2.shape)}"
        )
    e, two_i, h = w1.shape
    if w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"quantize_moe_weights: w1 {tuple(w1.shape)} implies w2 [E={e}, H={h}, I={two_i // 2}], "
            f"got {tuple(w2.shape)}"
        )
    if h % K128 or (two_i // 2) % K128:
        raise ValueError(
            f"quantize_moe_weights: hidden {h} and intermediate {two_i // 2} must be multiples of 128"
        )
    l1 = [quantize_fp4_ue8m0(w1[i]) for i in range(e)]
    l2 = [quantize_fp4_ue8m0(w2[i]) for i in range(e)]

    def stacked(parts, j, shape, dtype):
        return (
            torch.stack([p[j] for p in parts]) if parts else torch.empty(shape, dtype=dtype, device=w1.device)
        )

    l1_weights = (
        stacked(l1, 0, (0, two_i, h // 2), torch.int8),
        stacked(l1, 1, (0, two_i, h // K128), torch.int32),
    )
    i = two_i // 2
    l2_weights = (stacked(l2, 0, (0, h, i // 2), torch.int8), stacked(l2, 1, (0, h, i // K128), torch.int32))
    return l1_weights, l2_weights


def dequantize_moe_weights(
    l1_weights: tuple[torch.Tensor, torch.Tensor], l2_weights: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's FP4 tuples -> float32 (w1 [E, 2I, H], w2 [E, H, I]), exact."""
    w1 = dequantize_fp4_ue8m0(*l1_weights)
    w2 = dequantize_fp4_ue8m0(*l2_weights)
    e, two_i, h = w1.shape
    if w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"dequantize_moe_weights: L1 decodes to {tuple(w1.shape)} = [E, 2I, H], so L2 must decode "
            f"to [E, H, I] = {(e, h, two_i // 2)}, got {tuple(w2.shape)}"
        )
    return w1, w2


# ----------------------------------------------------------------------------------------------- shared expert
@dataclass(frozen=True)
class SharedExpertWeights:
    """FP8 shared-expert weights and their recipe (several shared experts are one with a wider intermediate).

    recipe (1, 1, 32):   w1_sf int32 [2Is, H/128], w2_sf int32 [H, Is/128] (packed UE8M0 per 32 along K).
    recipe (1, 128, 128): w1_sf float32 [ceil(2Is/128), H/128], w2_sf float32 [ceil(H/128), Is/128]
                          (power-of-two scales per 128x128 block; `packed_row_scales` gives the staged form).
    """

    w1: torch.Tensor  # float8_e4m3fn [2Is, H], rows [gate; up]
    w1_sf: torch.Tensor
    w2: torch.Tensor  # float8_e4m3fn [H, Is]
    w2_sf: torch.Tensor
    recipe: tuple[int, int, int] = RECIPE_K32

    def __post_init__(self) -> None:
        recipe = tuple(self.recipe)
        if recipe not in SHARED_RECIPES:
            raise ValueError(
                f"shared-expert recipe {self.recipe} is not supported; allowed: {SHARED_RECIPES}"
            )
        object.__setattr__(self, "recipe", recipe)
        for name in ("w1", "w2"):
            _check_dtype(getattr(self, name), torch.float8_e4m3fn, f"shared-expert {name}")
            if getattr(self, name).dim() != 2:
                raise ValueError(
                    f"shared-expert {name} must be 2-D, got shape {tuple(getattr(self, name).shape)}"
                )
        two_i, h = self.w1.shape
        if two_i % 2 or self.w2.shape != (h, two_i // 2):
            raise ValueError(
                f"shared-expert w1 {tuple(self.w1.shape)} = [2Is, H] needs w2 [H, Is] = "
                f"{(h, two_i // 2)}, got {tuple(self.w2.shape)}"
            )
        for w, sf, name in ((self.w1, self.w1_sf, "w1_sf"), (self.w2, self.w2_sf, "w2_sf")):
            n, k = w.shape
            if recipe == RECIPE_K32:
                _check_dtype(sf, torch.int32, f"shared-expert {name} (recipe (1,1,32))")
                want = (n, k // K128)
            else:
                _check_dtype(sf, torch.float32, f"shared-expert {name} (recipe (1,128,128))")
                want = (-(-n // BLOCK128), k // BLOCK128)
            if k % K128 or tuple(sf.shape) != want:
                raise ValueError(
                    f"shared-expert {name}: weight {(n, k)} needs K % 128 == 0 and scales {want} "
                    f"for recipe {recipe}, got {tuple(sf.shape)}"
                )

    @property
    def hidden(self) -> int:
        return self.w1.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[0] // 2

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w1 [2Is, H], w2 [H, Is]), exact."""
        if self.recipe == RECIPE_K32:
            return dequantize_fp8_ue8m0(self.w1, self.w1_sf), dequantize_fp8_ue8m0(self.w2, self.w2_sf)
        return dequantize_fp8_block128(self.w1, self.w1_sf), dequantize_fp8_block128(self.w2, self.w2_sf)

    def packed_row_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row packed int32 scales: (w1 [2Is, ceil(H/512)], w2 [H, ceil(Is/512)]) for (1,128,128),
        the stored int32 scales unchanged for (1,1,32)."""
        if self.recipe == RECIPE_K32:
            return self.w1_sf, self.w2_sf
        return (
            expand_block_scales_to_rows(self.w1_sf, self.w1.shape[0]),
            expand_block_scales_to_rows(self.w2_sf, self.w2.shape[0]),
        )


def quantize_shared_expert_weights(
    w1: torch.Tensor, w2: torch.Tensor, recipe: tuple[int, int, int] = RECIPE_K32
) -> SharedExpertWeights:
    """Float shared-expert weights w1 [2Is, H] (rows [gate; up]), w2 [H, Is] -> FP8 SharedExpertWeights."""
    recipe = tuple(recipe)
    if recipe not in SHARED_RECIPES:
        raise ValueError(f"shared-expert recipe {recipe} is not supported; allowed: {SHARED_RECIPES}")
    if w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(
            f"quantize_shared_expert_weights wants w1 [2Is, H] and w2 [H, Is], got {tuple(w1.shape)} "
            f"and {tuple(w2.shape)}"
        )
    quantize = quantize_fp8_ue8m0 if recipe == RECIPE_K32 else quantize_fp8_block128
    q1, s1 = quantize(w1)
    q2, s2 = quantize(w2)
    return SharedExpertWeights(q1, s1, q2, s2, recipe)
