"""Run directories ``results/<gpu>/<run-id>/``: created fresh (never overwritten), written as points finish, resumable.

| file          | rows                                                                                     |
| ------------- | ---------------------------------------------------------------------------------------- |
| raw.csv       | one per rank x window x point x operator (``rank``, ``window``, ``phase`` = warmup/measured) |
| points.csv    | one per point and operator, columns POINT_COLUMNS (docs/ARCHITECTURE.md), run settings last |
| accuracy.csv  | one per accuracy case and operator, when ``accuracy`` ran                                |
| env.json      | GPUs, driver, CUDA, torch and package versions, git commit + dirty flag, host, profile, command |

A point's rows are appended only once the whole point is measured (per operator: raw rows first, then its
points row), so an interrupted sweep leaves whole points behind; ``--resume`` drops raw rows of a point that has no points row and
measures only what points.csv lacks.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

POINT_KEY = ("model", "suite", "tokens_per_rank")
# The run settings every points and raw row ends with: the dispatch request and the overlap switch of the run,
# and the partition (communication / compute SMs) where the operator's note names it.
SETTING_COLUMNS = ("dispatch_sm_request", "overlap", "comm_sms", "compute_sms")
POINT_COLUMNS = (
    "gpu", "model", "suite", "tokens_per_rank", "total_tokens", "num_ranks", "hidden", "intermediate",
    "num_experts", "topk", "num_shared_experts", "operator", "baseline", "latency_us", "rank_medians_us",
    "spread_us", "speedup", "assignments", "remote_assignments", "hbm_working_set_bytes", "l2_mode", "status",
    "reason", *SETTING_COLUMNS,
)
RAW_COLUMNS = (
    "gpu", "model", "suite", "tokens_per_rank", "operator", "rank", "window", "phase", "latency_us",
    "replays_per_window", "timing", "l2_mode", "copies", *SETTING_COLUMNS,
)
ACCURACY_COLUMNS = (
    "case", "category", "model", "num_ranks", "tokens_per_rank", "shared_experts", "operator", "reference",
    "cosine", "processed_diff", "max_abs_err", "rel_l2", "passed", "versus", "versus_cosine", "versus_passed",
    "status", "reason",
)


_PARTITION_NOTE = re.compile(r"partition comm/compute (\d+)/(\d+) SMs")


def partition_from_note(note: str) -> tuple[int, int] | None:
    """(communication SMs, compute SMs) from an invocation note that names them (the sm90 backend's
    "partition comm/compute 4/128 SMs"), else None."""
    match = _PARTITION_NOTE.search(note or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


class RunDirError(RuntimeError):
    """A run directory is missing, incomplete or not a run directory."""


def new_run_id(now: datetime | None = None) -> str:
    """A sortable UTC time stamp, e.g. 20261202T155300Z."""
    return (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")


def create_run_dir(root: Path, gpu: str, run_id: str | None = None) -> Path:
    """A new, empty ``root/gpu/run_id``; an existing directory is never reused (``-2``, ``-3``... are appended)."""
    base = Path(root) / gpu
    base.mkdir(parents=True, exist_ok=True)
    stem = run_id or new_run_id()
    for attempt in range(1, 1000):
        candidate = base / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            candidate.mkdir()  # atomic: fails if it exists, so two sweeps never share a directory
        except FileExistsError:
            continue
        return candidate
    raise RunDirError(f"could not create a fresh run directory under {base} for {stem!r}")


def _key(row: dict[str, Any]) -> tuple[str, str, int, str]:
    return (str(row["model"]), str(row["suite"]), int(row["tokens_per_rank"]), str(row["operator"]))


def _header(path: Path) -> list[str]:
    """The column names of an existing CSV file (empty when it is missing or empty)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


def _append_rows(path: Path, columns: Iterable[str], rows: list[dict[str, Any]]) -> None:
    """Append rows; a file that already has a header keeps it: a run written before columns were added (the
    run settings at the end) goes on in its own layout when resumed, never a row out of step with its header."""
    columns = list(columns)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        header = _header(path)
        if header != columns:
            if not set(header) <= set(columns):
                raise RunDirError(f"{path}: its columns {header} are not ones this tool writes ({columns})")
            columns = header
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="raise")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in columns})
        f.flush()
        os.fsync(f.fileno())


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)  # shortest exact form: cosines need every digit
    if isinstance(value, bool):
        return str(value).lower()
    return value


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class RunWriter:
    """Writes one run directory (rank 0 only)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.raw_path = self.run_dir / "raw.csv"
        self.points_path = self.run_dir / "points.csv"
        self.accuracy_path = self.run_dir / "accuracy.csv"
        self.env_path = self.run_dir / "env.json"

    # ---------------------------------------------------------------------------------------------- resume
    def finished(self) -> dict[tuple[str, str, int, str], dict[str, str]]:
        """points.csv rows by (model, suite, tokens_per_rank, operator)."""
        return {_key(row): row for row in read_rows(self.points_path)}

    def prune_unfinished_raw(self) -> int:
        """Drop raw rows whose point and operator have no points row (a point interrupted mid-write)."""
        finished = self.finished()
        rows = read_rows(self.raw_path)
        kept = [r for r in rows if _key(r) in finished]
        if len(kept) != len(rows):
            tmp = self.raw_path.with_suffix(".csv.tmp")
            tmp.unlink(missing_ok=True)
            _append_rows(tmp, _header(self.raw_path) or RAW_COLUMNS, kept)
            tmp.replace(self.raw_path)
        return len(rows) - len(kept)

    # ---------------------------------------------------------------------------------------------- writers
    def append_point(self, point_row: dict[str, Any], raw_rows: list[dict[str, Any]]) -> None:
        if raw_rows:
            _append_rows(self.raw_path, RAW_COLUMNS, raw_rows)
        _append_rows(self.points_path, POINT_COLUMNS, [point_row])

    def append_accuracy(self, rows: list[dict[str, Any]]) -> None:
        _append_rows(self.accuracy_path, ACCURACY_COLUMNS, rows)

    def write_env(self, env: dict[str, Any]) -> None:
        tmp = self.env_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(env, indent=2, sort_keys=False, default=str) + "\n")
        tmp.replace(self.env_path)

    def read_env(self) -> dict[str, Any]:
        if not self.env_path.is_file():
            raise RunDirError(f"{self.run_dir} has no env.json: it is not a run directory this tool wrote")
        return json.loads(self.env_path.read_text())


def open_for_resume(run_dir: Path) -> RunWriter:
    writer = RunWriter(run_dir)
    if not writer.run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such directory; allowed: a run directory results/<gpu>/<run-id>/")
    writer.read_env()  # raises with a clear message when it is not a run directory
    return writer
