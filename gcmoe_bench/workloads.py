"""One sweep point's inputs: routing, quantized activations and weights, and the counts points.csv reports.

Every rank builds the *global* routing of the point from the same seed (it is small: T*P rows of k ids) and
keeps its own rows, so the assignment counts and the HBM working set come from the actual routing without any
communication. Weights depend only on the model and the rank, so they are built once per model and reused
across token counts; all operators of a point see identical inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from gcmoe_bench.models import ModelShape

FP4_BYTES_PER_VALUE = 0.5
SCALE_BYTES_PER_32_VALUES = 1  # one UE8M0 byte per 32 weights (packed four to an int32)


@dataclass(frozen=True)
class WorkloadCounts:
    """Counts over all ranks of one point, from its actual routing (docs/ARCHITECTURE.md, points.csv)."""

    assignments: int  # valid (token, expert) pairs
    remote_assignments: int  # pairs whose expert lives on another rank than the token
    hbm_working_set_bytes: int  # unique active experts' FP4 W1 + W2 bytes plus packed scales, each counted once


@dataclass
class Weights:
    """One rank's quantized expert weights (its E/P local experts), and the shared expert when the suite has one."""

    l1: tuple[torch.Tensor, torch.Tensor]
    l2: tuple[torch.Tensor, torch.Tensor]
    shared: Any | None = None


@dataclass
class Workload:
    """What one rank feeds an operator at one point."""

    model: ModelShape
    tokens_per_rank: int
    num_ranks: int
    rank: int
    shared_experts: int
    x: torch.Tensor  # float8_e4m3fn [T, H]
    x_sf: torch.Tensor  # int32 [T, H/128]
    topk_idx: torch.Tensor  # int64 [T, k], global expert ids, -1 = none
    topk_weights: torch.Tensor  # float32 [T, k]
    weights: Weights
    counts: WorkloadCounts

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def experts_per_rank(self) -> int:
        return self.model.experts_per_rank(self.num_ranks)

    def clone(self) -> Workload:
        """A copy with its own storage for every tensor (for ``--l2 rotate``: each copy starts cold in L2)."""
        return replace(
            self,
            x=self.x.clone(),
            x_sf=self.x_sf.clone(),
            topk_idx=self.topk_idx.clone(),
            topk_weights=self.topk_weights.clone(),
            weights=Weights(
                l1=tuple(t.clone() for t in self.weights.l1),
                l2=tuple(t.clone() for t in self.weights.l2),
                shared=_clone_tree(self.weights.shared),
            ),
        )

    def nbytes(self) -> int:
        """Bytes this rank's copy occupies (inputs plus weights), to size rotation."""
        tensors = [self.x, self.x_sf, self.topk_idx, self.topk_weights, *self.weights.l1, *self.weights.l2]
        return sum(t.numel() * t.element_size() for t in tensors) + _tree_nbytes(self.weights.shared)


def stable_seed(*parts: object) -> int:
    """A seed from names and numbers, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def shared_recipe(model: ModelShape) -> tuple[int, int, int]:
    """The shared expert's FP8 scale recipe from its K group (Table 4): per-32 UE8M0 scales, or 128x128 blocks."""
    return (1, 1, 32) if model.shared_k_group == 32 else (1, 128, 128)


def expert_bytes(model: ModelShape) -> int:
    """HBM bytes one routed expert streams: FP4 W1 [2I, H] and W2 [H, I] plus their UE8M0 scales."""
    values = 2 * model.intermediate * model.hidden + model.hidden * model.intermediate
    return int(values * FP4_BYTES_PER_VALUE + values // 32 * SCALE_BYTES_PER_32_VALUES)


def routing_counts(topk_idx: torch.Tensor, model: ModelShape, num_ranks: int, tokens_per_rank: int) -> WorkloadCounts:
    """Counts of the global routing ``topk_idx`` [P*T, k] (rows of rank r at r*T .. r*T+T-1)."""
    experts_per_rank = model.experts_per_rank(num_ranks)
    valid = topk_idx >= 0
    source_rank = torch.arange(topk_idx.shape[0], device=topk_idx.device).div(
        tokens_per_rank, rounding_mode="floor").unsqueeze(1).expand_as(topk_idx)
    owner_rank = topk_idx.div(experts_per_rank, rounding_mode="floor")
    unique_experts = torch.unique(topk_idx[valid]).numel()
    return WorkloadCounts(
        assignments=int(valid.sum()),
        remote_assignments=int((valid & (owner_rank != source_rank)).sum()),
        hbm_working_set_bytes=unique_experts * expert_bytes(model),
    )


def build_weights(model: ModelShape, num_ranks: int, rank: int, *, shared_experts: int, seed: int,
                  device: torch.device | str = "cpu") -> Weights:
    """This rank's local experts [rank*E/P, (rank+1)*E/P) (and the shared expert), quantized.

    Expert j's weights depend only on (seed, model, j), so any rank count slices the same layer."""
    from gc_moe import cases

    # quantized on the target device: at production shapes that is far faster than on the host
    l1, l2 = cases.random_moe_weights(
        model.num_experts, model.hidden, model.intermediate, seed=stable_seed(seed, model.name, "experts"),
        experts=cases.local_experts(model.num_experts, num_ranks, rank), device=device)
    shared = None
    if shared_experts:
        shared = cases.random_shared_expert_weights(model.hidden, model.intermediate,
                                                    seed=stable_seed(seed, model.name, "shared"),
                                                    recipe=shared_recipe(model), device=device)
    return Weights(l1=l1, l2=l2, shared=shared)


def build_workload(model: ModelShape, tokens_per_rank: int, num_ranks: int, rank: int, *, shared_experts: int,
                   weights: Weights, routing: str = "uniform", seed: int = 0,
                   device: torch.device | str = "cpu") -> Workload:
    """The inputs rank ``rank`` feeds at one point: its rows of the global routing and its activations."""
    from gc_moe import cases

    if not 1 <= tokens_per_rank <= model.capacity:
        raise ValueError(f"tokens_per_rank = {tokens_per_rank}; allowed: 1..{model.capacity} (the capacity)")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank = {rank}; allowed: 0..{num_ranks - 1}")
    # every rank draws every rank's routing (T x k ids each, cheap) so the counts cover the whole layer
    per_rank = [
        cases.make_routing(routing, tokens_per_rank, model.num_experts, model.topk, num_ranks=num_ranks,
                           source_rank=r, seed=stable_seed(seed, model.name, "routing", tokens_per_rank, r))
        for r in range(num_ranks)
    ]
    topk_idx = torch.cat([idx for idx, _ in per_rank])
    topk_weights = torch.cat([w for _, w in per_rank])
    rows = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    x, x_sf = cases.random_activations(tokens_per_rank, model.hidden,
                                       seed=stable_seed(seed, model.name, "activations", tokens_per_rank, rank))
    return Workload(
        model=model,
        tokens_per_rank=tokens_per_rank,
        num_ranks=num_ranks,
        rank=rank,
        shared_experts=shared_experts,
        x=x.to(device),
        x_sf=x_sf.to(device),
        topk_idx=topk_idx[rows].contiguous().to(device),
        topk_weights=topk_weights[rows].contiguous().to(device),
        weights=weights,
        counts=routing_counts(topk_idx, model, num_ranks, tokens_per_rank),
    )


def _to(tree: Any, device: torch.device | str) -> Any:
    return _map_tensors(tree, lambda t: t.to(device))


def _clone_tree(tree: Any) -> Any:
    return _map_tensors(tree, torch.Tensor.clone)


def _tree_nbytes(tree: Any) -> int:
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    _map_tensors(tree, count)
    return total


def _map_tensors(tree: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in tuples, lists, dicts and dataclasses (the shared-weight container)."""
    import dataclasses

    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(_map_tensors(t, fn) for t in tree)
    if isinstance(tree, list):
        return [_map_tensors(t, fn) for t in tree]
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if dataclasses.is_dataclass(tree):
        return dataclasses.replace(tree, **{f.name: _map_tensors(getattr(tree, f.name), fn)
                                            for f in dataclasses.fields(tree) if f.init})
    return tree
