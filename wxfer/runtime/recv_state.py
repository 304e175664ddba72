"""A Receiver's version and state: the version stamps the trainers write next to the weights,
read into ``version()``, ``state()`` and ``wait_version()``.

Version stamps (a seqlock per writing trainer): two int64 slots per sending trainer rank,
in registered memory next to the weights.  A sender writes step N into its *begin* slot,
and waits until that write has landed, before its first data write of step N; it writes N
into its *end* slot only after all its data writes of step N have landed.  ``version()``
is the step whose weights are all in place: the minimum end stamp when every sender's
begin equals its end, else -1 (some sender is writing, or gave up, or died, mid-step).
``state()`` says which, with the trainers' word from the store ("torn/<gpu>/..."): a
trainer that gives up on this worker (or on a step) records it there, so a worker the
trainers dropped learns it at its next ``state()`` / ``wait_version()``.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("wxfer.runtime.receiver")  # the Receiver's logger, whichever part logs
STATE_STORE_S = 1.0  # state() waits for the trainers' store at most this long (then answers without it)


class TornError(RuntimeError):
    """The weights here are not a complete step and will not become one without a new
    push to this worker: a trainer gave up or died in the middle of writing them, or the
    trainers dropped this worker (``Receiver.state()`` says which)."""


class ReceiverState:
    """The Receiver's reading of its version stamps (a mixin of wxfer.Receiver: it reads
    ``stamps``, ``stamp_slots``, ``senders``, ``ctl``, ``writers``, ``gpu``, ``epoch``)."""

    # ------------------------------------------------------------------ per step: nothing
    def _stamps(self) -> tuple[list, list]:
        """(end stamps, begin stamps) of the senders, the end ones read first: a begin
        read after an equal end means that sender was not writing when its end was read."""
        n = len(self.senders)
        end = self.stamps[:n].tolist()
        begin = self.stamps[self.stamp_slots : self.stamp_slots + n].tolist()
        return end, begin

    def version(self) -> int:
        """The step whose weights are all in place here; -1 before the first push, and while
        any trainer is writing (or gave up, or died, in the middle of writing) a step here.
        A reader that wants its use of the weights covered checks it again afterwards: the
        same value, not -1, means no write touched them in between.  With delta pushes the
        stamps say the step landed, not that its records were applied: call apply() after
        every push (docs/delta.md); one that missed an apply() is told by the next apply()."""
        if not self.senders:
            return -1
        end, begin = self._stamps()
        if any(b != e for b, e in zip(begin, end)):
            return -1
        return int(min(end))

    def _marks(self):
        """The trainers' records of giving up on this worker (store keys torn/<gpu>/e<epoch>/<i>);
        None when the store cannot be reached."""
        base = "torn/%d/e%d" % (self.gpu, self.epoch)
        try:
            n = self.ctl.add(base, 0)
            return [
                self.ctl.get_json("%s/%d" % (base, i), "a trainer's record of giving up", 5)
                for i in range(1, n + 1)
                if self.ctl.check("%s/%d" % (base, i))
            ]
        except Exception:  # noqa: BLE001 -- the store is gone
            return None

    def state(self) -> dict:
        """What the weights here are, one of:

        - ``complete``: ``version`` is the step fully in place;
        - ``unwritten``: no step written since this Receiver's setup (``version`` -1): the
          weights are what the memory held before (a loaded checkpoint, or what an earlier
          job left, maybe half written -- never ``complete`` at -1);
        - ``writing``: trainer rank(s) ``ranks`` are writing step ``step`` (for ``for_s`` s);
        - ``torn``: step ``step`` was left half written (``why``: which trainer rank gave up
          or died); the weights mix two steps until a push reaches this worker again
          (``final`` False: the trainers said their next push will);
        - ``dropped``: the trainers gave up on this worker at step ``step`` (``why``); it holds
          step ``version`` complete (-1 with ``step``: it was dropped in the middle of that
          step, a stalled worker the trainers skipped, and its weights are torn) but will not
          be written again until it is restarted.

        ``message`` says it in one line.  Reads the store (one round trip) only when a trainer
        has recorded giving up on this worker or some sender is mid-step."""
        if not self.senders:
            return _unwritten(self.gpu)
        end, begin = self._stamps()
        busy = [(r, b) for r, b, e in zip(self.senders, begin, end) if b != e]
        now = time.monotonic()
        first = self._busy_since if busy and self._busy_key == busy else now
        self._busy_key, self._busy_since = (busy, first) if busy else (None, None)
        v = -1 if busy else int(min(end))
        silent = 0.0  # seconds the store has not answered this look (0: it answered)
        if busy or self._marks_checked + 0.1 < now or self._store_look.in_flight():
            self._marks_checked = now
            answered, got = self._store_look.look(STATE_STORE_S)
            if answered:
                self._last_marks, gone = got
                self._gone = self._gone if gone is None else gone
            else:
                silent = got
        if silent:
            return _silent(self._state_of(busy, v, end, now, first), silent)
        return self._state_of(busy, v, end, now, first)

    def _look_store(self):
        """The trainers' records of giving up here, and the trainer ranks dead by now (None: not
        watched): what state() reads from the store, on the Bounded look's thread."""
        return self._marks(), (self.writers.gone() if self.writers is not None else None)

    def _state_of(self, busy: list, v: int, end: list, now: float, first: float) -> dict:
        """state() from the stamps read and the store's last answer."""
        marks = self._last_marks
        ranks = [r for r, _ in busy]
        if marks is None:
            if busy:  # nobody left to finish the step: the trainers' store is gone
                step = max(b for _, b in busy)
                why = "the trainers' store cannot be reached (the trainer hosting it died?)"
                msg = (
                    f"inference worker gpu {self.gpu}: torn since step {step}: trainer rank(s) {ranks} did "
                    "not finish it and the trainers' store cannot be reached (the trainer hosting it died?)"
                )
                return _state("torn", -1, step, ranks, why, now - first, True, msg)
            marks = []
        endof = dict(zip(self.senders, end))
        live = [
            m
            for m in marks
            if (m.get("writer") is None and busy) or (m.get("writer") in endof and endof[m["writer"]] < m["step"])
        ]
        if live:
            return self._marked(live, busy, v, now - first)
        if self._gone:
            return self._writers_gone(v, busy, end, now - first)
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        if busy:
            step = max(b for _, b in busy)
            msg = f"{where}: step {step} being written by trainer rank(s) {ranks} (for {now - first:.1f} s)"
            return _state("writing", -1, step, ranks, "", now - first, False, msg)
        if v < 0:
            return _unwritten(self.gpu)
        return _state("complete", v, v, [], "", 0.0, False, f"{where}: step {v} complete")

    def _marked(self, live: list, busy: list, v: int, for_s: float) -> dict:
        """state() when trainers recorded giving up on a step here (`live`: their records that
        a later stamp has not overtaken): torn while a step is half written, else dropped."""
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        m = min(live, key=lambda m: m["step"])
        why = "; ".join(sorted({x["why"] for x in live}))
        final = any(x.get("final", True) for x in live)
        skipped = [x for x in live if x.get("dropped")]  # skipped for good (a stalled worker)
        if busy and skipped:
            m = min(skipped, key=lambda m: m["step"])
            msg = (
                f"{where}: dropped by the trainers in the middle of step {m['step']} ({why}); its "
                "weights are torn (that step half written) and it is not written again until it is restarted"
            )
            ranks = sorted({x.get("writer") for x in live}, key=str)
            return _state("dropped", -1, m["step"], ranks, why, for_s, True, msg)
        if busy:
            msg = f"{where}: torn since step {m['step']}: {why}" + (
                "" if final else " (the trainers go on: their next push to this worker rewrites it)"
            )
        else:
            msg = (
                f"{where}: dropped by the trainers at step {m['step']} ({why}); it holds step {v} "
                "complete and is not written again until it is restarted"
            )
        ranks = sorted({x.get("writer") for x in live}, key=str)
        return _state("torn" if busy else "dropped", v, m["step"], ranks, why, for_s, final, msg)

    def _writers_gone(self, v: int, busy: list, end: list, for_s: float) -> dict:
        """state() when trainer ranks writing here died with no record of it (between pushes, or
        before they could record it): torn if one was mid-step, else dropped at its last step."""
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        ranks = sorted(self._gone)
        recs = self.writers.records if self.writers is not None else {}
        name = {r: f"trainer rank {r} (pid {recs[r].get('pid')}, host {recs[r].get('host')})" for r in ranks}
        why = "; ".join(f"{name[r]} died: {self._gone[r]}" for r in ranks)
        endof = dict(zip(self.senders, end))
        if busy:
            step = max(b for _, b in busy)
            msg = f"{where}: torn since step {step}: {why}"
        else:
            step = min(endof[r] for r in ranks)
            msg = (
                f"{where}: dropped: {why}; it holds step {v} complete and is not written again until "
                "the trainers are restarted"
            )
        return _state("torn" if busy else "dropped", v, step, ranks, why, for_s, True, msg)

    def wait_version(self, version: int, timeout: float = 60.0) -> int:
        """Poll (bounded) until version() >= `version`; returns it.  Raises TornError as soon
        as the trainers record that they gave up on this worker for good (dropped it, or a
        trainer rank died or stopped with a step half written here), and TimeoutError naming
        the trainer ranks not done (and the state) at the deadline."""
        deadline = time.monotonic() + timeout
        delay, checked = 0.0005, 0.0
        while True:
            v = self.version()
            if v >= version:
                return v
            now = time.monotonic()
            if now - checked >= 0.1:
                checked = now
                st = self.state()
                if st["state"] in ("torn", "dropped") and st.get("final", True):
                    log.error("Receiver gpu %s: %s (waiting for version %d)", self.gpu, st["message"], version)
                    raise TornError(f"wxfer.Receiver: {st['message']} (waiting for version {version})")
            if now > deadline:
                st = self.state()
                end, _ = self._stamps()
                late = [r for r, s in zip(self.senders, end) if s < version]
                log.warning("Receiver gpu %s: version %d after %.0f s, waiting for %d", self.gpu, v, timeout, version)
                raise TimeoutError(
                    f"wxfer.Receiver gpu {self.gpu}: version {v} after {timeout:.0f} s, "
                    f"waiting for {version}; trainer ranks not done: {late}; {st['message']}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def _unwritten(gpu) -> dict:
    return _state(
        "unwritten",
        -1,
        None,
        [],
        "",
        0.0,
        False,
        f"inference worker gpu {gpu}: no step written since this Receiver's setup (the weights are what "
        "the memory held before it)",
    )


def _silent(st: dict, silent: float) -> dict:
    """state() `st` from the store's last answer, when the store has not answered for `silent`
    seconds (stopped or stalled): said in its message."""
    st["message"] += (
        f" (the trainers' store has not answered for {silent:.1f} s: a trainer's record of "
        f"giving up on this worker, or a trainer's lease, is read from its last answer)"
    )
    return st


def _state(state, version, step, ranks, why, for_s, final, message) -> dict:
    """One answer of Receiver.state() (its keys are the documented ones)."""
    return dict(
        state=state, version=version, step=step, ranks=ranks, why=why, for_s=for_s, final=final, message=message
    )
