"""The inference workers one trainer rank writes (a Sender collaborator): their connection
records, the engine peer of each, where their version stamps are, which region descriptor is
whose, the workers this rank gave up on (skipped from then on), and a restarted worker taken at
the next push() without restarting the trainers (issue 8).

The seam for the reliability work (issue 25): what a peer is, when one counts as failed, and
how a restart is adopted are decided here and nowhere else.  Each worker's failure state is a
peerstate machine (``states``): alive, suspect (its lease read behind its bound once), failing
(found dead or its writes failed: named by the push), dead (skipped from then on), rejoining
(its restart being adopted).  The push thread makes every move that changes what is written;
the watcher only moves a worker between alive and suspect.

What changed between pushes is looked at by a watcher thread (issues 35.2, 37), every
WATCH_S seconds, during a push too: the restart count and the leases due (one store round
trip), this host's workers' pids (one poll).  A push then reads a flag: its start takes the
restarts whose records were complete (``adopt_rejoins``), and the deaths found, from when the
watcher's last look began; its end names the deaths found while it ran (``failed``)."""

from __future__ import annotations

import logging
import socket
import threading
import time

from . import control, liveness, program
from .peerstate import TABLE, Event, Peers, State
from .control import SetupError
from .param_desc import _unb64, decode_param_descriptor

WATCH_S = 0.1  # seconds between the watcher's looks (a restart waits at most this long for a push to see it)
WATCH_SILENT_S = 3.0  # a look that has not returned for this long is reported (the store stopped answering)
log = logging.getLogger(__name__)

PID_WAITER = True  # liveness.PidWatch.wait_exits from start_watch (False: a push polls the pidfds itself)


class Links:
    """This rank's inference workers and its connections to them.

    ctl: the job's Control; transport: the _wxfer.Transport the engine writes through; rank:
    this trainer rank; plan, program: the plan and this rank's program (a restart retargets
    them); workers: {gpu: connection record} of every worker this rank writes (data or
    stamp); write_timeout: the bound of a restart's store reads and connection."""

    def __init__(self, ctl, transport, rank: int, plan, program, workers: dict, write_timeout: float):
        self.ctl, self.transport, self.rank = ctl, transport, rank
        self.plan, self.program = plan, program
        self.write_timeout = float(write_timeout)
        self.workers = dict(workers)  # gpu -> its record (the connection record; a restart's whole one)
        self.peers: dict = {}  # gpu -> engine peer id
        self.gpu_of_peer: dict = {}  # engine peer id -> gpu
        self.gpu_of_region: dict = {}  # region descriptor -> gpu
        self.stamp_dest: dict = {}  # gpu -> this rank's end stamp destination
        self.begin_dest: dict = {}  # gpu -> this rank's begin stamp destination
        self.epoch = {g: 0 for g in self.workers}  # gpu -> the restart epoch written
        self.states = Peers(self.worker_name)  # gpu -> its failure state (peerstate.py)
        self.refused: dict = {}  # gpu -> why its restarted worker was not taken (reported once)
        self.rejoins_seen = 0  # the store's restart count at the last check
        self.rejoined = 0  # restarted workers taken so far
        self.leases = liveness.LeaseWatch(self.write_timeout)
        self.failed_in_engine: set = set()  # dead gpus whose engine peer was failed (fail_dead)
        self.on_adopt: list = []  # callables(gpu, old regions) run when a restart replaces a worker
        self._host, self._pidns = socket.gethostname(), liveness.pid_namespace()  # this process's
        self.pids = liveness.PidWatch(self._host, self._pidns)  # this host's workers' processes
        # the watcher (start_watch): what it found, under _mu, for the push thread to take
        self._mu = threading.RLock()
        self._news = False  # something below for the next push (the one flag a push reads)
        self._found: dict = {}  # gpu -> (EXITED or EXPIRED, why), found by a look, for the push to apply
        self._pending: dict = {}  # gpu -> epoch of a restart whose record is complete
        self._looks = 0  # looks finished (``sync``)
        self._looked = threading.Condition(self._mu)
        self._stop = threading.Event()
        self._watcher = None
        self._any_local = None  # _local_pids, until a restart is taken
        # whether a push's start checks this host's pids itself: until one check has bound every
        # worker to the pid waiter (liveness.PidWatch.wait_exits), after a restart taken, and
        # once the waiter reports an exit
        self._pids_dirty = True
        self.watch_error = None  # the last look's failure (the store unreachable), None once one passes
        self._look_since = None  # when the look in progress began (monotonic), None between looks
        self._said = None  # the watcher trouble last reported (watch_trouble), None when none
        self._say_mu = threading.Lock()  # _said's read-and-replace (say_watch: the watcher and the push)

    # ------------------------------------------------------------------ setup
    def connect(self) -> None:
        """Connect to every worker (all requests first, then the replies); learn where this
        rank's stamp slots are and which region is whose."""
        senders = program.receivers_of(self.plan)
        for g, w in self.workers.items():
            self.peers[g] = control.writer_request(self.ctl, self.transport, self.rank, g, _unb64(w["export"]))
        for g, w in self.workers.items():
            control.writer_finish(self.ctl, self.transport, self.rank, g, self.peers[g])
            slot = 8 * senders[g].index(self.rank)
            self.stamp_dest[g] = (_unb64(w["stamp"]), slot, 0, 8)
            self.begin_dest[g] = (_unb64(w["stamp"]), w["stamp_begin"] + slot, 0, 8)
        self.gpu_of_peer.update((pid, g) for g, pid in self.peers.items())
        # the counters each push reads in one round trip exist from now on (a read of a key not
        # there waits for it): the restart count, and every worker's lease (made by it already)
        self.ctl.add("infer/rejoins", 0)
        self.gpu_of_region.update(
            (decode_param_descriptor(d)[0], g) for (g, _), d in self.plan.descriptors.items() if g in self.workers
        )

    # ------------------------------------------------------------------ failed and live
    @property
    def dropped(self) -> set:
        """The workers this rank gave up on (skipped from then on): DEAD."""
        with self._mu:
            return self.states.in_state(State.DEAD)

    @property
    def dead(self) -> dict:
        """{gpu: why} of the workers found dead (liveness.py: their pid or their lease), not by
        a write: failing or dead on EXITED or EXPIRED."""
        with self._mu:
            st = self.states
            return {
                g: st.why.get(g, "")
                for g, c in list(st.cause.items())
                if c in (Event.EXITED, Event.EXPIRED) and st.get(g) in (State.FAILING, State.DEAD)
            }

    def live(self) -> set:
        """The workers this rank still writes (not given up on)."""
        return set(self.workers) - self.dropped

    def failed(self, engine, describe) -> dict:
        """{gpu: reason} of the receivers whose writes failed or were late in `engine` (it
        skips them from then on), or found dead (``adopt_rejoins``; their pids checked again
        here, one poll: a worker killed inside the push; and what the watcher found while the push
        ran); `describe(err)` words an engine error."""
        with self._mu:
            self._check_pids(self._found)
            self._take_found()
            out = {}
            for err in engine.failed_peers():
                if err.peer not in self.gpu_of_peer:
                    continue  # a worker since replaced by its restart
                g = self.gpu_of_peer[err.peer]
                out[g] = f"{describe(err)} (errno {err.errno})"
                self.states.apply(g, Event.WRITE_FAILED, out[g])
        for g, why in self.dead.items():  # the cause, not the writes it made fail (or fail_dead's words)
            if g in self.workers:
                out[g] = why
        return out

    def fail_dead(self, engine) -> None:
        """Have `engine` fail the peers of the workers found dead (``dead``): an external task
        to each one's begin stamp, completed with ESRCH and the reason, so that the engine
        skips every write to it from now on (isolate) as it does for a peer whose write failed."""
        if not self.dead:
            return
        import errno

        for g in sorted(self.dead):
            if g in self.failed_in_engine or g not in self.begin_dest:
                continue
            self.failed_in_engine.add(g)
            try:
                tid = engine.submit_external([self.begin_dest[g]])
                engine.complete_external(tid, errno.ESRCH, self.dead[g])
            except Exception as e:  # noqa: BLE001 -- still skipped here and named by this push
                self.states.why[g] = self.states.why.get(g, "") + f" (the engine was not told: {type(e).__name__}: {e})"

    def drop(self, gpus) -> set:
        """Give up on `gpus` (each failing, or dead already: skipped from now on); returns those
        not given up on before."""
        with self._mu:
            return {g for g in gpus if self.states.get(g) is not self.states.apply(g, Event.GIVE_UP)}

    def skipped(self, engine) -> frozenset:
        """The gpus not to write now: given up on here, or failed in `engine`."""
        with self._mu:
            gone = self.states.in_state(State.FAILING, State.DEAD)
        for err in engine.failed_peers():
            if err.peer in self.gpu_of_peer:
                gone.add(self.gpu_of_peer[err.peer])
        return frozenset(gone)

    def close(self) -> None:
        """The watcher stopped, the pidfds of this host's workers closed (the Sender's close())."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        with self._mu:
            self.pids.close()

    def take_refused(self) -> dict:
        """{gpu: why} of the restarts refused since the last call (each reported once)."""
        out, self.refused = self.refused, {}
        return out

    def worker_name(self, g: int) -> str:
        w = self.workers.get(g, {})
        return (
            f"inference worker gpu {g} (replica {w.get('replica')} rank {w.get('rank')}, "
            f"{w.get('host')} pid {w.get('pid')})"
        )

    def peer_name(self, peer) -> str | None:
        """The worker an engine peer id is, or None (not one of this rank's now)."""
        return self.worker_name(self.gpu_of_peer[peer]) if peer in self.gpu_of_peer else None

    # ------------------------------------------------------------------ alive
    def _local(self, w: dict) -> bool:
        """Whether worker record `w`'s process is checked here by its pid (this host and pid
        namespace)."""
        return liveness.checkable_here(w, self._host, self._pidns)

    def _lease_gpus(self, now: float) -> list:
        """The workers whose lease is read at `now`: those not given up on, with a lease, not
        read for half its period (LeaseWatch.due)."""
        return [
            g
            for g in sorted(self.workers)
            if self.states.get(g) in (State.ALIVE, State.SUSPECT)
            and self.workers[g].get("lease_s")
            and self.leases.due(g, self.workers[g], now)
        ]

    @property
    def _local_pids(self) -> bool:
        """Whether any worker is checked here by its pid (this host, this pid namespace); kept
        until a restart is taken."""
        if self._any_local is None:
            self._any_local = any(self._local(w) for w in self.workers.values())
        return self._any_local

    def _check_pids(self, into: dict) -> None:
        """Into `into`: the live workers of this host whose process is gone (one poll(2) of their
        pidfds: liveness.PidWatch; /proc reads where pidfds are not to be had).  Under _mu."""
        local = {
            g: w
            for g, w in self.workers.items()
            if self.states.get(g) in (State.ALIVE, State.SUSPECT) and g not in into and self._local(w)
        }
        if local:
            for g, why in self.pids.dead(local).items():
                into[g] = (Event.EXITED, f"{why} (seen by trainer rank {self.rank}; no write failed)")

    def _check_leases(self, lease: list, counts: list, into: dict) -> None:
        """Into `into`: the workers `lease` whose lease expired, given their `counts` now: a
        lease behind its bound makes its worker suspect (the watcher's own move), one still
        behind a lease period later is found (EXPIRED, for the push to apply).  Under _mu."""
        now = time.monotonic()
        for g, c in zip(lease, counts):
            if self.states.get(g) not in (State.ALIVE, State.SUSPECT) or g in into:
                continue
            w = self.workers[g]
            why = self.leases.expired(g, w, c, now)
            ev = self.states.lease_event(g, why, now, float(w.get("lease_s") or liveness.LEASE_S))
            why = None if why is None else f"{why} (seen by trainer rank {self.rank}; no write failed)"
            if ev is Event.EXPIRED:
                into[g] = (ev, why)
            elif ev is not None:
                self.states.apply(g, ev, why or "", now)

    def _take_found(self) -> None:
        """The deaths the looks found, applied (the push thread's; under _mu)."""
        for g, (ev, why) in self._found.items():
            if g in self.workers and (self.states.get(g), ev) in TABLE:  # (not one adopted since)
                self.states.apply(g, ev, why)
        self._found.clear()

    # ------------------------------------------------------------------ the watcher
    def start_watch(self, every: float = WATCH_S) -> None:
        """Look every `every` seconds in a daemon thread until close(); a push then reads a flag.
        With ``PID_WAITER`` (on) a thread blocked in poll(2) on this host's workers' pidfds sets
        the flag at once."""
        if PID_WAITER:
            self.pids.wait_exits(self._pid_exited)  # a death of this host's workers: the flag at once
        self._watcher = threading.Thread(target=self._watch, args=(float(every),), daemon=True)
        self._watcher.name = f"wxfer-links rank {self.rank}"
        self._watcher.start()

    def _pid_exited(self) -> None:
        """The pid waiter's report (its thread): a process of this host's workers exited; the
        next push's start checks the pids (``adopt_rejoins``)."""
        self._pids_dirty = True
        self._news = True

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            self._look_since = time.monotonic()
            try:
                self.look()
                self.watch_error = None
            except Exception as e:  # noqa: BLE001 -- the store busy or gone: looked at again
                self.watch_error = f"{type(e).__name__}: {e}"
            self._look_since = None
            self.say_watch()

    def watch_trouble(self) -> str | None:
        """Why the watcher sees nothing now (None: its looks pass): the store failed its last
        look, or a look has not returned for WATCH_SILENT_S (the store stopped answering)."""
        since = self._look_since
        if since is not None and time.monotonic() - since > WATCH_SILENT_S:
            return f"the store has not answered its look for {time.monotonic() - since:.1f} s"
        if self.watch_error is not None:
            return f"its last store look failed: {self.watch_error}"
        return None

    def say_watch(self) -> None:
        """Log the watcher's trouble once when it begins, and once when it ends (a few
        attribute reads when nothing changed: each push's start calls it).  The watcher thread
        and the push thread both call it: what was said is read and replaced under _say_mu, so
        one change is logged once."""
        trouble = self.watch_trouble()
        if (trouble is None) == (self._said is None):
            return
        with self._say_mu:
            before = self._said
            if (trouble is None) == (before is None):
                return  # the other thread said it
            self._said = trouble
        if trouble is not None:
            log.warning(
                "wxfer: trainer rank %d: the watcher of restarts and worker leases is blind: %s; pushes go "
                "on, but a restarted worker is not taken and a dead remote worker is not seen before a "
                "write to it fails, until the store answers",
                self.rank,
                trouble,
            )
        else:
            log.warning("wxfer: trainer rank %d: the watcher reads the store again (%s before)", self.rank, before)

    def look(self) -> None:
        """One look: which workers are dead (their pids here, one poll; their leases, each at
        most twice a period, read with the restart count in one store round trip: with none due,
        the count alone is one ``add``), and which restarts have a complete record (the
        restart count moved: each worker's epoch, and its record's presence).  The store is
        read outside _mu: a slow store never holds a push's own use of what was found."""
        with self._mu:
            lease = self._lease_gpus(time.monotonic())
            epochs = {g: self.workers[g].get("epoch", 0) for g in lease}
        keys = ["infer/rejoins"] + [liveness.lease_key(g, epochs[g]) for g in lease]
        counts = self.ctl.counters(keys)
        with self._mu:
            fresh = [(g, c) for g, c in zip(lease, counts[1:]) if self.workers[g].get("epoch", 0) == epochs[g]]
            self._check_leases([g for g, _ in fresh], [c for _, c in fresh], self._found)
            self._check_pids(self._found)
        if counts[0] != self.rejoins_seen:
            self._scan_restarts(counts[0])
        with self._mu:
            if self._found or self._pending:
                self._news = True
            self._looks += 1
            self._looked.notify_all()

    def _scan_restarts(self, n: int) -> None:
        """The workers restarted (epoch past the one written) whose record is complete, pending
        for the next push, each acknowledged to the worker (``rejoin/seen/<gpu>/e<epoch>``: it
        then writes ``infer/<gpu>/e<epoch>``, after which every push of this rank takes it); the
        count `n` taken as seen once none is still being written."""
        complete = True
        for g in sorted(self.workers):
            e = self.ctl.add("infer/epoch/%d" % g, 0)
            if e <= max(self.epoch[g], self._pending.get(g, 0)):
                continue
            if not self.ctl.check("infer/%d/e%d/meta" % (g, e)):  # written before the count moves
                complete = False  # registering now: looked at again
                continue
            with self._mu:
                if e > max(self.epoch[g], self._pending.get(g, 0)):
                    self._pending[g] = e
            self.ctl.add("rejoin/seen/%d/e%d" % (g, e), 1)  # the worker waits for every writer's
        if complete:
            self.rejoins_seen = n

    def sync(self, timeout: float = 5.0) -> bool:
        """Wait (bounded) for a look that begins after this call to end: what was in the store
        before it is then what the next push takes.  With no watcher, look now."""
        if self._watcher is None:
            self.look()
            return True
        with self._mu:
            want = self._looks + 2  # the look under way (if any) may have begun before the call
            return self._looked.wait_for(lambda: self._looks >= want, timeout)

    # ------------------------------------------------------------------ restarts
    def adopt_rejoins(self) -> None:
        """At a push's start: take what the watcher found (one flag read when nothing was;
        with no watcher, a look first): the deaths, into `dead`; the restarts with a complete
        record: connect to each, point this rank's destinations for it at its new memory
        (whether or not the one it replaces was seen failing); every other worker keeps its
        plan.  A restart that does not match the worker it replaces is refused (it stays
        skipped, and the push reports it)."""
        if self._watcher is None:
            self.look()
        else:
            self.say_watch()
            # this host's workers: the pid waiter's flag, or (until it watches them all, and
            # after it reported an exit) one poll(2) here: a death just before the push is seen
            if self._local_pids and (self._pids_dirty or not self.pids.waiting()):
                with self._mu:
                    self._pids_dirty = False
                    self._check_pids(self._found)
                    self._news = self._news or bool(self._found)
        if not self._news:
            return
        with self._mu:
            self._news = False
            if self._pids_dirty and self._local_pids:  # (the waiter fired meanwhile)
                self._pids_dirty = False
                self._check_pids(self._found)
            self._take_found()
            pending, self._pending = self._pending, {}
            for g, e in sorted(pending.items()):
                if e <= self.epoch[g]:
                    continue
                self.epoch[g] = e
                try:
                    self._adopt(g, e)  # REJOINING, then ALIVE once its memory is this rank's target
                    self.refused.pop(g, None)
                except Exception as ex:  # noqa: BLE001 -- reported by this push, the others go on
                    why = f"{type(ex).__name__}: {ex}"
                    self.refused[g] = f"its restart (epoch {e}) was refused: {why}"
                    self.ctl.set("rejoin/refused/%d/e%d" % (g, e), f"trainer rank {self.rank}: {why}")

    def _adopt(self, g: int, e: int) -> None:
        """Take worker `g`'s restart of epoch `e`.  Everything that can fail (its record read,
        checked and decoded, its connection) comes before the first change: a refused restart
        leaves the worker in place, its state and this rank's plan as they were."""
        old = self.workers[g]
        if "params" not in old:  # the connection record of setup: the worker's whole record, from the store
            old = self.ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", self.write_timeout)
        # bounded by write_timeout: a restarted worker that died again must not stall the push longer
        w = self.ctl.get_json(
            "infer/%d/e%d/meta" % (g, e), f"metadata of restarted inference worker gpu {g}", self.write_timeout
        )
        rec = _restart_record(g, e, w)
        probs = _mismatches(old, w)
        slot = self.stamp_dest[g][1] // 8
        if w["stamp_slots"] <= slot:
            probs.append(f"{w['stamp_slots']} version stamp slots, trainer rank {self.rank} needs slot {slot}")
        if probs:
            raise SetupError(
                f"restarted inference worker gpu {g} ({w['host']} pid {w['pid']}) does not match "
                "the one it replaces:\n    " + "\n    ".join(probs)
            )
        peer = control.writer_connect(
            self.ctl, self.transport, self.rank, g, rec["export"], self.write_timeout, epoch=e
        )
        # the new worker's memory: its descriptors into the plan, this rank's tasks for it
        for name, d in rec["desc"].items():
            self.plan.descriptors[(g, name)] = d
        self.program.retarget(self.plan, g)
        for r in _regions(old):
            self.gpu_of_region.pop(r, None)
        self.gpu_of_region.update((r, g) for r in rec["regions"])
        self.states.apply(g, Event.REJOIN, f"restarted (epoch {e})")
        self.gpu_of_peer.pop(self.peers[g], None)  # the old peer's writes (if any) stay abandoned
        self.peers[g] = peer
        self.gpu_of_peer[peer] = g
        off = self.stamp_dest[g][1]
        self.stamp_dest[g] = (rec["stamp"], off, 0, 8)
        self.begin_dest[g] = (rec["stamp"], w["stamp_begin"] + off, 0, 8)
        self.workers[g] = w
        self._any_local = None
        self._pids_dirty = True
        # the worker replaced is forgotten: failed, dead or not, the new one is written from now on
        self.states.apply(g, Event.ADOPTED)
        self.failed_in_engine.discard(g)
        self.leases.forget(g)
        self.pids.forget(old)
        for hook in self.on_adopt:
            hook(g, _regions(old))
        self.rejoined += 1


# the fields of a restart's record (Receiver._publish_restart) that its adoption reads, and their types
_RESTART_FIELDS = {
    "host": str,
    "pid": int,
    "params": dict,
    "desc": dict,
    "export": str,
    "stamp": str,
    "stamp_begin": int,
    "stamp_slots": int,
}


def _restart_record(g: int, e: int, w) -> dict:
    """Restart record `w` of worker `g` (epoch `e`) checked and decoded: {export, stamp: bytes,
    desc: {name: bytes}, regions: set}; SetupError naming each field missing, of the wrong type
    or not decodable (nothing is changed before it is read whole)."""
    if not isinstance(w, dict):
        raise SetupError(
            f"restarted inference worker gpu {g}: its record (epoch {e}) is a {type(w).__name__}, not a dict"
        )
    bad = [
        f"{k} {'missing' if k not in w else f'is a {type(w[k]).__name__}, not a {t.__name__}'}"
        for k, t in _RESTART_FIELDS.items()
        if not isinstance(w.get(k), t) or (t is int and isinstance(w[k], bool))
    ]
    rec = {"desc": {}, "regions": set()}
    for k in ("export", "stamp") if not bad else ():
        try:
            rec[k] = _unb64(w[k])
        except ValueError as ex:
            bad.append(f"{k} is not base64 ({ex})")
    for name, d in w["desc"].items() if not bad else ():
        try:
            rec["desc"][name] = _unb64(d)
            rec["regions"].add(decode_param_descriptor(rec["desc"][name])[0])
        except (ValueError, TypeError, AttributeError) as ex:
            bad.append(f"desc of {name}: {ex}")
    if bad:
        raise SetupError(
            f"restarted inference worker gpu {g}: its record (infer/{g}/e{e}/meta) is malformed: " + "; ".join(bad)
        )
    return rec


def _mismatches(old: dict, w: dict) -> list:
    """How restarted worker record `w` differs from the one it replaces (`old`)."""
    probs = []
    for k in ("transport", "options", "mapping", "replicas", "tp", "replica", "rank", "ep"):
        if w.get(k) != old.get(k):
            probs.append(f"{k} {w.get(k)!r}, before {old.get(k)!r}")
    for name in sorted(set(old["params"]) | set(w["params"])):
        a, b = old["params"].get(name), w["params"].get(name)
        if a != b:
            probs.append(
                f"{name}: "
                + ("missing" if b is None else "not in the plan" if a is None else f"shape/dtype {b}, the plan has {a}")
            )
    return probs


def _regions(worker: dict) -> set:
    """The region descriptors of an inference worker's published parameter descriptors."""
    return {decode_param_descriptor(_unb64(d))[0] for d in worker["desc"].values()}
