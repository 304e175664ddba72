"""External engine tasks (Engine.submit_external, csrc/engine/wx_engine_ext.c) over real
processes and the libfabric transport (tcp and shm), signalled by the host
(Engine.complete_external): the bytes are written "in place" by someone else than the
engine (here the target process itself, asked over its pipe), and the task still takes its
place among the engine's tasks: a fence after it waits for it, it waits for the fence before
it, wait() and wait(fence=) count it, its deadline names the task and peer, a failed peer is
skipped, and the trace shows it as kind "external". The same with a real CUDA event:
tests/test_external_gpu.py."""

import errno
import time

import pytest

from wxfer import _wxfer
from wxfer.testing import TargetProcess, connected_fabric
from wxfer.testing import pattern as rand
from helpers import FABRIC_PROVIDERS, connected_pair, held_word_engine, needs_fabric  # tests/helpers.py

PROVIDERS = FABRIC_PROVIDERS

pytestmark = needs_fabric()


@pytest.fixture(params=PROVIDERS)
def pair(request):
    yield from connected_pair(request, [1 << 20, 4096])


def _still_waiting(eng, **kw) -> bool:
    """Whether Engine.wait(**kw) is still waiting after a short while (no failure)."""
    try:
        eng.wait(timeout=0.3, **kw)
    except _wxfer.Error as e:
        assert e.errno == errno.ETIMEDOUT and "still in flight" in str(e), e
        return True
    return False


def test_a_fence_after_an_external_task_waits_for_its_signal(pair):
    """The end stamps' case: an in-place write (the target fills its first 64 KiB itself),
    then a fence write; the fence is not posted, and wait(fence=) / wait() do not return,
    until complete_external; then the trace has the task as kind external, before the fence."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    n = 1 << 16
    x = eng.submit_external([(tgt.descriptors[0], 0, 0, n)], tag=5)
    stamp = rand(8, 1)
    f = eng.submit(stamp, [(tgt.descriptors[1], 0, 0, 8)], tag=6, fence=True)
    assert f == x + 1
    assert _still_waiting(eng, fence=f) and _still_waiting(eng)
    assert tgt.read(1)[:8] == bytes(8)  # the fence's write was not posted meanwhile
    tgt.fill(0, 3)  # the "in-place" write, by someone else than the engine
    t_signal = time.monotonic_ns()
    assert eng.complete_external(x) is True
    eng.wait(timeout=30, fence=f)
    eng.wait(timeout=30)
    assert tgt.read(1)[:8] == stamp.tobytes()
    recs = {r["tag"]: r for r in eng.trace()}
    rx, rf = recs[5], recs[6]
    assert rx["kind"] == "external" and rf["kind"] == "write"
    assert (rx["status"], rx["bytes"], rx["held"], rx["ndests"], rx["nwrites"]) == (0, n, 0, 1, 1)
    assert rx["t_submit"] <= rx["t_ready"] and rx["t_ready"] >= t_signal
    assert rx["t_ready"] <= rx["t_post_first"] <= rx["t_done"] <= rf["t_post_first"]
    st = eng.stats()
    assert st["bytes_external"] == n and st["bytes_written"] == 8
    assert st["submitted"] == st["completed"] == 2
    assert eng.complete_external(x) is False  # finished: no longer waiting
    eng.close()


def test_an_external_task_finishes_after_the_fence_before_it():
    """The begin stamps' case: a fence whose writes are still out (the target stopped, SIGSTOP,
    tcp), then an external task signalled at once: it does not finish until the fence's writes
    completed; wait(fence=) on the fence returns without waiting for the task's signal."""
    import os
    import signal

    opts = {"provider": "tcp"}
    big = 32 << 20  # more than the sockets buffer: writes stay out while the target is stopped
    with TargetProcess("fabric", opts, [big, 4096]) as tgt:
        t = _wxfer.Transport("fabric", opts)
        tgt.connect(t)
        eng = _wxfer.Engine(t, timeout=30)
        eng.submit(rand(64, 1), [(tgt.descriptors[1], 0, 0, 64)], tag=1)  # connection set up
        eng.wait(timeout=20)
        os.kill(tgt.proc.pid, signal.SIGSTOP)
        try:
            b = eng.submit(rand(big, 2), [(tgt.descriptors[0], 0, 0, big)], tag=2, fence=True)
            x = eng.submit_external([(tgt.descriptors[1], 64, 0, 64)], tag=3)
            assert eng.complete_external(x) is True
            deadline = time.monotonic() + 10
            while eng.stats()["inflight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            st = eng.stats()
            assert st["inflight"] > 0 and st["completed"] == 1, st  # neither the fence nor it
        finally:
            os.kill(tgt.proc.pid, signal.SIGCONT)
        eng.wait(timeout=30, fence=b)
        eng.wait(timeout=30)
        recs = {r["tag"]: r for r in eng.trace()}
        assert recs[3]["t_post_first"] >= recs[2]["t_done"] >= recs[1]["t_done"]
        assert all(r["status"] == 0 for r in recs.values())
        x2 = eng.submit_external([(tgt.descriptors[1], 128, 0, 64)], tag=4)
        b2 = eng.submit(rand(8, 3), [(tgt.descriptors[1], 0, 0, 8)], tag=5, fence=True)
        x3 = eng.submit_external([(tgt.descriptors[1], 256, 0, 64)], tag=6)
        assert _still_waiting(eng, fence=b2)  # x2 before it: waited for
        eng.complete_external(x2)
        eng.wait(timeout=30, fence=b2)  # x3 after it: not waited for
        assert eng.complete_external(x3) is True
        eng.wait(timeout=30)
        eng.close()
        t.close()


def test_an_external_fence_is_waited_for_by_wait_fence(pair):
    """fence=True on an external task (the last in-place write of a step): wait(fence=id)
    returns once it was signalled, after the writes before it."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    eng.submit(rand(4096, 7), [(tgt.descriptors[0], 0, 0, 4096)], tag=1)
    x = eng.submit_external([(tgt.descriptors[0], 4096, 0, 4096)], tag=2, fence=True)
    assert _still_waiting(eng, fence=x)
    assert eng.complete_external(x) is True
    eng.wait(timeout=30, fence=x)
    recs = {r["tag"]: r for r in eng.trace()}
    assert recs[2]["t_post_first"] >= recs[1]["t_done"] and recs[2]["status"] == 0
    eng.close()


def test_external_task_waiting_for_its_signal_holds_up_later_tasks_not_earlier(pair):
    """The ready stage is one FIFO: tasks before an unsignalled external task land, the ones
    after it wait for its signal (as they wait for an earlier task's CUDA event)."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    a, c = rand(4096, 4), rand(4096, 5)
    eng.submit(a, [(tgt.descriptors[0], 0, 0, 4096)], tag=1)
    x = eng.submit_external([(tgt.descriptors[0], 4096, 0, 4096)], tag=2)
    eng.submit(c, [(tgt.descriptors[0], 8192, 0, 4096)], tag=3)
    deadline = time.monotonic() + 20
    while eng.stats()["completed"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    st = eng.stats()
    assert st["completed"] == 1 and st["bytes_written"] == 4096  # only the first
    eng.complete_external(x)
    eng.wait(timeout=30)
    got = tgt.read(0)
    assert got[:4096] == a.tobytes() and got[8192 : 3 * 4096] == c.tobytes()
    eng.close()


def test_a_task_with_nothing_to_wait_for_skips_an_idle_ready_stage(pair):
    """A write with no CUDA event (the version stamps) submitted while the ready stage is idle
    goes to the post queue in the submit call itself (no wake-up of the ready thread: issue
    37's begin fence), and the same write behind an unsignalled external task does not: it
    waits there in order (the test above says it is not written meanwhile)."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    stamp = rand(8, 6)
    for i in range(20):  # every time, not by luck of the threads' timing
        f = eng.submit(stamp, [(tgt.descriptors[1], 8 * i, 0, 8)], tag=10 + i, fence=True)
        returned = time.monotonic_ns()
        eng.wait(timeout=30, fence=f)
        (r,) = [r for r in eng.trace() if r["tag"] == 10 + i]
        assert r["t_submit"] <= r["t_ready"] <= returned, (i, r, returned)
    x = eng.submit_external([(tgt.descriptors[0], 0, 0, 4096)], tag=2)
    f = eng.submit(stamp, [(tgt.descriptors[1], 0, 0, 8)], tag=3, fence=True)
    returned = time.monotonic_ns()
    assert _still_waiting(eng, fence=f)
    eng.complete_external(x)
    eng.wait(timeout=30)
    recs = {r["tag"]: r for r in eng.trace()}
    assert recs[3]["t_ready"] > returned and recs[3]["t_ready"] >= recs[2]["t_ready"]
    eng.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_unsignalled_external_task_fails_at_its_deadline_naming_it_and_its_peer(provider):
    with connected_fabric(provider, [4096]) as (t, tgt):
        eng = _wxfer.Engine(t, timeout=0.5)
        x = eng.submit_external([(tgt.descriptors[0], 0, 0, 100)], tag=77)
        t0 = time.monotonic()
        with pytest.raises(_wxfer.Error) as ei:
            eng.wait(timeout=30)
        took = time.monotonic() - t0
        err = ei.value
        assert 0.4 < took < 5, took
        assert err.errno == errno.ETIMEDOUT and err.stage == "deadline", err
        assert (err.task, err.tag, err.peer) == (x, 77, 0)
        assert "task %d (tag 77), peer 0, deadline: in-place writes to peer 0" % x in str(err), str(err)
        assert "(100 bytes) not signalled complete after 0.5 s" in err.reason, err.reason
        assert eng.complete_external(x) is False
        eng.clear_error()
        eng.close()


def test_a_failure_signalled_by_the_host_fails_the_engine_with_its_reason(pair):
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    x = eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], tag=9)
    assert eng.complete_external(x, errno.EIO, "the kernel faulted") is True
    with pytest.raises(_wxfer.Error) as ei:
        eng.wait(timeout=30)
    err = ei.value
    assert (err.errno, err.task, err.tag, err.peer, err.stage) == (errno.EIO, x, 9, 0, "write")
    assert "the kernel faulted" in err.reason and "in-place writes to peer 0" in err.reason
    with pytest.raises(_wxfer.Error, match="the kernel faulted"):  # sticky, as any failure
        eng.submit_external([(tgt.descriptors[0], 0, 0, 64)])
    eng.clear_error()
    eng.close()


def test_signals_refused_where_they_do_not_apply(pair):
    """A second signal, a signal of a write task, a positive status of the wrong task: each
    refused or answered False; an external task behind a waiting one is still in the queue, so
    these are deterministic."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    a = eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], tag=1)
    b = eng.submit_external([(tgt.descriptors[0], 64, 0, 64)], tag=2)
    assert eng.complete_external(b) is True
    with pytest.raises(ValueError, match="signalled already"):
        eng.complete_external(b)
    w = eng.submit(rand(64, 1), [(tgt.descriptors[0], 128, 0, 64)], tag=3)
    assert eng.complete_external(w) is False  # a write task: nothing to signal
    assert eng.complete_external(10_000) is False  # never submitted
    eng.complete_external(a)
    eng.wait(timeout=30)
    assert [r["kind"] for r in sorted(eng.trace(), key=lambda r: r["id"])] == ["external", "external", "write"]
    with pytest.raises(_wxfer.Error, match="outside"):  # destinations validated as a write's
        eng.submit_external([(tgt.descriptors[0], (1 << 20) - 8, 0, 64)])
    with pytest.raises(TypeError, match="cuda_event"):
        eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], event=object())
    with pytest.raises(ValueError, match="handle is 0"):
        eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], event=0)
    assert eng.submit_external([], tag=4) > 0  # no destination: finished at once
    eng.wait(timeout=5)
    eng.close()


def test_prepared_destinations_are_validated_once_and_submitted_as_a_sequence_is(pair):
    """Engine.prepare_external (the in-place writer's batched copies, each push the same
    destinations): refused at prepare as submit_external refuses them; submitted again and
    again with its own tag, each an external task as a sequence's (its signal, its bytes, a
    fence after it waits for it); a Prepared of the other kind, or of another tag, refused."""
    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    d0, d1 = tgt.descriptors
    with pytest.raises(_wxfer.Error, match="outside"):  # validated as submit_external's
        eng.prepare_external([(d0, (1 << 20) - 8, 0, 64)], tag=3)
    p = eng.prepare_external([(d0, 0, 0, 64), (d0, 64, 0, 32)], tag=3)
    assert (p.tag, p.nbytes, p.region) == (3, 96, None)
    for step in range(2):
        x = eng.submit_external(p)
        f = eng.submit(rand(8, step), [(d1, 0, 0, 8)], tag=4, fence=True)
        assert _still_waiting(eng, fence=f)  # waits for the prepared task's signal
        assert eng.complete_external(x) is True
        eng.wait(timeout=30)
        assert tgt.read(1)[:8] == rand(8, step).tobytes()
    recs = [r for r in eng.trace() if r["tag"] == 3]
    assert [(r["kind"], r["bytes"], r["nwrites"]) for r in recs] == [("external", 96, 2)] * 2
    assert eng.stats()["bytes_external"] == 192
    assert eng.submit_external(p, tag=3) > 0  # its own tag may be given
    with pytest.raises(ValueError, match="tag 5, but dests is a Prepared of tag 3"):
        eng.submit_external(p, tag=5)
    with pytest.raises(TypeError, match="submit it with submit_external"):
        eng.submit_prepared([p])
    r = t.register(rand(64, 2), export=False)
    with pytest.raises(TypeError, match="submit it with submit_prepared"):
        eng.submit_external(eng.prepare(r, [(d0, 0, 0, 64)], tag=6))
    eng.clear_error()
    eng.close()


NO_LIBCUDA = "libcuda" in _wxfer.backends().get("cuda_ipc", (False, "libcuda"))[1]


@pytest.mark.skipif(not NO_LIBCUDA, reason="only where libcuda.so.1 cannot load (a made-up event handle)")
def test_an_event_task_without_libcuda_fails_naming_it_and_keeps_the_event_alive(pair):
    """The engine polls a CUDA event through the dlopened libcuda: without it, the task fails
    in its ready stage, saying so; the event object is held until the task is reaped; a host
    signal is refused while it waits for its event."""
    import sys

    class Ev:
        cuda_event = 0x1234

    t, tgt = pair
    eng = _wxfer.Engine(t, timeout=30)
    a = eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], tag=1)  # holds the ready stage
    ev = Ev()
    base = sys.getrefcount(ev)
    b = eng.submit_external([(tgt.descriptors[0], 64, 0, 64)], event=ev, tag=2)
    assert sys.getrefcount(ev) == base + 1
    with pytest.raises(ValueError, match="waits for its CUDA event"):
        eng.complete_external(b)
    eng.complete_external(a)
    with pytest.raises(_wxfer.Error) as ei:
        eng.wait(timeout=30)
    err = ei.value
    assert (err.task, err.peer, err.stage) == (b, 0, "ready") and "libcuda" in err.reason, str(err)
    eng.clear_error()
    eng.wait(timeout=30)
    eng.reap()
    assert sys.getrefcount(ev) == base
    eng.close()


@pytest.mark.skipif(
    not _wxfer.TESTING,
    reason="the fault-injection option _test_refuse_peer is compiled only into test builds: "
    "build with WXFER_TESTING=1 (make build / make test do)",
)
def test_isolate_skips_the_failed_peer_of_an_external_task():
    """isolate: once a peer failed (its writes never accepted, _test_refuse_peer), an external
    task to it and a live peer waits for its signal and counts the live peer's bytes only; one
    to the failed peer alone finishes without its signal (skipped); a failure signalled for a
    task fails its live peers alone, the engine goes on."""
    opts = {"provider": "tcp", "timeout": 120}
    with TargetProcess("fabric", opts, [1 << 16]) as good, TargetProcess("fabric", opts, [1 << 16]) as bad:
        t = _wxfer.Transport("fabric", dict(opts, _test_refuse_peer=1))
        assert good.connect(t) == 0 and bad.connect(t) == 1
        eng = _wxfer.Engine(t, timeout=1.0, isolate=True)
        eng.submit(rand(4096, 1), [(bad.descriptors[0], 0, 0, 4096)], tag=1)
        eng.wait(timeout=20)
        assert [f.peer for f in eng.failed_peers()] == [1]
        gd, bd = good.descriptors[0], bad.descriptors[0]
        both = eng.submit_external([(gd, 0, 0, 1000), (bd, 0, 0, 500)], tag=2)
        assert _still_waiting(eng)  # the live peer's write is still to come
        assert eng.complete_external(both) is True
        alone = eng.submit_external([(bd, 1000, 0, 300)], tag=3)
        eng.wait(timeout=20)  # no signal needed: its only peer failed
        assert eng.complete_external(alone) is False
        recs = {r["tag"]: r for r in eng.trace()}
        assert (recs[2]["status"], recs[2]["nwrites"]) == (-errno.EHOSTUNREACH, 1)
        assert (recs[3]["status"], recs[3]["nwrites"]) == (-errno.EHOSTUNREACH, 0)
        assert eng.stats()["bytes_external"] == 1000
        p = eng.prepare_external([(gd, 0, 0, 200), (bd, 0, 0, 100)], tag=5)  # (validated before)
        eng.complete_external(eng.submit_external(p))
        eng.wait(timeout=20)
        rec = [r for r in eng.trace() if r["tag"] == 5][-1]  # the failed peer skipped as with a list
        assert (rec["status"], rec["nwrites"], eng.stats()["bytes_external"]) == (-errno.EHOSTUNREACH, 1, 1200)
        x = eng.submit_external([(gd, 0, 0, 8), (bd, 0, 0, 8)], tag=4)
        eng.complete_external(x, errno.EIO, "copy failed")
        eng.wait(timeout=20)
        failed = {f.peer: f for f in eng.failed_peers()}
        assert sorted(failed) == [0, 1] and eng.error() is None
        assert failed[0].task == x and failed[0].stage == "write" and "copy failed" in failed[0].reason
        eng.close()
        t.close()


def test_an_external_task_behind_a_held_fence_word_gets_its_time_from_the_release():
    """Review #3 (isolation): with the fence word held for a stopped receiver (its fence write
    abandoned, NOT fenced: a device wait on the word does not pass), the in-place work of a
    live receiver queued behind that wait cannot finish; its external task's time limit must
    not run out meanwhile (it used to start when the ready stage picked it up: the live
    receiver failed for the late one). Its signal, later than the engine's timeout, still
    counts; once the stopped receiver resumes and the word goes on, the limit applies again."""
    n = 4 << 20
    with held_word_engine(n) as h:
        good, eng, word = h.good, h.eng, h.word
        eng.wait(timeout=20, fence=eng.submit(rand(n, 0), h.both(n), fence=True))  # (connected)
        h.stop()
        f = eng.submit(rand(n, 1), h.both(n), fence=True)
        eng.wait(timeout=20)  # the stopped receiver failed at its deadline, NOT fenced
        assert eng.word_state()[0] == 1 and word.value < f
        x = eng.submit_external([(good.descriptors[0], 0, 0, 64)], tag=7)
        time.sleep(2.0)  # twice the engine's timeout, the word held all along
        assert eng.complete_external(x) is True  # still waiting: not failed at its deadline
        eng.wait(timeout=20)
        assert [fl.peer for fl in eng.failed_peers()] == [1]  # the live receiver did not fail
        h.resume()
        assert h.released()
        y = eng.submit_external([(good.descriptors[0], 0, 0, 64)], tag=8)
        eng.wait(timeout=20)  # its limit applies again: the writer (here: nobody) is late
        fls = {fl.peer: fl for fl in eng.failed_peers()}
        assert sorted(fls) == [0, 1] and "not signalled complete" in fls[0].reason, fls
        assert eng.complete_external(y) is False
        eng.close()
