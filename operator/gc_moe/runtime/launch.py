"""Our own kernel launcher: arguments by value, checked against the cubin's parameter layout.

Every argument is an explicit `KernelArg` (pointer, integer, float, raw bytes, TMA descriptor) with a
size and alignment. Before any launch the arguments' C layout is compared, slot by slot, with the
layout the driver reports for the loaded kernel (`cuKernelGetParamInfo`); any difference is an error
(fail closed). TMA descriptors are encoded on the host (`cuTensorMapEncodeTiled`) and travel by value
(128 bytes, 64-byte aligned), as does the 592-byte peer descriptor of the workspace.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .cubin import ParamSlot
from .driver import check, cu

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024  # above this a kernel needs its dynamic limit raised


class ParamLayoutError(ValueError):
    """Kernel arguments do not match the kernel's parameter layout."""


@dataclass(frozen=True)
class KernelArg:
    """One kernel argument by value: its bytes and the alignment its slot needs."""

    data: bytes
    align: int
    what: str = ""

    @property
    def size(self) -> int:
        return len(self.data)


def ptr(value: Any) -> KernelArg:
    """A device pointer: an int address, or a tensor-like object with data_ptr()."""
    address = value.data_ptr() if hasattr(value, "data_ptr") else int(value)
    if address < 0 or address >= 1 << 64:
        raise ValueError(f"device pointer {address:#x} is outside 64 bits")
    return KernelArg(struct.pack("<Q", address), 8, "ptr")


def i32(value: int) -> KernelArg:
    return KernelArg(struct.pack("<i", int(value)), 4, "i32")


def u32(value: int) -> KernelArg:
    return KernelArg(struct.pack("<I", int(value)), 4, "u32")


def i64(value: int) -> KernelArg:
    return KernelArg(struct.pack("<q", int(value)), 8, "i64")


def u64(value: int) -> KernelArg:
    return KernelArg(struct.pack("<Q", int(value)), 8, "u64")


def f32(value: float) -> KernelArg:
    return KernelArg(struct.pack("<f", float(value)), 4, "f32")


def raw(data: bytes, align: int) -> KernelArg:
    """A by-value struct (e.g. a DSL tensor {ptr, shape, strides}, or the peer descriptor)."""
    if align not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"alignment {align} is not a power of two up to 128")
    return KernelArg(bytes(data), align, f"raw[{len(data)}]")


def natural_layout(args: Sequence[KernelArg]) -> list[ParamSlot]:
    """C layout of the arguments in order: each at the next offset its alignment allows."""
    slots, offset = [], 0
    for arg in args:
        offset = (offset + arg.align - 1) // arg.align * arg.align
        slots.append(ParamSlot(offset, arg.size))
        offset += arg.size
    return slots


def check_param_layout(args: Sequence[KernelArg], expected: Sequence[ParamSlot], kernel: str = "kernel") -> None:
    """Fail closed unless every argument lands at the offset and with the size the kernel expects."""
    if len(args) != len(expected):
        raise ParamLayoutError(f"{kernel} takes {len(expected)} parameters, got {len(args)} arguments")
    for i, (arg, have, want) in enumerate(zip(args, natural_layout(args), expected)):
        if have.size != want.size:
            raise ParamLayoutError(f"{kernel} parameter {i}: argument {arg.what or 'value'} is {have.size} bytes, "
                                   f"the kernel expects {want.size} bytes")
        if have.offset != want.offset:
            raise ParamLayoutError(f"{kernel} parameter {i}: argument would sit at byte {have.offset}, the kernel "
                                   f"reads it at byte {want.offset} (alignment {arg.align} of {arg.what or 'value'})")


class ParamBuffer:
    """Argument bytes laid out per the kernel's slots, and the void*[] array the driver reads."""

    def __init__(self, args: Sequence[KernelArg], slots: Sequence[ParamSlot]):
        total = max((s.offset + s.size for s in slots), default=0)
        self._storage = ctypes.create_string_buffer(total + TENSOR_MAP_ALIGN)
        base = ctypes.addressof(self._storage)
        base = (base + TENSOR_MAP_ALIGN - 1) // TENSOR_MAP_ALIGN * TENSOR_MAP_ALIGN
        for arg, slot in zip(args, slots):
            ctypes.memmove(base + slot.offset, arg.data, slot.size)
        self._pointers = (ctypes.c_void_p * max(1, len(slots)))(*[base + s.offset for s in slots])
        self.base = base
        self.signature = b"".join(a.data for a in args)

    @property
    def address(self) -> int:
        """The int address of the void*[] array (what kernelParams takes)."""
        return ctypes.addressof(self._pointers)


# ------------------------------------------------------------------------------------------------------------
# TMA descriptors


_TMA_DTYPES = {  # element name -> (CUtensorMapDataType member, bytes per element)
    "uint8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1), "float8_e4m3fn": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "int8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1), "uint16": ("CU_TENSOR_MAP_DATA_TYPE_UINT16", 2),
    "float16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2), "bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    "uint32": ("CU_TENSOR_MAP_DATA_TYPE_UINT32", 4), "int32": ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4),
    "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4), "uint64": ("CU_TENSOR_MAP_DATA_TYPE_UINT64", 8),
    "int64": ("CU_TENSOR_MAP_DATA_TYPE_INT64", 8),
}
_SWIZZLE_SPAN = {"none": None, "32B": 32, "64B": 64, "128B": 128}


@dataclass(frozen=True)
class TiledTensorMapSpec:
    """A tiled TMA descriptor's request; dims and box are innermost first (the driver's order)."""

    dtype: str
    address: int
    dims: tuple[int, ...]
    strides_bytes: tuple[int, ...]  # for dims 1..rank-1 (dim 0 is contiguous)
    box: tuple[int, ...]
    element_strides: tuple[int, ...] | None = None
    swizzle: str = "128B"
    l2_promotion: str = "256B"
    oob_fill_nan: bool = False

    def validate(self) -> None:
        """The driver's documented constraints, checked with errors that say which one failed."""
        if self.dtype not in _TMA_DTYPES:
            raise ValueError(f"TMA element type {self.dtype!r} unsupported: allowed {sorted(_TMA_DTYPES)}")
        elem = _TMA_DTYPES[self.dtype][1]
        rank = len(self.dims)
        if not 1 <= rank <= 5:
            raise ValueError(f"a tiled tensor map has rank 1..5, got {rank}")
        if len(self.box) != rank or len(self.strides_bytes) != rank - 1:
            raise ValueError(f"rank {rank} needs {rank} box sizes and {rank - 1} strides, got {len(self.box)} "
                             f"and {len(self.strides_bytes)}")
        if self.address % 16:
            raise ValueError(f"global address {self.address:#x} is not 16-byte aligned")
        for i, d in enumerate(self.dims):
            if not 1 <= d <= 1 << 32:
                raise ValueError(f"dim {i} = {d} is outside 1..2^32")
        for i, s in enumerate(self.strides_bytes, start=1):
            if s % 16 or not 0 < s < 1 << 40:
                raise ValueError(f"stride of dim {i} = {s} bytes must be a positive multiple of 16 below 2^40")
        for i, b in enumerate(self.box):
            if not 1 <= b <= 256:
                raise ValueError(f"box dim {i} = {b} is outside 1..256")
        if (self.box[0] * elem) % 16:
            raise ValueError(f"inner box of {self.box[0]} x {elem} bytes is not a multiple of 16 bytes")
        if self.swizzle not in _SWIZZLE_SPAN:
            raise ValueError(f"swizzle {self.swizzle!r} unknown: allowed {list(_SWIZZLE_SPAN)}")
        span = _SWIZZLE_SPAN[self.swizzle]
        if span is not None and self.box[0] * elem > span:
            raise ValueError(f"inner box of {self.box[0] * elem} bytes exceeds the {self.swizzle} swizzle span")
        es = self.element_strides or (1,) * rank
        if len(es) != rank or any(not 1 <= e <= 8 for e in es):
            raise ValueError(f"element strides {es} must be {rank} values in 1..8")
        if self.l2_promotion not in ("none", "64B", "128B", "256B"):
            raise ValueError(f"L2 promotion {self.l2_promotion!r} unknown: allowed none, 64B, 128B, 256B")


def encode_tiled_tensor_map(spec: TiledTensorMapSpec) -> KernelArg:
    """cuTensorMapEncodeTiled on the host; the 128-byte descriptor goes to the kernel by value."""
    spec.validate()
    rank = len(spec.dims)
    dtype = getattr(cu.CUtensorMapDataType, _TMA_DTYPES[spec.dtype][0])
    swizzle = getattr(cu.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + spec.swizzle.upper())
    promo = getattr(cu.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" +
                    ("NONE" if spec.l2_promotion == "none" else "L2_" + spec.l2_promotion.upper()))
    fill = (cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA if spec.oob_fill_nan
            else cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    tmap = check(cu.cuTensorMapEncodeTiled(
        dtype, rank, spec.address, [cu.cuuint64_t(d) for d in spec.dims],
        [cu.cuuint64_t(s) for s in spec.strides_bytes], [cu.cuuint32_t(b) for b in spec.box],
        [cu.cuuint32_t(e) for e in (spec.element_strides or (1,) * rank)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promo, fill), "cuTensorMapEncodeTiled")
    data = tensor_map_bytes(tmap)
    return KernelArg(data, TENSOR_MAP_ALIGN, "tensor_map")


def tensor_map_bytes(tmap) -> bytes:
    """The 128 opaque bytes of a CUtensorMap."""
    words = [int(w) for w in tmap.opaque]
    data = struct.pack(f"<{len(words)}Q", *words)
    if len(data) != TENSOR_MAP_BYTES:
        raise RuntimeError(f"CUtensorMap has {len(data)} bytes, expected {TENSOR_MAP_BYTES}")
    return data


# ------------------------------------------------------------------------------------------------------------
# loaded kernels and launches


def driver_param_layout(kernel) -> list[ParamSlot]:
    """The device-side parameter layout the driver reports for a CUkernel (cuKernelGetParamInfo)."""
    slots = []
    for index in range(4096):
        err, offset, size = cu.cuKernelGetParamInfo(kernel, index)
        if int(err) != 0:
            break
        slots.append(ParamSlot(int(offset), int(size)))
    return slots


class LoadedKernel:
    """A cubin loaded with cuLibraryLoadData (context-independent) and its kernel handle."""

    _libraries: ClassVar[dict[str, Any]] = {}  # cubin sha256 -> CUlibrary, one load per process

    def __init__(self, entry, library, kernel, params: list[ParamSlot]):
        self.entry = entry
        self.library = library
        self.kernel = kernel
        self.params = params
        self._smem_limit_set: dict[int, int] = {}

    @property
    def name(self) -> str:
        return self.entry.variant.describe()

    @classmethod
    def from_entry(cls, entry) -> LoadedKernel:
        check(cu.cuInit(0), "cuInit")
        library = cls._libraries.get(entry.cubin_sha256)
        if library is None:
            library = check(cu.cuLibraryLoadData(entry.cubin(), None, None, 0, None, None, 0), "cuLibraryLoadData")
            cls._libraries[entry.cubin_sha256] = library
        kernel = check(cu.cuLibraryGetKernel(library, entry.entry_name.encode()),
                       f"cuLibraryGetKernel({entry.entry_name})")
        params = driver_param_layout(kernel)
        recorded = [ParamSlot(o, s) for o, s in entry.resources.get("params", [])]
        if params != recorded:
            raise ParamLayoutError(f"{entry.variant.describe()}: the driver reports parameters {params}, the cache "
                                   f"entry recorded {recorded}: the cubin and its entry disagree, rebuild it")
        return cls(entry, library, kernel, params)

    def pack(self, args: Sequence[Any]) -> ParamBuffer:
        """Check the arguments against the driver's layout and lay them out by value."""
        args = [as_kernel_arg(a) for a in args]
        check_param_layout(args, self.params, self.name)
        return ParamBuffer(args, self.params)

    def ensure_dynamic_smem(self, nbytes: int, device: int = 0) -> None:
        """Raise the kernel's dynamic shared-memory limit when it needs more than the default 48 KiB."""
        if nbytes <= _DEFAULT_DYNAMIC_SMEM_LIMIT or self._smem_limit_set.get(device, 0) >= nbytes:
            return
        dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuKernelSetAttribute(attr, nbytes, self.kernel, dev), "cuKernelSetAttribute(max dynamic smem)")
        self._smem_limit_set[device] = nbytes

    def as_function(self):
        """The CUkernel cast to CUfunction: the driver resolves it in the stream's (green) context."""
        return cu.CUfunction(int(self.kernel))


def as_kernel_arg(value: Any) -> KernelArg:
    if isinstance(value, KernelArg):
        return value
    if hasattr(value, "data_ptr"):
        return ptr(value)
    raise TypeError(f"kernel arguments must be KernelArg values (ptr, i32, u32, i64, u64, f32, raw, tensor maps) "
                    f"or tensors, got {type(value).__name__}: say its width explicitly")


def _dim3(value, what: str) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def launch(kernel: LoadedKernel, grid, args: Sequence[Any], stream: Any, dynamic_smem: int | None = None,
           cluster=None, programmatic: bool = False) -> ParamBuffer:
    """Launch into `stream` (a green context's stream, an int handle, or a torch stream).

    Block, dynamic shared memory and cluster come from the kernel's launch shape unless given here.
    programmatic: programmatic stream serialization (a stream capture records a programmatic edge): the kernel
    may start before the previous one in the stream completes and must itself wait (`griddepcontrol.wait`)
    before reading what that kernel writes.
    Returns the packed parameters (the caller may keep them for a graph node of the same call).
    """
    shape = kernel.entry.launch
    grid = _dim3(grid, "grid")
    block = shape.block
    smem = shape.dynamic_smem_bytes if dynamic_smem is None else int(dynamic_smem)
    cluster = _dim3(cluster or shape.cluster, "cluster")
    if any(g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"grid {grid} is not a multiple of the cluster {cluster}")
    params = kernel.pack(args)
    kernel.ensure_dynamic_smem(smem)
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = stream_handle(stream)
    attrs = []
    if cluster != (1, 1, 1):
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    if programmatic:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    check(cu.cuLaunchKernelEx(config, kernel.as_function(), params.address, 0), f"launch {kernel.name}")
    return params


def stream_handle(stream: Any):
    """A CUstream from a CUstream, an int handle, or an object with cuda_stream (torch streams)."""
    if stream is None:
        return cu.CUstream(0)
    if hasattr(stream, "cuda_stream"):
        return cu.CUstream(int(stream.cuda_stream))
    if isinstance(stream, int):
        return cu.CUstream(stream)
    return stream
