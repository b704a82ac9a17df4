"""The SM90 Mega MoE reference port (baseline `mega-port`, host side in baselines.mega_moe.port_sm90): one
persistent kernel for the whole routed MoE layer (sm_90a, CuTe DSL).

Grid = the SM count, one CTA per SM, 512 threads (4 warpgroups), dynamic shared memory per `PortConfig`.
Every CTA walks the same phases; phases hand over through counters in global memory (acquire / release at
GPU scope), never through a grid-wide barrier except where the data needs all CTAs (the combine):

1. routing (CTA 0): counts per local expert, grouped-row offsets, the routing entry (token * k + slot) of
   every grouped row; then the tag-1 barrier (a `red.release.sys` arrival on every peer's TAG1 word, a
   bounded acquire wait for P arrivals) and `st.release` of ROUTING_READY. Every other CTA waits for it.
2. dispatch (all warps of all CTAs, one grouped row per warp at a time): pull the token's E4M3 row and
   its UE8M0 K32 scales, convert to E4M3 with one FP32 scale per K128 block (each K32 group rescaled by
   2^(e_j - e_max), one RNE rounding), its routing weight and combine row; then `atom.release` +1 on the
   expert's ROWS_READY.
3. work items, statically strided over the CTAs: first every W1 item (expert, 256-row M tile, token tile),
   then every W2 item. A W1 item waits for ROWS_READY[e] = rows of e; a W2 item waits for W1_DONE[e] = the
   expert's W1 items. Each item: a cp.async pipeline over K128 steps (weights 4 x 64 x 128 FP4 codes + K32
   scale bytes, the token tile's E4M3 block and FP32 scales), in-register FP4 -> E4M3 decode, register-A
   WGMMA m64nNk32 E4M3, per-K32 weight and per-K128 activation scales as FMAs on the FP32 partials.
   W1 epilogue: SwiGLU (alpha, clamp), routing weight, amax over the CTA's 128 channels, E4M3 + FP32 scale
   (one K128 block of the intermediate); release W1_DONE[e]. W2 epilogue: BF16 partials at the row's combine
   row (slot * T + token); release W2_DONE.
4. combine: wait for W2_DONE = every W2 item; CTA 0 first clears ROWS_READY / W1_DONE (nobody reads them any
   more), then every thread sums the top-k partials of 8 channels of one token in FP32 and stores BF16 y.
5. tail: every CTA adds 1 to FINISH; the last one runs the tag-2 barrier (same protocol as tag 1) and clears
   the remaining control words, so the next launch (a graph replay) starts from zero.

Every wait is bounded by `timeout_ns` of %globaltimer and ends in `trap`. P = 1 runs here; the peer table
(`peers`: peer base - local base, per rank) carries the barrier arrivals, so P > 1 needs only the pulls from
peers added (docs/mega-port.md).
"""


from dataclasses import dataclass

THREADS = 512
WARPS = THREADS // 32
TILES_PER_CTA = 4  # 64-row weight tiles per CTA: one per warpgroup
ROWS_PER_CTA = 64 * TILES_PER_CTA
TILE_BYTES = 4096  # 64 x 128 FP4 codes
TILE_SCALE_BYTES = 256  # 64 rows x 4 K32 scale bytes
# 32 and 64 spill (48 / 176 bytes of stack) with both GEMMs and the persistent loop in one kernel
BLOCK_N_CHOICES = (8, 16)
# the pull's 16-byte chunks per lane whose loads one pass issues before converting any (5 registers each: the
# ws kernel's dispatch warps run beside the GEMM within its 96 registers per thread)
PULL_PASS_CHUNKS = 8
MAX_LOCAL_EXPERTS = 256
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # formats.quantize_fp8_k128: scale = max(amax, 1e-4) / 448

# control words (int32) of the workspace
ROUTING_READY = 0
TAG1_ARRIVE = 1
TAG2_ARRIVE = 2
W2_DONE = 3
FINISH = 4
ROWS_READY = 16  # [MAX_LOCAL_EXPERTS]
W1_DONE = ROWS_READY + MAX_LOCAL_EXPERTS  # [MAX_LOCAL_EXPERTS]
CONTROL_WORDS = W1_DONE + MAX_LOCAL_EXPERTS

PARAMS = (
    ("x", "u64"), ("x_sf", "u64"), ("topk_idx", "u64"), ("topk_weights", "u64"),
    ("w1_codes", "u64"), ("w1_scales", "u64"), ("w1_factor", "u64"),
    ("w2_codes", "u64"), ("w2_scales", "u64"), ("w2_factor", "u64"),
    ("g_act", "u64"), ("g_scale", "u64"), ("g_weight", "u64"), ("g_dest", "u64"), ("g_src", "u64"),
    ("mid", "u64"), ("mid_scale", "u64"), ("partials", "u64"), ("y", "u64"),
    ("expert_offsets", "u64"), ("control", "u64"), ("peers", "u64"),
    ("num_tokens", "s32"), ("topk", "s32"), ("local_experts", "s32"), ("expert_base", "s32"),
    ("hidden", "s32"), ("intermediate", "s32"), ("num_ranks", "s32"), ("timeout_ns", "s64"),
)

PROMISES = (
    "wgmma.mma_async.sync.aligned.m64n",  # register-A E4M3 WGMMA
    "cp.async.cg.shared.global",  # the weight / activation pipeline
    "ld.acquire.gpu",  # phase hand-over waits
    "red.release.gpu.global.add",  # W1_DONE / W2_DONE releases
    "atom.release.gpu.global.add",  # ROWS_READY releases
    "st.release.gpu",  # ROUTING_READY
    "red.release.sys.global.add",  # tag-1 / tag-2 arrivals on the peers
    "ld.acquire.sys",  # tag-1 / tag-2 waits
    "cvt.rn.f16x2.e4m3x2",  # K32 -> K128 conversion of the pulled rows
    "nanosleep",
    "trap",  # bounded waits end in a trap
)


@dataclass(frozen=True)
class PortConfig:
    block_n: int = 16  # tokens per work item (the WGMMA N)
    stages: int = 5  # K128 steps in flight through cp.async
    swiglu_alpha: float = 1.0
    swiglu_clamp: float = 10.0

    def __post_init__(self):
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {self.block_n}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages must be in 2..8, got {self.stages}")

    # shared memory: stages x [weights 4 x 4096][scales 4 x 256][B block_n x 128][B scales], then the amax
    # exchange [16 warps x block_n], then the routing tables (counts, offsets, token-tile prefix)
    @property
    def scale_offset(self) -> int:
        return TILES_PER_CTA * TILE_BYTES

    @property
    def b_offset(self) -> int:
        return self.scale_offset + TILES_PER_CTA * TILE_SCALE_BYTES

    @property
    def xs_offset(self) -> int:
        return self.b_offset + self.block_n * 128

    @property
    def stage_bytes(self) -> int:
        return -(-(self.xs_offset + self.block_n * 4) // 128) * 128

    @property
    def amax_offset(self) -> int:
        return self.stages * self.stage_bytes

    @property
    def table_offset(self) -> int:
        return self.amax_offset + WARPS * self.block_n * 4

    @property
    def smem_bytes(self) -> int:
        # counts [E], offsets [E + 1], token-tile prefix [E + 1]
        return self.table_offset + 4 * (3 * MAX_LOCAL_EXPERTS + 2)

    @property
    def wgmmas_per_wait(self) -> int:
        """K32 WGMMAs issued before one wait, bounded by the registers of their fresh accumulators."""
        return {8: 4, 16: 4}[self.block_n]

    @property
    def name(self) -> str:
        return f"mega_port_sm90_n{self.block_n}_s{self.stages}_a{self.swiglu_alpha:g}_c{self.swiglu_clamp:g}"


# ---------------------------------------------------------------------------------------------- PTX helpers
def _device_helpers():
    """The inline-PTX pieces this kernel uses, kept in this file: its cubin's cache key then depends on this file
    alone (plus kernels/common), not on helper modules other kernels change."""
    from types import SimpleNamespace

    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    letters = {Int32: "r", Uint32: "r", Float32: "f", Int64: "l"}

    @dsl_user_op
    def asm(text, outs, ins, *, loc=None, ip=None):
        """`text` with outputs $0.. of types `outs`, then the inputs; returns None, one value or a list."""
        values = [v.ir_value(loc=loc, ip=ip) for v in ins]
        constraints = ",".join(["=" + letters[t] for t in outs] + [letters[type(v)] for v in ins])
        kw = {"has_side_effects": True, "is_align_stack": False, "asm_dialect": llvm.AsmDialect.AD_ATT,
              "loc": loc, "ip": ip}
        if not outs:
            llvm.inline_asm(None, values, text, constraints, **kw)
            return None
        if len(outs) == 1:
            return outs[0](llvm.inline_asm(outs[0].mlir_type, values, text, constraints, **kw))
        struct = llvm.StructType.get_literal([t.mlir_type for t in outs])
        res = llvm.inline_asm(struct, values, text, constraints, **kw)
        return [t(llvm.extractvalue(t.mlir_type, res, [i], loc=loc, ip=ip)) for i, t in enumerate(outs)]

    h = SimpleNamespace(asm=asm)
    h.cp_async_16 = lambda dst, src: asm("cp.async.cg.shared.global [$0], [$1], 16;", [], [dst, src])
    h.cp_async_16_zfill = lambda dst, src, n: asm("cp.async.cg.shared.global [$0], [$1], 16, $2;", [], [dst, src, n])
    h.cp_async_4_zfill = lambda dst, src, n: asm("cp.async.ca.shared.global [$0], [$1], 4, $2;", [], [dst, src, n])
    h.cp_async_commit = lambda: asm("cp.async.commit_group;", [], [])
    h.cp_async_wait = lambda pending: asm(f"cp.async.wait_group {pending};", [], [])
    h.barrier_sync = lambda: asm("bar.sync 0;", [], [])
    h.lds128 = lambda a: asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [a])
    h.lds32 = lambda a: asm("ld.shared.b32 $0, [$1];", [Uint32], [a])
    h.lds_f32x2 = lambda a: asm("ld.shared.v2.f32 {$0, $1}, [$2];", [Float32] * 2, [a])
    h.lds_f32 = lambda a: asm("ld.shared.f32 $0, [$1];", [Float32], [a])
    h.sts_f32 = lambda a, v: asm("st.shared.f32 [$0], $1;", [], [a, v])
    h.ldg_s32 = lambda a: asm("ld.global.nc.b32 $0, [$1];", [Int32], [a])
    h.ldg_f32 = lambda a: asm("ld.global.nc.f32 $0, [$1];", [Float32], [a])
    h.stg_f32 = lambda a, v: asm("st.global.f32 [$0], $1;", [], [a, v])
    h.stg_e4m3 = lambda a, v: asm("{\n.reg .b16 t;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\n"
                                  "cvt.rn.satfinite.e4m3x2.f32 t, z, $1;\nst.global.b8 [$0], t;\n}", [], [a, v])
    h.stg_bf16 = lambda a, v: asm("{\n.reg .b16 t;\ncvt.rn.bf16.f32 t, $1;\nst.global.b16 [$0], t;\n}", [], [a, v])
    h.shfl_xor_f32 = lambda v, m: asm(f"shfl.sync.bfly.b32 $0, $1, {m}, 31, -1;", [Float32], [v])
    h.fmax = lambda a, b: asm("max.f32 $0, $1, $2;", [Float32], [a, b])
    h.fmin = lambda a, b: asm("min.f32 $0, $1, $2;", [Float32], [a, b])
    h.fabs = lambda a: asm("abs.f32 $0, $1;", [Float32], [a])
    h.fast_reciprocal = lambda a: asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [a])
    # 1 / (1 + 2^(-x log2 e)) on the approximate units
    h.fast_sigmoid = lambda x: asm("{\n.reg .f32 t;\nmul.f32 t, $1, 0fBFB8AA3B;\nex2.approx.ftz.f32 t, t;\n"
                                   "add.f32 t, t, 0f3F800000;\nrcp.approx.ftz.f32 $0, t;\n}", [Float32], [x])

    def ue8m0_byte_to_f32(word, byte):
        """Byte `byte` of a scale word as 2^(b - 127): the byte becomes the float's exponent field."""
        return asm("mov.b32 $0, $1;", [Float32], [((word >> (8 * byte)) & Uint32(0xFF)) << 23])

    # E2M1 nibble (s e1 e0 m) -> the E4M3 byte of value / 64: sign to bit 7, the 3 magnitude bits to bits 2..4
    h.decode_low = lambda w: ((w << 4) & Uint32(0x80808080)) | ((w << 2) & Uint32(0x1C1C1C1C))
    h.decode_high = lambda w: (w & Uint32(0x80808080)) | ((w >> 2) & Uint32(0x1C1C1C1C))
    h.ue8m0_byte_to_f32 = ue8m0_byte_to_f32

    def smem_desc(addr, lbo, sbo):
        """WGMMA descriptor of a K-major operand without swizzle: start, K-direction and N-direction strides."""
        lo = ((addr >> 4) & Int32(0x3FFF)) | Int32((lbo >> 4) << 16)
        return Int64(lo) & Int64(0xFFFFFFFF) | Int64((sbo >> 4) << 32)

    h.smem_desc = smem_desc
    h.wgmma_fence = lambda: asm("wgmma.fence.sync.aligned;", [], [])

    def wgmma_batch(n, a_regs, descs):
        """len(descs) register-A m64n{n}k32 E4M3 WGMMAs, each into fresh accumulators; one commit, one wait
        (one asm block, so nothing touches the accumulators between issue and wait)."""
        per, count = n // 2, len(descs)
        zero = f"${count * per + 5 * count}"
        lines = ["{", ".reg .pred fresh;", f"setp.ne.b32 fresh, {zero}, 0;"]
        for i in range(count):
            d = ", ".join(f"${i * per + r}" for r in range(per))
            a = ", ".join(f"${count * per + 4 * i + r}" for r in range(4))
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, "
                         f"${count * per + 4 * count + i}, fresh, 1, 1;")
        lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
        return asm("\n".join(lines), [Float32] * (per * count), list(a_regs) + list(descs) + [Int32(0)])

    h.wgmma_batch = wgmma_batch
    return h


def _phase_helpers(ptx):
    """The memory-model, conversion and combine helpers of the port's phases (routing, dispatch, combine, tail),
    for `_make_kernel` and the warp-specialized port (`mega_port_ws`). ptx: `_device_helpers()`."""
    from types import SimpleNamespace

    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, cute

    asm = ptx.asm

    # global addresses Int64, shared Int32
    def ld_acquire_gpu(addr):
        return asm("ld.acquire.gpu.global.b32 $0, [$1];", [Int32], [addr])

    def ld_acquire_sys(addr):
        return asm("ld.acquire.sys.global.b32 $0, [$1];", [Int32], [addr])

    def ld_relaxed(addr):
        return asm("ld.relaxed.gpu.global.b32 $0, [$1];", [Int32], [addr])

    def ld_relaxed_f32(addr):
        return asm("ld.relaxed.gpu.global.f32 $0, [$1];", [Float32], [addr])

    def ld_relaxed_s64(addr):
        return asm("ld.relaxed.gpu.global.b64 $0, [$1];", [Int64], [addr])

    def st_relaxed(addr, v):
        asm("st.relaxed.gpu.global.b32 [$0], $1;", [], [addr, v])

    def st_release_gpu(addr, v):
        asm("st.release.gpu.global.b32 [$0], $1;", [], [addr, v])

    def red_release_gpu(addr, v):
        asm("red.release.gpu.global.add.s32 [$0], $1;", [], [addr, v])

    def atom_release_gpu(addr, v):
        return asm("atom.release.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def atom_acq_rel_gpu(addr, v):
        return asm("atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def red_release_sys(addr, v):
        asm("red.release.sys.global.add.s32 [$0], $1;", [], [addr, v])

    def fence_gpu():
        asm("fence.acq_rel.gpu;", [], [])

    def lds_s32(addr):
        return asm("ld.shared.b32 $0, [$1];", [Int32], [addr])

    def sts_s32(addr, v):
        asm("st.shared.b32 [$0], $1;", [], [addr, v])

    def atom_shared_add(addr, v):
        return asm("atom.shared.add.s32 $0, [$1], $2;", [Int32], [addr, v])

    def warp_sync():
        asm("bar.warp.sync -1;", [], [])

    def ldg_s64_nc(addr):
        return asm("ld.global.nc.b64 $0, [$1];", [Int64], [addr])

    def load_row_chunk(src):
        """16 E4M3 bytes of a token row (four words), issued without waiting (a pass issues all its loads first)."""
        return asm("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [src])

    def convert_store_row_chunk(words, dst, multiplier):
        """16 E4M3 bytes times a power of two <= 1 (E4M3 -> f16 -> f32 exact, one RNE rounding back), stored."""
        lines = ["{", ".reg .b32 v<4>;", ".reg .b16 p, r, s0, s1, s2, s3;", ".reg .b32 f01, f23;",
                 ".reg .f32 a0, a1, a2, a3;"] + [f"mov.b32 v{i}, ${i};" for i in range(4)]
        for i in range(4):
            lines += [f"mov.b32 {{p, r}}, v{i};", "cvt.rn.f16x2.e4m3x2 f01, p;", "cvt.rn.f16x2.e4m3x2 f23, r;",
                      "mov.b32 {s0, s1}, f01;", "mov.b32 {s2, s3}, f23;"]
            lines += [f"cvt.f32.f16 a{j}, s{j};" for j in range(4)]
            lines += [f"mul.f32 a{j}, a{j}, $5;" for j in range(4)]
            lines += ["cvt.rn.satfinite.e4m3x2.f32 p, a1, a0;", "cvt.rn.satfinite.e4m3x2.f32 r, a3, a2;",
                      f"mov.b32 v{i}, {{p, r}};"]
        lines += ["st.global.v4.b32 [$4], {v0, v1, v2, v3};", "}"]
        asm("\n".join(lines), [], [*words, dst, multiplier])

    def bits_f32(bits):
        return asm("mov.b32 $0, $1;", [Float32], [bits])

    def combine_add8(acc, addr):
        """acc[0..8) += the 8 BF16 values at addr (16 bytes, a coherent load: written by other CTAs)."""
        words = asm("ld.relaxed.gpu.global.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [addr])
        for i in range(4):
            acc[2 * i] = acc[2 * i] + bits_f32(words[i] << 16)
            acc[2 * i + 1] = acc[2 * i + 1] + bits_f32(words[i] & Uint32(0xFFFF0000))

    def store_bf16x8(addr, acc):
        asm("{\n.reg .b32 w<4>;\n" + "".join(
            f"cvt.rn.bf16x2.f32 w{i}, ${2 * i + 2}, ${2 * i + 1};\n" for i in range(4))
            + "st.global.v4.b32 [$0], {w0, w1, w2, w3};\n}", [], [addr] + [acc[i] for i in range(8)])

    @cute.jit
    def wait_at_least(addr, target, started, timeout_ns, system_scope: cutlass.Constexpr):
        """Acquire-spin until the word at addr >= target; trap once timeout_ns passed since started."""
        if cutlass.const_expr(system_scope):
            seen = ld_acquire_sys(addr)
        else:
            seen = ld_acquire_gpu(addr)
        while seen < target:
            if cute.arch.globaltimer() - started > timeout_ns:
                asm("trap;", [], [])
            asm("nanosleep.u32 32;", [], [])
            if cutlass.const_expr(system_scope):
                seen = ld_acquire_sys(addr)
            else:
                seen = ld_acquire_gpu(addr)

    @cute.jit
    def tag_barrier(control, word, peers, num_ranks, started, timeout_ns):
        """One arrival on every peer's `word`, then wait for num_ranks arrivals on ours (system scope)."""
        asm("fence.acq_rel.sys;", [], [])
        for p in cutlass.range(num_ranks):
            red_release_sys(control + ldg_s64_nc(peers + Int64(p) * 8) + Int64(4 * word), Int32(1))
        wait_at_least(control + Int64(4 * word), num_ranks, started, timeout_ns, True)

    @cute.jit
    def pull_row_k128(x, x_sf, g_act, g_scale, token, row, hidden, h_blocks, lane):
        """One warp: token's E4M3 row -> grouped row `row` with one FP32 scale per K128 block (each K32 group
        times 2^(e_j - e_max), one RNE rounding; the scale 2^(e_max - 127)). A lane takes 16-byte chunks
        lane, lane + 32, ...; a pass issues the loads of PULL_PASS_CHUNKS of them (scale words and bytes) before
        it converts any, so a row costs one load latency per pass (GC-MoE's role1 pulls the same way)."""
        first = Int32(0)
        while first * 32 < h_blocks * 8:
            words, data = [], []
            for j in cutlass.range_constexpr(PULL_PASS_CHUNKS):
                chunk = lane + 32 * (first + j)
                if chunk >= h_blocks * 8:  # past the row: load the pass's first chunk again, store nothing
                    chunk = lane + 32 * first
                words.append(ptx.ldg_s32(x_sf + (Int64(token) * Int64(h_blocks) + Int64(chunk // 8)) * 4))
                data.append(load_row_chunk(x + Int64(token) * Int64(hidden) + Int64(chunk * 16)))
            for j in cutlass.range_constexpr(PULL_PASS_CHUNKS):
                chunk = lane + 32 * (first + j)
                if chunk < h_blocks * 8:
                    word = words[j]
                    e0 = word & Int32(0xFF)
                    e1 = (word >> 8) & Int32(0xFF)
                    e2 = (word >> 16) & Int32(0xFF)
                    e3 = (word >> 24) & Int32(0xFF)
                    emax = e0
                    emax = max(emax, e1)
                    emax = max(emax, e2)
                    emax = max(emax, e3)
                    ej = (word >> (8 * ((chunk % 8) // 2))) & Int32(0xFF)
                    step = ej - emax + 127  # the biased exponent of 2^(e_j - e_max); below the normals: 0
                    if step < 0:
                        step = Int32(0)
                    convert_store_row_chunk(data[j], g_act + Int64(row) * Int64(hidden) + Int64(chunk * 16),
                                            bits_f32(step << 23))
                    if chunk % 8 == 0:
                        ptx.stg_f32(g_scale + (Int64(row) * Int64(h_blocks) + Int64(chunk // 8)) * 4,
                                    bits_f32(emax << 23))
            first = first + PULL_PASS_CHUNKS

    return SimpleNamespace(ld_acquire_gpu=ld_acquire_gpu, ld_acquire_sys=ld_acquire_sys, ld_relaxed=ld_relaxed, ld_relaxed_f32=ld_relaxed_f32, ld_relaxed_s64=ld_relaxed_s64, st_relaxed=st_relaxed, st_release_gpu=st_release_gpu, red_release_gpu=red_release_gpu, atom_release_gpu=atom_release_gpu, atom_acq_rel_gpu=atom_acq_rel_gpu, red_release_sys=red_release_sys, fence_gpu=fence_gpu, lds_s32=lds_s32, sts_s32=sts_s32, atom_shared_add=atom_shared_add, warp_sync=warp_sync, ldg_s64_nc=ldg_s64_nc,  bits_f32=bits_f32, combine_add8=combine_add8, store_bf16x8=store_bf16x8, wait_at_least=wait_at_least, tag_barrier=tag_barrier,
                           pull_row_k128=pull_row_k128)


# ---------------------------------------------------------------------------------------------- device code
def _make_kernel(cfg: PortConfig):
    import cutlass  # the DSL is needed to build only
    from cutlass import Float32, Int32, Int64, Uint32, cute

    ptx = _device_helpers()
    asm = ptx.asm

    BN = cfg.block_n
    STAGES = cfg.stages
    NSUB = BN // 8
    NP = cfg.wgmmas_per_wait

    phase = _phase_helpers(ptx)

    # ---- the GEMM pipeline of one work item
    @cute.jit
    def issue_stage(smem, stage, kb, tile0, tid, wg, t, row0, count, k_blocks, w_codes, w_scales, act, act_scale):
        sbase = smem + stage * cfg.stage_bytes
        tile = Int64((tile0 + wg) * k_blocks + kb)
        src = w_codes + tile * TILE_BYTES + Int64(t * 32)
        dst = sbase + wg * TILE_BYTES + t * 32
        ptx.cp_async_16(dst, src)
        ptx.cp_async_16(dst + 16, src + Int64(16))
        if tid < TILES_PER_CTA * 16:
            stile = Int64((tile0 + tid // 16) * k_blocks + kb)
            ptx.cp_async_16(sbase + cfg.scale_offset + tid * 16,
                            w_scales + stile * TILE_SCALE_BYTES + Int64((tid % 16) * 16))
        if tid < BN * 8:
            # B is K-major without swizzle: core matrix (8 tokens x 16 bytes) (n / 8, k / 16) at
            # ((n / 8) * 8 + k / 16) * 128, token n % 8 at 16 (n % 8) inside it
            n_lo = tid % 8
            chunk = (tid // 8) % 8
            n = (tid // 64) * 8 + n_lo
            row = Int64(row0) + Int64(n)
            nbytes = Int32(16)
            if n >= count:  # zero fill past the tile's tokens (from a valid address)
                row = Int64(row0)
                nbytes = Int32(0)
            ptx.cp_async_16_zfill(sbase + cfg.b_offset + ((tid // 64) * 8 + chunk) * 128 + n_lo * 16,
                                  act + row * Int64(k_blocks * 128) + Int64(kb * 128 + chunk * 16), nbytes)
        if tid < BN:
            row = Int64(row0) + Int64(tid)
            nbytes = Int32(4)
            if tid >= count:
                row = Int64(row0)
                nbytes = Int32(0)
            ptx.cp_async_4_zfill(sbase + cfg.xs_offset + tid * 4,
                                 act_scale + (row * Int64(k_blocks) + Int64(kb)) * 4, nbytes)

    @cute.jit
    def compute_stage(smem, stage, wg, t, warp, g, q, acc):
        sbase = smem + stage * cfg.stage_bytes
        wa = sbase + wg * TILE_BYTES + t * 32
        words = ptx.lds128(wa) + ptx.lds128(wa + 16)
        srow = sbase + cfg.scale_offset + wg * TILE_SCALE_BYTES + (16 * warp + g) * 4
        sc_lo = ptx.lds32(srow)  # rows g (W1: gate) and g + 8 (W1: up) of the warp's 16
        sc_hi = ptx.lds32(srow + 32)
        xs = [ptx.lds_f32x2(sbase + cfg.xs_offset + (8 * i + 2 * q) * 4) for i in range(NSUB)]
        for grp in cutlass.range_constexpr(4 // NP):
            a_regs = []
            descs = []
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj  # K32 block
                lo_word, hi_word = words[2 * j], words[2 * j + 1]  # k 0..15 and 16..31 of the block
                a_regs += [ptx.decode_low(lo_word), ptx.decode_high(lo_word),
                           ptx.decode_low(hi_word), ptx.decode_high(hi_word)]
                descs.append(ptx.smem_desc(sbase + cfg.b_offset + j * 256, 128, 1024))
            ptx.wgmma_fence()
            part = ptx.wgmma_batch(BN, a_regs, descs)
            for jj in cutlass.range_constexpr(NP):
                j = grp * NP + jj
                w_lo = ptx.ue8m0_byte_to_f32(sc_lo, j)
                w_hi = ptx.ue8m0_byte_to_f32(sc_hi, j)
                for i in cutlass.range_constexpr(NSUB):
                    base = jj * (BN // 2) + 4 * i
                    acc[4 * i + 0] = acc[4 * i + 0] + part[base + 0] * (w_lo * xs[i][0])
                    acc[4 * i + 1] = acc[4 * i + 1] + part[base + 1] * (w_lo * xs[i][1])
                    acc[4 * i + 2] = acc[4 * i + 2] + part[base + 2] * (w_hi * xs[i][0])
                    acc[4 * i + 3] = acc[4 * i + 3] + part[base + 3] * (w_hi * xs[i][1])

    @cute.jit
    def tile_product(smem, tile0, row0, count, k_blocks, w_codes, w_scales, act, act_scale, acc):
        """acc = the FP32 products of 4 weight tiles (tile0..tile0+3) with the token tile's rows, K = k_blocks x 128."""
        tid = cute.arch.thread_idx()[0]
        wg = tid // 128
        t = tid % 128
        warp = t // 32
        lane = tid % 32
        g = lane // 4
        q = lane % 4
        for i in cutlass.range_constexpr(BN // 2):
            acc[i] = Float32(0.0)
        for s in cutlass.range_constexpr(STAGES - 1):
            if s < k_blocks:
                issue_stage(smem, s, s, tile0, tid, wg, t, row0, count, k_blocks, w_codes, w_scales, act, act_scale)
            ptx.cp_async_commit()
        for kb in cutlass.range(k_blocks):
            ptx.cp_async_wait(STAGES - 2)
            ptx.barrier_sync()  # the step has landed for every thread; the slot refilled below is free
            nk = kb + STAGES - 1
            if nk < k_blocks:
                issue_stage(smem, nk % STAGES, nk, tile0, tid, wg, t, row0, count, k_blocks, w_codes, w_scales,
                            act, act_scale)
            ptx.cp_async_commit()
            compute_stage(smem, kb % STAGES, wg, t, warp, g, q, acc)

    @cute.jit
    def find_tile(smem, local_experts, tile):
        """Global token tile index -> (expert, first grouped row, rows in the tile) from the shared tables."""
        counts = smem + cfg.table_offset
        offsets = counts + 4 * MAX_LOCAL_EXPERTS
        prefix = offsets + 4 * (MAX_LOCAL_EXPERTS + 1)
        e = Int32(0)
        while phase.lds_s32(prefix + 4 * (e + 1)) <= tile:
            e = e + 1
        first = phase.lds_s32(offsets + 4 * e) + (tile - phase.lds_s32(prefix + 4 * e)) * BN
        rows = phase.lds_s32(offsets + 4 * (e + 1)) - first
        if rows > BN:
            rows = Int32(BN)
        return e, first, rows

    @cute.kernel
    def kernel(x: Int64, x_sf: Int64, topk_idx: Int64, topk_weights: Int64,
               w1_codes: Int64, w1_scales: Int64, w1_factor: Int64,
               w2_codes: Int64, w2_scales: Int64, w2_factor: Int64,
               g_act: Int64, g_scale: Int64, g_weight: Int64, g_dest: Int64, g_src: Int64,
               mid: Int64, mid_scale: Int64, partials: Int64, y: Int64,
               expert_offsets: Int64, control: Int64, peers: Int64,
               num_tokens: Int32, topk: Int32, local_experts: Int32, expert_base: Int32,
               hidden: Int32, intermediate: Int32, num_ranks: Int32, timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        cta = cute.arch.block_idx()[0]
        ctas = cute.arch.grid_dim()[0]
        warp_id = tid // 32
        lane = tid % 32
        started = cute.arch.globaltimer()
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        counts = smem + cfg.table_offset
        offsets = counts + 4 * MAX_LOCAL_EXPERTS
        prefix = offsets + 4 * (MAX_LOCAL_EXPERTS + 1)
        assignments = num_tokens * topk

        # ---------------------------------------------------------------- 1. routing (CTA 0) + tag-1 barrier
        if cta == 0:
            e = tid
            while e < local_experts:
                phase.sts_s32(counts + 4 * e, Int32(0))
                e = e + THREADS
            ptx.barrier_sync()
            a = tid
            while a < assignments:
                le = Int32(phase.ldg_s64_nc(topk_idx + Int64(a) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    phase.atom_shared_add(counts + 4 * le, Int32(1))
                a = a + THREADS
            ptx.barrier_sync()
            if tid == 0:
                run = Int32(0)
                for le in cutlass.range(local_experts):
                    phase.sts_s32(offsets + 4 * le, run)
                    phase.st_relaxed(expert_offsets + Int64(le) * 4, run)
                    c = phase.lds_s32(counts + 4 * le)
                    phase.sts_s32(counts + 4 * le, run)  # from here on: the expert's next free grouped row
                    run = run + c
                phase.sts_s32(offsets + 4 * local_experts, run)
                phase.st_relaxed(expert_offsets + Int64(local_experts) * 4, run)
            ptx.barrier_sync()
            a = tid
            while a < assignments:
                le = Int32(phase.ldg_s64_nc(topk_idx + Int64(a) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    row = phase.atom_shared_add(counts + 4 * le, Int32(1))
                    phase.st_relaxed(g_src + Int64(row) * 4, a)
                a = a + THREADS
            ptx.barrier_sync()
            if tid == 0:
                phase.tag_barrier(control, TAG1_ARRIVE, peers, num_ranks, started, timeout_ns)
                phase.fence_gpu()
                phase.st_release_gpu(control + Int64(4 * ROUTING_READY), Int32(1))
        if tid == 0:
            phase.wait_at_least(control + Int64(4 * ROUTING_READY), Int32(1), started, timeout_ns, False)
        ptx.barrier_sync()
        e = tid
        while e <= local_experts:
            phase.sts_s32(offsets + 4 * e, phase.ld_relaxed(expert_offsets + Int64(e) * 4))
            e = e + THREADS
        ptx.barrier_sync()
        if tid == 0:
            run = Int32(0)
            for le in cutlass.range(local_experts):
                phase.sts_s32(prefix + 4 * le, run)
                rows = phase.lds_s32(offsets + 4 * (le + 1)) - phase.lds_s32(offsets + 4 * le)
                run = run + (rows + (BN - 1)) // BN
            phase.sts_s32(prefix + 4 * local_experts, run)
        ptx.barrier_sync()
        total_rows = phase.lds_s32(offsets + 4 * local_experts)
        token_tiles = phase.lds_s32(prefix + 4 * local_experts)

        # ---------------------------------------------------------------- 2. dispatch: one grouped row per warp
        h_blocks = hidden // 128
        row = cta * WARPS + warp_id
        while row < total_rows:
            a = phase.ld_relaxed(g_src + Int64(row) * 4)
            token = a // topk
            slot = a - token * topk
            le = Int32(phase.ldg_s64_nc(topk_idx + Int64(a) * 8)) - expert_base
            phase.pull_row_k128(x, x_sf, g_act, g_scale, token, row, hidden, h_blocks, lane)
            if lane == 0:
                ptx.stg_f32(g_weight + Int64(row) * 4, ptx.ldg_f32(topk_weights + Int64(a) * 4))
                phase.st_relaxed(g_dest + Int64(row) * 4, slot * num_tokens + token)
            phase.warp_sync()
            if lane == 0:
                phase.atom_release_gpu(control + Int64(4 * (ROWS_READY + le)), Int32(1))
            row = row + ctas * WARPS

        # ---------------------------------------------------------------- 3. W1 items, then W2 items
        m1 = intermediate // 128  # 256-row W1 CTA tiles per expert (2I rows)
        m2 = hidden // ROWS_PER_CTA
        items1 = m1 * token_tiles
        items2 = m2 * token_tiles
        wg = tid // 128
        warp = (tid % 128) // 32
        g = lane // 4
        q = lane % 4
        acc = cute.make_rmem_tensor((BN // 2,), Float32)
        hv = cute.make_rmem_tensor((BN // 4,), Float32)
        item = cta
        while item < items1 + items2:
            local_item = item
            if item >= items1:
                local_item = item - items1
            mt = local_item // token_tiles
            expert, row0, count = find_tile(smem, local_experts, local_item - mt * token_tiles)
            expert_tiles = phase.lds_s32(prefix + 4 * (expert + 1)) - phase.lds_s32(prefix + 4 * expert)
            if tid == 0:
                if item < items1:
                    rows_of_e = phase.lds_s32(offsets + 4 * (expert + 1)) - phase.lds_s32(offsets + 4 * expert)
                    phase.wait_at_least(control + Int64(4 * (ROWS_READY + expert)), rows_of_e, started, timeout_ns,
                                  False)
                else:
                    phase.wait_at_least(control + Int64(4 * (W1_DONE + expert)), m1 * expert_tiles, started,
                                  timeout_ns, False)
            ptx.barrier_sync()  # the wait above, and every thread is past the previous item's shared reads
            # one pipeline for both GEMMs: the item picks its operands
            k_blocks = intermediate // 128
            tile0 = expert * (hidden // 64) + mt * TILES_PER_CTA
            codes, scales, act, act_scale, factors = w2_codes, w2_scales, mid, mid_scale, w2_factor
            if item < items1:
                k_blocks = h_blocks
                tile0 = expert * (2 * intermediate // 64) + mt * TILES_PER_CTA
                codes, scales, act, act_scale, factors = w1_codes, w1_scales, g_act, g_scale, w1_factor
            tile_product(smem, tile0, row0, count, k_blocks, codes, scales, act, act_scale, acc)
            factor = ptx.ldg_f32(factors + Int64(expert) * 4)
            if item < items1:
                i_blocks = intermediate // 128
                channel = mt * 128 + wg * 32 + warp * 8 + g
                for i in cutlass.range_constexpr(NSUB):
                    for c in cutlass.range_constexpr(2):
                        n = 8 * i + 2 * q + c
                        nrow = Int64(row0) + Int64(n)
                        if n >= count:
                            nrow = Int64(row0)
                        gate = ptx.fmin(acc[4 * i + c] * factor, Float32(cfg.swiglu_clamp))
                        up = ptx.fmax(ptx.fmin(acc[4 * i + 2 + c] * factor, Float32(cfg.swiglu_clamp)),
                                      Float32(-cfg.swiglu_clamp))
                        weight = phase.ld_relaxed_f32(g_weight + nrow * 4)
                        h = gate * ptx.fast_sigmoid(gate * Float32(cfg.swiglu_alpha)) * up * weight
                        hv[2 * i + c] = h
                        m = ptx.fabs(h)
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 4))
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 8))
                        m = ptx.fmax(m, ptx.shfl_xor_f32(m, 16))
                        if g == 0:
                            ptx.sts_f32(smem + cfg.amax_offset + ((wg * 4 + warp) * BN + n) * 4, m)
                ptx.barrier_sync()
                for i in cutlass.range_constexpr(NSUB):
                    for c in cutlass.range_constexpr(2):
                        n = 8 * i + 2 * q + c
                        amax = Float32(AMAX_FLOOR)
                        for p in cutlass.range_constexpr(WARPS):
                            amax = ptx.fmax(amax, ptx.lds_f32(smem + cfg.amax_offset + (p * BN + n) * 4))
                        inv = Float32(FP8_MAX) * ptx.fast_reciprocal(amax)
                        if n < count:
                            nrow = Int64(row0) + Int64(n)
                            ptx.stg_e4m3(mid + nrow * Int64(intermediate) + Int64(channel), hv[2 * i + c] * inv)
                            if tid < 4:
                                ptx.stg_f32(mid_scale + (nrow * Int64(i_blocks) + Int64(mt)) * 4,
                                            amax * Float32(1.0 / FP8_MAX))
                ptx.barrier_sync()
                if tid == 0:
                    phase.fence_gpu()
                    phase.red_release_gpu(control + Int64(4 * (W1_DONE + expert)), Int32(1))
            else:
                h_row = mt * ROWS_PER_CTA + wg * 64 + warp * 16 + g
                for i in cutlass.range_constexpr(NSUB):
                    for c in cutlass.range_constexpr(2):
                        n = 8 * i + 2 * q + c
                        if n < count:
                            d = phase.ld_relaxed(g_dest + (Int64(row0) + Int64(n)) * 4)
                            base = partials + (Int64(d) * Int64(hidden) + Int64(h_row)) * 2
                            ptx.stg_bf16(base, acc[4 * i + c] * factor)
                            ptx.stg_bf16(base + Int64(16), acc[4 * i + 2 + c] * factor)
                ptx.barrier_sync()
                if tid == 0:
                    phase.fence_gpu()
                    phase.red_release_gpu(control + Int64(4 * W2_DONE), Int32(1))
            item = item + ctas

        # ---------------------------------------------------------------- 4. combine (after every W2 item)
        if tid == 0:
            phase.wait_at_least(control + Int64(4 * W2_DONE), items2, started, timeout_ns, False)
        ptx.barrier_sync()
        if cta == 0:  # overlapped with the combine: no one reads the per-expert counters any more
            e = tid
            while e < local_experts:
                phase.st_relaxed(control + Int64(4 * (ROWS_READY + e)), Int32(0))
                phase.st_relaxed(control + Int64(4 * (W1_DONE + e)), Int32(0))
                e = e + THREADS
        per_token = hidden // 8
        unit = cta * THREADS + tid
        out = cute.make_rmem_tensor((8,), Float32)
        while unit < num_tokens * per_token:
            token = unit // per_token
            col = (unit - token * per_token) * 8
            for i in cutlass.range_constexpr(8):
                out[i] = Float32(0.0)
            for s in cutlass.range(topk):
                le = Int32(phase.ldg_s64_nc(topk_idx + (Int64(token) * Int64(topk) + Int64(s)) * 8)) - expert_base
                if le >= 0 and le < local_experts:
                    phase.combine_add8(out, partials + ((Int64(s) * Int64(num_tokens) + Int64(token)) * Int64(hidden)
                                                  + Int64(col)) * 2)
            phase.store_bf16x8(y + (Int64(token) * Int64(hidden) + Int64(col)) * 2, out)
            unit = unit + ctas * THREADS

        # ---------------------------------------------------------------- 5. tail: tag-2 barrier, clean
        ptx.barrier_sync()
        if tid == 0:
            phase.fence_gpu()
            arrived = phase.atom_acq_rel_gpu(control + Int64(4 * FINISH), Int32(1))
            if arrived == ctas - 1:  # the last CTA: every other one is past all its waits
                phase.tag_barrier(control, TAG2_ARRIVE, peers, num_ranks, started, timeout_ns)
                for word in (ROUTING_READY, TAG1_ARRIVE, TAG2_ARRIVE, W2_DONE, FINISH):
                    phase.st_relaxed(control + Int64(4 * word), Int32(0))

    return kernel


def _host_launcher(cfg: PortConfig, kernel):
    from cutlass import Int32, Int64, cute

    @cute.jit
    def host(a0: Int64, a1: Int64, a2: Int64, a3: Int64, a4: Int64, a5: Int64, a6: Int64, a7: Int64, a8: Int64,
             a9: Int64, a10: Int64, a11: Int64, a12: Int64, a13: Int64, a14: Int64, a15: Int64, a16: Int64,
             a17: Int64, a18: Int64, a19: Int64, a20: Int64, a21: Int64, num_tokens: Int32, topk: Int32,
             local_experts: Int32, expert_base: Int32, hidden: Int32, intermediate: Int32, num_ranks: Int32,
             timeout_ns: Int64):
        kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
               num_tokens, topk, local_experts, expert_base, hidden, intermediate, num_ranks, timeout_ns).launch(
            grid=(1, 1, 1), block=(THREADS, 1, 1), smem=cfg.smem_bytes)

    return host


def build_port(arch: str = "sm_90a", block_n: int = 16, stages: int = 5, swiglu_alpha: float = 1.0,
               swiglu_clamp: float = 10.0):
    """The runtime's builder: a CompileRequest for one variant (no GPU needed)."""
    from cutlass import Int32, Int64

    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the SM90 Mega MoE port is built for sm_90a only, not {arch!r}")
    cfg = PortConfig(block_n, stages, swiglu_alpha, swiglu_clamp)
    host = _host_launcher(cfg, _make_kernel(cfg))
    args = tuple(Int64(0) if kind == "u64" else Int64(1) if kind == "s64" else Int32(1) for _, kind in PARAMS)
    return CompileRequest(host, args, LaunchShape(block=(THREADS, 1, 1), dynamic_smem_bytes=cfg.smem_bytes))
