"""The layer with a token ring smaller than the pool (GC_MOE_RING_BLOCKS) on the H200: time per call at each ring
size beside the pool-sized ring, on the same weights and inputs, and a long replay run of the smallest ring.

    python scripts/device_ring_reuse.py OUT_DIR [--rings auto,64,16,6] [--tokens 1,8,64,256] [--replays N]

Writes OUT_DIR/ring_reuse.json and prints a table (us per call; the graph of 10 calls replayed 200 times, weights
from HBM every call). Needs an sm_90 GPU and the layer's cubins (PYTHONPATH=operator:. with the cache carried)."""

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default="glm-5.2,deepseek-v4.1-flash")
    ap.add_argument("--rings", default="auto,64,16,6", help="ring sizes in 8-row blocks ('auto': the pool)")
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--replays", type=int, default=100_000, help="replays of the smallest ring at --replay-tokens")
    ap.add_argument("--replay-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import torch
    from gc_moe.kernels.sm90 import layer as sm90_layer
    from gc_moe.kernels.sm90 import layer_checks as lc

    args.out.mkdir(parents=True, exist_ok=True)
    rings = args.rings.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    device = torch.device("cuda")
    rows, replay = [], {}
    for model in args.models.split(","):
        s = lc.SLICES[model]
        weights = lc.random_weights(s, device, seed=31)
        for ring in rings:
            os.environ[sm90_layer.RING_BLOCKS_ENV] = ring
            layer = lc.ApiLayer(s, device, backend="sm90", weights=weights)
            shape = layer.buffer.extras["sm90_layer"].shape
            for t in tokens:
                us = lc.time_calls(layer, t, seed=1000 + t)
                rows.append({"model": model, "ring_blocks": shape.ring_blocks, "pool_blocks": shape.pool_blocks,
                             "tokens": t, "us": us})
                print(f"{model:22s} ring {shape.ring_blocks:>4}/{shape.pool_blocks:<4} T={t:<4} {us:9.1f} us",
                      flush=True)
            if ring == rings[-1] and model == args.models.split(",")[0] and args.replays:
                r = lc.check_point(layer, args.replay_tokens, seed=77)
                started = time.perf_counter()
                rep = lc.replay_check(layer, r.pop("y"), args.replay_tokens, replays=args.replays)
                replay = {"model": model, "ring_blocks": shape.ring_blocks, "tokens": args.replay_tokens,
                          "seconds": time.perf_counter() - started, **rep, "cosine": r["cosine"]}
                print(f"replays: {replay}", flush=True)
            layer.buffer.destroy()
        os.environ.pop(sm90_layer.RING_BLOCKS_ENV, None)
    (args.out / "ring_reuse.json").write_text(json.dumps({"rows": rows, "replay": replay}, indent=1))
    print("\nmodel | T | " + " | ".join(f"ring {r}" for r in rings))
    for model in args.models.split(","):
        for t in tokens:
            cells = [f"{x['us']:.1f}" for x in rows if x["model"] == model and x["tokens"] == t]
            print(f"{model} | {t} | " + " | ".join(cells))
    ok = not replay or (replay["mismatched_replays"] == 0 and replay["eager_after_mismatch"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
