#!/usr/bin/env python3
"""The sm90 backend of `gc_moe.fp8_fp4_gc_moe` on one GPU (P = 1), through the public API, at the H200 profile's
per-rank slices (GLM-5.2: 32 local experts, k 8, H 6144, I 2048; DeepSeek-V4.1-Flash: 48, k 6, H 5120, I 2304;
capacity 256).

Steps (each prints JSON lines; a short table last):

1. per model and token count (--tokens): fresh random weights and inputs, y poisoned with NaN, one eager call;
   every element finite, cosine >= 0.97 and processed difference <= 0.002 against the float32 reference
   (`gc_moe.reference.moe_reference`); then the call captured in a torch CUDA graph (as the harness does) and
   replayed --replays times, every replay's y bit-equal to the eager y (counted on the device), one eager call
   after the replays equal too, control words: one finalized replay per call, no arrival errors, no overflow;
   The same with the shared expert fused (role4 nodes writing combine lane k; the slice's FP8 recipe:
   GLM-5.2 (1, 128, 128), DeepSeek (1, 1, 32)), and the unfused path's separate shared-expert launch alone
   against the reference's shared expert (cosine >= 0.99, processed difference <= 0.002);
2. --long-replays replays of one point (--long-model, --long-tokens) with the same checks (no deadlock: the
   waits are bounded by GC_MOE_WAIT_TIMEOUT_S, and the caller wraps the script in `timeout`);
3. the bounded wait: the ring-consumer W1 alone (no dispatch) in a child process must trap after 1 s;
4. latency per token count (--latency-tokens) for both models: a graph of 10 back-to-back calls replayed
   --latency-replays times, microseconds per call, beside the stand-alone grouped GEMM (W1 + W2 only, warm,
   docs/sm90-grouped-gemm.md, measured 2026-12-02 on the H200), and with the shared expert fused at 1, 8,
   64 and 256 tokens;
5. the layer split by differences (--parts-tokens, off unless given): per token count the layer as it runs
   (dispatch and role2 concurrent roots), with role2 after dispatch (overlap off), without role2 (dispatch ->
   finalize) and finalize alone (`Sm90Layer.timing_nodes`); role2 with a full ring = off - without, what the
   overlap hides = off - on, role1 = without - finalize alone. Same timing as step 4 (finalize alone combines
   whatever the buffers hold and counts arrival errors: statistics only, this step runs last).
6. where the shared expert runs (--orders-tokens, off unless given): per token count the shared layer with role4
   beside role2 (W1 -> W2 nodes: the default; one fused node with the fused role2), before role2 (role2 waits
   on role4; fused: the four-node graph) and after it, the routed nodes alone (role4 left out), and role4 alone
   (role4 -> finalize minus finalize alone), same timing as step 4.

    gcmoe-bench build --arch sm_90a --profile h200        # on the build machine; copy .cubin-cache over
    PYTHONPATH=operator GC_MOE_WAIT_TIMEOUT_S=30 python scripts/device_layer_backend.py --out device-out
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

# stand-alone grouped GEMM (W1 + W2 of the warp-specialized default, cold us: weights from HBM), the "ws" column
# of docs/sm90-grouped-gemm.md "Speed on the H200: the warp-specialized default" (2026-12-02). Its routing is
# rank 0 of 8 (uniform over all E experts), not the layer's P = 1 slice, so "overhead" is indicative only.
STANDALONE_GEMM_US = {
    "glm-5.2": {1: 75.5, 2: 100.5, 4: 124.7, 8: 172.9, 16: 214.1, 32: 218.5, 64: 266.7, 128: 397.8, 256: 695.9},
    "deepseek-v4.1-flash": {1: 74.0, 2: 84.9, 4: 135.4, 8: 153.1, 16: 224.5, 32: 312.6, 64: 317.0, 128: 383.8,
                            256: 548.1},
}


def point_passes(r: dict, replays: int) -> bool:
    return (r["nonfinite"] == 0 and r["cosine"] >= 0.97 and r["processed_diff"] <= 0.002
            and r["mismatched_replays"] == 0 and r["eager_after_mismatch"] == 0 and r["arrival_errors_added"] == 0
            and r["ring_overflows_added"] == 0 and r["replays_added"] == replays + 1)


def layer_parts(layer, num_tokens: int, replays: int) -> dict:
    """Step 5 at one point: us per call of the layer as built, with role2 after dispatch, without role2, and
    finalize alone."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    on = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)  # also makes the layer
    sm90 = layer.buffer.extras["sm90_layer"]
    overlap = sm90.overlap_roots
    try:
        sm90.overlap_roots = False
        serial = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
        sm90.timing_nodes = ("dispatch", "finalize")
        without = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
        sm90.timing_nodes = ("finalize",)
        finalize_alone = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
    finally:
        sm90.overlap_roots, sm90.timing_nodes = overlap, None
    return {"on_us": on, "serial_us": serial, "without_role2_us": without, "finalize_us": finalize_alone,
            "role2_nodes": sm90.role2_nodes}


ROLE4_FORMS = {  # step 6: (role2_nodes, role4_fused, role4_order)
    "default": ("auto", False, "auto"),
    "beside_nodes": ("auto", False, "beside"),
    "beside_fused": (1, True, "beside"),
    "beside_r4fused": ("auto", True, "beside"),  # role4 one node beside role2's W1 -> W2 (from 2 tokens)
    "before_fused": ("auto", True, "before"),
    "before_nodes": ("auto", False, "before"),
    "after_fused": ("auto", True, "after"),
}


def role4_forms(layer, num_tokens: int, replays: int) -> dict:
    """Step 6 at one point: us per call of the shared layer in each of ROLE4_FORMS, without role4, and role4
    alone (fused and as W1 -> W2) by difference with finalize alone."""
    from gc_moe.kernels.sm90 import layer_checks as lc

    sm90 = layer.buffer.extras["sm90_layer"]
    saved = sm90.role2_nodes, sm90.role4_fused, sm90.role4_order, sm90.timing_nodes
    row = {}
    try:
        for form, (nodes, fused, order) in ROLE4_FORMS.items():
            sm90.role2_nodes, sm90.role4_fused, sm90.role4_order = nodes, fused, order
            row[f"{form}_us"] = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
        sm90.role2_nodes, sm90.role4_order = "auto", "beside"
        sm90.timing_nodes = ("dispatch", "role2", "finalize")
        row["routed_us"] = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
        sm90.timing_nodes = ("finalize",)
        row["finalize_us"] = lc.time_calls(layer, num_tokens, seed=5000 + num_tokens, replays=replays)
        sm90.timing_nodes = ("role4", "finalize")
        for fused in (True, False):
            sm90.role4_fused = fused
            row[f"role4_{'fused' if fused else 'nodes'}_alone_us"] = lc.time_calls(
                layer, num_tokens, seed=5000 + num_tokens, replays=replays) - row["finalize_us"]
    finally:
        sm90.role2_nodes, sm90.role4_fused, sm90.role4_order, sm90.timing_nodes = saved
    return row


def main() -> int:
    import torch
    from gc_moe import api
    from gc_moe.kernels.sm90 import layer_checks as lc

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="glm-5.2,deepseek-v4.1-flash")
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--replays", type=int, default=1000)
    p.add_argument("--long-replays", type=int, default=100_000)
    p.add_argument("--long-model", default="deepseek-v4.1-flash")
    p.add_argument("--long-tokens", type=int, default=1)
    p.add_argument("--latency-tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--latency-replays", type=int, default=50)
    p.add_argument("--parts-tokens", default="", help="token counts of step 5 (empty: skip it)")
    p.add_argument("--orders-tokens", default="", help="token counts of step 6 (empty: skip it)")
    p.add_argument("--skip", default="", help="comma-separated steps to skip: points,shared,long,bounded,latency")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    out = {"points": [], "separate_shared": [], "long": None, "bounded": None, "latency": [], "parts": [],
           "orders": [], "backend": None}
    ok = True
    layers, shared_layers = {}, {}
    for name in args.models.split(","):
        started = time.perf_counter()
        layers[name] = lc.ApiLayer(lc.SLICES[name], dev, seed=11)
        backend = layers[name].buffer.backend
        out["backend"] = backend
        print(json.dumps({"model": name, "backend": backend, "setup_s": round(time.perf_counter() - started, 2)}),
              flush=True)
        if backend != "sm90":
            reason = api.registered_backends()["sm90"].unavailable_reason(dev, api.device_arch(dev))
            print(f"FAIL: the API picked {backend!r}, not 'sm90': {reason}", flush=True)
            return 1
        if "shared" not in skip:
            try:
                shared_layers[name] = lc.ApiLayer(lc.SLICES[name], dev, seed=11, shared=True,
                                                  weights=(layers[name].l1, layers[name].l2))
            except Exception as exc:  # noqa: BLE001
                print(json.dumps({"model": name, "suite": "shared", "error": f"{type(exc).__name__}: {exc}"}))
                ok = False
        if "points" in skip:
            continue
        suites = [("routed", layers[name])] + ([("shared", shared_layers[name])] if name in shared_layers else [])
        for suite, layer in suites:
            for t in (int(v) for v in args.tokens.split(",")):
                try:
                    r = lc.check_point(layer, t, seed=1000 + t)
                    y = r.pop("y")
                    r.update(lc.replay_check(layer, y, t, args.replays))
                    r["pass"] = point_passes(r, args.replays)
                except Exception as exc:  # noqa: BLE001  (one point's failure is reported, the others still run)
                    r = {"tokens": t, "error": f"{type(exc).__name__}: {exc}", "pass": False}
                r["model"], r["suite"] = name, suite
                ok &= r["pass"]
                out["points"].append(r)
                print(json.dumps(r), flush=True)
        if "shared" not in skip:  # the unfused path's shared expert, launched on its own
            for t in (1, 256):
                try:
                    r = lc.check_separate_shared(layers[name], t, seed=3000 + t)
                    r["pass"] = r["nonfinite"] == 0 and r["cosine"] >= 0.99 and r["processed_diff"] <= 0.002
                except Exception as exc:  # noqa: BLE001
                    r = {"tokens": t, "error": f"{type(exc).__name__}: {exc}", "pass": False}
                r["model"] = name
                ok &= r["pass"]
                out["separate_shared"].append(r)
                print(json.dumps(r), flush=True)

    if "long" not in skip:
        layer = layers[args.long_model]
        r = lc.check_point(layer, args.long_tokens, seed=77)
        y = r.pop("y")
        r.update(lc.replay_check(layer, y, args.long_tokens, args.long_replays))
        r["pass"] = point_passes(r, args.long_replays)
        r["model"] = args.long_model
        ok &= r["pass"]
        out["long"] = r
        print(json.dumps(r), flush=True)

    if "bounded" not in skip:
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", "from gc_moe.kernels.sm90.layer_checks import bounded_wait_probe as b; b(1.0)"],
            check=False, capture_output=True, text=True, timeout=120,
            env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "operator")})
        r = {"exit": proc.returncode, "seconds": round(time.perf_counter() - started, 2),
             "stdout": proc.stdout.strip()[-300:], "stderr": proc.stderr.strip()[-300:]}
        r["pass"] = proc.returncode == lc.BOUNDED_WAIT_EXIT
        ok &= r["pass"]
        out["bounded"] = r
        print(json.dumps(r), flush=True)

    if "latency" not in skip:
        for name, layer in layers.items():
            for t in (int(v) for v in args.latency_tokens.split(",")):
                row = {"model": name, "tokens": t, "standalone_gemm_us": STANDALONE_GEMM_US.get(name, {}).get(t)}
                for key, timed in (("layer_us", layer), ("shared_fused_us", shared_layers.get(name))):
                    if timed is None or (key == "shared_fused_us" and t not in (1, 8, 64, 256)):
                        row[key] = float("nan")
                        continue
                    try:
                        row[key] = lc.time_calls(timed, t, seed=5000 + t, replays=args.latency_replays)
                    except Exception as exc:  # noqa: BLE001
                        row[key] = float("nan")
                        print(json.dumps({"model": name, "tokens": t, "timed": key,
                                          "error": f"{type(exc).__name__}: {exc}"}))
                        ok = False
                out["latency"].append(row)

    for name, layer in layers.items():
        for t in (int(v) for v in filter(None, args.parts_tokens.split(","))):
            try:
                row = {"model": name, "tokens": t, **layer_parts(layer, t, args.latency_replays)}
            except Exception as exc:  # noqa: BLE001
                row = {"model": name, "tokens": t, "error": f"{type(exc).__name__}: {exc}"}
                ok = False
            out["parts"].append(row)
            print(json.dumps(row), flush=True)

    for name, layer in shared_layers.items():
        for t in (int(v) for v in filter(None, args.orders_tokens.split(","))):
            try:
                row = {"model": name, "tokens": t, **role4_forms(layer, t, args.latency_replays)}
            except Exception as exc:  # noqa: BLE001
                row = {"model": name, "tokens": t, "error": f"{type(exc).__name__}: {exc}"}
                ok = False
            out["orders"].append(row)
            print(json.dumps(row), flush=True)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_layer_backend.json").write_text(json.dumps(out, indent=1))
    print(f"\n{'model':20s} {'suite':6s} {'T':>4} {'rows':>5} {'cosine':>9} {'pdiff':>9} {'nonfin':>6} {'replays':>7} {'bad':>4} "
          f"{'us/rep':>7} {'arrive':>6}")
    for r in out["points"] + ([out["long"]] if out["long"] else []):
        if "error" in r:
            print(f"{r['model']:20s} {r.get('suite', ''):6s} {r['tokens']:>4} ERROR {r['error']}")
            continue
        print(f"{r['model']:20s} {r.get('suite', 'routed'):6s} {r['tokens']:>4} {r['rows']:>5} {r['cosine']:>9.6f} {r['processed_diff']:>9.2e} "
              f"{r['nonfinite']:>6} {r['replays']:>7} {r['mismatched_replays'] + r['eager_after_mismatch']:>4} "
              f"{r['us_per_replay_with_check']:>7.1f} {r['arrival_errors_added']:>6}  {'PASS' if r['pass'] else 'FAIL'}")
    for r in out["separate_shared"]:
        print(f"separate shared expert {r['model']:20s} T {r['tokens']:>4}: " + (
            f"ERROR {r['error']}" if "error" in r else f"cosine {r['cosine']:.6f} pdiff {r['processed_diff']:.2e} "
            f"nonfinite {r['nonfinite']}  {'PASS' if r['pass'] else 'FAIL'}"))
    if out["bounded"]:
        b = out["bounded"]
        print(f"bounded wait (W1 alone, 1 s): exit {b['exit']} after {b['seconds']} s  {'PASS' if b['pass'] else 'FAIL'}")
    if out["latency"]:
        print(f"\n{'model':20s} {'T':>4} {'layer us':>9} {'GEMM us':>8} {'overhead':>8} {'+shared':>8}")
        for r in out["latency"]:
            g = r["standalone_gemm_us"] or float("nan")
            print(f"{r['model']:20s} {r['tokens']:>4} {r['layer_us']:>9.1f} {g:>8.1f} {r['layer_us'] - g:>8.1f} "
                  f"{r['shared_fused_us']:>8.1f}")
    if out["parts"]:
        print(f"\n{'model':20s} {'T':>4} {'layer us':>9} {'serial':>8} {'no role2':>8} {'role2':>8} {'hidden':>8} "
              f"{'final.':>8}")
        for r in out["parts"]:
            if "error" in r:
                print(f"{r['model']:20s} {r['tokens']:>4} ERROR {r['error']}")
                continue
            print(f"{r['model']:20s} {r['tokens']:>4} {r['on_us']:>9.1f} {r['serial_us']:>8.1f} "
                  f"{r['without_role2_us']:>8.1f} {r['serial_us'] - r['without_role2_us']:>8.1f} "
                  f"{r['serial_us'] - r['on_us']:>8.1f} {r['finalize_us']:>8.1f}")
    if out["orders"]:
        cols = [f"{f}_us" for f in ROLE4_FORMS] + ["routed_us", "role4_fused_alone_us", "role4_nodes_alone_us"]
        print(f"\n{'model':20s} {'T':>4} " + " ".join(f"{c[:-3]:>13}" for c in cols))
        for r in out["orders"]:
            if "error" in r:
                print(f"{r['model']:20s} {r['tokens']:>4} ERROR {r['error']}")
                continue
            print(f"{r['model']:20s} {r['tokens']:>4} " + " ".join(f"{r[c]:>13.1f}" for c in cols))
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
