"""The symmetric-memory workspace: one allocation per group, laid out by a typed table of named regions.

Every rank allocates the same bytes with torch symmetric memory and rendezvouses; each region
(inputs, routing, token ring, combine buffer, signals and counters) is a typed view at a fixed
offset, the same on every rank, so a peer's region is its buffer pointer plus the same offset. The
peer descriptor that kernels take by value is 592 bytes: the local base (u64), 72 int64 offsets
(peer base - local base, one per rank, unused ones zero) and the rank index (int64).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PEERS = 72
PEER_DESCRIPTOR_BYTES = 8 + 8 * MAX_PEERS + 8  # 592
REGION_ALIGN = 1024  # TMA boxes and 128-byte swizzled tiles start on 1 KiB boundaries

_DTYPE_BYTES = {"uint8": 1, "int8": 1, "float8_e4m3fn": 1, "int16": 2, "bfloat16": 2, "float16": 2,
                "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}


@dataclass(frozen=True)
class Region:
    """A named, typed block of the workspace."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"region {self.name!r}: dtype {self.dtype!r} unsupported, allowed {sorted(_DTYPE_BYTES)}")
        n = _DTYPE_BYTES[self.dtype]
        for d in self.shape:
            if d < 0:
                raise ValueError(f"region {self.name!r}: negative dimension in shape {self.shape}")
            n *= d
        return n


class WorkspaceLayout:
    """Offsets of each region in one allocation, each aligned to REGION_ALIGN bytes."""

    def __init__(self, regions: Sequence[Region], align: int = REGION_ALIGN):
        if align < 1 or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two")
        names = [r.name for r in regions]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"region names must be unique, repeated: {sorted(dup)}")
        self.regions = list(regions)
        self.align = align
        self.offsets: dict[str, int] = {}
        offset = 0
        for r in self.regions:
            offset = (offset + align - 1) // align * align
            self.offsets[r.name] = offset
            offset += r.nbytes
        self.total_bytes = (offset + align - 1) // align * align

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r}: the layout has {[r.name for r in self.regions]}")

    def table(self) -> list[dict]:
        return [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "offset": self.offsets[r.name],
                 "bytes": r.nbytes} for r in self.regions]


def peer_descriptor(local_base: int, peer_bases: Sequence[int], rank: int) -> bytes:
    """The 592-byte by-value peer descriptor: base, 72 offsets (peer - base), rank index."""
    if not 1 <= len(peer_bases) <= MAX_PEERS:
        raise ValueError(f"{len(peer_bases)} peers: the descriptor holds 1..{MAX_PEERS}")
    if not 0 <= rank < len(peer_bases):
        raise ValueError(f"rank {rank} outside 0..{len(peer_bases) - 1}")
    if peer_bases[rank] != local_base:
        raise ValueError(f"peer_bases[{rank}] = {peer_bases[rank]:#x} is not this rank's base {local_base:#x}")
    offsets = [b - local_base for b in peer_bases] + [0] * (MAX_PEERS - len(peer_bases))
    data = struct.pack(f"<Q{MAX_PEERS}qq", local_base, *offsets, rank)
    assert len(data) == PEER_DESCRIPTOR_BYTES
    return data


class SymmetricWorkspace:
    """One torch symmetric-memory buffer per group, rendezvoused; typed views per region."""

    def __init__(self, layout: WorkspaceLayout, group=None, device=None):
        import torch
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if not dist.is_initialized():
            raise RuntimeError("the workspace needs an initialized torch.distributed process group "
                               "(world size 1 is fine)")
        self.layout = layout
        self.group = group or dist.group.WORLD
        device = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        self.buffer = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group.group_name)
        self.rank = self.handle.rank
        self.world_size = self.handle.world_size
        self.peer_bases = [int(p) for p in self.handle.buffer_ptrs]
        self.base = self.buffer.data_ptr()
        self.views = {}
        for r in layout.regions:
            start = layout.offsets[r.name]
            flat = self.buffer[start : start + r.nbytes].view(getattr(torch, r.dtype))
            self.views[r.name] = flat.view(r.shape)

    def __getattr__(self, name: str):
        views = self.__dict__.get("views", {})
        if name in views:
            return views[name]
        raise AttributeError(name)

    def peer_descriptor(self) -> bytes:
        return peer_descriptor(self.base, self.peer_bases, self.rank)

    def barrier(self) -> None:
        self.handle.barrier()
