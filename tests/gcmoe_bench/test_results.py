"""Run directories: never overwritten, whole points only, resumable."""

from __future__ import annotations

import random

from gcmoe_bench.results import (
    POINT_COLUMNS,
    RAW_COLUMNS,
    RunWriter,
    create_run_dir,
    new_run_id,
    read_rows,
)


def test_run_directories_are_never_reused(tmp_path):
    first = create_run_dir(tmp_path, "cpu", "20261202T120000Z")
    (first / "points.csv").write_text("precious\n")
    second = create_run_dir(tmp_path, "cpu", "20261202T120000Z")
    third = create_run_dir(tmp_path, "cpu", "20261202T120000Z")
    assert first.name == "20261202T120000Z" and second.name == "20261202T120000Z-2" and third.name.endswith("-3")
    assert (first / "points.csv").read_text() == "precious\n"
    assert not any(second.iterdir()) and first.parent == tmp_path / "cpu"
    # the default id is a time stamp, and two runs started in the same second still get their own directories
    a, b = create_run_dir(tmp_path, "h200"), create_run_dir(tmp_path, "h200")
    assert a != b and len(new_run_id()) == len("20261202T120000Z")


def _point(model: str, tokens: int, operator: str, latency: float) -> dict:
    return {"gpu": "cpu", "model": model, "suite": "routed", "tokens_per_rank": tokens, "operator": operator,
            "baseline": "reference", "latency_us": latency, "status": "ok", "reason": ""}


def _raw(model: str, tokens: int, operator: str, ranks: int, windows: int) -> list[dict]:
    return [{"gpu": "cpu", "model": model, "suite": "routed", "tokens_per_rank": tokens, "operator": operator,
             "rank": r, "window": w, "phase": "measured", "latency_us": random.uniform(1, 100)}
            for r in range(ranks) for w in range(windows)]


def test_points_append_and_resume_drops_raw_rows_of_an_unfinished_point(tmp_path):
    writer = RunWriter(create_run_dir(tmp_path, "cpu"))
    latencies = {}
    for tokens in (1, 2):
        for op in ("reference", "gc"):
            latencies[tokens, op] = random.uniform(10, 1000)
            writer.append_point(_point("m", tokens, op, latencies[tokens, op]), _raw("m", tokens, op, 2, 3))
    # an interruption between the raw rows and the points row of (T=4, gc)
    from gcmoe_bench.results import _append_rows

    _append_rows(writer.raw_path, RAW_COLUMNS, _raw("m", 4, "gc", 2, 3))
    assert len(read_rows(writer.raw_path)) == 5 * 6

    finished = writer.finished()
    assert set(finished) == {("m", "routed", t, op) for t in (1, 2) for op in ("reference", "gc")}
    for key, row in finished.items():
        assert float(row["latency_us"]) == latencies[key[2], key[3]]
    assert writer.prune_unfinished_raw() == 6
    raw = read_rows(writer.raw_path)
    assert len(raw) == 4 * 6 and all(int(r["tokens_per_rank"]) in (1, 2) for r in raw)
    assert list(raw[0]) == list(RAW_COLUMNS)
    assert list(read_rows(writer.points_path)[0]) == list(POINT_COLUMNS)
    assert writer.prune_unfinished_raw() == 0  # idempotent


def test_env_json_round_trip(tmp_path):
    writer = RunWriter(create_run_dir(tmp_path, "cpu"))
    env = {"command": "torchrun --nproc-per-node 2 -m gcmoe_bench sweep --gpu cpu", "profile": {"gpu": "cpu"}}
    writer.write_env(env)
    assert writer.read_env() == env


def test_rows_end_with_the_run_settings_and_the_partition_from_the_note():
    from gcmoe_bench.results import SETTING_COLUMNS, partition_from_note

    assert POINT_COLUMNS[-4:] == SETTING_COLUMNS and RAW_COLUMNS[-4:] == SETTING_COLUMNS
    assert partition_from_note("gc_moe backend: sm90; partition comm/compute 12/120 SMs; overlap off") == (12, 120)
    assert partition_from_note("gc_moe backend: reference") is None and partition_from_note("") is None


def test_a_run_written_before_the_setting_columns_keeps_its_layout_when_resumed(tmp_path):
    """A resumed run whose files predate the setting columns goes on in its own layout: no row out of step with
    its header, finished rows untouched; a header this tool never wrote is refused."""
    import pytest

    from gcmoe_bench.results import SETTING_COLUMNS, RunDirError, _append_rows

    writer = RunWriter(create_run_dir(tmp_path, "cpu"))
    old_points, old_raw = POINT_COLUMNS[:-4], RAW_COLUMNS[:-4]
    _append_rows(writer.points_path, old_points, [_point("m", 1, "gc", 5.0)])
    _append_rows(writer.raw_path, old_raw, _raw("m", 1, "gc", 1, 2) + _raw("m", 2, "gc", 1, 2))
    before = writer.points_path.read_text()
    settings = dict.fromkeys(SETTING_COLUMNS, "x")
    writer.append_point({**_point("m", 3, "gc", 7.0), **settings}, [{**r, **settings} for r in _raw("m", 3, "gc", 1, 2)])
    assert writer.points_path.read_text().startswith(before)
    rows = read_rows(writer.points_path)
    assert list(rows[-1]) == list(old_points) and rows[-1]["latency_us"] == "7.0"
    assert writer.prune_unfinished_raw() == 2  # T=2 has no points row
    assert list(read_rows(writer.raw_path)[0]) == list(old_raw)
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("model,something_else\n")
    with pytest.raises(RunDirError, match="are not ones this tool writes"):
        _append_rows(foreign, POINT_COLUMNS, [_point("m", 1, "gc", 1.0)])
