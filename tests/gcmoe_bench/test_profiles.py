"""Sweep profiles: the shipped ones load and say what the paper's setups are; invalid ones fail clearly."""

from __future__ import annotations

import copy
import json

import pytest
import tomllib

from gcmoe_bench.models import table4_models
from gcmoe_bench.profiles import (
    ProfileError,
    apply_overrides,
    available_profiles,
    load_profile,
    profile_from_dict,
    profile_from_resolved,
    profiles_dir,
)

PAPER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_table4_models_match_the_paper():
    models = table4_models()
    glm, dsv = models["glm-5.2"], models["deepseek-v4.1-flash"]
    assert (glm.hidden, glm.intermediate, glm.num_experts, glm.topk, glm.shared_k_group) == (6144, 2048, 256, 8, 128)
    assert (dsv.hidden, dsv.intermediate, dsv.num_experts, dsv.topk, dsv.shared_k_group) == (5120, 2304, 384, 6, 32)
    assert glm.capacity == dsv.capacity == 256 and glm.activation_clamp == 10.0


def test_shipped_profiles_load():
    assert {"b300", "h20", "h200", "cpu"} <= set(available_profiles())
    b300 = load_profile("b300")
    assert b300.num_ranks == 8 and b300.tokens_per_rank == PAPER_TOKENS and b300.dispatch_sm_request == 16
    assert [m.name for m in b300.models] == ["glm-5.2", "deepseek-v4.1-flash"]
    assert [(s.name, s.baseline, s.operators) for s in b300.suites] == [
        ("routed", "deepgemm", ("gc",)), ("shared", "deepgemm", ("gc",))]
    h20 = load_profile("h20")
    assert [m.name for m in h20.models] == ["deepseek-v4.1-flash"] and h20.dispatch_sm_request == 4
    assert h20.suites[1].all_operators == ("mega-port", "gc", "gc-unfused")
    assert (h20.protocol.warmup_windows, h20.protocol.measured_windows, h20.protocol.replays_per_window) == (10, 30, 100)
    assert h20.gate.min_free_mib == 51200 and h20.gate.samples == 3 and h20.gate.span_s == 10


def test_h200_slice_keeps_one_ranks_experts_and_eight_rank_layout_restores_them():
    one = load_profile("h200")
    assert one.num_ranks == 1
    assert [(m.name, m.num_experts, m.topk) for m in one.models] == [("glm-5.2", 32, 8), ("deepseek-v4.1-flash", 48, 6)]
    eight = load_profile("h200", layout="eight-rank")
    assert eight.num_ranks == 8 and eight.layout == "eight-rank"
    assert [m.num_experts for m in eight.models] == [256, 384]
    # per-rank expert count is the same in both layouts
    assert [m.experts_per_rank(1) for m in one.models] == [m.experts_per_rank(8) for m in eight.models]


def test_cpu_profile_is_shrunken_and_any_world_size():
    cpu = load_profile("cpu")
    assert cpu.device == "cpu" and cpu.num_ranks is None
    for m in cpu.models:
        assert m.hidden * m.intermediate * m.num_experts < 6144 * 2048 * 256 / 1000
        for ranks in (1, 2, 4, 8):
            assert m.num_experts % ranks == 0
    assert all(s.baseline == "reference" for s in cpu.suites)


def raw_profile() -> dict:
    return tomllib.loads((profiles_dir() / "h20.toml").read_text())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(colour="red"), r"unknown key\(s\) \['colour'\]"),
        (lambda r: r["protocol"].update(l2="cold"), r"l2 = 'cold'; allowed: flush, rotate"),
        (lambda r: r.update(tokens_per_rank=[1, 512]), r"tokens_per_rank \[512\] exceed model 'deepseek-v4.1-flash'"),
        (lambda r: r.update(tokens_per_rank=[]), "tokens_per_rank is empty"),
        (lambda r: r.update(tokens_per_rank=[0, 1]), "tokens_per_rank entry = 0; allowed: an integer >= 1"),
        (lambda r: r["suites"][0].update(operators=["gc", "magic"]), r"operator 'magic'; known operators: reference, gc"),
        (lambda r: r["models"][0].update(base="llama"), r"base = 'llama'; allowed: glm-5.2, deepseek-v4.1-flash"),
        (lambda r: r["models"][0].update(hidden=5000), r"hidden = 5000; allowed: a multiple of 128"),
        (lambda r: r["models"][0].update(topk=400), r"topk = 400 exceeds the 384 experts"),
        (lambda r: r["models"][0].update(expert_slice=5), r"expert_slice = 5 does not divide experts = 384"),
        (lambda r: r.update(ranks=5), r"384 experts, which 5 ranks cannot split evenly"),
        (lambda r: r["gate"].update(samples=2), r"samples = 2; allowed: >= 3"),
        (lambda r: r["gate"].update(span_s=5.0), r"span_s = 5.0; allowed: >= 10 seconds"),
        (lambda r: r.update(device="tpu"), r"device = 'tpu'; allowed: cuda, cpu"),
        (lambda r: r["suites"][1].update(shared_experts=2), r"shared_experts = 2; allowed: 0 \(routed\) or 1"),
        (lambda r: r.pop("models"), r"missing required key 'models'"),
        (lambda r: r["protocol"].update(replays_per_window=0), r"replays_per_window = 0; allowed: an integer >= 1"),
    ],
)
def test_invalid_profiles_name_the_field_and_what_is_allowed(mutate, message):
    raw = copy.deepcopy(raw_profile())
    mutate(raw)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(raw, source="h20.toml")


def test_unknown_profile_and_layout():
    with pytest.raises(ProfileError, match=r"no sweep profile .*available: .*b300.*cpu.*h20.*h200"):
        load_profile("a100")
    with pytest.raises(ProfileError, match=r"no layout 'sixteen'; available: default, eight-rank"):
        load_profile("h200", layout="sixteen")


def test_overrides_apply_and_validate():
    base = load_profile("h200")
    p = apply_overrides(base, models=["deepseek-v4.1-flash"], tokens=[64, 8], suites=["shared"], l2="rotate",
                        windows=5, warmup=1, replays=10, skip_gate=True)
    assert [m.name for m in p.models] == ["deepseek-v4.1-flash"] and p.models[0].num_experts == 48
    assert p.tokens_per_rank == (8, 64) and [s.name for s in p.suites] == ["shared"]
    assert (p.protocol.l2, p.protocol.measured_windows, p.protocol.warmup_windows, p.protocol.replays_per_window) == (
        "rotate", 5, 1, 10)
    assert p.skip_gate and not base.skip_gate  # the loaded profile is untouched
    with pytest.raises(ProfileError, match=r"--models 'mixtral' is not in profile 'h200'; allowed: glm-5.2, deepseek"):
        apply_overrides(base, models=["mixtral"])
    with pytest.raises(ProfileError, match=r"--suite \['fused'\] not in profile"):
        apply_overrides(base, suites=["fused"])
    with pytest.raises(ProfileError, match=r"tokens_per_rank \[300\] exceed"):
        apply_overrides(base, tokens=[300])
    with pytest.raises(ProfileError, match="l2 = 'warm'"):
        apply_overrides(base, l2="warm")


def test_resolved_profile_round_trips():
    for name in available_profiles():
        p = load_profile(name)
        recorded = json.loads(json.dumps(p.to_dict()))  # as env.json stores it
        assert profile_from_resolved(recorded) == p


def test_ablation_overrides_dispatch_request_overlap_and_operators():
    base = load_profile("h200")
    assert base.dispatch_sm_request == 4 and base.overlap == "on" and base.only_operators is None
    p = apply_overrides(base, dispatch_sms=8, overlap="off", operators=["gc", "gc"])
    assert p.dispatch_sm_request == 8 and p.overlap == "off" and p.only_operators == ("gc",)
    routed, shared = p.suites
    assert p.operators_of(routed) == ("gc",) and p.operators_of(shared) == ("gc",)  # the baseline is not named
    assert base.operators_of(routed) == routed.all_operators
    with_base = apply_overrides(base, operators=["gc", "mega-port"])
    assert with_base.operators_of(shared) == ("mega-port", "gc")  # the suite's order: baseline first
    with pytest.raises(ProfileError, match=r"--dispatch-sms 0; allowed: an integer >= 1"):
        apply_overrides(base, dispatch_sms=0)
    with pytest.raises(ProfileError, match=r"--overlap 'maybe'; allowed: on, off"):
        apply_overrides(base, overlap="maybe")
    with pytest.raises(ProfileError, match=r"--operators mega not in the suites routed, shared of profile 'h200'; "
                                           r"allowed: mega-port, gc, deepgemm, gc-unfused"):
        apply_overrides(base, operators=["gc", "mega"])
    with pytest.raises(ProfileError, match=r"suite 'routed' has none of them .*leave it out with --suite"):
        apply_overrides(base, operators=["gc-unfused"])
    assert apply_overrides(base, suites=["shared"], operators=["gc-unfused"]).only_operators == ("gc-unfused",)


def test_resolved_profile_with_ablation_settings_round_trips_and_old_records_get_defaults():
    p = apply_overrides(load_profile("h200"), dispatch_sms=16, overlap="off", operators=["gc"])
    recorded = json.loads(json.dumps(p.to_dict()))
    assert (recorded["dispatch_sm_request"], recorded["overlap"], recorded["only_operators"]) == (16, "off", ["gc"])
    assert profile_from_resolved(recorded) == p
    old = {k: v for k, v in recorded.items() if k not in ("overlap", "only_operators")}  # written before the switch
    again = profile_from_resolved(old)
    assert again.overlap == "on" and again.only_operators is None


def test_overlap_key_in_a_profile_file(tmp_path):
    text = (profiles_dir() / "cpu.toml").read_text()
    path = tmp_path / "off.toml"
    path.write_text('overlap = "off"\n' + text)
    assert load_profile(str(path)).overlap == "off"
    path.write_text('overlap = "sometimes"\n' + text)
    with pytest.raises(ProfileError, match="overlap = 'sometimes'; allowed: on, off"):
        load_profile(str(path))
