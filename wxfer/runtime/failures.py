"""A step's failure exchange among the trainer ranks (a Sender collaborator, issue 17): the
torn records of abandoned writes for Receiver.state() (torn/<gpu>/e<epoch>/<i> in the store),
the roll call naming a trainer rank that died or hung, and the one gloo all-reduce of a
failure flag per push (the reports gathered only when a flag is set), so that every rank
raises together and SPMD loops stay in step, and no rank posts the end stamps of a step that
another rank broke (the flag says which: a report, or a broken step).

The seam for the reliability work (issue 25): what is recorded for a torn step, and how the
ranks agree that a step failed, are decided here and nowhere else."""

from __future__ import annotations

import logging

from . import control

log = logging.getLogger(__name__)


class FailureExchange:
    """ctl: the job's Control; group: the trainers' gloo group (None: one rank); rank, world:
    this trainer rank and their number; timeout: the bound of the collectives; write_timeout:
    the bound of the roll call (at most 5 s); store_host: whether this rank hosts the store;
    links: this rank's workers (wxfer.runtime.links.Links: their epochs and the live ones);
    plan_gpus: every inference worker of the plan (a rank gone may have torn any of them)."""

    def __init__(self, ctl, group, rank, world, timeout, write_timeout, store_host, links, plan_gpus):
        self.ctl, self.group, self.rank, self.world = ctl, group, rank, world
        self.timeout, self.write_timeout = float(timeout), float(write_timeout)
        self.store_host = bool(store_host)
        self.links = links
        self.plan_gpus = list(plan_gpus)
        self.marked: set = set()  # (gpu, epoch, writer, step) recorded already

    # ------------------------------------------------------------------ torn records
    def mark(self, gpus, step: int, why: str, writer="self", final: bool = True, dropped: bool = False) -> None:
        """Record in the store, for Receiver.state(), that the writes of `writer` (this rank;
        None: some trainer rank) of step `step` to `gpus` were abandoned; `final`: no later
        push of this rank will repair them (it skips the worker, or is going away).  Best
        effort: a store that cannot be reached leaves the stamps to say "being written".
        `dropped`: this rank skips these workers from now on (state() reads dropped, not torn)."""
        writer = self.rank if writer == "self" else writer
        epochs = self.links.epoch
        for g in sorted(gpus):
            try:
                e = epochs[g] if g in epochs else self.ctl.add("infer/epoch/%d" % g, 0)
                if (g, e, writer, step) in self.marked:
                    continue
                self.marked.add((g, e, writer, step))
                base = "torn/%d/e%d" % (g, e)
                i = self.ctl.add(base, 1)
                self.ctl.set_json(
                    "%s/%d" % (base, i),
                    dict(
                        step=int(step), writer=writer, by=self.rank, why=why, final=bool(final), dropped=bool(dropped)
                    ),
                )
            except Exception:  # noqa: BLE001
                pass

    def mark_live(self, step: int, why: str, final: bool = True) -> None:
        """Every worker this rank still writes holds a torn step `step` (this rank abandoned it)."""
        self.mark(self.links.live(), step, why, final=final)

    def mark_other_rank_gone(self, step: int, exc) -> str:
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
                if not self.store_host
                else f"a trainer rank other than {self.rank} died or hung"
            )
        log.error("trainer rank %d: step %d: %s (%s)", self.rank, step, gone_s, exc)
        self.mark(self.plan_gpus, step, f"{gone_s} in step {step} ({exc})", writer=None)
        return gone_s

    # ------------------------------------------------------------------ the flag
    def agree(self, own: str | None, step: int, broken: bool = False) -> tuple:
        """Whether every trainer rank may post its end stamps of step `step`, and the other
        ranks' failure reports: (broken anywhere, [(rank, report)]).  One gloo all_reduce
        (MAX) of a flag per push -- 0: this rank's step went well; 1: it has a report (some
        workers' writes failed: skipped, named) but every byte it sent to the others landed;
        2: its step is broken (`broken`: an exception in its loop or its writes' wait), so no
        rank stamps the step complete anywhere -- then the reports, gathered only when a flag
        is set."""
        if self.group is None or self.world == 1:
            return bool(broken), []
        import torch
        import torch.distributed as dist

        level = 2 if broken else (0 if own is None else 1)
        flag = torch.tensor([level], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            control.wait_work(work, self.timeout, f"the failure flag of step {step} (trainer rank {self.rank})")
        except Exception as e:
            gone = self.mark_other_rank_gone(step, e)
            raise control.CollectiveError(
                f"wxfer: trainer rank {self.rank}, step {step}: {gone}; the other trainer "
                f"ranks did not finish the step within {self.timeout:.0f} s: {e}" + and_own(own)
            ) from e
        top = int(flag.item())
        if top == 0:
            return False, []
        what = f"the failure reports of step {step} (trainer rank {self.rank})"
        try:
            reports = control.gather_strings(self.group, own, self.timeout, what)
        except Exception as e:
            gone = self.mark_other_rank_gone(step, e)
            raise control.CollectiveError(
                f"wxfer: trainer rank {self.rank}, step {step}: {gone}: {e}" + and_own(own)
            ) from e
        return top >= 2, [(r, o) for r, o in enumerate(reports) if o is not None and r != self.rank]


def and_own(own: str | None) -> str:
    """This rank's own failure, kept in the error of a collective that failed after it."""
    return f"\n(and this rank: {own})" if own else ""


def is_gloo_failure(exc) -> bool:
    """A collective's own failure raised by torch (a peer rank's connection closed)."""
    t = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or (
        "gloo" in t.lower() and ("connection" in t.lower() or "closed" in t.lower() or "timed out" in t.lower())
    )
