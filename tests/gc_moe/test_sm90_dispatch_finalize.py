"""SM90 layer roles 1 and 3: the region table, ring arithmetic and format conversion against hand values
(CPU), and the offline sm_90a builds of both kernels with what their PTX promises."""

import re

import pytest
import torch
from gc_moe.formats import dequantize_fp8_k128, dequantize_fp8_ue8m0, pack_ue8m0, quantize_fp8_ue8m0
from gc_moe.kernels.sm90 import dispatch, finalize
from gc_moe.kernels.sm90 import layer_layout as ll
from gc_moe.runtime.workspace import REGION_ALIGN

SMALL = ll.LayerShape(num_ranks=2, num_experts=8, topk=3, hidden=256, intermediate=128, capacity=5, block_m=8)


# ------------------------------------------------------------------------------------------------ region table
def test_region_table_shapes_for_a_hand_computed_layer():
    s = SMALL  # e = 4, max rows = 5 * 2 * min(3, 4) = 30, ring blocks = ceil(30 / 8) = 4, ring rows 32
    assert (s.local_experts, s.max_rows, s.ring_blocks, s.ring_rows, s.entries_per_source) == (4, 30, 4, 32, 15)
    table = {r["name"]: r for r in ll.layer_layout(s).table()}
    expected = {
        "x": ([5, 256], 1280), "x_sf": ([5, 2], 40), "topk_idx": ([5, 3], 120), "topk_weights": ([5, 3], 60),
        "send_count": ([8], 64), "recv_count": ([2, 2, 4], 128), "src_index": ([2, 4, 15], 480),
        "ring_act": ([32, 256], 8192), "ring_scale": ([32, 2], 256), "routing_weight": ([32], 128),
        "dest_row": ([32], 128), "ring_source": ([32], 128), "expert_offsets": ([5], 20),
        "l2_act": ([32, 128], 4096), "l2_scale": ([32, 1], 128), "combine": ([3, 5, 256], 7680),
        "l1_full_count": ([4], 16), "l1_empty_count": ([4], 16), "l2_empty_count": ([4], 16),
        "w1_done_mask": ([4, 2], 64), "tag1_arrive": ([2], 8), "combine_ready": ([2], 8), "control": ([16], 64),
        "peers": ([72], 576),
    }
    assert {n: (r["shape"], r["bytes"]) for n, r in table.items()} == expected
    offsets = [r["offset"] for r in table.values()]
    assert all(o % REGION_ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    # 20 regions fit one 1 KiB slot each; x takes 2 KiB, ring_act 8, combine 8, l2_act 4
    assert ll.layer_layout(s).total_bytes == 1024 * (20 + 2 + 8 + 8 + 4)


def test_shared_expert_adds_combine_lane_k():
    s = ll.LayerShape(1, 4, 2, 128, 128, 3, 8, num_shared_experts=1)
    assert s.combine_lanes == 3 and ll.layer_layout(s).region("combine").shape == (3, 3, 128)


@pytest.mark.parametrize("kw, message", [
    ({"num_experts": 9}, "multiple of num_ranks"),
    ({"hidden": 200}, "multiples of 128"),
    ({"num_shared_experts": 2}, "num_shared_experts"),
    ({"topk": 32, "num_shared_experts": 1}, "at most 32"),
    ({"num_ranks": 73, "num_experts": 73}, "peer table"),
    ({"capacity": 0}, "capacity"),
])
def test_layer_shape_errors_say_what_is_allowed(kw, message):
    args = {"num_ranks": 2, "num_experts": 8, "topk": 3, "hidden": 256, "intermediate": 128, "capacity": 5,
            "block_m": 8}
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        ll.LayerShape(**args)


# ------------------------------------------------------------------------------------------------ ring arithmetic
def test_ring_slot_and_full_count_per_generation():
    assert [ll.ring_slot(b, 4) for b in (0, 3, 4, 9)] == [(0, 0), (3, 0), (0, 1), (1, 2)]
    assert [ll.expected_l1_full_count(g, 16) for g in range(3)] == [16, 32, 48]
    assert ll.ring_row(37, SMALL) == 5
    with pytest.raises(ValueError):
        ll.ring_slot(-1, 4)


def test_l1_full_counts_pad_the_last_partial_block():
    # 19 rows in blocks of 8: 8, 8, 3 landed + 5 padding, block 3 untouched
    assert ll.l1_full_counts_after_dispatch(19, SMALL) == [8, 8, 8, 0]
    assert ll.l1_full_counts_after_dispatch(16, SMALL) == [8, 8, 0, 0]
    assert ll.l1_full_counts_after_dispatch(0, SMALL) == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        ll.l1_full_counts_after_dispatch(33, SMALL)


def test_tiles_acquire_every_block_they_touch():
    assert list(ll.blocks_of_tile(5, 8, 8)) == [0, 1]  # rows 5..12
    assert list(ll.blocks_of_tile(8, 8, 8)) == [1]
    assert list(ll.blocks_of_tile(15, 1, 8)) == [1]
    assert list(ll.blocks_of_tile(3, 0, 8)) == []


def test_packed_publish_and_arrival_counts():
    packed = ll.packed_send_count([3, 0, 5, 1])  # four dispatch CTAs, one with no token for this expert
    assert packed == (4 << 32) + 9 == 17179869193
    assert ll.unpack_count(packed) == (4, 9)
    assert ll.expected_arrivals(4) == 4 and ll.expected_arrivals_per_expert(4, 8) == 32


def test_grouped_layout_orders_experts_then_source_ranks():
    # two ranks, 4 experts (2 local each), k = 2; owner 1 holds experts 2 and 3
    rank0 = [[2, 0], [3, 2]]
    rank1 = [[1, 3], [2, -1], [3, 2]]
    offsets, seg = ll.grouped_layout([rank0, rank1], ll.LayerShape(2, 4, 2, 128, 128, 3, 8), owner=1)
    # expert 2: rank0 (t0 s0, t1 s1) rows 0-1, rank1 (t1 s0, t2 s1) rows 2-3; expert 3: rank0 t1 s0 row 4,
    # rank1 (t0 s1, t2 s0) rows 5-6
    assert offsets == [0, 4, 7]
    assert seg[(0, 0)] == (0, [0, 3]) and seg[(0, 1)] == (2, [2, 5])
    assert seg[(1, 0)] == (4, [2]) and seg[(1, 1)] == (5, [1, 4])


def test_destination_and_source_words():
    assert ll.dest_row(token=4, slot=2, shape=SMALL) == 14  # slot * C + token
    assert ll.ring_source(1, 4, 2, SMALL) == (1 * 5 + 4) * 3 + 2 == 29


# ------------------------------------------------------------------------------------------------ formats
def test_k32_to_k128_conversion_on_a_hand_row():
    # one row, H = 128: K32 exponents 127, 128, 119, 105 (the formats.md example); max 128 -> scale 2
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, -1.0, 0.5
    x[0, 32], x[0, 33] = 896.0, 3.0
    x[0, 64], x[0, 65] = 1.0, -0.1
    q, sf = quantize_fp8_ue8m0(x)
    assert sf.item() == 0x6977807F
    q128, s128 = dispatch.convert_k32_to_k128(q, sf)
    assert s128.tolist() == [[2.0]]
    got = q128.float()[0]
    # group 0 halves (224, -0.5, 0.25), group 1 keeps 448, 1.5; group 2 (scale 2^-8) is divided by 2^9:
    # 256/512 = 0.5 and -26/512 = -0.05078125 (= -1.625 * 2^-5, still an exact E4M3 value)
    assert got[:3].tolist() == [224.0, -0.5, 0.25]
    assert got[32:34].tolist() == [448.0, 1.5]
    assert got[64:66].tolist() == [0.5, -0.05078125]
    assert torch.count_nonzero(got[96:]) == 0


def test_k32_to_k128_is_exact_without_underflow_and_bounded_with_it():
    gen = torch.Generator().manual_seed(7)
    n, h = 64, 512
    q = (torch.rand(n, h, generator=gen) * 400 + 48).to(torch.float8_e4m3fn)  # |q| >= 48: normal after <= 2^-3
    q = torch.where(torch.rand(n, h, generator=gen) < 0.5, -q.float(), q.float()).to(torch.float8_e4m3fn)
    near = torch.randint(120, 124, (n, h // 32), generator=gen, dtype=torch.uint8)  # spans <= 3 steps
    sf = pack_ue8m0(near)
    q128, s128 = dispatch.convert_k32_to_k128(q, sf)
    assert torch.equal(dequantize_fp8_k128(q128, s128), dequantize_fp8_ue8m0(q, sf))
    wide = torch.randint(100, 140, (n, h // 32), generator=gen, dtype=torch.uint8)  # up to 39 steps: underflow
    sf = pack_ue8m0(wide)
    q128, s128 = dispatch.convert_k32_to_k128(q, sf)
    err = (dequantize_fp8_k128(q128, s128) - dequantize_fp8_ue8m0(q, sf)).abs()
    step = s128.repeat_interleave(128, dim=1) * 2.0 ** -9  # E4M3 subnormal step at the K128 scale
    assert (err <= step / 2).all() and err.max() > 0


def test_combine_reference_sums_valid_slots_in_order_then_shared():
    gen = torch.Generator().manual_seed(3)
    combine = torch.randn(3, 4, 16, generator=gen).to(torch.bfloat16)  # k = 2 plus the shared lane
    idx = torch.tensor([[0, 1], [-1, 2], [3, -1], [-1, -1]])
    got = finalize.combine_reference(combine, idx, 4, shared=True).float()
    c = combine.float()
    want = torch.stack([c[0, 0] + c[1, 0] + c[2, 0], c[1, 1] + c[2, 1], c[0, 2] + c[2, 2], c[2, 3]])
    assert torch.equal(got, want.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------ launch arguments
def _args_layout(args):
    return [a.size for a in args]


def test_argument_lists_follow_the_parameter_tables():
    ws = ll.LocalWorkspace(ll.layer_layout(SMALL))
    ll.initialize_state(ws)
    assert ws.peers[0].item() == 0 and ws.control.abs().sum() == 0
    d = dispatch.dispatch_args(ws, SMALL, num_tokens=5, rank=1)
    assert _args_layout(d) == [8 if kind in ("u64", "s64") else 4 for _, kind in dispatch.PARAMS]
    assert d[0].data == ws.x.data_ptr().to_bytes(8, "little")
    assert d[-1].data == int(3600e9).to_bytes(8, "little")  # default timeout: 3600 s
    y = torch.zeros(5, 256, dtype=torch.bfloat16)
    f = finalize.finalize_args(ws, SMALL, y, num_tokens=5, dispatch_ctas=4)
    assert _args_layout(f) == [8 if kind in ("u64", "s64") else 4 for _, kind in finalize.PARAMS]
    assert f[2].data == y.data_ptr().to_bytes(8, "little")
    with pytest.raises(ValueError, match="capacity"):
        dispatch.dispatch_args(ws, SMALL, num_tokens=6, rank=0)
    with pytest.raises(ValueError, match="rank 2"):
        dispatch.dispatch_args(ws, SMALL, num_tokens=1, rank=2)
    with pytest.raises(ValueError, match="bfloat16"):
        finalize.finalize_args(ws, SMALL, y.float(), num_tokens=5, dispatch_ctas=4)


# ------------------------------------------------------------------------------------------------ offline build
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    cache = tmp_path_factory.mktemp("cubins")
    entries = {name: jit.build_variant(mod.variant(), "sm_90a", cache_dir=cache)
               for name, mod in (("dispatch", dispatch), ("finalize", finalize))}
    entries["probe"] = jit.build_variant(dispatch.consumer_probe_variant(), "sm_90a", cache_dir=cache)
    return entries


def _body(ptx):
    return ptx[ptx.index(".entry"):]


def test_both_roles_are_registered_for_sm90a():
    from gc_moe.kernels.registry import variants_for_profile

    names = {v.name for v in variants_for_profile("sm_90a", {})}
    assert {"sm90.dispatch", "sm90.finalize", "sm90.ring_consumer_probe"} <= names
    assert not {"sm90.dispatch", "sm90.finalize"} & {v.name for v in variants_for_profile("sm_103a", {})}


def test_builds_keep_their_promises_with_no_local_memory(built):
    from gc_moe.runtime import jit

    for name, entry in built.items():
        assert jit.check_promises(entry) == [], name
        ptx = _body(entry.ptx_path.read_text())
        assert entry.resources["frame_bytes"] == 0 and not re.search(r"\b(ld|st)\.local\b", ptx), name
        if name != "probe":
            kinds = dispatch.PARAMS if name == "dispatch" else finalize.PARAMS
            sizes = [8 if k in ("u64", "s64") else 4 for _, k in kinds]
            assert [size for _, size in entry.resources["params"]] == sizes


def test_dispatch_ptx_has_the_protocol(built):
    ptx = _body(built["dispatch"].ptx_path.read_text())
    # packed publish: a 64-bit atomic add of a value or-ed with 1 << 32
    assert re.search(r"atom\.global\.add\.u64", ptx)
    assert "4294967296" in ptx or "0x100000000" in ptx.lower()
    # tag-1: release arrivals at system scope on the peers, an acquire wait at system scope
    assert re.search(r"red\.release\.sys\.global\.add\.s32", ptx)
    assert re.search(r"ld\.acquire\.sys\.global\.b32", ptx)
    # ring blocks and grid syncs: release atomics at GPU scope, acquire waits
    assert len(re.findall(r"atom\.release\.gpu\.global\.add\.s32", ptx)) >= 3
    assert re.search(r"ld\.acquire\.gpu\.global\.b32", ptx)
    # the pull moves 16 bytes per lane and converts them (K32 UE8M0 -> K128 FP32 rescale)
    assert re.search(r"ld\.global\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx)
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) >= 8
    _assert_bounded_waits(ptx)


def test_finalize_ptx_has_the_protocol(built):
    ptx = _body(built["finalize"].ptx_path.read_text())
    assert re.search(r"fence\.acq_rel\.sys", ptx) and re.search(r"red\.release\.sys\.global\.add\.s32", ptx)
    assert re.search(r"ld\.acquire\.sys\.global\.b32", ptx)
    assert re.search(r"atom\.acq_rel\.gpu\.global\.add\.s32", ptx)
    assert re.search(r"st\.release\.gpu\.global\.b32", ptx)  # the parity flip
    assert re.search(r"ld\.global\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx)
    _assert_bounded_waits(ptx)


def test_ring_consumer_probe_acquires_before_it_records(built):
    ptx = _body(built["probe"].ptx_path.read_text())
    acquire = ptx.find("ld.acquire.gpu.global.b32")
    record = ptx.rfind("st.relaxed.gpu.global.b32")
    assert 0 <= acquire < record
    _assert_bounded_waits(ptx)


def test_expected_probe_rows_by_hand():
    # experts of 5, 0 and 7 rows in tiles of 4: tiles start at rows 0, 4 | 5, 9
    assert dispatch.expected_probe_rows([0, 5, 5, 12], 4, 16) == [4, 0, 0, 0, 1, 4, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0]


def _assert_bounded_waits(ptx):
    """Every trap sits in a block reached from a %globaltimer comparison: the waits are bounded."""
    assert "%globaltimer" in ptx and "nanosleep" in ptx
    traps = [m.start() for m in re.finditer(r"\btrap;", ptx)]
    assert traps
    for pos in traps:
        before = ptx[:pos]
        assert before.rfind("%globaltimer") != -1 and before.rfind("setp.") > before.rfind("%globaltimer")


# ------------------------------------------------------------------------------------------------ data flow
def _device_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "device_layer_proof.py"
    spec = importlib.util.spec_from_file_location("device_layer_proof", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_layout_through_a_standin_role2_and_the_combine_matches_the_reference():
    """P = 2 on the host: the twin of role1 on each owner, the device script's role2 stand-in on that ring,
    partials scattered to their source ranks by ring_source / dest_row, the combine twin per source rank:
    Eq. (1) of gc_moe.reference at the paper's thresholds."""
    from gc_moe import metrics
    from gc_moe.cases import make_routing, random_activations, random_moe_weights
    from gc_moe.reference import moe_reference

    script = _device_script()
    shape = ll.LayerShape(2, 8, 3, 256, 128, 6, 8)
    tokens = [6, 4]
    l1, l2 = random_moe_weights(8, 256, 128, seed=11)
    w1f, w2f = script.dequantized_weights(l1, l2, "cpu")
    xs, sfs, idxs, wts = [], [], [], []
    for r, t in enumerate(tokens):
        x, sf = random_activations(t, 256, seed=20 + r)
        idx, wt = make_routing("uniform", t, 8, 3, num_ranks=2, seed=30 + r, source_rank=r)
        xs.append(x), sfs.append(sf), idxs.append(idx), wts.append(wt)
    combines = [torch.zeros(shape.combine_lanes * shape.capacity + 1, 256, dtype=torch.bfloat16) for _ in range(2)]
    rows_seen = 0
    for owner in range(2):
        twin = dispatch.reference_dispatch(shape, owner, xs, sfs, idxs, wts)
        n = int(twin["expert_offsets"][-1])
        rows_seen += n
        pad = shape.ring_rows - n
        partials, valid = script.grouped_ffn_standin(
            torch.cat([twin["ring_act"], torch.zeros(pad, 256, dtype=torch.float8_e4m3fn)]),
            torch.cat([twin["ring_scale"], torch.ones(pad, 2)]), twin["expert_offsets"],
            torch.cat([twin["routing_weight"], torch.zeros(pad)]), w1f[4 * owner:4 * owner + 4],
            w2f[4 * owner:4 * owner + 4])
        assert valid.sum() == n and not valid[n:].any()
        src = twin["ring_source"] // (shape.capacity * shape.topk)
        for r in range(2):
            mine = (src == r).nonzero().flatten()
            script.scatter_partials(partials[mine], torch.ones(len(mine), dtype=torch.bool),
                                    twin["dest_row"][mine], combines[r])
    assert rows_seen == sum(int((i >= 0).sum()) for i in idxs)  # every assignment landed on exactly one owner
    for r in range(2):
        lanes = combines[r][:-1].view(shape.combine_lanes, shape.capacity, 256)
        y = finalize.combine_reference(lanes, idxs[r], tokens[r], shared=False).float()
        ref = moe_reference(xs[r], sfs[r], idxs[r], wts[r], l1, l2, activation_alpha=1.0, activation_clamp=10.0)
        assert torch.isfinite(y).all()
        assert metrics.cosine(y, ref.float()) >= 0.999
        assert metrics.processed_diff(y, ref.float()) <= metrics.THRESHOLDS.processed_diff


def test_standin_requant_is_the_formats_rule_and_ignores_stale_ring_rows():
    from gc_moe.formats import quantize_fp8_k128

    script = _device_script()
    a = torch.randn(7, 256, generator=torch.Generator().manual_seed(4)) * 3
    assert torch.equal(script.requantize_k128(a), dequantize_fp8_k128(*quantize_fp8_k128(a)))
    # rows past expert_offsets[-1] hold whatever a replay left: NaN bytes and scales must not reach the output
    act = torch.full((16, 256), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    act[:3] = torch.randn(3, 256).to(torch.float8_e4m3fn)
    scale = torch.full((16, 2), float("nan"))
    scale[:3] = 0.5
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32)
    partials, valid = script.grouped_ffn_standin(act, scale, offsets, torch.full((16,), float("nan")).index_fill(
        0, torch.arange(3), 0.7), torch.randn(2, 256, 256), torch.randn(2, 256, 128))
    assert valid.tolist() == [True] * 3 + [False] * 13
    assert torch.isfinite(partials.float()).all() and partials[:3].float().abs().sum() > 0


def test_device_script_ring_check_accepts_any_order_within_a_segment_and_catches_one_wrong_byte():
    from types import SimpleNamespace

    from gc_moe.cases import make_routing, random_activations

    script = _device_script()
    shape = ll.LayerShape(1, 4, 2, 256, 128, 6, 8)
    x, sf = random_activations(6, 256, seed=1)
    idx, wt = make_routing("uniform", 6, 4, 2, seed=2)
    twin = dispatch.reference_dispatch(shape, 0, [x], [sf], [idx], [wt])
    n = int(twin["expert_offsets"][-1])
    assert n == 12 and twin["l1_full_count"].tolist() == [8, 8]  # 12 rows: one full block, one padded
    ws = ll.LocalWorkspace(ll.layer_layout(shape))
    # the kernel's order within an (expert, source) segment is free: reverse every segment
    perm = []
    for j in range(4):
        a, b = twin["expert_offsets"][j].item(), twin["expert_offsets"][j + 1].item()
        perm += list(range(b - 1, a - 1, -1))
    perm = torch.tensor(perm)
    for name in ("ring_act", "ring_scale", "routing_weight", "dest_row", "ring_source"):
        getattr(ws, name)[:n] = twin[name][perm]
    ws.expert_offsets.copy_(twin["expert_offsets"])
    ws.l1_full_count.copy_(twin["l1_full_count"])
    layer = SimpleNamespace(ws=ws, shape=shape)
    assert all(v == 0 for v in script.check_ring(layer, twin, n).values())
    ws.ring_act.view(torch.uint8)[3, 17] ^= 1
    ws.dest_row[5] += 1
    bad = script.check_ring(layer, twin, n)
    assert bad["ring_act"] == 1 and bad["dest_row"] == 1 and sum(bad.values()) == 2


# ------------------------------------------------------------------------------------------------ role2 = the kernel
def test_kernel_mode_element_checks_accept_the_kernels_numerics_and_catch_one_wrong_element():
    """The device script's checks for role2 = the ring-consumer grouped GEMM, on the host twin at P = 1: W1's
    requantized output (formats.quantize_fp8_k128 of the float32 SwiGLU, what the kernel stores) passes the
    per-element W1 check; the stand-in's y (BF16 partials, FP32 combine, BF16 out: the kernel path's roundings)
    passes the per-element y check built from that output and matches gc_moe.reference; one wrong byte of
    W1's output or one missing partial is caught."""
    from gc_moe import metrics
    from gc_moe.cases import make_routing, random_activations, random_moe_weights
    from gc_moe.formats import quantize_fp8_k128
    from gc_moe.reference import moe_reference

    script = _device_script()
    seed = int(torch.randint(0, 2**20, (1,)))
    shape = ll.LayerShape(1, 8, 3, 256, 128, 7, 8)
    l1, l2 = random_moe_weights(8, 256, 128, seed=seed)
    w1f, w2f = script.dequantized_weights(l1, l2, "cpu")
    x, sf = random_activations(7, 256, seed=seed + 1)
    idx, wt = make_routing("uniform", 7, 8, 3, seed=seed + 2)
    twin = dispatch.reference_dispatch(shape, 0, [x], [sf], [idx], [wt])
    n = int(twin["expert_offsets"][-1])
    assert n == 21
    a = script.w1_float32(twin["ring_act"], twin["ring_scale"], twin["expert_offsets"], twin["routing_weight"], w1f)
    # the row loop by hand: expert of row r from the offsets, SwiGLU of its own product
    for r in range(n):
        e = int((twin["expert_offsets"][1:] <= r).sum())
        gu = dequantize_fp8_k128(twin["ring_act"][r:r + 1], twin["ring_scale"][r:r + 1]) @ w1f[e].T
        gate, up = gu[:, :128].clamp(max=10.0), gu[:, 128:].clamp(-10.0, 10.0)
        assert torch.allclose(a[r], (gate * torch.sigmoid(gate) * up * twin["routing_weight"][r])[0], rtol=1e-5,
                              atol=1e-6)
    q, qs = quantize_fp8_k128(a)
    assert script.w1_element_errors(q, qs, a) == 0
    wrong = q.clone()
    wrong.view(torch.uint8)[4, 9] += 2  # two E4M3 steps off
    assert script.w1_element_errors(wrong, qs, a) == 1
    y_want, tol = script.combine_from_intermediate(q, qs, twin["expert_offsets"], twin["dest_row"], w2f, idx,
                                                   shape, 7)
    # the kernel path's roundings: BF16 partials of W2 on W1's output, FP32 sum of the valid slots, BF16 y
    partials, valid = script.grouped_ffn_standin(twin["ring_act"], twin["ring_scale"], twin["expert_offsets"],
                                                 twin["routing_weight"], w1f, w2f)
    scratch = torch.zeros(shape.combine_lanes * shape.capacity + 1, 256, dtype=torch.bfloat16)
    script.scatter_partials(partials, valid, twin["dest_row"], scratch)
    lanes = scratch[:-1].view(shape.combine_lanes, shape.capacity, 256)
    y = finalize.combine_reference(lanes, idx, 7, shared=False).float()
    assert ((y - y_want).abs() <= tol).all()
    assert float(tol.mean()) < 0.05 * float(y_want.abs().mean())  # the tolerance is two BF16 roundings, not more
    ref = moe_reference(x, sf, idx, wt, l1, l2, activation_alpha=1.0, activation_clamp=10.0)
    assert metrics.cosine(y, ref.float()) >= 0.999
    dropped = lanes[1, 3].float().clone()
    lanes[1, 3] = 0  # one partial (token 3, slot 1) not written
    y_missing = finalize.combine_reference(lanes, idx, 7, shared=False).float()
    off = (y_missing - y_want).abs() > tol
    # every element the lost partial moved by more than the tolerance's margin is caught (how many that is
    # depends on the random draw: 168-256 of the row's 256 seen), and nothing in the other tokens' rows
    big = dropped.abs() > 3 * tol[3]
    assert int(big.sum()) > 32 and bool(off[3][big].all())
    assert not off[[t for t in range(7) if t != 3]].any()


def test_kernel_mode_graph_topology(monkeypatch):
    """The layer graph of the device script with role2 = the kernel: dispatch (communication context) and W1
    (compute) are roots, W2 follows W1, finalize follows dispatch and W2; W1 and W2 get their ring arguments."""
    from types import SimpleNamespace

    import gc_moe.runtime.graph as graph_module

    script = _device_script()
    added = []

    class RecordingGraph:
        def add_kernel(self, name, kernel, grid, args, context, depends_on=()):
            added.append((name, kernel, context, [d for d in depends_on], len(args)))
            return name

    monkeypatch.setattr(graph_module, "ChildGraph", RecordingGraph)
    monkeypatch.setattr(script.gg, "w1_launch", lambda k, m, *a: ((1, 1, 1), list(a[:7]) + list(a[-1])))
    monkeypatch.setattr(script.gg, "w2_launch", lambda k, m, *a: ((1, 1, 1), list(a[:6]) + list(a[-1])))
    shape = ll.LayerShape(1, 4, 2, 256, 128, 6, 8)
    ws = ll.LocalWorkspace(ll.layer_layout(shape))
    layer = SimpleNamespace(shape=shape, ws=ws, args=SimpleNamespace(timeout_s=5.0), dispatch_ctas=4,
                            finalize_ctas=8, k_dispatch="kd", k_w1="k1", k_w2="k2", k_finalize="kf",
                            parts=SimpleNamespace(comm_context="comm", compute_context="compute"))
    y = torch.zeros(6, 256, dtype=torch.bfloat16)
    script.layer_nodes(layer, y, 6, SimpleNamespace(l1=None, l2=None))
    assert [(n, k, c, d) for n, k, c, d, _ in added] == [
        ("dispatch", "kd", "comm", []), ("w1", "k1", "compute", []), ("w2", "k2", "compute", ["w1"]),
        ("finalize", "kf", "compute", ["dispatch", "w2"])]
    assert added[1][4] == 7 + 6 and added[2][4] == 6 + 3  # the ring arguments ride along
    added.clear()
    script.layer_nodes(layer, y, 6, SimpleNamespace(l1=None, l2=None), ("w2", "finalize"))
    assert [(n, d) for n, _, _, d, _ in added] == [("w2", []), ("finalize", ["w2"])]
