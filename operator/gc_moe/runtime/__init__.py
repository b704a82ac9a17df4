"""GPU runtime: green-context partitions, offline build + cubin cache, launcher, child graphs, workspace.

Importing this package needs neither the CuTe DSL nor a GPU; each piece loads the CUDA driver
(cuda-bindings) only when it is used.
"""

from __future__ import annotations

import platform
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe_environment(device: int = 0, with_partition: bool = True) -> dict:
    """What `gcmoe-bench env` prints: versions, driver, device, partition plan, workqueue mode, cache state.

    Works without a GPU (device fields then say why they are missing); never raises for a missing driver.
    """
    from . import jit

    env: dict = {
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "cuda-bindings", "cuda-python", "nvidia-cutlass-dsl",
                                              "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")},
        "cache": jit.cache_state(),
        "supported_dsl": jit.SUPPORTED_DSL_VERSION,
    }
    try:
        from .driver import driver_version

        env["driver_version"] = driver_version()
    except Exception as exc:  # noqa: BLE001  (no libcuda, no device: report instead of failing)
        env["driver_version"] = None
        env["device"] = {"error": str(exc)}
        return env
    try:
        from . import partition

        env["device"] = partition.device_sm_resource(device).to_dict()
        env["device"]["arch"] = jit.arch_of_device(device)
        plan = partition.plan_for_device(device)
        env["partition"] = plan.to_dict()
        env["workqueue"] = partition.workqueue_support(device)
        if with_partition:
            env["partition_live"] = partition.get_partitions(device).describe()
    except Exception as exc:  # noqa: BLE001  (env reports what it could not read)
        env.setdefault("device", {})["error"] = f"{type(exc).__name__}: {exc}"
    return env
