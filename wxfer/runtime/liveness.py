"""Whether an inference worker is alive, without a write having to fail (issue 25): over
cuda_ipc a dead worker's memory stays mapped and every copy into it succeeds.

Two signs, each cheap per push: on the worker's own host (and pid namespace) its process,
held by a pidfd bound to its start time (/proc/<pid>/stat field 22, read once, so that a
reused pid is not taken for it): one poll(2) for all of them tells which exited (``PidWatch``;
/proc read at each check where pidfds are refused); on any host a lease, a store counter the
worker's Python thread adds to every ``lease_s`` seconds (``Lease``), read by the trainers in
the one store round trip of the restart check (``Control.counters``), each at most twice a
period (``LeaseWatch.due``).  The count is a clock: the worker keeps it at 1 + (seconds since
it started) / lease_s, catching up after a late tick, so one reading tells how far behind it
is against the trainer's own clock since its first reading (durations only: no clocks
compared across hosts); the lease expired once it is max(write_timeout, 3 lease_s) behind."""

from __future__ import annotations

import atexit
import os
import select
import socket
import threading
import time
import weakref

from . import peerstate

LEASE_S = 1.0  # default seconds between a worker's lease renewals ($WXFER_LEASE_S)
RETRY_S = 0.02  # first wait before a failed lease renewal is retried (then doubled, at most the period)
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


def checkable_here(w: dict, host: str, pidns: str) -> bool:
    """Whether worker record `w`'s process can be checked from this process (`host`, `pidns`:
    this one's): the record gives its pid and start time, and it runs on this host in this pid
    namespace (a namespace /proc does not name is never taken for the same)."""
    return (
        w.get("start") is not None
        and w.get("pid") is not None
        and bool(pidns)
        and w.get("pidns") == pidns
        and w.get("host") == host
    )


def local_death(w: dict, host: str | None = None, pidns: str | None = None) -> str | None:
    """Why worker record `w` is dead, read on this host (None: alive, or not checkable here:
    another host or pid namespace, or a record without a start time)."""
    if w.get("start") is None or w.get("host") != (socket.gethostname() if host is None else host):
        return None
    if not checkable_here(w, w["host"], pid_namespace() if pidns is None else pidns):
        return None
    st = proc_start(w["pid"])
    if st is None:
        return f"its process (pid {w['pid']}) has exited"
    if st[1] != w["start"]:
        return f"its process (pid {w['pid']}) has exited (the pid now belongs to another process)"
    if st[0] in ("Z", "X"):
        return f"its process (pid {w['pid']}) has exited (a zombie)"
    return None


def _close_fds(fds: dict) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class PidWatch:
    """The processes of this host's workers, each held by a pidfd (Linux >= 5.3) bound to the
    start time its record gives: one poll(2) with no wait then tells which of them have exited
    (a zombie included), for any number of them, with no /proc read while they live.  A process
    whose pidfd cannot be had (no ``os.pidfd_open``, or refused: a seccomp filter) is read from
    /proc/<pid>/stat at each check instead (``local_death``).  Records of one process (workers
    in threads of one process) share its pidfd.  host, pidns: this process's."""

    def __init__(self, host: str, pidns: str):
        self.host, self.pidns = host, pidns
        self._fd: dict = {}  # (pid, start) -> its pidfd
        self._who: dict = {}  # pidfd -> ((pid, start), a record of that process)
        self._gone: dict = {}  # (pid, start) -> why it is dead
        self._slow: set = set()  # (pid, start) read from /proc at each check
        self._poll = select.poll() if hasattr(select, "poll") else None  # None: /proc reads only
        self._fin = weakref.finalize(self, _close_fds, self._fd)
        self._lk = threading.Lock()  # _fd / _who as the waiter thread reads them (wait_exits)
        self._waiter: threading.Thread | None = None  # the thread blocked in poll(2) on the pidfds
        self._wake_w = -1  # the write end of its wake pipe
        self._closed = False
        self.fired = 0  # exits the waiter reported

    def wait_exits(self, on_exit) -> bool:
        """Start a daemon thread blocked in poll(2) on these pidfds (the set as ``dead`` binds
        and releases them, a wake pipe telling it of each change) that calls ``on_exit()`` as
        soon as one becomes readable: its process exited.  A push then reads a flag instead of
        polling itself (issue 37: one poll(2) was 14 us of a push's start after an idle gap),
        and a death is still seen at once, not a watcher period later.  False: no poll(2)
        here.  ``on_exit`` runs on that thread and must only set a flag; a process seen exited
        is reported once (its pidfd stays readable until ``dead`` releases it)."""
        if self._poll is None or self._closed:
            return False
        if self._waiter is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._wake_w = w
            th = threading.Thread(target=self._wait_loop, args=(on_exit, r), daemon=True, name="wxfer-pidwait")
            self._waiter = th
            th.start()
        return True

    def waiting(self) -> bool:
        """Whether the waiter reports every process bound here (none read from /proc instead)."""
        return self._waiter is not None and not self._slow and not self._closed

    def _wait_loop(self, on_exit, r: int) -> None:
        fired: set = set()  # (pidfd, ident) reported: not polled again while bound
        while True:
            with self._lk:
                if self._closed:
                    break
                live = {(fd, who[0]) for fd, who in self._who.items()}
            fired &= live
            p = select.poll()
            p.register(r, select.POLLIN)
            for fd, ident in live - fired:
                p.register(fd, select.POLLIN)
            idents = dict(live - fired)
            for fd, ev in p.poll():
                if fd == r:
                    try:
                        while os.read(r, 64):
                            pass
                    except OSError:  # (BlockingIOError: drained)
                        pass
                elif not ev & select.POLLNVAL:  # (closed meanwhile: the set is made again)
                    fired.add((fd, idents[fd]))
                    self.fired += 1
                    on_exit()
        os.close(r)

    def _wake(self) -> None:
        with self._lk:  # (close() closes the pipe under it: never a write to a reused fd number)
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:  # (full: a wake is pending anyway)
                    pass

    def dead(self, records: dict) -> dict:
        """{key: why} of `records` ({key: worker record}, each ``checkable_here``) whose process
        has exited (a process seen exited stays so)."""
        for w in records.values():
            ident = (w["pid"], w["start"])
            if ident not in self._fd and ident not in self._gone and ident not in self._slow:
                self._bind(ident, w)
        if self._who:
            for fd, ev in self._poll.poll(0):
                self._exited(fd, ev)
        out = {}
        for k, w in records.items():
            ident = (w["pid"], w["start"])
            why = self._gone.get(ident)
            if why is None and ident in self._slow:
                why = local_death(w, self.host, self.pidns)
            if why is not None:
                out[k] = why
        return out

    def _bind(self, ident: tuple, w: dict) -> None:
        """A pidfd for the process of record `w`: opened first, then its start time read, so
        that a pid reused before the open is not taken for the worker."""
        if self._poll is None or not hasattr(os, "pidfd_open"):
            self._slow.add(ident)
            return
        try:
            fd = os.pidfd_open(int(ident[0]))
        except ProcessLookupError:
            self._gone[ident] = f"its process (pid {ident[0]}) has exited"
            return
        except OSError:  # refused here (ENOSYS, EPERM): /proc reads
            self._slow.add(ident)
            return
        why = local_death(w, self.host, self.pidns)
        if why is not None:
            os.close(fd)
            self._gone[ident] = why
            return
        with self._lk:
            self._fd[ident] = fd
            self._who[fd] = (ident, w)
        self._poll.register(fd, select.POLLIN)
        self._wake()

    def _release(self, ident: tuple) -> dict | None:
        with self._lk:
            fd = self._fd.pop(ident, None)
            if fd is None:
                return None
            _, w = self._who.pop(fd)
            self._poll.unregister(fd)
            os.close(fd)
        self._wake()
        return w

    def _exited(self, fd: int, ev: int) -> None:
        ident, _ = self._who[fd]
        w = self._release(ident)
        if ev & select.POLLNVAL:  # not a pidfd of ours any more: read /proc from now on
            self._slow.add(ident)
            return
        self._gone[ident] = local_death(w, self.host, self.pidns) or f"its process (pid {ident[0]}) has exited"

    def forget(self, w: dict) -> None:
        """Stop watching the process of record `w` (a worker replaced by its restart); another
        record of that process binds it again."""
        ident = (w.get("pid"), w.get("start"))
        self._release(ident)
        self._gone.pop(ident, None)
        self._slow.discard(ident)

    def close(self) -> None:
        for ident in list(self._fd):
            self._release(ident)
        self._wake()
        with self._lk:
            self._closed = True
            if self._wake_w >= 0:
                os.close(self._wake_w)  # (the waiter sees the pipe's end too)
                self._wake_w = -1


class LeaseWatch:
    """A trainer's view of its workers' leases: for each, a count and when it was read, the base
    against which a later count says how far behind the worker's lease is."""

    def __init__(self, write_timeout: float):
        self.write_timeout = float(write_timeout)
        self.seen: dict = {}  # gpu -> (count, monotonic time here it was read at)
        self.read_at: dict = {}  # gpu -> monotonic time here of its last reading

    def due(self, g: int, w: dict, now: float) -> bool:
        """Whether worker `g`'s lease is to be read at `now`: never read yet, or not for half its
        period.  Its count moves once a period and it expires only ``bound`` (>= 3 periods)
        behind, so a reading at every push would name an expired lease at most half a period
        sooner, at a store round trip per push (issue 26)."""
        last = self.read_at.get(g)
        return last is None or now - last >= 0.5 * float(w.get("lease_s") or LEASE_S)

    def bound(self, w: dict) -> float:
        return max(self.write_timeout, 3.0 * float(w.get("lease_s") or LEASE_S))

    def expired(self, g: int, w: dict, count: int, now: float | None = None) -> str | None:
        """Why worker `g`'s lease expired given its count now (None: it was renewed, or not
        for long enough to tell)."""
        now = time.monotonic() if now is None else now
        self.read_at[g] = now
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
        self.read_at.pop(g, None)


class Lease:
    """A worker's lease: a Python daemon thread adding to store key `key` so that it holds
    1 + (seconds since the lease started) / `interval` until ``stop()`` (native threads never
    call Python; this one is Python's own).  What the store holds is taken from each add's
    answer, so a late or failed add is caught up by the next one (an add that raised after it
    landed is not counted twice).  A store call that fails is retried with a backoff (from
    RETRY_S, doubling, at most `interval`) and the lease never stops while its owner lives: a
    store that is only slow or failing now and then leaves it at most the length of its stall
    behind (issue 35.1)."""

    def __init__(self, ctl, key: str, interval: float):
        self.ctl, self.key, self.interval = ctl, key, float(interval)
        self.ticks = 0  # adds that went through
        self.failures = 0  # adds that raised (each retried)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._offset = ctl.add(key, 1) - 1  # exists before the worker's record says where it is
        self.sent = 1  # what the store holds past _offset: the clock as last renewed
        self._thread = threading.Thread(target=self._run, name=f"wxfer-lease {key}", daemon=True)
        self._thread.start()
        _LEASES.add(self)

    def _run(self) -> None:
        back = 0.0  # > 0: the last add failed, retried after this many seconds
        while True:
            wait = back if back else self._t0 + self.sent * self.interval - time.monotonic()
            if self._stop.wait(max(0.0, wait)):
                return
            due = 1 + int((time.monotonic() - self._t0) / self.interval)  # the count as a clock
            if due <= self.sent:
                continue
            try:
                self.sent = self.ctl.add(self.key, due - self.sent) - self._offset
                self.ticks += 1
                back = 0.0
            except Exception:  # noqa: BLE001 -- the store is busy or gone: retried, the trainers judge
                self.failures += 1
                back = min(self.interval, 2 * back if back else RETRY_S)

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
    (one store round trip for all).  Each rank's verdict is a peerstate machine (``peers``): a
    lease read behind its bound makes the rank suspect, dead only if still behind a lease period
    later (a store stall delays every lease alike: the trainers renew as soon as it ends, issue
    35 finding 2); a rank dead by its lease alone is alive again when the lease renews (logged);
    one whose process exited stays dead."""

    def __init__(self, ctl, ranks, records: dict):
        self.ctl = ctl
        self.records = {r: w for r, w in records.items() if w is not None}
        self.ranks = [r for r in ranks if r in self.records]
        self.watch = {r: LeaseWatch(float(self.records[r].get("write_timeout") or 30.0)) for r in self.ranks}
        confirm = max([float(self.records[r].get("lease_s") or LEASE_S) for r in self.ranks] or [LEASE_S])
        self.peers = peerstate.Peers(lambda r: f"trainer rank {r}", confirm)
        host, pidns = socket.gethostname(), pid_namespace()
        self.local = {r: self.records[r] for r in self.ranks if checkable_here(self.records[r], host, pidns)}
        self.pids = PidWatch(host, pidns)  # those on this host: one poll of their pidfds per check

    @property
    def dead(self) -> dict:
        """{rank: why} of the ranks judged dead now."""
        return {r: self.peers.why.get(r, "") for r in sorted(self.peers.in_state(peerstate.State.DEAD))}

    def gone(self) -> dict:
        """{rank: why} of the writers dead by now; the store unreachable leaves the leases unread."""
        P, ev = self.peers, peerstate.Event
        local = {r: w for r, w in self.local.items() if P.get(r) is not peerstate.State.DEAD or P.lease_judged(r)}
        for r, why in (self.pids.dead(local) if local else {}).items():
            P.apply(r, ev.EXITED, why)
            P.apply(r, ev.GIVE_UP, why)
        lease = [r for r in self.ranks if self.records[r].get("lease_s") and P.lease_judged(r)]
        try:
            counts = self.ctl.counters([trainer_lease_key(r) for r in lease])
        except Exception:  # noqa: BLE001 -- the store is gone: state() says so by itself
            counts = []
        for r, c in zip(lease, counts):
            if P.on_lease(r, self.watch[r].expired(r, self.records[r], c)) is peerstate.State.FAILING:
                P.apply(r, ev.GIVE_UP)
        return self.dead
