"""What env.json records about the machine and the software, so a run can be reproduced and compared."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

PACKAGES = (
    "gcmoe-bench", "torch", "numpy", "pandas", "matplotlib", "typer", "rich", "nvidia-ml-py",
    "nvidia-cutlass-dsl", "cuda-python", "cuda-bindings", "sgl-deep-gemm",
)
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """Commit and dirty flag of the source tree (tracked files only: results being written do not count)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def invocation_command(argv: list[str] | None = None) -> str:
    """The command that reproduces this process: ``torchrun --nproc-per-node N -m gcmoe_bench ...`` under torchrun,
    ``python -m gcmoe_bench ...`` otherwise (sys.argv[0] is the module's file under ``-m``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    first = Path(sys.argv[0]).name if sys.argv else ""
    if first in ("gcmoe-bench",):
        launcher = ["gcmoe-bench"]
    else:
        launcher = ["python", "-m", "gcmoe_bench"]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
        nproc = os.environ.get("LOCAL_WORLD_SIZE", "1")
        prefix = ["torchrun"] + ([f"--nnodes {nnodes}"] if nnodes > 1 else []) + [f"--nproc-per-node {nproc}"]
        launcher = prefix + ["-m", "gcmoe_bench"]
    return " ".join(launcher + [shlex.quote(a) for a in args])


def nvml_driver() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return {"driver": driver, "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}"}
    except Exception:  # noqa: BLE001 - no NVML (CPU machines): versions stay unknown
        return {"driver": None, "cuda_driver": None}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def local_device_info(device: torch.device) -> dict[str, Any]:
    """This rank's host and device (every rank reports; rank 0 gathers)."""
    info: dict[str, Any] = {"host": socket.gethostname(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_mib=props.total_memory >> 20, l2_bytes=int(props.L2_cache_size))
    else:
        info.update(name=_cpu_name(), threads=torch.get_num_threads())
    return info


def environment(*, ranks: list[dict[str, Any]], profile: dict[str, Any], command: str,
                gate: dict[str, Any] | str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cuda_available = torch.cuda.is_available()
    return {
        "gpus": [r.get("name") for r in ranks],
        "ranks": ranks,
        "hosts": sorted({r["host"] for r in ranks}),
        **nvml_driver(),
        "cuda_runtime": torch.version.cuda,
        "cuda_available": cuda_available,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "packages": package_versions(),
        "git": git_state(),
        "host": socket.gethostname(),
        "profile": profile,
        "command": command,
        "argv": sys.argv[1:],  # the arguments; argv[0] is only where this file lives on the machine
        "gate": gate,
        **(extra or {}),
    }
