"""A measuring kernel: what one SM spends per K128 step on the grouped GEMM's consumer work, in parts.

One CTA of `warpgroups` x 128 threads (one SM, nothing else running on it, no global memory in the loop). Each
warpgroup runs `steps` K128 steps of the table decode's consumer (grouped_gemm's waited loop) from shared memory
that stays put:
  decode  the step's 16 A registers through the table decode (two 16-byte loads of codes, two scale words, the
          eight words' byte permutes), from one of two 4 KB weight tiles by step parity (so no load is hoisted);
          without it the A registers are the ones decoded before the loop
  chain   four register-A m64nNk32 E4M3 WGMMAs into one accumulator from a token tile of N rows, the wait, and the
          N/2 FP32 multiply-adds that scale it into the accumulators; without it the decoded words are folded into
          one register (3 three-input XORs per 4 words) so the decode stays
  skew    the odd warpgroups start half a step late (a spin of SKEW_CYCLES on %clock64 before their first step): do
          warpgroups that start out of phase stay out of phase, or do they fall back into step with each other?
Thread 0 of each warpgroup stores the %clock64 cycles of its steps. Cycles per step for decode alone, chain alone
and both, at 1 and 4 warpgroups, say whether a scheduler overlaps one warpgroup's decode with another's chain
(docs/sm90-grouped-gemm.md, step 49). The bytes it computes are not checked: it measures, it is not an operator.
"""


WARPGROUP_THREADS = 128
A_TILE_BYTES = 4096  # a warpgroup's 64 rows x 128 FP4 codes per K128 step
SCALE_TILE_BYTES = 256  # its 64 rows x 4 K32 scale bytes
N_CHOICES = (8, 16, 32, 64, 96)
SKEW_CYCLES = 500  # about half a decode-and-chain step at N = 64 with four warpgroups
OUT_TOTALS = 64  # out: per warpgroup (cycles, folded words) as two int64 from 0, its accumulators' sum (f32) from here
OUT_BYTES = OUT_TOTALS + 4 * 4


def smem_layout(n: int, warpgroups: int) -> tuple[int, int, int]:
    """(token tile offset, weight tiles offset, total bytes): the token tile first (1 KB aligned), then per warpgroup
    two weight tiles and two scale tiles."""
    a_offset = n * 128
    total = a_offset + warpgroups * 2 * (A_TILE_BYTES + SCALE_TILE_BYTES)
    return 0, a_offset, total


def check_config(n: int, warpgroups: int) -> None:
    if n not in N_CHOICES:
        raise ValueError(f"wgmma probe: n={n}, allowed {N_CHOICES}")
    if not 1 <= warpgroups <= 4:
        raise ValueError(f"wgmma probe: warpgroups={warpgroups}, allowed 1..4")


def build_probe(arch: str = "sm_90a", n: int = 64, warpgroups: int = 4, decode: bool = True, chain: bool = True,
                skew: bool = False):
    """The runtime's builder: a CompileRequest for one probe configuration (no GPU needed)."""
    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, cute

    from gc_moe.kernels.sm90 import ptx
    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the wgmma probe is built for sm_90a only, not {arch!r}")
    check_config(n, warpgroups)
    if not (decode or chain):
        raise ValueError("wgmma probe: decode and chain both off leaves nothing to measure")
    threads = warpgroups * WARPGROUP_THREADS
    b_offset, a_offset, smem_bytes = smem_layout(n, warpgroups)

    @cute.jit
    def fragment(smem, wg, t, sel):
        """grouped_gemm's table_fragment from tile `sel` of this warpgroup (its offsets: codes at 16 t and
        2048 + 16 t, the thread's rows' scale words)."""
        tile = smem + a_offset + (wg * 2 + sel) * A_TILE_BYTES
        scales = smem + a_offset + warpgroups * 2 * A_TILE_BYTES + (wg * 2 + sel) * SCALE_TILE_BYTES
        wa = tile + t * 16
        words = ptx.lds128(wa) + ptx.lds128(wa + A_TILE_BYTES // 2)
        row = (t // 32) * 16 + (t % 32) // 4
        return ptx.decode_fragment_table(words, ptx.lds32(scales + row * 4), ptx.lds32(scales + row * 4 + 32))

    @cute.kernel
    def probe_kernel(out: Int64, steps: Int32):
        tid = Int32(cute.arch.thread_idx()[0])
        wg = tid // WARPGROUP_THREADS
        t = tid % WARPGROUP_THREADS
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        # token tile zeros; weight and scale words a hash of their index (scale bytes kept small: finite tables)
        for i in cutlass.range(tid, a_offset // 4, threads):
            ptx.sts_s32(smem + b_offset + i * 4, Int32(0))
        for i in cutlass.range(tid, warpgroups * 2 * A_TILE_BYTES // 4, threads):
            ptx.sts_s32(smem + a_offset + i * 4, i * Int32(-1640531535) + Int32(12345))
        for i in cutlass.range(tid, warpgroups * 2 * SCALE_TILE_BYTES // 4, threads):
            ptx.sts_s32(smem + a_offset + warpgroups * 2 * A_TILE_BYTES + i * 4,
                        (i * Int32(40503)) & Int32(0x07070707))
        cute.arch.barrier()
        ptx.fence_proxy_async_shared()  # the token tile was written by the generic proxy
        desc0 = ptx.smem_desc_kmajor_lo(smem + b_offset, 128)
        descs = [ptx.smem_desc_kmajor_from_lo(desc0 + j * 16, 1024) for j in range(4)]
        fixed = fragment(smem, wg, t, Int32(0))
        acc = cute.make_rmem_tensor((max(n // 2, 1),), Float32)
        for r in cutlass.range_constexpr(n // 2):
            acc[r] = Float32(0.0)
        sink = Uint32(0)
        scale = Float32(0.5)
        if cutlass.const_expr(skew):  # noqa: SIM102 (a compile-time branch around a run-time one)
            if wg % 2 == 1:
                ptx.spin_cycles(SKEW_CYCLES)
        start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        for kb in cutlass.range(steps):
            a_regs = fixed
            if cutlass.const_expr(decode):
                a_regs = fragment(smem, wg, t, kb & 1)
            if cutlass.const_expr(chain):
                ptx.wgmma_fence()
                part = ptx.wgmma_rs_e4m3_chain(n, a_regs, descs)
                for r in cutlass.range_constexpr(n // 2):
                    acc[r] = acc[r] + part[r] * scale
            else:
                for j in cutlass.range_constexpr(4):
                    sink = sink ^ a_regs[4 * j] ^ a_regs[4 * j + 1] ^ a_regs[4 * j + 2] ^ a_regs[4 * j + 3]
        stop = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(n // 2):
            total = total + acc[r]
        if t == 0:
            ptx.stg_s64(out + Int64(wg) * 16, stop - start)
            # what the steps computed, so that no step is dead code (not checked)
            ptx.stg_s64(out + Int64(wg) * 16 + 8, Int64(sink))
            ptx.stg_f32(out + OUT_TOTALS + Int64(wg) * 4, total)

    @cute.jit
    def host(out: Int64, steps: Int32):
        probe_kernel(out, steps).launch(grid=(1, 1, 1), block=(threads, 1, 1), smem=smem_bytes)

    return CompileRequest(host, (Int64(0), Int32(1)), LaunchShape(block=(threads, 1, 1), dynamic_smem_bytes=smem_bytes))


def variant(n: int, warpgroups: int, decode: bool = True, chain: bool = True, skew: bool = False):
    """The runtime KernelVariant of one probe configuration."""
    from gc_moe.runtime.jit import KernelVariant

    check_config(n, warpgroups)
    extra = {"skew": True} if skew else {}
    promises = ("prmt.b32",) if decode else ()
    if chain:
        promises += ("wgmma.mma_async.sync.aligned.m64n",)
    return KernelVariant.make("sm90.wgmma_probe", __name__, "build_probe",
                              {"n": n, "warpgroups": warpgroups, "decode": decode, "chain": chain, **extra},
                              promises=promises,
                              extra_sources=("gc_moe.kernels.sm90.ptx", "gc_moe.kernels.sm90.grouped_gemm"))


def probe_variants() -> list:
    """What the probe script measures: at each N the chain alone and with the decode, at 1 and 4 warpgroups, and
    the decode alone at both; at N = 64 and 96 with four warpgroups also decode and chain skewed."""
    out = []
    for wgs in (1, 4):
        out.append(variant(64, wgs, decode=True, chain=False))
        for n in N_CHOICES:
            out += [variant(n, wgs, decode=False, chain=True), variant(n, wgs, decode=True, chain=True)]
    return out + [variant(n, 4, skew=True) for n in (64, 96)]
