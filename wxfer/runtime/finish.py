"""The end of a push on the trainer side (a Sender mixin): wait for this rank's writes, the end
version stamps after them (an engine fence), the workers that failed marked and skipped from
then on, verify mode's checksums, the mesh-group barrier, and every trainer rank's failure
reports exchanged, so that all ranks raise together (SPMD loops stay in step)."""

from __future__ import annotations

import logging
import time

from . import control

log = logging.getLogger(__name__)


class FinishMixin:
    def _failed_workers(self) -> dict:
        """{gpu: reason} of the receivers whose writes failed or were late (the engine skips
        them from then on; the others go on)."""
        out = {}
        for err in self.engine.failed_peers():
            if err.peer not in self._gpu_of_peer:
                continue  # a worker since replaced by its restart
            out[self._gpu_of_peer[err.peer]] = f"{self._describe(err)} (errno {err.errno})"
        return out

    def _finish(self, h, timeout) -> None:
        exc = None
        try:
            own = self._finish_writes(h, timeout)
        except Exception as e:  # noqa: BLE001 -- joined with the other ranks below, then raised
            self._direct_abandon()
            exc, own = e, f"{type(e).__name__}: {e}"
            log.error("trainer rank %d: step %d failed waiting for its writes: %s", self.rank, h.version, own)
            self._mark(
                set(self.workers) - self._dropped(),
                h.version,
                f"trainer rank {self.rank} gave up on step {h.version}: {own}",
                final=False,
            )
        if h._barrier is not None:
            try:
                h._barrier.wait(self.timeout)
            except Exception as e:
                gone = self._mark_other_rank_gone(h.version, e)
                raise control.CollectiveError(f"{gone}: {e}" + _and_own(own)) from exc
        # every trainer rank raises when any rank saw a failure (SPMD loops stay in step)
        others = self._failures_elsewhere(own)
        if exc is not None and not others:
            raise exc
        if own is not None or others:
            msg = f"wxfer: trainer rank {self.rank}, step {h.version}: " + (
                own if own is not None else "this rank's writes all landed, but"
            )
            msg += "".join(f"\ntrainer rank {r} reports: {o}" for r, o in others)
            log.error("%s", msg)
            raise RuntimeError(msg) from exc
        h.seconds = self.last_phases["done"] = time.perf_counter() - h._t0
        ph = self.last_phases
        log.debug(
            "push: trainer rank %d, step %d, %d bytes in %.6f s (submitted at %.6f s, writes landed at %.6f s)",
            self.rank,
            h.version,
            self.bytes_per_step,
            h.seconds,
            ph.get("submit", float("nan")),
            ph.get("writes", float("nan")),
        )
        h._keep.clear()

    def _finish_writes(self, h, timeout):
        """Wait for this rank's data writes, write its end stamps, verify; returns this rank's
        failure report (None: every receiver got every byte and its stamp)."""
        t = self.write_timeout if timeout is None else timeout
        # every task has its own deadline (write_timeout from its first write); a receiver
        # that stops answering fails alone at that deadline, so wait a little longer here
        t = 1.5 * t + 1.0
        if self.stamp_dests:
            # posted by the engine once every data write of the step has completed (a fence),
            # after the side stream's work so far; the engine skips the failed receivers: the
            # others get their stamp, since every one of their writes of this step has landed
            self.stamp_src.fill_(h.version)
            self._submit_stamps(self.stamp_src, self._stamp_dest, "end", h._end_event)
        self._wait_engine(t, "waiting for the weight writes and the end version stamps")
        self._direct_wait()  # the writes straight into the receivers (done: the end stamps waited for them)
        ph = self.last_phases
        ph["writes"] = time.perf_counter() - h._t0
        failed = self._failed_workers()
        if failed:
            new = set(failed) - self._dropped()
            self._dropped_gpus = self._dropped() | set(failed)
            for g in sorted(new):
                log.warning(
                    "trainer rank %d: step %d: inference worker gpu %d failed and is skipped from now on: %s",
                    self.rank,
                    h.version,
                    g,
                    failed[g],
                )
                self._mark(
                    [g],
                    h.version,
                    f"trainer rank {self.rank} gave up on its writes of step {h.version} "
                    f"here and skips this worker from now on: {failed[g]}",
                )
        refused, self._refused = self._refused, {}
        own = None
        if failed or refused:
            self._sums = None
            parts = []
            if failed:
                parts.append(
                    f"the writes to {len(failed)} inference worker(s) failed; they are skipped from now "
                    "on (a restarted one is taken at the next push):\n  "
                    + "\n  ".join(f"{self._worker_name(g)}: {why}" for g, why in sorted(failed.items()))
                )
            if refused:
                parts.append(
                    f"{len(refused)} restarted inference worker(s) refused (the one in place, if alive, "
                    "is still written):\n  "
                    + "\n  ".join(f"inference worker gpu {g}: {why}" for g, why in sorted(refused.items()))
                )
            ok = sorted(set(self.workers) - set(failed))
            own = (
                "\n".join(parts) + f"\nthe other workers ({ok}) received every byte of step {h.version} "
                "and its version stamp"
            )
        if own is None and self._sums is not None:
            self._last_sums, self._sums = self._sums, None
            from .verify import request

            self.last_verify = request(self.ctl, self.rank, h.version, self._last_sums, self.workers, t)
        return own

    def _failures_elsewhere(self, own: str | None) -> list:
        """[(rank, report)] of the other trainer ranks whose step failed: one gloo all_reduce
        of a flag per push, the reports gathered only when a flag is set."""
        if self.group is None or self.world == 1:
            return []
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if own is None else 1], dtype=torch.int32)
        work = dist.all_reduce(flag, group=self.group, async_op=True)
        try:
            control.wait_work(work, self.timeout, f"the failure flag of step {self.version} (trainer rank {self.rank})")
        except Exception as e:
            gone = self._mark_other_rank_gone(self.version, e)
            raise control.CollectiveError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {gone}; the other trainer "
                f"ranks did not finish the step within {self.timeout:.0f} s: {e}" + _and_own(own)
            ) from e
        if int(flag.item()) == 0:
            return []
        what = f"the failure reports of step {self.version} (trainer rank {self.rank})"
        try:
            reports = control.gather_strings(self.group, own, self.timeout, what)
        except Exception as e:
            gone = self._mark_other_rank_gone(self.version, e)
            raise control.CollectiveError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {gone}: {e}" + _and_own(own)
            ) from e
        return [(r, o) for r, o in enumerate(reports) if o is not None and r != self.rank]

    def _abort(self) -> None:
        try:
            self.engine.wait(timeout=self.write_timeout)
        except Exception:  # noqa: BLE001
            self.engine.clear_error()


def _and_own(own: str | None) -> str:
    """This rank's own failure, kept in the error of a collective that failed after it."""
    return f"\n(and this rank: {own})" if own else ""
