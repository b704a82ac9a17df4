"""The ``accuracy`` command: gc_moe.cases.ACCURACY_SUITE through the operators, checked with gc_moe.metrics.

For every case (and shared-expert mode the case asks for) and every model of the profile, each rank builds its
inputs with ``gc_moe.cases.build_case_inputs``, and three outputs are compared:

- the operator's, through the same adapter the sweep measures;
- the float32 expert-parallel reference on the same quantized inputs (processed difference, max abs, rel L2);
- a BF16 forward on the *unquantized* activations and weights (the cosine the paper's thresholds refer to).
  Its weights (``UnquantizedWeights``) are generated once per model and expert in a run and kept on the run's
  device in bfloat16, not regenerated per case.

When the operators include both ``gc`` and ``mega-port``, ``gc``'s row also carries the cosine of its output
against ``mega-port``'s on the same inputs (``versus``, ``versus_cosine``, ``versus_passed``: at least
``VERSUS_COSINE_MIN``), which counts in the verdict.

Each rank checks its own tokens; a case passes when it passes on every rank (the row reports the worst rank).
An operator that is not available, or whose ``prepare`` raises ``OperatorUnavailable``, on any rank is recorded as
``skipped`` for that case on every rank, with the reason. Any other error of an operator (in ``prepare``, the
call or its check) is recorded as ``error`` with the message in ``reason`` and the traceback in
``error-rank<r>.log`` of the run directory; it fails the run, and the suite goes on unless the error left a
rank's device unusable (a kernel fault): then every rank stops after writing the case's rows.
Cases use the Table 4 per-rank capacity (256), whatever the profile's sweep capacity is. Rank 0 prints one
progress line per case (``case i/N``, the model, the operators' verdicts, the elapsed time).
"""

from __future__ import annotations

import dataclasses
import time
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
# (operator, the operator it is cross-checked against) when a run has both: the cosine of their outputs
VERSUS = (("gc", "mega-port"),)
VERSUS_COSINE_MIN = 0.9999


class UnquantizedWeights:
    """The BF16-rounded unquantized weights of one model: expert j's are ``cases.random_expert_weights_float(j, H,
    I, seed=expert_seed)``, the shared expert's ``cases.random_shared_expert_weights_float(H, I, seed=shared_seed)``,
    each generated on the CPU on first use and converted with ``.to(device, bfloat16)``, the same float32 draws
    and the same rounding as generating them afresh. ``keep=True`` keeps them on ``device`` for later calls
    (E x 3 H I x 2 bytes at most: a few GB for the H200 slices); ``keep=False`` regenerates on every use."""

    def __init__(self, hidden: int, intermediate: int, *, expert_seed: int, shared_seed: int | None,
                 device: torch.device | str, keep: bool = True):
        self.hidden, self.intermediate = hidden, intermediate
        self.expert_seed, self.shared_seed = expert_seed, shared_seed
        self.device, self.keep = torch.device(device), keep
        self._experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.generated = 0  # weight sets drawn so far (experts and the shared expert)
        self.seconds = 0.0  # spent drawing and converting them

    @classmethod
    def for_model(cls, model: ModelShape, **kwargs) -> UnquantizedWeights:
        return cls(model.hidden, model.intermediate, **kwargs)

    def _bf16(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(w.to(device=self.device, dtype=torch.bfloat16) for w in pair)

    def _draw(self, make) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        pair = self._bf16(make())
        self.generated += 1
        self.seconds += time.perf_counter() - started
        return pair

    def expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [2I, H], w2 [H, I]) of global expert ``expert``, bfloat16 on the device."""
        from gc_moe import cases

        pair = self._experts.get(expert)
        if pair is None:
            pair = self._draw(lambda: cases.random_expert_weights_float(expert, self.hidden, self.intermediate,
                                                                        seed=self.expert_seed))
            if self.keep:
                self._experts[expert] = pair
        return pair

    def shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [2I, H], w2 [H, I]) of the shared expert, bfloat16 on the device."""
        from gc_moe import cases

        if self.shared_seed is None:
            raise ValueError("these unquantized weights were made without a shared-expert seed")
        pair = self._shared
        if pair is None:
            pair = self._draw(lambda: cases.random_shared_expert_weights_float(self.hidden, self.intermediate,
                                                                               seed=self.shared_seed))
            if self.keep:
                self._shared = pair
        return pair

    @property
    def kept_bytes(self) -> int:
        pairs = list(self._experts.values()) + ([self._shared] if self._shared is not None else [])
        return sum(w.numel() * w.element_size() for pair in pairs for w in pair)

    def describe(self) -> str:
        experts = len(self._experts)
        shared = " + the shared expert" if self._shared is not None else ""
        return (f"unquantized BF16 weights: {experts} experts{shared}, {self.kept_bytes / 2**30:.2f} GiB on "
                f"{self.device}, drawn in {self.seconds:.1f} s")


def unquantized_forward(hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        model: ModelShape, *, expert_seed: int, shared_seed: int | None,
                        weights: UnquantizedWeights | None = None) -> torch.Tensor:
    """Eq. (1) with BF16-rounded unquantized activations and weights, accumulated in float32 -> bf16 [T, H].
    Only the experts these tokens use are touched (expert j's float weights are the same on every rank).
    ``weights``: a run's ``UnquantizedWeights`` (same seeds, on topk_idx's device) to draw each expert once;
    None draws them afresh for this call only. Both give the same bits."""
    from gc_moe.reference import swiglu

    device = topk_idx.device
    if weights is None:
        weights = UnquantizedWeights(model.hidden, model.intermediate, expert_seed=expert_seed,
                                     shared_seed=shared_seed, device=device, keep=False)
    elif (weights.expert_seed != expert_seed or (shared_seed is not None and weights.shared_seed != shared_seed)
          or (weights.hidden, weights.intermediate) != (model.hidden, model.intermediate)
          or weights.device != device):
        raise ValueError(f"unquantized weights for H={weights.hidden}, I={weights.intermediate}, seeds "
                         f"{weights.expert_seed}/{weights.shared_seed} on {weights.device}; this call needs "
                         f"H={model.hidden}, I={model.intermediate}, seeds {expert_seed}/{shared_seed} on {device}")

    x = hidden_states.to(device=device, dtype=torch.bfloat16).float()
    y = torch.zeros(x.shape[0], model.hidden, device=device)
    for expert in sorted(set(topk_idx[topk_idx >= 0].tolist())):
        w1, w2 = weights.expert(expert)
        rows, slots = (topk_idx == expert).nonzero(as_tuple=True)
        act = swiglu(x[rows] @ w1.float().T, alpha=model.activation_alpha, clamp=model.activation_clamp)
        y.index_add_(0, rows, topk_weights[rows, slots, None] * (act @ w2.float().T))
    if shared_seed is not None:
        s1, s2 = weights.shared()
        act = swiglu(x @ s1.float().T, alpha=model.activation_alpha, clamp=model.activation_clamp)
        y += act @ s2.float().T
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
    """The suite on this rank; a failure after the run directory exists leaves its traceback there
    (error-rank<r>.log) and the run marked failed in env.json, then propagates to the one-line report."""
    known: dict[str, Path] = {}
    try:
        return _run_cases(ctx, profile, out_root, operators, case_filter, console, into, known)
    except BaseException as exc:
        if "run_dir" in known:
            if not getattr(exc, distributed.TRACEBACK_LOG, None):
                distributed.write_traceback(exc, known["run_dir"], ctx.rank)
            if ctx.is_main:
                _mark_failed(known["run_dir"], exc, into is not None)
        raise


def _mark_failed(run_dir: Path, exc: BaseException, into: bool) -> None:
    writer = results.RunWriter(run_dir)
    try:
        env = writer.read_env()
    except Exception:  # noqa: BLE001 - no env.json yet: nothing to mark
        return
    finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
    error = f"{type(exc).__name__}: {exc}"
    if into:  # a sweep's env.json: only its accuracy record says that the accuracy run failed
        env["accuracy"] = {**env.get("accuracy", {}), "status": "failed", "error": error, "finished_utc": finished}
    else:
        env.update(status="failed", error=error, finished_utc=finished)
    try:
        writer.write_env(env)
    except OSError:
        pass  # the traceback log and the stderr line still say what failed


def _say(console: Console, text: str, style: str | None = None) -> None:
    """One line as written (no markup: case names and errors may hold brackets; no wrapping: one line a case)."""
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def _suite_units(suite, models) -> int:
    return len(models) * sum(len(case.shared_modes()) for case in suite)


def _run_cases(ctx, profile: Profile, out_root: Path, operators: list[str], case_filter: list[str] | None,
               console: Console, into: Path | None, known: dict[str, Path]) -> bool:
    from gc_moe import cases

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
    known["run_dir"] = run_dir
    versus = [(op, other) for op, other in VERSUS if op in operators and other in operators]
    total = _suite_units(suite, profile.models)
    if ctx.is_main:
        _say(console, f"accuracy: {len(suite)} cases x {len(profile.models)} model(s) x {operators} "
                      f"on {ctx.world_size} rank(s) = {total} case runs -> {run_dir}")

    all_passed = True
    clock = time.perf_counter()
    done = 0
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
        unquantized = UnquantizedWeights.for_model(model, expert_seed=expert_seed, shared_seed=shared_seed,
                                                   device=ctx.device)
        for case in suite:
            for with_shared in case.shared_modes():
                case_clock = time.perf_counter()
                rows, broken = _run_case(ctx, run_dir, model, case, with_shared, operators, availability, versus,
                                         weights, unquantized, expert_seed, shared_seed)
                done += 1
                if ctx.is_main:
                    writer.append_accuracy(rows)
                    now = time.perf_counter()
                    verdicts = ", ".join(f"{row['operator']} {_verdict(row)}" for row in rows)
                    _say(console, f"case {done}/{total} {model.name} {case.name} shared={int(with_shared)}: "
                                  f"{verdicts} ({now - case_clock:.1f} s, elapsed {now - clock:.0f} s)")
                    for row in rows:
                        if _row_fails(row):
                            all_passed = False
                            _say(console, f"FAIL {model.name} {case.name} shared={with_shared} {row['operator']}: "
                                          f"{_failure_text(row)}", style="red")
                if broken:
                    raise RuntimeError(f"stopping: {broken}")
        if ctx.is_main:
            _say(console, f"{model.name}: done ({unquantized.describe()})")
        del unquantized, weights, l1, l2, shared
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
        _say(console, f"accuracy {'passed' if all_passed else 'FAILED'}: {writer.accuracy_path}")
    return all_passed


def _run_case(ctx, run_dir: Path, model: ModelShape, case, with_shared: bool, operators: list[str],
              availability: dict[str, tuple[bool, str]], versus: list[tuple[str, str]], weights: Weights,
              unquantized: UnquantizedWeights, expert_seed: int, shared_seed: int) -> tuple[list[dict], str]:
    """One case in one shared mode through every operator (collective). Returns the rows (the same on every
    rank) and, when an operator's error left some rank's device unusable, why (the later operators do not run)."""
    from gc_moe import cases, metrics
    from gc_moe.reference import moe_reference_ep

    inputs = cases.build_case_inputs(case, model, ctx.world_size, ctx.rank, shared=with_shared)
    y_ref = moe_reference_ep(
        ctx.data, inputs.x.to(ctx.device), inputs.x_sf.to(ctx.device), inputs.topk_idx.to(ctx.device),
        inputs.topk_weights.to(ctx.device), weights.l1, weights.l2, num_experts=model.num_experts,
        activation_alpha=model.activation_alpha, activation_clamp=model.activation_clamp,
        shared_weights=weights.shared if with_shared else None).cpu()
    y_unq = unquantized_forward(inputs.hidden_states, inputs.topk_idx.to(ctx.device),
                                inputs.topk_weights.to(ctx.device), model, expert_seed=expert_seed,
                                shared_seed=shared_seed if with_shared else None, weights=unquantized)
    workload = _case_workload(model, inputs, weights, ctx.world_size, ctx.rank, ctx.device)
    where = f"{model.name} {case.name} shared={int(with_shared)}"
    rows, outputs, broken = [], {}, ""
    for op in operators:
        ok, reason = availability[op]
        check, invocation, error_here, unavailable_here, note = None, None, None, {}, ""
        errors: dict[str, str] = {}
        if ok:
            try:
                invocation = get_operator(op).prepare(workload, ctx.data)
            except OperatorUnavailable as exc:  # a known limitation: skipped on every rank
                unavailable_here[op] = f"prepare: {type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - recorded in its row, every rank hears about it
                error_here = _record_error(exc, run_dir, ctx.rank, f"{op} on {where}: prepare")
            unavailable = agree_on_unavailable(ctx, unavailable_here)
            errors = agree_on_unavailable(ctx, {op: error_here} if error_here else {})
            if op in unavailable:
                ok, reason, invocation = False, unavailable[op], None
            if op in errors:
                invocation = None  # no rank calls it: a rank without a prepared call would leave the others waiting
        if invocation is not None:
            note = invocation.note  # how it ran (e.g. the gc_moe backend): kept in the row's reason
            try:
                invocation()  # collective: ranks without tokens take part too
                y = invocation.output.cpu()
                outputs[op] = y
                if inputs.num_tokens:
                    check = dataclasses.asdict(metrics.check_accuracy(y, y_ref, with_shared, y_unquantized=y_unq))
                else:
                    check = {"numel": 0}
            except Exception as exc:  # noqa: BLE001 - recorded in its row, every rank hears about it
                error_here = _record_error(exc, run_dir, ctx.rank, f"{op} on {where}")
                outputs.pop(op, None)
        unusable = _device_unusable(ctx.device) if error_here else ""
        gathered = ctx.gather_objects({"check": check, "error": error_here, "unusable": unusable})
        invocation = None  # its buffers go before the next operator prepares
        failed = [(rank, g["error"]) for rank, g in enumerate(gathered) if g["error"]]
        if failed and not errors:  # the call failed (a prepare error is merged already)
            errors = {op: "; ".join(m if ctx.world_size == 1 else f"rank {r}: {m}" for r, m in failed)}
        rows.append(_accuracy_row(case, model, ctx.world_size, with_shared, op, ok, reason,
                                  [g["check"] for g in gathered], errors.get(op), note=note))
        lost = [(rank, g["unusable"]) for rank, g in enumerate(gathered) if g["unusable"]]
        if lost:
            broken = (f"{op} on {where} left the device of " + "; ".join(f"rank {r} unusable ({m})" for r, m in lost)
                      + "; the rows so far are in accuracy.csv, the tracebacks in error-rank<r>.log")
            break
    for op, other in versus:
        _add_versus(ctx, rows, outputs, op, other, inputs.num_tokens)
    return rows, broken


def _record_error(exc: BaseException, run_dir: Path, rank: int, what: str) -> str:
    """The one-line error of an operator for its row; the traceback goes to run_dir/error-rank<r>.log."""
    path = distributed.write_traceback(exc, run_dir, rank)
    where = f" (traceback: {path.name})" if path else ""
    return f"{what}: {type(exc).__name__}: {_one_line(exc)}{where}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _device_unusable(device: torch.device) -> str:
    """"" when the device still works after an error, else why not (a kernel fault poisons the CUDA context)."""
    if device.type != "cuda":
        return ""
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
    except Exception as exc:  # noqa: BLE001 - the answer is the message
        return f"{type(exc).__name__}: {_one_line(exc)}"
    return ""


def _add_versus(ctx, rows: list[dict], outputs: dict[str, torch.Tensor], op: str, other: str,
                num_tokens: int) -> None:
    """Fill op's row with the cosine of its output against other's on the same inputs (worst rank), when both
    ran on every rank; otherwise say why there is no comparison. Collective when both ran."""
    from gc_moe import metrics

    row = next((r for r in rows if r["operator"] == op), None)
    if row is None:  # the case stopped before op ran
        return
    row["versus"] = other
    other_row = next((r for r in rows if r["operator"] == other), None)
    if row["status"] != "ok" or other_row is None or other_row["status"] != "ok":
        if row["status"] == "ok":
            note = f"not compared with {other} ({'not run' if other_row is None else other_row['status']})"
            row["reason"] = f"{row['reason']}; {note}" if row["reason"] else note
        return
    mine = metrics.cosine(outputs[op], outputs[other]) if num_tokens else None
    cosines = [c for c in ctx.gather_objects(mine) if c is not None]
    if not cosines:
        row["versus_passed"] = True
        return
    row["versus_cosine"] = min(cosines)
    row["versus_passed"] = bool(row["versus_cosine"] >= VERSUS_COSINE_MIN)  # NaN fails


def _row_fails(row: dict[str, Any]) -> bool:
    return row["status"] == "error" or (row["status"] == "ok" and (row.get("passed") is False
                                                                   or row.get("versus_passed") is False))


def _verdict(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return row["status"]
    return "FAIL" if _row_fails(row) else "pass"


def _failure_text(row: dict[str, Any]) -> str:
    if row["status"] == "error":
        return row["reason"]
    parts = []
    if row.get("passed") is False:
        parts.append(f"cosine {row['cosine']:.6f}, processed diff {row['processed_diff']:.3e}")
    if row.get("versus_passed") is False:
        parts.append(f"cosine against {row['versus']} {row['versus_cosine']:.7f} < {VERSUS_COSINE_MIN}")
    return "; ".join(parts)


def _accuracy_row(case, model: ModelShape, num_ranks: int, shared: bool, op: str, ok: bool, reason: str,
                  verdicts: list[dict | None], error: str | None = None, note: str = "") -> dict[str, Any]:
    row = {"case": case.name, "category": case.category, "model": model.name, "num_ranks": num_ranks,
           "tokens_per_rank": ";".join(map(str, case.tokens_per_rank(num_ranks, model.capacity))),
           "shared_experts": int(shared), "operator": op, "reference": "reference"}
    if error:
        return {**row, "status": "error", "passed": False, "reason": error}
    if not ok:
        return {**row, "status": "skipped", "reason": reason}
    # the worst rank speaks for the case; ranks without tokens have nothing to compare (numel 0)
    checked = [v for v in verdicts if v is not None and v["numel"] > 0]
    if not checked:
        return {**row, "status": "ok", "passed": True,
                "reason": "no tokens on any rank" + (f"; {note}" if note else "")}
    return {
        **row, "status": "ok", "reason": note,
        "cosine": min(v["cosine"] for v in checked),
        "processed_diff": max(v["processed_diff"] for v in checked),
        "max_abs_err": max(v["max_abs_err"] for v in checked),
        "rel_l2": max(v["rel_l2"] for v in checked),
        "passed": all(v["passed"] for v in checked),
    }
