"""Issue 25 item 1 on one GPU over cuda_ipc (marker `gpu`): the trainer (this process) and two
inference workers (real processes, tests/fault_worker.py) on cuda:0, where a dead worker's
memory stays mapped and every copy into it succeeds, so only liveness (its pid and start time,
its lease) can tell.  One test, in order: a worker killed between pushes is named by the next
push within write_timeout and the other gets every byte; a replacement for the same replica
is taken by the push after, bytes checked; the replacement killed inside a push is named by
that push.  It prints what it saw (run with -s)."""

import os
import signal
import sys
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, preset_for

HERE = os.path.dirname(os.path.abspath(__file__))
T = 30.0
sys.path.insert(0, HERE)
import fault_worker  # noqa: E402
from test_faults import _assert_bytes, _dump, _failing_push, _reap, _respawn, _scaled, _spawn  # noqa: E402

CUDA_IPC = _wxfer.backends().get("cuda_ipc", (False, ""))[0]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and CUDA_IPC), reason="needs a CUDA GPU and cuda_ipc"),
]


def _check_bytes(got, m, g):
    """Every byte worker `g` dumped is what the mapping makes of `m`'s weights (read on a CPU copy)."""
    cpu = fault_worker.model()
    cpu.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    _assert_bytes(got, cpu, g)


def test_cuda_ipc_one_gpu_kill_restart_and_kill_inside_a_push(store, tmp_path, monkeypatch):
    from wxfer.runtime.sender import Sender

    monkeypatch.setenv("FAULT_DEVICE", "cuda:0")  # the workers' (inherited by _spawn)
    s, addr = store
    name = "lvgpu"
    t_start = time.monotonic()
    procs = [_spawn("receiver", addr, name, q, 2, tmp_path) for q in range(2)]
    try:
        m = fault_worker.model().to("cuda:0")
        wt = 5.0
        sender = Sender(
            m, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=wt, device="cuda:0"
        )
        assert sender.transport_name == "cuda_ipc", sender.transport_name
        sender.push()
        print(f"setup + push 1: {time.monotonic() - t_start:.1f} s; in-place: {sender.stats()['direct']}")
        # 1. worker gpu 1 killed between pushes
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        _scaled(m)
        took, msg = _failing_push(sender, "killed between pushes: push 2 raised")
        assert took < wt, took
        assert f"its process (pid {procs[1].pid}) has exited" in msg and "inference worker gpu 1" in msg, msg
        assert "the other workers ([0]) received every byte of step 2" in msg, msg
        # 2. a replacement for replica 1: the next push takes it
        ctl = _respawn(s, addr, name, procs, tmp_path)
        _scaled(m)
        t0 = time.monotonic()
        sender.push()
        print(f"push 3 took the replacement in {time.monotonic() - t0:.2f} s; stats {sender.stats()['direct']}")
        assert sender.stats()["rejoined"] == 1 and sender.links.dead == {}
        got = _dump(ctl, 1, tmp_path / "new" / "1.pt", b"stay")  # it stays up, to be killed below
        print(f"replacement: version {got['version']}, state {got['state']['state']}")
        assert got["version"] == 3
        _check_bytes(got, m, 1)
        # 3. the replacement killed inside push 4: once its begin stamps were written (after the
        # liveness check at the push's start; every task kind, in place or not, comes after)
        _scaled(m)
        real = sender.runner.write_begin
        n = [0]

        def write_begin():
            real()
            n[0] += 1
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(10)

        sender.runner.write_begin = write_begin
        took, msg = _failing_push(sender, "killed inside push 4 (after its begin stamps): raised")
        assert n[0] == 1 and took < 1.5 * wt + 1, (n, took)  # on cuda_ipc the writes succeed: well within
        assert f"its process (pid {procs[-1].pid}) has exited" in msg, msg
        assert "the other workers ([0]) received every byte of step 4" in msg, msg
        got = _dump(ctl, 0, tmp_path / "0.pt")
        print(f"worker gpu 0: version {got['version']}, state {got['state']['state']}")
        assert got["version"] == 4
        _check_bytes(got, m, 0)
        sender.close()
        print(f"whole test: {time.monotonic() - t_start:.1f} s")
    finally:
        _reap(procs)
