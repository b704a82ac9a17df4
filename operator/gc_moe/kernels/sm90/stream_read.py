"""A measuring kernel: one streaming read of N bytes, the reference a decode GEMM's time over its byte floor is
judged against.

The floor of the grouped GEMM (bytes / the read bandwidth of a 4 GiB `amax`) leaves out what any single launch that
reads those bytes pays: the launch itself, the ramp to full bandwidth and the drain, which a large read hides. This
kernel reads `chunks` x CHUNK_BYTES from a global buffer and nothing else: one CTA per SM of one warp, lane 0
keeping STAGES bulk copies (cp.async.bulk, completing on an mbarrier per stage) in flight, the warp summing each
landed chunk (so every byte is used) before lane 0 refills its stage. Two ways to hand out the chunks:
  static   CTA c reads the chunks [c x chunks / ctas, (c + 1) x chunks / ctas), as the stream-K GEMMs split steps
  dynamic  CTA c first reads chunks c x STAGES.. (no claim on the ramp), then claims each next chunk with an
           atomic ticket, asked one refill ahead (its round trip under a chunk's wait, not in the refill's path), so
           a CTA that gets its bytes faster reads more of them (the dynamic tail the stream-K GEMMs do not have); the
           last CTA to finish resets the ticket for the next launch
Each CTA stores its lanes' 32-bit sums (`out[c * 32 + lane]`, the test's check that every chunk was read exactly
once) and its first and last %globaltimer (`times[2c]`, `times[2c + 1]`, ns): the spread of the CTAs' ends
(docs/sm90-grouped-gemm.md, step 62). `work_cycles` adds a spin per chunk (a consumer with compute of its own). It
measures; it is not an operator.
"""

CHUNK_BYTES = 16384  # one bulk copy: about a stream-K step of the GEMMs (a K128 step of 256 rows is 17 KB)
STAGES = 8  # 128 KB in flight per SM: several times the ~24 KB a microsecond of DRAM latency needs at full rate
LANES = 32
TICKET_WORDS = 2  # dynamic: the chunk ticket and the count of CTAs done (int32 each, zero before the first launch)
# work_cycles: the warp spins this long per chunk before freeing its stage, a consumer with compute of its own (a
# chunk's share of the bandwidth is ~1360 cycles on an H100 at 1.98 GHz): can an SM whose bytes came late still catch
# up once the others are done, with static ranges and with the ticket?
WORK_CHOICES = (0, 600, 1000)


def check_config(dynamic: bool, work_cycles: int = 0) -> None:
    if not isinstance(dynamic, bool):
        raise TypeError(f"stream read: dynamic={dynamic!r}, allowed True or False")
    if work_cycles not in WORK_CHOICES:
        raise ValueError(f"stream read: work_cycles={work_cycles}, allowed {WORK_CHOICES}")


def build_stream_read(arch: str = "sm_90a", dynamic: bool = False, work_cycles: int = 0):
    """The runtime's builder: a CompileRequest for the static or the dynamic read (no GPU needed)."""
    import cutlass
    from cutlass import Int32, Int64, Uint32, cute

    from gc_moe.kernels.sm90 import ptx
    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the stream read is built for sm_90a only, not {arch!r}")
    check_config(dynamic, work_cycles)
    barriers = STAGES * CHUNK_BYTES  # STAGES mbarriers, then STAGES chunk numbers (int32) after the chunks
    slots = barriers + STAGES * 8
    smem_bytes = slots + STAGES * 4

    @cute.jit
    def claim(ahead, next_static, last_static, chunks, ctas):
        """Lane 0's next chunk after its first STAGES, -1 once none is left: the CTA's range's next (static) or the
        ticket's answer `ahead` (dynamic: asked one refill earlier, so its round trip ran under a chunk's wait)."""
        got = Int32(-1)
        if cutlass.const_expr(dynamic):
            got = ctas * STAGES + ahead
            if got >= chunks:
                got = Int32(-1)
        else:
            if next_static < last_static:
                got = next_static
        return got

    @cute.jit
    def refill(smem, src, stage, chunk):
        """Lane 0: record stage's chunk number and, if it is one, start its bulk copy."""
        ptx.sts_s32(smem + slots + stage * 4, chunk)
        if chunk >= 0:
            bar = smem + barriers + stage * 8
            ptx.mbarrier_arrive_expect_tx(bar, CHUNK_BYTES)
            ptx.bulk_copy_g2s(smem + stage * CHUNK_BYTES, src + Int64(chunk) * CHUNK_BYTES, CHUNK_BYTES, bar)

    @cute.kernel
    def stream_read_kernel(src: Int64, chunks: Int32, ticket: Int64, out: Int64, times: Int64):
        lane = Int32(cute.arch.thread_idx()[0])
        cta = Int32(cute.arch.block_idx()[0])
        ctas = Int32(cute.arch.grid_dim()[0])
        smem = Int32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint())
        started = ptx.asm("mov.u64 $0, %globaltimer;", [Int64], [])
        next_static = Int32(cta * chunks // ctas)
        last_static = Int32((cta + 1) * chunks // ctas)
        ahead = Int32(0)  # dynamic: the ticket's answer for lane 0's next refill
        if lane == 0:
            for s in cutlass.range_constexpr(STAGES):
                ptx.mbarrier_init(smem + barriers + s * 8, 1)
            ptx.fence_mbarrier_init()
            for s in cutlass.range_constexpr(STAGES):
                # the first STAGES chunks need no claim (dynamic: chunks cta x STAGES.., so the ramp waits on no
                # atomic's round trip)
                got = Int32(-1)
                if cutlass.const_expr(dynamic):
                    if cta * STAGES + s < chunks:
                        got = cta * STAGES + s
                else:
                    got = claim(ahead, next_static, last_static, chunks, ctas)
                    if got >= 0:
                        next_static = next_static + 1
                refill(smem, src, Int32(s), got)
            if cutlass.const_expr(dynamic):
                if cta * STAGES < chunks:  # a CTA with chunks of its own asks for its first claimed one
                    ahead = ptx.atom_add_relaxed_gpu_s32(ticket, Int32(1))
        ptx.warp_sync()
        total = Uint32(0)
        stage = Int32(0)
        phase = Int32(0)
        chunk = ptx.lds_s32(smem + slots)
        while chunk >= 0:
            ptx.mbarrier_wait(smem + barriers + stage * 8, phase)
            base = smem + stage * CHUNK_BYTES + lane * 16
            for i in cutlass.range_constexpr(CHUNK_BYTES // (LANES * 16)):
                words = ptx.lds128(base + i * LANES * 16)
                total = total + words[0] + words[1] + words[2] + words[3]
            if cutlass.const_expr(work_cycles > 0):
                ptx.spin_cycles(work_cycles)
            ptx.warp_sync()  # every lane's loads of the stage before lane 0 refills it
            if lane == 0:
                got = claim(ahead, next_static, last_static, chunks, ctas)
                if got >= 0:
                    next_static = next_static + 1
                    if cutlass.const_expr(dynamic):  # the next refill's chunk, asked now
                        ahead = ptx.atom_add_relaxed_gpu_s32(ticket, Int32(1))
                elif cutlass.const_expr(dynamic):
                    ahead = chunks  # exhausted: every later refill of this CTA gets none
                refill(smem, src, stage, got)
            ptx.warp_sync()
            stage = stage + 1
            if stage == STAGES:
                stage = Int32(0)
                phase = phase ^ 1
            chunk = ptx.lds_s32(smem + slots + stage * 4)
        ptx.asm("st.global.b32 [$0], $1;", [], [out + Int64(cta * LANES + lane) * 4, total])
        if lane == 0:
            ptx.stg_s64(times + Int64(cta) * 16, started)
            ptx.stg_s64(times + Int64(cta) * 16 + 8, ptx.asm("mov.u64 $0, %globaltimer;", [Int64], []))
            if cutlass.const_expr(dynamic):
                # every claim of this CTA is ordered before its count; the last CTA resets both words for the next
                # launch (no CTA of this launch claims after its own count)
                done = ptx.atom_add_acq_rel_gpu_s32(ticket + Int64(4), Int32(1))
                if done == ctas - 1:
                    ptx.st_relaxed_gpu_s32(ticket, Int32(0))
                    ptx.st_relaxed_gpu_s32(ticket + Int64(4), Int32(0))

    @cute.jit
    def host(src: Int64, chunks: Int32, ticket: Int64, out: Int64, times: Int64):
        stream_read_kernel(src, chunks, ticket, out, times).launch(grid=(1, 1, 1), block=(LANES, 1, 1),
                                                                   smem=smem_bytes)

    return CompileRequest(host, (Int64(0), Int32(1), Int64(0), Int64(0), Int64(0)),
                          LaunchShape(block=(LANES, 1, 1), dynamic_smem_bytes=smem_bytes))


def variant(dynamic: bool = False, work_cycles: int = 0):
    """The runtime KernelVariant of the static or the dynamic read (with `work_cycles` of work per chunk)."""
    from gc_moe.runtime.jit import KernelVariant

    check_config(dynamic, work_cycles)
    params = {"dynamic": dynamic, **({"work_cycles": work_cycles} if work_cycles else {})}
    return KernelVariant.make("sm90.stream_read", __name__, "build_stream_read", params,
                              promises=("cp.async.bulk.shared", "mbarrier.try_wait"),
                              extra_sources=("gc_moe.kernels.sm90.ptx",))


def read_variants() -> list:
    """Every built form: static and dynamic, at each work_cycles."""
    return [variant(dynamic, work) for work in WORK_CHOICES for dynamic in (False, True)]


def chunks_for(nbytes: int) -> int:
    """Chunks that cover `nbytes` (at least one)."""
    if nbytes < 0:
        raise ValueError(f"stream read: {nbytes} bytes, allowed >= 0")
    return max(1, -(-nbytes // CHUNK_BYTES))
