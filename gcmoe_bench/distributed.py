"""Process groups for a sweep: torchrun (or single-process) init, rank-0 output, gathers, failure propagation.

Two groups: a gloo *control* group that the harness itself uses (window barriers, status agreement, gathering
measurements; CPU tensors only, so it never touches a GPU and works before any CUDA context exists, e.g. while
the idle gate runs), and the *data* group handed to operators (NCCL on GPUs, the gloo group on CPU).

Every wait is bounded: both groups carry the profile's timeout, so a rank that dies mid-collective makes the
others fail with a timeout instead of hanging. Under torchrun a rank that exits non-zero also makes torchrun's
elastic agent stop the others. Ranks that are still alive learn *which* rank failed and why through ``check_in``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RemoteRankError(RuntimeError):
    """Another rank failed; this rank stops too. The message carries the failing rank's own error."""


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    control: Any  # gloo ProcessGroup
    data: Any  # ProcessGroup for operators
    timeout_s: float
    launched_by_torchrun: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    # ------------------------------------------------------------------------------------- agreement
    def check_in(self, error: str | None = None) -> None:
        """A collective status check: every rank calls it at the same place. If any rank passes an error, every
        rank raises: RemoteRankError naming the failing rank(s) on the others, RuntimeError on the failing one.
        The cheap case (nobody failed) is a single one-integer all-reduce, so it doubles as the window barrier."""
        flag = torch.tensor([1 if error else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        if not int(flag.item()):
            return
        messages: list[str | None] = [None] * self.world_size
        dist.all_gather_object(messages, error, group=self.control)
        failed = {r: m for r, m in enumerate(messages) if m}
        if error:
            raise RuntimeError(error)
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise RemoteRankError(f"stopping because another rank failed ({detail})")

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's list of floats (all lists must have the same length), on every rank."""
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.control)
        return [t.tolist() for t in out]

    def broadcast_from_main(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out


def agree_on_unavailable(ctx: DistContext, unavailable_here: dict[str, str]) -> dict[str, str]:
    """Every rank's reasons for operators it could not prepare, merged: operator -> the reason(s) of the rank(s)
    that said so (prefixed ``rank r:`` when there are several ranks). The same answer on every rank, so all of them
    drop the same operators. Collective over the control group."""
    merged: dict[str, list[str]] = {}
    for rank, reasons in enumerate(ctx.gather_objects(unavailable_here)):
        for operator, reason in reasons.items():
            merged.setdefault(operator, []).append(reason if ctx.world_size == 1 else f"rank {rank}: {reason}")
    return {operator: "; ".join(reasons) for operator, reasons in merged.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(device_kind: str, timeout_s: float) -> DistContext:
    """Join the torchrun job described by the environment, or form a one-rank group when started without it.

    No CUDA context is created here: the data group on GPUs is NCCL, which connects lazily at its first use."""
    timeout = timedelta(seconds=timeout_s)
    torchrun = launched_by_torchrun()
    if not torchrun:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    control = dist.group.WORLD
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        data = dist.new_group(backend="nccl", timeout=timeout)
    else:
        device = torch.device("cpu")
        data = control
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       device=device, control=control, data=data, timeout_s=timeout_s,
                       launched_by_torchrun=torchrun)


def bind_device(ctx: DistContext) -> None:
    """Select this rank's GPU (creates its CUDA context): call only after the idle gate."""
    if ctx.device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the profile runs on CUDA but torch sees no CUDA GPU; use --gpu cpu on this machine")
        if ctx.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {ctx.local_rank} has no GPU: this host shows {torch.cuda.device_count()}; "
                f"start at most that many processes per node"
            )
        torch.cuda.set_device(ctx.device)


def shutdown() -> None:
    """Destroy the process groups. Also after a failure all ranks agreed on: a gloo group left open aborts the
    process at exit once its peers are gone, which would bury the clear error under a crash."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort on the way out: the outcome is already decided
            dist.destroy_process_group()


REPORTED = "gcmoe_bench_reported"  # attribute set on an exception once its one-line message is printed
TRACEBACK_LOG = "gcmoe_bench_traceback_log"  # attribute: where its traceback was written, if anywhere


def was_reported(exc: BaseException) -> bool:
    return bool(getattr(exc, REPORTED, False))


def write_traceback(exc: BaseException, run_dir: Path, rank: int) -> Path | None:
    """The traceback into RUN_DIR/error-rank<r>.log (appended: a resumed run keeps the earlier failures); the
    path is remembered on the exception so the one-line message can name it. None if it cannot be written."""
    path = Path(run_dir) / f"error-rank{rank}.log"
    try:
        with path.open("a") as f:
            f.write(f"--- {datetime.now(timezone.utc).isoformat(timespec='seconds')} rank {rank}\n")
            f.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, TRACEBACK_LOG, str(path))
    return path


def report_failure(ctx: DistContext | None, exc: BaseException) -> None:
    """One clear line per rank on stderr (every rank, so the failing rank's own error is never hidden). Where no
    run directory holds the traceback yet (e.g. the job could not be joined), the traceback follows the line."""
    who = f"rank {ctx.rank}/{ctx.world_size}" if ctx else "gcmoe-bench"
    kind = "" if isinstance(exc, RemoteRankError) else f"{type(exc).__name__}: "
    log = getattr(exc, TRACEBACK_LOG, None)
    where = f" (traceback: {log})" if log else ""
    print(f"[{who}] error: {kind}{exc}{where}", file=sys.stderr, flush=True)
    if not log and not isinstance(exc, RemoteRankError):
        traceback.print_exception(exc, file=sys.stderr)
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, REPORTED, True)


def run_collective(device_kind: str, timeout_s: float, body: Callable[[DistContext], T]) -> T:
    """Join the job, run ``body(ctx)`` on this rank and tear the groups down. A failure, joining included, is
    reported on this rank's stderr and re-raised after the teardown, so every rank ends with its own clear line."""
    try:
        ctx = init_distributed(device_kind, timeout_s)
    except BaseException as exc:
        report_failure(None, exc)
        shutdown()
        raise
    try:
        result = body(ctx)
    except BaseException as exc:
        report_failure(ctx, exc)
        shutdown()
        raise
    shutdown()
    return result
