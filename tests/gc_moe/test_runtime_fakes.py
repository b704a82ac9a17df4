"""Runtime pieces that talk to the driver, checked against a fake driver (no GPU here)."""

import types

import pytest
from gc_moe.runtime import launch as launch_mod
from gc_moe.runtime.cubin import ParamSlot
from gc_moe.runtime.graph import graph_key
from gc_moe.runtime.jit import CacheEntry, KernelVariant, LaunchShape
from gc_moe.runtime.launch import LoadedKernel, ParamLayoutError, i32, i64, ptr


class FakeDriver:
    """Just enough of cuda.bindings.driver for LoadedKernel.from_entry: reports a given parameter layout."""

    def __init__(self, layout):
        self.layout = layout
        self.loaded = []

    def cuInit(self, flags):
        return (0,)

    def cuLibraryLoadData(self, image, *rest):
        self.loaded.append(image)
        return (0, "lib")

    def cuLibraryGetKernel(self, library, name):
        return (0, f"kernel:{name.decode()}")

    def cuKernelGetParamInfo(self, kernel, index):
        if index < len(self.layout):
            return (0, *self.layout[index])
        return (1, 0, 0)  # CUDA_ERROR_INVALID_VALUE past the last parameter


def fake_entry(tmp_path, params, sha="ab" * 32):
    variant = KernelVariant.make("fake.kernel", "gc_moe.kernels.sm90.ring_proof", "build_consumer")
    entry = CacheEntry(variant, "sm_90a", "k", "kernel_fake", sha, "cd" * 32, LaunchShape((128, 1, 1)),
                       [{"size": s, "align": s} for _, s in params], {"params": [list(p) for p in params]}, {},
                       tmp_path)
    entry.cubin = lambda: b"\x7fELF fake"  # the bytes are not read by the fake driver
    return entry


@pytest.fixture(autouse=True)
def fresh_library_cache(monkeypatch):
    monkeypatch.setattr(LoadedKernel, "_libraries", {})


def test_load_accepts_a_driver_layout_equal_to_the_recorded_one(tmp_path, monkeypatch):
    layout = [(0, 8), (8, 4), (16, 8)]
    driver = FakeDriver(layout)
    monkeypatch.setattr(launch_mod, "cu", driver)
    kernel = LoadedKernel.from_entry(fake_entry(tmp_path, layout))
    assert kernel.params == [ParamSlot(0, 8), ParamSlot(8, 4), ParamSlot(16, 8)]
    assert kernel.kernel == "kernel:kernel_fake" and len(driver.loaded) == 1
    kernel.pack([ptr(0x1000), i32(3), i64(-5)])
    with pytest.raises(ParamLayoutError, match="parameter 1: argument i64 is 8 bytes, the kernel expects 4"):
        kernel.pack([ptr(0x1000), i64(3), i64(-5)])


def test_load_fails_closed_when_the_driver_disagrees_with_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_mod, "cu", FakeDriver([(0, 8), (8, 8)]))
    with pytest.raises(ParamLayoutError, match="the cubin and its entry disagree"):
        LoadedKernel.from_entry(fake_entry(tmp_path, [(0, 8), (8, 4)]))


def test_graph_key_moves_with_arguments_grid_and_partition(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_mod, "cu", FakeDriver([(0, 8), (8, 4)]))
    k = LoadedKernel.from_entry(fake_entry(tmp_path, [(0, 8), (8, 4)]))
    base = graph_key([(k, 4, [ptr(0x1000), i32(7)])], {"comm_sms": 4})
    assert base == graph_key([(k, (4, 1, 1), [ptr(0x1000), i32(7)])], {"comm_sms": 4})
    assert base != graph_key([(k, 4, [ptr(0x1000), i32(8)])], {"comm_sms": 4})
    assert base != graph_key([(k, 8, [ptr(0x1000), i32(7)])], {"comm_sms": 4})
    assert base != graph_key([(k, 4, [ptr(0x1000), i32(7)])], {"comm_sms": 20})


def test_describe_environment_without_a_gpu_reports_instead_of_failing(monkeypatch, tmp_path):
    from gc_moe.runtime import describe_environment, driver

    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))

    def no_driver():
        raise driver.CudaDriverError("cuInit", types.SimpleNamespace(name="CUDA_ERROR_NO_DEVICE"))

    monkeypatch.setattr(driver, "driver_version", no_driver)
    env = describe_environment()
    assert env["driver_version"] is None and "CUDA_ERROR_NO_DEVICE" in env["device"]["error"]
    assert env["cache"]["dir"] == str(tmp_path) and env["cache"]["entries"] == {}
    assert env["supported_dsl"] == "4.8.1"
