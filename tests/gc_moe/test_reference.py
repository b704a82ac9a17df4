"""The reference layer against a naive per-token loop with its own decoders, and its expert-parallel form on gloo."""

import math
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gc_moe import formats as f
from gc_moe.reference import moe_reference, moe_reference_ep, swiglu

H, I, E = 256, 128, 8


# ----------------------------------------------------------------------------------------------- independent decoders
def scale_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> exponent bytes [..., 4W] by shifts (not the formats module's byte view)."""
    parts = [(words.long() >> (8 * g)) & 0xFF for g in range(4)]
    return torch.stack(parts, dim=-1).flatten(-2)


def decode_fp4(packed: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """E2M1 from its bit fields: sign, 2-bit exponent (bias 1), 1-bit mantissa; float64."""
    b = packed.long() & 0xFF
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    exp, man = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(exp == 0, 0.5 * man, torch.pow(2.0, (exp - 1).double()) * (1 + 0.5 * man))
    value = torch.where(codes >= 8, -mag, mag)
    return value * torch.pow(2.0, (scale_bytes(words) - 127).double()).repeat_interleave(32, dim=-1)


def decode_fp8_rows(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    return x.double() * torch.pow(2.0, (scale_bytes(words) - 127).double()).repeat_interleave(32, dim=-1)


def naive_moe(x, x_sf, topk_idx, topk_weights, l1, l2, *, alpha, clamp, shared=None, expert_offset=0):
    """One token and one expert at a time, in float64."""
    xs = decode_fp8_rows(x, x_sf)
    t_count, k = topk_idx.shape
    y = torch.zeros(t_count, xs.shape[1], dtype=torch.float64)

    def ffn(xt, w1, w2):
        h = w1 @ xt
        gate, up = h[: h.numel() // 2], h[h.numel() // 2 :]
        if clamp is not None:
            gate, up = torch.clamp(gate, max=clamp), torch.clamp(up, -clamp, clamp)
        return w2 @ (gate / (1 + torch.exp(-alpha * gate)) * up)

    for t in range(t_count):
        for j in range(k):
            e = int(topk_idx[t, j]) - expert_offset
            if int(topk_idx[t, j]) < 0 or not 0 <= e < l1[0].shape[0]:
                continue
            w1, w2 = decode_fp4(l1[0][e], l1[1][e]), decode_fp4(l2[0][e], l2[1][e])
            y[t] += float(topk_weights[t, j]) * ffn(xs[t], w1, w2)
        if shared is not None:
            y[t] += ffn(
                xs[t], decode_fp8_rows(shared.w1, shared.w1_sf), decode_fp8_rows(shared.w2, shared.w2_sf)
            )
    return y


# ----------------------------------------------------------------------------------------------- inputs
def make_inputs(t, k, *, seed, num_experts=E, drop=0.25, hidden=H, inter=I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g) * 2
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / 4  # |gate|, |up| often beyond the clamp
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    topk_idx = torch.argsort(torch.rand(t, num_experts, generator=g), dim=1)[:, :k]  # k distinct experts
    topk_idx[torch.rand(t, k, generator=g) < drop] = -1
    topk_weights = torch.rand(t, k, generator=g)
    xq, x_sf = f.quantize_fp8_ue8m0(x)
    l1, l2 = f.quantize_moe_weights(w1, w2)
    shared = f.quantize_shared_expert_weights(
        torch.randn(2 * inter, hidden, generator=g) / 4,
        torch.randn(hidden, inter, generator=g) / math.sqrt(inter),
    )
    return xq, x_sf, topk_idx.long(), topk_weights, l1, l2, shared


def assert_bf16_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every element within a BF16 rounding of the float64 value (plus float32 accumulation slack)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0**-8 + 1e-4 * (want.abs().max() + 1)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


# ----------------------------------------------------------------------------------------------- swiglu
def test_swiglu_hand_values():
    got = swiglu(torch.tensor([[12.0, 1.0, -15.0, 3.0]]), alpha=1.0, clamp=10.0)
    # gate 12 clamped to 10, up -15 to -10; gate 1 below the clamp, up 3 inside it
    assert torch.allclose(got, torch.tensor([[10 / (1 + math.exp(-10)) * -10, 1 / (1 + math.exp(-1)) * 3]]))
    got = swiglu(torch.tensor([[-20.0, 1.0, 12.0, 3.0]]), alpha=2.0, clamp=10.0)
    # the gate is clamped only from above: -20 stays; alpha multiplies the sigmoid's argument
    expect = [-20 / (1 + math.exp(40)) * 10, 1 / (1 + math.exp(-2)) * 3]
    assert torch.allclose(got, torch.tensor([expect]))
    assert torch.allclose(
        swiglu(torch.tensor([[12.0, 15.0]]), clamp=None), torch.tensor([[12 / (1 + math.exp(-12)) * 15]])
    )


# ----------------------------------------------------------------------------------------------- against the loop
@pytest.mark.parametrize(
    "t, k, alpha, clamp, with_shared, seed",
    [
        (9, 4, 1.0, 10.0, False, 10),
        (7, 1, 1.0, 10.0, True, 11),
        (6, 3, 1.7, 6.0, True, 12),
        (5, 2, 1.0, None, False, 13),
    ],
)
def test_reference_matches_naive_loop(t, k, alpha, clamp, with_shared, seed):
    x, x_sf, idx, w, l1, l2, shared = make_inputs(t, k, seed=seed)
    idx[0] = -1  # a token with no expert at all
    shared = shared if with_shared else None
    got = moe_reference(
        x, x_sf, idx, w, l1, l2, activation_alpha=alpha, activation_clamp=clamp, shared_weights=shared
    )
    want = naive_moe(x, x_sf, idx, w, l1, l2, alpha=alpha, clamp=clamp, shared=shared)
    assert_bf16_matches(got, want)
    if shared is None:
        assert not bool(got[0].any())  # no expert, no shared expert: exactly zero
    assert float(want.abs().max()) > 1.0  # the case produces real output, not a trivially small one


def test_expert_offset_keeps_only_local_experts():
    x, x_sf, idx, w, l1, l2, _ = make_inputs(8, 4, seed=20)
    local = (l1[0][4:], l1[1][4:]), (l2[0][4:], l2[1][4:])
    got = moe_reference(x, x_sf, idx, w, *local, expert_offset=4)
    want = naive_moe(x, x_sf, idx, w, *local, alpha=1.0, clamp=10.0, expert_offset=4)
    assert_bf16_matches(got, want)
    assert bool(
        ((idx >= 4).any(1) == got.ne(0).any(1)).all()
    )  # output exactly where a local expert is chosen


def test_empty_inputs():
    x, x_sf, idx, w, l1, l2, shared = make_inputs(0, 3, seed=21)
    assert moe_reference(x, x_sf, idx, w, l1, l2, shared_weights=shared).shape == (0, H)
    x, x_sf, idx, w, l1, l2, shared = make_inputs(4, 2, seed=22)
    idx.fill_(-1)
    got = moe_reference(x, x_sf, idx, w, l1, l2)
    assert got.shape == (4, H) and not bool(got.any())


def test_requantized_intermediate_follows_the_fp32_layer():
    x, x_sf, idx, w, l1, l2, shared = make_inputs(16, 4, seed=23)
    exact = moe_reference(x, x_sf, idx, w, l1, l2, shared_weights=shared).double()
    kernel_like = moe_reference(
        x, x_sf, idx, w, l1, l2, shared_weights=shared, requantize_intermediate=True
    ).double()
    diff = 1 - 2 * (exact * kernel_like).sum() / ((exact**2).sum() + (kernel_like**2).sum())
    assert 0 < float(diff) < 2e-3  # FP8 requantization moves the output, within the paper's threshold
    assert not torch.equal(exact, kernel_like)


def test_input_errors():
    x, x_sf, idx, w, l1, l2, _ = make_inputs(3, 2, seed=24)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        moe_reference(x.float(), x_sf, idx, w, l1, l2)
    with pytest.raises(ValueError, match="x_sf"):
        moe_reference(x, x_sf[:, :1], idx, w, l1, l2)
    with pytest.raises(ValueError, match="-1"):
        moe_reference(x, x_sf, idx - 5, w, l1, l2)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_reference(x, x_sf, idx, w.double(), l1, l2)
    with pytest.raises(ValueError, match="l2 weights"):
        moe_reference(x, x_sf, idx, w, l1, (l2[0][:, :, :32], l2[1]))


def test_speed_at_sweep_shape():
    """T=256, H=1024, I=512, E=16, k=8 (the CPU sweep times this call) in under a second of one core's time.

    CPU time of a single thread, not wall time, so that other work on a shared machine cannot fail the test.
    """
    g = torch.Generator().manual_seed(25)
    t, h, inter, e, k = 256, 1024, 512, 16, 8
    x, x_sf = f.quantize_fp8_ue8m0(torch.randn(t, h, generator=g))
    idx = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k]
    w = torch.rand(t, k, generator=g)

    def random_fp4(rows, cols):  # random codes and scales: quantizing float weights would dominate the test
        codes = torch.randint(-128, 128, (e, rows, cols // 2), dtype=torch.int8, generator=g)
        exponents = torch.randint(118, 124, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
        return codes, f.pack_ue8m0(exponents)

    l1, l2 = random_fp4(2 * inter, h), random_fp4(h, inter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moe_reference(x[:8], x_sf[:8], idx[:8], w[:8], l1, l2)  # warm up
        start = time.process_time()
        moe_reference(x, x_sf, idx, w, l1, l2)
        seconds = time.process_time() - start
    finally:
        torch.set_num_threads(threads)
    assert seconds < 1.0


# ----------------------------------------------------------------------------------------------- expert parallel (gloo)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCENARIOS = {  # name -> (seed, tokens per rank, k, options)
    "uneven": (30, (5, 3), 3, {}),
    "empty_rank_with_shared": (31, (4, 0), 2, {"shared": True}),
    "k1_requantized": (32, (3, 4), 1, {"requantize_intermediate": True, "activation_alpha": 1.5}),
}


def scenario(name: str):
    seed, counts, k, opts = SCENARIOS[name]
    x, x_sf, idx, w, l1, l2, shared = make_inputs(sum(counts), k, seed=seed)
    kwargs = {key: val for key, val in opts.items() if key != "shared"}
    kwargs["shared_weights"] = shared if opts.get("shared") else None
    return counts, (x, x_sf, idx, w), (l1, l2), kwargs


def ep_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in SCENARIOS:
            counts, acts, (l1, l2), kwargs = scenario(name)
            rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
            experts = slice(rank * E // world, (rank + 1) * E // world)
            local = (l1[0][experts], l1[1][experts]), (l2[0][experts], l2[1][experts])
            y = moe_reference_ep(None, *(a[rows] for a in acts), *local, num_experts=E, **kwargs)
            torch.save(y, f"{out_dir}/{name}.{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_ranks_match_single_process(tmp_path):
    mp.spawn(ep_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran single-threaded: same BLAS path, so the same bits
    try:
        for name in SCENARIOS:
            counts, acts, weights, kwargs = scenario(name)
            want = moe_reference(*acts, *weights, **kwargs)
            got = torch.cat([torch.load(tmp_path / f"{name}.{rank}.pt") for rank in range(2)])
            assert got.shape == want.shape == (sum(counts), H), name
            assert float(want.float().abs().max()) > 1.0, name
            # same assignments, same per-expert row order, same slot-order combine: bit-identical output
            assert torch.equal(got, want), (
                f"{name}: max diff {float((got.float() - want.float()).abs().max())}"
            )
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------- CUDA
def to_cuda(obj, device="cuda"):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_cuda(o, device) for o in obj)
    if isinstance(obj, f.SharedExpertWeights):
        return f.SharedExpertWeights(
            *(to_cuda(t, device) for t in (obj.w1, obj.w1_sf, obj.w2, obj.w2_sf)), obj.recipe
        )
    return obj


@pytest.mark.gpu
def test_reference_on_cuda_matches_naive_loop():
    x, x_sf, idx, w, l1, l2, shared = make_inputs(9, 4, seed=40)
    got = moe_reference(*to_cuda((x, x_sf, idx, w, l1, l2)), shared_weights=to_cuda(shared))
    assert got.is_cuda
    assert_bf16_matches(got.cpu(), naive_moe(x, x_sf, idx, w, l1, l2, alpha=1.0, clamp=10.0, shared=shared))


def nccl_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        counts, acts, (l1, l2), kwargs = scenario("empty_rank_with_shared")
        counts = (sum(counts) - 1, 1)[:world] if world > 1 else (sum(counts),)
        rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
        experts = slice(rank * E // world, (rank + 1) * E // world)
        local = (l1[0][experts], l1[1][experts]), (l2[0][experts], l2[1][experts])
        device = f"cuda:{rank}"
        y = moe_reference_ep(
            None,
            *(to_cuda(a[rows], device) for a in acts),
            *to_cuda(local, device),
            num_experts=E,
            shared_weights=to_cuda(kwargs["shared_weights"], device),
        )
        torch.save(y.cpu(), f"{out_dir}/nccl.{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_expert_parallel_nccl_matches_cpu_reference(tmp_path):
    world = min(2, torch.cuda.device_count())
    mp.spawn(nccl_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    _, acts, weights, kwargs = scenario("empty_rank_with_shared")
    got = torch.cat([torch.load(tmp_path / f"nccl.{rank}.pt") for rank in range(world)])
    want = naive_moe(*acts, *weights, alpha=1.0, clamp=10.0, shared=kwargs["shared_weights"])
    assert_bf16_matches(got, want)


def test_reference_ignores_a_callers_tf32_setting():
    x, x_sf, idx, w, l1, l2, _ = make_inputs(4, 2, seed=41)
    want = moe_reference(x, x_sf, idx, w, l1, l2)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert torch.equal(moe_reference(x, x_sf, idx, w, l1, l2), want)
        assert torch.get_float32_matmul_precision() == "medium"  # the caller's setting is restored
    finally:
        torch.set_float32_matmul_precision(previous)
