"""Whether an inference worker is alive, without a write having to fail (issue 25): over
cuda_ipc a dead worker's memory stays mapped and every copy into it succeeds.

Two signs, each cheap per push: on the worker's own host (and pid namespace) its pid and its
process start time (/proc/<pid>/stat field 22, so that a reused pid is not taken for it), a
local read; on any host a lease, a store counter the worker's Python thread adds to every
``lease_s`` seconds (``Lease``), read by the trainers for all their workers in the one store
round trip of the restart check (``Control.counters``).  The count is a clock: the worker keeps
it at 1 + (seconds since it started) / lease_s, catching up after a late tick, so one reading
tells how far behind it is against the trainer's own clock since its first reading (durations
only: no clocks compared across hosts); the lease expired once it is max(write_timeout,
3 lease_s) behind."""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref

LEASE_S = 1.0  # default seconds between a worker's lease renewals ($WXFER_LEASE_S)
LEASE_TRIES = 3  # store failures in a row after which a lease stops (its store is gone: so are its readers)
_LEASES: weakref.WeakSet = weakref.WeakSet()  # the running ones, stopped at interpreter exit


@atexit.register
def _stop_all() -> None:
    for lease in list(_LEASES):
        lease.stop(1.0)


def lease_key(gpu: int, epoch: int) -> str:
    return "lease/%d/e%d" % (gpu, epoch)


def lease_interval(env=os.environ) -> float:
    v = env.get("WXFER_LEASE_S")
    try:
        s = float(v) if v else LEASE_S
    except ValueError:
        raise ValueError(f"wxfer: $WXFER_LEASE_S must be seconds (a number > 0), got {v!r}") from None
    if not s > 0:
        raise ValueError(f"wxfer: $WXFER_LEASE_S must be seconds (a number > 0), got {v!r}")
    return s


def pid_namespace() -> str:
    """This process's pid namespace ('' where /proc does not say)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def proc_start(pid: int) -> tuple:
    """(state letter, start time in clock ticks since boot) of process `pid` from
    /proc/<pid>/stat (fields 3 and 22), or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = raw.rpartition(")")[2].split()  # the command name may hold spaces and ')'
    if len(rest) < 20:
        return None
    return rest[0], int(rest[19])


def identity() -> dict:
    """What a worker publishes so that a trainer on its host can tell whether it still runs."""
    me = proc_start(os.getpid())
    return dict(pid=os.getpid(), start=None if me is None else me[1], pidns=pid_namespace())


def local_death(w: dict, host: str | None = None, pidns: str | None = None) -> str | None:
    """Why worker record `w` is dead, read on this host (None: alive, or not checkable here:
    another host or pid namespace, or a record without a start time)."""
    if w.get("start") is None or w.get("pid") is None:
        return None
    if w.get("host") != (socket.gethostname() if host is None else host):
        return None
    if not w.get("pidns") or w.get("pidns") != (pid_namespace() if pidns is None else pidns):
        return None
    st = proc_start(w["pid"])
    if st is None:
        return f"its process (pid {w['pid']}) has exited"
    if st[1] != w["start"]:
        return f"its process (pid {w['pid']}) has exited (the pid now belongs to another process)"
    if st[0] in ("Z", "X"):
        return f"its process (pid {w['pid']}) has exited (a zombie)"
    return None


class LeaseWatch:
    """A trainer's view of its workers' leases: for each, a count and when it was read, the base
    against which a later count says how far behind the worker's lease is."""

    def __init__(self, write_timeout: float):
        self.write_timeout = float(write_timeout)
        self.seen: dict = {}  # gpu -> (count, monotonic time here it was read at)

    def bound(self, w: dict) -> float:
        return max(self.write_timeout, 3.0 * float(w.get("lease_s") or LEASE_S))

    def expired(self, g: int, w: dict, count: int, now: float | None = None) -> str | None:
        """Why worker `g`'s lease expired given its count now (None: it was renewed, or not
        for long enough to tell)."""
        now = time.monotonic() if now is None else now
        step = float(w.get("lease_s") or LEASE_S)
        base = self.seen.get(g)
        if base is None or count - base[0] > (now - base[1]) / step:
            self.seen[g] = (count, now)  # the first reading, or one ahead of the base: a tighter base
            return None
        behind = (now - base[1]) - (count - base[0]) * step
        if behind <= self.bound(w):
            return None
        key = w.get("lease_key") or lease_key(g, w.get("epoch", 0))
        return (
            f"its lease (store key {key}) was not renewed for {behind:.1f} s "
            f"(bound {self.bound(w):.1f} s: max(write_timeout, 3 x its lease_s {w.get('lease_s')}))"
        )

    def forget(self, g: int) -> None:
        self.seen.pop(g, None)


class Lease:
    """A worker's lease: a Python daemon thread adding 1 to store key `key` every `interval`
    seconds until ``stop()`` (native threads never call Python; this one is Python's own).
    A store that fails is retried at the next tick (the trainers see the lease age meanwhile);
    LEASE_TRIES failures in a row stop it (the store, hosted by a trainer, is gone)."""

    def __init__(self, ctl, key: str, interval: float):
        self.ctl, self.key, self.interval = ctl, key, float(interval)
        self.ticks = 0
        self._stop = threading.Event()
        ctl.add(key, 1)  # exists before the worker's record says where it is
        self._thread = threading.Thread(target=self._run, name=f"wxfer-lease {key}", daemon=True)
        self._thread.start()
        _LEASES.add(self)

    def _run(self) -> None:
        t0, sent, fails = time.monotonic(), 1, 0
        while not self._stop.wait(max(0.0, t0 + sent * self.interval - time.monotonic())):
            due = 1 + int((time.monotonic() - t0) / self.interval)  # the count as a clock: late ticks caught up
            try:
                self.ctl.add(self.key, due - sent)
                sent, fails = due, 0
                self.ticks += 1
            except Exception:  # noqa: BLE001 -- the store is gone or busy: the trainers judge
                fails += 1
                if fails >= LEASE_TRIES:
                    return
                sent = due  # not retried at once: the next tick catches up

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def trainer_lease_key(rank: int) -> str:
    return "train/%d/lease" % rank


class WriterWatch:
    """A worker's view of the trainer ranks that write it (issue 25 item 6): each one's record
    (``train/<rank>/who``: pid, start time, host, pid namespace, lease_s, write_timeout) read
    once; ``gone()`` says which died, by their pids on this host (local reads) and their leases
    (one store round trip for all).  A rank seen gone stays gone."""

    def __init__(self, ctl, ranks, records: dict):
        self.ctl = ctl
        self.records = {r: w for r, w in records.items() if w is not None}
        self.ranks = [r for r in ranks if r in self.records]
        self.watch = {r: LeaseWatch(float(self.records[r].get("write_timeout") or 30.0)) for r in self.ranks}
        self.dead: dict = {}  # rank -> why

    def gone(self) -> dict:
        """{rank: why} of the writers dead by now; the store unreachable leaves the leases unread."""
        for r in self.ranks:
            if r not in self.dead:
                why = local_death(self.records[r])
                if why is not None:
                    self.dead[r] = why
        lease = [r for r in self.ranks if r not in self.dead and self.records[r].get("lease_s")]
        try:
            counts = self.ctl.counters([trainer_lease_key(r) for r in lease])
        except Exception:  # noqa: BLE001 -- the store is gone: state() says so by itself
            counts = []
        for r, c in zip(lease, counts):
            why = self.watch[r].expired(r, self.records[r], c)
            if why is not None:
                self.dead[r] = why
        return dict(self.dead)
