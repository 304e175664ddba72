"""Issue 35.2: a restarted inference worker is taken whenever it comes -- by the first push
that starts after its record is complete (a push in flight finishes without it) -- and its
constructor waits for that push as long as the trainer job lives, not a fixed time.  On every
transport here: fabric tcp, fabric shm, verbs on the emulated NIC (tests/rejoin_scenario.py,
one process: the trainer and two Receivers in threads)."""

import os
import re

import pytest

from wxfer import _wxfer
from helpers import ROOT, outputs, python, store_env  # tests/helpers.py

pytestmark = pytest.mark.slow  # make test-slow (CI runs it after make test)

HERE = os.path.dirname(os.path.abspath(__file__))
T = 30.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("provider", ["tcp", "shm", "verbs-emulated"])
def test_a_restart_is_taken_by_the_next_push_whenever_it_comes(store, provider, request):
    if not _wxfer.backends()["fabric"][0]:
        pytest.skip("fabric transport not built")
    _, addr = store
    env = store_env(int(addr.rsplit(":", 1)[1]))
    if provider == "verbs-emulated":  # the libibverbs emulation (csrc/testing) in the process
        env.update(WXFER_TRANSPORT="verbs", WXFER_LIBIBVERBS=request.getfixturevalue("emu_lib"))
    else:
        env["WXFER_FABRIC_PROVIDER"] = provider
    far = ["far"] if provider == "tcp" else []  # pushes far apart: once (the clock is the same on each)
    p = python(os.path.join(HERE, "rejoin_scenario.py"), addr, *far, env=env, cwd=ROOT)
    (out,) = outputs([p], 150)
    print(out[-3000:])
    assert p.returncode == 0 and out.rstrip().endswith("done"), out[-4000:]
    for when in ("before", "during", "right after"):
        assert re.search(rf"^ok restart {when} a push: taken by the next one", out, re.M), out[-3000:]
    if far:
        assert "ok restart 6 s before the next push, store timeout 2 s: taken" in out, out[-3000:]
        m = re.search(r"^ok trainer job gone: the waiting restart told in ([\d.]+) s", out, re.M)
        assert m and float(m.group(1)) < 6.0, out[-3000:]
