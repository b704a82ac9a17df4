"""scripts/set_deltas.py (each variant set of a grouped-GEMM bench JSON against a baseline set of the same run): the
differences per point and per role, each pair's mean and faster points, points without a baseline counted, and
clear errors for wrong input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "set_deltas.py"


def _row(tag, model, tokens, cold, w1=None, w2=None):
    row = {"tag": tag, "model": model, "tokens": tokens, "cold_us": cold}
    if w1 is not None:
        row.update(w1_cold_us=w1, w2_cold_us=w2)
    return row


def _run(tmp_path, data, *args):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args], check=False, capture_output=True,
                          text=True)


def test_differences_per_point_and_role(tmp_path):
    data = {"read_bw_bytes_per_s": 3.15e12, "rows": [
        _row("base", "m", 1, 70.0, 45.0, 26.0), _row("cand", "m", 1, 66.5, 43.0, 24.5),
        _row("base", "m", 8, 180.0), _row("cand", "m", 8, 181.25),
        _row("cand", "m", 64, 300.0)]}  # no baseline at 64 tokens
    out = _run(tmp_path, data, "--pairs", "cand:base")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "3.15 TB/s" in lines[0]
    one = next(ln for ln in lines if ln.split()[:2] == ["m", "1"])
    assert "66.5   -3.5" in one and "43.0   -2.0" in one and "24.5   -1.5" in one
    eight = next(ln for ln in lines if ln.split()[:2] == ["m", "8"])
    assert "181.2   +1.2" in eight and eight.rstrip().endswith("-")  # no per-role times in that row
    assert not any(ln.split()[:2] == ["m", "64"] for ln in lines)
    assert "1 candidate rows had no baseline row at the same point" in out.stdout
    # the pair's summary: (-3.5 + 1.25) / 2 over the two points with a baseline, faster at one; W1 where timed
    assert "cand - base: mean -1.12 us over 2 points, faster at 1, W1 alone -2.00, W2 alone -1.50" in out.stdout


def test_wrong_input_says_what_is_wrong(tmp_path):
    data = {"read_bw_bytes_per_s": 1e12, "rows": [_row("a", "m", 1, 2.0), _row("b", "m", 1, 3.0)]}
    unknown = _run(tmp_path, data, "--pairs", "a:zz")
    assert unknown.returncode == 2 and "['zz']" in unknown.stderr and "['a', 'b']" in unknown.stderr
    malformed = _run(tmp_path, data, "--pairs", "a")
    assert malformed.returncode == 2 and "CANDIDATE:BASELINE" in malformed.stderr
    not_bench = _run(tmp_path, {"rows": []}, "--pairs", "a:b")
    assert not_bench.returncode == 2 and "read_bw_bytes_per_s" in not_bench.stderr
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.json"), "--pairs", "a:b"],
                             check=False, capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr
