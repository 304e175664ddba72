"""Issue 25.5: setup under a reused name, with real processes over fabric tcp and a store that
outlives the jobs (hosted by the test).

- a new trainer job under the name of a finished one, with the old receivers still alive,
  neither plans on their records nor writes them (it had written them with no handshake and
  their version went back to 1): the new job's own receiver gets its step 1, the old ones
  keep the old job's last step untouched;
- the same with nobody left: the new job waits for its own receivers (it had passed setup on
  the dead workers' records and failed only at its first push);
- a second trainer job under the name of a live one is refused, naming it.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, preset_for, train_model
from wxfer.runtime.control import SetupError
from helpers import expected_shards  # tests/helpers.py

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 30.0

RECEIVER = textwrap.dedent("""
    import sys, torch
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    store, name, tag, out = sys.argv[1:5]
    params = inference_params(TINY, 1, 0)
    r = Receiver(params, mapping=preset_for(TINY).name, store=store, name=name, timeout=30)
    print("ready", flush=True)
    host, port = store.rsplit(":", 1)
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    raw.wait(["test/dump/" + tag], timedelta(seconds=60))
    torch.save(dict(params=params, version=r.version()), out)
    r.close()
""")

TRAINER = textwrap.dedent("""
    import sys, torch
    from wxfer.models import TINY, preset_for, train_model
    from wxfer.runtime.sender import Sender
    store, name = sys.argv[1], sys.argv[2]
    steps, scale, timeout = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
    m = train_model(TINY)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    try:
        s = Sender(m, mapping=preset_for(TINY), store=store, name=name, timeout=timeout, write_timeout=5)
    except Exception as e:
        print(f"setup failed: {type(e).__name__}: " + str(e).replace(chr(10), " | "), flush=True)
        sys.exit(3)
    for _ in range(steps):
        s.push()
        print("pushed", s.version, flush=True)
    s.close()
""")


def _spawn(tmp_path, script, *args):
    (tmp_path / "script_" / ".").mkdir(parents=True, exist_ok=True)
    path = tmp_path / "script_" / (script[0] + ".py")
    path.write_text(script[1])
    env = dict(os.environ, PYTHONPATH=ROOT, WXFER_FABRIC_PROVIDER="tcp", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(path), *[str(a) for a in args]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _expected(scale):
    m = train_model(TINY)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return expected_shards(m, TINY)


def _holds(params, expected) -> bool:
    return all(torch.equal(params[d].view(-1).view(torch.uint8)[o : o + b.numel()], b) for _, d, o, b in expected)


@pytest.mark.slow  # make test-slow (CI runs it after make test)
@pytest.mark.timeout(240)
def test_a_new_job_under_a_finished_ones_name_leaves_its_receivers_alone(store, tmp_path):
    s, addr = store
    rx = ("receiver", RECEIVER)
    tr = ("trainer", TRAINER)
    procs = [_spawn(tmp_path, rx, addr, "reuse", "old", tmp_path / "old.pt")]
    try:
        t1 = _spawn(tmp_path, tr, addr, "reuse", 3, 1.0, T)
        out1 = t1.communicate(timeout=120)[0]
        assert t1.returncode == 0 and "pushed 3" in out1, out1[-3000:]
        # job 1 is over; its receiver is alive. Job 2: its own receiver, the same name
        procs.append(_spawn(tmp_path, rx, addr, "reuse", "new", tmp_path / "new.pt"))
        t2 = _spawn(tmp_path, tr, addr, "reuse", 1, 2.0, T)
        # what each receiver must hold, worked out while job 2 waits out job 1's lease (STALE_S)
        want_old, want_new = _expected(1.0), _expected(2.0)
        out2 = t2.communicate(timeout=120)[0]
        assert t2.returncode == 0 and "pushed 1" in out2, out2[-3000:]
        for tag in ("old", "new"):
            s.set("test/dump/" + tag, b"1")
        for p in procs:
            assert p.wait(60) == 0, p.communicate()[0][-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    old, new = (torch.load(tmp_path / f, weights_only=False) for f in ("old.pt", "new.pt"))
    assert old["version"] == 3 and _holds(old["params"], want_old)  # job 1's step 3, untouched
    assert new["version"] == 1 and _holds(new["params"], want_new)  # job 2's step 1
    # nobody left now: a third job waits for receivers of its own (none come) and says so
    # (in this process, which has torch imported already: it only sets up, and fails)
    from wxfer.runtime.sender import Sender

    with pytest.raises(SetupError, match="waited 4 s for the metadata of inference worker gpu 0"):
        Sender(train_model(TINY), mapping=preset_for(TINY), store=addr, name="reuse", timeout=4, write_timeout=5)


def test_a_second_job_under_a_live_ones_name_is_refused(store):
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.models import inference_params
    from wxfer.testing import in_thread
    from helpers import joined  # tests/helpers.py

    _, addr = store
    th = in_thread(Receiver, inference_params(TINY, 1, 0), mapping=preset_for(TINY).name, store=addr, name="live")
    first = Sender(train_model(TINY), mapping=preset_for(TINY), store=addr, name="live", timeout=T)
    (recv,) = joined([th], T)
    t0 = time.monotonic()
    with pytest.raises(
        SetupError, match=f"trainer job {first.job['id'][:12]} \\(rank 0: host .* pid {os.getpid()}\\) is alive"
    ):
        Sender(train_model(TINY), mapping=preset_for(TINY), store=addr, name="live", timeout=T)
    assert time.monotonic() - t0 < 5
    first.push()
    assert first.version == 1 and recv.version() == 1  # the live job is unaffected
    first.close()
    recv.close()
