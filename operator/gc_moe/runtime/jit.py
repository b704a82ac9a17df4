"""Offline kernel build and the content-addressed cubin cache.

A kernel variant (`KernelVariant`) names a builder function in a kernel module and its compile-time
parameters. Building runs the CuTe DSL on any machine, no GPU needed: the builder returns a
`CompileRequest` (a `@cute.jit` host function that launches one `@cute.kernel`, placeholder arguments,
the launch shape), the DSL compiles it for the named arch and we keep its PTX and cubin.

Cache layout (GC_MOE_CACHE_DIR; default `.cubin-cache/` in a source checkout, else the user cache):

    objects/<sha256>.cubin, objects/<sha256>.ptx      content-addressed binaries
    entries/<arch>/<variant>/<lookup key>.json         what built them and what they promise

The lookup key hashes what decides the binary and is known without the DSL: the variant (module,
builder, parameters), the arch, the locked compiler options, the supported DSL version and a hash of
the kernel's own source files. The entry records the full compiler identity of the build. So a machine
with only the CUDA driver (the runtime path) finds the cubin it needs, and a machine with the DSL
rebuilds when its compiler identity differs from the one recorded.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cubin as cubin_info

ARCHS = ("sm_90a", "sm_100a", "sm_100f", "sm_103a", "sm_103f")  # arch- or family-specific targets
SUPPORTED_DSL_VERSION = "4.8.1"
DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
# bump when the entry format or the way binaries are produced changes: it invalidates every entry
BUILD_FORMAT = 1
# options are locked: the arch varies, nothing else (no relocatable code, no user overrides)
_OPT_LEVEL = 3

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../gc_moe
_COMMON_KERNEL_SOURCES = "kernels/common"


class KernelNotBuiltError(RuntimeError):
    """The cache has no cubin for a kernel and this machine cannot build one."""


class KernelBuildError(RuntimeError):
    """The DSL failed to build a kernel, or the binary breaks what its variant promises."""


@dataclass(frozen=True)
class LaunchShape:
    """How a kernel must be launched; the grid is the caller's."""

    block: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    dynamic_smem_bytes: int = 0

    def to_dict(self) -> dict:
        return {"block": list(self.block), "cluster": list(self.cluster),
                "dynamic_smem_bytes": self.dynamic_smem_bytes}

    @staticmethod
    def from_dict(d: Mapping) -> LaunchShape:
        return LaunchShape(tuple(d["block"]), tuple(d["cluster"]), int(d["dynamic_smem_bytes"]))


@dataclass(frozen=True)
class CompileRequest:
    """What a kernel builder returns: the DSL host function, placeholder arguments, the launch shape."""

    host_fn: Callable
    args: tuple
    launch: LaunchShape


@dataclass(frozen=True)
class KernelVariant:
    """One compiled form of one kernel: `module.builder(arch=..., **params) -> CompileRequest`.

    `promises` are PTX mnemonic prefixes the binary must contain (e.g. 'wgmma.mma_async');
    `local_bytes_budget` bounds the per-thread stack frame (local memory, spills included);
    `extra_sources` names other gc_moe modules (dotted) whose source shapes this kernel.
    """

    name: str
    module: str
    builder: str
    params: tuple[tuple[str, Any], ...] = ()
    promises: tuple[str, ...] = ()
    local_bytes_budget: int = 0
    extra_sources: tuple[str, ...] = ()

    @staticmethod
    def make(name: str, module: str, builder: str, params: Mapping[str, Any] | None = None, **kw) -> KernelVariant:
        return KernelVariant(name, module, builder, tuple(sorted((params or {}).items())), **kw)

    def describe(self) -> str:
        ps = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}[{ps}]" if ps else self.name


@dataclass
class CacheEntry:
    """A built kernel in the cache: where its binaries are and what they contain."""

    variant: KernelVariant
    arch: str
    key: str
    entry_name: str
    cubin_sha256: str
    ptx_sha256: str
    launch: LaunchShape
    ptx_params: list[dict]
    resources: dict
    identity: dict
    cache_dir: Path
    built_at: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def cubin_path(self) -> Path:
        return self.cache_dir / "objects" / f"{self.cubin_sha256}.cubin"

    @property
    def ptx_path(self) -> Path:
        return self.cache_dir / "objects" / f"{self.ptx_sha256}.ptx"

    def cubin(self) -> bytes:
        data = self.cubin_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.cubin_sha256:
            raise KernelBuildError(f"cubin {self.cubin_path} does not match its recorded hash: delete it and rebuild")
        return data

    def ptx(self) -> str:
        return self.ptx_path.read_text()

    def to_json(self) -> dict:
        return {
            "build_format": BUILD_FORMAT,
            "variant": {"name": self.variant.name, "module": self.variant.module, "builder": self.variant.builder,
                        "params": [list(p) for p in self.variant.params], "promises": list(self.variant.promises),
                        "local_bytes_budget": self.variant.local_bytes_budget,
                        "extra_sources": list(self.variant.extra_sources)},
            "arch": self.arch, "key": self.key, "entry_name": self.entry_name,
            "cubin_sha256": self.cubin_sha256, "ptx_sha256": self.ptx_sha256,
            "launch": self.launch.to_dict(), "ptx_params": self.ptx_params, "resources": self.resources,
            "identity": self.identity, "built_at": self.built_at, "extra": self.extra,
        }

    @staticmethod
    def from_json(d: Mapping, cache_dir: Path) -> CacheEntry:
        v = d["variant"]
        variant = KernelVariant(v["name"], v["module"], v["builder"], tuple(tuple(p) for p in v["params"]),
                                tuple(v["promises"]), int(v["local_bytes_budget"]), tuple(v["extra_sources"]))
        return CacheEntry(variant, d["arch"], d["key"], d["entry_name"], d["cubin_sha256"], d["ptx_sha256"],
                          LaunchShape.from_dict(d["launch"]), d["ptx_params"], d["resources"], d["identity"],
                          cache_dir, d.get("built_at", ""), d.get("extra", {}))


# ----------------------------------------------------------------------------------------------------------
# cache location, keys, identity


def default_cache_dir() -> Path:
    """GC_MOE_CACHE_DIR, else `.cubin-cache/` of the source checkout, else the user's cache directory."""
    env = os.environ.get("GC_MOE_CACHE_DIR")
    if env:
        return Path(env).expanduser().resolve()
    checkout = _PACKAGE_ROOT.parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "operator").is_dir():
        return checkout / ".cubin-cache"
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "gc_moe" / "cubins"


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: allowed {', '.join(ARCHS)} (arch-specific 'a' or family 'f' "
                         "targets: plain sm_90 lacks wgmma/setmaxnreg)")
    return arch


def assembler() -> str:
    """'dsl' (the DSL's own PTX->cubin path, the default) or the path of a system ptxas (GC_MOE_PTXAS)."""
    return os.environ.get("GC_MOE_PTXAS") or "dsl"


def _ptxas_identity(path: str) -> dict:
    import shutil
    import subprocess

    exe = shutil.which(path) or path
    if not os.path.isfile(exe):
        raise KernelBuildError(f"GC_MOE_PTXAS={path!r} is not an executable file")
    data = Path(exe).read_bytes()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    return {"path": exe, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "version": version.splitlines()[-1] if version else ""}


def _assemble_with_ptxas(exe: str, ptx: str, arch: str) -> bytes:
    import subprocess

    with tempfile.TemporaryDirectory(prefix="gc_moe_ptxas_") as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"-O{_OPT_LEVEL}", f"-arch={arch}", str(src), "-o", str(out)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"{exe} rejected the PTX for {arch}: {proc.stderr.strip()[:500]}")
        return out.read_bytes()


def compile_options(arch: str) -> str:
    return f"--gpu-arch {check_arch(arch)} --opt-level {_OPT_LEVEL} --keep-ptx --keep-cubin"


def _module_file(dotted: str) -> Path:
    if not dotted.startswith("gc_moe."):
        raise ValueError(f"kernel sources must live in gc_moe, got module {dotted!r}")
    rel = Path(*dotted.split(".")[1:])
    for candidate in (_PACKAGE_ROOT / rel.with_suffix(".py"), _PACKAGE_ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"no source file for module {dotted!r} under the gc_moe package")


def source_files(variant: KernelVariant) -> list[Path]:
    """The files whose content decides the variant's binary: its module, kernels/common, extra sources."""
    files = {_module_file(variant.module)}
    files.update(_module_file(m) for m in variant.extra_sources)
    common = _PACKAGE_ROOT / _COMMON_KERNEL_SOURCES
    if common.is_dir():
        files.update(common.rglob("*.py"))
    return sorted(files)


def source_hash(variant: KernelVariant) -> str:
    h = hashlib.sha256()
    for f in source_files(variant):
        h.update(f.relative_to(_PACKAGE_ROOT).as_posix().encode() + b"\0")
        h.update(f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()


def lookup_key(variant: KernelVariant, arch: str) -> str:
    """Content address of a variant's cache entry; computable without the DSL or a GPU."""
    record = {
        "build_format": BUILD_FORMAT,
        "variant": [variant.name, variant.module, variant.builder, [list(p) for p in variant.params]],
        "arch": check_arch(arch),
        "options": compile_options(arch),
        "assembler": "dsl" if assembler() == "dsl" else "ptxas",
        "dsl": f"{DSL_DISTRIBUTION}=={SUPPORTED_DSL_VERSION}",
        "source": source_hash(variant),
    }
    blob = json.dumps(record, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def dsl_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None and _installed_version(DSL_DISTRIBUTION) is not None


def _installed_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def compiler_identity() -> dict:
    """What built a binary: DSL version and flavour, a hash of its installed files list, Python, options."""
    from importlib import metadata

    identity: dict[str, Any] = {"dsl_version": _installed_version(DSL_DISTRIBUTION), "python": platform.python_version()}
    flavours = [d for d in ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-base")
                if _installed_version(d)]
    identity["dsl_libs"] = {d: _installed_version(d) for d in flavours}
    h = hashlib.sha256()
    for dist in [DSL_DISTRIBUTION, *flavours]:
        try:
            record = metadata.distribution(dist).read_text("RECORD") or ""
        except metadata.PackageNotFoundError:
            record = ""
        h.update(record.encode())
    identity["dsl_record_sha256"] = h.hexdigest()
    exe = assembler()
    identity["assembler"] = "dsl-internal" if exe == "dsl" else _ptxas_identity(exe)
    return identity


# ----------------------------------------------------------------------------------------------------------
# build


def _entry_path(cache_dir: Path, variant: KernelVariant, arch: str, key: str) -> Path:
    return cache_dir / "entries" / arch / variant.name / f"{key}.json"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def find_entry(variant: KernelVariant, arch: str, cache_dir: Path | None = None) -> CacheEntry | None:
    """The cache entry for a variant, or None (no entry, or its binary is missing)."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    path = _entry_path(cache_dir, variant, arch, lookup_key(variant, arch))
    if not path.is_file():
        return None
    entry = CacheEntry.from_json(json.loads(path.read_text()), cache_dir)
    if not entry.cubin_path.is_file():
        return None
    return entry


def check_promises(entry: CacheEntry, ptx: str | None = None) -> list[str]:
    """What the binary breaks of what its variant promises (empty when it keeps every promise)."""
    ptx = entry.ptx() if ptx is None else ptx
    problems = []
    for mnemonic in entry.variant.promises:
        if cubin_info.ptx_instruction_count(ptx, mnemonic) == 0:
            problems.append(f"{entry.variant.name}: PTX has no '{mnemonic}' instruction")
    frame = int(entry.resources.get("frame_bytes") or 0)
    if frame > entry.variant.local_bytes_budget:
        problems.append(f"{entry.variant.name}: {frame} bytes of local memory per thread (stack frame, spills "
                        f"included) over its budget of {entry.variant.local_bytes_budget}")
    cubin_params = [tuple(p) for p in entry.resources.get("params", [])]
    ptx_sizes = [p["size"] for p in entry.ptx_params]
    if [s for _, s in cubin_params] != ptx_sizes:
        problems.append(f"{entry.variant.name}: cubin parameter sizes {[s for _, s in cubin_params]} differ from "
                        f"the PTX declaration {ptx_sizes}")
    block = entry.resources.get("required_block")
    if block and tuple(block) != tuple(entry.launch.block):
        problems.append(f"{entry.variant.name}: cubin requires block {tuple(block)}, its launch shape says "
                        f"{entry.launch.block}")
    return problems


def build_variant(variant: KernelVariant, arch: str, cache_dir: Path | None = None, force: bool = False) -> CacheEntry:
    """Compile a variant for `arch` with the CuTe DSL (no GPU needed) and store it; reuse a valid entry."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    check_arch(arch)
    if not dsl_available():
        raise KernelNotBuiltError(_not_built_message(variant, arch, cache_dir, reason="the CuTe DSL is not installed"))
    identity = compiler_identity()
    if identity["dsl_version"] != SUPPORTED_DSL_VERSION:
        raise KernelBuildError(f"{DSL_DISTRIBUTION} {identity['dsl_version']} is installed, the kernels are written "
                               f"for {SUPPORTED_DSL_VERSION}: pip install {DSL_DISTRIBUTION}=={SUPPORTED_DSL_VERSION}")
    existing = find_entry(variant, arch, cache_dir)
    if existing is not None and not force and existing.identity == identity:
        return existing

    key = lookup_key(variant, arch)
    module = importlib.import_module(variant.module)
    builder = getattr(module, variant.builder, None)
    if builder is None:
        raise KernelBuildError(f"{variant.module} has no builder {variant.builder!r} for kernel {variant.name}")
    request = builder(arch=arch, **dict(variant.params))
    if not isinstance(request, CompileRequest):
        raise KernelBuildError(f"{variant.module}.{variant.builder} returned {type(request).__name__}, "
                               "expected a CompileRequest")

    from cutlass import cute

    started = time.perf_counter()
    # the DSL writes kept files into a dump directory (the working directory by default): give it a scratch one
    with tempfile.TemporaryDirectory(prefix="gc_moe_build_") as scratch:
        try:
            compiled = cute.compile(request.host_fn, *request.args,
                                    options=f"{compile_options(arch)} --dump-dir {scratch}")
        except Exception as exc:  # the DSL's errors are many kinds; name the kernel and keep the cause
            raise KernelBuildError(f"building {variant.describe()} for {arch} failed: {exc}") from exc
    seconds = time.perf_counter() - started
    cubin_bytes, ptx_text = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    if ptx_text and assembler() != "dsl":
        cubin_bytes = _assemble_with_ptxas(identity["assembler"]["path"], ptx_text, arch)
    if not cubin_bytes or not ptx_text:
        raise KernelBuildError(f"the DSL kept no cubin/PTX for {variant.describe()} (options {compile_options(arch)})")

    entries = cubin_info.ptx_entries(ptx_text)
    if len(entries) != 1:
        raise KernelBuildError(f"{variant.describe()}: expected one kernel entry, the PTX has {sorted(entries)}: "
                               "a variant's host function must launch exactly one kernel")
    entry_name, ptx_params = next(iter(entries.items()))
    resources = cubin_info.read_cubin_resources(cubin_bytes).get(entry_name)
    if resources is None:
        raise KernelBuildError(f"{variant.describe()}: cubin has no kernel named {entry_name}")

    cubin_sha, ptx_sha = hashlib.sha256(cubin_bytes).hexdigest(), hashlib.sha256(ptx_text.encode()).hexdigest()
    _write_atomic(cache_dir / "objects" / f"{cubin_sha}.cubin", cubin_bytes)
    _write_atomic(cache_dir / "objects" / f"{ptx_sha}.ptx", ptx_text.encode())
    entry = CacheEntry(
        variant=variant, arch=arch, key=key, entry_name=entry_name, cubin_sha256=cubin_sha, ptx_sha256=ptx_sha,
        launch=request.launch, ptx_params=[{"size": p.size, "align": p.align} for p in ptx_params],
        resources=resources.to_dict(), identity=identity, cache_dir=cache_dir,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), extra={"compile_seconds": round(seconds, 3)},
    )
    problems = check_promises(entry, ptx_text)
    if problems:
        raise KernelBuildError("; ".join(problems))
    _write_atomic(_entry_path(cache_dir, variant, arch, key), json.dumps(entry.to_json(), indent=1).encode())
    return entry


def build_command(arch: str, profile: str = "<profile>") -> str:
    return f"gcmoe-bench build --arch {arch} --profile {profile}"


def _not_built_message(variant: KernelVariant, arch: str, cache_dir: Path, reason: str) -> str:
    return (f"kernel {variant.describe()} for {arch} is not in the cubin cache {cache_dir} "
            f"(key {lookup_key(variant, arch)}) and {reason}: build it on a machine with "
            f"{DSL_DISTRIBUTION}=={SUPPORTED_DSL_VERSION} with `{build_command(arch)}` "
            "(or set GC_MOE_CACHE_DIR to a cache that has it)")


def get_entry(variant: KernelVariant, arch: str, cache_dir: Path | None = None) -> CacheEntry:
    """The cache entry for a variant: from the cache, else built here when the DSL is installed."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    entry = find_entry(variant, arch, cache_dir)
    if entry is not None:
        return entry
    if not dsl_available():
        raise KernelNotBuiltError(_not_built_message(variant, arch, cache_dir, reason="the CuTe DSL is not installed"))
    return build_variant(variant, arch, cache_dir)


def build_profile(arch: str, profile: Mapping | None = None, cache_dir: Path | None = None,
                  force: bool = False, log: Callable[[str], None] | None = None) -> list[dict]:
    """Fill the cache with every kernel variant `profile` needs on `arch`; one summary row per variant."""
    from ..kernels.registry import variants_for_profile

    check_arch(arch)
    rows = []
    for variant in variants_for_profile(arch, profile or {}):
        started = time.perf_counter()
        cached = None if force else find_entry(variant, arch, cache_dir)
        entry = build_variant(variant, arch, cache_dir, force=force)
        rows.append({
            "kernel": variant.describe(), "arch": arch, "key": entry.key, "cubin_sha256": entry.cubin_sha256[:16],
            "cached": cached is not None and cached.cubin_sha256 == entry.cubin_sha256,
            "registers": entry.resources.get("registers"), "frame_bytes": entry.resources.get("frame_bytes"),
            "param_bytes": entry.resources.get("param_bytes"), "seconds": round(time.perf_counter() - started, 3),
        })
        if log:
            log(f"{rows[-1]['kernel']}: {'cached' if rows[-1]['cached'] else 'built'} {entry.cubin_sha256[:16]}")
    return rows


def cache_state(cache_dir: Path | None = None) -> dict:
    """What the cache holds: its directory and entry counts per arch."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    per_arch = {}
    root = cache_dir / "entries"
    if root.is_dir():
        for arch_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            per_arch[arch_dir.name] = sum(1 for _ in arch_dir.rglob("*.json"))
    return {"dir": str(cache_dir), "exists": cache_dir.is_dir(), "entries": per_arch, "dsl_installed": dsl_available()}


# ----------------------------------------------------------------------------------------------------------
# load (needs the CUDA driver; the DSL is not needed)


def arch_of_device(device: int = 0) -> str:
    """The target whose cubins a device loads: GC_MOE_ARCH if set (e.g. sm_103f), else the arch-specific
    target of its compute capability: sm_90a (Hopper), sm_100a, sm_103a (Blackwell)."""
    override = os.environ.get("GC_MOE_ARCH")
    if override:
        return check_arch(override)
    from .driver import check, cu

    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    major = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    arch = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}.get((major, minor))
    if arch is None:
        raise RuntimeError(f"compute capability {major}.{minor} has no kernels here: supported 9.0, 10.0, 10.3")
    return arch


def load_kernel(variant: KernelVariant, arch: str | None = None, cache_dir: Path | None = None):
    """Load a variant's cubin with cuLibraryLoadData and return a `launch.LoadedKernel`."""
    from .launch import LoadedKernel

    arch = arch or arch_of_device()
    return LoadedKernel.from_entry(get_entry(variant, arch, cache_dir))


def iter_entries(cache_dir: Path | None = None, arch: str | None = None) -> Iterable[CacheEntry]:
    """Every entry in the cache (all keys, current or stale), for inspection."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    root = cache_dir / "entries" / arch if arch else cache_dir / "entries"
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*.json")):
        yield CacheEntry.from_json(json.loads(path.read_text()), cache_dir)


