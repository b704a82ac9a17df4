"""SM103 (Blackwell, B300) weight layout: the K128 tile-contiguous prepack of Section 4.4, and its exact inverse.

The SM103 kernels target B300 (sm_103f), which this project cannot run yet (its test GPUs are Hopper H200s), so
this layout is verified only on the host (byte-exact round trips and hand-checked positions), not against a
running kernel.
See docs/layouts.md for the byte tables.

Input (DeepGEMM's layout): L1 = (int8 [E, 2I, H/2], int32 [E, 2I, H/128]) with rows [gate; up],
L2 = (int8 [E, H, I/2], int32 [E, H, I/128]); FP4 packed two per byte, 4 UE8M0 bytes per int32 (see formats).

Output, per matrix with R rows and K columns (kb = K/128 tiles along K):
- data: [E, kb, R, 64] int8 (FP4) or [E, kb, R, 128] float8_e4m3fn (FP8 shared experts): tile kb holds every
  row's bytes of columns [128 kb, 128 kb + 128) back to back, so one TMA box (128, 128, 1, 1) over
  (K, rows, kb, experts) reads one contiguous 8 KB (FP8: 16 KB) range.
- scales: [E, W, R] int32, MN-major (W = K/128 scale words per row), rows in UTCCP order: within each
  128-row block, new row 4 i + j holds old row 32 j + i (i < 32, j < 4), so the 32x128b UTCCP copy hands TMEM
  lane i the four words of rows i, i+32, i+64, i+96.
- L1 only: gate and up rows interleaved in groups of 8 ([gate 0..7, up 0..7, gate 8..15, up 8..15, ...]), in
  both data and scales, so the SwiGLU epilogue finds gate row r and up row r in one tile. The UTCCP row order
  is applied after the interleave.

The same functions pack FP8 shared-expert weights: recipe (1,1,32) scales are int32 [.., R, K/128]; for recipe
(1,128,128) the caller expands block-row scales to one row per output row, one UE8M0 byte per K128 block, four
blocks per word: int32 [.., R, ceil(K/512)] (the kernel's selector picks byte kb mod 4).

Eq. (3), the staged shared-expert activation scales: token t with u = t mod BM lands in row
floor(t/BM)*align(BM,128) + floor(u/128)*128 + (u mod 32)*4 + floor((u mod 128)/32) of an MN-major
[H/128, ceil(Tmax/8)*128] int32 buffer, the order the kernel itself writes for routed activation scales.
"""

from __future__ import annotations

import math

import torch

from ..planning import SM103_BLOCK_M

K_TILE = 128  # values per K tile (one TMA box, four K32 MMAs)
GATE_UP_GROUP = 8  # rows per gate/up interleave group
UTCCP_BLOCK_ROWS = 128  # rows per UTCCP scale block
UTCCP_LANES = 32  # TMEM lanes one 32x128b copy fills
UTCCP_WORDS = UTCCP_BLOCK_ROWS // UTCCP_LANES  # 4 words (128 bits) per lane
SHARED_SCALE_ROW_GRANULE = 8  # the staged buffer holds ceil(Tmax/8)*128 rows, enough for every BM

_FP4_DTYPE = torch.int8  # two E2M1 codes per byte
_FP8_DTYPE = torch.float8_e4m3fn
_TILE_BYTES = {_FP4_DTYPE: K_TILE // 2, _FP8_DTYPE: K_TILE}
_VALUES_PER_BYTE = {_FP4_DTYPE: 2, _FP8_DTYPE: 1}


# ----------------------------------------------------------------------------------------------- row orders
def interleave_gate_up(t: torch.Tensor, group: int = GATE_UP_GROUP) -> torch.Tensor:
    """Rows (dim -2) [gate; up] -> [gate 0..g-1, up 0..g-1, gate g..2g-1, ...]. Any leading dims."""
    rows = t.shape[-2]
    if rows % (2 * group) != 0:
        raise ValueError(
            f"interleave_gate_up: {rows} rows must split into gate and up halves of whole {group}-row groups"
        )
    gate, up = t.unflatten(-2, (2, rows // (2 * group), group)).unbind(-4)
    return torch.stack((gate, up), dim=-3).flatten(-4, -3).flatten(-3, -2).contiguous()


def deinterleave_gate_up(t: torch.Tensor, group: int = GATE_UP_GROUP) -> torch.Tensor:
    """The inverse of interleave_gate_up."""
    rows = t.shape[-2]
    if rows % (2 * group) != 0:
        raise ValueError(f"deinterleave_gate_up: {rows} rows is not a whole number of gate/up group pairs")
    pairs = t.unflatten(-2, (rows // (2 * group), 2, group))
    return pairs.transpose(-4, -3).flatten(-4, -2).contiguous()


def utccp_row_permutation(rows: int, device=None) -> torch.Tensor:
    """perm with new_row r <- old_row perm[r]: in each 128-row block, new row 4i + j <- old row 32j + i."""
    if rows % UTCCP_BLOCK_ROWS != 0:
        raise ValueError(f"UTCCP scale order needs a multiple of {UTCCP_BLOCK_ROWS} rows, got {rows}")
    r = torch.arange(rows, device=device)
    block, within = r // UTCCP_BLOCK_ROWS, r % UTCCP_BLOCK_ROWS
    lane, word = within // UTCCP_WORDS, within % UTCCP_WORDS
    return block * UTCCP_BLOCK_ROWS + word * UTCCP_LANES + lane


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# ----------------------------------------------------------------------------------------------- data tiles
def pack_k128_tiles(data: torch.Tensor) -> torch.Tensor:
    """[..., R, K bytes] row-major -> [..., kb, R, tile bytes] (64 B per row for FP4, 128 B for FP8)."""
    tile_bytes = _tile_bytes(data)
    if data.shape[-1] % tile_bytes != 0:
        raise ValueError(
            f"K128 prepack: a row of {data.shape[-1]} bytes is not a whole number of {tile_bytes}-byte K128 tiles "
            f"(K must be a multiple of {K_TILE})"
        )
    return data.unflatten(-1, (-1, tile_bytes)).transpose(-3, -2).contiguous()


def unpack_k128_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """[..., kb, R, tile bytes] -> [..., R, kb * tile bytes], the inverse of pack_k128_tiles."""
    if tiles.shape[-1] != _tile_bytes(tiles):
        raise ValueError(
            f"K128 tiles of {tiles.dtype} have {_tile_bytes(tiles)} bytes per row, got {tiles.shape[-1]}"
        )
    return tiles.transpose(-3, -2).flatten(-2).contiguous()


def _tile_bytes(t: torch.Tensor) -> int:
    if t.dtype not in _TILE_BYTES:
        raise TypeError(
            f"weights must be int8 (packed FP4) or float8_e4m3fn (FP8 shared experts), got {t.dtype}"
        )
    return _TILE_BYTES[t.dtype]


# ----------------------------------------------------------------------------------------------- scales
def pack_scales(sf: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, W] K-major -> [..., W, R] MN-major with rows in UTCCP order."""
    if sf.dtype != torch.int32:
        raise TypeError(f"weight scales must be int32 (four packed UE8M0 bytes), got {sf.dtype}")
    perm = utccp_row_permutation(sf.shape[-2], sf.device)
    return sf.index_select(-2, perm).transpose(-1, -2).contiguous()


def unpack_scales(sf: torch.Tensor) -> torch.Tensor:
    """[..., W, R] MN-major UTCCP order -> int32 [..., R, W], the inverse of pack_scales."""
    inv = _inverse_permutation(utccp_row_permutation(sf.shape[-1], sf.device))
    return sf.transpose(-1, -2).index_select(-2, inv).contiguous()


# ----------------------------------------------------------------------------------------------- transform
def _check_pair(name: str, pair) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected a (data, scales) pair, got {type(pair).__name__}")
    data, sf = pair
    if not isinstance(data, torch.Tensor) or not isinstance(sf, torch.Tensor):
        raise TypeError(
            f"{name}: got ({type(data).__name__}, {type(sf).__name__}); allowed: two torch.Tensor (data, scales)"
        )
    if data.dim() != 3 or sf.dim() != 3:
        raise ValueError(
            f"{name}: data and scales must be 3-D [experts, rows, ...], got {tuple(data.shape)} and {tuple(sf.shape)}"
        )
    if data.dtype not in _TILE_BYTES:
        raise TypeError(
            f"{name}: data must be int8 (packed FP4) or float8_e4m3fn (FP8 shared experts), got {data.dtype}"
        )
    if sf.dtype != torch.int32:
        raise TypeError(f"{name}: scales must be int32 (four packed UE8M0 bytes), got {sf.dtype}")
    experts, rows, row_bytes = data.shape
    k = row_bytes * _VALUES_PER_BYTE[data.dtype]
    words = (k // K_TILE, math.ceil(k / (4 * K_TILE)))  # recipe (1,1,32); (1,128,128) (FP8 only)
    if k % K_TILE != 0:
        raise ValueError(f"{name}: K = {k} must be a multiple of {K_TILE} (complete K128 tiles)")
    if rows % UTCCP_BLOCK_ROWS != 0:
        raise ValueError(f"{name}: {rows} rows must be a multiple of {UTCCP_BLOCK_ROWS} (UTCCP scale blocks)")
    allowed = words[:1] if data.dtype == _FP4_DTYPE else words
    if sf.shape[:2] != (experts, rows) or sf.shape[2] not in allowed:
        raise ValueError(
            f"{name}: scales {tuple(sf.shape)} do not match data {tuple(data.shape)}; allowed: "
            f"[{experts}, {rows}, W] with W in {sorted(set(allowed))}"
        )
    return data, sf


def transform(l1_weights, l2_weights):
    """(l1, l2) in DeepGEMM's layout -> (w1, w2) in the SM103 layout, each (tiles, MN-major scales)."""
    l1_data, l1_sf = _check_pair("l1_weights", l1_weights)
    l2_data, l2_sf = _check_pair("l2_weights", l2_weights)
    w1 = (pack_k128_tiles(interleave_gate_up(l1_data)), pack_scales(interleave_gate_up(l1_sf)))
    w2 = (pack_k128_tiles(l2_data), pack_scales(l2_sf))
    return w1, w2


def inverse(w1, w2):
    """The exact inverse of transform: SM103 (w1, w2) -> DeepGEMM-layout (l1, l2)."""
    (t1, s1), (t2, s2) = w1, w2
    l1 = (deinterleave_gate_up(unpack_k128_tiles(t1)), deinterleave_gate_up(unpack_scales(s1)))
    l2 = (unpack_k128_tiles(t2), unpack_scales(s2))
    return l1, l2


# ----------------------------------------------------------------------------------------------- Eq. (3)
def _check_block_m(block_m: int) -> None:
    if block_m not in SM103_BLOCK_M:
        raise ValueError(f"block_m: got {block_m!r}; allowed on sm103: {SM103_BLOCK_M}")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def shared_scale_row(t: int, block_m: int) -> int:
    """Eq. (3): the staged-buffer row of token t's activation scales for ring blocks of `block_m` tokens."""
    _check_block_m(block_m)
    if t < 0:
        raise ValueError(f"token index must be non-negative, got {t}")
    u = t % block_m
    return (t // block_m) * _align(block_m, 128) + (u // 128) * 128 + (u % 32) * 4 + (u % 128) // 32


def shared_scale_rows(num_tokens: int, block_m: int, device=None) -> torch.Tensor:
    """Eq. (3) for tokens 0..num_tokens-1 (int64), vectorized."""
    _check_block_m(block_m)
    t = torch.arange(num_tokens, device=device)
    u = t % block_m
    return (t // block_m) * _align(block_m, 128) + (u // 128) * 128 + (u % 32) * 4 + (u % 128) // 32


def shared_scale_buffer_rows(capacity: int) -> int:
    """Rows of the staged buffer: ceil(Tmax/8) * 128, an upper bound valid for every BM candidate."""
    return math.ceil(capacity / SHARED_SCALE_ROW_GRANULE) * UTCCP_BLOCK_ROWS


def stage_shared_scales(x_sf: torch.Tensor, block_m: int, capacity: int) -> torch.Tensor:
    """x_sf int32 [T, H/128] -> the staged MN-major buffer int32 [H/128, ceil(Tmax/8)*128] in Eq. (3) order.
    Rows no token maps to are zero."""
    if x_sf.dtype != torch.int32 or x_sf.dim() != 2:
        raise ValueError(f"x_sf must be int32 [T, H/128], got {x_sf.dtype} {tuple(x_sf.shape)}")
    if x_sf.shape[0] > capacity:
        raise ValueError(f"x_sf has {x_sf.shape[0]} tokens; allowed: at most capacity={capacity}")
    staged = torch.zeros(
        x_sf.shape[1], shared_scale_buffer_rows(capacity), dtype=torch.int32, device=x_sf.device
    )
    staged[:, shared_scale_rows(x_sf.shape[0], block_m, x_sf.device)] = x_sf.t()
    return staged


def unstage_shared_scales(staged: torch.Tensor, num_tokens: int, block_m: int) -> torch.Tensor:
    """The staged buffer -> x_sf int32 [num_tokens, H/128], the inverse of stage_shared_scales."""
    return staged[:, shared_scale_rows(num_tokens, block_m, staged.device)].t().contiguous()


def transform_shared(shared) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """formats.SharedExpertWeights -> (w1, w2) in the SM103 layout with a leading expert dim of 1: FP8 tiles of
    128 bytes per row, gate/up interleaved, per-row packed scales (the (1,128,128) recipe expanded to rows)."""
    s1, s2 = shared.packed_row_scales()
    return transform((shared.w1.unsqueeze(0), s1.unsqueeze(0)), (shared.w2.unsqueeze(0), s2.unsqueeze(0)))
