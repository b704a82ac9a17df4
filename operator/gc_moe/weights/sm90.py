"""SM90 weight transform: the MXFP4 window repack of the Hopper path and its exact inverse.

The SM90 kernel decodes FP4 to E4M3 in registers and feeds register-A WGMMA m64nNk32 (weights as the A
operand). It reads weights in the layout this module writes:

| tensor  | dtype / shape                      | meaning                                                     |
| ------- | ---------------------------------- | ----------------------------------------------------------- |
| codes   | uint8 [E, M/64, K/128, 4096]       | one 64-row x 128-K tile of E2M1 codes, bytes in lane order   |
| scales  | uint8 [E, M/64, K/128, 64, 4]      | per (tile row, K32 block) UE8M0 byte of 2^(d + 6), d in 0..11 |
| factor  | float32 [E]                        | per-expert compensating factor 2^(base - 127)                |

Decode. A code byte holds two E2M1 nibbles; `(n & 8) << 4 | (n & 7) << 2` turns a nibble into the E4M3 byte
of value(n) / 64 exactly (the E2M1 exponent lands in the low bits of the E4M3 exponent, bias 7 vs 1).
The stored scales carry the x64 back (the "x64 convention"), so decode(n) * 2^(d+6) * factor = value(n) * 2^(e-127).

Window. Per expert the UE8M0 exponents e of its K32 blocks span [e_min, e_max]. The window base is
max(e_min, e_max - WINDOW_STEPS); a block stores d = e - base. A block with e < base (only when the span
exceeds WINDOW_STEPS) is re-expressed at d = 0: its codes are shifted down by 2^(base - e) through a lookup
over the 4-bit code space (nearest, midpoints down as the quantizer), the one place the repack is inexact. Keeping d small
keeps the per-K32 FP32 products of the kernel far from overflow and underflow for any absolute scale.

Lane order (what one thread of the warpgroup loads with two 16-byte shared loads per 64x128 tile):
thread T = 32 w + 4 g + q (warp w, group g, quad lane q) owns bytes [32 T, 32 T + 32) of the tile. Word
2 j + h (j = K32 block, h = half) byte b holds in its low nibble A[16 w + g, 32 j + 16 h + 4 q + b] and in
its high nibble A[16 w + g + 8, same k]. Decoding the low nibbles of word 2 j + h gives WGMMA A register
2 h, the high nibbles register 2 h + 1 (the m64k32 8-bit A fragment: rows g / g+8, k 4q.. / 16+4q..).

Nibble order "table" (opt-in, `nibble_order="table"`; the kernels' `table_decode`): the same 32 bytes per thread,
each word's eight codes rearranged for a byte-permute decode. Word nibble n (bits 4n..4n+3) holds in bits 0..2 the
magnitude of A[row g, k_n] (n < 4) or A[row g + 8, k_(n-4)] (n >= 4), k_i = 32 j + 16 h + 4 q + i, and in bit 3 a
sign: of A[row g, k_(n-1)/2] for odd n, of A[row g + 8, k_n/2] for even n. Then `w & 0x77777777` holds the row's
magnitudes as four permute selectors per half, `w & 0x80808080` row g's signs at the E4M3 sign bits and
`(w << 4) & 0x80808080` row g + 8's. Also, thread T's words 0..3 lie at bytes [16 T, 16 T + 16) of the tile and
words 4..7 at [2048 + 16 T, ...): each of its two 16-byte shared loads is then contiguous over the warp (no bank
conflict; the lane order's 32-byte stride costs two wavefronts per quarter warp).

Nibble order "split" (opt-in, `nibble_order="split"`; the kernels' `split_nibbles`): the same 32 bytes per thread,
its two 16-byte halves placed as in the table order, each byte's eight bits shared by the two rows' codes of one k
so that both E4M3 bytes come out with few masks and shifts. Word 2 j + h byte b holds the code n of A[row g, k]
(k = 32 j + 16 h + 4 q + b) already in its E4M3 bits (`(n & 8) << 4 | (n & 7) << 2`: bits 7, 4..2) and the code
m of A[row g + 8, k] in the other four: its bits 0..1 at 0..1, bit 2 at 6, bit 3 at 5. Then `w & 0x9C9C9C9C` is
row g's A register and `((w & 0x23232323) << 2) | ((w >> 2) & 0x10101010)` row g + 8's: five instructions per
word against the lane order's seven.

Row order. W2 tiles take rows in order. W1 tiles interleave gate and up so one thread holds both halves
of the same intermediate channel: W1 tile mt, row 16 w + r is gate channel 32 mt + 8 w + r for r < 8 and
up channel 32 mt + 8 w + r - 8 for r >= 8 (rows [gate; up] of the DeepGEMM layout, I rows each).
Four consecutive W1 tiles cover one K128 block of the intermediate dimension (the requant block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gc_moe.formats import (
    K128,
    SF_BLOCK,
    fp4_codes_from_float,
    fp4_codes_to_float,
    pack_fp4,
    pack_ue8m0,
    unpack_fp4,
    unpack_ue8m0,
)

TILE_M = 64  # rows of one WGMMA A tile
TILE_K = K128  # K extent of one tile (four K32 blocks)
TILE_BYTES = TILE_M * TILE_K // 2
WINDOW_STEPS = 11  # largest exponent distance d a block may keep from the window base
X64_EXPONENT = 6  # decode yields value / 2^6; stored scales carry 2^6 back
UE8M0_BIAS = 127
NIBBLE_ORDERS = ("lane", "table", "split")


@dataclass
class Sm90Matrix:
    """One repacked weight matrix (all local experts)."""

    codes: torch.Tensor  # uint8 [E, M/64, K/128, 4096]
    scales: torch.Tensor  # uint8 [E, M/64, K/128, 64, 4]
    factor: torch.Tensor  # float32 [E]
    rows: int  # M
    cols: int  # K
    gate_up_interleaved: bool
    nibble_order: str = "lane"  # "table": the byte-permute decode's order; "split": the masked one (module docstring)

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]


@dataclass
class Sm90Weights:
    l1: Sm90Matrix  # W1 [2I, H], gate/up interleaved per tile
    l2: Sm90Matrix  # W2 [H, I]


# ---------------------------------------------------------------------------------------- lane permutation
def _lane_index_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tile byte position (T, word, byte) and nibble: the (row, k) it holds. Returns row, k [4096, 2]."""
    t = torch.arange(128, device=device).view(128, 1, 1)
    word = torch.arange(8, device=device).view(1, 8, 1)
    byte = torch.arange(4, device=device).view(1, 1, 4)
    w, g, q = t // 32, (t % 32) // 4, t % 4
    j, h = word // 2, word % 2
    row_lo = (16 * w + g).expand(128, 8, 4)
    k = (32 * j + 16 * h + 4 * q + byte).expand(128, 8, 4)
    rows = torch.stack((row_lo, row_lo + 8), dim=-1).reshape(TILE_BYTES, 2)
    ks = torch.stack((k, k), dim=-1).reshape(TILE_BYTES, 2)
    return rows, ks


def w1_row_order(intermediate: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Original W1 row ([gate; up]) for each repacked row: int64 [2I]."""
    r = torch.arange(2 * intermediate, device=device)
    tile, in_tile = r // TILE_M, r % TILE_M
    w, within = in_tile // 16, in_tile % 16
    channel = tile * 32 + w * 8 + within % 8
    return torch.where(within < 8, channel, intermediate + channel)


# (magnitude nibble, sign nibble) of word nibble n in the table order: codes c[0..7] = row g k0..k3, row g+8 k0..k3
_TABLE_MAGNITUDE = (0, 1, 2, 3, 4, 5, 6, 7)
_TABLE_SIGN = (4, 0, 5, 1, 6, 2, 7, 3)


def _lane_words_to_codes(tile_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] in lane order -> codes [..., n words, 8]: row g k0..k3, then row g+8 k0..k3."""
    b = tile_bytes.view(*tile_bytes.shape[:-1], tile_bytes.shape[-1] // 4, 4)
    return torch.cat((b & 0xF, b >> 4), dim=-1)


def _split_thread_halves(tile_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4096]: thread T's bytes [32 T, 32 T + 32) -> [16 T, ...) and [2048 + 16 T, ...)."""
    return tile_bytes.view(*tile_bytes.shape[:-1], 128, 2, 16).transpose(-3, -2).reshape(tile_bytes.shape)


def _join_thread_halves(tile_bytes: torch.Tensor) -> torch.Tensor:
    """The inverse of _split_thread_halves."""
    return tile_bytes.view(*tile_bytes.shape[:-1], 2, 128, 16).transpose(-3, -2).reshape(tile_bytes.shape)


def _codes_to_table_bytes(c: torch.Tensor) -> torch.Tensor:
    """codes [..., n words, 8] (as _lane_words_to_codes) -> uint8 [..., 4 n]: each word in table nibble order
    (the 16-byte halves are placed by _split_thread_halves)."""
    nib = [(c[..., _TABLE_MAGNITUDE[n]] & 7) | (c[..., _TABLE_SIGN[n]] & 8) for n in range(8)]
    out = torch.stack([nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(4)], dim=-1)
    return out.reshape(*c.shape[:-2], 4 * c.shape[-2])


def _table_bytes_to_codes(tile_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] in table order -> codes [..., n words, 8] (row g k0..k3, row g+8 k0..k3)."""
    b = tile_bytes.view(*tile_bytes.shape[:-1], tile_bytes.shape[-1] // 4, 4)
    nib = [(b[..., n // 2] >> (4 * (n % 2))) & 0xF for n in range(8)]
    codes = [None] * 8
    for n in range(8):
        codes[_TABLE_MAGNITUDE[n]] = nib[n] & 7
    for n in range(8):
        codes[_TABLE_SIGN[n]] = codes[_TABLE_SIGN[n]] | (nib[n] & 8)
    return torch.stack(codes, dim=-1)


def _codes_to_split_bytes(c: torch.Tensor) -> torch.Tensor:
    """codes [..., n words, 8] (as _lane_words_to_codes) -> uint8 [..., 4 n]: each word in split nibble order
    (the 16-byte halves are placed by _split_thread_halves)."""
    lo, hi = c[..., :4], c[..., 4:]
    row_g = ((lo & 8) << 4) | ((lo & 7) << 2)  # bits 7, 4..2: the E4M3 byte of row g's code
    row_g8 = (hi & 3) | ((hi & 4) << 4) | ((hi & 8) << 2)  # bits 0..1, 6, 5
    return (row_g | row_g8).reshape(*c.shape[:-2], 4 * c.shape[-2])


def _split_bytes_to_codes(tile_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] in split order -> codes [..., n words, 8] (row g k0..k3, row g+8 k0..k3)."""
    b = tile_bytes.view(*tile_bytes.shape[:-1], tile_bytes.shape[-1] // 4, 4)
    row_g = ((b >> 2) & 7) | ((b >> 4) & 8)
    row_g8 = (b & 3) | ((b >> 4) & 4) | ((b >> 2) & 8)
    return torch.cat((row_g, row_g8), dim=-1)


def with_nibble_order(mat: Sm90Matrix, order: str) -> Sm90Matrix:
    """The same matrix with its codes in `order` (NIBBLE_ORDERS); scales and factor shared, codes new."""
    if order not in NIBBLE_ORDERS:
        raise ValueError(f"nibble order {order!r}; allowed: {NIBBLE_ORDERS}")
    if order == mat.nibble_order:
        return mat
    if mat.nibble_order == "lane":
        codes = _lane_words_to_codes(mat.codes)
    elif mat.nibble_order == "table":
        codes = _table_bytes_to_codes(_join_thread_halves(mat.codes))
    else:
        codes = _split_bytes_to_codes(_join_thread_halves(mat.codes))
    if order == "table":
        new = _split_thread_halves(_codes_to_table_bytes(codes))
    elif order == "split":
        new = _split_thread_halves(_codes_to_split_bytes(codes))
    else:
        new = (codes[..., :4] | (codes[..., 4:] << 4)).reshape(mat.codes.shape)
    return Sm90Matrix(codes=new.contiguous(), scales=mat.scales, factor=mat.factor, rows=mat.rows, cols=mat.cols,
                      gate_up_interleaved=mat.gate_up_interleaved, nibble_order=order)


# ---------------------------------------------------------------------------------------- window
def window_base(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponents [E, ...] (uint8) -> per-expert window base int32 [E]."""
    e = exponents.flatten(1).to(torch.int32)
    return torch.maximum(e.amin(1), e.amax(1) - WINDOW_STEPS)


def shift_codes_down(codes: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """E2M1 codes scaled by 2^-shift (shift >= 0), rounded as formats.fp4_codes_from_float: the 4-bit lookup."""
    shift = shift.clamp(0, 8).to(torch.int64)
    lut = torch.stack(
        [fp4_codes_from_float(fp4_codes_to_float(torch.arange(16)) * 2.0**-s) for s in range(9)]
    ).to(codes.device)  # [9, 16]: shift s, code -> shifted code
    return lut[shift, codes.long()].to(torch.uint8)


def _check_matrix(packed: torch.Tensor, sf: torch.Tensor, what: str) -> tuple[int, int, int]:
    if packed.dtype != torch.int8 or packed.dim() != 3:
        raise ValueError(f"{what}: codes must be int8 [E, M, K/2], got {packed.dtype} {tuple(packed.shape)}")
    e, m, k2 = packed.shape
    k = 2 * k2
    if m % TILE_M or k % TILE_K:
        raise ValueError(f"{what}: M={m} must be a multiple of {TILE_M} and K={k} a multiple of {TILE_K}")
    if sf.dtype != torch.int32 or tuple(sf.shape) != (e, m, k // K128):
        raise ValueError(
            f"{what}: scales must be int32 [{e}, {m}, {k // K128}], got {sf.dtype} {tuple(sf.shape)}"
        )
    return e, m, k


def repack_matrix(
    packed: torch.Tensor, sf: torch.Tensor, *, gate_up: bool, what: str = "weights", nibble_order: str = "lane"
) -> Sm90Matrix:
    """MXFP4 (int8 [E, M, K/2], int32 [E, M, K/128]) -> the SM90 window-repacked layout (codes in `nibble_order`)."""
    if nibble_order not in NIBBLE_ORDERS:
        raise ValueError(f"{what}: nibble order {nibble_order!r}; allowed: {NIBBLE_ORDERS}")
    e, m, k = _check_matrix(packed, sf, what)
    if gate_up and (m // 2) % 32:
        raise ValueError(
            f"{what}: intermediate size {m // 2} must be a multiple of 32 for the gate/up interleave"
        )
    codes = unpack_fp4(packed)  # [E, M, K]
    exps = unpack_ue8m0(sf)  # [E, M, K/32]
    if gate_up:
        order = w1_row_order(m // 2, packed.device)
        codes, exps = codes[:, order], exps[:, order]
    base = window_base(exps)  # [E]
    d = exps.to(torch.int32) - base.view(e, 1, 1)
    shift = (-d).clamp_min(0)
    if bool((shift > 0).any()):  # only when some expert's span exceeds the window
        codes = shift_codes_down(codes, shift.repeat_interleave(SF_BLOCK, dim=-1))
    d = d.clamp_min(0)
    # tiles: [E, M/64, 64, K/128, 128] -> [E, M/64, K/128, 64, 128]
    tiles = codes.view(e, m // TILE_M, TILE_M, k // TILE_K, TILE_K).transpose(2, 3)
    rows, ks = _lane_index_maps(packed.device)
    nib = tiles[..., rows, ks]  # [E, mt, kt, 4096, 2]
    tile_bytes = nib[..., 0] | (nib[..., 1] << 4)
    scale_bytes = (d + X64_EXPONENT + UE8M0_BIAS).to(torch.uint8)
    scale_bytes = scale_bytes.view(e, m // TILE_M, TILE_M, k // TILE_K, 4).transpose(2, 3)
    factor = torch.ldexp(torch.ones(e, device=packed.device), (base - UE8M0_BIAS).to(torch.float32))
    mat = Sm90Matrix(
        codes=tile_bytes.contiguous(),
        scales=scale_bytes.contiguous(),
        factor=factor,
        rows=m,
        cols=k,
        gate_up_interleaved=gate_up,
    )
    return with_nibble_order(mat, nibble_order)


def _untile(mat: Sm90Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    """Repacked tiles -> (codes uint8 [E, M, K], d int32 [E, M, K/32]) in repacked row order."""
    mat = with_nibble_order(mat, "lane")
    e, m, k = mat.num_experts, mat.rows, mat.cols
    rows, ks = _lane_index_maps(mat.codes.device)
    tiles = torch.empty(
        e, m // TILE_M, k // TILE_K, TILE_M, TILE_K, dtype=torch.uint8, device=mat.codes.device
    )
    tiles[..., rows[:, 0], ks[:, 0]] = mat.codes & 0xF
    tiles[..., rows[:, 1], ks[:, 1]] = mat.codes >> 4
    codes = tiles.transpose(2, 3).reshape(e, m, k)
    d = mat.scales.transpose(2, 3).reshape(e, m, k // SF_BLOCK).to(torch.int32) - X64_EXPONENT - UE8M0_BIAS
    return codes, d


def inverse_matrix(mat: Sm90Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The SM90 layout -> MXFP4 (int8 [E, M, K/2], int32 [E, M, K/128]) in the original row order.

    Exact inverse of repack_matrix whenever every expert's exponent span is at most WINDOW_STEPS; otherwise it
    returns the MXFP4 weights the kernel really computes with (shifted blocks at the window base).
    """
    codes, d = _untile(mat)
    base = torch.log2(mat.factor).round().to(torch.int32) + UE8M0_BIAS
    exps = (d + base.view(-1, 1, 1)).to(torch.uint8)
    if mat.gate_up_interleaved:
        order = w1_row_order(mat.rows // 2, codes.device)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        codes, exps = codes[:, inv], exps[:, inv]
    return pack_fp4(codes), pack_ue8m0(exps.contiguous())


def dequantize_matrix(mat: Sm90Matrix) -> torch.Tensor:
    """What the kernel computes with, in repacked row order: float32 [E, M, K] = decode * 2^(d+6) * factor."""
    codes, d = _untile(mat)
    decoded = fp4_codes_to_float(codes) / 2.0**X64_EXPONENT
    scale = torch.ldexp(torch.ones_like(d, dtype=torch.float32), (d + X64_EXPONENT).float())
    return decoded * scale.repeat_interleave(SF_BLOCK, dim=-1) * mat.factor.view(-1, 1, 1)


def transform(
    l1_weights: tuple[torch.Tensor, torch.Tensor], l2_weights: tuple[torch.Tensor, torch.Tensor],
    nibble_order: str = "lane",
) -> Sm90Weights:
    """DeepGEMM-layout MXFP4 W1 / W2 -> the SM90 kernel's layout (codes in `nibble_order`)."""
    return Sm90Weights(
        l1=repack_matrix(*l1_weights, gate_up=True, what="l1_weights", nibble_order=nibble_order),
        l2=repack_matrix(*l2_weights, gate_up=False, what="l2_weights", nibble_order=nibble_order),
    )


def inverse(
    weights: Sm90Weights,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The SM90 layout -> (l1_weights, l2_weights) in DeepGEMM's layout (see inverse_matrix for exactness)."""
    return inverse_matrix(weights.l1), inverse_matrix(weights.l2)
