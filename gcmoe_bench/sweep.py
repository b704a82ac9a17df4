"""The sweep driver: profile -> workloads -> operators -> protocol -> results, on every rank of the job.

Every rank walks the same plan in the same order (models, suites, tokens per rank, the suite's baseline first and
then its operators; with `--operators` only those named), so the collectives inside the protocol line up. Rank 0
owns the run directory and the progress display; the other ranks are quiet.

An operator that is not available, or whose ``prepare`` raises ``OperatorUnavailable``, on any rank is skipped at
that point on every rank (its row says why, naming the rank); the sweep goes on. Any other error stops every rank.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gcmoe_bench import distributed, protocol, results
from gcmoe_bench.distributed import DistContext, agree_on_unavailable
from gcmoe_bench.env import environment, invocation_command, local_device_info
from gcmoe_bench.gate import GateError, run_gate
from gcmoe_bench.models import ModelShape
from gcmoe_bench.operators import OperatorUnavailable, get_operator
from gcmoe_bench.profiles import Profile, SuiteSpec
from gcmoe_bench.results import partition_from_note
from gcmoe_bench.workloads import Weights, Workload, build_weights, build_workload


def gate_step(ctx: DistContext, profile: Profile) -> dict[str, Any] | str:
    """Run the idle gate on each node's local rank 0 before any CUDA context exists; all ranks share the verdict."""
    if profile.device != "cuda":
        return "not applicable (CPU profile)"
    if profile.skip_gate:
        return "skipped (--skip-gate)"
    verdict: dict[str, Any] | str | None = None
    error = None
    if ctx.is_local_main:
        g = profile.gate
        try:
            verdict = run_gate(min_free_mib=g.min_free_mib, samples=g.samples, span_s=g.span_s,
                               max_utilization_percent=g.max_utilization_percent).to_dict()
        except GateError as exc:
            error = str(exc)
    ctx.check_in(error)
    return verdict or "passed on another node's local rank 0"


# the GC-MoE runtime reads its dispatch-partition request from these (one per arch family)
DISPATCH_ENV_VARS = ("GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS")


def apply_dispatch_request(profile: Profile) -> None:
    """Hand the profile's dispatch SM request to the GC-MoE runtime (a profile targets one GPU kind)."""
    if profile.dispatch_sm_request is not None:
        for name in DISPATCH_ENV_VARS:
            os.environ[name] = str(profile.dispatch_sm_request)


# the GC-MoE SM90 layer reads whether its dispatch and W1 graph roots overlap from this ("1" or "0")
OVERLAP_ENV_VAR = "GC_MOE_OVERLAP_ROOTS"


def apply_overlap(profile: Profile) -> None:
    """Hand the profile's overlap switch (on / off) to the GC-MoE runtime for this run."""
    os.environ[OVERLAP_ENV_VAR] = "1" if profile.overlap == "on" else "0"


def _settings(profile: Profile, note: str = "") -> dict[str, Any]:
    """The run settings each points and raw row carries: the dispatch request and the overlap switch of the
    run, and the partition the operator actually ran on where its note says (empty otherwise)."""
    parts = partition_from_note(note)
    return {"dispatch_sm_request": profile.dispatch_sm_request, "overlap": profile.overlap,
            "comm_sms": parts[0] if parts else None, "compute_sms": parts[1] if parts else None}


def _point_row(profile: Profile, model: ModelShape, suite: SuiteSpec, workload: Workload, operator: str,
               **fields: Any) -> dict[str, Any]:
    return {
        "gpu": profile.gpu,
        "model": model.name,
        "suite": suite.name,
        "tokens_per_rank": workload.tokens_per_rank,
        "total_tokens": workload.tokens_per_rank * workload.num_ranks,
        "num_ranks": workload.num_ranks,
        "hidden": model.hidden,
        "intermediate": model.intermediate,
        "num_experts": model.num_experts,
        "topk": model.topk,
        "num_shared_experts": suite.shared_experts,
        "operator": operator,
        "baseline": suite.baseline,
        "assignments": workload.counts.assignments,
        "remote_assignments": workload.counts.remote_assignments,
        "hbm_working_set_bytes": workload.counts.hbm_working_set_bytes,
        "l2_mode": profile.protocol.l2,
        **_settings(profile, fields.get("reason", "") if fields.get("status") == "ok" else ""),
        **fields,
    }


def _raw_rows(profile: Profile, model: ModelShape, suite: SuiteSpec, tokens: int, operator: str,
              m: protocol.Measurement) -> list[dict[str, Any]]:
    rows = []
    for rank, windows in enumerate(m.window_us):
        for window, latency in enumerate(windows):
            rows.append({
                "gpu": profile.gpu, "model": model.name, "suite": suite.name, "tokens_per_rank": tokens,
                "operator": operator, "rank": rank, "window": window,
                "phase": "warmup" if window < m.warmup_windows else "measured", "latency_us": latency,
                "replays_per_window": profile.protocol.replays_per_window, "timing": m.timing,
                "l2_mode": profile.protocol.l2, "copies": m.copies, **_settings(profile, m.note),
            })
    return rows


def _plan(profile: Profile, finished: set[tuple[str, str, int, str]]) -> list[tuple[ModelShape, SuiteSpec, int, list[str]]]:
    plan = []
    for model in profile.models:
        for suite in profile.suites:
            for tokens in profile.tokens_per_rank:
                todo = [op for op in profile.operators_of(suite)
                        if (model.name, suite.name, tokens, op) not in finished]
                if todo:
                    plan.append((model, suite, tokens, todo))
    return plan


def _availability(ctx: DistContext, operator: str) -> tuple[bool, str]:
    """Skipped everywhere if any rank cannot run it (every rank must measure the same operators)."""
    ok, reason = get_operator(operator).available(ctx.device)
    verdicts = ctx.gather_objects((ok, reason))
    for rank, (rank_ok, rank_reason) in enumerate(verdicts):
        if not rank_ok:
            return False, rank_reason if ctx.world_size == 1 else f"rank {rank}: {rank_reason}"
    return True, ""


def _without_speedup(note: str, baseline: str, baseline_reason: str, verb: str = "skipped") -> str:
    why = f"no speedup: baseline {baseline} {verb} ({baseline_reason})"
    return f"{note}; {why}" if note else why


def run_sweep(profile: Profile, *, out_root: Path, resume: Path | None = None,
              console: Console | None = None) -> Path:
    """Run (or resume) a sweep on this rank; returns the run directory. Collective over the torchrun job."""
    return distributed.run_collective(
        profile.device, profile.timeout_s,
        lambda ctx: _run(ctx, profile, out_root=out_root, resume=resume, console=console))


def _run(ctx: DistContext, profile: Profile, *, out_root: Path, resume: Path | None,
         console: Console | None) -> Path:
    """The sweep on this rank; a failure after the run directory exists leaves its traceback there
    (error-rank<r>.log) and env.json's status "failed", then propagates to the one-line report."""
    known: dict[str, Path] = {}
    try:
        return _run_points(ctx, profile, out_root=out_root, resume=resume, console=console, known=known)
    except BaseException as exc:
        if "run_dir" in known:
            distributed.write_traceback(exc, known["run_dir"], ctx.rank)
            if ctx.is_main:
                _mark_failed(known["run_dir"], exc)
        raise


def _mark_failed(run_dir: Path, exc: BaseException) -> None:
    writer = results.RunWriter(run_dir)
    try:
        env = writer.read_env()
    except Exception:  # noqa: BLE001 - no env.json yet: nothing to mark
        return
    env["status"] = "failed"
    env["error"] = f"{type(exc).__name__}: {exc}"
    env["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        writer.write_env(env)
    except OSError:
        pass  # the traceback log and the stderr line still say what failed


def _run_points(ctx: DistContext, profile: Profile, *, out_root: Path, resume: Path | None,
                console: Console | None, known: dict[str, Path]) -> Path:
    console = console or Console(stderr=True)
    quiet = not ctx.is_main
    if profile.num_ranks is not None and profile.num_ranks != ctx.world_size:
        raise ValueError(
            f"profile {profile.gpu!r} (layout {profile.layout!r}) runs on {profile.num_ranks} rank(s) but this job "
            f"has {ctx.world_size}; start it with torchrun --nproc-per-node {profile.num_ranks}"
        )
    for model in profile.models:
        model.experts_per_rank(ctx.world_size)  # a clear error before any work if the experts do not split
    gate_record = gate_step(ctx, profile)
    distributed.bind_device(ctx)
    apply_dispatch_request(profile)
    apply_overlap(profile)

    # ---- the run directory: rank 0 creates (or reopens) it, everyone learns its path
    error = None
    run_dir = None
    if ctx.is_main:
        try:
            if resume is not None:
                writer = results.open_for_resume(resume)
                recorded = writer.read_env().get("world_size")
                if recorded != ctx.world_size:
                    raise ValueError(f"{resume} was measured on {recorded} rank(s); resume it with the same "
                                     f"number (torchrun --nproc-per-node {recorded}), not {ctx.world_size}")
                dropped = writer.prune_unfinished_raw()
                if dropped:
                    console.print(f"resume: dropped {dropped} raw rows of an interrupted point")
                run_dir = writer.run_dir
            else:
                run_dir = results.create_run_dir(out_root, profile.gpu)
        except Exception as exc:  # noqa: BLE001 - every rank must hear about any failure
            error = f"{type(exc).__name__}: {exc}"
    ctx.check_in(error)
    run_dir = Path(ctx.broadcast_from_main(str(run_dir) if run_dir else None))
    known["run_dir"] = run_dir
    writer = results.RunWriter(run_dir)
    finished = writer.finished() if ctx.is_main else {}
    finished = ctx.broadcast_from_main(finished)

    device_info = ctx.gather_objects(local_device_info(ctx.device))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if ctx.is_main:
        command = invocation_command()
        if resume is not None:
            env = writer.read_env()
            env.setdefault("resumed", []).append({"command": command, "started_utc": started, "gate": gate_record})
        else:
            env = environment(ranks=device_info, profile=profile.to_dict(), command=command, gate=gate_record,
                              extra={"world_size": ctx.world_size, "started_utc": started,
                                     "skip_gate": profile.skip_gate})
        env["status"] = "running"
        writer.write_env(env)

    plan = _plan(profile, set(finished))
    windows = profile.protocol.warmup_windows + profile.protocol.measured_windows
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=quiet, transient=False)
    total_windows = windows * sum(len(todo) for *_, todo in plan)
    baseline_latency = {k[:3]: float(r["latency_us"]) for k, r in finished.items()
                        if k[3] == r["baseline"] and r["status"] == "ok"}
    baseline_skipped = {k[:3]: r["reason"] for k, r in finished.items()  # why those points have no speedup
                        if k[3] == r["baseline"] and r["status"] == "skipped"}
    if ctx.is_main:
        console.print(f"sweep {profile.gpu} (layout {profile.layout}) on {ctx.world_size} rank(s): "
                      f"{len(plan)} points to measure -> {run_dir}")
    cache_bytes = protocol.last_level_cache_bytes(ctx.device)
    flusher = protocol.CacheFlusher(ctx.device, profile.protocol.flush_bytes or 2 * cache_bytes)
    weights_cache: dict[str, Weights] = {}
    any_shared = max(s.shared_experts for s in profile.suites)

    with progress if not quiet else nullcontext():
        task = progress.add_task("sweep", total=max(total_windows, 1))
        for model, suite, tokens, todo in plan:
            if model.name not in weights_cache:
                weights_cache.clear()  # one model's weights at a time
                weights_cache[model.name] = build_weights(model, ctx.world_size, ctx.rank, shared_experts=any_shared,
                                                          seed=profile.seed, device=ctx.device)
            workload = build_workload(model, tokens, ctx.world_size, ctx.rank, shared_experts=suite.shared_experts,
                                      weights=weights_cache[model.name], routing=profile.routing,
                                      seed=profile.seed, device=ctx.device)
            point = f"{model.name} {suite.name} T={tokens}"
            key = (model.name, suite.name, tokens)
            runnable, skipped, measured = [], {}, {}  # skipped: operator -> reason
            for operator in todo:
                ok, reason = _availability(ctx, operator)
                if ok:
                    runnable.append(operator)
                else:
                    skipped[operator] = reason
                    progress.advance(task, windows)
            # interleaved: all operators of the point measured together; else one after the other
            groups = [runnable] if profile.protocol.interleave else [[op] for op in runnable]
            for group in groups:
                if not group:
                    continue
                progress.update(task, description=f"{point} {'+'.join(group)}")
                group_measured, unavailable = _measure(ctx, profile, workload, group, flusher, cache_bytes,
                                                       on_window=lambda *_: progress.advance(task, 1))
                measured.update(group_measured)
                skipped.update(unavailable)
                progress.advance(task, windows * len(unavailable))
            # the point's rows, once all of it is known (a skipped baseline leaves the speedups empty, saying why)
            if suite.baseline in measured:
                baseline_latency[key] = measured[suite.baseline].latency_us
            if suite.baseline in skipped:
                baseline_skipped[key] = skipped[suite.baseline]
            base = baseline_latency.get(key)
            outcome = {}  # operator -> (points row, raw rows, console line)
            for operator, reason in skipped.items():
                row = _point_row(profile, model, suite, workload, operator, status="skipped", reason=reason)
                outcome[operator] = (row, [], f"[yellow]skip[/] {point} {operator}: {reason}")
            for operator, m in measured.items():
                note = m.note
                if key in baseline_skipped and operator != suite.baseline:
                    note = _without_speedup(note, suite.baseline, baseline_skipped[key])
                elif suite.baseline not in profile.operators_of(suite):
                    note = _without_speedup(note, suite.baseline, "not among --operators", verb="not measured")
                row = _point_row(
                    profile, model, suite, workload, operator, status="ok", reason=note,
                    latency_us=m.latency_us, rank_medians_us=";".join(f"{v:.3f}" for v in m.rank_medians_us),
                    spread_us=m.spread_us, speedup=(base / m.latency_us) if base else None,
                )
                speed = f" x{base / m.latency_us:.3f}" if base and operator != suite.baseline else ""
                line = f"{point} {operator}: {m.latency_us:.1f} us (spread {m.spread_us:.1f}, {m.timing}){speed}"
                outcome[operator] = (row, _raw_rows(profile, model, suite, tokens, operator, m), line)
            if ctx.is_main:  # the whole point at once, in the suite's order (baseline first)
                for operator in todo:
                    row, raw, line = outcome[operator]
                    writer.append_point(row, raw)
                    progress.console.print(line)

    ctx.check_in(None)
    if ctx.is_main:
        env = writer.read_env()
        env["status"] = "complete"
        env["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        writer.write_env(env)
        console.print(f"done: {run_dir}")
    return run_dir


def _measure(ctx: DistContext, profile: Profile, workload: Workload, operators: list[str],
             flusher: protocol.CacheFlusher, cache_bytes: int,
             on_window) -> tuple[dict[str, protocol.Measurement], dict[str, str]]:
    """Prepare the operators (rotation copies included) on one point's workload and measure them together.
    Returns the measurements and, apart, the operators some rank could not prepare (operator -> reason): those
    are dropped on every rank before any window. Any other prepare error stops every rank."""
    spec = profile.protocol
    copies = 1
    if spec.l2 == "rotate":
        copies = protocol.rotation_copies(cache_bytes, workload.nbytes(), spec.replays_per_window)
        copies = min(ctx.gather_objects(copies))  # identical on every rank, so graphs and windows line up
    error = None
    invocation_sets: dict[str, list] = {}
    unavailable_here: dict[str, str] = {}
    workloads = [workload] + [workload.clone() for _ in range(copies - 1)]
    for operator in operators:
        try:
            invocation_sets[operator] = [get_operator(operator).prepare(w, ctx.data) for w in workloads]
        except OperatorUnavailable as exc:  # a known limitation: recorded as skipped, the sweep goes on
            unavailable_here[operator] = f"prepare: {type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - every rank must hear about any failure
            error = f"{operator}: prepare failed at {workload.model.name} T={workload.tokens_per_rank}: " \
                    f"{type(exc).__name__}: {exc}"
            break
    ctx.check_in(error)
    unavailable = agree_on_unavailable(ctx, unavailable_here)
    for operator in unavailable:
        invocation_sets.pop(operator, None)  # prepared here but not on another rank: nobody measures it
    if not invocation_sets:
        return {}, unavailable
    return protocol.measure_many(invocation_sets, ctx, spec, flusher=flusher, on_window=on_window), unavailable
