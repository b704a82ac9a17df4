"""The float32 reference MoE layer (Eq. (1) of the paper): the oracle for every kernel and the CPU operator.

    y_t = sum_{j in TopK(t)} g_tj W2^(j) SwiGLU(W1^(j) x_t)  +  W2s SwiGLU(W1s x_t)

Inputs are the operator's quantized inputs (FP8 x with packed UE8M0 scales, DeepGEMM's FP4 weight tuples,
optional FP8 shared-expert weights); they are dequantized exactly and the layer is evaluated in float32.
Top-k index -1 means "no expert". The k partials of a token are summed in float32 in top-k slot order and
the shared-expert partial is added last, the order the kernels' combine uses; the result is rounded to BF16.

Intermediate precision (`requantize_intermediate`):
- False (default): the whole layer in float32. This is the reference the paper's accuracy thresholds are
  measured against ("a reference forward that dequantizes the packed weights and evaluates the layer in FP32").
- True: the kernels' numerics around the exact GEMMs: L1 outputs rounded to BF16 before the activation, the
  routing weight applied before the L2 GEMM, the activation requantized to FP8 E4M3 with UE8M0 per-32 scales
  (DeepGEMM's host quantizer), every expert's L2 partial rounded to BF16 before the combine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .formats import (
    SharedExpertWeights,
    dequantize_fp4_ue8m0,
    dequantize_fp8_ue8m0,
    quantize_fp8_ue8m0,
)

WeightPair = tuple[torch.Tensor, torch.Tensor]


def swiglu(gate_up: torch.Tensor, *, alpha: float = 1.0, clamp: float | None = 10.0) -> torch.Tensor:
    """[..., 2I] with columns [gate | up] -> [..., I]: g * sigmoid(alpha * g) * u.

    g = min(gate, clamp) (clamped above only), u = clamp(up, -clamp, clamp); clamp=None disables both.
    alpha scales the sigmoid's argument (Swish-beta); alpha = 1 is DeepGEMM's silu(gate) * up.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"swiglu wants [..., 2I] with gate and up halves, got last dimension {gate_up.shape[-1]}"
        )
    gate, up = gate_up.float().chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    return gate * torch.sigmoid(alpha * gate) * up


# ----------------------------------------------------------------------------------------------- input checks
def _check_activations(
    x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
):
    if x.dtype != torch.float8_e4m3fn or x.dim() != 2:
        raise TypeError(f"x must be float8_e4m3fn [T, H], got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if x_sf.dtype != torch.int32 or tuple(x_sf.shape) != (t, h // 128) or h % 128:
        raise ValueError(
            f"x_sf must be int32 [T, H/128] = {(t, h // 128)} with H % 128 == 0, "
            f"got {x_sf.dtype} {tuple(x_sf.shape)} for H = {h}"
        )
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != t:
        raise ValueError(f"topk_idx must be int64 [T={t}, k], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must be float32 of topk_idx's shape {tuple(topk_idx.shape)}, "
            f"got {topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    if topk_idx.numel() and int(topk_idx.min()) < -1:
        raise ValueError(
            f"topk_idx entries must be expert ids >= 0 or -1 (no expert), found {int(topk_idx.min())}"
        )


def _check_expert_weights(l1_weights: WeightPair, l2_weights: WeightPair, hidden: int) -> tuple[int, int]:
    """Returns (local experts, intermediate) after checking DeepGEMM's tuple shapes."""
    (w1, w1_sf), (w2, w2_sf) = l1_weights, l2_weights
    if w1.dim() != 3 or w1.dtype != torch.int8 or w1.shape[2] * 2 != hidden:
        raise ValueError(
            f"l1_weights[0] must be int8 [E, 2I, H/2] with H = {hidden}, got {w1.dtype} {tuple(w1.shape)}"
        )
    e, two_i, _ = w1.shape
    i = two_i // 2
    want = {
        "l1 scales": (w1_sf, (e, two_i, hidden // 128), torch.int32),
        "l2 weights": (w2, (e, hidden, i // 2), torch.int8),
        "l2 scales": (w2_sf, (e, hidden, i // 128), torch.int32),
    }
    for name, (t, shape, dtype) in want.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must be {dtype} {shape} for E={e}, I={i}, H={hidden}, got {t.dtype} {tuple(t.shape)}"
            )
    if two_i % 2 or i % 128:
        raise ValueError(f"intermediate size I = {i} must be a multiple of 128")
    return e, i


def _check_shared(shared: SharedExpertWeights | None, hidden: int) -> None:
    if shared is not None and shared.hidden != hidden:
        raise ValueError(
            f"shared-expert weights have hidden size {shared.hidden}; allowed: the activations' hidden size {hidden}"
        )


# ----------------------------------------------------------------------------------------------- the math
@contextlib.contextmanager
def _float32_matmul() -> Iterator[None]:
    """Full float32 GEMMs even where the caller allowed TF32 (torch.set_float32_matmul_precision)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _ffn(
    x_rows: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    row_weights: torch.Tensor | None,
    *,
    alpha: float,
    clamp: float | None,
    requantize: bool,
) -> torch.Tensor:
    """One expert on its rows: [n, H] -> [n, H] float32 (weighted by row_weights when given)."""
    h = x_rows @ w1.T
    if requantize:
        h = h.bfloat16().float()
    act = swiglu(h, alpha=alpha, clamp=clamp)
    if row_weights is not None:
        act = act * row_weights.unsqueeze(-1)
    if requantize:
        act = dequantize_fp8_ue8m0(*quantize_fp8_ue8m0(act))
    out = act @ w2.T
    return out.bfloat16().float() if requantize else out


def _routed_partials(
    x_rows: torch.Tensor,
    local_expert: torch.Tensor,
    weights: torch.Tensor,
    l1_weights: WeightPair,
    l2_weights: WeightPair,
    *,
    alpha: float,
    clamp: float | None,
    requantize: bool,
) -> torch.Tensor:
    """Per (token, expert) assignment: g * W2 SwiGLU(W1 x), [N, H] float32; rows may repeat a token.

    Rows are grouped by expert (stable, so each group keeps its arrival order) and only the experts that
    receive rows are dequantized, one at a time, which bounds memory at real model shapes.
    """
    out = torch.empty_like(x_rows)
    if local_expert.numel() == 0:
        return out
    order = torch.argsort(local_expert, stable=True)
    counts = torch.bincount(local_expert, minlength=l1_weights[0].shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        w1 = dequantize_fp4_ue8m0(l1_weights[0][expert], l1_weights[1][expert])
        w2 = dequantize_fp4_ue8m0(l2_weights[0][expert], l2_weights[1][expert])
        out[rows] = _ffn(x_rows[rows], w1, w2, weights[rows], alpha=alpha, clamp=clamp, requantize=requantize)
    return out


def _combine(
    num_tokens: int,
    hidden: int,
    token: torch.Tensor,
    slot: torch.Tensor,
    partials: torch.Tensor,
    topk: int,
    shared_partial: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Sum partials per token in top-k slot order, then the shared partial; round to BF16."""
    y = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for j in range(topk):  # each token appears at most once per slot, so every add is a plain sum
        in_slot = slot == j
        y.index_add_(0, token[in_slot], partials[in_slot])
    if shared_partial is not None:
        y += shared_partial
    return y.bfloat16()


def _shared_partial(
    x_f32: torch.Tensor,
    shared: SharedExpertWeights | None,
    *,
    alpha: float,
    clamp: float | None,
    requantize: bool,
) -> torch.Tensor | None:
    if shared is None:
        return None
    w1, w2 = shared.dequantize()
    return _ffn(x_f32, w1, w2, None, alpha=alpha, clamp=clamp, requantize=requantize)


# ----------------------------------------------------------------------------------------------- single process
@_float32_matmul()
def moe_reference(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: WeightPair,
    l2_weights: WeightPair,
    *,
    activation_alpha: float = 1.0,
    activation_clamp: float | None = 10.0,
    shared_weights: SharedExpertWeights | None = None,
    expert_offset: int = 0,
    requantize_intermediate: bool = False,
) -> torch.Tensor:
    """Eq. (1) in float32 -> bf16 [T, H].

    x float8_e4m3fn [T, H], x_sf int32 [T, H/128], topk_idx int64 [T, k] (-1 = no expert), topk_weights
    float32 [T, k]; l1_weights/l2_weights hold experts [expert_offset, expert_offset + E_local) in DeepGEMM's
    FP4 layout. Assignments to other experts contribute nothing (they live on other ranks).
    """
    _check_activations(x, x_sf, topk_idx, topk_weights)
    t, h = x.shape
    num_local, _ = _check_expert_weights(l1_weights, l2_weights, h)
    _check_shared(shared_weights, h)
    x_f32 = dequantize_fp8_ue8m0(x, x_sf)
    local = topk_idx - expert_offset
    mine = (topk_idx >= 0) & (local >= 0) & (local < num_local)
    token, slot = mine.nonzero(as_tuple=True)  # (token, slot) pairs in token-major order
    numerics = {"alpha": activation_alpha, "clamp": activation_clamp, "requantize": requantize_intermediate}
    partials = _routed_partials(
        x_f32[token], local[token, slot], topk_weights[token, slot], l1_weights, l2_weights, **numerics
    )
    shared = _shared_partial(x_f32, shared_weights, **numerics)
    return _combine(t, h, token, slot, partials, topk_idx.shape[1], shared, x.device)


# ----------------------------------------------------------------------------------------------- expert parallel
def _all_to_all(
    payload: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    out = payload.new_empty((sum(recv_counts), *payload.shape[1:]))
    dist.all_to_all_single(
        out,
        payload.contiguous(),
        output_split_sizes=list(recv_counts),
        input_split_sizes=list(send_counts),
        group=group,
    )
    return out


def _byte_field(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns [start, stop) of a uint8 payload reinterpreted as dtype (copied into fresh row-major storage,
    since a strided slice cannot be viewed as a wider dtype)."""
    return rows[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


@_float32_matmul()
def moe_reference_ep(
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: WeightPair,
    l2_weights: WeightPair,
    *,
    num_experts: int,
    activation_alpha: float = 1.0,
    activation_clamp: float | None = 10.0,
    shared_weights: SharedExpertWeights | None = None,
    requantize_intermediate: bool = False,
) -> torch.Tensor:
    """Expert-parallel Eq. (1) over a torch.distributed group -> bf16 [T_rank, H] for this rank's tokens.

    Rank r owns experts [r*E/P, (r+1)*E/P) (l1/l2 hold exactly those). Each (token, expert) assignment is
    dispatched to its owner with an all-to-all (counts first, then one byte payload per assignment: the FP8
    row, its packed scales, the expert id and the routing weight); owners return float32 partials through a
    second all-to-all and the source rank combines them in top-k slot order. The shared expert runs locally.
    Works on gloo (CPU tensors) and NCCL (CUDA tensors); every rank must call it, also with zero tokens.
    """
    _check_activations(x, x_sf, topk_idx, topk_weights)
    t, h = x.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"num_experts = {num_experts} must be divisible by the group size {world}")
    per_rank = num_experts // world
    num_local, _ = _check_expert_weights(l1_weights, l2_weights, h)
    if num_local != per_rank:
        raise ValueError(
            f"rank {rank} holds {num_local} experts, but {num_experts} experts over {world} ranks "
            f"means {per_rank} per rank"
        )
    if topk_idx.numel() and int(topk_idx.max()) >= num_experts:
        raise ValueError(
            f"topk_idx has expert {int(topk_idx.max())}, allowed are -1 and 0..{num_experts - 1}"
        )
    _check_shared(shared_weights, h)
    numerics = {"alpha": activation_alpha, "clamp": activation_clamp, "requantize": requantize_intermediate}

    # dispatch: assignments sorted by owner rank, token-major within an owner
    token, slot = (topk_idx >= 0).nonzero(as_tuple=True)
    expert = topk_idx[token, slot]
    by_owner = torch.argsort(expert // per_rank, stable=True)
    token, slot, expert = token[by_owner], slot[by_owner], expert[by_owner]
    send_counts = torch.bincount(expert // per_rank, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()

    sf_bytes = x_sf.shape[1] * 4
    payload = torch.cat(
        [
            x[token].view(torch.uint8),
            x_sf[token].view(torch.uint8),
            expert.unsqueeze(1).view(torch.uint8),
            topk_weights[token, slot].unsqueeze(1).view(torch.uint8),
        ],
        dim=1,
    )
    received = _all_to_all(payload, send_counts, recv_counts, group)
    recv_x = _byte_field(received, 0, h, torch.float8_e4m3fn)
    recv_sf = _byte_field(received, h, h + sf_bytes, torch.int32)
    recv_expert = _byte_field(received, h + sf_bytes, h + sf_bytes + 8, torch.int64).squeeze(1)
    recv_weight = _byte_field(received, h + sf_bytes + 8, h + sf_bytes + 12, torch.float32).squeeze(1)

    # owners compute, then partials travel back along the reverse split
    partials = _routed_partials(
        dequantize_fp8_ue8m0(recv_x, recv_sf),
        recv_expert - rank * per_rank,
        recv_weight,
        l1_weights,
        l2_weights,
        **numerics,
    )
    returned = _all_to_all(partials, recv_counts, send_counts, group)

    shared = _shared_partial(dequantize_fp8_ue8m0(x, x_sf), shared_weights, **numerics)
    return _combine(t, h, token, slot, returned, topk_idx.shape[1], shared, x.device)
