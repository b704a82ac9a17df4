"""Routing generators, random inputs and weights, and the 47-case accuracy suite (Section 6.5).

Everything here is seeded and reproducible: random numbers are drawn on the CPU from a `torch.Generator`
seeded through `derive_seed`, so a case gives the same tensors on any machine and device (quantization then
runs on the requested device). Rationale for each case: docs/accuracy.md.

Routing (`make_routing`) returns `topk_idx` int64 [T, k] with global expert ids (-1 = no expert) and
`topk_weights` float32 [T, k]: a softmax over random logits of a token's valid slots, so the weights are
positive and sum to 1 over them; -1 slots weigh 0. Expert e lives on rank e // (E / P).

Value scales: hidden states are N(0, scale^2) (scale 1 is the RMS of a normalized residual stream); expert
weights are N(0, 1/fan_in) (std 1/sqrt(H) for W1, 1/sqrt(I) for W2), so gate and up pre-activations and the
expert outputs keep unit variance: SwiGLU works in its curved range with the clamp at 10 inactive except in
the tails (cases that need the clamp raise the activation scale), and y stays O(1), far from BF16 and FP8
overflow and underflow, so the error measured is the FP8/FP4 quantization error, not a range artefact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from gc_moe.formats import quantize_fp8_ue8m0, quantize_moe_weights, quantize_shared_expert_weights

MAX_COMBINE_SLOTS = 32  # Appendix A: k + 1[shared] <= 32 (one warp lane per combine slot)
# The shared expert's output is drawn at twice a routed expert's: a top-1 token's output would otherwise be
# half FP4-routed, whose quantization error alone puts its cosine to the unquantized forward near 0.988,
# under the paper's 0.99 for the shared suite (measurements: docs/accuracy.md).
SHARED_EXPERT_OUTPUT_SCALE = 2.0

# ----------------------------------------------------------------------------------------------- seeds


def derive_seed(seed: int, *labels: object) -> int:
    """A stable 63-bit seed from a base seed and labels (same value on every platform and Python run)."""
    text = ":".join(str(v) for v in (seed, *labels))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _generator(seed: int, *labels: object) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, *labels))


# ----------------------------------------------------------------------------------------------- routing
ROUTING_KINDS = ("uniform", "balanced", "skewed", "concentrated", "fixed_expert")

# Keyword parameters every kind accepts, with their defaults.
_COMMON_PARAMS = {
    "exclude_ranks": (),  # destination ranks whose experts no token may pick (negative = from the end)
    "exclude_own_rank": False,  # no token picks an expert of its own (source) rank: all traffic remote
    "only_own_rank": False,  # tokens pick only experts of their own rank (at most e of them; the rest is -1)
    "valid_slots": None,  # (lo, hi): each token keeps a uniform number of valid slots in [lo, hi]; rest -1
    "invalid_placement": "random",  # where the -1 slots go: "random" positions or the "tail" of the row
    "weight_temperature": 1.0,  # softmax temperature of the routing weights (small = one dominant slot)
}
_KIND_PARAMS = {
    "uniform": {},
    "balanced": {},
    "skewed": {"num_hot": 4, "hot_mass": 0.9, "hot_experts": None},
    "concentrated": {"hot_ranks": (-1,)},
    "fixed_expert": {"expert": 0, "exclusive": False},
}


def _resolve_ranks(ranks: Sequence[int], num_ranks: int, what: str) -> tuple[int, ...]:
    out = []
    for r in ranks:
        if not isinstance(r, int) or not -num_ranks <= r < num_ranks:
            raise ValueError(f"{what}: rank {r!r} is out of range; allowed: -{num_ranks}..{num_ranks - 1}")
        out.append(r % num_ranks)
    return tuple(sorted(set(out)))


def _experts_of_ranks(ranks: Sequence[int], local_experts: int) -> torch.Tensor:
    if not ranks:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(r * local_experts, (r + 1) * local_experts) for r in ranks])


def _pick_without_repeats(
    pool: torch.Tensor, num_tokens: int, count: int, g: torch.Generator
) -> torch.Tensor:
    """[num_tokens, count] experts, each row `count` distinct uniform picks from `pool`."""
    if count == 0:
        return torch.empty(num_tokens, 0, dtype=torch.int64)
    keys = torch.rand(num_tokens, pool.numel(), generator=g)
    return pool[keys.argsort(dim=1)[:, :count]]


def _shuffle_rows_slots(idx: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random permutation of each row's slots, so no slot position carries structure."""
    perm = torch.rand(idx.shape, generator=g).argsort(dim=1)
    return idx.gather(1, perm)


def routing_weights(topk_idx: torch.Tensor, *, seed: int, temperature: float = 1.0) -> torch.Tensor:
    """float32 [T, k]: softmax over N(0,1)/temperature logits of each row's valid slots; -1 slots get 0."""
    if temperature <= 0:
        raise ValueError(f"weight_temperature: got {temperature}; allowed: > 0")
    g = _generator(seed, "weights")
    logits = torch.randn(topk_idx.shape, generator=g, dtype=torch.float64) / temperature
    logits = logits.masked_fill(topk_idx < 0, -math.inf)
    w = torch.softmax(logits, dim=1).nan_to_num(nan=0.0)  # a row with no valid slot is all -inf -> NaN -> 0
    return w.float()


def make_routing(
    kind: str,
    num_tokens: int,
    num_experts: int,
    topk: int,
    *,
    num_ranks: int = 1,
    seed: int,
    source_rank: int = 0,
    **params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing for `num_tokens` tokens of rank `source_rank`.

    Returns (topk_idx int64 [T, k], topk_weights float32 [T, k]).

    kind (rows never repeat an expert; ranks and experts accept negative indices counted from the end):
      uniform       k distinct experts uniformly at random.
      balanced      every expert gets floor or ceil(T*k/n) of the assignments (n = experts allowed).
      skewed        weighted sampling without replacement: `num_hot` hot experts (or `hot_experts`) share
                    `hot_mass` of the probability, the rest share 1 - hot_mass.
      concentrated  every token puts min(k, experts of `hot_ranks`) slots on `hot_ranks`' experts, the rest
                    uniformly elsewhere: with T = capacity these ranks receive the ring's worst case
                    T*P*min(k, e).
      fixed_expert  every token picks `expert`; the other slots uniformly, or -1 with `exclusive=True`.
    Parameters every kind accepts: exclude_ranks, exclude_own_rank, only_own_rank, valid_slots,
    invalid_placement, weight_temperature (see _COMMON_PARAMS).
    """
    if kind not in ROUTING_KINDS:
        raise ValueError(f"routing kind {kind!r} is unknown; allowed: {', '.join(ROUTING_KINDS)}")
    allowed_params = {**_COMMON_PARAMS, **_KIND_PARAMS[kind]}
    unknown = sorted(set(params) - set(allowed_params))
    if unknown:
        raise ValueError(
            f"routing kind {kind!r} got unknown parameters {unknown}; allowed: {sorted(allowed_params)}"
        )
    p = {**allowed_params, **params}
    for name, value, lo in (
        ("num_tokens", num_tokens, 0),
        ("num_experts", num_experts, 1),
        ("topk", topk, 1),
        ("num_ranks", num_ranks, 1),
    ):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"make_routing: {name} got {value!r}; allowed: an integer >= {lo}")
    if num_experts % num_ranks:
        raise ValueError(
            f"make_routing: num_experts {num_experts} must be divisible by num_ranks {num_ranks}"
        )
    if topk > num_experts:
        raise ValueError(f"make_routing: topk {topk} exceeds num_experts {num_experts}")
    if not 0 <= source_rank < num_ranks:
        raise ValueError(f"make_routing: source_rank {source_rank} out of range; allowed: 0..{num_ranks - 1}")
    if p["exclude_own_rank"] and p["only_own_rank"]:
        raise ValueError("make_routing: exclude_own_rank and only_own_rank exclude each other")

    local = num_experts // num_ranks
    g = _generator(seed, "routing")
    t, k = num_tokens, topk

    # The destination experts a token may pick.
    if p["only_own_rank"]:
        allowed_ranks = {source_rank}
    else:
        allowed_ranks = set(range(num_ranks)) - set(
            _resolve_ranks(p["exclude_ranks"], num_ranks, "exclude_ranks")
        )
        if p["exclude_own_rank"]:
            allowed_ranks.discard(source_rank)
    allowed = _experts_of_ranks(sorted(allowed_ranks), local)
    n = allowed.numel()
    # Only `only_own_rank` may leave fewer than k experts (the rest of the row is -1): other kinds need k.
    need = min(k, local) if p["only_own_rank"] else k
    if n < need:
        raise ValueError(
            f"make_routing({kind!r}): only {n} experts are allowed (ranks {sorted(allowed_ranks)} of "
            f"{num_ranks}, {local} each) but topk is {k}; exclude fewer ranks or lower topk"
        )

    route = _ROUTERS[kind]
    idx = route(allowed, t, min(k, n), p, g, num_experts=num_experts, local=local, num_ranks=num_ranks)
    if idx.shape[1] < k:  # only_own_rank with fewer local experts than k
        idx = torch.cat([idx, torch.full((t, k - idx.shape[1]), -1, dtype=torch.int64)], 1)
    idx = _shuffle_rows_slots(idx, g)
    idx = _apply_valid_slots(idx, p["valid_slots"], p["invalid_placement"], g)
    return idx, routing_weights(idx, seed=derive_seed(seed, "routing"), temperature=p["weight_temperature"])


# Each router returns [T, count] distinct experts per row drawn from `allowed` (count = min(k, n)).
def _route_uniform(allowed, t, count, p, g, **_):
    return _pick_without_repeats(allowed, t, count, g)


def _route_balanced(allowed, t, count, p, g, **_):
    # Consecutive positions t*count + j (mod n) are distinct within a row since count <= n, and T*count
    # consecutive positions hit every residue floor or ceil(T*count/n) times; a random expert order and a
    # random start remove the structure, the row shuffle here and the slot shuffle after remove the rest.
    n = allowed.numel()
    order = allowed[torch.randperm(n, generator=g)]
    start = int(torch.randint(n, (1,), generator=g))
    pos = (torch.arange(t).unsqueeze(1) * count + torch.arange(count) + start) % n
    return order[pos][torch.randperm(t, generator=g)]


def _route_skewed(allowed, t, count, p, g, *, num_experts, **_):
    hot = _skewed_hot_experts(p, allowed, num_experts, g)
    if not 0.0 < p["hot_mass"] <= 1.0:
        raise ValueError(f"skewed: hot_mass got {p['hot_mass']}; allowed: (0, 1]")
    n, is_hot = allowed.numel(), torch.isin(allowed, hot)
    cold = n - hot.numel()
    probs = torch.zeros(n, dtype=torch.float64)
    if cold == 0 or p["hot_mass"] == 1.0:
        if hot.numel() < count:
            raise ValueError(f"skewed: all mass on {hot.numel()} hot experts cannot fill {count} slots")
        probs[is_hot] = 1.0 / hot.numel()
    else:
        probs[is_hot] = p["hot_mass"] / hot.numel()
        probs[~is_hot] = (1.0 - p["hot_mass"]) / cold
    if t == 0:
        return torch.empty(0, count, dtype=torch.int64)
    return allowed[torch.multinomial(probs.expand(t, n), count, replacement=False, generator=g)]


def _route_concentrated(allowed, t, count, p, g, *, local, num_ranks, **_):
    hot_ranks = _resolve_ranks(p["hot_ranks"], num_ranks, "hot_ranks")
    hot = allowed[torch.isin(allowed, _experts_of_ranks(hot_ranks, local))]
    if hot.numel() == 0:
        raise ValueError(f"concentrated: hot ranks {hot_ranks} have no allowed expert")
    rest = allowed[~torch.isin(allowed, hot)]
    m = min(count, hot.numel())
    if rest.numel() < count - m:
        raise ValueError(
            f"concentrated: {rest.numel()} experts outside the hot ranks cannot fill {count - m} slots"
        )
    return torch.cat([_pick_without_repeats(hot, t, m, g), _pick_without_repeats(rest, t, count - m, g)], 1)


def _route_fixed_expert(allowed, t, count, p, g, *, num_experts, **_):
    expert = p["expert"]
    if not isinstance(expert, int) or not -num_experts <= expert < num_experts:
        raise ValueError(
            f"fixed_expert: expert {expert!r} out of range; allowed: -{num_experts}..{num_experts - 1}"
        )
    expert %= num_experts
    if not bool((allowed == expert).any()):
        raise ValueError(f"fixed_expert: expert {expert} lives on an excluded rank")
    first = torch.full((t, 1), expert, dtype=torch.int64)
    if p["exclusive"]:
        return torch.cat([first, torch.full((t, count - 1), -1, dtype=torch.int64)], 1)
    return torch.cat([first, _pick_without_repeats(allowed[allowed != expert], t, count - 1, g)], 1)


_ROUTERS = {
    "uniform": _route_uniform,
    "balanced": _route_balanced,
    "skewed": _route_skewed,
    "concentrated": _route_concentrated,
    "fixed_expert": _route_fixed_expert,
}


def _skewed_hot_experts(p: dict, allowed: torch.Tensor, num_experts: int, g: torch.Generator) -> torch.Tensor:
    if p["hot_experts"] is not None:
        hot = torch.tensor([e % num_experts for e in p["hot_experts"]], dtype=torch.int64).unique()
        if not bool(torch.isin(hot, allowed).all()):
            raise ValueError(f"skewed: hot experts {hot.tolist()} include experts of excluded ranks")
        return hot
    num_hot = p["num_hot"]
    if not isinstance(num_hot, int) or not 1 <= num_hot <= allowed.numel():
        raise ValueError(f"skewed: num_hot got {num_hot!r}; allowed: 1..{allowed.numel()}")
    return allowed[torch.randperm(allowed.numel(), generator=g)[:num_hot]].sort().values


def _apply_valid_slots(idx: torch.Tensor, valid_slots, placement: str, g: torch.Generator) -> torch.Tensor:
    """Set slots to -1 so each token keeps a uniform random number of valid slots in [lo, hi]."""
    if placement not in ("random", "tail"):
        raise ValueError(f"invalid_placement got {placement!r}; allowed: 'random', 'tail'")
    t, k = idx.shape
    if valid_slots is None:
        if placement == "tail":  # move the -1 slots some kinds leave to the end of the row
            order = (idx < 0).to(torch.int64).argsort(dim=1, stable=True)
            idx = idx.gather(1, order)
        return idx
    lo, hi = valid_slots
    hi = k if hi is None else hi  # None: up to topk, so a case reads the same for every model's k
    if not 0 <= lo <= hi <= k:
        raise ValueError(f"valid_slots got {valid_slots}; allowed: 0 <= lo <= hi <= topk={k}")
    keep = torch.randint(lo, hi + 1, (t, 1), generator=g)
    if placement == "tail":
        pos = torch.arange(k).expand(t, k)
    else:
        pos = torch.rand(t, k, generator=g).argsort(dim=1).argsort(dim=1)  # a random rank of each slot
    idx = idx.masked_fill(pos >= keep, -1)
    if placement == "tail":
        order = (idx < 0).to(torch.int64).argsort(dim=1, stable=True)
        idx = idx.gather(1, order)
    return idx


# ----------------------------------------------------------------------------------------------- activations
ACTIVATION_PROFILES = ("normal", "block_scales", "zero_rows")


def random_hidden_states(
    num_tokens: int, hidden: int, *, seed: int, scale: float = 1.0, profile: str = "normal"
) -> torch.Tensor:
    """float32 [T, H] hidden states, N(0, scale^2), before quantization.

    profile: "normal"; "block_scales" multiplies each 32-value block by 2^u, u uniform in -4..4, so
    neighbouring UE8M0 scales differ by up to 8 binades; "zero_rows" zeroes a random quarter of the tokens
    (at least one, and never all when T >= 2), whose scales then sit at the UE8M0 floor.
    """
    if profile not in ACTIVATION_PROFILES:
        raise ValueError(
            f"activation profile {profile!r} is unknown; allowed: {', '.join(ACTIVATION_PROFILES)}"
        )
    if not scale > 0:
        raise ValueError(f"activation scale got {scale}; allowed: > 0")
    g = _generator(seed, "hidden_states")
    x = torch.randn(num_tokens, hidden, generator=g) * scale
    if profile == "block_scales":
        if hidden % 32:
            raise ValueError(f"block_scales: hidden {hidden} must be a multiple of 32")
        exps = torch.randint(-4, 5, (num_tokens, hidden // 32, 1), generator=g).float()
        x = (x.unflatten(1, (-1, 32)) * torch.exp2(exps)).flatten(1)
    elif profile == "zero_rows" and num_tokens:
        zero = torch.rand(num_tokens, generator=g) < 0.25
        zero[int(torch.randint(num_tokens, (1,), generator=g))] = True
        if num_tokens >= 2 and bool(zero.all()):
            zero[0] = False
        x[zero] = 0.0
    return x


def random_activations(
    num_tokens: int,
    hidden: int,
    *,
    seed: int,
    scale: float = 1.0,
    profile: str = "normal",
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized activations (x float8_e4m3fn [T, H], x_sf int32 [T, H/128]) of `random_hidden_states`."""
    h = random_hidden_states(num_tokens, hidden, seed=seed, scale=scale, profile=profile)
    return quantize_fp8_ue8m0(h.to(device) if device is not None else h)


# ----------------------------------------------------------------------------------------------- weights
def _expert_ids(num_experts: int, experts: Sequence[int] | None) -> list[int]:
    ids = list(range(num_experts)) if experts is None else [int(e) for e in experts]
    bad = [e for e in ids if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"experts {bad} out of range; allowed: 0..{num_experts - 1}")
    return ids


def random_expert_weights_float(
    expert: int, hidden: int, intermediate: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's float32 weights (w1 [2I, H] rows [gate; up], w2 [H, I]), N(0, 1/fan_in), own seed."""
    g = _generator(seed, "expert", expert)
    w1 = torch.randn(2 * intermediate, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(hidden, intermediate, generator=g) / math.sqrt(intermediate)
    return w1, w2


def random_moe_weights_float(
    num_experts: int, hidden: int, intermediate: int, *, seed: int, experts: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w1 [e, 2I, H], w2 [e, H, I]) for `experts` (default all); expert j is the same in any
    subset."""
    ids = _expert_ids(num_experts, experts)
    parts = [random_expert_weights_float(e, hidden, intermediate, seed=seed) for e in ids]
    if not parts:
        return torch.empty(0, 2 * intermediate, hidden), torch.empty(0, hidden, intermediate)
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def random_moe_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    seed: int,
    experts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Quantized (l1_weights, l2_weights) in DeepGEMM's FP4 layout for `experts` (default all; a rank passes
    `local_experts(...)`). Expert by expert, so host memory holds one expert in float32 at a time."""
    l1_q, l1_sf, l2_q, l2_sf = [], [], [], []
    for e in _expert_ids(num_experts, experts):
        w1, w2 = random_expert_weights_float(e, hidden, intermediate, seed=seed)
        if device is not None:
            w1, w2 = w1.to(device), w2.to(device)
        (a, b), (c, d) = quantize_moe_weights(w1.unsqueeze(0), w2.unsqueeze(0))
        l1_q.append(a), l1_sf.append(b), l2_q.append(c), l2_sf.append(d)
    if not l1_q:
        return quantize_moe_weights(
            torch.empty(0, 2 * intermediate, hidden, device=device),
            torch.empty(0, hidden, intermediate, device=device),
        )
    return (torch.cat(l1_q), torch.cat(l1_sf)), (torch.cat(l2_q), torch.cat(l2_sf))


def random_shared_expert_weights_float(
    hidden: int, intermediate: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 shared-expert weights (w1 [2Is, H], w2 [H, Is]): W1 as the routed experts, W2 at
    SHARED_EXPERT_OUTPUT_SCALE times their scale."""
    g = _generator(seed, "shared_expert")
    w1 = torch.randn(2 * intermediate, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(hidden, intermediate, generator=g) * (
        SHARED_EXPERT_OUTPUT_SCALE / math.sqrt(intermediate)
    )
    return w1, w2


def random_shared_expert_weights(
    hidden: int,
    intermediate: int,
    *,
    seed: int,
    recipe: tuple[int, int, int] = (1, 1, 32),
    device: torch.device | str | None = None,
):
    """FP8 `SharedExpertWeights` of `random_shared_expert_weights_float` in the given recipe."""
    w1, w2 = random_shared_expert_weights_float(hidden, intermediate, seed=seed)
    if device is not None:
        w1, w2 = w1.to(device), w2.to(device)
    return quantize_shared_expert_weights(w1, w2, recipe)


def local_experts(num_experts: int, num_ranks: int, rank: int) -> range:
    """The global expert ids rank `rank` owns (E/P consecutive ids)."""
    if num_experts % num_ranks or not 0 <= rank < num_ranks:
        raise ValueError(
            f"local_experts: need num_experts % num_ranks == 0 and 0 <= rank < num_ranks, got "
            f"E={num_experts}, P={num_ranks}, rank={rank}"
        )
    e = num_experts // num_ranks
    return range(rank * e, (rank + 1) * e)


# ----------------------------------------------------------------------------------------------- the suite
CAPACITY = "capacity"  # a token count that resolves to the model's per-rank capacity
SUITE_WEIGHT_SEED = 20261102  # one weight set per model serves every case of the suite
TokenCount = int | Literal["capacity"]
Category = Literal["default", "boundary", "asymmetric"]


@dataclass(frozen=True)
class ModelShape:
    """The shape facts a case needs (a row of models.csv); any object with these attributes works too."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    capacity: int = 256
    num_shared_experts: int = 1


@dataclass(frozen=True)
class AccuracyCase:
    """One named case of the accuracy suite; `instantiate` it with `build_case_inputs`.

    tokens: per-rank token count (int or CAPACITY) for every rank, or a tuple: rank r sends tokens[r % len].
    routing / routing_params: `make_routing` kind and parameters (rank sets count from the end when negative;
    at small P, rank ids >= P are dropped and a restriction that would cover every rank is void).
    topk: None = the model's k; an int; or "max" = the largest k the combine allows (32 - shared, at most E).
    shared: "off", "on" or "both" (the case runs with and without the shared expert).
    """

    name: str
    category: Category
    tokens: TokenCount | tuple[TokenCount, ...]
    seed: int
    rationale: str
    routing: str = "uniform"
    routing_params: Mapping[str, object] = field(default_factory=dict, hash=False)
    topk: int | Literal["max"] | None = None
    activation_scale: float = 1.0
    activation_profile: str = "normal"
    shared: Literal["off", "on", "both"] = "both"

    @property
    def asymmetric_tokens(self) -> bool:
        return isinstance(self.tokens, tuple)

    def shared_modes(self) -> tuple[bool, ...]:
        return {"off": (False,), "on": (True,), "both": (False, True)}[self.shared]

    def tokens_per_rank(self, num_ranks: int, capacity: int) -> tuple[int, ...]:
        pattern = self.tokens if isinstance(self.tokens, tuple) else (self.tokens,)
        counts = tuple(
            capacity if c == CAPACITY else c for c in (pattern[r % len(pattern)] for r in range(num_ranks))
        )
        bad = [c for c in counts if not isinstance(c, int) or not 0 <= c <= capacity]
        if bad:
            raise ValueError(f"case {self.name}: token counts {bad} are outside 0..capacity={capacity}")
        return counts

    def topk_for(self, model_shape, shared: bool) -> int:
        if self.topk is None:
            k = model_shape.topk
        elif self.topk == "max":
            k = min(MAX_COMBINE_SLOTS - int(shared), model_shape.num_experts)
        else:
            k = self.topk
        if not 1 <= k <= model_shape.num_experts or k + int(shared) > MAX_COMBINE_SLOTS:
            raise ValueError(
                f"case {self.name}: topk {k} (shared={shared}) is outside 1..min(E, 32 - shared)"
            )
        return k

    def routing_params_for(self, num_ranks: int) -> dict:
        """Routing parameters with rank sets resolved for P ranks."""
        params = dict(self.routing_params)
        for key in ("exclude_ranks", "hot_ranks"):
            if key in params:
                kept = sorted({r % num_ranks for r in params[key] if -num_ranks <= r < num_ranks})
                if key == "exclude_ranks" and len(kept) == num_ranks:
                    kept = []  # excluding every rank would leave nothing to route to: void at this P
                if key == "hot_ranks" and not kept:
                    kept = [num_ranks - 1]
                params[key] = tuple(kept)
        if num_ranks == 1 and params.get("exclude_own_rank"):
            params["exclude_own_rank"] = False  # no remote rank exists at P = 1
        return params


@dataclass
class CaseInputs:
    """What one rank feeds the operator for one case (CPU tensors unless a device was given)."""

    case: AccuracyCase
    num_ranks: int
    rank: int
    shared: bool
    topk: int
    hidden_states: torch.Tensor  # float32 [T, H] before quantization (for the unquantized BF16 forward)
    x: torch.Tensor  # float8_e4m3fn [T, H]
    x_sf: torch.Tensor  # int32 [T, H/128]
    topk_idx: torch.Tensor  # int64 [T, k]
    topk_weights: torch.Tensor  # float32 [T, k]

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


def build_case_inputs(
    case: AccuracyCase,
    model_shape,
    num_ranks: int,
    rank: int,
    *,
    shared: bool,
    device: torch.device | str | None = None,
) -> CaseInputs:
    """The inputs rank `rank` of `num_ranks` feeds for `case` on `model_shape` (no GEMM runs here).

    Each rank draws its own tokens and routing from seeds derived from (case.seed, rank), so a rank builds
    only its share, and the union over ranks is the same whichever process builds it. Weights are not per
    case: every rank takes
    `random_moe_weights(..., seed=SUITE_WEIGHT_SEED, experts=local_experts(E, P, rank))`.
    """
    if shared not in case.shared_modes():
        raise ValueError(f"case {case.name} runs with shared in {case.shared_modes()}, got shared={shared}")
    if not isinstance(num_ranks, int) or num_ranks < 1 or not 0 <= rank < num_ranks:
        raise ValueError(
            f"build_case_inputs: need num_ranks >= 1 and 0 <= rank < num_ranks, got {num_ranks}, {rank}"
        )
    if model_shape.num_experts % num_ranks:
        raise ValueError(
            f"build_case_inputs: {model_shape.num_experts} experts do not split over {num_ranks} ranks"
        )
    num_tokens = case.tokens_per_rank(num_ranks, model_shape.capacity)[rank]
    topk = case.topk_for(model_shape, shared)
    topk_idx, topk_weights = make_routing(
        case.routing,
        num_tokens,
        model_shape.num_experts,
        topk,
        num_ranks=num_ranks,
        source_rank=rank,
        seed=derive_seed(case.seed, "rank", rank),
        **case.routing_params_for(num_ranks),
    )
    hidden_states = random_hidden_states(
        num_tokens,
        model_shape.hidden,
        seed=derive_seed(case.seed, "rank", rank),
        scale=case.activation_scale,
        profile=case.activation_profile,
    )
    if device is not None:
        hidden_states, topk_idx, topk_weights = (
            t.to(device) for t in (hidden_states, topk_idx, topk_weights)
        )
    x, x_sf = quantize_fp8_ue8m0(hidden_states)
    return CaseInputs(case, num_ranks, rank, shared, topk, hidden_states, x, x_sf, topk_idx, topk_weights)


def _c(name, category, tokens, seed, rationale, **kw) -> AccuracyCase:
    return AccuracyCase(name=name, category=category, tokens=tokens, seed=seed, rationale=rationale, **kw)


_CAP = CAPACITY
_DEFAULT = tuple(
    _c(f"default_t{t}", "default", t, 100 + i, f"the sweep point T={t}: uniform top-k routing")
    for i, t in enumerate((1, 2, 4, 8, 16, 32, 64, 128, 256))
)
_BOUNDARY = (
    _c("boundary_t1_k1", "boundary", 1, 201, "the least work: one token, one expert", topk=1),
    _c("boundary_cap_k1", "boundary", _CAP, 202, "top-1 routing at capacity", topk=1),
    _c(
        "boundary_cap_kmax",
        "boundary",
        _CAP,
        203,
        "the most combine slots (k + shared = 32) at capacity",
        topk="max",
    ),
    _c("boundary_t3", "boundary", 3, 204, "a small non-power-of-two count"),
    _c("boundary_t17", "boundary", 17, 205, "one token past a 16-token block"),
    _c("boundary_t97", "boundary", 97, 206, "one token past a 96-token block"),
    _c("boundary_t129", "boundary", 129, 207, "one token past a 128-token block"),
    _c("boundary_t255", "boundary", 255, 208, "capacity - 1"),
    _c(
        "boundary_invalid_tail",
        "boundary",
        64,
        209,
        "-1 in trailing slots, 1..k valid per token",
        routing_params={"valid_slots": (1, None), "invalid_placement": "tail"},
    ),
    _c(
        "boundary_invalid_random",
        "boundary",
        _CAP,
        210,
        "-1 anywhere, 0..k valid: tokens with no expert",
        routing_params={"valid_slots": (0, None)},
    ),
    _c(
        "boundary_one_valid_slot",
        "boundary",
        128,
        211,
        "exactly one valid slot per token",
        routing_params={"valid_slots": (1, 1)},
    ),
    _c(
        "boundary_all_invalid",
        "boundary",
        16,
        212,
        "every slot -1: zero routed output",
        routing_params={"valid_slots": (0, 0)},
    ),
    _c(
        "boundary_one_expert_only",
        "boundary",
        _CAP,
        213,
        "all tokens to one expert, nothing else",
        routing="fixed_expert",
        routing_params={"expert": 0, "exclusive": True},
    ),
    _c(
        "boundary_last_expert",
        "boundary",
        _CAP,
        214,
        "every token picks the last expert id",
        routing="fixed_expert",
        routing_params={"expert": -1},
    ),
    _c(
        "boundary_hot_experts",
        "boundary",
        _CAP,
        215,
        "4 hot experts carry 90% of the routing mass",
        routing="skewed",
        routing_params={"num_hot": 4, "hot_mass": 0.9},
    ),
    _c(
        "boundary_one_rank_at_capacity",
        "boundary",
        _CAP,
        216,
        "every slot it can on one rank: the ring's worst case",
        routing="concentrated",
        routing_params={"hot_ranks": (-1,)},
    ),
    _c(
        "boundary_balanced_cap",
        "boundary",
        _CAP,
        217,
        "every expert equally loaded at capacity",
        routing="balanced",
    ),
    _c(
        "boundary_local_only",
        "boundary",
        64,
        218,
        "tokens stay on their rank: no remote traffic",
        routing_params={"only_own_rank": True},
    ),
    _c(
        "boundary_remote_only",
        "boundary",
        64,
        219,
        "no token stays on its rank: all traffic remote",
        routing_params={"exclude_own_rank": True},
    ),
    _c(
        "boundary_large_activations",
        "boundary",
        64,
        220,
        "activations x8: the SwiGLU clamp is active",
        activation_scale=8.0,
    ),
    _c(
        "boundary_small_activations",
        "boundary",
        64,
        221,
        "activations x2^-12: small UE8M0 exponents",
        activation_scale=2.0**-12,
    ),
    _c(
        "boundary_block_scales",
        "boundary",
        64,
        222,
        "per-32 blocks spread over 8 binades",
        activation_profile="block_scales",
    ),
    _c(
        "boundary_zero_rows",
        "boundary",
        64,
        223,
        "some tokens' hidden states are all zero",
        activation_profile="zero_rows",
    ),
)
_ASYMMETRIC = (
    _c(
        "asym_ramp",
        "asymmetric",
        (1, 37, 73, 109, 145, 181, 217, 253),
        301,
        "token counts rising across ranks",
    ),
    _c("asym_one_busy", "asymmetric", (_CAP, 1, 1, 1, 1, 1, 1, 1), 302, "one rank at capacity, the others 1"),
    _c(
        "asym_one_light",
        "asymmetric",
        (1, _CAP, _CAP, _CAP, _CAP, _CAP, _CAP, _CAP),
        303,
        "one rank with 1 token, the others full",
    ),
    _c("asym_mixed_counts", "asymmetric", (5, 200, 17, _CAP, 2, 99, 64, 131), 304, "irregular counts"),
    _c("asym_idle_odd_ranks", "asymmetric", (48, 0), 305, "odd ranks send nothing but still receive"),
    _c("asym_single_source", "asymmetric", (_CAP, 0, 0, 0, 0, 0, 0, 0), 306, "only rank 0 sends"),
    _c("asym_single_token", "asymmetric", (0, 0, 0, 0, 0, 0, 0, 1), 307, "one token in the whole group"),
    _c(
        "asym_empty_last_rank",
        "asymmetric",
        64,
        308,
        "no token routes to the last rank",
        routing_params={"exclude_ranks": (-1,)},
    ),
    _c(
        "asym_empty_odd_ranks",
        "asymmetric",
        _CAP,
        309,
        "no token routes to odd ranks",
        routing_params={"exclude_ranks": (1, 3, 5, 7)},
    ),
    _c(
        "asym_empty_all_but_first",
        "asymmetric",
        (_CAP, 1, 64, 0, 17, _CAP, 3, 128),
        310,
        "every token routes to rank 0's experts; the other ranks are empty",
        routing_params={"exclude_ranks": (1, 2, 3, 4, 5, 6, 7)},
    ),
    _c(
        "asym_idle_and_empty",
        "asymmetric",
        (64, 0),
        311,
        "odd ranks neither send nor receive",
        routing_params={"exclude_ranks": (1, 3, 5, 7)},
    ),
    _c(
        "asym_capacity_to_idle_rank",
        "asymmetric",
        (_CAP, _CAP, 0, 0, _CAP, _CAP, 0, 0),
        312,
        "full ranks route all they can to an idle rank",
        routing="concentrated",
        routing_params={"hot_ranks": (-1,)},
    ),
    _c(
        "asym_local_ramp",
        "asymmetric",
        (1, 37, 73, 109, 145, 181, 217, 253),
        313,
        "uneven counts with local-only routing",
        routing_params={"only_own_rank": True},
    ),
    _c(
        "asym_invalid_mixed",
        "asymmetric",
        (5, 200, 17, _CAP, 2, 99, 64, 131),
        314,
        "irregular counts and -1 slots",
        routing_params={"valid_slots": (0, None)},
    ),
    _c(
        "asym_hot_mixed",
        "asymmetric",
        (_CAP, 3, 128, 0, 77, _CAP, 1, 32),
        315,
        "irregular counts and hot experts",
        routing="skewed",
        routing_params={"num_hot": 2, "hot_mass": 0.8},
    ),
)
ACCURACY_SUITE: tuple[AccuracyCase, ...] = _DEFAULT + _BOUNDARY + _ASYMMETRIC
CASES_BY_NAME: dict[str, AccuracyCase] = {c.name: c for c in ACCURACY_SUITE}
