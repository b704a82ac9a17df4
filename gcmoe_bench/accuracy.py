"""The ``accuracy`` command: gc_moe.cases.ACCURACY_SUITE through the operators, checked with gc_moe.metrics.

For every case (and shared-expert mode the case asks for) and every model of the profile, each rank builds its
inputs with ``gc_moe.cases.build_case_inputs``, and three outputs are compared:

- the operator's, through the same adapter the sweep measures;
- the float32 expert-parallel reference on the same quantized inputs (processed difference, max abs, rel L2);
- a BF16 forward on the *unquantized* activations and weights (the cosine the paper's thresholds refer to).

Each rank checks its own tokens; a case passes when it passes on every rank (the row reports the worst rank).
An operator that is not available, or whose ``prepare`` raises ``OperatorUnavailable``, on any rank is recorded as
``skipped`` for that case on every rank, with the reason; any other error stops every rank.
Cases use the Table 4 per-rank capacity (256), whatever the profile's sweep capacity is.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from gcmoe_bench import distributed, results
from gcmoe_bench.distributed import agree_on_unavailable
from gcmoe_bench.env import environment, invocation_command, local_device_info
from gcmoe_bench.models import ModelShape, table4_models
from gcmoe_bench.operators import OperatorUnavailable, get_operator
from gcmoe_bench.profiles import Profile
from gcmoe_bench.workloads import Weights, Workload, WorkloadCounts, shared_recipe, stable_seed

DEFAULT_OPERATORS = ("gc", "gc-unfused")


def unquantized_forward(hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        model: ModelShape, *, expert_seed: int, shared_seed: int | None) -> torch.Tensor:
    """Eq. (1) with BF16-rounded unquantized activations and weights, accumulated in float32 -> bf16 [T, H].
    Only the experts these tokens use are generated (expert j's float weights are the same on every rank)."""
    from gc_moe import cases
    from gc_moe.reference import swiglu

    device = topk_idx.device

    def bf16(w: torch.Tensor) -> torch.Tensor:
        return w.to(device=device, dtype=torch.bfloat16).float()

    x = bf16(hidden_states)
    y = torch.zeros(x.shape[0], model.hidden, device=device)
    for expert in sorted(set(topk_idx[topk_idx >= 0].tolist())):  # one expert's float weights at a time
        w1, w2 = cases.random_expert_weights_float(expert, model.hidden, model.intermediate, seed=expert_seed)
        rows, slots = (topk_idx == expert).nonzero(as_tuple=True)
        act = swiglu(x[rows] @ bf16(w1).T, alpha=model.activation_alpha, clamp=model.activation_clamp)
        y.index_add_(0, rows, topk_weights[rows, slots, None] * (act @ bf16(w2).T))
    if shared_seed is not None:
        s1, s2 = cases.random_shared_expert_weights_float(model.hidden, model.intermediate, seed=shared_seed)
        act = swiglu(x @ bf16(s1).T, alpha=model.activation_alpha, clamp=model.activation_clamp)
        y += act @ bf16(s2).T
    return y.to(torch.bfloat16).cpu()


def _case_workload(model: ModelShape, inputs: Any, weights: Weights, num_ranks: int, rank: int,
                   device: torch.device) -> Workload:
    return Workload(
        model=dataclasses.replace(model, topk=inputs.topk), tokens_per_rank=inputs.num_tokens,
        num_ranks=num_ranks, rank=rank, shared_experts=int(inputs.shared),
        x=inputs.x.to(device), x_sf=inputs.x_sf.to(device), topk_idx=inputs.topk_idx.to(device),
        topk_weights=inputs.topk_weights.to(device),
        weights=weights if inputs.shared else dataclasses.replace(weights, shared=None),
        counts=WorkloadCounts(0, 0, 0),
    )


def run_accuracy(profile: Profile, *, out_root: Path, operators: list[str] | None = None,
                 case_filter: list[str] | None = None, console: Console | None = None,
                 into: Path | None = None) -> bool:
    """Run the suite on this rank (collective); rank 0 writes accuracy.csv, in a new run directory under
    ``out_root`` or, with ``into``, beside the points of an existing sweep run (which must have no accuracy.csv).
    Returns True when every case passed."""
    return distributed.run_collective(
        profile.device, profile.timeout_s,
        lambda ctx: _run(ctx, profile, out_root, list(operators or DEFAULT_OPERATORS), case_filter,
                         console or Console(stderr=True), into))


def _run(ctx, profile: Profile, out_root: Path, operators: list[str], case_filter: list[str] | None,
         console: Console, into: Path | None) -> bool:
    from gc_moe import cases, metrics
    from gc_moe.reference import moe_reference_ep

    for op in operators:
        get_operator(op)  # unknown names fail before any work
    suite = [c for c in cases.ACCURACY_SUITE
             if not case_filter or c.name in case_filter or c.category in case_filter]
    if not suite:
        raise ValueError(f"--cases {case_filter} selects no case; names and categories are listed in "
                         f"gc_moe.cases.ACCURACY_SUITE (categories: default, boundary, asymmetric)")
    distributed.bind_device(ctx)
    error, run_dir = None, None
    if ctx.is_main:
        try:
            if into is None:
                run_dir = results.create_run_dir(out_root, profile.gpu)
            else:
                run_dir = results.open_for_resume(into).run_dir
                if (run_dir / "accuracy.csv").exists():
                    raise results.RunDirError(f"{run_dir} already has an accuracy.csv; results are never overwritten")
        except (OSError, results.RunDirError) as exc:
            error = f"cannot use the run directory: {exc}"
    ctx.check_in(error)
    run_dir = Path(ctx.broadcast_from_main(str(run_dir) if run_dir else None))
    writer = results.RunWriter(run_dir)
    device_info = ctx.gather_objects(local_device_info(ctx.device))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if ctx.is_main and into is None:
        writer.write_env(environment(
            ranks=device_info, profile=profile.to_dict(), command=invocation_command(), gate="not run (accuracy)",
            extra={"world_size": ctx.world_size, "command_kind": "accuracy", "operators": operators,
                   "started_utc": started}))
    if ctx.is_main:
        console.print(f"accuracy: {len(suite)} cases x {len(profile.models)} model(s) x {operators} "
                      f"on {ctx.world_size} rank(s) -> {run_dir}")

    all_passed = True
    availability = {op: get_operator(op).available(ctx.device) for op in operators}
    for model in profile.models:
        model = dataclasses.replace(model, capacity=table4_models()[model.base].capacity)
        expert_seed = cases.SUITE_WEIGHT_SEED
        shared_seed = stable_seed(cases.SUITE_WEIGHT_SEED, model.name, "shared")
        l1, l2 = cases.random_moe_weights(model.num_experts, model.hidden, model.intermediate, seed=expert_seed,
                                          experts=cases.local_experts(model.num_experts, ctx.world_size, ctx.rank),
                                          device=ctx.device)
        shared = cases.random_shared_expert_weights(model.hidden, model.intermediate, seed=shared_seed,
                                                    recipe=shared_recipe(model), device=ctx.device)
        weights = Weights(l1=l1, l2=l2, shared=shared)
        for case in suite:
            for with_shared in case.shared_modes():
                inputs = cases.build_case_inputs(case, model, ctx.world_size, ctx.rank, shared=with_shared)
                y_ref = moe_reference_ep(
                    ctx.data, inputs.x.to(ctx.device), inputs.x_sf.to(ctx.device), inputs.topk_idx.to(ctx.device),
                    inputs.topk_weights.to(ctx.device), l1, l2, num_experts=model.num_experts,
                    activation_alpha=model.activation_alpha, activation_clamp=model.activation_clamp,
                    shared_weights=shared if with_shared else None).cpu()
                y_unq = unquantized_forward(inputs.hidden_states, inputs.topk_idx.to(ctx.device),
                                            inputs.topk_weights.to(ctx.device), model,
                                            expert_seed=expert_seed, shared_seed=shared_seed if with_shared else None)
                workload = _case_workload(model, inputs, weights, ctx.world_size, ctx.rank, ctx.device)
                rows = []
                for op in operators:
                    ok, reason = availability[op]
                    error, check, invocation, unavailable_here = None, None, None, {}
                    if ok:
                        try:
                            invocation = get_operator(op).prepare(workload, ctx.data)
                        except OperatorUnavailable as exc:  # a known limitation: skipped on every rank
                            unavailable_here[op] = f"prepare: {type(exc).__name__}: {exc}"
                        except Exception as exc:  # noqa: BLE001 - every rank must hear about it
                            error = f"{op} on case {case.name}: prepare: {type(exc).__name__}: {exc}"
                        ctx.check_in(error)
                        unavailable = agree_on_unavailable(ctx, unavailable_here)
                        if op in unavailable:
                            ok, reason, invocation = False, unavailable[op], None
                    if invocation is not None:
                        try:
                            invocation()  # collective: ranks without tokens take part too
                            if inputs.num_tokens:
                                check = dataclasses.asdict(metrics.check_accuracy(
                                    invocation.output.cpu(), y_ref, with_shared, y_unquantized=y_unq))
                            else:
                                check = {"numel": 0}
                        except Exception as exc:  # noqa: BLE001 - every rank must hear about it
                            error = f"{op} on case {case.name}: {type(exc).__name__}: {exc}"
                    ctx.check_in(error)
                    verdicts = ctx.gather_objects(check)
                    rows.append(_accuracy_row(case, model, ctx.world_size, inputs, with_shared, op, ok, reason,
                                              verdicts))
                if ctx.is_main:
                    writer.append_accuracy(rows)
                    for row in rows:
                        if row["status"] == "ok" and row["passed"] is False:
                            all_passed = False
                            console.print(f"[red]FAIL[/] {model.name} {case.name} shared={with_shared} "
                                          f"{row['operator']}: cosine {row['cosine']:.6f}, "
                                          f"processed diff {row['processed_diff']:.3e}")
        console.print(f"{model.name}: done") if ctx.is_main else None
    all_passed = ctx.broadcast_from_main(all_passed)
    if ctx.is_main:
        env = writer.read_env()
        finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if into is None:
            env.update(status="complete", all_passed=all_passed, finished_utc=finished)
        else:  # a sweep's env.json: record the accuracy run beside it, change nothing else
            env["accuracy"] = {"command": invocation_command(), "world_size": ctx.world_size, "operators": operators,
                               "all_passed": all_passed, "started_utc": started, "finished_utc": finished}
        writer.write_env(env)
        console.print(f"accuracy {'passed' if all_passed else 'FAILED'}: {writer.accuracy_path}")
    return all_passed


def _accuracy_row(case, model: ModelShape, num_ranks: int, inputs, shared: bool, op: str, ok: bool, reason: str,
                  verdicts: list[dict | None]) -> dict[str, Any]:
    row = {"case": case.name, "category": case.category, "model": model.name, "num_ranks": num_ranks,
           "tokens_per_rank": ";".join(map(str, case.tokens_per_rank(num_ranks, model.capacity))),
           "shared_experts": int(shared), "operator": op, "reference": "reference"}
    if not ok:
        return {**row, "status": "skipped", "reason": reason}
    # the worst rank speaks for the case; ranks without tokens have nothing to compare (numel 0)
    checked = [v for v in verdicts if v is not None and v["numel"] > 0]
    if not checked:
        return {**row, "status": "ok", "passed": True, "reason": "no tokens on any rank"}
    return {
        **row, "status": "ok", "reason": "",
        "cosine": min(v["cosine"] for v in checked),
        "processed_diff": max(v["processed_diff"] for v in checked),
        "max_abs_err": max(v["max_abs_err"] for v in checked),
        "rel_l2": max(v["rel_l2"] for v in checked),
        "passed": all(v["passed"] for v in checked),
    }
