"""`gcmoe-bench build --arch sm_90a --profile h200` from the command line, offline: every registered kernel
variant lands in the cubin cache, and a second build reuses every entry."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gcmoe_bench.cli import app

pytest.importorskip("cutlass", reason="building kernels needs the CuTe DSL (the `kernels` extra)")


def test_build_fills_the_cache_offline(tmp_path, monkeypatch):
    from gc_moe.kernels import registry

    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    first = CliRunner().invoke(app, ["build", "--arch", "sm_90a", "--profile", "h200"])
    assert first.exit_code == 0, first.output
    cubins = sorted(tmp_path.rglob("*.cubin"))
    assert len(cubins) >= len(registry.variants_for_profile("sm_90a", {})), first.output
    stamps = {p: p.stat().st_mtime_ns for p in cubins}
    second = CliRunner().invoke(app, ["build", "--arch", "sm_90a", "--profile", "h200"])
    assert second.exit_code == 0, second.output
    assert {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*.cubin"))} == stamps
