import math

import pytest
import torch
from gc_moe.metrics import THRESHOLDS, check_accuracy, cosine, max_abs_err, processed_diff, rel_l2


def t(*v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


# Hand-computed: y = (1, 2, 2), y' = (2, 1, 2): <y, y'> = 8, |y|^2 = |y'|^2 = 9, y - y' = (-1, 1, 0).
# y = (3, 4), y' = (0, 5): <y, y'> = 20, |y| = |y'| = 5, y - y' = (3, -1).
# y = 2 y': cosine 1, processed diff 1 - 2*2/(4 + 1) = 1/5.
HAND_CASES = [
    (t(1, 2, 2), t(2, 1, 2), 8 / 9, 1 - 16 / 18, 1.0, math.sqrt(2) / 3),
    (t(3, 4), t(0, 5), 0.8, 1 - 40 / 50, 3.0, math.sqrt(10) / 5),
    (t(2, -4, 6), t(1, -2, 3), 1.0, 0.2, 3.0, 1.0),
    (t(1, 0), t(0, 1), 0.0, 1.0, 1.0, math.sqrt(2)),
    (t(1, 1), t(-1, -1), -1.0, 2.0, 2.0, 2.0),
]


@pytest.mark.parametrize("y, y_ref, cos, pdiff, mae, rl2", HAND_CASES)
def test_metrics_match_hand_computed_values(y, y_ref, cos, pdiff, mae, rl2):
    assert cosine(y, y_ref) == pytest.approx(cos, abs=1e-15)
    assert processed_diff(y, y_ref) == pytest.approx(pdiff, abs=1e-15)
    assert max_abs_err(y, y_ref) == pytest.approx(mae, abs=1e-15)
    assert rel_l2(y, y_ref) == pytest.approx(rl2, rel=1e-15)


def test_processed_diff_equals_the_paper_formula_on_random_tensors():
    g = torch.Generator().manual_seed(torch.seed())
    y_ref = torch.randn(37, 129, generator=g)
    y = y_ref + 0.05 * torch.randn(37, 129, generator=g)
    a, b = y.double().flatten().tolist(), y_ref.double().flatten().tolist()
    dot = math.fsum(u * v for u, v in zip(a, b))
    na, nb = math.fsum(u * u for u in a), math.fsum(v * v for v in b)
    assert processed_diff(y, y_ref) == pytest.approx(1 - 2 * dot / (na + nb), rel=1e-9)
    assert cosine(y, y_ref) == pytest.approx(dot / math.sqrt(na * nb), rel=1e-12)
    assert max_abs_err(y, y_ref) == max(abs(u - v) for u, v in zip(a, b))
    assert rel_l2(y, y_ref) == pytest.approx(
        math.sqrt(math.fsum((u - v) ** 2 for u, v in zip(a, b)) / nb), rel=1e-12
    )


def test_metrics_are_float64_over_every_element():
    # bf16 inputs whose float32 dot product would lose the tiny difference; float64 keeps it exactly.
    y_ref = torch.ones(1 << 16, dtype=torch.bfloat16)
    y = y_ref.clone()
    y[-1] = 1.0078125  # the next bf16 after 1, in the last element only
    assert max_abs_err(y, y_ref) == 0.0078125
    expected = 0.0078125**2 / (2 * (1 << 16) + 2 * 0.0078125 + 0.0078125**2)
    assert processed_diff(y, y_ref) == pytest.approx(expected, rel=1e-12)


def test_zero_and_empty_tensors_are_defined():
    z = torch.zeros(4, 8)
    y = torch.randn(4, 8) + 1.0
    assert (cosine(z, z), processed_diff(z, z), max_abs_err(z, z), rel_l2(z, z)) == (1.0, 0.0, 0.0, 0.0)
    assert cosine(z, y) == 0.0 and processed_diff(z, y) == 1.0 and rel_l2(z, y) == 1.0
    assert rel_l2(y, z) == math.inf
    e = torch.empty(0, 6144)
    assert check_accuracy(e, e, shared=False).passed
    assert not check_accuracy(z, y, shared=False).passed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["y", "y_ref", "y_unquantized"])
def test_non_finite_values_always_fail(bad, where):
    y_ref = torch.randn(16, 256)
    tensors = {"y": y_ref.clone(), "y_ref": y_ref.clone(), "y_unquantized": y_ref.clone()}
    pos = tuple(int(torch.randint(n, (1,))) for n in y_ref.shape)
    tensors[where][pos] = bad
    r = check_accuracy(tensors["y"], tensors["y_ref"], shared=True, y_unquantized=tensors["y_unquantized"])
    assert not r.passed and not r.finite
    if where != "y_unquantized":
        for metric in (cosine, processed_diff, max_abs_err, rel_l2):
            assert math.isnan(metric(tensors["y"], tensors["y_ref"]))


def test_thresholds_are_the_papers():
    assert THRESHOLDS.cosine_routed == 0.97 and THRESHOLDS.cosine_shared == 0.99
    assert THRESHOLDS.processed_diff == 0.002 and THRESHOLDS.repeat_diff == 0.002
    assert THRESHOLDS.cosine_for(False) == 0.97 and THRESHOLDS.cosine_for(True) == 0.99


def _at_cosine(y_ref: torch.Tensor, target: float, g: torch.Generator) -> torch.Tensor:
    """A tensor with exactly the given cosine to y_ref (up to float64 rounding) and the same norm."""
    r = y_ref.double().flatten()
    noise = torch.randn(r.shape, generator=g, dtype=torch.float64)
    ortho = noise - (noise @ r) / (r @ r) * r
    ortho *= r.norm() / ortho.norm()
    out = target * r + math.sqrt(1 - target**2) * ortho
    return out.reshape(y_ref.shape)


@pytest.mark.parametrize("shared", [False, True])
def test_check_accuracy_applies_cosine_against_the_unquantized_forward(shared):
    g = torch.Generator().manual_seed(torch.seed())
    y_unq = torch.randn(64, 512, generator=g, dtype=torch.float64)
    limit = THRESHOLDS.cosine_for(shared)
    for target, should_pass in ((limit + 2e-4, True), (limit - 2e-4, False)):
        y = _at_cosine(y_unq, target, g)
        y_ref = _at_cosine(y, 0.9995, g)  # processed diff to y_ref = 1 - 0.9995 = 5e-4 <= 0.002
        r = check_accuracy(y, y_ref, shared, y_unquantized=y_unq)
        assert r.cosine == pytest.approx(target, abs=1e-9)
        assert r.processed_diff == pytest.approx(5e-4, rel=1e-6)
        assert r.passed is should_pass, r.summary()
        assert r.cosine_threshold == limit and r.finite


def test_check_accuracy_fails_on_processed_diff_alone():
    g = torch.Generator().manual_seed(torch.seed())
    y_ref = torch.randn(32, 256, generator=g, dtype=torch.float64)
    ok = check_accuracy(_at_cosine(y_ref, 0.999, g), y_ref, shared=True)  # diff 1e-3
    bad = check_accuracy(_at_cosine(y_ref, 0.997, g), y_ref, shared=True)  # diff 3e-3, cosine still >= 0.99
    assert ok.passed, ok.summary()
    assert not bad.passed and bad.cosine >= 0.99
    assert any("processed diff" in f for f in bad.failures)
    # a norm mismatch alone: cosine 1, processed diff 1 - 2*1.1/(1.21 + 1) = 0.00452...
    scaled = check_accuracy(1.1 * y_ref, y_ref, shared=False)
    assert scaled.cosine == pytest.approx(1.0) and scaled.processed_diff == pytest.approx(1 - 2.2 / 2.21)
    assert not scaled.passed


def test_check_accuracy_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="one shape"):
        check_accuracy(torch.ones(2, 3), torch.ones(3, 2), shared=False)
    with pytest.raises(ValueError, match="one shape"):
        check_accuracy(torch.ones(2, 3), torch.ones(2, 3), shared=False, y_unquantized=torch.ones(6))
