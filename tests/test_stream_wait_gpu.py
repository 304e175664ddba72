"""The begin stamps' device wait (issue 37; marker `gpu`, skips without one): a side stream
waits with cuStreamWaitValue32 (``_wxfer.stream_wait``) for a word in pinned host memory that
the engine stores each finished fence's id into (``Engine.fence_word``); the host goes on at
once.  Checked: the stream does not run past the wait before the word says so (host-set and
cyclic across 2^32), and with a real cuda_ipc engine the in-place copy queued behind the wait
lands after the fence's stamp was written; a receiver whose begin stamp is late is not written
before the engine fenced it.  The CPU half (the word's values):
tests/test_engine.py::test_fence_word_mirrors_each_finished_fence_and_is_released_at_close and
::test_fence_word_is_held_while_a_peer_whose_fence_write_did_not_land_is_not_fenced,
tests/test_verbs.py::test_python_fence_word_goes_on_once_the_peer_whose_fence_write_was_abandoned_is_fenced.
The default order since (``WXFER_BEGIN_WAIT=stream``): the begin stamp written on the side stream
ahead of the in-place copy, with no wait on the fence word, which the engine's error holds."""

import ctypes
import time

import pytest

torch = pytest.importorskip("torch")
from wxfer import _wxfer  # noqa: E402

from helpers import gpu_count  # noqa: E402 -- tests/helpers.py

needs_gpu = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")


def _word(value: int):
    w = torch.zeros(1, dtype=torch.int32).pin_memory()
    ctypes.c_uint32.from_address(w.data_ptr()).value = value
    dev, why = _wxfer.stream_wait_addr(0, w.data_ptr())
    assert dev, f"the device wait is unavailable on this GPU: {why}"
    return w, dev


def _set(w, value: int) -> None:
    ctypes.c_uint32.from_address(w.data_ptr()).value = value & 0xFFFFFFFF


def _done_within(ev, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ev.query():
            return True
        time.sleep(0.001)
    return False


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("start,wait_for,release", [(0, 5, 5), (0xFFFFFFFF, 2, 3)])
def test_a_stream_waits_on_the_device_until_the_word_reaches_the_value(start, wait_for, release):
    """(0xFFFFFFFF, 2): the comparison is cyclic, so a word that wrapped past 2^32 still counts."""
    torch.cuda.set_device(0)
    w, dev = _word(start)
    x = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    seen = torch.zeros(8, dtype=torch.uint8).pin_memory()  # read by the host with no CUDA call
    side, ev = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(side):
        _wxfer.stream_wait(0, side.cuda_stream, dev, wait_for)
        x.fill_(7)
        seen.copy_(x[:8], non_blocking=True)
        ev.record(side)
    assert time.perf_counter() - t < 0.05  # the host did not wait
    time.sleep(0.1)
    # blocked on the device.  Nothing is read on another stream while the side stream waits: a
    # read there may queue behind the wait in a hardware queue the streams share (it hung here)
    assert not ev.query() and seen.tolist() == [0] * 8
    _set(w, release)
    assert _done_within(ev, 10.0), "the stream did not go on once the word was set"
    assert seen.tolist() == [7] * 8 and int(x.min()) == 7


@pytest.mark.gpu
@needs_gpu
def test_unpinned_memory_is_refused_with_a_reason():
    buf = ctypes.c_uint32(0)
    dev, why = _wxfer.stream_wait_addr(0, ctypes.addressof(buf))
    assert dev == 0 and "pinned" in why


@pytest.mark.gpu
@needs_gpu
def test_an_in_place_copy_behind_the_device_wait_lands_after_the_begin_fence():
    """The Sender's order with a real engine: the begin stamps' fence submitted and posted, the
    side stream told to wait for its id, the in-place copy queued at once; the copy's bytes are
    there only with the fence finished (its stamp written), and the host waited for the post
    only."""
    from test_external_gpu import _colocated

    n = 8 << 20
    rx, (r, rs), (dst, stamps), tx, view = _colocated(n)
    eng = _wxfer.Engine(tx, timeout=30)
    w, dev = _word(0)
    eng.fence_word(w.data_ptr(), w)
    try:
        src = torch.full((n,), 9, dtype=torch.uint8, device="cuda:0")
        stamp_src = torch.full((8,), 5, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        side, ev = torch.cuda.Stream(), torch.cuda.Event()
        for step in range(3):
            fid = eng.submit(stamp_src, [(rs.descriptor, 0, 0, 8)], tag=100 + step, fence=True)
            t = time.perf_counter()
            eng.wait(timeout=30, fence=fid, posted=True)  # its copy enqueued ahead of the wait
            with torch.cuda.stream(side):
                _wxfer.stream_wait(0, side.cuda_stream, dev, fid & 0xFFFFFFFF)
                view.copy_(src)
                ev.record(side)
            assert time.perf_counter() - t < 0.05
            x = eng.submit_external([(r.descriptor, 0, 0, n)], event=ev, device=0, tag=200 + step)
            eng.wait(timeout=30)
            assert eng.complete_external(x) is False
            recs = {rec["tag"]: rec for rec in eng.trace()}
            assert recs[200 + step]["t_done"] >= recs[100 + step]["t_done"]
            assert ctypes.c_uint32.from_address(w.data_ptr()).value == fid & 0xFFFFFFFF
            torch.cuda.synchronize()
            assert int(dst.min()) == 9 and stamps[:8].tolist() == [5] * 8
            dst.zero_()
            torch.cuda.synchronize()
    finally:
        eng.close()
        tx.close()
        rx.close()


def _receiver(nbytes: int):
    """A receiver on GPU 0: (its transport, its data and stamps regions, their memory)."""
    from test_external_gpu import _transport

    rx = _transport()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    stamps = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    return rx, (rx.register(dst, export=True), rx.register(stamps, export=True)), (dst, stamps)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not _wxfer.TESTING, reason="_test_late_peer is compiled only into WXFER_TESTING=1 builds")
@pytest.mark.parametrize("late_ms,fenced", [(1400, True), (3000, False)])
def test_a_receiver_whose_begin_stamp_is_late_is_not_written_before_it_is_fenced(late_ms, fenced):
    """The hazard the fence word guards (docs/cuda_ipc.md): the begin stamps' fence to two
    receivers, the second one's copy reported late (TEST ONLY _test_late_peer: its completion
    comes late_ms after its post; the bytes land as queued), the engine's timeout 1 s. The
    fence finishes at that receiver's deadline (it fails alone); the in-place copy into its
    memory, queued behind the device wait before the host could see the failure, must not run
    until the engine has fenced it: fenced in time (1.4 s < the deadline plus half the timeout)
    the word goes on, its late stamp is there (a reader reads torn: begin != end); not fenced
    (3 s), the word is held (``Engine.word_state`` names b) until b's abandoned copy has
    completed, then goes on."""
    from test_external_gpu import _Mapped

    torch.cuda.set_device(0)
    n = 8 << 20
    rxa, (ra, rsa), (_, stamps_a) = _receiver(n)
    rxb, (rb, rsb), (dst_b, stamps_b) = _receiver(n)
    assert ra is not None  # (its regions kept registered while the test runs)
    tx = _wxfer.Transport("cuda_ipc", {"device": "0", "_test_late_peer": "1", "_test_late_ms": str(late_ms)})
    for rx in (rxa, rxb):
        peer, _ = tx.connect_request(rx.export())
        tx.connect_finish(peer, b"")
    addr, _ = tx.map(rb.descriptor, 0, n)
    view_b = torch.as_tensor(_Mapped(addr, n), device="cuda:0")
    eng = _wxfer.Engine(tx, timeout=1.0, isolate=True)
    w, dev = _word(0)
    eng.fence_word(w.data_ptr(), w)
    word = ctypes.c_uint32.from_address(w.data_ptr())
    try:
        src = torch.full((n,), 9, dtype=torch.uint8, device="cuda:0")
        stamp_src = torch.full((8,), 5, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        side, ev = torch.cuda.Stream(), torch.cuda.Event()
        fid = eng.submit(stamp_src, [(rsa.descriptor, 0, 0, 8), (rsb.descriptor, 0, 0, 8)], tag=100, fence=True)
        eng.wait(timeout=30, fence=fid, posted=True)
        assert eng.failed_peers() == []  # the host sees no failure: it writes receiver b
        seen = torch.zeros(8, dtype=torch.uint8).pin_memory()
        with torch.cuda.stream(side):
            _wxfer.stream_wait(0, side.cuda_stream, dev, fid & 0xFFFFFFFF)
            view_b.copy_(src)
            seen.copy_(view_b[:8], non_blocking=True)
            ev.record(side)
        t0 = time.monotonic()
        eng.wait(timeout=30, fence=fid)  # finished at b's deadline, b failed alone
        assert 0.8 < time.monotonic() - t0 < late_ms / 1e3, time.monotonic() - t0
        [fl] = eng.failed_peers()
        assert fl.peer == 1 and fl.stage == "deadline", str(fl)
        time.sleep(0.1)
        assert word.value != fid & 0xFFFFFFFF and not ev.query()  # (was: released, b written)
        assert seen.tolist() == [0] * 8  # (read from pinned memory: no CUDA call while side waits)
        eng.wait(timeout=30)  # b's fence done (in time or not)
        [fl] = eng.failed_peers()
        if fenced:
            assert "fenced before giving up" in fl.reason, fl.reason
            assert _done_within(ev, 10.0), "the word was not released once b was fenced"
            assert word.value == fid & 0xFFFFFFFF
            torch.cuda.synchronize()
            assert stamps_b[:8].tolist() == [5] * 8  # its late begin stamp: a reader reads torn
            assert int(dst_b.min()) == 9
        else:
            assert "NOT fenced" in fl.reason, fl.reason
            time.sleep(0.1)
            assert not ev.query() and word.value != fid & 0xFFFFFFFF  # held while its copy is out
            held = eng.word_state()
            assert held is not None and held[0] == 1, held  # for b (a push now waits on the host)
            # its late copy completes at late_ms: nothing of it lands later, the word goes on
            # (it used to stay held until the close: every later device wait hung)
            assert _done_within(ev, 10.0), "the word was not released once b's abandoned copy completed"
            assert word.value == fid & 0xFFFFFFFF and eng.word_state() is None
            assert "abandoned writes have all completed" in eng.failed_peers()[0].reason
            torch.cuda.synchronize()
            assert int(dst_b.min()) == 9
        assert stamps_a[:8].tolist() == [5] * 8
    finally:
        eng.close()
        assert word.value == (fid + 1) & 0xFFFFFFFF  # past every task: the stream goes on
        assert _done_within(ev, 10.0)
        tx.close()
        rxa.close()
        rxb.close()


@pytest.mark.gpu
@needs_gpu
def test_a_retired_word_is_kept_until_the_streams_that_waited_on_it_have_passed():
    """The Sender's close (TaskRunner.close -> tasks.retire_word): the word's pinned memory is
    not freed while a stream's queued cuStreamWaitValue32 may still read it."""
    import weakref

    from wxfer.runtime import tasks

    torch.cuda.set_device(0)
    w, dev = _word(0)
    addr, ref = w.data_ptr(), weakref.ref(w)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _wxfer.stream_wait(0, side.cuda_stream, dev, 5)
    tasks.retire_word(w, [side])
    del w
    tasks.retire_word(None, ())
    assert ref() is not None  # the stream still waits on it
    ctypes.c_uint32.from_address(addr).value = 5  # (the engine's stop sets it past every id)
    side.synchronize()
    tasks.retire_word(None, ())
    assert ref() is None  # passed: let go


@pytest.mark.gpu
@needs_gpu
def test_stream_order_stamps_ahead_of_the_in_place_copy_and_never_waits_on_a_held_word():
    """WXFER_BEGIN_WAIT=stream (the default): ``InPlaceWriter.stamp_begin`` maps the receiver's
    begin stamp through the real cuda_ipc transport and fills it on the side stream, ahead of
    the in-place copy queued after it; the host does not wait.  The engine's sticky error holds
    its fence word until close (the case that stalled the device wait's stream until
    ``Sender.close()``): the side stream's stamp and copy run anyway, within a bound, while
    the word is still held.  The side stream is first held by a test word of its own, so that
    nothing has run when the host returns: then neither the stamp nor the copy is there."""
    from types import SimpleNamespace

    from test_external_gpu import _colocated

    from wxfer.runtime.inplace import InPlaceWriter

    n = 8 << 20
    rx, (r, rs), (dst, stamps), tx, view = _colocated(n)
    eng = _wxfer.Engine(tx, timeout=0.5)
    w, _ = _word(0)
    eng.fence_word(w.data_ptr(), w)
    side = torch.cuda.Stream()
    links = SimpleNamespace(on_adopt=[], skipped=lambda e: frozenset(), gpu_of_region={})
    ip = InPlaceWriter(True, 1 << 20, torch.device("cuda", 0), side, tx, "cuda_ipc", eng, links)
    try:
        stamp_src = torch.full((8,), 5, dtype=torch.uint8, device="cuda:0")
        eng.submit_external([(r.descriptor, 0, 0, 64)], tag=5)  # never signalled: the engine's error
        f = eng.submit(stamp_src, [(rs.descriptor, 0, 0, 8)], fence=True)
        with pytest.raises(Exception, match="deadline"):
            eng.wait(timeout=20, fence=f)
        end = time.monotonic() + 10
        while eng.word_state() is None and time.monotonic() < end:
            time.sleep(0.01)
        assert eng.word_state() is not None and eng.word_state()[0] is None  # held until close
        eng.clear_error()
        src = torch.full((n,), 9, dtype=torch.uint8, device="cuda:0")
        dest = (rs.descriptor, 8, 0, 8)
        with torch.cuda.stream(side):
            assert ip.stamp_begin({0: dest}, 1) is None  # (the stamp mapped: not while held below)
        torch.cuda.synchronize()
        assert stamps[8:16].view(torch.int64).item() == 1
        # read by the host with no CUDA call: nothing is read on another stream while the side
        # stream is held (a read there may queue behind the hold in a hardware queue they share)
        probe = torch.zeros(2, dtype=torch.int64).pin_memory()
        for version in (7, 8):
            hold, hdev = _word(0)
            ev = torch.cuda.Event()
            probe.zero_()
            with torch.cuda.stream(side):
                _wxfer.stream_wait(0, side.cuda_stream, hdev, 1)  # the test's own hold
                t = time.perf_counter()
                assert ip.stamp_begin({0: dest}, version) is None
                probe[:1].copy_(ip.stamp_views[0][1], non_blocking=True)  # the stamp at this point
                view.copy_(src)
                probe[1:].view(torch.uint8)[:8].copy_(view[:8], non_blocking=True)
                ev.record(side)
                took = time.perf_counter() - t
            assert took < 0.05, took  # the host did not wait
            time.sleep(0.05)
            assert not ev.query() and probe.tolist() == [0, 0]  # nothing ran before the release
            _set(hold, 1)
            assert _done_within(ev, 10.0), "the side stream waited on the engine's held word"
            assert eng.word_state() is not None  # still held: nothing waited on it
            assert probe.tolist() == [version, 0x0909090909090909]  # the stamp, then the bytes
            torch.cuda.synchronize()
            assert stamps[8:16].view(torch.int64).item() == version and int(dst.min()) == 9
            dst.zero_()
            torch.cuda.synchronize()
    finally:
        ip.close()
        eng.close()
        tx.close()
        rx.close()
