"""Stand-alone check and benchmark of the SM90 FP8xFP4 grouped GEMM (W1 + SwiGLU + requant, then W2).

Tokens are grouped by torch (no dispatch, no ring). For each model's per-rank slice (E/8 local experts)
and each token count T per rank, 8T tokens are routed top-k uniformly over all E experts and the pairs
landing on the local experts form the grouped rows, as on rank 0 of an 8-way expert-parallel layer.

Check (--check): outputs poisoned with NaN first; the W1 output (dequantized) and the W2 partials are
compared with a float32 oracle built from the canonical MXFP4 weights (original row order); every
element must be written and finite; cosine >= 0.999 and processed difference <= 0.002.

Timing (--time): a CUDA graph of [W1, W2] replayed `replays` times per window (CUDA events), `windows`
windows, the median reported. `cold` mode puts an L2 flush before the two kernels in the graph and subtracts
the flush-only graph's time, so every replay reads its weights from HBM. The flush (--flush) READS 256 MB by
default: a write flush (a 256 MB memset, the earlier method, `--flush write`; `both` times the two) leaves ~50 MB
of dirty lines in the L2 whose write-back then competes with W1's reads, which inflated the cold times. The floor is the
bytes of the active experts (FP4 W1 + W2 + repacked scales, read once) over the read bandwidth of a
large `amax` measured in the same run. `--read-ref` also times, per point and under the same protocol (read flush,
graph replay, the flush-only graph subtracted), single reads of exactly the point's bytes with the stream-read kernel
(kernels/sm90/stream_read.py, one CTA per SM keeping 128 KB of bulk copies in flight: `stream_read_us` with static
ranges, `stream_read_dyn_us` with chunks claimed by ticket, each with its CTAs' end spread; a torch `amax` over the
same bytes was 7-26 us over the floor and not monotonic in the size, docs step 62), so the time over the floor splits into what any one streaming launch pays (launch, ramp to full
bandwidth, drain) and what the GEMM adds.

`--fold-scales` runs the folded-scale variants (K32 scale in the decode, `GemmConfig.fold_scales`) beside the
configured ones at every point, on the same inputs: each point gives one row per variant set (`tag`; the folded set's ends in `_fold`).
`--table-decode` adds the byte-permute decode of the folded scales (`GemmConfig.table_decode`, weights in the
"table" nibble order) as `tab` (token tiles up to 32) and `tab64` (up to 64). An `--extra-set` may name
`max_block_n` beside its knobs (that set's largest token tile).

Run on the GPU machine with the cubins built on the build machine and copied over:
  python scripts/bench_grouped_gemm_sm90.py --build-only            # here: fills .cubin-cache
  python scripts/bench_grouped_gemm_sm90.py --check --time          # GPU machine (with .cubin-cache copied over)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from gc_moe.formats import dequantize_fp4_ue8m0, dequantize_fp8_k128, pack_ue8m0, quantize_fp8_k128
from gc_moe.weights import sm90 as wsm90

MODELS = {  # per-rank slices of the paper's Table 4 models on 8 ranks
    "deepseek-v4.1-flash": {"hidden": 5120, "inter": 2304, "experts": 384, "topk": 6},
    "glm-5.2": {"hidden": 6144, "inter": 2048, "experts": 256, "topk": 8},
}
RANKS = 8
# --auto-set knobs for the pair kernel alone (the pseudo-knob pair: run it where tile_knobs picks stream-K)
PAIR_ONLY_KNOBS = ("pair", "publisher_warp")
# --pair's sets: the pair kernel's knobs (kernels.sm90.stream_pair.variant); the traced ones with --trace only
PAIR_SETS = {"pair": {}, "pair_lean": {"lean_epilogue": True}, "pair_wf": {"words_first": True},
             "pair_pub": {"publisher_warp": True}, "pair_pubwf": {"publisher_warp": True, "words_first": True},
             "pair_t": {"trace": True}, "pair_tf": {"trace": True, "words_first": True},
             "pair_tpubwf": {"trace": True, "publisher_warp": True, "words_first": True}}


def block_n_for(max_rows: int, max_block_n: int = 32, tiles=(8, 16, 32, 64)) -> int:
    """Token tile: the smallest of `tiles` (a set's built tiles, up to max_block_n) that covers the busiest expert,
    else the largest with more token tiles (their CTAs run side by side and share the weights through L2)."""
    fitting = [bn for bn in sorted(tiles) if bn <= max_block_n]
    return next((bn for bn in fitting if max_rows <= bn), fitting[-1])


def random_mxfp4(e: int, rows: int, cols: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weights: uniform codes, UE8M0 exponents spread over 2^-9..2^-4 (weights ~ 1e-2)."""
    packed = torch.randint(-128, 128, (e, rows, cols // 2), dtype=torch.int8, generator=gen, device=device)
    exps = torch.randint(118, 124, (e, rows, cols // 32), dtype=torch.uint8, generator=gen, device=device)
    return packed, pack_ue8m0(exps)


def route(tokens_per_rank: int, model: dict, gen: torch.Generator, device):
    """Rank 0's grouped pairs: (expert_offsets int32 [E_loc+1], pair token, pair slot, pair weight)."""
    t_total = tokens_per_rank * RANKS
    e, k, e_loc = model["experts"], model["topk"], model["experts"] // RANKS
    scores = torch.rand(t_total, e, generator=gen, device=device)
    idx = scores.topk(k, dim=1).indices  # k distinct experts per token
    w = torch.rand(t_total, k, generator=gen, device=device) + 0.1
    w = w / w.sum(1, keepdim=True)
    token = torch.arange(t_total, device=device).repeat_interleave(k)
    slot = torch.arange(k, device=device).repeat(t_total)
    expert = idx.flatten()
    local = expert < e_loc
    token, slot, expert, weight = token[local], slot[local], expert[local], w.flatten()[local]
    order = torch.argsort(expert * (t_total * k) + token * k + slot)
    token, slot, expert, weight = token[order], slot[order], expert[order], weight[order]
    counts = torch.bincount(expert, minlength=e_loc)
    offsets = torch.zeros(e_loc + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0)
    return offsets, token, slot, expert, weight, counts


def metrics(y: torch.Tensor, ref: torch.Tensor) -> dict:
    y, ref = y.double().flatten(), ref.double().flatten()
    dot = (y * ref).sum()
    return {
        "cosine": float(dot / (y.norm() * ref.norm()).clamp_min(1e-300)),
        "diff": float(1 - 2 * dot / (y.square().sum() + ref.square().sum()).clamp_min(1e-300)),
        "finite": bool(torch.isfinite(y).all()),
    }


class Point:
    """One (model, tokens) point: inputs, outputs, launches."""

    def __init__(self, name, model, tokens, weights, canon, kernels, gen, device, max_block_n=32):
        """weights: {nibble order: weights.sm90.Sm90Weights} (`grouped_gemm.nibble_order` names the one a kernel
        reads)."""
        self.name, self.model, self.tokens = name, model, tokens
        self.weights_by_order, self.canon = weights, canon
        self.weights = weights["lane"]
        h, inter = model["hidden"], model["inter"]
        self.offsets, self.token, self.slot, self.expert, self.rw, self.counts = route(tokens, model, gen, device)
        self.rows = int(self.offsets[-1])
        self.active = int((self.counts > 0).sum())
        self.capacity = max(1, int(self.counts.max()))
        self.max_block_n = max_block_n
        x = torch.randn(max(self.rows, 1), h, generator=gen, device=device)
        self.act, self.act_scale = quantize_fp8_k128(x)
        self.mid = torch.empty(max(self.rows, 1), inter, dtype=torch.float8_e4m3fn, device=device)
        self.mid_scale = torch.empty(max(self.rows, 1), inter // 128, dtype=torch.float32, device=device)
        self.out = torch.empty(max(self.rows, 1), h, dtype=torch.bfloat16, device=device)
        self.dest = torch.arange(max(self.rows, 1), dtype=torch.int32, device=device)
        self.rw = self.rw.float().contiguous() if self.rows else torch.ones(1, device=device)
        self.device = device
        self.splits = {}  # kernels that split K: their partials and counts, one pair per kernel
        self.pdl = False  # W2 launched programmatically after W1 where it can be (a set's pseudo-knob `pdl`)
        self.pair = None  # (the stream-K pair kernel, its buffers): W1 and W2 as one launch (`--pair`)
        self.ready = None  # a handover set's hand-over words (one buffer for its W1 and W2)
        self.use(kernels)

    def use(self, kernels, max_block_n=None):
        """Run with this variant set's kernels: {(role, block_n): loaded kernel}, token tiles up to max_block_n
        (None: the point's), on the weights in the nibble order the kernels read."""
        from gc_moe.kernels.sm90.grouped_gemm import GemmConfig, handover_words, nibble_order, split_buffers

        self.block_n = block_n_for(self.capacity, max_block_n or self.max_block_n, {bn for _, bn in kernels})
        self.k1, self.k2 = kernels[("w1", self.block_n)], kernels[("w2", self.block_n)]
        self.weights = self.weights_by_order[nibble_order(GemmConfig(**dict(self.k1.entry.variant.params)))]
        for k, mat in ((self.k1, self.weights.l1), (self.k2, self.weights.l2)):
            if k.name not in self.splits:  # allocated before any capture
                self.splits[k.name] = split_buffers(k, mat, self.capacity, self.device)
        self.split1, self.split2 = self.splits[self.k1.name], self.splits[self.k2.name]
        self.ready = None
        if GemmConfig(**dict(self.k1.entry.variant.params)).handover:  # allocated before any capture
            self.ready = self.splits.setdefault(("ready", self.k1.name), handover_words(
                self.weights.l2.num_experts, self.capacity, self.model["inter"], self.device))

    def poison(self):
        self.mid.view(torch.uint8).fill_(0x7F)  # E4M3FN NaN
        self.mid_scale.fill_(float("nan"))
        self.out.fill_(float("nan"))

    def launch(self, stream, sync_each: bool = False, roles=("w1", "w2")):
        """roles: the kernels to launch (the per-role times launch one; W2 then reads the last W1's output).
        With self.pdl and a stream_k W2 after its W1, W2 goes out programmatically (launch_w2(programmatic=True))."""
        from gc_moe.kernels.sm90.grouped_gemm import launch_w1, launch_w2

        if self.pair is not None:
            from gc_moe.kernels.sm90.stream_pair import launch_pair

            if tuple(roles) != ("w1", "w2"):
                raise ValueError("the pair kernel runs W1 and W2 together: no per-role launch")
            kernel, buffers = self.pair
            launch_pair(kernel, self.weights.l1, self.weights.l2, self.act, self.act_scale, self.offsets, self.rw,
                        self.mid, self.mid_scale, self.dest, self.out, self.capacity, buffers, stream)
            return
        if self.ready is not None and tuple(roles) != ("w1", "w2"):
            raise ValueError("a handover set's W1 and W2 run as a pair (W1 alone leaves the hand-over words set)")
        if "w1" in roles:
            launch_w1(self.k1, self.weights.l1, self.act, self.act_scale, self.offsets, self.rw, self.mid,
                      self.mid_scale, self.capacity, stream, split=self.split1, ready=self.ready)
            if sync_each:
                torch.cuda.synchronize()
                print("# w1 ran", flush=True)
        if "w2" in roles:
            programmatic = self.programmatic_w2() and "w1" in roles and not sync_each
            launch_w2(self.k2, self.weights.l2, self.mid, self.mid_scale, self.offsets, self.dest, self.out,
                      self.capacity, stream, split=self.split2, programmatic=programmatic, ready=self.ready)

    def programmatic_w2(self) -> bool:
        """W2 goes out programmatically after W1: the set asks for it (pdl) and W2 is a stream-K loop."""
        from gc_moe.kernels.sm90.grouped_gemm import GemmConfig

        return self.pdl and GemmConfig(**dict(self.k2.entry.variant.params)).stream_k

    def token_tiles(self) -> dict:
        """{tile: the experts' token tiles at that tile}: what a tile rule weighs (experts above a tile take more)."""
        return {bn: sum(-(-int(c) // bn) for c in self.counts.tolist()) for bn in (8, 16, 24, 32, 64, 96)}

    def weight_bytes(self) -> int:
        """Active experts' repacked W1 + W2 codes and scale bytes, each read once."""
        return self.role_bytes("w1") + self.role_bytes("w2")

    def role_bytes(self, role: str) -> int:
        """One role's share of weight_bytes (its codes, scale bytes and one scale word per active expert)."""
        m = self.weights.l1 if role == "w1" else self.weights.l2
        return self.active * (m.codes[0].numel() + m.scales[0].numel() + 4)

    def flops(self) -> float:
        h, inter = self.model["hidden"], self.model["inter"]
        return 2.0 * self.rows * (2 * inter * h + h * inter)

    def check(self) -> dict:
        """Float32 oracle per expert from canonical weights; W1 output and W2 partials compared."""
        (l1p, l1s), (l2p, l2s) = self.canon
        x = dequantize_fp8_k128(self.act, self.act_scale)
        mid = dequantize_fp8_k128(self.mid, self.mid_scale)
        ref_mid = torch.zeros(self.rows, self.model["inter"], device=x.device)
        ref_out = torch.zeros(self.rows, self.model["hidden"], device=x.device)
        ref_out_q = torch.zeros_like(ref_out)
        for e in range(len(self.counts)):
            a, b = int(self.offsets[e]), int(self.offsets[e + 1])
            if a == b:
                continue
            w1 = dequantize_fp4_ue8m0(l1p[e], l1s[e])
            w2 = dequantize_fp4_ue8m0(l2p[e], l2s[e])
            gu = x[a:b] @ w1.T
            inter = self.model["inter"]
            gate, up = gu[:, :inter].clamp(max=10.0), gu[:, inter:].clamp(-10.0, 10.0)
            hmid = gate * torch.sigmoid(gate) * up * self.rw[a:b, None]
            ref_mid[a:b] = hmid
            ref_out[a:b] = hmid @ w2.T
            ref_out_q[a:b] = mid[a:b] @ w2.T  # W2 alone, on the kernel's own requantized input
        r = {"mid": metrics(mid[: self.rows], ref_mid), "out": metrics(self.out[: self.rows].float(), ref_out),
             "out_w2_only": metrics(self.out[: self.rows].float(), ref_out_q)}
        r["ok"] = all(v["finite"] and v["cosine"] >= 0.999 and v["diff"] <= 0.002 for v in r.values())
        return r


def measure_read_bandwidth(device) -> float:
    buf = torch.empty(1 << 30, dtype=torch.float32, device=device).uniform_()
    for _ in range(3):
        buf.amax()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        buf.amax()
    e.record()
    torch.cuda.synchronize()
    bw = buf.numel() * 4 * 10 / (s.elapsed_time(e) * 1e-3)
    del buf
    return bw


def read_flush(flush: torch.Tensor) -> None:
    """The cold timings' L2 flush: a read of the 256 MB flush buffer."""
    torch.amax(flush.view(torch.float16))


def stream_read_refs(nbytes: int, source: torch.Tensor, stream, flush, replays: int, windows: int,
                     kernels: dict) -> dict:
    """The stream-read kernels (kernels/sm90/stream_read.py: `stream_read` static ranges, `stream_read_dyn` chunks
    claimed by ticket) over the point's bytes, one CTA per SM: cold time as the GEMM's, then one launch after the
    flush checked (every chunk summed exactly once) and its CTAs' end spread (us)."""
    from gc_moe.kernels.sm90 import stream_read as sr
    from gc_moe.runtime.launch import i32, launch, ptr

    sms = torch.cuda.get_device_properties(source.device).multi_processor_count
    chunks = sr.chunks_for(nbytes)
    if chunks * sr.CHUNK_BYTES > source.numel() * 4:
        raise SystemExit(f"stream read: {chunks * sr.CHUNK_BYTES} bytes, more than the {source.numel() * 4}-byte source")
    words = source.view(torch.int32)[: chunks * sr.CHUNK_BYTES // 4]
    expected = int(words.to(torch.int64).sum().item()) & 0xFFFFFFFF
    out = torch.empty(sms * sr.LANES, dtype=torch.int32, device=source.device)
    times = torch.empty(sms * 2, dtype=torch.int64, device=source.device)
    ticket = torch.zeros(sr.TICKET_WORDS, dtype=torch.int32, device=source.device)
    res = {"stream_read_bytes": chunks * sr.CHUNK_BYTES}

    def flush_only():
        read_flush(flush)

    for tag, kernel in kernels.items():
        def read(kernel=kernel):
            launch(kernel, (sms, 1, 1), [ptr(source), i32(chunks), ptr(ticket), ptr(out), ptr(times)], stream)

        def flush_then_read(read=read):
            flush_only()
            read()

        res[f"{tag}_us"] = (time_graph(flush_then_read, stream, replays, windows)
                            - time_graph(flush_only, stream, replays, windows))
        out.fill_(-1)
        with torch.cuda.stream(stream):
            flush_then_read()
        stream.synchronize()
        got = int(out.to(torch.int64).sum().item()) & 0xFFFFFFFF
        if got != expected or int(ticket.abs().sum().item()) != 0:
            raise SystemExit(f"{tag}: checksum {got:#x} against {expected:#x} over {chunks} chunks, ticket "
                             f"{ticket.tolist()} (must be back at 0): a chunk was missed or read twice")
        t = times.view(sms, 2).cpu()
        res[f"{tag}_end_spread_us"] = round(float(t[:, 1].max() - t[:, 1].min()) / 1e3, 2)
        res[f"{tag}_span_us"] = round(float(t[:, 1].max() - t[:, 0].min()) / 1e3, 2)
    return res


def time_graph(fn, stream, replays: int, windows: int) -> float:
    """Median over windows of (window time / replays), in microseconds."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(replays):
                fn()
    res = []
    for w in range(windows + 2):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        with torch.cuda.stream(stream):  # replay() runs on the current stream: the one the events time
            s.record(stream)
            g.replay()
            e.record(stream)
        e.synchronize()
        if w >= 2:
            res.append(s.elapsed_time(e) * 1e3 / replays)
    res.sort()
    return res[len(res) // 2]


def mma_loops(lines: list[str]) -> list[tuple[int, int, list[str]]]:
    """The SASS loops that issue QGMMA (a backward branch's target to the branch, per-lane BRA.U.ANY loops left out):
    each loop's (first, last instruction index, instructions), outer loops included."""
    import re

    ins = []
    for line in lines:
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if not m or "U.ANY" in text:
            continue
        target = int(m.group(1), 16)
        if target < a and target in index:
            body = [t for _, t in ins[index[target]:i + 1]]
            if any("QGMMA" in t for t in body):
                loops.append((index[target], i, body))
    return loops


def local_ops_in_mma_loops(lines: list[str]) -> int:
    """LDL / STL inside the SASS loops that issue QGMMA: the main loops, which the issue's SASS rule keeps free of
    local memory (an epilogue may spill once per CTA)."""
    import re

    return sum(1 for _, _, body in mma_loops(lines) for t in body if re.search(r"\b(LDL|STL)\b", t))


def innermost_mma_loops(lines: list[str]) -> list[list[str]]:
    """The instructions of each innermost QGMMA loop (one holding no other), in order: a K loop's SASS per trip."""
    loops = mma_loops(lines)
    return [body for a, b, body in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d, _ in loops)]


def k_loop_sizes(lines: list[str]) -> list[int]:
    """Instructions of each innermost QGMMA loop, in order."""
    return [len(body) for body in innermost_mma_loops(lines)]


def serialized_wgmmas(lines: list[str]) -> bool:
    """Whether ptxas serialized the kernel's WGMMAs (its C7513 "wgmma.mma_async instructions are serialized"): every
    QGMMA completes its own group (gsb0) and is waited for to zero before the next QGMMA issues, so no chain of K32
    WGMMAs and no group stays in flight. A kernel with every group a single WGMMA waited at once reads the same."""
    qgmma = [i for i, t in enumerate(lines) if "QGMMA" in t]
    if not qgmma:
        return False
    for i, nxt in zip(qgmma, qgmma[1:] + [len(lines)]):
        if "gsb0" not in lines[i]:
            return False
        waits = [t for t in lines[i + 1:nxt] if "WARPGROUP.DEPBAR" in t]
        if not waits or "0x0" not in waits[0]:
            return False
    return True


def sass_report(gg, jit) -> None:
    """Per variant: registers and stack frame (cubin), QGMMA / LDL / STL counts in the SASS, LDL / STL inside the
    QGMMA loops (must be 0), whether ptxas serialized the WGMMAs (`serialized_wgmmas`) and the K loops' sizes."""
    import shutil
    import subprocess

    from gc_moe.kernels.sm90 import stream_pair

    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    print(f"{'variant':100s} {'regs':>4s} {'frame':>5s} {'QGMMA':>5s} {'LDL':>4s} {'STL':>4s} {'LDS.128':>7s} "
          f"{'UBLKCP':>6s} {'BAR.SYNC':>8s} {'loop L/S':>8s} {'serial':>6s} K loops (instructions per trip)")
    for v in gg.all_variants() + stream_pair.all_variants():
        entry = jit.get_entry(v, "sm_90a")
        lines = subprocess.run([tool, "-sass", str(entry.cubin_path)], capture_output=True, text=True,
                               check=False).stdout.splitlines()

        def count(op: str, lines=lines) -> int:
            return sum(1 for line in lines if f" {op}" in line)

        res = entry.resources.get(entry.entry_name, entry.resources)
        print(f"{v.describe():100s} {res.get('registers', -1):4} {res.get('frame_bytes', -1):5} "
              f"{count('QGMMA'):5d} {count('LDL'):4d} {count('STL'):4d} {count('LDS.128'):7d} "
              f"{count('UBLKCP'):6d} {count('BAR.SYNC'):8d} {local_ops_in_mma_loops(lines):8d} "
              f"{'yes' if serialized_wgmmas(lines) else 'no':>6s} {' '.join(map(str, k_loop_sizes(lines)))}", flush=True)


def occupancy_report(kernel_sets) -> None:
    """CTAs per SM the driver would keep resident for each loaded kernel (its block and shared memory)."""
    from gc_moe.runtime.driver import cu

    for tag, kernels in kernel_sets.items():
        if kernels is None:  # chosen per point from the other sets
            continue
        cells = []
        for (role, bn), k in sorted(kernels.items()):
            shape = k.entry.launch
            try:
                k.ensure_dynamic_smem(shape.dynamic_smem_bytes)
                err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.as_function(), shape.block[0],
                                                                         shape.dynamic_smem_bytes)
                cells.append(f"{role}/{bn}:{n if int(err) == 0 else err}")
            except (RuntimeError, AttributeError, TypeError, ValueError) as exc:  # a diagnostic only
                cells.append(f"{role}/{bn}:? ({type(exc).__name__})")
        print(f"# CTAs per SM, {tag}: " + " ".join(cells), flush=True)


def run_point(pt, row, args, stream, flush, bw) -> bool:
    """Check and/or time one point with the kernels `pt` uses now; fills `row`, returns whether the check passed."""
    if pt.rows == 0:
        row["note"] = "no local pairs"
        return True
    ok = True
    if args.profile:
        for _ in range(2):  # the first pair warms caches and loads; a profiler skips it
            pt.launch(stream)
            stream.synchronize()
        return True
    if args.check:
        pt.poison()
        with torch.cuda.stream(stream):
            pt.launch(stream, sync_each=args.sync_each)
        stream.synchronize()
        c = pt.check()
        row.update(cos_mid=c["mid"]["cosine"], cos_out=c["out"]["cosine"], diff_out=c["out"]["diff"],
                   diff_w2=c["out_w2_only"]["diff"], ok=c["ok"])
        ok = c["ok"]
    if args.time:
        def gemm(pt=pt):
            pt.launch(stream)

        flushes = {"read": lambda: read_flush(flush), "write": flush.zero_}

        def cold_us(method, pt=pt, roles=("w1", "w2")):
            def flush_then_gemm():
                flushes[method]()
                pt.launch(stream, roles=roles)

            flush_only = time_graph(flushes[method], stream, args.replays, args.windows)
            return time_graph(flush_then_gemm, stream, args.replays, args.windows) - flush_only

        warm = time_graph(gemm, stream, args.replays, args.windows)
        methods = ("read", "write") if args.flush == "both" else (args.flush,)
        colds = {m: cold_us(m) for m in methods}
        cold = colds[methods[0]]
        floor = row["bytes"] / bw * 1e6
        row.update(warm_us=warm, cold_us=cold, floor_us=floor, bw_pct=100 * floor / cold,
                   tflops=pt.flops() / (cold * 1e-6) / 1e12, flush=methods[0])
        if "write" in colds and len(colds) > 1:
            row["cold_write_flush_us"] = colds["write"]
        if args.per_role and pt.pair is None and pt.ready is None:  # each kernel alone after the same flush
            row.update(w1_cold_us=cold_us(methods[0], roles=("w1",)), w2_cold_us=cold_us(methods[0], roles=("w2",)))
    if args.trace:
        if pt.pair is None:
            # a handover set's kernels run in pairs only: its trace is the pair's
            row["trace"] = trace_point(pt, stream, flush) if pt.ready is None else {}
            if args.trace_warm and pt.ready is None:
                row["trace_warm"] = trace_point(pt, stream, flush, warm=True)
                for role, tr in row["trace_warm"].items():
                    brief = {k: v for k, v in tr.items() if k != "ctas_by_sm_runs"}
                    print(f"# warm trace {row['tag']} {pt.name} T={pt.tokens} {role}: {json.dumps(brief)}", flush=True)
            pair = pair_trace_point(pt, stream, flush)
        else:  # the pair kernel: traced only in its trace variant
            row["trace"], pair = pair_kernel_trace_point(pt, stream, flush)
        for role, tr in row["trace"].items():
            brief = {k: v for k, v in tr.items() if k != "ctas_by_sm_runs"}  # the per-CTA lists: the JSON only
            print(f"# trace {row['tag']} {pt.name} T={pt.tokens} {role}: {json.dumps(brief)}", flush=True)
        if pair is not None:
            row["pair_trace"] = pair
            brief = {k: v for k, v in pair.items() if k != "runs"}
            print(f"# pair trace {row['tag']} {pt.name} T={pt.tokens}: {json.dumps(brief)}", flush=True)
    return ok


def trace_summary(words, segments, role: str = "") -> dict:
    """Phases of one traced stream_k launch (GemmConfig.trace), in us: the CTAs' start spread, the unit scan, the
    first full stage after it (a stand-alone W1, role "w1": split where its producer's first copies went out, after
    its own scan end), the K loops' time per step and the waits in them (consumers for full stages,
    producer for empty ones), the first full stage of later segments (the ring at a unit switch), the epilogues by
    kind (an owner's includes its wait for the pieces), the CTAs' end spread and the span from the first start to
    the last end."""
    import statistics

    from gc_moe.kernels.sm90 import grouped_gemm as gg

    w = words.view(torch.int64).reshape(-1, gg.TRACE_SLOTS, 2).cpu().tolist()
    per = gg.TRACE_SEGMENT_SLOTS
    tail = 3 + per * gg.TRACE_SEGMENTS
    rows = [(c, w[c]) for c in range(len(segments)) if segments[c]]
    starts = [r[0][0] for _, r in rows]
    t0 = min(starts)
    ends = [max(r[tail][0], r[tail + 1][0]) for _, r in rows]
    ghz = statistics.median((r[tail + 1][1] - r[0][1]) / max(1, r[tail + 1][0] - r[0][0]) for _, r in rows)

    def us(c1, c0):
        return (c1 - c0) / ghz / 1e3
    loop_us = loop_steps = full_wait_us = empty_wait_us = 0.0
    gaps, epi = [], {"whole": [], "owner": [], "piece": []}
    for c, r in rows:
        if r[tail + 2][0] != len(segments[c]):
            raise RuntimeError(f"trace: CTA {c} walked {r[tail + 2][0]} segments, the host expects "
                               f"{len(segments[c])}")
        for i, (steps, kind) in enumerate(segments[c][:gg.TRACE_SEGMENTS]):
            if i == gg.TRACE_SEGMENTS - 1 and len(segments[c]) > gg.TRACE_SEGMENTS:
                break  # the last slots hold the last of several segments
            start, first, done, epi_end = (r[3 + per * i + j][1] for j in range(4))
            full_wait, empty_wait = r[3 + per * i + 4]
            loop_us += us(done, first)
            loop_steps += steps
            full_wait_us += us(full_wait, 0)
            empty_wait_us += us(empty_wait, 0)
            if i > 0:
                gaps.append(us(first, start))
            epi[kind].append(us(epi_end, done))

    def med_max(v):
        return (round(statistics.median(v), 2), round(max(v), 2)) if v else None
    first_copies = {}
    if role == "w1" and all(r[tail + 3][1] for _, r in rows):  # the stand-alone W1's stamp (not the pair kernel's)
        first_copies = {
            # the producer's path from its scan to its first copies out, then the memory's to thread 0's full stage
            "first_issue_us": med_max([us(r[tail + 3][1], r[2][1]) for _, r in rows]),
            "first_landed_us": med_max([us(r[4][1], r[tail + 3][1]) for _, r in rows]),
            # its path in parts (median, max us): the range computed, the first unit looked up, the copies' sources
            # computed, the copies out (each from the one before)
            "first_issue_parts_us": {
                part: med_max([us(r[end][1], r[start][1]) for _, r in rows])
                for part, start, end in (("range", 2, tail + 4), ("lookup", tail + 4, tail + 5),
                                         ("sources", tail + 5, tail + 6), ("copies", tail + 6, tail + 3))},
        }
    return {
        "ctas": len(rows), "ghz": round(ghz, 3), "span_us": round((max(ends) - t0) / 1e3, 2),
        "start_spread_us": round((max(starts) - t0) / 1e3, 2),
        "scan_us": med_max([us(r[1][1], r[0][1]) for _, r in rows]),
        "first_stage_us": med_max([us(r[4][1], r[1][1]) for _, r in rows]), **first_copies,
        "us_per_step": round(loop_us / max(loop_steps, 1), 3), "steps_per_cta": round(loop_steps / len(rows), 1),
        # per step: thread 0's wait for full stages (the data late) and the producer's for empty ones (the
        # consumers late); the first stage's wait of each segment included
        "full_wait_per_step_us": round(full_wait_us / max(loop_steps, 1), 3),
        "empty_wait_per_step_us": round(empty_wait_us / max(loop_steps, 1), 3),
        "switch_wait_us": med_max(gaps), **{f"epilogue_{k}_us": med_max(v) for k, v in epi.items()},
        "end_spread_us": round((max(ends) - min(ends)) / 1e3, 2),
        # {epilogues a CTA ran (whole or owner): [CTAs, their mean end after the median CTA's end, us]}: stream-K
        # shares the steps equally, not the epilogues, and the CTAs with one more end late (docs step 77)
        "end_by_epilogues_us": end_by_epilogues(segments, [c for c, _ in rows], ends),
        # per working CTA: the SM it ran on, its start and end (us after the first start) and its steps, to see
        # whether the late ends sit on the same SMs (or GPCs) from launch to launch
        "ctas_by_sm": [[r[tail + 2][1], round((r[0][0] - t0) / 1e3, 2), round((end - t0) / 1e3, 2),
                        sum(steps for steps, _ in segments[c])] for (c, r), end in zip(rows, ends)],
    }


def end_by_epilogues(segments, ctas, ends) -> dict:
    """{epilogues of kind whole or owner in a CTA's segments: [CTAs, mean end - the median CTA's end in us]}, from
    the CTAs' `ends` in ns (the trace's global timer)."""
    import statistics

    median_end = statistics.median(ends)
    groups = {}
    for c, end in zip(ctas, ends):
        groups.setdefault(sum(kind != "piece" for _, kind in segments[c]), []).append((end - median_end) / 1e3)
    return {n: [len(v), round(statistics.fmean(v), 2)] for n, v in sorted(groups.items())}


def after_read_flush(pt, stream, flush, runs: int, roles=("w1", "w2"), replay: bool = False, warm: bool = False):
    """Launches the point's kernels (`roles`) `runs` times, each after a read flush of the L2 and synchronized:
    yields after each, for the caller to read what the launch stamped. replay: the kernels as one captured graph,
    replayed (a programmatic W2 launched eagerly waits for the host's second launch, 65-240 us after W1 ends, which
    is not what the timed graph replays see). warm: the same launch once more between the flush and the one that
    counts. Its code and data stay cached only where the point's bytes fit the L2: at the models' shapes the weights
    streamed by the first launch evict them again (docs step 68; a --shape below the L2 size is warm)."""
    graph = None
    if replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            pt.launch(stream, roles=roles)
    for run in range(runs):
        with torch.cuda.stream(stream):
            read_flush(flush)
            for _ in range(2 if warm else 1):
                if graph is None:
                    pt.launch(stream, roles=roles)
                else:
                    graph.replay()
        stream.synchronize()
        yield run


def trace_point(pt, stream, flush, runs: int = 3, warm: bool = False) -> dict:
    """Each traced stream_k kernel of the point launched after a read flush `runs` times: the summary of the run
    with the median span (`trace_summary`), with every run's per-CTA (SM, start, end, steps) lists. warm: each
    traced launch right after the same launch (`after_read_flush`)."""
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    out = {}
    for role, kernel, split, mat in (("w1", pt.k1, pt.split1, pt.weights.l1), ("w2", pt.k2, pt.split2, pt.weights.l2)):
        if not dict(kernel.entry.variant.params).get("trace"):
            continue
        ctas, segments = traced_segments(pt, kernel, mat)
        results = [trace_summary(split[0][: ctas * gg.TRACE_SLOTS * 4], segments, role)  # W2 reads W1's last output
                   for _ in after_read_flush(pt, stream, flush, runs, roles=(role,), warm=warm)]
        runs_by_sm = [r.pop("ctas_by_sm") for r in results]  # every run's, in launch order
        results.sort(key=lambda r: r["span_us"])
        out[role] = {**results[len(results) // 2], "ctas_by_sm_runs": runs_by_sm}
    return out


def traced_segments(pt, kernel, mat):
    """(CTAs of the launch, each CTA's stream-K segments) of a traced kernel of the point, as the host partitions
    its units (`grouped_gemm.stream_segments`)."""
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    cfg = gg.GemmConfig(**dict(kernel.entry.variant.params))
    ctas = gg.grid(cfg, mat.rows, mat.num_experts, pt.capacity, gg.device_sms(pt.device))[0]
    units = sum(-(-int(c) // 8) for c in pt.counts.tolist()) * (mat.rows // gg.ROWS_PER_CTA)
    return ctas, gg.stream_segments(units, mat.cols // 128, ctas)


def pair_trace_summary(w1_words, w1_segments, w2_words, w2_segments) -> dict:
    """The W1 -> W2 handover of one traced pair launched with the programmatic W2 (both kernels traced), on the
    %globaltimer axis (us after W1's first CTA start): when W1's CTAs end, when W2's start (and how long after
    the W1 CTA on the same SM ended), when each W2 producer's `griddepcontrol.wait` returned and when its first
    stage was full, against W1's last end; W2's end spread and the pair's span. What the pair loses between the
    two kernels' streaming, next to what each loses alone (`trace_summary`)."""
    import statistics

    from gc_moe.kernels.sm90 import grouped_gemm as gg

    tail = 3 + gg.TRACE_SEGMENT_SLOTS * gg.TRACE_SEGMENTS

    def ctas(words, segments):
        w = words.view(torch.int64).reshape(-1, gg.TRACE_SLOTS, 2).cpu().tolist()
        return [w[c] for c in range(len(segments)) if segments[c]]
    w1, w2 = ctas(w1_words, w1_segments), ctas(w2_words, w2_segments)
    t0 = min(r[0][0] for r in w1)

    def at(ns):
        return round((ns - t0) / 1e3, 2)

    def med_max(v):
        return (round(statistics.median(v), 2), round(max(v), 2)) if v else None
    w1_end = {r[tail + 2][1]: max(r[tail][0], r[tail + 1][0]) for r in w1}  # SM -> its W1 CTA's end
    w1_last = max(w1_end.values())
    w2_start = [r[0][0] for r in w2]
    w2_end = [max(r[tail][0], r[tail + 1][0]) for r in w2]
    after_own_sm = [(r[0][0] - w1_end[r[tail + 2][1]]) / 1e3 for r in w2 if r[tail + 2][1] in w1_end]
    return {
        "w1_first_end_us": at(min(w1_end.values())), "w1_last_end_us": at(w1_last),
        "w2_first_start_us": at(min(w2_start)), "w2_last_start_us": at(max(w2_start)),
        # a W2 CTA takes an SM once its W1 CTA left it (one CTA per SM): the launch's latency per SM
        "w2_start_after_own_sm_w1_us": med_max(after_own_sm),
        # both against W1's last end: the wait returns once W1's grid completed, then the rows of W1's output
        "w2_wait_done_after_w1_us": med_max([(r[tail + 3][0] - w1_last) / 1e3 for r in w2]),
        "w2_first_stage_after_w1_us": med_max([(r[4][0] - w1_last) / 1e3 for r in w2]),
        "w2_end_spread_us": round((max(w2_end) - min(w2_end)) / 1e3, 2),
        "span_us": at(max(w2_end)),
    }


def pair_trace_point(pt, stream, flush, runs: int = 3) -> dict | None:
    """The traced W1 and the traced W2 launched as the pair runs it (W2 programmatically, from a replayed graph) after a
    read flush `runs` times: `pair_trace_summary` of the run with the median span, with every run's. None unless both kernels are
    traced stream-K loops and the set launches W2 programmatically (pdl)."""
    if not (pt.programmatic_w2() and all(dict(k.entry.variant.params).get("trace") for k in (pt.k1, pt.k2))):
        return None
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    ctas1, seg1 = traced_segments(pt, pt.k1, pt.weights.l1)
    ctas2, seg2 = traced_segments(pt, pt.k2, pt.weights.l2)
    results = [pair_trace_summary(pt.split1[0][: ctas1 * gg.TRACE_SLOTS * 4], seg1,
                                  pt.split2[0][: ctas2 * gg.TRACE_SLOTS * 4], seg2)
               for _ in after_read_flush(pt, stream, flush, runs, replay=True)]
    by_span = sorted(results, key=lambda r: r["span_us"])
    return {**by_span[len(by_span) // 2], "runs": results}


def pair_kernel_trace_point(pt, stream, flush, runs: int = 3) -> tuple[dict, dict | None]:
    """The traced pair kernel (`stream_pair.variant(trace=True)`) launched after a read flush `runs` times: each
    half's `trace_summary` (W2's start and scan: its walk's and its table's) with every run's per-CTA lists, and the
    hand-over's `pair_trace_summary`, of the run with the median span. ({}, None) for an untraced pair kernel."""
    from gc_moe.kernels.sm90 import grouped_gemm as gg

    kernel, buffers = pt.pair
    if not dict(kernel.entry.variant.params).get("trace"):
        return {}, None
    ctas = buffers["sms"]
    tiles = sum(-(-int(c) // 8) for c in pt.counts.tolist())
    segments = {role: gg.stream_segments(tiles * (mat.rows // gg.ROWS_PER_CTA), mat.cols // 128, ctas)
                for role, mat in (("w1", pt.weights.l1), ("w2", pt.weights.l2))}
    results = []
    for _ in after_read_flush(pt, stream, flush, runs):
        words = {role: buffers[role][0][: ctas * gg.TRACE_SLOTS * 4] for role in ("w1", "w2")}
        results.append({**{role: trace_summary(words[role], segments[role]) for role in ("w1", "w2")},
                        "pair": pair_trace_summary(words["w1"], segments["w1"], words["w2"], segments["w2"])})
    results.sort(key=lambda r: r["pair"]["span_us"])
    median = results[len(results) // 2]
    trace = {role: {**median[role], "ctas_by_sm_runs": [r[role].pop("ctas_by_sm") for r in results]}
             for role in ("w1", "w2")}
    return trace, {**median["pair"], "runs": [r["pair"] for r in results]}


def parse_shape(spec: str) -> tuple[str, dict]:
    """'NAME=BASE:hidden=H,inter=I' -> (NAME, BASE's slice with those fields replaced): the same routing statistics
    at another K, to separate a kernel's per-unit cost from its per-step cost."""
    name, sep, rest = spec.partition("=")
    base, sep2, fields = rest.partition(":")
    if not (sep and sep2 and name and base in MODELS and fields):
        raise SystemExit(f"--shape wants NAME=BASE:FIELD=INT[,FIELD=INT...] with BASE one of {sorted(MODELS)}, got {spec!r}")
    shape = dict(MODELS[base])
    for item in fields.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in shape or not value.strip().isdigit():
            raise SystemExit(f"--shape: {item!r} is not FIELD=INT with FIELD one of {sorted(shape)}")
        shape[key.strip()] = int(value)
    if shape["hidden"] % 128 or shape["inter"] % 128:
        raise SystemExit(f"--shape {name}: hidden and inter must be multiples of 128, got {shape}")
    shape["base"] = base  # the rows name it: scripts/analyze_unit_costs.py fits a base with its shapes
    return name, shape


def parse_auto_set(spec: str) -> tuple[str, dict, bool]:
    """--auto-set 'tag:knob=value,...' -> (tag, the knobs it adds to tile_knobs's, whether its stream-K W2 launches
    programmatically: the pseudo-knob pdl). The pseudo-knobs wide, two_cta and card stay in the knobs: `tile_rule` reads
    them."""
    (tag, extra), = parse_extra_set(spec, {}).items()
    return tag, extra, bool(extra.pop("pdl", False))


def tile_rule(gg, extra: dict, card: str = "h100"):
    """grouped_gemm.tile_knobs as an --auto-set asks for it (wide=True: the wide tile for 65-96 rows; two_cta=False:
    tile 32 for 9-32 rows; card='h100': another card's rule than the run's `card`), and the knobs the set adds
    (without the pseudo-knobs)."""
    wide = bool(extra.get("wide", True))  # tile_knobs's default: the wide tile for 65-96 rows
    two_cta = bool(extra.get("two_cta", True))  # and tiles 16 / 24 at two CTAs per SM
    card = extra.get("card", card)
    return (lambda capacity, *a: gg.tile_knobs(capacity, *a, wide_tile=wide, two_cta_tiles=two_cta, card=card)), {
        k: v for k, v in extra.items() if k not in ("wide", "two_cta", "card")}


def auto_set_variants(gg, extra: dict, knobs: dict | None = None, card: str = "h100") -> dict:
    """{token tile: its [W1, W2] variants} of grouped_gemm.tile_knobs's sets on `card` with `extra` added (not where
    the rule asks for no knobs: the default set) on top of the run's `knobs`."""
    rule, extra = tile_rule(gg, extra, card)
    out = {}
    for bn in sorted({rule(rows)[0] for rows in range(97)}):
        tile_set = rule(bn)[1]
        set_knobs = {**(knobs or {}), **tile_set, **(extra if tile_set else {})}
        out[bn] = [gg.variant(role, bn, **set_knobs) for role in ("w1", "w2")]
    return out


def parse_extra_set(spec: str, knobs: dict) -> dict:
    """'tag:knob=value,knob=value' -> {tag: knobs + those}; values are Python literals (True, 4, 10_000_000)."""
    import ast

    tag, sep, rest = spec.partition(":")
    if not sep or not tag or not rest:
        raise SystemExit(f"--extra-set wants TAG:KNOB=VALUE[,KNOB=VALUE...], got {spec!r}")
    extra = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--extra-set: {item!r} is not KNOB=VALUE")
        extra[key.strip()] = ast.literal_eval(value.strip())
    return {tag: {**knobs, **extra}}


def markdown_tables(path: str) -> str:
    """The rows of a benchmark JSON as one markdown table per (variant set, model)."""
    with open(path) as f:
        data = json.load(f)
    out = []
    groups = {}
    for r in data["rows"]:
        groups.setdefault((r.get("tag", ""), r["model"]), []).append(r)
    for (tag, model), rows in groups.items():
        out.append(f"{model}, `{tag}` (read bandwidth {data['read_bw_bytes_per_s'] / 1e12:.2f} TB/s):\n")
        out.append("| tokens/rank | rows | act | bn | MB | floor us | cold us | warm us | % of bw | TFLOP/s | cos | diff |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            out.append(f"| {r['tokens']} | {r['rows']} | {r['active']} | {r['block_n']} | {r['bytes'] / 1e6:.1f} | "
                       f"{r.get('floor_us', math.nan):.1f} | {r.get('cold_us', math.nan):.1f} | "
                       f"{r.get('warm_us', math.nan):.1f} | {r.get('bw_pct', math.nan):.1f} | "
                       f"{r.get('tflops', math.nan):.1f} | {r.get('cos_out', math.nan):.5f} | "
                       f"{r.get('diff_out', math.nan):.5f} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deepseek-v4.1-flash,glm-5.2")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="compile every variant into the cubin cache and exit")
    ap.add_argument("--sass", action="store_true",
                    help="disassemble each cubin (cuobjdump): registers, stack, QGMMA, LDL/STL counts, the K loops' "
                         "instructions per trip; alone (no --check / --time) it needs no GPU")
    ap.add_argument("--sync-each", action="store_true", help="synchronize after W1 (locates a failing kernel)")
    ap.add_argument("--l2-hint", action="store_true", help="variants with the evict-first L2 policy (see docs)")
    ap.add_argument("--stages", type=int, default=None,
                    help="pipeline depth (default: the most that fit for the warp-specialized variants, 6 else)")
    ap.add_argument("--max-block-n", type=int, default=32, choices=(8, 16, 32, 64),
                    help="largest token tile; busier experts get more token tiles (default 32)")
    ap.add_argument("--producer-warps", type=int, default=1, choices=(1, 2, 4),
                    help="producer warps of the warp-specialized variants (default 1)")
    ap.add_argument("--one-cta", action="store_true",
                    help="also run the default variants with one CTA per SM at every bn (ctas_per_sm=1; bn 8 defaults to 2)")
    ap.add_argument("--pair", action="store_true",
                    help="also the sets of PAIR_SETS: W1 and W2's stream-K loops as one launch "
                         "(kernels.sm90.stream_pair, token tile 8, one CTA per SM; pair_lean with the lean epilogue, "
                         "pair_wf with W2's segments taking their words first, pair_pub with W1's words released by a "
                         "warp of their own, pair_pubwf with both) at every point; with --trace also the traced "
                         "`pair_t`, `pair_tf` and `pair_tpubwf`")
    ap.add_argument("--sm-weights", default=None, metavar="JSON",
                    help="with --pair: also `pair_w`, the pair kernel with ranges sized by per-SM weights from this "
                         "JSON of {smid: rate} (scripts/analyze_unit_costs.py weights on a --trace run's JSON)")
    ap.add_argument("--pdl", action="store_true",
                    help="with --auto-ctas: also ws_auto_pdl, W2 launched programmatically after W1 where tile_knobs "
                         "picks the stream-K loops (an --extra-set takes the pseudo-knob pdl=True alike)")
    ap.add_argument("--auto-ctas", action="store_true",
                    help="also a set `ws_auto`: per point the token tile and knobs of grouped_gemm.tile_knobs "
                         "(stream-K loops at tile 8, the table decode from 9 rows on), and the default variants at "
                         "one CTA per SM (`ws1`)")
    ap.add_argument("--auto-set", action="append", default=[], metavar="TAG:KNOB=VALUE,...",
                    help="with --auto-ctas: also a set like ws_auto (tile_knobs per point) with these knobs added where "
                         "they apply (e.g. lean:lean_epilogue=True; pdl=True launches its stream-K W2 programmatically; "
                         "pair=True runs the stream-K pair kernel where the rule picks stream-K; card='h100' follows "
                         "that card's rule instead of the run's GPU's: grouped_gemm.card_of)")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME=BASE:hidden=H,inter=I",
                    help="a model slice for --models: BASE's with other sizes (e.g. half K, to split a kernel's time "
                         "into per-unit and per-step parts)")
    ap.add_argument("--extra-set", action="append", default=[], metavar="TAG:KNOB=VALUE,...",
                    help="also a variant set with these GemmConfig knobs on the default ones, e.g. "
                         "ws_c4:compact_grid=True,producer_warps=4 (repeatable)")
    ap.add_argument("--baseline", action="store_true",
                    help="also run the cp.async pipeline (warp_specialized=False, the earlier default) at every point")
    ap.add_argument("--experts-fastest", action="store_true", help="grid with token tiles slowest (before tuning)")
    ap.add_argument("--fold-scales", action="store_true",
                    help="also run the folded-scale variants (K32 scale in the decode) at every point")
    ap.add_argument("--table-decode", action="store_true",
                    help="also the folded scales' byte-permute decode: sets `tab` (token tiles up to 32) and `tab64` "
                         "(up to 64)")
    ap.add_argument("--profile", action="store_true",
                    help="launch W1 and W2 twice per point, eager, nothing else (for a profiler: skip the first two)")
    ap.add_argument("--trace", action="store_true",
                    help="for sets with traced stream-K loops (an --extra-set with stream_k=True,trace=True): each "
                         "kernel's phases after a read flush, into the row's `trace` (start, unit scan, first stage, "
                         "us per K128 step, unit switches, epilogues, end spread)")
    ap.add_argument("--trace-warm", action="store_true",
                    help="with --trace: also each traced kernel launched right after the same launch (after the "
                         "flush), into `trace_warm`: warm only where the point's bytes fit the L2 (a small --shape)")
    ap.add_argument("--tag", default="", help="label written into each row (which variant set ran)")
    ap.add_argument("--flush", default="read", choices=("read", "write", "both"),
                    help="the cold timing's L2 flush: read 256 MB (default), write them (the earlier method), or "
                         "both (cold_us from the read flush, cold_write_flush_us beside it)")
    ap.add_argument("--per-role", action="store_true",
                    help="also time W1 alone and W2 alone (cold, same flush): columns w1 / w2")
    ap.add_argument("--read-ref", action="store_true",
                    help="also time one stream-read launch over each point's bytes after the same flush "
                         "(stream_read_us, stream_read_dyn_us)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", default=None, metavar="JSON",
                    help="print the rows of an earlier run's JSON as markdown tables and exit (no GPU)")
    ap.add_argument("--json", default=None, help="where the rows go (default: ./bench_grouped_gemm_sm90_<tag>.json)")
    args = ap.parse_args()
    for spec in args.shape:
        shape_name, shape = parse_shape(spec)
        MODELS[shape_name] = shape
    if args.markdown:
        print(markdown_tables(args.markdown))
        return 0

    from gc_moe.kernels.sm90 import grouped_gemm as gg
    from gc_moe.runtime import jit

    if args.build_only:
        sets = [{}, {"fold_scales": True}, {"ctas_per_sm": 1}, {"warp_specialized": False},
                {"warp_specialized": False, "fold_scales": True}, {"token_tiles_fastest": False}, {"l2_evict_first": True},
                {"producer_warps": 2}, {"producer_warps": 4}, {"wait_suspend_ns": 10_000_000},
                {"compact_grid": True}, {"compact_grid": True, "producer_warps": 4},
                {"compact_grid": True, "ctas_per_sm": 1}, {"compact_grid": True, "ring_consumer": True},
                {"k_splits": 2}, {"k_splits": 3}, {"k_splits": 4}, {"k_splits": 3, "ctas_per_sm": 1},
                {"k_splits": 3, "w2_k_splits": 2}, {"k_splits": 3, "w2_k_splits": 2, "ctas_per_sm": 1},
                {"k_splits": 4, "w2_k_splits": 2}, {"fold_scales": True, "table_decode": True},
                {"fold_scales": True, "table_decode": True, "ctas_per_sm": 2, "max_block_n": 16},
                {"fold_scales": True, "table_decode": True, "fit_n": True},
                {"fold_scales": True, "table_decode": True, "fit_n": True, "ctas_per_sm": 2, "max_block_n": 24},
                {"fold_scales": True, "table_decode": True, "ctas_per_sm": 2, "max_block_n": 24},
                {"stream_k": True}, {"stream_k": True, "ctas_per_sm": 1},
                {"stream_k": True, "ctas_per_sm": 1, "trace": True}]
        # the sets this command line names (--extra-set, --auto-set) besides: a device run finds all of them built
        for spec in args.extra_set:
            (_, extra), = parse_extra_set(spec, {}).items()
            extra.pop("pdl", None)
            sets.append(extra)
        auto_variants = [v for spec in args.auto_set for card in gg.CARDS  # (pair kernels: built below in any case)
                         for pair in auto_set_variants(gg, {k: x for k, x in parse_auto_set(spec)[1].items()
                                                            if k not in PAIR_ONLY_KNOBS}, card=card).values()
                         for v in pair]
        from gc_moe.kernels.sm90 import stream_pair, stream_read

        seen = set()
        for v in ([v for knobs in sets for v in gg.variant_set(**knobs)] + auto_variants + gg.all_variants()
                  + stream_pair.all_variants() + stream_read.read_variants()):
            if v.describe() in seen:
                continue
            seen.add(v.describe())
            entry = jit.build_variant(v, "sm_90a")
            print(v.describe(), entry.entry_name, entry.resources)
        return 0

    if args.sass:
        sass_report(gg, jit)  # offline: the cubins and cuobjdump ($CUOBJDUMP or PATH), no GPU
        if not (args.check or args.time or args.profile):
            return 0

    device = torch.device("cuda")
    torch.zeros(1, device=device)  # make the primary context current before the driver-level kernel loads
    card = gg.card_of(torch.cuda.get_device_name(device))  # whose measurements tile_knobs follows
    print(f"# tile_knobs card: {card} ({torch.cuda.get_device_name(device)})", flush=True)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    knobs = {"stages": args.stages, **({"l2_evict_first": True} if args.l2_hint else {}),
             **({"token_tiles_fastest": False} if args.experts_fastest else {}),
             **({"producer_warps": args.producer_warps} if args.producer_warps != 1 else {})}
    base_tag = args.tag or ("ws" if gg.GemmConfig("w1", 8, args.stages, **{k: v for k, v in knobs.items()
                                                                           if k != "stages"}).warp_specialized
                            else f"s{args.stages or 6}")
    kernel_sets = {base_tag: knobs, **({f"{base_tag}_fold": {**knobs, "fold_scales": True}} if args.fold_scales else {})}
    if args.one_cta or args.auto_ctas:
        kernel_sets["ws1"] = {**knobs, "ctas_per_sm": 1}
    if args.auto_ctas:
        kernel_sets["ws_auto"] = None  # per point: grouped_gemm.tile_knobs's tile and knobs
        if args.pdl:
            kernel_sets["ws_auto_pdl"] = None  # the same, W2 launched programmatically where it is stream-K
    auto_knobs = {"ws_auto": {}, "ws_auto_pdl": {}}  # per tile_knobs set: the knobs it adds
    auto_pdl = {}  # --auto-set sets that launch a stream-K W2 programmatically (pseudo-knob pdl=True)
    auto_pair = {}  # --auto-set sets that run the stream-K pair kernel where tile_knobs picks stream-K (pair=True):
    # the pair kernel's own knobs
    for spec in args.auto_set if args.auto_ctas else ():
        tag, auto_knobs[tag], auto_pdl[tag] = parse_auto_set(spec)
        pair_only = {k: auto_knobs[tag].pop(k) for k in PAIR_ONLY_KNOBS if k in auto_knobs[tag]}
        if pair_only.pop("pair", False):  # the pseudo-knob pair: the pair kernel where the rule picks stream-K
            # (its nibble order follows the set's tile-8 loops: below, where the pair kernels are loaded)
            auto_pair[tag] = {k: auto_knobs[tag][k] for k in ("lean_epilogue", "words_first", "quick_start")
                              if k in auto_knobs[tag]}
            auto_pair[tag].update(pair_only)
        kernel_sets[tag] = None
    if args.table_decode:
        kernel_sets["tab"] = {**knobs, "fold_scales": True, "table_decode": True}
        kernel_sets["tab64"] = {**knobs, "fold_scales": True, "table_decode": True, "max_block_n": 64}
    for spec in args.extra_set:
        kernel_sets.update(parse_extra_set(spec, knobs))
    set_max_block_n = {}  # per set: its largest token tile (a pseudo-knob, not a GemmConfig one)
    set_pdl = {"ws_auto_pdl": True, **auto_pdl}  # per set: W2 launched programmatically where it is stream-K (pdl)
    if args.baseline:
        kernel_sets["cpasync"] = {**knobs, "warp_specialized": False}
    for tag, set_knobs in kernel_sets.items():
        if set_knobs is None:
            continue
        set_knobs = dict(set_knobs)
        set_max_block_n[tag] = set_knobs.pop("max_block_n", args.max_block_n)
        set_pdl[tag] = bool(set_knobs.pop("pdl", False))
        loaded = {}
        for v in gg.variant_set(**set_knobs, max_block_n=set_max_block_n[tag]):
            p = dict(v.params)
            loaded[(p["role"], p["block_n"])] = jit.load_kernel(v, "sm_90a")
        kernel_sets[tag] = loaded
    kernels = kernel_sets[base_tag]
    # ws_auto (and the --auto-set sets): grouped_gemm.tile_knobs's sets, loaded beside the timed ones
    auto_tiles = {}  # per set tag: {token tile: its kernels}
    if args.auto_ctas:
        for tag, extra in auto_knobs.items():
            if tag not in kernel_sets:
                continue
            auto_tiles[tag] = {bn: {(role, bn): jit.load_kernel(v, "sm_90a") for role, v in zip(("w1", "w2"), pair)}
                               for bn, pair in auto_set_variants(gg, extra, knobs, card).items()}
    pair_kernels = {}  # set tag -> the pair kernel it runs (at every point, or an --auto-set's stream-K points)
    sm_table = None  # pair_w's per-SM weights (--sm-weights)
    if args.pair or auto_pair:
        from gc_moe.kernels.sm90 import stream_pair

        if args.pair:
            # W1 and W2 in one launch, at every point; with the lean epilogue, with W2's words first; and traced
            # (where the pair's time over the floor goes)
            for tag, knobs in PAIR_SETS.items():
                if args.trace or not knobs.get("trace"):
                    pair_kernels[tag] = jit.load_kernel(stream_pair.variant(**knobs), "sm_90a")
                    kernel_sets[tag] = "pair"
        if args.sm_weights:
            if not args.pair:
                raise SystemExit("--sm-weights sizes the pair kernel's ranges: pass --pair too")
            with open(args.sm_weights) as f:
                sm_table = stream_pair.sm_weight_table({int(k): float(v) for k, v in json.load(f).items()})
            named, sms = sum(1 for w in sm_table if w > 0), torch.cuda.get_device_properties(device).multi_processor_count
            if named != sms:  # the launch's CTAs run on every SM: the table must name each of them
                print(f"# --sm-weights names {named} SMs, the device has {sms}: no pair_w rows", flush=True)
            else:
                pair_kernels["pair_w"] = jit.load_kernel(stream_pair.variant(sm_weights=True), "sm_90a")
                kernel_sets["pair_w"] = "pair"
        for tag, pair_knobs in auto_pair.items():
            # the pair reads the codes in the order of the set's tile-8 loops (its weights are theirs)
            tile8 = {**tile_rule(gg, auto_knobs[tag], card)[0](1)[1], **auto_knobs[tag]}
            pair_knobs = {**pair_knobs, "split_nibbles": bool(tile8.get("split_nibbles"))}
            pair_kernels[tag] = jit.load_kernel(stream_pair.variant(**pair_knobs), "sm_90a")
    occupancy_report({k: v for k, v in kernel_sets.items() if v != "pair"})
    stream = torch.cuda.Stream()
    bw = measure_read_bandwidth(device) if args.time else float("nan")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    # --read-ref: the source of the same-bytes read, as large as the largest point's weights (~1 GB at most)
    read_source = torch.empty(1 << 28, dtype=torch.float32, device=device).uniform_() \
        if args.read_ref and args.time else None
    stream_reads = {}
    if read_source is not None:
        from gc_moe.kernels.sm90 import stream_read as sr

        stream_reads = {"stream_read": jit.load_kernel(sr.variant(False), "sm_90a"),
                        "stream_read_dyn": jit.load_kernel(sr.variant(True), "sm_90a")}
    rows_out, all_ok = [], True
    for name in args.models.split(","):
        model = MODELS[name]
        e_loc = model["experts"] // RANKS
        t0 = time.time()
        canon = (random_mxfp4(e_loc, 2 * model["inter"], model["hidden"], gen, device),
                 random_mxfp4(e_loc, model["hidden"], model["inter"], gen, device))
        weights = {"lane": wsm90.transform(*canon)}
        orders = {gg.nibble_order(gg.GemmConfig(**dict(k.entry.variant.params)))
                  for ks in kernel_sets.values() if isinstance(ks, dict) for k in ks.values()}
        if auto_tiles:
            orders |= {gg.nibble_order(gg.GemmConfig(**dict(k.entry.variant.params)))
                       for tiles in auto_tiles.values() for ks in tiles.values() for k in ks.values()}
        for order in sorted(orders - {"lane"}):  # each kernel on the codes in its own order (the same weights)
            lane = weights["lane"]
            weights[order] = wsm90.Sm90Weights(l1=wsm90.with_nibble_order(lane.l1, order),
                                               l2=wsm90.with_nibble_order(lane.l2, order))
        torch.cuda.synchronize()
        print(f"# {name}: {e_loc} local experts, weights ready in {time.time() - t0:.1f} s", flush=True)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            pt = Point(name, model, tokens, weights, canon, kernels, gen, device, args.max_block_n)
            read_ref = {}
            if read_source is not None and pt.rows:
                if pt.weight_bytes() > read_source.numel() * 4:
                    raise SystemExit(f"--read-ref: {name} T={tokens} reads {pt.weight_bytes()} bytes, more than the "
                                     f"{read_source.numel() * 4}-byte source")
                read_ref = stream_read_refs(pt.weight_bytes(), read_source, stream, flush, args.replays, args.windows,
                                            stream_reads)
                if args.per_role:  # each role's bytes alone, beside w1_cold_us / w2_cold_us
                    for role in ("w1", "w2"):
                        one = stream_read_refs(pt.role_bytes(role), read_source, stream, flush, args.replays,
                                               args.windows, {"stream_read": stream_reads["stream_read"]})
                        read_ref.update({f"{role}_{k}": v for k, v in one.items()})
            for tag, set_kernels in kernel_sets.items():
                row_note = {}
                max_bn = set_max_block_n.get(tag)
                pt.pair = None
                if set_kernels == "pair":
                    from gc_moe.kernels.sm90.stream_pair import pair_buffers

                    set_kernels, max_bn = kernels, 8  # the lane-order weights; the pair's own tile
                    row_note = {"knobs": {"stream_pair": True, **PAIR_SETS.get(tag, {"sm_weights": True}
                                                                               if tag == "pair_w" else {})}}
                elif set_kernels is None:  # ws_auto or an --auto-set
                    sms = torch.cuda.get_device_properties(device).multi_processor_count
                    w1_units = pt.token_tiles()[8] * (2 * model["inter"] // 256)
                    auto_tag = "ws_auto" if tag == "ws_auto_pdl" else tag
                    rule, _ = tile_rule(gg, auto_knobs[auto_tag], card)
                    max_bn, tile_set = rule(pt.capacity, w1_units, sms)
                    set_kernels = auto_tiles[auto_tag][max_bn] if tile_set else kernels  # no knobs: the default set
                    row_note = {"knobs": {**tile_set, **auto_knobs[auto_tag]} if tile_set else {}}
                    if tag in auto_pair and tile_set.get("stream_k"):
                        from gc_moe.kernels.sm90.stream_pair import pair_buffers

                        row_note["knobs"] = {**row_note["knobs"], "stream_pair": True}
                    elif tag in auto_pair:
                        row_note["knobs"] = {**row_note["knobs"], "stream_pair": False}
                pt.use(set_kernels, max_bn)
                pt.pdl = set_pdl.get(tag, False)
                if tag in pair_kernels and row_note.get("knobs", {}).get("stream_pair"):  # buffers before any capture
                    pt.pair = (pair_kernels[tag], pair_buffers(pt.weights.l1, pt.weights.l2, pt.capacity, device,
                                                               sm_weights=sm_table if tag == "pair_w" else None))
                row = {"tag": tag, "model": name, "base": model.get("base", name), "hidden": model["hidden"],
                       "inter": model["inter"],
                       "tokens": tokens, "rows": pt.rows,
                       "active": pt.active, "capacity": pt.capacity, "block_n": pt.block_n, "bytes": pt.weight_bytes(),
                       "tiles": pt.token_tiles(), "pdl": pt.programmatic_w2(), **read_ref, **row_note}
                all_ok &= run_point(pt, row, args, stream, flush, bw)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        del weights, canon
        torch.cuda.empty_cache()
    path = args.json or f"bench_grouped_gemm_sm90_{base_tag}{'_vs_fold' if args.fold_scales else ''}.json"
    with open(path, "w") as f:
        json.dump({"read_bw_bytes_per_s": bw, "rows": rows_out}, f, indent=1)
    print(f"\nread bandwidth (amax, 4 GiB): {bw / 1e12:.2f} TB/s")
    print(f"{'variant':12s} {'model':22s} {'T':>4s} {'rows':>5s} {'act':>4s} {'bn':>3s} {'MB':>7s} {'floor':>7s} {'cold':>7s} "
          f"{'warm':>7s} {'%bw':>5s} {'TF':>5s} {'cos':>8s} {'diff':>8s} ok {'cold(write flush)':>17s}"
          f"{' w1 / w2' if args.per_role else ''}")
    for r in rows_out:
        print(f"{r['tag']:12s} {r['model']:22s} {r['tokens']:4d} {r['rows']:5d} {r['active']:4d} {r['block_n']:3d} "
              f"{r['bytes'] / 1e6:7.1f} {r.get('floor_us', math.nan):7.1f} {r.get('cold_us', math.nan):7.1f} "
              f"{r.get('warm_us', math.nan):7.1f} {r.get('bw_pct', math.nan):5.1f} {r.get('tflops', math.nan):5.2f} "
              f"{r.get('cos_out', math.nan):8.5f} {r.get('diff_out', math.nan):8.5f} {r.get('ok', '-')} "
              f"{r.get('cold_write_flush_us', math.nan):17.1f}"
              + (f" {r.get('w1_cold_us', math.nan):.1f} / {r.get('w2_cold_us', math.nan):.1f}" if args.per_role else ""))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
