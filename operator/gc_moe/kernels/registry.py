"""The kernel variants a benchmark profile needs, per arch: what `gcmoe-bench build` compiles.

Each family is a function `(arch, profile) -> iterable of KernelVariant`, registered with
`@family`. A kernel author adds one family next to the others here; the family names its module
and builder by string, so this list imports without the CuTe DSL. `profile` is the profile's dict
(e.g. the parsed sweeps/<gpu>.toml); families read what decides their compile-time parameters and
ignore the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gc_moe.runtime.jit import KernelVariant

Family = Callable[[str, Mapping], Iterable[KernelVariant]]
_FAMILIES: list[Family] = []


def family(fn: Family) -> Family:
    """Register a variant family."""
    _FAMILIES.append(fn)
    return fn


def variants_for_profile(arch: str, profile: Mapping | None = None) -> list[KernelVariant]:
    """Every variant the registered families ask for on `arch`, each once, in a stable order."""
    seen: dict[tuple, KernelVariant] = {}
    for fn in _FAMILIES:
        for v in fn(arch, profile or {}):
            seen.setdefault((v.name, v.module, v.builder, v.params), v)
    return list(seen.values())


RING_PROOF_MODULE = "gc_moe.kernels.sm90.ring_proof"
RING_PROOF_PRODUCER = KernelVariant.make("ring_proof.producer", RING_PROOF_MODULE, "build_producer",
                                         promises=("st.release.gpu", "ld.acquire.gpu"))
RING_PROOF_CONSUMER = KernelVariant.make("ring_proof.consumer", RING_PROOF_MODULE, "build_consumer",
                                         promises=("ld.acquire.gpu", "st.release.gpu", "trap", "nanosleep"))
RING_PROOF_CHECKER = KernelVariant.make("ring_proof.checker", RING_PROOF_MODULE, "build_checker",
                                        promises=("st.release.gpu",))

LAUNCH_PROBE = KernelVariant.make("ring_proof.launch_probe", RING_PROOF_MODULE, "build_launch_probe",
                                  promises=("atom.global.add",))


@family
def ring_proof(arch: str, profile: Mapping) -> Iterable[KernelVariant]:
    """The runtime's cross-partition proof kernels (built for every profile: `device_runtime_proof.py`)."""
    if arch == "sm_90a":
        yield from (RING_PROOF_PRODUCER, RING_PROOF_CONSUMER, RING_PROOF_CHECKER, LAUNCH_PROBE)


@family
def sm90_grouped_gemm(arch: str, profile: Mapping) -> Iterable[KernelVariant]:
    """The SM90 FP8xFP4 grouped GEMM: both roles at every block_n its module lists, and the stream-K pair kernel."""
    if arch == "sm_90a":
        from gc_moe.kernels.sm90 import grouped_gemm, stream_pair  # import without the DSL; built lazily

        yield from grouped_gemm.all_variants()
        yield from stream_pair.all_variants()  # W1 and W2's stream-K loops as one launch (opt-in)


@family
def sm90_layer_roles(arch: str, profile: Mapping) -> Iterable[KernelVariant]:
    """Roles 1-3 of the SM90 layer: dispatch and finalize (one binary each, shapes are kernel parameters) and the
    fused role2 kernel at every token tile the layer plans, for a pool-sized and for a reused ring."""
    if arch == "sm_90a":
        from gc_moe.kernels.sm90 import dispatch, finalize  # import without the DSL; built lazily
        from gc_moe.kernels.sm90 import layer as sm90_layer

        yield dispatch.variant()
        yield finalize.variant()
        yield dispatch.consumer_probe_variant()
        for reuse in (False, True):
            yield from (sm90_layer.role2_variant(bn, ring_reuse=reuse) for bn in sm90_layer.role2.BLOCK_N_CHOICES)
            yield from (sm90_layer.role2_variant(bn, ctas_per_sm=2, ring_reuse=reuse)
                        for bn in sm90_layer.role2.TWO_CTA_BLOCK_N)


@family
def sm90_mega_port(arch: str, profile: Mapping) -> Iterable[KernelVariant]:
    """The SM90 Mega MoE reference port (baseline `mega-port`): one persistent kernel per block_n."""
    if arch == "sm_90a":
        from baselines.mega_moe.port_sm90 import host  # imports without the DSL; kernels are built lazily

        yield from host.all_variants()


@family
def sm90_shared_expert(arch: str, profile: Mapping) -> Iterable[KernelVariant]:
    """Role4 of the SM90 layer: the FP8 shared expert (W1 + SwiGLU + requant, W2 into a row-strided BF16 output),
    both roles at every block_n for both shared recipes; one binary each for every token count."""
    if arch == "sm_90a":
        from gc_moe.kernels.sm90 import shared_expert  # imports without the DSL; kernels are built lazily

        yield from shared_expert.all_variants()
