"""The analysis against the paper's own numbers (Tables 5-10, published means) and hand-checked values.

Also home of `write_synthetic_run`, the small measured run directory the report, figure and regress tests use.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gcmoe_bench import analysis

PAPER = analysis.PAPER_DIR
# The paper prints latencies to 3 decimals: a value computed from one is known only up to this half-unit.
LATENCY_HALF_UNIT = 0.0005

MINI_MODELS = {
    # name: (hidden, intermediate, experts, topk)
    "glm-5.2-mini": (512, 256, 16, 8),
    "deepseek-v4.1-flash-mini": (384, 256, 24, 6),
}
SUITES = {"routed": ("reference", ["gc"]), "shared": ("reference", ["gc", "gc-unfused"])}


def write_synthetic_run(
    root: Path,
    rng: np.random.Generator,
    gpu: str = "cpu",
    run_id: str = "20261202-000000-synthetic",
    models: dict | None = None,
    suites: dict | None = None,
    tokens: tuple[int, ...] = (1, 2, 4, 8),
    num_ranks: int = 2,
) -> Path:
    """A run directory results/<gpu>/<run-id>/ with points.csv (ARCHITECTURE.md columns), raw.csv, env.json.

    Latencies are random: each point's baseline in [50, 500) µs, each operator faster or slower by a random
    factor in [0.75, 1.4); per-rank medians spread below the slowest rank."""
    models = models or MINI_MODELS
    suites = suites or SUITES
    run_dir = root / gpu / run_id
    run_dir.mkdir(parents=True)
    rows, raw = [], []
    for model, (hidden, intermediate, experts, topk) in models.items():
        for suite, (baseline, operators) in suites.items():
            for t in tokens:
                base_latency = rng.uniform(50, 500)
                assignments = t * num_ranks * topk
                # one rank has no remote expert; otherwise any share of the assignments may be remote
                remote = 0 if num_ranks == 1 else int(rng.integers(1, assignments + 1))
                active = int(rng.integers(1, min(experts, assignments) + 1))
                per_expert = 3 * hidden * intermediate // 2 + 3 * hidden * intermediate // 32
                for operator in [baseline, *operators]:
                    latency = base_latency if operator == baseline else base_latency / rng.uniform(0.75, 1.4)
                    medians = [latency] + list(latency * rng.uniform(0.97, 1.0, num_ranks - 1))
                    rng.shuffle(medians)
                    rows.append(
                        {
                            "gpu": gpu,
                            "model": model,
                            "suite": suite,
                            "tokens_per_rank": t,
                            "total_tokens": t * num_ranks,
                            "num_ranks": num_ranks,
                            "hidden": hidden,
                            "intermediate": intermediate,
                            "num_experts": experts,
                            "topk": topk,
                            "num_shared_experts": int(suite != "routed"),
                            "operator": operator,
                            "baseline": baseline,
                            "latency_us": max(medians),
                            "rank_medians_us": ";".join(f"{m:.6f}" for m in medians),
                            "spread_us": max(medians) - min(medians),
                            "speedup": np.nan,
                            "assignments": assignments,
                            "remote_assignments": remote,
                            "hbm_working_set_bytes": active * per_expert,
                            "l2_mode": "flush",
                            "status": "ok",
                            "reason": "",
                        }
                    )
                    for rank, median in enumerate(medians):
                        raw.append(
                            {
                                "model": model,
                                "suite": suite,
                                "tokens_per_rank": t,
                                "operator": operator,
                                "rank": rank,
                                "window": 0,
                                "latency_us": median,
                            }
                        )
    points = pd.DataFrame(rows)
    base = points[points.operator == points.baseline].set_index(["model", "suite", "tokens_per_rank"])[
        "latency_us"
    ]
    points["speedup"] = [
        base[(r.model, r.suite, r.tokens_per_rank)] / r.latency_us for r in points.itertuples()
    ]
    points.to_csv(run_dir / "points.csv", index=False)
    pd.DataFrame(raw).to_csv(run_dir / "raw.csv", index=False)
    (run_dir / "env.json").write_text(json.dumps({"gpu": gpu, "run_id": run_id, "command": "synthetic"}))
    return run_dir


@pytest.fixture
def rng(request):
    # Fresh inputs per test, reproducible from the test's name.
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


# ------------------------------------------------------------------------------------------------------------
# The paper's own numbers
# ------------------------------------------------------------------------------------------------------------


def _within_printed_digits(model_fn, latency_us: float, published: float, decimals: int) -> bool:
    """Does some latency that prints as `latency_us` give a value that prints as `published`?

    The models are monotone in the latency, so the attainable values form an interval."""
    low = model_fn(latency_us + LATENCY_HALF_UNIT)
    high = model_fn(latency_us - LATENCY_HALF_UNIT)
    half = 0.5 * 10.0**-decimals
    return low - half <= published <= high + half


def _paper_latencies():
    return pd.read_csv(PAPER / "latency_tables.csv")


def test_table10_tflops_reproduced_from_paper_latencies():
    latencies = _paper_latencies()
    published = pd.read_csv(PAPER / "tflops_b300.csv").set_index("tokens_per_rank")
    models = pd.read_csv(PAPER / "models.csv").set_index("model")
    checked = 0
    for model, prefix in (("glm-5.2", "glm"), ("deepseek-v4.1-flash", "dsv")):
        hidden, intermediate, topk = models.loc[model, ["hidden", "intermediate", "topk"]]
        rows = latencies[
            (latencies.gpu == "b300") & (latencies.suite == "routed") & (latencies.model == model)
        ]
        assert len(rows) == 9
        for row in rows.itertuples():
            assignments = row.tokens_per_rank * 8 * topk
            for operator, latency in (("mega", row.baseline_us), ("gc", row.operator_us)):
                value = published.loc[row.tokens_per_rank, f"{prefix}_tflops_{operator}"]

                def model_fn(us, a=assignments, h=hidden, i=intermediate):
                    return float(analysis.effective_tflops(a, h, i, us))

                assert _within_printed_digits(model_fn, latency, value, 3), (
                    model,
                    row.tokens_per_rank,
                    operator,
                )
                # The check is tight: a model off by 0.01% misses every printed value.
                assert not _within_printed_digits(lambda us, f=model_fn: f(us) * 1.0001, latency, value, 3)
                checked += 1
    assert checked == 36
    # An independent spot check by hand: GLM-5.2, 1 token/rank, Mega: 6*64*6144*2048 / 64.184 µs.
    assert analysis.effective_tflops(64, 6144, 2048, 64.184) == pytest.approx(4831838208 / 64.184e-6 / 1e12)


def test_table9_reproduced_tflops_hbm_nvlink():
    latencies = _paper_latencies()
    rows = latencies[(latencies.gpu == "h20") & (latencies.suite == "routed")].merge(
        pd.read_csv(PAPER / "throughput_h20.csv"), on="tokens_per_rank"
    )
    assert len(rows) == 9
    hidden, intermediate, topk = 5120, 2304, 6
    counts = pd.read_csv(PAPER / "routing_counts.csv").set_index("tokens_per_rank")
    for row in rows.itertuples():
        for operator, latency in (("mega", row.baseline_us), ("gc", row.operator_us)):
            tflops = getattr(row, f"tflops_{operator}")
            assert _within_printed_digits(
                lambda us, a=row.tokens_per_rank * 8 * topk: float(
                    analysis.effective_tflops(a, hidden, intermediate, us)
                ),
                latency,
                tflops,
                3,
            )
            # The HBM and NVLink columns imply integral counts, the same for both operators (one routing).
            hbm, nvlink = getattr(row, f"hbm_gbps_{operator}"), getattr(row, f"nvlink_gbps_{operator}")
            experts, remote = analysis.infer_routing_counts(hbm, nvlink, latency, hidden, intermediate)
            assert abs(experts - round(float(experts))) < 0.01
            assert abs(remote - round(float(remote))) < 0.02
            assert round(float(experts)) == counts.loc[row.tokens_per_rank, "active_experts"]
            assert round(float(remote)) == counts.loc[row.tokens_per_rank, "remote_assignments"]
            assert round(float(experts)) <= 384 and round(float(remote)) <= row.tokens_per_rank * 8 * topk
            working_set = counts.loc[row.tokens_per_rank, "active_experts"] * analysis.expert_weight_bytes(
                hidden, intermediate
            )
            assert _within_printed_digits(
                lambda us, w=working_set: float(analysis.hbm_working_set_gbps(w, us)), latency, hbm, 1
            )
            n_remote = counts.loc[row.tokens_per_rank, "remote_assignments"]
            assert _within_printed_digits(
                lambda us, n=n_remote: float(analysis.nvlink_payload_gbps(n, hidden, us)), latency, nvlink, 3
            )


def test_model_constants_by_hand():
    # DeepSeek-V4.1-Flash: FP4 W1 (2I x H / 2 = 11,796,480 B) + W2 (H x I / 2 = 5,898,240 B)
    # + scales (2I x H / 32 = 737,280 B and H x I / 32 = 368,640 B).
    assert analysis.expert_weight_bytes(5120, 2304) == 11_796_480 + 5_898_240 + 737_280 + 368_640
    assert analysis.nvlink_bytes_per_assignment(5120) == 5120 + 160 + 10240
    # 1 GB moved in 1 ms is 1000 GB/s; 15520 B x 1000 assignments in 10 µs is 1552 GB/s.
    assert analysis.hbm_working_set_gbps(1e9, 1000.0) == pytest.approx(1000.0)
    assert analysis.nvlink_payload_gbps(1000, 5120, 10.0) == pytest.approx(1552.0)


def test_paper_points_speedups_and_means_match_published():
    points = analysis.load_paper_points()
    latencies = _paper_latencies()
    assert len(points) == 2 * len(latencies)
    merged = points[points.operator != points.baseline].merge(
        latencies, on=["gpu", "model", "suite", "tokens_per_rank", "operator", "baseline"]
    )
    assert len(merged) == len(latencies)
    np.testing.assert_allclose(merged["speedup"], merged["baseline_us"] / merged["operator_us"], rtol=1e-12)
    # The published ratios were taken before the latencies were rounded: they agree to the last printed digit.
    assert (merged["speedup"] - merged["speedup_published"]).abs().max() <= 1.0001e-4
    assert (points[points.operator == points.baseline]["speedup"] == 1.0).all()

    means = analysis.suite_means(points).set_index(["gpu", "suite", "model"])
    published = pd.read_csv(PAPER / "published_means.csv")
    assert len(means) == len(published) == 9
    for row in published.itertuples():
        mean = means.loc[(row.gpu, row.suite, row.model)]
        assert mean["points"] == row.points
        assert round(mean["mean_speedup"], 4) == row.mean_speedup, row
        # the geometric mean never exceeds the arithmetic mean, and is not equal to it on these uneven ratios
        assert mean["geomean_speedup"] < mean["mean_speedup"]


def test_paper_shapes_and_assignments():
    points = analysis.load_paper_points()
    glm = points[(points.model == "glm-5.2")].iloc[0]
    assert (glm.hidden, glm.intermediate, glm.num_experts, glm.topk) == (6144, 2048, 256, 8)
    assert (points.num_ranks == 8).all()
    np.testing.assert_array_equal(points.assignments, points.tokens_per_rank * 8 * points.topk)
    h20 = points[(points.gpu == "h20") & (points.suite == "routed")]
    assert h20.hbm_working_set_bytes.notna().all() and h20.remote_assignments.notna().all()
    assert points[points.gpu == "b300"].hbm_working_set_bytes.isna().all()


# ------------------------------------------------------------------------------------------------------------
# Measured runs (synthetic)
# ------------------------------------------------------------------------------------------------------------


def test_run_points_speedups_means_throughput(tmp_path, rng):
    run_dir = write_synthetic_run(tmp_path, rng)
    points, means = analysis.analyze(analysis.load_run_points(run_dir))
    raw = pd.read_csv(run_dir / "points.csv")
    assert len(points) == len(raw)
    assert (points.source == run_dir.name).all()
    for row in points.itertuples():
        base = raw[
            (raw.model == row.model)
            & (raw.suite == row.suite)
            & (raw.tokens_per_rank == row.tokens_per_rank)
            & (raw.operator == row.baseline)
        ]["latency_us"].item()
        assert row.speedup == pytest.approx(base / row.latency_us, rel=1e-12)
        assert row.tflops == pytest.approx(
            6 * row.assignments * row.hidden * row.intermediate / row.latency_us / 1e6
        )
        assert row.hbm_gbps == pytest.approx(row.hbm_working_set_bytes / (row.latency_us * 1e-6) / 1e9)
        assert row.nvlink_gbps == pytest.approx(
            row.remote_assignments * (3 * row.hidden + row.hidden / 32) / (row.latency_us * 1e-6) / 1e9
        )
    # means: per model and over both models, checked with the statistics module
    for (suite, operator), group in points[points.operator != points.baseline].groupby(["suite", "operator"]):
        for model, rows in list(group.groupby("model")) + [("all", group)]:
            mean = means[(means.suite == suite) & (means.operator == operator) & (means.model == model)]
            assert len(mean) == 1
            ratios = rows["speedup"].tolist()
            assert mean["mean_speedup"].item() == pytest.approx(statistics.fmean(ratios), rel=1e-12)
            assert mean["geomean_speedup"].item() == pytest.approx(
                statistics.geometric_mean(ratios), rel=1e-12
            )
            assert mean["points"].item() == len(ratios)
            assert mean["faster_points"].item() == sum(r > 1 for r in ratios)
    assert not (means.operator == means.baseline).any()


def test_skipped_rows_carry_no_numbers(tmp_path, rng):
    run_dir = write_synthetic_run(tmp_path, rng)
    table = pd.read_csv(run_dir / "points.csv", dtype={"reason": str})
    skipped = (table.operator == "gc-unfused") & (table.tokens_per_rank == 4)
    table.loc[skipped, "status"] = "skipped"
    table.loc[skipped, "reason"] = "adapter does not load here"
    table.to_csv(run_dir / "points.csv", index=False)
    points, means = analysis.analyze(analysis.load_run_points(run_dir))
    is_skipped = (points.operator == "gc-unfused") & (points.tokens_per_rank == 4)
    assert is_skipped.sum() == 2
    assert points[is_skipped]["speedup"].isna().all() and points[is_skipped]["tflops"].isna().all()
    assert points[~is_skipped]["speedup"].notna().all()
    unfused = means[(means.operator == "gc-unfused") & (means.model != "all")]
    assert (unfused.points == 3).all()


def test_bad_points_are_refused_clearly(tmp_path, rng):
    run_dir = write_synthetic_run(tmp_path, rng)
    table = pd.read_csv(run_dir / "points.csv")
    table.drop(columns=["latency_us"]).to_csv(run_dir / "points.csv", index=False)
    with pytest.raises(ValueError, match="lacks columns \\['latency_us'\\]"):
        analysis.load_run_points(run_dir)
    table[table.operator != "reference"].to_csv(run_dir / "points.csv", index=False)
    with pytest.raises(ValueError, match="no row for baseline operator 'reference'"):
        analysis.load_run_points(run_dir)
    with pytest.raises(FileNotFoundError, match="points.csv"):
        analysis.load_run_points(tmp_path / "nowhere")


def test_geometric_mean_edge_cases():
    assert math.isnan(analysis.geometric_mean([]))
    assert math.isnan(analysis.geometric_mean([1.0, -1.0]))
    assert analysis.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
