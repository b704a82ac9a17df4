#!/usr/bin/env python3
"""Roles 1 and 3 of the SM90 GC-MoE layer on one GPU (P = 1), around a torch stand-in for role2, and the
layer with the grouped GEMM itself as role2 (its ring-consumer variant), one graph on both green contexts.

Per token count: role1 (dispatch, a kernel node in the communication green context) fills the token ring;
the stand-in (torch on the capture stream: the grouped GEMM's numerics in float32, W1 + SwiGLU + routing
weight + E4M3 K128 requant + W2, BF16 partials scattered to combine rows) reads exactly the ring the
grouped GEMM reads; role3 (finalize, a kernel node in the compute green context) combines into y. Checks:

1. eager run, stopped after role1: the ring against `dispatch.reference_dispatch` (expert offsets exact;
   every grouped row, matched by its source word: E4M3 bytes, FP32 scales, routing weight, destination row;
   l1_full_count per ring block);
2. the whole layer eagerly: y against the host twin (same stand-in on the twin's ring, `combine_reference`),
   every element within one BF16 rounding of its partials, and against `gc_moe.reference` (float32 Eq. (1): cosine and
   processed difference at the paper's thresholds);
3. the layer captured once (child graphs of the kernel nodes attached to a torch CUDA graph with the
   stand-in between them), replayed --replays times with no host work: every replay's y equal to the eager
   y bit for bit (counted on the device; the largest processed difference is reported too);
4. the ring handshake across partitions: role1 (communication context) and the ring-consumer probe (compute
   context, `dispatch.acquire_ring_rows`, what role2 adds) as concurrent roots, role3 after both, replayed
   --replays times: every tile saw its rows (`dispatch.expected_probe_rows`), no bounded wait trapped;
5. control words over both loops (arrival errors, ring overflows, replays, received rows), a short table.

With `--role2 kernel` (or `both`, the default) each token count also runs the layer with the grouped GEMM's
ring-consumer variant (`grouped_gemm.GemmConfig.ring_consumer`) as role2: dispatch (communication context)
and W1 (compute context) as concurrent roots, W2 after W1, finalize after dispatch and W2. Checks:

6. eager [dispatch, W1]: the ring as in 1; l1_empty_count per ring block equal to
   `grouped_gemm.expected_l1_empty_counts`; every element of W1's requantized output (l2_act, l2_scale)
   within one E4M3 rounding (2^-4 relative, half a subnormal step) plus 2^-10 relative of the float32
   SwiGLU x routing weight computed from the ring and the weights as the kernel holds them;
7. eager [W2, finalize] after it: every element of y within two BF16 roundings of the float32 combine of
   W2 applied to W1's own output (partials scattered by dest_row, valid slots summed), every element
   finite (combine and y poisoned with NaN first), cosine and processed difference against
   `gc_moe.reference` at the paper's thresholds;
8. the four nodes captured once and replayed --replays times: every replay's y equal to the eager y bit for
   bit; control words as in 5.

Role1 and the stand-in do not overlap in step 3 (the stand-in follows role1 in the capture); step 4 is the
overlap role2 gets once it acquires ring blocks (docs/sm90-layer.md). Needs the dispatch and finalize cubins in the cache:

    python -c "from gc_moe.runtime.jit import build_profile; build_profile('sm_90a', {})"   # build machine, then copy .cubin-cache over
    PYTHONPATH=operator python scripts/device_layer_proof.py --replays 1000 --out device-out
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

import torch
from gc_moe.formats import dequantize_fp4_ue8m0, dequantize_fp8_k128
from gc_moe.kernels.sm90 import dispatch, finalize
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.kernels.sm90 import layer_layout as ll

ALPHA, CLAMP = 1.0, 10.0
FP8_RECIPROCAL = float(torch.tensor(1.0) / torch.tensor(448.0))  # as formats: x * fl32(1/448)


# ------------------------------------------------------------------------------------------------ role2 stand-in
def requantize_k128(a):
    """E4M3 with FP32 K128 scales and back, as the W1 epilogue (`formats.quantize_fp8_k128`'s rule, without its
    host-side finiteness check, so it can be captured)."""
    blocks = a.unflatten(-1, (-1, 128))
    scale = blocks.abs().amax(-1).clamp_min(1e-4) * FP8_RECIPROCAL
    q = (blocks * (1.0 / scale)[..., None]).to(torch.float8_e4m3fn)
    return (q.float() * scale[..., None]).flatten(-2)


def grouped_ffn_standin(ring_act, ring_scale, expert_offsets, routing_weight, w1f, w2f, alpha=ALPHA, clamp=CLAMP):
    """The grouped GEMM's result per ring row, in float32 torch, without host synchronization (capturable).

    ring_act E4M3 [R, H], ring_scale f32 [R, H/128], expert_offsets int32 [e + 1] (rows of expert j:
    [off[j], off[j + 1])), routing_weight f32 [R]; w1f [e, 2I, H] (rows [gate; up]), w2f [e, H, I] float32.
    Returns (partials bf16 [R, H], valid bool [R]); rows past off[e] are not valid (their ring bytes are
    whatever an earlier replay left, possibly NaN, and are zeroed before use).
    """
    rows, inter = ring_act.shape[0], w1f.shape[1] // 2
    r = torch.arange(rows, device=ring_act.device, dtype=torch.int32)
    expert = torch.searchsorted(expert_offsets[1:].contiguous(), r, right=True)
    valid = r < expert_offsets[-1]
    x = torch.where(valid[:, None], dequantize_fp8_k128(ring_act, ring_scale), 0.0)
    weight = torch.where(valid, routing_weight, 0.0)
    out = torch.zeros(rows, w2f.shape[1], dtype=torch.float32, device=ring_act.device)
    for le in range(w1f.shape[0]):
        gu = x @ w1f[le].T
        gate, up = gu[:, :inter].clamp(max=clamp), gu[:, inter:].clamp(-clamp, clamp)
        a = requantize_k128(gate * torch.sigmoid(alpha * gate) * up * weight[:, None])
        out = torch.where((expert == le)[:, None], a @ w2f[le].T, out)
    return out.to(torch.bfloat16), valid


def scatter_partials(partials, valid, dest_row, combine_scratch):
    """Rows' partials into combine_scratch [lanes * C + 1, H] at dest_row; invalid rows go to the last row."""
    trash = combine_scratch.shape[0] - 1
    dest = torch.where(valid, dest_row.long(), torch.full_like(dest_row, trash, dtype=torch.long))
    combine_scratch.index_copy_(0, dest, partials)


def w1_float32(ring_act, ring_scale, expert_offsets, routing_weight, w1f, alpha=ALPHA, clamp=CLAMP):
    """Per ring row the float32 W1 result the kernel requantizes (SwiGLU x routing weight); 0 past the rows."""
    return w1_float32_parts(ring_act, ring_scale, expert_offsets, routing_weight, w1f, alpha, clamp)["a"]


def w1_float32_parts(ring_act, ring_scale, expert_offsets, routing_weight, w1f, alpha=ALPHA, clamp=CLAMP):
    """w1_float32's value `a` with what an error in the kernel's sums does to it: `gate`, `up` (before the
    clamps), and `conditioning` = |da/dgate| sum_k |x_k w_gate,k| + |da/dup| sum_k |x_k w_up,k|, the size of
    a's change per unit relative error of the products' sums (the tensor core's own rounding of its sums
    scales with the products, not with their cancelled result). All [rows, I] float32."""
    rows, inter = ring_act.shape[0], w1f.shape[1] // 2
    r = torch.arange(rows, device=ring_act.device, dtype=torch.int32)
    expert = torch.searchsorted(expert_offsets[1:].contiguous(), r, right=True)
    valid = r < expert_offsets[-1]
    x = torch.where(valid[:, None], dequantize_fp8_k128(ring_act, ring_scale), 0.0)
    weight = torch.where(valid, routing_weight, 0.0)
    parts = {name: torch.zeros(rows, inter, dtype=torch.float32, device=ring_act.device)
             for name in ("a", "gate", "up", "conditioning")}
    for le in range(w1f.shape[0]):
        gu = x @ w1f[le].T
        magnitude = x.abs() @ w1f[le].abs().T
        gate, up = gu[:, :inter].clamp(max=clamp), gu[:, inter:].clamp(-clamp, clamp)
        sig = torch.sigmoid(alpha * gate)
        silu = gate * sig
        d_gate = (sig * (1 + alpha * gate * (1 - sig)) * up * weight[:, None]).abs() * (gu[:, :inter] < clamp)
        d_up = (silu * weight[:, None]).abs() * (gu[:, inter:].abs() < clamp)
        mine = (expert == le)[:, None]
        for name, value in (("a", silu * up * weight[:, None]), ("gate", gu[:, :inter]), ("up", gu[:, inter:]),
                            ("conditioning", d_gate * magnitude[:, :inter] + d_up * magnitude[:, inter:])):
            parts[name] = torch.where(mine, value, parts[name])
    return parts


# The kernel's float result h differs from the float32 `a` by its own arithmetic: fast sigmoid, reciprocal and
# the scale's 448 * rcp(amax) against amax / 448 (a few 2^-22 relative, covered by 2^-10 |a|), and the FP8
# tensor core's sums: each m64nNk32 WGMMA adds its 32 exact products in an accumulator narrower than FP32
# (why DeepGEMM promotes to FP32 every K128). That error scales with the products' magnitudes, so with the
# conditioning, not with |a|: where gate or up nearly cancel (|up| = 6e-5 against sum |x w| ~ 1), h may sit a
# few percent from a and its byte one or two E4M3 steps (subnormal ones included) from a's own rounding.
# On the H200 (2026-12-02, T = 64 and 256, 327,680 elements) the largest distance was 2^-18.4 of the
# conditioning; 2^-16 leaves a factor ~5 and still flags any element more than ~2^-11 of |a| off for a
# typical element (conditioning ~ 32 |a|).
W1_RELATIVE_SLACK = 2.0 ** -10
W1_SUM_SLACK = 2.0 ** -16


def e4m3_rounding_bounds(codes):
    """For E4M3 bytes, the real interval [lo, hi] (in units of the block scale) of the values that round to
    each byte with round-to-nearest and saturation (the kernel's cvt.rn.satfinite): halfway to the neighbours,
    to +-inf past 448. NaN bytes give NaN bounds."""
    magnitudes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448, increasing
    mids = (magnitudes[:-1] + magnitudes[1:]) / 2
    lo_table = torch.cat([torch.zeros(1, dtype=torch.float64), mids, torch.full((1,), float("nan"))])
    hi_table = torch.cat([mids, torch.full((1,), float("inf")), torch.full((1,), float("nan"))])
    raw = codes.contiguous().view(torch.uint8).long().cpu()
    magnitude, negative = raw & 0x7F, (raw >> 7).bool()
    lo, hi = lo_table[magnitude], hi_table[magnitude]
    zero = magnitude == 0
    lo = torch.where(zero, -hi, lo)  # +-0 rounds from both sides of zero
    return torch.where(negative & ~zero, -hi, lo), torch.where(negative & ~zero, -lo, hi)


def w1_element_check(l2_act, l2_scale, a, conditioning=None, relative=W1_RELATIVE_SLACK, sums=W1_SUM_SLACK):
    """Per element of W1's requantized output: `distance`, how far `a` lies from the values that the kernel's
    byte is a correct rounding of at the kernel's own block scale, and `allowed`, how far the kernel's float
    result may lie from `a` (relative * |a| + sums * conditioning). An element is wrong when distance > allowed
    or it is not finite. float64 on the CPU."""
    scale = l2_scale.double().cpu().repeat_interleave(128, dim=1)
    lo, hi = e4m3_rounding_bounds(l2_act)
    a64 = a.double().cpu()
    distance = torch.clamp(torch.maximum(lo * scale - a64, a64 - hi * scale), min=0.0)
    allowed = relative * a64.abs()
    if conditioning is not None:
        allowed = allowed + sums * conditioning.double().cpu()
    finite = torch.isfinite(dequantize_fp8_k128(l2_act, l2_scale)).cpu()
    return distance, allowed, finite


def w1_element_errors(l2_act, l2_scale, a, conditioning=None):
    """Elements of W1's requantized output that are no correct E4M3 rounding (at the kernel's block scale) of
    any value within the kernel's arithmetic slack of the float32 `a`, or not finite. Without `conditioning`
    the slack is 2^-10 |a| alone."""
    distance, allowed, finite = w1_element_check(l2_act, l2_scale, a, conditioning)
    return int(((distance > allowed) & finite).sum()) + int((~finite).sum())


def w1_strict_errors(l2_act, l2_scale, a):
    """The earlier, stricter count: |dequantized - a| > (2^-4 + 2^-10)|a| + 2^-9 scale (no slack for the
    tensor core's sums). Kept to show which elements it flagged."""
    q = dequantize_fp8_k128(l2_act, l2_scale)
    tol = (2.0 ** -4 + 2.0 ** -10) * a.abs() + 2.0 ** -9 * l2_scale.repeat_interleave(128, dim=1)
    return ((q - a).abs() > tol) | ~torch.isfinite(q)


def w1_report(l2_act, l2_scale, parts, limit=12):
    """The W1 check's numbers for the proof's JSON: both counts, and the elements either check flags with
    expected (float32 a), got (dequantized byte), scale, E4M3 steps between the byte and a's own rounding,
    a's position in E4M3 steps from the rounding boundary the byte lies beyond, gate/up, the conditioning and
    the distance in units of |a| and of the conditioning."""
    a, conditioning = parts["a"], parts["conditioning"]
    distance, allowed, finite = w1_element_check(l2_act, l2_scale, a, conditioning)
    wrong = ((distance > allowed) | ~finite)
    strict = w1_strict_errors(l2_act, l2_scale, a).cpu()
    off_rounding = distance > 0  # the byte is not a's own rounding: the kernel's float value crossed a boundary
    ratio = torch.where(off_rounding, distance / conditioning.double().cpu().clamp_min(1e-30), 0.0)
    scale = l2_scale.double().cpu().repeat_interleave(128, dim=1)
    own = (a.double().cpu() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

    def index(codes):  # signed position on the E4M3 number line: neighbours differ by one
        raw = codes.view(torch.uint8)
        return torch.where((raw >> 7).bool(), -(raw & 0x7F).long(), (raw & 0x7F).long())

    got_codes = l2_act.contiguous().cpu()
    steps = (index(got_codes) - index(own)).abs()
    lo, hi = e4m3_rounding_bounds(got_codes)
    step = torch.where(hi.isfinite() & lo.isfinite(), hi - lo, 1.0)
    shown = []
    for r, c in (wrong | strict).nonzero().tolist()[:limit]:
        v = float(a[r, c]) / float(scale[r, c])
        shown.append({
            "row": r, "channel": c, "expected": float(a[r, c]),
            "got": float(dequantize_fp8_k128(l2_act[r:r + 1], l2_scale[r:r + 1])[0, c]),
            "scale": float(scale[r, c]), "expected_over_scale": v, "steps_from_own_rounding": int(steps[r, c]),
            "beyond_boundary_in_steps": float(distance[r, c] / scale[r, c] / step[r, c]),
            "gate": float(parts["gate"][r, c]), "up": float(parts["up"][r, c]),
            "conditioning": float(conditioning[r, c]), "distance": float(distance[r, c]),
            "distance_over_abs_expected": float(distance[r, c] / max(abs(float(a[r, c])), 1e-30)),
            "distance_over_conditioning": float(ratio[r, c]), "allowed": float(allowed[r, c]),
            "strict_flag": bool(strict[r, c]), "flag": bool(wrong[r, c]),
        })
    return {
        "w1_element_errors": int(wrong.sum()), "w1_strict_errors": int(strict.sum()),
        "w1_elements": int(a.numel()), "w1_off_own_rounding": int(off_rounding.sum()),
        "w1_max_steps_from_own_rounding": int(steps.max()) if steps.numel() else 0,
        "w1_max_distance_over_conditioning": float(ratio.max()) if ratio.numel() else 0.0,
        "w1_flagged": shown,
    }


def combine_from_intermediate(l2_act, l2_scale, expert_offsets, dest_row, w2f, idx, shape, num_tokens):
    """float32 y of W2 applied to W1's own output (rows [0, n)): partials to dest_row, valid slots summed.
    Returns (y, tolerance): two BF16 roundings (the partials and y), 2^-8 of sum |partial| + |y|."""
    rows, hidden = l2_act.shape[0], w2f.shape[1]
    r = torch.arange(rows, device=l2_act.device, dtype=torch.int32)
    expert = torch.searchsorted(expert_offsets[1:].contiguous(), r, right=True)
    q = dequantize_fp8_k128(l2_act, l2_scale)
    partial = torch.zeros(rows, hidden, device=l2_act.device)
    for le in range(w2f.shape[0]):
        partial = torch.where((expert == le)[:, None], q @ w2f[le].T, partial)
    lanes = torch.zeros(shape.topk * shape.capacity, hidden, device=l2_act.device)
    lanes.index_copy_(0, dest_row.long(), partial)
    lanes = lanes.view(shape.topk, shape.capacity, hidden)[:, :num_tokens]
    used = (idx[:num_tokens] >= 0).T[..., None].to(l2_act.device)
    y = (lanes * used).sum(0)
    return y, 2.0 ** -8 * ((lanes.abs() * used).sum(0) + y.abs())


def dequantized_weights(l1, l2, device):
    w1 = torch.stack([dequantize_fp4_ue8m0(l1[0][j], l1[1][j]) for j in range(l1[0].shape[0])]).to(device)
    w2 = torch.stack([dequantize_fp4_ue8m0(l2[0][j], l2[1][j]) for j in range(l2[0].shape[0])]).to(device)
    return w1, w2


# ------------------------------------------------------------------------------------------------ the proof
class Layer:
    def __init__(self, shape: ll.LayerShape, args):
        import torch.distributed as dist
        from gc_moe.runtime import jit
        from gc_moe.runtime.partition import get_partitions
        from gc_moe.runtime.workspace import SymmetricWorkspace

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
        self.shape, self.args = shape, args
        self.parts = get_partitions()
        self.dispatch_ctas = self.parts.describe()["comm_sms"]
        self.finalize_ctas = min(self.parts.describe()["compute_sms"], 64)
        self.ws = SymmetricWorkspace(ll.layer_layout(shape))
        ll.initialize_state(self.ws)
        self.k_dispatch = jit.load_kernel(dispatch.variant(), "sm_90a")
        self.k_finalize = jit.load_kernel(finalize.variant(), "sm_90a")
        self.k_probe = jit.load_kernel(dispatch.consumer_probe_variant(), "sm_90a")
        self.k_w1 = self.k_w2 = None
        if args.role2 in ("kernel", "both"):
            self.k_w1 = jit.load_kernel(gg.variant("w1", args.block_n, ring_consumer=True), "sm_90a")
            self.k_w2 = jit.load_kernel(gg.variant("w2", args.block_n, ring_consumer=True), "sm_90a")
        self.scratch = torch.zeros(shape.combine_lanes * shape.capacity + 1, shape.hidden, dtype=torch.bfloat16,
                                   device="cuda")
        torch.cuda.synchronize()

    def standin(self, w1f, w2f):
        ws = self.ws
        partials, valid = grouped_ffn_standin(ws.ring_act, ws.ring_scale, ws.expert_offsets, ws.routing_weight,
                                              w1f, w2f)
        scatter_partials(partials, valid, ws.dest_row, self.scratch)
        ws.combine.view(-1, self.shape.hidden).copy_(self.scratch[:-1])

    def graphs(self, y, num_tokens):
        from gc_moe.runtime.graph import ChildGraph

        timeout = self.args.timeout_s
        g1 = ChildGraph()
        g1.add_kernel("dispatch", self.k_dispatch, self.dispatch_ctas,
                      dispatch.dispatch_args(self.ws, self.shape, num_tokens, 0, timeout), self.parts.comm_context)
        g3 = ChildGraph()
        g3.add_kernel("finalize", self.k_finalize, self.finalize_ctas,
                      finalize.finalize_args(self.ws, self.shape, y, num_tokens, self.dispatch_ctas, timeout),
                      self.parts.compute_context)
        return g1, g3


def run_consumer_probe(layer, num_tokens, replays, offsets):
    """Role1 and the ring-consumer probe (what role2 adds) as concurrent roots in their two partitions, role3
    after both: the probe acquires each tile's ring blocks while role1 fills them. Returns mismatching `seen`
    words after the last replay (zeroed inside the captured graph before each replay)."""
    from gc_moe.runtime.graph import ChildGraph
    from gc_moe.runtime.launch import i32, i64, ptr

    shape, ws = layer.shape, layer.ws
    y = torch.empty(num_tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    seen = torch.zeros(shape.ring_rows, dtype=torch.int32, device="cuda")
    timeout = int(layer.args.timeout_s * 1e9)
    tiles = -(-shape.capacity * shape.num_ranks // shape.block_m)
    g = ChildGraph()
    d = g.add_kernel("dispatch", layer.k_dispatch, layer.dispatch_ctas,
                     dispatch.dispatch_args(ws, shape, num_tokens, 0, layer.args.timeout_s), layer.parts.comm_context)
    ring_ready = ws.control.data_ptr() + 4 * ll.RING_READY
    c = g.add_kernel("probe", layer.k_probe, (tiles, shape.local_experts, 1),
                     [ptr(ring_ready), ptr(ws.l1_full_count), ptr(ws.expert_offsets), ptr(seen),
                      i32(shape.block_m), i32(shape.ring_blocks), i32(shape.block_m), i64(timeout)],
                     layer.parts.compute_context)
    g.add_kernel("finalize", layer.k_finalize, layer.finalize_ctas,
                 finalize.finalize_args(ws, shape, y, num_tokens, layer.dispatch_ctas, layer.args.timeout_s),
                 layer.parts.compute_context, depends_on=[d, c])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        seen.zero_()
        g.attach_to_capture(torch.cuda.current_stream())
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    want = torch.tensor(dispatch.expected_probe_rows(offsets, shape.block_m, shape.ring_rows), dtype=torch.int32)
    return int((seen.cpu() != want).sum())


def check_ring(layer, twin, rows):
    """Counts of mismatching elements between the ring role1 filled and the host twin."""
    ws, shape = layer.ws, layer.shape
    got_src = ws.ring_source[:rows].cpu()
    order = torch.argsort(got_src)  # the twin's rows are sorted by source word within an (expert, rank) segment
    want_order = torch.argsort(twin["ring_source"])
    bad = {
        "expert_offsets": int((ws.expert_offsets.cpu() != twin["expert_offsets"]).sum()),
        "ring_source": int((got_src[order] != twin["ring_source"][want_order]).sum()),
        "ring_act": int((ws.ring_act[:rows].cpu().view(torch.uint8)[order]
                         != twin["ring_act"].view(torch.uint8)[want_order]).sum()),
        "ring_scale": int((ws.ring_scale[:rows].cpu()[order] != twin["ring_scale"][want_order]).sum()),
        "routing_weight": int((ws.routing_weight[:rows].cpu()[order] != twin["routing_weight"][want_order]).sum()),
        "dest_row": int((ws.dest_row[:rows].cpu()[order] != twin["dest_row"][want_order]).sum()),
        "l1_full_count": int((ws.l1_full_count.cpu() != twin["l1_full_count"]).sum()),
    }
    # rows stay inside their expert's segment
    offsets = twin["expert_offsets"].tolist()
    for j in range(shape.local_experts):
        a, b = offsets[j], offsets[j + 1]
        got = sorted(ws.ring_source[a:b].cpu().tolist())
        bad["segments"] = bad.get("segments", 0) + int(got != sorted(twin["ring_source"][a:b].tolist()))
    return bad


def run_point(layer, num_tokens, w, replays):
    from gc_moe import metrics
    from gc_moe.cases import make_routing, random_activations
    from gc_moe.reference import moe_reference

    shape, ws, dev = layer.shape, layer.ws, torch.device("cuda")
    x, x_sf = random_activations(num_tokens, shape.hidden, seed=100 + num_tokens)
    idx, wts = make_routing("uniform", num_tokens, shape.num_experts, shape.topk, seed=200 + num_tokens)
    ws.x[:num_tokens].copy_(x)
    ws.x_sf[:num_tokens].copy_(x_sf)
    ws.topk_idx[:num_tokens].copy_(idx)
    ws.topk_weights[:num_tokens].copy_(wts)
    y = torch.full((num_tokens, shape.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    g1, g3 = layer.graphs(y, num_tokens)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    before = ws.control.cpu().tolist()  # cumulative words: this point reports its own increments

    # 1. role1 alone, then the ring against the twin
    g1.launch(stream.cuda_stream)
    torch.cuda.synchronize()
    twin = dispatch.reference_dispatch(shape, 0, [x], [x_sf], [idx], [wts])
    rows = int(twin["expert_offsets"][-1])
    ring_bad = check_ring(layer, twin, rows)
    # 2. the rest of the layer eagerly
    layer.standin(*w["dev"])
    g3.launch(stream.cuda_stream)
    torch.cuda.synchronize()
    y_eager = y.clone()
    pad = shape.ring_rows - rows
    twin_dev = {k: v.to(dev) for k, v in twin.items()}
    partials, valid = grouped_ffn_standin(
        torch.cat([twin_dev["ring_act"], torch.zeros(pad, shape.hidden, dtype=torch.float8_e4m3fn, device=dev)]),
        torch.cat([twin_dev["ring_scale"], torch.ones(pad, shape.hidden // 128, device=dev)]),
        twin_dev["expert_offsets"], torch.cat([twin_dev["routing_weight"], torch.zeros(pad, device=dev)]),
        *w["dev"])
    scratch = torch.zeros_like(layer.scratch)
    scatter_partials(partials, valid, torch.cat([twin_dev["dest_row"], torch.zeros(pad, dtype=torch.int32,
                                                                                   device=dev)]), scratch)
    combine_twin = scratch[:-1].view(shape.combine_lanes, shape.capacity, shape.hidden)
    y_twin = finalize.combine_reference(combine_twin, idx.to(dev), num_tokens, shared=False)
    # one BF16 rounding of each partial (the stand-in's matmuls may tile the twin's rows differently)
    ulp = finalize.combine_reference(combine_twin.abs(), idx.to(dev), num_tokens, shared=False).float() * 2.0 ** -7
    twin_bad = int(((y_eager.float() - y_twin.float()).abs() > ulp).sum()) + int((~torch.isfinite(y_eager)).sum())
    ref = moe_reference(x, x_sf, idx, wts, *w["canonical"], activation_alpha=ALPHA, activation_clamp=CLAMP)
    cos = metrics.cosine(y_eager.cpu().float(), ref.float())
    diff = metrics.processed_diff(y_eager.cpu().float(), ref.float())

    # 3. one capture, many replays, every replay compared on the device
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        cap = torch.cuda.current_stream()
        g1.attach_to_capture(cap)
        layer.standin(*w["dev"])
        g3.attach_to_capture(cap)
    torch.cuda.synchronize()
    mismatched = torch.zeros((), dtype=torch.int64, device=dev)
    worst = torch.zeros((), dtype=torch.float64, device=dev)  # largest processed difference graph vs eager
    e64 = y_eager.double()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
        mismatched += (y.view(torch.int16) != y_eager.view(torch.int16)).any().to(torch.int64)
        g64 = y.double()
        energy = ((g64 * g64).sum() + (e64 * e64).sum()).clamp_min(1e-300)
        worst = torch.maximum(worst, 1 - 2 * (g64 * e64).sum() / energy)
    end.record()
    torch.cuda.synchronize()
    probe_bad = run_consumer_probe(layer, num_tokens, replays, twin["expert_offsets"].tolist())
    c = [now - then for now, then in zip(ws.control.cpu().tolist(), before)]
    return {
        "tokens": num_tokens, "rows": rows, "ring_mismatches": ring_bad, "twin_mismatches": twin_bad,
        "cosine": cos, "processed_diff": diff, "replays": replays, "mismatched_replays": int(mismatched),
        "max_repeat_diff": float(worst),
        "us_per_replay_with_check": 1e3 * start.elapsed_time(end) / max(replays, 1),
        "arrival_errors": c[ll.ARRIVAL_ERRORS], "ring_overflows": c[ll.RING_OVERFLOWS],
        "replays_finalized": c[ll.REPLAYS], "received_rows": c[ll.RECEIVED_ROWS],
        "expected_received_rows": rows * (2 * replays + 1), "probe_mismatches": probe_bad,
    }


def layer_nodes(layer, y, num_tokens, mats, nodes=("dispatch", "w1", "w2", "finalize")):
    """A child graph of the layer's nodes named in `nodes` with role2 = the ring-consumer grouped GEMM:
    dispatch (communication context) and W1 (compute) are roots, W2 follows W1, finalize follows dispatch
    and W2 (of the nodes present)."""
    from gc_moe.runtime.graph import ChildGraph

    shape, ws, args = layer.shape, layer.ws, layer.args
    cap = shape.capacity * shape.num_ranks  # the most grouped rows one expert can take
    g, made = ChildGraph(), {}
    if "dispatch" in nodes:
        made["dispatch"] = g.add_kernel("dispatch", layer.k_dispatch, layer.dispatch_ctas,
                                        dispatch.dispatch_args(ws, shape, num_tokens, 0, args.timeout_s),
                                        layer.parts.comm_context)
    if "w1" in nodes:
        grid, a = gg.w1_launch(layer.k_w1, mats.l1, ws.ring_act, ws.ring_scale, ws.expert_offsets,
                               ws.routing_weight, ws.l2_act, ws.l2_scale, cap,
                               gg.ring_args_w1(ws, shape, args.timeout_s))
        made["w1"] = g.add_kernel("w1", layer.k_w1, grid, a, layer.parts.compute_context)
    if "w2" in nodes:
        grid, a = gg.w2_launch(layer.k_w2, mats.l2, ws.l2_act, ws.l2_scale, ws.expert_offsets, ws.dest_row,
                               ws.combine.view(-1, shape.hidden), cap, gg.ring_args_w2(ws, shape))
        made["w2"] = g.add_kernel("w2", layer.k_w2, grid, a, layer.parts.compute_context,
                                  depends_on=[made["w1"]] if "w1" in made else [])
    if "finalize" in nodes:
        g.add_kernel("finalize", layer.k_finalize, layer.finalize_ctas,
                     finalize.finalize_args(ws, shape, y, num_tokens, layer.dispatch_ctas, args.timeout_s),
                     layer.parts.compute_context, depends_on=[made[n] for n in ("dispatch", "w2") if n in made])
    return g


def run_kernel_point(layer, num_tokens, w, replays):
    """Steps 6-8: the layer with the ring-consumer grouped GEMM as role2."""
    from gc_moe import metrics
    from gc_moe.cases import make_routing, random_activations
    from gc_moe.reference import moe_reference

    shape, ws, dev = layer.shape, layer.ws, torch.device("cuda")
    x, x_sf = random_activations(num_tokens, shape.hidden, seed=100 + num_tokens)
    idx, wts = make_routing("uniform", num_tokens, shape.num_experts, shape.topk, seed=200 + num_tokens)
    ws.x[:num_tokens].copy_(x)
    ws.x_sf[:num_tokens].copy_(x_sf)
    ws.topk_idx[:num_tokens].copy_(idx)
    ws.topk_weights[:num_tokens].copy_(wts)
    ws.l2_act.view(torch.uint8).fill_(0x7F)  # NaN: an element W1 does not write shows
    ws.l2_scale.fill_(float("nan"))
    ws.combine.fill_(float("nan"))
    y = torch.full((num_tokens, shape.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    before = ws.control.cpu().tolist()

    # 6. dispatch and W1 as concurrent roots, then the ring, l1_empty_count and W1's output
    layer_nodes(layer, y, num_tokens, w["sm90"], ("dispatch", "w1")).launch(stream.cuda_stream)
    torch.cuda.synchronize()
    twin = dispatch.reference_dispatch(shape, 0, [x], [x_sf], [idx], [wts])
    rows = int(twin["expert_offsets"][-1])
    offsets = twin["expert_offsets"].tolist()
    ring_bad = check_ring(layer, twin, rows)
    want_empty = gg.expected_l1_empty_counts(offsets, layer.args.block_n, shape.block_m, shape.ring_blocks,
                                             w["sm90"].l1.rows // gg.ROWS_PER_CTA)
    empty_bad = int((ws.l1_empty_count.cpu() != torch.tensor(want_empty, dtype=torch.int32)).sum())
    parts = w1_float32_parts(ws.ring_act[:rows], ws.ring_scale[:rows], ws.expert_offsets, ws.routing_weight[:rows],
                             w["kernel_dev"][0])
    w1 = w1_report(ws.l2_act[:rows], ws.l2_scale[:rows], parts)
    # 7. W2 and finalize after it
    layer_nodes(layer, y, num_tokens, w["sm90"], ("w2", "finalize")).launch(stream.cuda_stream)
    torch.cuda.synchronize()
    y_eager = y.clone()
    y_want, tol = combine_from_intermediate(ws.l2_act[:rows], ws.l2_scale[:rows], ws.expert_offsets,
                                            ws.dest_row[:rows], w["kernel_dev"][1], idx, shape, num_tokens)
    y_bad = int(((y_eager.float() - y_want).abs() > tol).sum()) + int((~torch.isfinite(y_eager)).sum())
    ref = moe_reference(x, x_sf, idx, wts, *w["canonical"], activation_alpha=ALPHA, activation_clamp=CLAMP)
    cos = metrics.cosine(y_eager.cpu().float(), ref.float())
    diff = metrics.processed_diff(y_eager.cpu().float(), ref.float())

    # 8. the whole layer as one graph, replayed
    full = layer_nodes(layer, y, num_tokens, w["sm90"])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        full.attach_to_capture(torch.cuda.current_stream())
    torch.cuda.synchronize()
    mismatched = torch.zeros((), dtype=torch.int64, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
        mismatched += (y.view(torch.int16) != y_eager.view(torch.int16)).any().to(torch.int64)
    end.record()
    torch.cuda.synchronize()
    c = [now - then for now, then in zip(ws.control.cpu().tolist(), before)]
    return {
        "tokens": num_tokens, "rows": rows, "ring_mismatches": ring_bad, "l1_empty_mismatches": empty_bad,
        **w1, "y_element_errors": y_bad, "cosine": cos, "processed_diff": diff,
        "replays": replays, "mismatched_replays": int(mismatched),
        "us_per_replay_with_check": 1e3 * start.elapsed_time(end) / max(replays, 1),
        "arrival_errors": c[ll.ARRIVAL_ERRORS], "ring_overflows": c[ll.RING_OVERFLOWS],
        "replays_finalized": c[ll.REPLAYS], "received_rows": c[ll.RECEIVED_ROWS],
        "expected_received_rows": rows * (replays + 1),
    }


def kernel_point_passes(r) -> bool:
    return (sum(r["ring_mismatches"].values()) == 0 and r["l1_empty_mismatches"] == 0 and r["w1_element_errors"] == 0
            and r["y_element_errors"] == 0 and r["mismatched_replays"] == 0 and r["cosine"] >= 0.97
            and r["processed_diff"] <= 0.002 and r["arrival_errors"] == 0 and r["ring_overflows"] == 0
            and r["replays_finalized"] == r["replays"] + 1 and r["received_rows"] == r["expected_received_rows"])


def main() -> int:
    from gc_moe.cases import random_moe_weights

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replays", type=int, default=1000)
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--block-m", type=int, default=8)
    p.add_argument("--block-n", type=int, default=8, choices=gg.BLOCK_N_CHOICES,
                   help="token tile of the grouped GEMM (role2 kernel)")
    p.add_argument("--role2", choices=("standin", "kernel", "both"), default="both",
                   help="role2 as the torch stand-in (steps 1-5), the ring-consumer grouped GEMM (6-8), or both")
    p.add_argument("--timeout-s", type=float, default=10.0, help="bounded waits (the operator's default: 3600)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shape = ll.LayerShape(1, args.experts, args.topk, args.hidden, args.intermediate, max(tokens), args.block_m)
    l1, l2 = random_moe_weights(args.experts, args.hidden, args.intermediate, seed=5)
    w = {"canonical": (l1, l2), "dev": dequantized_weights(l1, l2, "cuda")}
    layer = Layer(shape, args)
    if args.role2 in ("kernel", "both"):
        from gc_moe.weights import sm90 as wsm90

        dev_l1 = tuple(t.to("cuda") for t in l1)
        dev_l2 = tuple(t.to("cuda") for t in l2)
        w["sm90"] = wsm90.transform(dev_l1, dev_l2)
        # the weights as the kernel holds them (the window may shift blocks below its base)
        w["kernel_dev"] = dequantized_weights(*wsm90.inverse(w["sm90"]), "cuda")
    results, kernel_results, started = [], [], time.time()
    for t in tokens:
        if args.role2 in ("standin", "both"):
            try:
                results.append(run_point(layer, t, w, args.replays))
            except Exception as err:  # noqa: BLE001  (one point's failure is reported, the others still run)
                results.append({"tokens": t, "error": f"{type(err).__name__}: {err}"})
            print(json.dumps(results[-1]), flush=True)
        if args.role2 in ("kernel", "both"):
            try:
                kernel_results.append(run_kernel_point(layer, t, w, args.replays))
            except Exception as err:  # noqa: BLE001
                kernel_results.append({"tokens": t, "error": f"{type(err).__name__}: {err}"})
            print(json.dumps(kernel_results[-1]), flush=True)
    ok = True
    print(f"\n{'T':>5} {'rows':>6} {'ring':>6} {'twin':>6} {'cosine':>9} {'pdiff':>9} {'replays':>8} "
          f"{'bad':>5} {'rdiff':>8} {'us/rep':>8} {'arrive':>6} {'probe':>5}")
    for r in results:
        if "error" in r:
            ok = False
            print(f"{r['tokens']:>5} ERROR {r['error']}")
            continue
        ring = sum(r["ring_mismatches"].values())
        good = (ring == 0 and r["twin_mismatches"] == 0 and r["mismatched_replays"] == 0 and r["cosine"] >= 0.97
                and r["processed_diff"] <= 0.002 and r["arrival_errors"] == 0 and r["ring_overflows"] == 0
                and r["replays_finalized"] == 2 * r["replays"] + 1 and r["probe_mismatches"] == 0
                and r["received_rows"] == r["expected_received_rows"])
        ok &= good
        print(f"{r['tokens']:>5} {r['rows']:>6} {ring:>6} {r['twin_mismatches']:>6} {r['cosine']:>9.6f} "
              f"{r['processed_diff']:>9.2e} {r['replays']:>8} {r['mismatched_replays']:>5} {r['max_repeat_diff']:>8.1e} "
              f"{r['us_per_replay_with_check']:>8.1f} {r['arrival_errors']:>6} {r['probe_mismatches']:>5}  "
              f"{'PASS' if good else 'FAIL'}")
    if kernel_results:
        print(f"\nrole2 = ring-consumer grouped GEMM (block_n {args.block_n})\n{'T':>5} {'rows':>6} {'ring':>6} "
              f"{'empty':>6} {'w1 el':>6} {'strict':>6} {'y el':>6} {'cosine':>9} {'pdiff':>9} {'replays':>8} {'bad':>5} "
              f"{'us/rep':>8} {'arrive':>6}")
    for r in kernel_results:
        if "error" in r:
            ok = False
            print(f"{r['tokens']:>5} ERROR {r['error']}")
            continue
        good = kernel_point_passes(r)
        ok &= good
        print(f"{r['tokens']:>5} {r['rows']:>6} {sum(r['ring_mismatches'].values()):>6} {r['l1_empty_mismatches']:>6} "
              f"{r['w1_element_errors']:>6} {r['w1_strict_errors']:>6} {r['y_element_errors']:>6} {r['cosine']:>9.6f} {r['processed_diff']:>9.2e} "
              f"{r['replays']:>8} {r['mismatched_replays']:>5} {r['us_per_replay_with_check']:>8.1f} "
              f"{r['arrival_errors']:>6}  {'PASS' if good else 'FAIL'}")
    print(f"partition: {layer.parts.describe()}, dispatch CTAs {layer.dispatch_ctas}, finalize CTAs "
          f"{layer.finalize_ctas}, {time.time() - started:.1f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_layer_proof.json").write_text(json.dumps(results, indent=1))
        if kernel_results:
            (args.out / "device_layer_proof_kernel.json").write_text(json.dumps(kernel_results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
