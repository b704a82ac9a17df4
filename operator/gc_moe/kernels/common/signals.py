"""Generation-tagged ring signals and bounded waits across green-context partitions.

A producer fills a ring slot, then publishes the slot's counter with the current generation using
release semantics at GPU scope; a consumer acquires the counter until it holds that generation. The
generation changes every replay, so a value left from the previous replay never satisfies a wait.
Partitions do not guarantee that producer and consumer run at the same time, so every wait is
bounded by %globaltimer and reports (or traps) instead of hanging.
"""

from cutlass import Int32, Int64, cute

from .ptx import nanosleep, trap

WAIT_OK = 0
WAIT_TIMED_OUT = 1


@cute.jit
def publish(counter: cute.Pointer, generation: Int32):
    """Release `generation` into `counter`; the caller has made the slot's data visible to this thread
    (a CTA barrier after the other threads' writes)."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.store(counter, generation, sem="release", scope="gpu")


@cute.jit
def read_generation(counter: cute.Pointer) -> Int32:
    """Acquire-load a counter."""
    return cute.arch.load(counter, Int32, sem="acquire", scope="gpu")


@cute.jit
def wait_generation(counter: cute.Pointer, generation: Int32, start_ns: Int64, timeout_ns: Int64,
                    trap_on_timeout: Int32) -> Int32:
    """Spin (acquire loads, short back-off) until `counter == generation` or `timeout_ns` passed since
    `start_ns`. Returns WAIT_OK or WAIT_TIMED_OUT; traps on timeout when `trap_on_timeout` is non-zero."""
    seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    status = Int32(WAIT_OK)
    while seen != generation and status == WAIT_OK:
        if cute.arch.globaltimer() - start_ns > timeout_ns:
            status = Int32(WAIT_TIMED_OUT)
        else:
            nanosleep(Int32(32))
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    if status != WAIT_OK and trap_on_timeout != 0:
        trap()
    return status
