"""The communication and compute green contexts, made from one SM split.

Compute target = floor((total - request) / alignment) * alignment SMs, the rest is the communication
partition. The request is GC_MOE_DISPATCH_SMS (default 16) on SM100-family GPUs and
GC_MOE_SM90_DISPATCH_SMS (default 4) on SM90. One `cuDevSmResourceSplitByCount` gives the compute
group; its `remaining` resource is the communication partition. Each gets a green context and one
non-blocking stream. Balanced workqueues (CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED) need a CUDA 13.1+
driver; below that the pair runs on the default workqueue config and `workqueue_mode` says so.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass

from .driver import CudaDriverError, check, cu

MIN_COMPUTE_SMS = 32
MIN_DISPATCH_SMS = 2
BALANCED_WORKQUEUE_MIN_DRIVER = 13010
DEFAULT_DISPATCH_SMS = {"sm90": 4, "sm100": 16}
DISPATCH_ENV = {"sm90": "GC_MOE_SM90_DISPATCH_SMS", "sm100": "GC_MOE_DISPATCH_SMS"}


class PartitionError(ValueError):
    """A partition plan or split that breaks the operator's constraints."""


@dataclass(frozen=True)
class SmResource:
    """The device's SM resource as the driver reports it."""

    sm_count: int
    min_partition: int
    alignment: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PartitionPlan:
    """How the device's SMs are split between dispatch (communication) and compute."""

    total_sms: int
    request: int
    comm_sms: int
    compute_sms: int
    alignment: int
    min_partition: int

    def to_dict(self) -> dict:
        return asdict(self)


def arch_family(cc_major: int) -> str:
    if cc_major == 9:
        return "sm90"
    if cc_major == 10:
        return "sm100"
    raise PartitionError(f"compute capability {cc_major}.x has no partition defaults: supported 9.x (SM90), 10.x")


def dispatch_request(family: str, environ=os.environ) -> int:
    """The dispatch-SM request for an arch family, from its environment variable or the default."""
    if family not in DISPATCH_ENV:
        raise PartitionError(f"unknown arch family {family!r}: allowed {sorted(DISPATCH_ENV)}")
    name = DISPATCH_ENV[family]
    raw = environ.get(name)
    if raw is None or raw == "":
        return DEFAULT_DISPATCH_SMS[family]
    try:
        value = int(raw)
    except ValueError:
        raise PartitionError(f"{name}={raw!r} is not an integer number of SMs") from None
    if value < 1:
        raise PartitionError(f"{name}={value}: the dispatch request must be at least 1 SM")
    return value


def plan_partition(total_sms: int, request: int, alignment: int, min_partition: int) -> PartitionPlan:
    """Compute SMs = floor((total - request) / alignment) * alignment; validate both sides."""
    if alignment < 1 or min_partition < 1:
        raise PartitionError(f"alignment {alignment} and minimum partition {min_partition} must be positive")
    if not 0 < request < total_sms:
        raise PartitionError(f"dispatch request {request} SMs must be between 1 and {total_sms - 1} "
                             f"(the device has {total_sms})")
    compute = (total_sms - request) // alignment * alignment
    plan = PartitionPlan(total_sms, request, total_sms - compute, compute, alignment, min_partition)
    validate_plan(plan)
    return plan


def validate_plan(plan: PartitionPlan) -> None:
    if plan.compute_sms < MIN_COMPUTE_SMS:
        raise PartitionError(f"compute partition of {plan.compute_sms} SMs is below the minimum {MIN_COMPUTE_SMS} "
                             f"(device {plan.total_sms} SMs, dispatch request {plan.request}): lower the request")
    if plan.compute_sms % 2:
        raise PartitionError(f"compute partition of {plan.compute_sms} SMs is odd: it must be even (SM pairs)")
    if plan.comm_sms < MIN_DISPATCH_SMS:
        raise PartitionError(f"communication partition of {plan.comm_sms} SMs is below the minimum "
                             f"{MIN_DISPATCH_SMS}: raise the dispatch request")
    if plan.compute_sms < plan.min_partition:
        raise PartitionError(f"compute partition of {plan.compute_sms} SMs is below the driver's minimum group "
                             f"of {plan.min_partition}")
    if plan.comm_sms + plan.compute_sms != plan.total_sms:
        raise PartitionError(f"comm {plan.comm_sms} + compute {plan.compute_sms} SMs != the device's "
                             f"{plan.total_sms}")


def _init_device(device: int):
    check(cu.cuInit(0), "cuInit")
    return check(cu.cuDeviceGet(device), "cuDeviceGet")


def _sm_resource_raw(device: int):
    dev = _init_device(device)
    return dev, check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                      "cuDeviceGetDevResource(SM)")


def device_sm_resource(device: int = 0) -> SmResource:
    _, res = _sm_resource_raw(device)
    return SmResource(int(res.sm.smCount), int(res.sm.minSmPartitionSize), int(res.sm.smCoscheduledAlignment))


def plan_for_device(device: int = 0) -> PartitionPlan:
    dev = _init_device(device)
    major = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                  "compute capability")
    res = device_sm_resource(device)
    return plan_partition(res.sm_count, dispatch_request(arch_family(int(major))), res.alignment, res.min_partition)


def workqueue_support(device: int = 0) -> dict:
    """Whether balanced workqueues can be requested: the driver version decides (13.1+)."""
    from .driver import driver_version

    version = driver_version()
    supported = version >= BALANCED_WORKQUEUE_MIN_DRIVER and hasattr(cu, "CUdevWorkqueueConfigScope")
    return {"driver_version": version, "balanced_supported": bool(supported),
            "reason": None if supported else f"driver {version // 1000}.{version % 1000 // 10} < 13.1: "
                                             "workqueue-config resources are not available"}


class GreenPartitions:
    """A communication and a compute green context from one split, one non-blocking stream each."""

    def __init__(self, device: int = 0, plan: PartitionPlan | None = None):
        self.device = device
        dev, sm = _sm_resource_raw(device)
        self.plan = plan or plan_for_device(device)
        groups, count, remaining = check(
            cu.cuDevSmResourceSplitByCount(1, sm, 0, self.plan.compute_sms), "cuDevSmResourceSplitByCount")
        if count < 1:
            raise PartitionError(f"the driver made no group of {self.plan.compute_sms} SMs")
        compute_res = groups[0] if isinstance(groups, (list, tuple)) else groups
        got_compute, got_comm = int(compute_res.sm.smCount), int(remaining.sm.smCount)
        if got_compute != self.plan.compute_sms or got_comm != self.plan.comm_sms:
            raise PartitionError(f"the driver split {got_comm}/{got_compute} SMs (comm/compute), the plan says "
                                 f"{self.plan.comm_sms}/{self.plan.compute_sms}")
        self.workqueue_mode = "default (driver below 13.1: balanced workqueues unavailable)"
        wq = workqueue_support(device)
        comm_resources, compute_resources = [remaining], [compute_res]
        if wq["balanced_supported"]:
            mode = self._balanced_workqueue_resources(dev)
            if mode is not None:
                comm_resources.append(mode[0])
                compute_resources.append(mode[1])
                self.workqueue_mode = "balanced (requested)"
        self.comm_ctx = self._green_ctx(comm_resources, dev, "communication")
        self.compute_ctx = self._green_ctx(compute_resources, dev, "compute")
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.comm_stream = check(cu.cuGreenCtxStreamCreate(self.comm_ctx, flags, 0), "cuGreenCtxStreamCreate(comm)")
        self.compute_stream = check(cu.cuGreenCtxStreamCreate(self.compute_ctx, flags, 0),
                                    "cuGreenCtxStreamCreate(compute)")
        self.comm_context = check(cu.cuCtxFromGreenCtx(self.comm_ctx), "cuCtxFromGreenCtx(comm)")
        self.compute_context = check(cu.cuCtxFromGreenCtx(self.compute_ctx), "cuCtxFromGreenCtx(compute)")
        self.comm_sms = self._sm_count(self.comm_ctx)
        self.compute_sms = self._sm_count(self.compute_ctx)
        if (self.comm_sms, self.compute_sms) != (self.plan.comm_sms, self.plan.compute_sms):
            raise PartitionError(f"green contexts hold {self.comm_sms}/{self.compute_sms} SMs, planned "
                                 f"{self.plan.comm_sms}/{self.plan.compute_sms}")
        if wq["balanced_supported"] and self.workqueue_mode.startswith("balanced"):
            self.workqueue_mode = "balanced (verified)" if self._verify_balanced() else "balanced (not read back)"
        self.closed = False

    @staticmethod
    def _green_ctx(resources, dev, what):
        desc = check(cu.cuDevResourceGenerateDesc(resources, len(resources)), f"cuDevResourceGenerateDesc({what})")
        return check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                     f"cuGreenCtxCreate({what})")

    @staticmethod
    def _sm_count(gctx) -> int:
        res = check(cu.cuGreenCtxGetDevResource(gctx, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                    "cuGreenCtxGetDevResource")
        return int(res.sm.smCount)

    @staticmethod
    def _balanced_workqueue_resources(dev):
        """Two workqueue-config resources with the balanced scope and concurrency 1 (driver 13.1+)."""
        out = []
        for _ in range(2):
            try:
                res = check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG),
                            "cuDeviceGetDevResource(WORKQUEUE_CONFIG)")
            except CudaDriverError:
                return None
            res.wqConfig.sharingScope = cu.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED
            res.wqConfig.wqConcurrencyLimit = 1
            out.append(res)
        return out

    def _verify_balanced(self) -> bool:
        try:
            for gctx in (self.comm_ctx, self.compute_ctx):
                res = check(cu.cuGreenCtxGetDevResource(
                    gctx, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG), "read back workqueue config")
                if res.wqConfig.sharingScope != cu.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED:
                    return False
            return True
        except CudaDriverError:
            return False

    def torch_streams(self):
        """The two streams as torch.cuda.ExternalStream (comm, compute)."""
        import torch

        return (torch.cuda.ExternalStream(int(self.comm_stream), device=self.device),
                torch.cuda.ExternalStream(int(self.compute_stream), device=self.device))

    def describe(self) -> dict:
        return {"comm_sms": self.comm_sms, "compute_sms": self.compute_sms, "workqueue_mode": self.workqueue_mode,
                "plan": self.plan.to_dict()}

    def close(self) -> None:
        """Record an event on each stream, synchronize, then destroy streams and contexts."""
        if self.closed:
            return
        for gctx, stream in ((self.comm_ctx, self.comm_stream), (self.compute_ctx, self.compute_stream)):
            event = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            check(cu.cuEventRecord(event, stream), "cuEventRecord")
            check(cu.cuEventSynchronize(event), "cuEventSynchronize")
            check(cu.cuEventDestroy(event), "cuEventDestroy")
            check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
            check(cu.cuGreenCtxDestroy(gctx), "cuGreenCtxDestroy")
        self.closed = True


_cache: dict[tuple, GreenPartitions] = {}
_lock = threading.Lock()


def get_partitions(device: int = 0) -> GreenPartitions:
    """The partition pair for (device's primary context, this thread), made once."""
    dev = _init_device(device)
    primary = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    key = (device, int(primary), threading.get_ident())
    with _lock:
        parts = _cache.get(key)
        if parts is None or parts.closed:
            parts = _cache[key] = GreenPartitions(device)
    check(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
    return parts


def release_partitions() -> None:
    """Close every cached pair (e.g. at exit)."""
    with _lock:
        for parts in _cache.values():
            parts.close()
        _cache.clear()
