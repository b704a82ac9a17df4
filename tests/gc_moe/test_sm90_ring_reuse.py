"""A token ring smaller than the pool, reused within a replay (GC_MOE_RING_BLOCKS): the shape and its regions, the
host twins of role1's wait targets and role2's row-count releases, the fused kernel's tile-by-tile tickets, the
guards, and a step model of the protocol that shows why the ticket order keeps the waits acyclic (it completes at
the smallest ring the layer allows, and the pool-order tickets deadlock on the same small ring)."""

import random

import pytest

from gc_moe.kernels.sm90 import dispatch, role2
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.kernels.sm90 import layer as sm90_layer
from gc_moe.kernels.sm90 import layer_layout as ll

GLM = dict(num_ranks=1, num_experts=32, topk=8, hidden=6144, intermediate=2048, capacity=256)


def shape(ring_blocks="auto", **kw):
    args = {**GLM, **kw}
    return sm90_layer.layer_shape(args["num_ranks"], args["num_experts"], args["topk"], args["hidden"],
                                  args["intermediate"], args["capacity"], ring_blocks=ring_blocks)


def test_a_bounded_ring_keeps_the_pool_sized_routing_words_and_shrinks_the_ring_regions():
    pool, small = shape(), shape(ring_blocks=6)
    assert (pool.pool_blocks, pool.ring_blocks, pool.ring_reuse) == (256, 256, False)
    assert (small.pool_blocks, small.ring_blocks, small.ring_rows, small.ring_reuse) == (256, 6, 48, True)
    assert shape(ring_blocks=400).ring_blocks == 256 and not shape(ring_blocks=400).ring_reuse  # capped at the pool
    regions = {r.name: r.shape for r in ll.layer_regions(small)}
    assert regions["ring_act"] == (48, 6144) and regions["ring_scale"] == (48, 48)
    assert regions["routing_weight"] == regions["dest_row"] == regions["ring_source"] == (2048,)
    assert regions["l2_act"] == (2048, 2048) and regions["l1_full_count"] == regions["l1_empty_count"] == (6,)
    saved = ll.layer_layout(pool).total_bytes - ll.layer_layout(small).total_bytes
    ring_bytes = (2048 - 48) * (6144 + 4 * 48)  # the ring rows; the three signal arrays' bytes round to the alignment
    assert ring_bytes <= saved <= ring_bytes + 3 * 4 * 256


def test_the_smallest_reused_ring_is_one_block_more_than_a_tile_can_span():
    assert ll.min_reuse_ring_blocks(8) == 6  # a 32-row tile starting at row 7 of a block spans 5 blocks
    assert max(len(ll.blocks_of_tile(first, 32, 8)) for first in range(8)) == ll.min_reuse_ring_blocks(8) - 1
    with pytest.raises(ValueError, match="ring_blocks_limit: got 5; allowed: 0 .* or at least 6 blocks of 8 rows"):
        shape(ring_blocks=5)


def test_ring_blocks_from_the_environment():
    env = sm90_layer.RING_BLOCKS_ENV
    assert sm90_layer.ring_blocks_from_env({}) == "auto" == sm90_layer.ring_blocks_from_env({env: "auto"})
    assert sm90_layer.ring_blocks_from_env({env: "6"}) == 6
    for bad in ("5", "0", "-8", "six", "6.5"):
        with pytest.raises(ValueError, match=f"{env}={bad!r}; allowed: auto .* >= 6"):
            sm90_layer.ring_blocks_from_env({env: bad})


def test_role1_waits_for_every_w1_read_of_the_previous_generation():
    s = shape(ring_blocks=6)
    w1_ctas = 2 * s.intermediate // gg.ROWS_PER_CTA
    assert ll.l1_readers(s) == 8 * w1_ctas == 128
    assert [ll.l1_empty_target(r, s) for r in (0, 47, 48, 55, 56, 96, 2047)] == [0, 0, 128, 128, 128, 256, 42 * 128]
    # what the reuse-mode W1 leaves after 100 rows: 12 full blocks and 4 rows of a 13th over 6 ring blocks
    counts = ll.expected_l1_empty_counts_by_rows(100, s)
    assert counts == [2 * 128 + 4 * w1_ctas, 256, 256, 256, 256, 256]
    # the l1_full padding of the last partial block lands with its last row, after the block's previous generation
    assert ll.l1_full_counts_after_dispatch(100, s) == [24, 16, 16, 16, 16, 16]


def test_dispatch_arguments_carry_the_pool_and_the_wait_unit():
    from types import SimpleNamespace

    import torch

    for s, readers in ((shape(), 0), (shape(ring_blocks=6), 128)):
        ws = SimpleNamespace(**{r.name: torch.zeros(1) for r in ll.layer_regions(s)})
        args = dispatch.dispatch_args(ws, s, 4, 0)
        names = [n for n, _ in dispatch.PARAMS]
        assert len(args) == len(names)
        values = {n: int.from_bytes(a.data, "little", signed=True) for n, a in zip(names, args) if n in (
            "ring_blocks", "pool_blocks", "l1_readers")}
        assert values == {"ring_blocks": s.ring_blocks, "pool_blocks": 256, "l1_readers": readers}


def test_tile_by_tile_tickets_visit_the_w1_units_in_grouped_row_order():
    rows = [5, 0, 17, 9]
    tiles = [-(-r // 8) for r in rows]
    prefix = [0]
    for t in tiles:
        prefix.append(prefix[-1] + t)
    w1_ctas, w2_ctas = 3, 2
    n = prefix[-1] * (w1_ctas + w2_ctas)
    reuse = [role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas, ring_reuse=True) for t in range(n + 1)]
    pool = [role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas) for t in range(n + 1)]
    assert reuse[-1] is None and sorted(reuse[:-1]) == sorted(pool[:-1])  # the same units, once each
    w1 = [u for u in reuse if u and u[0] == "w1"]
    assert w1 == [("w1", e, bx, bz) for e in range(4) for bz in range(tiles[e]) for bx in range(w1_ctas)]
    assert [u for u in reuse if u and u[0] == "w2"] == [u for u in pool if u and u[0] == "w2"]


def test_the_reuse_knobs_and_their_guards():
    assert dict(role2.variant(8, ring_reuse=True).params)["ring_reuse"] is True
    assert "ring_reuse" not in dict(role2.variant(8).params)  # the pool ring's variants keep their cache keys
    assert role2.Role2Config(16, ring_reuse=True).half("w1").ring_reuse
    with pytest.raises(ValueError, match="ring_reuse is a knob of the fused role2 halves"):
        gg.GemmConfig("w1", 8, ring_consumer=True, ring_reuse=True)
    from types import SimpleNamespace

    ws = SimpleNamespace(control=SimpleNamespace(data_ptr=lambda: 0), l1_full_count=None, l1_empty_count=None)
    with pytest.raises(ValueError, match="read by the fused role2 kernel only"):
        gg.ring_args_w1(ws, shape(ring_blocks=6))
    small = shape(ring_blocks=6)
    with pytest.raises(ValueError, match="role2_nodes 2 with a ring of 6 blocks reused"):
        sm90_layer.Sm90Layer(small, device="cpu", role2_nodes=2, overlap_roots=True)
    with pytest.raises(ValueError, match="overlap_roots False with a ring of 6 blocks"):
        sm90_layer.Sm90Layer(small, device="cpu", overlap_roots=False)
    assert "ring 6 of 256 blocks, reused" in sm90_layer.settings_note(4, 128, True, ring_blocks=6, pool_blocks=256)
    assert "ring" not in sm90_layer.settings_note(4, 128, True, ring_blocks=256, pool_blocks=256)


# ------------------------------------------------------------------------------------------------ protocol model
def run_protocol(offsets, block_n, block_m, ring_blocks, w1_ctas, ctas, role1_warps, ticket_rows_first, seed):
    """A step model of one replay: role1's warps write grouped rows in their order (row w, w + W, ...), each first
    waiting for l1_empty_target; role2's persistent CTAs each hold the unit they consume and one drawn next unit
    that acquires its tile's blocks (l1_full_count >= BM (generation + 1)); a consumed W1 unit releases the rows
    it read. Steps pick a random runnable actor. Returns "done" or "deadlock"."""
    rng = random.Random(seed)
    rows = offsets[-1]
    full, empty = [0] * ring_blocks, [0] * ring_blocks
    tiles = []  # (first row, rows) of each (expert, token tile)
    order = []
    for e in range(len(offsets) - 1):
        for bz in range(-(-(offsets[e + 1] - offsets[e]) // block_n)):
            first = offsets[e] + bz * block_n
            tiles.append((first, min(block_n, offsets[e + 1] - first)))
        per_expert = tiles[len(tiles) - -(-(offsets[e + 1] - offsets[e]) // block_n):]
        if ticket_rows_first:  # tile by tile, weight-row CTAs fastest (the reuse tickets)
            order += [t for t in per_expert for _ in range(w1_ctas)]
        else:  # weight-row CTA by weight-row CTA, token tiles fastest (the pool ring's tickets)
            order += [t for _ in range(w1_ctas) for t in per_expert]
    cursor = [w for w in range(role1_warps)]
    next_ticket = 0
    held = [[] for _ in range(ctas)]  # per CTA: [consuming unit?, acquiring unit]
    readers = block_m * w1_ctas

    def blocks(tile):
        return ll.blocks_of_tile(tile[0], tile[1], block_m)

    def acquired(tile):
        return all(full[b % ring_blocks] >= block_m * (b // ring_blocks + 1) for b in blocks(tile))

    done_units = 0
    while done_units < len(order) or any(c < rows for c in cursor):
        moves = []
        for w, r in enumerate(cursor):
            if r < rows and empty[(r // block_m) % ring_blocks] >= (r // block_m // ring_blocks) * readers:
                moves.append(("role1", w))
        for c in range(ctas):
            if held[c] and held[c][0][1] == "consuming":
                moves.append(("consume", c))
            elif held[c] and acquired(held[c][-1][0]):
                moves.append(("acquire", c))
            if len(held[c]) < 2 and next_ticket < len(order) and (not held[c] or held[c][-1][1] == "consuming"):
                moves.append(("draw", c))
        if not moves:
            return "deadlock"
        kind, i = rng.choice(moves)
        if kind == "role1":
            r = cursor[i]
            landed = 1 + ((block_m - rows % block_m) if r == rows - 1 and rows % block_m else 0)
            full[(r // block_m) % ring_blocks] += landed
            cursor[i] += role1_warps
        elif kind == "draw":
            held[i].append([order[next_ticket], "acquiring"])
            next_ticket += 1
        elif kind == "acquire":
            held[i][-1][1] = "consuming"
            if len(held[i]) == 2:  # the older one is still consumed first: keep the order
                held[i][-1][1] = "acquired"
        else:
            tile = held[i].pop(0)[0]
            for b in blocks(tile):
                lo, hi = max(tile[0], b * block_m), min(tile[0] + tile[1], (b + 1) * block_m)
                empty[b % ring_blocks] += hi - lo
            done_units += 1
            if held[i] and held[i][0][1] == "acquired":
                held[i][0][1] = "consuming"
    return "done"


@pytest.mark.parametrize("block_n", [8, 16, 32])
def test_the_protocol_model_completes_at_the_smallest_ring_with_tile_by_tile_tickets(block_n):
    s = shape(ring_blocks=ll.min_reuse_ring_blocks(8))
    for seed in range(6):
        rng = random.Random(seed)
        counts = [rng.choice([0, 1, 3, 8, 13, 40]) for _ in range(6)]
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        assert run_protocol(offsets, block_n, 8, s.ring_blocks, w1_ctas=4, ctas=3, role1_warps=5,
                            ticket_rows_first=True, seed=seed) == "done", (block_n, counts)


def test_the_protocol_model_deadlocks_with_the_pool_rings_ticket_order():
    """One busy expert, 8-row tiles, a 6-block ring: the pool order draws every tile's first weight-row CTA
    before any tile's last, so the CTAs end up holding units that wait for rows role1 cannot write yet."""
    offsets = [0, 96]
    assert run_protocol(offsets, 8, 8, 6, w1_ctas=4, ctas=2, role1_warps=4, ticket_rows_first=False,
                        seed=1) == "deadlock"
    assert run_protocol(offsets, 8, 8, 6, w1_ctas=4, ctas=2, role1_warps=4, ticket_rows_first=True,
                        seed=1) == "done"
