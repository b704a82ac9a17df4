"""Read what a kernel binary promises without a GPU: PTX entries and parameters, cubin resource attributes.

The cubin is an ELF file; ptxas records each kernel's resources in `.nv.info` sections as
(format, attribute, value) records. We read the few attributes the runtime checks: registers,
the per-thread stack frame (local memory, where spills land), the parameter layout, and the
block shape the kernel requires. The PTX gives the entry names and the declared parameters.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

# .nv.info record formats and the attribute codes we read (ptxas' EIATTR numbering)
_FMT_NVAL, _FMT_BVAL, _FMT_HVAL, _FMT_SVAL = 0x01, 0x02, 0x03, 0x04
_ATTR_REQNTID = 0x10
_ATTR_FRAME_SIZE = 0x11
_ATTR_MIN_STACK_SIZE = 0x12
_ATTR_KPARAM_INFO = 0x17
_ATTR_CBANK_PARAM_SIZE = 0x19
_ATTR_REGCOUNT = 0x2F
_SHT_NOBITS = 8


@dataclass(frozen=True)
class ParamSlot:
    """One kernel parameter in the device-side layout: byte offset and size."""

    offset: int
    size: int


@dataclass(frozen=True)
class PtxParam:
    """One `.param` declaration of a PTX entry."""

    name: str
    size: int
    align: int


@dataclass
class KernelResources:
    """What ptxas recorded for one kernel of a cubin."""

    name: str
    registers: int | None = None
    frame_bytes: int = 0  # per-thread local memory (stack frame, spills included)
    min_stack_bytes: int = 0
    params: list[ParamSlot] = field(default_factory=list)
    param_bytes: int | None = None
    required_block: tuple[int, int, int] | None = None
    static_smem_bytes: int = 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "registers": self.registers,
            "frame_bytes": self.frame_bytes,
            "min_stack_bytes": self.min_stack_bytes,
            "params": [[p.offset, p.size] for p in self.params],
            "param_bytes": self.param_bytes,
            "required_block": list(self.required_block) if self.required_block else None,
            "static_smem_bytes": self.static_smem_bytes,
        }


class CubinFormatError(ValueError):
    """The bytes are not a cubin this reader understands."""


def _sections(elf: bytes) -> list[tuple[str, int, int, int, int, int]]:
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise CubinFormatError("not a 64-bit ELF file (a cubin starts with \\x7fELF, class 2)")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        name, kind, _flags, _addr, off, size, link, info, _align, _ent = struct.unpack_from(
            "<IIQQQQIIQQ", elf, shoff + i * shentsize
        )
        raw.append((name, kind, off, size, link, info))
    names_off = raw[shstrndx][2]

    def name_at(o: int) -> str:
        end = elf.index(b"\0", names_off + o)
        return elf[names_off + o : end].decode()

    return [(name_at(n), kind, off, size, link, info) for n, kind, off, size, link, info in raw]


def _symbols(elf: bytes, sections) -> dict[int, str]:
    """Symbol index -> name, from .symtab (the .nv.info records name kernels by symbol index)."""
    symtab = next((s for s in sections if s[0] == ".symtab"), None)
    if symtab is None:
        return {}
    strtab_off = sections[symtab[4]][2]
    out = {}
    for i in range(symtab[3] // 24):
        st_name = struct.unpack_from("<I", elf, symtab[2] + 24 * i)[0]
        end = elf.index(b"\0", strtab_off + st_name)
        out[i] = elf[strtab_off + st_name : end].decode()
    return out


def _records(blob: bytes):
    i = 0
    while i + 2 <= len(blob):
        fmt, attr = blob[i], blob[i + 1]
        if fmt == _FMT_SVAL:
            size = struct.unpack_from("<H", blob, i + 2)[0]
            yield attr, blob[i + 4 : i + 4 + size]
            i += 4 + size
        elif fmt in (_FMT_HVAL, _FMT_BVAL):
            yield attr, blob[i + 2 : i + 4]
            i += 4
        elif fmt == _FMT_NVAL:
            yield attr, b""
            i += 4
        else:
            raise CubinFormatError(f"unknown .nv.info record format {fmt:#x} at byte {i}")


def read_cubin_resources(elf: bytes) -> dict[str, KernelResources]:
    """Kernel name -> resources recorded in the cubin (registers, frame, parameter layout, block)."""
    sections = _sections(elf)
    symbols = _symbols(elf, sections)
    kernels: dict[str, KernelResources] = {}

    def kernel(name: str) -> KernelResources:
        return kernels.setdefault(name, KernelResources(name=name))

    for name, kind, off, size, _link, _info in sections:
        if name.startswith(".text."):
            kernel(name[len(".text.") :])
    for name, kind, off, size, _link, _info in sections:
        if name == ".nv.info":
            for attr, val in _records(elf[off : off + size]):
                if attr in (_ATTR_REGCOUNT, _ATTR_FRAME_SIZE, _ATTR_MIN_STACK_SIZE) and len(val) == 8:
                    sym, value = struct.unpack("<II", val)
                    k = kernel(symbols.get(sym, f"symbol#{sym}"))
                    if attr == _ATTR_REGCOUNT:
                        k.registers = value
                    elif attr == _ATTR_FRAME_SIZE:
                        k.frame_bytes = value
                    else:
                        k.min_stack_bytes = value
        elif name.startswith(".nv.info."):
            k = kernel(name[len(".nv.info.") :])
            params: dict[int, ParamSlot] = {}
            for attr, val in _records(elf[off : off + size]):
                if attr == _ATTR_KPARAM_INFO and len(val) == 12:
                    _index, ordinal, offset, packed = struct.unpack("<IHHI", val)
                    params[ordinal] = ParamSlot(offset=offset, size=(packed >> 18) & 0x3FFF)
                elif attr == _ATTR_CBANK_PARAM_SIZE:
                    k.param_bytes = struct.unpack("<H", val[:2])[0]
                elif attr == _ATTR_REQNTID and len(val) == 12:
                    k.required_block = struct.unpack("<III", val)
            k.params = [params[i] for i in sorted(params)]
        elif name.startswith(".nv.shared.") and kind == _SHT_NOBITS and not name.startswith(".nv.shared.reserved"):
            kernel(name[len(".nv.shared.") :]).static_smem_bytes = size
    return {n: k for n, k in kernels.items() if not n.startswith("symbol#")}


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.DOTALL)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)(?:\s+\.ptr\s+\.\w+\s+\.align\s+\d+)?\s+(\w+)(?:\[(\d+)\])?")
_SCALAR_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4,
                 "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def ptx_entries(ptx: str) -> dict[str, list[PtxParam]]:
    """Entry name -> its declared parameters (size and alignment in bytes), in order."""
    out = {}
    for entry, body in _ENTRY.findall(ptx):
        params = []
        for align, scalar, name, count in _PARAM.findall(body):
            elem = _SCALAR_BYTES[scalar]
            size = elem * int(count) if count else elem
            params.append(PtxParam(name=name, size=size, align=int(align) if align else elem))
        out[entry] = params
    return out


def ptx_required_block(ptx: str, entry: str) -> tuple[int, int, int] | None:
    """The `.reqntid` of an entry (the block shape the kernel was compiled for), if declared."""
    m = re.search(re.escape(entry) + r"\s*\(.*?\)\s*((?:\.\w+[^{]*?)*)\{", ptx, re.DOTALL)
    if not m:
        return None
    r = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", m.group(1))
    if not r:
        return None
    return tuple(int(x) if x else 1 for x in r.groups())  # type: ignore[return-value]


def ptx_instruction_count(ptx: str, mnemonic_prefix: str) -> int:
    """How many instructions in the PTX start with the given mnemonic prefix (e.g. 'wgmma.mma_async')."""
    pattern = re.compile(r"^\s*(?:@!?%?\w+\s+)?" + re.escape(mnemonic_prefix), re.MULTILINE)
    return len(pattern.findall(ptx))
