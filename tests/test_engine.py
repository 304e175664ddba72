"""The native engine over real processes and the libfabric transport (tcp and shm):
bytes land, odd sizes and offsets, many small tasks, the watermark, refused writes, a
vanished peer, and the GIL released while waiting."""

import ctypes
import errno
import gc
import threading
import time
import weakref

import numpy as np
import pytest

from wxfer import _wxfer
from wxfer.testing import TargetProcess
from wxfer.testing import pattern as rand
from helpers import FABRIC_PROVIDERS, connected_pair, held_word_engine, needs_fabric  # tests/helpers.py
from wxfer.runtime.trace import held_over_time, to_chrome

PROVIDERS = FABRIC_PROVIDERS

pytestmark = needs_fabric()


@pytest.fixture(params=PROVIDERS)
def pair(request):
    yield from connected_pair(request, [1 << 20, 3 * 4096 + 17])


def test_odd_sizes_and_unaligned_offsets(pair):
    t, tgt = pair
    size = 1 << 20
    expect = np.zeros(size, dtype=np.uint8)
    src = rand(size, 1)
    eng = _wxfer.Engine(t, chunk=64 * 1024 + 3)  # odd chunk size: writes split unevenly
    rng = np.random.default_rng(2)
    dests = []
    cursor = 0
    while cursor < size - 1:  # disjoint, odd-length, unaligned pieces
        n = int(rng.integers(1, 100_000))
        n = min(n, size - cursor)
        soff = int(rng.integers(0, size - n + 1))
        dests.append((tgt.descriptors[0], cursor, soff, n))
        expect[cursor : cursor + n] = src[soff : soff + n]
        cursor += n + int(rng.integers(0, 7))
    eng.submit(src, dests, tag=7)
    eng.wait(timeout=60)
    got = np.frombuffer(tgt.read(0), dtype=np.uint8)
    assert np.array_equal(got, expect)
    st = eng.stats()
    assert st["bytes_written"] == sum(d[3] for d in dests)
    assert st["completed"] == st["submitted"] == 1
    eng.close()


def test_many_small_tasks_into_two_regions(pair):
    t, tgt = pair
    eng = _wxfer.Engine(t)
    n1, n2 = 1 << 20, 3 * 4096 + 17
    exp1, exp2 = np.zeros(n1, np.uint8), np.zeros(n2, np.uint8)
    for i in range(400):
        if i % 2:
            size, off = 1 + (i * 37) % 60, (i * 131) % (n2 - 64)
            data = rand(size, i)
            eng.submit(data, [(tgt.descriptors[1], off, 0, size)], tag=i)
            exp2[off : off + size] = data
        else:
            size, off = 2048 + i, i * 2500
            data = rand(size, i)
            eng.submit(data, [(tgt.descriptors[0], off, 0, size)], tag=i)
            exp1[off : off + size] = data
    eng.wait(timeout=60)
    assert np.array_equal(np.frombuffer(tgt.read(0), np.uint8), exp1)
    assert np.array_equal(np.frombuffer(tgt.read(1), np.uint8), exp2)
    recs = eng.trace()
    assert len(recs) == 400 and all(r["status"] == 0 for r in recs)
    assert all(r["t_submit"] <= r["t_admit"] <= r["t_ready"] <= r["t_post_first"] <= r["t_done"] for r in recs)
    chrome = to_chrome(recs)
    assert sum(1 for e in chrome["traceEvents"] if e["ph"] == "X") >= 4 * 400 - 10
    eng.close()


def test_watermark_is_never_exceeded(pair):
    t, tgt = pair
    wm = 256 * 1024
    eng = _wxfer.Engine(t, watermark=wm, chunk=32 * 1024)
    task = 60 * 1024
    for i in range(40):
        eng.submit(rand(task, i), [(tgt.descriptors[0], (i * task) % ((1 << 20) - task), 0, task)], tag=i)
    eng.wait(timeout=60)
    recs = eng.trace()
    assert len(recs) == 40
    peak = max(h for _, h in held_over_time(recs))
    assert peak <= wm
    assert peak >= 3 * task  # the watermark allowed overlap, and it was used
    assert eng.stats()["held_peak"] <= wm
    assert eng.stats()["held"] == 0
    eng.close()


def test_reserve_admits_before_the_source_exists(pair):
    """reserve() admits under the watermark before the caller makes the source (what the
    Sender does, so a push holds at most the watermark plus one task); a reserved submit is
    not admitted twice; a failed reserved submit and unreserve() give the bytes back; a task
    holding nothing (zero copy) is never held back."""
    t, tgt = pair
    wm, task = 256 * 1024, 60 * 1024
    eng = _wxfer.Engine(t, watermark=wm, chunk=32 * 1024)
    for i in range(30):
        ta = eng.reserve(task)
        assert eng.stats()["held"] <= wm
        src = rand(task, i)  # made after admission
        eng.submit(src, [(tgt.descriptors[0], (i * task) % ((1 << 20) - task), 0, task)], tag=i, held=task, reserved=ta)
    eng.wait(timeout=60)
    recs = eng.trace()
    assert len(recs) == 30 and all(r["t_admit"] <= r["t_submit"] for r in recs)
    assert max(h for _, h in held_over_time(recs)) <= wm and eng.stats()["held_peak"] <= wm
    assert eng.stats()["held"] == 0
    ta = eng.reserve(task)
    with pytest.raises(_wxfer.Error, match="outside"):
        eng.submit(rand(64, 0), [(tgt.descriptors[1], 1 << 40, 0, 64)], held=task, reserved=ta)
    assert eng.stats()["held"] == 0  # given back by the failed submit
    with pytest.raises(ValueError, match="held="):
        eng.submit(rand(64, 0), [(tgt.descriptors[1], 0, 0, 64)], reserved=ta)
    eng.unreserve(eng.reserve(2 * wm) * 0 + 2 * wm)  # alone: admitted, then given back
    assert eng.stats()["held"] == 0
    big = eng.reserve(2 * wm)  # over the watermark, alone
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not admitted under the watermark within 0.3 s"):
        eng.reserve(task, timeout=0.3)  # the watermark is full and nothing of it will finish
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    eng.reserve(0)  # holds nothing: not held back
    assert time.monotonic() - t0 < 1.0
    eng.unreserve(2 * wm)
    assert big > 0 and eng.stats()["held"] == 0
    eng.close()


def test_bad_key_and_out_of_range_refused_before_posting(pair):
    t, tgt = pair
    eng = _wxfer.Engine(t)
    good = tgt.descriptors[1]
    d = bytearray(good)
    # the key is the first u64 of the region record, after the 8-byte header, the u32
    # address length and the address
    alen = int.from_bytes(d[8:12], "little")
    koff = 12 + alen
    d[koff : koff + 8] = (int.from_bytes(d[koff : koff + 8], "little") ^ 0x5A5A).to_bytes(8, "little")
    with pytest.raises(_wxfer.Error, match="key 0x"):
        eng.submit(rand(16, 0), [(bytes(d), 0, 0, 16)])
    with pytest.raises(_wxfer.Error, match="outside"):
        eng.submit(rand(64, 0), [(good, 3 * 4096 + 17 - 10, 0, 64)])
    with pytest.raises(_wxfer.Error, match="outside"):
        eng.submit(rand(64, 0), [(good, 0, 32, 64)])  # source range past the source
    # a task with one bad destination among good ones writes nothing at all
    with pytest.raises(_wxfer.Error):
        eng.submit(rand(64, 0), [(good, 0, 0, 64), (good, 1 << 40, 0, 1)])
    eng.wait(timeout=10)
    assert tgt.read(1) == bytes(3 * 4096 + 17)
    assert eng.stats()["submitted"] == 0
    eng.close()


def test_write_primitive(pair):
    t, tgt = pair
    src = rand(5000, 9)
    r = t.register(src, export=False)
    t.write(r, 100, tgt.descriptors[1], 7, 4321, timeout=30)
    got = np.frombuffer(tgt.read(1), np.uint8)
    assert np.array_equal(got[7 : 7 + 4321], src[100 : 100 + 4321])
    assert not got[:7].any() and not got[7 + 4321 :].any()
    with pytest.raises(_wxfer.Error, match="local range"):
        t.write(r, 4000, tgt.descriptors[1], 0, 2000)
    r.close()


def test_gil_released_while_waiting(pair):
    t, tgt = pair
    eng = _wxfer.Engine(t, watermark=64 * 1024, chunk=4096, depth=2)
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.0005)

    th = threading.Thread(target=spin)
    th.start()
    try:
        t0 = time.perf_counter()
        for i in range(30):  # blocks in admission (watermark) with the GIL released
            eng.submit(rand(60 * 1024, i), [(tgt.descriptors[0], 0, 0, 60 * 1024)])
        eng.wait(timeout=60)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        th.join()
    assert ticks > 10, (ticks, elapsed)
    eng.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_vanished_peer_raises_within_bounded_time(provider):
    opts = {"provider": provider}
    tgt = TargetProcess("fabric", opts, [4 << 20])
    t = _wxfer.Transport("fabric", opts)
    tgt.connect(t)
    desc = tgt.descriptors[0]
    tgt.kill()
    eng = _wxfer.Engine(t, timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(_wxfer.Error) as ei:
        for i in range(4):
            eng.submit(rand(1 << 20, i), [(desc, i << 20, 0, 1 << 20)])
        eng.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed
    assert "peer" in str(ei.value)
    err = ei.value
    if err.task is not None:  # failed in the engine (not refused at submit)
        assert err.peer == 0 and err.stage in ("post", "write", "deadline"), (err.peer, err.stage)
        assert err.tag == 0 and err.errno > 0 and err.reason in str(err)
        assert "task %d (tag 0), peer 0, %s: " % (err.task, err.stage) in str(err), str(err)
    eng.close()
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 20


@pytest.mark.skipif(
    not _wxfer.TESTING,
    reason="the fault-injection option _test_refuse_peer is compiled "
    "only into test builds: build with WXFER_TESTING=1 (make build / make test do)",
)
def test_isolate_fails_a_peer_whose_writes_are_never_accepted():
    """A transport that keeps answering -EAGAIN for one peer (as tcp;ofi_rxm does for a while
    for a peer that died, here forced by the TEST-ONLY option _test_refuse_peer): with
    isolate, that peer fails at the task deadline naming it, and the other peer gets every
    byte. Without the deadline covering writes that never got posted, this waited forever."""
    opts = {"provider": "tcp", "timeout": 120}
    with TargetProcess("fabric", opts, [1 << 20]) as good, TargetProcess("fabric", opts, [1 << 20]) as bad:
        t = _wxfer.Transport("fabric", dict(opts, _test_refuse_peer=1))
        assert good.connect(t) == 0 and bad.connect(t) == 1
        eng = _wxfer.Engine(t, timeout=1.5, isolate=True)
        srcs = [rand(1 << 18, i) for i in range(4)]
        t0 = time.monotonic()
        for i, s in enumerate(srcs):
            eng.submit(s, [(good.descriptors[0], i << 18, 0, 1 << 18), (bad.descriptors[0], i << 18, 0, 1 << 18)])
        eng.wait(timeout=20)
        took = time.monotonic() - t0
        failed = eng.failed_peers()
        assert [f.peer for f in failed] == [1], failed
        f = failed[0]
        assert isinstance(f, _wxfer.Error) and f.errno == errno.ETIMEDOUT and f.stage == "deadline", f
        assert f.tag in range(4) and f.task in range(1, 5), (f.tag, f.task)
        assert "not accepted for 1.5 s" in f.reason and "peer 1" in str(f), str(f)
        assert eng.error() is None  # isolate: the engine itself goes on
        assert took < 1.5 + 3, took
        assert good.read(0) == b"".join(s.tobytes() for s in srcs)
        assert bad.read(0) == bytes(1 << 20)  # nothing reached the refused peer
        # a later task's writes to the failed peer are skipped: its trace record says so
        late = rand(1 << 12, 9)
        eng.submit(late, [(good.descriptors[0], 0, 0, 1 << 12), (bad.descriptors[0], 0, 0, 1 << 12)], tag=9)
        eng.wait(timeout=20)
        [rec] = [r for r in eng.trace() if r["tag"] == 9]
        assert rec["status"] == -errno.EHOSTUNREACH, rec  # (was 0: the finish overwrote the skip's)
        assert good.read(0)[: 1 << 12] == late.tobytes()
        eng.close()
        t.close()


def test_engine_closed_with_writes_out_releases_their_sources_when_the_transport_closes():
    """Closing an Engine while writes are still out to a receiver that stopped answering
    (SIGSTOP) must not leak their sources: the Engine is parked on its Transport, whose
    close cancels those writes, and then the sources are released."""
    import os
    import signal
    import sys

    opts = {"provider": "tcp"}
    with TargetProcess("fabric", opts, [4 << 20]) as tgt:
        t = _wxfer.Transport("fabric", opts)
        tgt.connect(t)
        eng = _wxfer.Engine(t, timeout=30)
        eng.submit(rand(4096, 1), [(tgt.descriptors[0], 0, 0, 4096)])  # connection set up
        eng.wait(timeout=20)
        os.kill(tgt.proc.pid, signal.SIGSTOP)
        try:
            src = rand(4 << 20, 3)
            base = sys.getrefcount(src)
            eng.submit(src, [(tgt.descriptors[0], 0, 0, 4 << 20)])
            deadline = time.monotonic() + 10
            while eng.stats()["inflight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert eng.stats()["inflight"] > 0
            eng.close()  # writes still out: parked, source held
            assert sys.getrefcount(src) > base
            t.close()  # cancels them; the source is let go
            assert sys.getrefcount(src) == base
        finally:
            os.kill(tgt.proc.pid, signal.SIGCONT)


def _reordered_export(blob: bytes, order) -> bytes:
    """The export blob with its region entries in another order (the wire format of
    csrc/transport/wx_desc.h: header, u32 address length, address, u32 n, n entries of
    key, rbase, len (u64), mem, device, blob_len (u32), blob)."""
    off = 12 + int.from_bytes(blob[8:12], "little")
    n = int.from_bytes(blob[off : off + 4], "little")
    entries, p = [], off + 4
    for _ in range(n):
        size = 36 + int.from_bytes(blob[p + 32 : p + 36], "little")
        entries.append(blob[p : p + size])
        p += size
    assert p == len(blob) and sorted(order) == list(range(n))
    return blob[: off + 4] + b"".join(entries[i] for i in order)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_peer_table_refreshed_while_writes_to_it_are_queued(provider):
    """A worker that re-exports (a restart at the same address) has its region table replaced
    by connect_request while writes validated against the old table are still queued: they
    must land where they were validated to land. (The queued destinations used to point into
    the table the refresh freed: the allocator's own bookkeeping then overwrote the key and
    base of its first entry, which the writes still read; under ASan, a use-after-free.)"""
    opts = {"provider": provider}
    n, size = 64, 4096
    with TargetProcess("fabric", opts, [n * size, n * size]) as tgt:
        t = _wxfer.Transport("fabric", opts)
        tgt.connect(t)
        key = _wxfer.decode_descriptor(tgt.descriptors[0])["region"]["key"]
        keys = [r["key"] for r in _wxfer.decode_export(tgt.export)["regions"]]
        first = [keys.index(key), 1 - keys.index(key)]  # descriptor 0's region first
        t.connect_request(_reordered_export(tgt.export, first))  # a refresh: no handshake
        eng = _wxfer.Engine(t, chunk=512, depth=1, timeout=30)  # 512 writes, one at a time
        srcs = [rand(size, 100 + i) for i in range(n)]
        for i, s in enumerate(srcs):
            eng.submit(s, [(tgt.descriptors[0], i * size, 0, size)], tag=i)
        for _ in range(8):  # the worker re-exports
            peer, req = t.connect_request(_reordered_export(tgt.export, first[::-1]))
            assert (peer, req) == (0, b"")
        eng.wait(timeout=60)
        assert eng.stats()["completed"] == n
        assert tgt.read(0) == b"".join(s.tobytes() for s in srcs)
        assert tgt.read(1) == bytes(n * size)
        eng.close()
        t.close()


def test_wait_for_a_fence_returns_when_it_finished_not_the_tasks_after_it(pair):
    """Engine.wait(fence=id) (the Sender's wait for the begin stamps before its direct writes):
    back once that fence task finished -- every earlier write landed, its own too -- while the
    tasks submitted after it may still be writing; an id never submitted does not block."""
    import time

    t, tgt = pair
    eng = _wxfer.Engine(t, chunk=64 * 1024)
    big = 512 * 1024
    a, f = rand(big, 1), rand(8, 2)
    eng.submit(a, [(tgt.descriptors[0], 0, 0, big)], tag=1)
    fid = eng.submit(f, [(tgt.descriptors[1], 0, 0, 8)], tag=2, fence=True)
    later = [rand(big, 10 + i) for i in range(64)]
    for i, b in enumerate(later):
        eng.submit(b, [(tgt.descriptors[0], big, 0, big)], tag=100 + i)
    eng.wait(timeout=60, fence=fid)
    back = time.monotonic_ns()
    eng.wait(timeout=60, fence=fid + 10_000)  # never submitted: at once
    eng.wait(timeout=60)
    recs = {r["tag"]: r for r in eng.trace()}
    assert back >= recs[2]["t_done"] >= recs[1]["t_done"]
    assert back < max(recs[100 + i]["t_done"] for i in range(64))  # it did not wait for them all
    assert np.array_equal(np.frombuffer(tgt.read(1), np.uint8)[:8], f)
    eng.close()


def test_wait_posted_returns_once_the_fence_is_handed_to_the_transport(pair):
    """Engine.wait(fence=id, posted=True) (before the begin stamps' device wait): back once that
    task's writes were handed to the transport -- for a fence, after every earlier write
    completed -- not necessarily landed; an id never submitted does not block; posted=True
    needs fence=."""
    t, tgt = pair
    eng = _wxfer.Engine(t, chunk=64 * 1024)
    big = 512 * 1024
    eng.submit(rand(big, 1), [(tgt.descriptors[0], 0, 0, big)], tag=1)
    fid = eng.submit(rand(8, 2), [(tgt.descriptors[1], 0, 0, 8)], tag=2, fence=True)
    eng.wait(timeout=60, fence=fid, posted=True)
    recs = {r["tag"]: r for r in eng.trace()}
    assert 1 in recs and recs[1]["status"] == 0  # the fence posts only after it completed
    eng.wait(timeout=60, fence=fid + 10_000, posted=True)  # never submitted: at once
    with pytest.raises(ValueError, match="fence"):
        eng.wait(timeout=1, posted=True)
    eng.wait(timeout=60)
    assert {r["tag"] for r in eng.trace()} >= {1, 2}
    eng.close()


def test_fence_word_mirrors_each_finished_fence_and_is_released_at_close(pair):
    """Engine.fence_word (the begin stamps' device wait, cuStreamWaitValue32 on the GPU): the
    uint32 holds the id of the last fence task finished -- stored as each one finishes, not
    when a plain task does -- and is set past every task submitted once the engine closes."""
    t, tgt = pair
    eng = _wxfer.Engine(t, chunk=64 * 1024)
    word = ctypes.c_uint32(12345)
    addr = ctypes.addressof(word)
    with pytest.raises(ValueError, match="keep"):
        eng.fence_word(addr, None)
    eng.fence_word(addr, word)
    assert word.value == 0  # no fence finished yet: the mirror starts at 0
    big = 512 * 1024
    eng.submit(rand(big, 1), [(tgt.descriptors[0], 0, 0, big)], tag=1)
    f1 = eng.submit(rand(8, 2), [(tgt.descriptors[1], 0, 0, 8)], tag=2, fence=True)
    eng.wait(timeout=60, fence=f1)
    assert word.value == f1 & 0xFFFFFFFF
    plain = eng.submit(rand(big, 3), [(tgt.descriptors[0], 0, 0, big)], tag=3)
    eng.wait(timeout=60)
    assert word.value == f1  # a plain task does not move it
    f2 = eng.submit(rand(8, 4), [(tgt.descriptors[1], 0, 0, 8)], tag=4, fence=True)
    eng.wait(timeout=60)
    assert f2 > plain > f1 and word.value == f2
    eng.close()
    assert word.value == f2 + 1  # past every task submitted: no stream waits on a closed engine


def test_fence_word_is_held_for_a_fence_the_engine_error_cancelled_and_word_state_says_so(pair):
    """A fence the engine's sticky error cancelled (not posted: its stamps are not known to
    have landed) holds the word until the engine stops, also after clear_error and later
    fences; word_state() says so (no peer: the engine's error) instead of letting a caller
    queue a device wait that cannot pass."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=0.5)
    word = ctypes.c_uint32(0)
    eng.fence_word(ctypes.addressof(word), word)
    f1 = eng.submit(rand(8, 1), [(tgt.descriptors[1], 0, 0, 8)], fence=True)
    eng.wait(timeout=20, fence=f1)
    assert word.value == f1 and eng.word_state() is None
    eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], tag=5)  # no signal: its deadline fails the engine
    f2 = eng.submit(rand(8, 2), [(tgt.descriptors[1], 0, 0, 8)], fence=True)
    with pytest.raises(Exception, match="deadline"):
        eng.wait(timeout=20, fence=f2)
    end = time.monotonic() + 10  # (the error raised at once; the cancelled fence finishes next)
    while eng.word_state() is None and time.monotonic() < end:
        time.sleep(0.01)
    peer, name, held_s = eng.word_state()
    assert (peer, name) == (None, None) and held_s >= 0 and word.value == f1
    eng.clear_error()
    f3 = eng.submit(rand(8, 3), [(tgt.descriptors[1], 0, 0, 8)], fence=True)
    eng.wait(timeout=20, fence=f3)
    assert word.value == f1 and eng.word_state()[0] is None  # until the stop
    eng.close()
    assert word.value == f3 + 1


def test_fence_word_is_held_while_a_peer_whose_fence_write_did_not_land_is_not_fenced():
    """The begin stamps' hazard (docs/cuda_ipc.md): a fence task whose write to one peer is
    abandoned at its deadline (isolate; the target stopped, SIGSTOP) finishes, and
    Engine.wait(fence=...) returns, but the fence word stays at the last fence released: a
    stream waiting for it would otherwise write that peer while its begin stamp still equals
    its end stamp. Fabric cannot fence a peer (its writes may still land): the word stays
    held while they are out, later fences do not move it, and word_state() names the peer.
    Once the peer resumes and the writes abandoned to it have completed (none can land
    later), the word goes on to the last fence finished (it used to stay until close: every
    later device wait hung); the engine's close sets it past every task."""
    import time

    with held_word_engine() as h:
        good, eng, word = h.good, h.eng, h.word
        n = 4 << 20
        f1 = eng.submit(rand(n, 1), h.both(n), fence=True)
        eng.wait(timeout=20, fence=f1)
        assert word.value == f1 and eng.word_state() is None  # every write landed: released
        h.stop()
        src = rand(n, 2)
        f2 = eng.submit(src, h.both(n), fence=True, tag=2)
        eng.wait(timeout=20, fence=f2)  # finished at the stopped peer's deadline
        assert word.value == f1, (word.value, f1, f2)  # (was f2: released, failed or not)
        eng.wait(timeout=20)  # the failed peer's fence was tried
        [fl] = eng.failed_peers()
        assert fl.peer == 1 and "NOT fenced" in fl.reason and fl.stage == "deadline", str(fl)
        assert word.value == f1  # not fenced: its stamp may land after the writes behind the wait
        peer, name, held_s = eng.word_state()
        assert peer == 1 and name.startswith("peer 1 (") and name in fl.reason and held_s > 0, (peer, name)
        assert good.read(0) == src.tobytes()
        f3 = eng.submit(rand(8, 3), [(good.descriptors[0], 0, 0, 8)], fence=True)
        eng.wait(timeout=20, fence=f3)
        assert word.value == f1  # a later fence does not release the earlier wait (cyclic >=)
        h.resume()  # its provider progresses: the writes complete
        end = time.monotonic() + 15
        while word.value != f3 and time.monotonic() < end:
            time.sleep(0.02)
        assert word.value == f3, (word.value, f1, f3)  # the last fence finished
        assert eng.word_state() is None
        [fl] = eng.failed_peers()
        assert "abandoned writes have all completed" in fl.reason, str(fl)
        f4 = eng.submit(rand(8, 4), [(good.descriptors[0], 0, 0, 8)], fence=True)
        eng.wait(timeout=20, fence=f4)
        assert word.value == f4  # released as it finishes again
        eng.close()
        assert word.value == f4 + 1  # stopped: past every task


def test_trace_is_a_bounded_ring(pair):
    """The engine's trace keeps the last 65536 tasks (the Sender never clears it): older
    records are dropped, counted, and the kept ones are the newest, oldest first."""
    t, tgt = pair
    eng = _wxfer.Engine(t)
    n = 65536 + 100
    for i in range(n):
        eng.submit(rand(1, 0), [], tag=i)  # no destination: finishes at submit
    tr = eng.trace()
    assert len(tr) == 65536 and eng.stats()["trace_dropped"] == 100
    assert [r["tag"] for r in tr[:3]] == [100, 101, 102] and tr[-1]["tag"] == n - 1
    eng.trace(clear=True)
    assert eng.trace() == [] and eng.stats()["trace_dropped"] == 0
    eng.close()


def test_fence_task_is_posted_after_earlier_writes_and_before_later_ones(pair):
    """fence=True (the version stamps): its writes are posted only once every earlier write
    has completed, and later tasks' writes only once its own have -- without the caller
    waiting in between; the bytes of every task land."""
    t, tgt = pair
    eng = _wxfer.Engine(t, chunk=64 * 1024)
    big = 512 * 1024
    a, f, b = rand(big, 1), rand(8, 2), rand(big, 3)
    eng.submit(a, [(tgt.descriptors[0], 0, 0, big)], tag=1)
    eng.submit(f, [(tgt.descriptors[1], 0, 0, 8)], tag=2, fence=True)
    eng.submit(b, [(tgt.descriptors[0], big, 0, big)], tag=3)
    eng.wait(timeout=60)
    recs = {r["tag"]: r for r in eng.trace()}
    assert all(r["status"] == 0 for r in recs.values())
    assert recs[2]["t_post_first"] >= recs[1]["t_done"]  # after every earlier write landed
    assert recs[3]["t_post_first"] >= recs[2]["t_done"]  # later writes after its own
    got0 = np.frombuffer(tgt.read(0), np.uint8)
    assert np.array_equal(got0[:big], a) and np.array_equal(got0[big : 2 * big], b)
    assert np.array_equal(np.frombuffer(tgt.read(1), np.uint8)[:8], f)
    eng.close()


def test_a_cycle_through_a_tasks_source_is_collected(pair):
    """Engine is a GC type: it shows the collector the transport and its unreaped tasks'
    sources (here a buffer exporter), and a cycle engine -> task -> source -> engine is
    collected (tp_clear closes the engine, which releases the source)."""
    t, tgt = pair

    class Src(ctypes.c_char * 4096):  # a buffer exporter that can hold attributes
        pass

    eng = _wxfer.Engine(t)
    src = Src()
    src.engine = eng
    eng.submit(src, [(tgt.descriptors[0], 0, 0, 4096)])
    deadline = time.monotonic() + 30
    while eng.stats()["completed"] < 1:  # finished, not reaped (wait() would reap)
        assert time.monotonic() < deadline, eng.stats()
        time.sleep(0.01)
    refs = gc.get_referents(eng)
    assert t in refs and src in refs, refs
    gone = weakref.ref(src)
    del src, eng, refs
    gc.collect()
    assert gone() is None
