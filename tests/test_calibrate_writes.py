"""calibrate's write probe (wxfer.tools.calibrate_writes.write_rates) measures the writes the way a
push makes them, many in flight at once: against an engine whose submit + wait takes a round
trip, the bytes at a rate and a fixed time per write, it finds that rate and that time per
write, where one write at a time would read the round trip into the rate."""

import time

import pytest
import torch

from wxfer.tools.calibrate_writes import write_rates

ROUND, RATE, PER = 8e-3, 4e9, 400e-6  # s per submit + wait, bytes/s in flight, s per write
SIZE = 32 << 20


class _Engine:
    """Sleeps as a link would: ROUND + bytes / RATE + PER per write, per submit + wait."""

    def __init__(self):
        self.dests = None
        self.submits = []

    def submit(self, region, dests, tag=0):
        self.dests = list(dests)
        self.submits.append(len(self.dests))

    def wait(self, timeout=None):
        nb = sum(d[3] for d in self.dests)
        time.sleep(ROUND + nb / RATE + PER * len(self.dests))


@pytest.mark.timeout(120)
def test_the_rate_and_the_cost_per_write_of_writes_in_flight(monkeypatch):
    from wxfer.tools import calibrate

    monkeypatch.setattr(calibrate, "_sync", lambda dev: None)  # the GPU's path, timed on the host here
    eng = _Engine()
    got = write_rates(eng, object(), b"desc", SIZE, torch.device("cuda", 0), quick=True)
    # the slope between writes in flight: the round trip cancels (one write alone would read
    # SIZE / (ROUND + SIZE / RATE), half the rate)
    assert got["write_GBps"] * 1e9 == pytest.approx(RATE, rel=0.2), got
    assert got["write_single_GBps"] * 1e9 < 0.6 * RATE
    assert got["write_dev_link_s"] == pytest.approx(PER, rel=0.3), got
    assert got["write_inflight"] == 8 and got["write_cut_n"] in eng.submits and got["write_cut_n"] > 4
    # every write of a submit lies inside the region of SIZE bytes
    assert all(0 <= d[2] and d[2] + d[3] <= SIZE for d in eng.dests)
