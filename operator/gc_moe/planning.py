"""Host-side planning: the block-size heuristic, the token-ring capacity model and the operator's constraints.

- `choose_block_m` (Section 4.4): the token block size BM of the grouped GEMM from the expected tokens per
  expert m = T*P*k/E and its spread.
- `ring_capacity` (Section 4.3): how many logical ring blocks one replay can need (the pool) and how many must be
  live at once for the compute partition actually granted by the driver.
- `check_constraints` (Appendix A, Table 12): every shape/recipe limit of the kernels, checked before anything is
  allocated, so a bad configuration fails with a message instead of a hang or a silent wrong answer.

Pure Python: no tensors, no device. Thresholds the paper states only in words are named constants below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHS = ("sm90", "sm103")

# Table 12 / Section 4.4: BM candidates per path.
SM103_BLOCK_M = (16, 32, 64, 96, 128, 192, 240)
SM90_BLOCK_M = (8, 16, 32, 64)
BLOCK_M_CANDIDATES = {"sm103": SM103_BLOCK_M, "sm90": SM90_BLOCK_M}

# "Small batches pin BM = 16-32": at or below this many tokens per rank the first ring block must fill after as
# few tokens as possible (the GEMM starts on the first full block), so BM stays in {16, 32}.
SMALL_BATCH_TOKENS = 16
SMALL_BATCH_MAX_BLOCK_M = 32
# "At least two blocks when the per-rank expert count is small": with few local experts, one block per expert
# leaves most clusters of the compute partition idle, so each expert's tokens are split over >= 2 blocks.
SMALL_LOCAL_EXPERTS = 8
MIN_BLOCKS_FEW_EXPERTS = 2

# Table 12 limits.
MAX_INTERMEDIATE = 4096  # W1 output tiles 2I/128 must fit the 64-bit W1-completion word
INTERMEDIATE_MULTIPLE = 128  # complete K128 tiles of W2
HIDDEN_MULTIPLE = 256  # 2-CTA clusters pair N128 tiles: H/128 even
MAX_COMBINE_SLOTS = 32  # one warp lane per combine slot: k + 1[shared] <= 32
MAX_EXPERTS = 2048  # static per-expert signal region
MAX_EXPERTS_PER_RANK = 512  # lane-held per-expert counters
MAX_RANKS = 72  # 592-byte by-value peer descriptor with 72 offsets
ROUTED_RECIPES = ((1, 1, 32),)  # the MMA scale-factor path hard-codes K32 UE8M0
SHARED_RECIPES = ((1, 1, 32), (1, 128, 128))
ACTIVATIONS = ("swiglu",)  # SwiGLU is fused in the W1 epilogue
MAX_SHARED_EXPERTS = 1  # the shared output occupies one combine lane (lane k)

# Task geometry used by the ring model: CTAs per cluster and weight rows one cluster task covers (operands are
# swapped, so a task is a tile of weight rows against one ring block of tokens).
TASK_GEOMETRY = {
    "sm103": {"cluster_ctas": 2, "rows_per_task": 256},  # 2-CTA tcgen05 MMA, a pair of N128 tiles
    "sm90": {"cluster_ctas": 1, "rows_per_task": 128},
}
DEFAULT_L1_WAVES = 2  # L1 waves the scheduler pre-publishes before the first L2 wave


class GcMoeConstraintError(ValueError):
    """A configuration outside the operator's supported envelope (Appendix A, Table 12).

    `violations` lists one line per broken constraint: its name, the value given and what is allowed.
    """

    def __init__(self, violations: list[str]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"GC-MoE configuration outside the supported envelope (Appendix A):\n{lines}")


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise GcMoeConstraintError([f"arch: got {arch!r}; allowed: one of {ARCHS}"])


def _check_positive_ints(**values) -> None:
    bad = [
        f"{name}: got {v!r}; allowed: a positive integer"
        for name, v in values.items()
        if isinstance(v, bool) or not isinstance(v, int) or v < 1
    ]
    if bad:
        raise GcMoeConstraintError(bad)


# ----------------------------------------------------------------------------------------------- block size
def expected_tokens_per_expert(num_tokens: int, num_ranks: int, topk: int, num_experts: int) -> float:
    """m = T*P*k/E: the mean number of routed tokens one expert receives under balanced routing."""
    return num_tokens * num_ranks * topk / num_experts


def block_m_target(num_tokens: int, num_ranks: int, topk: int, num_experts: int) -> float:
    """Tokens one expert's blocks should cover: m + sqrt(m) (mean plus one standard deviation of a Poisson
    count), capped at T*P because an expert receives each token at most once."""
    m = expected_tokens_per_expert(num_tokens, num_ranks, topk, num_experts)
    return min(m + math.sqrt(m), float(num_tokens * num_ranks))


def _smallest_covering(candidates: tuple[int, ...], tokens: float) -> int:
    return next((c for c in candidates if c >= tokens), candidates[-1])


def choose_block_m(num_tokens: int, num_ranks: int, topk: int, num_experts: int, arch: str = "sm103") -> int:
    """The grouped GEMM's token block size BM for T = `num_tokens` tokens per rank (Section 4.4).

    SM103: cover the target m + sqrt(m) with the number of blocks the largest candidate (240) would need, then
    take the smallest candidate that still covers it (so 300 tokens -> two blocks of 192, not 240 + 60 padding);
    use at least two blocks when the per-rank expert count is <= SMALL_LOCAL_EXPERTS; pin BM to 16-32 at
    <= SMALL_BATCH_TOKENS tokens per rank. SM90: the smallest of {8, 16, 32, 64} covering the same token bound.
    """
    _check_arch(arch)
    _check_positive_ints(num_tokens=num_tokens, num_ranks=num_ranks, topk=topk, num_experts=num_experts)
    target = block_m_target(num_tokens, num_ranks, topk, num_experts)
    candidates = BLOCK_M_CANDIDATES[arch]
    if arch == "sm90":
        return _smallest_covering(candidates, target)

    blocks = math.ceil(target / candidates[-1])
    if num_experts // num_ranks <= SMALL_LOCAL_EXPERTS:
        blocks = max(blocks, MIN_BLOCKS_FEW_EXPERTS)
    block_m = _smallest_covering(candidates, target / blocks)
    if num_tokens <= SMALL_BATCH_TOKENS:
        block_m = min(block_m, SMALL_BATCH_MAX_BLOCK_M)
    return block_m


# ----------------------------------------------------------------------------------------------- ring capacity
@dataclass(frozen=True)
class RingPlan:
    """Sizes of the token ring for one configuration (Section 4.3).

    A logical pool block b lives in ring block b mod ring_blocks with generation b // ring_blocks.
    """

    block_m: int
    assignments: int  # max routed (token, expert) pairs landing on one rank: Tmax * P * min(k, e)
    pool_blocks: int  # logical blocks one replay can need: ceil(assignments / BM) + e
    cluster_count: int  # clusters (task slots) of the compute partition
    l1_tasks_per_block: int
    l2_tasks_per_block: int
    l1_waves: int
    live_blocks: int  # blocks that must be resident to keep l1_waves L1 waves plus one L2 wave busy
    ring_blocks: int  # physical ring blocks to allocate: min(pool, live)

    @property
    def ring_tokens(self) -> int:
        return self.ring_blocks * self.block_m

    def ring_slot(self, logical_block: int) -> tuple[int, int]:
        """(ring block, generation) of a logical pool block."""
        if not 0 <= logical_block < self.pool_blocks:
            raise ValueError(f"logical block {logical_block} outside the pool [0, {self.pool_blocks})")
        return logical_block % self.ring_blocks, logical_block // self.ring_blocks

    def check_fits(self, allocated_ring_blocks: int) -> None:
        """Refuse to start on a ring allocated for a smaller partition or batch (a graph must never start with
        an undersized ring)."""
        if allocated_ring_blocks < self.ring_blocks:
            raise GcMoeConstraintError(
                [
                    (
                        f"ring capacity: got {allocated_ring_blocks} allocated ring blocks; allowed: at least "
                        f"{self.ring_blocks} for BM={self.block_m} on {self.cluster_count} clusters"
                    )
                ]
            )


def ring_capacity(
    capacity: int,
    num_ranks: int,
    topk: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    block_m: int,
    compute_sms: int,
    arch: str = "sm103",
    l1_waves: int = DEFAULT_L1_WAVES,
) -> RingPlan:
    """The ring model of Section 4.3 for per-rank capacity Tmax = `capacity`.

    pool = ceil(Tmax * P * min(k, e) / BM) + e (the + e: every local expert may end in a partial block).
    live = ceil(l1_waves * clusters / L1 tasks per block) + ceil(clusters / L2 tasks per block), where clusters
    = compute_sms / CTAs per cluster is taken from the partition the driver actually returned, L1 tasks per block
    = 2I / rows per task and L2 tasks per block = H / rows per task.
    """
    _check_arch(arch)
    _check_positive_ints(
        capacity=capacity,
        num_ranks=num_ranks,
        topk=topk,
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        block_m=block_m,
        compute_sms=compute_sms,
        l1_waves=l1_waves,
    )
    geometry = TASK_GEOMETRY[arch]
    problems = []
    if block_m not in BLOCK_M_CANDIDATES[arch]:
        problems.append(f"block_m: got {block_m}; allowed on {arch}: {BLOCK_M_CANDIDATES[arch]}")
    if compute_sms % geometry["cluster_ctas"] != 0:
        problems.append(
            f"compute_sms: got {compute_sms}; allowed on {arch}: a multiple of the cluster size "
            f"{geometry['cluster_ctas']}"
        )
    if num_experts % num_ranks != 0:
        problems.append(f"E mod P = 0: got E={num_experts}, P={num_ranks}; allowed: E a multiple of P")
    if problems:
        raise GcMoeConstraintError(problems)

    local_experts = num_experts // num_ranks
    assignments = capacity * num_ranks * min(topk, local_experts)
    pool_blocks = math.ceil(assignments / block_m) + local_experts
    clusters = compute_sms // geometry["cluster_ctas"]
    l1_tasks = math.ceil(2 * intermediate / geometry["rows_per_task"])
    l2_tasks = math.ceil(hidden / geometry["rows_per_task"])
    live_blocks = math.ceil(l1_waves * clusters / l1_tasks) + math.ceil(clusters / l2_tasks)
    return RingPlan(
        block_m=block_m,
        assignments=assignments,
        pool_blocks=pool_blocks,
        cluster_count=clusters,
        l1_tasks_per_block=l1_tasks,
        l2_tasks_per_block=l2_tasks,
        l1_waves=l1_waves,
        live_blocks=live_blocks,
        ring_blocks=min(pool_blocks, live_blocks),
    )


# ----------------------------------------------------------------------------------------------- constraints
def _as_recipe(recipe) -> tuple | None:
    try:
        return tuple(int(r) for r in recipe)
    except (TypeError, ValueError):
        return None


def check_constraints(
    *,
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_ranks: int,
    topk: int,
    num_shared_experts: int = 0,
    recipe=(1, 1, 32),
    shared_recipe=None,
    activation: str = "swiglu",
    block_m: int | None = None,
    capacity: int | None = None,
    num_tokens: int | None = None,
    arch: str = "sm103",
) -> None:
    """Check every constraint of Appendix A (Table 12) up front; raise one GcMoeConstraintError listing all
    that fail. Table 12 describes the SM103 path; the SM90 path shares it except for its BM set.

    Not checkable here (enforced where the resources are created): one process per GPU with peer access
    (symmetric-memory rendezvous) and serialized calls per workspace.
    """
    _check_arch(arch)
    _check_positive_ints(
        hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_ranks=num_ranks, topk=topk
    )
    v: list[str] = []
    if intermediate > MAX_INTERMEDIATE or intermediate % INTERMEDIATE_MULTIPLE != 0:
        v.append(
            f"I <= {MAX_INTERMEDIATE} and I mod {INTERMEDIATE_MULTIPLE} = 0: got intermediate={intermediate}; "
            f"allowed: a multiple of {INTERMEDIATE_MULTIPLE} up to {MAX_INTERMEDIATE} "
            f"(2I/128 W1 tiles must fit the 64-bit W1-completion word)"
        )
    if hidden % HIDDEN_MULTIPLE != 0:
        v.append(
            f"H mod {HIDDEN_MULTIPLE} = 0: got hidden={hidden}; allowed: a multiple of {HIDDEN_MULTIPLE} "
            f"(2-CTA clusters pair N128 tiles)"
        )
    if not isinstance(num_shared_experts, int) or not 0 <= num_shared_experts <= MAX_SHARED_EXPERTS:
        v.append(
            f"num_shared_experts: got {num_shared_experts!r}; allowed: 0 or {MAX_SHARED_EXPERTS} (several shared "
            f"experts are one expert with their intermediates concatenated)"
        )
    shared_slot = 1 if num_shared_experts else 0
    if topk + shared_slot > MAX_COMBINE_SLOTS:
        v.append(
            f"k + 1[shared] <= {MAX_COMBINE_SLOTS}: got topk={topk} with {num_shared_experts} shared expert(s) "
            f"({topk + shared_slot} combine slots); allowed: at most {MAX_COMBINE_SLOTS - shared_slot} routed "
            f"experts per token here (one warp lane per combine slot)"
        )
    if num_experts > MAX_EXPERTS:
        v.append(f"E <= {MAX_EXPERTS} global: got num_experts={num_experts}; allowed: at most {MAX_EXPERTS}")
    if num_ranks > MAX_RANKS:
        v.append(f"P <= {MAX_RANKS} ranks: got num_ranks={num_ranks}; allowed: at most {MAX_RANKS}")
    if num_experts % num_ranks != 0:
        v.append(
            f"E mod P = 0: got num_experts={num_experts}, num_ranks={num_ranks}; allowed: num_experts a "
            f"multiple of num_ranks"
        )
    elif num_experts // num_ranks > MAX_EXPERTS_PER_RANK:
        v.append(
            f"E/P <= {MAX_EXPERTS_PER_RANK} per rank: got {num_experts // num_ranks} experts per rank; allowed: "
            f"at most {MAX_EXPERTS_PER_RANK}"
        )
    if _as_recipe(recipe) not in ROUTED_RECIPES:
        v.append(f"routed recipe: got {recipe!r}; allowed: {ROUTED_RECIPES[0]} (K32 UE8M0 scale path)")
    if num_shared_experts and shared_recipe is not None and _as_recipe(shared_recipe) not in SHARED_RECIPES:
        v.append(f"shared recipe: got {shared_recipe!r}; allowed: one of {SHARED_RECIPES}")
    if activation not in ACTIVATIONS:
        v.append(f"activation: got {activation!r}; allowed: {ACTIVATIONS} (fused in the W1 epilogue)")
    if block_m is not None and block_m not in BLOCK_M_CANDIDATES[arch]:
        v.append(f"BM: got block_m={block_m!r}; allowed on {arch}: {BLOCK_M_CANDIDATES[arch]}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
        v.append(f"capacity: got {capacity!r}; allowed: a positive number of tokens per rank")
    if num_tokens is not None:
        if not isinstance(num_tokens, int) or num_tokens < 0:
            v.append(f"num_tokens: got {num_tokens!r}; allowed: a non-negative integer")
        elif isinstance(capacity, int) and num_tokens > capacity:
            v.append(
                f"num_tokens <= capacity: got num_tokens={num_tokens}; allowed: at most capacity={capacity}"
            )
    if v:
        raise GcMoeConstraintError(v)
