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
  wide    (N = 96) the operator's wide tile instead of one m64n96 chain: a chain of N = 64, its wait and multiply-adds,
          then one of N = 32 from the same A registers, its wait and multiply-adds (two waits per step)
  split   (split > 0: the work divided by role instead) warpgroups 0..split-1 only decode, the 4 fragments of a step
          between them, and the others only run chains, the 4 m64 row blocks between them: one warpgroup's decode
          beside another's WGMMAs with no dependency between them. With `shared_a` the decoders store each decoded
          fragment (four 16-byte stores and a proxy fence) and the chains take A from shared memory (SS-WGMMA: the
          design that takes the decode off the chains' warps); without it the chains are register-A from fixed
          registers. No barrier between the roles: a measure of what the two share (issue slots, register file,
          shared memory), not a pipeline
  pingpong  (decode and chain, an even number of warpgroups, no split) the warpgroups in two halves that take turns at
          the tensor cores, as FlashAttention-3 schedules its two consumers: a half decodes its step, waits for its
          turn (a named barrier), issues its chain, hands the turn to the other half (bar.arrive) and only then waits
          for its chain and scales it. The halves cannot fall back into step (the skewed probe's do), so one half's
          decode runs while the other half's chains hold the tensor cores, if a scheduler can overlap the two at all
  inplace (with chain, not wide or split) the operator's `scale_ratios` form: the sums scaled by the step's factor
          first (N/2 multiplies), then the chain accumulates into them (no fresh partials, no multiply-adds after it)
  sync    (decode and chain, no split, skew, wide or ping-pong) the operator's per-step synchronization around the
          same work: "wait" puts an mbarrier wait before each step and a lane-0 arrival after it (each warp its own
          barrier, so the wait never blocks: what the instructions cost, not a dependency), "fence" adds the
          consumers' `fence.proxy.async` after the wait (the token tile came through cp.async). What moving the
          fence out of the consumers' loop could give back. "arrive": the arrival alone (no wait). "early": the wait
          for the next step's barrier issued while the step's chain runs (before the chain's wait; each warp two
          barriers that alternate by step, so that barrier is complete by then): whether the wait's latency hides
          under the tensor core. "arrive_all" / "wait_all": "arrive" / "wait" with every lane arriving on a barrier
          that counts 32 (no warp sync, no predicate)
Thread 0 of each warpgroup stores the %clock64 cycles of its steps. Cycles per step for decode alone, chain alone
and both, at 1 and 4 warpgroups, say whether a scheduler overlaps one warpgroup's decode with another's chain
(docs/sm90-grouped-gemm.md, step 49). The bytes it computes are not checked: it measures, it is not an operator.
"""


WARPGROUP_THREADS = 128
A_TILE_BYTES = 4096  # a warpgroup's 64 rows x 128 FP4 codes per K128 step
SCALE_TILE_BYTES = 256  # its 64 rows x 4 K32 scale bytes
N_CHOICES = (8, 16, 32, 64, 96)
SKEW_CYCLES = 500  # about half a decode-and-chain step at N = 64 with four warpgroups
A_BLOCK_BYTES = 8192  # split with shared_a: one decoded m64 row block of a K128 step as E4M3 (64 rows x 128 bytes)
DECODER_REGISTERS = 40  # split: what a decoder warpgroup keeps (its loop needs 36-39)
MAX_CHAIN_FLOATS = 48  # scaled accumulators per thread of a chain warpgroup (its row blocks x N/2; as many in flight)
# the measured splits (N, decoders, warpgroups, shared_a): two decoders beside four chain warpgroups (the chains'
# 96 registers hold N = 64 only), and one decoder of all four fragments (the chains get 104: N = 96 fits shared-A)
SPLITS = ((64, 2, 6, False), (64, 2, 6, True), (64, 1, 5, True), (96, 1, 5, True))
PINGPONG_BARRIERS = (1, 2)  # named barriers: the turn of half 0 (warpgroups 0..w/2-1), the turn of half 1
PINGPONG_N = (32, 64, 96)  # the table tiles' chains at 128-256 tokens per rank
# sync: none, the stage wait and arrival, those and the proxy fence, the arrival alone, the wait under the chain
SYNC_CHOICES = ("", "wait", "fence", "arrive", "early", "arrive_all", "wait_all")
SYNC_EVERY_LANE = ("arrive_all", "wait_all")  # each lane arrives (the barriers count 32)
SYNC_N = (32, 64, 96)
MAX_WARPGROUPS = 6  # a split probe's decoders and chain warpgroups together (four without split)
OUT_TOTALS = 16 * MAX_WARPGROUPS  # out: per warpgroup (cycles, folded words) as two int64 from 0, its sum (f32) here
OUT_BYTES = OUT_TOTALS + 4 * MAX_WARPGROUPS
SYNC_BARRIER_BYTES = 16 * 4 * MAX_WARPGROUPS  # sync: two mbarriers per warp, after the decoded A blocks


def smem_layout(n: int, warpgroups: int) -> tuple[int, int, int, int]:
    """(token tile offset, weight tiles offset, decoded A blocks offset, their end): the token tile first (1 KB
    aligned), then per warpgroup two weight tiles and two scale tiles, then (1 KB aligned) the four decoded m64 row
    blocks of a split probe with shared_a. The sync probe's barriers follow (SYNC_BARRIER_BYTES)."""
    a_offset = n * 128
    blocks = -(-(a_offset + warpgroups * 2 * (A_TILE_BYTES + SCALE_TILE_BYTES)) // 1024) * 1024
    return 0, a_offset, blocks, blocks + 4 * A_BLOCK_BYTES


def check_config(n: int, warpgroups: int, split: int = 0, shared_a: bool = False, wide: bool = False,
                 pingpong: bool = False, inplace: bool = False, sync: str = "") -> None:
    if n not in N_CHOICES:
        raise ValueError(f"wgmma probe: n={n}, allowed {N_CHOICES}")
    if not 1 <= warpgroups <= (MAX_WARPGROUPS if split else 4):
        raise ValueError(f"wgmma probe: warpgroups={warpgroups}, allowed 1..4 (1..{MAX_WARPGROUPS} with split)")
    if split:
        chains = warpgroups - split
        if not 1 <= split < warpgroups or 4 % split or 4 % chains:
            raise ValueError(f"wgmma probe: split={split} of {warpgroups} warpgroups; allowed: decoders and chain "
                             "warpgroups both at least one and both dividing the step's 4 row blocks")
        if 4 // chains * (n // 2) > MAX_CHAIN_FLOATS:
            raise ValueError(f"wgmma probe: n={n} with {chains} chain warpgroup(s) holds {4 // chains * n // 2} "
                             f"accumulators per thread; allowed at most {MAX_CHAIN_FLOATS}")
    elif shared_a:
        raise ValueError("wgmma probe: shared_a is a knob of the split probe (split > 0)")
    if wide and (n != 96 or split):
        raise ValueError(f"wgmma probe: wide is the N = 96 tile's two chains without split, got n={n}, split={split}")
    if pingpong and (split or wide or warpgroups % 2):
        raise ValueError(f"wgmma probe: pingpong takes turns between two halves of the warpgroups (an even count, "
                         f"no split, no wide), got warpgroups={warpgroups}, split={split}, wide={wide}")
    if inplace and (split or wide):
        raise ValueError(f"wgmma probe: inplace is a form of the plain or ping-pong chain, got split={split}, "
                         f"wide={wide}")
    if sync not in SYNC_CHOICES:
        raise ValueError(f"wgmma probe: sync={sync!r}, allowed {SYNC_CHOICES}")
    if sync and (split or wide or pingpong):
        raise ValueError(f"wgmma probe: sync wraps the plain loop's steps, got split={split}, wide={wide}, "
                         f"pingpong={pingpong}")


def build_probe(arch: str = "sm_90a", n: int = 64, warpgroups: int = 4, decode: bool = True, chain: bool = True,
                skew: bool = False, split: int = 0, shared_a: bool = False, wide: bool = False,
                pingpong: bool = False, inplace: bool = False, sync: str = ""):
    """The runtime's builder: a CompileRequest for one probe configuration (no GPU needed)."""
    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, cute

    from gc_moe.kernels.sm90 import ptx
    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    if arch != "sm_90a":
        raise ValueError(f"the wgmma probe is built for sm_90a only, not {arch!r}")
    check_config(n, warpgroups, split, shared_a, wide, pingpong, inplace, sync)
    if sync and (skew or not (decode and chain)):
        raise ValueError("wgmma probe: sync wraps the decode-and-chain step (both on, not skewed)")
    if inplace and not chain:
        raise ValueError("wgmma probe: inplace is a form of the chain; it needs it")
    if not (decode or chain):
        raise ValueError("wgmma probe: decode and chain both off leaves nothing to measure")
    if pingpong and not (decode and chain):
        raise ValueError("wgmma probe: pingpong alternates the decode with the chains; it needs both")
    threads = warpgroups * WARPGROUP_THREADS
    b_offset, a_offset, blocks_offset, barriers_offset = smem_layout(n, warpgroups)
    smem_bytes = barriers_offset + SYNC_BARRIER_BYTES
    frags = 4 // split if split else 1  # per decoder warpgroup and step
    mblocks = 4 // (warpgroups - split) if split else 1  # per chain warpgroup and step
    # the CTA's register pool is what the launch gave it (65536 / threads per thread, rounded down to 8), not the
    # SM's 65536: a chain warpgroup may raise its share only to what the decoders give up (asking more never returns)
    launch_registers = min(255, 65536 // threads) // 8 * 8
    chain_registers = min(256, (threads * launch_registers // WARPGROUP_THREADS - split * DECODER_REGISTERS)
                          // max(warpgroups - split, 1) // 8 * 8)

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
        warp_bar = smem + barriers_offset + (tid // 32) * 16
        if cutlass.const_expr(sync != ""):
            lanes = 32 if sync in SYNC_EVERY_LANE else 1
            if tid % 32 == 0:
                for b in cutlass.range_constexpr(2):
                    ptx.mbarrier_init(warp_bar + 8 * b, lanes)
                ptx.fence_mbarrier_init()
                for b in cutlass.range_constexpr(2):
                    ptx.mbarrier_arrive_count(warp_bar + 8 * b, lanes)  # phase 0 completes: the first waits pass
        cute.arch.barrier()
        ptx.fence_proxy_async_shared()  # the token tile was written by the generic proxy
        desc0 = ptx.smem_desc_kmajor_lo(smem + b_offset, 128)
        descs = [ptx.smem_desc_kmajor_from_lo(desc0 + j * 16, 1024) for j in range(4)]
        # the wide tile's tail chain: token rows 64.. (eight 1 KB row groups further)
        tail_descs = [ptx.smem_desc_kmajor_from_lo(desc0 + j * 16 + 8 * 1024 // 16, 1024) for j in range(4)]
        scale = Float32(0.5)
        if cutlass.const_expr(pingpong):
            pingpong_steps(out, smem, cute.arch.make_warp_uniform(wg), t, steps, descs, scale)
        elif cutlass.const_expr(sync == "early"):
            early_wait_steps(out, smem, wg, t, steps, descs, scale, warp_bar)
        elif cutlass.const_expr(split == 0):
            fixed = fragment(smem, wg, t, Int32(0))
            acc = cute.make_rmem_tensor((max(n // 2, 1),), Float32)
            for r in cutlass.range_constexpr(n // 2):
                acc[r] = Float32(0.0)
            sink = Uint32(0)
            if cutlass.const_expr(skew):  # noqa: SIM102 (a compile-time branch around a run-time one)
                if wg % 2 == 1:
                    ptx.spin_cycles(SKEW_CYCLES)
            start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
            for kb in cutlass.range(steps):
                if cutlass.const_expr(sync in ("wait", "fence", "wait_all")):
                    ptx.mbarrier_wait(warp_bar, kb & 1)  # complete already: its own lane(s) arrived last step
                    if cutlass.const_expr(sync == "fence"):
                        ptx.fence_proxy_async_shared()
                a_regs = fixed
                if cutlass.const_expr(decode):
                    a_regs = fragment(smem, wg, t, kb & 1)
                if cutlass.const_expr(chain and wide):  # the operator's wide tile: 64 rows, then the other 32
                    for first, width in ((0, 64), (64, 32)):
                        ptx.wgmma_fence()
                        part = ptx.wgmma_rs_e4m3_chain(width, a_regs, descs if first == 0 else tail_descs)
                        for r in cutlass.range_constexpr(width // 2):
                            acc[first // 2 + r] = acc[first // 2 + r] + part[r] * scale
                elif cutlass.const_expr(chain and inplace):  # the sums to the step's scale, the chain into them
                    for r in cutlass.range_constexpr(n // 2):
                        acc[r] = acc[r] * scale
                    ptx.wgmma_fence()
                    out_acc = ptx.wgmma_rs_e4m3_accumulate([(n, descs)], a_regs, [acc[r] for r in range(n // 2)])
                    for r in cutlass.range_constexpr(n // 2):
                        acc[r] = out_acc[r]
                elif cutlass.const_expr(chain):
                    ptx.wgmma_fence()
                    part = ptx.wgmma_rs_e4m3_chain(n, a_regs, descs)
                    for r in cutlass.range_constexpr(n // 2):
                        acc[r] = acc[r] + part[r] * scale
                else:
                    for j in cutlass.range_constexpr(4):
                        sink = sink ^ a_regs[4 * j] ^ a_regs[4 * j + 1] ^ a_regs[4 * j + 2] ^ a_regs[4 * j + 3]
                if cutlass.const_expr(sync in SYNC_EVERY_LANE):  # every lane arrives: no warp sync, no predicate
                    ptx.mbarrier_arrive(warp_bar)
                elif cutlass.const_expr(sync != ""):  # the step's stage goes back, as the operator's consumers do
                    ptx.warp_sync()
                    if t % 32 == 0:
                        ptx.mbarrier_arrive(warp_bar)
            stop = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
            total = Float32(0.0)
            for r in cutlass.range_constexpr(n // 2):
                total = total + acc[r]
            if t == 0:
                record(out, wg, stop - start, sink, total)
        else:
            role_wg = cute.arch.make_warp_uniform(wg)  # a uniform branch keeps each role's loop on uniform registers
            # the decoders need few registers, the chains' in-flight and scaled accumulators many (2 x N per thread
            # at two row blocks): the pool moves to the chains as in a warp-specialized kernel
            if role_wg < split:
                cute.arch.setmaxregister_decrease(DECODER_REGISTERS)
                if cutlass.const_expr(decode):
                    decoder_steps(out, smem, role_wg, t, steps)
            else:
                cute.arch.setmaxregister_increase(chain_registers)
                if cutlass.const_expr(chain):
                    chain_steps(out, smem, role_wg, t, steps, descs, scale)

    @cute.jit
    def early_wait_steps(out, smem, wg, t, steps, descs, scale, warp_bar):
        """sync "early": step kb's chain issued, then the wait for step kb + 1's barrier (kb + 1 mod 2, completed by
        step kb - 1's arrival), then the chain's wait, the multiply-adds and step kb's arrival on barrier kb mod 2."""
        acc = cute.make_rmem_tensor((n // 2,), Float32)
        part = cute.make_rmem_tensor((n // 2,), Float32)
        for r in cutlass.range_constexpr(n // 2):
            acc[r] = Float32(0.0)
            part[r] = Float32(0.0)
        ptx.mbarrier_wait(warp_bar, Int32(0))
        start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        for kb in cutlass.range(steps):
            a_regs = fragment(smem, wg, t, kb & 1)
            ptx.wgmma_fence()
            issued = ptx.wgmma_rs_e4m3_chain_issue(n, a_regs, descs, [part[r] for r in range(n // 2)], 1)
            ptx.mbarrier_wait(warp_bar + ((kb + 1) & 1) * 8, ((kb + 1) >> 1) & 1)
            done = ptx.wgmma_wait_tied(issued, 0)
            for r in cutlass.range_constexpr(n // 2):
                part[r] = done[r]
                acc[r] = acc[r] + done[r] * scale
            ptx.warp_sync()
            if t % 32 == 0:
                ptx.mbarrier_arrive(warp_bar + (kb & 1) * 8)
        record_steps(out, wg, t, start, acc)

    def turn(barrier_id: int, wait: bool):
        """Wait for (bar.sync) or hand over (bar.arrive) a turn: half the warpgroups wait while the other half
        arrives, so each barrier counts all of them."""
        op = "sync" if wait else "arrive"
        ptx.asm(f"bar.{op} {barrier_id}, {threads};", [], [])

    @cute.jit
    def pingpong_steps(out, smem, wg, t, steps, descs, scale):
        """A half's steps: decode, its turn, the chain issued (not waited), the turn handed over, then the wait and
        the multiply-adds. Half 1 hands half 0 the first turn; half 0 takes the last hand-over after its loop, so
        every arrival meets its wait."""
        half = wg // (warpgroups // 2)
        acc = cute.make_rmem_tensor((n // 2,), Float32)
        part = cute.make_rmem_tensor((n // 2,), Float32)
        for r in cutlass.range_constexpr(n // 2):
            acc[r] = Float32(0.0)
            part[r] = Float32(0.0)
        if half == 1:
            turn(PINGPONG_BARRIERS[0], False)
        start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        for kb in cutlass.range(steps):
            a_regs = fragment(smem, wg, t, kb & 1)
            if half == 0:
                turn(PINGPONG_BARRIERS[0], True)
            else:
                turn(PINGPONG_BARRIERS[1], True)
            if cutlass.const_expr(inplace):
                for r in cutlass.range_constexpr(n // 2):
                    acc[r] = acc[r] * scale
            ptx.wgmma_fence()
            if cutlass.const_expr(inplace):
                issued = ptx.wgmma_rs_e4m3_accumulate([(n, descs)], a_regs, [acc[r] for r in range(n // 2)], 1)
            else:
                issued = ptx.wgmma_rs_e4m3_chain_issue(n, a_regs, descs, [part[r] for r in range(n // 2)], 1)
            if half == 0:
                turn(PINGPONG_BARRIERS[1], False)
            else:
                turn(PINGPONG_BARRIERS[0], False)
            done = ptx.wgmma_wait_tied(issued, 0)  # nothing writes a register between the issue and this wait
            for r in cutlass.range_constexpr(n // 2):
                if cutlass.const_expr(inplace):
                    acc[r] = done[r]
                else:
                    part[r] = done[r]
                    acc[r] = acc[r] + done[r] * scale
        if half == 0:
            turn(PINGPONG_BARRIERS[0], True)
        record_steps(out, wg, t, start, acc)

    @cute.jit
    def record_steps(out, wg, t, start, acc):
        """The cycles since `start` and the sum of the n / 2 accumulators, stored by the warpgroup's thread 0."""
        stop = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(n // 2):
            total = total + acc[r]
        if t == 0:
            record(out, wg, stop - start, Uint32(0), total)

    @cute.jit
    def record(out, wg, cycles, sink, total):
        ptx.stg_s64(out + Int64(wg) * 16, cycles)
        # what the steps computed, so that no step is dead code (not checked)
        ptx.stg_s64(out + Int64(wg) * 16 + 8, Int64(sink))
        ptx.stg_f32(out + OUT_TOTALS + Int64(wg) * 4, total)

    @cute.jit
    def decoder_steps(out, smem, wg, t, steps):
        """Decoder warpgroup `wg` of a split probe: per step its `frags` fragments (of row blocks wg * frags ..),
        stored as E4M3 for the chains (shared_a: four 16-byte stores each, then one proxy fence) or folded."""
        sink = Uint32(0)
        start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        for kb in cutlass.range(steps):
            for f in cutlass.range_constexpr(frags):
                a_regs = fragment(smem, wg, t, (kb + f) & 1)
                if cutlass.const_expr(shared_a):
                    block = smem + blocks_offset + (wg * frags + f) * A_BLOCK_BYTES + t * 16
                    for i in cutlass.range_constexpr(4):
                        ptx.sts128(block + i * (A_BLOCK_BYTES // 4), a_regs[4 * i:4 * i + 4])
                else:
                    for j in cutlass.range_constexpr(4):
                        sink = sink ^ a_regs[4 * j] ^ a_regs[4 * j + 1] ^ a_regs[4 * j + 2] ^ a_regs[4 * j + 3]
            if cutlass.const_expr(shared_a):
                ptx.fence_proxy_async_shared()  # the chains' WGMMAs read what the generic proxy stored
        stop = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        if t == 0:
            record(out, wg, stop - start, sink, Float32(0.0))

    @cute.jit
    def chain_steps(out, smem, wg, t, steps, descs, scale):
        """Chain warpgroup `wg` of a split probe: per step `mblocks` chains of four K32 WGMMAs (row blocks
        (wg - split) * mblocks ..; A from the decoded blocks with shared_a, else from fixed registers), one wait,
        N/2 multiply-adds per chain."""
        acc = cute.make_rmem_tensor((mblocks * (n // 2),), Float32)
        for r in cutlass.range_constexpr(mblocks * (n // 2)):
            acc[r] = Float32(0.0)
        first = (wg - split) * mblocks
        a_descs = []
        fixed = []
        if cutlass.const_expr(shared_a):
            lo = ptx.smem_desc_kmajor_lo(smem + blocks_offset + first * A_BLOCK_BYTES, 128)
            a_descs = [[ptx.smem_desc_kmajor_from_lo(lo + (m * A_BLOCK_BYTES + j * 256) // 16, 1024)
                        for j in range(4)] for m in range(mblocks)]
        else:
            fixed = fragment(smem, wg, t, Int32(0))
        start = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        for _kb in cutlass.range(steps):
            ptx.wgmma_fence()
            if cutlass.const_expr(shared_a):  # every row block's chain in flight at once, one wait
                parts = ptx.wgmma_ss_e4m3_chains(n, a_descs, descs)
                for m in cutlass.range_constexpr(mblocks):
                    for r in cutlass.range_constexpr(n // 2):
                        acc[m * (n // 2) + r] = acc[m * (n // 2) + r] + parts[m][r] * scale
            else:  # as the operator's waited loop: a chain, its wait, its multiply-adds
                for m in cutlass.range_constexpr(mblocks):
                    part = ptx.wgmma_rs_e4m3_chain(n, fixed, descs)
                    for r in cutlass.range_constexpr(n // 2):
                        acc[m * (n // 2) + r] = acc[m * (n // 2) + r] + part[r] * scale
        stop = ptx.asm("mov.u64 $0, %clock64;", [Int64], [])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(mblocks * (n // 2)):
            total = total + acc[r]
        if t == 0:
            record(out, wg, stop - start, Uint32(0), total)

    @cute.jit
    def host(out: Int64, steps: Int32):
        probe_kernel(out, steps).launch(grid=(1, 1, 1), block=(threads, 1, 1), smem=smem_bytes)

    return CompileRequest(host, (Int64(0), Int32(1)), LaunchShape(block=(threads, 1, 1), dynamic_smem_bytes=smem_bytes))


def variant(n: int, warpgroups: int, decode: bool = True, chain: bool = True, skew: bool = False, split: int = 0,
            shared_a: bool = False, wide: bool = False, pingpong: bool = False, inplace: bool = False, sync: str = ""):
    """The runtime KernelVariant of one probe configuration."""
    from gc_moe.runtime.jit import KernelVariant

    check_config(n, warpgroups, split, shared_a, wide, pingpong, inplace, sync)
    extra = {"skew": True} if skew else {}
    if wide:
        extra["wide"] = True
    if pingpong:
        extra["pingpong"] = True
    if inplace:
        extra["inplace"] = True
    if sync:
        extra["sync"] = sync
    if split:
        extra.update(split=split, shared_a=shared_a)
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
    out += [variant(n, 4, skew=True) for n in (64, 96)]
    # the operator's wide tile (two chains, two waits per step) against the one m64n96 chain above
    out += [variant(96, 4, decode=False, wide=True), variant(96, 4, wide=True)]
    # the work divided by role (decoders of all four fragments between them, four chain warpgroups of one row block
    # each): register-A chains from fixed registers beside decoders, and the shared-A design (decoders storing E4M3,
    # SS-WGMMA chains); each role alone and both
    for n, split, wgs, shared_a in SPLITS:
        out += [variant(n, wgs, split=split, shared_a=shared_a, decode=decode, chain=chain)
                for decode, chain in ((True, False), (False, True), (True, True))]
    # the halves taking turns at the tensor cores (FlashAttention-3's schedule) against the plain decode and chain: at
    # four warpgroups (the operator's table tiles) and at two, where the parts alone are measured too
    out += [variant(64, 2, decode=True, chain=False)]
    for n in PINGPONG_N:
        out += [variant(n, 2, decode=False), variant(n, 2), variant(n, 2, pingpong=True), variant(n, 4, pingpong=True)]
    # the operator's scale_ratios form (sums scaled, then the chain into them), plain and taking turns
    out += [variant(n, 4, inplace=True, pingpong=pp) for n in (64, 96) for pp in (False, True)]
    # the operator's per-step synchronization around the plain step: the arrival (lane 0 after a warp sync, or every
    # lane), the stage wait, the proxy fence, the wait under the chain
    out += [variant(n, 4, sync=sync) for n in SYNC_N for sync in SYNC_CHOICES[1:]]
    return out
