"""SM90 grouped GEMM: offline builds of every variant (CPU, CuTe DSL) and the on-GPU check against float32."""

import dataclasses
import json
import re
import struct
import types

import pytest
import torch
from gc_moe.formats import (
    E2M1_VALUES,
    dequantize_fp4_ue8m0,
    dequantize_fp8_k128,
    pack_fp4,
    pack_ue8m0,
    quantize_fp8_k128,
)
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.weights import sm90 as wsm90


def test_config_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="block_n must be one of"):
        gg.GemmConfig("w1", 12)
    with pytest.raises(ValueError, match="role must be"):
        gg.GemmConfig("w3")
    with pytest.raises(ValueError, match="multiple of 256"):
        gg.grid(gg.GemmConfig("w2", 8), 320, 4, 8)
    assert gg.grid(gg.GemmConfig("w1", 16), 4608, 48, 33) == (3, 18, 48)  # token tiles fastest
    assert gg.grid(gg.GemmConfig("w1", 16, token_tiles_fastest=False), 4608, 48, 33) == (18, 48, 3)


def test_split_k_knob_its_grid_parameters_and_buffers():
    cfg = gg.GemmConfig("w1", 8, k_splits=3)
    assert gg.grid(cfg, 4096, 32, 5) == (3, 16, 32)  # a token tile's splits are its neighbours in x
    assert [n for n, _ in cfg.params][-2:] == ["split_partials", "split_counts"] and cfg.name.endswith("_k3_ws2")
    assert dict(gg.variant("w1", 16, k_splits=2).params)["k_splits"] == 2
    assert "k_splits" not in dict(gg.variant("w1", 8).params)  # the default variants keep their cache keys
    assert dict(gg.variant("w2", 8, k_splits=3).params)["k_splits"] == 3
    w2 = gg.GemmConfig("w2", 16, k_splits=2)
    assert [n for n, _ in w2.params] == [n for n, _ in gg.PARAMS_W2 + gg.SPLIT_PARAMS] and "_k2_" in w2.name
    # sets may name the knob everywhere: tile 32 and the cp.async pipeline drop it; a set splits W1 and W2 apart
    assert "k_splits" not in dict(gg.variant("w1", 32, k_splits=3).params)
    assert "k_splits" not in dict(gg.variant("w1", 64, k_splits=3).params)
    by_role = {(dict(v.params)["role"], dict(v.params)["block_n"]): dict(v.params).get("k_splits", 1)
               for v in gg.variant_set(k_splits=3, w2_k_splits=2)}
    assert by_role == {("w1", 8): 3, ("w1", 16): 3, ("w1", 32): 1, ("w1", 64): 1,
                       ("w2", 8): 2, ("w2", 16): 2, ("w2", 32): 1, ("w2", 64): 1}
    for bad in ({"k_splits": 5}, {"k_splits": 2, "ring_consumer": True}, {"k_splits": 2, "fold_scales": True},
                {"k_splits": 2, "block_n": 32}, {"k_splits": 2, "role": "w2", "compact_grid": True}):
        kw = {"role": "w1", "block_n": 8, **bad}
        with pytest.raises(ValueError, match="k_splits .* allowed 1, or one of"):
            gg.GemmConfig(**kw)
    built = [v for v in gg.all_variants() if dict(v.params).get("k_splits")]
    assert sorted((dict(v.params)["role"], dict(v.params)["block_n"], dict(v.params)["k_splits"]) for v in built) == [
        (role, bn, ks) for role in ("w1", "w2") for bn in (8, 16) for ks in (2, 3, 4)]

    class Fake:  # split_buffers reads only the loaded kernel's variant parameters
        def __init__(self, variant):
            self.entry = type("E", (), {"variant": variant})()

    from types import SimpleNamespace

    mat = SimpleNamespace(rows=4096, num_experts=32)
    partials, counts = gg.split_buffers(Fake(gg.variant("w1", 8, k_splits=3)), mat, 5, "cpu")
    assert counts.shape == (16 * 32,) and partials.shape == (16 * 32 * 3 * gg.THREADS * 4,)
    assert int(counts.abs().sum()) == 0 and gg.split_buffers(Fake(gg.variant("w1", 8)), mat, 5, "cpu") is None
    w2_mat = SimpleNamespace(rows=6144, num_experts=32)  # W2's rows are H: 24 weight-row CTAs
    partials, counts = gg.split_buffers(Fake(gg.variant("w2", 16, k_splits=2)), w2_mat, 20, "cpu")
    assert counts.shape == (2 * 24 * 32,) and partials.shape == (2 * 24 * 32 * 2 * gg.THREADS * 8,)


@pytest.mark.parametrize("units,k_blocks,ctas", [(1, 4, 264), (162, 40, 264), (36, 32, 132), (7, 3, 5),
                                                  (1000, 18, 132), (3, 48, 2)])
def test_stream_k_partition_covers_every_step_once(units, k_blocks, ctas):
    """The stream-K CTAs' segments (as the kernel walks them) cover every (unit, K128 step) once, in order; piece
    numbers unit + CTA are unique and below units + CTAs (stream_sizes' bound); a unit's pieces are exactly the
    CTAs from the owner of its first step to the owner of its last (the kernel's count of arrivals and its order
    of summation), also with more CTAs than steps."""
    work = units * k_blocks
    launched, ctas = ctas, gg.stream_ctas(ctas, work)  # the launch's other CTAs exit
    steps_seen, pieces, walks = [], [], []
    for cta in range(ctas):
        s, end = gg.stream_range(cta, ctas, work)
        walk = []
        while s < end:
            unit = s // k_blocks
            k_end = min(end - unit * k_blocks, k_blocks)
            steps = k_end - (s - unit * k_blocks)
            walk.append((steps, "whole" if steps == k_blocks else "piece" if s > unit * k_blocks else "owner"))
            steps_seen += range(s, s + steps)
            pieces.append((unit, cta))
            s += steps
        walks.append(walk)
    assert steps_seen == list(range(work))
    # the host's copy of the walk (the trace reader's): the same segments, kinds, and nothing for the idle CTAs
    assert gg.stream_segments(units, k_blocks, launched) == walks + [[]] * (launched - ctas)
    ids = [u + c for u, c in pieces]
    assert len(set(ids)) == len(ids) and max(ids) < units + ctas
    for unit in range(units):
        first, last = (gg.stream_owner(unit * k_blocks, ctas, work),
                       gg.stream_owner((unit + 1) * k_blocks - 1, ctas, work))
        assert [c for u, c in pieces if u == unit] == list(range(first, last + 1))


def test_stream_k_knob_its_grid_parameters_and_buffers():
    cfg = gg.GemmConfig("w1", 8, stream_k=True)
    assert gg.grid(cfg, 4096, 32, 5, sms=132) == (264, 1, 1)  # two CTAs per SM at tile 8 by default
    assert gg.grid(gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1), 6144, 32, 5, sms=66) == (66, 1, 1)
    with pytest.raises(ValueError, match="pass sms >= 1"):
        gg.grid(cfg, 4096, 32, 5)
    assert [n for n, _ in cfg.params] == [n for n, _ in gg.PARAMS_W1 + gg.STREAM_PARAMS] and "_sk_" in cfg.name
    assert dict(gg.variant("w2", 8, stream_k=True).params)["stream_k"] is True
    # sets may name the knob everywhere: tiles past 8, the cp.async pipeline and the folded scales drop it
    for bn, knobs in ((16, {}), (32, {}), (64, {}), (8, {"fold_scales": True}),
                      (16, {"fold_scales": True, "table_decode": True})):
        assert "stream_k" not in dict(gg.variant("w1", bn, stream_k=True, **knobs).params)
    for bad in ({"ring_consumer": True}, {"fold_scales": True}, {"block_n": 16}, {"k_splits": 2},
                {"compact_grid": True}):
        with pytest.raises(ValueError, match="stream_k is a knob of the stand-alone"):
            gg.GemmConfig(**{"role": "w1", "block_n": 8, "stream_k": True, **bad})
    built = sorted((dict(v.params)["role"], dict(v.params)["block_n"], dict(v.params).get("ctas_per_sm", 0),
                    dict(v.params).get("trace", False), dict(v.params).get("lean_epilogue", False),
                    dict(v.params).get("handover", False), dict(v.params).get("words_first", False))
                   for v in gg.all_variants()
                   if dict(v.params).get("stream_k") and not dict(v.params).get("step_group")
                   and not dict(v.params).get("tagged_pieces") and not dict(v.params).get("quick_start")
                   and not (dict(v.params).get("ctas_per_sm") == 1 and dict(v.params)["stages"] == gg.RING_STAGES[8]))
    # (0: the tile's default ctas_per_sm; tile_knobs's ring of 6 stages at one CTA per SM is listed below)
    # tile_knobs's ring with the walk's quick start (its default, on the split nibble order: plain, traced, with the
    # hand-over words) and without it (the same three, its baseline); on the lane order the default plain and traced
    capped = sorted((dict(v.params)["role"], dict(v.params).get("split_nibbles", False),
                     dict(v.params).get("quick_start", False), dict(v.params).get("trace", False),
                     dict(v.params).get("handover", False)) for v in gg.all_variants()
                    if dict(v.params).get("stream_k") and dict(v.params)["stages"] == gg.RING_STAGES[8]
                    and dict(v.params).get("ctas_per_sm") == 1 and not dict(v.params).get("tagged_pieces")
                    and dict(v.params).get("lean_ring")  # (tile_knobs's; its baseline without lean_ring: its own test)
                    and not dict(v.params).get("tma_tokens")  # (and with the token tile's map: its own test)
                    and not dict(v.params).get("dynamic_tail")  # (and with the dynamic tail: its own test)
                    and not dict(v.params).get("early_scales")  # (and with the scales held early: its own test)
                    and not dict(v.params).get("amax_slots")  # (and W1's amax slot sets: their own test)
                    and not dict(v.params).get("epilogue_warp")  # (and W1's epilogue warp: its own test)
                    # (and tile_knobs's epilogue: the other one on a card's rule has its own test)
                    and dict(v.params).get("lean_epilogue", False) == gg.tile_knobs(1)[1].get("lean_epilogue", False))
    assert capped == sorted([(role, True, quick, trace, handover) for role in ("w1", "w2") for quick in (False, True)
                             for trace, handover in ((False, False), (True, False), (False, True))]
                            + [(role, False, True, trace, False) for role in ("w1", "w2") for trace in (False, True)])
    assert gg.tile_knobs(1)[1]["quick_start"] is True and gg.tile_knobs(1)[1]["split_nibbles"] is True
    assert built == sorted([(role, 8, ctas, False, False, False, False) for role in ("w1", "w2") for ctas in (0, 1)]
                           + [(role, 8, 1, True, False, False, False) for role in ("w1", "w2")]
                           + [(role, 8, 1, trace, True, False, False) for role in ("w1", "w2")
                              for trace in (False, True)]
                           + [(role, 8, 1, trace, False, True, False) for role in ("w1", "w2")
                              for trace in (False, True)]
                           + [("w2", 8, 1, trace, False, True, True) for trace in (False, True)])
    # and with a step's WGMMAs as one group: plain, lean, traced
    grouped = sorted((dict(v.params)["role"], dict(v.params).get("lean_epilogue", False), dict(v.params).get("trace", False))
                     for v in gg.all_variants() if dict(v.params).get("step_group")
                     and not dict(v.params).get("tagged_pieces"))
    assert grouped == sorted((role, lean, trace) for role in ("w1", "w2")
                             for lean, trace in ((False, False), (True, False), (False, True)))
    # the traced loop: a stream_k knob at one CTA per SM only (the variant's default there), its own name, the
    # phases ahead of the partials
    with pytest.raises(ValueError, match="trace stamps the phases of a stream_k loop"):
        gg.GemmConfig("w1", 8, trace=True)
    with pytest.raises(ValueError, match="trace stamps a stream_k loop at one CTA per SM"):
        gg.GemmConfig("w1", 8, stream_k=True, trace=True, ctas_per_sm=2)
    with pytest.raises(ValueError, match="pass ctas_per_sm=1"):
        gg.variant("w2", 8, stream_k=True, trace=True, ctas_per_sm=2)
    assert dict(gg.variant("w1", 8, stream_k=True, trace=True).params)["ctas_per_sm"] == 1
    assert "trace" not in dict(gg.variant("w1", 16, stream_k=True, trace=True).params)
    assert "_skt_" in gg.GemmConfig("w2", 8, stream_k=True, trace=True, ctas_per_sm=1).name

    class Fake:  # split_buffers reads only the loaded kernel's variant parameters
        def __init__(self, variant):
            self.entry = type("E", (), {"variant": variant})()

    from types import SimpleNamespace

    mat = SimpleNamespace(rows=4096, num_experts=32)
    partials, counts = gg.split_buffers(Fake(gg.variant("w1", 8, stream_k=True)), mat, 5, "cpu", sms=132)
    units = 1 * 16 * 32  # one token tile of 8 x 16 weight-row CTAs x 32 experts
    assert counts.shape == (units,) and partials.shape == ((units + 264) * gg.THREADS * 4,)
    assert int(counts.abs().sum()) == 0
    traced, _ = gg.split_buffers(Fake(gg.variant("w1", 8, stream_k=True, trace=True)), mat, 5, "cpu", sms=132)
    assert traced.shape == (132 * gg.TRACE_SLOTS * 4 + (units + 132) * gg.THREADS * 4,)  # one CTA per SM


def _tile_knobs_without(block_n, *names):
    """tile_knobs's set at a tile without the named knobs (what a knob's test compares with and without it)."""
    return {k: v for k, v in gg.tile_knobs(block_n)[1].items() if k not in names}


def test_tile_knobs_follow_the_measured_points():
    # step 65: the ring at 6 stages, not 12; step 69: the walk's quick start; step 72: the split nibble order
    # step 79: the ring's bases warp-uniform; step 85: the H100's (tile_knobs's default card) lean epilogue
    stream = {"stream_k": True, "ctas_per_sm": 1, "max_stages": 6, "quick_start": True, "split_nibbles": True,
              "lean_ring": True, "lean_epilogue": True}
    assert gg.tile_knobs(0) == (8, stream) and gg.tile_knobs(8) == (8, stream)
    # at tile 8 the default grid where W1's units pass 5.4 waves (past step 65's measured 704 units on 132 SMs)
    assert gg.tile_knobs(4, 400, 132) == (8, stream) and gg.tile_knobs(4, 712, 132) == (8, stream)
    unit8 = {"max_stages": gg.UNIT_GRID_8_STAGES, "split_nibbles": True}  # step 65: its ring capped too
    assert gg.tile_knobs(4, 713, 132) == (8, unit8) and gg.tile_knobs(6, 900, 132) == (8, unit8)
    for role in ("w1", "w2"):
        unit = gg.GemmConfig(**dict(gg.variant(role, 8, **unit8).params))
        assert not unit.stream_k and unit.ctas_per_sm == 2 and unit.stages == 4
        assert gg.variant(role, 8, **unit8) in gg.all_variants()
    assert gg.tile_knobs(9, 5000, 132)[0] == 16  # the units decide at tile 8 only
    table = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}  # steps 33-34
    assert gg.tile_knobs(9) == (16, {**table, "ctas_per_sm": 2}) and gg.tile_knobs(16)[0] == 16
    assert gg.tile_knobs(17) == (24, {**table, "ctas_per_sm": 2}) and gg.tile_knobs(24)[0] == 24
    persistent = {**table, "persistent": True}  # steps 50 / 54: the persistent grid at tiles 32, 64 and 96
    p32, p64 = {**persistent, "max_stages": 5}, {**persistent, "max_stages": 6}  # step 65: their rings capped
    assert gg.tile_knobs(25) == (32, p32) and gg.tile_knobs(32) == (32, p32)
    assert gg.tile_knobs(33) == (64, p64) and gg.tile_knobs(500) == (64, p64)
    wide = {**persistent, "transposed_stores": True, "scale_ratios": True}  # step 61: at the wide tile only
    assert gg.tile_knobs(65) == (96, wide) and gg.tile_knobs(96) == (96, wide)  # the wide tile by default
    for cap in (1, 9, 16, 17, 24, 25, 33, 80):  # every choice is a buildable variant of both roles
        bn, knobs = gg.tile_knobs(cap)
        for role in ("w1", "w2"):
            cfg = gg.GemmConfig(**dict(gg.variant(role, bn, **knobs).params))
            assert (cfg.stream_k if bn == 8 else cfg.table_decode and cfg.fit_n) and cfg.block_n == bn
            assert cfg.persistent == (bn in (32, 64, 96))
            deepest = dict(gg.variant(role, bn, **{k: v for k, v in knobs.items() if k != "max_stages"}).params)
            assert cfg.stages == gg.RING_STAGES.get(bn, deepest["stages"]) < deepest["stages"] + (bn not in gg.RING_STAGES)
            assert gg.variant(role, bn, **knobs) in gg.all_variants()  # CI builds it
    with pytest.raises(ValueError, match="allowed >= 0"):
        gg.tile_knobs(-1)
    # the wide tile: 65-96 rows at tile 96, the rest as without it; wide_tile=False keeps tile 64 there
    assert [gg.tile_knobs(cap)[0] for cap in (8, 33, 64, 65, 96, 97)] == [8, 64, 64, 96, 96, 64]
    assert gg.tile_knobs(80, wide_tile=False)[0] == 64
    # two_cta_tiles=False: tile 32 at one CTA per SM for 9-32 rows, the rest as before
    assert [gg.tile_knobs(cap, two_cta_tiles=False) for cap in (9, 17, 24, 32)] == [(32, p32)] * 4
    assert [gg.tile_knobs(cap, two_cta_tiles=False)[0] for cap in (8, 33, 80)] == [8, 64, 96]
    for role in ("w1", "w2"):
        assert gg.variant(role, 96, **gg.tile_knobs(80, wide_tile=True)[1]) in gg.all_variants()


def test_tile_knobs_per_card():
    # step 78: on the H200 tile 8's stream-K ring of 12 and the pieces without a fence; every other choice is shared
    assert [gg.card_of(n) for n in ("NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H20")] == [
        "h200", "h200", "h100", "h100"]
    h200 = {"stream_k": True, "ctas_per_sm": 1, "max_stages": 12, "tagged_pieces": True, "quick_start": True,
            "split_nibbles": True, "lean_ring": True}
    assert gg.tile_knobs(1, card="h200") == (8, h200) and gg.tile_knobs(8, 712, 132, card="h200") == (8, h200)
    assert gg.tile_knobs(1, card="h100") == gg.tile_knobs(1) and gg.tile_knobs(1)[1]["max_stages"] == 6
    for cap, units in ((4, 713), (9, None), (17, None), (25, None), (33, None), (80, None), (200, None)):
        assert gg.tile_knobs(cap, units, 132, card="h200") == gg.tile_knobs(cap, units, 132), cap
    with pytest.raises(ValueError, match=r"card 'b300': allowed one of \('h100', 'h200'\)"):
        gg.tile_knobs(1, card="b300")
    for role in ("w1", "w2"):
        for knobs in ({}, {"trace": True}):  # CI builds it, plain and traced
            v = gg.variant(role, 8, **h200, **knobs)
            assert v in gg.all_variants()
            cfg = gg.GemmConfig(**dict(v.params))
            assert cfg.stages == 12 and cfg.tagged_pieces and cfg.quick_start and cfg.split_nibbles and cfg.lean_ring


def test_wide_tile_is_the_one_cta_table_decodes_only():
    """Tile 96 runs the table decode's waited consumer at one CTA per SM (a chain of 64 rows and one of the rest from
    one decoded fragment); every other configuration refuses it and says what is allowed."""
    for knobs in ({}, {"fold_scales": True}, {"fold_scales": True, "table_decode": True, "ctas_per_sm": 2},
                  {"fold_scales": True, "table_decode": True, "warp_specialized": False}):
        with pytest.raises(ValueError, match=r"block_n must be one of .*\(96,\) with table_decode at one"):
            gg.GemmConfig("w1", 96, **knobs)
    cfg = gg.GemmConfig(**dict(gg.variant("w1", 96, fold_scales=True, table_decode=True, fit_n=True).params))
    assert cfg.ctas_per_sm == 1 and not cfg.table_pipelined and cfg.consumer_registers == 112
    assert cfg.stages == 7 and cfg.smem_bytes <= cfg.smem_limit and cfg.wgmmas_per_wait == 4
    assert 96 in gg.block_n_choices(fold_scales=True, table_decode=True)
    assert 96 not in gg.block_n_choices(fold_scales=True, table_decode=True, ctas_per_sm=2)
    assert 96 not in gg.block_n_choices() and 96 not in gg.block_n_choices(fold_scales=True)
    # sets reach it only when they name max_block_n=96
    assert max(dict(v.params)["block_n"] for v in gg.variant_set(fold_scales=True, table_decode=True)) == 64
    assert max(dict(v.params)["block_n"] for v in gg.variant_set(fold_scales=True, table_decode=True,
                                                                   max_block_n=96)) == 96


def test_shared_memory_plan_fits_the_sm():
    for bn in gg.BLOCK_N_CHOICES:
        for ws in (False, True) if bn <= gg.WS_MAX_BLOCK_N else (False,):
            cfg = gg.GemmConfig("w1", bn, warp_specialized=ws)
            assert cfg.b_offset % 128 == 0 and cfg.stage_bytes % 128 == 0
            assert cfg.smem_bytes + 1024 <= 227 * 1024  # the DSL adds 1 KiB of static shared memory
            assert cfg.barrier_offset % 8 == 0 and cfg.barrier_offset >= cfg.amax_offset + 16 * bn * 4
        assert gg.GemmConfig("w1", bn, warp_specialized=False).stages == 6
    # the warp-specialized ring takes every stage that fits (the SM's share of ctas_per_sm): one more would not
    for bn, ctas in ((8, 1), (8, 2), (16, 1), (32, 1)):
        cfg = gg.GemmConfig("w2", bn, ctas_per_sm=ctas)
        assert cfg.warp_specialized and cfg.threads == gg.THREADS + gg.PRODUCER_THREADS
        assert cfg.stages == cfg.max_stages >= (8 if ctas == 1 else 6)
        assert ctas * (cfg.smem_bytes + 2 * 1024) <= gg.SMEM_PER_SM  # per CTA: 1 KiB static, 1 KiB reserved
        with pytest.raises(ValueError, match="shared memory"):
            gg.GemmConfig("w2", bn, cfg.stages + 1, ctas_per_sm=ctas)
    assert gg.GemmConfig("w2", 8).ctas_per_sm == 2 and gg.GemmConfig("w2", 8).stages == 6
    assert gg.GemmConfig("w2", 8, ctas_per_sm=1).stages == 12 and gg.GemmConfig("w2", 32).stages == 10
    with pytest.raises(ValueError, match="ctas_per_sm"):
        gg.GemmConfig("w2", 8, warp_specialized=False, ctas_per_sm=2)


def test_consumer_registers_move_within_the_ctas_pool():
    cfg = gg.GemmConfig("w1", 32, producer_warps=4, consumer_registers=112)
    assert cfg.threads == 640 and cfg.producer_registers == 32
    assert gg.GemmConfig("w2", 16, producer_warps=4, consumer_registers=104).producer_registers == 64
    for c in gg.CONSUMER_REGISTER_CHOICES:
        split = gg.GemmConfig("w2", 32, producer_warps=4, consumer_registers=c)
        # the pool is the launch's 640 x 96; setmaxnreg takes multiples of 8 in 24..256
        assert 128 * split.producer_registers + 512 * c <= 640 * gg.WS_ENTRY_REGISTERS
        assert split.producer_registers % 8 == 0 and split.producer_registers >= 24
        assert split.name.endswith(f"_p4_r{c}")
    for bad in ({"producer_warps": 2, "consumer_registers": 112},  # the producer must be a whole warpgroup
                {"producer_warps": 4, "consumer_registers": 120},  # more than the pool holds
                {"producer_warps": 4, "consumer_registers": 112, "ctas_per_sm": 2, "block_n": 8},
                {"producer_warps": 1, "consumer_registers": 112, "warp_specialized": False}):
        knobs = {"block_n": 32, **bad}
        with pytest.raises(ValueError, match="consumer_registers .*allowed None, or one of \\(104, 112\\)"):
            gg.GemmConfig("w1", **knobs)
    assert gg.launch_register_bounds(gg.GemmConfig("w1", 32)) == {}
    assert gg.launch_register_bounds(gg.GemmConfig("w1", 8)) == {"min_blocks_per_mp": 2,
                                                                 "preferred_smem_carveout": 100}
    assert dict(gg.variant("w1", 32, producer_warps=4, consumer_registers=112).params)["consumer_registers"] == 112
    with pytest.raises(ValueError, match="side_threads 64: allowed 0, or whole warps"):
        gg.GemmConfig("w1", 16, side_threads=64)  # only beside a fused_role2 half


def test_pipeline_knob_defaults_and_errors():
    assert not gg.GemmConfig("w1", 64).warp_specialized  # bn 64 needs more than 96 registers per thread
    assert gg.GemmConfig("w1", 8, ring_consumer=True).warp_specialized  # the ring consumer too, up to bn 32
    assert not gg.GemmConfig("w1", 64, ring_consumer=True).warp_specialized
    assert not gg.GemmConfig("w1", 8, l2_evict_first=True).warp_specialized
    with pytest.raises(ValueError, match="block_n <= 32"):
        gg.GemmConfig("w1", 64, warp_specialized=True)
    assert not gg.GemmConfig("w1", 8, ring_consumer=True, warp_specialized=False).warp_specialized  # opt-out
    with pytest.raises(ValueError, match="l2_evict_first"):
        gg.GemmConfig("w1", 8, l2_evict_first=True, warp_specialized=True)
    assert gg.GemmConfig("w1", 16, producer_warps=2).threads == gg.THREADS + 2 * gg.PRODUCER_THREADS
    with pytest.raises(ValueError, match="producer_warps"):
        gg.GemmConfig("w1", 16, warp_specialized=False, producer_warps=2)
    assert "producer_warps" not in dict(gg.variant("w2", 64, producer_warps=2).params)  # bn 64: cp.async
    assert dict(gg.variant("w2", 16, producer_warps=2).params)["producer_warps"] == 2
    assert gg.GemmConfig("w1", 8, producer_warps=4).threads == 640
    with pytest.raises(ValueError, match=r"\(1, 2, 4\)"):
        gg.GemmConfig("w1", 8, producer_warps=3)
    with pytest.raises(ValueError, match="wait_suspend_ns"):
        gg.GemmConfig("w1", 8, wait_suspend_ns=-1)
    assert "wait_suspend_ns" not in dict(gg.variant("w1", 8).params)  # the default (polling) is not named
    assert dict(gg.variant("w1", 8, wait_suspend_ns=10_000_000).params)["wait_suspend_ns"] == 10_000_000
    with pytest.raises(ValueError, match="compact_grid"):
        gg.GemmConfig("w1", 64, compact_grid=True)
    assert "compact_grid" not in dict(gg.variant("w1", 64, compact_grid=True).params)  # bn 64: cp.async
    assert dict(gg.variant("w2", 16, compact_grid=True).params)["compact_grid"] is True
    # the parameters a launch rebuilds its config from name the cp.async pipeline when it is used
    for v in gg.variant_set() + gg.variant_set(ring_consumer=True):
        p = dict(v.params)
        assert gg.GemmConfig(**p).warp_specialized == (p["block_n"] <= 32)
        assert ("warp_specialized" in p) == (not gg.GemmConfig(**p).warp_specialized)


# --------------------------------------------------------------------------------------------- folded decode
# CPU proof of the fold_scales decode: gg.decode_fp4x4_folded / gg.fold_exponent_step are the expressions the
# kernel traces (ptx.py passes u32=Uint32); here they run on int64 tensors holding 32-bit words.
def _words(byte_tensor):
    """uint8 [..., 4] -> int64 [...] little-endian 32-bit words (byte 0 lowest, as ld.shared loads them)."""
    b = byte_tensor.to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _word_bytes(words):
    """int64 [...] 32-bit words -> uint8 [..., 4]."""
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def _e4m3(byte_tensor):
    return byte_tensor.contiguous().view(torch.float8_e4m3fn).float()


def test_folded_decode_every_code_at_every_window_step():
    """All 16 codes x d in 0..11, low and high nibble paths, the other nibble random: the E4M3 byte equals
    torch's exact E4M3 encoding of value * 2^(d-5), byte for byte (signed zero, code 0.5, 6 at d = 11)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    d = torch.arange(12).view(12, 1, 1)
    code = torch.arange(16).view(1, 16, 1).expand(12, 16, 4)
    other = torch.randint(0, 16, (12, 16, 4), generator=gen)
    # scale word: the wanted byte at a random position j, random in-window bytes elsewhere
    j = int(torch.randint(0, 4, (1,), generator=gen))
    sbytes = torch.randint(0, 12, (12, 4), generator=gen) + gg.SCALE_BYTE_OFFSET
    sbytes[:, j] = torch.arange(12) + gg.SCALE_BYTE_OFFSET
    step = gg.fold_exponent_step(_words(sbytes.to(torch.uint8)), j).view(12, 1)
    assert torch.equal(step.flatten(), 8 * (torch.arange(12) + 1))
    expected_value = E2M1_VALUES[code] * torch.exp2(d.float() - gg.FOLD_EXPONENT)
    expected_byte = expected_value.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(_e4m3(expected_byte), expected_value)  # every (code, d) is exact in E4M3: the window keeps it in range
    for high in (False, True):
        nibbles = (code << 4 | other) if high else (other << 4 | code)
        got = _word_bytes(gg.decode_fp4x4_folded(_words(nibbles.to(torch.uint8)), step, high))
        assert torch.equal(got, expected_byte), f"high={high}"
        assert torch.equal(_e4m3(got), expected_value)
    # hand-checked corners: 0.5 at d=0 is 2^-6, E4M3's smallest normal; 6 at d=11 is 384 (0x7C); -0 is 0x80
    assert int(expected_byte[0, 1, 0]) == 0x08 and int(expected_byte[11, 7, 0]) == 0x7C
    assert int(expected_byte[5, 8, 0]) == 0x80 and int(expected_byte[0, 9, 0]) == 0x88


def test_folded_decode_needs_the_window():
    """One step past the window (d = 12) the largest code is 768 > 448: the fold is exact only for d <= 11."""
    from gc_moe.weights import sm90 as w

    assert w.WINDOW_STEPS == 11 and w.X64_EXPONENT + w.UE8M0_BIAS == gg.SCALE_BYTE_OFFSET
    word = torch.tensor([0x07070707])
    got = _word_bytes(gg.decode_fp4x4_folded(word, torch.tensor([8 * 13]), False))
    assert float(_e4m3(got)[0, 0]) != 6.0 * 2.0 ** (12 - gg.FOLD_EXPONENT)


# --------------------------------------------------------------------------------------------- table decode
# CPU proof of table_decode: gg.decode_table / gg.decode_fp4x8_table are the kernel's expressions; the byte
# permute they take is PTX prmt.b32 in its default mode, modelled here from the ISA's definition.
def _prmt(a, b, selector):
    """prmt.b32 d, a, b, c (default mode) on int64 tensors of 32-bit words: byte i of d = byte c[4i..4i+2] of
    the pair (a: bytes 0..3, b: 4..7), or that byte's sign replicated when c[4i+3] is set."""
    a, b, selector = torch.as_tensor(a), torch.as_tensor(b), torch.as_tensor(selector)
    out = torch.zeros(torch.broadcast_shapes(a.shape, b.shape, selector.shape), dtype=torch.int64)
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        idx = nib & 7
        byte = torch.where(idx < 4, a >> (8 * (idx % 4)), b >> (8 * (idx % 4))) & 0xFF
        byte = torch.where(nib >= 8, torch.where(byte >= 0x80, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def test_prmt_model_hand_checked():
    a, b = torch.tensor([0x33221100]), torch.tensor([0x77665544])
    assert int(_prmt(a, b, torch.tensor([0x3210]))) == 0x33221100
    assert int(_prmt(a, b, torch.tensor([0x4567]))) == 0x44556677
    assert int(_prmt(torch.tensor([0x80]), b, torch.tensor([0x0008]))) == 0x808080FF  # sign replicate of byte 0


def test_table_byte_extract_in_one_prmt_matches_shift_and_mask():
    """The kernel takes a scale word's middle bytes with one PRMT (`ptx.byte_zext`: selector 0x4440 | byte, zero
    second operand): modelled on every byte value at each position, the tables equal the shift-and-mask ones."""
    def byte_zext(word, byte):
        return _prmt(word, 0, 0x4440 | byte)

    values = torch.arange(256, dtype=torch.int64)
    for byte in range(4):
        words = (values << (8 * byte)) | (0xA5A5A5A5 & ~(0xFF << (8 * byte)))  # the other bytes set
        assert torch.equal(byte_zext(words, byte), values)
        want = gg.decode_table(words, byte)
        got = gg.decode_table(words, byte, int, byte_zext)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), byte


def test_table_decode_every_code_at_every_window_step():
    """All 16 codes x d in 0..11 in both rows of a word (table nibble order), the other codes random: the E4M3
    bytes equal torch's exact encoding of value * 2^(d-5), the same bytes as the folded decode."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    d = torch.arange(12).view(12, 1, 1)
    j = int(torch.randint(0, 4, (1,), generator=gen))
    sbytes = torch.randint(0, 12, (12, 4), generator=gen) + gg.SCALE_BYTE_OFFSET
    sbytes[:, j] = torch.arange(12) + gg.SCALE_BYTE_OFFSET
    table = gg.decode_table(_words(sbytes.to(torch.uint8)), j)
    table = tuple(t.view(12, 1) for t in table)
    expected_value = E2M1_VALUES[torch.arange(16)].view(1, 16, 1) * torch.exp2(d.float() - gg.FOLD_EXPONENT)
    expected_byte = expected_value.expand(12, 16, 4).to(torch.float8_e4m3fn).view(torch.uint8)
    for row in (0, 1):  # the code under test in row g (low register) or row g + 8 (high register)
        for pos in range(4):
            codes = torch.randint(0, 16, (12, 16, 8), generator=gen, dtype=torch.uint8)
            codes[..., 4 * row + pos] = torch.arange(16, dtype=torch.uint8).view(1, 16)
            word = _words(wsm90._codes_to_table_bytes(codes.view(12, 16, 1, 8)).view(12, 16, 4))
            lo, hi = gg.decode_fp4x8_table(word, table, table, _prmt)
            got = _word_bytes(hi if row else lo)[..., pos]
            assert torch.equal(got, expected_byte[..., pos]), (row, pos)
            # and the word's other codes decode to their own values
            other = _e4m3(_word_bytes(lo if row else hi))
            want = E2M1_VALUES[codes[..., 4 * (1 - row): 4 * (1 - row) + 4].long()] * torch.exp2(d.float() - 5)
            assert torch.equal(other, want)


def _thread_words(mat):
    """The 8 code words each thread of a 64x128 tile loads, as the kernel issues its two 16-byte loads: lane order
    bytes [32 T, +32), table and split orders [16 T, +16) and [2048 + 16 T, +16). int64 [E, mt, kt, T, word 2j+h]."""
    if mat.nibble_order == "lane":
        return _words(mat.codes.view(*mat.codes.shape[:3], 128, 8, 4))
    halves = mat.codes.view(*mat.codes.shape[:3], 2, 128, 4, 4)
    return _words(torch.cat((halves[..., 0, :, :, :], halves[..., 1, :, :, :]), dim=-2))


def _decode_block(decode, scale_words, row_lo, j, w):
    """K32 block j of word w, both rows (g, g + 8), through the kernel's folded or table decode: E4M3 values
    [E, mt, kt, T, 4] each."""
    if decode == "folded":
        lo = gg.decode_fp4x4_folded(w, gg.fold_exponent_step(scale_words[..., row_lo], j), False)
        hi = gg.decode_fp4x4_folded(w, gg.fold_exponent_step(scale_words[..., row_lo + 8], j), True)
    else:
        lo, hi = gg.decode_fp4x8_table(w, gg.decode_table(scale_words[..., row_lo], j),
                                       gg.decode_table(scale_words[..., row_lo + 8], j), _prmt)
    return _e4m3(_word_bytes(lo)), _e4m3(_word_bytes(hi))


@pytest.mark.parametrize("decode", ["folded", "table"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_folded_decodes_of_whole_tiles_equal_the_dequantized_weights(gate_up, decode):
    """Per thread as the kernel does (two 16-byte loads, row g / g+8 scale words, K32 block j), on weights
    repacked in the decode's nibble order: E4M3(decode) * 2^5 * factor equals formats.dequantize_fp4_ue8m0 of the
    canonical weights, every element, every d."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    e, m, k = 2, 128, 512
    codes = torch.randint(0, 16, (e, m, k), dtype=torch.uint8, generator=gen)
    codes[:, :, :16] = torch.arange(16, dtype=torch.uint8)  # every code in every row
    exps = torch.randint(113, 125, (e, m, k // 32), dtype=torch.uint8, generator=gen)
    exps[:, 0, :12] = torch.arange(113, 125, dtype=torch.uint8)  # span exactly 12 values: d = 0..11 all occur
    packed, sf = pack_fp4(codes), pack_ue8m0(exps)
    mat = wsm90.repack_matrix(packed, sf, gate_up=gate_up, nibble_order="lane" if decode == "folded" else "table")
    assert set((mat.scales.flatten().long() - gg.SCALE_BYTE_OFFSET).tolist()) == set(range(12))
    words = _thread_words(mat)
    scale_words = _words(mat.scales)  # [E, mt, kt, tile row]: byte j = K32 block j
    t = torch.arange(128)
    warp, g, q = t // 32, (t % 32) // 4, t % 4
    row_lo = 16 * warp + g
    dense = torch.zeros(e, m // 64, k // 128, 64, 128)
    for j in range(4):
        for h in range(2):
            lo, hi = _decode_block(decode, scale_words, row_lo, j, words[..., 2 * j + h])
            for b in range(4):
                col = 32 * j + 16 * h + 4 * q + b
                dense[..., row_lo, col] = lo[..., b]
                dense[..., row_lo + 8, col] = hi[..., b]
    got = dense.transpose(2, 3).reshape(e, m, k) * 2.0**gg.FOLD_EXPONENT * mat.factor.view(e, 1, 1)
    ref = dequantize_fp4_ue8m0(packed, sf)
    if gate_up:
        ref = ref[:, wsm90.w1_row_order(m // 2)]
    assert torch.equal(got, ref)
    assert torch.equal(got, wsm90.dequantize_matrix(mat))


class _NamedKernel:
    name = "k"


def _assert_reads_only(cfg, mat, order):
    """A kernel of `cfg` refuses `mat` (lane order) and takes the same matrix in `order`."""
    with pytest.raises(ValueError, match=f"'{order}' nibble order"):
        gg._check_nibble_order(cfg, _NamedKernel, mat)
    gg._check_nibble_order(cfg, _NamedKernel, wsm90.with_nibble_order(mat, order))


@pytest.mark.parametrize("gate_up", [False, True])
def test_split_decode_of_whole_tiles_equals_the_dequantized_weights(gate_up):
    """Per thread as the split_nibbles kernel does (two 16-byte loads of the split order, decode_fp4x8_split, then the
    K32 scale 2^(d + 6) and the expert's factor): every element equals formats.dequantize_fp4_ue8m0 of the canonical
    weights, every code in both rows of a word, every d; and the decode equals the lane order's word for word."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    e, m, k = 2, 128, 512
    codes = torch.randint(0, 16, (e, m, k), dtype=torch.uint8, generator=gen)
    codes[:, :, :16] = torch.arange(16, dtype=torch.uint8)  # every code in every row
    exps = torch.randint(113, 125, (e, m, k // 32), dtype=torch.uint8, generator=gen)
    exps[:, 0, :12] = torch.arange(113, 125, dtype=torch.uint8)
    packed, sf = pack_fp4(codes), pack_ue8m0(exps)
    mat = wsm90.repack_matrix(packed, sf, gate_up=gate_up, nibble_order="split")
    lane_words = _thread_words(wsm90.with_nibble_order(mat, "lane"))
    words = _thread_words(mat)
    scales = mat.scales.long() - wsm90.UE8M0_BIAS  # [E, mt, kt, tile row, K32 block]: 2^(d + 6)
    t = torch.arange(128)
    warp, g, q = t // 32, (t % 32) // 4, t % 4
    row_lo = 16 * warp + g
    dense = torch.zeros(e, m // 64, k // 128, 64, 128)
    for j in range(4):
        for h in range(2):
            lo, hi = gg.decode_fp4x8_split(words[..., 2 * j + h])
            lane = lane_words[..., 2 * j + h]
            assert torch.equal(lo, ((lane << 4) & 0x80808080) | ((lane << 2) & 0x1C1C1C1C))
            assert torch.equal(hi, (lane & 0x80808080) | ((lane >> 2) & 0x1C1C1C1C))
            lo, hi = _e4m3(_word_bytes(lo)), _e4m3(_word_bytes(hi))
            for b in range(4):
                col = 32 * j + 16 * h + 4 * q + b
                dense[..., row_lo, col] = lo[..., b] * torch.exp2(scales[..., row_lo, j].float())
                dense[..., row_lo + 8, col] = hi[..., b] * torch.exp2(scales[..., row_lo + 8, j].float())
    got = dense.transpose(2, 3).reshape(e, m, k) * mat.factor.view(e, 1, 1)
    ref = dequantize_fp4_ue8m0(packed, sf)
    if gate_up:
        ref = ref[:, wsm90.w1_row_order(m // 2)]
    assert torch.equal(got, ref)
    assert torch.equal(got, wsm90.dequantize_matrix(mat))


def test_split_nibbles_knob_and_the_nibble_order_it_needs():
    cfg = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, split_nibbles=True)
    assert gg.nibble_order(cfg) == "split" and gg.nibble_order(gg.GemmConfig("w1", 8)) == "lane"
    for bad in ({"fold_scales": True}, {"warp_specialized": False}, {"ring_consumer": True}):
        with pytest.raises(ValueError, match="split_nibbles is a knob"):
            gg.GemmConfig(**{"role": "w2", "block_n": 8, "split_nibbles": True, **bad})
    # a knob sets may name everywhere: on at tile 8's loops, dropped where the scales are folded
    assert dict(gg.variant("w1", 8, **{**gg.tile_knobs(1)[1], "split_nibbles": True}).params)["split_nibbles"]
    assert "split_nibbles" not in dict(gg.variant("w1", 16, **{**gg.tile_knobs(9)[1], "split_nibbles": True}).params)
    assert "split_nibbles" not in dict(gg.variant("w1", 16, split_nibbles=True).params)  # spills there
    assert "split_nibbles" not in dict(gg.variant("w2", 8, **{**gg.tile_knobs(1)[1], "step_group": True}).params)
    assert "split_nibbles" not in dict(gg.variant("w1", 8).params)  # the plain variants keep their cache keys
    gen = torch.Generator().manual_seed(5)
    mat = wsm90.repack_matrix(pack_fp4(torch.randint(0, 16, (2, 128, 256), dtype=torch.uint8, generator=gen)),
                              pack_ue8m0(torch.full((2, 128, 8), 127, dtype=torch.uint8)), gate_up=False)
    _assert_reads_only(cfg, mat, "split")
    for order in wsm90.NIBBLE_ORDERS:  # every order back to every other, exactly
        back = wsm90.with_nibble_order(wsm90.with_nibble_order(wsm90.with_nibble_order(mat, order), "split"), "lane")
        assert torch.equal(back.codes, mat.codes)


def test_table_decode_knob_and_the_nibble_order_it_needs():
    with pytest.raises(ValueError, match="fold_scales=True"):
        gg.GemmConfig("w1", 16, table_decode=True)
    cfg = gg.GemmConfig("w2", 64, fold_scales=True, table_decode=True)
    assert cfg.warp_specialized and "_tab" in cfg.name and "_fold" not in cfg.name
    assert not gg.GemmConfig("w2", 64, fold_scales=True).warp_specialized
    with pytest.raises(ValueError, match="block_n <= 32"):
        gg.GemmConfig("w2", 64, fold_scales=True, warp_specialized=True)
    v64 = dict(gg.variant("w1", 64, fold_scales=True, table_decode=True).params)
    assert v64["producer_warps"] == 4 and v64["consumer_registers"] == 112 and v64["table_decode"] is True
    assert "table_decode" not in dict(gg.variant("w1", 16, table_decode=True).params)  # no fold: no table
    mat = wsm90.repack_matrix(pack_fp4(torch.zeros(1, 64, 128, dtype=torch.uint8)),
                              pack_ue8m0(torch.full((1, 64, 4), 127, dtype=torch.uint8)), gate_up=False)
    _assert_reads_only(cfg, mat, "table")
    with pytest.raises(ValueError, match="'lane' nibble order"):
        gg._check_nibble_order(gg.GemmConfig("w2", 16), _NamedKernel, wsm90.with_nibble_order(mat, "table"))
    with pytest.raises(ValueError, match="allowed"):
        wsm90.with_nibble_order(mat, "rows")


def test_fit_n_knob_names_and_limits():
    for knobs in ({}, {"fold_scales": True}, {"fold_scales": True, "table_decode": True, "warp_specialized": False},
                  {"fold_scales": True, "table_decode": True, "ring_consumer": True}):
        with pytest.raises(ValueError, match="fit_n is a knob of the stand-alone table decode"):
            gg.GemmConfig("w1", 32, fit_n=True, **knobs)
    cfg = gg.GemmConfig("w2", 32, fold_scales=True, table_decode=True, fit_n=True)
    assert "_tab_fit" in cfg.name
    params = dict(gg.variant("w1", 32, fold_scales=True, table_decode=True, fit_n=True).params)
    assert params["fit_n"] is True
    # named only when on, and only with the table decode (sets may name it everywhere)
    assert "fit_n" not in dict(gg.variant("w1", 32, fold_scales=True, table_decode=True).params)
    assert "fit_n" not in dict(gg.variant("w1", 32, fit_n=True).params)
    # W1's epilogue at bn 24 / 64 is the one place allowed local memory (after the loop)
    budgets = {(role, bn): gg.variant(role, bn, fold_scales=True, table_decode=True, fit_n=True).local_bytes_budget
               for role in ("w1", "w2") for bn in gg.BLOCK_N_CHOICES + gg.TABLE_TWO_CTA_BLOCK_N}
    assert budgets == {**{k: 0 for k in budgets}, ("w1", 64): gg.TABLE64_W1_EPILOGUE_LOCAL_BYTES,
                       ("w1", 24): gg.TWO_CTA_W1_EPILOGUE_LOCAL_BYTES}


def test_persistent_knob_grid_arguments_and_word_slots():
    """persistent walks the unit grid with ctas_per_sm x SMs CTAs (never more than units), takes the unit grid's
    experts and token tiles as its last arguments, runs the waited loop at every tile (no pipelined consumer: it keeps
    its last stages) and gives the lean epilogue's words two slots and their empty barriers."""
    for knobs in ({}, {"fold_scales": True}, {"fold_scales": True, "table_decode": True, "ring_consumer": True},
                  {"fold_scales": True, "table_decode": True, "compact_grid": True}):
        with pytest.raises(ValueError, match="persistent is a knob of the stand-alone table decode"):
            gg.GemmConfig("w1", 32, persistent=True, **knobs)
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    for role in ("w1", "w2"):
        for bn, ctas in ((8, None), (16, 2), (32, None), (64, None), (96, None)):
            v = gg.variant(role, bn, ctas_per_sm=ctas, persistent=True, **tab)
            cfg = gg.GemmConfig(**dict(v.params))
            base = gg.GemmConfig(**dict(gg.variant(role, bn, ctas_per_sm=ctas, **tab).params))
            assert cfg.persistent and "_pers" in cfg.name and not cfg.table_pipelined
            assert cfg.params == base.params + gg.PERSIST_PARAMS
            assert cfg.meta_bytes == 2 * cfg.meta_slot_bytes + 16 and base.meta_bytes == base.meta_slot_bytes
            assert cfg.meta_slot_bytes >= 4 * (bn + 1) and cfg.meta_slot_bytes % 16 == 0
            assert cfg.smem_bytes <= cfg.smem_limit and base.stages - 1 <= cfg.stages <= base.stages
            # 32 experts, capacity 40: token tiles x weight-row CTAs x experts units, at most one CTA each
            units = -(-40 // bn) * (4096 // gg.ROWS_PER_CTA) * 32
            assert gg.grid(cfg, 4096, 32, 40, sms=132) == (min(cfg.ctas_per_sm * 132, units), 1, 1)
            assert gg.grid(cfg, 4096, 32, 40, sms=3) == (3 * cfg.ctas_per_sm, 1, 1)
            assert [struct.unpack("<i", a.data)[0] for a in gg._persist_args(cfg, 32, 40)] == [32, -(-40 // bn)]
            assert gg._persist_args(base, 32, 40) == []
            # the launch helpers' split check takes the persistent grid's SMs (no K split: nothing to add)
            mat = types.SimpleNamespace(rows=4096, num_experts=32)
            assert gg._split_args(cfg, types.SimpleNamespace(name=cfg.name), mat, 40, 132, 2048, None) == []
    with pytest.raises(ValueError, match="persistent variant's grid is ctas_per_sm x SMs"):
        gg.grid(gg.GemmConfig("w1", 64, persistent=True, **tab), 4096, 32, 40)
    # sets may name it everywhere; the variants name it only with the stand-alone table decode
    assert "persistent" not in dict(gg.variant("w1", 8, stream_k=True, persistent=True).params)
    assert "persistent" not in dict(gg.variant("w2", 32, fold_scales=True, persistent=True).params)
    assert "persistent" not in dict(gg.variant("w2", 24, persistent=True, **tab).params)  # spills there
    built = [dict(v.params) for v in gg.all_variants() if dict(v.params).get("persistent")]
    # at each tile its deepest ring, and tile_knobs's capped one (RING_STAGES) where it is shallower
    assert sorted((p["role"], p["block_n"], p["block_n"] in (32, 64) and p["stages"] == gg.RING_STAGES[p["block_n"]])
                  for p in built
                  if not p.get("snake_walk") and not p.get("scale_ratios") and not p.get("transposed_stores")
                  and not p.get("early_rows")) == sorted(
        [(role, bn, False) for role in ("w1", "w2") for bn in (8, 16, 32, 64, 96)]
        + [(role, bn, True) for role in ("w1", "w2") for bn in (32, 64)])


def test_snake_walk_knob_needs_the_persistent_grid_and_takes_an_order_table():
    """snake_walk orders the persistent grid's walk: without the persistent grid it is refused (and dropped by
    `variant`, so sets may name it everywhere); with it the experts' order table (SNAKE_MAX_EXPERTS int32) follows
    everything else in shared memory, the arguments stay the persistent grid's and the ring keeps its depth."""
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    with pytest.raises(ValueError, match="snake_walk is an order of the persistent grid's walk"):
        gg.GemmConfig("w1", 64, snake_walk=True, **tab)
    assert "snake_walk" not in dict(gg.variant("w1", 64, snake_walk=True, **tab).params)
    assert "snake_walk" not in dict(gg.variant("w2", 24, snake_walk=True, persistent=True, **tab).params)
    for role in ("w1", "w2"):
        for bn in (32, 64, 96):
            cfg = gg.GemmConfig(**dict(gg.variant(role, bn, persistent=True, snake_walk=True, **tab).params))
            plain = gg.GemmConfig(**dict(gg.variant(role, bn, persistent=True, **tab).params))
            assert cfg.snake_walk and cfg.name == plain.name.replace("_pers", "_pers_snake")
            assert cfg.params == plain.params and cfg.stages == plain.stages
            assert cfg.order_offset == plain.smem_bytes and cfg.smem_bytes == plain.smem_bytes + 4 * gg.SNAKE_MAX_EXPERTS
            assert cfg.order_offset % 4 == 0 and cfg.smem_bytes <= cfg.smem_limit
            # the experts' counts pass through the amax region before the first unit: it holds SNAKE_MAX_EXPERTS
            assert 16 * bn * 4 >= 4 * gg.SNAKE_MAX_EXPERTS
    built = [(dict(v.params)["role"], dict(v.params)["block_n"]) for v in gg.all_variants()
             if dict(v.params).get("snake_walk")]
    assert sorted(built) == sorted((role, bn) for role in ("w1", "w2") for bn in (32, 64, 96))


def test_scale_ratios_knob_limits_stage_layout_arrivals_and_registers():
    """scale_ratios keeps the persistent grid's sums in units of each step's activation scale: refused without the
    persistent grid or with more tokens than producer threads (one token each), dropped by `variant` where it does not
    apply; its stage holds each token's scale and ratio (the ring keeps its depth at the tiles it is built at), each
    producer thread arrives once more on a full barrier (its stores' publication), and at tiles 64 / 96 the consumers
    take 104 registers so the producer warpgroup gets 64 (it holds the next step's scale)."""
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    with pytest.raises(ValueError, match="scale_ratios is a knob of the persistent grid"):
        gg.GemmConfig("w1", 64, scale_ratios=True, **tab)
    with pytest.raises(ValueError, match="scale_ratios is a knob of the persistent grid"):
        gg.GemmConfig("w1", 64, persistent=True, scale_ratios=True, **tab)  # one producer warp, 64 tokens
    assert "scale_ratios" not in dict(gg.variant("w2", 64, scale_ratios=True, **tab).params)
    assert "scale_ratios" not in dict(gg.variant("w2", 24, persistent=True, scale_ratios=True, **tab).params)
    # where the persistent grid does not apply, neither do the ratios' registers: the plain tile's split
    dropped = dict(gg.variant("w1", 64, persistent=True, scale_ratios=True, token_tiles_fastest=False, **tab).params)
    assert "scale_ratios" not in dropped and dropped["consumer_registers"] == max(gg.CONSUMER_REGISTER_CHOICES)
    for role in ("w1", "w2"):
        for bn in (32, 64, 96):
            cfg = gg.GemmConfig(**dict(gg.variant(role, bn, persistent=True, scale_ratios=True, **tab).params))
            plain = gg.GemmConfig(**dict(gg.variant(role, bn, persistent=True, **tab).params))
            assert cfg.scale_ratios and cfg.name.startswith(plain.name.split("_pers")[0] + "_pers_ratio")
            assert cfg.xr_offset == cfg.xs_offset + 4 * bn and cfg.stage_bytes >= cfg.xr_offset + 4 * bn
            assert cfg.stage_bytes % 128 == 0 and cfg.stages == plain.stages and cfg.smem_bytes <= cfg.smem_limit
            assert cfg.full_arrivals == plain.full_arrivals + cfg.producer_threads
            assert bn <= cfg.producer_threads and cfg.params == plain.params
            if bn > 32:
                assert (cfg.consumer_registers, cfg.producer_registers) == (104, 64)
                assert (plain.consumer_registers, plain.producer_registers) == (112, 32)
    assert gg.SCALE_RATIO_FLOOR * 2.0 ** 19 < 1e-13  # a clamped block's largest change (|products| < 2^19)
    built = [(dict(v.params)["role"], dict(v.params)["block_n"], dict(v.params).get("transposed_stores", False),
              dict(v.params).get("early_rows", False)) for v in gg.all_variants() if dict(v.params).get("scale_ratios")]
    # at tiles 32 / 64 / 96, and tile_knobs's wide tile with the transposed stores (and W2's early rows beside it)
    assert sorted(built) == sorted([(role, bn, False, False) for role in ("w1", "w2") for bn in (32, 64, 96)]
                                   + [("w1", 96, True, False), ("w2", 96, True, False), ("w2", 96, False, True)])


def test_transposed_stores_knob_limits_and_region():
    """transposed_stores is a knob of the lean epilogue outside stream-K: refused elsewhere (and dropped by `variant`,
    so sets may name it everywhere); its region (W1: the tile's E4M3 rows, 128 bytes each; W2: 512 bytes per consumer
    warp) follows everything else, 128-byte aligned, and at every tile tile_knobs runs from 16 rows the ring keeps its
    depth and the arguments stay the same."""
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    for role, knobs in (("w1", {**tab, "lean_epilogue": False}), ("w2", {**tab, "lean_epilogue": False}),
                        ("w2", {"ring_consumer": True})):
        with pytest.raises(ValueError, match="transposed_stores is a knob of the lean epilogue"):
            gg.GemmConfig(role, 64, transposed_stores=True, **knobs)
    with pytest.raises(ValueError, match="transposed_stores is a knob of the lean epilogue"):
        gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1, lean_epilogue=True, transposed_stores=True)
    assert "transposed_stores" not in dict(gg.variant("w2", 64, transposed_stores=True, fold_scales=True).params)
    assert "transposed_stores" not in dict(gg.variant("w1", 8, stream_k=True, ctas_per_sm=1, lean_epilogue=True,
                                                      transposed_stores=True).params)
    assert gg.TRANSPOSE_WARP_BYTES == 16 * 16 * 2  # 16 tokens x 16 hidden rows of a warp, BF16
    # not W1 at tile 24 (its copy spilled in two CTAs' registers)
    assert "transposed_stores" not in dict(gg.variant("w1", 24, transposed_stores=True, **gg.tile_knobs(24)[1]).params)
    for role, bn in [(role, bn) for role in ("w1", "w2") for bn in (16, 24, 32, 64, 96) if (role, bn) != ("w1", 24)]:
        knobs = _tile_knobs_without(bn, "transposed_stores")
        cfg = gg.GemmConfig(**dict(gg.variant(role, bn, transposed_stores=True, **knobs).params))
        plain = gg.GemmConfig(**dict(gg.variant(role, bn, **knobs).params))
        tag = "_ratio" if knobs.get("scale_ratios") else "_pers" if knobs.get("persistent") else "_lean"
        # the ring as deep, but W1's at the wide tile with the scale ratios (tile_knobs's set there): its 12 KB region
        # beside the ratios' stage words takes one stage (7 -> 6)
        assert cfg.stages == plain.stages - ((role, bn) == ("w1", 96))
        plain = dataclasses.replace(plain, stages=cfg.stages)  # the plain plan at that depth (name, offsets)
        assert cfg.transposed_stores and cfg.name == plain.name.replace(tag, tag + "_tst", 1)
        assert cfg.params == plain.params and cfg.threads == plain.threads
        assert cfg.transpose_offset >= plain.smem_bytes and cfg.transpose_offset % 128 == 0
        region = bn * 128 if role == "w1" else gg.THREADS // 32 * gg.TRANSPOSE_WARP_BYTES
        assert cfg.smem_bytes == cfg.transpose_offset + region <= cfg.smem_limit
    built = [(dict(v.params)["role"], dict(v.params)["block_n"], dict(v.params).get("persistent", False))
             for v in gg.all_variants() if dict(v.params).get("transposed_stores")]
    # tile_knobs's sets, and at the persistent tiles the unit grid too (the GPU test compares both walks)
    assert sorted(built) == sorted([(role, bn, bn >= 32) for role in ("w1", "w2") for bn in (16, 24, 32, 64, 96)
                                    if (role, bn) != ("w1", 24)]
                                   + [(role, bn, False) for role in ("w1", "w2") for bn in (32, 64, 96)])


def test_early_rows_knob_limits():
    """early_rows is a knob of the lean W2's value stores: refused elsewhere (W1, no lean epilogue, stream-K, with
    transposed_stores) and dropped by `variant` there; it changes nothing of the shared-memory plan."""
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True}
    for role, knobs in (("w1", tab), ("w2", {**tab, "lean_epilogue": False}), ("w2", {**tab, "transposed_stores": True})):
        with pytest.raises(ValueError, match="early_rows is a knob of the lean W2's value stores"):
            gg.GemmConfig(role, 64, early_rows=True, **knobs)
    assert "early_rows" not in dict(gg.variant("w1", 64, early_rows=True, **tab).params)
    assert "early_rows" not in dict(gg.variant("w2", 64, early_rows=True, transposed_stores=True, **tab).params)
    assert "early_rows" not in dict(gg.variant("w2", 8, stream_k=True, ctas_per_sm=1, lean_epilogue=True,
                                               early_rows=True).params)
    for bn in (16, 24, 32, 64, 96):
        knobs = _tile_knobs_without(bn, "transposed_stores")
        cfg = gg.GemmConfig(**dict(gg.variant("w2", bn, early_rows=True, **knobs).params))
        plain = gg.GemmConfig(**dict(gg.variant("w2", bn, **knobs).params))
        assert cfg.early_rows and cfg.smem_bytes == plain.smem_bytes and cfg.stages == plain.stages
    built = sorted(dict(v.params)["block_n"] for v in gg.all_variants() if dict(v.params).get("early_rows"))
    assert built == [16, 24, 32, 64, 96]


def test_lean_epilogue_knob_names_limits_and_shared_words():
    """The lean epilogue is a knob of the stand-alone kernels; with one unit per CTA its staged words take
    (block_n + 1) x 4 bytes after the amax region (rounded to 16) and leave the rings as deep as before; a stream_k
    loop loads them into registers instead (no shared words)."""
    for knobs in ({"ring_consumer": True}, {"k_splits": 2}, {"warp_specialized": False}):
        with pytest.raises(ValueError, match="lean_epilogue is a knob of the stand-alone W1 / W2"):
            gg.GemmConfig("w1", 8, lean_epilogue=True, **knobs)
    stream = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, lean_epilogue=True)
    assert stream.meta_bytes == 0 and stream.smem_bytes == gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1).smem_bytes
    tab = {"fold_scales": True, "table_decode": True, "fit_n": True}
    for role in ("w1", "w2"):
        for bn, ctas in ((16, 2), (24, None), (32, None), (64, None)):
            v = gg.variant(role, bn, lean_epilogue=True, ctas_per_sm=ctas, **tab)
            cfg = gg.GemmConfig(**dict(v.params))
            base = gg.GemmConfig(**dict(gg.variant(role, bn, ctas_per_sm=ctas, **tab).params))
            assert cfg.lean_epilogue and not base.lean_epilogue
            assert "_lean" in cfg.name and "_lean" not in base.name
            assert cfg.stages == base.stages and cfg.meta_offset == base.amax_offset + 16 * bn * 4
            assert cfg.meta_bytes == -(-4 * (bn + 1) // 16) * 16 and base.meta_bytes == 0
            assert cfg.barrier_offset == base.barrier_offset + cfg.meta_bytes
            assert cfg.smem_bytes <= cfg.smem_limit
    # sets may name it everywhere; the variants name it only where it applies
    assert dict(gg.variant("w1", 8, stream_k=True, lean_epilogue=True).params)["lean_epilogue"] is True
    assert "lean_epilogue" not in dict(gg.variant("w1", 8, ring_consumer=True, lean_epilogue=True).params)
    assert "lean_epilogue" not in dict(gg.variant("w1", 8, k_splits=2, lean_epilogue=True).params)
    assert dict(gg.variant("w2", 8, lean_epilogue=True).params)["lean_epilogue"] is True


def _load_script(name: str):
    """A module of scripts/ (not a package) loaded by path, for its CPU-side helpers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_auto_sets_follow_the_runs_card_or_the_one_they_name():
    """The bench's tile_knobs sets (ws_auto and --auto-set) follow the GPU's card (grouped_gemm.card_of) unless a
    set names one (the pseudo-knob card); --build-only builds every card's."""
    bench = _load_script("bench_grouped_gemm_sm90")
    tag, extra, pdl = bench.parse_auto_set("h100r:card='h100',pdl=True")
    assert (tag, extra, pdl) == ("h100r", {"card": "h100"}, True)
    rule, added = bench.tile_rule(gg, extra, "h200")
    assert rule(1) == gg.tile_knobs(1, card="h100") and added == {}
    rule, _ = bench.tile_rule(gg, {}, "h200")
    assert rule(1) == gg.tile_knobs(1, card="h200") and rule(1)[1]["max_stages"] == 12
    w1_h200, w2_h200 = bench.auto_set_variants(gg, {}, card="h200")[8]
    w1_h100, _ = bench.auto_set_variants(gg, {}, card="h100")[8]
    assert dict(w1_h200.params)["stages"] == 12 and dict(w2_h200.params)["tagged_pieces"] is True
    assert dict(w1_h100.params)["stages"] == 6 and "tagged_pieces" not in dict(w1_h100.params)
    # the other tiles are the same on both cards
    assert {bn: p for bn, p in bench.auto_set_variants(gg, {}, card="h200").items() if bn != 8} == {
        bn: p for bn, p in bench.auto_set_variants(gg, {}, card="h100").items() if bn != 8}


def test_sass_loop_check_counts_local_accesses_inside_mma_loops_only():
    """The bench's `loop L/S` column (the SASS rule: no LDL / STL in the main loop): local accesses count only inside
    a backward branch's body that issues QGMMA; the epilogue's and a per-lane copy loop's (BRA.U.ANY) do not."""
    bench = _load_script("bench_grouped_gemm_sm90")
    listing = [f"        /*{a:04x}*/ {text} ;" for a, text in [
        (0x0100, "LDL R2, [R1]"),                                   # before the loop
        (0x0110, "QGMMA.64x32x32.F32.E4M3.E4M3 R24, R40, gdesc[UR8], R24"),
        (0x0120, "STL [R1+0x4], R3"),
        (0x0130, "@P0 BRA 0x110"),                                  # the main loop: 0x110 .. 0x130
        (0x0140, "STL [R1+0x8], R4"),                               # the epilogue
        (0x0150, "LDL R5, [R1+0x8]"),
        (0x0160, "@P1 BRA.U.ANY 0x140"),                            # a per-lane loop without QGMMA
        (0x0170, "EXIT")]]
    assert bench.local_ops_in_mma_loops(listing) == 1
    assert bench.local_ops_in_mma_loops(listing[:2] + listing[3:]) == 0


def test_sass_k_loop_sizes_are_the_innermost_qgmma_loops():
    """The bench's K-loop column: instructions per trip of each innermost QGMMA loop, two loops with the same text
    inside one outer loop counted apart (the fitted loops of one kernel look alike)."""
    bench = _load_script("bench_grouped_gemm_sm90")
    body = ["QGMMA.64x8x32.F32.E4M3.E4M3 R24, R40, gdesc[UR8], R24", "FFMA R1, R2, R3, R1"]
    listing, addr = [], 0x100

    def emit(text):
        nonlocal addr
        listing.append(f"        /*{addr:04x}*/ {text} ;")
        addr += 0x10
    emit("MOV R0, RZ")  # the outer loop's head
    for _ in range(2):
        start = addr
        for text in body:
            emit(text)
        emit(f"@P0 BRA 0x{start:x}")
    emit("@P1 BRA 0x100")
    assert bench.k_loop_sizes(listing) == [3, 3] and bench.local_ops_in_mma_loops(listing) == 0


def test_bench_shape_option_names_what_is_wrong():
    """The bench's --shape: a model slice at other sizes (the same experts and top-k), refused with the allowed form."""
    bench = _load_script("bench_grouped_gemm_sm90")
    name, shape = bench.parse_shape("glm-h3072=glm-5.2:hidden=3072,inter=1024")
    assert name == "glm-h3072" and shape == {**bench.MODELS["glm-5.2"], "hidden": 3072, "inter": 1024,
                                             "base": "glm-5.2"}
    assert bench.MODELS["glm-5.2"]["hidden"] == 6144  # the base slice is not touched
    for spec_text, match in (("x=nope:hidden=128", "BASE one of"), ("x=glm-5.2:width=128", "FIELD one of"),
                             ("x=glm-5.2:hidden=100", "multiples of 128"), ("glm-5.2:hidden=128", "NAME=BASE")):
        with pytest.raises(SystemExit, match=match):
            bench.parse_shape(spec_text)


def test_pair_trace_summary_reads_the_handover_on_one_timer():
    """The bench's pair trace: W1's and W2's traced stamps on the %globaltimer axis, W2's CTAs matched to the W1 CTA
    that left their SM, its wait and first stage measured from W1's last end; CTAs without segments left out."""
    bench = _load_script("bench_grouped_gemm_sm90")
    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS

    def words(rows):  # per CTA: (start, first stage, end, SM, wait) in ns after 1 s; None for an idle CTA
        w = torch.zeros(len(rows), gg.TRACE_SLOTS, 2, dtype=torch.int64)
        for c, r in enumerate(rows):
            if r is None:
                continue
            start, first, end, sm, wait = (10**9 + v if i != 3 else v for i, v in enumerate(r))
            w[c, 0, 0], w[c, 4, 0], w[c, tail, 0], w[c, tail + 1, 0] = start, first, end - 100, end
            w[c, tail + 2, 0], w[c, tail + 2, 1], w[c, tail + 3, 0] = 1, sm, wait
        return w.view(-1)
    w1 = [(0, 3000, 30000, 7, 0), (200, 3100, 32000, 9, 0), None]
    w2 = [(30500, 0, 50000, 7, 33000), (33000, 0, 52500, 9, 33500)]
    for c, first in ((0, 34000), (1, 35000)):
        w2[c] = w2[c][:1] + (first,) + w2[c][2:]
    got = bench.pair_trace_summary(words(w1), [[(4, "whole")], [(4, "whole")], []],
                                   words(w2), [[(2, "whole")], [(2, "whole")]])
    assert got["w1_first_end_us"] == 30.0 and got["w1_last_end_us"] == 32.0
    assert got["w2_first_start_us"] == 30.5 and got["w2_last_start_us"] == 33.0
    assert got["w2_start_after_own_sm_w1_us"] == (0.75, 1.0)  # SM 7: 0.5 after its W1 CTA, SM 9: 1.0
    assert got["w2_wait_done_after_w1_us"] == (1.25, 1.5)
    assert got["w2_first_stage_after_w1_us"] == (2.5, 3.0)
    assert got["w2_end_spread_us"] == 2.5 and got["span_us"] == 52.5


def test_trace_summary_splits_w1s_first_stage_at_its_first_copies():
    """The bench's trace summary of a stand-alone W1: the first full stage after the scan split where the producer's
    first copies went out (clock64 cycles of the CTA's SM, at the clock the CTA's stamps give); W2's summary, whose
    same slot holds its wait, has no such split."""
    bench = _load_script("bench_grouped_gemm_sm90")
    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS
    w = torch.zeros(2, gg.TRACE_SLOTS, 2, dtype=torch.int64)
    for c, (issue_ns, full_ns) in enumerate(((1500, 3600), (1300, 3800))):  # after a scan ending at 1000 ns
        for slot, ns in ((0, 0), (1, 1000), (2, 1000), (4, full_ns), (tail + 3, issue_ns), (3 + 2, 9000),
                         (tail, 20000), (tail + 1, 20000 + c), (tail + 4, 1100), (tail + 5, 1150 + 100 * c),
                         (tail + 6, 1250)):
            w[c, slot, 0], w[c, slot, 1] = 10**9 + ns, 2 * ns  # 2 cycles per ns
        w[c, tail + 2, 0] = 1  # one segment
    segments = [[(8, "whole")], [(8, "whole")]]
    got = bench.trace_summary(w.view(-1), segments, "w1")
    assert got["first_stage_us"] == (2.7, 2.8) and got["ghz"] == 2.0
    assert got["first_issue_us"] == (0.4, 0.5) and got["first_landed_us"] == (2.3, 2.5)
    assert got["first_issue_parts_us"] == {"range": (0.1, 0.1), "lookup": (0.1, 0.15), "sources": (0.05, 0.1),
                                           "copies": (0.15, 0.25)}
    assert "first_issue_us" not in bench.trace_summary(w.view(-1), segments, "w2")


def test_end_by_epilogues_groups_the_ctas_by_the_epilogues_they_ran():
    """The trace summary's end by epilogues: CTAs grouped by their whole and owner segments (pieces do not count),
    each group's mean end after the median CTA's end, in us."""
    bench = _load_script("bench_grouped_gemm_sm90")
    segments = [[(3, "piece"), (8, "whole"), (2, "owner")], [(6, "piece"), (5, "owner")],
                [(1, "piece"), (8, "whole"), (2, "owner")], [(7, "piece"), (4, "owner")], []]
    ends_ns = [12_000, 9_000, 13_000, 10_000]  # median 11 us
    got = bench.end_by_epilogues(segments, [0, 1, 2, 3], ends_ns)
    assert got == {1: [2, -1.5], 2: [2, 1.5]}


def test_trace_end_by_epilogues_reads_a_traced_row_with_the_walks_segments():
    """scripts/trace_end_by_epilogues.py: a traced row's per-CTA ends grouped by the epilogues of the walk the kernel
    ran (grouped_gemm.stream_segments), averaged over the launches; a row whose traced steps are not that walk's is
    refused."""
    script = _load_script("trace_end_by_epilogues")
    bench = _load_script("bench_grouped_gemm_sm90")
    row = {"tag": "t", "model": "m", "tokens": 1, "block_n": 8, "tiles": {"8": 1}, "hidden": 1280, "inter": 256}
    segments = gg.stream_segments(2, 10, 3)  # W1: 2 units (2 x 256 rows / 256) of 10 steps over 3 CTAs
    assert [sum(kind != "piece" for _, kind in s) for s in segments] == [1, 1, 0]
    ends = [[11.0, 11.6, 10.0], [14.0, 15.2, 12.0]]  # two launches, us: medians 11 and 14
    row["trace"] = {"w1": {"ctas_by_sm_runs": [[[c, 0.0, end[c], sum(n for n, _ in segments[c])] for c in range(3)]
                                               for end in ends]}}
    got = script.late_groups(gg, bench, row, "w1")
    assert got == {"groups": {0: [1, -1.5], 1: [2, 0.45]}, "last_us": 0.9}
    assert script.late_groups(gg, bench, row, "w2") is None
    row["trace"]["w1"]["ctas_by_sm_runs"][0][0][3] += 1
    with pytest.raises(SystemExit, match="not the walk's"):
        script.late_groups(gg, bench, row, "w1")


def test_division_by_magic_gives_every_quotient_of_the_stream_k_walk():
    """quick_start's divisions (grouped_gemm.divide_by_magic, the steps of ptx.divide_by_magic): floor(n / d) for
    every divisor of a grid (1..256 CTAs) and the numerators a walk forms (CTA x work up to 2^31 - 1, the edges
    around multiples of d included), and the walk's ranges and first units equal to stream_range's."""
    import random

    rng = random.Random(5)
    for d in range(1, 257):
        magic = gg.division_magic(d)
        numerators = {0, 1, d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1}
        numerators |= {rng.randrange(2**31) for _ in range(300)} | {rng.randrange(4 * d) for _ in range(50)}
        for n in numerators:
            if n >= 0:
                assert gg.divide_by_magic(n, d, magic) == n // d, (n, d)
    for ctas, units, k_blocks in ((132, 9 * 18, 40), (132, 600, 18), (7, 13 * 18, 40), (256, 2000, 56)):
        work, magic = units * k_blocks, gg.division_magic(ctas)
        for cta in range(ctas):
            s, end = gg.stream_range(cta, ctas, work)
            assert (gg.divide_by_magic(cta * work, ctas, magic), gg.divide_by_magic((cta + 1) * work, ctas, magic)) \
                == (s, end)
            assert gg.divide_by_magic(cta * units, ctas, magic) == s // k_blocks  # the walk's first unit
    with pytest.raises(ValueError, match="quick_start is a knob of the stream_k W1 / W2"):
        gg.GemmConfig("w1", 8, quick_start=True)
    assert "_quick" in gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1, quick_start=True).name
    assert "quick_start" not in dict(gg.variant("w1", 16, quick_start=True).params)  # a stream-K knob only
    assert dict(gg.variant("w1", 8, stream_k=True, quick_start=True).params)["quick_start"] is True


def test_lean_ring_is_a_knob_of_the_stand_alone_stream_k_loops():
    """lean_ring (the ring's bases warp-uniform, the consumers' waits trying first): a stream_k knob that names its
    kernels, dropped by `variant` where it does not apply; tile_knobs's on both cards since step 79, all_variants
    builds each card's tile-8 set without it (the baseline)."""
    with pytest.raises(ValueError, match="lean_ring is a knob of the stand-alone stream_k W1 / W2"):
        gg.GemmConfig("w1", 8, lean_ring=True)
    with pytest.raises(ValueError, match="lean_ring is a knob of the stand-alone stream_k W1 / W2"):
        gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, stream_pair=True, lean_ring=True)
    lean = gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1, lean_ring=True)
    assert lean.name == gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1).name.replace("_sk_", "_sk_lring_")
    assert "lean_ring" not in dict(gg.variant("w1", 16, lean_ring=True).params)
    assert "lean_ring" not in dict(gg.variant("w1", 64, fold_scales=True, table_decode=True, lean_ring=True).params)
    assert dict(gg.variant("w1", 8, stream_k=True, lean_ring=True).params)["lean_ring"] is True
    assert all(gg.tile_knobs(1, card=card)[1]["lean_ring"] for card in gg.CARDS)
    for role in ("w1", "w2"):
        for card, knobs in (("h100", {}), ("h200", {}), ("h200", {"trace": True})):
            baseline = gg.variant(role, 8, **{**gg.tile_knobs(1, card=card)[1], **knobs, "lean_ring": False})
            assert "lean_ring" not in dict(baseline.params) and baseline in gg.all_variants()


def test_tma_tokens_is_a_knob_of_the_stand_alone_stream_k_loops():
    """tma_tokens (the token tile through a tensor map): a knob of the stand-alone stream_k loops that names its
    kernels and adds the map's address as their last parameter, dropped by `variant` where it does not apply; the
    map's request is the chunk-major box of one K128 step of 8 rows, and bad activations are refused with what is
    allowed. all_variants builds each card's tile-8 set with it, plain and traced."""
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 1, "stream_pair": True},
                {"stream_k": True, "ctas_per_sm": 1, "handover": True}):
        with pytest.raises(ValueError, match="tma_tokens is a knob of the stand-alone stream_k W1 / W2"):
            gg.GemmConfig("w1", 8, tma_tokens=True, **bad)
    plain = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1)
    tma = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, tma_tokens=True)
    assert tma.name == plain.name.replace("_sk_", "_sk_tmat_") and tma.params == plain.params + (("token_map", "u64"),)
    assert "tma_tokens" not in dict(gg.variant("w1", 16, tma_tokens=True).params)
    assert "tma_tokens" not in dict(gg.variant("w2", 8, stream_k=True, handover=True, tma_tokens=True).params)
    assert dict(gg.variant("w2", 8, stream_k=True, tma_tokens=True).params)["tma_tokens"] is True
    spec = gg.token_map_spec(0x7F0000000000, 37, 5120)
    assert (spec.dims, spec.strides_bytes, spec.box, spec.swizzle) == ((16, 37, 320), (5120, 16), (16, 8, 8), "none")
    # the box: one K128 step of a token tile, the bytes its stage's barrier expects beyond the weights'
    assert spec.box[0] * spec.box[1] * spec.box[2] == gg.TOKEN_MAP_ROWS * 128 and gg.TOKEN_MAP_ROWS == tma.block_n
    for rows, k in ((0, 5120), (37, 5000)):
        with pytest.raises(ValueError, match="allowed rows >= 1 and K a positive multiple of 128"):
            gg.token_map_spec(0x7F0000000000, rows, k)
    built = gg.all_variants()
    for role in ("w1", "w2"):
        for card in gg.CARDS:
            for knobs in ({}, {"trace": True}):
                assert gg.variant(role, 8, **{**gg.tile_knobs(1, card=card)[1], **knobs, "tma_tokens": True}) in built


def test_dynamic_tail_is_a_knob_of_the_stand_alone_stream_k_loops():
    """dynamic_tail (the last units' steps in chunks claimed by ticket): a knob of the stand-alone stream_k loops with
    one producer warp that names its kernels, dropped by `variant` where it does not apply; its stage keeps a chunk
    word past the activation scales (in the stage's padding: the ring keeps its depth on both cards), and the split
    buffers hold a piece per tail chunk after the static pieces and the chunks' ticket after the counts.
    all_variants builds each card's tile-8 set with it."""
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 1, "trace": True},
                {"stream_k": True, "ctas_per_sm": 1, "handover": True},
                {"stream_k": True, "ctas_per_sm": 1, "stream_pair": True}):
        with pytest.raises(ValueError, match="dynamic_tail is a knob of the stand-alone stream_k W1 / W2"):
            gg.GemmConfig("w1", 8, dynamic_tail=True, **bad)
    plain = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1)
    tail = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, dynamic_tail=True)
    assert tail.name == plain.name.replace("_sk_", "_sk_dtail_") and tail.params == plain.params
    assert tail.chunk_slot_offset + gg.TAIL_SLOT_BYTES <= tail.stage_bytes == plain.stage_bytes
    assert tail.chunk_slot_offset >= tail.xs_offset + tail.block_n * 4  # past the activation scales
    for card in gg.CARDS:
        knobs = gg.tile_knobs(1, card=card)[1]
        assert gg.variant("w1", 8, **knobs, dynamic_tail=True).params == tuple(sorted(
            {**dict(gg.variant("w1", 8, **knobs).params), "dynamic_tail": True}.items()))
        assert dict(gg.variant("w2", 8, **knobs, dynamic_tail=True).params)["stages"] == \
            dict(gg.variant("w2", 8, **knobs).params)["stages"]
    for knobs in ({"stream_k": True, "trace": True}, {"stream_k": True, "handover": True}, {}):
        assert "dynamic_tail" not in dict(gg.variant("w1", 8, dynamic_tail=True, **knobs).params)
    assert "dynamic_tail" not in dict(gg.variant("w1", 16, dynamic_tail=True).params)
    # sizes at DeepSeek-V4.1-Flash's W1 slice (4608 rows, 48 experts, capacity 8, 132 SMs): units + CTAs static pieces,
    # then units // TAIL_UNIT_DIV x TAIL_CHUNKS chunk pieces; one count per unit, then the ticket
    units = 1 * (4608 // gg.ROWS_PER_CTA) * 48
    partials, counts = gg.stream_sizes(plain, 4608, 48, 8, 132)
    partials_t, counts_t = gg.stream_sizes(tail, 4608, 48, 8, 132)
    piece = gg.THREADS * 4
    assert (partials, counts) == ((units + 132) * piece, units)
    assert (partials_t, counts_t) == (partials + units // gg.TAIL_UNIT_DIV * gg.TAIL_CHUNKS * piece, units + 1)
    built = gg.all_variants()
    for role in ("w1", "w2"):
        for card in gg.CARDS:
            assert gg.variant(role, 8, **{**gg.tile_knobs(1, card=card)[1], "dynamic_tail": True}) in built


def test_early_scales_is_a_knob_of_the_stand_alone_stream_k_unfolded_loop():
    """early_scales (a K128 step's scale words and activation scales loaded once after its wait): a knob of the
    stand-alone stream_k loop that names its kernels, dropped by `variant` where it does not apply (step_group's
    one-group step, the folded table loops, the unit grid); all_variants builds each card's tile-8 set with it, plain
    and traced (the offline build test then checks their register-A WGMMAs and that nothing spills)."""
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 1, "step_group": True},
                {"stream_k": True, "ctas_per_sm": 1, "stream_pair": True}):
        with pytest.raises(ValueError, match="early_scales is a knob of the stand-alone stream_k W1 / W2"):
            gg.GemmConfig("w1", 8, early_scales=True, **bad)
    plain = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1)
    held = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, early_scales=True)
    assert held.name == plain.name.replace("_sk_", "_sk_escl_") and held.params == plain.params and held.smem_bytes == plain.smem_bytes
    for card in gg.CARDS:
        knobs = gg.tile_knobs(1, card=card)[1]
        assert gg.variant("w1", 8, **knobs, early_scales=True).params == tuple(sorted(
            {**dict(gg.variant("w1", 8, **knobs).params), "early_scales": True}.items()))
    for knobs in ({"stream_k": True, "ctas_per_sm": 1, "step_group": True}, {}):
        assert "early_scales" not in dict(gg.variant("w1", 8, early_scales=True, **knobs).params)
    assert "early_scales" not in dict(gg.variant("w1", 32, early_scales=True, **gg.tile_knobs(20)[1]).params)
    built = gg.all_variants()
    for role in ("w1", "w2"):
        for card in gg.CARDS:
            for knobs in ({}, {"trace": True}):
                assert gg.variant(role, 8, **{**gg.tile_knobs(1, card=card)[1], **knobs, "early_scales": True}) in built


def test_amax_slots_is_a_knob_of_the_stand_alone_stream_k_w1():
    """amax_slots (W1's amax per token through shared-memory max reductions into rotating slot sets): a knob of the
    stand-alone stream_k W1 that names its kernels and asks for the reduction in their PTX, dropped by `variant` where
    it does not apply (W2, the tables, the hand-over words, the dynamic tail's chunks); all_variants builds each card's
    tile-8 set with it, alone and with the lean epilogue (plain and traced), and the lean epilogue alone beside it."""
    for role, bad in (("w1", {}), ("w2", {"stream_k": True, "ctas_per_sm": 1}),
                      ("w1", {"stream_k": True, "ctas_per_sm": 1, "stream_pair": True}),
                      ("w1", {"stream_k": True, "ctas_per_sm": 1, "handover": True}),
                      ("w1", {"stream_k": True, "ctas_per_sm": 1, "dynamic_tail": True})):
        with pytest.raises(ValueError, match="amax_slots is a knob of the stand-alone stream_k W1"):
            gg.GemmConfig(role, 8, amax_slots=True, **bad)
    plain = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1)
    slots = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, amax_slots=True)
    assert slots.name == plain.name.replace("_sk_", "_sk_amxs_") and slots.smem_bytes == plain.smem_bytes
    assert 3 * slots.block_n * 4 <= slots.meta_offset - slots.amax_offset  # the three sets fit the amax region
    for card in gg.CARDS:
        knobs = gg.tile_knobs(1, card=card)[1]
        with_slots = gg.variant("w1", 8, **knobs, amax_slots=True)
        assert with_slots.params == tuple(sorted({**dict(gg.variant("w1", 8, **knobs).params), "amax_slots": True}.items()))
        assert "red.shared.max.u32" in with_slots.promises
        assert gg.variant("w2", 8, **knobs, amax_slots=True) == gg.variant("w2", 8, **knobs)
    for knobs in ({"stream_k": True, "ctas_per_sm": 1, "handover": True},
                  {"stream_k": True, "ctas_per_sm": 1, "dynamic_tail": True}, {}):
        assert "amax_slots" not in dict(gg.variant("w1", 8, amax_slots=True, **knobs).params)
    assert "amax_slots" not in dict(gg.variant("w1", 32, amax_slots=True, **gg.tile_knobs(20)[1]).params)
    built = gg.all_variants()
    for card in gg.CARDS:
        rule = gg.tile_knobs(1, card=card)[1]
        for knobs in ({"amax_slots": True}, {"lean_epilogue": True, "amax_slots": True},
                      {"lean_epilogue": True, "amax_slots": True, "trace": True}):
            assert gg.variant("w1", 8, **{**rule, **knobs}) in built
        for role in ("w1", "w2"):
            for knobs in ({"lean_epilogue": True}, {"lean_epilogue": True, "trace": True}):
                assert gg.variant(role, 8, **{**rule, **knobs}) in built


def test_epilogue_warp_is_a_knob_of_the_stand_alone_stream_k_w1_at_tile_8():
    """epilogue_warp (W1's unit epilogues run by a warp of their own, fed through one shared-memory slot): a knob of the
    stand-alone stream_k W1 at tile 8 and one CTA per SM that names its kernels, adds one warp and the slot (the ring
    as deep as before on both cards' rules), dropped by `variant` where it does not apply (W2, the hand-over words,
    the dynamic tail's chunks, the amax slot sets, other tiles); all_variants builds each card's tile-8 rule with it,
    plain and traced."""
    sk = {"stream_k": True, "ctas_per_sm": 1}
    for role, bn, bad in (("w1", 8, {}), ("w2", 8, sk), ("w1", 8, {**sk, "stream_pair": True}),
                          ("w1", 8, {**sk, "handover": True}), ("w1", 8, {**sk, "dynamic_tail": True}),
                          ("w1", 8, {**sk, "amax_slots": True}), ("w1", 8, {"stream_k": True, "ctas_per_sm": 2})):
        with pytest.raises(ValueError, match="epilogue_warp is a knob of the stand-alone stream_k W1 at tile 8"):
            gg.GemmConfig(role, bn, epilogue_warp=True, **bad)
    plain = gg.GemmConfig("w1", 8, stages=6, **sk)
    warp = gg.GemmConfig("w1", 8, stages=6, epilogue_warp=True, **sk)
    assert warp.name == plain.name.replace("_sk_", "_sk_epw_") and warp.threads == plain.threads + 32
    assert warp.epilogue_offset >= plain.smem_bytes and warp.epilogue_offset % 16 == 0
    assert warp.smem_bytes == warp.epilogue_offset + gg.EPILOGUE_VALUES_OFFSET + 8 * 128 * 4
    for card in gg.CARDS:
        knobs = gg.tile_knobs(1, card=card)[1]
        with_warp = gg.variant("w1", 8, **knobs, epilogue_warp=True)
        assert with_warp.params == tuple(sorted({**dict(gg.variant("w1", 8, **knobs).params),
                                                 "epilogue_warp": True}.items()))
        assert gg.GemmConfig(**dict(with_warp.params)).smem_bytes <= gg.SMEM_LIMIT
        assert gg.variant("w2", 8, **knobs, epilogue_warp=True) == gg.variant("w2", 8, **knobs)
        for extra in ({"handover": True}, {"dynamic_tail": True}, {"amax_slots": True}):
            assert "epilogue_warp" not in dict(gg.variant("w1", 8, **{**knobs, **extra}, epilogue_warp=True).params)
    assert "epilogue_warp" not in dict(gg.variant("w1", 8, epilogue_warp=True).params)  # the two-CTA unit grid
    assert "epilogue_warp" not in dict(gg.variant("w1", 32, epilogue_warp=True, **gg.tile_knobs(20)[1]).params)
    built = gg.all_variants()
    for card in gg.CARDS:
        for knobs in ({}, {"trace": True}):
            assert gg.variant("w1", 8, **{**gg.tile_knobs(1, card=card)[1], **knobs, "epilogue_warp": True}) in built


def test_unit_cost_fit_recovers_per_unit_and_per_step_costs(tmp_path):
    """scripts/analyze_unit_costs.py `fit`: rows of one set and base slice at three K (its --shape variants, each with
    its own routing) whose times are rounds x (3 us + steps x 0.6 us) give back 3 and 0.6; a role at one K alone
    gives no fit; the rows read back from a bench log (a run its time bound cut short) as from its JSON."""
    analyze = _load_script("analyze_unit_costs")
    rows = []
    for model, hidden, tiles in (("glm-5.2", 6144, 33), ("glm-h3072", 3072, 32), ("glm-h1536", 1536, 34)):
        row = {"tag": "ws_auto", "model": model, "base": "glm-5.2", "hidden": hidden, "inter": 2048, "tokens": 128,
               "block_n": 64, "tiles": {"64": tiles}, "knobs": {"fold_scales": True}, "cold_us": 1.0}
        for role, units, steps in (("w1", tiles * 16, hidden // 128), ("w2", tiles * hidden // 256, 16)):
            row[f"{role}_cold_us"] = -(-units // 132) * (3.0 + 0.6 * steps)
        rows.append(row)
    fits = {f["role"]: f for f in analyze.fit(rows)}
    assert fits["w1"]["per_unit_us"] == 3.0 and fits["w1"]["per_step_us"] == 0.6 and fits["w1"]["max_residual"] == 0
    assert fits["w1"]["rounds"] == [4, 5] and fits["w1"]["step_share_at_full_k"] == round(28.8 / 31.8, 2)
    assert "w2" not in fits  # W2's K (inter) is the same in all three: no fit
    log = tmp_path / "shapes.log"
    log.write_text("# glm-5.2: 32 local experts\n" + "\n".join(json.dumps(r) for r in rows) + "\nTimeout\n")
    assert analyze.load_rows(str(log)) == rows
    assert analyze.ctas_per_sm({"block_n": 24, "knobs": {"ctas_per_sm": 2}}) == 2
    assert analyze.ctas_per_sm({"block_n": 8, "knobs": {"stream_k": True, "ctas_per_sm": 1}}) == 1


def test_over_read_fit_splits_a_kernels_time_over_its_read_into_launch_steps_and_units():
    """scripts/analyze_unit_costs.py `over-read`: W1 / W2 times built as a stream read of their bytes plus 4 / 3 us
    per launch, 0.05 us per K128 step and 0.8 us per unit of each CTA's share give back those terms; the rows above
    --max-tokens, a set with too few points and rows of other grids than stream-K are left out; points that cannot
    separate the terms raise."""
    analyze = _load_script("analyze_unit_costs")
    rows = []
    for model, hidden, inter in (("deepseek-v4.1-flash", 5120, 2304), ("glm-5.2", 6144, 2048)):
        for tokens, tiles in ((1, 9), (2, 13), (4, 22), (8, 27), (64, 48)):
            row = {"tag": "ws_auto_pdl", "model": model, "hidden": hidden, "inter": inter, "tokens": tokens,
                   "block_n": 8, "tiles": {"8": tiles}, "knobs": {"stream_k": True, "ctas_per_sm": 1}}
            for role, fixed in (("w1", 4.0), ("w2", 3.0)):
                units, steps = analyze.role_shape(row, role)
                row[f"{role}_stream_read_us"] = 0.52 * steps * units / 132
                row[f"{role}_cold_us"] = (row[f"{role}_stream_read_us"] + fixed + 0.05 * steps * units / 132
                                          + 0.8 * units / 132)
            rows.append(row)
    rows.append({**rows[0], "tag": "lonely"})
    rows += [{**r, "tag": "unit_grid", "knobs": None} for r in rows[:8]]  # not the stream-K grid: left out
    (got,) = analyze.over_read(rows)
    assert got["set"] == "ws_auto_pdl" and got["points"] == 16 and got["max_abs_residual_us"] == 0
    assert got["fixed_us"] == {"w1": 4.0, "w2": 3.0} and got["per_step_us"] == 0.05 and got["per_unit_us"] == 0.8
    assert "deepseek-v4.1-flash T=64 w1" not in got["over_read_us"]
    # one model at one token count: each role's two terms move together, so the points do not separate them
    assert analyze.over_read([{**r, "tag": "one_point"} for r in rows[:1]] * 4) == []


def test_spread_persistence_tells_static_from_random_late_sms():
    """scripts/analyze_unit_costs.py `spread`: SMs late by the same amounts in every launch correlate (1.0) and are
    named; lateness shuffled between launches does not correlate."""
    analyze = _load_script("analyze_unit_costs")
    lateness = [0.1 * (s % 4) for s in range(28)]  # the latest quarter: the 7 SMs with s % 4 == 3
    same = [[[s, 0.0, 30.0 + lateness[s], 50] for s in range(28)] for _ in range(3)]
    got = analyze.spread_persistence(same)
    assert got["lateness_correlation"] == 1.0 and got["end_spreads_us"] == [0.3] * 3
    assert got["late_in_every_launch"] == [s for s in range(28) if s % 4 == 3]
    moved = [[[s, 0.0, 30.0 + lateness[(s * k + k) % 28], 50] for s in range(28)] for k in (1, 3, 5)]
    assert abs(analyze.spread_persistence(moved)["lateness_correlation"]) < 0.5
    rows = [{"tag": "skt1", "model": "glm-5.2", "tokens": 1, "trace": {"w1": {"ctas_by_sm_runs": same}},
             "pair_trace": {"span_us": 50.0, "runs": []}}]
    assert [r["role"] for r in analyze.spread(rows)] == ["w1", "pair"]
    # W2 ending as late as W1 did on each SM (plus a constant): correlation and slope 1; W2's ends unrelated: ~0
    w2_same = [[[s, 31.0, 50.0 + lateness[s], 20] for s in range(28)] for _ in range(3)]
    got = analyze.finish_order(same, w2_same)
    assert got == {"launches": 3, "w1_w2_end_correlation": [1.0] * 3, "w2_on_w1_end_slope": [1.0] * 3}
    unrelated = [[[s, 31.0, 50.0 + 0.1 * ((s // 4) % 4), 20] for s in range(28)] for _ in range(3)]
    assert analyze.finish_order(same, unrelated)["w1_w2_end_correlation"] == [0.0] * 3
    both = [{**rows[0], "trace": {"w1": {"ctas_by_sm_runs": same}, "w2": {"ctas_by_sm_runs": w2_same}}}]
    assert [r["role"] for r in analyze.spread(both)] == ["w1", "w2", "w1->w2", "pair"]
    # `weights`: each SM's steps over its spans, over the launches (SMs missing from one launch left out)
    rates = analyze.sm_rates(rows + [{"trace": {"w2": {"ctas_by_sm_runs": [[[s, 1.0, 11.0, 20] for s in range(27)]]}}}])
    assert sorted(rates) == list(range(27)) and rates[0] == round((3 * 50 + 20) / (3 * 30.0 + 10.0), 4)


def test_tile_24_is_the_two_cta_table_decodes_only():
    cfg = gg.GemmConfig("w1", 24, fold_scales=True, table_decode=True)
    assert cfg.ctas_per_sm == 2 and not cfg.table_pipelined and cfg.smem_bytes <= cfg.smem_limit
    for knobs in ({}, {"fold_scales": True}, {"fold_scales": True, "table_decode": True, "ctas_per_sm": 1}):
        with pytest.raises(ValueError, match="with table_decode at two CTAs per SM"):
            gg.GemmConfig("w1", 24, **knobs)
    assert gg.block_n_choices(fold_scales=True, table_decode=True, ctas_per_sm=2) == (8, 16, 24, 32, 64)
    assert gg.block_n_choices(fold_scales=True, table_decode=True) == gg.BLOCK_N_CHOICES + gg.TABLE_WIDE_BLOCK_N
    tiles = [dict(v.params)["block_n"] for v in gg.variant_set(fold_scales=True, table_decode=True, ctas_per_sm=2,
                                                                max_block_n=24)]
    assert tiles == [8, 16, 24] * 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    cache = tmp_path_factory.mktemp("cubins")
    return {v: jit.build_variant(v, "sm_90a", cache_dir=cache) for v in gg.all_variants()}


def test_every_variant_builds_offline_with_register_a_wgmma_and_no_spills(built):
    # default, folded-scale, ring-consumer sets and the cp.async pipeline below bn 64 (at bn 64 it is the default),
    # the compact ring consumer at bn 8 (both roles), W1 and W2 with K split in 2-4 at bn 8 / 16, the table decode
    # (with bn 16 at two CTAs per SM, and bn 24 there), its fitted N at bn 16 / 24 / 32 / 64, the stream-K loops at
    # bn 8 (one and two CTAs per SM, both roles, and traced at one), the lean epilogue at the table decode's bn 16 / 24 /
    # 32 / 64 and in the stream-K loops at one CTA per SM (plain and traced), the wide tile 96 with and without it,
    # the stream-K loops with the hand-over words (plain and traced), the persistent grids at bn 8 / 16 / 32 / 64 / 96,
    # the hand-over W2 taking its words first (plain and traced), the snake walk and the scale ratios at bn 32 / 64 / 96,
    # the transposed stores at bn 16 / 24 / 32 / 64 / 96 (W1 not at 24; and as the unit grid at 32 / 64 / 96), W2's
    # early combine rows at the same tiles, the stream-K loops with a step's WGMMAs as one group (plain, lean, traced),
    # the stream-K loops with tagged pieces (plain, lean, traced, step_group), tile_knobs's capped rings at bn 8 / 32 /
    # 64 (and as the unit grid at 32 / 64), tile 8's unit grid at its capped ring, the stream-K walk's quick start
    # (tile_knobs's: traced, with the hand-over words) and the plain walk at its ring (plain, traced, with the words),
    # the tile-8 loops on the split nibble order (tile_knobs's stream-K, traced, the unit grid), tile_knobs's H200
    # tile-8 loops (plain, traced), each card's tile-8 loops without lean_ring (its baseline; and the H200's traced),
    # each card's tile-8 loops with the token tile through a tensor map (plain, traced), each card's tile-8 loops with
    # the dynamic tail, each card's tile-8 loops with a step's scales held from its wait (plain, traced), and each
    # card's tile-8 loops with W1's amax slot sets (alone, with the lean epilogue, traced with it) and the lean
    # epilogue (W1 and W2, plain and traced; on the H100, whose rule has it, the slots alone are its lean set), and each
    # card's tile-8 W1 with its unit epilogues in a warp of their own (plain, traced)
    assert len(built) == (10 * len(gg.BLOCK_N_CHOICES) - 2 + 2 + 2 * 2 * 3 + 2 + 2 + 6 + 4 + 4 + 8 + 4 + 4 + 4 + 10 + 2
                          + 6 + 6 + 9 + 6 + 5 + 6 + 8 + 6 + 4 + 2 + 10 + 6 + 4 + 6 + 8 + 4 + 8 + 9 + 4)
    for variant, entry in built.items():
        params = dict(variant.params)
        ptx = entry.ptx_path.read_text()
        bn = params["block_n"]
        fold = params.get("fold_scales", False)
        ring = params.get("ring_consumer", False)
        cfg = gg.GemmConfig(**params)
        # the wide tile's chains: 64 rows, then the rest (its fitted loops: N = 8 .. 64 alone, 64 + 8 .. 64 + 32)
        wide = bn in gg.TABLE_WIDE_BLOCK_N
        tails = (bn - gg.WIDE_MAIN_N) // 8 if wide else 0
        top = gg.WIDE_MAIN_N if wide else bn
        # register A ({...} list of 4 regs), shared-memory B descriptor, E4M3 x E4M3, one K32 per instruction
        mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{top}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, \{{([^}}]*)\}}",
                         ptx)
        # one K128 step of 4 K32 WGMMAs; the pipelined consumer has it twice (the first step, then the loop's), with
        # step_group four times (an even count's first step, the first step, two per trip of its loop), the
        # pipelined table consumer three times (the first step, then two per trip of its loop); the wide tile's
        # N = 64 chain once per loop that has it
        def steps_at(n, cfg=cfg):
            return (4 if cfg.step_group else 2) if cfg.pipelined else 3 if cfg.table_pipelined else 1

        steps = steps_at(top)
        main_loops = (1 + tails if cfg.fit_n else 1) if wide else 1
        assert len(mma) == 4 * steps * main_loops and all(len(a.split(",")) == 4 for a in mma), variant.describe()
        # the token tile's 16-byte cp.async pieces (tma_tokens: only a fenced owner's staged pieces have them)
        assert ("cp.async.cg.shared.global" in ptx) == (not cfg.tma_tokens or not cfg.tagged_pieces)
        assert "L2::cache_hint" not in ptx
        # the split order's decode: row g's register is one mask of the code word (0x9C9C9C9C), four per K128 step
        masks = len(re.findall(r"and\.b32\s+%r\d+, %r\d+, -1667457892;", ptx))
        assert (masks >= 8) == cfg.split_nibbles, variant.describe()
        res = entry.resources
        # no stack but W1's epilogue at two shapes (grouped_gemm._local_bytes_budget; none inside the K loops: the
        # bench's SASS report)
        assert res["frame_bytes"] <= variant.local_bytes_budget, f"{variant.describe()} spills: {res['frame_bytes']} B"
        if cfg.fit_n:  # one loop per N = 8, 16, ... bn, each with its four chained K32 WGMMAs (wide: and the tails)
            for n in range(8, top, 8):
                loops = 1 + (n <= 8 * tails)
                assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.", ptx)) == 4 * (
                    steps_at(n) + (loops - 1) * steps_at(gg.WIDE_MAIN_N + n))  # the wide tile's tail chains
        # ptxas's budget: 96 per thread for one 544-thread CTA per SM, 56 for two, 128 for 512 threads
        assert res["registers"] <= ({1: 96, 2: 56}[cfg.ctas_per_sm] if cfg.warp_specialized else 128)
        assert (".minnctapersm 2" in ptx) == (cfg.ctas_per_sm == 2)
        assert entry.launch.block == (cfg.threads, 1, 1) and res["required_block"][0] == cfg.threads
        expected = [8 if kind in ("u64", "s64") else 4 for _, kind in cfg.params]
        assert [size for _, size in res["params"]] == expected  # folding changes no parameter, the ring appends
        assert len(expected) == len(gg.PARAMS_W1 if params["role"] == "w1" else gg.PARAMS_W2) + (
            len(gg.RING_PARAMS_W1 if params["role"] == "w1" else gg.RING_PARAMS_W2) if ring else 0) + (
            len(gg.SPLIT_PARAMS) if params.get("k_splits", 1) > 1 else 0) + (
            len(gg.STREAM_PARAMS) if params.get("stream_k") else 0) + (
            len(gg.HANDOVER_PARAMS_W1 if params["role"] == "w1" else gg.HANDOVER_PARAMS_W2)
            if params.get("handover") else 0) + (len(gg.PERSIST_PARAMS) if params.get("persistent") else 0) + (
            len(gg.TOKEN_MAP_PARAMS) if params.get("tma_tokens") else 0)
        assert entry.launch.dynamic_smem_bytes == cfg.smem_bytes
        assert not re.search(r"\b(ld|st)\.local\b", ptx), variant.describe()
        waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d);", ptx)
        loops = bn // 8 if cfg.fit_n else 1  # fit_n: the consumer once per N
        if cfg.step_group:  # an even count's first step drained at once; then each step waits for the one before it
            assert waits == ["1", "0", "1", "1", "1", "0"], variant.describe()
        elif cfg.pipelined:  # every group waits for the one before it (1 in flight), a last wait drains
            groups = 4 // cfg.wgmmas_per_group
            assert waits == ["1"] * (2 * groups) + ["0"], variant.describe()
        elif cfg.table_pipelined:  # each step's chain waits for the step before it, a last wait drains
            assert waits == (["1"] * 3 + ["0"]) * loops, variant.describe()
        else:  # the wide tile's two-chain loops wait twice per step (with scale_ratios once: one commit for both)
            second = (tails if cfg.fit_n else 1) if wide and not cfg.scale_ratios else 0
            assert waits == ["0"] * ((1 if fold else 4 // cfg.wgmmas_per_wait) * loops + second), variant.describe()


def test_default_variants_do_not_name_the_fold_knob():
    """The default set keeps its parameters, so its cache keys (and binaries) are those of before the knob."""
    for v in gg.variant_set() + gg.variant_set(fold_scales=True):
        assert "ring_consumer" not in dict(v.params)
    for v in gg.variant_set():
        assert "fold_scales" not in dict(v.params)
    assert all(dict(v.params)["fold_scales"] is True for v in gg.variant_set(fold_scales=True))
    assert gg.GemmConfig("w1", 64, fold_scales=True).wgmmas_per_wait == 4
    assert gg.GemmConfig("w1", 64).name + "_fold" == gg.GemmConfig("w1", 64, fold_scales=True).name


def test_folded_variants_chain_four_k32_wgmmas_into_one_accumulator(built):
    """fold_scales: per K128 step one asm block of four WGMMAs on the same accumulator registers, the first
    fresh and three accumulating, one wait; the FP32 work left is one FMA per accumulator per step."""
    folded = {v: e for v, e in built.items() if dict(v.params).get("fold_scales")}
    # the folded decode, the table decode (+ bn 16 and 24 at 2 per SM), its fitted N at bn 16 / 24 / 32 / 64, and
    # the lean epilogue at bn 16 / 24 / 32 / 64, the wide tile 96 (with and without it), the persistent grids at
    # bn 8 / 16 / 32 / 64 / 96, their snake walk and their scale ratios at bn 32 / 64 / 96, the transposed stores at
    # bn 16 / 24 / 32 / 64 / 96 (W1 not at 24; and as the unit grid at 32 / 64 / 96), W2's early combine rows at the
    # same tiles, tile_knobs's capped rings at bn 32 / 64 (persistent and as the unit grid)
    assert len(folded) == 4 * len(gg.BLOCK_N_CHOICES) + 2 + 2 + 8 + 8 + 4 + 10 + 6 + 6 + 9 + 6 + 5 + 4 + 4
    for variant, entry in folded.items():
        bn = dict(variant.params)["block_n"]
        cfg = gg.GemmConfig(**dict(variant.params))
        wide = bn in gg.TABLE_WIDE_BLOCK_N  # its largest chain is 64 rows (see the test above)
        top = gg.WIDE_MAIN_N if wide else bn
        ptx = entry.ptx_path.read_text()
        mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{top}k32\.f32\.e4m3\.e4m3 \{{([^}}]*)\}}, "
                         r"\{[^}]*\}, %rd\d+, (\w+), 1, 1;", ptx)
        chains = 3 if cfg.table_pipelined else 1  # see the test above
        if wide:
            chains = 1 + (bn - gg.WIDE_MAIN_N) // 8 if cfg.fit_n else 1
        assert len(mma) == 4 * chains, variant.describe()
        assert all(len({acc for acc, _ in mma[i:i + 4]}) == 1 for i in range(0, len(mma), 4)), variant.describe()
        assert len(mma[0][0].split(",")) == top // 2
        if cfg.scale_ratios:  # every WGMMA accumulates into the rescaled sums (scale-d true), one wait per chain pair
            assert [pred for _, pred in mma] == ["sum"] * 4 * chains and "setp.eq.b32 sum, 0, 0;" in ptx
            assert "fresh" not in ptx
        else:
            assert [pred for _, pred in mma] == ["fresh", "chain", "chain", "chain"] * chains
            assert "setp.ne.b32 fresh" in ptx and "setp.eq.b32 chain" in ptx  # fresh false, chain true (zero input)
        assert entry.resources["frame_bytes"] <= variant.local_bytes_budget and entry.resources["registers"] <= 128


def test_warp_specialized_ptx_has_no_cta_barrier_in_the_main_loop(built):
    """The warp-specialized variants: one CTA-wide barrier (after the mbarrier init), per stage a full barrier
    of 33 arrivals per producer warp (the producer's expect-tx + 32 cp.async arrivals each) and an empty barrier of 16 (one per
    consumer warp), bulk copies of the 4096-byte weight tiles and 256-byte scale blocks completing on it,
    the consumers' waits, proxy fence and release; W1's epilogue meets on a 512-thread named barrier."""
    from gc_moe.kernels.sm90 import ptx as ptx_mod  # needs the DSL, as the fixture does

    ws = {v: e for v, e in built.items() if gg.GemmConfig(**dict(v.params)).warp_specialized}
    # default, folded and ring-consumer sets, both roles, bn 8..32; compact ring bn 8; split W1 / W2 at bn 8 / 16;
    # the table decode at bn 8..64 and at bn 16 / 24 with two CTAs per SM, its fitted N at bn 16 / 24 / 32 / 64; the
    # stream-K loops at bn 8 (plain, and traced at one CTA per SM); the lean epilogue at bn 16 / 24 / 32 / 64 and in
    # the stream-K loops at one CTA per SM; the wide tile 96; the stream-K loops with the hand-over words (and W2
    # taking them first); the persistent grids at bn 8 / 16 / 32 / 64 / 96 (and their snake walk and scale ratios at
    # bn 32 / 64 / 96); the transposed stores at bn 16 / 24 / 32 / 64 / 96 (W1 not at 24; and as the unit grid at
    # 32 / 64 / 96), W2's early combine rows, the stream-K loops with a step's WGMMAs as one group (plain, lean and
    # traced) and with tagged pieces (plain, lean, traced, step_group), tile_knobs's capped rings at bn 8 / 32 / 64
    # (and as the unit grid at 32 / 64), tile 8's unit grid at its capped ring, the stream-K walk's quick start
    # (traced, with the words) and the plain walk at tile_knobs's ring (plain, traced, with the words), tile 8's loops
    # on the split nibble order (stream-K, traced, the unit grid), tile_knobs's H200 tile-8 loops (plain, traced),
    # each card's tile-8 loops without lean_ring (its baseline; and the H200's traced), each card's tile-8 loops with
    # the token tile through a tensor map (plain, traced), each card's tile-8 loops with the dynamic tail, each card's
    # tile-8 loops with a step's scales held from its wait (plain, traced), each card's tile-8 loops with W1's amax
    # slot sets and with the lean epilogue (the H100's rule has it), each card's tile-8 W1 with its epilogue warp
    assert len(ws) == (6 * 3 + 2 + 2 * 2 * 3 + 2 * 4 + 2 + 2 + 6 + 4 + 4 + 8 + 4 + 4 + 4 + 10 + 2 + 6 + 6 + 9 + 6 + 5
                       + 6 + 8 + 6 + 4 + 2 + 10 + 6 + 4 + 6 + 8 + 4 + 8 + 9 + 4)
    for variant, entry in ws.items():
        params = dict(variant.params)
        cfg = gg.GemmConfig(**params)
        ptx = _entry_body(entry)
        # the ring consumer's W1 adds two before the main loop: after the RING_READY wait and the acquire; the snake
        # walk one, between the experts' counts and their ranking (before the stage ring's)
        ring_w1 = params.get("ring_consumer", False) and params["role"] == "w1"
        assert ptx.count("bar.sync 0;") == (3 if ring_w1 else 1) + bool(params.get("snake_walk")), variant.describe()
        # a split unit meets three times before the epilogue: partials stored, the arrival's flag, flag read; a
        # stream-K piece once (partials stored before the release; the owner: its acquire before the loads), and
        # a stream-K or persistent W1 epilogue once more at its end (its amax words are read before the next unit's
        # epilogue), a lean W1 epilogue once more after its per-token amax, a handover W1 once more before it publishes
        # a unit, a W1 with transposed stores once more before its rows are copied out; stream-K with tagged pieces
        # not at all (a piece's stores need no meeting, an owner's warps poll their own slots); a W1 with the amax
        # slot sets meets once per epilogue, lean or not (its reductions before, its reads after); a W1 with the
        # epilogue warp not at all (its consumers hand the values over through the slot's barriers)
        split = 3 if params.get("k_splits", 1) > 1 else 0 if params.get("tagged_pieces") else 2 if params.get(
            "stream_k") else 0
        w1_meets = 0
        if params.get("epilogue_warp"):
            w1_meets = 0
        elif params["role"] == "w1" and params.get("amax_slots"):
            w1_meets = 1
        elif params["role"] == "w1":
            w1_meets = (1 + bool(params.get("stream_k") or params.get("persistent")) + bool(params.get("lean_epilogue"))
                        + bool(params.get("handover")) + bool(params.get("transposed_stores")))
        # the dynamic tail: a chunk's two meetings (partials stored; thread 0's word read), a fenced owner's one more
        # before its staged pieces' stage goes back, and the chunks' own copy of the W1 epilogue
        tail = (2 + (not params.get("tagged_pieces")) + w1_meets) if params.get("dynamic_tail") else 0
        assert ptx.count("bar.sync 1, 512;") == split + w1_meets + tail, variant.describe()
        # a handover W2's producer warp meets on its own named barrier around the permit vote (bar.warp.sync there
        # cost every K loop its uniform registers), with words_first around its first look too
        producer_meets = (2 + 2 * bool(params.get("words_first"))) if params.get("handover") and params["role"] == "w2" \
            else 0
        assert ptx.count(f"bar.sync {ptx_mod.PRODUCER_WARP_BARRIER}, 32;") == producer_meets, variant.describe()
        assert ptx.count("mbarrier.init.shared::cta.b64 [%r") >= 1
        # (a persistent lean grid first sets up its two word slots' empty barriers, one arrival per consumer warp; the
        # epilogue warp's slot then has its full barrier, one arrival per consumer thread, and its empty one, per lane)
        assert re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx) == (
            ["16", "16"] if cfg.persistent and cfg.lean_epilogue else []) + [str(cfg.full_arrivals), "16"] * cfg.stages \
            + (["512", "32"] if cfg.epilogue_warp else [])
        bulk = re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes "
                          r"\[%r\d+\], \[%rd\d+\], (\d+), \[%r\d+\];", ptx)
        assert sorted(set(bulk)) == ["256", "4096"], variant.describe()
        # tma_tokens: the stage's token tile (block_n rows of 128 bytes) comes by one tensor-map copy, its bytes
        # announced with the weights', and the consumers keep no proxy fence (the one left orders the barriers' init)
        tma = bool(params.get("tma_tokens"))
        tx = gg.STAGE_TX_BYTES + (cfg.block_n * 128 if tma else 0)
        assert "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r" in ptx and f"], {tx};" in ptx, variant.describe()
        assert ("cp.async.bulk.tensor.3d.shared::cluster.global.tile" in ptx) == tma, variant.describe()
        assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx
        assert ptx.count("mbarrier.try_wait.parity.shared::cta.b64") >= 2  # consumers' full, producer's empty
        assert ("fence.proxy.async.shared::cta;" in ptx) != tma and "mbarrier.arrive.shared::cta.b64 _," in ptx
        assert "cp.async.wait_all;" in ptx and "cp.async.commit_group" not in ptx


# --------------------------------------------------------------------------------------------- ring consumer
def test_ring_consumer_knob_names_params_and_registration():
    cfg = gg.GemmConfig("w1", 16, ring_consumer=True)
    # the ring consumer runs on the pipeline of its bn's default: warp-specialized up to bn 32, cp.async at 64
    assert cfg.warp_specialized and cfg.name == gg.GemmConfig("w1", 16).name.replace("_ws", "_ring_ws")
    assert not gg.GemmConfig("w1", 64, ring_consumer=True).warp_specialized
    assert [n for n, _ in cfg.params][-6:] == ["ring_ready", "l1_full_count", "l1_empty_count", "ring_block_m",
                                               "ring_blocks", "timeout_ns"]
    assert [n for n, _ in gg.GemmConfig("w2", 8, ring_consumer=True).params][-3:] == ["ring_source", "peers",
                                                                                      "source_rows"]
    assert gg.GemmConfig("w1", 16).params == gg.PARAMS_W1 and gg.GemmConfig("w2", 16).params == gg.PARAMS_W2
    from gc_moe.kernels.registry import variants_for_profile

    ring = [v for v in variants_for_profile("sm_90a", {}) if dict(v.params).get("ring_consumer")]
    assert sorted((dict(v.params)["role"], dict(v.params)["block_n"], dict(v.params).get("compact_grid", False))
                  for v in ring) == sorted([(r, bn, False) for r in ("w1", "w2") for bn in gg.BLOCK_N_CHOICES]
                                           + [("w1", 8, True), ("w2", 8, True)])
    assert not any(dict(v.params).get("ring_consumer") for v in variants_for_profile("sm_103a", {}))


def test_ring_tile_waits_by_hand_with_ring_reuse():
    """Experts of 5, 0, 7 and 18 rows, token tiles of 8, ring blocks of 4 rows, 3 ring blocks (so logical
    blocks 3..7 are generations 1 and 2): each tile waits on the blocks its rows touch, at BM (generation + 1)."""
    offsets = [0, 5, 5, 12, 30]
    assert gg.tile_rows(offsets, 3, 2, 8) == (28, 2) and gg.tile_rows(offsets, 1, 0, 8) == (5, 0)
    assert gg.tile_rows(offsets, 3, 3, 8) == (36, 0)
    assert gg.ring_tile_waits(offsets, 8, 4, 3) == {
        (0, 0): [(0, 4), (1, 4)],  # rows 0..4: logical blocks 0, 1
        (2, 0): [(1, 4), (2, 4)],  # rows 5..11: blocks 1, 2
        (3, 0): [(0, 8), (1, 8)],  # rows 12..19: blocks 3, 4 = ring blocks 0, 1 of generation 1
        (3, 1): [(2, 8), (0, 12)],  # rows 20..27: blocks 5 (ring 2, gen 1) and 6 (ring 0, gen 2)
        (3, 2): [(1, 12)],  # rows 28, 29: block 7 (ring 1, gen 2)
    }
    # two weight-row CTAs per token tile: ring block 0 read by 3 tiles, block 1 by 4, block 2 by 2
    assert gg.expected_l1_empty_counts(offsets, 8, 4, 3, 2) == [6, 8, 4]


def test_ring_tile_waits_cover_every_row_once_on_random_layouts():
    """Against an independent walk (dispatch.expected_probe_rows, the probe's twin): the tiles start where the
    probe records them with the same row counts; with the ring covering the pool every wait is BM and the
    blocks waited on are exactly the blocks holding rows."""
    from gc_moe.kernels.sm90 import dispatch

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(20):
        experts = int(torch.randint(1, 9, (1,), generator=gen))
        counts = torch.randint(0, 40, (experts,), generator=gen)
        offsets = [0] + counts.cumsum(0).tolist()
        bn = gg.BLOCK_N_CHOICES[int(torch.randint(0, 4, (1,), generator=gen))]
        bm = int(torch.randint(1, 17, (1,), generator=gen))
        total = offsets[-1]
        blocks = max(1, -(-total // bm))
        waits = gg.ring_tile_waits(offsets, bn, bm, blocks)
        seen = dispatch.expected_probe_rows(offsets, bn, blocks * bm)
        got = [0] * (blocks * bm)
        for e, t in waits:
            first, rows = gg.tile_rows(offsets, e, t, bn)
            got[first] = rows
        assert got == seen
        assert all(c == bm for w in waits.values() for _, c in w)
        touched = {b for w in waits.values() for b, _ in w}
        assert touched == {r // bm for r in range(total)}


def _entry_body(entry):
    ptx = entry.ptx_path.read_text()
    return ptx[ptx.index(".entry"):]


def test_ring_consumer_w1_ptx_acquires_before_it_reads_and_releases_after(built):
    """W1 as a ring consumer: a bounded acquire wait on RING_READY before the coherent load of the expert
    offsets, acquire waits on l1_full_count before the first cp.async of the tile, the l1_empty_count release
    after the last WGMMA and the routing-weight loads, every trap after a %globaltimer comparison; the ring's
    words are read coherently (the only read-only load left is the weights' factor)."""
    ring = {v: e for v, e in built.items() if dict(v.params).get("ring_consumer") and dict(v.params)["role"] == "w1"}
    assert len(ring) == len(gg.BLOCK_N_CHOICES) + 1  # and the compact grid at bn 8
    for variant, entry in ring.items():
        ptx = _entry_body(entry)
        acquires = [m.start() for m in re.finditer(r"ld\.acquire\.gpu\.global\.b32", ptx)]
        offsets_load = ptx.find("ld.global.b32")
        first_copy = ptx.find("cp.async.cg.shared.global")
        release = [m.start() for m in re.finditer(r"atom\.release\.gpu\.global\.add\.s32", ptx)]
        assert len(acquires) >= 3 and acquires[0] < offsets_load < acquires[-1] < first_copy, variant.describe()
        assert ptx.rfind("bar.sync 0;", 0, first_copy) > acquires[-1]  # the CTA waits for thread 0's acquire
        assert len(release) == 1 and release[0] > ptx.rfind("wgmma.mma_async") and release[0] > ptx.rfind(
            "ld.global.f32")
        # the release follows a barrier of every consumer thread (CTA-wide, or the consumers' named barrier when
        # warp-specialized) that itself follows their last routing-weight load
        barrier = max(ptx.rfind("bar.sync 0;", 0, release[0]), ptx.rfind("bar.sync 1, 512;", 0, release[0]))
        assert barrier > ptx.rfind("ld.global.f32")
        assert ptx.count("ld.global.nc") == 1 and ptx.count("ld.global.nc.f32") == 1
        assert "%globaltimer" in ptx and "nanosleep" in ptx
        traps = [m.start() for m in re.finditer(r"\btrap;", ptx)]
        assert traps
        for pos in traps:
            before = ptx[:pos]
            assert before.rfind("%globaltimer") != -1 and before.rfind("setp.") > before.rfind("%globaltimer")
        assert entry.resources["frame_bytes"] == 0 and not re.search(r"\b(ld|st)\.local\b", ptx)


def test_ring_consumer_w2_ptx_scatters_through_the_peer_table(built):
    """W2 as a ring consumer: per stored row, the source rank from ring_source (a division by source_rows)
    and a 64-bit load of its peer offset before the BF16 stores; no waits (W2 follows W1 in the graph)."""
    ring = {v: e for v, e in built.items() if dict(v.params).get("ring_consumer") and dict(v.params)["role"] == "w2"}
    assert len(ring) == len(gg.BLOCK_N_CHOICES) + 1  # and the compact grid at bn 8
    for variant, entry in ring.items():
        ptx = _entry_body(entry)
        bn = dict(variant.params)["block_n"]
        assert len(re.findall(r"ld\.global\.nc\.b64", ptx)) == bn // 4  # one peer offset per stored row
        assert re.search(r"div\.s32", ptx)
        assert ptx.find("ld.global.nc.b64") < ptx.find("st.global.b16")
        # no ring waits: the only traps are the pipeline's own bounded mbarrier waits, as without the ring
        plain = _entry_body(built[gg.variant("w2", bn)])
        assert "ld.acquire" not in ptx and ptx.count("trap;") == plain.count("trap;")
        assert entry.resources["frame_bytes"] == 0


# --------------------------------------------------------------------------------------------- GPU check
def _run_case(hidden, inter, experts, topk, tokens, block_n, seed, fold_scales=False, warp_specialized=None,
              return_raw=False, w2_k_splits=1, sms=None, splits_out=None, relaunches=1, programmatic_pairs=0,
              pair_launches=0, pair_sm_weights=None, handover_pairs=0, handover_words_first=False, **more_knobs):
    """sms: the SMs a stream_k variant's grid spreads over (None: the device's); splits_out: a list that gets
    (offsets, W1's split buffers, W2's) after the launches; relaunches: how many times a split W1 and W2 are
    launched again on the same buffers (each must write the first launch's bytes); programmatic_pairs: then that
    many times W1 and a programmatic W2 back to back on poisoned outputs, half of them replays of a captured graph
    (each must write the same bytes); pair_launches: then that many launches of the stream-K pair kernel
    (kernels.sm90.stream_pair) on poisoned outputs and partials, half of them graph replays: each must write the
    bytes of the two kernels (the same stream-K partition over the same SMs) and leave its hand-over words zero;
    pair_sm_weights: a table, or a function of (offsets, W1's split buffers, W2's) that makes one from the traced
    loops' SM ids, for the sm_weights variant instead (its outputs are then what the function returns checks);
    handover_pairs: then that many W1 + W2 pairs of the handover variants (`GemmConfig.handover`, W2 launched
    programmatically) on poisoned outputs, half of them graph replays: each must write the bytes of the plain
    stream-K kernels (the same partition over the same SMs) and leave the hand-over words zero."""
    from gc_moe.runtime import jit

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the primary context must be current for the driver-level loads
    gen = torch.Generator(device=dev).manual_seed(seed)

    def mxfp4(rows, cols):
        packed = torch.randint(-128, 128, (experts, rows, cols // 2), dtype=torch.int8, generator=gen, device=dev)
        exps = torch.randint(117, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen, device=dev)
        return packed, pack_ue8m0(exps)

    l1, l2 = mxfp4(2 * inter, hidden), mxfp4(hidden, inter)
    w = wsm90.transform(l1, l2, nibble_order="table" if more_knobs.get("table_decode") else
                        "split" if more_knobs.get("split_nibbles") else "lane")
    # routing: tokens x topk distinct experts, expert 0 left without tokens
    if experts < topk + 2:
        raise ValueError(f"{experts} experts cannot leave expert 0 empty with top-{topk} routing; allowed: >= {topk + 2}")
    idx = torch.rand(tokens, experts - 1, generator=gen, device=dev).topk(topk, dim=1).indices + 1
    expert = idx.flatten()  # grouped rows are defined by the counts alone: row contents are drawn per row
    counts = torch.bincount(expert, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = counts.cumsum(0)
    rows = expert.numel()
    rw = torch.rand(rows, generator=gen, device=dev) + 0.1
    act, act_sf = quantize_fp8_k128(torch.randn(rows, hidden, generator=gen, device=dev))
    mid = torch.full((rows, inter), 0x7F, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)  # NaN
    mid_sf = torch.full((rows, inter // 128), float("nan"), device=dev)
    out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    dest = torch.randperm(rows, generator=gen, device=dev).to(torch.int32)
    knobs = {"fold_scales": fold_scales, "warp_specialized": warp_specialized, **more_knobs}
    k1 = jit.load_kernel(gg.variant("w1", block_n, **knobs), "sm_90a")
    k2 = jit.load_kernel(gg.variant("w2", block_n, **{**knobs, "k_splits": w2_k_splits}), "sm_90a")
    stream = torch.cuda.current_stream()
    cap = int(counts.max())
    split = gg.split_buffers(k1, w.l1, cap, dev, sms)  # k_splits > 1: partials and arrival counts, else None
    head1, head2 = _tagged_head(k1, w.l1, cap, sms), _tagged_head(k2, w.l2, cap, sms)
    _poison_partials(split, head1)
    gg.launch_w1(k1, w.l1, act, act_sf, offsets, rw, mid, mid_sf, cap, stream, split=split, sms=sms)
    if split is not None:
        # a second launch on the same buffers writes the same bytes (the last split sums in split order, whichever
        # arrives last) and leaves every arrival count at zero again
        first, first_sf = mid.clone(), mid_sf.clone()
        for launch in range(relaunches):
            mid.view(torch.uint8).fill_(0x7F)
            mid_sf.fill_(float("nan"))
            _poison_partials(split, head1)
            gg.launch_w1(k1, w.l1, act, act_sf, offsets, rw, mid, mid_sf, cap, stream, split=split, sms=sms)
            torch.cuda.synchronize()
            assert torch.equal(mid.view(torch.uint8), first.view(torch.uint8)) and torch.equal(mid_sf, first_sf), \
                f"{k1.name} relaunch {launch + 1} of {relaunches}: " + _byte_mismatch(mid, first, mid_sf, first_sf)
            assert int(split[1].abs().sum()) == 0, "a split unit's arrival count was not set back to zero"
    if head1 is not None:
        _poison_partials(split, head1)  # the last launch's slots are empty again too
    split2 = gg.split_buffers(k2, w.l2, cap, dev, sms)
    _poison_partials(split2, head2)
    gg.launch_w2(k2, w.l2, mid, mid_sf, offsets, dest, out, cap, stream, split=split2, sms=sms)
    if split2 is not None:  # as W1's above
        first = out.clone()
        for launch in range(relaunches):
            out.fill_(float("nan"))
            _poison_partials(split2, head2)
            gg.launch_w2(k2, w.l2, mid, mid_sf, offsets, dest, out, cap, stream, split=split2, sms=sms)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), first.view(torch.int16)), \
                f"W2 relaunch {launch + 1} of {relaunches}: " + _w2_mismatch(out, first)
            assert int(split2[1].abs().sum()) == 0, "a split W2 unit's arrival count was not set back to zero"
        if head2 is not None:
            _poison_partials(split2, head2)  # the last launch's slots are empty again too
    torch.cuda.synchronize()
    if programmatic_pairs:
        want_mid, want_sf, want_out = mid.clone(), mid_sf.clone(), out.clone()

        def pair(on):  # on the current stream `on` (the fills go there too)
            mid.view(torch.uint8).fill_(0x7F)
            mid_sf.fill_(float("nan"))
            out.fill_(float("nan"))
            gg.launch_w1(k1, w.l1, act, act_sf, offsets, rw, mid, mid_sf, cap, on, split=split, sms=sms)
            gg.launch_w2(k2, w.l2, mid, mid_sf, offsets, dest, out, cap, on, split=split2, sms=sms,
                         programmatic=True)

        for launch in _eager_and_replayed(pair, stream, programmatic_pairs):
            assert torch.equal(mid.view(torch.uint8), want_mid.view(torch.uint8)) and torch.equal(mid_sf, want_sf)
            assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), \
                f"programmatic pair {launch + 1}: " + _w2_mismatch(out, want_out)
    if handover_pairs:
        want_mid, want_sf, want_out = mid.clone(), mid_sf.clone(), out.clone()
        h1 = jit.load_kernel(gg.variant("w1", block_n, **knobs, handover=True), "sm_90a")
        h2 = jit.load_kernel(gg.variant("w2", block_n, **knobs, handover=True, words_first=handover_words_first),
                             "sm_90a")
        hsplit1, hsplit2 = gg.split_buffers(h1, w.l1, cap, dev, sms), gg.split_buffers(h2, w.l2, cap, dev, sms)
        ready = gg.handover_words(experts, cap, inter, dev)

        def handover_pair(on):
            mid.view(torch.uint8).fill_(0x7F)
            mid_sf.fill_(float("nan"))
            out.fill_(float("nan"))
            gg.launch_w1(h1, w.l1, act, act_sf, offsets, rw, mid, mid_sf, cap, on, split=hsplit1, sms=sms,
                         ready=ready)
            gg.launch_w2(h2, w.l2, mid, mid_sf, offsets, dest, out, cap, on, split=hsplit2, sms=sms,
                         programmatic=True, ready=ready)

        for launch in _eager_and_replayed(handover_pair, stream, handover_pairs):
            assert torch.equal(mid.view(torch.uint8), want_mid.view(torch.uint8)) and torch.equal(mid_sf, want_sf), \
                f"handover pair {launch + 1}: " + _byte_mismatch(mid, want_mid, mid_sf, want_sf)
            assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), \
                f"handover pair {launch + 1}: " + _w2_mismatch(out, want_out)
            assert int(ready.abs().sum()) == 0, f"handover pair {launch + 1} left hand-over words set"
    if pair_launches:
        weights = pair_sm_weights((offsets, split, split2)) if callable(pair_sm_weights) else pair_sm_weights
        _check_pair_kernel(w, act, act_sf, offsets, rw, mid, mid_sf, dest, out, cap, sms, pair_launches, weights)
    if splits_out is not None:
        splits_out.append((offsets, split, split2))
    if return_raw:
        return mid, mid_sf, out

    x = dequantize_fp8_k128(act, act_sf)
    got_mid = dequantize_fp8_k128(mid, mid_sf)
    ref_mid = torch.zeros(rows, inter, device=dev)
    ref_out = torch.zeros(rows, hidden, device=dev)
    for e in range(experts):
        a, b = int(offsets[e]), int(offsets[e + 1])
        if a == b:
            continue
        gu = x[a:b] @ dequantize_fp4_ue8m0(l1[0][e], l1[1][e]).T
        gate, up = gu[:, :inter].clamp(max=10.0), gu[:, inter:].clamp(-10.0, 10.0)
        ref_mid[a:b] = gate * torch.sigmoid(gate) * up * rw[a:b, None]
        ref_out[dest[a:b].long()] = ref_mid[a:b] @ dequantize_fp4_ue8m0(l2[0][e], l2[1][e]).T
    return got_mid, ref_mid, out.float(), ref_out


def _eager_and_replayed(launch_on, stream, launches):
    """Runs `launch_on(stream)` `launches` times, the odd ones as replays of a graph captured from it (on a stream
    of its own), synchronizing after each; yields the launch's index for the caller's checks."""
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()  # a capture needs a stream of its own
    capture.wait_stream(stream)
    with torch.cuda.graph(graph, stream=capture):
        launch_on(capture)
    stream.wait_stream(capture)
    for launch in range(launches):
        if launch % 2:
            graph.replay()
        else:
            launch_on(stream)
        torch.cuda.synchronize()
        yield launch


def _check_pair_kernel(w, act, act_sf, offsets, rw, mid, mid_sf, dest, out, cap, sms, launches, sm_weights=None):
    """The stream-K pair kernel over `_run_case`'s tensors, `launches` times per variant (odd ones graph replays).
    Without `sm_weights` its equal-range variants (plain, lean, words_first, publisher_warp, traced), each against the bytes
    the two kernels wrote there (`_run_case(pair_launches=...)`); with a table (`stream_pair.sm_weight_table` over the SMs the
    launch runs on) the sm_weights variant, every launch against its first (other piece boundaries: other last bits),
    its outputs left in mid / mid_sf / out."""
    from gc_moe.kernels.sm90 import stream_pair
    from gc_moe.runtime import jit

    torch.cuda.synchronize()
    want = (mid.clone(), mid_sf.clone(), out.clone()) if sm_weights is None else None
    buffers = stream_pair.pair_buffers(w.l1, w.l2, cap, mid.device, sms, sm_weights=sm_weights)
    stream = torch.cuda.current_stream()
    variants = [v for v in stream_pair.all_variants()
                if bool(dict(v.params).get("sm_weights")) == (sm_weights is not None)]
    split = wsm90.Sm90Weights(l1=wsm90.with_nibble_order(w.l1, "split"), l2=wsm90.with_nibble_order(w.l2, "split"))
    for variant in variants:
        kernel = jit.load_kernel(variant, "sm_90a")
        codes = split if dict(variant.params).get("split_nibbles") else w  # the same weights in its nibble order

        def pair(on, kernel=kernel, codes=codes):
            mid.view(torch.uint8).fill_(0x7F)
            mid_sf.fill_(float("nan"))
            out.fill_(float("nan"))
            _poison_partials(buffers["w1"])
            _poison_partials(buffers["w2"])
            stream_pair.launch_pair(kernel, codes.l1, codes.l2, act, act_sf, offsets, rw, mid, mid_sf, dest, out, cap,
                                    buffers, on)

        for launch in _eager_and_replayed(pair, stream, launches):
            if want is None:  # the weighted variant: its first launch is the reference of the others
                want = (mid.clone(), mid_sf.clone(), out.clone())
            want_mid, want_sf, want_out = want
            where = f"{variant.describe()} launch {launch + 1}: "
            assert torch.equal(mid.view(torch.uint8), want_mid.view(torch.uint8)) and torch.equal(mid_sf, want_sf), \
                where + _byte_mismatch(mid, want_mid, mid_sf, want_sf)
            assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), where + _w2_mismatch(out, want_out)
            assert int(buffers["ready"].abs().sum()) == 0, where + "a hand-over word was not back at zero"
            assert all(int(buffers[r][1].abs().sum()) == 0 for r in ("w1", "w2")), where + "a unit's count not reset"
        if dict(variant.params).get("trace"):  # each half's walk as the host partitions it, W2's wait after W1's end
            _check_pair_trace(buffers, w, offsets)


def _check_pair_trace(buffers, w, offsets):
    """The traced pair kernel's stamps (its last launch): every working CTA walked the host's segments in each half,
    its clocks in order, and each side of a CTA began W2 after its own W1 walk."""
    ctas = buffers["sms"]
    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS
    tiles = sum(-(-int(c) // 8) for c in (offsets[1:] - offsets[:-1]).tolist())
    words = {}
    for role, mat in (("w1", w.l1), ("w2", w.l2)):
        walks = gg.stream_segments(tiles * (mat.rows // gg.ROWS_PER_CTA), mat.cols // 128, ctas)
        words[role] = buffers[role][0][: ctas * gg.TRACE_SLOTS * 4].view(torch.int64).reshape(ctas, gg.TRACE_SLOTS,
                                                                                              2).tolist()
        for cta, walk in enumerate(walks):
            if walk:
                assert words[role][cta][tail + 2][0] == len(walk), (role, cta, words[role][cta][tail + 2], len(walk))
                assert words[role][cta][0][1] <= words[role][cta][1][1] <= words[role][cta][tail + 1][1]
    for cta in range(ctas):
        w1, w2 = words["w1"][cta], words["w2"][cta]
        if w2[tail + 2][0]:  # a W2 walk: thread 0 starts it after its W1 walk, the producer waits after its own
            assert w1[tail + 1][1] <= w2[0][1] and w1[tail][1] <= w2[tail + 3][1], (cta, w1[tail], w2[tail + 3])


def _poison_partials(split, tagged_head=None):
    """NaN over a split launch's FP32 partials (the counts stay zero): a partial read before its piece wrote it
    shows as a non-finite output instead of a stale or zero value. tagged_head (`_tagged_head`, for tagged_pieces):
    the slots must stay empty instead (a NaN there would read as a published partial), so check that every word
    past the traced phases' head is ptx.PIECE_EMPTY: what the previous launch left."""
    if split is None:
        return
    if tagged_head is None:
        split[0].fill_(float("nan"))
        return
    words = split[0].view(torch.int32)[tagged_head:]
    left = int((words != gg.PIECE_EMPTY_BITS).sum())
    assert left == 0, f"{left} words of tagged piece slots were not empty before the launch"


def _tagged_head(kernel, mat, capacity, sms):
    """None for a kernel without tagged_pieces, else the FP32 words ahead of its piece slots (the traced phases)."""
    cfg = gg.GemmConfig(**dict(kernel.entry.variant.params))
    if not cfg.tagged_pieces:
        return None
    if not cfg.trace:
        return 0
    return gg.grid(cfg, mat.rows, mat.num_experts, capacity, sms or gg.device_sms("cuda"))[0] * gg.TRACE_SLOTS * 4


def _cos_diff(y, r):
    y, r = y.double().flatten(), r.double().flatten()
    dot = (y * r).sum()
    return float(dot / (y.norm() * r.norm())), float(1 - 2 * dot / (y.square().sum() + r.square().sum()))


PIPELINES = [None, False]  # the default (warp-specialized up to bn 32) and the cp.async pipeline


def _assert_matches_reference(got_mid, ref_mid, got, ref):
    """Every W1 and W2 output element written, both within cosine 0.999 / difference 0.002 of float32."""
    assert torch.isfinite(got_mid).all() and torch.isfinite(got).all(), "an output element was not written"
    for y, r in ((got_mid, ref_mid), (got, ref)):
        cos, diff = _cos_diff(y, r)
        assert cos >= 0.999 and diff <= 0.002, (cos, diff)


def _byte_mismatch(mid, mid_ref, sf, sf_ref):
    """Where two W1 outputs differ: counts of differing E4M3 bytes and K128 scales, the first (row, channel)
    positions and the 128-channel blocks hit (whole blocks hint at a scale, scattered bytes at the sums)."""
    diff = (mid.view(torch.uint8) != mid_ref.view(torch.uint8)).nonzero().tolist()
    sf_diff = (sf.view(torch.int32) != sf_ref.view(torch.int32)).nonzero().tolist()
    blocks = sorted({(r, c // 128) for r, c in diff})
    values = [(float(mid[r, c].float()), float(mid_ref[r, c].float())) for r, c in diff[:6]]
    return (f"{len(diff)} of {mid.numel()} bytes differ (first at {diff[:6]}, E4M3 values {values}), in (row, "
            f"K128 block) {blocks[:12]}; {len(sf_diff)} scales differ (first at {sf_diff[:6]})")


def _w2_mismatch(out, out_ref):
    """How many BF16 W2 outputs differ between two runs."""
    return f"{int((out.view(torch.int16) != out_ref.view(torch.int16)).sum())} of {out.numel()} W2 outputs differ"


def _assert_same_bytes_to_an_ulp(run, reference_run):
    """Two raw `_run_case` results of the same arithmetic that ptxas may contract differently (a few FP32 multiply-adds
    of the epilogue in another loop nest): W1's E4M3 rows equal, its FP32 scales within a few ulps, W2's BF16 within
    one ulp in at most 1e-3 of the outputs (step 13 measured 1-6 in 10^5 for a persistent loop)."""
    (mid, sf, out), (mid_ref, sf_ref, out_ref) = run, reference_run
    assert torch.isfinite(sf).all() and torch.isfinite(out.float()).all()
    assert torch.equal(mid.view(torch.uint8), mid_ref.view(torch.uint8)), _byte_mismatch(mid, mid_ref, sf, sf_ref)
    assert ((sf - sf_ref).abs() <= 5e-7 * sf_ref.abs()).all()
    ulps = (out.view(torch.int16).int() - out_ref.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 1e-3, _w2_mismatch(out, out_ref)


def _assert_same_bytes(run, reference_run):
    """Two raw `_run_case` results (W1 rows, their scales, W2 rows): the first all written, both byte for byte equal."""
    (mid, sf, out), (mid_ref, sf_ref, out_ref) = run, reference_run
    assert torch.isfinite(sf).all() and torch.isfinite(out.float()).all()
    assert torch.equal(mid.view(torch.uint8), mid_ref.view(torch.uint8)) and torch.equal(sf, sf_ref), \
        _byte_mismatch(mid, mid_ref, sf, sf_ref)
    assert torch.equal(out.view(torch.int16), out_ref.view(torch.int16)), _w2_mismatch(out, out_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("warp_specialized", PIPELINES, ids=["default", "cpasync"])
@pytest.mark.parametrize("fold_scales", [False, True], ids=["unfolded", "folded"])
@pytest.mark.parametrize("block_n", gg.BLOCK_N_CHOICES)
@pytest.mark.parametrize("topk,tokens", [(1, 5), (8, 3), (6, 40), (8, 64)])
def test_grouped_gemm_matches_float32_reference(block_n, topk, tokens, fold_scales, warp_specialized):
    got_mid, ref_mid, got, ref = _run_case(512, 256, 10, topk, tokens, block_n, seed=block_n * 100 + tokens,
                                           fold_scales=fold_scales, warp_specialized=warp_specialized)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("warp_specialized", PIPELINES, ids=["default", "cpasync"])
@pytest.mark.parametrize("fold_scales", [False, True], ids=["unfolded", "folded"])
@pytest.mark.parametrize("hidden,inter,topk", [(5120, 2304, 6), (6144, 2048, 8)], ids=["deepseek", "glm"])
def test_grouped_gemm_model_shapes(hidden, inter, topk, fold_scales, warp_specialized):
    # expert 0 is left empty and topk distinct experts are drawn from the others: experts >= topk + 2
    _, _, got, ref = _run_case(hidden, inter, topk + 2, topk, 9, 16, seed=hidden, fold_scales=fold_scales,
                               warp_specialized=warp_specialized)
    assert torch.isfinite(got).all()
    cos, diff = _cos_diff(got, ref)
    assert cos >= 0.999 and diff <= 0.002, (cos, diff)


@pytest.mark.gpu
@pytest.mark.parametrize("k_splits", gg.K_SPLIT_CHOICES[1:])
@pytest.mark.parametrize("split_roles", ["w1", "w2", "both"])
@pytest.mark.parametrize("block_n", [bn for bn in gg.BLOCK_N_CHOICES if bn <= gg.K_SPLIT_MAX_BLOCK_N])
@pytest.mark.parametrize("hidden,inter,topk,tokens", [(512, 512, 1, 5), (512, 512, 8, 3), (1024, 512, 6, 40),
                                                      (6144, 2048, 8, 1)])
def test_split_k_matches_float32_reference(block_n, split_roles, k_splits, hidden, inter, topk, tokens):
    """W1 and / or W2 with K split over 2-4 CTAs (the last to arrive sums the partials): against the float32
    reference, every element written; two launches on the same buffers write the same bytes (`_run_case`)."""
    w1_splits = k_splits if split_roles in ("w1", "both") else 1
    w2_splits = k_splits if split_roles in ("w2", "both") else 1
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, max(10, topk + 2), topk, tokens, block_n,
                                           seed=block_n * 10 + k_splits + tokens, k_splits=w1_splits,
                                           w2_k_splits=w2_splits)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,ctas_per_sm", [(8, 1), (8, 2)])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (512, 512, 10, 1, 5, None),      # more CTAs than steps: 1-step pieces, idle CTAs
    (1024, 512, 10, 8, 3, None),
    (1024, 512, 10, 6, 40, 3),       # few CTAs: many units per CTA on one continuing ring
    (6144, 2048, 10, 8, 1, None),    # GLM-5.2's K at one token
    (5120, 2304, 48, 6, 2, 7),       # DeepSeek-V4.1-Flash's K, units cut at odd places
    (5120, 2304, 48, 6, 2, None),    # and over every SM (two CTAs per SM: uneven progress, owners waiting)
    (512, 256, 64, 8, 12, None)])    # the most local experts a stream-K loop takes (two passes of the scan)
def test_stream_k_matches_float32_reference(block_n, ctas_per_sm, hidden, inter, experts, topk, tokens, sms):
    """W1 and W2 as stream-K loops (the CTAs share the units' steps; the other pieces of a shared unit added in CTA
    order by its owner): against the float32 reference, every element written; two launches on the same buffers
    write the same bytes and leave every count at zero (`_run_case`)."""
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, experts, topk, tokens, block_n,
                                           seed=hidden + tokens + block_n, stream_k=True, ctas_per_sm=ctas_per_sm,
                                           sms=sms, relaunches=8)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [
    (5120, 2304, 48, 6, 1),          # DeepSeek-V4.1-Flash at one token: W2 starts while W1's tail runs
    (6144, 2048, 32, 8, 8),
    (1024, 512, 10, 6, 40)])         # many units per CTA
def test_programmatic_w2_reads_the_finished_w1_rows(ctas_per_sm, hidden, inter, experts, topk, tokens):
    """The stream-K W2 launched programmatically right after its W1 (launch_w2(programmatic=True), directly and in
    a captured graph) writes the bytes of the serialized pair: its producer waits for W1's grid before it copies a
    row, though its CTAs and their weight stages start earlier. Outputs poisoned before every pair."""
    _run_case(hidden, inter, experts, topk, tokens, 8, seed=hidden + tokens, stream_k=True, ctas_per_sm=ctas_per_sm,
              programmatic_pairs=10, return_raw=True)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (5120, 2304, 48, 6, 1, None),    # DeepSeek-V4.1-Flash at one token: W2's SMs start while W1's tail runs
    (6144, 2048, 32, 8, 8, None),    # GLM-5.2 at eight tokens
    (1024, 512, 10, 6, 40, 3)])      # many units per CTA, W2's segments waiting on W1 units of other CTAs
@pytest.mark.parametrize("words_first", [False, True], ids=["weights_first", "words_first"])
def test_handover_pair_writes_the_stream_k_bytes(hidden, inter, experts, topk, tokens, sms, words_first):
    """The handover W1 + W2 (W2 programmatic, taking W1's rows per K128 step through the hand-over words instead of
    waiting for W1's grid; words_first: each W2 segment takes its words before its weights where W1 set them): ten
    pairs, half graph replays, on poisoned outputs write the plain stream-K kernels' bytes (which match the float32
    reference) and leave every word at zero."""
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, experts, topk, tokens, 8, seed=hidden + tokens + 5,
                                           stream_k=True, ctas_per_sm=1, sms=sms, handover_pairs=10,
                                           handover_words_first=words_first)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [
    (5120, 2304, 48, 6, 1),          # DeepSeek-V4.1-Flash at one token
    (6144, 2048, 32, 8, 8),          # GLM-5.2 at eight tokens
    (1024, 512, 10, 6, 40)])         # many units per CTA
def test_stream_pair_with_sm_weights_matches_float32_reference(hidden, inter, experts, topk, tokens):
    """The sm_weights pair kernel: ranges sized by per-SM weights (random within the allowed ratio, over the SMs the
    traced stream-K loops ran on) give other piece boundaries, so its bytes are checked against the float32
    reference; eight launches (half graph replays) write the same bytes and leave the words at zero."""
    import random

    from gc_moe.kernels.sm90 import stream_pair

    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS
    ctas = gg.device_sms("cuda")

    def table_from_trace(splits):
        words = splits[1][0][: ctas * gg.TRACE_SLOTS * 4].view(torch.int64).reshape(ctas, gg.TRACE_SLOTS, 2)
        smids = {int(words[c, tail + 2, 1]) for c in range(ctas)}
        assert len(smids) == ctas, "every SM runs one traced CTA"
        rng = random.Random(hidden + tokens)
        return stream_pair.sm_weight_table({s: rng.uniform(0.7, 1.3) for s in smids})

    got_mid, ref_mid, got, ref = _run_case(hidden, inter, experts, topk, tokens, 8, seed=hidden + tokens + 1,
                                           stream_k=True, ctas_per_sm=1, trace=True, pair_launches=8,
                                           pair_sm_weights=table_from_trace)
    _assert_matches_reference(got_mid, ref_mid, got, ref)  # the weighted pair's outputs, left in place


@pytest.mark.gpu
def test_traced_programmatic_pair_stamps_the_handover_in_order():
    """The traced stream-K pair with the programmatic W2 (the bench's pair trace): the same bytes as the plain pair,
    and on the %globaltimer axis each W2 CTA starts after some W1 CTA ended (one CTA per SM) and its producer's
    `griddepcontrol.wait` returns only after the last W1 CTA's end, its first full stage after that."""
    bench = _load_script("bench_grouped_gemm_sm90")
    case = (5120, 2304, 48, 6, 1, 8)
    splits = []
    traced = _run_case(*case, seed=3, stream_k=True, ctas_per_sm=1, trace=True, programmatic_pairs=4,
                       return_raw=True, splits_out=splits)
    _assert_same_bytes(traced, _run_case(*case, seed=3, stream_k=True, ctas_per_sm=1, return_raw=True))
    offsets, split1, split2 = splits[0]
    counts = (offsets[1:] - offsets[:-1]).tolist()
    ctas = gg.device_sms("cuda")
    tiles = sum(-(-c // 8) for c in counts)
    seg1 = gg.stream_segments(tiles * (2 * 2304 // gg.ROWS_PER_CTA), 5120 // 128, ctas)
    seg2 = gg.stream_segments(tiles * (5120 // gg.ROWS_PER_CTA), 2304 // 128, ctas)
    words = [split[0][: ctas * gg.TRACE_SLOTS * 4].view(torch.int64).reshape(ctas, gg.TRACE_SLOTS, 2).tolist()
             for split in (split1, split2)]
    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS
    w1_ends = [max(w[tail][0], w[tail + 1][0]) for w, seg in zip(words[0], seg1) if seg]
    w2 = [w for w, seg in zip(words[1], seg2) if seg]
    assert all(w[tail + 3][0] >= max(w1_ends) for w in w2), "a W2 producer passed its wait before W1's grid ended"
    assert all(w[4][0] >= w[tail + 3][0] for w in w2)  # the first stage holds W1's rows: after the wait
    w1 = [w for w, seg in zip(words[0], seg1) if seg]  # W1's producer: scan, first copies out, then the full stage
    assert all(w[2][0] <= w[tail + 3][0] <= w[4][0] and w[tail + 3][1] > 0 for w in w1)
    assert all(w[2][1] <= w[tail + 4][1] <= w[tail + 5][1] <= w[tail + 6][1] <= w[tail + 3][1] for w in w1)  # its path
    got = bench.pair_trace_summary(split1[0][: ctas * gg.TRACE_SLOTS * 4], seg1,
                                   split2[0][: ctas * gg.TRACE_SLOTS * 4], seg2)
    assert got["w2_first_start_us"] >= got["w1_first_end_us"] and got["span_us"] > got["w1_last_end_us"] > 0
    assert got["w2_wait_done_after_w1_us"][0] >= 0 and got["w2_start_after_own_sm_w1_us"][0] >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (5120, 2304, 48, 6, 1, None),    # DeepSeek-V4.1-Flash at one token, every SM
    (6144, 2048, 32, 8, 8, None),    # GLM-5.2 at eight tokens
    (5120, 2304, 48, 6, 2, 7),       # units cut at odd places, W2 waiting on W1 units of other CTAs
    (1024, 512, 10, 6, 40, 3),       # many units per CTA: W1 owners with staged pieces, then W2 on the same ring
    (512, 256, 64, 8, 12, None)])    # the most local experts (two passes of the scan), more CTAs than W2 steps
def test_stream_pair_matches_float32_reference_and_the_two_kernels(hidden, inter, experts, topk, tokens, sms):
    """The stream-K pair kernel (W1 and W2 in one launch, handing over through counted words) writes the bytes of
    the two stream-K kernels at one CTA per SM, which match the float32 reference; eight launches of each variant
    (plain, lean_epilogue, words_first, publisher_warp, traced; half of them graph replays) on poisoned outputs,
    each leaving its words and counts at zero."""
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, experts, topk, tokens, 8, seed=hidden + tokens + experts,
                                           stream_k=True, ctas_per_sm=1, sms=sms, pair_launches=8)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


def test_stream_pair_host_side_names_what_is_wrong():
    """The pair kernel's halves share one ring; its launch refuses mismatched matrices and a W2 K it cannot poll."""
    from types import SimpleNamespace

    from gc_moe.kernels.sm90 import stream_pair

    cfg = stream_pair.PairConfig()
    w1, w2 = cfg.half("w1"), cfg.half("w2")
    assert w1.stream_pair and w2.stream_pair and w1.stages == w2.stages and w1.smem_bytes == w2.smem_bytes
    assert w1.name.endswith("_skp_ws") and "stream_pair" not in dict(gg.variant("w1", 8, stream_k=True).params)
    with pytest.raises(ValueError, match="stream_pair is a half"):
        gg.GemmConfig("w1", 8, stream_pair=True, ctas_per_sm=1)  # not stream_k
    assert stream_pair.ready_words(48, 9, 2304) == 48 * 2 * 18
    knobs = ("lean_epilogue", "sm_weights", "trace", "words_first", "publisher_warp", "quick_start", "split_nibbles")
    assert [{k for k in knobs if dict(v.params).get(k)} for v in stream_pair.all_variants()] == [
        set(), {"lean_epilogue"}, {"sm_weights"}, {"trace"}, {"words_first"}, {"trace", "words_first"},
        {"publisher_warp"}, {"words_first", "publisher_warp"}, {"trace", "words_first", "publisher_warp"},
        {"quick_start"}, {"quick_start", "trace"}, {"quick_start", "words_first", "publisher_warp"},
        {"split_nibbles"}, {"split_nibbles", "trace"}, {"split_nibbles", "quick_start"},
        {"split_nibbles", "words_first", "publisher_warp"}]
    split = stream_pair.PairConfig(split_nibbles=True)  # both halves read the split order
    assert split.half("w1").split_nibbles and split.half("w2").split_nibbles
    quick = stream_pair.PairConfig(quick_start=True)  # W1's walk only: W2's starts under W1's last units
    assert quick.half("w1").quick_start and not quick.half("w2").quick_start
    with pytest.raises(ValueError, match="quick_start is a knob of the stream_k W1 / W2"):
        stream_pair.PairConfig(quick_start=True, sm_weights=True)
    traced = stream_pair.PairConfig(trace=True).half("w2")
    assert traced.name.endswith("_skpt_ws") and traced.trace
    with pytest.raises(ValueError, match="not traced"):
        stream_pair.PairConfig(trace=True, sm_weights=True)
    assert stream_pair.PairConfig(lean_epilogue=True).half("w2").lean_epilogue
    weighted = stream_pair.PairConfig(sm_weights=True).half("w1")
    assert weighted.name.endswith("_skpw_ws") and weighted.smem_bytes == w1.smem_bytes + 2 * gg.SM_TABLE_BYTES
    assert weighted.stages == w1.stages and weighted.smem_bytes <= weighted.smem_limit
    with pytest.raises(ValueError, match="sm_weights sizes the ranges"):
        gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, sm_weights=True)

    def mat(rows, cols, interleaved, experts=4):
        return SimpleNamespace(rows=rows, cols=cols, num_experts=experts, gate_up_interleaved=interleaved)
    kernel = SimpleNamespace(entry=SimpleNamespace(variant=stream_pair.variant()))
    args = (None,) * 8 + (8, {})  # the tensors, capacity, buffers
    with pytest.raises(ValueError, match="l1 = the W1 matrix"):
        stream_pair.pair_launch(kernel, mat(1024, 512, False), mat(512, 512, False), *args)
    with pytest.raises(ValueError, match=r"W2 must be \[4, 512, 512\]"):
        stream_pair.pair_launch(kernel, mat(1024, 512, True), mat(512, 256, False), *args)
    with pytest.raises(ValueError, match="intermediate <= 4096"):
        stream_pair.pair_launch(kernel, mat(2 * 4224, 512, True), mat(512, 4224, False), *args)
    with pytest.raises(ValueError, match="at most 64"):
        stream_pair.pair_launch(kernel, mat(1024, 512, True, 65), mat(512, 512, False, 65), *args)


@pytest.mark.parametrize("counts,hidden,inter,sms", [
    ([1, 0, 3, 2, 0, 1, 1, 1, 2], 5120, 2304, 132),   # DeepSeek-V4.1-Flash's K at one token
    ([9, 0, 17, 8, 40, 1], 6144, 2048, 132),          # several token tiles per expert
    ([5, 0, 30, 2], 1024, 512, 3),                    # few SMs: many segments per CTA
    ([3] * 64, 512, 256, 132)])                        # the most experts; more CTAs than W2 steps
def test_stream_pair_hand_over_words_end_at_zero(counts, hidden, inter, sms):
    """The pair kernel's host twin of its hand-over: with the kernel's unit order and stream-K partition, every
    word a W2 segment reads is one a W1 unit publishes, and each ends the launch at zero (W1 adds H / 256 readers,
    the W2 units of its token tile take one permit each), so a replay starts from clean words."""
    from gc_moe.kernels.sm90 import stream_pair

    words = stream_pair.hand_over_balance(counts, hidden, inter, sms)
    assert words and all(v == 0 for v in words.values()), {k: v for k, v in words.items() if v}
    assert max(words) < stream_pair.ready_words(len(counts), max(counts), inter)


def test_stream_pair_weighted_ranges_tile_the_work_and_find_their_owners():
    """The sm_weights variant's ranges (host twin): nonempty, in %smid order, covering every K128 step once; the
    kernel's owner search (the largest smid s with work W_s < (step + 1) W, then its rank) names the rank whose range
    holds each step; below SM_WEIGHT_MIN_STEPS per SM the equal ranges by rank; the hand-over words still end at 0."""
    import random

    from gc_moe.kernels.sm90 import stream_pair

    rng = random.Random(3)
    smids = sorted(rng.sample(range(gg.MAX_SM_IDS), 132))  # not contiguous: the table names the launch's SMs
    table = stream_pair.sm_weight_table({s: rng.uniform(0.5, 1.5) for s in smids})
    weighted = [w for w in table if w > 0]
    assert len(weighted) == 132 and max(weighted) <= gg.SM_WEIGHT_RATIO * min(weighted)
    assert abs(sum(weighted) / 132 - 1000) < 60
    prefix = [sum(table[:i]) for i in range(gg.MAX_SM_IDS + 1)]
    rank_prefix = [sum(1 for w in table[:i] if w > 0) for i in range(gg.MAX_SM_IDS + 1)]
    for work in (4 * 132, 6077, 99991):
        ranges = stream_pair.weighted_ranges(table, work)
        assert ranges[0][0] == 0 and ranges[-1][1] == work
        assert all(a < b for a, b in ranges) and all(ranges[r][1] == ranges[r + 1][0] for r in range(131))
        for step in range(0, work, max(1, work // 997)):
            lo = 0  # the kernel's binary search, bit by bit from 2^7
            for bit in range(7, -1, -1):
                if work * prefix[lo + (1 << bit)] < (step + 1) * prefix[-1]:
                    lo += 1 << bit
            owner = rank_prefix[lo]
            assert ranges[owner][0] <= step < ranges[owner][1], (work, step, owner)
    small = stream_pair.weighted_ranges(table, 100)  # fewer than 4 steps per SM: equal ranges, 100 ranks working
    assert [b - a for a, b in small] == [1] * 100 + [0] * 32
    words = stream_pair.hand_over_balance([1, 0, 3, 2, 0, 1, 1, 1, 2], 5120, 2304, 132, table)
    assert all(v == 0 for v in words.values())
    with pytest.raises(ValueError, match="positive rate"):
        stream_pair.sm_weight_table({300: 1.0})


def test_stream_pair_builds_offline_without_local_memory(tmp_path):
    """The pair kernel builds on a machine without a GPU: its promises (the hand-over's release, relaxed adds and
    fence, the bounded waits' trap) and a stack of 0 bytes are checked by the build; each half's pipelined K loop
    issues its four K32 WGMMAs twice (the first step, then the loop's) and the W2 producer polls with one warp vote
    (words_first: and looks once with another, then takes its permits with acquire atomics)."""
    pytest.importorskip("cutlass")
    from gc_moe.kernels.sm90 import stream_pair
    from gc_moe.runtime import jit

    for variant in stream_pair.all_variants():
        entry = jit.build_variant(variant, "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3", ptx)) == 2 * 2 * 4
        first = bool(dict(variant.params).get("words_first"))
        assert ptx.count("vote.sync.all.pred") == 1 + first and ptx.count("red.release.gpu.global.add.s32") >= 1
        assert ptx.count("atom.acquire.gpu.global.add.s32") == first
        # publisher_warp: thread 0 counts the finished W1 units (one release store), the publisher polls the count
        publisher = bool(dict(variant.params).get("publisher_warp"))
        assert ptx.count("st.release.cta.shared::cta.b32") == publisher
        assert ("ld.acquire.cta.shared::cta.b32" in ptx) == publisher
        assert entry.resources["required_block"][0] == 544 + 32 * publisher


def test_handover_knob_its_parameters_and_what_it_refuses():
    """The stand-alone stream-K pair's hand-over words (`GemmConfig.handover`): a knob of the stream-K loops at one
    CTA per SM (the variant's default there), its own name and parameters: W1's three, W2's two."""
    w1, w2 = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, handover=True), \
        gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1, handover=True)
    assert [n for n, _ in w1.params] == [n for n, _ in gg.PARAMS_W1 + gg.STREAM_PARAMS + gg.HANDOVER_PARAMS_W1]
    assert [n for n, _ in w2.params] == [n for n, _ in gg.PARAMS_W2 + gg.STREAM_PARAMS + gg.HANDOVER_PARAMS_W2]
    assert "_sk_ho" in w1.name and "_sk_ho" in w2.name
    assert dict(gg.variant("w1", 8, stream_k=True, handover=True).params)["ctas_per_sm"] == 1
    assert "handover" not in dict(gg.variant("w1", 16, stream_k=True, handover=True).params)  # no stream_k there
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 2}, {"stream_k": True, "ctas_per_sm": 1, "producer_warps": 2},
                {"stream_k": True, "ctas_per_sm": 1, "stream_pair": True}):
        with pytest.raises(ValueError, match="handover is a knob of the stand-alone stream-K"):
            gg.GemmConfig(**{"role": "w2", "block_n": 8, "handover": True, **bad})


def test_words_first_knob_its_names_and_what_it_refuses():
    """`GemmConfig.words_first` (a hand-over W2 segment's words before its weights): a knob of the hand-over W2 alone.
    The variant sets may name it anywhere (it stays off where W2 hands over no words, and W1 ignores it), the pair
    kernel passes it to both halves, and the kernel's parameters are the handover W2's."""
    from gc_moe.kernels.sm90 import stream_pair

    wf = gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1, handover=True, words_first=True)
    assert wf.name.endswith("_sk_ho_wf_ws") and wf.params == gg.GemmConfig("w2", 8, stream_k=True, ctas_per_sm=1,
                                                                         handover=True).params
    assert dict(gg.variant("w2", 8, stream_k=True, handover=True, words_first=True).params)["words_first"]
    for role, knobs in (("w1", {"stream_k": True, "handover": True}), ("w2", {"stream_k": True}), ("w2", {})):
        assert "words_first" not in dict(gg.variant(role, 8, words_first=True, **knobs).params), (role, knobs)
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 1}):
        with pytest.raises(ValueError, match="words_first is a knob of the hand-over W2"):
            gg.GemmConfig(**{"role": "w2", "block_n": 8, "words_first": True, **bad})
    pair = stream_pair.PairConfig(words_first=True)
    assert pair.half("w2").words_first and pair.half("w1").words_first
    assert dict(stream_pair.variant(words_first=True).params)["words_first"]
    assert "words_first" not in dict(stream_pair.variant().params)  # the plain pair keeps its cache key


def test_publisher_warp_knob_its_warp_its_count_and_what_it_refuses():
    """`GemmConfig.publisher_warp` (the pair's W1 words released by a warp of their own): a knob of the pair's
    halves, one more warp in the CTA (the launch's block) and the count of finished units after the rest of the
    shared memory; the ring is the one without it."""
    from gc_moe.kernels.sm90 import stream_pair

    plain, pub = stream_pair.PairConfig().half("w1"), stream_pair.PairConfig(publisher_warp=True).half("w1")
    assert pub.threads == plain.threads + 32 == 576 and pub.stages == plain.stages
    assert pub.publish_offset == plain.smem_bytes and pub.smem_bytes == plain.smem_bytes + 16
    assert pub.name.endswith("_skp_pub_ws") and stream_pair.PairConfig(publisher_warp=True).half("w2").publisher_warp
    with pytest.raises(ValueError, match="publisher_warp is a knob of the stream-K pair kernel's halves"):
        gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, publisher_warp=True)
    assert dict(stream_pair.variant(publisher_warp=True).params)["publisher_warp"]


def test_handover_launch_names_the_words_it_needs():
    """The launch helpers check the hand-over words before they touch the driver: missing, too few, the wrong
    dtype, or given to a kernel without the knob; W2's K blocks bounded by the producer warp's lanes."""
    import types

    from gc_moe.runtime.jit import KernelVariant

    def fake(v: KernelVariant):
        return types.SimpleNamespace(entry=types.SimpleNamespace(variant=v), name=v.describe())

    ho = fake(gg.variant("w2", 8, stream_k=True, handover=True))
    cfg = gg.GemmConfig(**dict(ho.entry.variant.params))
    with pytest.raises(ValueError, match=r"pass ready=handover_words\(4, 9, 512, device\) \(int32 >= 32"):
        gg._handover_args(cfg, ho, 4, 9, 512, 1024, None)
    with pytest.raises(ValueError, match="int32 >= 32"):
        gg._handover_args(cfg, ho, 4, 9, 512, 1024, torch.zeros(32, dtype=torch.int64))
    with pytest.raises(ValueError, match="at most 32 K128 blocks"):
        gg._handover_args(cfg, ho, 4, 9, 33 * 128, 1024, None)
    plain = fake(gg.variant("w2", 8, stream_k=True))
    plain_cfg = gg.GemmConfig(**dict(plain.entry.variant.params))
    with pytest.raises(ValueError, match="has no hand-over words"):
        gg._handover_args(plain_cfg, plain, 4, 9, 512, 1024, torch.zeros(32, dtype=torch.int32))
    assert gg._handover_args(plain_cfg, plain, 4, 9, 512, 1024, None) == []
    assert gg.handover_words(4, 9, 512, "cpu").shape == (4 * 2 * 4,)  # 2 token tiles of 8 at capacity 9


def test_programmatic_launch_is_for_the_stream_k_w2_only():
    from gc_moe.runtime.jit import KernelVariant

    class Fake:  # launch_w2 checks the variant before it touches the driver
        def __init__(self, variant: KernelVariant):
            self.entry = type("E", (), {"variant": variant})()
            self.name = variant.describe()

    with pytest.raises(ValueError, match="only the stream_k W2 waits for its W1 grid"):
        gg.launch_w2(Fake(gg.variant("w2", 8)), None, None, None, None, None, None, 1, None, programmatic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_stream_k_w1_short_whole_units_relaunch_the_same_bytes(ctas_per_sm):
    """A stream-K W1 CTA with many whole units shorter than its stage ring in a row: a fast consumer warp runs
    the next unit's K loop from stages already filled and reaches its epilogue while a slow one still reads the
    previous unit's amax words. Forty launches on the same buffers must write the first one's bytes."""
    got_mid, ref_mid, got, ref = _run_case(512, 512, 10, 6, 40, 8, seed=11, stream_k=True, ctas_per_sm=ctas_per_sm,
                                           sms=2, relaunches=40)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (5120, 2304, 48, 6, 2, None),    # DeepSeek-V4.1-Flash's K, every SM
    (1024, 512, 10, 6, 40, 3)])      # many segments per CTA (the last trace slots shared)
def test_traced_stream_k_writes_the_same_bytes_and_its_phases(hidden, inter, experts, topk, tokens, sms):
    """The traced stream-K loops (GemmConfig.trace, one CTA per SM) write byte for byte what the plain ones write, and their trace
    holds each working CTA's walk: as many segments as the host's partition gives, and the stamps in order."""
    splits = []
    case = (hidden, inter, experts, topk, tokens, 8)
    traced = _run_case(*case, seed=5, stream_k=True, ctas_per_sm=1, sms=sms, return_raw=True,
                       trace=True, splits_out=splits, relaunches=8)
    _assert_same_bytes(traced, _run_case(*case, seed=5, stream_k=True, ctas_per_sm=1, sms=sms,
                                         return_raw=True, relaunches=8))
    offsets, split1, split2 = splits[0]
    counts = (offsets[1:] - offsets[:-1]).tolist()
    grid_ctas = sms or gg.device_sms("cuda")  # one CTA per SM
    per, tail = gg.TRACE_SEGMENT_SLOTS, 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS
    for role, split, rows, k_blocks in (("w1", split1, 2 * inter, hidden // 128), ("w2", split2, hidden, inter // 128)):
        words = split[0][: grid_ctas * gg.TRACE_SLOTS * 4].view(torch.int64).reshape(grid_ctas, gg.TRACE_SLOTS, 2)
        walks = gg.stream_segments(sum(-(-c // 8) for c in counts) * (rows // gg.ROWS_PER_CTA), k_blocks, grid_ctas)
        for cta, walk in enumerate(walks):
            if not walk:
                continue
            segments = len(walk)
            w = words[cta].tolist()
            assert w[tail + 2][0] == segments, (cta, w[tail + 2][0], segments)
            # clocks in order: entry, scan, then each recorded segment's start, first stage, K loop end, epilogue end
            clocks = [w[0][1], w[1][1]] + [w[3 + per * i + j][1] for i in range(min(segments, gg.TRACE_SEGMENTS) - 1)
                                           for j in range(4)] + [w[tail + 1][1]]
            assert clocks == sorted(clocks), (cta, clocks)
            assert w[0][1] <= w[tail][1]  # the producer's end after the CTA's start (one SM's %clock64)
            if role == "w2":  # its producer's griddepcontrol.wait returned between the CTA's start and its end
                assert w[0][1] <= w[tail + 3][1] <= w[tail][1], (cta, w[0][1], w[tail + 3][1], w[tail][1])
        # the SMs the working CTAs ran on: one CTA per SM, the grid resident at once
        sm_ids = [words[cta].tolist()[tail + 2][1] for cta, walk in enumerate(walks) if walk]
        assert len(set(sm_ids)) == len(sm_ids) and all(0 <= i < gg.device_sms("cuda") for i in sm_ids), sm_ids


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", (8, 16, 32))
def test_folded_pipelines_write_the_same_bytes(block_n):
    """The folded variants run the same arithmetic on either pipeline: the warp-specialized one (bulk copies,
    mbarrier ring, 544 threads) must write byte for byte what the cp.async one writes, over experts that
    need several token tiles (rows past an expert's count zero-filled) and an empty expert."""
    runs = [_run_case(1024, 512, 6, 4, 3 * block_n, block_n, seed=7 + block_n, fold_scales=True,
                      warp_specialized=ws, return_raw=True) for ws in (True, False)]
    _assert_same_bytes(*runs)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", gg.BLOCK_N_CHOICES + gg.TABLE_TWO_CTA_BLOCK_N)
@pytest.mark.parametrize("topk,tokens", [(1, 5), (8, 3), (6, 40), (8, 130)])
def test_table_decode_matches_float32_reference(block_n, topk, tokens):
    """The folded scales' table decode (weights in the table nibble order), warp-specialized at every bn."""
    got_mid, ref_mid, got, ref = _run_case(512, 256, 10, topk, tokens, block_n, seed=block_n * 1000 + tokens,
                                           fold_scales=True, table_decode=True)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [8, 24, 32, 64])
@pytest.mark.parametrize("hidden,inter", [(512, 384), (256, 128)])
def test_table_decode_odd_and_single_k_steps(hidden, inter, block_n):
    """W2 with 3 K128 steps and with 1, W1 with 2: the pipelined consumer's two-step trips and its last chain
    (odd and single step counts)."""
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, 8, 4, 2 * block_n + 3, block_n, seed=inter + block_n,
                                           fold_scales=True, table_decode=True)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("hidden,inter,topk", [(5120, 2304, 6), (6144, 2048, 8)], ids=["deepseek", "glm"])
def test_table_decode_model_shapes(hidden, inter, topk, block_n):
    _, _, got, ref = _run_case(hidden, inter, topk + 2, topk, 40, block_n, seed=hidden + block_n,
                               fold_scales=True, table_decode=True)
    assert torch.isfinite(got).all()
    cos, diff = _cos_diff(got, ref)
    assert cos >= 0.999 and diff <= 0.002, (cos, diff)


@pytest.mark.gpu
def test_table_decode_two_ctas_per_sm_writes_the_same_bytes():
    """bn 16 with two CTAs per SM (half the stages each) moves the same bytes through the same arithmetic."""
    runs = [_run_case(1024, 512, 6, 4, 48, 16, seed=17, return_raw=True, fold_scales=True, table_decode=True, **kn)
            for kn in ({"ctas_per_sm": 2}, {})]
    _assert_same_bytes(*runs)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 21, 150])
@pytest.mark.parametrize("block_n,ctas_per_sm", [(16, 2), (24, 2), (32, None), (64, None)])
def test_fit_n_agrees_with_the_whole_tile(block_n, ctas_per_sm, tokens):
    """N fitted to each token tile's rows (rounded up to 8) computes every valid token as the whole tile does, at
    rows per expert from a few to several tiles (tails of every size): the same E4M3 bytes out of W1, its FP32
    scales within a few ulps and W2's BF16 within one ulp. (At bn 24 / 64 every byte is equal; the pipelined bn 16 /
    32 consumers, compiled once per N, contract a few FP32 multiply-adds differently: 1-2 ulps in up to 9% of the
    scales, one BF16 ulp in up to 5e-5 of the outputs, measured on the H200.)"""
    knobs = {"fold_scales": True, "table_decode": True, "ctas_per_sm": ctas_per_sm}
    (mid, sf, out), (mid_ref, sf_ref, out_ref) = [
        _run_case(1024, 512, 7, 4, tokens, block_n, seed=tokens + block_n, return_raw=True, **kn)
        for kn in ({**knobs, "fit_n": True}, knobs)]
    assert torch.isfinite(sf).all() and torch.isfinite(out.float()).all()
    assert torch.equal(mid.view(torch.uint8), mid_ref.view(torch.uint8))
    assert ((sf - sf_ref).abs() <= 5e-7 * sf_ref.abs()).all()
    ulps = (out.view(torch.int16).int() - out_ref.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 21, 150])
@pytest.mark.parametrize("block_n,ctas_per_sm", [(16, 2), (24, None), (32, None), (64, None)])
def test_lean_epilogue_writes_the_same_bytes(block_n, ctas_per_sm, tokens):
    """The epilogue's words staged in shared memory by the producer (routing weights, combine rows, the expert's
    factor) and W1's amax reduced once per token are the same numbers as the global loads and the per-thread
    reduction (a max is exact in any order): W1 and W2 write the same bytes, over tiles with fewer rows than the
    tile (the zero-filled words) and experts with several tiles."""
    knobs = {"fold_scales": True, "table_decode": True, "fit_n": True, "ctas_per_sm": ctas_per_sm}
    runs = [_run_case(1024, 512, 7, 4, tokens, block_n, seed=tokens + 5 * block_n, return_raw=True, **kn)
            for kn in ({**knobs, "lean_epilogue": True}, knobs)]
    _assert_same_bytes(*runs)


@pytest.mark.gpu
@pytest.mark.parametrize("trace", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8)])
def test_lean_stream_k_writes_the_same_bytes(hidden, inter, experts, topk, tokens, trace):
    """The stream-K loops with the epilogue's words loaded before each segment's K loop (and W1's amax reduced once
    per token) write the bytes the plain loops write, relaunched on the same buffers (owners, pieces and whole
    units alike)."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {"stream_k": True, "ctas_per_sm": 1, "return_raw": True, "relaunches": 4}
    lean = _run_case(*case, seed=tokens + 23, lean_epilogue=True, trace=trace, **knobs)
    _assert_same_bytes(lean, _run_case(*case, seed=tokens + 23, **knobs))


def test_step_group_knob_where_it_applies():
    """step_group: the stream-K loop at one CTA per SM (traced too); sets may name it everywhere, the variant drops it
    where it does not apply; its consumers issue a step as one group of four K32 WGMMAs."""
    cfg = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, step_group=True)
    assert cfg.wgmmas_per_group == 4 and cfg.pipelined
    assert gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1).wgmmas_per_group == 2
    with pytest.raises(ValueError, match="step_group is a knob of the stream_k loop at one CTA per SM"):
        gg.GemmConfig("w1", 8, stream_k=True, step_group=True, ctas_per_sm=2)
    traced = dict(gg.variant("w1", 8, stream_k=True, ctas_per_sm=1, trace=True, step_group=True).params)
    assert traced["step_group"] is True and traced["trace"] is True
    with pytest.raises(ValueError, match="step_group"):
        gg.GemmConfig("w2", 8, step_group=True)
    assert dict(gg.variant("w2", 8, stream_k=True, ctas_per_sm=1, step_group=True).params)["step_group"] is True
    for bn, knobs in ((8, {"stream_k": True, "ctas_per_sm": 2}), (8, {}), (16, {"stream_k": True}),
                      (64, {"fold_scales": True, "table_decode": True})):
        assert "step_group" not in dict(gg.variant("w1", bn, step_group=True, **knobs).params), (bn, knobs)


def test_w2_early_stages_knob_where_it_applies():
    """w2_early_stages: the stand-alone stream-K W2 only, 1..its ring; sets may name it everywhere (the variant drops it
    where it does not apply and caps it at the ring); its own kernel name."""
    knobs = gg.tile_knobs(1)[1]
    params = dict(gg.variant("w2", 8, w2_early_stages=4, **knobs).params)
    assert params["w2_early_stages"] == 4 and "_e4" in gg.GemmConfig(**params).name
    assert dict(gg.variant("w2", 8, w2_early_stages=9, **knobs).params)["w2_early_stages"] == gg.RING_STAGES[8]
    for role, bn, more in (("w1", 8, knobs), ("w2", 16, gg.tile_knobs(16)[1]), ("w2", 8, {}),
                           ("w2", 8, {"stream_k": True, "ctas_per_sm": 1, "handover": True})):
        assert "w2_early_stages" not in dict(gg.variant(role, bn, w2_early_stages=2, **more).params), (role, bn)
    for bad in ({"role": "w1", "stream_k": True, "ctas_per_sm": 1}, {"role": "w2"},
                {"role": "w2", "stream_k": True, "ctas_per_sm": 1, "stages": 6, "w2_early_stages": 7}):
        with pytest.raises(ValueError, match="w2_early_stages"):
            gg.GemmConfig(**{"block_n": 8, "w2_early_stages": 2, **bad})


def test_tagged_pieces_knob_where_it_applies():
    """tagged_pieces: the stand-alone stream-K loops only (not the hand-over ones); sets may name it everywhere, the
    variant drops it where it does not apply; its own kernel name (the bench keys split buffers by name); its split
    buffers start with every piece slot empty; built plain, lean, traced and with step_group."""
    cfg = gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1, tagged_pieces=True)
    assert "_tag" in cfg.name and "_tag" not in gg.GemmConfig("w1", 8, stream_k=True, ctas_per_sm=1).name
    for bad in ({}, {"stream_k": True, "ctas_per_sm": 1, "handover": True}):
        with pytest.raises(ValueError, match="tagged_pieces is a knob of the stand-alone stream_k W1 / W2"):
            gg.GemmConfig("w2", 8, tagged_pieces=True, **bad)
    assert dict(gg.variant("w2", 8, stream_k=True, tagged_pieces=True).params)["tagged_pieces"] is True
    for bn, knobs in ((8, {}), (16, {"stream_k": True}), (8, {"stream_k": True, "ctas_per_sm": 1, "handover": True}),
                      (64, {"fold_scales": True, "table_decode": True})):
        assert "tagged_pieces" not in dict(gg.variant("w1", bn, tagged_pieces=True, **knobs).params), (bn, knobs)
    built = sorted((dict(v.params)["role"], dict(v.params).get("lean_epilogue", False),
                    dict(v.params).get("trace", False), dict(v.params).get("step_group", False))
                   for v in gg.all_variants() if dict(v.params).get("tagged_pieces")
                   and not dict(v.params).get("quick_start"))  # (tile_knobs's H200 set: its own test)
    assert built == sorted((role, *knobs) for role in ("w1", "w2")
                           for knobs in ((False, False, False), (True, False, False), (False, True, False),
                                         (False, False, True)))

    class Fake:  # split_buffers reads only the loaded kernel's variant parameters
        def __init__(self, variant):
            self.entry = type("E", (), {"variant": variant})()

    from types import SimpleNamespace

    mat = SimpleNamespace(rows=4096, num_experts=32)
    partials, counts = gg.split_buffers(Fake(gg.variant("w1", 8, stream_k=True, tagged_pieces=True)), mat, 5, "cpu",
                                        sms=132)
    plain, _ = gg.split_buffers(Fake(gg.variant("w1", 8, stream_k=True)), mat, 5, "cpu", sms=132)
    assert partials.dtype == torch.float32 and partials.shape == plain.shape
    assert bool((partials.view(torch.int32) == gg.PIECE_EMPTY_BITS).all()) and int(counts.abs().sum()) == 0
    assert gg.PIECE_EMPTY_BITS & 0xFFFFFFFF == 0xFFFFFFFF  # ptx.PIECE_EMPTY (the kernel's constant) as int32


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{}, {"lean_epilogue": True}, {"trace": True}, {"step_group": True}],
                         ids=["plain", "lean", "traced", "step_group"])
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (5120, 512, 5, 2, 1)])
def test_tagged_pieces_write_the_stream_k_bytes(hidden, inter, experts, topk, tokens, sms, knobs):
    """The stream-K loops with the pieces published without a fence (`tagged_pieces`) add the same partials in the
    same order as the fenced ones, so they write the same bytes, relaunched on the same buffers, each launch leaving
    every piece slot empty again (`_run_case` checks it before each launch): units of 1-2 pieces (3 SMs), of up to
    ~5 (every SM, K of 8 steps) and of ~30 at 1 token (W1's 40 steps over ~4 units: the pieces past the owner's
    early loads polled after its K loop). And the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    common = {"stream_k": True, "ctas_per_sm": 1, "sms": sms, **knobs}
    tagged = _run_case(*case, seed=tokens + hidden + 5, tagged_pieces=True, return_raw=True, relaunches=3, **common)
    _assert_same_bytes(tagged, _run_case(*case, seed=tokens + hidden + 5, return_raw=True, **common))
    got_mid, ref_mid, got, ref = _run_case(*case, seed=tokens + hidden + 6, tagged_pieces=True,
                                           **{k: v for k, v in common.items() if k != "trace"})
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("trace", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [
    (1024, 512, 7, 4, 3),
    (5120, 2304, 10, 6, 8),   # DeepSeek-V4.1-Flash's K at 8 tokens
    (512, 256, 64, 8, 12),    # 64 local experts: the lookup's second ballot
    (256, 256, 5, 2, 40),     # experts of 9-32 rows: two to four token tiles (the lookup's division)
    (256, 256, 6, 2, 1)])     # fewer K128 steps than CTAs at every SM: the range's other divisor
def test_quick_start_writes_the_stream_k_bytes(hidden, inter, experts, topk, tokens, sms, trace):
    """The stream-K walk's quick start (`quick_start`: its range and first unit by multiplies, its units' experts by
    ballots, its unit carried from segment to segment) walks the same partition, so W1 and W2 write the bytes of
    tile_knobs's stream-K loops, relaunched on the same buffers, and (untraced) with the hand-over words too (W2
    launched programmatically). And the float32 reference. (tile_knobs's stream-K loops start quickly since step 69:
    the baseline here is the plain walk at the same ring.)"""
    case = (hidden, inter, experts, topk, tokens, 8)
    common = {**gg.tile_knobs(1)[1], "sms": sms, "quick_start": False}
    seed = hidden + tokens + experts
    quick = _run_case(*case, seed=seed, trace=trace, return_raw=True, relaunches=2, handover_pairs=0 if trace else 2,
                      **{**common, "quick_start": True})
    _assert_same_bytes(quick, _run_case(*case, seed=seed, return_raw=True, **common))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, **{**common, "quick_start": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("trace", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (5120, 512, 5, 2, 1)])
def test_h200_tile8_set_writes_the_h100_sets_bytes(hidden, inter, experts, topk, tokens, trace):
    """tile_knobs's tile-8 loops on the H200 (a ring of 12, the pieces published without a fence) walk the same
    partition and add the same partials in the same order as the H100's (6 stages, fenced pieces), so W1 and W2
    write the same bytes, relaunched on the same buffers. And the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    h200 = {**gg.tile_knobs(1, card="h200")[1], **({"trace": True} if trace else {})}
    h100 = {**gg.tile_knobs(1, card="h100")[1], **({"trace": True} if trace else {})}
    seed = hidden + tokens + experts + 11
    _assert_same_bytes(_run_case(*case, seed=seed, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **h200),
                       _run_case(*case, seed=seed, return_raw=True, **h100))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, **h200)
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card,trace", [("h200", False), ("h100", False), ("h200", True)],
                         ids=["h200", "h100", "h200_traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (5120, 512, 5, 2, 1)])
def test_lean_ring_writes_the_same_bytes(hidden, inter, experts, topk, tokens, card, trace):
    """The stream-K loops with their ring's bases held warp-uniform and their waits trying first (`lean_ring`, each
    card's tile-8 set, the traced loop) run the same steps on the same stages, so W1 and W2 write the same bytes as
    without, relaunched on the same buffers. And the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], **({"trace": True} if trace else {})}
    assert knobs["lean_ring"]
    seed = hidden + tokens + experts + 23
    _assert_same_bytes(_run_case(*case, seed=seed, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **knobs),
                       _run_case(*case, seed=seed, return_raw=True, **{**knobs, "lean_ring": False}))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, **knobs)
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card,trace", [("h200", False), ("h100", False), ("h100", True), ("h200", True)],
                         ids=["h200", "h100", "h100_traced", "h200_traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (5120, 512, 5, 2, 1)])
def test_tma_tokens_write_the_same_bytes(hidden, inter, experts, topk, tokens, card, trace):
    """The stream-K loops with their token tiles through a tensor map (`tma_tokens`, each card's tile-8 set, the
    traced loops) stage the same rows a tile uses (the rows past an expert's count come from the next rows, not
    zeros, but their columns are scaled by zero and never stored), so W1 and W2 write the same bytes as with the
    cp.async pieces, relaunched on the same buffers and as programmatic pairs (graph replays among them: the map made
    at the first launch stays valid under capture). And the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], **({"trace": True} if trace else {})}
    seed = hidden + tokens + experts + 31
    _assert_same_bytes(_run_case(*case, seed=seed, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **{**knobs, "tma_tokens": True}),
                       _run_case(*case, seed=seed, return_raw=True, **knobs))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, **{**knobs, "tma_tokens": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card", ["h100", "h200"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (5120, 2304, 10, 6, 8, None),   # DeepSeek-V4.1-Flash's K over every SM: W1's 40 steps and W2's 18 in 4 chunks each
    (1024, 512, 10, 6, 40, 3),      # many units over 3 CTAs: each CTA walks several chunks on its ring
    (256, 256, 7, 4, 3, None),      # W1's K of 2 steps (2 chunks per unit); W2's 6 units keep no tail
])
def test_dynamic_tail_matches_reference_and_relaunches_the_same_bytes(hidden, inter, experts, topk, tokens, sms,
                                                                      card):
    """The stream-K loops with the last units' steps in chunks claimed by ticket (`dynamic_tail`, each card's tile-8
    set): every unit's sums reach its epilogue once, whichever CTA draws which chunk and whichever chunk arrives last
    (the last adds them in chunk order), so relaunches on the same buffers and programmatic pairs (graph replays among
    them) write the first launch's bytes and leave every count and the ticket at zero; against the float32 reference
    on fresh inputs, outputs poisoned first."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], "dynamic_tail": True}
    got_mid, ref_mid, got, ref = _run_case(*case, seed=hidden + tokens + 41, sms=sms, relaunches=6,
                                           programmatic_pairs=2, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card,trace", [("h200", False), ("h100", False), ("h200", True)],
                         ids=["h200", "h100", "h200_traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (1024, 512, 7, 4, 3, None),     # units shorter than the H200's ring
    (5120, 2304, 10, 6, 8, None),   # DeepSeek-V4.1-Flash's K: W1's 40 steps, W2's 18, pieces and owners
    (1024, 512, 10, 6, 40, 3),      # many units over 3 CTAs: each CTA's walk runs on across units and its ring wraps
])
def test_early_scales_write_the_same_bytes(hidden, inter, experts, topk, tokens, sms, card, trace):
    """The stream-K loops with a step's scales loaded once after its wait (`early_scales`, each card's tile-8 set, the
    traced loop) scale the same WGMMA results by the same words in the same order, and give a step's stage back
    after its last WGMMAs instead of after its scaling: W1 and W2 write the same bytes as without, relaunched on the
    same buffers and as programmatic pairs. And the float32 reference on fresh inputs."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], **({"trace": True} if trace else {})}
    seed = hidden + tokens + experts + 43
    _assert_same_bytes(_run_case(*case, seed=seed, sms=sms, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **{**knobs, "early_scales": True}),
                       _run_case(*case, seed=seed, sms=sms, return_raw=True, **knobs))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, sms=sms, **{**knobs, "early_scales": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card,extra", [("h200", {}), ("h100", {}), ("h200", {"lean_epilogue": True}),
                                        ("h100", {"lean_epilogue": True}), ("h200", {"lean_epilogue": True, "trace": True})],
                         ids=["h200", "h100", "h200_lean", "h100_lean", "h200_lean_traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (1024, 512, 7, 4, 3, None),     # units shorter than the H200's ring
    (5120, 2304, 10, 6, 8, None),   # DeepSeek-V4.1-Flash's K: W1's 40 steps, whole units, pieces and owners
    (1024, 512, 10, 6, 40, 3),      # many units over 3 CTAs: each CTA's epilogues cycle the three slot sets often
])
def test_amax_slots_write_the_same_bytes(hidden, inter, experts, topk, tokens, sms, card, extra):
    """W1's amax per token through shared-memory max reductions into rotating slot sets (`amax_slots`: one barrier
    per unit epilogue) is the same maximum of the same values, so W1 and W2 write the same bytes as without it (each
    card's tile-8 set, with the lean epilogue, traced), relaunched on the same buffers and as programmatic pairs (the
    sets start at zero in every launch). And the float32 reference on fresh inputs."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], **extra}
    seed = hidden + tokens + experts + 47
    trace = extra.get("trace", False)
    _assert_same_bytes(_run_case(*case, seed=seed, sms=sms, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **{**knobs, "amax_slots": True}),
                       _run_case(*case, seed=seed, sms=sms, return_raw=True, **knobs))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, sms=sms, **{**knobs, "amax_slots": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("card,trace", [("h200", False), ("h100", False), ("h200", True)],
                         ids=["h200", "h100", "h200_traced"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens,sms", [
    (1024, 512, 7, 4, 3, None),     # units shorter than the H200's ring: hand-overs close together
    (5120, 2304, 10, 6, 8, None),   # DeepSeek-V4.1-Flash's K: W1's 40 steps, whole units, pieces and owners
    (1024, 512, 10, 6, 40, 3),      # many units over 3 CTAs: each CTA's slot changes hands many times, 9-40 rows
])
def test_epilogue_warp_writes_the_same_bytes(hidden, inter, experts, topk, tokens, sms, card, trace):
    """W1's unit epilogues run by a warp of their own (`epilogue_warp`: the consumers hand their SwiGLU values over
    through one shared-memory slot) take the same maximum of the same values and round them the same way, so W1
    and W2 write the same bytes as without it (each card's tile-8 set, traced), relaunched on the same buffers and
    as programmatic pairs (the slot's barriers start anew in every launch). And the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {**gg.tile_knobs(1, card=card)[1], **({"trace": True} if trace else {})}
    seed = hidden + tokens + experts + 53
    _assert_same_bytes(_run_case(*case, seed=seed, sms=sms, return_raw=True, relaunches=2,
                                 programmatic_pairs=0 if trace else 2, **{**knobs, "epilogue_warp": True}),
                       _run_case(*case, seed=seed, sms=sms, return_raw=True, **knobs))
    if not trace:
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, sms=sms, **{**knobs, "epilogue_warp": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{**gg.tile_knobs(1)[1], "split_nibbles": False},
                                   {**gg.tile_knobs(1)[1], "trace": True, "split_nibbles": False},
                                   {"max_stages": gg.UNIT_GRID_8_STAGES}], ids=["stream_k", "traced", "unit_grid"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (256, 256, 5, 2, 40)])
def test_split_nibbles_write_the_lane_orders_bytes(hidden, inter, experts, topk, tokens, knobs):
    """The tile-8 loops on the "split" nibble order (`split_nibbles`) decode the same E4M3 bytes as on the lane order
    and do the same FP32 work, so W1 and W2 write the same bytes, relaunched on the same buffers (the stream-K loops,
    traced, and the unit grid past its waves; 9-40 rows per expert: several token tiles). And the float32
    reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    seed = hidden + tokens + experts
    split = _run_case(*case, seed=seed, return_raw=True, relaunches=2, **{**knobs, "split_nibbles": True})
    _assert_same_bytes(split, _run_case(*case, seed=seed, return_raw=True, **knobs))
    if not knobs.get("trace"):
        got_mid, ref_mid, got, ref = _run_case(*case, seed=seed + 1, **{**knobs, "split_nibbles": True})
        _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lean,trace", [(False, False), (True, False), (False, True)], ids=["plain", "lean", "traced"])
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 3), (5120, 2304, 10, 6, 8),
                                                              (256, 256, 5, 2, 2)])
def test_step_group_writes_the_stream_k_bytes(hidden, inter, experts, topk, tokens, sms, lean, trace):
    """The stream-K loops with a K128 step's WGMMAs as one group (`step_group`) do the same FP32 work in the same
    order as the two-group loops (per step the four K32 products scaled in K order, then the activation scale), so
    they write the same bytes, relaunched on the same buffers: segments of one step and of odd and even counts
    (every SM: short ranges; 3 SMs: long ones, W1's K of 2 steps at hidden 256), owners, pieces and whole units. And
    the float32 reference."""
    case = (hidden, inter, experts, topk, tokens, 8)
    knobs = {"stream_k": True, "ctas_per_sm": 1, "return_raw": True, "relaunches": 3, "sms": sms,
             "lean_epilogue": lean}
    grouped = _run_case(*case, seed=tokens + hidden, step_group=True, trace=trace, **knobs)
    _assert_same_bytes(grouped, _run_case(*case, seed=tokens + hidden, **knobs))
    got_mid, ref_mid, got, ref = _run_case(*case, seed=tokens + hidden + 1, stream_k=True, ctas_per_sm=1, sms=sms,
                                           step_group=True, lean_epilogue=lean)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(5120, 2304, 8, 6, 110), (6144, 2048, 10, 8, 100),
                                                              (1024, 512, 7, 4, 150)])
def test_wide_tile_matches_float32_reference_and_tile_64(hidden, inter, experts, topk, tokens, lean):
    """Tile 96 (one decode per K128 step for a chain of 64 rows and one of the rest) against the float32 reference at
    65-96 rows per expert (and tails of every size with more tokens), and against tile 64 (two token tiles for those
    experts): the same arithmetic per token, so the same E4M3 bytes, FP32 scales within a few ulps and W2's BF16
    within one ulp."""
    knobs = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": lean}
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, experts, topk, tokens, 96, seed=tokens + hidden, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    (mid, sf, out), (mid_64, sf_64, out_64) = [
        _run_case(hidden, inter, experts, topk, tokens, bn, seed=tokens + hidden, return_raw=True, **knobs)
        for bn in (96, 64)]
    assert torch.isfinite(sf).all() and torch.isfinite(out.float()).all()
    assert torch.equal(mid.view(torch.uint8), mid_64.view(torch.uint8)), _byte_mismatch(mid, mid_64, sf, sf_64)
    assert ((sf - sf_64).abs() <= 5e-7 * sf_64.abs()).all()
    ulps = (out.view(torch.int16).int() - out_64.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("hidden,inter,tokens", [(1024, 512, 5), (1024, 512, 150), (512, 384, 45), (256, 128, 21)])
@pytest.mark.parametrize("block_n,ctas_per_sm", [(8, None), (16, 2), (32, None), (64, None), (96, None)])
def test_persistent_writes_the_unit_grids_bytes(hidden, inter, tokens, block_n, ctas_per_sm, sms):
    """The persistent grid (`persistent`: CTAs walk the unit grid on one stage ring that runs on across units, the lean
    epilogue's words in two slots) against the float32 reference and the unit grid with the same consumer loop (the
    waited one): the same chains and FMAs per unit, so the same bytes to an ulp. Over all SMs (a few units per CTA) and over 3
    (dozens per CTA: the ring wraps inside and across units, each word slot is refilled many times), W2 with 3 K128
    steps and with 1 (units shorter than the ring), tiles with a few rows to several tiles per expert."""
    knobs = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True,
             "ctas_per_sm": ctas_per_sm}
    case = (hidden, inter, 7, 4, tokens, block_n)
    seed = tokens + 5 * block_n + hidden
    got_mid, ref_mid, got, ref = _run_case(*case, seed=seed, persistent=True, sms=sms, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    # tiles 64 / 96: the unit grid runs the waited loop too (to an ulp: ptxas may contract the epilogue differently in
    # the unit loop); tiles 8 / 16 / 32: the persistent grid over the other SM count, other units per CTA through the
    # same code, so the same bytes
    persistent = _run_case(*case, seed=seed, return_raw=True, persistent=True, sms=sms, **knobs)
    if block_n in (64, 96):
        _assert_same_bytes_to_an_ulp(persistent, _run_case(*case, seed=seed, return_raw=True, **knobs))
    else:
        _assert_same_bytes(persistent, _run_case(*case, seed=seed, return_raw=True, persistent=True,
                                                 sms=3 if sms is None else None, **knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("experts,topk,tokens", [(7, 4, 150), (12, 4, 45), (70, 6, 120)],
                         ids=["7_experts", "12_experts", "70_experts_natural_order"])
@pytest.mark.parametrize("block_n", [32, 64, 96])
def test_snake_walk_writes_the_plain_walks_bytes(experts, topk, tokens, block_n, sms):
    """snake_walk moves units between CTAs, not their arithmetic: against the float32 reference and the plain
    persistent walk (another binary: to an ulp), over all SMs (one round or a few: the mirrored partial round) and
    over 3 (dozens of rounds per CTA), with ties between the experts' counts, an expert with no rows, and more local
    experts than the order table holds (the natural order)."""
    knobs = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True, "persistent": True}
    case = (512, 384, experts, topk, tokens, block_n)
    seed = tokens + 3 * block_n + experts
    got_mid, ref_mid, got, ref = _run_case(*case, seed=seed, sms=sms, snake_walk=True, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    _assert_same_bytes_to_an_ulp(_run_case(*case, seed=seed, return_raw=True, sms=sms, snake_walk=True, **knobs),
                                 _run_case(*case, seed=seed, return_raw=True, sms=sms, **knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 3], ids=["all_sms", "3_sms"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 150), (512, 384, 12, 4, 45),
                                                              (256, 128, 10, 6, 21)])
@pytest.mark.parametrize("block_n", [32, 64, 96])
def test_scale_ratios_match_the_float32_reference_and_the_plain_sums(hidden, inter, experts, topk, tokens, block_n,
                                                                      sms):
    """scale_ratios (the sums rescaled by s_(k-1) / s_k before each step, the products accumulated in place, x s_(K-1)
    after the last): against the float32 reference, and against the plain persistent grid's W2 rows (the same
    products, rounded in another order: cosine >= 0.9995, within 3% of the largest output; W1's sums round to other
    FP32 values, so a token's K128 amax and with it the E4M3 codes of its whole block can move by a rounding step,
    which W2 carries: 1.2-2% of the largest output as measured on an H100), with K steps from 1 (W2 at inter 128) to
    8, tiles of a few rows to several per expert, the wide tile's two chains under one wait."""
    knobs = {"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True, "persistent": True}
    case = (hidden, inter, experts, topk, tokens, block_n)
    seed = tokens + 7 * block_n + hidden
    got_mid, ref_mid, got, ref = _run_case(*case, seed=seed, sms=sms, scale_ratios=True, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    _, _, out = _run_case(*case, seed=seed, return_raw=True, sms=sms, scale_ratios=True, **knobs)
    _, _, plain = _run_case(*case, seed=seed, return_raw=True, sms=sms, **knobs)
    assert torch.isfinite(out.float()).all()
    assert _cos_diff(out.float(), plain.float())[0] >= 0.9995
    assert float((out.float() - plain.float()).abs().max()) <= 0.03 * float(plain.float().abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("ratios", [False, True], ids=["sums", "scale_ratios"])
@pytest.mark.parametrize("block_n", [32, 64, 96])
@pytest.mark.parametrize("hidden,inter,topk,tokens", [(5120, 2304, 6, 70), (6144, 2048, 8, 90)],
                         ids=["deepseek", "glm"])
def test_persistent_model_shapes_match_float32_reference(hidden, inter, topk, tokens, block_n, ratios):
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, topk + 2, topk, tokens, block_n, seed=hidden + 3 * block_n,
                                           fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                                           persistent=True, **({"scale_ratios": True} if ratios else {}))
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["unit_grid", "persistent"])
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 150), (512, 384, 12, 4, 45),
                                                              (256, 128, 10, 6, 21)])
@pytest.mark.parametrize("block_n", [16, 24, 32, 64, 96])
def test_transposed_stores_write_the_value_stores_bytes(hidden, inter, experts, topk, tokens, block_n, persistent):
    """transposed_stores moves the epilogues' outputs through shared memory, not their arithmetic: the same W1 E4M3
    rows and scales and the same W2 BF16 bytes as the lean epilogue's stores (the same products, the same rounding)
    and within the float32 reference's bounds, every output written, at tile_knobs's tiles from 16 rows (two CTAs per
    SM at 16 / 24), with chunks of 16 tokens cut by the tile's count, an odd last token group (tile 24) and units
    whose count runs past the tile, one unit per CTA and the persistent grid's walk (the region reused unit after
    unit)."""
    knobs = _tile_knobs_without(block_n, "transposed_stores")
    if knobs.get("persistent") != persistent and (persistent or block_n in (16, 24)):
        pytest.skip("tiles 16 / 24 run as a unit grid")
    knobs["persistent"] = persistent  # (variant drops scale_ratios off the persistent grid)
    case = (hidden, inter, experts, topk, tokens, block_n)
    seed = tokens + 5 * block_n + hidden + persistent
    got_mid, ref_mid, got, ref = _run_case(*case, seed=seed, transposed_stores=True, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    _assert_same_bytes(_run_case(*case, seed=seed, return_raw=True, transposed_stores=True, **knobs),
                       _run_case(*case, seed=seed, return_raw=True, **knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts,topk,tokens", [(1024, 512, 7, 4, 150), (256, 128, 10, 6, 21)])
@pytest.mark.parametrize("block_n", [16, 24, 32, 64, 96])
def test_early_rows_write_the_value_stores_bytes(hidden, inter, experts, topk, tokens, block_n):
    """early_rows only moves the combine rows' shared loads ahead of the stores: the same bytes as the plain lean W2
    (and within the float32 reference's bounds), at tile_knobs's tiles, units whose count runs past the tile."""
    knobs = _tile_knobs_without(block_n, "transposed_stores")
    case = (hidden, inter, experts, topk, tokens, block_n)
    seed = tokens + 11 * block_n + hidden
    got_mid, ref_mid, got, ref = _run_case(*case, seed=seed, early_rows=True, **knobs)
    _assert_matches_reference(got_mid, ref_mid, got, ref)
    _assert_same_bytes(_run_case(*case, seed=seed, return_raw=True, early_rows=True, **knobs),
                       _run_case(*case, seed=seed, return_raw=True, **knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("hidden,inter,topk", [(5120, 2304, 6), (6144, 2048, 8)], ids=["deepseek", "glm"])
def test_lean_epilogue_model_shapes_match_float32_reference(hidden, inter, topk, block_n):
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, topk + 2, topk, 37, block_n, seed=hidden + 9 * block_n,
                                           fold_scales=True, table_decode=True, fit_n=True, lean_epilogue=True,
                                           ctas_per_sm=2 if block_n == 16 else None)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("hidden,inter,topk", [(5120, 2304, 6), (6144, 2048, 8)], ids=["deepseek", "glm"])
def test_fit_n_model_shapes_match_float32_reference(hidden, inter, topk, block_n):
    got_mid, ref_mid, got, ref = _run_case(hidden, inter, topk + 2, topk, 37, block_n, seed=hidden + 7 * block_n,
                                           fold_scales=True, table_decode=True, fit_n=True)
    _assert_matches_reference(got_mid, ref_mid, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", gg.BLOCK_N_CHOICES)
def test_table_decode_writes_the_folded_bytes(block_n):
    """The table decode yields the folded decode's E4M3 bytes and runs the same chain and FMAs: W1 and W2 must
    write byte for byte what the folded variant writes (the warp-specialized one up to bn 32, the cp.async one
    at bn 64, where only the table decode is warp-specialized), over several token tiles and an empty expert."""
    ref_knobs = {"fold_scales": True, "warp_specialized": None if block_n <= 32 else False}
    runs = [_run_case(1024, 512, 6, 4, 3 * block_n, block_n, seed=13 + block_n, return_raw=True, **kn)
            for kn in ({"fold_scales": True, "table_decode": True}, ref_knobs)]
    _assert_same_bytes(*runs)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"producer_warps": 2}, {"producer_warps": 4}, {"wait_suspend_ns": 10_000_000},
                                   {"compact_grid": True}, {"compact_grid": True, "producer_warps": 4},
                                   {"compact_grid": True, "ctas_per_sm": 1}],
                         ids=["p2", "p4", "suspend", "compact", "compact_p4", "compact_1cta"])
@pytest.mark.parametrize("block_n", (8, 16, 32))
def test_producer_and_wait_knobs_write_the_default_bytes(block_n, knobs):
    """Spreading the bulk copies and token copies over more producer warps, or sleeping in the mbarrier waits,
    moves the same bytes into the same stages: W1 and W2 must write exactly what the default writes, over
    experts with several token tiles and an empty expert."""
    runs = [_run_case(1024, 512, 6, 4, 3 * block_n, block_n, seed=11 + block_n, return_raw=True, **kn)
            for kn in (knobs, {})]
    _assert_same_bytes(*runs)


def test_ring_arguments_follow_the_ring_parameter_tables():
    from types import SimpleNamespace

    from gc_moe.kernels.sm90 import layer_layout as ll

    shape = ll.LayerShape(2, 8, 3, 256, 256, 5, 8)  # ring of ceil(5 * 2 * 3 / 8) = 4 blocks
    ws = ll.LocalWorkspace(ll.layer_layout(shape))
    a1 = gg.ring_args_w1(ws, shape, timeout_s=2.5)
    assert [a.size for a in a1] == [8 if k in ("u64", "s64") else 4 for _, k in gg.RING_PARAMS_W1]
    assert a1[0].data == (ws.control.data_ptr() + 4 * ll.RING_READY).to_bytes(8, "little")
    assert a1[2].data == ws.l1_empty_count.data_ptr().to_bytes(8, "little")
    assert [int.from_bytes(a.data, "little") for a in a1[3:]] == [8, 4, 2_500_000_000]
    a2 = gg.ring_args_w2(ws, shape)
    assert [a.size for a in a2] == [8 if k in ("u64", "s64") else 4 for _, k in gg.RING_PARAMS_W2]
    assert a2[1].data == ws.peers.data_ptr().to_bytes(8, "little") and int.from_bytes(a2[2].data, "little") == 15
    with pytest.raises(ValueError, match="timeout_s"):
        gg.ring_args_w1(ws, shape, timeout_s=0)
    ring_kernel = SimpleNamespace(name="w1_ring")
    with pytest.raises(ValueError, match="is a ring consumer"):
        gg._check_ring_args(gg.GemmConfig("w1", 8, ring_consumer=True), ring_kernel, [])
    with pytest.raises(ValueError, match="not a ring consumer"):
        gg._check_ring_args(gg.GemmConfig("w2", 8), ring_kernel, a2)
    assert len(gg._check_ring_args(gg.GemmConfig("w2", 8, ring_consumer=True), ring_kernel, a2)) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("compact", [False, True], ids=["grid", "compact"])
@pytest.mark.parametrize("block_n", gg.BLOCK_N_CHOICES)
def test_ring_consumer_on_a_filled_ring_equals_the_default_kernels(block_n, compact):
    """A ring role1 already filled (RING_READY = 1, l1_full_count as role1 leaves it, ring blocks of 8 rows
    that token tiles straddle): the ring-consumer W1/W2 write byte for byte what the default variants write
    from the same rows, and l1_empty_count holds one release per (W1 CTA, ring block it read)."""
    from gc_moe.kernels.sm90 import layer_layout as ll
    from gc_moe.runtime import jit

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the primary context must be current for the driver-level loads
    gen = torch.Generator(device=dev).manual_seed(block_n)
    shape = ll.LayerShape(1, 6, 3, 512, 256, 10, 8)  # 30 grouped rows, 4 ring blocks of 8
    ws = ll.LocalWorkspace(ll.layer_layout(shape), device=dev)
    ll.initialize_state(ws)

    def mxfp4(rows, cols):
        packed = torch.randint(-128, 128, (6, rows, cols // 2), dtype=torch.int8, generator=gen, device=dev)
        return packed, pack_ue8m0(torch.randint(117, 125, (6, rows, cols // 32), dtype=torch.uint8, generator=gen,
                                                device=dev))

    w = wsm90.transform(mxfp4(512, 512), mxfp4(512, 256))
    idx = torch.rand(10, 6, generator=gen, device=dev).topk(3, dim=1).indices
    offsets = torch.zeros(7, dtype=torch.int32, device=dev)
    offsets[1:] = torch.bincount(idx.flatten(), minlength=6).cumsum(0)
    rows = 30
    ws.expert_offsets.copy_(offsets)
    act, act_sf = quantize_fp8_k128(torch.randn(rows, 512, generator=gen, device=dev))
    ws.ring_act[:rows], ws.ring_scale[:rows] = act, act_sf
    ws.routing_weight[:rows] = torch.rand(rows, generator=gen, device=dev) + 0.1
    ws.dest_row[:rows] = torch.randperm(rows, generator=gen, device=dev).to(torch.int32)
    ws.ring_source[:rows] = torch.arange(rows, dtype=torch.int32, device=dev)  # all from rank 0
    ws.l1_full_count.copy_(torch.tensor(ll.l1_full_counts_after_dispatch(rows, shape), dtype=torch.int32))
    ws.control[ll.RING_READY] = 1
    cap = shape.capacity * shape.num_ranks
    stream = torch.cuda.current_stream()
    mid = torch.full_like(ws.l2_act.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn)
    mid_sf = torch.full_like(ws.l2_scale, float("nan"))
    out = torch.full((30, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    ws.l2_act.view(torch.uint8).fill_(0x7F)
    ws.l2_scale.fill_(float("nan"))
    ws.combine.fill_(float("nan"))
    # the ring consumer runs on its bn's default pipeline: compare with that pipeline without the ring
    k1, k2 = (jit.load_kernel(gg.variant(r, block_n), "sm_90a") for r in ("w1", "w2"))
    r1, r2 = (jit.load_kernel(gg.variant(r, block_n, ring_consumer=True, compact_grid=compact), "sm_90a")
              for r in ("w1", "w2"))
    gg.launch_w1(k1, w.l1, ws.ring_act, ws.ring_scale, ws.expert_offsets, ws.routing_weight, mid, mid_sf, cap,
                 stream)
    gg.launch_w2(k2, w.l2, mid, mid_sf, ws.expert_offsets, ws.dest_row, out, cap, stream)
    gg.launch_w1(r1, w.l1, ws.ring_act, ws.ring_scale, ws.expert_offsets, ws.routing_weight, ws.l2_act,
                 ws.l2_scale, cap, stream, ring_args=gg.ring_args_w1(ws, shape, timeout_s=10.0))
    gg.launch_w2(r2, w.l2, ws.l2_act, ws.l2_scale, ws.expert_offsets, ws.dest_row, ws.combine.view(-1, 512), cap,
                 stream, ring_args=gg.ring_args_w2(ws, shape))
    torch.cuda.synchronize()
    assert torch.equal(ws.l2_act[:rows].view(torch.uint8), mid[:rows].view(torch.uint8))
    assert torch.equal(ws.l2_scale[:rows], mid_sf[:rows]) and torch.isfinite(mid_sf[:rows]).all()
    assert torch.equal(ws.combine.view(-1, 512).view(torch.int16), out.view(torch.int16))
    assert torch.isfinite(out.float()).all()
    assert ws.l1_empty_count.tolist() == gg.expected_l1_empty_counts(
        offsets.tolist(), block_n, shape.block_m, shape.ring_blocks, w.l1.rows // gg.ROWS_PER_CTA)


def test_prune_cubin_cache_keeps_this_trees_entries_and_copies_their_cubins(tmp_path, monkeypatch):
    """scripts/prune_cubin_cache.py: an entry whose key is not this tree's, or whose cubin is missing, is stale; a
    prune deletes those and the objects no current entry references; a runtime copy holds the current entries and
    their cubins, no PTX."""
    import json

    from gc_moe.runtime import jit
    from gc_moe.runtime.jit import CacheEntry, LaunchShape

    prune = _load_script("prune_cubin_cache")
    cache = tmp_path / "cache"
    (cache / "objects").mkdir(parents=True)

    def put(variant, key, sha, cubin=True):
        entry = CacheEntry(variant, "sm_90a", key, "k", sha, sha, LaunchShape(block=(32, 1, 1)), [], {}, {}, cache)
        path = cache / "entries" / "sm_90a" / variant.name / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entry.to_json()))
        (cache / "objects" / f"{sha}.ptx").write_text("ptx")
        if cubin:
            (cache / "objects" / f"{sha}.cubin").write_bytes(b"\0")
        return path

    current = gg.variant("w1", 8)
    kept = put(current, jit.lookup_key(current, "sm_90a"), "aa")
    old = put(current, "0" * 32, "bb")  # another tree's build of the same variant
    other = gg.variant("w2", 8)
    broken = put(other, jit.lookup_key(other, "sm_90a"), "cc", cubin=False)  # an interrupted build
    stale, keep = prune.stale_entries(cache)
    assert sorted(stale) == sorted([old, broken]) and keep == {"aa.cubin", "aa.ptx"}
    assert prune.runtime_copy(cache, tmp_path / "run", set(stale), keep) == 0
    assert sorted(p.relative_to(tmp_path / "run").as_posix() for p in (tmp_path / "run").rglob("*") if p.is_file()) \
        == [kept.relative_to(cache).as_posix(), "objects/aa.cubin"]
    with pytest.raises(SystemExit, match="exists: remove it first"):
        prune.runtime_copy(cache, tmp_path / "run", set(stale), keep)
    monkeypatch.setattr("sys.argv", ["prune_cubin_cache.py", "--cache-dir", str(cache)])
    assert prune.main() == 0
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        kept.relative_to(cache).as_posix(), "objects/aa.cubin", "objects/aa.ptx"]


def test_sass_diff_pairs_the_variants_two_caches_share(tmp_path):
    """scripts/sass_diff.py compares the variants built in both caches: entries pair by kernel name, parameters and
    arch, each with its cubin found by SHA-256 (a variant whose cubin is missing is left out); two builds of one
    variant in one cache are refused."""
    import json

    sass_diff = _load_script("sass_diff")
    cases = [((("block_n", 8), ("role", "w1")), "aa"), ((("role", "w2"),), "bb")]
    for i, (params, sha) in enumerate(cases):
        (tmp_path / "entries" / "sm_90a").mkdir(parents=True, exist_ok=True)
        (tmp_path / "objects").mkdir(exist_ok=True)
        entry = {"variant": {"name": "sm90.grouped_gemm", "params": [list(p) for p in params]}, "arch": "sm_90a",
                 "cubin_sha256": sha}
        (tmp_path / "entries" / "sm_90a" / f"{i}.json").write_text(json.dumps(entry))
    (tmp_path / "objects" / "aa.cubin").write_bytes(b"\0")  # bb's cubin is missing
    found = sass_diff.entries(tmp_path, "sm90.grouped_gemm")
    assert found == {"sm90.grouped_gemm[block_n=8,role=w1] sm_90a": tmp_path / "objects" / "aa.cubin"}
    assert sass_diff.entries(tmp_path, "sm90.other") == {}
    # another tree's build of the same variant in the same cache (an A/B's): refused, not one of them picked
    (tmp_path / "objects" / "cc.cubin").write_bytes(b"\1")
    entry = {"variant": {"name": "sm90.grouped_gemm", "params": [list(p) for p in cases[0][0]]}, "arch": "sm_90a",
             "cubin_sha256": "cc"}
    (tmp_path / "entries" / "sm_90a" / "2.json").write_text(json.dumps(entry))
    with pytest.raises(SystemExit, match="two builds of sm90.grouped_gemm"):
        sass_diff.entries(tmp_path, "sm90.grouped_gemm")
    assert sass_diff.INSTRUCTION.findall("        /*0a10*/                   QGMMA.64x64x32 R24, R56 ;  /* 0x0 */") == [
        "QGMMA.64x64x32 R24, R56"]
