"""Offline build (no GPU): every registered sm_90a kernel compiles, keeps its promises, and the cache behaves."""

import json
import shutil
import subprocess

import pytest
from gc_moe.kernels.registry import RING_PROOF_CONSUMER, variants_for_profile
from gc_moe.runtime import cubin, jit


def test_lookup_key_is_stable_and_moves_with_what_decides_the_binary():
    key = jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a")
    assert key == jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a")
    assert key != jit.lookup_key(RING_PROOF_CONSUMER, "sm_100a")
    with_param = jit.KernelVariant.make(RING_PROOF_CONSUMER.name, RING_PROOF_CONSUMER.module,
                                        RING_PROOF_CONSUMER.builder, {"block_m": 16})
    assert jit.lookup_key(with_param, "sm_90a") != key
    assert "kernels/sm90/ring_proof.py" in [p.relative_to(jit._PACKAGE_ROOT).as_posix()
                                            for p in jit.source_files(RING_PROOF_CONSUMER)]


def test_source_edit_changes_the_key(tmp_path, monkeypatch):
    pkg = tmp_path / "gc_moe"
    shutil.copytree(jit._PACKAGE_ROOT / "kernels", pkg / "kernels")
    monkeypatch.setattr(jit, "_PACKAGE_ROOT", pkg)
    before = jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a")
    with open(pkg / "kernels" / "common" / "signals.py", "a") as f:
        f.write("\n# an edit\n")
    assert jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a") != before


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="unknown arch 'sm_90'"):
        jit.lookup_key(RING_PROOF_CONSUMER, "sm_90")


def test_missing_entry_without_the_dsl_names_kernel_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "dsl_available", lambda: False)
    with pytest.raises(jit.KernelNotBuiltError) as err:
        jit.get_entry(RING_PROOF_CONSUMER, "sm_90a", cache_dir=tmp_path)
    message = str(err.value)
    assert "ring_proof.consumer" in message and "gcmoe-bench build --arch sm_90a" in message
    assert str(tmp_path) in message


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    cache = tmp_path_factory.mktemp("cubin-cache")
    rows = jit.build_profile("sm_90a", {}, cache_dir=cache)
    return cache, rows


def test_build_profile_fills_the_cache_and_reuses_it(built):
    cache, rows = built
    names = {v.describe() for v in variants_for_profile("sm_90a", {})}
    assert {r["kernel"] for r in rows} == names and len(rows) == len(names)
    again = jit.build_profile("sm_90a", {}, cache_dir=cache)
    assert all(r["cached"] for r in again)
    assert [r["cubin_sha256"] for r in again] == [r["cubin_sha256"] for r in rows]
    assert jit.cache_state(cache)["entries"] == {"sm_90a": len(names)}


def test_every_entry_keeps_its_promises_and_layout(built):
    cache, _ = built
    for variant in variants_for_profile("sm_90a", {}):
        entry = jit.find_entry(variant, "sm_90a", cache)
        assert entry is not None, variant.name
        assert jit.check_promises(entry) == [], variant.name
        data = entry.cubin()
        assert data[:4] == b"\x7fELF"
        res = cubin.read_cubin_resources(data)[entry.entry_name]
        ptx = cubin.ptx_entries(entry.ptx())[entry.entry_name]
        # cubin parameter slots: sizes as declared in the PTX, offsets naturally aligned and increasing
        assert [p.size for p in res.params] == [p.size for p in ptx]
        offset = 0
        for slot, decl in zip(res.params, ptx):
            offset = (offset + decl.align - 1) // decl.align * decl.align
            assert slot.offset == offset
            offset += decl.size
        assert res.param_bytes == offset
        assert res.frame_bytes <= variant.local_bytes_budget
        assert tuple(res.required_block) == entry.launch.block


def test_broken_promise_is_reported(built):
    cache, _ = built
    entry = jit.find_entry(RING_PROOF_CONSUMER, "sm_90a", cache)
    entry.variant = jit.KernelVariant.make("fake", entry.variant.module, entry.variant.builder,
                                           promises=("wgmma.mma_async",), local_bytes_budget=0)
    assert jit.check_promises(entry) == ["fake: PTX has no 'wgmma.mma_async' instruction"]
    entry.resources = dict(entry.resources, frame_bytes=64)
    assert any("64 bytes of local memory" in p for p in jit.check_promises(entry))


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no system ptxas to cross-check against")
def test_cubin_reader_agrees_with_ptxas(built, tmp_path):
    cache, _ = built
    entry = jit.find_entry(RING_PROOF_CONSUMER, "sm_90a", cache)
    out = subprocess.run(["ptxas", "-v", "-arch=sm_90a", str(entry.ptx_path), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    regs = int(out.split("Used ")[1].split(" registers")[0])
    frame = int(out.split(" bytes stack frame")[0].rsplit("\n", 1)[-1].strip())
    res = cubin.read_cubin_resources((tmp_path / "k.cubin").read_bytes())[entry.entry_name]
    assert (res.registers, res.frame_bytes) == (regs, frame)


def test_entry_json_round_trips(built):
    cache, _ = built
    entry = jit.find_entry(RING_PROOF_CONSUMER, "sm_90a", cache)
    again = jit.CacheEntry.from_json(json.loads(json.dumps(entry.to_json())), cache)
    assert again.to_json() == entry.to_json()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no system ptxas")
def test_system_ptxas_path_is_keyed_and_recorded(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    dsl_key = jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a")
    monkeypatch.setenv("GC_MOE_PTXAS", "ptxas")
    assert jit.lookup_key(RING_PROOF_CONSUMER, "sm_90a") != dsl_key
    entry = jit.build_variant(RING_PROOF_CONSUMER, "sm_90a", cache_dir=tmp_path)
    assert entry.identity["assembler"]["version"].startswith("Build cuda_")
    assert entry.cubin()[:4] == b"\x7fELF" and jit.check_promises(entry) == []
    assert jit.find_entry(RING_PROOF_CONSUMER, "sm_90a", tmp_path).cubin_sha256 == entry.cubin_sha256
