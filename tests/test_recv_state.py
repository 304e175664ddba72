"""wxfer.runtime.recv_state alone: what Receiver.state() / version() / wait_version() read from
the version stamps and the trainers' torn records, over a real TCPStore, without a transport."""

import pytest
import torch

from wxfer.runtime.control import Bounded, Control
from wxfer.runtime.recv_state import ReceiverState, TornError

T = 10.0
GPU = 3
MADE: list = []  # the Stamps of the running test


class Stamps(ReceiverState):
    """What ReceiverState reads of a Receiver: stamps over `senders`, the store, the identity."""

    def __init__(self, ctl, senders, slots=4):
        self.stamps = torch.full((2 * slots,), -1, dtype=torch.int64)
        self.stamp_slots, self.senders, self.ctl = slots, list(senders), ctl
        self.gpu, self.epoch, self.replica, self.rank = GPU, 0, 1, 1
        self.writers, self._gone = None, {}
        self._busy_key = self._busy_since = None
        self._marks_checked, self._last_marks = -1.0, []
        self._store_look = Bounded(self._look_store, "test store look")
        MADE.append(self)

    def write(self, i, begin, end):
        """Trainer slot i's stamps: begin (the step it started), end (the step it finished)."""
        self.stamps[self.stamp_slots + i], self.stamps[i] = begin, end
        self._marks_checked = -1.0  # the next state() reads the store again


def mark(ctl, step, writer, final=True, dropped=False, why="gave up"):
    """A trainer's record of giving up on worker GPU (the keys failures.FailureExchange.mark writes)."""
    base = "torn/%d/e0" % GPU
    i = ctl.add(base, 1)
    ctl.set_json("%s/%d" % (base, i), dict(step=step, writer=writer, by=0, why=why, final=final, dropped=dropped))


@pytest.fixture
def ctl(store):
    return Control(store[0], "rs", T)


@pytest.fixture(autouse=True)
def _closed_looks():
    """The store look thread of every Stamps a test made, closed at its end."""
    yield
    while MADE:
        MADE.pop()._store_look.close()


def test_no_writers_and_unwritten_stamps_read_unwritten(ctl):
    for r in (Stamps(ctl, []), Stamps(ctl, [0, 1])):
        st = r.state()
        assert r.version() == -1 and st["state"] == "unwritten" and st["version"] == -1, st
        assert f"gpu {GPU}" in st["message"]


def test_complete_is_the_least_end_stamp_once_no_sender_is_mid_step(ctl):
    r = Stamps(ctl, [0, 1])
    r.write(0, 5, 5)
    r.write(1, 4, 4)
    st = r.state()
    assert r.version() == 4 and (st["state"], st["version"], st["step"]) == ("complete", 4, 4), st


def test_a_sender_mid_step_reads_writing_then_torn_once_it_records_giving_up(ctl):
    r = Stamps(ctl, [0, 1])
    r.write(0, 5, 5)
    r.write(1, 5, 4)
    st = r.state()
    assert r.version() == -1 and (st["state"], st["step"], st["ranks"]) == ("writing", 5, [1]), st
    mark(ctl, 5, 1, final=False, why="trainer rank 1 timed out")
    st = r.state()
    assert (st["state"], st["step"], st["final"]) == ("torn", 5, False), st
    assert "trainer rank 1 timed out" in st["why"] and "next push" in st["message"]


def test_a_record_overtaken_by_a_later_end_stamp_no_longer_counts(ctl):
    r = Stamps(ctl, [0])
    mark(ctl, 2, 0, why="old")
    r.write(0, 3, 3)
    assert r.state()["state"] == "complete"


def test_dropped_between_pushes_keeps_the_complete_step(ctl):
    r = Stamps(ctl, [0, 1])
    r.write(0, 4, 4)
    r.write(1, 4, 4)
    mark(ctl, 5, 0, dropped=True, why="worker stalled")
    st = r.state()
    assert (st["state"], st["version"], st["step"], st["final"]) == ("dropped", 4, 5, True), st
    with pytest.raises(TornError, match="dropped by the trainers at step 5"):
        r.wait_version(5, timeout=5.0)


def test_wait_version_returns_when_reached_and_names_late_ranks_at_its_deadline(ctl):
    r = Stamps(ctl, [0, 1])
    r.write(0, 2, 2)
    r.write(1, 2, 2)
    assert r.wait_version(2, timeout=1.0) == 2
    r.write(0, 3, 3)
    with pytest.raises(TimeoutError, match=r"waiting for 3; trainer ranks not done: \[1\]"):
        r.wait_version(3, timeout=0.2)
