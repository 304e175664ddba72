"""Issue 17.2: the version stamp never lies.  A receiver stopped (SIGSTOP) in the middle of
a step for longer than write_timeout: the trainer gives up on it; after SIGCONT the writes
it abandoned still land (fabric tcp cannot fence them), but version() counts no step there,
state() says it was dropped in the middle of step 2, its weights torn (trainer rank 0 gave
up; issue 35.8: it had said "torn"), and wait_version raises at once
instead of waiting out its timeout.  Real processes over fabric tcp."""

import signal
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import control
from wxfer.models import TINY, preset_for

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
T = 30.0
import fault_worker  # noqa: E402
from test_faults import _dump, _expected, _reap, _scaled, _spawn  # noqa: E402


@pytest.mark.timeout(150)
def test_a_receiver_dropped_mid_step_learns_it_is_torn(store, tmp_path):
    from wxfer.runtime.sender import Sender

    s, addr = store
    # the lease bound (3 x 3 s) past write_timeout (3 s): what the trainer sees is the write
    # timeout (with the default 1 s lease both bounds are 3 s, and a loaded machine saw the lease)
    procs = [_spawn("receiver", addr, "torn", q, 2, tmp_path, WXFER_LEASE_S="3") for q in range(2)]
    try:
        m = fault_worker.model()
        sender = Sender(
            m, mapping=preset_for(TINY), store=addr, name="torn", timeout=T, write_timeout=3, watermark="64KiB"
        )
        sender.push()
        _scaled(m)
        real, n = sender._run_task, [0]

        def run_task(op, keep):  # stop worker gpu 1 once step 2 is under way (after its first
            real(op, keep)  # task: with one task per layer the model has only a few)
            n[0] += 1
            if n[0] == 1:
                procs[1].send_signal(signal.SIGSTOP)

        sender._run_task = run_task
        with pytest.raises(RuntimeError, match="inference worker gpu 1") as ei:
            sender.push()
        # fabric cannot fence: the give-up says the abandoned writes may still land
        assert "NOT fenced: fabric tcp;ofi_rxm cannot recall the" in str(ei.value), str(ei.value)
        assert "they may still land" in str(ei.value), str(ei.value)
        sender._run_task = real
        procs[1].send_signal(signal.SIGCONT)  # what the trainer abandoned may land now
        time.sleep(1.0)
        _scaled(m)
        with pytest.raises(RuntimeError, match="inference worker gpu 1"):
            sender.push()  # step 3: gpu 1 is skipped, gpu 0 gets it all
        ctl = control.Control(s, "torn", T)
        got = {}
        for g in (0, 1):
            got[g] = _dump(ctl, g, tmp_path / ("%d.pt" % g), b"wait 3")
        print({g: (d["version"], d["state"]["message"], d.get("wait_error"), d.get("wait_s")) for g, d in got.items()})
        # the worker that kept up: step 3 complete, every byte
        assert got[0]["version"] == 3 and got[0]["state"]["state"] == "complete", got[0]["state"]
        assert got[0]["wait_error"] is None
        for dst, off, b in _expected(m):
            assert torch.equal(got[0]["params"][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
        # the dropped one: never reports a step while it holds a mix; says why; does not wait
        st = got[1]["state"]
        assert got[1]["version"] == -1, st
        # issue 35.8: skipped for good, it reads dropped (it had read torn), its weights named torn
        assert st["state"] == "dropped" and st["step"] == 2 and st["ranks"] == [0] and st["final"], st
        assert "dropped by the trainers in the middle of step 2" in st["message"], st
        assert "weights are torn" in st["message"] and "trainer rank 0 gave up" in st["message"], st
        assert "NOT fenced" in st["message"], st
        assert got[1]["wait_error"].startswith("TornError") and got[1]["wait_s"] < 2.0, got[1]
        sender.close()
    finally:
        if procs[1].poll() is None:
            procs[1].send_signal(signal.SIGCONT)
        _reap(procs)


@pytest.mark.timeout(120)
def test_a_restarted_worker_that_dies_before_the_push_costs_write_timeout_not_the_setup_timeout(store, tmp_path):
    """Issue 17.5: the push takes a restarted worker; one that died before that push must
    not hold it for the setup timeout (30 s here) waiting for its handshake reply."""
    from wxfer.runtime.sender import Sender

    s, addr = store
    procs = [_spawn("receiver", addr, "rdie", 0, 1, tmp_path)]
    try:
        m = fault_worker.model()
        sender = Sender(m, mapping=preset_for(TINY), store=addr, name="rdie", timeout=T, write_timeout=2)
        sender.push()
        ctl = control.Control(s, "rdie", T)
        (tmp_path / "new").mkdir()
        procs.append(_spawn("receiver", addr, "rdie", 0, 1, tmp_path / "new"))
        deadline = time.monotonic() + T
        while not ctl.check("infer/0/e1"):
            assert time.monotonic() < deadline and procs[-1].poll() is None, procs[-1].communicate()[0]
            time.sleep(0.05)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="restarted inference worker\\(s\\) refused") as ei:
            sender.push()
        took = time.monotonic() - t0
        print(f"push with a dead restart: {took:.2f} s: {ei.value}")
        assert took < 2 + 3, took
        ctl.set("test/dump/0", b"1")  # the worker in place still got step 2
        ctl.get("test/dumped/0", "worker 0's dump", T)
        assert torch.load(tmp_path / "0.pt")["version"] == 2
        sender.close()
    finally:
        _reap(procs)
