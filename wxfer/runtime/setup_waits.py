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


def load_plan(ctl, group, rank: int, timeout: float, data: bytes, linger):
    """The plan from the store's `data` (rank 0's result), decoded and checked on this rank,
    agreed on by every rank; SetupError on every rank naming each failing rank's reason.
    `linger(receivers)`: wait for the receivers to read the error (the store's host)."""
    plan, err = None, None
    try:
        plan = program.plan_from_bytes(
            control.decode_result(data, "trainer rank 0 (controller)"), "the plan from trainer rank 0"
        )
    except SetupError as e:
        if data[:2] == control.ERR:  # rank 0's own error: every rank has it already
            raise
        err = str(e)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    try:
        control.agree(group, err, rank, "loading the plan", timeout)
    except SetupError as e:
        if rank == 0:  # the receivers wait for this key (or a handshake request)
            ctl.set("setup", control.encode_result(None, str(e)))
        linger(len(program.receivers_of(plan)) if plan is not None else None)
        raise
    return plan
