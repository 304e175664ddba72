"""Issue 17.6: inference workers disagreeing on the layout (one says replicas=1, another
replica 1 of 2) are refused at setup on every process: the trainer names the worker outside
gpu 0's layout, and both workers raise, promptly.  Real worker processes over fabric tcp."""

import time

import pytest

from wxfer import _wxfer
from wxfer.runtime import control
from wxfer.runtime.control import SetupError
from wxfer.models import TINY, preset_for

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
T = 30.0
import fault_worker  # noqa: E402
from test_faults import _reap, _spawn  # noqa: E402


@pytest.mark.timeout(120)
def test_workers_disagreeing_on_replicas_are_refused_everywhere(store, tmp_path):
    from wxfer.runtime.sender import Sender

    s, addr = store
    procs = [_spawn("receiver", addr, "dis", 0, 1, tmp_path), _spawn("receiver", addr, "dis", 1, 2, tmp_path)]
    try:
        ctl = control.Control(s, "dis", T)
        deadline = time.monotonic() + 60
        while ctl.add("infer/count", 0) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        with pytest.raises(
            SetupError,
            match="inference worker gpu 1 \\(replica 1 of 2, rank 0 of tp=1\\) lies "
            "outside gpu 0's layout replicas=1 tp=1",
        ):
            Sender(fault_worker.model(), mapping=preset_for(TINY), store=addr, name="dis", timeout=T)
        t0 = time.monotonic()
        outs = [p.communicate(timeout=T)[0] for p in procs]
        assert time.monotonic() - t0 < 10
        for p, out in zip(procs, outs):
            assert p.returncode != 0 and "SetupError" in out and "lies outside gpu 0's layout" in out, out[-2000:]
    finally:
        _reap(procs)
