"""Issue 25 item 1: a worker's death is seen without a write failing (wxfer.runtime.liveness):
its pid and process start time on its own host, its lease in the store on any host.  Real
processes and a real TCPStore; the Sender cells over fabric tcp (cuda_ipc's, on one GPU, are in
tests/test_liveness_gpu.py)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, preset_for
from wxfer.runtime import control, liveness
from wxfer.runtime.links import Links
from helpers import joined, receivers_in_threads  # tests/helpers.py

HERE = os.path.dirname(os.path.abspath(__file__))
T = 30.0
FABRIC = _wxfer.backends()["fabric"][0]
sys.path.insert(0, HERE)
import fault_worker  # noqa: E402
from test_faults import _assert_kept_and_restarted, _failing_push, _reap, _respawn, _scaled, _spawn  # noqa: E402


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _record(p):
    st = liveness.proc_start(p.pid)
    return dict(host=socket.gethostname(), pid=p.pid, start=st[1], pidns=liveness.pid_namespace())


def test_a_process_that_exits_is_seen_dead_by_pid_and_start_time():
    p = _sleeper()
    try:
        w = _record(p)
        assert liveness.local_death(w) is None
        # the same pid with another start time: a reused pid is not taken for the worker
        assert "belongs to another process" in liveness.local_death(dict(w, start=w["start"] - 1))
        # another host or pid namespace: not judged here (the lease is)
        assert liveness.local_death(dict(w, host="elsewhere")) is None
        assert liveness.local_death(dict(w, pidns="pid:[1]")) is None
        p.kill()
        deadline = time.monotonic() + 10
        while liveness.proc_start(p.pid)[0] != "Z":  # killed, not reaped yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "zombie" in liveness.local_death(w)
        p.wait(10)
        assert liveness.local_death(w) == f"its process (pid {p.pid}) has exited"
    finally:
        _reap([p])


def test_a_lease_expires_once_its_count_is_its_bound_behind_the_trainers_clock():
    lw = liveness.LeaseWatch(2.0)
    w = dict(lease_s=1.0, epoch=3)  # bound max(2, 3 x 1) = 3 s; the count: one a second
    assert lw.expired(5, w, 10, now=0.0) is None  # the base
    assert lw.expired(5, w, 12, now=2.5) is None  # 0.5 s behind
    assert lw.expired(5, w, 12, now=4.9) is None  # stopped at 2: 2.9 s behind
    why = lw.expired(5, w, 12, now=5.2)
    assert why is not None and "lease/5/e3" in why and "3.2 s" in why and "bound 3.0 s" in why
    # one reading is enough: renewed until a moment ago, then stopped, still seen behind
    assert lw.expired(6, w, 0, now=0.0) is None
    assert lw.expired(6, w, 3, now=6.5) is not None  # 3.5 s behind
    # a count ahead of the base (the base was read late) becomes the base
    assert lw.expired(7, w, 0, now=0.0) is None and lw.expired(7, w, 9, now=5.0) is None
    assert lw.seen[7] == (9, 5.0)
    lw.forget(5)
    assert lw.expired(5, w, 12, now=9.0) is None


def test_a_lease_thread_renews_the_key_until_stopped_and_links_read_it_with_the_restart_count(store):
    s, addr = store
    ctl = control.Control(s, "lease", T)
    lease = liveness.Lease(ctl, liveness.lease_key(1, 0), 0.05)
    try:
        assert ctl.counters(["lease/1/e0"]) == [1]  # exists before the record says where
        t0 = time.monotonic()
        time.sleep(0.4)
        # a clock: 1 + (seconds since it started) / 0.05
        assert abs(ctl.add("lease/1/e0", 0) - (1 + (time.monotonic() - t0) / 0.05)) <= 3
    finally:
        lease.stop()
    frozen = ctl.add("lease/1/e0", 0)
    time.sleep(0.2)
    assert ctl.add("lease/1/e0", 0) == frozen
    # Links: the lease read with the restart count in one round trip, expired past its bound
    ctl.add("infer/rejoins", 0)
    w = dict(gpu=1, host="elsewhere", pid=1, lease_s=0.05, replica=1, rank=0)
    ln = Links(ctl, None, 0, None, None, {1: w}, 0.3)
    ln.stamp_dest[1] = ln.begin_dest[1] = (b"x", 0, 0, 8)
    calls = []
    real = ctl.counters
    ctl.counters = lambda keys: calls.append(list(keys)) or real(keys)
    ln.adopt_rejoins()
    assert calls == [["infer/rejoins", "lease/1/e0"]] and ln.dead == {}
    time.sleep(0.45)
    ln.adopt_rejoins()  # behind its bound once: suspect (a store stall reads the same), still written
    assert ln.dead == {} and ln.states.get(1).name == "SUSPECT" and ln.skipped(_NoEngine()) == frozenset()
    time.sleep(0.06)  # still behind a lease period later: dead
    ln.adopt_rejoins()
    assert list(ln.dead) == [1] and "lease/1/e0) was not renewed" in ln.dead[1] and "no write failed" in ln.dead[1]
    assert ln.skipped(_NoEngine()) == frozenset({1})
    assert ln.failed(_NoEngine(), str) == {1: ln.dead[1]}


class _NoEngine:
    def failed_peers(self):
        return []


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
def test_a_worker_killed_between_pushes_is_named_by_its_pid_and_its_restart_taken(store, tmp_path):
    """Fabric tcp: a worker SIGKILLed and reaped between pushes is named at the next push by
    its pid (no write has to fail, no wait for write_timeout), the other one gets every byte;
    a new process for it registers and the push after takes it, bytes checked."""
    from wxfer.runtime.sender import Sender

    s, addr = store
    name = "lvk"
    procs = [_spawn("receiver", addr, name, q, 2, tmp_path) for q in range(2)]
    try:
        m = fault_worker.model()
        wt = 5.0
        sender = Sender(m, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=wt)
        sender.push()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        _scaled(m)
        took, msg = _failing_push(sender, "killed between pushes: push 2 failed")
        assert took < wt / 2, took
        assert f"its process (pid {procs[1].pid}) has exited" in msg and "no write failed" in msg, msg
        assert "inference worker gpu 1 (replica 1 rank 0," in msg, msg
        assert "the other workers ([0]) received every byte of step 2" in msg, msg
        ctl = _respawn(s, addr, name, procs, tmp_path)
        _scaled(m)
        sender.push()
        assert sender.stats()["rejoined"] == 1 and sender.links.dead == {}
        _assert_kept_and_restarted(ctl, m, tmp_path, 3)
        sender.close()
    finally:
        _reap(procs)


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
def test_a_worker_whose_lease_stops_is_skipped_and_named_without_a_write_failing(store, monkeypatch):
    """Fabric tcp, receivers in this process: worker gpu 1's lease stops (its process alive, its
    memory still answering: what a worker on another host, or one whose pid this trainer cannot
    read, looks like when it hangs); the first push past the lease's bound skips it and names
    it at once, the other gets every byte; nothing of that step is written to gpu 1."""
    from wxfer.runtime.sender import Sender

    monkeypatch.setenv("WXFER_LEASE_S", "0.1")
    s, addr = store
    name = "lvl"
    params, ths = receivers_in_threads(TINY, addr, name, 2, timeout=T)
    m = fault_worker.model()
    wt = 1.0
    sender = Sender(m, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=wt)
    recvs = joined(ths, T)
    try:
        for g, w in sender.links.workers.items():
            w["host"] = "elsewhere"  # judged by the lease alone
        sender.push()
        recvs[1].lease.stop()
        time.sleep(wt + 0.5)
        before = {n: t.clone() for n, t in params[1].items()}
        _scaled(m)
        took, msg = _failing_push(sender, "lease stopped: push 2 failed")
        assert took < wt, took
        assert "lease/1/e0) was not renewed" in msg and "inference worker gpu 1" in msg, msg
        assert "the other workers ([0]) received every byte of step 2" in msg, msg
        assert recvs[0].version() == 2 and recvs[1].version() == 1
        assert all(torch.equal(before[n], params[1][n]) for n in before)  # skipped: not written
        exp = {}
        from helpers import expected_shards  # tests/helpers.py

        for rank, dst, off, b in expected_shards(m, TINY, 2):
            exp.setdefault(rank, []).append((dst, off, b))
        for dst, off, b in exp[0]:
            assert torch.equal(params[0][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
    finally:
        sender.close()
        for r in recvs:
            r.close()


# ------------------------------------------------------------------ item 6: the writers' death
@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
@pytest.mark.parametrize("tp", [1, 2])
def test_a_worker_whose_only_writer_dies_between_pushes_is_told(store, tp):
    """The trainer (a real process, world 1) pushes step 1 and is SIGKILLed before step 2:
    every worker of the layout (TP 1, TP 2) raises TornError from wait_version(2) within its
    bound, and state() names the rank (its pid read on this host: no write, no record)."""
    s, addr = store
    name = "lvw%d" % tp
    params, ths = receivers_in_threads(TINY, addr, name, tp, timeout=T)
    p = _spawn("trainer", addr, name, 0)
    try:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL and "pushed 1" in out, out
        recvs = joined(ths, T)
        for r in recvs:
            assert r.version() == 1
            t0 = time.monotonic()
            with pytest.raises(_torn()) as ei:
                r.wait_version(2, 20)
            took = time.monotonic() - t0
            st = r.state()
            print(f"tp {tp} rank {r.rank}: TornError after {took:.2f} s: {ei.value}")
            assert took < 2.0, took
            assert st["state"] == "dropped" and st["ranks"] == [0] and st["version"] == 1 and st["final"], st
            assert f"trainer rank 0 (pid {p.pid}" in st["message"] and "has exited" in st["message"], st
        for r in recvs:
            r.close()
    finally:
        _reap([p])


def _torn():
    from wxfer.runtime.receiver import TornError

    return TornError


def test_writer_watch_sees_a_writer_by_its_lease_on_another_host(store):
    s, addr = store
    ctl = control.Control(s, "ww", T)
    key = liveness.trainer_lease_key(0)
    lease = liveness.Lease(ctl, key, 0.05)
    rec = dict(pid=1, host="elsewhere", start=1, pidns="x", lease_s=0.05, lease_key=key, write_timeout=0.3)
    ww = liveness.WriterWatch(ctl, [0, 1], {0: rec, 1: None})  # rank 1 published no record: not judged
    try:
        assert ww.ranks == [0] and ww.gone() == {}
        time.sleep(0.5)
        assert ww.gone() == {}  # renewed
    finally:
        lease.stop()
    time.sleep(0.5)
    assert ww.gone() == {} and ww.peers.get(0).name == "SUSPECT"  # behind once: suspect only
    time.sleep(0.06)  # still behind a lease period later: dead
    gone = ww.gone()
    assert list(gone) == [0] and f"store key {key}) was not renewed" in gone[0], gone
    ctl.add(key, 100)  # its lease renews again (it was stalled, not dead): the verdict is withdrawn
    assert ww.gone() == {} and ww.peers.get(0).name == "ALIVE"
