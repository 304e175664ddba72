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
