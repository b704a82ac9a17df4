"""The public API of Listing 1, and the registry of backends that execute it.

    buffer = gc_moe.get_symm_buffer_for_gc_moe(group, num_experts, capacity, topk, hidden, intermediate)
    w1, w2 = gc_moe.transform_weights_for_gc_moe(l1_weights, l2_weights)
    buffer.x[:tokens].copy_(x_fp8); buffer.x_sf[:tokens].copy_(x_sf)
    buffer.topk_idx[:tokens].copy_(topk_idx); buffer.topk_weights[:tokens].copy_(topk_weights)
    y = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=x_fp8.device)
    gc_moe.fp8_fp4_gc_moe(y, w1, w2, buffer, recipe=(1, 1, 32), activation='swiglu',
                          activation_alpha=1.0, activation_clamp=10.0)

Backends. A `Backend` says which archs it serves, whether it can run here (`unavailable_reason`), which weight
layout it reads, how it allocates the buffer and how it runs one call. The buffer picks its backend once, at
creation, from the device's arch: the highest-priority registered backend that can run, else `reference`, the
float32 layer of `gc_moe.reference` (CPU, or a GPU without a kernel backend). Kernel packages register
themselves on import: `register_backend(Backend(...))` in a module `gc_moe.kernels.<arch>.backend`, which is
imported here when present. Nothing else in this file changes when a kernel backend lands.

Weights. `transform_weights_for_gc_moe` returns (w1, w2) tagged with their layout (`weights.LayoutTaggedWeights`).
With arch=None the layout is the one the device's backend reads (the canonical DeepGEMM input layout for
`reference`); with arch='sm90' / 'sm103' it is that arch's layout, whatever the device. A backend handed weights
in another layout: `reference` inverts them to canonical (exact), a kernel backend refuses with the reason.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import reference
from . import weights as weight_layouts
from .formats import K128, SharedExpertWeights
from .planning import ARCHS, ROUTED_RECIPES, GcMoeConstraintError, check_constraints

MMA_TYPES = ("fp8xfp4",)
ACTIVATIONS = ("swiglu",)
REFERENCE = "reference"
# Compute capability -> arch of a kernel path (Section 2.2: H20/H200 are sm_90a, B300 is compute capability 10.3).
_ARCH_OF_CAPABILITY = {(9, 0): "sm90", (10, 3): "sm103"}
# Kernel packages that register a backend when imported (absent ones are skipped).
_OPTIONAL_BACKEND_MODULES = ("gc_moe.kernels.sm90.backend", "gc_moe.kernels.sm103.backend")


# ----------------------------------------------------------------------------------------------- buffer
@dataclass
class GcMoeBuffer:
    """The per-layer workspace and its input views (Listing 1). Rows [0, capacity) of `x`, `x_sf`, `topk_idx`
    and `topk_weights` are the caller's; a call reads rows [0, num_tokens)."""

    group: dist.ProcessGroup | None
    num_experts: int
    capacity: int  # tokens per rank
    topk: int
    hidden: int
    intermediate: int
    mma_type: str
    num_shared_experts: int
    device: torch.device
    rank: int
    world_size: int
    backend: str
    x: torch.Tensor  # float8_e4m3fn [capacity, H]
    x_sf: torch.Tensor  # int32 [capacity, H/128]
    topk_idx: torch.Tensor  # int64 [capacity, k], -1 = no expert
    topk_weights: torch.Tensor  # float32 [capacity, k]
    extras: dict = field(
        default_factory=dict
    )  # backend-owned state (symmetric workspace, ring, signals, ...)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_offset(self) -> int:
        """First global expert id this rank owns."""
        return self.rank * self.local_experts

    def destroy(self) -> None:
        """Release the tensors (a kernel backend also releases its workspace through `extras`)."""
        release = self.extras.pop("release", None)
        if release is not None:
            release()
        self.x = self.x_sf = self.topk_idx = self.topk_weights = None
        self.extras.clear()


# ----------------------------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class Backend:
    """One way to execute the operator.

    unavailable_reason(device, arch) -> None when it can run there, else why not (shown to the user).
    allocate(buffer_without_views) -> dict with x, x_sf, topk_idx, topk_weights (and optionally 'extras').
    run(y_rows, w1, w2, buffer, num_tokens, options) writes y_rows ([num_tokens, H] bf16) in place; w1, w2 are in
    `weight_layout`; options holds recipe, activation, activation_alpha, activation_clamp, fast_math and
    shared_weights (formats.SharedExpertWeights or None).
    """

    name: str
    archs: tuple[str | None, ...]  # archs served; None = any device (CPU included)
    weight_layout: str
    unavailable_reason: Callable[[torch.device, str | None], str | None]
    allocate: Callable[[GcMoeBuffer], dict]
    run: Callable[..., None]
    priority: int = 0


_BACKENDS: dict[str, Backend] = {}
_optional_backends_loaded = False


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend by name."""
    if backend.weight_layout not in weight_layouts.LAYOUTS:
        raise ValueError(
            f"backend {backend.name!r}: unknown weight layout {backend.weight_layout!r}; allowed: "
            f"{weight_layouts.LAYOUTS}"
        )
    _BACKENDS[backend.name] = backend


def _load_optional_backends() -> None:
    global _optional_backends_loaded
    if _optional_backends_loaded:
        return
    _optional_backends_loaded = True
    for name in _OPTIONAL_BACKEND_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not (err.name and name.startswith(err.name)):
                raise


def registered_backends() -> dict[str, Backend]:
    _load_optional_backends()
    return dict(_BACKENDS)


def device_arch(device: torch.device | str) -> str | None:
    """'sm90' / 'sm103' for a GPU with a kernel path of that arch, None otherwise (CPU, other GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(device))


def select_backend(device: torch.device | str, name: str | None = None) -> Backend:
    """The backend a buffer on `device` uses: `name` if given (it must be able to run there), else the
    highest-priority backend that serves the device's arch and can run, else `reference`."""
    device = torch.device(device)
    arch = device_arch(device)
    backends = registered_backends()
    if name is not None:
        if name not in backends:
            raise ValueError(f"unknown backend {name!r}; registered: {sorted(backends)}")
        backend = backends[name]
        if None in backend.archs or arch in backend.archs:
            reason = backend.unavailable_reason(device, arch)
        else:
            reason = f"it serves {backend.archs}, this device is {arch or device.type}"
        if reason:
            raise RuntimeError(f"backend {name!r} cannot run on {device}: {reason}")
        return backend
    candidates = [
        b
        for b in backends.values()
        if (arch in b.archs or None in b.archs) and b.unavailable_reason(device, arch) is None
    ]
    return max(candidates, key=lambda b: b.priority)


# ----------------------------------------------------------------------------------------------- validation
def _group_shape(group) -> tuple[dist.ProcessGroup | None, int, int]:
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def _default_device(group) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if group is not None:
        return torch.device("cpu")
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _check_tensor(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {dtype} {list(shape)}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}; allowed: {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(t.shape)}; allowed: {list(shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}; allowed: the buffer's device {device}")


def _canonical_shapes(l1_weights, l2_weights) -> tuple[int, int, int]:
    """Validate the canonical (DeepGEMM) weight tuples; return (experts, hidden, intermediate)."""
    for name, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{name}: expected a (int8 data, int32 scales) pair, got {type(pair).__name__}")
        if not all(isinstance(p, torch.Tensor) for p in pair):
            raise TypeError(
                f"{name}: got ({', '.join(type(p).__name__ for p in pair)}); allowed: two torch.Tensor "
                f"(int8 data, int32 scales)"
            )
    data1, _ = l1_weights
    if data1.dim() != 3:
        raise ValueError(f"l1_weights data: shape {list(data1.shape)}; allowed: [E, 2I, H/2] (int8, 3-D)")
    experts, two_i, half_h = data1.shape
    hidden, intermediate = 2 * half_h, two_i // 2
    if hidden % K128 or intermediate % K128 or two_i % 2:
        raise ValueError(
            f"l1_weights data: shape {list(data1.shape)} gives H={hidden}, I={intermediate}; "
            f"allowed: both multiples of {K128}"
        )
    device = data1.device
    _check_tensor(l1_weights[0], "l1_weights data", torch.int8, (experts, two_i, hidden // 2), device)
    _check_tensor(l1_weights[1], "l1_weights scales", torch.int32, (experts, two_i, hidden // K128), device)
    _check_tensor(l2_weights[0], "l2_weights data", torch.int8, (experts, hidden, intermediate // 2), device)
    _check_tensor(
        l2_weights[1], "l2_weights scales", torch.int32, (experts, hidden, intermediate // K128), device
    )
    return experts, hidden, intermediate


def _check_options(recipe, activation, activation_alpha, activation_clamp, fast_math) -> tuple:
    try:
        recipe_t = tuple(int(r) for r in recipe)
    except (TypeError, ValueError):
        recipe_t = None
    if recipe_t not in ROUTED_RECIPES:
        raise ValueError(f"recipe: got {recipe!r}; allowed: {ROUTED_RECIPES[0]} (UE8M0 scale per 32 values)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: got {activation!r}; allowed: {ACTIVATIONS}")
    if (
        isinstance(activation_alpha, bool)
        or not isinstance(activation_alpha, (int, float))
        or not (math.isfinite(activation_alpha) and activation_alpha > 0)
    ):
        raise ValueError(f"activation_alpha: got {activation_alpha!r}; allowed: a finite number > 0")
    if activation_clamp is not None and (
        isinstance(activation_clamp, bool)
        or not isinstance(activation_clamp, (int, float))
        or not (math.isfinite(activation_clamp) and activation_clamp > 0)
    ):
        raise ValueError(
            f"activation_clamp: got {activation_clamp!r}; allowed: a finite number > 0, or None for no clamp"
        )
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math: got {fast_math!r}; allowed: True or False")
    return recipe_t


# ----------------------------------------------------------------------------------------------- public API
def get_symm_buffer_for_gc_moe(
    group: dist.ProcessGroup | None,
    num_experts: int,
    capacity: int,
    topk: int,
    hidden: int,
    intermediate: int,
    mma_type: str = "fp8xfp4",
    num_shared_experts: int = 0,
    *,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> GcMoeBuffer:
    """Allocate the operator's buffer for one layer configuration (every rank of `group` calls it).

    group: the expert-parallel group (rank r owns experts [r E/P, (r+1) E/P)); None means the default group if
    torch.distributed is initialized, else a single process owning every expert. capacity: max tokens per rank
    per call. device defaults to the group's device (CUDA for NCCL, CPU for gloo). backend forces a registered
    backend by name. Raises GcMoeConstraintError for a configuration outside Appendix A.
    """
    if mma_type not in MMA_TYPES:
        raise ValueError(f"mma_type: got {mma_type!r}; allowed: {MMA_TYPES}")
    group, rank, world = _group_shape(group)
    device = torch.device(device) if device is not None else _default_device(group)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = device_arch(device)
    check_constraints(
        hidden=hidden,
        intermediate=intermediate,
        num_experts=num_experts,
        num_ranks=world,
        topk=topk,
        num_shared_experts=num_shared_experts,
        capacity=capacity,
        arch=arch if arch in ARCHS else "sm103",
    )
    chosen = select_backend(device, backend)
    buffer = GcMoeBuffer(
        group=group,
        num_experts=num_experts,
        capacity=capacity,
        topk=topk,
        hidden=hidden,
        intermediate=intermediate,
        mma_type=mma_type,
        num_shared_experts=num_shared_experts,
        device=device,
        rank=rank,
        world_size=world,
        backend=chosen.name,
        x=None,
        x_sf=None,
        topk_idx=None,
        topk_weights=None,
    )
    views = dict(chosen.allocate(buffer))
    buffer.extras.update(views.pop("extras", {}))
    for name, dtype, shape in (
        ("x", torch.float8_e4m3fn, (capacity, hidden)),
        ("x_sf", torch.int32, (capacity, hidden // K128)),
        ("topk_idx", torch.int64, (capacity, topk)),
        ("topk_weights", torch.float32, (capacity, topk)),
    ):
        _check_tensor(views.get(name), f"backend {chosen.name!r} buffer view {name}", dtype, shape, device)
        setattr(buffer, name, views[name])
    return buffer


def transform_weights_for_gc_moe(l1_weights, l2_weights, arch: str | None = None):
    """Canonical FP4 weights (DeepGEMM's input layout) -> (w1, w2) in the layout the operator reads.

    arch=None: the layout of the backend that runs on the weights' device (canonical for `reference`).
    arch='sm90' / 'sm103': that arch's layout, whatever the device (e.g. to prepare weights offline).
    The result is tagged with its layout; the canonical layout stays usable by every backend.
    """
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"arch: got {arch!r}; allowed: None (from the device) or one of {ARCHS}")
    if weight_layouts.layout_of(l1_weights) != weight_layouts.CANONICAL:
        raise ValueError(
            f"l1_weights are already in the {weight_layouts.layout_of(l1_weights)!r} layout; "
            f"transform_weights_for_gc_moe takes the canonical (DeepGEMM input) layout"
        )
    _canonical_shapes(l1_weights, l2_weights)
    if arch is None:
        layout = select_backend(l1_weights[0].device).weight_layout
        arch = None if layout == weight_layouts.CANONICAL else layout
    return weight_layouts.transform(l1_weights, l2_weights, arch)


def fp8_fp4_gc_moe(
    y: torch.Tensor,
    w1,
    w2,
    buffer: GcMoeBuffer,
    recipe=(1, 1, 32),
    activation: str = "swiglu",
    activation_alpha: float = 1.0,
    activation_clamp: float | None = 10.0,
    num_tokens: int | None = None,
    shared_weights: SharedExpertWeights | None = None,
    fast_math: bool = True,
) -> None:
    """The MoE layer for rows [0, num_tokens) of the buffer, written into y[:num_tokens] (bf16 [., H]) in place.

    w1, w2: this rank's experts, from transform_weights_for_gc_moe (or canonical tuples). num_tokens defaults to
    y.shape[0]. shared_weights: formats.SharedExpertWeights, required iff the buffer was made with shared experts.
    Every rank of the buffer's group must call it (possibly with zero tokens).
    """
    if not isinstance(buffer, GcMoeBuffer) or buffer.x is None:
        raise TypeError(
            f"buffer: got {type(buffer).__name__}; allowed: a live buffer from get_symm_buffer_for_gc_moe"
        )
    recipe = _check_options(recipe, activation, activation_alpha, activation_clamp, fast_math)
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(
            f"y: got {getattr(y, 'shape', type(y).__name__)}; allowed: a 2-D bf16 tensor [tokens, "
            f"{buffer.hidden}]"
        )
    if num_tokens is None:
        num_tokens = y.shape[0]
    if (
        isinstance(num_tokens, bool)
        or not isinstance(num_tokens, int)
        or not 0 <= num_tokens <= buffer.capacity
    ):
        raise GcMoeConstraintError(
            [
                (
                    f"num_tokens <= capacity: got num_tokens={num_tokens!r}; allowed: 0 to "
                    f"capacity={buffer.capacity}"
                )
            ]
        )
    if y.dtype != torch.bfloat16 or y.shape[1] != buffer.hidden or y.shape[0] < num_tokens:
        raise ValueError(
            f"y: {y.dtype} {list(y.shape)}; allowed: torch.bfloat16 [>= {num_tokens}, {buffer.hidden}]"
        )
    if y.device != buffer.device:
        raise ValueError(f"y: on {y.device}; allowed: the buffer's device {buffer.device}")
    if buffer.num_shared_experts and shared_weights is None:
        raise ValueError(
            "shared_weights: got None; the buffer was made with num_shared_experts=1, so pass the "
            "FP8 shared-expert weights (formats.SharedExpertWeights)"
        )
    if not buffer.num_shared_experts and shared_weights is not None:
        raise ValueError(
            "shared_weights: given, but the buffer was made with num_shared_experts=0; allowed: None"
        )
    if shared_weights is not None:
        if not isinstance(shared_weights, SharedExpertWeights):
            raise TypeError(
                f"shared_weights: got {type(shared_weights).__name__}; allowed: formats.SharedExpertWeights"
            )
        if shared_weights.hidden != buffer.hidden or shared_weights.w1.device != buffer.device:
            raise ValueError(
                f"shared_weights: hidden {shared_weights.hidden} on {shared_weights.w1.device}; "
                f"allowed: hidden {buffer.hidden} on {buffer.device}"
            )

    backend = registered_backends().get(buffer.backend)
    if backend is None:
        raise RuntimeError(f"buffer was made for backend {buffer.backend!r}, which is no longer registered")
    layout = weight_layouts.layout_of(w1)
    if layout != backend.weight_layout:
        if backend.weight_layout != weight_layouts.CANONICAL:
            raise ValueError(
                f"w1/w2 are in the {layout!r} layout but the {backend.name!r} backend reads "
                f"{backend.weight_layout!r}; transform with transform_weights_for_gc_moe(l1, l2) "
                f"on this device"
            )
        w1, w2 = weight_layouts.to_canonical(w1, w2)
    if backend.weight_layout == weight_layouts.CANONICAL:
        experts, hidden, intermediate = _canonical_shapes(w1, w2)
        want = (buffer.local_experts, buffer.hidden, buffer.intermediate)
        if (experts, hidden, intermediate) != want or w1[0].device != buffer.device:
            raise ValueError(
                f"w1/w2: {experts} experts, H={hidden}, I={intermediate} on {w1[0].device}; allowed: this rank's "
                f"{want[0]} experts with H={want[1]}, I={want[2]} on {buffer.device}"
            )
    options = {
        "recipe": recipe,
        "activation": activation,
        "activation_alpha": float(activation_alpha),
        "activation_clamp": None if activation_clamp is None else float(activation_clamp),
        "fast_math": fast_math,
        "shared_weights": shared_weights,
    }
    backend.run(y[:num_tokens], w1, w2, buffer, num_tokens, options)


# ----------------------------------------------------------------------------------------------- reference
def _reference_allocate(buffer: GcMoeBuffer) -> dict:
    c, h, k, dev = buffer.capacity, buffer.hidden, buffer.topk, buffer.device
    return {
        "x": torch.zeros(c, h, dtype=torch.float8_e4m3fn, device=dev),
        "x_sf": torch.zeros(c, h // K128, dtype=torch.int32, device=dev),
        "topk_idx": torch.full((c, k), -1, dtype=torch.int64, device=dev),
        "topk_weights": torch.zeros(c, k, dtype=torch.float32, device=dev),
    }


def _reference_run(y_rows, w1, w2, buffer: GcMoeBuffer, num_tokens: int, options: dict) -> None:
    inputs = (
        buffer.x[:num_tokens],
        buffer.x_sf[:num_tokens],
        buffer.topk_idx[:num_tokens],
        buffer.topk_weights[:num_tokens],
        tuple(w1),
        tuple(w2),
    )
    numerics = {
        "activation_alpha": options["activation_alpha"],
        "activation_clamp": options["activation_clamp"],
        "shared_weights": options["shared_weights"],
    }
    idx = inputs[2]
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= buffer.num_experts):
        raise ValueError(
            f"buffer.topk_idx: expert ids in [{int(idx.min())}, {int(idx.max())}]; allowed: -1 (no "
            f"expert) and 0..{buffer.num_experts - 1}"
        )
    if buffer.world_size == 1:
        out = reference.moe_reference(*inputs, **numerics)
    else:
        out = reference.moe_reference_ep(buffer.group, *inputs, num_experts=buffer.num_experts, **numerics)
    y_rows.copy_(out)


register_backend(
    Backend(
        name=REFERENCE,
        archs=(None,),
        weight_layout=weight_layouts.CANONICAL,
        unavailable_reason=lambda device, arch: None,
        allocate=_reference_allocate,
        run=_reference_run,
        priority=-1,
    )
)
