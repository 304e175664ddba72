"""Issue 35.1: leases over a store that fails or stalls on a schedule, over many lease periods
(the clock shrunk): no live worker or job is ever declared dead, a dead one is within its bound."""

import threading
import time

from wxfer.runtime import control, jobs, liveness

T = 30.0


class Flaky:
    """`inner`'s ``add``, failing on a schedule: every `every`-th call raises before it reaches
    the store, every `landed`-th one raises after it landed (a timeout on the answer), call
    number `stall_at` first stalls `stall_s` seconds."""

    def __init__(self, inner, every=0, landed=0, stall_at=0, stall_s=0.0):
        self.inner, self.every, self.landed, self.stall_at, self.stall_s = inner, every, landed, stall_at, stall_s
        self.calls = self.failed = 0
        self.lock = threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.calls += 1
            i = self.calls
        if i == self.stall_at:
            time.sleep(self.stall_s)
        if self.every and i % self.every == 0:
            self.failed += 1
            raise RuntimeError("flaky store: refused")
        got = self.inner.add(key, n)
        if self.landed and i % self.landed == 0:
            self.failed += 1
            raise TimeoutError("flaky store: the answer was lost")
        return got


def _watch(read, bound_s, for_s, step=0.02):
    """Read `read()` (a reason or None) every `step` for `for_s` seconds; the first reason."""
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        why = read()
        if why is not None:
            return why
        time.sleep(step)
    return None


def test_a_worker_lease_over_a_failing_and_stalling_store_never_expires_while_it_lives(store):
    s, _ = store
    ctl = control.Control(s, "lf", T)
    # every 3rd add refused, every 7th lost after it landed: 40 periods of 0.05 s, bound 0.25 s
    flaky = Flaky(ctl, every=3, landed=7)
    lease = liveness.Lease(flaky, "lease/0/e0", 0.05)
    lw, w = liveness.LeaseWatch(0.25), dict(lease_s=0.05, epoch=0)
    try:
        why = _watch(lambda: lw.expired(0, w, ctl.add("lease/0/e0", 0)), 0.25, 2.0)
        assert why is None, (why, flaky.failed)
        assert flaky.failed >= 10 and lease.failures >= 10, (flaky.failed, lease.failures)
    finally:
        lease.stop()
    # a 2 s stall (and a refusal now and then) under a bound of 2.5 s, 0.1 s periods
    flaky = Flaky(ctl, every=5, stall_at=4, stall_s=2.0)
    lease = liveness.Lease(flaky, "lease/1/e0", 0.1)
    lw, w = liveness.LeaseWatch(2.5), dict(lease_s=0.1, epoch=0)
    try:
        why = _watch(lambda: lw.expired(1, w, ctl.add("lease/1/e0", 0)), 2.5, 3.5)
        assert why is None and flaky.calls > 4, why
    finally:
        lease.stop()
    # dead (stopped): named within its bound (+ a read period)
    t0 = time.monotonic()
    why = _watch(lambda: lw.expired(1, w, ctl.add("lease/1/e0", 0)), 2.5, 4.0)
    took = time.monotonic() - t0
    assert why is not None and "lease/1/e0" in why, why
    print(f"stopped worker lease named after {took:.2f} s (bound 2.5 s)")
    assert took <= 2.5 + 0.2, took


def test_the_job_lease_over_a_failing_and_stalling_store_never_goes_stale_while_the_job_lives(store, monkeypatch):
    s, _ = store
    monkeypatch.setattr(jobs, "LEASE_S", 0.05)  # STALE_S stays 3 s: a 2 s stall is within it
    ctl = control.Control(s, "lj", T)
    ctl.add("job/lease", 0)
    flaky = Flaky(s, every=3, stall_at=10, stall_s=2.0)
    stop = threading.Event()
    threading.Thread(target=jobs._lease, args=(flaky, ctl.prefix, stop), daemon=True).start()
    watch = jobs.JobWatch(ctl)
    try:
        why = _watch(lambda: None if watch.alive() else "stale", jobs.STALE_S, 4.0)
        assert why is None and flaky.calls > 10 and flaky.failed >= 3, (why, flaky.calls, flaky.failed)
        assert jobs.job_alive(ctl, 1.0)
    finally:
        stop.set()
    t0 = time.monotonic()
    why = _watch(lambda: None if watch.alive() else "stale", jobs.STALE_S, 5.0)
    took = time.monotonic() - t0
    print(f"stopped job lease seen stale after {took:.2f} s (STALE_S {jobs.STALE_S})")
    assert why == "stale" and took <= jobs.STALE_S + 0.3, took


class _NoEngine:
    def failed_peers(self):
        return []


def test_a_lease_that_stops_during_a_push_is_named_when_that_push_ends(store):
    """Issue 35.1: deaths were looked at only when a push started; the trainer's watcher looks
    during a push too, and the push's end (Links.failed) names what it found, with no look of
    its own at the store."""
    from wxfer.runtime.links import Links

    s, _ = store
    ctl = control.Control(s, "ld", T)
    ctl.add("infer/rejoins", 0)
    lease = liveness.Lease(ctl, liveness.lease_key(1, 0), 0.05)
    w = dict(gpu=1, host="elsewhere", pid=1, lease_s=0.05, replica=1, rank=0)
    ln = Links(ctl, None, 0, None, None, {1: w}, 0.3)
    ln.start_watch(0.02)
    try:
        assert ln.sync(5.0)
        ln.adopt_rejoins()  # the push's start: nothing found
        assert ln.dead == {}
        lease.stop()  # dies while the push runs
        t0 = time.monotonic()
        while not ln._news:
            assert time.monotonic() - t0 < 0.3 + 1.0, "the watcher did not see the lease stop"
            time.sleep(0.01)
        got = ln.failed(_NoEngine(), str)  # the push's end
        assert list(got) == [1] and "lease/1/e0) was not renewed" in got[1], got
        print(f"lease stopped mid-push: found after {time.monotonic() - t0:.2f} s (bound 0.3 s)")
    finally:
        lease.stop()
        ln.close()


_STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
print("up", flush=True)
time.sleep(300)
"""


class _Stalled:
    """`inner`'s ``add``, held until monotonic time ``until`` (a trainer's lease calls alone)."""

    def __init__(self, inner):
        self.inner, self.until = inner, 0.0

    def add(self, key, n):
        time.sleep(max(0.0, self.until - time.monotonic()))
        return self.inner.add(key, n)


class _Poll:
    """state() of Receiver `r` every 50 ms in a thread: [(monotonic time, state, message)]."""

    def __init__(self, r):
        self.r, self.seen, self.stop = r, [], threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop.wait(0.05):
            st = self.r.state()
            self.seen.append((time.monotonic(), st["state"], st["message"]))

    def bad(self, since=0.0):
        return [x for x in self.seen if x[0] >= since and x[1] not in ("complete", "writing")]

    def close(self):
        self.stop.set()
        self.t.join(T)


def test_a_store_stall_past_the_lease_bound_leaves_live_trainers_alive_and_later_steps_complete(monkeypatch):
    """Issue 35 store finding 2 (docs/faults.md).  The store (its own process) SIGSTOPped 4.5 s,
    past the 3 s lease bound (lease_s 1), between two pushes, the worker polling state() all
    along (the trainer's lease calls held 0.3 s more, so that the worker reads the lease behind
    first): a lease read behind once makes its peer suspect and the renewal that follows makes
    it alive (peerstate.py): no state() reads torn or dropped, push 2 writes the worker and
    state() reads step 2 complete.  Then the trainer's lease alone stalled 5 s (the worker
    sees what a hung trainer looks like): judged dead (`dropped`), and alive again once its
    lease renews, so that step 3 reads complete.  Before the machine, a verdict was for good:
    `dropped` after later complete steps."""
    import os
    import signal
    import subprocess
    import sys

    from helpers import joined, receivers_in_threads  # tests/helpers.py
    from wxfer import _wxfer
    from wxfer.models import TINY, preset_for
    from wxfer.runtime.sender import Sender

    if not _wxfer.backends()["fabric"][0]:
        import pytest

        pytest.skip("fabric transport not built")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_worker
    import torch

    monkeypatch.delenv("WXFER_LEASE_S", raising=False)  # the default 1 s: the bound is 3 s
    port = control.free_port()
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    sender, recvs, poll = None, [], None
    try:
        assert host.stdout.readline().strip() == "up"
        addr, name = "127.0.0.1:%d" % port, "stall"
        _, ths = receivers_in_threads(TINY, addr, name, 1, timeout=T)
        m = fault_worker.model()
        sender = Sender(m, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=1.0)
        recvs = joined(ths, T)
        r = recvs[0]
        sender.push()
        assert r.wait_version(1, 10) == 1 and r.state()["state"] == "complete"
        poll = _Poll(r)
        time.sleep(0.3)
        # the trainer's lease calls held 0.3 s past the stall: the worker reads its lease behind
        # before it catches up, as with the trainers in their own processes (store_faults.py)
        stall = sender._lease.ctl = _Stalled(sender._lease.ctl)
        t0 = time.monotonic()
        stall.until = t0 + 4.8
        os.kill(host.pid, signal.SIGSTOP)
        time.sleep(4.5)
        os.kill(host.pid, signal.SIGCONT)
        time.sleep(1.7)
        n = len(poll.seen)
        print(f"after a 4.5 s store stall: {n} state() readings, the last: {poll.seen[-1][2]}")
        assert not poll.bad(), poll.bad()[:3]
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
        sender.push()  # the trainer's watcher read the worker's lease behind too: suspect only
        assert r.wait_version(2, 10) == 2
        assert sender.links.dead == {} and sender.links.dropped == set()
        # the trainer's lease alone stalled 5 s: dead after its bound and a period, then renewed
        t0 = time.monotonic()
        stall.until = t0 + 5.0
        time.sleep(6.5)
        dropped = poll.bad(t0)
        assert dropped and all(x[1] == "dropped" for x in dropped), dropped[:3]
        assert "trainer rank 0" in dropped[0][2] and "was not renewed" in dropped[0][2], dropped[0]
        when = (round(dropped[0][0] - t0, 2), round(dropped[-1][0] - t0, 2))
        print(f"trainer lease stalled 5 s: state() read dropped from {when[0]} s to {when[1]} s")
        assert t0 + 3.0 <= dropped[0][0] and dropped[-1][0] <= stall.until + 1.0, when
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
        sender.push()
        assert r.wait_version(3, 10) == 3
        time.sleep(0.3)
        poll.close()
        assert poll.seen[-1][1] == "complete" and "step 3 complete" in poll.seen[-1][2], poll.seen[-1]
        assert r.writers.dead == {} and r.writers.peers.get(0).name == "ALIVE"
    finally:
        if poll is not None:
            poll.close()
        if sender is not None:
            sender.close()
        for x in recvs:
            x.close()
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
