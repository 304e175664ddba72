"""One peer's failure state (issue 37.3): an inference worker seen by a trainer rank, or a
trainer rank seen by an inference worker, is in one of five states, and moves only along the
transitions of ``TABLE``:

- ``ALIVE``: written (trusted); its lease renews, its process runs, its writes land;
- ``SUSPECT``: its lease was read behind its bound (a stall of the peer, or of the store both
  use: the same reading cannot tell), still written; a renewal makes it alive again, a lease
  still behind ``confirm`` seconds later makes it failing;
- ``FAILING``: a failure is known (its process exited, its lease expired, a write to it failed
  or was late) and not yet acted on: the push that found it names it, the engine fences it;
- ``DEAD``: given up on (skipped until it is restarted); a verdict taken from its lease alone is
  withdrawn when the lease renews again (``RENEWED``: back to alive, logged);
- ``REJOINING``: its restart is being adopted (connected, its destinations retargeted), then
  ``ADOPTED``: alive.  A restart refused (it does not match the worker it replaces) moves
  nothing: the worker in place keeps its state.

``next_state(state, event)`` is the pure table; ``Peers`` keeps the states of many peers with
why and since when, logging every change.  The C engine's failed peers go through the same
table (csrc/core/wx_peer_state.c: the same numbers), checked against this one in
tests/test_peerstate.py."""

from __future__ import annotations

import enum
import logging
import time

log = logging.getLogger(__name__)


class State(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    FAILING = 2
    DEAD = 3
    REJOINING = 4


class Event(enum.IntEnum):
    RENEWED = 0  # its lease was read on time
    LATE = 1  # its lease was read behind its bound
    EXPIRED = 2  # a suspect's lease still behind its bound `confirm` seconds later
    EXITED = 3  # its process exited (its pid, on this host)
    WRITE_FAILED = 4  # a write to it failed or was late (the engine failed its peer)
    GIVE_UP = 5  # acted on: skipped from now on (a push's end; the engine's fence done)
    REJOIN = 6  # its restart's record is complete
    ADOPTED = 7  # its restart was taken (connected, written from the next step)


A, S, F, D, R = State.ALIVE, State.SUSPECT, State.FAILING, State.DEAD, State.REJOINING
E = Event

# (state, event) -> the next state; a pair not here is illegal.  Self-loops are the events that
# do happen in a state and change nothing (a dead peer's old writes failing again each push).
TABLE: dict = {
    (A, E.RENEWED): A,
    (A, E.LATE): S,
    (A, E.EXITED): F,
    (A, E.WRITE_FAILED): F,
    (A, E.REJOIN): R,  # restarted before anyone saw it fail
    (S, E.RENEWED): A,
    (S, E.LATE): S,
    (S, E.EXPIRED): F,
    (S, E.EXITED): F,
    (S, E.WRITE_FAILED): F,
    (S, E.REJOIN): R,
    (F, E.EXITED): F,
    (F, E.WRITE_FAILED): F,
    (F, E.GIVE_UP): D,
    (F, E.REJOIN): R,
    (D, E.RENEWED): A,  # a verdict from its lease alone, withdrawn: it lives (a store stall)
    (D, E.EXITED): D,
    (D, E.WRITE_FAILED): D,
    (D, E.GIVE_UP): D,
    (D, E.REJOIN): R,
    (R, E.EXITED): R,  # the process it replaces, seen exited meanwhile
    (R, E.WRITE_FAILED): R,  # the old peer's writes
    (R, E.GIVE_UP): R,  # the old peer given up on; the restart still comes next push
    (R, E.REJOIN): R,  # a later restart of it
    (R, E.ADOPTED): A,
}

# the states whose lease is judged (LATE / RENEWED / EXPIRED can come); DEAD only where its
# verdict came from the lease (``Peers.revivable``)
LEASE_JUDGED = frozenset((A, S))


class IllegalTransition(ValueError):
    """An event that cannot happen in the peer's state: a bug in the caller."""


def next_state(state: State, event: Event, who: str = "a peer") -> State:
    """The state after `event` in `state` (pure); IllegalTransition naming `who`, the state and
    the event where the table has no such transition."""
    nxt = TABLE.get((State(state), Event(event)))
    if nxt is None:
        raise IllegalTransition(
            f"wxfer: {who}: no transition from state {State(state).name} on event {Event(event).name}"
        )
    return nxt


class Peers:
    """The failure states of a set of peers (keys: gpu or trainer rank), each with why it is
    there, since when (monotonic), and the event that made it fail (``cause``).  `name(key)`
    words a peer for messages; `confirm`: how long a suspect's lease must stay behind before
    it fails (``lease_event``)."""

    def __init__(self, name=str, confirm: float = 1.0):
        self.name, self.confirm = name, float(confirm)
        self.state: dict = {}  # key -> State (ALIVE when absent)
        self.why: dict = {}  # key -> the reason of its last change away from ALIVE
        self.since: dict = {}  # key -> monotonic time of its last change
        self.cause: dict = {}  # key -> the Event that made it FAILING (kept while DEAD)

    def get(self, key) -> State:
        return self.state.get(key, State.ALIVE)

    def apply(self, key, event: Event, why: str = "", now: float | None = None) -> State:
        """Move peer `key` on `event` (IllegalTransition where the table forbids it); returns
        its new state.  A change is logged (a revival from DEAD as a warning)."""
        old = self.get(key)
        new = next_state(old, event, self.name(key))
        if event is Event.EXITED and old in (State.FAILING, State.DEAD) and self.cause.get(key) is not event:
            self.cause[key] = event  # its process is gone: no renewal can withdraw the verdict
            self.why[key] = why or self.why.get(key, "")
        if new is old:
            return new
        self.state[key] = new
        self.since[key] = time.monotonic() if now is None else now
        if new is State.FAILING:
            self.cause[key] = event
        elif new is not State.DEAD:
            self.cause.pop(key, None)
        if new is State.ALIVE:
            self.why.pop(key, None)
        elif why:
            self.why[key] = why
        level = logging.WARNING if (old is State.DEAD and new is State.ALIVE) else logging.INFO
        log.log(
            level, "%s: %s -> %s on %s%s", self.name(key), old.name, new.name, event.name, f" ({why})" if why else ""
        )
        return new

    def in_state(self, *states) -> set:
        return {k for k, s in self.state.items() if s in states}

    def lease_judged(self, key) -> bool:
        """Whether peer `key`'s lease readings are events for it: alive or suspect, or dead by its
        lease alone (a renewal withdraws that verdict)."""
        s = self.get(key)
        return s in LEASE_JUDGED or (s is State.DEAD and self.cause.get(key) is Event.EXPIRED)

    def lease_event(self, key, why: str | None, now: float, confirm: float | None = None):
        """The event a reading of peer `key`'s lease is (`why`: why it is behind its bound; None:
        renewed): RENEWED; LATE; EXPIRED once it has been suspect for `confirm` seconds (the
        Peers' own by default) and is still behind; None for a dead one still behind."""
        s = self.get(key)
        if why is None:
            return Event.RENEWED
        if s is State.SUSPECT and now - self.since[key] >= (self.confirm if confirm is None else confirm):
            return Event.EXPIRED
        return None if s is State.DEAD else Event.LATE

    def on_lease(self, key, why: str | None, now: float | None = None) -> State:
        """A reading of peer `key`'s lease, applied (``lease_event``); returns its state."""
        now = time.monotonic() if now is None else now
        ev = self.lease_event(key, why, now)
        return self.get(key) if ev is None else self.apply(key, ev, why or "", now)
