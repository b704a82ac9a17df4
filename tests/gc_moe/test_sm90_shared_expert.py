"""SM90 shared expert (role4): host arithmetic and the host twin (CPU), offline sm_90a builds with their PTX
promises (CuTe DSL), and on a GPU every output element against the float32 reference at both models' shapes."""

import random
import re

import pytest
import torch
from gc_moe import reference
from gc_moe.formats import dequantize_fp8_ue8m0
from gc_moe.kernels import registry
from gc_moe.kernels.sm90 import shared_expert as se

SM90_SMEM_PER_CTA = 232448  # 227 KB of dynamic + static shared memory per CTA on sm_90


def _cos_diff(y, r):
    y, r = y.double().flatten(), r.double().flatten()
    dot = (y * r).sum()
    return float(dot / (y.norm() * r.norm())), float(1 - 2 * dot / (y.square().sum() + r.square().sum()))


# --------------------------------------------------------------------------------------------- host arithmetic
def test_config_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="role must be 'w1' or 'w2'"):
        se.SharedConfig("w3")
    with pytest.raises(ValueError, match="block_n must be one of"):
        se.SharedConfig("w1", 12)
    with pytest.raises(ValueError, match="recipe must be one of"):
        se.SharedConfig("w1", 8, "k64")
    with pytest.raises(ValueError, match=r"recipe \(1, 1, 64\) is not supported; allowed"):
        se.recipe_name((1, 1, 64))
    with pytest.raises(ValueError, match="multiples of 128"):
        se.plan_launch(4, 5000, 2304)


def test_shared_memory_plan_fits_and_regions_do_not_overlap():
    for bn in se.BLOCK_N_CHOICES:
        cfg = se.SharedConfig("w1", bn)
        assert cfg.smem_bytes + 1024 <= SM90_SMEM_PER_CTA  # the DSL adds 1 KB of static shared memory
        assert cfg.b_offset == 4 * 64 * 128 and cfg.ws_offset == cfg.b_offset + 4 * bn * 128
        assert cfg.xs_offset == cfg.ws_offset + 4 * 64 * 4 and cfg.stage_bytes % 128 == 0
        assert cfg.stage_bytes >= cfg.xs_offset + 4 * bn * 4
        # the epilogue's reduction and amax tables reuse the drained pipeline, below the flag word
        assert cfg.amax_offset + 16 * bn * 4 <= cfg.flag_offset


def test_w1_tile_rows_pair_gate_and_up_of_one_channel_and_cover_every_row():
    inter = 384
    seen = []
    for tile in range(2 * inter // 64):
        for r in range(64):
            row = se.w1_tile_row_to_weight_row(tile, r, inter)
            seen.append(row)
            v, hi, lo = r // 16, (r // 8) % 2, r % 8
            channel = 32 * tile + 8 * v + lo  # the epilogue's channel of accumulator rows g and g + 8
            assert row == channel + hi * inter
            assert tile // 4 == channel // 128  # 4 tiles = one K128 scale group of the intermediate
    assert sorted(seen) == list(range(2 * inter))


def test_split_ranges_cover_every_k_step_once():
    rng = random.Random(5)
    for _ in range(300):
        k_blocks, splits = rng.randint(1, 60), rng.randint(1, 12)
        steps = [s for split in range(splits) for s in se.split_range(k_blocks, splits, split)]
        assert steps == list(range(se.super_steps(k_blocks)))
        blocks = [4 * s + wg for s in steps for wg in range(4) if 4 * s + wg < k_blocks]
        assert blocks == list(range(k_blocks))


def test_launch_plans_at_the_models_shapes():
    # (H, Is): W1 2Is/64 tiles, W2 H/64 tiles; splits only where every CTA still fits one wave of 132 SMs
    dsv = [se.plan_launch(t, 5120, 2304) for t in (1, 8, 9, 64, 65, 256)]
    assert [(p.block_n, p.token_tiles) for p in dsv] == [(8, 1), (8, 1), (16, 1), (32, 2), (32, 3), (32, 8)]
    assert {(p.k_splits_w1, p.k_splits_w2) for p in dsv} == {(1, 1)}  # 72 and 80 CTAs
    glm = se.plan_launch(1, 6144, 2048)
    assert (glm.k_splits_w1, glm.k_splits_w2) == (2, 1)  # 64 W1 tiles -> 128 CTAs; 96 W2 tiles
    assert se.grid("w1", glm, 6144, 2048) == (1, 2, 64) and se.grid("w2", glm, 6144, 2048) == (1, 1, 96)
    assert se.fixup_group_size("w1", glm) == 8 and se.fixup_group_size("w2", glm) == 1
    assert se.scratch_floats("w2", glm, 6144, 2048) == 0  # W2 without split stores from registers
    assert se.counter_words("w1", glm, 6144, 2048) == 2048 // 128


def test_workspace_sizes_cover_every_plan_up_to_capacity():
    for hidden, inter in ((5120, 2304), (6144, 2048), (512, 256)):
        scratch, counters = se.workspace_sizes(hidden, inter, 256)
        for t, pipeline in ((t, p) for t in range(1, 257) for p in se.PIPELINES):
            p = se.plan_launch(t, hidden, inter, pipeline=pipeline)
            assert se.scratch_floats("w1", p, hidden, inter) + se.scratch_floats("w2", p, hidden, inter) <= scratch
            assert se.counter_words("w1", p, hidden, inter) + se.counter_words("w2", p, hidden, inter) <= counters


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)], ids=["k32", "block128"])
def test_host_twin_matches_the_float32_reference(recipe):
    weights, x, x_sf = se.random_inputs(512, 384, recipe, 13, seed=7, device="cpu")
    act, scale, y = se.emulate(weights, x, x_sf, 11)
    ref = reference._shared_partial(dequantize_fp8_ue8m0(x[:11], x_sf[:11]), weights, alpha=1.0, clamp=10.0,
                                    requantize=False)
    cos, diff = _cos_diff(y, ref)
    assert cos >= 0.999 and diff <= 0.002, (cos, diff)
    assert act.shape == (11, 384) and scale.shape == (11, 3)


def test_registry_builds_every_variant_of_both_recipes():
    names = [v for v in registry.variants_for_profile("sm_90a") if v.name == "sm90.shared_expert"]
    assert len(names) == 2 * 2 * (len(se.BLOCK_N_CHOICES) + len(se.WS_BLOCK_N) + len(se.TWO_CTA_BLOCK_N))
    assert {dict(v.params)["recipe"] for v in names} == {"k32", "block128"}
    assert sorted({dict(v.params)["block_n"] for v in names if dict(v.params)["pipeline"] == "ws"}) == list(
        se.WS_BLOCK_N)
    assert not [v for v in registry.variants_for_profile("sm_100a") if v.name == "sm90.shared_expert"]


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)], ids=["k32", "block128"])
def test_packed_weights_hold_each_tile_in_the_wgmma_core_matrix_order(recipe):
    """pack_weights: byte (row r, K k) of tile m's K128 block kb sits at ((r // 8) * 8 + k // 16) * 128 +
    (r % 8) * 16 + k % 16 of its 8 KB block (W1's rows in the gate/up interleave), and the block's scale words
    are the 64 rows' in tile order (block128: the FP32 of the row's 128-row block)."""
    hidden, inter = 512, 384
    weights, _, _ = se.random_inputs(hidden, inter, recipe, 4, seed=3, device="cpu")
    packed = se.pack_weights(weights)
    for name, w, w_sf, row_of in (
            ("w1", weights.w1, weights.w1_sf, lambda m, r: se.w1_tile_row_to_weight_row(m, r, inter)),
            ("w2", weights.w2, weights.w2_sf, lambda m, r: m * se.TILE_ROWS + r)):
        codes, sf = getattr(packed, name), getattr(packed, name + "_sf")
        tiles, kb = w.shape[0] // se.TILE_ROWS, w.shape[1] // 128
        assert codes.shape == (tiles, kb, se.A_BLOCK_BYTES) and sf.shape == (tiles, kb, se.TILE_ROWS)
        assert codes.dtype == torch.uint8 and sf.dtype == torch.int32 and codes.is_contiguous()
        raw = w.view(torch.uint8)
        gen = torch.Generator().manual_seed(5)
        for _ in range(300):
            m, b = int(torch.randint(tiles, (1,), generator=gen)), int(torch.randint(kb, (1,), generator=gen))
            r, k = int(torch.randint(64, (1,), generator=gen)), int(torch.randint(128, (1,), generator=gen))
            at = ((r // 8) * 8 + k // 16) * 128 + (r % 8) * 16 + k % 16
            assert codes[m, b, at] == raw[row_of(m, r), b * 128 + k], (name, m, b, r, k)
            want = w_sf[row_of(m, r) // 128, b].view(torch.int32) if recipe == (1, 128, 128) else w_sf[row_of(m, r), b]
            assert sf[m, b, r] == want, (name, m, b, r)
    assert packed.source == tuple(t.data_ptr() for t in (weights.w1, weights.w1_sf, weights.w2, weights.w2_sf))


def test_plans_pick_the_warp_specialized_pipeline_where_it_builds():
    plans = [se.plan_launch(t, 6144, 2048) for t in (1, 8, 9, 32, 33, 256)]
    assert [(p.pipeline, p.block_n, p.token_tiles) for p in plans] == [
        ("ws", 8, 1), ("ws", 8, 1), ("ws", 16, 1), ("ws", 32, 1), ("ws", 32, 2), ("ws", 32, 8)]
    two = se.plan_launch(1, 6144, 2048, 128, ctas_per_sm=2)  # twice the K splits: 64 W1 tiles x 4 = 256 CTAs
    assert (two.ctas_per_sm, two.k_splits_w1, two.k_splits_w2) == (2, 4, 2)
    assert se.plan_launch(1, 6144, 2048, 128).ctas_per_sm == se.AUTO_CTAS_PER_SM
    with pytest.raises(ValueError, match="ctas_per_sm 2; allowed: 1, or 2 on the warp-specialized pipeline"):
        se.plan_launch(16, 6144, 2048, ctas_per_sm=2)
    old = [se.plan_launch(t, 6144, 2048, pipeline="cp.async") for t in (8, 33, 256)]
    assert [(p.pipeline, p.block_n, p.token_tiles) for p in old] == [
        ("cp.async", 8, 1), ("cp.async", 64, 1), ("cp.async", 64, 4)]
    with pytest.raises(ValueError, match="warp-specialized pipeline runs block_n"):
        se.SharedConfig("w1", 64, pipeline="ws")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        se.SharedConfig("w1", 8, pipeline="tma")
    cfg = se.SharedConfig("w1", 8, pipeline="ws")
    assert cfg.threads == 544 and cfg.smem_bytes <= se.SMEM_LIMIT and cfg.barrier_offset >= cfg.flag_offset + 8
    assert cfg.name.endswith("_ws") and se.SharedConfig("w1", 8).threads == 512


# --------------------------------------------------------------------------------------------- offline builds
@pytest.fixture(scope="module", params=["k32", "block128"])
def built(request, tmp_path_factory):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    cache = tmp_path_factory.mktemp("cubins")
    return {v: jit.build_variant(v, "sm_90a", cache_dir=cache) for v in se.all_variants()
            if dict(v.params)["recipe"] == request.param}


def test_every_variant_builds_with_shared_ab_wgmma_no_spills_and_the_fixup_order(built):
    separate = {v: e for v, e in built.items() if v.name == "sm90.shared_expert"}
    assert len(separate) == 2 * (len(se.BLOCK_N_CHOICES) + len(se.WS_BLOCK_N) + len(se.TWO_CTA_BLOCK_N))
    for variant, entry in separate.items():
        params = dict(variant.params)
        cfg = se.SharedConfig(params["role"], params["block_n"], params["recipe"], params["pipeline"],
                              params.get("ctas_per_sm", 1))
        ptx = entry.ptx_path.read_text()
        # both operands from shared memory (two 64-bit descriptors), E4M3 x E4M3, one K32 per instruction
        mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.block_n}k32\.f32\.e4m3\.e4m3 "
                         r"\{[^}]*\}, (%rd\d+), (%rd\d+), fresh, 1, 1;", ptx)
        assert len(mma) == 4, variant.describe()
        assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 4 // cfg.wgmmas_per_wait
        res = entry.resources
        assert res["frame_bytes"] == 0 and res["registers"] <= 128, (variant.describe(), res)
        assert not re.search(r"\b(ld|st)\.local\b", ptx), variant.describe()
        assert [size for _, size in res["params"]] == [8 if kind == "u64" else 4 for _, kind in cfg.params]
        assert entry.launch.dynamic_smem_bytes == cfg.smem_bytes <= cfg.smem_limit
        if cfg.ctas_per_sm == 2:  # two CTAs' registers fit the register file, and ptxas was told so
            assert res["registers"] * cfg.threads * 2 <= 65536 and ".minnctapersm 2" in ptx
        assert entry.launch.block == (cfg.threads, 1, 1) and res["required_block"] == [cfg.threads, 1, 1]
        if cfg.ws:
            # the producer: both bulk copies announced on the stage's full barrier, the token rows' cp.async
            # arriving on it; the consumers: the full barrier's wait, then the proxy fence before the WGMMAs,
            # the empty barrier's arrival after them; the epilogue's barrier among the 512 consumers only
            assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 2
            assert "mbarrier.arrive.expect_tx.shared::cta.b64" in ptx
            assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx and "cp.async.wait_group" not in ptx
            wait = ptx.index("mbarrier.try_wait.parity.shared::cta.b64")
            assert "trap;" in ptx  # the waits are bounded
            first_mma = ptx.index("wgmma.mma_async")
            assert ptx.index("fence.proxy.async.shared::cta") < first_mma
            assert "mbarrier.arrive.shared::cta.b64" in ptx[first_mma:]
            assert "bar.sync 1, 512;" in ptx and wait > 0
        else:
            # copies land, then the proxy fence, then the barrier the WGMMAs follow
            wait = ptx.index("cp.async.wait_group")
            assert wait < ptx.index("fence.proxy.async.shared::cta", wait) < ptx.index("bar.sync", wait)
        # fixup: partials stored, fenced, then one acq_rel arrival; the last CTA fences before reading them
        store = ptx.index("st.global.cg.f32")
        fence = ptx.index("fence.acq_rel.gpu", store)
        atom = ptx.index("atom.acq_rel.gpu.global.add.s32", fence)
        assert ptx.count("atom.acq_rel.gpu.global.add.s32") == 1
        assert ptx.index("st.relaxed.gpu.global.b32", atom) > atom  # the last CTA resets the counter
        assert ptx.index("ld.relaxed.gpu.global.f32") > ptx.index("fence.acq_rel.gpu", atom)
        assert "ld.global.nc" not in ptx  # nothing this launch's CTAs write is read through the read-only path
        if cfg.role == "w1":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "ex2.approx.ftz.f32" in ptx
        else:
            assert "cvt.rn.bf16.f32" in ptx
        scale_mov = len(re.findall(r"shl\.b32\s+%r\d+, %r\d+, 23;", ptx))
        if cfg.recipe == "k32" or cfg.role == "w1":
            assert scale_mov > 0  # UE8M0 bytes become exponent fields (weights k32, or W1's x_sf)


def test_fused_variants_hold_both_halves_and_the_hand_over(built):
    """Role4 as one kernel: both GEMMs' WGMMAs, the ticket, W1's release per CTA and W2's bounded acquire; no
    local memory except the one slot bn 64 keeps outside its K loops."""
    fused = {v: e for v, e in built.items() if v.name == "sm90.shared_fused"}
    assert sorted(dict(v.params)["block_n"] for v in fused) == sorted(
        se.BLOCK_N_CHOICES + se.WS_BLOCK_N + se.TWO_CTA_BLOCK_N)
    for variant, entry in fused.items():
        bn = dict(variant.params)["block_n"]
        cfg = se.SharedConfig("w1", bn, dict(variant.params)["recipe"], dict(variant.params)["pipeline"],
                              dict(variant.params).get("ctas_per_sm", 1))
        assert entry.launch.block == (cfg.threads, 1, 1) and entry.launch.dynamic_smem_bytes == cfg.smem_bytes
        ptx = entry.ptx_path.read_text()
        assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k32\.f32\.e4m3\.e4m3 ", ptx)) == 8
        assert "atom.relaxed.gpu.global.add.s32" in ptx  # the ticket
        assert "atom.release.gpu.global.add.s32" in ptx  # a W1 CTA done, after its stores
        assert "ld.acquire.gpu.global.b32" in ptx and "trap;" in ptx  # W2's bounded wait
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.bf16.f32" in ptx
        res = entry.resources
        assert res["registers"] <= 128 and res["frame_bytes"] <= (8 if bn == 64 else 0), (variant.describe(), res)
        assert [size for _, size in res["params"]] == [8 if k in ("u64", "s64") else 4 for _, k in se.FUSED_PARAMS]


def test_fused_ctas_are_both_grids():
    plan = se.plan_launch(1, 6144, 2048, 132)
    a, b, c = se.grid("w1", plan, 6144, 2048)
    d, e, f = se.grid("w2", plan, 6144, 2048)
    assert se.fused_ctas(plan, 6144, 2048) == (a * b * c, d * e * f)


# --------------------------------------------------------------------------------------------- the GPU checks, on CPU
@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)], ids=["k32", "block128"])
def test_gpu_checks_accept_the_twin_and_reject_misplaced_elements(recipe):
    tokens = 6
    weights, x, x_sf = se.random_inputs(512, 384, recipe, tokens, seed=11, device="cpu")
    act, scale, y = se.emulate(weights, x, x_sf, tokens)
    y = y.bfloat16().float()
    _verify(weights, x, x_sf, tokens, act.float(), scale, y)
    swapped = act.float().clone()
    swapped[:, [5, 6]] = swapped[:, [6, 5]]  # two channels of one K128 group exchanged
    with pytest.raises(AssertionError, match="W1 elements off"):
        _verify(weights, x, x_sf, tokens, swapped, scale, y)
    wrong = y.clone()
    wrong[3, 100] = -wrong[3, 100] + 0.5
    with pytest.raises(AssertionError, match="output elements off"):
        _verify(weights, x, x_sf, tokens, act.float(), scale, wrong)


# --------------------------------------------------------------------------------------------- GPU check
def _run(hidden, inter, recipe, tokens, seed, plan=None, capacity=None, topk=2, replays=1, pipeline="auto"):
    """Launch W1 + W2 into combine lane `topk` of a poisoned [topk + 1, C, H] buffer; return everything the
    checks need. Lanes other than `topk` and rows >= tokens must stay untouched."""
    dev = torch.device("cuda")
    capacity = capacity or max(tokens, 1) + 3
    weights, x, x_sf = se.random_inputs(hidden, inter, recipe, capacity, seed=seed)
    kernels = se.load("sm_90a", recipe)
    ws = se.SharedExpertWorkspace.allocate(hidden, inter, capacity, dev)
    if plan is not None:  # forced splits: scratch and counters for them (`plan` may name its pipeline)
        ws.scratch = torch.empty(se.scratch_floats("w1", plan, hidden, inter)
                                 + se.scratch_floats("w2", plan, hidden, inter) + 1, device=dev)
        ws.counters = torch.zeros(se.counter_words("w1", plan, hidden, inter)
                                  + se.counter_words("w2", plan, hidden, inter), dtype=torch.int32, device=dev)
    ws.act.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
    ws.act_scale.fill_(float("nan"))
    combine = torch.full((topk + 1, capacity, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    plan = plan or se.plan_launch(max(tokens, 1), hidden, inter, pipeline=pipeline)
    packed = se.pack_weights(weights) if plan.pipeline == "ws" else None
    nodes = se.launch_args(kernels, weights, x, x_sf, combine[topk], hidden, tokens, ws, plan=plan, packed=packed)
    outs = []
    for _ in range(replays):
        se.launch(torch.cuda.current_stream(), nodes)
        torch.cuda.synchronize()
        outs.append(combine[topk, :tokens].clone())
    return weights, x, x_sf, ws, combine, outs


def _check(hidden, inter, recipe, tokens, seed, **kw):
    weights, x, x_sf, ws, combine, outs = _run(hidden, inter, recipe, tokens, seed, **kw)
    topk = combine.shape[0] - 1
    assert torch.isnan(combine[:topk].float()).all(), "another combine lane was written"
    assert torch.isnan(combine[topk, tokens:].float()).all(), "a row past num_tokens was written"
    y = combine[topk, :tokens].float()
    assert torch.isfinite(y).all(), "an output element was not written"
    for again in outs[1:]:
        assert torch.equal(again, outs[0]), "a replay differs (fixup counters not reset?)"
    return _verify(weights, x, x_sf, tokens, ws.act[:tokens].float(), ws.act_scale[:tokens], y)


def _verify(weights, x, x_sf, tokens, act, scale, y):
    """Every element of the intermediate (E4M3 values act, K128 scales) and of the output y (float32 [T, H])."""
    inter = weights.intermediate
    assert torch.isfinite(act).all() and torch.isfinite(scale).all() and (scale > 0).all()
    # every W1 element: one E4M3 rounding of the float32 SwiGLU at the kernel's own K128 scale, plus what the
    # FP8 WGMMA's accumulation may add (fewer mantissa bits than FP32 inside each K32 instruction: on the H200
    # 1..23 elements per case landed just past the rounding-only bound). That error is bounded by 2^-13 of the
    # sum of |terms| of each pre-activation, carried through SwiGLU's derivatives; beyond it nothing may land,
    # and at most 0.1% of the elements may leave the rounding-only bound.
    _, twin_scale, _ = se.emulate(weights, x, x_sf, tokens)
    w1, w2 = weights.dequantize()
    x32 = dequantize_fp8_ue8m0(x[:tokens], x_sf[:tokens])
    gu = x32 @ w1.T
    h = reference.swiglu(gu, alpha=1.0, clamp=10.0)
    terms = x32.abs() @ w1.abs().T * 2.0**-13
    d_gate, d_up = terms[:, :inter], terms[:, inter:]
    gate, up = gu[:, :inter].clamp(max=10.0), gu[:, inter:].clamp(-10.0, 10.0)
    d_h = 1.1 * up.abs() * d_gate + (gate * torch.sigmoid(gate)).abs() * d_up + d_gate * d_up
    got_h = (act.view(tokens, -1, 128) * scale[..., None]).view(tokens, inter)
    step = scale.repeat_interleave(128, dim=1)  # the E4M3 value 1 at this scale
    rounding = 0.0625 * h.abs() + step * 2.0**-9 + 1e-5 * step * 448
    err = (got_h - h).abs()
    bad = err > rounding + 1.07 * d_h
    assert not bad.any(), f"{int(bad.sum())} W1 elements off, first at {bad.nonzero()[0].tolist()}"
    assert int((err > rounding).sum()) <= 1e-3 * err.numel(), f"{int((err > rounding).sum())} W1 elements past rounding"
    assert torch.allclose(scale, twin_scale, rtol=1e-3, atol=0)
    # every W2 element: float32 W2 on the kernel's own intermediate, one BF16 rounding (+ the same accumulation
    # allowance; at most 0.1% of the elements past the rounding-only bound)
    twin_y = got_h @ w2.T
    rounding = 2.0**-8 * twin_y.abs() + 1e-4 * twin_y.abs().max()
    err = (y - twin_y).abs()
    bad = err > rounding + 1.004 * (got_h.abs() @ w2.abs().T) * 2.0**-13
    assert not bad.any(), f"{int(bad.sum())} output elements off, first at {bad.nonzero()[0].tolist()}"
    assert int((err > rounding).sum()) <= 1e-3 * err.numel(), f"{int((err > rounding).sum())} outputs past rounding"
    # the whole shared path against the float32 reference
    ref = reference._shared_partial(dequantize_fp8_ue8m0(x[:tokens], x_sf[:tokens]), weights, alpha=1.0,
                                    clamp=10.0, requantize=False)
    cos, diff = _cos_diff(y, ref)
    assert cos >= 0.99 and diff <= 0.002, (cos, diff)
    return cos, diff


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 8, 16, 37, 64, 100, 256])
@pytest.mark.parametrize("model", sorted(se.MODELS))
def test_shared_expert_matches_float32_reference_at_model_shapes(model, tokens):
    hidden, inter, recipe = se.MODELS[model]
    _check(hidden, inter, recipe, tokens, seed=tokens)  # the default plan: warp-specialized, 32-token tiles


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 37, 256])
@pytest.mark.parametrize("model", sorted(se.MODELS))
def test_cp_async_pipeline_matches_float32_reference(model, tokens):
    hidden, inter, recipe = se.MODELS[model]
    _check(hidden, inter, recipe, tokens, seed=tokens + 1, pipeline="cp.async")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16, 32])
@pytest.mark.parametrize("model", sorted(se.MODELS))
def test_both_pipelines_write_the_same_bytes(model, tokens):
    """The warp-specialized pipeline (packed weights, bulk copies) against the cp.async one: the same K order per
    warpgroup and the same fixup, so the intermediate and the output are bit-equal."""
    hidden, inter, recipe = se.MODELS[model]
    runs = {p: _run(hidden, inter, recipe, tokens, seed=70 + tokens, pipeline=p) for p in ("ws", "cp.async")}
    (_, _, _, ws_a, _, out_a), (_, _, _, ws_b, _, out_b) = runs["ws"], runs["cp.async"]
    assert torch.equal(ws_a.act[:tokens].view(torch.uint8), ws_b.act[:tokens].view(torch.uint8))
    assert torch.equal(out_a[0].view(torch.int16), out_b[0].view(torch.int16))
    if tokens <= 8:  # two CTAs per SM: other K splits, so the same values up to FP32 rounding of the fixup's sum
        plan = se.plan_launch(tokens, hidden, inter, pipeline="ws", ctas_per_sm=2)
        _check(hidden, inter, recipe, tokens, seed=70 + tokens, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 128, 128)], ids=["k32", "block128"])
@pytest.mark.parametrize("block_n,splits,pipeline", [
    (8, (3, 2), "cp.async"), (16, (5, 4), "cp.async"), (32, (2, 3), "cp.async"), (64, (1, 2), "cp.async"),
    (8, (3, 2), "ws"), (16, (5, 4), "ws"), (32, (2, 3), "ws")])
def test_forced_k_splits_fix_up_across_ctas_and_replay_bit_equal(recipe, block_n, splits, pipeline):
    # K = 640 (5 K128 blocks) over 3 splits leaves one split without a whole step, and the last step holds one
    # K128 block (the producer's partial stage); 3 replays reuse the counters
    tokens = block_n + 3
    plan = se.LaunchPlan(block_n, 2, *splits, pipeline)
    _check(640, 384, recipe, tokens, seed=block_n, plan=plan, capacity=2 * block_n, replays=3)


@pytest.mark.gpu
def test_zero_tokens_write_nothing():
    *_, combine, _ = _run(512, 256, (1, 1, 32), 0, seed=1, capacity=8)
    assert torch.isnan(combine.float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["ws", "ws2", "cp.async"])
@pytest.mark.parametrize("tokens", [1, 8, 40, 256])
@pytest.mark.parametrize("model", sorted(se.MODELS))
def test_fused_kernel_writes_what_the_two_launches_write(model, tokens, pipeline):
    """Role4 as one kernel (W2's CTAs gated on every W1 CTA; on the warp-specialized pipeline W2's producer
    streams its first stages' weights before the gate) against W1 then W2: the same bytes, and three launches in
    a row (the gate's words reset by the last W2 CTA) equal."""
    hidden, inter, recipe = se.MODELS[model]
    dev = torch.device("cuda")
    weights, x, x_sf = se.random_inputs(hidden, inter, recipe, tokens, seed=90 + tokens)
    kernels = se.load("sm_90a", recipe)
    ws = se.SharedExpertWorkspace.allocate(hidden, inter, tokens, dev)
    if pipeline == "ws2" and tokens > 8:
        pytest.skip("two CTAs per SM at token tile 8 only")
    plan = se.plan_launch(tokens, hidden, inter, pipeline=pipeline[:2] if pipeline == "ws2" else pipeline,
                          ctas_per_sm=2 if pipeline == "ws2" else 1)
    packed = se.pack_weights(weights) if plan.pipeline == "ws" else None
    two = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    se.launch(torch.cuda.current_stream(), se.launch_args(kernels, weights, x, x_sf, two, hidden, tokens, ws,
                                                           plan=plan, packed=packed))
    fused_nodes = se.fused_launch_args(kernels, weights, x, x_sf, (one := torch.empty_like(two)), hidden, tokens, ws,
                                       plan=plan, packed=packed, timeout_s=20.0)
    for _ in range(3):
        one.fill_(float("nan"))
        se.launch(torch.cuda.current_stream(), fused_nodes)
        torch.cuda.synchronize()
        assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    assert int(ws.sync.abs().sum()) == 0  # ticket and gate words back to zero
