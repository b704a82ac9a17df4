#!/usr/bin/env python3
"""Prove the GPU runtime on a device: partitions, cached cubins, launcher, child graph, bounded waits.

Needs torch and cuda-bindings only; the ring-proof cubins must be in the cache (build them first with
`gcmoe-bench build --arch sm_90a --profile h200`, or `python -c "from gc_moe.runtime.jit import
build_profile; build_profile('sm_90a', {})"`, and copy the cache directory to the GPU machine).

Steps: (1) the green-context pair; (2) a child graph, producer in the communication partition and
consumer in the compute partition as roots, checker after both, replayed --replays times: no hang,
no wrong value, root overlap from %globaltimer; (3) the same graph attached to a torch CUDA graph
capture; (4) the consumer with no producer: its bounded wait reports within its timeout; (5) the
same with trap-on-timeout in a child process: the launch fails instead of hanging; (6) launcher
checks (param layout, TMA encode); (7) the symmetric workspace at world size 1. A table comes last.

    PYTHONPATH=operator python scripts/device_runtime_proof.py --replays 10000 --out runs/runtime_proof
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from gc_moe.kernels import registry
from gc_moe.kernels.sm90 import ring_proof as rp
from gc_moe.runtime import describe_environment, jit
from gc_moe.runtime.driver import cu
from gc_moe.runtime.launch import (
    ParamLayoutError,
    TiledTensorMapSpec,
    encode_tiled_tensor_map,
    i32,
    i64,
    launch,
    ptr,
)

NUM_SLOTS, SLOT_WORDS = 64, 4096


def wait_stream(stream, deadline_s: float, what: str) -> float:
    """Poll a stream until idle; exit the process (no hang) if it is still busy after `deadline_s`."""
    start = time.perf_counter()
    while True:
        err = cu.cuStreamQuery(stream)[0]
        if int(err) == 0:
            return time.perf_counter() - start
        if err != cu.CUresult.CUDA_ERROR_NOT_READY:
            raise RuntimeError(f"{what}: {err.name}")
        if time.perf_counter() - start > deadline_s:
            print(f"HANG: {what} still running after {deadline_s} s", flush=True)
            os._exit(3)
        time.sleep(0.0005)


class Proof:
    def __init__(self, torch, parts, replays: int):
        self.torch, self.parts, self.replays = torch, parts, replays
        dev = "cuda"
        self.producer = jit.load_kernel(registry.RING_PROOF_PRODUCER, "sm_90a")
        self.consumer = jit.load_kernel(registry.RING_PROOF_CONSUMER, "sm_90a")
        self.checker = jit.load_kernel(registry.RING_PROOF_CHECKER, "sm_90a")
        self.p_ctas = parts.comm_sms
        self.c_ctas = min(NUM_SLOTS, parts.compute_sms)
        self.ring = torch.full((NUM_SLOTS * SLOT_WORDS,), -7, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(2 * NUM_SLOTS, dtype=torch.int32, device=dev)
        self.control = torch.zeros(rp.CONTROL_WORDS, dtype=torch.int32, device=dev)
        self.control[rp.GENERATION] = 1
        self.p_stamps = torch.zeros(2 * self.p_ctas, dtype=torch.int64, device=dev)
        self.c_stamps = torch.zeros(2 * self.c_ctas, dtype=torch.int64, device=dev)
        self.timeline = torch.zeros(replays * rp.TIMELINE_FIELDS, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()

    def consumer_args(self, timeout_ns: int, trap: int):
        return [ptr(self.ring), ptr(self.counters), ptr(self.control), ptr(self.c_stamps), i32(NUM_SLOTS),
                i32(SLOT_WORDS), i64(timeout_ns), i32(trap)]

    def build_graph(self, timeout_ns: int):
        from gc_moe.runtime.graph import ChildGraph

        g = ChildGraph()
        prod = g.add_kernel("producer", self.producer, self.p_ctas,
                            [ptr(self.ring), ptr(self.counters), ptr(self.control), ptr(self.p_stamps),
                             i32(NUM_SLOTS), i32(SLOT_WORDS)], self.parts.comm_context)
        cons = g.add_kernel("consumer", self.consumer, self.c_ctas, self.consumer_args(timeout_ns, 0),
                            self.parts.compute_context)
        g.add_kernel("checker", self.checker, 1,
                     [ptr(self.counters), ptr(self.control), ptr(self.p_stamps), ptr(self.c_stamps),
                      ptr(self.timeline), i32(NUM_SLOTS), i32(self.p_ctas), i32(self.c_ctas),
                      i32(self.replays)], self.parts.compute_context, depends_on=[prod, cons])
        return g

    def control_dict(self):
        c = self.control.cpu().tolist()
        return {"generation": c[rp.GENERATION], "replays_checked": c[rp.REPLAYS_CHECKED],
                "data_mismatches": c[rp.DATA_MISMATCHES], "wait_timeouts": c[rp.WAIT_TIMEOUTS],
                "missing_full": c[rp.MISSING_FULL], "missing_done": c[rp.MISSING_DONE]}

    def host_ring_check(self, generation: int) -> int:
        """Independent host check of the last replay's ring: count of words that differ."""
        torch = self.torch
        s = torch.arange(NUM_SLOTS, dtype=torch.int64).view(-1, 1)
        w = torch.arange(SLOT_WORDS, dtype=torch.int64).view(1, -1)
        expect = (generation * 65599 + s * 4099 + w) & 0xFFFFFFFF
        expect = torch.where(expect >= 2**31, expect - 2**32, expect).to(torch.int32).view(-1)
        return int((self.ring.cpu() != expect).sum())


def overlap_stats(timeline, replays: int) -> dict:
    t = timeline.view(-1, 4).cpu().to(dtype=__import__("torch").int64)[:replays]
    ps, pe, cs, ce = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    overlap = (__import__("torch").minimum(pe, ce) - __import__("torch").maximum(ps, cs)).clamp(min=0).double()
    prod = (pe - ps).double()
    cons = (ce - cs).double()
    frac = overlap / prod.clamp(min=1)
    return {"overlap_ns_median": float(overlap.median()), "overlap_ns_p10": float(overlap.quantile(0.1)),
            "producer_ns_median": float(prod.median()), "consumer_ns_median": float(cons.median()),
            "overlap_of_producer_median": float(frac.median()),
            "replays_with_overlap": int((overlap > 0).sum()), "replays": int(t.shape[0]),
            "root_start_gap_ns_median": float((cs - ps).double().median())}


def run_trap_child(timeout_ns: int) -> None:
    """Child process: consumer alone with trap-on-timeout; the launch must fail, not hang."""
    import torch
    from gc_moe.runtime.partition import get_partitions

    torch.zeros(1, device="cuda")
    parts = get_partitions()
    proof = Proof(torch, parts, replays=1)
    launch(proof.consumer, proof.c_ctas, proof.consumer_args(timeout_ns, 1), parts.compute_stream)
    start = time.perf_counter()
    try:
        wait_stream(parts.compute_stream, 30, "trap child")
        print(json.dumps({"trap_error": None, "seconds": time.perf_counter() - start}))
    except RuntimeError as exc:
        print(json.dumps({"trap_error": str(exc), "seconds": time.perf_counter() - start}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=10000)
    ap.add_argument("--timeout-ms", type=float, default=20.0, help="consumer's bounded wait with no producer")
    ap.add_argument("--out", default="runs/runtime_proof")
    ap.add_argument("--trap-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    timeout_ns = int(args.timeout_ms * 1e6)
    if args.trap_child:
        run_trap_child(timeout_ns)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "replays": args.replays}
    rows: list[tuple[str, str, str]] = []

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
            results[name] = value
            return value
        except Exception as exc:  # noqa: BLE001  (one failing step must not hide the others' results)
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            rows.append((name, "ERROR", f"{type(exc).__name__}: {exc}"[:90]))
            print(results[name]["trace"], flush=True)
            return None
        finally:
            results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 3)

    import torch

    torch.zeros(1, device="cuda")
    env = step("environment", lambda: describe_environment(with_partition=False))
    if env:
        detail = (f"driver {env.get('driver_version')} {env.get('device', {}).get('arch')} "
                  f"{env.get('device', {}).get('sm_count')} SMs; {env.get('workqueue')}"[:90])
        rows.append(("environment", "ok", detail))

    from gc_moe.runtime.partition import get_partitions

    parts = step("partitions", lambda: get_partitions())
    if parts is None:
        return finish(out, results, rows)
    results["partitions"] = parts.describe()
    detail = (f"comm {parts.comm_sms} / compute {parts.compute_sms} SMs; "
              f"workqueue {parts.workqueue_mode}"[:90])
    rows.append(("partitions", "ok", detail))

    proof = step("load", lambda: Proof(torch, parts, args.replays))
    if proof is None:
        return finish(out, results, rows)
    results["load"] = {k.name: {"params": k.params, "cubin": k.entry.cubin_sha256[:16]}
                       for k in (proof.producer, proof.consumer, proof.checker)}
    rows.append(("load", "ok", "3 cubins via cuLibraryLoadData; param layouts match cuKernelGetParamInfo"))

    def replay_graph():
        graph = proof.build_graph(timeout_ns=2_000_000_000)
        graph.instantiate()
        stream = torch.cuda.Stream()
        handle = cu.CUstream(stream.cuda_stream)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        graph.launch(handle)  # warm-up replay 1
        wait_stream(handle, 30, "first replay")
        start.record(stream)
        for _ in range(args.replays - 1):
            graph.launch(handle)
        end.record(stream)
        wall = wait_stream(handle, 120, f"{args.replays} replays")
        ctl = proof.control_dict()
        host_bad = proof.host_ring_check(ctl["generation"] - 1)
        ov = overlap_stats(proof.timeline, args.replays)
        res = {"control": ctl, "host_ring_mismatches": host_bad, "overlap": ov,
               "us_per_replay": start.elapsed_time(end) * 1000 / max(1, args.replays - 1), "wall_s": wall}
        ok = (ctl["replays_checked"] == args.replays and ctl["data_mismatches"] == 0 and ctl["wait_timeouts"] == 0
              and ctl["missing_full"] == 0 and ctl["missing_done"] == 0 and host_bad == 0)
        res["ok"] = ok
        rows.append(("graph replays", "PASS" if ok else "FAIL",
                     (f"{ctl['replays_checked']} checked, {ctl['data_mismatches']} bad words, "
                      f"{ctl['wait_timeouts']} timeouts, {ctl['missing_full']}+{ctl['missing_done']} missing")))
        detail = (f"median {ov['overlap_ns_median'] / 1e3:.1f} us of producer "
                  f"{ov['producer_ns_median'] / 1e3:.1f} us; {ov['replays_with_overlap']}"
                  f"/{ov['replays']} replays overlap")
        rows.append(("root overlap", "info", detail))
        rows.append(("replay time", "info", f"{res['us_per_replay']:.2f} us per replay (events)"))
        proof.graph = graph
        return res

    step("graph_replays", replay_graph)

    def outer_capture():
        g = proof.graph if hasattr(proof, "graph") else proof.build_graph(2_000_000_000)
        before = proof.control_dict()["replays_checked"]
        stream = torch.cuda.Stream()
        outer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(outer, stream=stream):
            g.attach_to_capture(torch.cuda.current_stream())
        for _ in range(100):
            outer.replay()
        torch.cuda.synchronize()
        ctl = proof.control_dict()
        ok = ctl["replays_checked"] - before == 100 and ctl["data_mismatches"] == 0 and ctl["wait_timeouts"] == 0
        rows.append(("outer capture", "PASS" if ok else "FAIL",
                     f"child graph in torch.cuda.graph: {ctl['replays_checked'] - before}/100 replays checked"))
        return {"control": ctl, "checked": ctl["replays_checked"] - before, "ok": ok}

    step("outer_capture", outer_capture)

    def no_producer():
        proof.control[rp.WAIT_TIMEOUTS] = 0
        proof.control[rp.GENERATION] += 1  # a generation nobody publishes
        torch.cuda.synchronize()
        stream = parts.compute_stream
        t0 = time.perf_counter()
        launch(proof.consumer, proof.c_ctas, proof.consumer_args(timeout_ns, 0), stream)
        wall = wait_stream(stream, 30, "consumer without producer")
        elapsed = time.perf_counter() - t0
        ctl = proof.control_dict()
        ok = ctl["wait_timeouts"] == NUM_SLOTS and elapsed < 10 * args.timeout_ms / 1e3 + 1.0
        rows.append(("no producer", "PASS" if ok else "FAIL",
                     (f"{ctl['wait_timeouts']}/{NUM_SLOTS} waits reported timeout; returned in "
                      f"{elapsed * 1e3:.1f} ms (timeout {args.timeout_ms} ms)")))
        return {"control": ctl, "elapsed_s": elapsed, "wait_s": wall, "ok": ok}

    step("no_producer", no_producer)

    def trap_child():
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--trap-child", "--timeout-ms", str(args.timeout_ms)],
                              capture_output=True, text=True, timeout=120, check=False)
        elapsed = time.perf_counter() - t0
        last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        info = json.loads(last[-1]) if last else {}
        ok = bool(info.get("trap_error"))
        rows.append(("trap on timeout", "PASS" if ok else "FAIL",
                     f"child launch failed with {info.get('trap_error')!s:.40} after {info.get('seconds', 0):.3f} s"))
        return {"stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:], "rc": proc.returncode,
                "elapsed_s": elapsed, "info": info, "ok": ok}

    step("trap_child", trap_child)

    def launcher_checks():
        try:
            proof.consumer.pack([ptr(proof.ring)] * 4 + [i32(1), i32(1), i32(5), i32(0)])  # i32 where i64 goes
            refused = False
        except ParamLayoutError as exc:
            refused = str(exc)
        t = torch.empty(256, 128, dtype=torch.bfloat16, device="cuda")
        tmap = encode_tiled_tensor_map(TiledTensorMapSpec("bfloat16", t.data_ptr(), (128, 256), (256,), (64, 64)))
        ok = bool(refused) and tmap.size == 128
        detail = (f"bad layout refused: {bool(refused)}; "
                  f"TMA descriptor {tmap.size} bytes")
        rows.append(("launcher", "PASS" if ok else "FAIL", detail))
        return {"refused": refused, "tmap_bytes": tmap.size, "ok": ok}

    step("launcher", launcher_checks)

    def launch_probe():
        from gc_moe.runtime.graph import ChildGraph, GraphCache, graph_key

        probe = jit.load_kernel(registry.LAUNCH_PROBE, "sm_90a")
        fields = rp.PROBE_FIELDS * rp.PROBE_CLUSTER
        expect = []
        for b in range(rp.PROBE_CLUSTER):
            expect += [rp.expected_probe_checksum(b), b, rp.PROBE_CLUSTER, 4 * rp.PROBE_SMEM_WORDS]
        out = torch.zeros(fields, dtype=torch.int32, device="cuda")
        launch(probe, rp.PROBE_CLUSTER, [ptr(out)], parts.compute_stream)
        wait_stream(parts.compute_stream, 30, "launch probe")
        direct = out.cpu().tolist()
        out.zero_()
        cache = GraphCache()
        key = graph_key([(probe, rp.PROBE_CLUSTER, [ptr(out)])], parts.describe())

        def build():
            g = ChildGraph()
            g.add_kernel("probe", probe, rp.PROBE_CLUSTER, [ptr(out)], parts.comm_context)
            return g

        g1 = cache.get_or_build(key, build)
        g2 = cache.get_or_build(graph_key([(probe, rp.PROBE_CLUSTER, [ptr(out)])], parts.describe()), build)
        g1.launch(parts.comm_stream)
        wait_stream(parts.comm_stream, 30, "launch probe graph")
        in_graph = out.cpu().tolist()
        ok = direct == expect and in_graph == expect and g1 is g2 and len(cache) == 1
        rows.append(("cluster + smem", "PASS" if ok else "FAIL",
                     (f"2-CTA cluster, 64 KiB dynamic smem: direct {direct == expect}, "
                      f"graph node {in_graph == expect}, graph cache hit {g1 is g2}")))
        return {"expect": expect, "direct": direct, "graph": in_graph, "ok": ok}

    step("launch_probe", launch_probe)

    def workspace():
        import torch.distributed as dist
        from gc_moe.runtime.workspace import Region, SymmetricWorkspace, WorkspaceLayout

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
        layout = WorkspaceLayout([Region("x", "float8_e4m3fn", (256, 7168)), Region("topk_idx", "int64", (256, 8)),
                                  Region("signals", "int32", (1024,))])
        ws = SymmetricWorkspace(layout)
        ws.signals.fill_(3)
        desc = ws.peer_descriptor()
        ok = (len(desc) == 592 and ws.peer_bases[0] == ws.base and int(ws.signals.sum()) == 3 * 1024
              and ws.signals.data_ptr() == ws.base + layout.offsets["signals"])
        rows.append(("workspace", "PASS" if ok else "FAIL",
                     f"world {ws.world_size}, {layout.total_bytes} B, descriptor {len(desc)} B"))
        return {"table": layout.table(), "world": ws.world_size, "ok": ok}

    step("workspace", workspace)
    return finish(out, results, rows)


def finish(out: Path, results: dict, rows) -> int:
    (out / "runtime_proof.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n| step | result | detail |\n| --- | --- | --- |")
    for name, status, detail in rows:
        print(f"| {name} | {status} | {detail} |")
    failed = [r for r in rows if r[1] in ("FAIL", "ERROR")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
