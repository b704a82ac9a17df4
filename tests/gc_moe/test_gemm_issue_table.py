"""scripts/gemm_issue_table.py (the grouped GEMM's table per model from a benchmark JSON): per point the fastest
checked row of the named sets, the kernels it ran found again from its knobs, and clear errors for wrong input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gemm_issue_table.py"


@pytest.fixture(scope="module")
def table_script():
    spec = importlib.util.spec_from_file_location("gemm_issue_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(tag, model, tokens, cold, ok=True, block_n=8, knobs=None):
    return {"tag": tag, "model": model, "tokens": tokens, "active": 3, "bytes": 2e6, "floor_us": 1.0,
            "cold_us": cold, "bw_pct": 100.0 / cold, "tflops": 1.5, "block_n": block_n, "ok": ok,
            "knobs": knobs if knobs is not None else {"stream_k": True, "ctas_per_sm": 1}}


def test_fastest_checked_row_of_the_named_sets(table_script):
    data = {"read_bw_bytes_per_s": 3.2e12, "rows": [
        _row("ws_auto", "m", 1, 9.0), _row("ws_auto_pair", "m", 1, 7.0, knobs={"stream_k": True, "stream_pair": True}),
        _row("ws_auto_pdl", "m", 1, 5.0, ok=False),  # fastest but wrong: never picked
        _row("other", "m", 1, 1.0),  # not a named set
        _row("ws_auto", "m", 64, 30.0, block_n=64,
             knobs={"fold_scales": True, "table_decode": True, "fit_n": True, "lean_epilogue": True,
                    "persistent": True})]}
    seen = []
    text = table_script.tables(data, ["ws_auto", "ws_auto_pdl", "ws_auto_pair"],
                               report=lambda vs: seen.append([v.describe() for v in vs]) or "R")
    lines = [ln for ln in text.splitlines() if ln.startswith(("| 1 ", "| 64 "))]
    assert "`ws_auto_pair`" in lines[0] and "| 7.0 |" in lines[0] and "`ws_auto`" in lines[1]
    assert "3.20 TB/s" in text and text.count("| tokens/rank |") == 1
    # the pair kernel alone for the pair row; W1 and W2 at the row's tile and knobs otherwise
    assert len(seen[0]) == 1 and "stream_pair" in seen[0][0]
    assert len(seen[1]) == 2 and all("persistent=True" in d and "block_n=64" in d for d in seen[1])


def test_wrong_input_says_what_is_wrong(tmp_path):
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.json")], capture_output=True,
                             text=True, check=False)
    assert missing.returncode != 0 and "no such file" in missing.stderr
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"read_bw_bytes_per_s": 1e12, "rows": [_row("x", "m", 1, 2.0)]}))
    wrong = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=False)
    assert wrong.returncode != 0 and "no rows of the sets" in wrong.stderr and "['x']" in wrong.stderr


def test_same_bytes_read_column_only_when_the_run_timed_it(table_script):
    plain = {"read_bw_bytes_per_s": 3.2e12, "rows": [_row("ws_auto", "m", 1, 9.0)]}
    assert "read us" not in table_script.tables(plain, ["ws_auto"], report=lambda vs: "R")
    timed = {"read_bw_bytes_per_s": 3.2e12, "rows": [{**_row("ws_auto", "m", 1, 9.0), "stream_read_us": 4.25, "stream_read_dyn_us": 3.5},
                                                     _row("ws_auto", "m", 2, 11.0)]}
    text = table_script.tables(timed, ["ws_auto"], report=lambda vs: "R")
    header = next(ln for ln in text.splitlines() if ln.startswith("| tokens/rank"))
    one = next(ln for ln in text.splitlines() if ln.startswith("| 1 "))
    two = next(ln for ln in text.splitlines() if ln.startswith("| 2 "))
    # the read sits between the floor and the measured time; a point without one says so
    assert header.split(" | ")[4] == "read us" and "| 1.0 | 4.2 / 3.5 | 9.0 |" in one and "| 1.0 | - | 11.0 |" in two
    cells = [len(ln.split("|")) for ln in text.splitlines() if ln.startswith("|")]
    assert len(set(cells)) == 1  # every row has the header's columns


def test_registers_come_from_the_cache_alone_with_no_dsl_to_build(table_script, tmp_path, monkeypatch):
    """Where the kernels ran there is no CuTe DSL: the registers column reads the cache's entries and says which
    kernel it lacks instead of trying to build it."""
    from gc_moe.kernels.sm90 import grouped_gemm as gg
    from gc_moe.runtime import jit
    from gc_moe.runtime.jit import CacheEntry, LaunchShape

    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "dsl_available", lambda: False)
    w1, w2 = gg.variant("w1", 8), gg.variant("w2", 8)
    entry = CacheEntry(w1, "sm_90a", jit.lookup_key(w1, "sm_90a"), "k", "aa", "aa", LaunchShape(block=(32, 1, 1)),
                       [], {"registers": 80, "frame_bytes": 0}, {}, tmp_path)
    path = tmp_path / "entries" / "sm_90a" / w1.name / f"{entry.key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(entry.to_json()))
    (tmp_path / "objects").mkdir()
    (tmp_path / "objects" / "aa.cubin").write_bytes(b"\0")
    assert table_script.resources([w1, w2]) == "80 / 0, not in the cubin cache"
