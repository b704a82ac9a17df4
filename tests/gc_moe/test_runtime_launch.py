import struct

import pytest
from gc_moe.runtime.cubin import ParamSlot
from gc_moe.runtime.launch import (
    ParamBuffer,
    ParamLayoutError,
    TiledTensorMapSpec,
    check_param_layout,
    f32,
    i32,
    i64,
    natural_layout,
    ptr,
    raw,
    u32,
)
from gc_moe.runtime.workspace import PEER_DESCRIPTOR_BYTES, Region, WorkspaceLayout, peer_descriptor

# the consumer proof kernel's layout as cuKernelGetParamInfo reported it on the H200 (4 pointers, 2 i32, i64, i32)
CONSUMER_SLOTS = [ParamSlot(0, 8), ParamSlot(8, 8), ParamSlot(16, 8), ParamSlot(24, 8), ParamSlot(32, 4),
                  ParamSlot(36, 4), ParamSlot(40, 8), ParamSlot(48, 4)]


def test_matching_arguments_pack_at_the_driver_offsets():
    args = [ptr(0x7F0000001000 + 256 * i) for i in range(4)] + [i32(64), i32(4096), i64(20_000_000), i32(1)]
    check_param_layout(args, CONSUMER_SLOTS, "consumer")
    buf = ParamBuffer(args, CONSUMER_SLOTS)
    import ctypes

    blob = ctypes.string_at(buf.base, 52)
    assert struct.unpack_from("<4Q", blob, 0) == tuple(0x7F0000001000 + 256 * i for i in range(4))
    assert struct.unpack_from("<iiqi", blob, 32) == (64, 4096, 20_000_000, 1)


def test_a_narrow_integer_where_a_wide_one_goes_is_refused():
    args = [ptr(16)] * 4 + [i32(1), i32(1), i32(5), i32(0)]
    with pytest.raises(ParamLayoutError, match="parameter 6: argument i32 is 4 bytes, the kernel expects 8"):
        check_param_layout(args, CONSUMER_SLOTS, "consumer")


def test_wrong_count_and_shifted_offsets_are_refused():
    with pytest.raises(ParamLayoutError, match="takes 8 parameters, got 7"):
        check_param_layout([ptr(16)] * 4 + [i32(1), i32(1), i64(5)], CONSUMER_SLOTS)
    # a 4-byte value before a pointer: the pointer lands at 8 by alignment; a kernel reading it at 4 is refused
    with pytest.raises(ParamLayoutError, match="sits at byte 8|would sit at byte 8"):
        check_param_layout([u32(1), ptr(16)], [ParamSlot(0, 4), ParamSlot(4, 8)])


def test_natural_layout_follows_alignment():
    tmap = raw(bytes(128), 64)
    slots = natural_layout([i32(1), tmap, f32(1.0), raw(bytes(592), 8)])
    assert slots == [ParamSlot(0, 4), ParamSlot(64, 128), ParamSlot(192, 4), ParamSlot(200, 592)]


def test_tensor_arguments_need_explicit_widths():
    from gc_moe.runtime.launch import as_kernel_arg

    with pytest.raises(TypeError, match="say its width explicitly"):
        as_kernel_arg(5)


@pytest.mark.parametrize("kwargs,message", [
    ({"address": 8}, "not 16-byte aligned"),
    ({"dims": (128, 256, 1, 1, 1, 1), "strides_bytes": (256, 256, 256, 256, 256), "box": (64,) * 6}, "rank 1..5"),
    ({"strides_bytes": (250,)}, "multiple of 16"),
    ({"box": (64, 300)}, "outside 1..256"),
    ({"box": (4, 64)}, "not a multiple of 16 bytes"),
    ({"box": (128, 64)}, "exceeds the 128B swizzle span"),
    ({"dtype": "float4"}, "unsupported"),
])
def test_tma_spec_validation_names_the_broken_constraint(kwargs, message):
    base = {"dtype": "bfloat16", "address": 0x7F0000000000, "dims": (128, 256), "strides_bytes": (256,), "box": (64, 64)}
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        TiledTensorMapSpec(**base).validate()


def test_valid_tma_spec_passes():
    TiledTensorMapSpec("bfloat16", 0x7F0000000000, (128, 256), (256,), (64, 64)).validate()
    TiledTensorMapSpec("float8_e4m3fn", 0x7F0000000000, (7168, 256, 8), (7168, 7168 * 256), (128, 16, 1)).validate()


def test_peer_descriptor_is_592_bytes_with_offsets_and_rank():
    bases = [0x7F0000000000, 0x7E0000000000, 0x7F8000000000]
    blob = peer_descriptor(bases[1], bases, rank=1)
    assert len(blob) == PEER_DESCRIPTOR_BYTES == 592
    base, *rest = struct.unpack("<Q72qq", blob)
    offsets, rank = rest[:72], rest[72]
    assert base == bases[1] and rank == 1
    assert [base + o for o in offsets[:3]] == bases and offsets[3:] == [0] * 69
    with pytest.raises(ValueError, match="not this rank's base"):
        peer_descriptor(bases[0], bases, rank=1)
    with pytest.raises(ValueError, match="1..72"):
        peer_descriptor(0, [0] * 73, rank=0)


def test_workspace_layout_aligns_regions_and_rejects_duplicates():
    layout = WorkspaceLayout([Region("x", "float8_e4m3fn", (3, 100)), Region("topk_idx", "int64", (3, 8)),
                              Region("signals", "int32", (5,))])
    assert layout.offsets == {"x": 0, "topk_idx": 1024, "signals": 2048}
    assert layout.total_bytes == 3072
    assert [r["bytes"] for r in layout.table()] == [300, 192, 20]
    with pytest.raises(ValueError, match="repeated"):
        WorkspaceLayout([Region("a", "int32", (1,)), Region("a", "int32", (2,))])
    with pytest.raises(ValueError, match="dtype 'complex64' unsupported"):
        WorkspaceLayout([Region("a", "complex64", (1,))])
