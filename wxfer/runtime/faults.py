"""The Sender's failure paths (issue 17): records of abandoned writes for Receiver.state(),
joining the other trainer ranks' collectives after a failure inside push(), and waiting
after a setup error until the other processes have read it.  A mixin of Sender."""

from __future__ import annotations

import logging
import time

from . import control, prepare, program, setup_waits

log = logging.getLogger(__name__)


class FaultsMixin:
    """Needs the Sender's rank, world, group, ctl, plan, program, workers, version,
    timeout, device, stream, _epoch, _marked, _hosted, _abort() and _failures_elsewhere()."""

    def _linger(self, trainer_key, trainers: int, recv_key, receivers: int) -> None:
        """After a setup error: wait (up to `timeout` for the other trainer
        ranks, 10 s for the receivers) until they read it from the store a trainer hosts."""
        if not self._hosted:
            return
        try:
            self._linger_on(trainer_key, trainers, recv_key, receivers)
        except Exception:  # noqa: BLE001 -- the store's host exited: nothing left to wait for
            pass

    def _linger_on(self, trainer_key, trainers, recv_key, receivers) -> None:
        for key, n, t in ((trainer_key, trainers, self.timeout), (recv_key, receivers, min(self.timeout, 10.0))):
            if key is None or n == 0:
                continue
            deadline = time.monotonic() + setup_waits.linger_left(self, t)  # within the phase's bound
            while time.monotonic() < deadline:
                want = n
                if want is None:  # every receiver of gpu 0's layout (it may not have registered yet)
                    try:
                        w = self.ctl.get_json("infer/0", "", 0) if self.ctl.check("infer/0") else None
                    except Exception:  # noqa: BLE001
                        w = None
                    want = w["replicas"] * w["tp"] if w else 1
                if self.ctl.add(key, 0) >= want:
                    break
                time.sleep(0.02)

    def _mark_other_rank_gone(self, step: int, exc) -> str:
        """A collective among the trainer ranks failed in step `step`: name the ranks gone (a
        roll call in the store, bounded by write_timeout) and record that every receiver of
        the plan may hold a torn step.  Returns the naming ("trainer rank 1 (pid N, host H)
        died or hung")."""
        try:
            gone = control.roll_call(
                self.ctl, f"rollcall/{step}", self.rank, self.world, min(5.0, max(2.0, self.write_timeout))
            )
            gone_s = (" and ".join(gone) + " died or hung") if gone else f"a trainer rank other than {self.rank} failed"
        except Exception:  # noqa: BLE001 -- the store is gone: its host died
            gone_s = (
                f"a trainer rank other than {self.rank} died or hung (the store it hosted cannot be reached)"
                if not self._store_host
                else f"a trainer rank other than {self.rank} died or hung"
            )
        log.error("trainer rank %d: step %d: %s (%s)", self.rank, step, gone_s, exc)
        self._mark(program.receivers_of(self.plan), step, f"{gone_s} in step {step} ({exc})", writer=None)
        return gone_s

    def _mark(self, gpus, step: int, why: str, writer="self", final: bool = True) -> None:
        """Record in the store, for Receiver.state(), that the writes of `writer` (this rank;
        None: some trainer rank) of step `step` to `gpus` were abandoned; `final`: no later
        push of this rank will repair them (it skips the worker, or is going away).  Best
        effort: a store that cannot be reached leaves the stamps to say "being written"."""
        writer = self.rank if writer == "self" else writer
        for g in sorted(gpus):
            try:
                e = self._epoch[g] if g in self._epoch else self.ctl.add("infer/epoch/%d" % g, 0)
                if (g, e, writer, step) in self._marked:
                    continue
                self._marked.add((g, e, writer, step))
                base = "torn/%d/e%d" % (g, e)
                i = self.ctl.add(base, 1)
                self.ctl.set_json(
                    "%s/%d" % (base, i), dict(step=int(step), writer=writer, by=self.rank, why=why, final=bool(final))
                )
            except Exception:  # noqa: BLE001
                pass

    def _dropped(self) -> set:
        return getattr(self, "_dropped_gpus", set())

    def _join_failed(self, exc, own: str, barrier, at) -> None:
        """This rank failed inside the task loop at task `at` = (mesh group, index): take part
        in what the other ranks are in -- the collectives (full_tensor) of the remaining tasks,
        run without writing, and the barriers of the remaining mesh groups -- then join the
        failure flag, so that every rank raises this failure within its bounds instead of
        hanging.  A failure of a collective itself (a rank died or hung) is raised as it is:
        the group is broken.  (A failure raised from inside a task's full_tensor() leaves the
        FSDP collectives one task out of step: the others fail at their collective timeout.)"""
        broken = isinstance(exc, control.CollectiveError) or _is_gloo_failure(exc)
        if broken and self.group is not None and self.world > 1:
            gone = self._mark_other_rank_gone(self.version, exc)
            self._abort()
            msg = f"wxfer: trainer rank {self.rank}, step {self.version}: {gone}: {own}"
            raise control.CollectiveError(msg) from exc
        if self.group is None or self.world == 1:
            self._abort()
            return
        groups = self.program.groups
        gi, oi = at
        try:
            for g in range(gi, len(groups)):
                if g > gi and barrier is not None:
                    barrier.wait(self.timeout)
                start = oi + 1 if g == gi else 0
                if g == gi and oi >= len(groups[g]):
                    continue  # this group's barrier was issued already
                self._drain(groups[g][start:])
                barrier = control.Barrier(
                    self.group,
                    f"the barrier after mesh group {g} (trainer rank "
                    f"{self.rank}, step {self.version}, after its failure)",
                )
            self._abort()
            if barrier is not None:
                barrier.wait(self.timeout)
            others = self._failures_elsewhere(own)
        except Exception as e2:  # noqa: BLE001 -- the others are gone too: report ours
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {own}\n(and telling the "
                f"other trainer ranks failed: {e2})"
            ) from exc
        if others:
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {own}"
                + "".join(f"\ntrainer rank {r} reports: {o}" for r, o in others)
            ) from exc

    def _drain(self, ops) -> None:
        """The collectives of `ops` (stage 1-2, nothing written), for the other ranks' sake."""
        import contextlib
        import torch

        for op in ops:
            try:
                with (
                    torch.no_grad(),
                    torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext(),
                ):
                    # the same collectives as _run_task's (one all-gather per task and group)
                    prep = op.prep if op.prep is not None else prepare.task_prep(op, self.device)
                    op.prep = prep
                    prepare.run(prep, op, self.device)
            except Exception:  # noqa: BLE001 -- this step is failed already
                pass


def _is_gloo_failure(exc) -> bool:
    """A collective's own failure raised by torch (a peer rank's connection closed)."""
    t = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or (
        "gloo" in t.lower() and ("connection" in t.lower() or "closed" in t.lower() or "timed out" in t.lower())
    )


def mapping_digest(mapping) -> dict:
    """{name, sha}: what a trainer rank was given as `mapping` (compared across ranks)."""
    import hashlib

    try:
        p = program.get_preset(mapping)
    except Exception as e:  # noqa: BLE001 -- reported by the controller as a disagreement or its own error
        return dict(name=repr(mapping)[:80], sha=hashlib.sha256(f"{type(e).__name__}: {e}".encode()).hexdigest())
    return dict(name=getattr(p, "name", ""), sha=hashlib.sha256(repr(p).encode()).hexdigest())
