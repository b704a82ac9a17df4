"""Inline-PTX building blocks of the SM90 kernels (CuTe DSL, traced inside @cute.kernel functions).

Each helper emits one short PTX sequence through `llvm.inline_asm`. Global addresses travel as Int64,
shared addresses as Int32 (the .shared window), so the kernels take only scalar parameters.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

_CONSTRAINT = {Int32: "r", Uint32: "r", Float32: "f", Int64: "l"}


@dsl_user_op
def asm(ptx: str, outs: list, ins: list, *, loc=None, ip=None):
    """Run `ptx` with outputs $0.. of types `outs` followed by inputs; returns None, a value, or a list."""
    in_vals = [v.ir_value(loc=loc, ip=ip) for v in ins]
    constraints = ",".join(["=" + _CONSTRAINT[t] for t in outs] + [_CONSTRAINT[type(v)] for v in ins])
    kw = {"has_side_effects": True, "is_align_stack": False, "asm_dialect": llvm.AsmDialect.AD_ATT,
          "loc": loc, "ip": ip}
    if not outs:
        llvm.inline_asm(None, in_vals, ptx, constraints, **kw)
        return None
    if len(outs) == 1:
        return outs[0](llvm.inline_asm(outs[0].mlir_type, in_vals, ptx, constraints, **kw))
    struct = llvm.StructType.get_literal([t.mlir_type for t in outs])
    res = llvm.inline_asm(struct, in_vals, ptx, constraints, **kw)
    return [t(llvm.extractvalue(t.mlir_type, res, [i], loc=loc, ip=ip)) for i, t in enumerate(outs)]


# ------------------------------------------------------------------------------------------ async copies
def evict_first_policy() -> Int64:
    """An L2 cache policy that marks streamed weights evict-first (read once per layer)."""
    return asm("createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", [Int64], [])


def cp_async_16_weights(dst: Int32, src: Int64, policy) -> None:
    """16-byte copy of streamed weights; with an L2 policy (createpolicy) when one is given."""
    if policy is None:
        asm("cp.async.cg.shared.global [$0], [$1], 16;", [], [dst, src])
    else:
        asm("cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, 16, $2;", [], [dst, src, policy])


def cp_async_16_zfill(dst: Int32, src: Int64, src_bytes: Int32) -> None:
    """16-byte copy; bytes past src_bytes (0 or 16) are zero-filled."""
    asm("cp.async.cg.shared.global [$0], [$1], 16, $2;", [], [dst, src, src_bytes])


def cp_async_4_zfill(dst: Int32, src: Int64, src_bytes: Int32) -> None:
    asm("cp.async.ca.shared.global [$0], [$1], 4, $2;", [], [dst, src, src_bytes])


def cp_async_commit() -> None:
    asm("cp.async.commit_group;", [], [])


def cp_async_wait(pending: int) -> None:
    asm(f"cp.async.wait_group {pending};", [], [])


def barrier_sync() -> None:
    asm("bar.sync 0;", [], [])


# ------------------------------------------------------------------------------------------ loads / stores
def lds128(addr: Int32) -> list:
    return asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", [Uint32] * 4, [addr])


def lds32(addr: Int32) -> Uint32:
    return asm("ld.shared.b32 $0, [$1];", [Uint32], [addr])


def lds_s32(addr: Int32) -> Int32:
    return asm("ld.shared.b32 $0, [$1];", [Int32], [addr])


def lds_f32x2(addr: Int32) -> list:
    return asm("ld.shared.v2.f32 {$0, $1}, [$2];", [Float32] * 2, [addr])


def lds_f32x4(addr: Int32) -> list:
    return asm("ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", [Float32] * 4, [addr])


def sts_f32(addr: Int32, v: Float32) -> None:
    asm("st.shared.f32 [$0], $1;", [], [addr, v])


def sts_s32(addr: Int32, v: Int32) -> None:
    asm("st.shared.b32 [$0], $1;", [], [addr, v])


def sts128(addr: Int32, words: list) -> None:
    asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", [], [addr, *words])


def lds_f32(addr: Int32) -> Float32:
    return asm("ld.shared.f32 $0, [$1];", [Float32], [addr])


def red_max_shared_nonneg_f32(addr: Int32, v: Float32) -> None:
    """Shared-memory max of a non-negative float: its bits compare as an unsigned integer's do, so the
    integer max of the slot (zero to start) is the float max."""
    asm("{\n.reg .b32 b;\nmov.b32 b, $1;\nred.shared.max.u32 [$0], b;\n}", [], [addr, v])


def ldg_s32(addr: Int64) -> Int32:
    return asm("ld.global.nc.b32 $0, [$1];", [Int32], [addr])


def ldg_f32(addr: Int64) -> Float32:
    return asm("ld.global.nc.f32 $0, [$1];", [Float32], [addr])


def ldg_s64(addr: Int64) -> Int64:
    return asm("ld.global.nc.b64 $0, [$1];", [Int64], [addr])


# coherent loads: words another kernel writes while this one runs (read after an acquire), where the
# read-only `.nc` path is not allowed
def ld_global_s32(addr: Int64) -> Int32:
    return asm("ld.global.b32 $0, [$1];", [Int32], [addr])


def ld_global_f32(addr: Int64) -> Float32:
    return asm("ld.global.f32 $0, [$1];", [Float32], [addr])


def stg_f32(addr: Int64, v: Float32) -> None:
    asm("st.global.f32 [$0], $1;", [], [addr, v])


def stg_e4m3(addr: Int64, v: Float32) -> None:
    """Round v to E4M3 (saturating) and store the byte."""
    asm(
        "{\n.reg .b16 t;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 t, z, $1;\nst.global.b8 [$0], t;\n}",
        [],
        [addr, v],
    )


def stg_e4m3x4(addr: Int64, v: list) -> None:
    """Round four values to E4M3 (saturating, as stg_e4m3 does each) and store them as one word, v[0] at the lowest
    address (the conversion puts its first operand in the upper byte)."""
    asm(
        "{\n.reg .b16 lo, hi;\n.reg .b32 w;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 w, {lo, hi};\nst.global.b32 [$0], w;\n}",
        [],
        [addr, *v],
    )


def sts_e4m3(addr: Int32, v: Float32) -> None:
    """Round v to E4M3 (saturating) and store the byte to shared memory."""
    asm(
        "{\n.reg .b16 t;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 t, z, $1;\nst.shared.b8 [$0], t;\n}",
        [],
        [addr, v],
    )


def stg_bf16(addr: Int64, v: Float32) -> None:
    asm("{\n.reg .b16 t;\ncvt.rn.bf16.f32 t, $1;\nst.global.b16 [$0], t;\n}", [], [addr, v])


# ------------------------------------------------------------------------------------------ math
def pack_bf16x2(lo: Float32, hi: Float32) -> Uint32:
    """Two FP32 values rounded to BF16 in one word (lo in the low half: the lower address once stored)."""
    return asm("cvt.rn.bf16x2.f32 $0, $1, $2;", [Uint32], [hi, lo])


def stmatrix_x4_trans(addr: Int32, words: list) -> None:
    """Four 8x8 BF16 matrices from the warp's fragments (word j: matrix j, lane l holding row l // 4, columns
    2 (l % 4) and 2 (l % 4) + 1), stored transposed: lane 8 j + c names the shared row that takes column c of
    matrix j (16 bytes, the matrix's eight rows in order)."""
    asm("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", [], [addr, *words])


def stg128(addr: Int64, words: list) -> None:
    asm("st.global.v4.b32 [$0], {$1, $2, $3, $4};", [], [addr, *words])


def ue8m0_byte_to_f32(word: Uint32, byte: int) -> Float32:
    """Byte `byte` of a packed scale word as the float 2^(b - 127) (the byte becomes the exponent field)."""
    bits = ((word >> (8 * byte)) & Uint32(0xFF)) << 23
    return asm("mov.b32 $0, $1;", [Float32], [bits])


def fast_sigmoid(x: Float32) -> Float32:
    """1 / (1 + 2^(-x log2 e)) with the approximate ex2 / rcp units."""
    return asm(
        "{\n.reg .f32 t;\nmul.f32 t, $1, 0fBFB8AA3B;\nex2.approx.ftz.f32 t, t;\n"
        "add.f32 t, t, 0f3F800000;\nrcp.approx.ftz.f32 $0, t;\n}",
        [Float32],
        [x],
    )


def decode_fp4x4_low(w: Uint32) -> Uint32:
    """Low nibbles of the four bytes of w -> four E4M3 bytes of value / 64 (sign to bit 7, magnitude << 2)."""
    return ((w << 4) & Uint32(0x80808080)) | ((w << 2) & Uint32(0x1C1C1C1C))


def decode_fp4x4_high(w: Uint32) -> Uint32:
    """High nibbles of the four bytes of w -> four E4M3 bytes of value / 64."""
    return (w & Uint32(0x80808080)) | ((w >> 2) & Uint32(0x1C1C1C1C))


def decode_fp4x8_split(w: Uint32) -> tuple:
    """A "split"-order word's eight codes -> the row g and row g + 8 A registers (grouped_gemm.decode_fp4x8_split)."""
    from gc_moe.kernels.sm90.grouped_gemm import decode_fp4x8_split as decode

    return decode(w, Uint32)


def decode_fp4x4_folded(w: Uint32, step: Uint32, high: bool) -> Uint32:
    """Four FP4 nibbles of w with their K32 scale folded in: E4M3 bytes of value * 2^(d - 5) (see
    grouped_gemm.decode_fp4x4_folded, the arithmetic shared with its CPU emulation)."""
    from gc_moe.kernels.sm90.grouped_gemm import decode_fp4x4_folded as decode

    return decode(w, step, high, Uint32)


def prmt(a: Uint32, b: Uint32, selector: Uint32) -> Uint32:
    """Byte permute (default mode): result byte i = byte selector[4i..4i+3] of (a: bytes 0..3, b: 4..7)."""
    return asm("prmt.b32 $0, $1, $2, $3;", [Uint32], [a, b, selector])


def byte_zext(word: Uint32, byte: int) -> Uint32:
    """Byte `byte` of `word`, zero-extended, in one PRMT (shift and mask take two)."""
    return prmt(word, Uint32(0), Uint32(0x4440 | byte))


def decode_table(scale_word: Uint32, byte: int) -> tuple:
    """Byte `byte` of a packed K32 scale word -> the block's two table words (grouped_gemm.decode_table)."""
    from gc_moe.kernels.sm90.grouped_gemm import decode_table as table

    return table(scale_word, byte, Uint32, byte_zext)


def decode_fp4x8_table(w: Uint32, table_lo: tuple, table_hi: tuple) -> tuple:
    """A "table"-order word's eight codes -> the row g and row g + 8 A registers (grouped_gemm.decode_fp4x8_table)."""
    from gc_moe.kernels.sm90.grouped_gemm import decode_fp4x8_table as decode

    return decode(w, table_lo, table_hi, prmt, Uint32)


def decode_fragment_table(words: list, scale_lo: Uint32, scale_hi: Uint32) -> list:
    """A consumer thread's 16 A registers of a K128 step through the table decode: its eight code words (two 16-byte
    loads) and its two rows' packed K32 scale words (row g, row g + 8), per K32 block the two rows' tables."""
    a_regs = []
    for j in range(4):
        table_lo = decode_table(scale_lo, j)
        table_hi = decode_table(scale_hi, j)
        a_regs += [*decode_fp4x8_table(words[2 * j], table_lo, table_hi),
                   *decode_fp4x8_table(words[2 * j + 1], table_lo, table_hi)]
    return a_regs


def fold_exponent_step(scale_word: Uint32, byte: int) -> Uint32:
    """Byte `byte` of a packed K32 scale word (d + 133) -> the exponent-field add 8 (d + 1)."""
    from gc_moe.kernels.sm90.grouped_gemm import fold_exponent_step as step

    return step(scale_word, byte, Uint32)


# ------------------------------------------------------------------------------------------ WGMMA
def smem_desc_kmajor(addr: Int32, lbo: int, sbo: int) -> Int64:
    """WGMMA shared-memory descriptor, no swizzle: start, K-direction core stride (LBO), N-direction (SBO)."""
    return smem_desc_kmajor_from_lo(smem_desc_kmajor_lo(addr, lbo), sbo)


def smem_desc_kmajor_lo(addr: Int32, lbo: int) -> Int32:
    """The low word of smem_desc_kmajor (start-address field | LBO field). A shared::cta address is below
    256 KB, so its field (address >> 4) stays below 2^14: a loop may advance this word by (bytes >> 4) without
    touching the LBO bits, and rebuild each descriptor with smem_desc_kmajor_from_lo alone."""
    return ((addr >> 4) & Int32(0x3FFF)) | Int32((lbo >> 4) << 16)


def smem_desc_kmajor_from_lo(lo: Int32, sbo: int) -> Int64:
    return Int64(lo) & Int64(0xFFFFFFFF) | Int64((sbo >> 4) << 32)


def wgmma_fence() -> None:
    asm("wgmma.fence.sync.aligned;", [], [])


def wgmma_rs_e4m3_batch(n: int, a_regs: list, descs: list) -> list:
    """Issue len(descs) register-A `m64n{n}k32` E4M3 WGMMAs into fresh accumulators, commit, wait.

    a_regs: 4 Uint32 per instruction; returns n/2 floats per instruction (the m64nN f32 fragment).
    One asm block keeps the accumulators untouched by the compiler between issue and wait.
    """
    per = n // 2
    count = len(descs)
    zero = f"${count * per + 5 * count}"
    lines = ["{", ".reg .pred fresh;", f"setp.ne.b32 fresh, {zero}, 0;"]
    for i in range(count):
        d = ", ".join(f"${i * per + r}" for r in range(per))
        a0 = count * per + 4 * i
        a = ", ".join(f"${a0 + r}" for r in range(4))
        desc = f"${count * per + 4 * count + i}"
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, {desc}, fresh, 1, 1;")
    lines.append("wgmma.commit_group.sync.aligned;")
    lines.append("wgmma.wait_group.sync.aligned 0;")
    lines.append("}")
    return asm("\n".join(lines), [Float32] * (per * count), list(a_regs) + list(descs) + [Int32(0)])


def wgmma_rs_e4m3_chain(n: int, a_regs: list, descs: list) -> list:
    """len(descs) register-A `m64n{n}k32` E4M3 WGMMAs chained into one accumulator, commit, one wait.

    The first starts fresh (scale-d false), the others accumulate: with the K32 scales folded into the A
    operand the K32 blocks of one K128 step share one FP32 chain. Returns the n/2 floats of the fragment.
    """
    per = n // 2
    count = len(descs)
    zero = f"${per + 5 * count}"
    d = ", ".join(f"${r}" for r in range(per))
    lines = ["{", ".reg .pred fresh, chain;", f"setp.ne.b32 fresh, {zero}, 0;", f"setp.eq.b32 chain, {zero}, 0;"]
    for i in range(count):
        a = ", ".join(f"${per + 4 * i + r}" for r in range(4))
        desc = f"${per + 4 * count + i}"
        pred = "fresh" if i == 0 else "chain"
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, {desc}, {pred}, 1, 1;")
    lines.append("wgmma.commit_group.sync.aligned;")
    lines.append("wgmma.wait_group.sync.aligned 0;")
    lines.append("}")
    return asm("\n".join(lines), [Float32] * per, list(a_regs) + list(descs) + [Int32(0)])


def wgmma_ss_e4m3_chains(n: int, a_descs: list, b_descs: list) -> list:
    """len(a_descs) chains of shared-A `m64n{n}k32` E4M3 WGMMAs (chain i: A descriptors a_descs[i], one per K32
    block, against b_descs), each into its own accumulator, the first of a chain fresh; one commit, one wait.
    Returns per chain its n/2 floats."""
    per = n // 2
    chains, count = len(a_descs), len(b_descs)
    ins = [d for chain in a_descs for d in chain] + list(b_descs) + [Int32(0)]
    zero = f"${chains * per + len(ins) - 1}"
    lines = ["{", ".reg .pred fresh, chain;", f"setp.ne.b32 fresh, {zero}, 0;", f"setp.eq.b32 chain, {zero}, 0;"]
    for c in range(chains):
        d = ", ".join(f"${c * per + r}" for r in range(per))
        for i in range(count):
            a = f"${chains * per + c * count + i}"
            b = f"${chains * per + chains * count + i}"
            pred = "fresh" if i == 0 else "chain"
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {a}, {b}, {pred}, 1, 1;")
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    out = asm("\n".join(lines), [Float32] * (per * chains), ins)
    out = out if isinstance(out, list) else [out]
    return [out[c * per:(c + 1) * per] for c in range(chains)]


# ------------------------------------------------------------------------------------------ warp / scalar
def shfl_xor_f32(v: Float32, lane_mask: int) -> Float32:
    return asm(f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 31, -1;", [Float32], [v])


def fmax(a: Float32, b: Float32) -> Float32:
    return asm("max.f32 $0, $1, $2;", [Float32], [a, b])


def fmin(a: Float32, b: Float32) -> Float32:
    return asm("min.f32 $0, $1, $2;", [Float32], [a, b])


def fabs(a: Float32) -> Float32:
    return asm("abs.f32 $0, $1;", [Float32], [a])


def fast_reciprocal(a: Float32) -> Float32:
    """1 / a with the approximate unit (an IEEE division would pull in a slow-path subroutine)."""
    return asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [a])


# ------------------------------------------------------------------------------------------ mbarrier pipelines
# The warp-specialized grouped GEMM: a producer warp fills a ring of shared-memory stages (bulk copies and
# cp.async, each completing on the stage's "full" mbarrier); consumer warps wait on it, read the stage and
# arrive on its "empty" mbarrier. Addresses are .shared::cta offsets (Int32).
def mbarrier_init(addr: Int32, count: int) -> None:
    asm(f"mbarrier.init.shared::cta.b64 [$0], {count};", [], [addr])


def fence_mbarrier_init() -> None:
    """Make mbarrier.init visible to the async proxy (bulk copies complete on the barriers)."""
    asm("fence.mbarrier_init.release.cluster;", [], [])


def fence_proxy_async_shared() -> None:
    """Order generic-proxy shared-memory writes (cp.async) before async-proxy reads (WGMMA operands)."""
    asm("fence.proxy.async.shared::cta;", [], [])


def named_barrier_sync(barrier_id: int, threads: int) -> None:
    """bar.sync on barrier `barrier_id` among `threads` threads (a subset of the CTA, whole warps)."""
    asm(f"bar.sync {barrier_id}, {threads};", [], [])


GEMM_BARRIER = 2  # named barrier of a GEMM's threads when side threads share the CTA (0: the CTA, 1: consumers)
PRODUCER_WARP_BARRIER = 3  # named barrier of a warp-specialized GEMM's single producer warp (its 32 threads)


def gemm_barrier(cfg) -> None:
    """A barrier over a warp-specialized GEMM's threads (`grouped_gemm.GemmConfig`): the whole CTA, or, with
    `cfg.side_threads` beside them (the Mega MoE port's dispatch warps), a named barrier over `cfg.threads`."""
    if cfg.side_threads:
        named_barrier_sync(GEMM_BARRIER, cfg.threads)
    else:
        barrier_sync()


def warp_sync() -> None:
    asm("bar.warp.sync -1;", [], [])


def mbarrier_arrive(addr: Int32) -> None:
    asm("mbarrier.arrive.shared::cta.b64 _, [$0];", [], [addr])


def mbarrier_arrive_count(addr: Int32, count: int) -> None:
    """`count` arrivals at once (one thread arriving for several warps, after a barrier they all passed)."""
    asm(f"mbarrier.arrive.shared::cta.b64 _, [$0], {count};", [], [addr])


def mbarrier_arrive_expect_tx(addr: Int32, tx_bytes: int) -> None:
    """One arrival that also announces `tx_bytes` of bulk copies completing on this phase."""
    asm(f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {tx_bytes};", [], [addr])


def cp_async_mbarrier_arrive_noinc(addr: Int32) -> None:
    """One arrival on the barrier once every earlier cp.async of this thread has landed (counted at init)."""
    asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", [], [addr])


def bulk_copy_g2s(dst: Int32, src: Int64, size: int, mbar: Int32) -> None:
    """cp.async.bulk of `size` bytes (multiple of 16, both addresses 16-byte aligned) global -> shared,
    completing `size` transaction bytes on mbarrier `mbar`."""
    asm(f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {size}, [$2];", [],
        [dst, src, mbar])


def tensor_map_acquire(tmap: Int64) -> None:
    """Before a CTA's first copy through a tensor map in global memory (written there by the host): the tensor-map
    proxy's view of its 128 bytes acquired, as the PTX memory model asks of a map not passed as a kernel parameter."""
    asm("fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", [], [tmap])


def tensor_copy_3d_g2s(dst: Int32, tmap: Int64, c0: Int32, c1: Int32, c2: Int32, mbar: Int32) -> None:
    """cp.async.bulk.tensor of one box of the 3-D tensor map at global address `tmap` (coordinates c0, c1, c2,
    innermost first; the box lands in shared memory at `dst`, 128-byte aligned, elements past the tensor zero-filled),
    completing the box's bytes on mbarrier `mbar`. Async proxy on both sides: a WGMMA may read the box after the
    barrier's phase without a proxy fence."""
    asm("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [$0], [$1, {$2, $3, $4}], "
        "[$5];", [], [dst, tmap, c0, c1, c2, mbar])


def mbarrier_wait(addr: Int32, parity: Int32, max_tries: int = 1 << 24, suspend_ns: int = 0,
                  limit_ns: int = 10_000_000_000, first_try: bool = False) -> None:
    """Wait until the phase of parity `parity` of the barrier completed; trap instead of hanging.

    suspend_ns = 0: poll `try_wait` (each suspends for a hardware time limit) and trap after `max_tries` polls.
    first_try: one `try_wait` before the polls' counter is set, so a phase already complete costs the wait and its
    branch alone (the counter's move is one instruction of every K128 step of a loop whose stages are full).
    suspend_ns > 0: `try_wait` with that suspend-time hint, so a waiting warp sleeps until the phase completes
    instead of re-issuing its poll loop (whose instructions take issue slots from the warps that work); the
    bound is then time: trap once `limit_ns` of %globaltimer passed since the first failed try."""
    if suspend_ns <= 0:
        first = ("mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n@done bra.uni DONE;\n"
                 if first_try else "")
        asm(
            "{\n.reg .pred done, more;\n.reg .b32 tries;\n" + first + "mov.b32 tries, 0;\n"
            "WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n@done bra.uni DONE;\n"
            f"add.s32 tries, tries, 1;\nsetp.lt.s32 more, tries, {max_tries};\n@more bra.uni WAIT;\ntrap;\n"
            "DONE:\n}",
            [],
            [addr, parity],
        )
        return
    asm(
        "{\n.reg .pred done, late;\n.reg .b64 t0, t1;\n"
        f"mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1, {suspend_ns};\n@done bra.uni DONE;\n"
        "mov.u64 t0, %globaltimer;\n"
        f"WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1, {suspend_ns};\n@done bra.uni DONE;\n"
        f"mov.u64 t1, %globaltimer;\nsub.u64 t1, t1, t0;\nsetp.gt.u64 late, t1, {limit_ns};\n"
        "@!late bra.uni WAIT;\ntrap;\n"
        "DONE:\n}",
        [],
        [addr, parity],
    )


def cp_async_wait_all() -> None:
    """Wait for every cp.async of this thread, committed to a group or not."""
    asm("cp.async.wait_all;", [], [])


# ------------------------------------------------------------------------------------------ pipelined WGMMA
@dsl_user_op
def _asm_tied(ptx: str, n_out: int, ins: list, tied: list, *, loc=None, ip=None) -> list:
    """`ptx` with Float32 outputs $0..$(n_out-1), then inputs `ins`, then `tied` Float32 inputs bound to the
    outputs' registers (in/out operands: the compiler keeps each output in its input's register, so a WGMMA
    may still write it after the asm block ends)."""
    in_vals = [v.ir_value(loc=loc, ip=ip) for v in list(ins) + list(tied)]
    constraints = ",".join(["=f"] * n_out + [_CONSTRAINT[type(v)] for v in ins] + [str(i) for i in range(len(tied))])
    struct = llvm.StructType.get_literal([Float32.mlir_type] * n_out)
    res = llvm.inline_asm(struct, in_vals, ptx, constraints, has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(Float32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(n_out)]


def wgmma_rs_e4m3_issue(n: int, a_regs: list, descs: list, acc: list, pending: int) -> list:
    """Issue len(descs) register-A `m64n{n}k32` E4M3 WGMMAs into fresh accumulators `acc` (n/2 floats each,
    in/out operands), commit them as one group and wait until at most `pending` groups are in flight: with
    pending = 1 the group just issued keeps running while the caller works on the one before it."""
    per = n // 2
    count = len(descs)
    lines = ["{", ".reg .pred fresh;", "setp.ne.b32 fresh, 0, 0;"]
    for i in range(count):
        d = ", ".join(f"${i * per + r}" for r in range(per))
        a0 = count * per + 4 * i
        a = ", ".join(f"${a0 + r}" for r in range(4))
        desc = f"${count * per + 4 * count + i}"
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, {desc}, fresh, 1, 1;")
    lines += ["wgmma.commit_group.sync.aligned;", f"wgmma.wait_group.sync.aligned {pending};", "}"]
    return _asm_tied("\n".join(lines), per * count, list(a_regs) + list(descs), list(acc))


def wgmma_rs_e4m3_chain_issue(n: int, a_regs: list, descs: list, acc: list, pending: int) -> list:
    """len(descs) register-A `m64n{n}k32` E4M3 WGMMAs chained into `acc` (n/2 floats, in/out operands; the first
    starts fresh), committed as one group, then wait until at most `pending` groups are in flight: the folded
    scales' pipelined consumer keeps one K128 step's chain running while it scales the step before."""
    per = n // 2
    count = len(descs)
    lines = ["{", ".reg .pred fresh, chain;", "setp.ne.b32 fresh, 0, 0;", "setp.eq.b32 chain, 0, 0;"]
    d = ", ".join(f"${r}" for r in range(per))
    for i in range(count):
        a = ", ".join(f"${per + 4 * i + r}" for r in range(4))
        desc = f"${per + 4 * count + i}"
        pred = "fresh" if i == 0 else "chain"
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, {desc}, {pred}, 1, 1;")
    lines += ["wgmma.commit_group.sync.aligned;", f"wgmma.wait_group.sync.aligned {pending};", "}"]
    return _asm_tied("\n".join(lines), per, list(a_regs) + list(descs), list(acc))


def wgmma_rs_e4m3_accumulate(chains: list, a_regs: list, acc: list, pending: int = 0) -> list:
    """Register-A `m64n{n}k32` E4M3 WGMMAs that all accumulate into `acc` (in/out operands, scale-d 1), one chain
    per (n, descs) of `chains` on the same A fragment, chain i on the next n_i / 2 floats of acc; one commit, one
    wait. The scale-ratio consumer (grouped_gemm's `scale_ratios`): its sums are rescaled before the step, so the
    step's products go straight into them, and the wide tile's two chains need no second wait. pending: the groups
    left in flight after the commit (a caller that waits later, `wgmma_wait_tied`, writes no register of the chain
    before that wait)."""
    per = sum(n // 2 for n, _ in chains)
    count = sum(len(descs) for _, descs in chains)
    lines = ["{", ".reg .pred sum;", "setp.eq.b32 sum, 0, 0;"]
    first, desc_at = 0, per + len(a_regs)
    for n, descs in chains:
        d = ", ".join(f"${first + r}" for r in range(n // 2))
        for i in range(len(descs)):
            a = ", ".join(f"${per + 4 * i + r}" for r in range(4))
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {{{a}}}, ${desc_at}, sum, 1, 1;")
            desc_at += 1
        first += n // 2
    assert desc_at == per + len(a_regs) + count and len(acc) == per
    lines += ["wgmma.commit_group.sync.aligned;", f"wgmma.wait_group.sync.aligned {pending};", "}"]
    return _asm_tied("\n".join(lines), per, list(a_regs) + [d for _, descs in chains for d in descs], list(acc))


def rcp_approx_f32(v: Float32) -> Float32:
    return asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [v])


def wgmma_wait_tied(acc: list, pending: int = 0) -> list:
    """wgmma.wait_group `pending` with `acc` as in/out operands (the registers a group in flight writes)."""
    return _asm_tied(f"wgmma.wait_group.sync.aligned {pending};", len(acc), [], list(acc))


def lds64(addr: Int32) -> list:
    return asm("ld.shared.v2.b32 {$0, $1}, [$2];", [Uint32] * 2, [addr])


# ------------------------------------------------------------------------------------------ warp integer helpers
def shfl_up_s32(v: Int32, delta: int) -> Int32:
    """The value of lane (lane - delta); lanes below delta get their own."""
    return asm(f"shfl.sync.up.b32 $0, $1, {delta}, 0, -1;", [Int32], [v])


def shfl_idx_s32(v: Int32, src: Int32) -> Int32:
    """The value of lane `src` (every lane of the warp takes part)."""
    return asm("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", [Int32], [v, src])


def division_magic(d: Int32) -> Uint32:
    """floor((2^32 - 1) / d) for d >= 1: `divide_by_magic`'s multiplier, one division ahead of the quotients."""
    return asm("{\n.reg .u32 t;\nmov.u32 t, 0xFFFFFFFF;\ndiv.u32 $0, t, $1;\n}", [Uint32], [d])


def divide_by_magic(n: Int32, d: Int32, magic: Uint32) -> Int32:
    """floor(n / d) for 0 <= n < 2^31 and magic = division_magic(d): the high word of n x magic is the quotient or
    one less, and the remainder it leaves corrects it (five dependent integer instructions, against the ~20 of a
    division by a value known only at run time). Emulated by grouped_gemm.divide_by_magic."""
    return asm("{\n.reg .u32 q, r;\n.reg .pred p;\nmul.hi.u32 q, $1, $3;\nmul.lo.u32 r, q, $2;\nsub.u32 r, $1, r;\n"
               "setp.ge.u32 p, r, $2;\n@p add.u32 q, q, 1;\nmov.b32 $0, q;\n}", [Int32], [n, d, magic])


def popc(mask: Int32) -> Int32:
    """The set bits of a 32-bit mask."""
    return asm("popc.b32 $0, $1;", [Int32], [mask])


def zero_after(dep: Float32) -> Float32:
    """0.0, computed after `dep` (an unused input): a constant that the compiler cannot hoist above the code that
    produced `dep`, so zeros meant for after a loop are not held (and rematerialized) through it."""
    return asm("mov.b32 $0, 0;", [Float32], [dep])


def ballot(flag: Int32) -> Int32:
    """Bit i set where lane i's flag is non-zero (every lane of the warp takes part)."""
    return asm("{\n.reg .pred p;\nsetp.ne.s32 p, $1, 0;\nvote.sync.ballot.b32 $0, p, -1;\n}", [Int32], [flag])


def highest_bit(mask: Int32) -> Int32:
    """Index of the highest set bit of `mask` (-1 when none)."""
    return asm("bfind.u32 $0, $1;", [Int32], [mask])


# ------------------------------------------------------------------------------------------ fused role2 signals
def ld_relaxed_gpu_f32(addr: Int64) -> Float32:
    """A coherent load (GPU scope: never a stale L1 line) of a value another CTA of this kernel wrote."""
    return asm("ld.relaxed.gpu.global.f32 $0, [$1];", [Float32], [addr])


def ld_relaxed_gpu_s32(addr: Int64) -> Int32:
    return asm("ld.relaxed.gpu.global.b32 $0, [$1];", [Int32], [addr])


def atom_add_relaxed_gpu_s32(addr: Int64, v: Int32) -> Int32:
    return asm("atom.relaxed.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])


def st_relaxed_gpu_s32(addr: Int64, v: Int32) -> None:
    asm("st.relaxed.gpu.global.b32 [$0], $1;", [], [addr, v])


def fence_acq_rel_gpu() -> None:
    """Orders this thread's earlier writes before its later ones at GPU scope (the split-K partials before the
    arrival that publishes them)."""
    asm("fence.acq_rel.gpu;", [], [])


def atom_add_acq_rel_gpu_s32(addr: Int64, v: Int32) -> Int32:
    return asm("atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", [Int32], [addr, v])


def red_or_release_gpu_u64(addr: Int64, bits: Int64) -> None:
    """Set `bits` in a 64-bit word with release semantics (what this thread observed happens before)."""
    asm("red.release.gpu.global.or.b64 [$0], $1;", [], [addr, bits])


def wait_all_bits_relaxed_gpu(addr: Int64, bits: Int64, started: Int64, timeout_ns: Int64) -> None:
    """Poll the 64-bit word at `addr` with relaxed loads and a 128 ns back-off until every bit of `bits` is set,
    then `fence.acq_rel.gpu` (a relaxed read that saw the release, then the fence: an acquire); trap once
    `timeout_ns` of %globaltimer passed since `started`."""
    asm(
        "{\n.reg .pred done, late;\n.reg .b64 seen, t;\n"
        "WAIT:\nld.relaxed.gpu.global.b64 seen, [$0];\nand.b64 seen, seen, $1;\n"
        "setp.eq.b64 done, seen, $1;\n@done bra.uni DONE;\nnanosleep.u32 128;\n"
        "mov.u64 t, %globaltimer;\nsub.u64 t, t, $2;\nsetp.gt.s64 late, t, $3;\n@!late bra.uni WAIT;\ntrap;\n"
        "DONE:\nfence.acq_rel.gpu;\n}",
        [],
        [addr, bits, started, timeout_ns],
    )


# ------------------------------------------------------------------------------------------ stream-K tagged pieces
# A piece slot holds 32-bit words that are either a partial's bits or PIECE_EMPTY: pieces store their partials with
# no fence (a value never has these bits: it is clamped one below), the owner polls until no word of a slot is
# PIECE_EMPTY, then stores PIECE_EMPTY back, so every slot is empty again when the launch ends.
PIECE_EMPTY = 0xFFFFFFFF


def st_piece_v4(addr: Int64, v: list) -> None:
    """Store four FP32 partials to a piece slot (relaxed, GPU scope; no fence): a value with PIECE_EMPTY's bits (a
    NaN) is stored one below, still a NaN."""
    asm(
        "{\n.reg .b32 a, b, c, d;\n"
        "mov.b32 a, $1;\nmov.b32 b, $2;\nmov.b32 c, $3;\nmov.b32 d, $4;\n"
        "min.u32 a, a, 0xFFFFFFFE;\nmin.u32 b, b, 0xFFFFFFFE;\nmin.u32 c, c, 0xFFFFFFFE;\nmin.u32 d, d, 0xFFFFFFFE;\n"
        "st.relaxed.gpu.global.v4.b32 [$0], {a, b, c, d};\n}",
        [],
        [addr, *v],
    )


def ld_piece_v4_if(addr: Int64, take: Int32) -> list:
    """A piece slot's four words as FP32 where `take` != 0 (a relaxed load issued now, checked later with
    `settle_piece_v4`), else four zeros and no load."""
    return asm(
        "{\n.reg .pred p;\nsetp.ne.s32 p, $5, 0;\n"
        "mov.f32 $0, 0f00000000;\nmov.f32 $1, 0f00000000;\nmov.f32 $2, 0f00000000;\nmov.f32 $3, 0f00000000;\n"
        "@p ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];\n}",
        [Float32] * 4,
        [addr, take],
    )


def settle_piece_v4(addr: Int64, v: list, limit_ns: int = 10_000_000_000) -> list:
    """The piece slot at `addr` as four FP32 partials, given `v` (its words as loaded earlier). The whole warp
    (converged) loops until no lane has a word still PIECE_EMPTY (the piece's store not seen yet): those lanes
    load their slot again (relaxed), a 64 ns back-off between tries, the loop's exit a warp vote so its control flow
    stays uniform; traps once `limit_ns` of %globaltimer passed. Then every lane empties its slot (PIECE_EMPTY
    stored, relaxed: after this thread's load of the same words, so it lands after the piece's store)."""
    return asm(
        "{\n.reg .pred ok, all, late;\n.reg .b32 a, b, c, d, m;\n.reg .b64 t0, t1;\n"
        "mov.b32 a, $5;\nmov.b32 b, $6;\nmov.b32 c, $7;\nmov.b32 d, $8;\nmov.u64 t0, %globaltimer;\n"
        "CHECK:\nmax.u32 m, a, b;\nmax.u32 m, m, c;\nmax.u32 m, m, d;\nsetp.ne.u32 ok, m, 0xFFFFFFFF;\n"
        "vote.sync.all.pred all, ok, 0xffffffff;\n@all bra.uni DONE;\nnanosleep.u32 64;\n"
        f"mov.u64 t1, %globaltimer;\nsub.u64 t1, t1, t0;\nsetp.gt.u64 late, t1, {limit_ns};\n"
        "vote.sync.any.pred late, late, 0xffffffff;\n@late trap;\n"
        "@!ok ld.relaxed.gpu.global.v4.b32 {a, b, c, d}, [$4];\nbra.uni CHECK;\n"
        "DONE:\nmov.b32 $0, a;\nmov.b32 $1, b;\nmov.b32 $2, c;\nmov.b32 $3, d;\nmov.b32 m, 0xFFFFFFFF;\n"
        "st.relaxed.gpu.global.v4.b32 [$4], {m, m, m, m};\n}",
        [Float32] * 4,
        [addr, *v],
    )


def empty_piece_v4(addr: Int64) -> None:
    """Store PIECE_EMPTY to the four words of a piece slot (relaxed, GPU scope): a slot read by other means than
    `settle_piece_v4` (the dynamic tail's chunks, counted) left empty for the next launch."""
    asm("{\n.reg .b32 m;\nmov.b32 m, 0xFFFFFFFF;\nst.relaxed.gpu.global.v4.b32 [$0], {m, m, m, m};\n}", [], [addr])


def red_add_release_gpu_s32(addr: Int64, v: Int32) -> None:
    """Add `v` with release semantics (the writes this thread observed, e.g. through a CTA barrier, happen
    before); no value comes back, so the thread does not wait for the round trip."""
    asm("red.release.gpu.global.add.s32 [$0], $1;", [], [addr, v])


def wait_at_least_acquire_gpu(addr: Int64, target: Int32, limit_ns: int = 10_000_000_000) -> None:
    """Acquire-poll the 32-bit word at `addr` until it is >= target (a 64 ns back-off between polls); trap once
    `limit_ns` of %globaltimer passed since the first failed poll instead of hanging."""
    asm(
        "{\n.reg .pred done, late;\n.reg .b32 seen;\n.reg .b64 t0, t1;\n"
        "ld.acquire.gpu.global.b32 seen, [$0];\nsetp.ge.s32 done, seen, $1;\n@done bra.uni DONE;\n"
        "mov.u64 t0, %globaltimer;\n"
        "WAIT:\nnanosleep.u32 64;\nld.acquire.gpu.global.b32 seen, [$0];\nsetp.ge.s32 done, seen, $1;\n"
        "@done bra.uni DONE;\n"
        f"mov.u64 t1, %globaltimer;\nsub.u64 t1, t1, t0;\nsetp.gt.u64 late, t1, {limit_ns};\n@!late bra.uni WAIT;\n"
        "trap;\nDONE:\n}",
        [],
        [addr, target],
    )


def take_permits_warp(addr: Int64, mine: Int32, limit_ns: int = 10_000_000_000) -> None:
    """The whole warp (converged) waits until each lane with `mine` != 0 sees its 32-bit word at `addr` >= 1
    (relaxed polls, a 64 ns back-off, the loop's exit a warp vote so its control flow is uniform), then those lanes
    take one permit each (add -1) and every lane fences (`fence.acq_rel.gpu`: with the polls, an acquire). Traps
    once `limit_ns` of %globaltimer passed without every word set."""
    asm(
        "{\n.reg .pred lane, ok, all, late;\n.reg .b32 seen;\n.reg .b64 t0, t1;\n"
        "setp.ne.s32 lane, $1, 0;\nmov.u64 t0, %globaltimer;\n"
        "WAIT:\nsetp.eq.s32 ok, $1, 0;\n@lane ld.relaxed.gpu.global.b32 seen, [$0];\n@lane setp.ge.s32 ok, seen, 1;\n"
        "vote.sync.all.pred all, ok, 0xffffffff;\n@all bra.uni DONE;\nnanosleep.u32 64;\n"
        f"mov.u64 t1, %globaltimer;\nsub.u64 t1, t1, t0;\nsetp.gt.u64 late, t1, {limit_ns};\n"
        "vote.sync.any.pred late, late, 0xffffffff;\n@!late bra.uni WAIT;\ntrap;\n"
        "DONE:\n@lane red.relaxed.gpu.global.add.s32 [$0], -1;\nfence.acq_rel.gpu;\n}",
        [],
        [addr, mine],
    )


def try_take_permits_warp(addr: Int64, mine: Int32) -> Int32:
    """`take_permits_warp` without waiting: the whole warp (converged) looks once at the 32-bit word at `addr` of
    each lane with `mine` != 0 (relaxed loads, a warp vote). Where every such word is >= 1 those lanes take one
    permit each with an acquire atomic (add -1, which waits for its own round trip only; a fence would also wait for
    the warp's copies still in flight) and every lane returns 1; else nothing is taken and every lane returns 0."""
    return asm(
        "{\n.reg .pred lane, ok, all;\n.reg .b32 seen;\n"
        "setp.ne.s32 lane, $2, 0;\nsetp.eq.s32 ok, $2, 0;\nmov.b32 $0, 0;\n"
        "@lane ld.relaxed.gpu.global.b32 seen, [$1];\n@lane setp.ge.s32 ok, seen, 1;\n"
        "vote.sync.all.pred all, ok, 0xffffffff;\n@!all bra.uni DONE;\n"
        "@lane atom.acquire.gpu.global.add.s32 seen, [$1], -1;\nmov.b32 $0, 1;\n"
        "DONE:\n}",
        [Int32],
        [addr, mine],
    )


def st_release_cta_shared_s32(addr: Int32, v: Int32) -> None:
    """Store `v` to shared memory with release semantics at CTA scope (the writes this thread observed, e.g.
    through a CTA barrier, happen before it); ptxas emits a CTA-level MEMBAR and the store, nothing GPU-wide."""
    asm("st.release.cta.shared::cta.b32 [$0], $1;", [], [addr, v])


def wait_shared_at_least_acquire_cta(addr: Int32, target: Int32, limit_ns: int = 10_000_000_000) -> None:
    """Acquire-poll the shared 32-bit word at `addr` (CTA scope) until it is >= target, with a 32 ns back-off
    between polls; trap once `limit_ns` of %globaltimer passed since the first failed poll instead of hanging."""
    asm(
        "{\n.reg .pred done, late;\n.reg .b32 seen;\n.reg .b64 t0, t1;\n"
        "ld.acquire.cta.shared::cta.b32 seen, [$0];\nsetp.ge.s32 done, seen, $1;\n@done bra.uni DONE;\n"
        "mov.u64 t0, %globaltimer;\n"
        "WAIT:\nnanosleep.u32 32;\nld.acquire.cta.shared::cta.b32 seen, [$0];\nsetp.ge.s32 done, seen, $1;\n"
        "@done bra.uni DONE;\n"
        f"mov.u64 t1, %globaltimer;\nsub.u64 t1, t1, t0;\nsetp.gt.u64 late, t1, {limit_ns};\n@!late bra.uni WAIT;\n"
        "trap;\nDONE:\n}",
        [],
        [addr, target],
    )


def spin_cycles(cycles: int) -> None:
    """Busy-wait `cycles` SM clock cycles (%clock64): a warp started deliberately late (no memory traffic)."""
    asm("{\n.reg .u64 t0, t1;\n.reg .pred early;\nmov.u64 t0, %clock64;\nSPIN:\nmov.u64 t1, %clock64;\n"
        f"sub.u64 t1, t1, t0;\nsetp.lt.u64 early, t1, {int(cycles)};\n@early bra.uni SPIN;\n}}", [], [])


def mbarrier_wait_cycles(addr: Int32, parity: Int32, max_tries: int = 1 << 24) -> Int32:
    """`mbarrier_wait` (polling, bounded by `max_tries`, then trap) that returns the %clock cycles from before its first
    try to its success: a try suspends the thread until the phase completes (or a hardware time limit), so the first
    try's time counts too (a traced loop's measure of its waits; 32 bits: one register)."""
    return asm(
        "{\n.reg .pred done, more;\n.reg .b32 tries, t0, t1;\nmov.u32 t0, %clock;\nmov.b32 tries, 0;\n"
        "WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2;\n@done bra.uni DONE;\n"
        f"add.s32 tries, tries, 1;\nsetp.lt.s32 more, tries, {max_tries};\n@more bra.uni WAIT;\ntrap;\n"
        "DONE:\nmov.u32 t1, %clock;\nsub.u32 $0, t1, t0;\n}",
        [Int32],
        [addr, parity],
    )


def stamp_times(addr: Int64) -> None:
    """Store (%globaltimer, %clock64) as two 64-bit words at `addr` (16-byte aligned): one traced event, comparable
    across SMs by the first word (ns) and within one SM, finer, by the second (cycles)."""
    asm("{\n.reg .b64 g, c;\nmov.u64 g, %globaltimer;\nmov.u64 c, %clock64;\nst.global.v2.b64 [$0], {g, c};\n}",
        [], [addr])


def sm_id() -> Int32:
    """%smid: the SM this thread runs on (a trace's label; not stable across launches)."""
    return asm("mov.u32 $0, %smid;", [Int32], [])


def stg_s64(addr: Int64, v: Int64) -> None:
    asm("st.global.b64 [$0], $1;", [], [addr, v])


def mbarrier_inval(addr: Int32) -> None:
    """Invalidate a barrier with no pending operations, so that the same shared memory may be initialized again."""
    asm("mbarrier.inval.shared::cta.b64 [$0];", [], [addr])


# ------------------------------------------------------------------------- programmatic dependent launch
def griddepcontrol_launch_dependents() -> None:
    """Lets the grid launched after this one with programmatic stream serialization start its CTAs once every CTA of
    this grid has signalled or exited (they may then run beside this grid's last CTAs)."""
    asm("griddepcontrol.launch_dependents;", [], [])


def griddepcontrol_wait() -> None:
    """Waits until the grids this one depends on (programmatically) have completed and their writes are visible;
    returns at once when the launch had no such dependency."""
    asm("griddepcontrol.wait;", [], [])
