"""The device layer proof's W1 check (scripts/device_layer_proof.py), on the CPU: a byte counts as right when it
is a correct E4M3 rounding, at the kernel's own block scale, of a value within the kernel's arithmetic slack of
the float32 result; the slack for the tensor core's sums scales with the products (the conditioning)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from gc_moe.cases import make_routing, random_activations, random_moe_weights
from gc_moe.formats import dequantize_fp8_k128, quantize_fp8_k128
from gc_moe.kernels.sm90 import dispatch
from gc_moe.kernels.sm90 import layer_layout as ll


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "device_layer_proof.py"
    spec = importlib.util.spec_from_file_location("device_layer_proof_w1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture
def w1_case(script):
    seed = int(torch.randint(0, 2**20, (1,)))
    shape = ll.LayerShape(1, 8, 3, 256, 128, 16, 8)
    l1, l2 = random_moe_weights(8, 256, 128, seed=seed)
    w1f, _ = script.dequantized_weights(l1, l2, "cpu")
    x, sf = random_activations(16, 256, seed=seed + 1)
    idx, wt = make_routing("uniform", 16, 8, 3, seed=seed + 2)
    twin = dispatch.reference_dispatch(shape, 0, [x], [sf], [idx], [wt])
    parts = script.w1_float32_parts(twin["ring_act"], twin["ring_scale"], twin["expert_offsets"],
                                    twin["routing_weight"], w1f)
    return parts


def test_rounding_bounds_bracket_every_e4m3_value(script):
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    lo, hi = script.e4m3_rounding_bounds(codes)
    values = codes.double()
    finite = values.isfinite()
    assert bool(((lo <= values) & (values <= hi))[finite].all())
    assert bool(lo[~finite].isnan().all() and hi[~finite].isnan().all())
    # every finite value's interval rounds back to it: probe just inside both ends
    inside = torch.stack([lo + (hi - lo) * 1e-6, hi - (hi - lo) * 1e-6], -1)[finite & lo.isfinite() & hi.isfinite()]
    back = inside.float().to(torch.float8_e4m3fn).double()
    want = values[finite & lo.isfinite() & hi.isfinite()]
    assert torch.equal(back.abs(), want.abs()[:, None].expand_as(back))
    assert float(hi[0x7E]) == float("inf") and float(lo[0xFE]) == float("-inf")  # saturation at +-448


def test_exact_requantization_passes_both_counts(script, w1_case):
    a = w1_case["a"]
    q, qs = quantize_fp8_k128(a)
    report = script.w1_report(q, qs, w1_case)
    assert report["w1_element_errors"] == 0 and report["w1_strict_errors"] == 0 and report["w1_flagged"] == []
    assert script.w1_element_errors(q, qs, a) == 0


def test_a_byte_off_by_a_step_beyond_the_slack_is_flagged_with_its_numbers(script, w1_case):
    a = w1_case["a"]
    q, qs = quantize_fp8_k128(a)
    big = (a.abs() == a.abs().max()).nonzero()[0].tolist()
    r, c = big
    wrong = q.clone()
    wrong.view(torch.uint8)[r, c] -= 2  # two E4M3 steps below the largest value of the block: far past any slack
    report = script.w1_report(wrong, qs, w1_case)
    assert report["w1_element_errors"] == 1 and report["w1_strict_errors"] == 1
    (shown,) = report["w1_flagged"]
    assert (shown["row"], shown["channel"]) == (r, c) and shown["flag"] and shown["strict_flag"]
    assert shown["steps_from_own_rounding"] == 2 and shown["beyond_boundary_in_steps"] > 0.5
    assert shown["expected"] == pytest.approx(float(a[r, c]))
    assert shown["got"] == float(dequantize_fp8_k128(wrong, qs)[r, c])
    nan = q.clone()
    nan.view(torch.uint8)[r, c] = 0x7F
    assert script.w1_report(nan, qs, w1_case)["w1_element_errors"] == 1


def test_sum_errors_within_the_conditioning_slack_pass_but_not_beyond(script, w1_case):
    """What the kernel's narrower tensor-core sums do: its float value moves by a fraction of the conditioning,
    which can push a byte one step past a rounding boundary; allowed up to W1_SUM_SLACK, flagged past it."""
    a, cond = w1_case["a"], w1_case["conditioning"]
    signs = torch.where(torch.rand(a.shape) < 0.5, -1.0, 1.0)
    near = a + signs * cond * script.W1_SUM_SLACK * 0.9
    q, qs = quantize_fp8_k128(near)
    # requantized at the moved values' own scale, as the kernel does from its own amax
    assert script.w1_report(q, qs, w1_case)["w1_element_errors"] == 0
    far = a + signs * cond * script.W1_SUM_SLACK * 512
    q, qs = quantize_fp8_k128(far)
    report = script.w1_report(q, qs, w1_case)
    assert report["w1_element_errors"] > 0 and report["w1_flagged"]
