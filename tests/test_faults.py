"""Issue 8 faults, with real processes over fabric tcp: an inference worker killed in the
middle of a step (and restarted); a trainer killed in the middle of a step."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import control
from wxfer.models import TINY, inference_params, preset_for

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
T = 30.0
sys.path.insert(0, HERE)
import fault_worker  # noqa: E402
from helpers import expected_shards  # noqa: E402 -- tests/helpers.py


def _spawn(*args, provider="tcp", **extra):
    env = dict(
        os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), WXFER_FABRIC_PROVIDER=provider
    )
    env.update(extra)
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "fault_worker.py")] + [str(a) for a in args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _reap(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _expected(model):
    return [(dst, off, b) for _, dst, off, b in expected_shards(model, TINY)]


def _scaled(m, f=1.5):
    """The trainer's next step: every weight of `m` times `f`."""
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(f)


def _wait_registered(ctl, key, p):
    """Until the (re)started worker process `p` has registered `key`; bounded by T, fails if it exits."""
    deadline = time.monotonic() + T
    while not ctl.check(key):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.05)


def _respawn(s, addr, name, procs, tmp_path):
    """A new receiver process for the killed worker gpu 1 (replica 1 of 2) of `name`, its
    files under tmp_path/new, appended to `procs`; once it has registered: the Control."""
    ctl = control.Control(s, name, T)
    (tmp_path / "new").mkdir()
    procs.append(_spawn("receiver", addr, name, 1, 2, tmp_path / "new"))
    _wait_registered(ctl, "infer/1/e1", procs[-1])
    return ctl


def _failing_push(sender, what):
    """A push that must raise RuntimeError: (its seconds, its message), printed after `what`."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        sender.push()
    took, msg = time.monotonic() - t0, str(ei.value)
    print(f"{what} after {took:.2f} s: {msg}")
    return took, msg


def _dump(ctl, g, path, req=b"1"):
    """Worker gpu `g` (fault_worker.py) dumps what it holds to `path`; read back on the CPU."""
    ctl.set("test/dump/%d" % g, req)
    ctl.get("test/dumped/%d" % g, f"worker {g}'s dump", T)
    return torch.load(path, map_location="cpu")


def _assert_kept_and_restarted(ctl, m, tmp_path, version):
    """Worker gpu 0 (dumping to tmp_path/0.pt) and gpu 1's restart (tmp_path/new/1.pt) both hold
    step `version`'s stamp and every byte of `m`."""
    for g, path in ((0, tmp_path / "0.pt"), (1, tmp_path / "new" / "1.pt")):
        got = _dump(ctl, g, path)
        assert got["version"] == version, (g, got["version"])
        _assert_bytes(got, m, g)


def _assert_bytes(got, m, who):
    """Every byte of a dump `got` is what the mapping makes of `m`'s weights."""
    for dst, off, b in _expected(m):
        flat = got["params"][dst].view(-1).view(torch.uint8)
        assert torch.equal(flat[off : off + b.numel()], b), (who, dst)


# issue 25's fault matrix over libfabric shm, run by hand on the 2-core VM (2026-12-02, 2 runs
# of each): a worker SIGKILLed mid-step took the live one down with it (its writes refused,
# -FI_EAGAIN, until write_timeout: not isolated), and a worker SIGSTOPped mid-step hung the
# trainer's engine inside fi_writemsg (gdb: __pthread_spin_lock under fi_writemsg, by all signs
# the lock in the stopped worker's shared region) in 1 of 2 runs.  Not run in CI: it can hang.  README, reliability.
SHM_FAULTS = pytest.mark.xfail(
    run=False,
    reason="fabric shm: a dead worker takes the live one down (writes refused), a stopped one can hang "
    "fi_writemsg on shm's cross-process lock",
)


@pytest.mark.parametrize("provider", ["tcp", pytest.param("shm", marks=SHM_FAULTS)])
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_an_inference_worker_killed_mid_step(store, tmp_path, fault, provider, monkeypatch):
    """kill: SIGKILL (its connections reset); stop: SIGSTOP (it stops answering; only the
    write deadline, write_timeout=2 s here, can tell).  Then a new process for that worker
    registers again and the trainer's next push takes it (that process is started during
    step 2, its imports done while the step waits; it registers only after step 3).  Over
    libfabric's tcp and shm."""
    from wxfer.runtime.sender import Sender

    monkeypatch.setenv("WXFER_FABRIC_PROVIDER", provider)
    s, addr = store
    fault_name = fault
    fault += "-" + provider  # the job's name
    procs = [_spawn("receiver", addr, "kw" + fault, q, 2, tmp_path, provider=provider) for q in range(2)]
    try:
        m = fault_worker.model()
        wt = 2.0
        sender = Sender(
            m, mapping=preset_for(TINY), store=addr, name="kw" + fault, timeout=T, write_timeout=wt, watermark="64KiB"
        )
        sender.push()
        # the process that is to be worker gpu 1's restart: it registers once test/restart is set
        gate = "test/restart/kw" + fault
        (tmp_path / "new").mkdir()
        procs.append(_spawn("receiver", addr, "kw" + fault, 1, 2, tmp_path / "new", provider=provider, FAULT_GATE=gate))
        _scaled(m)
        real, n = sender._run_task, [0]
        # kill worker gpu 1 once step 2 is under way, with at least two tasks still to come
        # (one task per decoder layer: the tiny model has three)
        at = max(1, min(3, sum(len(g) for g in sender.program.groups) - 2))

        def run_task(op, keep):
            real(op, keep)
            n[0] += 1
            if n[0] == at:
                if fault_name == "kill":
                    procs[1].send_signal(signal.SIGKILL)
                    procs[1].wait(10)
                else:
                    procs[1].send_signal(signal.SIGSTOP)

        sender._run_task = run_task
        took, msg = _failing_push(sender, f"worker {fault} mid-step: push failed")
        assert took < wt + 5, took  # within write_timeout (+ slack)
        assert "step 2" in msg and "inference worker gpu 1 (replica 1 rank 0," in msg, msg
        if fault_name == "stop":
            assert "not complete after 2.0 s" in msg, msg
        assert "the other workers ([0]) received every byte of step 2" in msg
        # the next push skips the failed worker and still names it; the other one goes on
        _scaled(m)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as ei:
            sender.push()
        msg = str(ei.value)
        assert time.monotonic() - t0 < wt, msg  # no second wait for the dead one
        assert "step 3" in msg and "inference worker gpu 1" in msg and "gpu 0" not in msg, msg
        # worker gpu 1 is started again: it registers anew and the next push takes it, with
        # no error and no restart of the trainer
        ctl = control.Control(s, "kw" + fault, T)
        assert not ctl.check("infer/1/e1")  # (the new process has not registered yet)
        s.set(gate, b"1")
        _wait_registered(ctl, "infer/1/e1", procs[-1])
        _scaled(m)
        sender.push()
        assert sender.stats()["rejoined"] == 1
        # the other worker got every byte of steps 2, 3 and 4 and their version stamps, the
        # restarted one every byte of step 4 and its stamp
        _assert_kept_and_restarted(ctl, m, tmp_path, 4)
        sender.close()
    finally:
        if fault_name == "stop" and procs[1].poll() is None:
            procs[1].send_signal(signal.SIGCONT)
        _reap(procs)


def test_a_trainer_killed_mid_step_leaves_the_step_incomplete(store):
    from wxfer.runtime.receiver import Receiver

    s, addr = store
    params = inference_params(TINY, 1, 0)
    box = {}
    th = threading.Thread(
        target=lambda: box.setdefault(
            "r", Receiver(params, mapping=preset_for(TINY).name, store=addr, name="kt", timeout=T)
        ),
        daemon=True,
    )
    th.start()
    p = _spawn("trainer", addr, "kt", 2)  # of 3 tasks (one per FSDP2 unit): root, layer 0, layer 1
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        _reap([p])
    th.join(T)
    recv = box["r"]
    assert p.returncode == -signal.SIGKILL, out
    assert "pushed 1" in out and "pushed 2" not in out, out
    step1 = {
        n: b.view(-1).view(torch.uint8) for n, b in ((n, t) for n, t in [(d, None) for d in []])
    }  # placeholder for clarity
    del step1
    # some bytes of step 2 landed, but version() still says 1: step 2 is incomplete
    m = fault_worker.model()
    exp1 = _expected(m)
    with torch.no_grad():
        for q in m.parameters():
            q.mul_(1.5)
    exp2 = _expected(m)
    landed2 = sum(torch.equal(params[d].view(-1).view(torch.uint8)[o : o + b.numel()], b) for d, o, b in exp2)
    still1 = sum(torch.equal(params[d].view(-1).view(torch.uint8)[o : o + b.numel()], b) for d, o, b in exp1)
    print(
        f"trainer killed mid-step: {landed2} shards of step 2 landed, {still1} still hold step 1, "
        f"version() = {recv.version()}"
    )
    # the begin stamp of step 2 landed before its first data write: version() counts no step
    # while the weights mix steps 1 and 2, and state() says step 2 is torn: its writer, trainer
    # rank 0, died (its pid, read on this host: issue 25 item 6), and wait_version says so at once
    assert recv.version() == -1
    assert landed2 >= 1 and still1 >= 1
    st = recv.state()
    assert st["state"] == "torn" and st["step"] == 2 and st["ranks"] == [0] and st["final"], st
    assert f"trainer rank 0 (pid {p.pid}" in st["message"] and "has exited" in st["message"], st
    from wxfer.runtime.receiver import TornError

    with pytest.raises(TornError, match="torn since step 2"):
        recv.wait_version(2, 5)
    recv.close()


def test_shm_warns_at_setup_that_it_does_not_isolate_a_fault(store, caplog):
    """Issue 35.4: the two cells above are expected failures over shm; a user setting up over
    shm is told so at setup, on both sides, with the transport to use instead (tcp)."""
    import warnings

    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import in_thread
    from helpers import joined  # tests/helpers.py

    _, addr = store
    opts = {"provider": "shm"}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        th = in_thread(
            Receiver,
            inference_params(TINY, 1, 0),
            mapping=preset_for(TINY),
            store=addr,
            name="shmw",
            timeout=T,
            transport="fabric",
            transport_options=opts,
        )
        sender = Sender(fault_worker.model(), mapping=preset_for(TINY), store=addr, name="shmw", timeout=T)
        (recv,) = joined([th], T)
    try:
        said = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
        for who in ("wxfer.Receiver gpu 0", "wxfer.Sender trainer rank 0"):
            msg = next((m for m in said if m.startswith(who)), None)
            assert msg is not None, said
            assert "provider shm does not isolate a fault" in msg and "use provider tcp" in msg, msg
        assert any("does not isolate a fault" in r.getMessage() for r in caplog.records)  # and in the log
        sender.push()
        assert recv.version() == 1  # a warning, not a refusal
    finally:
        sender.close()
        recv.close()
    # tcp: nothing said
    from wxfer.runtime.isolation import fault_isolation

    assert fault_isolation("fabric", {"provider": "tcp"}) is None and fault_isolation("verbs", {}) is None
