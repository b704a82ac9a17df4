"""The SM90 GC-MoE layer: roles 1-3 as one child CUDA graph on the two green contexts, replayed with no host work.

`Sm90Layer` owns what one layer needs on one rank:

- the green-context partition (`runtime.partition.get_partitions`): dispatch runs in the communication context,
  the grouped GEMM and finalize in the compute context;
- the workspace of `layer_layout` (one plain device allocation at P = 1, one torch symmetric-memory allocation
  rendezvoused over the group at P > 1), its signals zeroed once (`layer_layout.initialize_state`);
- the kernels: dispatch (role1), role2 at the token tile the token-bound heuristic picks for the call's token
  count (`plan_call`), finalize (role3), role4 when the layer has a shared expert. Role2 is one persistent
  kernel (`role2`: W1 and W2 units of the ring-consumer grouped GEMM, W2 driven by the W1-completion bitmap) at
  every token count (`role2_nodes` "auto"): at token tile 8 wherever the plan's tile is at most 16, two CTAs per
  SM from 2 tokens per rank, else the plan's tile (32) at one CTA per SM; beside the shared expert (role4 in the
  same partition) W1 -> W2 as two nodes from 2 tokens, where the persistent kernel would keep role4 waiting;
- one child graph per (token count, output, weights): dispatch (communication context) and role2 (compute
  context) as concurrent roots, finalize after both: three nodes with the fused role2, four with W1 and W2; the
  shared expert adds W1 -> W2 (or one node with `role4_fused`), before role2 at 1 token per rank (role2 waits on
  it while dispatch fills the ring) and beside it above (`role4_order`). Every replay leaves the state ready for the next
  (role3 resets the ring signals and the W1-completion words and flips the parity), so a graph replays, eagerly
  or inside an outer torch CUDA graph capture, without host work in between.
- the overlap switch (`overlap_roots`, default GC_MOE_OVERLAP_ROOTS, "1"): off, role2 (W1) depends on dispatch,
  so the two roots run one after the other (the ablation of the overlap; the ring holds the whole pool, so
  dispatch finishes without W1 consuming anything).
- the role2 switch (`role2_nodes`, default GC_MOE_ROLE2_NODES, "auto"): "auto" as above; 1, the fused role2
  kernel at every token count (three nodes, five with role4's W1 -> W2); 2, W1 and W2 as two nodes at every
  token count (four nodes).
- the fused role2 kernel's token tile (GC_MOE_ROLE2_BLOCK_N, "auto"): as above, or a fixed 8 / 16 / 32 (an
  experiment knob: bn 32 at every token count measured slower where the call's tile is smaller), and its CTAs per
  SM at tile 8 (GC_MOE_ROLE2_CTAS_PER_SM, "2"; "1": one).
- the role4 switch (`role4_fused`, default GC_MOE_ROLE4_FUSED, "0"): the shared expert as one fused node ("1")
  instead of W1 -> W2 (1.5-2 us slower alone on the H200, so off by default), and where it runs
  (`role4_order`, GC_MOE_ROLE4_ORDER: "auto", "beside", "before", "after"); its kernels' pipeline and CTAs per SM
  (GC_MOE_SHARED_PIPELINE, GC_MOE_SHARED_CTAS_PER_SM: `SharedExpert`).

Waits are bounded (`timeout_s`, default 3600 s, the operator's): a wait that passes it traps on the device.
Supported shapes: `unsupported_reasons` lists what a configuration breaks, with what is allowed. Host-only
helpers (`plan_call`, `unsupported_reasons`, `kernel_variants`, `missing_kernels`) import without the DSL and
without a GPU.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

from gc_moe.kernels.sm90 import dispatch, finalize, role2
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.kernels.sm90 import layer_layout as ll
from gc_moe.planning import choose_block_m

ARCH = "sm_90a"
DEFAULT_TIMEOUT_S = 3600.0
TIMEOUT_ENV = "GC_MOE_WAIT_TIMEOUT_S"  # the backend's bounded waits, seconds
OVERLAP_ENV = "GC_MOE_OVERLAP_ROOTS"  # "1" (default): dispatch and W1 run concurrently; "0": W1 after dispatch
ROLE2_CTAS_ENV = "GC_MOE_ROLE2_CTAS_PER_SM"  # "2" (default) or "1": the fused role2 kernel's CTAs per SM at bn 8
ROLE2_ENV = "GC_MOE_ROLE2_NODES"  # "auto" (default), "1": role2 as one fused kernel, "2": W1 and W2 as two nodes
ROLE2_NODE_CHOICES = ("auto", 1, 2)
# the fused role2 kernel's token tile: "auto" (default: the call's tile, at most 32) or a fixed 8 / 16 / 32
ROLE2_BLOCK_N_ENV = "GC_MOE_ROLE2_BLOCK_N"
# "auto" (default): the token ring covers the pool of one replay; a number: at most that many ring blocks of
# RING_BLOCK_M rows, reused within a replay (role1 waits for W1's releases; role2 runs as the fused kernel)
RING_BLOCKS_ENV = "GC_MOE_RING_BLOCKS"
ROLE4_ENV = "GC_MOE_ROLE4_FUSED"  # "0" (default): the shared expert as W1 -> W2 nodes; "1": as one fused kernel
# where role4 runs against role2 in the compute partition: "auto" (the default: before up to
# ROLE4_BEFORE_MAX_TOKENS tokens per rank, beside above), "beside" (concurrent roots), "before" (role2 waits on
# role4: the shared expert runs while dispatch fills the ring) or "after" (role4 waits on role2)
ROLE4_ORDER_ENV = "GC_MOE_ROLE4_ORDER"
ROLE4_ORDERS = ("auto", "beside", "before", "after")
# Measured on the H200 with role4 on the warp-specialized pipeline (docs/sm90-layer.md): before role2 at 1 token
# per rank -2.8% (GLM-5.2) / -9.4% (DeepSeek) against beside; at 2 tokens +7-8%, at 4-16 tokens -7..+3%
ROLE4_BEFORE_MAX_TOKENS = 1
# the shared expert's pipeline: "auto" (default: shared_expert.AUTO_PIPELINE, the warp-specialized one at every
# token count), "cp.async" or "ws"
SHARED_PIPELINE_ENV = "GC_MOE_SHARED_PIPELINE"
# the shared expert's CTAs per SM at token tile 8 on the warp-specialized pipeline: "auto" (default), "1" or "2"
SHARED_CTAS_ENV = "GC_MOE_SHARED_CTAS_PER_SM"
PACKED_CACHE_SIZE = 8  # weight sets whose packed copy the shared expert keeps
# "auto": the fused role2 kernel at every token count. Measured on the H200 (docs/sm90-layer.md): with two CTAs
# per SM at token tile 8 from 2 tokens it is within -17..+5% of W1 and W2 as two nodes at every point of both
# models (one CTA per SM was 20-40% slower at 2-32 tokens); at a planned tile of 16 its one-CTA bn 16 variant
# (96 registers) was 13-17% slower than the two nodes, bn 8 at two CTAs per SM within 1%. So plan tiles up to
# this one run the fused kernel at 8
ROLE2_FUSED_TILE8_UP_TO = 16
# ... except beside the shared expert (role4's W1 -> W2 nodes in the same partition) from 2 tokens per rank: the
# persistent fused kernel holds every compute SM until its last unit, so role4's CTAs wait for it instead of
# running between W1 / W2 CTAs; measured 5-15% slower there (sweep 20261203T165408Z against 20261203T160713Z),
# so "auto" keeps W1 -> W2 as two nodes for those calls
ROLE2_FUSED_MAX_TOKENS_WITH_SHARED = 1
# Ring block rows: the smallest token tile, so the first ring block is full after as few pulled rows as possible
# (W1 of any token tile acquires every block its rows touch, so the GEMM's tile need not equal it).
RING_BLOCK_M = 8
# The ring-consumer W1 cubins are built with the SwiGLU of both models (alpha 1, clamp 10).
SWIGLU_ALPHA, SWIGLU_CLAMP = 1.0, 10.0
FINALIZE_MAX_CTAS = 64
LAYER_MAX_BLOCK_N = gg.WS_MAX_BLOCK_N  # the layer's token tiles: 8 / 16 / 32, all warp-specialized
LAYER_BLOCK_N_CHOICES = tuple(bn for bn in gg.BLOCK_N_CHOICES if bn <= LAYER_MAX_BLOCK_N)
GRAPH_CACHE_SIZE = 64
TIMING_NODES = ("dispatch", "role2", "role4", "finalize")  # what Sm90Layer.timing_nodes may keep
SHARED_EXPERT_MODULE = "gc_moe.kernels.sm90.shared_expert"
UNCHECKED = object()  # an option unsupported_reasons was not asked about


# ------------------------------------------------------------------------------------------------ host planning
def unsupported_reasons(*, num_experts: int, num_ranks: int, topk: int, hidden: int, intermediate: int,
                        capacity: int, num_shared_experts: int = 0, activation_alpha=UNCHECKED,
                        activation_clamp=UNCHECKED) -> list[str]:
    """Why the SM90 layer cannot run this configuration (empty when it can): one line per broken rule, with the
    value given and what is allowed. The activation is checked only when given (it is a per-call option)."""
    problems = []
    if hidden % gg.ROWS_PER_CTA:
        problems.append(f"hidden {hidden}: the W2 grid covers {gg.ROWS_PER_CTA} output channels per CTA; allowed: "
                        f"a multiple of {gg.ROWS_PER_CTA}")
    if intermediate % 128:
        problems.append(f"intermediate {intermediate}: W1 covers 128 channels (256 gate/up rows) per CTA; allowed: "
                        f"a multiple of 128")
    if num_experts > dispatch.MAX_EXPERTS:
        problems.append(f"num_experts {num_experts}: dispatch counts experts in shared memory; allowed: at most "
                        f"{dispatch.MAX_EXPERTS}")
    if num_experts % num_ranks:
        problems.append(f"num_experts {num_experts} over {num_ranks} ranks; allowed: a multiple of the rank count")
    if topk + num_shared_experts > 32:
        problems.append(f"topk {topk} + shared {num_shared_experts}; allowed: at most 32 combine lanes")
    if num_shared_experts:
        reason = shared_expert_unavailable_reason()
        if reason:
            problems.append(f"num_shared_experts {num_shared_experts}: {reason}; allowed: 0 (the reference backend "
                            f"serves shared experts: get_symm_buffer_for_gc_moe(..., backend='reference'))")
    if activation_alpha is not UNCHECKED and activation_alpha != SWIGLU_ALPHA:
        problems.append(f"activation_alpha {activation_alpha}: the ring-consumer W1 cubins are built with alpha "
                        f"{SWIGLU_ALPHA:g}; allowed: {SWIGLU_ALPHA:g}")
    if activation_clamp is not UNCHECKED and activation_clamp != SWIGLU_CLAMP:
        problems.append(f"activation_clamp {activation_clamp}: the ring-consumer W1 cubins are built with clamp "
                        f"{SWIGLU_CLAMP:g}; allowed: {SWIGLU_CLAMP:g}")
    if not problems:
        try:
            layer_shape(num_ranks, num_experts, topk, hidden, intermediate, capacity)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


_shared_reason_cache: dict = {}


def shared_expert_unavailable_reason(cache_dir=None) -> str | None:
    """Why the shared expert (role4, `kernels.sm90.shared_expert`) cannot run here: its module is absent, or
    its cubins are neither in the cache nor buildable (no DSL). None when it can."""
    import importlib

    from gc_moe.runtime import jit

    try:
        se = importlib.import_module(SHARED_EXPERT_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and SHARED_EXPERT_MODULE.startswith(exc.name):
            return f"the SM90 shared-expert kernel ({SHARED_EXPERT_MODULE}) is not part of this build"
        raise
    cache_dir = cache_dir or jit.default_cache_dir()
    if cache_dir not in _shared_reason_cache:
        missing = [v.describe() for v in se.all_variants() if jit.find_entry(v, ARCH, cache_dir) is None]
        _shared_reason_cache[cache_dir] = None if not missing or jit.dsl_available() else (
            f"{len(missing)} shared-expert kernels are not in the cubin cache {cache_dir} (e.g. {missing[0]}): run "
            f"`{jit.build_command(ARCH, 'h200')}`")
    return _shared_reason_cache[cache_dir]


def check_shared_weights(shape: ll.LayerShape, shared, device) -> None:
    """Shared-expert weights (formats.SharedExpertWeights) at the layer's H and I, on its device."""
    if not all(hasattr(shared, a) for a in ("w1", "w1_sf", "w2", "w2_sf", "recipe", "hidden", "intermediate")):
        raise TypeError(f"shared_weights: got {type(shared).__name__}; allowed: formats.SharedExpertWeights")
    if (shared.hidden, shared.intermediate) != (shape.hidden, shape.intermediate):
        raise ValueError(f"shared_weights: H={shared.hidden}, Is={shared.intermediate}; allowed: H={shape.hidden}, "
                         f"Is={shape.intermediate} (one shared expert of the routed experts' size)")
    if shared.w1.device != device:
        raise ValueError(f"shared_weights: on {shared.w1.device}; allowed: the layer's device {device}")


class SharedExpert:
    """Role4 on one rank: the shared expert's workspace and kernels (both recipes), and its two launches
    (W1 then W2) for a token count, an output and weights, as graph nodes or as eager launches. The output
    is combine lane k of the layer (fused) or any BF16 [T, H] rows (the unfused path)."""

    def __init__(self, hidden: int, intermediate: int, capacity: int, device, num_sms: int):
        import importlib

        reason = shared_expert_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.se = importlib.import_module(SHARED_EXPERT_MODULE)
        self.hidden, self.intermediate, self.capacity = hidden, intermediate, capacity
        self.ws = self.se.SharedExpertWorkspace.allocate(hidden, intermediate, capacity, device, num_sms)
        self._packed: OrderedDict = OrderedDict()
        self.pipeline = shared_pipeline_from_env()  # "auto": shared_expert.AUTO_PIPELINE
        self.ctas_per_sm = shared_ctas_from_env()  # "auto": shared_expert.AUTO_CTAS_PER_SM where it builds
        self.kernels = {}
        for recipe in self.se.RECIPES:  # loaded now: a graph first built inside a capture loads nothing
            name = self.se.recipe_name(recipe)
            self.kernels[recipe] = {key: _load(self.se.variant(key[0], key[1], name))
                                    for key in ((r, bn) for r in ("w1", "w2") for bn in self.se.BLOCK_N_CHOICES)}
            self.kernels[recipe].update({("fused", bn): _load(self.se.fused_variant(bn, name))
                                         for bn in self.se.BLOCK_N_CHOICES})
            self.kernels[recipe].update({(f"{r}_ws", bn): _load(self.se.variant(r, bn, name, "ws"))
                                         for r in ("w1", "w2") for bn in self.se.WS_BLOCK_N})
            self.kernels[recipe].update({("fused_ws", bn): _load(self.se.fused_variant(bn, name, "ws"))
                                         for bn in self.se.WS_BLOCK_N})
            self.kernels[recipe].update({(f"{r}_ws2", bn): _load(self.se.variant(r, bn, name, "ws", 2))
                                         for r in ("w1", "w2") for bn in self.se.TWO_CTA_BLOCK_N})
            self.kernels[recipe].update({("fused_ws2", bn): _load(self.se.fused_variant(bn, name, "ws", 2))
                                         for bn in self.se.TWO_CTA_BLOCK_N})
            for k in self.kernels[recipe].values():
                k.ensure_dynamic_smem(k.entry.launch.dynamic_smem_bytes, device.index)

    def packed(self, shared):
        """The weights packed for the warp-specialized pipeline (`shared_expert.pack_weights`), once per weight
        set: per `formats.SharedExpertWeights` object while it lives and its tensors are not modified in place (a
        weight set freed and another allocated at the same addresses is packed anew). The first call with a
        weight set should run outside a CUDA graph capture (packing is torch work on the current stream)."""
        import weakref

        versions = tuple(t._version for t in (shared.w1, shared.w1_sf, shared.w2, shared.w2_sf))
        entry = self._packed.get(id(shared))
        if entry is not None and entry[0]() is shared and entry[1] == versions:
            self._packed.move_to_end(id(shared))
            return entry[2]
        packed = self.se.pack_weights(shared)
        self._packed[id(shared)] = (weakref.ref(shared), versions, packed)
        while len(self._packed) > PACKED_CACHE_SIZE:
            self._packed.popitem(last=False)
        return packed

    def graph_key(self, shared) -> tuple:
        """What a layer graph with this weight set depends on beyond the weights' addresses: the packed copy."""
        if self.pipeline == "cp.async":
            return ()
        packed = self.packed(shared)
        return tuple(t.data_ptr() for t in (packed.w1, packed.w1_sf, packed.w2, packed.w2_sf))

    def nodes(self, shared, x, x_sf, out, out_row_stride: int, num_tokens: int, fused: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
        """The launches of one call: W1 then W2, or (fused) one kernel doing both (`shared_expert.FUSED_PARAMS`);
        on the warp-specialized pipeline (the default) they read the packed weights."""
        plan = self.se.plan_launch(max(1, num_tokens), self.hidden, self.intermediate, self.ws.num_sms,
                                   pipeline=self.pipeline, ctas_per_sm=self.ctas_per_sm)
        packed = self.packed(shared) if plan.pipeline == "ws" else None
        if fused:
            return self.se.fused_launch_args(self.kernels[tuple(shared.recipe)], shared, x, x_sf, out,
                                             out_row_stride, num_tokens, self.ws, plan=plan, alpha=SWIGLU_ALPHA,
                                             clamp=SWIGLU_CLAMP, timeout_s=timeout_s, packed=packed)
        return self.se.launch_args(self.kernels[tuple(shared.recipe)], shared, x, x_sf, out, out_row_stride,
                                   num_tokens, self.ws, plan=plan, alpha=SWIGLU_ALPHA, clamp=SWIGLU_CLAMP,
                                   packed=packed)

    def launch(self, shared, x, x_sf, out, num_tokens: int, stream) -> None:
        """Eager W1 then W2 on `stream` into out rows [0, num_tokens) (stride H); captured when it captures."""
        if num_tokens:
            self.se.launch(stream, self.nodes(shared, x, x_sf, out, self.hidden, num_tokens))


def layer_shape(num_ranks: int, num_experts: int, topk: int, hidden: int, intermediate: int, capacity: int,
                num_shared_experts: int = 0, ring_blocks=None) -> ll.LayerShape:
    """The workspace shape of one rank: the ring in blocks of RING_BLOCK_M rows, covering the whole pool
    (`ring_blocks` "auto"), or at most `ring_blocks` of them reused within a replay; None: GC_MOE_RING_BLOCKS."""
    if ring_blocks is None:
        ring_blocks = ring_blocks_from_env()
    limit = 0 if ring_blocks == "auto" else ring_blocks
    return ll.LayerShape(num_ranks, num_experts, topk, hidden, intermediate, capacity, RING_BLOCK_M,
                         num_shared_experts, ring_blocks_limit=limit)


def ring_blocks_from_env(environ=os.environ):
    """The token ring's size: GC_MOE_RING_BLOCKS "auto" (the default when unset or empty: the whole pool of one
    replay) or a number of RING_BLOCK_M-row blocks, at least layer_layout.min_reuse_ring_blocks (reused within a
    replay where the pool is larger)."""
    raw = environ.get(RING_BLOCKS_ENV, "")
    least = ll.min_reuse_ring_blocks(RING_BLOCK_M)
    if raw in ("", "auto"):
        return "auto"
    if not raw.isdigit() or int(raw) < least:
        raise ValueError(f"{RING_BLOCKS_ENV}={raw!r}; allowed: auto (the default: the ring covers the pool) or a "
                         f"whole number of {RING_BLOCK_M}-row blocks >= {least} (a reused ring)")
    return int(raw)


@dataclass(frozen=True)
class CallPlan:
    """What one call launches: the grouped GEMM's token tile and the grid bound on one expert's rows."""

    num_tokens: int
    block_n: int  # W1 / W2 token tile (planning.choose_block_m, SM90 candidates)
    expert_rows_bound: int  # the most grouped rows one local expert can receive this call
    # (the grouped GEMM's compact_grid is not used: stand-alone it won at one token per rank, GLM-5.2 75 -> 54
    # us, but in the layer it measured 1.7% routed and 3.8% shared slower at GLM-5.2 T=1, docs/sm90-layer.md)


def plan_call(shape: ll.LayerShape, num_tokens: int) -> CallPlan:
    """The token tile the token-bound heuristic picks for `num_tokens` tokens per rank (the mean rows per expert
    T P k / E plus one standard deviation, covered by the smallest of 8 / 16 / 32 / 64, capped at 32), and the
    grid bound: at
    P = 1 an expert meets each of this call's tokens at most once (T rows); at P > 1 the other ranks' counts are
    not known on the host, so the bound is the capacity of every rank (C P)."""
    if not 0 <= num_tokens <= shape.capacity:
        raise ValueError(f"num_tokens {num_tokens}; allowed: 0 to capacity={shape.capacity}")
    # capped at the warp-specialized pipeline's largest tile: more 32-token tiles beat one 64-token tile on the
    # cp.async pipeline (stand-alone: DeepSeek T=256 548 against 687 us, docs/sm90-grouped-gemm.md)
    block_n = min(choose_block_m(max(num_tokens, 1), shape.num_ranks, shape.topk, shape.num_experts, arch="sm90"),
                  LAYER_MAX_BLOCK_N)
    bound = max(num_tokens, 1) if shape.num_ranks == 1 else shape.capacity * shape.num_ranks
    return CallPlan(num_tokens, block_n, bound)


def kernel_variants() -> list:
    """Every cubin the layer may load: dispatch, finalize, the fused role2 kernel and the ring-consumer W1 / W2
    at every token tile."""
    out = [dispatch.variant(), finalize.variant()]
    for reuse in (False, True):  # the pool-sized ring's kernels, a reused ring's (GC_MOE_RING_BLOCKS)
        out += [role2_variant(bn, ring_reuse=reuse) for bn in role2.BLOCK_N_CHOICES]
        out += [role2_variant(bn, ctas_per_sm=2, ring_reuse=reuse) for bn in role2.TWO_CTA_BLOCK_N]
    for bn in LAYER_BLOCK_N_CHOICES:
        out += list(gemm_variants(bn))
    return out


def role2_variant(block_n: int, ctas_per_sm: int = 1, ring_reuse: bool = False):
    """The fused role2 kernel (W1 and W2 units in one launch) at one token tile, for a pool-sized or a reused
    ring."""
    return role2.variant(block_n, swiglu_alpha=SWIGLU_ALPHA, swiglu_clamp=SWIGLU_CLAMP, ctas_per_sm=ctas_per_sm,
                         ring_reuse=ring_reuse)


def gemm_variants(block_n: int):
    """The ring-consumer W1 and W2 at one token tile."""
    return (gg.variant("w1", block_n, swiglu_alpha=SWIGLU_ALPHA, swiglu_clamp=SWIGLU_CLAMP, ring_consumer=True),
            gg.variant("w2", block_n, ring_consumer=True))


def missing_kernels(cache_dir=None) -> list[str]:
    """Names of the layer's variants that are not in the cubin cache (current source hash) for sm_90a."""
    from gc_moe.runtime import jit

    return [v.describe() for v in kernel_variants() if jit.find_entry(v, ARCH, cache_dir) is None]


def timeout_from_env(environ=os.environ) -> float:
    """The bounded waits' limit: GC_MOE_WAIT_TIMEOUT_S if set (seconds > 0), else 3600."""
    raw = environ.get(TIMEOUT_ENV, "")
    if raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}; allowed: a number of seconds > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}; allowed: a finite number of seconds > 0")
    return value


def _switch_from_env(environ, name: str, default: bool, allowed: str) -> bool:
    """An on/off switch from the environment: "1" or "0", `default` when unset or empty; else an error naming
    what is `allowed`."""
    raw = environ.get(name, "")
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}; allowed: {allowed}")
    return raw == "1"


def _choice_from_env(environ, name: str, choices, allowed: str) -> str:
    """A setting from the environment: "auto" when unset, empty or "auto", else one of `choices` (strings); any
    other value is an error naming what is `allowed`."""
    raw = environ.get(name, "")
    if raw in ("", "auto"):
        return "auto"
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}; allowed: {allowed}")
    return raw


def overlap_from_env(environ=os.environ) -> bool:
    """Whether dispatch and W1 run as concurrent roots: GC_MOE_OVERLAP_ROOTS "1" (the default when unset or
    empty) or "0" (W1 after dispatch)."""
    return _switch_from_env(environ, OVERLAP_ENV, True,
                            "1 (dispatch and W1 overlap, the default) or 0 (W1 after dispatch)")


def role2_nodes_from_env(environ=os.environ):
    """How role2 runs: GC_MOE_ROLE2_NODES "auto" (the default when unset or empty: one fused kernel, its tile
    chosen per call; W1 and W2 nodes beside the shared expert from 2 tokens), "1" (one fused kernel) or "2" (W1
    and W2 nodes)."""
    raw = _choice_from_env(environ, ROLE2_ENV, ("1", "2"), "auto (the default: one fused kernel, its tile chosen "
                           "per call), 1 (role2 as one fused kernel) or 2 (W1 and W2 as two graph nodes)")
    return raw if raw == "auto" else int(raw)


def role4_fused_from_env(environ=os.environ) -> bool:
    """Whether the shared expert (role4) runs as one fused kernel: GC_MOE_ROLE4_FUSED "0" (the default when unset
    or empty: W1 and W2 nodes) or "1" (one node)."""
    return _switch_from_env(environ, ROLE4_ENV, False,
                            "0 (the shared expert as W1 and W2 nodes, the default) or 1 (one fused node)")


def role4_order_from_env(environ=os.environ) -> str:
    """Where the shared expert (role4) runs against role2: GC_MOE_ROLE4_ORDER "auto" (the default when unset or
    empty: `role4_order_at`), "beside" (concurrent roots), "before" (role2 waits on role4) or "after" (role4
    waits on role2)."""
    return _choice_from_env(environ, ROLE4_ORDER_ENV, ROLE4_ORDERS,
                            "auto (the default: before role2 at 1 token per rank, beside it above), beside (role4 "
                            "and role2 concurrent), before (role2 waits on role4) or after (role4 waits on role2)")


def shared_pipeline_from_env(environ=os.environ) -> str:
    """The shared expert's pipeline: GC_MOE_SHARED_PIPELINE "auto" (the default when unset or empty:
    shared_expert.AUTO_PIPELINE), "cp.async" (every thread copies, a CTA barrier per stage, 64-token tiles above
    32 tokens) or "ws" (warp-specialized, 32-token tiles above 32 tokens)."""
    return _choice_from_env(environ, SHARED_PIPELINE_ENV, ("cp.async", "ws"),
                            "auto (the default: warp-specialized), cp.async (every thread copies, a CTA barrier per "
                            "stage) or ws (warp-specialized)")


def shared_ctas_from_env(environ=os.environ):
    """The shared expert's CTAs per SM at token tile 8 (warp-specialized): GC_MOE_SHARED_CTAS_PER_SM "auto" (the
    default when unset or empty: shared_expert.AUTO_CTAS_PER_SM), "1" or "2" (3 stages each)."""
    raw = _choice_from_env(environ, SHARED_CTAS_ENV, ("1", "2"), "auto (the default), 1 or 2 (two CTAs per SM at "
                           "token tile 8 on the warp-specialized pipeline)")
    return raw if raw == "auto" else int(raw)


def role2_block_n_from_env(environ=os.environ):
    """The fused role2 kernel's token tile: GC_MOE_ROLE2_BLOCK_N "auto" (the default when unset or empty: the
    call's) or a fixed tile, one of role2.BLOCK_N_CHOICES."""
    raw = _choice_from_env(environ, ROLE2_BLOCK_N_ENV, tuple(str(b) for b in role2.BLOCK_N_CHOICES),
                           f"auto (the default: the call's token tile, at most {max(role2.BLOCK_N_CHOICES)}) or one of "
                           f"{role2.BLOCK_N_CHOICES}")
    return raw if raw == "auto" else int(raw)


def role2_ctas_from_env(environ=os.environ) -> int:
    """Persistent CTAs per SM of the fused role2 kernel: GC_MOE_ROLE2_CTAS_PER_SM "2" (the default when unset or
    empty: two at the token tiles that build that way, role2.TWO_CTA_BLOCK_N, from 2 tokens per rank; one CTA per
    SM stays at 1 token, where it measured faster) or "1" (one everywhere)."""
    raw = environ.get(ROLE2_CTAS_ENV, "")
    if raw == "":
        return 2
    if raw not in ("1", "2"):
        raise ValueError(f"{ROLE2_CTAS_ENV}={raw!r}; allowed: 2 (the default: two persistent role2 CTAs per SM at "
                         f"token tile {' / '.join(map(str, role2.TWO_CTA_BLOCK_N))} from 2 tokens per rank) or 1 "
                         f"(one per SM)")
    return int(raw)


def role2_ctas_per_sm(setting: int, block_n: int, num_tokens: int) -> int:
    """The fused kernel's CTAs per SM for one call: `setting` where its token tile builds with two and the call has
    more than one token per rank, else one."""
    return 2 if setting == 2 and block_n in role2.TWO_CTA_BLOCK_N and num_tokens >= 2 else 1


def role2_block_n(plan_block_n: int, setting="auto") -> int:
    """The fused role2 kernel's token tile for a call whose plan picked `plan_block_n`: 8 up to a plan tile of
    ROLE2_FUSED_TILE8_UP_TO (where it runs two CTAs per SM), else the plan's, at most the kernel's largest;
    `setting` may fix one."""
    if setting != "auto":
        return setting
    if plan_block_n <= ROLE2_FUSED_TILE8_UP_TO:
        return min(role2.BLOCK_N_CHOICES)
    return min(plan_block_n, max(role2.BLOCK_N_CHOICES))


def role4_order_at(setting: str, num_tokens: int) -> str:
    """Where role4 runs for a call with `num_tokens` tokens per rank: the setting, "auto" resolved."""
    if setting == "auto":
        return "before" if num_tokens <= ROLE4_BEFORE_MAX_TOKENS else "beside"
    return setting


def role2_fused(role2_nodes, num_tokens: int, shared: bool = False, role4_order: str = "auto") -> bool:
    """Whether a call with `num_tokens` tokens per rank runs role2 as the one fused kernel; `shared`: the layer
    runs the shared expert (role4) in the compute partition, `role4_order` where (only beside role2 does role4
    wait for the persistent kernel's SMs)."""
    if role2_nodes == "auto":
        return (not shared or role4_order_at(role4_order, num_tokens) != "beside"
                or num_tokens <= ROLE2_FUSED_MAX_TOKENS_WITH_SHARED)
    return role2_nodes == 1


def w1_dependencies(dispatch_node, overlap_roots: bool) -> list:
    """The nodes W1 waits for: none when the roots overlap (W1 acquires ring blocks as dispatch fills them),
    the dispatch node when they do not (W1 starts once dispatch has finished)."""
    return [] if overlap_roots else [dispatch_node]


def settings_note(comm_sms: int, compute_sms: int, overlap_roots: bool, role2_nodes="auto",
                  role4_fused: bool = False, role2_tile="auto", role2_ctas: int = 2,
                  role4_order: str = "auto", ring_blocks: int | None = None, pool_blocks: int | None = None) -> str:
    """How a layer runs, as the harness records it beside each measurement (role4 only when it is one node or
    not beside role2, the fused role2 kernel's token tile only when it is fixed, its CTAs per SM only when one,
    the ring only when it is reused: `ring_blocks` < `pool_blocks`)."""
    role2_text = {"auto": "one fused node (W1 and W2 nodes beside the shared expert from 2 tokens per rank)",
                  1: "one fused node", 2: "W1 and W2 nodes"}[role2_nodes]
    return (f"partition comm/compute {comm_sms}/{compute_sms} SMs; overlap {'on' if overlap_roots else 'off'}; "
            f"role2 {role2_text}" + (f" (fused token tile {role2_tile})" if role2_tile != "auto" else "")
            + (" (fused kernel at one CTA per SM)" if role2_ctas == 1 and role2_nodes != 2 else "")
            + ("; role4 one fused node" if role4_fused else "")
            + (f"; role4 {role4_order} role2" if role4_order != "auto" else "")
            + (f"; ring {ring_blocks} of {pool_blocks} blocks, reused" if ring_blocks and pool_blocks
               and ring_blocks < pool_blocks else ""))


def check_weights(shape: ll.LayerShape, l1, l2, device) -> None:
    """The SM90 matrices (`weights.sm90.Sm90Matrix`) must be this rank's experts at the layer's H and I."""
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    for what, mat, rows, cols, interleaved in (("w1", l1, 2 * i, h, True), ("w2", l2, h, i, False)):
        if not all(hasattr(mat, a) for a in ("codes", "scales", "factor", "rows", "cols", "gate_up_interleaved")):
            raise TypeError(f"{what}: got {type(mat).__name__}; allowed: the SM90 layout from "
                            f"transform_weights_for_gc_moe (gc_moe.weights.sm90.Sm90Matrix)")
        got = (mat.num_experts, mat.rows, mat.cols, bool(mat.gate_up_interleaved))
        if got != (e, rows, cols, interleaved):
            raise ValueError(f"{what}: {got[0]} experts of [{got[1]}, {got[2]}] (gate/up interleaved {got[3]}); "
                             f"allowed: this rank's {e} experts of [{rows}, {cols}] (interleaved {interleaved})")
        if mat.codes.device != device:
            raise ValueError(f"{what}: on {mat.codes.device}; allowed: the layer's device {device}")


# ------------------------------------------------------------------------------------------------ the layer
_LOADED: dict = {}  # variant description -> LoadedKernel (one load per process; graphs keep using it)


def _load(variant):
    from gc_moe.runtime import jit

    key = variant.describe()
    if key not in _LOADED:
        _LOADED[key] = jit.load_kernel(variant, ARCH)
    return _LOADED[key]


class Sm90Layer:
    """One layer on one rank: partition, workspace, kernels and its child graphs (see the module docstring)."""

    def __init__(self, shape: ll.LayerShape, *, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 overlap_roots: bool | None = None, role2_nodes=None, role4_fused: bool | None = None,
                 role4_order: str | None = None):
        import torch

        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s {timeout_s!r}; allowed: a finite number of seconds > 0")
        if overlap_roots is None:
            overlap_roots = overlap_from_env()
        if not isinstance(overlap_roots, bool):
            raise TypeError(f"overlap_roots {overlap_roots!r}; allowed: True, False or None ({OVERLAP_ENV})")
        self.overlap_roots = overlap_roots
        if role2_nodes is None:
            role2_nodes = role2_nodes_from_env()
        if role2_nodes not in ROLE2_NODE_CHOICES or isinstance(role2_nodes, bool):
            raise ValueError(f"role2_nodes {role2_nodes!r}; allowed: 'auto' (one fused kernel; W1 and W2 nodes beside "
                             f"the shared expert from 2 tokens), 1 (one fused kernel), 2 (W1 and W2 nodes) or None "
                             f"({ROLE2_ENV})")
        if shape.ring_reuse and not overlap_roots:
            raise ValueError(f"overlap_roots False with a ring of {shape.ring_blocks} blocks reused within a replay "
                             f"(pool {shape.pool_blocks}): role1 waits for role2's releases, so role2 must run beside "
                             f"it; allowed: overlap_roots True ({OVERLAP_ENV}=1), or {RING_BLOCKS_ENV}=auto")
        if shape.ring_reuse and role2_nodes == 2:
            raise ValueError(f"role2_nodes 2 with a ring of {shape.ring_blocks} blocks reused within a replay (pool "
                             f"{shape.pool_blocks}); allowed: 'auto' or 1 (a reused ring is read by the fused role2 "
                             f"kernel, whose tickets keep role1's waits acyclic), or {RING_BLOCKS_ENV}=auto")
        self.role2_nodes = role2_nodes
        self.role2_tile = role2_block_n_from_env()  # "auto", or the fused kernel's fixed token tile
        self.role2_ctas = role2_ctas_from_env()  # 2: two fused-kernel CTAs per SM at bn 8 from 2 tokens; or 1
        if role4_fused is None:
            role4_fused = role4_fused_from_env()
        if not isinstance(role4_fused, bool):
            raise TypeError(f"role4_fused {role4_fused!r}; allowed: True, False or None ({ROLE4_ENV})")
        # role4 as one kernel (shared_expert's fused launch): correct on the H200 but 2-6% slower than its two
        # nodes (W2 CTAs wait resident for all W1 CTAs), so off by default (docs/sm90-layer.md)
        self.role4_fused = role4_fused
        if role4_order is None:
            role4_order = role4_order_from_env()
        if role4_order not in ROLE4_ORDERS:
            raise ValueError(f"role4_order {role4_order!r}; allowed: one of {ROLE4_ORDERS} or None ({ROLE4_ORDER_ENV})")
        self.role4_order = role4_order
        device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        if device.type != "cuda":
            raise ValueError(f"device {device}; allowed: an sm_90 CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.get_device_capability(device) != (9, 0):
            raise RuntimeError(f"{device} has compute capability {torch.cuda.get_device_capability(device)}; the "
                               f"SM90 layer runs on 9.0 (sm_90a)")
        problems = unsupported_reasons(num_experts=shape.num_experts, num_ranks=shape.num_ranks, topk=shape.topk,
                                       hidden=shape.hidden, intermediate=shape.intermediate,
                                       capacity=shape.capacity, num_shared_experts=shape.num_shared_experts)
        if problems:
            raise ValueError("the SM90 layer cannot run this configuration: " + "; ".join(problems))
        from gc_moe.runtime.partition import get_partitions

        self.shape, self.device, self.timeout_s = shape, device, float(timeout_s)
        torch.zeros(1, device=device)  # a current context before the first driver-level load
        self.parts = get_partitions(device.index)
        described = self.parts.describe()
        self.dispatch_ctas = described["comm_sms"]  # every rank's finalize checks this many contributors
        self.finalize_ctas = min(described["compute_sms"], FINALIZE_MAX_CTAS)
        layout = ll.layer_layout(shape)
        if shape.num_ranks == 1:
            self.ws = ll.LocalWorkspace(layout, device)
        else:
            from gc_moe.runtime.workspace import SymmetricWorkspace

            self.ws = SymmetricWorkspace(layout, group, device)
            if self.ws.world_size != shape.num_ranks:
                raise ValueError(f"the group has {self.ws.world_size} ranks, the layer shape {shape.num_ranks}")
        self.rank = 0 if shape.num_ranks == 1 else self.ws.rank
        ll.initialize_state(self.ws)
        torch.cuda.synchronize(device)
        if shape.num_ranks > 1:
            self.ws.barrier()  # every peer's signals are zero before anyone's first replay
        # every kernel loaded (and its shared-memory limit raised) now: a graph first built inside a capture
        # then only adds nodes, no module loads
        self.k_dispatch = _load(dispatch.variant())
        self.k_finalize = _load(finalize.variant())
        for k in [k for bn in LAYER_BLOCK_N_CHOICES for k in self.gemm_kernels(bn)] + [
                self.role2_kernel(bn) for bn in role2.BLOCK_N_CHOICES] + [
                self.role2_kernel(bn, 2) for bn in role2.TWO_CTA_BLOCK_N]:
            k.ensure_dynamic_smem(k.entry.launch.dynamic_smem_bytes, device.index)
        self.shared = None
        if shape.num_shared_experts:
            self.shared = SharedExpert(shape.hidden, shape.intermediate, shape.capacity, device,
                                       described["compute_sms"])
        self._stage = None  # output rows for a non-contiguous or empty y
        self._graphs: OrderedDict = OrderedDict()
        # timing only: the layer's nodes the graph keeps (None: all), e.g. ("dispatch", "finalize"), so a harness
        # can time parts of the layer and take differences; y is then not the layer's output
        self.timing_nodes = None

    # the inputs of Listing 1 are the workspace's first regions
    def input_views(self) -> dict:
        return {name: getattr(self.ws, name) for name in ("x", "x_sf", "topk_idx", "topk_weights")}

    def settings_note(self) -> str:
        """The partition and the overlap switch, e.g. "partition comm/compute 4/128 SMs; overlap on"."""
        described = self.parts.describe()
        return settings_note(described["comm_sms"], described["compute_sms"], self.overlap_roots,
                             self.role2_nodes, self.role4_fused, self.role2_tile, self.role2_ctas,
                             self.role4_order, self.shape.ring_blocks, self.shape.pool_blocks)

    def gemm_kernels(self, block_n: int):
        w1, w2 = gemm_variants(block_n)
        return _load(w1), _load(w2)

    def role2_kernel(self, block_n: int, ctas_per_sm: int = 1):
        return _load(role2_variant(block_n, ctas_per_sm, self.shape.ring_reuse))

    def build_graph(self, y, num_tokens: int, l1, l2, shared=None):
        """The child graph of one call: [dispatch || role2] -> finalize; with shared experts also role4 (the shared
        expert's W1 -> W2, or one fused node) into combine lane k, before finalize: beside role2 (a third root),
        before it (role2 waits on role4) or after it (`role4_order`). With the overlap off, dispatch -> role2
        (`w1_dependencies`); with role2_nodes 2, role2 is W1 -> W2."""
        from gc_moe.runtime.graph import ChildGraph

        shape, ws, plan = self.shape, self.ws, plan_call(self.shape, num_tokens)
        keep = TIMING_NODES if self.timing_nodes is None else self.timing_nodes
        if not set(keep) <= set(TIMING_NODES) or "finalize" not in keep or ("role2" in keep) > ("dispatch" in keep):
            raise ValueError(f"timing_nodes {self.timing_nodes!r}; allowed: None or a subset of {TIMING_NODES} "
                             f"with 'finalize', and 'dispatch' wherever 'role2' (it waits for dispatch's ring)")
        if shape.ring_reuse and ("dispatch" in keep) > ("role2" in keep):
            raise ValueError(f"timing_nodes {self.timing_nodes!r} with a reused ring: keep 'role2' wherever "
                             f"'dispatch' (role1 waits for role2's releases of the ring blocks)")
        g = ChildGraph()
        compute = self.parts.compute_context
        d = None
        if "dispatch" in keep:
            d = g.add_kernel("dispatch", self.k_dispatch, self.dispatch_ctas,
                             dispatch.dispatch_args(ws, shape, num_tokens, self.rank, self.timeout_s),
                             self.parts.comm_context)
        role4_nodes = None  # lane k of this rank's own tokens (finalize reads no row at T = 0)
        if shared is not None and num_tokens and "role4" in keep:
            role4_nodes = self.shared.nodes(shared, ws.x, ws.x_sf, ws.combine[shape.topk], shape.hidden, num_tokens,
                                            fused=self.role4_fused, timeout_s=self.timeout_s)
        order = role4_order_at(self.role4_order, num_tokens)
        role4_last = None
        if role4_nodes is not None and order == "before":
            role4_last = self.shared.se.add_to_graph(g, compute, role4_nodes)[-1]
        role2_after = w1_dependencies(d, self.overlap_roots) + ([role4_last] if role4_last is not None else [])
        if "role2" not in keep:
            last = None
        elif shape.ring_reuse or role2_fused(self.role2_nodes, num_tokens, shared is not None, self.role4_order):
            bn = role2_block_n(plan.block_n, self.role2_tile)
            k_role2 = self.role2_kernel(bn, role2_ctas_per_sm(self.role2_ctas, bn, num_tokens))
            grid, args = role2.role2_launch(k_role2, l1, l2, ws, shape, plan.expert_rows_bound, self.timeout_s,
                                            self.parts.describe()["compute_sms"])
            last = g.add_kernel("role2", k_role2, grid, args, compute, depends_on=role2_after)
        else:
            k_w1, k_w2 = self.gemm_kernels(plan.block_n)
            grid, args = gg.w1_launch(k_w1, l1, ws.ring_act, ws.ring_scale, ws.expert_offsets, ws.routing_weight,
                                      ws.l2_act, ws.l2_scale, plan.expert_rows_bound,
                                      gg.ring_args_w1(ws, shape, self.timeout_s))
            w1 = g.add_kernel("w1", k_w1, grid, args, compute, depends_on=role2_after)
            grid, args = gg.w2_launch(k_w2, l2, ws.l2_act, ws.l2_scale, ws.expert_offsets, ws.dest_row,
                                      ws.combine.view(-1, shape.hidden), plan.expert_rows_bound,
                                      gg.ring_args_w2(ws, shape))
            last = g.add_kernel("w2", k_w2, grid, args, compute, depends_on=[w1])
        if role4_nodes is not None and order != "before":
            after = [last] if order == "after" and last is not None else []
            role4_last = self.shared.se.add_to_graph(g, compute, role4_nodes, depends_on=after)[-1]
        before_finalize = [n for n in (d, last, role4_last) if n is not None]
        g.add_kernel("finalize", self.k_finalize, self.finalize_ctas,
                     finalize.finalize_args(ws, shape, y, num_tokens, self.dispatch_ctas, self.timeout_s),
                     compute, depends_on=before_finalize)
        return g

    def _output_rows(self, y, num_tokens: int):
        """Where finalize writes: y itself when it is a contiguous bf16 [num_tokens >= 1, H], else staging rows."""
        import torch

        if y.is_contiguous() and num_tokens > 0:
            return y, False
        if self._stage is None:
            self._stage = torch.empty(self.shape.capacity, self.shape.hidden, dtype=torch.bfloat16,
                                      device=self.device)
        return self._stage, True

    def graph(self, y, num_tokens: int, l1, l2, shared=None):
        """The cached child graph for (token count, output rows, weights); built on first use."""
        target, staged = self._output_rows(y, num_tokens)
        key = (num_tokens, target.data_ptr(), l1.codes.data_ptr(), l2.codes.data_ptr(), l1.factor.data_ptr(),
               l2.factor.data_ptr(), self.role2_nodes, self.overlap_roots, self.role4_fused, self.timing_nodes,
               self.role2_ctas, self.role4_order)
        if shared is not None:
            key += tuple(t.data_ptr() for t in (shared.w1, shared.w1_sf, shared.w2, shared.w2_sf))
            key += self.shared.graph_key(shared)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self.build_graph(target, num_tokens, l1, l2, shared)
            while len(self._graphs) > GRAPH_CACHE_SIZE:  # captured copies of an evicted graph stay valid
                self._graphs.popitem(last=False)[1].destroy()
        else:
            self._graphs.move_to_end(key)
        return g, target, staged

    def run(self, y, num_tokens: int, l1, l2, stream=None, shared=None) -> None:
        """One layer call into y[:num_tokens] (bf16 [>= num_tokens, H]) on `stream` (default: torch's current
        stream); `shared`: the shared expert's weights (formats.SharedExpertWeights), required iff the layer
        was made with a shared expert. Inside a torch CUDA graph capture the child graph is attached to the
        capture; otherwise it is launched. No host synchronization either way."""
        import torch

        if (shared is None) != (self.shared is None):
            raise ValueError(f"shared: {'given' if shared is not None else 'None'}; allowed: "
                             f"{'formats.SharedExpertWeights' if self.shared else 'None'} (the layer has "
                             f"{self.shape.num_shared_experts} shared experts)")
        if shared is not None:
            check_shared_weights(self.shape, shared, self.device)

        if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != self.shape.hidden or y.shape[0] < num_tokens:
            raise ValueError(f"y: {y.dtype} {list(y.shape)}; allowed: bfloat16 [>= {num_tokens}, "
                             f"{self.shape.hidden}]")
        if y.device != self.device:
            raise ValueError(f"y: on {y.device}; allowed: the layer's device {self.device}")
        check_weights(self.shape, l1, l2, self.device)
        g, target, staged = self.graph(y[:num_tokens] if num_tokens else y, num_tokens, l1, l2, shared)
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            g.attach_to_capture(stream)
        else:
            g.launch(stream)
        if staged and num_tokens:
            y[:num_tokens].copy_(target[:num_tokens])

    def control(self) -> dict:
        """The control words (host read: synchronizes)."""
        words = self.ws.control.cpu().tolist()
        return {"recv_parity": words[ll.RECV_PARITY], "arrival_errors": words[ll.ARRIVAL_ERRORS],
                "received_rows": words[ll.RECEIVED_ROWS], "ring_overflows": words[ll.RING_OVERFLOWS],
                "replays": words[ll.REPLAYS]}

    def release(self) -> None:
        """Destroy the cached graphs (the workspace goes with the last reference to it). Copies attached to an
        outer capture belong to that capture and stay valid."""
        graphs = getattr(self, "_graphs", {})
        while graphs:
            graphs.popitem()[1].destroy()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001, S110  (the driver may already be gone at interpreter exit)
            pass
