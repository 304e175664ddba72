"""Issue 35.9, the store rows' finding 1: a store that stops answering (its process SIGSTOPped,
sockets open) must not stop a worker's ``state()`` nor blind a trainer without a word.

- ``state()`` reads the store on a thread of its own (control.Bounded) and waits for it at most
  receiver.STATE_STORE_S: it answers from the stamps and the store's last answer, and says the
  store is silent; further calls return at once while the look is stuck.  Before, it blocked
  in ``Control.add`` for as long as the store was stopped (past 85 s in
  benchmarks/store_faults.py).
- The trainer's watcher, blocked in the same store, is reported once (a warning and
  ``Sender.stats()["watcher"]``) and once more when the store answers again.

Real processes: the TCPStore in its own process; the Sender and two Receivers (threads) here,
over fabric tcp."""

import logging
import subprocess
import sys
import signal
import threading
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, preset_for
from wxfer.runtime import control, links, receiver
from helpers import joined, receivers_in_threads  # tests/helpers.py

T = 30.0
FABRIC = _wxfer.backends()["fabric"][0]


def test_a_bounded_look_waits_at_most_its_bound_and_runs_one_look_at_a_time():
    gate, calls = threading.Event(), []

    def fn():
        calls.append(1)
        if not gate.wait(10):
            raise AssertionError("never released")
        if len(calls) == 3:
            raise ValueError("the store said no")
        return len(calls)

    b = control.Bounded(fn, "test look")
    t0 = time.monotonic()
    ok, silent = b.look(0.3)
    took = time.monotonic() - t0
    assert not ok and 0.25 < took < 2.0 and silent >= 0.25, (ok, silent, took)
    assert b.in_flight()
    t0 = time.monotonic()
    ok, silent = b.look(0.3)  # the same look still stuck: no wait, no second call
    assert not ok and time.monotonic() - t0 < 0.1 and silent >= 0.3
    assert len(calls) == 1
    gate.set()
    assert b.look(2.0) == (True, 1)  # the stuck look's answer
    assert b.look(2.0) == (True, 2)  # a fresh one
    with pytest.raises(ValueError, match="the store said no"):
        b.look(2.0)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.look(1.0)


def _store_process(port: int) -> subprocess.Popen:
    code = (
        "import sys, time; from datetime import timedelta; import torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, timeout=timedelta(seconds={T}), "
        "wait_for_workers=False); print('up', flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def _timed_state(r):
    t0 = time.monotonic()
    st = r.state()
    return st, time.monotonic() - t0


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
@pytest.mark.timeout(120)
def test_state_and_the_watcher_outlast_a_stopped_store(monkeypatch, caplog):
    from wxfer.runtime.sender import Sender

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    import fault_worker

    monkeypatch.setattr(links, "WATCH_SILENT_S", 0.5, raising=False)
    port = control.free_port()
    sp = _store_process(port)
    addr, name = "127.0.0.1:%d" % port, "stall"
    sender = recvs = None
    try:
        params, ths = receivers_in_threads(TINY, addr, name, 2, timeout=T)
        m = fault_worker.model()
        sender = Sender(m, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=3)
        recvs = joined(ths, T)
        sender.push()
        for r in recvs:
            st, took = _timed_state(r)
            assert st["state"] == "complete" and st["version"] == 1, st
            assert "has not answered" not in st["message"]
        sp.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # past state()'s 0.1 s between store looks
        st, took = _timed_state(recvs[0])
        print(f"store stopped: state() took {took:.2f} s: {st['message']}")
        assert took < receiver.STATE_STORE_S + 0.5, took
        assert st["state"] == "complete" and st["version"] == 1, st
        assert "the trainers' store has not answered for" in st["message"], st
        st, took = _timed_state(recvs[0])  # the look still stuck: at once
        assert took < 0.1 and "has not answered" in st["message"], (took, st)
        # the push does not need the store: it lands, and state() reads it (from the stamps)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
        time.sleep(0.6)  # the watcher's look has been stuck past WATCH_SILENT_S
        caplog.set_level(logging.WARNING, logger="wxfer.runtime.links")
        sender.push()
        assert recvs[1].version() == 2
        st, took = _timed_state(recvs[1])
        assert took < receiver.STATE_STORE_S + 0.5 and st["state"] == "complete" and st["version"] == 2, st
        trouble = sender.stats()["watcher"]
        assert trouble is not None and "has not answered its look" in trouble, trouble
        said = [r.getMessage() for r in caplog.records if "watcher of restarts" in r.getMessage()]
        assert len(said) == 1 and "is blind" in said[0], said
        sp.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while "has not answered" in recvs[0].state()["message"] or sender.stats()["watcher"] is not None:
            assert time.monotonic() < deadline, (recvs[0].state(), sender.stats()["watcher"])
            time.sleep(0.05)
        sender.push()
        assert any("reads the store again" in r.getMessage() for r in caplog.records)
        for r in recvs:
            st = r.state()
            assert st["state"] == "complete" and st["version"] == 3 and "has not answered" not in st["message"], st
    finally:
        sp.send_signal(signal.SIGCONT)
        for x in [sender] + list(recvs or []):
            if x is not None:
                x.close()
        sp.kill()
        sp.wait(10)
