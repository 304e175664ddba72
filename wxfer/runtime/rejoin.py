"""The trainer side of a restarted inference worker (issue 8): taken at the next push() without
restarting the trainers (a Sender mixin)."""

from __future__ import annotations

from . import control
from .control import SetupError
from .receiver import _unb64, decode_param_descriptor


class RejoinMixin:
    def _adopt_rejoins(self) -> None:
        """Take the inference workers restarted since the last push (one store round trip
        when there are none): connect to each, point this rank's destinations for it at its
        new memory; every other worker keeps its plan.  A restart that does not match the
        worker it replaces is refused (it stays skipped, and the push reports it)."""
        n = self.ctl.add("infer/rejoins", 0)
        if n == self._rejoins_seen:
            return
        for g in sorted(self.workers):
            e = self.ctl.add("infer/epoch/%d" % g, 0)
            if e > self._epoch[g]:
                self._epoch[g] = e
                try:
                    self._adopt(g, e)
                    self._refused.pop(g, None)
                except Exception as ex:  # noqa: BLE001 -- reported by this push, the others go on
                    why = f"{type(ex).__name__}: {ex}"
                    self._refused[g] = f"its restart (epoch {e}) was refused: {why}"
                    self.ctl.set("rejoin/refused/%d/e%d" % (g, e), f"trainer rank {self.rank}: {why}")
        self._rejoins_seen = n

    def _adopt(self, g: int, e: int) -> None:
        old = self.workers[g]
        if "params" not in old:  # the connection record of setup: the worker's whole record, from the store
            old = self.ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", self.write_timeout)
        # bounded by write_timeout: a restarted worker that died again must not stall the push longer
        w = self.ctl.get_json(
            "infer/%d/e%d" % (g, e), f"metadata of restarted inference worker gpu {g}", self.write_timeout
        )
        probs = []
        for k in ("transport", "options", "mapping", "replicas", "tp", "replica", "rank", "ep"):
            if w.get(k) != old.get(k):
                probs.append(f"{k} {w.get(k)!r}, before {old.get(k)!r}")
        for name in sorted(set(old["params"]) | set(w["params"])):
            a, b = old["params"].get(name), w["params"].get(name)
            if a != b:
                probs.append(
                    f"{name}: "
                    + (
                        "missing"
                        if b is None
                        else "not in the plan"
                        if a is None
                        else f"shape/dtype {b}, the plan has {a}"
                    )
                )
        slot = self._stamp_dest[g][1] // 8
        if w["stamp_slots"] <= slot:
            probs.append(f"{w['stamp_slots']} version stamp slots, trainer rank {self.rank} needs slot {slot}")
        if probs:
            raise SetupError(
                f"restarted inference worker gpu {g} ({w['host']} pid {w['pid']}) does not match "
                "the one it replaces:\n    " + "\n    ".join(probs)
            )
        peer = control.writer_connect(
            self.ctl, self.transport, self.rank, g, _unb64(w["export"]), self.write_timeout, epoch=e
        )
        # the new worker's memory: its descriptors into the plan, this rank's tasks for it
        for name, d in w["desc"].items():
            self.plan.descriptors[(g, name)] = _unb64(d)
        self.program.retarget(self.plan, g)
        for r in _regions(old):
            self._gpu_of_region.pop(r, None)
        self._gpu_of_region.update((r, g) for r in _regions(w))
        self._gpu_of_peer.pop(self.peers[g], None)  # the old peer's writes (if any) stay abandoned
        self.peers[g] = peer
        self._gpu_of_peer[peer] = g
        self._stamp_dest[g] = (_unb64(w["stamp"]), self._stamp_dest[g][1], 0, 8)
        self._begin_dest[g] = (_unb64(w["stamp"]), w["stamp_begin"] + self._stamp_dest[g][1], 0, 8)
        self.workers[g] = w
        self.rejoined += 1


def _regions(worker: dict) -> set:
    """The region descriptors of an inference worker's published parameter descriptors."""
    return {decode_param_descriptor(_unb64(d))[0] for d in worker["desc"].values()}
