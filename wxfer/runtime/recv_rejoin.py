"""A restarted inference worker: the handshakes that bring it back into a running trainer job."""

from __future__ import annotations

import time

from . import control, jobs
from .control import SetupError


class ReceiverRejoin:
    """The rejoin of a Receiver started again for a (replica, rank) after the trainers' setup
    (a mixin of wxfer.Receiver)."""

    def _publish_restart(self, meta: dict) -> None:
        """This worker's record as a restart (the trainers' setup is through): the next epoch of
        its (replica, rank), ``infer/<gpu>/e<epoch>/meta``, read by the trainers' watchers."""
        control.decode_result(self.ctl.get("status", "the trainers' setup status"), "trainer rank 0 (controller)")
        self.epoch = self.ctl.add("infer/epoch/%d" % self.gpu, 1)
        meta["epoch"] = self.epoch
        self._start_lease(meta["lease_s"])
        self.ctl.set_json("infer/%d/e%d/meta" % (self.gpu, self.epoch), meta)
        self.ctl.add("infer/rejoins", 1)

    def _rejoin_handshakes(self) -> None:
        """A restarted worker: its record (``infer/<gpu>/e<epoch>/meta``) is seen by the watcher
        of every trainer rank writing here (each acknowledges it), then ``infer/<gpu>/e<epoch>``
        says so: from then on the next push() of each takes it, however far off.  Wait for
        those pushes as long as the trainer job lives (its lease: jobs.JobWatch) and each
        trainer rank does (its pid and lease: liveness.WriterWatch), or `rejoin_timeout`
        seconds where one was given, or for a trainer's refusal (``rejoin/refused/<gpu>/e<epoch>``)."""
        self.senders = self.ctl.get_json("senders/%d" % self.gpu, "the list of trainers writing here")
        g, e = self.gpu, self.epoch
        self._t_rejoin, self._job = time.monotonic(), jobs.JobWatch(self.ctl)
        self._watch_writers()
        seen = "rejoin/seen/%d/e%d" % (g, e)
        self._wait_trainers(lambda: self.ctl.add(seen, 0) >= len(self.senders), None, "see its record")
        self.ctl.set("infer/%d/e%d" % (g, e), b"1")  # every writer's next push takes it
        for r in self.senders:
            req = control.hs_key("req", r, g, e)
            self._wait_trainers(lambda: self.ctl.check(req), r, "connect")
            control.target_accept(self.ctl, self.transport, r, g, epoch=e)
        self.ctl.set("ready/%d/e%d" % (g, e), b"1")

    def _wait_trainers(self, done, rank, what: str) -> None:
        """Wait until `done()` (trainer `rank`, or every one when None, to `what`): while the job
        and the writers live, at most `rejoin_timeout` from the start of the rejoin if given;
        SetupError on a refusal, a timeout, or the trainers gone."""
        refused = "rejoin/refused/%d/e%d" % (self.gpu, self.epoch)
        who = f"wxfer.Receiver gpu {self.gpu} (restarted, replica {self.replica} rank {self.rank})"
        them = "the trainer ranks" if rank is None else f"trainer rank {rank}"
        delay, looked = 0.005, time.monotonic()
        while not done():
            if self.ctl.check(refused):
                why = self.ctl.get(refused, "the trainers' refusal").decode(errors="replace")
                raise SetupError(f"{who}: refused by the trainers: {why}")
            waited = time.monotonic() - self._t_rejoin
            if self.rejoin_timeout is not None and waited > self.rejoin_timeout:
                raise SetupError(
                    f"{who}: {them} did not {what} within rejoin_timeout={self.rejoin_timeout:g} s "
                    "(the trainers pick up a restarted worker at their next push())"
                )
            if time.monotonic() - looked >= 0.25:  # the trainers alive: a few store reads a second
                looked = time.monotonic()
                gone = self.writers.gone()
                if gone or not self._job.alive():
                    why = "; ".join(f"trainer rank {r}: {w}" for r, w in sorted(gone.items()))
                    why = why or f"its job lease was not renewed for {jobs.STALE_S:g} s"
                    raise SetupError(
                        f"{who}: {them} will not {what}: the trainer job is gone ({why}; waited "
                        f"{waited:.1f} s for its next push())"
                    )
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
