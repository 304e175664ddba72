"""External engine tasks finished by a real CUDA event (marker `gpu`; skips without one): an
in-place write -- a copy kernel into a receiver's memory that the cuda_ipc transport mapped
on the writer's GPU, behind a long sleep kernel on a side stream -- handed to the engine as
Engine.submit_external(..., event=torch.cuda.Event), then a fence (the end stamps' case).
The engine's progress thread polls the event with cuEventQuery (dlopened libcuda) and never
blocks on it; the fence is posted only after the event completed. The CPU side of the same
task kind (host signals, failed peers, deadlines): tests/test_external.py."""

import time

import pytest

torch = pytest.importorskip("torch")
from wxfer import _wxfer  # noqa: E402


from helpers import gpu_count  # noqa: E402 -- tests/helpers.py

needs_gpu = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")
SLEEP_CYCLES = int(1e9)  # torch.cuda._sleep: about 0.5 s at 2 GHz


class _Mapped:
    """Device memory at `addr` that torch does not own, as torch.as_tensor takes it."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def _transport():
    ok, why = _wxfer.backends().get("cuda_ipc", (False, "not compiled into this build"))
    assert ok, "a GPU is present but the cuda_ipc backend is unavailable: %s" % why
    return _wxfer.Transport("cuda_ipc", {"device": "0"})


def _colocated(nbytes: int):
    """(receiver transport, its regions (data, stamps), their memory, writer transport, the data
    region's view as mapped by the writer) on GPU 0."""
    torch.cuda.set_device(0)
    rx = _transport()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    stamps = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    regions = (rx.register(dst, export=True), rx.register(stamps, export=True))
    tx = _transport()
    peer, _ = tx.connect_request(rx.export())
    tx.connect_finish(peer, b"")
    addr, dev = tx.map(regions[0].descriptor, 0, nbytes)
    assert dev == 0
    view = torch.as_tensor(_Mapped(addr, nbytes), device="cuda:0")
    assert view.data_ptr() == addr
    return rx, regions, (dst, stamps), tx, view


@pytest.mark.gpu
@needs_gpu
def test_an_in_place_kernel_is_an_engine_task_finished_by_its_cuda_event():
    n = 8 << 20
    rx, (r, rs), (dst, stamps), tx, view = _colocated(n)
    eng = _wxfer.Engine(tx, timeout=30)
    try:
        src = torch.full((n,), 9, dtype=torch.uint8, device="cuda:0")
        stamp_src = torch.full((8,), 5, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        side, ev = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            view.copy_(src)  # the in-place write, straight into the receiver's memory
            ev.record(side)
        x = eng.submit_external([(r.descriptor, 0, 0, n)], event=ev, device=0, tag=11)
        f = eng.submit(stamp_src, [(rs.descriptor, 0, 0, 8)], tag=12, fence=True)
        assert not ev.query()  # still sleeping: the engine was handed it unfinished
        with pytest.raises(_wxfer.Error, match="still in flight"):
            eng.wait(timeout=0.05, fence=f)
        # (not read on the device here: a read on another stream may queue behind the side
        # stream's sleep in a hardware queue they share; the trace below says the fence's write
        # was posted only after the external task finished: t_post_first >= t_done)
        eng.wait(timeout=30, fence=f)
        assert ev.query()
        eng.wait(timeout=30)
        torch.cuda.synchronize()
        assert int(dst.min()) == int(dst.max()) == 9 and stamps[:8].tolist() == [5] * 8
        recs = {rec["tag"]: rec for rec in eng.trace()}
        rx_, rf = recs[11], recs[12]
        assert rx_["id"] == x and rx_["kind"] == "external" and rf["kind"] == "write"
        assert (rx_["status"], rx_["bytes"], rx_["nwrites"]) == (0, n, 1)
        assert rx_["t_ready"] - rx_["t_submit"] > 50_000_000  # it waited for the sleep kernel
        assert rf["t_post_first"] >= rx_["t_done"]
        assert eng.stats()["bytes_external"] == n
        assert eng.complete_external(x) is False  # finished
    finally:
        eng.close()
        tx.close()
        rx.close()


@pytest.mark.gpu
@needs_gpu
def test_many_external_tasks_share_one_event_of_a_batched_launch():
    """The batched copies' case: one launch writes many tasks' bytes, one event recorded after
    it, one external task per plan task (each its own trace record and tag); the event object
    is kept alive by the engine until the tasks are reaped."""
    import sys

    k, each = 64, 4096
    rx, (r, rs), (dst, stamps), tx, view = _colocated(k * each)
    eng = _wxfer.Engine(tx, timeout=30)
    try:
        src = torch.arange(k * each, device="cuda:0").to(torch.uint8)
        torch.cuda.synchronize()
        side, ev = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            view.copy_(src)
            ev.record(side)
        base = sys.getrefcount(ev)
        ids = [eng.submit_external([(r.descriptor, i * each, 0, each)], event=ev, device=0, tag=i) for i in range(k)]
        assert sys.getrefcount(ev) == base + k
        t0 = time.monotonic()
        eng.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
        recs = [rec for rec in eng.trace() if rec["kind"] == "external"]
        assert sorted(rec["id"] for rec in recs) == ids and all(rec["status"] == 0 for rec in recs)
        eng.reap()
        assert sys.getrefcount(ev) == base
    finally:
        eng.close()
        tx.close()
        rx.close()
