"""Issue 26: the liveness checks at a push's start and end made cheap without losing what they
see.  A worker's process on this host is held by a pidfd (liveness.PidWatch): one poll per
check, no /proc read while it lives, a death (zombie or reaped) or a reused pid still seen;
/proc reads where pidfds are refused.  A lease is read at most twice a period (its count moves
once a period), and the restart count alone is one store round trip."""

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from wxfer.runtime import control, liveness
from wxfer.runtime.links import Links

T = 30.0


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _record(p, **kw):
    st = liveness.proc_start(p.pid)
    return dict(host=socket.gethostname(), pid=p.pid, start=st[1], pidns=liveness.pid_namespace(), **kw)


def _watch():
    return liveness.PidWatch(socket.gethostname(), liveness.pid_namespace())


def _until_zombie(p):
    deadline = time.monotonic() + 10
    while liveness.proc_start(p.pid)[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def proc_reads(monkeypatch):
    """Counts /proc/<pid>/stat reads (liveness.proc_start)."""
    n = [0]
    real = liveness.proc_start

    def counted(pid):
        n[0] += 1
        return real(pid)

    monkeypatch.setattr(liveness, "proc_start", counted)
    return n


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open")
def test_a_pidfd_sees_a_death_without_reading_proc_while_the_process_lives(proc_reads):
    a, b = _sleeper(), _sleeper()
    pw = _watch()
    try:
        recs = {0: _record(a), 1: _record(b), 2: _record(b)}  # 1 and 2: one process (workers in threads)
        proc_reads[0] = 0
        assert pw.dead(recs) == {}
        assert proc_reads[0] == 2  # each process's start time, once, to bind its pidfd
        assert len(pw._fd) == 2
        for _ in range(50):
            assert pw.dead(recs) == {}
        assert proc_reads[0] == 2  # alive: polls only
        b.kill()
        _until_zombie(b)  # killed, not reaped: a pidfd is readable already
        got = pw.dead(recs)
        assert set(got) == {1, 2} and got[1] == f"its process (pid {b.pid}) has exited (a zombie)", got
        b.wait(10)
        assert pw.dead(recs) == got  # seen exited stays so, reaped or not
        a.kill()
        a.wait(10)
        got = pw.dead(recs)
        assert got[0] == f"its process (pid {a.pid}) has exited", got
        assert pw._fd == {} and pw._who == {}  # their pidfds closed
    finally:
        pw.close()
        for p in (a, b):
            p.kill()
            p.wait(10)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open")
def test_a_pidfd_is_bound_to_the_recorded_start_time():
    p = _sleeper()
    pw = _watch()
    try:
        w = _record(p)
        # the pid alive, but another process than the record's (a reused pid): dead at once
        got = pw.dead({5: dict(w, start=w["start"] - 1)})
        assert got == {5: f"its process (pid {p.pid}) has exited (the pid now belongs to another process)"}
        assert pw._fd == {}  # no pidfd kept for another process
        assert pw.dead({6: w}) == {}  # the right start time: bound
        fd = pw._fd[(w["pid"], w["start"])]
        pw.forget(w)  # a worker replaced by its restart: its pidfd closed
        assert pw._fd == {}
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        pw.close()
        p.kill()
        p.wait(10)
    pw = _watch()
    got = pw.dead({7: w})  # gone before the bind (or its pid reused since: another start time)
    assert list(got) == [7] and got[7].startswith(f"its process (pid {p.pid}) has exited"), got


def test_where_pidfds_are_refused_proc_is_read_at_each_check(monkeypatch, proc_reads):
    def refused(pid):
        raise OSError(errno.ENOSYS, "pidfd_open refused")

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    p = _sleeper()
    pw = _watch()
    try:
        w = _record(p)
        proc_reads[0] = 0
        for i in range(3):
            assert pw.dead({0: w}) == {}
        assert proc_reads[0] == 3 and pw._fd == {}
        p.kill()
        p.wait(10)
        assert pw.dead({0: w}) == {0: f"its process (pid {p.pid}) has exited"}
    finally:
        pw.close()
        p.kill()
        p.wait(10)


class _Store:
    """A store counting what each call costs in round trips."""

    def __init__(self):
        self.kv, self.calls = {}, []

    def add(self, k, n):
        self.calls.append(("add", k))
        self.kv[k] = self.kv.get(k, 0) + n
        return self.kv[k]

    def multi_get(self, keys):
        self.calls.append(("multi_get", list(keys)))
        return [str(self.kv[k]).encode() for k in keys]


def test_counters_of_one_key_is_one_add_and_of_several_one_multi_get():
    st = _Store()
    ctl = control.Control(st, "c", T)
    ctl.add("a", 3)
    ctl.add("b", 4)
    st.calls.clear()
    assert ctl.counters(["a"]) == [3] and st.calls == [("add", "wxfer/c/a")]
    st.calls.clear()
    assert ctl.counters(["a", "b"]) == [3, 4] and st.calls == [("multi_get", ["wxfer/c/a", "wxfer/c/b"])]
    assert ctl.counters([]) == []


def test_links_read_each_lease_at_most_twice_a_period_and_pids_by_one_poll(store):
    """One worker on this host (its pid checked here) and one elsewhere (its lease the only
    sign), leases of 1 s: the first check reads the restart count and both leases in one
    round trip; a check within half a period the count alone (one add); after it, both leases
    again.  The near one killed is named by its pid at the next check, no lease read."""
    s, _ = store
    ctl = control.Control(s, "lnear", T)
    ctl.add("infer/rejoins", 0)
    ctl.add("lease/0/e0", 1)
    ctl.add("lease/1/e0", 1)
    p = _sleeper()
    try:
        near = _record(p, gpu=0, lease_s=1.0, replica=0, rank=0)
        far = dict(gpu=1, host="elsewhere", pid=1, start=1, pidns="x", lease_s=1.0, replica=1, rank=0)
        ln = Links(ctl, None, 0, None, None, {0: near, 1: far}, 30.0)
        calls, adds = [], []
        real_counters, real_add = ctl.counters, ctl.add
        ctl.counters = lambda keys: calls.append(list(keys)) or real_counters(keys)
        ctl.add = lambda k, n: adds.append(k) or real_add(k, n)
        ln.adopt_rejoins()
        assert calls == [["infer/rejoins", "lease/0/e0", "lease/1/e0"]] and ln.dead == {}
        calls.clear()
        adds.clear()
        ln.adopt_rejoins()
        assert calls == [["infer/rejoins"]] and adds == ["infer/rejoins"]  # one round trip
        time.sleep(0.6)
        calls.clear()
        ln.adopt_rejoins()
        assert calls == [["infer/rejoins", "lease/0/e0", "lease/1/e0"]]
        calls.clear()
        p.kill()
        p.wait(10)
        ln.adopt_rejoins()
        assert calls == [["infer/rejoins"]]  # no lease due: the pid alone names it
        assert list(ln.dead) == [0], ln.dead
        assert f"its process (pid {p.pid}) has exited" in ln.dead[0] and "no write failed" in ln.dead[0]
        ln.close()
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open")
def test_the_pid_waiter_reports_an_exit_at_once_and_stops_at_close():
    """PidWatch.wait_exits: a thread blocked in poll(2) on the bound pidfds calls back as soon
    as a process exits (once per exit, while its pidfd stays bound), sees pidfds bound after it
    started, and ends at close()."""

    a, b = _sleeper(), _sleeper()
    pw = _watch()
    hits = []
    try:
        assert pw.dead({0: _record(a)}) == {}
        assert pw.wait_exits(lambda: hits.append(time.monotonic())) and pw.waiting()
        assert pw.dead({0: _record(a), 1: _record(b)}) == {}  # b bound after the waiter started
        time.sleep(0.2)
        assert hits == []  # alive: nothing reported
        for p in (b, a):
            t0 = time.monotonic()
            p.kill()
            end = t0 + 5
            while len(hits) < (1 if p is b else 2) and time.monotonic() < end:
                time.sleep(0.002)
            assert hits and hits[-1] - t0 < 1.0, (hits, t0)
        time.sleep(0.2)
        assert len(hits) == 2 and pw.fired == 2  # once each, though their pidfds stay readable
        waiter = pw._waiter
        pw.close()
        waiter.join(5)
        assert not waiter.is_alive() and not pw.waiting()
    finally:
        pw.close()
        for p in (a, b):
            p.kill()
            p.wait(10)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open")
def test_a_push_reads_the_pid_waiters_flag_and_still_names_a_death_just_before_it(store, monkeypatch):
    """With the watcher (a long period: it does not look during the test) and the pid waiter, a
    push's start polls this host's pids only until they are all bound, then reads the flag;
    a worker killed just before a push is named by that push (the waiter's report, no watcher
    look, no write failing)."""
    s, _ = store
    ctl = control.Control(s, "lwait", T)
    ctl.add("infer/rejoins", 0)
    p = _sleeper()
    try:
        ln = Links(ctl, None, 0, None, None, {0: _record(p, gpu=0, replica=0, rank=0)}, 30.0)
        polls = []
        real = ln.pids.dead
        monkeypatch.setattr(ln.pids, "dead", lambda recs: polls.append(1) or real(recs))
        ln.start_watch(every=600.0)
        ln.adopt_rejoins()
        assert len(polls) == 1 and ln.pids.waiting()  # bound by the push's own check
        for _ in range(20):
            ln.adopt_rejoins()
        assert len(polls) == 1 and ln.dead == {}  # the flag alone
        p.kill()
        end = time.monotonic() + 5
        while ln.pids.fired == 0 and time.monotonic() < end:
            time.sleep(0.002)
        ln.adopt_rejoins()
        assert list(ln.dead) == [0] and f"pid {p.pid}" in ln.dead[0], ln.dead
        assert ln._looks == 0  # the watcher did not look: the waiter's report named it
        ln.close()
    finally:
        p.kill()
        p.wait(10)
