"""The stream-read measuring kernel (kernels/sm90/stream_read.py): what its binaries hold offline, and on the GPU that
the static and the ticket-claimed reads each sum every chunk exactly once, launch after launch (the ticket back at
zero each time), with sane per-CTA times."""

import re

import pytest
from gc_moe.kernels.sm90 import stream_read as sr


def test_configuration_and_errors():
    with pytest.raises(TypeError, match="dynamic"):
        sr.variant("yes")
    with pytest.raises(ValueError, match="bytes, allowed >= 0"):
        sr.chunks_for(-1)
    assert sr.chunks_for(0) == 1 and sr.chunks_for(sr.CHUNK_BYTES) == 1 and sr.chunks_for(sr.CHUNK_BYTES + 1) == 2
    with pytest.raises(ValueError, match="work_cycles=7"):
        sr.variant(False, 7)
    forms = [(dict(v.params)["dynamic"], dict(v.params).get("work_cycles", 0)) for v in sr.read_variants()]
    assert forms == [(d, w) for w in sr.WORK_CHOICES for d in (False, True)]
    assert sr.CHUNK_BYTES % 16 == 0 and sr.STAGES * sr.CHUNK_BYTES <= 227 * 1024


def test_binaries_hold_what_they_time(tmp_path):
    pytest.importorskip("cutlass")
    from gc_moe.runtime import jit

    for v in sr.read_variants():
        entry = jit.build_variant(v, "sm_90a", cache_dir=tmp_path)
        ptx = entry.ptx_path.read_text()
        # every chunk through a bulk copy completing on its stage's barrier; the dynamic one's ticket: the first claim, the
        # claim ahead in the loop, and the count of CTAs done
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        atomics = len(re.findall(r"\batom\.", ptx))
        assert atomics == (3 if dict(v.params)["dynamic"] else 0), (v.describe(), atomics)
        assert ("%clock64" in ptx) == bool(dict(v.params).get("work_cycles")), v.describe()
        assert entry.resources["frame_bytes"] == 0
        assert entry.launch.block == (sr.LANES, 1, 1)
        assert entry.launch.dynamic_smem_bytes >= sr.STAGES * (sr.CHUNK_BYTES + 12)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("nbytes,work", [(1, 0), (5 * sr.CHUNK_BYTES + 7, 0), (37 << 20, 0),
                                         (37 << 20, max(sr.WORK_CHOICES))])
def test_every_chunk_read_once(dynamic, nbytes, work):
    import torch
    from gc_moe.runtime import jit
    from gc_moe.runtime.launch import i32, launch, ptr

    device = torch.device("cuda")
    torch.zeros(1, device=device)
    kernel = jit.load_kernel(sr.variant(dynamic, work), "sm_90a")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks = sr.chunks_for(nbytes)
    gen = torch.Generator(device=device).manual_seed(nbytes)
    source = torch.randint(-(1 << 31), 1 << 31, (chunks * sr.CHUNK_BYTES // 4 + 1024,), dtype=torch.int64,
                           device=device, generator=gen).to(torch.int32)
    source[chunks * sr.CHUNK_BYTES // 4:] = 0x7FFFFFFF  # past the chunks: a read beyond them shows in the sum
    expected = int(source[: chunks * sr.CHUNK_BYTES // 4].to(torch.int64).sum().item()) & 0xFFFFFFFF
    ticket = torch.zeros(sr.TICKET_WORDS, dtype=torch.int32, device=device)
    for launch_no in range(3):  # the ticket must come back to zero for the next launch
        out = torch.full((sms * sr.LANES,), -1, dtype=torch.int32, device=device)
        times = torch.zeros(sms * 2, dtype=torch.int64, device=device)
        launch(kernel, (sms, 1, 1), [ptr(source), i32(chunks), ptr(ticket), ptr(out), ptr(times)],
               torch.cuda.current_stream())
        torch.cuda.synchronize()
        got = int(out.to(torch.int64).sum().item()) & 0xFFFFFFFF
        assert got == expected, (launch_no, hex(got), hex(expected))
        assert ticket.tolist() == [0] * sr.TICKET_WORDS, launch_no
        t = times.view(sms, 2).cpu()
        assert bool((t[:, 0] > 0).all()) and bool((t[:, 1] >= t[:, 0]).all())
