"""The SM90 reference port of Mega MoE (baseline ``mega-port``): the whole routed MoE layer as one fused persistent
kernel on every SM, with GC-MoE's FP8xFP4 numerics (docs/mega-port.md).

Same interface as ``baselines.mega_moe.deepgemm``: ``available(device)`` and ``prepare(inputs, group)`` returning a
``MegaMoeCall``. Inputs are GC-MoE's (FP8 activations with UE8M0 K32 scales, top-k, MXFP4 weights), the weights
transformed once with ``gc_moe.weights.sm90`` (the layout GC-MoE's grouped GEMM reads). The kernel is
``gc_moe.kernels.sm90.mega_port`` (there because the cubin cache hashes kernel sources under gc_moe), built
offline: ``gcmoe-bench build --arch sm_90a --profile h200``. No fused shared expert: for shared suites the call
launches a separate shared-expert kernel after the routed one, the SM90 shared-expert kernel GC-MoE's unfused
path uses (``gc_moe.kernels.sm90.layer.SharedExpert``: W1 then W2 on the whole GPU, reading x / x_sf in place),
and adds its output (the paper's H20 baseline: the port plus a separate shared-expert kernel). Where that kernel
cannot run (``shared_expert_kernel_reason``) the shared expert is bf16 torch GEMMs on the dequantized FP8 weights
instead; the note says which ran, and why. World size 1 only (the kernel keeps the peer table; pulls from peers
are not written yet): larger groups raise ``PortUnavailable``.
"""

from __future__ import annotations

from typing import Any

import torch

from baselines.mega_moe.deepgemm import MegaMoeCall, MegaMoeInputs, SeparateSharedExpert

from . import host

ARCH = "sm_90a"


class PortUnavailable(RuntimeError):
    """The port cannot run this job for a known reason (world size > 1, cubin not built); the harness records a
    skip with the message."""


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _missing_cubins(alpha: float = 1.0, clamp: float = 10.0) -> list[str]:
    from gc_moe.runtime import jit

    return [v.describe() for v in host.all_variants(alpha, clamp) if jit.find_entry(v, ARCH) is None]


def available(device: torch.device) -> tuple[bool, str]:
    """(True, "") where the port runs: an sm_90 GPU and the port's cubins in the cache; else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the SM90 Mega MoE port needs a CUDA GPU (sm_90a); this run is on {device.type}"
    major, minor = _capability(device)
    if (major, minor) != (9, 0):
        return False, f"the SM90 Mega MoE port needs sm_90a (H20/H200); this GPU is sm_{major}{minor}"
    try:
        missing = _missing_cubins()
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be read is a reason, not a crash
        return False, f"the port's cubin cache cannot be read: {type(exc).__name__}: {exc}"
    if missing:
        from gc_moe.runtime.jit import build_command

        return False, f"the port's cubins are not built ({', '.join(missing)}): run {build_command(ARCH, 'h200')}"
    return True, ""


def shared_expert_kernel_reason(inputs: MegaMoeInputs) -> str | None:
    """Why the separate shared expert cannot be the SM90 shared-expert kernel for these inputs (None when it can):
    the kernel or its cubins are not here (``layer.shared_expert_unavailable_reason``), the SwiGLU is not the one
    its cubins are built with, or the weights' recipe or shape is not one it takes."""
    shared = inputs.shared_weights
    if shared is None:
        return "no shared expert"
    try:
        from gc_moe.kernels.sm90 import layer as sm90_layer

        reason = sm90_layer.shared_expert_unavailable_reason()
    except Exception as exc:  # noqa: BLE001 - a kernel package that cannot be read is a reason, not a crash
        return f"the SM90 shared-expert kernel cannot be looked up: {type(exc).__name__}: {exc}"
    if reason:
        return reason
    alpha, clamp = inputs.activation_alpha, inputs.activation_clamp
    if (alpha, clamp) != (sm90_layer.SWIGLU_ALPHA, sm90_layer.SWIGLU_CLAMP):
        return (f"its cubins are built for SwiGLU alpha {sm90_layer.SWIGLU_ALPHA:g}, clamp "
                f"{sm90_layer.SWIGLU_CLAMP:g}; this model has alpha {alpha}, clamp {clamp}")
    from gc_moe.kernels.sm90 import shared_expert as se

    if tuple(shared.recipe) not in se.RECIPES:
        return f"recipe {tuple(shared.recipe)}; the kernel takes {', '.join(map(str, se.RECIPES))}"
    if shared.hidden != inputs.hidden or shared.hidden % 128 or shared.intermediate % 128:
        return (f"shared expert H={shared.hidden}, Is={shared.intermediate}; the kernel takes the layer's H "
                f"({inputs.hidden}) and multiples of 128")
    return None


SHARED_KERNEL_DESCRIPTION = "the SM90 shared-expert kernel (W1 then W2 on all {sms} SMs), added to the kernel's output"


def shared_expert_note(sms: int, reason: str | None) -> str:
    """What the call's note says of the shared expert: the kernel on `sms` SMs, or the bf16 GEMMs and why."""
    if reason is None:
        return f"shared expert separate: {SHARED_KERNEL_DESCRIPTION.format(sms=sms)}"
    return (f"shared expert separate: {SeparateSharedExpert.description} (the SM90 shared-expert kernel cannot run "
            f"here: {reason})")


def _shared_expert_kernel(inputs: MegaMoeInputs, x, x_sf, output, sms: int):
    """(run, keep): the shared-expert kernel's two launches on torch's current stream into its own rows, then
    added to ``output`` (graph-capturable: no host synchronization)."""
    from gc_moe.kernels.sm90 import layer as sm90_layer

    shared, device, t = inputs.shared_weights, x.device, inputs.tokens
    kernel = sm90_layer.SharedExpert(shared.hidden, shared.intermediate, inputs.num_max_tokens_per_rank, device,
                                     sms)
    rows = torch.empty(t, inputs.hidden, dtype=torch.bfloat16, device=device)

    def run() -> None:
        kernel.launch(shared, x, x_sf, rows, t, torch.cuda.current_stream(device))
        output.add_(rows)

    return run, (kernel, rows, shared)


def _world_size(group: Any) -> int:
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def prepare(inputs: MegaMoeInputs, group: Any, *, timeout_s: float = host.DEFAULT_TIMEOUT_S,
            block_n: int | None = None, stages: int = host.BUILT_STAGES, cooperative: bool = True,
            pipeline: str | None = None) -> MegaMoeCall:
    """Transform the weights, allocate the workspace, and return one launch of the persistent kernel that writes
    ``output`` (bf16 [T, H]) in place; graph-capturable. pipeline: "auto" (the one measured faster for this
    call), "cp_async" or "ws"; None: GCMOE_MEGA_PORT_PIPELINE, else "auto". `stages` is a knob of cp_async."""
    from gc_moe.runtime import jit
    from gc_moe.weights import sm90 as weights_sm90

    world = _world_size(group)
    if world != 1:
        raise PortUnavailable(f"the SM90 Mega MoE port runs at world size 1 only (its pulls from peers are not "
                              f"written yet); this group has {world} ranks")
    ok, reason = available(inputs.x.device)
    if not ok:
        raise PortUnavailable(reason)
    if inputs.activation_clamp is None:
        raise ValueError("the SM90 Mega MoE port needs a SwiGLU clamp (activation_clamp), got None")
    device = inputs.x.device
    t, hidden, topk = inputs.tokens, inputs.hidden, inputs.topk_idx.shape[1]
    weights = weights_sm90.transform(tuple(inputs.l1_weights), tuple(inputs.l2_weights))
    local_experts = weights.l1.num_experts
    pipeline = host.resolve_pipeline(pipeline if pipeline is not None else host.pipeline_from_env(), t, topk,
                                     local_experts)
    host.check_shape(hidden, inputs.intermediate, local_experts, topk, pipeline)
    alpha, clamp = float(inputs.activation_alpha), float(inputs.activation_clamp)
    if pipeline == "ws":
        bn = block_n or host.choose_block_n_ws(t, topk, local_experts)
        wanted = host.variant_ws(bn, alpha, clamp)
    else:
        bn = block_n or host.choose_block_n(t, topk, local_experts)
        wanted = host.variant(bn, stages, alpha, clamp)
    try:
        kernel = jit.load_kernel(wanted, ARCH)
    except jit.KernelNotBuiltError as exc:  # e.g. a SwiGLU alpha / clamp the registry does not build
        raise PortUnavailable(str(exc)) from exc
    ws = host.PortWorkspace.allocate(inputs.num_max_tokens_per_rank, topk, hidden, inputs.intermediate,
                                     local_experts, device)
    x, x_sf = inputs.x.contiguous(), inputs.x_sf.contiguous()
    topk_idx, topk_weights = inputs.topk_idx.contiguous(), inputs.topk_weights.contiguous()
    output = torch.empty(t, hidden, dtype=torch.bfloat16, device=device)
    args = host.kernel_args(ws, x, x_sf, topk_idx, topk_weights, weights, output, timeout_s=timeout_s,
                            pipeline=pipeline)
    grid = host.sm_count(device.index or 0)

    def run() -> None:
        host.launch(kernel, args, grid, torch.cuda.current_stream(device), cooperative=cooperative)

    threads = kernel.entry.launch.block[0]
    if pipeline == "ws":
        ws_cfg = host.kws.PortWsConfig(bn)
        producer = "producer warpgroup" if ws_cfg.loop.producer_warps == 4 else "producer warp"
        dispatch = (f"{ws_cfg.dispatch_warps} dispatch warps beside the GEMM" if ws_cfg.dispatch_warps
                    else "dispatch before the GEMM loop")
        note = (f"SM90 Mega MoE port: one persistent kernel, {grid} CTAs x {threads} threads, ws pipeline "
                f"({producer}, mbarrier ring, ticketed units, {dispatch}), block_n {bn}")
    else:
        note = (f"SM90 Mega MoE port: one persistent kernel, {grid} CTAs x {threads} threads, block_n {bn}, "
                f"{stages} stages")
    keep = (weights, ws, x, x_sf, topk_idx, topk_weights, kernel)
    if inputs.shared_weights is not None:
        reason = shared_expert_kernel_reason(inputs)
        shared_run = None
        if reason is None:
            try:
                shared_run, shared_keep = _shared_expert_kernel(inputs, x, x_sf, output, grid)
            except (jit.KernelNotBuiltError, RuntimeError) as exc:  # e.g. its cubins went missing from the cache
                reason = f"{type(exc).__name__}: {exc}"
        if shared_run is None:
            shared = SeparateSharedExpert(inputs)
            shared_run, shared_keep = (lambda: shared.add_to(output)), (shared,)
        kernel_run = run

        def run() -> None:  # the routed kernel, then the separate shared expert
            kernel_run()
            shared_run()

        note += f", {shared_expert_note(grid, reason)}"
        keep += shared_keep
    return MegaMoeCall(run=run, output=output, keep_alive=keep, note=note, capturable=True)
