"""One push() on the trainer side (the Sender's ``StepLoop``): the restarted workers taken,
the begin stamps, then for each mesh group, for each task of this rank in order, stage 1-2
and the submission (zero-copy tasks in batches, small ones copied in place, packed ones
written in place or staged: every write an engine task); an asynchronous gloo barrier after
each group; then the end: this rank's writes waited for, the workers that failed marked and
skipped from then on, verify mode's checksums, every trainer rank's failure flag exchanged
(so that all ranks raise together and SPMD loops stay in step), and only then, when no rank
broke the step, the end stamps (one rank alone: an engine fence after every task, posted
without waiting for a flag).  A failure inside the loop drains the collectives the other
ranks are in -- from the failed task's first one not posted -- before it is raised."""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import time

from .. import envs, taskpath
from . import control, prepare
from ..zerocopy import Batcher
from .failures import and_own, is_gloo_failure
from .tasks import writes_bound

log = logging.getLogger(__name__)
_PREP = operator.attrgetter("prep")
# the tasks written in place a push runs first when tasks without collectives come before them
# (StepLoop._ordered): two, so that the SMs have the second quantizer launch queued while the
# host goes through the tasks that were ahead of them (the Qwen3-8B FP8 row's 75; ~0.23 ms)
LEAD = 2


def gc_pause() -> bool:
    """Pause Python's cyclic garbage collector while a push submits ($WXFER_GC_PAUSE, on unless
    0/off/false/no): a push allocates a few small objects per task, enough to start collections
    whose time on a trainer's large object graph (an FSDP2 model's modules and DTensors) lands
    on the first writes.  Objects are still freed by their counts; the collector resumes when
    push() returns (submitted, or raising).  True: paused here, to be enabled by the caller."""
    if not gc.isenabled() or not envs.on("WXFER_GC_PAUSE"):
        return False
    gc.disable()
    return True


class PushHandle:
    """What ``push(async_op=True)`` returns: every task is submitted (sources packed);
    ``wait()`` returns once this rank's writes and version stamps have landed."""

    def __init__(self, steps, lock, version, t0, barrier, keep):
        self._steps, self._lock, self.version, self._t0 = steps, lock, version, t0
        self._barrier, self._keep = barrier, keep
        self._done = False
        self.seconds = None

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> float:
        with self._lock:  # one thread finishes a step; another waits for it
            if not self._done:
                try:
                    self.seconds = self._steps.finish(self, timeout)
                finally:
                    self._done = True  # a failed step is reported once, not again by the next push
        return self.seconds


class StepLoop:
    """ctl: the job's Control (verify's requests); group, rank, world: the trainers' gloo
    group (None: one rank), this rank, their number; timeout: the bound of the collectives;
    write_timeout: of the writes; device, stream: where stage 2 runs; engine, program: this
    rank's engine and program; links (wxfer.runtime.links.Links), runner
    (wxfer.runtime.tasks.TaskRunner), inplace (wxfer.runtime.inplace.InPlaceWriter),
    failures (wxfer.runtime.failures.FailureExchange): the collaborators a step drives."""

    def __init__(
        self,
        ctl,
        group,
        rank,
        world,
        timeout,
        write_timeout,
        device,
        stream,
        engine,
        program,
        links,
        runner,
        inplace,
        failures,
    ):
        self.ctl, self.group, self.rank, self.world = ctl, group, rank, world
        self.timeout, self.write_timeout = float(timeout), float(write_timeout)
        self.device, self.stream, self.engine, self.program = device, stream, engine, program
        self.links, self.runner, self.inplace, self.failures = links, runner, inplace, failures
        self.pending = None  # the last push's handle
        self.last_submit_s = None  # seconds to submit the last push
        self.last_phases: dict = {}  # seconds from the start of the last push() to the end of each phase
        self.carried = None  # a failure after the last push's agreement (its end stamps): told with the next
        self.delta = None  # delta pushes: wxfer.runtime.delta_send.DeltaWriter (Sender(delta=True))
        self._leads: dict = {}  # mesh group -> (its ops, the preps looked at, the order run: _ordered)
        self._events = None  # the CUDA events of the push's stream order, made at the first (_order_streams)
        self._side_ctx = None  # the side stream's context, made at the first push (_on_side)

    def settle(self) -> None:
        """The last push finished (its writes waited for) before the next one begins."""
        if self.pending is not None and not self.pending.done():
            self.pending.wait()

    # ------------------------------------------------------------------ submit
    def push(self, version: int, verify: bool, run_task, lock) -> PushHandle:
        """Submit step `version` (`run_task(op, event)`: one task's stage 1-3, the runner's
        unless a caller wraps it); returns its handle (``PushHandle.wait`` finishes it)."""
        paused = gc_pause()
        try:
            return self._push(version, verify, run_task, lock)
        finally:
            if paused:
                gc.enable()

    def _push(self, version: int, verify: bool, run_task, lock) -> PushHandle:
        import torch

        self.runner.start(version, verify)
        if self.delta is not None:
            self.delta.start(version)
        t0 = time.perf_counter()
        ph = self.last_phases = {}
        self.links.adopt_rejoins()  # before the begin stamps: a replaced worker is not written at all
        self.links.fail_dead(self.engine)  # nor one found dead (its pid, its lease): skipped, named at the end
        ph["rejoin_check"] = time.perf_counter() - t0
        keep = []  # CUDA events must outlive the engine's wait on them
        ev = None
        state = {"barrier": None, "at": (0, -1)}  # (mesh group, task) reached: a failure drains from there
        try:
            # the begin stamps first: the engine posts them while this thread orders the streams
            self.runner.write_begin()
            ph["begin_stamps"] = time.perf_counter() - t0
            if self.stream is not None:
                ev = self._order_streams(torch)  # what the zero-copy writes wait for
                keep.append(ev)
            ph["streams"] = time.perf_counter() - t0
            with (
                torch.no_grad(),
                self._on_side(torch),
                prepare.bounded(self.timeout, f"trainer rank {self.rank}, step {version}"),
            ):
                ph["groups"] = time.perf_counter() - t0  # the task loop begins (its first submission: the trace)
                self._groups(version, run_task, ev, state)
                if self.delta is not None:
                    self.delta.flush()  # each receiver's records, one write, before the end stamps
        except Exception as e:
            if self.delta is not None:
                self.delta.landed(False)
            self.inplace.abandon()  # its in-place writes land before this push raises
            own = f"{type(e).__name__}: {e}"
            log.error("trainer rank %d: step %d failed while submitting: %s", self.rank, version, own)
            broken = self.group is not None and self.world > 1 and self._group_broken(e)
            if not broken:  # a broken group: _join_failed's roll call records which rank is gone
                self.failures.mark_live(
                    version, f"trainer rank {self.rank} gave up on step {version} half written: {own}", final=False
                )
            self._join_failed(e, own, state["barrier"], state["at"], version, state.get("ops"))
            raise
        except BaseException as e:  # KeyboardInterrupt, SystemExit: record, no collectives
            if self.delta is not None:
                self.delta.landed(False)
            self.inplace.abandon()
            log.warning("trainer rank %d: step %d stopped: %s", self.rank, version, type(e).__name__)
            self.failures.mark_live(version, f"trainer rank {self.rank} stopped in step {version}: {type(e).__name__}")
            raise
        if self.stream is not None:
            join = self._events[2]  # (made by _order_streams, above: the training stream waits for the side one)
            join.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(join)
        self.last_submit_s = ph["submit"] = time.perf_counter() - t0
        self.pending = PushHandle(self, lock, version, t0, state["barrier"], keep)
        return self.pending

    def _order_streams(self, torch):
        """The side stream ordered after the training stream's work so far, and the push's event
        recorded after that on the side stream (returned: what the zero-copy writes wait for).
        Its CUDA events are made once and recorded again each push (issue 37: ``wait_stream``'s
        temporary event and a new event per push were two event creations and a destruction
        on the way to the first write): a wait already queued keeps the record it was queued
        after (cudaStreamWaitEvent uses the event's state at the call), and the push before,
        whose writes the engine waited for on the push event, was finished (``settle``) or
        abandoned before this one records it again (a task of it still polling it waits the
        longer).  The third is the training stream's wait for the side stream at the submit's
        end.  They live as long as this StepLoop (no destruction under an engine's wait)."""
        evs = self._events
        if evs is None:
            evs = self._events = (torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event())
        order, ev = evs[0], evs[1]
        order.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(order)
        ev.record(self.stream)
        return ev

    def _on_side(self, torch):
        """The side stream made current for the task loop: one ``torch.cuda.StreamContext`` made
        at the first push and entered again by each (its __init__ looks up the current device;
        entered once at a time: a push holds the Sender's lock, and the failure's drain makes its
        own); no stream: a null context."""
        if self.stream is None:
            return _nullcontext()
        if self._side_ctx is None:
            self._side_ctx = torch.cuda.stream(self.stream)
        return self._side_ctx

    def _groups(self, version, run_task, ev, state) -> None:
        """Every mesh group's tasks in order, a barrier after each (`state`: the barrier
        issued last and the (group, task) reached, for a failure's drain)."""
        runner, inplace, delta = self.runner, self.inplace, self.delta
        queue_copy = inplace.queue_copy  # (looked up once: per task it is most of the 1.7B-class loop)
        # a run of copy tasks whose cached bindings hold, queued in one call (copy_launch.queue_run),
        # in a push that copies (no call per task otherwise)
        live = delta is None and getattr(inplace, "copy_live", False) is True
        queue_run = inplace.queue_run if live else None
        for gi, ops in enumerate(self.program.groups):
            if state["barrier"] is not None:
                state["barrier"].wait(self.timeout)
            state["ops"] = None  # (until this group's order is known: a failure here drains the plan's)
            ops = self._ordered(gi, ops)
            state["ops"] = (gi, ops)  # a failure's drain follows the order run, in this group only
            batch = Batcher()  # zero-copy tasks, handed to the engine in one call (wxfer.zerocopy)
            after = 0  # the tasks before it were queued by queue_run
            for oi, op in enumerate(ops):
                if oi < after:
                    continue
                state["at"] = (gi, oi)
                if queue_run is not None:
                    after = queue_run(ops, oi)
                    if after > oi:
                        continue
                prep = op.prep
                if prep is not None:
                    prep.done = 0  # none of its collectives posted yet (a failure's drain resumes there)
                if delta is not None and not delta.bypass(op):  # the delta writer (delta_send.py)
                    run_task(op, ev)
                    continue
                if queue_copy(op):  # small: one batched copy into the receivers
                    continue
                fast = runner.fast_task(op)
                if fast is not None:
                    full = batch.add(fast, op.nbytes)
                    if full is not None:
                        runner.submit_fast(full, ev)
                    continue
                if len(batch):
                    state["at"] = (gi, oi - 1)  # a failure here: task oi's collectives are still to drain
                    runner.submit_fast(batch.take(), ev)
                    state["at"] = (gi, oi)
                run_task(op, ev)
            if len(batch):
                runner.submit_fast(batch.take(), ev)
            inplace.end_group()  # the copies still queued, the second stream joined (overlap.py)
            # stage 4: the barrier overlaps this group's writes
            state["at"] = (gi, len(ops))
            state["barrier"] = control.Barrier(
                self.group, f"the barrier after mesh group {gi} (trainer rank {self.rank}, step {version})"
            )
            state["at"] = (gi + 1, -1)

    def _ordered(self, gi: int, ops: list) -> list:
        """The order a push runs mesh group `gi`'s tasks (`ops`, the plan's order) in: the plan's,
        except where this push writes in place (cuda_ipc colocated, verify off: the in-place
        writer's ``copy_live``) and the group's first task written in place (the classifier's
        best path direct, its layout bound: ``InPlaceWriter.plan_of``) comes after tasks that
        hold all their sources here (no collective: zero copy, copied in batches or beside the
        quantizer, or packed from whole tensors): that task goes first, with the next ones
        written in place right after it (``LEAD`` in all).  Why (issue 37): Qwen3-8B
        FP8 runs its 73 norms (copies, queued for one launch later) before its first layer, whose
        quantizer launch is the first work the SMs get; the H100's first quantizer task came
        0.69 ms after the begin stamps (benchmarks/runs/h100-2026-12-07-d).  This rank's
        collectives keep their order (only tasks without one move), so the ranks' collectives
        still pair.  Decided once per group and kept while its tasks' preps are the same."""
        if self.delta is not None or getattr(self.inplace, "copy_live", False) is not True:
            return ops
        hit = self._leads.get(gi)
        if hit is not None and hit[0] is ops and all(map(operator.is_, hit[1], map(_PREP, ops))):
            return hit[2]
        out, preps = ops, []
        for f, op in enumerate(ops):
            preps.append(op.prep)
            if self._in_place(op):
                lead = [op]  # ... and the next ones written in place, LEAD in all
                for nxt in ops[f + 1 : f + LEAD]:
                    preps.append(nxt.prep)
                    if not self._in_place(nxt):
                        break
                    lead.append(nxt)
                if f:
                    out = [*lead, *ops[:f], *ops[f + len(lead) :]]
                break
            prep = op.prep
            if prep is None or getattr(prep, "gathers", True) or getattr(prep, "generic", True):
                break  # a collective before it (or a task not known to have none): the plan's order
        self._leads[gi] = (ops, tuple(preps), out)
        return out

    def _in_place(self, op) -> bool:
        """Task `op` is written in place (its best path direct, its layout bound here)."""
        best = getattr(op.prep, "best", None)
        return (
            bool(op.sends)
            and best is not None
            and best.path == taskpath.DIRECT
            and self.inplace.plan_of(op)[0] is not None
        )

    def task_order(self) -> list:
        """[[plan task, ...] of each mesh group] in the order a push runs them now (``_ordered``:
        the in-place writer's state of the last push); the host fit's order."""
        return [[op.task for op in self._ordered(gi, ops)] for gi, ops in enumerate(self.program.groups)]

    # ------------------------------------------------------------------ a failure inside the loop
    @staticmethod
    def _group_broken(exc) -> bool:
        """A collective among the trainer ranks failed or was late: a rank died or hung."""
        return isinstance(exc, control.CollectiveError) or is_gloo_failure(exc)

    def _join_failed(self, exc, own: str, barrier, at, version, ops=None) -> None:
        """This rank failed inside the task loop at task `at` = (mesh group, index): take part
        in what the other ranks are in -- the collectives (full_tensor) of the remaining tasks,
        run without writing, and the barriers of the remaining mesh groups -- then join the
        failure flag, so that every rank raises this failure within its bounds instead of
        hanging.  A failure of a collective itself (a rank died or hung) is raised as it is:
        the group is broken.  The drain resumes at the failed task's first collective that had
        not returned (prepare.collectives counts them), so a failure before a collective (the
        watermark, an allocation, a bad source) or between two pairs every collective with the
        other ranks' own; only one raised inside a collective after it was posted (or between
        the collectives of one DTensor.full_tensor() on a 2-D mesh) leaves them one out of step,
        the others failing at their collective's timeout.  No rank stamps the step complete:
        the flag says it is broken (``FailureExchange.agree``).  `ops`: (group, its tasks in the
        order the push ran them: ``_ordered``; `at` indexes it) for the group the push was in when
        its order was known, None: the plan's order everywhere."""
        broken = self._group_broken(exc)
        if broken and self.group is not None and self.world > 1:
            gone = self.failures.mark_other_rank_gone(version, exc)
            self._abort()
            msg = f"wxfer: trainer rank {self.rank}, step {version}: {gone}: {own}"
            raise control.CollectiveError(msg) from exc
        if self.group is None or self.world == 1:
            self._abort()
            return
        groups = self.program.groups
        gi, oi = at
        try:
            for g in range(gi, len(groups)):
                cur = ops[1] if g == gi and ops is not None and ops[0] == gi else groups[g]
                if g > gi and barrier is not None:
                    barrier.wait(self.timeout)
                if g == gi and oi >= len(cur):
                    continue  # this group's barrier was issued already
                if g == gi and oi >= 0:
                    # the failed task's collectives not yet posted (a failure before them -- the
                    # watermark, an allocation -- or between them), then the later tasks'
                    self._drain([cur[oi]], resume=True)
                    self._drain(cur[oi + 1 :])
                else:
                    self._drain(cur)
                barrier = control.Barrier(
                    self.group,
                    f"the barrier after mesh group {g} (trainer rank {self.rank}, step {version}, after its failure)",
                )
            self._abort()
            if barrier is not None:
                barrier.wait(self.timeout)
            _, others = self.failures.agree(own, version, broken=True)
        except Exception as e2:  # noqa: BLE001 -- the others are gone too: report ours
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {version}: {own}\n(and telling the "
                f"other trainer ranks failed: {e2})"
            ) from exc
        if others:
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {version}: {own}"
                + "".join(f"\ntrainer rank {r} reports: {o}" for r, o in others)
            ) from exc

    def _drain(self, ops, resume: bool = False) -> None:
        """The collectives of `ops` (nothing packed or written), for the other ranks' sake;
        `resume`: from each one's first collective not posted in this push (prep.done)."""
        import torch

        for op in ops:
            try:
                with (
                    torch.no_grad(),
                    torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext(),
                    prepare.bounded(self.timeout, f"trainer rank {self.rank}, draining its failed step"),
                ):
                    # the same collectives as run_task's (one all-gather per task and group)
                    prep = op.prep if op.prep is not None else prepare.task_prep(op, self.device)
                    op.prep = prep
                    prepare.collectives(prep, self.device, None, prep.done if resume else 0)
            except Exception as e:  # noqa: BLE001 -- this step is failed already
                if isinstance(e, control.CollectiveError) or is_gloo_failure(e):
                    raise  # the group is broken (a rank died or hung): no more to drain

    def _abort(self) -> None:
        try:
            self.engine.wait(timeout=self.write_timeout)
        except Exception:  # noqa: BLE001
            self.engine.clear_error()

    # ------------------------------------------------------------------ finish
    def finish(self, h: PushHandle, timeout) -> float:
        """_finish, and the delta writer told whether the step landed everywhere."""
        if self.delta is None:
            return self._finish(h, timeout)
        try:
            seconds = self._finish(h, timeout)
        except BaseException:
            self.delta.landed(False)
            raise
        self.delta.landed(True, seconds)
        return seconds

    def _finish(self, h: PushHandle, timeout) -> float:
        """Wait for step `h`, join the other ranks (barrier, failure flag); raise when any
        rank's step failed; returns its seconds.  With several trainer ranks the end stamps
        are posted only after the flag said that no rank broke the step (``_end_stamps``)."""
        exc = None
        several = self.group is not None and self.world > 1
        try:
            own = self._finish_writes(h, timeout, stamps=not several)
        except Exception as e:  # noqa: BLE001 -- joined with the other ranks below, then raised
            self.inplace.abandon()
            exc, own = e, f"{type(e).__name__}: {e}"
            log.error("trainer rank %d: step %d failed waiting for its writes: %s", self.rank, h.version, own)
            why = f"trainer rank {self.rank} gave up on step {h.version}: {own}"
            self.failures.mark_live(h.version, why, final=False)
        own = _joined(self.carried, own)  # what failed after the last push's agreement
        self.carried = None
        if h._barrier is not None:
            try:
                h._barrier.wait(self.timeout)
            except Exception as e:
                gone = self.failures.mark_other_rank_gone(h.version, e)
                raise control.CollectiveError(f"{gone}: {e}" + and_own(own)) from exc
        # every trainer rank raises when any rank saw a failure (SPMD loops stay in step)
        broken, others = self.failures.agree(own, h.version, broken=exc is not None)
        if several and broken and exc is None:
            why = f"trainer rank {self.rank} did not stamp step {h.version} complete: another trainer rank broke it"
            self.failures.mark_live(h.version, why, final=False)
        elif several and not broken:
            late = self._end_stamps(h, timeout)
            if late is not None and own is None and not others:
                self.carried = late  # the others agreed already: reported with the next push's flag
                log.error("trainer rank %d: step %d: %s", self.rank, h.version, late)
            else:
                own = _joined(own, late)
        if exc is not None and not others:
            raise exc
        if own is not None or others:
            msg = f"wxfer: trainer rank {self.rank}, step {h.version}: " + (
                own if own is not None else "this rank's writes all landed, but"
            )
            msg += "".join(f"\ntrainer rank {r} reports: {o}" for r, o in others)
            log.error("%s", msg)
            raise RuntimeError(msg) from exc
        seconds = self.last_phases["done"] = time.perf_counter() - h._t0
        ph = self.last_phases
        log.debug(
            "push: trainer rank %d, step %d, %d bytes in %.6f s (submitted at %.6f s, writes landed at %.6f s)",
            self.rank,
            h.version,
            self.program.bytes_per_step,
            seconds,
            ph.get("submit", float("nan")),
            ph.get("writes", float("nan")),
        )
        h._keep.clear()
        return seconds

    def _bound(self, timeout) -> float:
        return writes_bound(self.write_timeout if timeout is None else timeout)

    def _finish_writes(self, h: PushHandle, timeout, stamps: bool = True):
        """Wait for this rank's data writes (`stamps`: and its end stamps, posted by the
        engine after them), verify; returns this rank's failure report (None: every receiver
        got every byte, and its stamp when `stamps`)."""
        t = self._bound(timeout)
        if stamps:
            self.runner.write_end()  # a plain fence: after every task, the in-place writes' too
            self.runner.wait_engine(t, "waiting for the weight writes and the end version stamps")
        else:
            self.runner.wait_engine(t, "waiting for the weight writes")
        self.last_phases["writes"] = time.perf_counter() - h._t0
        failed, refused = self._take_failed(h.version, "its writes")
        if failed or refused:
            self.runner.drop_sums()
            return self._report(h.version, failed, refused)
        self.runner.verify_landed(self.ctl, t)  # a mismatch raises: the step is broken, not stamped
        return None

    def _end_stamps(self, h: PushHandle, timeout) -> str | None:
        """Every rank agreed that the step went well: post this rank's end stamps and wait for
        them; returns what failed meanwhile (a worker that died after its data landed), or None."""
        try:
            self.runner.write_end()
            self.runner.wait_engine(self._bound(timeout), "waiting for the end version stamps")
        except Exception as e:  # noqa: BLE001 -- the data landed; the stamps' failure is reported
            return f"{type(e).__name__}: {e}"
        self.last_phases["stamps"] = time.perf_counter() - h._t0
        failed, _ = self._take_failed(h.version, "its end stamp", new_only=True)
        return self._report(h.version, failed, {}) if failed else None

    def _take_failed(self, version: int, what: str, new_only: bool = False) -> tuple:
        """({gpu: why} failed in the engine or found dead, {gpu: why} restarts refused); the
        failed ones are skipped from now on and recorded torn (`new_only`: only those not
        given up on before, and no restarts taken)."""
        failed = self.links.failed(self.engine, self.runner.describe)
        new = self.links.drop(failed)
        if new_only:
            failed = {g: why for g, why in failed.items() if g in new}
        for g in sorted(new):
            log.warning(
                "trainer rank %d: step %d: inference worker gpu %d failed and is skipped from now on: %s",
                self.rank,
                version,
                g,
                failed[g],
            )
            self.failures.mark(
                [g],
                version,
                f"trainer rank {self.rank} gave up on {what} of step {version} "
                f"here and skips this worker from now on: {failed[g]}",
                dropped=True,
            )
        return failed, ({} if new_only else self.links.take_refused())

    def _report(self, version, failed: dict, refused: dict) -> str:
        """This rank's failure report: the workers whose writes failed, the restarts refused."""
        parts = []
        if failed:
            parts.append(
                f"the writes to {len(failed)} inference worker(s) failed; they are skipped from now "
                "on (a restarted one is taken at the next push):\n  "
                + "\n  ".join(f"{self.links.worker_name(g)}: {why}" for g, why in sorted(failed.items()))
            )
        if refused:
            parts.append(
                f"{len(refused)} restarted inference worker(s) refused (the one in place, if alive, "
                "is still written):\n  "
                + "\n  ".join(f"inference worker gpu {g}: {why}" for g, why in sorted(refused.items()))
            )
        ok = sorted(set(self.links.workers) - set(failed))
        if not ok:  # issue 35.8: "the other workers ([])" said nothing
            return "\n".join(parts) + f"\nno other inference worker is written by this trainer rank in step {version}"
        return (
            "\n".join(parts) + f"\nthe other workers ({ok}) received every byte of step {version} and its version stamp"
        )


def _joined(a: str | None, b: str | None) -> str | None:
    return b if a is None else a if b is None else a + "\n" + b


def _nullcontext():
    return contextlib.nullcontext()
