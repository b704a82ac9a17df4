"""On a GPU: the device proof script end to end (partitions, cached cubins, graph replays, bounded waits)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_device_runtime_proof_passes(tmp_path):
    pytest.importorskip("cuda.bindings.driver")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "operator"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_runtime_proof.py"), "--replays", "500",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "runtime_proof.json").read_text())
    replays = results["graph_replays"]
    assert replays["ok"] and replays["control"]["replays_checked"] == 500
    assert replays["control"]["data_mismatches"] == 0 and replays["host_ring_mismatches"] == 0
    assert results["no_producer"]["ok"] and results["trap_child"]["ok"]
    assert results["outer_capture"]["checked"] == 100
    assert results["partitions"]["comm_sms"] + results["partitions"]["compute_sms"] == \
        results["partitions"]["plan"]["total_sms"]
