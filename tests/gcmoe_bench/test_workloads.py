"""Workloads: counts from the actual routing (against a per-assignment loop), consistent slices across ranks."""

from __future__ import annotations

import dataclasses
import random

import torch

from gcmoe_bench.models import ModelShape, table4_models
from gcmoe_bench.workloads import build_weights, build_workload, expert_bytes, routing_counts

TINY = ModelShape(name="tiny", base="glm-5.2", hidden=256, intermediate=128, num_experts=16, topk=4,
                  num_shared_experts=1, shared_k_group=128, capacity=16)


def loop_counts(topk_idx: torch.Tensor, model: ModelShape, ranks: int, tokens: int) -> tuple[int, int, int]:
    """The definitions of docs/ARCHITECTURE.md, one assignment at a time."""
    per_rank = model.num_experts // ranks
    assignments = remote = 0
    active: dict[int, set[int]] = {r: set() for r in range(ranks)}
    for row, experts in enumerate(topk_idx.tolist()):
        for e in experts:
            if e < 0:
                continue
            assignments += 1
            owner = e // per_rank
            remote += owner != row // tokens
            active[owner].add(e)
    # per owner: unique active experts' FP4 W1 [2I, H] + W2 [H, I] bytes plus one scale byte per 32 weights
    h, i = model.hidden, model.intermediate
    per_expert = (2 * i * h) // 2 + (h * i) // 2 + (2 * i * h) // 32 + (h * i) // 32
    return assignments, remote, sum(len(s) for s in active.values()) * per_expert


def test_counts_match_a_loop_on_random_routing_with_empty_slots():
    for _ in range(5):
        ranks = random.choice([1, 2, 4, 8])
        tokens = random.randint(1, 16)
        idx = torch.stack([torch.randperm(TINY.num_experts)[: TINY.topk] for _ in range(ranks * tokens)])
        idx[torch.rand(idx.shape) < 0.3] = -1
        c = routing_counts(idx, TINY, ranks, tokens)
        assert (c.assignments, c.remote_assignments, c.hbm_working_set_bytes) == loop_counts(idx, TINY, ranks, tokens)


def test_expert_bytes_of_the_paper_models():
    glm = table4_models()["glm-5.2"]
    # W1 2*2048*6144 + W2 6144*2048 FP4 weights = 37,748,736 values: 18,874,368 bytes + 1,179,648 scale bytes
    assert expert_bytes(glm) == 18_874_368 + 1_179_648


def test_workload_rows_are_each_ranks_slice_of_one_global_routing():
    ranks, tokens = 4, 5
    weights = [build_weights(TINY, ranks, r, shared_experts=1, seed=3) for r in range(ranks)]
    loads = [build_workload(TINY, tokens, ranks, r, shared_experts=1, weights=weights[r], seed=3)
             for r in range(ranks)]
    global_idx = torch.cat([w.topk_idx for w in loads])
    expected = loop_counts(global_idx, TINY, ranks, tokens)
    for w in loads:
        assert dataclasses.astuple(w.counts) == expected  # every rank derives the same whole-layer counts
        assert w.x.shape == (tokens, TINY.hidden) and w.x.dtype == torch.float8_e4m3fn
        assert w.x_sf.shape == (tokens, TINY.hidden // 128) and w.x_sf.dtype == torch.int32
        assert w.topk_idx.shape == (tokens, TINY.topk) and w.topk_weights.shape == (tokens, TINY.topk)
        assert torch.allclose(w.topk_weights.sum(1), torch.ones(tokens))
        assert w.weights.l1[0].shape == (TINY.num_experts // ranks, 2 * TINY.intermediate, TINY.hidden // 2)
    # expert j has the same weights whatever the rank count: rank r of 4 holds experts 4r..4r+3 of the 1-rank set
    whole = build_weights(TINY, 1, 0, shared_experts=0, seed=3)
    for r, w in enumerate(weights):
        rows = slice(r * 4, r * 4 + 4)
        for mine, full in zip((*w.l1, *w.l2), (*whole.l1, *whole.l2)):
            assert torch.equal(mine, full[rows])
    # the same point rebuilt is the same input (every operator sees identical inputs)
    again = build_workload(TINY, tokens, ranks, 2, shared_experts=1, weights=weights[2], seed=3)
    assert torch.equal(again.x.view(torch.uint8), loads[2].x.view(torch.uint8))
    assert torch.equal(again.topk_idx, loads[2].topk_idx)


def test_clone_owns_its_storage():
    w = build_workload(TINY, 3, 2, 1, shared_experts=1, weights=build_weights(TINY, 2, 1, shared_experts=1, seed=0))
    c = w.clone()
    assert torch.equal(c.x.view(torch.uint8), w.x.view(torch.uint8)) and c.x.data_ptr() != w.x.data_ptr()
    assert c.weights.l1[0].data_ptr() != w.weights.l1[0].data_ptr()
    assert c.weights.shared is not None and c.nbytes() == w.nbytes() > 0
