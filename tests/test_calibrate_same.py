"""calibrate's probes for colocated receivers (placement same: packed tasks written in place,
small zero-copy tasks copied by batched copies, as on one GPU), run on the CPU with the
direct seams emulated as in tests/test_direct.py: every probe runs the kinds it is meant to,
and one fit over all of them measures every host column, well separated (the copy tasks' column
from samples of copies between engine writes, not only from the push's tail)."""

import pytest

from wxfer import _wxfer

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")


@pytest.fixture
def emulated(monkeypatch):
    """Direct writes and copies into the live receivers' memory (no cuda_ipc mapping)."""
    import torch

    from wxfer.runtime import receiver as rmod
    from wxfer.runtime.inplace import InPlaceWriter

    live = []
    init = rmod.Receiver.__init__

    def wrapped(self, *a, **kw):
        init(self, *a, **kw)
        live.append(self)

    def regions():
        out = {d: t for r in live for d, t in r.region_base.items()}
        # the stamps too (WXFER_BEGIN_WAIT=stream writes the begin stamps in place)
        for r in live:
            try:
                out[bytes(r.stamp_region.descriptor)] = r.stamps.view(torch.uint8)
            except ValueError:  # (a receiver of an earlier probe, closed)
                pass
        return out

    def fake_map(self, rdesc, off, nb):
        t = regions()[bytes(rdesc)]
        assert 0 <= off and off + nb <= t.numel(), (off, nb)
        return t.data_ptr() + off, self.device.index

    monkeypatch.setattr(rmod.Receiver, "__init__", wrapped)
    monkeypatch.setattr(InPlaceWriter, "off", lambda self: None if self.enabled else "off")
    monkeypatch.setattr(InPlaceWriter, "_map", fake_map)
    monkeypatch.setattr(InPlaceWriter, "_tensor", lambda self, a, n: {t.data_ptr(): t for t in regions().values()}[a])
    return live


@pytest.mark.timeout(240)
def test_colocated_probes_measure_every_host_column(emulated):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from wxfer.zerocopy import ZERO_COPY_BATCH
    from wxfer.runtime import control, hostfit
    from wxfer.tools.calibrate_host import designs_for, probe

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    port = control.free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    addr = "127.0.0.1:%d" % port
    designs, kinds = [], {}
    for d in designs_for(dev, "same", quick=True):
        got, summ = probe(d, dev, dev, "auto", addr, 3, {})
        designs.append(got)
        kinds[d["name"]] = summ["kinds"]
    del store
    # each probe ran the runtime's own kinds: in place (direct), copied, engine zero copy, packed
    assert set(kinds["bf16"]) == {"copy"} and "direct" in kinds["fp8"] and "direct" in kinds["fp8-tp2-fine"]
    assert set(kinds["bf16-nocopy"]) == {"zero_copy"}, kinds
    assert set(kinds["bf16-mixed"]) == {"copy", "zero_copy"}, kinds  # copies between engine writes
    assert "packed" in kinds["fp8-packed"] and "packed" in kinds["fp8-tp2-fine-packed"], kinds
    out = hostfit.fit_designs(designs, ZERO_COPY_BATCH, 2.0)
    cols = set(hostfit.COLUMNS) - {"barrier_s"}
    assert set(out["host_unmeasured"]) == {"barrier_s"}, out["host_unmeasured"]
    assert cols <= set(out), sorted(cols - set(out))
    cond = out["host_conditioning"]
    assert cond["condition"] < 1e3 and set(cond["samples"]) == cols, cond
    assert out["host_direct_task_s"] > 0 and out["host_copy_task_s"] > 0 and out["push_end_s"] > 0
