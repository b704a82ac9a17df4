"""PTX helpers the CuTe DSL does not wrap: trap, nanosleep. Call them from inside a @cute.kernel/@cute.jit."""

from cutlass import Int32, cute


@cute.jit
def trap():
    """Abort the kernel: the launch fails with an illegal-instruction error the host sees."""
    cute.arch.inline_ptx("trap;")


@cute.jit
def nanosleep(ns: Int32):
    """Back off a spinning thread for about `ns` nanoseconds (a hint, sm_70+)."""
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[ns])
