"""On-GPU check and timing of the SM90 Mega MoE port at the H200 profile's per-rank slices (E/8 local experts, P = 1).

    python -m baselines.mega_moe.port_sm90.device_check --tokens 1,8,64,256 --time 1,2,4,8,16,32,64,128,256
    python -m baselines.mega_moe.port_sm90.device_check --tokens 1,8,64,256 --shared   # the shared suite's call

Per point: fresh random MXFP4 weights and FP8 activations, top-k routing uniform over the local experts; the port
runs on a NaN-poisoned y; every element must be finite; cosine and processed difference against the float32
reference (gc_moe.reference.moe_reference on the dequantized weights); a CUDA-graph replay must equal the eager
call bit for bit. With --time T,..: the bandwidth floor (active experts' FP4 codes + scale bytes, read once, over
the read bandwidth of a large `amax` measured in the same run) against the cold time (a 1 GiB write before
each graph replay of the call flushes L2; CUDA events around the replay alone), median of --repeats.
With --shared the checked call is the shared suite's: the port plus its separate shared expert (FP8 weights in
the model's recipe, GLM-5.2 (1, 128, 128), DeepSeek (1, 1, 32)), against the reference with the shared expert;
the point records the call's note (which shared expert ran).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

# (hidden, intermediate, local experts = E/8, top-k): gcmoe_bench/data/models.csv with sweeps/h200.toml's slice
MODELS = {
    "glm-5.2": (6144, 2048, 32, 8),
    "deepseek-v4.1-flash": (5120, 2304, 48, 6),
}
SHARED_RECIPES = {"glm-5.2": (1, 128, 128), "deepseek-v4.1-flash": (1, 1, 32)}  # models.csv shared_k_group
CAPACITY = 256
COSINE_MIN = 0.97
PROCESSED_DIFF_MAX = 0.002


@dataclass
class Point:
    model: str
    tokens: int
    rows: int
    active: int
    block_n: int
    cosine: float = float("nan")
    processed_diff: float = float("nan")
    finite: bool = False
    replay_equal: bool = False
    megabytes: float = float("nan")
    floor_us: float = float("nan")
    cold_us: float = float("nan")
    stages: int = 0  # the cp.async pipeline's knob; 0 where the ws pipeline ran (its ring is not one)
    pipeline: str = ""
    shared: bool = False
    note: str = ""

    @property
    def ok(self) -> bool:
        return (self.finite and self.replay_equal and self.cosine >= COSINE_MIN
                and self.processed_diff <= PROCESSED_DIFF_MAX)


def random_weights(model: str, seed: int, device):
    """DeepGEMM-layout MXFP4 (l1, l2) of the model's local experts: random codes, UE8M0 exponents 117..124."""
    from gc_moe.formats import pack_ue8m0

    hidden, inter, experts, _ = MODELS[model]
    gen = torch.Generator(device=device).manual_seed(seed)

    def mxfp4(rows, cols):
        packed = torch.randint(-128, 128, (experts, rows, cols // 2), dtype=torch.int8, generator=gen, device=device)
        exps = torch.randint(117, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen, device=device)
        return packed, pack_ue8m0(exps)

    return mxfp4(2 * inter, hidden), mxfp4(hidden, inter)


def random_inputs(model: str, tokens: int, seed: int, device, empty_slots: bool = False):
    """x (E4M3 + UE8M0 K32), top-k over distinct local experts, positive routing weights summing to 1;
    empty_slots: every other token's last slot routes nowhere (-1)."""
    from gc_moe.formats import quantize_fp8_ue8m0

    hidden, _, experts, topk = MODELS[model]
    gen = torch.Generator(device=device).manual_seed(seed)
    x, x_sf = quantize_fp8_ue8m0(torch.randn(tokens, hidden, generator=gen, device=device))
    idx = torch.rand(tokens, experts, generator=gen, device=device).topk(topk, dim=1).indices.to(torch.int64)
    w = torch.rand(tokens, topk, generator=gen, device=device) + 0.05
    if empty_slots:
        idx[::2, -1] = -1
    return x, x_sf, idx, (w / w.sum(dim=1, keepdim=True)).float()


def random_shared_weights(model: str, seed: int, device):
    """FP8 shared-expert weights of the model's shape (Is = I) in its recipe, N(0, 1/fan_in)."""
    import math

    from gc_moe.formats import quantize_shared_expert_weights

    hidden, inter, _, _ = MODELS[model]
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(2 * inter, hidden, generator=gen, device=device) / math.sqrt(hidden)
    w2 = torch.randn(hidden, inter, generator=gen, device=device) / math.sqrt(inter)
    return quantize_shared_expert_weights(w1, w2, SHARED_RECIPES[model])


def _active(idx) -> int:
    return int(torch.unique(idx[idx >= 0]).numel())


def _pipeline(model: str, tokens: int) -> str:
    """The pipeline `prepare` runs for this point (GCMOE_MEGA_PORT_PIPELINE, else auto's choice)."""
    from baselines.mega_moe.port_sm90 import host

    _, _, experts, topk = MODELS[model]
    return host.resolve_pipeline(host.pipeline_from_env(), tokens, topk, experts)


def _block_n(model: str, tokens: int) -> int:
    from baselines.mega_moe.port_sm90 import host

    _, _, experts, topk = MODELS[model]
    if _pipeline(model, tokens) == "ws":  # as prepare picks it
        return host.choose_block_n_ws(tokens, topk, experts)
    return host.choose_block_n(tokens, topk, experts)


def _inputs(model, l1, l2, x, x_sf, idx, w, shared_weights=None):
    from baselines.mega_moe.deepgemm import MegaMoeInputs

    _, _, experts, _ = MODELS[model]
    return MegaMoeInputs(x=x, x_sf=x_sf, topk_idx=idx, topk_weights=w, l1_weights=l1, l2_weights=l2,
                         num_experts=experts, num_max_tokens_per_rank=CAPACITY, shared_weights=shared_weights)


def check_point(model: str, tokens: int, seed: int, weights=None, block_n: int | None = None,
                empty_slots: bool = False, shared: bool = False) -> Point:
    """Run the port once eagerly on a poisoned y and once from a CUDA graph; compare with the float32 reference.
    shared: with a shared expert (the call adds its separate shared expert; the reference includes it)."""
    from gc_moe import metrics, reference

    import baselines.mega_moe.port_sm90 as port

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the primary context must be current for the driver-level loads
    l1, l2 = weights if weights is not None else random_weights(model, seed, dev)
    x, x_sf, idx, w = random_inputs(model, tokens, seed + 1, dev, empty_slots)
    shared_weights = random_shared_weights(model, seed + 2, dev) if shared else None
    call = port.prepare(_inputs(model, l1, l2, x, x_sf, idx, w, shared_weights), None, block_n=block_n)
    call.output.fill_(float("nan"))
    call.run()
    torch.cuda.synchronize()
    y = call.output.clone()
    ref = reference.moe_reference(x, x_sf, idx, w, l1, l2, shared_weights=shared_weights)
    point = Point(model, tokens, int((idx >= 0).sum()), _active(idx), block_n or _block_n(model, tokens),
                  shared=shared, note=call.note)
    point.finite = bool(torch.isfinite(y.float()).all())
    point.cosine = metrics.cosine(y, ref)
    point.processed_diff = metrics.processed_diff(y, ref)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            call.run()
    except Exception as exc:  # noqa: BLE001 - reported, the point fails
        print(f"graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        return point
    torch.cuda.current_stream().wait_stream(stream)
    call.output.fill_(float("nan"))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    point.replay_equal = bool(torch.equal(call.output.view(torch.int16), y.view(torch.int16)))
    return point


def read_bandwidth(device) -> float:
    """Bytes per second of an `amax` over 4 GiB (what streaming the weights once can reach)."""
    big = torch.empty(1 << 30, dtype=torch.float32, device=device).uniform_()
    for _ in range(2):
        big.amax()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        big.amax()
    end.record()
    torch.cuda.synchronize()
    return 5 * big.numel() * 4 / (start.elapsed_time(end) * 1e-3)


def expert_bytes(model: str) -> int:
    """FP4 codes + K32 scale bytes of one expert's W1 and W2 (what the kernel streams per active expert)."""
    hidden, inter, _, _ = MODELS[model]
    params = 2 * inter * hidden + hidden * inter
    return params // 2 + params // 32


def time_point(model: str, tokens: int, seed: int, weights, bandwidth: float, repeats: int,
               block_n: int | None = None, stages: int | None = None) -> Point:
    import baselines.mega_moe.port_sm90 as port

    dev = torch.device("cuda")
    l1, l2 = weights
    x, x_sf, idx, w = random_inputs(model, tokens, seed + 1, dev)
    call = port.prepare(_inputs(model, l1, l2, x, x_sf, idx, w), None, block_n=block_n,
                        stages=stages or port.host.BUILT_STAGES)
    active = _active(idx)
    point = Point(model, tokens, int((idx >= 0).sum()), active, block_n or _block_n(model, tokens))
    point.megabytes = active * expert_bytes(model) / 1e6
    point.floor_us = active * expert_bytes(model) / bandwidth * 1e6
    # the call as a one-kernel graph, replayed right behind a 1 GiB write: the write flushes L2 and keeps the GPU
    # busy while the host enqueues, so the events time the kernel alone
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call.run()
    torch.cuda.current_stream().wait_stream(stream)
    flush = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    times = []
    for i in range(repeats + 2):
        flush.fill_(i % 251)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    point.cold_us = times[len(times) // 2]
    return point


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--tokens", default="1,8,64,256", help="tokens per rank checked, comma-separated")
    parser.add_argument("--time", default="", help="tokens per rank timed against the floor, comma-separated")
    parser.add_argument("--all-block-n", action="store_true", help="time every built block_n, not only the chosen")
    parser.add_argument("--stages", default="", help="also time these stage counts (their cubins built beforehand)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shared", action="store_true",
                        help="check the shared suite's call too (the port plus its separate shared expert)")
    parser.add_argument("--json", default="", help="write the points here")
    args = parser.parse_args(argv)
    from baselines.mega_moe.port_sm90 import host

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    checked = [int(v) for v in args.tokens.split(",") if v]
    timed = [int(v) for v in args.time.split(",") if v]
    bandwidth = read_bandwidth(dev) if timed else float("nan")
    if timed:
        print(f"read bandwidth (amax over 4 GiB): {bandwidth / 1e12:.2f} TB/s", flush=True)
    checks, times, failed = [], [], False
    for model in args.models.split(","):
        weights = random_weights(model, 7, dev)
        for t in checked:
            for shared in (False, True) if args.shared else (False,):
                p = check_point(model, t, 100 + t, weights, shared=shared)
                failed |= not p.ok
                checks.append(p)
                print(f"check {model} T={t} shared={int(shared)}: rows {p.rows} act {p.active} bn {p.block_n} "
                      f"cos {p.cosine:.6f} pdiff {p.processed_diff:.2e} finite {p.finite} replay-equal "
                      f"{p.replay_equal} {'ok' if p.ok else 'FAIL'}" + (f" ({p.note})" if shared else ""),
                      flush=True)
        for t in timed:
            configs = [(bn, host.BUILT_STAGES) for bn in (host.BUILT_BLOCK_N if args.all_block_n else (None,))]
            configs += [(None, int(s)) for s in args.stages.split(",") if s]
            for bn, stages in configs:
                p = time_point(model, t, 100 + t, weights, bandwidth, args.repeats, bn, stages)
                p.pipeline = _pipeline(model, t)
                p.stages = stages if p.pipeline == "cp_async" else 0
                times.append(p)
                print(f"time {model} T={t} {p.pipeline} bn {p.block_n} stages {p.stages or '-'}: "
                      f"{p.megabytes:.1f} MB floor {p.floor_us:.1f} us cold {p.cold_us:.1f} us", flush=True)
        del weights
    if checks:
        print("\n| model | tokens | shared | rows | act | bn | cosine | processed diff | finite | replay equal |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in checks:
            print(f"| {p.model} | {p.tokens} | {int(p.shared)} | {p.rows} | {p.active} | {p.block_n} | "
                  f"{p.cosine:.6f} | {p.processed_diff:.2e} | {p.finite} | {p.replay_equal} |")
    if times:
        print("\n| model | tokens | rows | act | pipeline | bn | stages | MB | floor us | cold us | % of bw |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in times:
            print(f"| {p.model} | {p.tokens} | {p.rows} | {p.active} | {p.pipeline} | {p.block_n} | "
                  f"{p.stages or '-'} | {p.megabytes:.1f} | {p.floor_us:.1f} | {p.cold_us:.1f} | "
                  f"{100 * p.floor_us / p.cold_us:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": [p.__dict__ for p in checks], "times": [p.__dict__ for p in times],
                       "read_bandwidth": bandwidth}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
