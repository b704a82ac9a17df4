"""Proof kernels for the cross-partition ring protocol (producer, consumer, checker).

The producer runs in the communication partition: it fills ring slots with a pattern that depends on
(generation, slot, word) and publishes each slot's `full` counter with the generation (release).
The consumer runs in the compute partition: it acquires each slot's counter with a bounded wait,
checks every word and marks the slot `done`. The checker depends on both: it verifies every `full`
and `done` counter, records the two roots' %globaltimer spans, resets the counters and advances the
generation, so the next graph replay needs no host work.

Memory (device buffers the host allocates; indices below are shared with the host side):
  ring      int32 [num_slots * slot_words]
  counters  int32 [2 * num_slots]            full[s] at s, done[s] at num_slots + s
  control   int32 [CONTROL_WORDS]            generation and the cumulative report
  p_stamps  int64 [2 * producer CTAs]        per-CTA start/end ns of the latest replay
  c_stamps  int64 [2 * consumer CTAs]
  timeline  int64 [capacity * 4]             per replay: producer start, end, consumer start, end

The host-side constants import without the DSL; the kernels are defined only where it is installed.
"""

from __future__ import annotations

# control words
GENERATION = 0
REPLAYS_CHECKED = 1
DATA_MISMATCHES = 2
WAIT_TIMEOUTS = 3
MISSING_FULL = 4
MISSING_DONE = 5
CONTROL_WORDS = 8
TIMELINE_FIELDS = 4
BLOCK_THREADS = 128
CHECKER_THREADS = 32
# launch probe: a 2-CTA cluster with more dynamic shared memory than the 48 KiB default
PROBE_CLUSTER = 2
PROBE_SMEM_WORDS = 16384  # 64 KiB of int32
PROBE_FIELDS = 4  # per CTA: checksum of its shared-memory words, rank in cluster, cluster size, dynamic smem bytes
_PATTERN_GEN, _PATTERN_SLOT = 65599, 4099


def expected_probe_checksum(block: int) -> int:
    """Sum over the probe's shared-memory words (word + block), as int32."""
    v = (PROBE_SMEM_WORDS * (PROBE_SMEM_WORDS - 1) // 2 + PROBE_SMEM_WORDS * block) & 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def expected_word(generation: int, slot: int, word: int) -> int:
    """The ring word the producer writes, as a signed int32 (host-side twin of the kernels' pattern)."""
    v = (generation * _PATTERN_GEN + slot * _PATTERN_SLOT + word) & 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


try:
    import cutlass  # noqa: F401  (the DSL probe: the kernels below need it)
    from cutlass import Int32, Int64, cute
    from cutlass.cute.runtime import make_ptr
    from cutlass.memory import SmemAllocator
except ImportError:  # runtime-only machines: the constants above are all they need
    cute = None

if cute is not None:
    from gc_moe.kernels.common.signals import WAIT_OK, publish, read_generation, wait_generation
    from gc_moe.runtime.jit import CompileRequest, LaunchShape

    @cute.jit
    def _pattern(generation: Int32, slot: Int32, word: Int32) -> Int32:
        return generation * Int32(_PATTERN_GEN) + slot * Int32(_PATTERN_SLOT) + word

    @cute.kernel
    def producer_kernel(ring: cute.Pointer, counters: cute.Pointer, control: cute.Pointer, p_stamps: cute.Pointer,
                        num_slots: Int32, slot_words: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblocks, _, _ = cute.arch.grid_dim()
        started = cute.arch.globaltimer()
        generation = read_generation(control + GENERATION)
        slot = bidx
        while slot < num_slots:
            word = tidx
            while word < slot_words:
                cute.arch.store(ring + (slot * slot_words + word), _pattern(generation, slot, word))
                word = word + BLOCK_THREADS
            cute.arch.barrier()  # every thread's words precede thread 0's release
            if tidx == 0:
                publish(counters + slot, generation)
            slot = slot + nblocks
        finished = cute.arch.globaltimer()
        if tidx == 0:
            cute.arch.store(p_stamps + 2 * bidx, started)
            cute.arch.store(p_stamps + 2 * bidx + 1, finished)

    @cute.kernel
    def consumer_kernel(ring: cute.Pointer, counters: cute.Pointer, control: cute.Pointer, c_stamps: cute.Pointer,
                        num_slots: Int32, slot_words: Int32, timeout_ns: Int64, trap_on_timeout: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblocks, _, _ = cute.arch.grid_dim()
        started = cute.arch.globaltimer()
        generation = read_generation(control + GENERATION)
        slot = bidx
        while slot < num_slots:
            if tidx == 0:
                status = wait_generation(counters + slot, generation, started, timeout_ns, trap_on_timeout)
                if status != WAIT_OK:
                    cute.arch.atomic_add(control + WAIT_TIMEOUTS, Int32(1))
            cute.arch.barrier()
            # each thread acquires the counter itself: the data check runs only on a published slot
            published = read_generation(counters + slot) == generation
            if published:
                mismatches = Int32(0)
                word = tidx
                while word < slot_words:
                    if cute.arch.load(ring + (slot * slot_words + word), Int32) != _pattern(generation, slot, word):
                        mismatches = mismatches + 1
                    word = word + BLOCK_THREADS
                if mismatches != 0:
                    cute.arch.atomic_add(control + DATA_MISMATCHES, mismatches)
            cute.arch.barrier()  # outside the branch: every thread reaches it whatever it saw
            if tidx == 0 and published:
                publish(counters + (num_slots + slot), generation)
            slot = slot + nblocks
        finished = cute.arch.globaltimer()
        if tidx == 0:
            cute.arch.store(c_stamps + 2 * bidx, started)
            cute.arch.store(c_stamps + 2 * bidx + 1, finished)

    @cute.kernel
    def checker_kernel(counters: cute.Pointer, control: cute.Pointer, p_stamps: cute.Pointer, c_stamps: cute.Pointer,
                       timeline: cute.Pointer, num_slots: Int32, producer_ctas: Int32, consumer_ctas: Int32,
                       timeline_capacity: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            generation = read_generation(control + GENERATION)
            missing_full = Int32(0)
            missing_done = Int32(0)
            for slot in range(num_slots):
                if cute.arch.load(counters + slot, Int32) != generation:
                    missing_full = missing_full + 1
                if cute.arch.load(counters + (num_slots + slot), Int32) != generation:
                    missing_done = missing_done + 1
                cute.arch.store(counters + slot, Int32(0))
                cute.arch.store(counters + (num_slots + slot), Int32(0))
            p_start = cute.arch.load(p_stamps, Int64)
            p_end = cute.arch.load(p_stamps + 1, Int64)
            for cta in range(1, producer_ctas):
                s = cute.arch.load(p_stamps + 2 * cta, Int64)
                e = cute.arch.load(p_stamps + 2 * cta + 1, Int64)
                p_start = min(p_start, s)
                p_end = max(p_end, e)
            c_start = cute.arch.load(c_stamps, Int64)
            c_end = cute.arch.load(c_stamps + 1, Int64)
            for cta in range(1, consumer_ctas):
                s = cute.arch.load(c_stamps + 2 * cta, Int64)
                e = cute.arch.load(c_stamps + 2 * cta + 1, Int64)
                c_start = min(c_start, s)
                c_end = max(c_end, e)
            replay = cute.arch.load(control + REPLAYS_CHECKED, Int32)
            if replay < timeline_capacity:
                row = timeline + TIMELINE_FIELDS * replay
                cute.arch.store(row, p_start)
                cute.arch.store(row + 1, p_end)
                cute.arch.store(row + 2, c_start)
                cute.arch.store(row + 3, c_end)
            if missing_full != 0:
                cute.arch.atomic_add(control + MISSING_FULL, missing_full)
            if missing_done != 0:
                cute.arch.atomic_add(control + MISSING_DONE, missing_done)
            cute.arch.store(control + REPLAYS_CHECKED, replay + 1)
            # the next replay's generation; release orders the resets above before it
            publish(control + GENERATION, generation + 1)

    @cute.jit
    def _launch_producer(ring: cute.Pointer, counters: cute.Pointer, control: cute.Pointer, p_stamps: cute.Pointer,
                         num_slots: Int32, slot_words: Int32):
        producer_kernel(ring, counters, control, p_stamps, num_slots, slot_words).launch(
            grid=[1, 1, 1], block=[BLOCK_THREADS, 1, 1])

    @cute.jit
    def _launch_consumer(ring: cute.Pointer, counters: cute.Pointer, control: cute.Pointer, c_stamps: cute.Pointer,
                         num_slots: Int32, slot_words: Int32, timeout_ns: Int64, trap_on_timeout: Int32):
        consumer_kernel(ring, counters, control, c_stamps, num_slots, slot_words, timeout_ns, trap_on_timeout).launch(
            grid=[1, 1, 1], block=[BLOCK_THREADS, 1, 1])

    @cute.jit
    def _launch_checker(counters: cute.Pointer, control: cute.Pointer, p_stamps: cute.Pointer, c_stamps: cute.Pointer,
                        timeline: cute.Pointer, num_slots: Int32, producer_ctas: Int32, consumer_ctas: Int32,
                        timeline_capacity: Int32):
        checker_kernel(counters, control, p_stamps, c_stamps, timeline, num_slots, producer_ctas, consumer_ctas,
                       timeline_capacity).launch(grid=[1, 1, 1], block=[CHECKER_THREADS, 1, 1])

    @cute.kernel
    def launch_probe_kernel(out: cute.Pointer):
        """Checks the launcher's dynamic shared memory and cluster attributes from inside a kernel."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        words = smem.allocate_tensor(Int32, cute.make_layout(PROBE_SMEM_WORDS), byte_alignment=16)
        for i in range(tidx, PROBE_SMEM_WORDS, BLOCK_THREADS):
            words[i] = i + bidx
        cute.arch.barrier()
        partial = Int32(0)
        for i in range(tidx, PROBE_SMEM_WORDS, BLOCK_THREADS):
            partial = partial + words[(i + 7 * BLOCK_THREADS) % PROBE_SMEM_WORDS]  # read other threads' words
        cute.arch.atomic_add(out + PROBE_FIELDS * bidx, partial)
        if tidx == 0:
            cute.arch.store(out + (PROBE_FIELDS * bidx + 1), cute.arch.block_idx_in_cluster())
            cute.arch.store(out + (PROBE_FIELDS * bidx + 2), cute.arch.cluster_size())
            cute.arch.store(out + (PROBE_FIELDS * bidx + 3), cute.arch.dynamic_smem_size())

    @cute.jit
    def _launch_probe(out: cute.Pointer):
        launch_probe_kernel(out).launch(grid=[PROBE_CLUSTER, 1, 1], block=[BLOCK_THREADS, 1, 1],
                                        cluster=[PROBE_CLUSTER, 1, 1], smem=4 * PROBE_SMEM_WORDS)

    def _gmem(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    def build_producer(arch: str) -> CompileRequest:
        args = (_gmem(Int32), _gmem(Int32), _gmem(Int32), _gmem(Int64), Int32(1), Int32(1))
        return CompileRequest(_launch_producer, args, LaunchShape(block=(BLOCK_THREADS, 1, 1)))

    def build_consumer(arch: str) -> CompileRequest:
        args = (_gmem(Int32), _gmem(Int32), _gmem(Int32), _gmem(Int64), Int32(1), Int32(1), Int64(1), Int32(0))
        return CompileRequest(_launch_consumer, args, LaunchShape(block=(BLOCK_THREADS, 1, 1)))

    def build_checker(arch: str) -> CompileRequest:
        args = (_gmem(Int32), _gmem(Int32), _gmem(Int64), _gmem(Int64), _gmem(Int64),
                Int32(1), Int32(1), Int32(1), Int32(1))
        return CompileRequest(_launch_checker, args, LaunchShape(block=(CHECKER_THREADS, 1, 1)))

    def build_launch_probe(arch: str) -> CompileRequest:
        return CompileRequest(_launch_probe, (_gmem(Int32),),
                              LaunchShape(block=(BLOCK_THREADS, 1, 1), cluster=(PROBE_CLUSTER, 1, 1),
                                          dynamic_smem_bytes=4 * PROBE_SMEM_WORDS))
