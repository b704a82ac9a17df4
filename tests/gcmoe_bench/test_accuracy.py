"""The accuracy command's own machinery: the unquantized BF16 weights drawn once per run (bit-identical to drawing
them per case), the cross-check of gc against mega-port, the progress lines, and operator errors recorded in
their rows and in error-rank<r>.log instead of lost.

The command-line tests run a driver that registers stand-ins and then the ordinary command line: ``mega-port``
as the reference operator (on the CPU the public API's gc is the reference, so the two agree bit for bit), or
perturbed; ``crashy`` as the reference operator whose prepare or call raises on a chosen rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gc_moe import cases

from gcmoe_bench import accuracy
from gcmoe_bench.models import ModelShape
from tests.gcmoe_bench.test_sweep import rows, run_cli

TINY = ModelShape(name="tiny", base="deepseek-v4.1-flash", hidden=256, intermediate=128, num_experts=8, topk=3,
                  num_shared_experts=1, shared_k_group=32, capacity=8)


# ------------------------------------------------------------------------------------ unquantized weights
def test_cached_unquantized_forward_is_bit_identical_and_draws_each_expert_once(monkeypatch):
    drawn = []
    real = cases.random_expert_weights_float

    def counting(expert, hidden, intermediate, *, seed):
        drawn.append(expert)
        return real(expert, hidden, intermediate, seed=seed)

    monkeypatch.setattr(cases, "random_expert_weights_float", counting)
    calls = []
    for call, (tokens, shared) in enumerate(((5, False), (7, True), (5, True), (1, False), (6, False))):
        idx, wts = cases.make_routing("uniform", tokens, TINY.num_experts, TINY.topk, seed=100 + call)
        if call == 3:
            idx[0, 1:] = -1  # a partly empty row
        calls.append((cases.random_hidden_states(tokens, TINY.hidden, seed=200 + call), idx, wts,
                      12 if shared else None))
    fresh = [accuracy.unquantized_forward(x, idx, wts, TINY, expert_seed=11, shared_seed=shared_seed)
             for x, idx, wts, shared_seed in calls]
    used = {e for _, idx, _, _ in calls for e in idx[idx >= 0].tolist()}
    assert len(drawn) > len(used)  # drawn afresh per call: experts repeat across calls
    drawn.clear()
    cache = accuracy.UnquantizedWeights.for_model(TINY, expert_seed=11, shared_seed=12, device="cpu")
    for (x, idx, wts, shared_seed), want in zip(calls, fresh, strict=True):
        got = accuracy.unquantized_forward(x, idx, wts, TINY, expert_seed=11, shared_seed=shared_seed,
                                           weights=cache)
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert sorted(drawn) == sorted(used)  # each expert drawn once for the whole run
    assert cache.generated == len(used) + 1  # + the shared expert
    assert cache.kept_bytes == (len(used) + 1) * 3 * TINY.hidden * TINY.intermediate * 2
    assert "the shared expert" in cache.describe()


def test_unquantized_forward_matches_the_bf16_formula():
    """The cached weights are the float32 draws rounded to bf16: Eq. (1) written out for one token."""
    from gc_moe.reference import swiglu

    idx = torch.tensor([[2, -1, 5]])
    wts = torch.tensor([[0.25, 0.0, 0.75]])
    x = cases.random_hidden_states(1, TINY.hidden, seed=3)
    cache = accuracy.UnquantizedWeights.for_model(TINY, expert_seed=11, shared_seed=None, device="cpu")
    got = accuracy.unquantized_forward(x, idx, wts, TINY, expert_seed=11, shared_seed=None, weights=cache)
    xb = x.to(torch.bfloat16).float()
    want = torch.zeros(1, TINY.hidden)
    for expert, weight in ((2, 0.25), (5, 0.75)):
        w1, w2 = cases.random_expert_weights_float(expert, TINY.hidden, TINY.intermediate, seed=11)
        act = swiglu(xb @ w1.to(torch.bfloat16).float().T, alpha=1.0, clamp=10.0)
        want += weight * (act @ w2.to(torch.bfloat16).float().T)
    assert torch.equal(got, want.to(torch.bfloat16))


def test_unquantized_weights_must_match_the_call():
    cache = accuracy.UnquantizedWeights.for_model(TINY, expert_seed=11, shared_seed=12, device="cpu")
    idx, wts = cases.make_routing("uniform", 2, TINY.num_experts, TINY.topk, seed=1)
    x = cases.random_hidden_states(2, TINY.hidden, seed=2)
    with pytest.raises(ValueError, match="seeds 11/12 on cpu; this call needs H=256, I=128, seeds 99/12"):
        accuracy.unquantized_forward(x, idx, wts, TINY, expert_seed=99, shared_seed=12, weights=cache)
    with pytest.raises(ValueError, match="without a shared-expert seed"):
        accuracy.UnquantizedWeights.for_model(TINY, expert_seed=11, shared_seed=None, device="cpu").shared()


# ------------------------------------------------------------------------------------ the command line
DRIVER = '''
import os
import torch
from gcmoe_bench import operators
from gcmoe_bench.cli import main

PORT = os.environ.get("FAKE_PORT", "same")  # "same": the reference's output; "off": half its columns x 0.9
CRASH = os.environ.get("CRASH", "")  # "prepare" or "call": where crashy raises
CRASH_RANK = int(os.environ.get("CRASH_RANK", "0"))


class FakePort(operators.ReferenceAdapter):
    name = "mega-port"
    role = "baseline"

    def prepare(self, workload, group):
        inv = super().prepare(workload, group)
        if PORT == "off":
            run = inv._run

            def perturbed():
                run()
                inv.output[:, : inv.output.shape[1] // 2].mul_(0.9)

            inv._run = perturbed
        return inv


class Crashy(operators.ReferenceAdapter):
    name = "crashy"
    role = "operator"

    def prepare(self, workload, group):
        if CRASH == "prepare" and workload.rank == CRASH_RANK:
            raise ValueError("crashy cannot prepare\\nsecond line")
        inv = super().prepare(workload, group)
        if CRASH == "call" and workload.rank == CRASH_RANK:
            def boom():
                raise RuntimeError("crashy failed in its call")

            inv._run = boom
        return inv


if os.environ.get("FAKE_PORT"):
    operators.REGISTRY["mega-port"] = FakePort()
operators.REGISTRY["crashy"] = Crashy()
main()
'''


def run_driver(tmp_path: Path, args: list[str], *, ranks: int | None = None, **env_vars) -> subprocess.CompletedProcess:
    driver = tmp_path / "accuracy_driver.py"
    driver.write_text(DRIVER)
    launcher = [sys.executable, str(driver)]
    if ranks:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    str(driver)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **env_vars}
    return subprocess.run(launcher + ["accuracy", "--gpu", "cpu", "--models", "deepseek-v4.1-flash-mini",
                                      "--out", str(tmp_path)] + args,
                          capture_output=True, text=True, timeout=200, env=env, check=False)


def _run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "cpu").iterdir()
    return run_dir


def test_gc_is_cross_checked_against_mega_port(tmp_path):
    done = run_driver(tmp_path, ["--cases", "boundary_t3", "--operators", "gc,mega-port"], FAKE_PORT="same")
    assert done.returncode == 0, done.stderr[-3000:]
    got = rows(_run_dir(tmp_path) / "accuracy.csv")
    assert [(r["shared_experts"], r["operator"]) for r in got] == [(s, op) for s in "01" for op in ("gc", "mega-port")]
    for r in got:
        assert r["status"] == "ok" and r["passed"] == "true"
        if r["operator"] == "gc":
            assert r["versus"] == "mega-port" and r["versus_passed"] == "true"
            assert float(r["versus_cosine"]) >= accuracy.VERSUS_COSINE_MIN
        else:
            assert r["versus"] == r["versus_cosine"] == r["versus_passed"] == ""
    # progress: one line per case and shared mode, with the case count and the elapsed time
    assert "case 1/2 deepseek-v4.1-flash-mini boundary_t3 shared=0: gc pass, mega-port pass (" in done.stderr
    assert "case 2/2 deepseek-v4.1-flash-mini boundary_t3 shared=1: gc pass, mega-port pass (" in done.stderr
    assert "elapsed" in done.stderr and "unquantized BF16 weights:" in done.stderr


def test_a_cross_check_below_the_floor_fails_the_run(tmp_path):
    done = run_driver(tmp_path, ["--cases", "boundary_t3", "--operators", "gc,mega-port"], FAKE_PORT="off")
    assert done.returncode == 1, done.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    gc_rows = [r for r in rows(run_dir / "accuracy.csv") if r["operator"] == "gc"]
    assert len(gc_rows) == 2
    for r in gc_rows:
        assert r["passed"] == "true" and r["versus_passed"] == "false"  # gc itself is right; the pair disagrees
        assert 0.99 < float(r["versus_cosine"]) < accuracy.VERSUS_COSINE_MIN
    assert "FAIL deepseek-v4.1-flash-mini boundary_t3 shared=False gc: cosine against mega-port 0.99" in done.stderr
    assert json.loads((run_dir / "env.json").read_text())["all_passed"] is False


def test_no_cross_check_when_mega_port_is_skipped(tmp_path):
    done = run_cli(["accuracy", "--gpu", "cpu", "--models", "deepseek-v4.1-flash-mini", "--cases", "boundary_t3",
                    "--operators", "gc,mega-port", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    for r in rows(_run_dir(tmp_path) / "accuracy.csv"):
        if r["operator"] == "gc":
            assert r["status"] == "ok" and r["passed"] == "true" and r["versus"] == "mega-port"
            assert r["versus_cosine"] == r["versus_passed"] == ""
            # how gc ran (its invocation note), then why it has no cross-check
            assert r["reason"] == "gc_moe backend: reference; not compared with mega-port (skipped)"
        else:
            assert r["status"] == "skipped" and r["reason"].startswith("mega-port needs a CUDA GPU")


def test_an_operator_error_is_recorded_and_the_suite_goes_on(tmp_path):
    done = run_driver(tmp_path, ["--cases", "boundary_t3", "--operators", "crashy,gc"], CRASH="call")
    assert done.returncode == 1, done.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    got = rows(run_dir / "accuracy.csv")
    assert [(r["shared_experts"], r["operator"]) for r in got] == [(s, op) for s in "01" for op in ("crashy", "gc")]
    for r in got:
        if r["operator"] == "crashy":
            assert r["status"] == "error" and r["passed"] == "false" and r["cosine"] == ""
            assert r["reason"] == (f"crashy on deepseek-v4.1-flash-mini boundary_t3 shared={r['shared_experts']}: "
                                   "RuntimeError: crashy failed in its call (traceback: error-rank0.log)")
        else:
            assert r["status"] == "ok" and r["passed"] == "true"
    log = (run_dir / "error-rank0.log").read_text()
    assert log.count("RuntimeError: crashy failed in its call") == 2 and "Traceback" in log
    env = json.loads((run_dir / "env.json").read_text())
    assert env["status"] == "complete" and env["all_passed"] is False
    assert "FAIL deepseek-v4.1-flash-mini boundary_t3 shared=False crashy: crashy on" in done.stderr


@pytest.mark.slow
def test_a_prepare_error_on_one_rank_is_recorded_on_both(tmp_path):
    done = run_driver(tmp_path, ["--cases", "boundary_t3", "--operators", "crashy,gc"], ranks=2, CRASH="prepare",
                      CRASH_RANK="1")
    assert done.returncode != 0, done.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    got = rows(run_dir / "accuracy.csv")
    assert [(r["shared_experts"], r["operator"]) for r in got] == [(s, op) for s in "01" for op in ("crashy", "gc")]
    for r in got:
        if r["operator"] == "crashy":
            assert r["status"] == "error"
            assert r["reason"] == (f"rank 1: crashy on deepseek-v4.1-flash-mini boundary_t3 "
                                   f"shared={r['shared_experts']}: prepare: ValueError: crashy cannot prepare second "
                                   f"line (traceback: error-rank1.log)")
        else:
            assert r["status"] == "ok" and r["passed"] == "true"
    assert "ValueError: crashy cannot prepare" in (run_dir / "error-rank1.log").read_text()
    assert not (run_dir / "error-rank0.log").exists()
