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

GLM = {"num_ranks": 1, "num_experts": 32, "topk": 8, "hidden": 6144, "intermediate": 2048, "capacity": 256}


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
    assert regions["l2_act"] == (48, 2048) and regions["l2_scale"] == (48, 16)
    assert regions["l1_full_count"] == regions["l1_empty_count"] == regions["l2_empty_count"] == (6,)
    saved = ll.layer_layout(pool).total_bytes - ll.layer_layout(small).total_bytes
    # the ring rows and W1's output rows; the three signal arrays' bytes round to the alignment
    ring_bytes = (2048 - 48) * (6144 + 4 * 48 + 2048 + 4 * 16)
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


def test_tile_by_tile_tickets_with_the_w2_lag():
    rows = [5, 0, 17, 9, 30]
    tiles = [-(-r // 8) for r in rows]
    prefix = [0]
    for t in tiles:
        prefix.append(prefix[-1] + t)
    w1_ctas, w2_ctas = 3, 2
    n = prefix[-1] * (w1_ctas + w2_ctas)
    pool = [role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas) for t in range(n + 1)]
    order = [(e, bz) for e in range(5) for bz in range(tiles[e])]  # the token tiles in grouped-row order
    for lag in (None, 0, 1, 2, 100):
        reuse = [role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas, ring_reuse=True, lag=lag) for t in range(n + 1)]
        assert reuse[-1] is None and sorted(reuse[:-1]) == sorted(pool[:-1])  # the same units, once each
        w1 = [u for u in reuse if u and u[0] == "w1"]
        w2 = [u for u in reuse if u and u[0] == "w2"]
        assert w1 == [("w1", e, bx, bz) for e, bz in order for bx in range(w1_ctas)]  # tile by tile
        assert w2 == [("w2", e, bx, bz) for e, bz in order for bx in range(w2_ctas)]
        d = len(order) if lag is None else min(lag, len(order))
        for j, (e, bz) in enumerate(order):  # W2 of tile j right after W1 of tile j + lag (or after all W1)
            first_w2 = reuse.index(("w2", e, 0, bz))
            after = order[min(j + d, len(order) - 1)]
            assert first_w2 > reuse.index(("w1", after[0], w1_ctas - 1, after[1]))
            if j + d + 1 < len(order):
                nxt = order[j + d + 1]
                assert first_w2 < reuse.index(("w1", nxt[0], 0, nxt[1]))
    assert [role2.w2_lag_tiles(b, 8, 32) for b in (6, 8, 16, 64, 256)] == [0, 0, 2, 14, 62]
    assert [role2.w2_lag_tiles(b, 8, 8) for b in (6, 16, 64)] == [4, 14, 62]
    assert role2.effective_lag(4, 10, rows=48, ring_rows=48) == 10  # no row goes round: W2 after all of W1
    assert role2.effective_lag(4, 10, rows=49, ring_rows=48) == 4
    assert role2.effective_lag(-1, 10, rows=49, ring_rows=48) == 0 and role2.effective_lag(40, 10, 49, 48) == 10


def test_the_reuse_knobs_and_their_guards():
    assert role2.REUSE_BLOCK_M == sm90_layer.RING_BLOCK_M  # the reuse variants unroll over the layer's blocks
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
def run_protocol(offsets, block_n, block_m, ring_blocks, w1_ctas, w2_ctas, ctas, role1_warps, seed,
                 ring_reuse=True, lag=None):
    """A step model of one replay. Role1's warps write grouped rows in their order (row w, w + W, ...), each first
    waiting for l1_empty_target. Role2's persistent CTAs take tickets (`role2.unit_of_ticket`) and each holds the
    unit it consumes and one drawn unit that acquires its input: W1 the ring blocks of its tile (l1_full_count >=
    BM (generation + 1)), W2 every W1 unit of its tile. A W1 unit, before it stores, waits until W2 released the
    previous generation of its output rows (l2_empty_count), then releases its ring rows; a W2 unit releases
    its W1 rows. Steps pick a random runnable move. Returns "done" or "deadlock"."""
    rng = random.Random(seed)
    rows = offsets[-1]
    full, l1_empty, l2_empty = [0] * ring_blocks, [0] * ring_blocks, [0] * ring_blocks
    prefix, tiles = [0], []
    for e in range(len(offsets) - 1):
        count = offsets[e + 1] - offsets[e]
        for bz in range(-(-count // block_n)):
            first = offsets[e] + bz * block_n
            tiles.append((first, min(block_n, offsets[e + 1] - first)))
        prefix.append(len(tiles))
    n_units = len(tiles) * (w1_ctas + w2_ctas)
    order = []
    for t in range(n_units):
        role, e, _bx, bz = role2.unit_of_ticket(t, prefix, w1_ctas, w2_ctas, ring_reuse=ring_reuse, lag=lag)
        order.append((role, prefix[e] + bz))
    w1_done = [0] * len(tiles)
    cursor = list(range(role1_warps))
    next_ticket, finished = 0, 0
    held = [[] for _ in range(ctas)]  # per CTA, oldest first: [unit, acquired?]

    def blocks(j):
        return ll.blocks_of_tile(tiles[j][0], tiles[j][1], block_m)

    def rows_in(j, b):
        first, n = tiles[j]
        return min(first + n, (b + 1) * block_m) - max(first, b * block_m)

    def can_acquire(unit):
        role, j = unit
        if role == "w1":
            return all(full[b % ring_blocks] >= block_m * (b // ring_blocks + 1) for b in blocks(j))
        return w1_done[j] == w1_ctas

    def can_finish(unit):
        role, j = unit
        return role == "w2" or all(l2_empty[b % ring_blocks] >= (b // ring_blocks) * block_m * w2_ctas
                                   for b in blocks(j))

    while finished < n_units or any(c < rows for c in cursor):
        moves = []
        for w, r in enumerate(cursor):
            if r < rows and l1_empty[(r // block_m) % ring_blocks] >= (r // block_m // ring_blocks) * block_m * w1_ctas:
                moves.append(("role1", w))
        for c in range(ctas):
            if held[c] and held[c][0][1] and can_finish(held[c][0][0]):
                moves.append(("finish", c))
            if held[c] and not held[c][-1][1] and can_acquire(held[c][-1][0]):
                moves.append(("acquire", c))
            if next_ticket < n_units and (not held[c] or (len(held[c]) == 1 and held[c][0][1])):
                moves.append(("draw", c))
        if not moves:
            return "deadlock"
        kind, i = rng.choice(moves)
        if kind == "role1":
            r = cursor[i]
            full[(r // block_m) % ring_blocks] += 1 + ((block_m - rows % block_m) if r == rows - 1 and rows % block_m
                                                      else 0)
            cursor[i] += role1_warps
        elif kind == "draw":
            held[i].append([order[next_ticket], False])
            next_ticket += 1
        elif kind == "acquire":
            held[i][-1][1] = True
        else:
            role, j = held[i].pop(0)[0]
            for b in blocks(j):
                (l1_empty if role == "w1" else l2_empty)[b % ring_blocks] += rows_in(j, b)
            if role == "w1":
                w1_done[j] += 1
            finished += 1
    return "done"


@pytest.mark.parametrize("block_n", [8, 16, 32])
def test_the_protocol_model_completes_on_small_rings_with_the_kernels_tickets(block_n):
    for ring_blocks in (ll.min_reuse_ring_blocks(8), 16, 40):
        for seed in range(4):
            rng = random.Random(seed)
            counts = [rng.choice([0, 1, 3, 8, 13, 40]) for _ in range(6)]
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            tiles = sum(-(-c // block_n) for c in counts)
            lag = role2.effective_lag(role2.w2_lag_tiles(ring_blocks, 8, block_n), tiles, offsets[-1], ring_blocks * 8)
            result = run_protocol(offsets, block_n, 8, ring_blocks, w1_ctas=4, w2_ctas=3, ctas=3, role1_warps=5,
                                  seed=seed, lag=lag)
            assert result == "done", (block_n, ring_blocks, counts)


def test_the_protocol_model_deadlocks_with_other_ticket_orders():
    """One busy expert, 8-row tiles, a 6-block ring. The pool ring's order (weight-row CTA before token tile, every
    W2 unit after every W1 unit) draws every tile's first W1 CTA before any tile's last, and a lag longer than the
    ring allows puts the W2 units a W1 store waits for behind it: either way the CTAs end up holding units that
    wait for units behind them."""
    offsets = [0, 96]
    kw = {"w1_ctas": 4, "w2_ctas": 3, "ctas": 2, "role1_warps": 4, "seed": 1}
    assert run_protocol(offsets, 8, 8, 6, ring_reuse=False, **kw) == "deadlock"
    assert run_protocol(offsets, 8, 8, 6, lag=12, **kw) == "deadlock"
    assert run_protocol(offsets, 8, 8, 6, lag=role2.w2_lag_tiles(6, 8, 8), **kw) == "done"
