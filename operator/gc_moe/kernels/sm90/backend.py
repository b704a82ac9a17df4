"""The `sm90` backend of `gc_moe.fp8_fp4_gc_moe`: the SM90 GC-MoE layer (`kernels.sm90.layer`) on sm_90 GPUs.

Registered on import (`gc_moe.api` imports this module when it is present); importing needs neither the CuTe DSL
nor a GPU. It serves compute capability 9.0 when the driver bindings import and the layer's cubins are in the
cache (or the DSL is installed to build them); `unavailable_reason` says which of these is missing. Per buffer,
`allocate` builds one `Sm90Layer` (partition, workspace, kernels; P = 1 in a plain allocation, P > 1 in torch
symmetric memory over the buffer's group) whose input regions are the buffer's x, x_sf, topk_idx and
topk_weights; a configuration the layer cannot run raises `GcMoeConstraintError` naming what is allowed.
Shared experts run fused, as role4 nodes of the layer graph writing combine lane k, when the shared-expert
kernel (`kernels.sm90.shared_expert`) and its cubins are here; otherwise they are declined with the reason
(the reference backend serves them). `separate_shared_expert` gives the unfused ablation its own launches.
`run` launches the layer's child graph for (token count, y, weights), or attaches it when torch is capturing
a CUDA graph: the call is capturable and does no host synchronization. Waits are bounded by GC_MOE_WAIT_TIMEOUT_S (default 3600 s).
GC_MOE_OVERLAP_ROOTS ("1" default, "0") says whether dispatch and W1 overlap (`Sm90Layer.overlap_roots`);
GC_MOE_ROLE2_NODES ("auto" default: the fused kernel, W1 and W2 nodes beside the shared expert from 2 tokens;
"1", "2") how role2 runs (`Sm90Layer.role2_nodes`);
GC_MOE_ROLE4_FUSED ("0" default, "1") whether the shared expert runs as one fused node (`Sm90Layer.role4_fused`);
`settings_note(buffer)` gives the partition and that switch as one line.
"""

from __future__ import annotations

import importlib.util

from gc_moe import api
from gc_moe import weights as weight_layouts
from gc_moe.kernels.sm90 import layer as sm90_layer
from gc_moe.planning import GcMoeConstraintError

NAME = "sm90"
PRIORITY = 10
_kernel_reason_cache: dict = {}


def _kernels_reason() -> str | None:
    """None when every cubin the layer loads is in the cache or can be built here; else what to run."""
    from gc_moe.runtime import jit

    cache_dir = jit.default_cache_dir()
    if cache_dir not in _kernel_reason_cache:
        missing = sm90_layer.missing_kernels(cache_dir)
        reason = None
        if missing and not jit.dsl_available():
            reason = (f"{len(missing)} of its kernels are not in the cubin cache {cache_dir} (e.g. {missing[0]}) "
                      f"and the CuTe DSL is not installed to build them: run `{jit.build_command('sm_90a', 'h200')}` "
                      f"and copy the cache here (or set GC_MOE_CACHE_DIR)")
        _kernel_reason_cache[cache_dir] = reason
    return _kernel_reason_cache[cache_dir]


def unavailable_reason(device, arch) -> str | None:
    if arch != "sm90":
        return f"the sm90 backend runs on sm_90 GPUs (compute capability 9.0); this device is {arch or device}"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "the CUDA driver bindings (cuda-bindings) are not installed"
    return _kernels_reason()


def _symmetric_memory_reason() -> str | None:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"P > 1 needs torch symmetric memory (torch.distributed._symmetric_memory does not import: {exc})"
    return None


def allocate(buffer: api.GcMoeBuffer) -> dict:
    problems = sm90_layer.unsupported_reasons(
        num_experts=buffer.num_experts, num_ranks=buffer.world_size, topk=buffer.topk, hidden=buffer.hidden,
        intermediate=buffer.intermediate, capacity=buffer.capacity, num_shared_experts=buffer.num_shared_experts)
    if buffer.world_size > 1:
        reason = _symmetric_memory_reason()
        if reason:
            problems.append(reason)
    if problems:
        raise GcMoeConstraintError([f"sm90 backend: {p}" for p in problems])
    shape = sm90_layer.layer_shape(buffer.world_size, buffer.num_experts, buffer.topk, buffer.hidden,
                                   buffer.intermediate, buffer.capacity, buffer.num_shared_experts)
    layer = sm90_layer.Sm90Layer(shape, group=buffer.group, device=buffer.device,
                                 timeout_s=sm90_layer.timeout_from_env(),
                                 overlap_roots=sm90_layer.overlap_from_env(),
                                 role2_nodes=sm90_layer.role2_nodes_from_env())
    views = layer.input_views()
    views["topk_idx"].fill_(-1)
    return {**views, "extras": {"sm90_layer": layer, "release": layer.release}}


def settings_note(buffer: api.GcMoeBuffer) -> str:
    """The buffer's layer settings: "partition comm/compute 4/128 SMs; overlap on"."""
    return buffer.extras["sm90_layer"].settings_note()


def _matrices(w1, w2):
    """The Sm90Matrix of each stage from the tagged (w1, w2) that transform_weights_for_gc_moe returns."""
    if weight_layouts.layout_of(w1) != "sm90" or weight_layouts.layout_of(w2) != "sm90":
        raise ValueError(f"w1/w2 are in the {weight_layouts.layout_of(w1)!r} layout; the sm90 backend reads 'sm90': "
                         f"transform_weights_for_gc_moe(l1, l2) on this device")
    return w1[0], w2[0]


def run(y_rows, w1, w2, buffer: api.GcMoeBuffer, num_tokens: int, options: dict) -> None:
    problems = sm90_layer.unsupported_reasons(
        num_experts=buffer.num_experts, num_ranks=buffer.world_size, topk=buffer.topk, hidden=buffer.hidden,
        intermediate=buffer.intermediate, capacity=buffer.capacity,
        num_shared_experts=int(options.get("shared_weights") is not None),
        activation_alpha=options["activation_alpha"], activation_clamp=options["activation_clamp"])
    if problems:
        raise GcMoeConstraintError([f"sm90 backend: {p}" for p in problems])
    l1, l2 = _matrices(w1, w2)
    buffer.extras["sm90_layer"].run(y_rows, num_tokens, l1, l2, shared=options.get("shared_weights"))


def separate_shared_expert(buffer: api.GcMoeBuffer):
    """The unfused path's shared expert (the fusion ablation): role4 as launches of its own after the routed
    call, reading the buffer's x / x_sf in place. Returns run(out, shared_weights, num_tokens), which writes
    out rows [0, num_tokens) (bf16 [>= T, H], contiguous) on torch's current stream (capturable). Raises
    GcMoeConstraintError saying why when the shared-expert kernel cannot run here."""
    import torch

    reason = sm90_layer.shared_expert_unavailable_reason()
    if reason:
        raise GcMoeConstraintError([f"sm90 backend: shared expert: {reason}"])
    layer = buffer.extras["sm90_layer"]
    if "sm90_shared_expert" not in buffer.extras:
        buffer.extras["sm90_shared_expert"] = sm90_layer.SharedExpert(
            buffer.hidden, buffer.intermediate, buffer.capacity, buffer.device, layer.parts.describe()["compute_sms"])
    shared_expert = buffer.extras["sm90_shared_expert"]

    def run_shared(out, shared_weights, num_tokens: int) -> None:
        sm90_layer.check_shared_weights(layer.shape, shared_weights, buffer.device)
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape[0] < num_tokens \
                or out.shape[-1] != buffer.hidden:
            raise ValueError(f"out: {out.dtype} {list(out.shape)}; allowed: contiguous bfloat16 "
                             f"[>= {num_tokens}, {buffer.hidden}]")
        shared_expert.launch(shared_weights, buffer.x, buffer.x_sf, out, num_tokens,
                             torch.cuda.current_stream(buffer.device))

    return run_shared


api.register_backend(
    api.Backend(
        name=NAME,
        archs=("sm90",),
        weight_layout="sm90",
        unavailable_reason=unavailable_reason,
        allocate=allocate,
        run=run,
        priority=PRIORITY,
    )
)
