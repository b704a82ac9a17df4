"""DeepGEMM's Mega MoE kernels as baselines, behind one interface: ``available(device)`` and ``prepare(...)``.

| kernel                | GPUs                  | weights                                   | shared expert                       |
| --------------------- | --------------------- | ----------------------------------------- | ----------------------------------- |
| ``fp8_fp4_mega_moe``  | SM100 family (10.x)   | GC-MoE's MXFP4 weights, bytes unchanged    | fused where the installed version   |
|                       |                       |                                           | has ``num_shared_experts``          |
| ``fp8_mega_moe``      | SM90 (sgl-deep-gemm)  | FP8 E4M3, FP32 scales per 128x128 block   | separate (bf16 GEMMs beside it)     |
|                       |                       | (re-quantized from the MXFP4 weights)     |                                     |

``fp8_fp4_mega_moe`` is the paper's B300 baseline and reads exactly the activations and weights GC-MoE reads
(gc_moe.formats keeps DeepGEMM's byte layout). ``fp8_mega_moe`` is an external Hopper anchor: it streams FP8
weights (twice the FP4 bytes), so it bounds from above what a Hopper Mega MoE costs, not what the FP8xFP4 port
does. Where the package is missing, fails to import, lacks the entry point or the GPU does not match,
``available`` says exactly which, and the harness records the operator as skipped with that reason.

``prepare`` allocates DeepGEMM's symmetric buffer, transforms the weights, copies one rank's inputs into the
buffer's views (outside any timed region, as Listing 1 does) and returns a ``MegaMoeCall``: one zero-argument
launch that writes ``output`` (bf16 [T, H]) in place, graph-capturable.  Where the installed package cannot set
up its buffer (no allocator, or the allocator raises, as sgl-deep-gemm 0.2.0 does at world size 1), ``prepare``
raises ``BufferSetupFailed``: the harness records that as a skip with the message, not as a failure.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gc_moe import formats, reference
from gc_moe.formats import SharedExpertWeights

PACKAGE = "deep_gemm"
DISTRIBUTION = "sgl-deep-gemm"  # the pip-installable DeepGEMM build; upstream DeepGEMM installs the same module
ROUTED_RECIPE = (1, 1, 32)  # FP8 activations x FP4 weights, one UE8M0 scale per 32 values along K
SM90_RECIPE = (128, 128, 128)  # fp8_mega_moe: activation scales per 128 along K, weight scales per 128x128 block
ACTIVATION = "swiglu"


@dataclass(frozen=True)
class MegaMoeInputs:
    """One rank's operands, in gc_moe.formats' layout (docs/ARCHITECTURE.md)."""

    x: torch.Tensor  # float8_e4m3fn [T, H]
    x_sf: torch.Tensor  # int32 [T, H/128], packed UE8M0 per 32
    topk_idx: torch.Tensor  # int64 [T, k], global expert ids, -1 = none
    topk_weights: torch.Tensor  # float32 [T, k]
    l1_weights: tuple[torch.Tensor, torch.Tensor]  # int8 [E_loc, 2I, H/2], int32 [E_loc, 2I, H/128]
    l2_weights: tuple[torch.Tensor, torch.Tensor]  # int8 [E_loc, H, I/2], int32 [E_loc, H, I/128]
    num_experts: int  # global
    num_max_tokens_per_rank: int
    activation_alpha: float = 1.0
    activation_clamp: float | None = 10.0
    shared_weights: SharedExpertWeights | None = None

    def __post_init__(self) -> None:
        t, h = self.x.shape
        k = self.topk_idx.shape[1] if self.topk_idx.dim() == 2 else -1
        checks = (
            (self.x.dtype == torch.float8_e4m3fn, f"x must be float8_e4m3fn [T, H], got {self.x.dtype}"),
            (self.x_sf.dtype == torch.int32 and tuple(self.x_sf.shape) == (t, h // 128),
             f"x_sf must be int32 [T, H/128] = {(t, h // 128)}, got {self.x_sf.dtype} {tuple(self.x_sf.shape)}"),
            (self.topk_idx.dtype == torch.int64 and self.topk_idx.dim() == 2 and self.topk_idx.shape[0] == t,
             f"topk_idx must be int64 [T={t}, k], got {self.topk_idx.dtype} {tuple(self.topk_idx.shape)}"),
            (self.topk_weights.dtype == torch.float32 and tuple(self.topk_weights.shape) == (t, k),
             (f"topk_weights must be float32 [T, k] = {(t, k)}, got {self.topk_weights.dtype} "
              f"{tuple(self.topk_weights.shape)}")),
            (1 <= t <= self.num_max_tokens_per_rank,
             f"T = {t} tokens; allowed: 1..{self.num_max_tokens_per_rank} (num_max_tokens_per_rank)"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"MegaMoeInputs: {message}")
        w1, w2 = self.l1_weights[0], self.l2_weights[0]
        e, two_i = w1.shape[0], w1.shape[1]
        want = {"l1 values": (e, two_i, h // 2), "l1 scales": (e, two_i, h // 128),
                "l2 values": (e, h, two_i // 4), "l2 scales": (e, h, two_i // 2 // 128)}
        got = {"l1 values": w1.shape, "l1 scales": self.l1_weights[1].shape,
               "l2 values": w2.shape, "l2 scales": self.l2_weights[1].shape}
        for name, shape in want.items():
            if tuple(got[name]) != shape:
                raise ValueError(f"MegaMoeInputs: {name} must be {shape} for H = {h}, 2I = {two_i}, "
                                 f"E_loc = {e}; got {tuple(got[name])}")

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    @property
    def intermediate(self) -> int:
        return self.l1_weights[0].shape[1] // 2


@dataclass
class MegaMoeCall:
    """One prepared launch: ``run()`` writes ``output`` in place; ``keep_alive`` holds what the launch reads."""

    run: Callable[[], None]
    output: torch.Tensor
    keep_alive: tuple
    note: str  # how it ran: kernel, package version, shared-expert mode
    capturable: bool = True


# ----------------------------------------------------------------------------------------------- the package
def import_deep_gemm() -> tuple[Any | None, str]:
    """(the deep_gemm module, "") or (None, why not): not installed, or the import's own error text."""
    try:
        return importlib.import_module(PACKAGE), ""
    except ModuleNotFoundError as exc:
        if exc.name == PACKAGE:
            return None, f"{PACKAGE} is not installed (pip package {DISTRIBUTION})"
        return None, f"{PACKAGE} fails to import: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a wheel built for another torch fails with ImportError/OSError/...
        return None, f"{PACKAGE} fails to import: {type(exc).__name__}: {exc}"


def package_version(module: Any) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        return metadata.version(DISTRIBUTION)
    except Exception:  # noqa: BLE001 - a source build has no distribution metadata
        return "unknown version"


def device_capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability (a seam: CPU tests replace it)."""
    return torch.cuda.get_device_capability(device)


def device_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001 - only used in messages
        return "unknown GPU"


def _accepts(function: Callable, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class BufferSetupFailed(RuntimeError):
    """The installed DeepGEMM cannot allocate its symmetric buffer for this job (a limitation of that version, not
    of the inputs).  Kept free of the harness so this module imports without it; the harness's adapter turns it
    into its own ``OperatorUnavailable``."""


def allocate_buffer(allocate: Callable | None, function: str, module: Any, *args: Any, **kwargs: Any) -> Any:
    """``allocate(*args, **kwargs)``; a missing allocator or any error it raises becomes ``BufferSetupFailed``
    naming the package version, the allocator and the original error."""
    version = f"{PACKAGE} {package_version(module)}"
    if allocate is None:
        raise BufferSetupFailed(f"{version} has no symmetric-buffer allocator for {function}")
    try:
        return allocate(*args, **kwargs)
    except Exception as exc:
        name = getattr(allocate, "__name__", "the buffer allocator")
        raise BufferSetupFailed(f"{version} {name} failed: {error_line(exc)}") from exc


def error_line(exc: BaseException) -> str:
    """``Type: message`` with the message's first line only: errors raised inside torch's C++ (through the
    package's native module) carry a C++ stack after it, which a results row should not."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# ----------------------------------------------------------------------------------------------- the kernels
class MegaMoeKernel(ABC):
    """One DeepGEMM Mega MoE entry point; subclasses name it, its GPUs and the functions it needs."""

    function = ""
    arch_label = ""  # how messages name the GPUs it needs
    required: tuple[str, ...] = ()

    @abstractmethod
    def supports_capability(self, capability: tuple[int, int]) -> bool:
        """Whether this entry point has a kernel for a GPU of this compute capability."""

    def available(self, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"{self.function} needs a CUDA GPU ({self.arch_label}); this run is on {device.type}"
        major, minor = device_capability(device)
        if not self.supports_capability((major, minor)):
            return False, (f"{self.function} needs {self.arch_label}; this GPU is sm_{major}{minor} "
                           f"({device_name(device)})")
        module, reason = import_deep_gemm()
        if module is None:
            return False, reason
        lacking = [name for name in self.required if not hasattr(module, name)]
        if lacking:
            return False, f"{PACKAGE} {package_version(module)} lacks {', '.join(lacking)}"
        return True, ""

    @abstractmethod
    def prepare(self, inputs: MegaMoeInputs, group: Any) -> MegaMoeCall:
        """Allocate the buffer, transform the weights, stage the inputs; return the call."""

    def _module(self) -> Any:
        module, reason = import_deep_gemm()
        if module is None:
            raise RuntimeError(reason)
        lacking = [name for name in self.required if not hasattr(module, name)]
        if lacking:
            raise RuntimeError(f"{PACKAGE} {package_version(module)} lacks {', '.join(lacking)}")
        return module


class Fp8Fp4MegaMoe(MegaMoeKernel):
    """DeepGEMM's ``fp8_fp4_mega_moe`` on the SM100 family: GC-MoE's own operands, shared expert fused if it can."""

    function = "fp8_fp4_mega_moe"
    arch_label = "SM100 (compute capability 10.x)"
    required = ("get_symm_buffer_for_mega_moe", "transform_weights_for_mega_moe", "fp8_fp4_mega_moe")

    def supports_capability(self, capability: tuple[int, int]) -> bool:
        return capability[0] == 10

    def prepare(self, inputs: MegaMoeInputs, group: Any) -> MegaMoeCall:
        dg = self._module()
        _check_plain_swiglu(inputs, self.function)
        shared = inputs.shared_weights
        fused = shared is not None and fused_shared_supported(dg)
        buffer_options = {}
        if fused:
            buffer_options["num_shared_experts"] = _num_shared_experts(shared, inputs.intermediate)
        buffer = allocate_buffer(
            dg.get_symm_buffer_for_mega_moe, self.function, dg, group, inputs.num_experts,
            inputs.num_max_tokens_per_rank, inputs.topk_idx.shape[1], inputs.hidden, inputs.intermediate,
            **buffer_options)
        l1, l2 = dg.transform_weights_for_mega_moe(mn_major_scales(inputs.l1_weights),
                                                   mn_major_scales(inputs.l2_weights))
        stage_inputs(buffer, inputs.x, inputs.x_sf, inputs.topk_idx, inputs.topk_weights)
        call_options: dict[str, Any] = {"recipe": ROUTED_RECIPE, "activation": ACTIVATION,
                                        "activation_clamp": inputs.activation_clamp, "fast_math": True}
        keep_alive: tuple = (buffer, l1, l2)
        if fused:
            s1, s2 = dg.transform_weights_for_mega_moe(*shared_weights_k32(shared))
            call_options.update(shared_l1_weights=s1, shared_l2_weights=s2)
            shared_sf_view = getattr(buffer, "shared_l1_acts_sf", None)
            if isinstance(shared_sf_view, torch.Tensor) and shared_sf_view.numel():
                # the shared GEMM reads x from the routed view and its scales from this MN-major view
                shared_sf_view[: inputs.tokens].copy_(inputs.x_sf)
            keep_alive += (s1, s2)
        output = torch.empty(inputs.tokens, inputs.hidden, dtype=torch.bfloat16, device=inputs.x.device)
        routed = _launch(dg.fp8_fp4_mega_moe, output, l1, l2, buffer, call_options)
        version = package_version(dg)
        if shared is None:
            return MegaMoeCall(routed, output, keep_alive, f"deep_gemm {version} {self.function}")
        if fused:
            return MegaMoeCall(routed, output, keep_alive,
                               f"deep_gemm {version} {self.function}, shared expert fused")
        separate = SeparateSharedExpert(inputs)
        return MegaMoeCall(_then(routed, lambda: separate.add_to(output)), output, keep_alive + (separate,),
                           f"deep_gemm {version} {self.function}, shared expert separate (this version has no "
                           f"num_shared_experts): {SeparateSharedExpert.description}")


class Fp8MegaMoeSm90(MegaMoeKernel):
    """sgl-deep-gemm's SM90 ``fp8_mega_moe``: FP8 weights re-quantized from GC-MoE's MXFP4 ones."""

    function = "fp8_mega_moe"
    arch_label = "SM90 (compute capability 9.0)"
    required = ("fp8_mega_moe", "transform_weights_for_mega_moe_sm90")

    def supports_capability(self, capability: tuple[int, int]) -> bool:
        return tuple(capability) == (9, 0)

    def prepare(self, inputs: MegaMoeInputs, group: Any) -> MegaMoeCall:
        dg = self._module()
        _check_plain_swiglu(inputs, self.function)
        allocate = getattr(dg, "get_symm_buffer_for_sm90_mega_moe", None) or getattr(
            dg, "get_symm_buffer_for_mega_moe", None)
        sizes = (inputs.num_experts, inputs.num_max_tokens_per_rank, inputs.topk_idx.shape[1], inputs.hidden,
                 inputs.intermediate)
        buffer_note = "symmetric buffer"
        try:
            buffer = allocate_buffer(allocate, f"{self.function} (get_symm_buffer_for_sm90_mega_moe / "
                                     f"get_symm_buffer_for_mega_moe)", dg, group, *sizes)
        except BufferSetupFailed as symmetric_failure:
            if _group_size(group) != 1 or not Sm90PlainBuffer.supported(dg):
                raise
            # one rank has no peers to map: a plain allocation sliced by the package's own layout function
            try:
                buffer = Sm90PlainBuffer(dg, group, *sizes, device=inputs.x.device)
            except Exception as exc:
                raise BufferSetupFailed(f"{symmetric_failure}; the world-size-1 plain buffer failed too: "
                                        f"{error_line(exc)}") from exc
            buffer_note = f"plain world-size-1 buffer ({symmetric_failure})"
        l1, l2 = dg.transform_weights_for_mega_moe_sm90(fp8_block128_weights(inputs.l1_weights),
                                                        fp8_block128_weights(inputs.l2_weights))
        x, x_sf = activations_for_buffer(inputs.x, inputs.x_sf, buffer.x_sf.dtype)
        stage_inputs(buffer, x, x_sf, inputs.topk_idx, inputs.topk_weights)
        output = torch.empty(inputs.tokens, inputs.hidden, dtype=torch.bfloat16, device=inputs.x.device)
        routed = _launch(dg.fp8_mega_moe, output, l1, l2, buffer,
                         {"recipe": SM90_RECIPE, "activation": ACTIVATION,
                          "activation_clamp": inputs.activation_clamp, "fast_math": True})
        note = (f"deep_gemm {package_version(dg)} {self.function} (FP8 weights, recipe {SM90_RECIPE}; "
                f"{buffer_note})")
        keep_alive: tuple = (buffer, l1, l2)
        if inputs.shared_weights is None:
            return MegaMoeCall(routed, output, keep_alive, note)
        separate = SeparateSharedExpert(inputs)
        return MegaMoeCall(_then(routed, lambda: separate.add_to(output)), output, keep_alive + (separate,),
                           f"{note}, shared expert separate: {SeparateSharedExpert.description}")


def _group_size(group: Any) -> int | None:
    size = getattr(group, "size", None)
    try:
        return int(size()) if callable(size) else None
    except Exception:  # noqa: BLE001 - an unknown group object: no fallback
        return None


class Sm90PlainBuffer:
    """``fp8_mega_moe``'s buffer for a one-rank job from one plain device allocation.

    sgl-deep-gemm's SM90 allocator always goes through ``torch.distributed._symmetric_memory``; at world size 1
    there is no peer to map, so the kernel only needs the bytes and their one pointer.  The size and the input
    views come from the package's own ``_C.get_symm_buffer_size_for_sm90_mega_moe`` (its layout, not ours); the
    attributes are the ones ``fp8_mega_moe`` reads (buffer, handle.buffer_ptrs, group, sizes, input views)."""

    size_function = "get_symm_buffer_size_for_sm90_mega_moe"

    @classmethod
    def supported(cls, module: Any) -> bool:
        native = getattr(module, "_C", None)
        return native is not None and hasattr(native, cls.size_function) and hasattr(
            native, "get_token_alignment_for_mega_moe")

    def __init__(self, module: Any, group: Any, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                 hidden: int, intermediate: int, *, device: torch.device):
        native = module._C
        alignment = int(native.get_token_alignment_for_mega_moe())
        self.group = group
        self.num_experts, self.num_topk = num_experts, num_topk
        self.num_max_tokens_per_rank = -(-num_max_tokens_per_rank // alignment) * alignment
        self.hidden, self.intermediate_hidden = hidden, intermediate
        num_bytes, slice_views = getattr(native, self.size_function)(
            1, num_experts, self.num_max_tokens_per_rank, num_topk, hidden, intermediate, True, ACTIVATION)
        self.buffer = torch.zeros(int(num_bytes), dtype=torch.int8, device=device)
        self.handle = _BufferPointers([self.buffer.data_ptr()])
        views = [v if isinstance(v, torch.Tensor) else torch.from_dlpack(v) for v in slice_views(self.buffer)]
        if len(views) < 4:
            raise ValueError(f"{self.size_function} sliced {len(views)} views; expected at least x, x_sf, "
                             f"topk_idx, topk_weights")
        x, self.x_sf, self.topk_idx, self.topk_weights = views[:4]
        self.x = x if x.dtype == torch.float8_e4m3fn else x.view(torch.float8_e4m3fn)
        self.more_views = views[4:]  # pool views the kernel uses; kept alive with the buffer
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)


@dataclass
class _BufferPointers:
    buffer_ptrs: list[int]


FP8_FP4_MEGA_MOE = Fp8Fp4MegaMoe()
FP8_MEGA_MOE_SM90 = Fp8MegaMoeSm90()
KERNELS = (FP8_FP4_MEGA_MOE, FP8_MEGA_MOE_SM90)


def kernel_for(device: torch.device) -> MegaMoeKernel | None:
    """The kernel this device runs: SM100 family -> fp8_fp4_mega_moe, SM90 -> fp8_mega_moe, else none."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    capability = device_capability(device)
    return next((k for k in KERNELS if k.supports_capability(capability)), None)


def available(device: torch.device) -> tuple[bool, str]:
    """Whether this device runs one of DeepGEMM's Mega MoE kernels, and if not, why."""
    device = torch.device(device)
    kernels = "; ".join(f"{k.arch_label}: {k.function}" for k in KERNELS)
    if device.type != "cuda":
        return False, f"needs a CUDA GPU ({kernels}); this run is on {device.type}"
    kernel = kernel_for(device)
    if kernel is None:
        major, minor = device_capability(device)
        return False, f"needs {kernels}; this GPU is sm_{major}{minor} ({device_name(device)})"
    return kernel.available(device)


def prepare(inputs: MegaMoeInputs, group: Any) -> MegaMoeCall:
    """Prepare the kernel this device runs (collective over ``group``: the buffer is symmetric)."""
    kernel = kernel_for(inputs.x.device)
    if kernel is None:
        raise RuntimeError(available(inputs.x.device)[1])
    return kernel.prepare(inputs, group)


# ----------------------------------------------------------------------------------------------- operands
def mn_major_scales(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 scales [E, N, K/128] K-major) -> the same scales MN-major (strides (N*K/128, 1, N)).

    DeepGEMM's SM100 kernels load weight scales MN-major (its transform_sf_into_required_layout's output);
    gc_moe.formats stores them K-major. Same words, another order."""
    values, scales = pair
    if scales.dtype != torch.int32 or scales.dim() != 3:
        raise ValueError(f"weight scales must be int32 [E, N, K/128], got {scales.dtype} {tuple(scales.shape)}")
    return values.contiguous(), scales.transpose(1, 2).contiguous().transpose(1, 2)


def fp8_block128_weights(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights (int8 [E, N, K/2], int32 [E, N, K/128]) -> FP8 (float8_e4m3fn [E, N, K],
    float32 [E, N/128, K/128] power-of-two 128x128 block scales), one expert at a time to bound memory.

    Exact for the weights the harness builds: an E2M1 value times a power of two is an E4M3 value
    unless the 32-blocks of one 128x128 tile span more than ~2^8 in scale."""
    values, scales = pair
    experts, n = values.shape[0], values.shape[1]
    if n % formats.BLOCK128:
        raise ValueError(f"fp8_mega_moe needs N % 128 == 0 (whole 128x128 scale blocks), got N = {n}")
    quantized = [formats.quantize_fp8_block128(formats.dequantize_fp4_ue8m0(values[e], scales[e]))
                 for e in range(experts)]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


def activations_for_buffer(x: torch.Tensor, x_sf: torch.Tensor,
                           buffer_sf_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations in the scale format the buffer holds: packed UE8M0 per 32 as they are, or re-quantized
    with one FP32 scale per 128 values (fp8_mega_moe's per-token (1, 128) activation recipe)."""
    if buffer_sf_dtype == torch.int32:
        return x, x_sf
    if buffer_sf_dtype == torch.float32:
        return formats.quantize_fp8_k128(formats.dequantize_fp8_ue8m0(x, x_sf))
    raise ValueError(f"the buffer's x_sf view is {buffer_sf_dtype}; known: int32 (UE8M0 per 32), float32 (per 128)")


def stage_inputs(buffer: Any, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> None:
    """Copy one rank's inputs into the first T rows of the buffer's views (checked, so a layout drift of a
    DeepGEMM version fails here with the view's shape instead of corrupting the run)."""
    t = x.shape[0]
    for name, source in (("x", x), ("x_sf", x_sf), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        view = getattr(buffer, name)
        if view.dtype != source.dtype or view.dim() != source.dim() or view.shape[0] < t \
                or tuple(view.shape[1:]) != tuple(source.shape[1:]):
            raise ValueError(f"deep_gemm buffer view {name} is {view.dtype} {tuple(view.shape)}; the inputs need "
                             f"{source.dtype} [>= {t}, {', '.join(map(str, source.shape[1:]))}]")
        view[:t].copy_(source)


def fused_shared_supported(module: Any) -> bool:
    """Whether this deep_gemm fuses a shared expert into fp8_fp4_mega_moe (later releases and some builds)."""
    return _accepts(module.get_symm_buffer_for_mega_moe, "num_shared_experts") and _accepts(
        module.fp8_fp4_mega_moe, "shared_l1_weights")


def _num_shared_experts(shared: SharedExpertWeights, intermediate: int) -> int:
    # DeepGEMM fuses S shared experts as one of intermediate S*I
    if shared.intermediate % intermediate:
        raise ValueError(f"the shared expert's intermediate {shared.intermediate} is not a multiple of the routed "
                         f"intermediate {intermediate}, which DeepGEMM's fused shared-expert mode needs")
    return shared.intermediate // intermediate


def shared_weights_k32(shared: SharedExpertWeights) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Shared-expert FP8 weights with packed UE8M0 scales per 32 (the fused mode's format), MN-major.

    Recipe (1, 128, 128) scales are powers of two: each 128x128 block's exponent is repeated for its four
    32-value groups, so the FP8 values and the weights they stand for are unchanged."""
    pairs = []
    for values, scales in ((shared.w1, shared.w1_sf), (shared.w2, shared.w2_sf)):
        if shared.recipe == formats.RECIPE_BLOCK128:
            exponents = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
            per_row = exponents.repeat_interleave(formats.BLOCK128, dim=0)[: values.shape[0]]
            scales = formats.pack_ue8m0(per_row.repeat_interleave(formats.SF_PER_WORD, dim=-1))
        pairs.append((values.contiguous(), scales.t().contiguous().t()))
    return tuple(pairs)


class SeparateSharedExpert:
    """The shared expert as its own computation beside a kernel without a fused mode: bf16 GEMMs on the
    exactly dequantized weights (the paper's unfused baseline adds a separate shared-expert kernel)."""

    description = "bf16 torch GEMMs on dequantized FP8 weights, added to the kernel's output"

    def __init__(self, inputs: MegaMoeInputs):
        shared = inputs.shared_weights
        w1, w2 = shared.dequantize()
        self.w1 = w1.to(torch.bfloat16)
        self.w2 = w2.to(torch.bfloat16)
        # the layer's input, dequantized once: the timed call does what a separate kernel would, the GEMMs
        self.x = formats.dequantize_fp8_ue8m0(inputs.x, inputs.x_sf).to(torch.bfloat16)
        self.alpha, self.clamp = inputs.activation_alpha, inputs.activation_clamp

    def __call__(self) -> torch.Tensor:
        hidden = reference.swiglu(self.x @ self.w1.t(), alpha=self.alpha, clamp=self.clamp)
        return hidden.to(torch.bfloat16) @ self.w2.t()

    def add_to(self, output: torch.Tensor) -> None:
        output.add_(self())


def _check_plain_swiglu(inputs: MegaMoeInputs, function: str) -> None:
    if inputs.activation_alpha != 1.0:
        raise ValueError(f"{function} computes silu(gate) * up (activation_alpha = 1); this model has "
                         f"activation_alpha = {inputs.activation_alpha}")


def _launch(function: Callable, output: torch.Tensor, l1: Any, l2: Any, buffer: Any,
            options: dict[str, Any]) -> Callable[[], None]:
    def run() -> None:
        function(output, l1, l2, buffer, **options)

    return run


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        first()
        second()

    return run
