"""Host side of the SM90 Mega MoE port (no CuTe DSL needed): variants, workspace, arguments, launch.

Two pipelines of the same design, built offline into the cubin cache (`gcmoe-bench build --arch sm_90a --profile
h200`) and launched here through gc_moe.runtime: `cp_async` (gc_moe.kernels.sm90.mega_port: every thread copies
and computes each work item) and `ws` (gc_moe.kernels.sm90.mega_port_ws: the GEMMs on GC-MoE's warp-specialized
persistent loop). Grid = the SM count, one CTA per SM, cooperative (the phases wait on each other's counters, so
every CTA must be resident). PIPELINE_ENV picks the harness's pipeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gc_moe.kernels.sm90 import mega_port as k
from gc_moe.kernels.sm90 import mega_port_ws as kws

MODULE = "gc_moe.kernels.sm90.mega_port"
MODULE_WS = "gc_moe.kernels.sm90.mega_port_ws"
PIPELINES = ("cp_async", "ws")
PIPELINE_ENV = "GCMOE_MEGA_PORT_PIPELINE"  # "auto" (default), "cp_async" or "ws"
DEFAULT_PIPELINE = "auto"  # per call, the pipeline measured faster there (`resolve_pipeline`)
DEFAULT_TIMEOUT_S = 10.0
BUILT_BLOCK_N = k.BLOCK_N_CHOICES
BUILT_STAGES = 5
SWITCH_TO_16_ROWS = 6  # mean rows per expert from which N 16 beats N 8


def variant(block_n: int, stages: int = BUILT_STAGES, swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0):
    """The runtime KernelVariant of one configuration."""
    from gc_moe.runtime.jit import KernelVariant

    k.PortConfig(block_n, stages, swiglu_alpha, swiglu_clamp)  # validates
    params = {"block_n": block_n, "stages": stages, "swiglu_alpha": swiglu_alpha, "swiglu_clamp": swiglu_clamp}
    return KernelVariant.make("mega_port.sm90", MODULE, "build_port", params, promises=k.PROMISES,
                              local_bytes_budget=0)


def variant_ws(block_n: int, swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0,
               dispatch_warps: int | None = None):
    """The runtime KernelVariant of the warp-specialized pipeline at one token tile (dispatch warps beside the
    GEMM loop: `kws.DISPATCH_WARPS` unless given)."""
    from gc_moe.runtime.jit import KernelVariant

    cfg = kws.PortWsConfig(block_n, swiglu_alpha, swiglu_clamp, dispatch_warps)  # validates
    params = {"block_n": block_n, "swiglu_alpha": swiglu_alpha, "swiglu_clamp": swiglu_clamp,
              "dispatch_warps": cfg.dispatch_warps}
    return KernelVariant.make("mega_port_ws.sm90", MODULE_WS, "build_port_ws", params, promises=kws.PROMISES,
                              local_bytes_budget=kws.LOCAL_BYTES_BUDGET[block_n],
                              extra_sources=("gc_moe.kernels.sm90.mega_port", "gc_moe.kernels.sm90.role2",
                                             "gc_moe.kernels.sm90.grouped_gemm", "gc_moe.kernels.sm90.ptx",
                                             "gc_moe.kernels.sm90.dispatch", "gc_moe.kernels.sm90.layer_layout"))


def all_variants(swiglu_alpha: float = 1.0, swiglu_clamp: float = 10.0):
    """What the registry builds: every block_n of both pipelines (the cp.async one at the default stage count;
    both models: alpha 1, clamp 10)."""
    return ([variant(bn, BUILT_STAGES, swiglu_alpha, swiglu_clamp) for bn in BUILT_BLOCK_N]
            + [variant_ws(bn, swiglu_alpha, swiglu_clamp) for bn in kws.BLOCK_N_CHOICES])


def pipeline_from_env(environ=os.environ) -> str:
    """The harness's pipeline: GCMOE_MEGA_PORT_PIPELINE, "auto" when unset or empty."""
    raw = environ.get(PIPELINE_ENV, "")
    if raw == "":
        return DEFAULT_PIPELINE
    if raw not in PIPELINES + ("auto",):
        raise ValueError(f"{PIPELINE_ENV}={raw!r}; allowed: auto, {', '.join(PIPELINES)}")
    return raw


def resolve_pipeline(pipeline: str, tokens: int, topk: int, local_experts: int) -> str:
    """"auto" -> the pipeline measured faster for this call (H200, docs/mega-port.md): ws where its token tile is
    32 (the tile the cp.async pipeline cannot build: 15-27% faster at 64-256 tokens per rank), cp_async below
    (within -14..+9% of ws there, mostly faster at 1-32 tokens)."""
    if pipeline == "auto":
        return "ws" if choose_block_n_ws(tokens, topk, local_experts) == 32 else "cp_async"
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}; allowed: auto, {', '.join(PIPELINES)}")
    return pipeline


def choose_block_n(tokens: int, topk: int, local_experts: int) -> int:
    """Tokens per work item from the mean rows of an expert under uniform routing (T k / E): N 8 below
    SWITCH_TO_16_ROWS, else N 16 (measured on the H200, docs/mega-port.md: at 2 rows per expert N 8 is 12-14%
    faster, at 8 and more N 16 is 17-50% faster; N 32 / 64 are not built)."""
    return 8 if tokens * topk / local_experts < SWITCH_TO_16_ROWS else 16


def choose_block_n_ws(tokens: int, topk: int, local_experts: int) -> int:
    """The ws pipeline's token tile: the layer's token-bound rule (mean rows per expert plus one standard
    deviation, the smallest of 8 / 16 / 32 covering it), so the port and GC-MoE tile the same way."""
    from gc_moe.planning import choose_block_m

    return min(choose_block_m(max(tokens, 1), 1, topk, local_experts, arch="sm90"), max(kws.BLOCK_N_CHOICES))


def work_items(expert_counts: list[int], block_n: int, hidden: int, intermediate: int) -> tuple[int, int]:
    """(W1 items, W2 items) the kernel walks for these per-expert row counts: the host twin of its schedule."""
    tiles = sum(-(-c // block_n) for c in expert_counts)
    return (2 * intermediate // k.ROWS_PER_CTA) * tiles, (hidden // k.ROWS_PER_CTA) * tiles


def check_shape(hidden: int, intermediate: int, local_experts: int, topk: int, pipeline: str = "cp_async") -> None:
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}; allowed: {', '.join(PIPELINES)}")
    if pipeline == "ws" and intermediate // 128 > kws.role2.MAX_INTER_BLOCKS:
        raise ValueError(f"intermediate {intermediate}: the ws pipeline's W1-completion word holds "
                         f"{kws.role2.MAX_INTER_BLOCKS} K128 blocks; allowed: at most {128 * kws.role2.MAX_INTER_BLOCKS}")
    if hidden % k.ROWS_PER_CTA:
        raise ValueError(f"hidden {hidden} must be a multiple of {k.ROWS_PER_CTA} (W2 rows per CTA tile)")
    if intermediate % 128:
        raise ValueError(f"intermediate {intermediate} must be a multiple of 128 (the requant block)")
    if not 1 <= local_experts <= k.MAX_LOCAL_EXPERTS:
        raise ValueError(f"{local_experts} local experts; allowed: 1..{k.MAX_LOCAL_EXPERTS}")
    if topk < 1:
        raise ValueError(f"topk {topk}; allowed: >= 1")


@dataclass
class PortWorkspace:
    """Everything the kernel writes besides y; sized for `capacity` tokens."""

    g_act: object  # fp8 [C k, H]: grouped rows (dispatch output)
    g_scale: object  # f32 [C k, H/128]
    g_weight: object  # f32 [C k]
    g_dest: object  # int32 [C k]: combine row slot * T + token
    g_src: object  # int32 [C k]: routing entry token * k + slot
    mid: object  # fp8 [C k, I]
    mid_scale: object  # f32 [C k, I/128]
    partials: object  # bf16 [k C, H]
    expert_offsets: object  # int32 [E + 1]
    control: object  # int32 [CONTROL_WORDS], zero between launches
    peers: object  # int64 [P]: peer base - local base of `control`
    # the ws pipeline's ring and GEMM-loop signals, zero between launches
    l1_full_count: object  # int32 [ring blocks of RING_BLOCK_M rows]
    l1_empty_count: object  # int32 [ring blocks]
    w1_done_mask: object  # int64 [E, mask stride]: the W1-completion bits of each (expert, token tile)

    @classmethod
    def allocate(cls, capacity: int, topk: int, hidden: int, intermediate: int, local_experts: int, device,
                 num_ranks: int = 1):
        import torch

        rows = capacity * topk
        fp8 = torch.float8_e4m3fn
        return cls(
            g_act=torch.zeros(rows, hidden, dtype=fp8, device=device),
            g_scale=torch.zeros(rows, hidden // 128, dtype=torch.float32, device=device),
            g_weight=torch.zeros(rows, dtype=torch.float32, device=device),
            g_dest=torch.zeros(rows, dtype=torch.int32, device=device),
            g_src=torch.zeros(rows, dtype=torch.int32, device=device),
            mid=torch.zeros(rows, intermediate, dtype=fp8, device=device),
            mid_scale=torch.zeros(rows, intermediate // 128, dtype=torch.float32, device=device),
            partials=torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device),
            expert_offsets=torch.zeros(local_experts + 1, dtype=torch.int32, device=device),
            control=torch.zeros(max(k.CONTROL_WORDS, kws.CONTROL_WORDS), dtype=torch.int32, device=device),
            peers=torch.zeros(num_ranks, dtype=torch.int64, device=device),  # P = 1: the rank itself
            l1_full_count=torch.zeros(kws.ring_blocks(capacity, topk), dtype=torch.int32, device=device),
            l1_empty_count=torch.zeros(kws.ring_blocks(capacity, topk), dtype=torch.int32, device=device),
            w1_done_mask=torch.zeros(local_experts, kws.mask_stride(capacity), dtype=torch.int64, device=device),
        )


def kernel_args(ws: PortWorkspace, x, x_sf, topk_idx, topk_weights, w, y, *, rank: int = 0, num_ranks: int = 1,
                timeout_s: float = DEFAULT_TIMEOUT_S, pipeline: str = "cp_async") -> list:
    """Arguments in the pipeline's kernel `PARAMS` order. w: gc_moe.weights.sm90.Sm90Weights of the rank's local
    experts."""
    import torch
    from gc_moe.runtime.launch import i32, i64, ptr

    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    local_experts, intermediate = w.l1.num_experts, w.l1.rows // 2
    check_shape(hidden, intermediate, local_experts, topk, pipeline)
    rows = ws.g_dest.shape[0]
    if tokens * topk > rows:
        raise ValueError(f"{tokens} tokens x top-{topk} = {tokens * topk} rows; the workspace holds {rows}")
    checks = ((x, torch.float8_e4m3fn, (tokens, hidden)), (x_sf, torch.int32, (tokens, hidden // 128)),
              (topk_idx, torch.int64, (tokens, topk)), (topk_weights, torch.float32, (tokens, topk)),
              (y, torch.bfloat16, (tokens, hidden)))
    for t, dtype, shape in checks:
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"expected a contiguous CUDA {dtype} tensor {shape}, got {t.dtype} {tuple(t.shape)}")
    if w.l2.rows != hidden or w.l2.cols != intermediate or w.l1.cols != hidden:
        raise ValueError(f"weights (W1 {w.l1.rows}x{w.l1.cols}, W2 {w.l2.rows}x{w.l2.cols}) do not fit H = {hidden}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}; allowed: > 0")
    pointers = [x, x_sf, topk_idx, topk_weights, w.l1.codes, w.l1.scales, w.l1.factor, w.l2.codes, w.l2.scales,
                w.l2.factor, ws.g_act, ws.g_scale, ws.g_weight, ws.g_dest, ws.g_src, ws.mid, ws.mid_scale,
                ws.partials, y, ws.expert_offsets, ws.control, ws.peers]
    scalars = [i32(tokens), i32(topk), i32(local_experts), i32(rank * local_experts), i32(hidden),
               i32(intermediate), i32(num_ranks)]
    if pipeline == "cp_async":
        return [ptr(p) for p in pointers] + scalars + [i64(int(timeout_s * 1e9))]
    capacity = rows // topk
    return [ptr(p) for p in pointers + [ws.l1_full_count, ws.l1_empty_count, ws.w1_done_mask]] + scalars + [
        i32(capacity), i32(ws.l1_full_count.shape[0]), i32(ws.w1_done_mask.shape[1]), i64(int(timeout_s * 1e9))]


def sm_count(device: int = 0) -> int:
    from gc_moe.runtime.driver import check, cu

    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(SM count)"))


def launch(kernel, args: list, grid: int, stream, cooperative: bool = True):
    """One launch of the persistent kernel: `grid` CTAs (the SM count), cooperative so that the driver refuses
    a grid that cannot be resident at once instead of letting the phase waits time out."""
    from gc_moe.runtime.driver import check, cu
    from gc_moe.runtime.launch import stream_handle

    smem = kernel.entry.launch.dynamic_smem_bytes
    params = kernel.pack(args)
    kernel.ensure_dynamic_smem(smem)
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = kernel.entry.launch.block[0], 1, 1
    config.sharedMemBytes = smem
    config.hStream = stream_handle(stream)
    attrs = []
    if cooperative:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    check(cu.cuLaunchKernelEx(config, kernel.as_function(), params.address, 0), f"launch {kernel.name}")
    return params
