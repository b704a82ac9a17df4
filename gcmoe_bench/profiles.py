"""Sweep profiles: load and validate ``sweeps/<gpu>.toml``, then apply command-line overrides.

A profile names what one sweep measures (models, tokens per rank, suites and their operators) and how
(protocol windows, L2 mode, idle gate).  ``[layouts.NAME]`` tables hold alternative layouts of the same GPU kind
(e.g. the 8-rank layout of ``h200.toml``); ``--layout NAME`` replaces the top-level keys with the layout's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from gcmoe_bench.models import ModelShape, table4_models

L2_MODES = ("flush", "rotate")
OVERLAP_MODES = ("on", "off")  # GC-MoE's dispatch and W1 graph roots: concurrent (the operator's default) or serialized
DEVICES = ("cuda", "cpu")
SCALE_GRANULE = 128  # H and I must hold whole packed UE8M0 words (4 scales x 32 values)


class ProfileError(ValueError):
    """A profile file or an override is invalid; the message names the field, the value and what is allowed."""


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    shared_experts: int  # 0: routed experts only; 1: one shared expert fused (or run beside, for unfused operators)
    baseline: str
    operators: tuple[str, ...]

    @property
    def all_operators(self) -> tuple[str, ...]:
        """Baseline first, so every operator's speedup can be computed as soon as it is measured."""
        return (self.baseline,) + tuple(op for op in self.operators if op != self.baseline)


@dataclass(frozen=True)
class ProtocolSpec:
    warmup_windows: int = 10
    measured_windows: int = 30
    replays_per_window: int = 100
    l2: str = "flush"
    flush_bytes: int | None = None  # None: twice the device's last-level cache
    interleave: bool = False  # measure a point's operators window by window in turn, not one after the other


@dataclass(frozen=True)
class GateSpec:
    min_free_mib: int = 51200
    samples: int = 3
    span_s: float = 10.0
    max_utilization_percent: int = 0


@dataclass(frozen=True)
class Profile:
    gpu: str
    description: str
    device: str
    num_ranks: int | None  # None: any world size (the CPU profile)
    models: tuple[ModelShape, ...]
    tokens_per_rank: tuple[int, ...]
    suites: tuple[SuiteSpec, ...]
    protocol: ProtocolSpec = field(default_factory=ProtocolSpec)
    gate: GateSpec = field(default_factory=GateSpec)
    routing: str = "uniform"
    seed: int = 0
    dispatch_sm_request: int | None = None
    timeout_s: float = 600.0
    layout: str = "default"
    skip_gate: bool = False
    overlap: str = "on"  # GC-MoE's overlap of dispatch and W1 (handed to the runtime as GC_MOE_OVERLAP_ROOTS)
    only_operators: tuple[str, ...] | None = None  # measure only these operators of each suite (None: all)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def operators_of(self, suite: SuiteSpec) -> tuple[str, ...]:
        """The operators measured in `suite`, baseline first: all of them, or those `only_operators` names (the
        baseline too only when named)."""
        if self.only_operators is None:
            return suite.all_operators
        return tuple(op for op in suite.all_operators if op in self.only_operators)


_TOP_KEYS = {
    "gpu", "description", "device", "ranks", "tokens_per_rank", "capacity", "routing", "seed",
    "dispatch_sm_request", "timeout_s", "protocol", "gate", "models", "suites", "layouts", "overlap",
}
_MODEL_KEYS = {
    "base", "name", "hidden", "intermediate", "experts", "topk", "shared_experts", "shared_k_group",
    "capacity", "expert_slice",
}
_SUITE_KEYS = {"name", "shared_experts", "baseline", "operators"}


def profiles_dir() -> Path:
    """``sweeps/`` of the source tree (profiles are data that users edit, so they live beside the package)."""
    return Path(__file__).resolve().parent.parent / "sweeps"


def available_profiles(directory: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (directory or profiles_dir()).glob("*.toml"))


def load_profile(gpu: str, *, layout: str | None = None, directory: Path | None = None) -> Profile:
    """Read ``sweeps/<gpu>.toml`` (or ``gpu`` as a path to a TOML file) and validate it."""
    path = Path(gpu) if gpu.endswith(".toml") else (directory or profiles_dir()) / f"{gpu}.toml"
    if not path.is_file():
        raise ProfileError(
            f"no sweep profile {str(path)!r}; available: {', '.join(available_profiles(directory)) or 'none'}"
        )
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from exc
    return profile_from_dict(raw, layout=layout, source=str(path))


def profile_from_dict(raw: dict[str, Any], *, layout: str | None = None, source: str = "profile") -> Profile:
    _check_keys(raw, _TOP_KEYS, source)
    layouts = raw.get("layouts", {})
    merged = {k: v for k, v in raw.items() if k != "layouts"}
    if layout not in (None, "default"):
        if layout not in layouts:
            raise ProfileError(
                f"{source}: no layout {layout!r}; available: {', '.join(['default', *layouts]) }"
            )
        _check_keys(layouts[layout], _TOP_KEYS - {"layouts", "gpu"}, f"{source} [layouts.{layout}]")
        merged.update(layouts[layout])

    where = source if layout in (None, "default") else f"{source} (layout {layout})"
    gpu = _require(merged, "gpu", str, where)
    device = merged.get("device", "cuda")
    if device not in DEVICES:
        raise ProfileError(f"{where}: device = {device!r}; allowed: {', '.join(DEVICES)}")
    num_ranks = merged.get("ranks")
    if num_ranks is not None and (not isinstance(num_ranks, int) or num_ranks < 1):
        raise ProfileError(f"{where}: ranks = {num_ranks!r}; allowed: a positive integer (or leave it out)")
    capacity = merged.get("capacity", 256)
    models = tuple(_model(m, capacity, f"{where} [[models]] #{i + 1}") for i, m in enumerate(
        _require(merged, "models", list, where)))
    if not models:
        raise ProfileError(f"{where}: models is empty; name at least one model")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ProfileError(f"{where}: model names repeat: {names}; give each [[models]] entry its own name")
    suites = tuple(_suite(s, f"{where} [[suites]] #{i + 1}") for i, s in enumerate(
        _require(merged, "suites", list, where)))
    if not suites:
        raise ProfileError(f"{where}: suites is empty; name at least one suite")
    protocol = _protocol(merged.get("protocol", {}), where)
    gate = _gate(merged.get("gate", {}), where)
    profile = Profile(
        gpu=gpu,
        description=merged.get("description", ""),
        device=device,
        num_ranks=num_ranks,
        models=models,
        tokens_per_rank=_tokens(_require(merged, "tokens_per_rank", list, where), where),
        suites=suites,
        protocol=protocol,
        gate=gate,
        routing=merged.get("routing", "uniform"),
        seed=int(merged.get("seed", 0)),
        dispatch_sm_request=merged.get("dispatch_sm_request"),
        timeout_s=float(merged.get("timeout_s", 600.0)),
        layout=layout or "default",
        overlap=merged.get("overlap", "on"),
    )
    validate(profile, where)
    return profile


def validate(profile: Profile, where: str = "profile") -> None:
    """Checks across fields: tokens against capacity, ranks against experts, operator names."""
    from gcmoe_bench.operators import operator_names  # the registry is the one list of operator names

    known = operator_names()
    for suite in profile.suites:
        for op in suite.all_operators:
            if op not in known:
                raise ProfileError(
                    f"{where}: suite {suite.name!r} names operator {op!r}; known operators: {', '.join(known)}"
                )
    for model in profile.models:
        too_big = [t for t in profile.tokens_per_rank if t > model.capacity]
        if too_big:
            raise ProfileError(
                f"{where}: tokens_per_rank {too_big} exceed model {model.name!r}'s capacity {model.capacity}; "
                f"allowed: 1..{model.capacity}"
            )
        if profile.num_ranks is not None and model.num_experts % profile.num_ranks:
            raise ProfileError(
                f"{where}: model {model.name!r} has {model.num_experts} experts, which {profile.num_ranks} ranks "
                f"cannot split evenly"
            )
    if profile.dispatch_sm_request is not None and (
        not isinstance(profile.dispatch_sm_request, int) or profile.dispatch_sm_request < 1
    ):
        raise ProfileError(f"{where}: dispatch_sm_request = {profile.dispatch_sm_request!r}; allowed: >= 1")
    if profile.timeout_s <= 0:
        raise ProfileError(f"{where}: timeout_s = {profile.timeout_s}; allowed: > 0 seconds")
    if profile.overlap not in OVERLAP_MODES:
        raise ProfileError(f"{where}: overlap = {profile.overlap!r}; allowed: {', '.join(OVERLAP_MODES)}")
    if profile.only_operators is not None:
        offered = list(dict.fromkeys(op for suite in profile.suites for op in suite.all_operators))
        unknown = [op for op in profile.only_operators if op not in offered]
        if unknown or not profile.only_operators:
            raise ProfileError(f"{where}: --operators {', '.join(unknown) or '(none)'} not in the suites "
                               f"{', '.join(s.name for s in profile.suites)} of profile {profile.gpu!r}; allowed: "
                               f"{', '.join(offered)}")
        for suite in profile.suites:
            if not profile.operators_of(suite):
                raise ProfileError(f"{where}: --operators {', '.join(profile.only_operators)}: suite {suite.name!r} "
                                   f"has none of them (it has {', '.join(suite.all_operators)}); leave it out "
                                   f"with --suite")


def apply_overrides(
    profile: Profile,
    *,
    models: list[str] | None = None,
    tokens: list[int] | None = None,
    suites: list[str] | None = None,
    l2: str | None = None,
    windows: int | None = None,
    warmup: int | None = None,
    replays: int | None = None,
    skip_gate: bool | None = None,
    dispatch_sms: int | None = None,
    overlap: str | None = None,
    operators: list[str] | None = None,
) -> Profile:
    """The profile with command-line overrides applied (each one validated like the file's own fields)."""
    changes: dict[str, Any] = {}
    if models:
        by_name = {m.name: m for m in profile.models}
        chosen = []
        for name in models:
            matches = [m for m in profile.models if name in (m.name, m.base)]
            if not matches:
                raise ProfileError(
                    f"--models {name!r} is not in profile {profile.gpu!r}; allowed: {', '.join(by_name)}"
                )
            chosen += [m for m in matches if m not in chosen]
        changes["models"] = tuple(chosen)
    if tokens:
        changes["tokens_per_rank"] = _tokens(list(tokens), "--tokens")
    if suites:
        by_name = {s.name: s for s in profile.suites}
        unknown = [s for s in suites if s not in by_name]
        if unknown:
            raise ProfileError(f"--suite {unknown} not in profile {profile.gpu!r}; allowed: {', '.join(by_name)}")
        changes["suites"] = tuple(by_name[s] for s in suites)
    protocol_changes: dict[str, Any] = {}
    if l2 is not None:
        protocol_changes["l2"] = l2
    if windows is not None:
        protocol_changes["measured_windows"] = windows
    if warmup is not None:
        protocol_changes["warmup_windows"] = warmup
    if replays is not None:
        protocol_changes["replays_per_window"] = replays
    if protocol_changes:
        merged = dataclasses.asdict(profile.protocol) | protocol_changes
        changes["protocol"] = _protocol(merged, "command line")
    if skip_gate is not None:
        changes["skip_gate"] = skip_gate
    if dispatch_sms is not None:
        if isinstance(dispatch_sms, bool) or not isinstance(dispatch_sms, int) or dispatch_sms < 1:
            raise ProfileError(f"--dispatch-sms {dispatch_sms!r}; allowed: an integer >= 1 (the SMs GC-MoE "
                               f"requests for its dispatch partition)")
        changes["dispatch_sm_request"] = dispatch_sms
    if overlap is not None:
        if overlap not in OVERLAP_MODES:
            raise ProfileError(f"--overlap {overlap!r}; allowed: {', '.join(OVERLAP_MODES)}")
        changes["overlap"] = overlap
    if operators:
        changes["only_operators"] = tuple(dict.fromkeys(operators))
    result = dataclasses.replace(profile, **changes)
    validate(result, "command line")
    return result


def profile_from_resolved(data: dict[str, Any]) -> Profile:
    """Rebuild a profile from ``Profile.to_dict()`` (what env.json records), for ``--resume``."""
    return Profile(
        **{
            **data,
            "models": tuple(ModelShape(**m) for m in data["models"]),
            "tokens_per_rank": tuple(data["tokens_per_rank"]),
            "suites": tuple(SuiteSpec(**{**s, "operators": tuple(s["operators"])}) for s in data["suites"]),
            "protocol": ProtocolSpec(**data["protocol"]),
            "gate": GateSpec(**data["gate"]),
            "only_operators": None if data.get("only_operators") is None else tuple(data["only_operators"]),
        }
    )


def _check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: expected a table, got {type(table).__name__}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")


def _require(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise ProfileError(f"{where}: missing required key {key!r}")
    if not isinstance(table[key], kind):
        raise ProfileError(f"{where}: {key} = {table[key]!r}; expected a {kind.__name__}")
    return table[key]


def _positive_int(value: Any, what: str, where: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProfileError(f"{where}: {what} = {value!r}; allowed: an integer >= {minimum}")
    return value


def _tokens(values: list[Any], where: str) -> tuple[int, ...]:
    if not values:
        raise ProfileError(f"{where}: tokens_per_rank is empty; allowed: integers >= 1, e.g. [1, 2, 4]")
    tokens = tuple(_positive_int(v, "tokens_per_rank entry", where) for v in values)
    if len(set(tokens)) != len(tokens):
        raise ProfileError(f"{where}: tokens_per_rank {list(tokens)} repeats a value")
    return tuple(sorted(tokens))


def _model(table: dict[str, Any], default_capacity: int, where: str) -> ModelShape:
    _check_keys(table, _MODEL_KEYS, where)
    base_name = _require(table, "base", str, where)
    known = table4_models()
    if base_name not in known:
        raise ProfileError(f"{where}: base = {base_name!r}; allowed: {', '.join(known)} (the paper's Table 4)")
    base = known[base_name]
    experts = _positive_int(table.get("experts", base.num_experts), "experts", where)
    expert_slice = _positive_int(table.get("expert_slice", 1), "expert_slice", where)
    if experts % expert_slice:
        raise ProfileError(f"{where}: expert_slice = {expert_slice} does not divide experts = {experts}")
    shape = ModelShape(
        name=table.get("name", base_name),
        base=base_name,
        hidden=_positive_int(table.get("hidden", base.hidden), "hidden", where),
        intermediate=_positive_int(table.get("intermediate", base.intermediate), "intermediate", where),
        num_experts=experts // expert_slice,
        topk=_positive_int(table.get("topk", base.topk), "topk", where),
        num_shared_experts=_positive_int(table.get("shared_experts", base.num_shared_experts), "shared_experts",
                                         where, minimum=0),
        shared_k_group=_positive_int(table.get("shared_k_group", base.shared_k_group), "shared_k_group", where),
        capacity=_positive_int(table.get("capacity", default_capacity), "capacity", where),
        activation_alpha=base.activation_alpha,
        activation_clamp=base.activation_clamp,
    )
    for what, value in (("hidden", shape.hidden), ("intermediate", shape.intermediate)):
        if value % SCALE_GRANULE:
            raise ProfileError(f"{where}: {what} = {value}; allowed: a multiple of {SCALE_GRANULE}")
    if shape.topk > shape.num_experts:
        raise ProfileError(
            f"{where}: topk = {shape.topk} exceeds the {shape.num_experts} experts the layer has "
            f"(after expert_slice); allowed: topk <= experts"
        )
    return shape


def _suite(table: dict[str, Any], where: str) -> SuiteSpec:
    _check_keys(table, _SUITE_KEYS, where)
    operators = _require(table, "operators", list, where)
    if not all(isinstance(o, str) for o in operators):
        raise ProfileError(f"{where}: operators = {operators!r}; expected a list of operator names")
    shared = table.get("shared_experts", 0)
    if shared not in (0, 1):
        raise ProfileError(f"{where}: shared_experts = {shared!r}; allowed: 0 (routed) or 1 (one shared expert)")
    return SuiteSpec(
        name=_require(table, "name", str, where),
        shared_experts=shared,
        baseline=_require(table, "baseline", str, where),
        operators=tuple(operators),
    )


def _protocol(table: dict[str, Any], where: str) -> ProtocolSpec:
    _check_keys(table, {f.name for f in dataclasses.fields(ProtocolSpec)}, f"{where} [protocol]")
    spec = ProtocolSpec(**table)
    _positive_int(spec.warmup_windows, "warmup_windows", where, minimum=0)
    _positive_int(spec.measured_windows, "measured_windows", where)
    _positive_int(spec.replays_per_window, "replays_per_window", where)
    if spec.l2 not in L2_MODES:
        raise ProfileError(f"{where}: l2 = {spec.l2!r}; allowed: {', '.join(L2_MODES)}")
    if spec.flush_bytes is not None:
        _positive_int(spec.flush_bytes, "flush_bytes", where)
    if not isinstance(spec.interleave, bool):
        raise ProfileError(f"{where}: interleave = {spec.interleave!r}; allowed: true or false")
    return spec


def _gate(table: dict[str, Any], where: str) -> GateSpec:
    _check_keys(table, {f.name for f in dataclasses.fields(GateSpec)}, f"{where} [gate]")
    spec = GateSpec(**table)
    # the paper's floor: a gate over fewer samples or a shorter span would not see a bursty neighbour
    if not isinstance(spec.samples, int) or spec.samples < 3:
        raise ProfileError(f"{where} [gate]: samples = {spec.samples!r}; allowed: >= 3")
    if spec.span_s < 10:
        raise ProfileError(f"{where} [gate]: span_s = {spec.span_s!r}; allowed: >= 10 seconds")
    _positive_int(spec.min_free_mib, "min_free_mib", where, minimum=0)
    return spec
