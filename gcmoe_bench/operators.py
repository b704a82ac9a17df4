"""One adapter interface for every operator the sweep measures, and the registry of them.

An adapter says whether it can run on a device (``available``) and turns one rank's workload into a zero-argument
callable that performs one invocation (``prepare``).  The protocol treats every adapter the same: it captures the
callable in a CUDA graph (unless the invocation says it synchronizes with the host: then it is called directly and
raw.csv records ``cuda-eager``), and times it.  An adapter that is not available is recorded by the sweep as
``skipped`` with its reason, never silently dropped; so is one whose ``prepare`` raises ``OperatorUnavailable``
(a known limitation found only while setting up, e.g. a package version whose buffer allocation fails).

| name         | role      | what it runs                                                                   |
| ------------ | --------- | ------------------------------------------------------------------------------ |
| reference    | reference | the float32 expert-parallel reference (gc_moe.reference.moe_reference_ep)      |
| gc           | operator  | gc_moe.fp8_fp4_gc_moe (public API), shared expert fused when the suite has one |
| gc-unfused   | operator  | gc_moe.fp8_fp4_gc_moe routed, plus the shared expert run separately            |
| mega-port    | baseline  | the SM90 port of Mega MoE (H20/H200), separate shared-expert kernel after it   |
| deepgemm     | baseline  | DeepGEMM's fp8_fp4_mega_moe (SM100 family), its fused shared-expert mode;      |
|              |           | on SM90 sgl-deep-gemm's fp8_mega_moe (FP8 weights), an external Hopper anchor  |
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from gcmoe_bench.workloads import Workload

RECIPE = (1, 1, 32)
ACTIVATION = "swiglu"


class OperatorUnavailable(RuntimeError):
    """Raised by ``prepare`` when this operator cannot run here for a known, external reason (the installed package
    cannot set up its buffers on this job, say).  The harness records the operator as ``skipped`` with this message
    on every rank and goes on; any other exception from ``prepare`` is a defect and stops the run.

    Raise it before the first collective of ``prepare`` where possible: the other ranks may be waiting in one."""


class Invocation:
    """One prepared operator call: ``invocation()`` runs it and writes ``invocation.output`` (bf16 [T, H]) in place."""

    def __init__(self, run: Callable[[], Any], output: torch.Tensor, keep_alive: tuple = (), *,
                 capturable: bool = True, note: str = ""):
        self._run = run
        self.output = output
        self.note = note  # what results should say about how it ran (e.g. which gc_moe backend)
        self.capturable = capturable  # False: the call synchronizes with the host, so it runs eagerly
        self._keep_alive = keep_alive  # buffers the call reads: they must outlive any graph that captured it

    def __call__(self) -> None:
        self._run()


class OperatorAdapter(ABC):
    """The interface the protocol measures.  Subclasses set the class attributes and the two methods."""

    name: str = ""
    role: str = "operator"  # "operator", "baseline" or "reference": its natural place in a suite
    summary: str = ""

    @abstractmethod
    def available(self, device: torch.device) -> tuple[bool, str]:
        """(True, "") when it can run on ``device``; otherwise (False, the reason, naming what is missing)."""

    @abstractmethod
    def prepare(self, workload: Workload, group: Any) -> Invocation:
        """Allocate buffers, transform weights and stage the inputs; return one invocation.  Collective over ``group``.
        Raises ``OperatorUnavailable`` when a known limitation stops it (recorded as skipped, not a failure)."""


def _missing_module(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module} does not import ({exc})"
    return None


def _reference_ep() -> Callable[..., torch.Tensor]:
    from gc_moe import reference

    return reference.moe_reference_ep


def _shared_expert_output(workload: Workload) -> torch.Tensor:
    """The shared expert alone (bf16 [T, H]), as a separate kernel would compute it: the reference layer with every
    routed slot empty, so only the shared expert contributes."""
    from gc_moe import reference

    w = workload.weights
    no_routes = torch.full_like(workload.topk_idx, -1)
    return reference.moe_reference(
        workload.x, workload.x_sf, no_routes, torch.zeros_like(workload.topk_weights), w.l1, w.l2,
        activation_alpha=workload.model.activation_alpha, activation_clamp=workload.model.activation_clamp,
        shared_weights=w.shared,
    )


class ReferenceAdapter(OperatorAdapter):
    name = "reference"
    role = "reference"
    summary = "float32 expert-parallel reference (gc_moe.reference.moe_reference_ep), dispatch by all-to-all"

    def available(self, device: torch.device) -> tuple[bool, str]:
        missing = _missing_module("gc_moe.reference")
        return (False, missing) if missing else (True, "")

    def prepare(self, workload: Workload, group: Any) -> Invocation:
        reference_ep = _reference_ep()
        w = workload.weights
        output = torch.empty(workload.tokens_per_rank, workload.model.hidden, dtype=torch.bfloat16,
                             device=workload.device)

        def run() -> None:
            output.copy_(reference_ep(
                group, workload.x, workload.x_sf, workload.topk_idx, workload.topk_weights, w.l1, w.l2,
                num_experts=workload.model.num_experts, activation_alpha=workload.model.activation_alpha,
                activation_clamp=workload.model.activation_clamp,
                shared_weights=w.shared if workload.shared_experts else None,
            ))

        return Invocation(run, output, capturable=False)  # it exchanges counts on the host before its all-to-all


class GcAdapter(OperatorAdapter):
    """GC-MoE through its public API (Listing 1).  The API picks its backend from the device: the SM90 layer's
    kernels on an sm_90 GPU (``sm90``), else the float32 reference.  A configuration a kernel backend declines
    (it raises GcMoeConstraintError naming why, e.g. shared experts before their kernel is wired) runs on the
    reference backend, and the invocation's note says so and why: never a fallback presented as the kernel."""

    name = "gc"
    role = "operator"
    summary = "GC-MoE public API (gc_moe.fp8_fp4_gc_moe); shared expert fused when the suite has one"
    fuse_shared = True

    def available(self, device: torch.device) -> tuple[bool, str]:
        try:
            from gc_moe import api  # the module itself: robust even where a test tree shadows the package
        except ImportError as exc:
            return False, f"gc_moe.api does not import ({exc})"
        needed = ("get_symm_buffer_for_gc_moe", "transform_weights_for_gc_moe", "fp8_fp4_gc_moe")
        lacking = [n for n in needed if not hasattr(api, n)]
        if lacking:
            return False, f"gc_moe.api lacks {', '.join(lacking)}"
        return True, ""

    def prepare(self, workload: Workload, group: Any) -> Invocation:
        from gc_moe import api as gc_moe
        from gc_moe.planning import GcMoeConstraintError

        model, w = workload.model, workload.weights
        fused_shared = bool(workload.shared_experts) and self.fuse_shared
        shape = (group, model.num_experts, model.capacity, model.topk, model.hidden, model.intermediate)
        shared_count = workload.shared_experts if fused_shared else 0
        declined, shared_launch = "", None
        try:
            buffer = gc_moe.get_symm_buffer_for_gc_moe(*shape, mma_type="fp8xfp4", num_shared_experts=shared_count)
        except GcMoeConstraintError as exc:
            if gc_moe.select_backend(workload.device).name == gc_moe.REFERENCE:
                raise  # the configuration itself is outside the operator's envelope
            declined = f"; {gc_moe.select_backend(workload.device).name} declined: {exc}"
            buffer = gc_moe.get_symm_buffer_for_gc_moe(*shape, mma_type="fp8xfp4", num_shared_experts=shared_count,
                                                       backend=gc_moe.REFERENCE)
        backend = buffer.backend
        w1, w2 = _weights_for(gc_moe, backend, w.l1, w.l2)
        t = workload.tokens_per_rank
        buffer.x[:t].copy_(workload.x)
        buffer.x_sf[:t].copy_(workload.x_sf)
        buffer.topk_idx[:t].copy_(workload.topk_idx)
        buffer.topk_weights[:t].copy_(workload.topk_weights)
        output = torch.empty(t, model.hidden, dtype=torch.bfloat16, device=workload.device)
        call_args = {
            "recipe": RECIPE, "activation": ACTIVATION, "activation_alpha": model.activation_alpha,
            "activation_clamp": model.activation_clamp, "num_tokens": t,
        }
        note = f"gc_moe backend: {backend}{declined}"
        if backend == "sm90":  # the partition and the overlap switch this measurement ran with
            from gc_moe.kernels.sm90.backend import settings_note

            note += f"; {settings_note(buffer)}"
        if fused_shared:
            def run() -> None:
                gc_moe.fp8_fp4_gc_moe(output, w1, w2, buffer, shared_weights=w.shared, **call_args)
        elif workload.shared_experts:
            # unfused: the routed operator, then the shared expert as its own computation, summed
            shared_launch, why = _separate_shared_expert(buffer)
            if shared_launch is not None:
                shared_out = torch.empty(t, model.hidden, dtype=torch.bfloat16, device=workload.device)

                def run() -> None:
                    gc_moe.fp8_fp4_gc_moe(output, w1, w2, buffer, **call_args)
                    shared_launch(shared_out, w.shared, t)
                    output.add_(shared_out)
                note += f"; shared expert: the {backend} shared-expert kernel, launched after the routed call, added"
            else:
                def run() -> None:
                    gc_moe.fp8_fp4_gc_moe(output, w1, w2, buffer, **call_args)
                    output.add_(_shared_expert_output(workload))
                if backend != gc_moe.REFERENCE:  # under the reference backend everything is the reference anyway
                    note += f"; shared expert: float32 reference, added after the routed call ({why})"
        else:
            def run() -> None:
                gc_moe.fp8_fp4_gc_moe(output, w1, w2, buffer, **call_args)

        # the reference (the API's reference backend, or the unfused shared expert) synchronizes with the host;
        # a kernel backend's call is graph-capturable
        capturable = backend != gc_moe.REFERENCE and not (workload.shared_experts and not fused_shared
                                                          and shared_launch is None)
        return Invocation(run, output, keep_alive=(buffer, w1, w2), capturable=capturable, note=note)


class GcUnfusedAdapter(GcAdapter):
    name = "gc-unfused"
    summary = "GC-MoE routed experts, shared expert computed separately and added (the fusion ablation)"
    fuse_shared = False


def _separate_shared_expert(buffer) -> tuple[Callable | None, str]:
    """(run(out, shared_weights, num_tokens), "") when the buffer's kernel backend has a shared-expert kernel
    to launch on its own (its module's `separate_shared_expert`), else (None, why not)."""
    from gc_moe.planning import GcMoeConstraintError

    if buffer.backend == "reference":
        return None, "the reference backend has no shared-expert kernel"
    try:
        module = importlib.import_module(f"gc_moe.kernels.{buffer.backend}.backend")
    except ImportError as exc:
        return None, f"gc_moe.kernels.{buffer.backend}.backend does not import ({exc})"
    make = getattr(module, "separate_shared_expert", None)
    if make is None:
        return None, f"the {buffer.backend} backend has no separate shared-expert launch"
    try:
        return make(buffer), ""
    except GcMoeConstraintError as exc:
        return None, str(exc)


_TRANSFORMED: dict = {}  # (backend layout, weight tensors' addresses and shapes) -> (w1, w2), one model at a time


def _weights_for(gc_moe, backend: str, l1, l2):
    """(w1, w2) in the layout `backend` reads; the last transform is reused while the same weights come back
    (the accuracy suite prepares every case with one weight set per model)."""
    layout = gc_moe.registered_backends()[backend].weight_layout
    if layout == "canonical":
        return tuple(l1), tuple(l2)
    key = (layout, *((t.data_ptr(), tuple(t.shape), t.device) for t in (*l1, *l2)))
    if key not in _TRANSFORMED:
        _TRANSFORMED.clear()
        _TRANSFORMED[key] = (gc_moe.transform_weights_for_gc_moe(l1, l2, arch=layout), (l1, l2))
    return _TRANSFORMED[key][0]


class _PendingBaseline(OperatorAdapter):
    """A baseline whose adapter cannot run yet: registered so that sweeps record it as skipped, with the reason."""

    role = "baseline"
    module = ""
    needs = ""

    def available(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"{self.name} needs a CUDA GPU ({self.needs}); this run is on {device.type}"
        missing = _missing_module(self.module)
        if missing:
            return False, f"{self.name}: {missing}"
        return False, f"{self.name}: no harness adapter for {self.module} yet"

    def prepare(self, workload: Workload, group: Any) -> Invocation:
        raise RuntimeError(self.available(workload.device)[1])


class MegaPortAdapter(OperatorAdapter):
    """The SM90 reference port of Mega MoE (baselines.mega_moe.port_sm90): the routed layer as one persistent
    kernel with GC-MoE's FP8xFP4 numerics; for shared suites a separate shared-expert kernel after it (the SM90
    shared-expert kernel of GC-MoE's unfused path, on the whole GPU), or bf16 torch GEMMs where that kernel cannot
    run: the invocation's note says which."""

    name = "mega-port"
    role = "baseline"
    summary = "SM90 port of Mega MoE (one fused persistent kernel); separate shared-expert kernel after it"

    def available(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"{self.name} needs a CUDA GPU (sm_90a); this run is on {device.type}"
        try:
            from baselines.mega_moe import port_sm90
        except ImportError as exc:
            return False, f"{self.name}: baselines.mega_moe.port_sm90 does not import ({exc})"
        ok, reason = port_sm90.available(device)
        return (True, "") if ok else (False, f"{self.name}: {reason}")

    def prepare(self, workload: Workload, group: Any) -> Invocation:
        from baselines.mega_moe import deepgemm, port_sm90

        if workload.tokens_per_rank == 0:  # before any collective
            raise OperatorUnavailable(f"{self.name}: no tokens on this rank; the port's inputs take 1..capacity "
                                      f"tokens per rank")
        model, w = workload.model, workload.weights
        inputs = deepgemm.MegaMoeInputs(
            x=workload.x, x_sf=workload.x_sf, topk_idx=workload.topk_idx, topk_weights=workload.topk_weights,
            l1_weights=w.l1, l2_weights=w.l2, num_experts=model.num_experts, num_max_tokens_per_rank=model.capacity,
            activation_alpha=model.activation_alpha, activation_clamp=model.activation_clamp,
            shared_weights=w.shared if workload.shared_experts else None,
        )
        try:
            call = port_sm90.prepare(inputs, group)
        except port_sm90.PortUnavailable as exc:
            raise OperatorUnavailable(f"{self.name}: {exc}") from exc
        return Invocation(call.run, call.output, keep_alive=call.keep_alive, capturable=call.capturable,
                          note=call.note)


class DeepGemmAdapter(OperatorAdapter):
    """DeepGEMM's Mega MoE (baselines.mega_moe.deepgemm): fp8_fp4_mega_moe on the SM100 family (fused shared
    expert where the installed version has it), sgl-deep-gemm's fp8_mega_moe on SM90 as an external anchor."""

    name = "deepgemm"
    role = "baseline"
    summary = ("DeepGEMM fp8_fp4_mega_moe (SM100 family), fused shared-expert mode for shared suites; "
               "fp8_mega_moe (FP8 weights) on SM90")

    def available(self, device: torch.device) -> tuple[bool, str]:
        try:
            from baselines.mega_moe import deepgemm
        except ImportError as exc:
            return False, f"{self.name}: baselines.mega_moe.deepgemm does not import ({exc})"
        ok, reason = deepgemm.available(device)
        return (True, "") if ok else (False, f"{self.name}: {reason}")

    def prepare(self, workload: Workload, group: Any) -> Invocation:
        from baselines.mega_moe import deepgemm

        model, w = workload.model, workload.weights
        inputs = deepgemm.MegaMoeInputs(
            x=workload.x, x_sf=workload.x_sf, topk_idx=workload.topk_idx, topk_weights=workload.topk_weights,
            l1_weights=w.l1, l2_weights=w.l2, num_experts=model.num_experts, num_max_tokens_per_rank=model.capacity,
            activation_alpha=model.activation_alpha, activation_clamp=model.activation_clamp,
            shared_weights=w.shared if workload.shared_experts else None,
        )
        try:
            call = deepgemm.prepare(inputs, group)
        except deepgemm.BufferSetupFailed as exc:  # the installed DeepGEMM cannot run this job: a skip, not a bug
            raise OperatorUnavailable(f"{self.name}: {exc}") from exc
        return Invocation(call.run, call.output, keep_alive=call.keep_alive, capturable=call.capturable,
                          note=call.note)


REGISTRY: dict[str, OperatorAdapter] = {
    adapter.name: adapter
    for adapter in (ReferenceAdapter(), GcAdapter(), GcUnfusedAdapter(), MegaPortAdapter(), DeepGemmAdapter())
}


def operator_names() -> list[str]:
    return list(REGISTRY)


def get_operator(name: str) -> OperatorAdapter:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; known: {', '.join(REGISTRY)}") from None
