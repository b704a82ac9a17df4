import itertools
import math

import pytest
from gc_moe.planning import (
    GcMoeConstraintError,
    RingPlan,
    check_constraints,
    choose_block_m,
    ring_capacity,
)

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------------------------- BM tables
# Hand-computed: m = T*P*k/E, target = m + sqrt(m).
# GLM-5.2 (E=256, k=8, P=8): m = T/4. T=64: 16+4=20 -> 32; T=128: 32+5.66=37.7 -> 64; T=256: 64+8=72 -> 96.
GLM_SM103 = dict(zip(TOKENS, (16, 16, 16, 16, 16, 16, 32, 64, 96)))
# DeepSeek-V4.1-Flash (E=384, k=6, P=8): m = T/8. T=64: 8+2.83 -> 16; T=128: 16+4=20 -> 32; T=256: 37.7 -> 64.
DSV4_SM103 = dict(zip(TOKENS, (16, 16, 16, 16, 16, 16, 16, 32, 64)))
# SM90 on H20, same model: T<=32 -> target <= 6 -> 8; T=64 -> 10.8 -> 16; 128 -> 32; 256 -> 64.
DSV4_SM90 = dict(zip(TOKENS, (8, 8, 8, 8, 8, 8, 16, 32, 64)))


@pytest.mark.parametrize("tokens", TOKENS)
def test_block_m_tables_of_both_models(tokens):
    assert choose_block_m(tokens, 8, 8, 256, "sm103") == GLM_SM103[tokens]
    assert choose_block_m(tokens, 8, 6, 384, "sm103") == DSV4_SM103[tokens]
    assert choose_block_m(tokens, 8, 6, 384, "sm90") == DSV4_SM90[tokens]


@pytest.mark.parametrize(
    "tokens, ranks, topk, experts, expected",
    [
        # GLM at prefill sizes: T=1024 -> m=256, target 272 -> 2 blocks of 136 -> 192 (not 240 + 32 padding)
        (1024, 8, 8, 256, 192),
        # T=4096 -> m=1024, target 1056 -> 5 blocks of 211.2 -> 240
        (4096, 8, 8, 256, 240),
        # e = 2 local experts (small): T=64, k=2, E=16 -> m=64, target 72, forced 2 blocks of 36 -> 64 (else 96)
        (64, 8, 2, 16, 64),
        # e = 16 (not small) at the same m: one block covering 72 -> 96
        (64, 8, 16, 128, 96),
        # small batch pin: T=16, E=8, k=8, P=8 -> m=128, target capped at T*P=128, would be 128 -> pinned to 32
        (16, 8, 8, 8, 32),
        # T=1, P=1: target capped at 1 token -> 16
        (1, 1, 8, 8, 16),
    ],
)
def test_block_m_sm103_rules(tokens, ranks, topk, experts, expected):
    assert choose_block_m(tokens, ranks, topk, experts, "sm103") == expected


@pytest.mark.parametrize(
    "tokens, ranks, topk, experts, expected",
    [(1, 1, 1, 1, 8), (4, 8, 8, 8, 32), (8, 8, 8, 8, 64), (3, 2, 2, 4, 8), (1024, 8, 8, 256, 64)],
)
def test_block_m_sm90_rules(tokens, ranks, topk, experts, expected):
    # (4,8,8,8): m=32, target 37.7 capped at T*P=32 -> 32; (8,8,8,8): m=64, 72 -> saturates at 64;
    # (3,2,2,4): m=3, target 4.7 -> 8
    assert choose_block_m(tokens, ranks, topk, experts, "sm90") == expected


def test_block_m_range_over_batches():
    # SM90 never shrinks BM as the batch grows; SM103 may (splitting into more blocks), but only within its set
    sm90 = [choose_block_m(t, 8, 8, 256, "sm90") for t in range(1, 4097)]
    assert all(a <= b for a, b in itertools.pairwise(sm90)) and set(sm90) == {8, 16, 32, 64}
    sm103 = [choose_block_m(t, 8, 8, 256, "sm103") for t in range(1, 4097)]
    assert set(sm103) == {16, 32, 64, 96, 128, 192, 240}


def test_block_m_rejects_bad_arguments():
    with pytest.raises(GcMoeConstraintError, match=r"arch: got 'sm80'; allowed: one of \('sm90', 'sm103'\)"):
        choose_block_m(8, 8, 8, 256, "sm80")
    with pytest.raises(GcMoeConstraintError, match=r"num_tokens: got 0; allowed: a positive integer"):
        choose_block_m(0, 8, 8, 256)


# ----------------------------------------------------------------------------------------------- ring capacity
def test_ring_capacity_glm_on_b300_hand_computed():
    # Tmax=256, P=8, k=8, E=256 -> e=32; BM=96; 128 compute SMs -> 64 clusters.
    plan = ring_capacity(256, 8, 8, 256, hidden=6144, intermediate=2048, block_m=96, compute_sms=128)
    assert plan.assignments == 256 * 8 * 8 == 16384
    assert plan.pool_blocks == 171 + 32  # ceil(16384/96) = 171
    assert plan.cluster_count == 64
    assert plan.l1_tasks_per_block == 16  # 2*2048/256
    assert plan.l2_tasks_per_block == 24  # 6144/256
    assert plan.live_blocks == 8 + 3  # ceil(2*64/16) + ceil(64/24)
    assert plan.ring_blocks == 11 and plan.ring_tokens == 11 * 96


def test_ring_capacity_dsv4_small_partition_and_k_above_e():
    # DSV4 (H=5120, I=2304) with 104 compute SMs (dispatch request 24 on H200-like 132 SMs): 52 clusters.
    plan = ring_capacity(256, 8, 6, 384, hidden=5120, intermediate=2304, block_m=64, compute_sms=104)
    assert plan.assignments == 256 * 8 * 6
    assert plan.pool_blocks == 192 + 48
    assert (plan.l1_tasks_per_block, plan.l2_tasks_per_block) == (18, 20)
    assert plan.live_blocks == math.ceil(104 / 18) + math.ceil(52 / 20) == 6 + 3
    # k > e: at most e distinct local experts per token -> min(k, e) = 2 assignments per (token, rank)
    small = ring_capacity(4, 2, 8, 4, hidden=256, intermediate=128, block_m=16, compute_sms=128)
    assert small.assignments == 4 * 2 * 2
    assert small.pool_blocks == 1 + 2
    assert small.live_blocks == 128 + 64  # 2*64/1 + 64/1
    assert (
        small.ring_blocks == 3
    )  # the pool is smaller than the live model: never allocate more than the pool


def test_ring_capacity_sm90_geometry():
    plan = ring_capacity(
        256, 8, 6, 384, hidden=5120, intermediate=2304, block_m=64, compute_sms=128, arch="sm90", l1_waves=1
    )
    assert plan.cluster_count == 128
    assert (plan.l1_tasks_per_block, plan.l2_tasks_per_block) == (36, 40)
    assert plan.live_blocks == math.ceil(128 / 36) + math.ceil(128 / 40) == 4 + 4


def test_ring_slot_and_fit_check():
    plan = RingPlan(16, 100, 10, 4, 2, 2, 2, 3, 3)
    assert [plan.ring_slot(b) for b in (0, 2, 3, 7, 9)] == [(0, 0), (2, 0), (0, 1), (1, 2), (0, 3)]
    with pytest.raises(ValueError, match=r"logical block 10 outside the pool \[0, 10\)"):
        plan.ring_slot(10)
    plan.check_fits(3)
    with pytest.raises(GcMoeConstraintError, match="got 2 allocated ring blocks; allowed: at least 3"):
        plan.check_fits(2)


def test_ring_capacity_rejects_bad_arguments():
    with pytest.raises(GcMoeConstraintError, match=r"block_m: got 48; allowed on sm103: \(16, 32"):
        ring_capacity(256, 8, 8, 256, 6144, 2048, block_m=48, compute_sms=128)
    with pytest.raises(GcMoeConstraintError, match="compute_sms: got 127; allowed on sm103: a multiple of"):
        ring_capacity(256, 8, 8, 256, 6144, 2048, block_m=96, compute_sms=127)
    with pytest.raises(GcMoeConstraintError, match="E mod P = 0: got E=250, P=8"):
        ring_capacity(256, 8, 8, 250, 6144, 2048, block_m=96, compute_sms=128)
    with pytest.raises(GcMoeConstraintError, match="compute_sms: got 0; allowed: a positive integer"):
        ring_capacity(256, 8, 8, 256, 6144, 2048, block_m=96, compute_sms=0)


# ----------------------------------------------------------------------------------------------- constraints
GOOD = {"hidden": 6144, "intermediate": 2048, "num_experts": 256, "num_ranks": 8, "topk": 8}


@pytest.mark.parametrize(
    "model",
    [GOOD, {"hidden": 5120, "intermediate": 2304, "num_experts": 384, "num_ranks": 8, "topk": 6}],
)
def test_both_models_pass(model):
    check_constraints(**model, num_shared_experts=1, shared_recipe=(1, 128, 128), block_m=96, capacity=256)
    check_constraints(**model, arch="sm90", block_m=8, capacity=256, num_tokens=256)


@pytest.mark.parametrize(
    "override, fragments",
    [
        (
            {"intermediate": 4224},
            ["I <= 4096 and I mod 128 = 0", "got intermediate=4224", "64-bit W1-completion word"],
        ),
        (
            {"intermediate": 2000},
            ["I <= 4096 and I mod 128 = 0", "got intermediate=2000", "a multiple of 128"],
        ),
        ({"hidden": 6016}, ["H mod 256 = 0", "got hidden=6016", "allowed: a multiple of 256"]),
        (
            {"topk": 32, "num_shared_experts": 1},
            ["k + 1[shared] <= 32", "got topk=32 with 1 shared", "at most 31"],
        ),
        ({"topk": 33}, ["k + 1[shared] <= 32", "got topk=33", "at most 32 routed"]),
        ({"num_shared_experts": 2}, ["num_shared_experts: got 2", "allowed: 0 or 1"]),
        (
            {"num_experts": 4096, "num_ranks": 64},
            ["E <= 2048 global", "got num_experts=4096", "at most 2048"],
        ),
        (
            {"num_experts": 1024, "num_ranks": 1},
            ["E/P <= 512 per rank", "got 1024 experts per rank", "at most 512"],
        ),
        (
            {"num_experts": 250},
            ["E mod P = 0", "got num_experts=250, num_ranks=8", "a multiple of num_ranks"],
        ),
        ({"num_experts": 288, "num_ranks": 96}, ["P <= 72 ranks", "got num_ranks=96", "at most 72"]),
        ({"recipe": (1, 128, 128)}, ["routed recipe: got (1, 128, 128)", "allowed: (1, 1, 32)"]),
        (
            {"num_shared_experts": 1, "shared_recipe": (1, 1, 128)},
            ["shared recipe: got (1, 1, 128)", "allowed: one of ((1, 1, 32), (1, 128, 128))"],
        ),
        ({"activation": "gelu"}, ["activation: got 'gelu'", "allowed: ('swiglu',)"]),
        ({"block_m": 48}, ["BM: got block_m=48", "allowed on sm103: (16, 32, 64, 96, 128, 192, 240)"]),
        ({"block_m": 96, "arch": "sm90"}, ["BM: got block_m=96", "allowed on sm90: (8, 16, 32, 64)"]),
        ({"capacity": 0}, ["capacity: got 0", "a positive number of tokens"]),
        (
            {"capacity": 16, "num_tokens": 17},
            ["num_tokens <= capacity: got num_tokens=17", "at most capacity=16"],
        ),
        ({"num_tokens": -1}, ["num_tokens: got -1", "a non-negative integer"]),
    ],
)
def test_each_constraint_names_itself_the_value_and_the_allowed_range(override, fragments):
    with pytest.raises(GcMoeConstraintError) as info:
        check_constraints(**{**GOOD, **override})
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    assert len(info.value.violations) == 1, info.value.violations
    assert isinstance(info.value, ValueError)


def test_all_violations_reported_at_once():
    with pytest.raises(GcMoeConstraintError) as info:
        check_constraints(
            hidden=100, intermediate=100, num_experts=7, num_ranks=2, topk=40, activation="relu"
        )
    assert len(info.value.violations) == 5
    assert [v.split(":")[0] for v in info.value.violations] == [
        "I <= 4096 and I mod 128 = 0",
        "H mod 256 = 0",
        "k + 1[shared] <= 32",
        "E mod P = 0",
        "activation",
    ]


def test_shape_arguments_must_be_positive_integers():
    with pytest.raises(GcMoeConstraintError, match=r"topk: got 0; allowed: a positive integer"):
        check_constraints(**{**GOOD, "topk": 0})
    with pytest.raises(GcMoeConstraintError, match=r"hidden: got 6144.0; allowed: a positive integer"):
        check_constraints(**{**GOOD, "hidden": 6144.0})
    with pytest.raises(GcMoeConstraintError, match=r"arch: got 'sm100'"):
        check_constraints(**GOOD, arch="sm100")
