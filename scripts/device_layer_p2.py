#!/usr/bin/env python3
"""P = 2 on one GPU as two processes: the SM90 layer's cross-rank protocol through the public API.

    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 GC_MOE_WAIT_TIMEOUT_S=60 \\
        timeout --signal=INT --kill-after=15 540 \\
        torchrun --standalone --nproc-per-node 2 scripts/device_layer_p2.py --out $OUT/p2.json

Both ranks run on cuda:0 (the only GPU); each owns E/2 experts, so every call crosses ranks: role1 pulls the
other rank's rows through the symmetric workspace (torch symmetric memory, both allocations on one device, which
torch refuses unless TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1), the tag-1 barrier and the combine readiness
count both ranks, W2 scatters partials into the source rank's combine buffer. Host collectives (the results
exchange, the float32 expert-parallel reference) use a gloo group; the buffer's group is gloo too by default
(--backend nccl gives it an NCCL group instead: NCCL may refuse two ranks on one device, and the layer needs
the group only for the symmetric-memory rendezvous).

Two processes on one GPU without MPS time-slice rather than run concurrently, so a rank's spin waits on the
other last until the next context switch: slow, not a deadlock. GC_MOE_WAIT_TIMEOUT_S (default here 60 s)
bounds every device wait (past it the kernel traps and the rank reports the launch failure instead of hanging),
and the launch wraps everything in `timeout`. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
set here too when unset).

Per shape (--shapes: `small` = E 16, k 4, H 1024, I 256, capacity 64; `glm-5.2` / `deepseek-v4.1-flash` = two
ranks of the H200 profile's per-rank slice, E/8 experts each: E 64 / 96 in all, capacity 64) and token count
(--tokens, default 1, 8, 64; the same count on both ranks): fresh inputs per rank (its own seed, uniform top-k
over all E experts, so about half of each rank's assignments are remote), y poisoned with NaN, one eager call
through `gc_moe.get_symm_buffer_for_gc_moe` / `fp8_fp4_gc_moe` (as the harness's GcAdapter calls it); each
rank's y against the expert-parallel float32 reference (`gc_moe.reference.moe_reference_ep` over the gloo group,
on the CPU) with `gc_moe.metrics.check_accuracy` (finite, cosine >= 0.97, processed difference <= 0.002); then
the call captured in a CUDA graph and replayed --replays times, every replay's y bit-equal to the eager y
(counted on the device), one eager call after the replays equal too; the layer's control words: one finalized
replay per call, no arrival errors, no ring overflow.

Anything that makes P = 2 impossible here (the process group, torch symmetric memory refusing the overlapping
devices, a declined configuration, a trapped wait) is caught, and its exact text written with the stage it
happened in. Each rank writes <out stem>.rank<r>.json as it goes (so a run stopped by `timeout` still says where
it was); rank 0 writes --out with both ranks' records and prints a short table last. Exit status: 0 every
point passed, 1 a point failed, 2 P = 2 could not be set up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

WORLD = 2
DEFAULT_WAIT_TIMEOUT_S = "60"
ALPHA, CLAMP = 1.0, 10.0
SEED = 20261203
# name -> (experts in all, top-k, hidden, intermediate, capacity); the model shapes are two ranks of the H200
# profile's per-rank slice (E/8 experts each, gcmoe_bench/data/models.csv)
SHAPES = {
    "small": (16, 4, 1024, 256, 64),
    "glm-5.2": (64, 8, 6144, 2048, 64),
    "deepseek-v4.1-flash": (96, 6, 5120, 2304, 64),
}
SETUP_STAGES = ("environment", "process group", "device", "buffer", "weights")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("p2.json"), help="rank 0 writes the combined JSON here")
    p.add_argument("--shapes", default="small", help=f"comma-separated, from: {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="1,8,64", help="tokens per rank, comma-separated")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="process-group backend of the buffer's group (host collectives always use gloo)")
    p.add_argument("--collective-timeout", type=float, default=180.0,
                   help="seconds a host collective (gloo) may wait for the other rank")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same flow on the CPU through the API's reference backend (no kernels, no graph "
                        "replays): checks this script, not the layer")
    args = p.parse_args(argv)
    args.shape_list = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shape_list if s not in SHAPES]
    if unknown or not args.shape_list:
        p.error(f"--shapes {args.shapes!r}: unknown {unknown}; allowed: {', '.join(SHAPES)}")
    try:
        args.token_list = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: comma-separated integers")
    for name in args.shape_list:
        capacity = SHAPES[name][4]
        bad = [t for t in args.token_list if not 1 <= t <= capacity]
        if bad:
            p.error(f"--tokens {bad} for {name}: allowed 1..{capacity} (its capacity)")
    if args.replays < 1:
        p.error(f"--replays {args.replays}: allowed >= 1")
    return args


def rank_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix or '.json'}")


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def point_passes(p: dict, replays: int) -> bool:
    if p.get("dry_run"):
        return p.get("error") is None and p.get("accuracy_passed") is True and p.get("nonfinite") == 0
    return (p.get("error") is None and p.get("accuracy_passed") is True and p.get("nonfinite") == 0
            and p.get("mismatched_replays") == 0 and p.get("eager_after_mismatch") == 0
            and p.get("arrival_errors_added") == 0 and p.get("ring_overflows_added") == 0
            and p.get("replays_added") == replays + 1)


class Recorder:
    """This rank's record: the stage it is in, what happened, flushed to its own file after every step."""

    def __init__(self, out: Path, rank: int, args: argparse.Namespace):
        self.path = rank_path(out, rank)
        self.data = {"rank": rank, "world_size": WORLD, "args": {k: v for k, v in vars(args).items()
                                                                    if k not in ("out",)},
                     "env": {}, "stage": "start", "setup_error": None, "points": [], "shapes": {}}

    def stage(self, name: str) -> None:
        self.data["stage"] = name
        self.flush()

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def environment_record() -> dict:
    keys = ("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "GC_MOE_WAIT_TIMEOUT_S",
            "GC_MOE_CACHE_DIR", "GC_MOE_OVERLAP_ROOTS", "GC_MOE_SM90_DISPATCH_SMS", "GC_MOE_RING_BLOCKS",
            "CUDA_MPS_PIPE_DIRECTORY",
            "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: os.environ.get(k) for k in keys}


def setup_environment() -> dict:
    """The variables P = 2 on one device needs, set when unset (before torch touches CUDA); returns what was
    given beforehand."""
    given = environment_record()
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("GC_MOE_WAIT_TIMEOUT_S", DEFAULT_WAIT_TIMEOUT_S)
    return given


def rank_inputs(shape: tuple, num_tokens: int, rank: int, device):
    """This rank's hidden states (quantized) and routing for one point: seeded by (point, rank)."""
    from gc_moe import cases
    from gc_moe.formats import quantize_fp8_ue8m0

    experts, topk, hidden, _, _ = shape
    seed = cases.derive_seed(SEED, "p2", experts, num_tokens, "rank", rank)
    idx, wts = cases.make_routing("uniform", num_tokens, experts, topk, num_ranks=WORLD, source_rank=rank, seed=seed)
    h = cases.random_hidden_states(num_tokens, hidden, seed=seed)
    x, x_sf = quantize_fp8_ue8m0(h.to(device))
    return x, x_sf, idx.to(device), wts.to(device)


def capture(call, device):
    import torch

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        call()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    return graph


def run_point(name: str, shape: tuple, num_tokens: int, rank: int, buffer, w1, w2, l1_cpu, l2_cpu, control,
              device, replays: int, control_group) -> dict:
    """One point on this rank (both ranks run the same sequence of calls: eager, warm-up, replays, eager)."""
    import torch
    from gc_moe import api, metrics
    from gc_moe.reference import moe_reference_ep

    experts, _, hidden, _, _ = shape
    out = {"shape": name, "tokens": num_tokens, "rank": rank, "error": None}
    x, x_sf, idx, wts = rank_inputs(shape, num_tokens, rank, device)
    per_rank = experts // WORLD
    valid = idx[idx >= 0]
    out["rows"] = int(valid.numel())
    out["remote_rows"] = int((valid // per_rank != rank).sum())
    t = num_tokens
    buffer.x[:t].copy_(x)
    buffer.x_sf[:t].copy_(x_sf)
    buffer.topk_idx[:t].copy_(idx)
    buffer.topk_weights[:t].copy_(wts)
    y = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device=device)

    def call(target=y):
        api.fp8_fp4_gc_moe(target, w1, w2, buffer, recipe=(1, 1, 32), activation="swiglu", activation_alpha=ALPHA,
                           activation_clamp=CLAMP, num_tokens=t)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    started = time.perf_counter()
    call()
    sync()
    out["eager_s"] = round(time.perf_counter() - started, 4)
    y_eager = y.clone()
    ref = moe_reference_ep(control_group, x.cpu(), x_sf.cpu(), idx.cpu(), wts.cpu(), l1_cpu, l2_cpu,
                           num_experts=experts, activation_alpha=ALPHA, activation_clamp=CLAMP)
    yf = y_eager.float().cpu()
    check = metrics.check_accuracy(yf, ref.float(), False)
    out.update(nonfinite=int((~torch.isfinite(yf)).sum()), cosine=check.cosine,
               processed_diff=check.processed_diff, max_abs_err=check.max_abs_err,
               accuracy_passed=bool(check.passed), accuracy_failures=list(check.failures))

    if device.type != "cuda":  # --cpu-dry-run: no graphs, no control words
        out["dry_run"] = True
        return out
    # graph replays: warm-up call, capture, replays compared on the device, one eager call after
    y.fill_(float("nan"))
    call()
    graph = capture(call, device)
    y.fill_(float("nan"))
    before = control()
    mismatched = torch.zeros((), dtype=torch.int64, device=device)
    want = y_eager.view(torch.int16)
    started = time.perf_counter()
    for _ in range(replays):
        graph.replay()
        mismatched += (y.view(torch.int16) != want).any()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    y.fill_(float("nan"))
    call()
    torch.cuda.synchronize(device)
    after = control()
    out.update(replays=replays, mismatched_replays=int(mismatched),
               eager_after_mismatch=int((y.view(torch.int16) != want).any()),
               ms_per_replay=round(1e3 * seconds / replays, 3),
               **{f"{k}_added": after[k] - before[k] for k in ("replays", "arrival_errors", "ring_overflows")
                  if k in after and k in before})
    del graph
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    given = setup_environment()
    rank = int(os.environ.get("RANK", "0"))
    rec = Recorder(args.out, rank, args)
    rec.data["env"] = {"given": given, "used": environment_record()}
    setup_error = None
    group = control_group = None
    try:
        rec.stage("environment")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != WORLD or "MASTER_ADDR" not in os.environ:
            raise RuntimeError(f"needs {WORLD} processes under torchrun (torchrun --standalone --nproc-per-node "
                               f"{WORLD} {Path(__file__).name} ...); WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
        import torch
        import torch.distributed as dist

        rec.data["torch"] = torch.__version__
        rec.stage("process group")
        timeout = timedelta(seconds=args.collective_timeout)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
        control_group = dist.group.WORLD
        rec.stage("device")
        if args.cpu_dry_run:
            device, group = torch.device("cpu"), control_group
        else:
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA GPU")
            device = torch.device("cuda", 0)  # both ranks: the one GPU
            torch.cuda.set_device(device)
            rec.data["gpu"] = torch.cuda.get_device_name(device)
            if torch.cuda.get_device_capability(device) != (9, 0):
                raise RuntimeError(f"{rec.data['gpu']} has compute capability "
                                   f"{torch.cuda.get_device_capability(device)}; the SM90 layer needs 9.0")
            group = control_group if args.backend == "gloo" else dist.new_group(backend="nccl", timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - the reason is the result
        setup_error = {"stage": rec.data["stage"], "error": error_text(exc), "traceback": traceback.format_exc()}
    if control_group is not None:  # both ranks go on, or neither
        try:
            if agree(control_group, setup_error) and setup_error is None:
                setup_error = {"stage": rec.data["stage"], "error": "the other rank failed to set up (its record "
                                                                    "says why)"}
        except Exception as exc:  # noqa: BLE001
            setup_error = setup_error or {"stage": rec.data["stage"], "error": f"no answer from the other rank: "
                                                                              f"{error_text(exc)}"}
    points_ok = True
    if setup_error is None:
        try:
            points_ok, setup_error = run_shapes(args, rec, rank, group, control_group, device)
        except BaseException as exc:  # noqa: BLE001 - e.g. an exchange with a rank that hangs timed out
            points_ok = False
            setup_error = rec.data.get("setup_error") or {"stage": rec.data["stage"], "error": error_text(exc),
                                                          "traceback": traceback.format_exc()}
    rec.data["setup_error"] = setup_error
    rec.stage("done")
    return finish(args, rec, rank, control_group, points_ok, setup_error)


def run_shapes(args, rec: Recorder, rank: int, group, control_group, device) -> tuple[bool, dict | None]:
    """Every shape and token count; the same calls on both ranks. Returns (all points passed, the setup error
    that made P = 2 impossible, or None). A rank that fails stops; the other learns it at the next exchange."""
    import torch
    import torch.distributed as dist
    from gc_moe import api, cases

    all_ok = True
    for name in args.shape_list:
        shape = SHAPES[name]
        experts, topk, hidden, inter, capacity = shape
        info = rec.data["shapes"][name] = {"experts": experts, "topk": topk, "hidden": hidden,
                                           "intermediate": inter, "capacity": capacity}
        try:
            rec.stage(f"buffer {name}")
            started = time.perf_counter()
            buffer = api.get_symm_buffer_for_gc_moe(group, experts, capacity, topk, hidden, inter, device=device)
            info["backend"] = buffer.backend
            info["buffer_s"] = round(time.perf_counter() - started, 2)
            if buffer.backend != "sm90" and not args.cpu_dry_run:
                why = api.registered_backends()["sm90"].unavailable_reason(device, api.device_arch(device))
                raise RuntimeError(f"the API picked the {buffer.backend!r} backend, not 'sm90': {why}")
            layer = buffer.extras.get("sm90_layer")
            control = layer.control if layer is not None else dict
            if layer is not None:
                info["layer"] = {"rank": layer.rank, "timeout_s": layer.timeout_s,
                                 "peer_bases": getattr(layer.ws, "peer_bases", None)}
                if hasattr(layer, "settings_note"):
                    info["layer"]["settings"] = layer.settings_note()
            rec.stage(f"weights {name}")
            l1, l2 = cases.random_moe_weights(experts, hidden, inter, seed=SEED,
                                              experts=cases.local_experts(experts, WORLD, rank), device=device)
            w1, w2 = api.transform_weights_for_gc_moe(l1, l2)
            l1_cpu, l2_cpu = tuple(t.cpu() for t in l1), tuple(t.cpu() for t in l2)
        except BaseException as exc:  # noqa: BLE001 - the reason is the result
            error = {"stage": rec.data["stage"], "error": error_text(exc), "traceback": traceback.format_exc()}
            rec.data["setup_error"] = error
            rec.flush()  # before the exchange: the other rank may be stuck in the rendezvous
            agree(control_group, error)
            return False, error
        if agree(control_group, None):
            return False, {"stage": rec.data["stage"], "error": "the other rank failed to set up (its record says why)"}
        for t in args.token_list:
            rec.stage(f"point {name} T={t}")
            try:
                p = run_point(name, shape, t, rank, buffer, w1, w2, l1_cpu, l2_cpu, control, device,
                              args.replays, control_group)
            except BaseException as exc:  # noqa: BLE001 - a trapped wait ends here
                p = {"shape": name, "tokens": t, "rank": rank, "error": error_text(exc),
                     "traceback": traceback.format_exc()}
                try:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except Exception as sync_exc:  # noqa: BLE001
                    p["device"] = f"unusable after the error: {error_text(sync_exc)}"
            p["passed"] = point_passes(p, args.replays)
            all_ok &= p["passed"]
            rec.data["points"].append(p)
            rec.flush()
            print(json.dumps({k: v for k, v in p.items() if k != "traceback"}, default=str), flush=True)
            if agree(control_group, p["error"]):  # a failed call leaves the protocol out of step: stop
                return False, None
        if layer is not None:
            layer.release()
        del buffer, layer, w1, w2, l1, l2
        dist.barrier(group=control_group)
    return all_ok, None


def agree(control_group, error) -> bool:
    """True when some rank reports an error (every rank calls it at the same place)."""
    import torch.distributed as dist

    flags = [None] * WORLD
    dist.all_gather_object(flags, error, group=control_group)
    return any(f is not None for f in flags)


def finish(args, rec: Recorder, rank: int, control_group, points_ok: bool, setup_error) -> int:
    """Rank 0 gathers both records, writes --out and prints the table; every rank returns the exit status."""
    records = [rec.data]
    gather_error = None
    if control_group is not None:
        import torch.distributed as dist

        try:
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, rec.data, group=control_group)
            records = gathered
        except Exception as exc:  # noqa: BLE001 - rank 0 still writes its own
            gather_error = error_text(exc)
    errors = [r["setup_error"] for r in records if r and r.get("setup_error")]
    passed = points_ok and not errors and not gather_error and all(
        p.get("passed") for r in records if r for p in r["points"]) and any(r and r["points"] for r in records)
    status = 0 if passed else (2 if errors and not any(r and r["points"] for r in records) else 1)
    if rank == 0:
        summary = {"passed": passed, "exit_status": status, "cpu_dry_run": args.cpu_dry_run,
                   "setup_errors": errors, "gather_error": gather_error, "ranks": records}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str))
        print_table(records, errors, gather_error, passed, args.out, args.cpu_dry_run)
    if control_group is not None:
        import contextlib

        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return status


def print_table(records: list, errors: list, gather_error, passed: bool, out: Path, dry_run: bool = False) -> None:
    print("\n| shape | T | rank | rows | remote | cosine | processed diff | non-finite | replays | != eager "
          "| arrival err | ms/replay | pass |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    points = sorted((p for r in records if r for p in r["points"]), key=lambda p: (p["shape"], p["tokens"], p["rank"]))
    for p in points:
        if p.get("error"):
            print(f"| {p['shape']} | {p['tokens']} | {p['rank']} | error: {p['error']} |")
            continue
        print(f"| {p['shape']} | {p['tokens']} | {p['rank']} | {p.get('rows')} | {p.get('remote_rows')} | "
              f"{p.get('cosine', float('nan')):.6f} | {p.get('processed_diff', float('nan')):.2e} | "
              f"{p.get('nonfinite')} | {p.get('replays')} | {p.get('mismatched_replays')} | "
              f"{p.get('arrival_errors_added')} | {p.get('ms_per_replay')} | {'yes' if p['passed'] else 'NO'} |")
    for e in errors:
        print(f"P = 2 setup failed at stage '{e['stage']}': {e['error']}")
    if gather_error:
        print(f"the ranks' records could not be gathered: {gather_error}")
    what = "P = 2 CPU dry run (the API's reference backend: no kernels)" if dry_run else "P = 2 on one GPU"
    print(f"{what}: {'PASS' if passed else 'FAIL'} ({out})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
