"""Checks of the SM90 layer through the public API on a GPU: what its GPU tests and `scripts/device_layer_backend.py`
share (fresh random inputs, poisoned outputs, the float32 reference, graph replays against the eager call).

The per-rank slices the H200 profile runs (sweeps/h200.toml: E/8 experts at P = 1, capacity 256) are `SLICES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA, CLAMP = 1.0, 10.0


@dataclass(frozen=True)
class Slice:
    name: str
    num_experts: int  # local experts (E/8 of the model)
    topk: int
    hidden: int
    intermediate: int
    capacity: int = 256
    shared_recipe: tuple = (1, 1, 32)  # the shared expert's FP8 recipe (models.csv shared_k_group)


SLICES = {
    "glm-5.2": Slice("glm-5.2", 32, 8, 6144, 2048, shared_recipe=(1, 128, 128)),
    "deepseek-v4.1-flash": Slice("deepseek-v4.1-flash", 48, 6, 5120, 2304, shared_recipe=(1, 1, 32)),
}


def random_weights(s: Slice, device, seed: int):
    """Fresh random MXFP4 expert weights (canonical tuples), drawn on the device: N(0, 1/fan_in) as gc_moe.cases."""
    import torch

    from gc_moe.formats import quantize_moe_weights

    g = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(s.num_experts, 2 * s.intermediate, s.hidden, device=device, generator=g) / math.sqrt(s.hidden)
    w2 = torch.randn(s.num_experts, s.hidden, s.intermediate, device=device, generator=g) / math.sqrt(s.intermediate)
    l1, l2 = quantize_moe_weights(w1, w2)
    del w1, w2
    return l1, l2


def random_shared_weights(s: Slice, device, seed: int):
    """Fresh FP8 shared-expert weights in the slice's recipe, N(0, 1/fan_in)."""
    import torch

    from gc_moe.formats import quantize_shared_expert_weights

    g = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(2 * s.intermediate, s.hidden, device=device, generator=g) / math.sqrt(s.hidden)
    w2 = torch.randn(s.hidden, s.intermediate, device=device, generator=g) / math.sqrt(s.intermediate)
    return quantize_shared_expert_weights(w1, w2, s.shared_recipe)


def random_inputs(s: Slice, num_tokens: int, device, seed: int):
    """Fresh activations (x E4M3, x_sf packed UE8M0) and uniform top-k routing for one call."""
    import torch

    from gc_moe.cases import make_routing
    from gc_moe.formats import quantize_fp8_ue8m0

    g = torch.Generator(device=device).manual_seed(seed)
    x, x_sf = quantize_fp8_ue8m0(torch.randn(num_tokens, s.hidden, device=device, generator=g))
    idx, wts = make_routing("uniform", num_tokens, s.num_experts, s.topk, seed=seed)
    return x, x_sf, idx.to(device), wts.to(device)


class ApiLayer:
    """One slice's buffer and weights through the public API (`gc_moe.api`), on the backend it picks."""

    def __init__(self, s: Slice, device, seed: int = 7, backend: str | None = None, shared: bool = False,
                 weights=None):
        from gc_moe import api

        self.slice, self.device = s, device
        self.l1, self.l2 = weights if weights is not None else random_weights(s, device, seed)
        self.shared_weights = random_shared_weights(s, device, seed + 1) if shared else None
        self.buffer = api.get_symm_buffer_for_gc_moe(None, s.num_experts, s.capacity, s.topk, s.hidden,
                                                     s.intermediate, num_shared_experts=int(shared), device=device,
                                                     backend=backend)
        self.w1, self.w2 = api.transform_weights_for_gc_moe(self.l1, self.l2)

    def stage(self, x, x_sf, idx, wts) -> None:
        t, b = x.shape[0], self.buffer
        b.x[:t].copy_(x)
        b.x_sf[:t].copy_(x_sf)
        b.topk_idx[:t].copy_(idx)
        b.topk_weights[:t].copy_(wts)

    def call(self, y, num_tokens: int) -> None:
        from gc_moe import api

        api.fp8_fp4_gc_moe(y, self.w1, self.w2, self.buffer, activation_alpha=ALPHA, activation_clamp=CLAMP,
                           num_tokens=num_tokens, shared_weights=self.shared_weights)

    def control(self) -> dict:
        layer = self.buffer.extras.get("sm90_layer")
        return layer.control() if layer is not None else {}


def check_point(layer: ApiLayer, num_tokens: int, seed: int) -> dict:
    """One eager call on fresh inputs into a NaN-poisoned y: non-finite elements, cosine and processed difference
    against the float32 reference (gc_moe.reference.moe_reference on the same quantized inputs). Leaves the
    inputs staged and returns y too."""
    import torch

    from gc_moe import metrics
    from gc_moe.reference import moe_reference

    x, x_sf, idx, wts = random_inputs(layer.slice, num_tokens, layer.device, seed)
    layer.stage(x, x_sf, idx, wts)
    y = torch.full((num_tokens, layer.slice.hidden), float("nan"), dtype=torch.bfloat16, device=layer.device)
    layer.call(y, num_tokens)
    torch.cuda.synchronize(layer.device)
    ref = moe_reference(x, x_sf, idx, wts, layer.l1, layer.l2, activation_alpha=ALPHA, activation_clamp=CLAMP,
                        shared_weights=layer.shared_weights)
    yf, rf = y.float().cpu(), ref.float().cpu()
    return {"tokens": num_tokens, "rows": int((idx >= 0).sum()), "nonfinite": int((~torch.isfinite(yf)).sum()),
            "cosine": metrics.cosine(yf, rf), "processed_diff": metrics.processed_diff(yf, rf), "y": y}


def check_separate_shared(layer: ApiLayer, num_tokens: int, seed: int) -> dict:
    """The unfused path's shared expert (`backend.separate_shared_expert`) alone on fresh inputs into poisoned
    rows, against the float32 reference with every routed slot empty (the shared expert only)."""
    import torch

    from gc_moe import metrics
    from gc_moe.kernels.sm90 import backend as sm90_backend
    from gc_moe.reference import moe_reference

    x, x_sf, idx, wts = random_inputs(layer.slice, num_tokens, layer.device, seed)
    layer.stage(x, x_sf, idx, wts)
    shared = random_shared_weights(layer.slice, layer.device, seed + 1)
    out = torch.full((num_tokens, layer.slice.hidden), float("nan"), dtype=torch.bfloat16, device=layer.device)
    sm90_backend.separate_shared_expert(layer.buffer)(out, shared, num_tokens)
    torch.cuda.synchronize(layer.device)
    none = torch.full_like(idx, -1)
    ref = moe_reference(x, x_sf, none, torch.zeros_like(wts), layer.l1, layer.l2, activation_alpha=ALPHA,
                        activation_clamp=CLAMP, shared_weights=shared)
    of, rf = out.float().cpu(), ref.float().cpu()
    return {"tokens": num_tokens, "nonfinite": int((~torch.isfinite(of)).sum()), "cosine": metrics.cosine(of, rf),
            "processed_diff": metrics.processed_diff(of, rf)}


def capture(layer: ApiLayer, y, num_tokens: int, calls: int = 1):
    """A torch CUDA graph of `calls` API calls (what the harness captures when the invocation is capturable)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(layer.device)
    side.wait_stream(torch.cuda.current_stream(layer.device))
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            layer.call(y, num_tokens)
    torch.cuda.synchronize(layer.device)
    return graph


def replay_check(layer: ApiLayer, y_eager, num_tokens: int, replays: int, sync_every: int = 10_000) -> dict:
    """Replay a captured call `replays` times into a poisoned y; count on the device the replays whose y is not
    bit-equal to the eager y; then one more eager call, which must agree too (the state survives replays).
    Returns mismatches, microseconds per replay (comparison included) and the control words' increments
    (`replays_added` = replays + 1 when every call was finalized once)."""
    import time

    import torch

    y = torch.full_like(y_eager, float("nan"))
    layer.call(y, num_tokens)  # warm up outside the capture, as the harness does
    graph = capture(layer, y, num_tokens)
    y.fill_(float("nan"))
    before = layer.control()
    mismatched = torch.zeros((), dtype=torch.int64, device=layer.device)
    want = y_eager.view(torch.int16)
    started = time.perf_counter()
    for i in range(replays):
        graph.replay()
        mismatched += (y.view(torch.int16) != want).any()
        if (i + 1) % sync_every == 0:
            torch.cuda.synchronize(layer.device)
    torch.cuda.synchronize(layer.device)
    seconds = time.perf_counter() - started
    y.fill_(float("nan"))
    layer.call(y, num_tokens)
    after_eager = int((y.view(torch.int16) != want).any())
    after = layer.control()
    return {"replays": replays, "mismatched_replays": int(mismatched), "eager_after_mismatch": after_eager,
            "us_per_replay_with_check": 1e6 * seconds / max(replays, 1),
            **{f"{k}_added": after[k] - before[k] for k in ("replays", "arrival_errors", "ring_overflows")
               if k in after}}


def time_calls(layer: ApiLayer, num_tokens: int, seed: int, replays: int = 200, calls: int = 10) -> float:
    """Microseconds per layer call: a graph of `calls` back-to-back API calls on fresh inputs, replayed (weights
    stream from HBM each call: both slices' weights are far larger than the 60 MB L2)."""
    import torch

    x, x_sf, idx, wts = random_inputs(layer.slice, num_tokens, layer.device, seed)
    layer.stage(x, x_sf, idx, wts)
    y = torch.empty(max(num_tokens, 1), layer.slice.hidden, dtype=torch.bfloat16, device=layer.device)
    layer.call(y[:num_tokens], num_tokens)  # warm up outside the capture
    graph = capture(layer, y[:num_tokens], num_tokens, calls)
    graph.replay()
    torch.cuda.synchronize(layer.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(layer.device)
    return 1e3 * start.elapsed_time(end) / (replays * calls)


BOUNDED_WAIT_EXIT = 3  # bounded_wait_probe's exit status when the wait trapped as it must


def bounded_wait_probe(timeout_s: float = 1.0) -> None:
    """Run in a child process (a trap ends its CUDA context): the ring-consumer W1 alone, with no dispatch to
    release RING_READY, must trap after `timeout_s`. Exits BOUNDED_WAIT_EXIT with the elapsed seconds when the
    synchronize reports the trap, 0 when the kernel returned (the bound did not work)."""
    import sys
    import time

    import torch

    from gc_moe.kernels.sm90 import grouped_gemm as gg
    from gc_moe.kernels.sm90 import layer as sm90_layer
    from gc_moe.weights import sm90 as weights_sm90

    toy = Slice("toy", 16, 4, 1024, 256, capacity=8)
    shape = sm90_layer.layer_shape(1, toy.num_experts, toy.topk, toy.hidden, toy.intermediate, toy.capacity)
    layer = sm90_layer.Sm90Layer(shape, timeout_s=timeout_s)
    mats = weights_sm90.transform(*random_weights(toy, layer.device, seed=3))
    ws = layer.ws
    k_w1, _ = layer.gemm_kernels(8)
    torch.cuda.synchronize()
    started = time.perf_counter()
    gg.launch_w1(k_w1, mats.l1, ws.ring_act, ws.ring_scale, ws.expert_offsets, ws.routing_weight, ws.l2_act,
                 ws.l2_scale, toy.capacity, torch.cuda.current_stream(),
                 ring_args=gg.ring_args_w1(ws, shape, timeout_s))
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(f"bounded wait trapped after {time.perf_counter() - started:.2f} s: {exc}", flush=True)
        sys.exit(BOUNDED_WAIT_EXIT)
    print(f"W1 returned after {time.perf_counter() - started:.2f} s without RING_READY", flush=True)
    sys.exit(0)
