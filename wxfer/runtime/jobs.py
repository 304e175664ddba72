"""A job id and a generation in the store: setup under a reused name (issue 25.5).

A store that outlives a trainer job (one the user hosts) kept that job's records under the
job's name: a new trainer job under the same name planned on them (dead workers' metadata)
and failed only at its first push, or, with the old receivers alive, wrote into them with
no handshake of its own and versions starting again at 1.

Now every trainer job claims a *generation* of its name: the store counter key
``wxfer/<name>/gen`` says which is current, and generation N's records live under
``wxfer/<name>/`` (N = 0, the layout of before) or ``wxfer/<name>/g<N>/``.  Trainer rank 0
writes the job's record there (``job``: a fresh job id, host, pid) and renews its lease
(``job/lease``, a counter a daemon thread adds to every LEASE_S) while its process lives.

- Trainer rank 0 finding the current generation held by another job: alive (its lease moves
  within STALE_S) -> refused, naming it; not alive -> it opens the next generation, so
  nothing of the old job is read and no old receiver is written (they never registered in
  this job).  Every trainer rank uses rank 0's generation.
- A receiver finding the current generation held by a job that is not alive opens the next
  one too (whichever of a receiver and a trainer comes first: ``compare_set``), so receivers
  of the new job and its trainers meet in one generation; a receiver of a live job (a
  restart) registers in that job's generation, as before.

The counter and the lease are not covered by the job secret (like every counter: a forged
value can stall or fail setup, not redirect a write).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

from . import control
from .control import Control, SetupError

LEASE_S = 0.25
STALE_S = 3.0


def _gen_key(name: str) -> str:
    return "wxfer/%s/gen" % name


def namespace(name: str, gen: int) -> str:
    """The Control name of generation `gen` of `name`."""
    return name if gen == 0 else "%s/g%d" % (name, gen)


def current(store, name: str) -> int:
    return int(store.compare_set(_gen_key(name), "", "0").decode() or 0)


def advance(store, name: str, gen: int) -> int:
    """Open the generation after `gen` (or the one someone else already opened)."""
    return int(store.compare_set(_gen_key(name), str(gen), str(gen + 1)).decode())


def job_alive(ctl: Control, wait: float | None = None) -> bool:
    """Whether the trainer job holding `ctl`'s generation renews its lease within `wait`
    (default STALE_S)."""
    wait = STALE_S if wait is None else wait
    first = ctl.add("job/lease", 0)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(LEASE_S / 2)
        if ctl.add("job/lease", 0) != first:
            return True
    return False


class JobWatch:
    """A receiver's running view of the trainer job's lease: ``alive()`` reads the counter (one
    store round trip) and says whether it moved within STALE_S of the last time it did."""

    def __init__(self, ctl: Control):
        self.ctl = ctl
        self.count = ctl.add("job/lease", 0)
        self.moved = time.monotonic()

    def alive(self) -> bool:
        c = self.ctl.add("job/lease", 0)
        now = time.monotonic()
        if c != self.count:
            self.count, self.moved = c, now
        return now - self.moved < STALE_S


def _lease(store, prefix: str, stop: threading.Event) -> None:
    """Renew the job's lease every LEASE_S until `stop`: a store call that fails is retried
    after a backoff (from LEASE_S / 8, doubling, at most LEASE_S), never given up while this
    process lives (issue 35.1: one failed call had stopped it, and the job looked gone)."""
    back = 0.0
    while not stop.wait(back or LEASE_S):
        try:
            store.add(prefix + "job/lease", 1)
            back = 0.0
        except Exception:  # noqa: BLE001 -- busy or gone: retried; readers judge by STALE_S
            back = min(LEASE_S, 2 * back if back else LEASE_S / 8)


def claim(ctl: Control, name: str, timeout: float) -> tuple[Control, dict]:
    """Trainer rank 0: this job's generation of `name` (a Control for it) and its record;
    SetupError naming the other job when the current generation is held by a live one."""
    store = ctl.store
    gen = current(store, name)
    deadline = time.monotonic() + timeout
    while True:
        g = Control(store, namespace(name, gen), ctl.timeout, secret=ctl.secret)
        rec = dict(id=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), gen=gen)
        if store.compare_set(g.key("job/claim"), "", rec["id"]).decode() == rec["id"]:
            g.set_json("job", rec)
            break
        other = g.get_json("job", "the record of the trainer job holding this name", 5)
        if job_alive(g):
            raise SetupError(
                f"wxfer: trainer job {other['id'][:12]} (rank 0: host {other['host']} pid {other['pid']}) "
                f"is alive and uses the name {name!r} in this store: give this job another name= "
                "(or stop that job)"
            )
        gen = advance(store, name, gen)  # the old job is gone: its records stay where they are
        if time.monotonic() > deadline:
            raise SetupError(f"wxfer: could not claim a generation of the name {name!r} within {timeout:.0f} s")
    stop = threading.Event()
    threading.Thread(target=_lease, args=(store, g.prefix, stop), name="wxfer-lease", daemon=True).start()
    rec["stop"] = stop
    return g, rec


def join(ctl: Control, group, rank: int, name: str, timeout: float) -> tuple[Control, dict | None]:
    """Every trainer rank: rank 0 claims the generation, the others take it (gloo). Returns
    (that generation's Control, rank 0's job record with its lease's ``stop`` event, else None)."""
    err, gen, job = None, None, None
    if rank == 0:
        try:
            ctl, job = claim(ctl, name, timeout)
            gen = job["gen"]
        except Exception as e:  # noqa: BLE001 -- every rank raises it
            err = f"{type(e).__name__}: {e}"
    if group is not None:
        got = control.gather_json(
            group, [gen, err], timeout, "trainer rank 0's job generation (trainer rank %d)" % rank
        )
        gen, err = got[0]
    if err:
        raise SetupError(f"wxfer: setup failed on trainer rank 0 (claiming the job's name): {err}")
    if rank:
        ctl = Control(ctl.store, namespace(name, gen), ctl.timeout, secret=ctl.secret)
    return ctl, job


def receiver_namespace(ctl: Control, name: str) -> Control:
    """A receiver: the generation it registers in (see the module's docstring)."""
    store = ctl.store
    gen = current(store, name)
    while True:
        g = Control(store, namespace(name, gen), ctl.timeout, secret=ctl.secret)
        if not store.check([g.key("job/claim")]) or job_alive(g):
            return g
        gen = advance(store, name, gen)
