import csv
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from gc_moe import weights
from gc_moe.formats import quantize_shared_expert_weights
from gc_moe.planning import SM103_BLOCK_M
from gc_moe.weights import sm103

MODELS_CSV = Path(__file__).resolve().parents[2] / "gcmoe_bench" / "data" / "models.csv"
# The two models of the paper (Table 4): hidden, intermediate.
MODELS = {"glm-5.2": (6144, 2048), "deepseek-v4.1-flash": (5120, 2304)}


def random_bytes(*shape, gen, dtype=torch.int8):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).view(dtype)


def random_words(*shape, gen):
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)


def random_moe(experts, hidden, intermediate, gen):
    l1 = (
        random_bytes(experts, 2 * intermediate, hidden // 2, gen=gen),
        random_words(experts, 2 * intermediate, hidden // 128, gen=gen),
    )
    l2 = (
        random_bytes(experts, hidden, intermediate // 2, gen=gen),
        random_words(experts, hidden, intermediate // 128, gen=gen),
    )
    return l1, l2


# Independent index maps, written from the layout description (docs/layouts.md), not from the implementation.
def interleaved_source_row(new_row, intermediate):
    pair, within = divmod(new_row, 16)
    return pair * 8 + within if within < 8 else intermediate + pair * 8 + within - 8


def utccp_source_row(new_row):
    block, within = divmod(new_row, 128)
    lane, word = divmod(within, 4)
    return block * 128 + word * 32 + lane


# ----------------------------------------------------------------------------------------------- row orders
def test_interleave_hand_example():
    rows = torch.arange(32).unsqueeze(-1)  # I = 16: gate rows 0..15, up rows 16..31
    got = sm103.interleave_gate_up(rows).squeeze(-1).tolist()
    assert got == [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert torch.equal(sm103.deinterleave_gate_up(sm103.interleave_gate_up(rows)), rows)


def test_utccp_permutation_hand_values():
    perm = sm103.utccp_row_permutation(256).tolist()
    assert perm[:8] == [0, 32, 64, 96, 1, 33, 65, 97]
    assert perm[124:128] == [31, 63, 95, 127]
    assert perm[128:132] == [128, 160, 192, 224]
    assert sorted(perm) == list(range(256))
    assert perm == [utccp_source_row(r) for r in range(256)]


def test_every_byte_lands_where_the_layout_says():
    gen = torch.Generator().manual_seed(1)
    hidden, intermediate, experts = 256, 128, 2
    (d1, s1), (d2, s2) = l1, l2 = random_moe(experts, hidden, intermediate, gen)
    (t1, p1), (t2, p2) = sm103.transform(l1, l2)
    assert t1.shape == (experts, hidden // 128, 2 * intermediate, 64) and t1.dtype == torch.int8
    assert p1.shape == (experts, hidden // 128, 2 * intermediate) and p1.is_contiguous()
    assert t2.shape == (experts, intermediate // 128, hidden, 64)
    assert p2.shape == (experts, intermediate // 128, hidden)
    for e in range(experts):
        for kb in range(hidden // 128):
            for r in range(2 * intermediate):
                src = interleaved_source_row(r, intermediate)
                assert torch.equal(t1[e, kb, r], d1[e, src, kb * 64 : kb * 64 + 64])
                assert p1[e, kb, r] == s1[e, interleaved_source_row(utccp_source_row(r), intermediate), kb]
        for kb in range(intermediate // 128):
            for r in range(hidden):
                assert torch.equal(t2[e, kb, r], d2[e, r, kb * 64 : kb * 64 + 64])
                assert p2[e, kb, r] == s2[e, utccp_source_row(r), kb]


def test_tiles_are_contiguous_8kb_bursts():
    gen = torch.Generator().manual_seed(2)
    l1, l2 = random_moe(1, 512, 256, gen)
    (t1, _), _ = sm103.transform(l1, l2)
    assert t1.is_contiguous()
    # one TMA box (128 K values x 128 rows) of tile kb is one contiguous 8 KB range
    flat = t1.view(-1)
    box = t1[0, 1, 128:256]
    start = (1 * 512 + 128) * 64
    assert torch.equal(flat[start : start + 8192].view(128, 64), box)


# ----------------------------------------------------------------------------------------------- real shapes
@pytest.mark.parametrize("model", sorted(MODELS))
def test_round_trip_is_byte_exact_at_real_shapes(model):
    hidden, intermediate = MODELS[model]
    gen = torch.Generator().manual_seed(hash(model) % 2**31)
    l1, l2 = random_moe(1, hidden, intermediate, gen)
    w1, w2 = sm103.transform(l1, l2)
    assert w1[0].shape == (1, hidden // 128, 2 * intermediate, 64)
    assert w2[0].shape == (1, intermediate // 128, hidden, 64)
    assert w1[1].shape == (1, hidden // 128, 2 * intermediate)
    assert w2[1].shape == (1, intermediate // 128, hidden)
    back1, back2 = sm103.inverse(w1, w2)
    for got, want in zip((*back1, *back2), (*l1, *l2)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # spot check fresh random positions against the independent index maps
    for _ in range(200):
        kb = int(torch.randint(hidden // 128, (1,), generator=gen))
        r = int(torch.randint(2 * intermediate, (1,), generator=gen))
        c = int(torch.randint(64, (1,), generator=gen))
        assert w1[0][0, kb, r, c] == l1[0][0, interleaved_source_row(r, intermediate), kb * 64 + c]
        assert w1[1][0, kb, r] == l1[1][0, interleaved_source_row(utccp_source_row(r), intermediate), kb]


def test_models_csv_shapes_match_the_paper():
    path = MODELS_CSV if MODELS_CSV.exists() else None
    if path is None:
        pytest.skip("model table not shipped in this checkout")
    with open(path) as f:
        rows = {r["model"]: (int(r["hidden"]), int(r["intermediate"])) for r in csv.DictReader(f)}
    for model, shape in MODELS.items():
        assert rows.get(model) == shape


@pytest.mark.parametrize("recipe, model", [((1, 1, 32), "deepseek-v4.1-flash"), ((1, 128, 128), "glm-5.2")])
def test_shared_expert_fp8_round_trip(recipe, model):
    hidden, intermediate = MODELS[model]
    gen = torch.Generator().manual_seed(7)
    shared = quantize_shared_expert_weights(
        torch.randn(2 * intermediate, hidden, generator=gen),
        torch.randn(hidden, intermediate, generator=gen),
        recipe,
    )
    (t1, p1), (t2, p2) = sm103.transform_shared(shared)
    assert t1.dtype == torch.float8_e4m3fn and t1.shape == (1, hidden // 128, 2 * intermediate, 128)
    words = hidden // 128 if recipe == (1, 1, 32) else math.ceil(hidden / 512)
    assert p1.shape == (1, words, 2 * intermediate)
    (b1, c1), (b2, c2) = sm103.inverse((t1, p1), (t2, p2))
    s1, s2 = shared.packed_row_scales()
    assert torch.equal(b1[0].view(torch.int8), shared.w1.view(torch.int8)) and torch.equal(c1[0], s1)
    assert torch.equal(b2[0].view(torch.int8), shared.w2.view(torch.int8)) and torch.equal(c2[0], s2)
    r = 200
    assert torch.equal(
        t1[0, 3, r].view(torch.int8),
        shared.w1[interleaved_source_row(r, intermediate), 384:512].view(torch.int8),
    )


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda l1: (l1[0].float(), l1[1]), r"l1_weights: data must be int8 \(packed FP4\) or float8_e4m3fn"),
        (lambda l1: (l1[0], l1[1].to(torch.int64)), "l1_weights: scales must be int32"),
        (lambda l1: (l1[0][:, :, :96], l1[1]), "K = 192 must be a multiple of 128"),
        (lambda l1: (l1[0][:, :64], l1[1][:, :64]), "64 rows must be a multiple of 128"),
        (lambda l1: (l1[0], l1[1][:, :, :1]), r"allowed: \[2, 256, W\] with W in \[2\]"),
        (lambda l1: (l1[0][0], l1[1][0]), "must be 3-D"),
        (lambda l1: l1[0], "expected a \\(data, scales\\) pair"),
    ],
)
def test_bad_inputs_are_refused_with_a_reason(mutate, message):
    l1, l2 = random_moe(2, 256, 128, torch.Generator().manual_seed(3))
    with pytest.raises((TypeError, ValueError), match=message):
        sm103.transform(mutate(l1), l2)


# ----------------------------------------------------------------------------------------------- Eq. (3)
@pytest.mark.parametrize(
    "t, bm, row",
    [
        (0, 16, 0),
        (1, 16, 4),
        (15, 16, 60),
        (16, 16, 128),
        (17, 16, 132),
        (31, 32, 124),
        (32, 32, 128),
        (95, 96, 126),
        (128, 96, 129),
        (200, 96, 288),
        (239, 96, 317),
        (240, 96, 321),
        (96, 96, 128),
        (100, 96, 144),
        (0, 240, 0),
        (31, 240, 124),
        (32, 240, 1),
        (127, 240, 127),
        (128, 240, 128),
        (129, 240, 132),
        (200, 240, 162),
        (239, 240, 191),
        (240, 240, 256),
        (241, 240, 260),
    ],
)
def test_eq3_hand_values(t, bm, row):
    # row(t) = floor(t/BM)*align(BM,128) + floor(u/128)*128 + (u mod 32)*4 + floor((u mod 128)/32), u = t mod BM
    assert sm103.shared_scale_row(t, bm) == row
    assert int(sm103.shared_scale_rows(t + 1, bm)[t]) == row


@pytest.mark.parametrize("bm", SM103_BLOCK_M)
def test_eq3_is_injective_and_fits_the_staged_buffer(bm):
    for tokens in (1, 7, 8, 9, 100, 255, 256, 512):
        rows = sm103.shared_scale_rows(tokens, bm)
        assert rows.unique().numel() == tokens
        assert int(rows.max()) < sm103.shared_scale_buffer_rows(tokens) == math.ceil(tokens / 8) * 128
        assert rows.tolist() == [sm103.shared_scale_row(t, bm) for t in range(tokens)]


def test_eq3_matches_the_utccp_order_of_routed_scales():
    # for a full 128-token block the staged order is exactly the UTCCP weight-scale permutation
    rows = sm103.shared_scale_rows(128, 128)
    perm = sm103.utccp_row_permutation(128)
    assert torch.equal(perm[rows], torch.arange(128))


def test_stage_and_unstage_shared_scales():
    gen = torch.Generator().manual_seed(4)
    x_sf = random_words(37, 48, gen=gen)
    staged = sm103.stage_shared_scales(x_sf, 32, capacity=64)
    assert staged.shape == (48, 8 * 128)
    assert torch.equal(staged[:, 128 + 3 * 4], x_sf[35])  # t = 35: second block (128), u = 3 -> 3*4 + 0
    assert torch.equal(staged[:, sm103.shared_scale_row(36, 32)], x_sf[36])
    assert torch.equal(sm103.unstage_shared_scales(staged, 37, 32), x_sf)
    used = torch.zeros(staged.shape[1], dtype=torch.bool)
    used[sm103.shared_scale_rows(37, 32)] = True
    assert bool((staged[:, ~used] == 0).all())
    with pytest.raises(ValueError, match="at most capacity=16"):
        sm103.stage_shared_scales(x_sf, 32, capacity=16)
    with pytest.raises(ValueError, match=r"block_m: got 48; allowed on sm103"):
        sm103.shared_scale_row(3, 48)


# ----------------------------------------------------------------------------------------------- dispatcher
def test_dispatcher_tags_and_inverts():
    l1, l2 = random_moe(1, 256, 128, torch.Generator().manual_seed(5))
    w1, w2 = weights.transform(l1, l2, "sm103")
    assert (w1.layout, w1.stage, w2.layout, w2.stage) == ("sm103", "l1", "sm103", "l2")
    tiles, _scales = w1  # still unpacks as a pair
    assert tiles.shape == (1, 2, 256, 64)
    c1, c2 = weights.to_canonical(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip((*c1, *c2), (*l1, *l2)))
    k1, _k2 = weights.transform(l1, l2, None)
    assert k1.layout == "canonical" and weights.layout_of(l1) == "canonical"
    with pytest.raises(ValueError, match="already transformed"):
        weights.transform(w1, w2, "sm103")
    with pytest.raises(ValueError, match="look swapped"):
        weights.to_canonical(w2, w1)
    with pytest.raises(ValueError, match=r"no weight transform for arch 'sm100'"):
        weights.transform(l1, l2, "sm100")


def test_missing_sm90_module_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "gc_moe.weights.sm90", None)
    l1, l2 = random_moe(1, 256, 128, torch.Generator().manual_seed(6))
    with pytest.raises(NotImplementedError, match=r"SM90 MXFP4 window repack \(gc_moe.weights.sm90\)"):
        weights.transform(l1, l2, "sm90")


def test_incomplete_sm90_module_names_the_missing_function(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "gc_moe.weights.sm90", types.SimpleNamespace(transform=lambda a, b: (a, b))
    )
    with pytest.raises(NotImplementedError, match=r"gc_moe.weights.sm90.inverse\(\)"):
        weights.arch_module("sm90")
