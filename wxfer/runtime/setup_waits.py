"""The trainers' setup waits, bounded by their phase (issue 25.7).

Each setup phase of a trainer rank (the plan: rank 0 waiting for the receivers and building
it, the others waiting for it; then the connections) ends within 1.1x `timeout` of its start
on every rank, its error naming the first failing rank's reason:

- rank 0 waits for the receivers until the phase start + `timeout` and posts its error;
- the other ranks wait for the plan a little longer (PLAN_WAIT x `timeout`), so that they
  read rank 0's reason rather than time out beside it;
- after an error, a rank lingers (the store lives in rank 0; a launcher ends rank 0 once
  another rank exits) only until LINGER x `timeout` from the phase start, not a further
  `timeout` for acks from ranks that already gave up;
- the plan every rank loads from the store is decoded and checked on every rank, and the
  ranks agree on it before any of them connects: a plan refused on rank 1 fails every rank
  naming rank 1's reason (it had reached rank 0 as a raw gloo error once rank 1 exited),
  and rank 0 tells the receivers (store key ``setup``).
"""

from __future__ import annotations

import time

from . import control, program
from .control import SetupError

PLAN_WAIT = 1.03
LINGER = 1.05


class Phase:
    """A setup phase's bound on a trainer rank: ``start()`` begins one; lingering after an error
    ends `frac` x timeout from there (``left``)."""

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self.by = None

    def start(self, frac: float = LINGER) -> None:
        self.by = time.monotonic() + frac * self.timeout

    def left(self, cap: float) -> float:
        """Seconds one may still linger after a setup error: at most `cap`, no later than the
        phase's deadline; at least 50 ms so that a reader polling at 50 ms gets it."""
        if self.by is None:
            return cap
        return max(0.05, min(cap, self.by - time.monotonic()))


def load_plan(ctl, group, rank: int, timeout: float, data, linger, error: str | None = None):
    """The plan from the store's `data` (rank 0's result), decoded and checked on this rank,
    agreed on by every rank; SetupError on every rank naming each failing rank's reason.
    `linger(receivers)`: wait for the receivers to read the error (the store's host).
    `error`: this rank could not read the plan at all (its record failed authentication).
    An error record is agreed on too (issue 35.8): one that trainer rank 0 did not write
    (forged in a store without a secret) fails every rank naming it, where rank 1 had
    raised alone and rank 0 got a raw gloo error; when rank 0 did fail, its reason is raised
    as before."""
    plan, err, rank0_said = None, error, None
    if err is None:
        try:
            plan = program.plan_from_bytes(
                control.decode_result(data, "trainer rank 0 (controller)"), "the plan from trainer rank 0"
            )
        except SetupError as e:
            if data[:2] == control.ERR:  # rank 0's own error, as the store has it (or a forged one)
                rank0_said = e
            err = str(e)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    try:
        control.agree(group, err, rank, "loading the plan", timeout)
    except (SetupError, control.CollectiveError) as e:
        if rank0_said is not None and 0 in getattr(e, "ranks", ()):
            raise rank0_said from None  # rank 0 failed indeed (and told the receivers): its reason
        if isinstance(e, control.CollectiveError):  # a rank gone: Ctrl-C (its note), else gloo's word
            try:
                check_stopped(ctl)
            except SetupError as stopped:
                e = stopped
            except Exception:  # noqa: BLE001 -- the store is gone too
                pass
            if rank == 0:
                ctl.set("setup", control.encode_result(None, str(e)))
            linger(len(program.receivers_of(plan)) if plan is not None else None)
            raise e
        if rank == 0:  # the receivers wait for this key (or a handshake request)
            ctl.set("setup", control.encode_result(None, str(e)))
        linger(len(program.receivers_of(plan)) if plan is not None else None)
        raise
    return plan


def join_refusal(group, error: str, timeout: float) -> None:
    """Trainer rank 0, whose plan failed to build: take part in the other ranks' agreement on
    the plan (load_plan) with its error, so that they raise its reason (bounded: `timeout`)."""
    try:
        control.agree(group, error, 0, "loading the plan", timeout)
    except Exception:  # noqa: BLE001 -- rank 0 raises its own error
        pass


STOPPED = "setup/stopped"  # a trainer rank interrupted during setup says so here (encode_result)


def tell_stopped(ctl, rank: int, exc: BaseException) -> None:
    """Trainer rank `rank` was interrupted (Ctrl-C, SystemExit) during setup: say so in the
    store, where rank 0's waits for the workers and the plan's readers look, instead of
    leaving them to their timeout.  Best effort (the store may be gone)."""
    import os
    import socket

    why = (
        f"trainer rank {rank} (pid {os.getpid()}, host {socket.gethostname()}) was stopped during "
        f"setup: {type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"
    )
    try:
        ctl.set(STOPPED, control.encode_result(None, why))
        if rank == 0:  # the receivers wait for this key
            ctl.set("setup", control.encode_result(None, why))
    except Exception:  # noqa: BLE001
        pass


def check_stopped(ctl) -> None:
    """SetupError when a trainer rank said it was stopped during setup (tell_stopped)."""
    if ctl.check(STOPPED):
        control.decode_result(ctl.get(STOPPED, "a stopped trainer rank's note", 1), "another trainer rank")
