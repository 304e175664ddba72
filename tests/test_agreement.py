"""Issue 17.3 and 17.4 with real processes (two FSDP2 trainer ranks under torchrun, gloo;
inference workers in their own processes; fabric tcp):

- an exception inside push() on one trainer rank reaches the other within write_timeout,
  the collectives stay in step, and the next push works on both (17.3);
- a trainer rank failing its connect phase fails setup on every trainer rank *and* in every
  Receiver constructor, promptly (17.3);
- a second push() from another thread while one runs is refused, clearly (17.4);
- trainer ranks given different mappings are refused on every process (17.6).
"""

import os
import re
import textwrap
import time

import pytest

from wxfer import _wxfer
from wxfer.runtime.control import free_port
from helpers import ONE_WRITE_PER_LINE, store_env, torchrun_args, outputs, python  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")

TRAINER = ONE_WRITE_PER_LINE + textwrap.dedent("""
    import sys, threading, time, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import TINY, preset_for, shard_fsdp2, train_model
    from wxfer.runtime.sender import Sender
    case = sys.argv[1]
    import os
    dist_rank1 = lambda: os.environ.get("RANK") == "1"
    mapping = preset_for(dict(TINY, rms_norm_eps=1e-5)) if case == "mapping" and dist_rank1() else preset_for(TINY)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (dist.get_world_size(),)))
    opts = {"no_such_option": "1"} if case == "connect" and rank == 1 else None
    try:
        sender = Sender(model, mapping=mapping, timeout=40, write_timeout=3, transport_options=opts)
    except Exception as e:
        print(f"rank {rank} setup failed: {type(e).__name__}: " + str(e).replace(chr(10), " | "), flush=True)
        sys.exit(3)
    def bump():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    bump(); sender.push()
    # step 2: rank 0's engine refuses its second task (as for a garbage descriptor)
    class Failing:
        def __init__(self, e):
            self.e, self.n = e, 0
        def submit(self, *a, **kw):
            self.n += 1
            if self.n == 3:            # 1: the begin stamps, 2: task 1, 3: task 2
                raise ValueError("injected failure on rank 0")
            return self.e.submit(*a, **kw)
        def __getattr__(self, k):
            return getattr(self.e, k)
    real_engine = sender.runner.engine  # (what submits a step's tasks and stamps)
    if rank == 0:
        sender.runner.engine = Failing(real_engine)
    real = sender._run_task
    bump()
    t0 = time.monotonic()
    try:
        sender.push()
        print(f"rank {rank} step 2 did not fail", flush=True)
    except Exception as e:
        print(f"rank {rank} step 2 {type(e).__name__} after {time.monotonic() - t0:.2f} s: "
              + str(e).replace(chr(10), " | "), flush=True)
    sender.runner.engine = real_engine
    bump(); sender.push()
    print(f"rank {rank} step 3 ok", flush=True)
    # step 4 from a thread; meanwhile a second push() from the main thread is refused
    inside = threading.Event()
    def slow(op, keep):
        inside.set(); time.sleep(0.02); real(op, keep)
    sender._run_task = slow
    box = {}
    def run():
        try:
            box["v"] = sender.push()
        except Exception as e:
            box["e"] = e
    bump()
    th = threading.Thread(target=run); th.start()
    inside.wait(30)
    try:
        sender.push()
        print(f"rank {rank} concurrent push accepted", flush=True)
    except RuntimeError as e:
        print(f"rank {rank} concurrent push refused: " + str(e).replace(chr(10), " | "), flush=True)
    th.join(60)
    print(f"rank {rank} step 4 thread: {'ok' if 'v' in box else box.get('e')}", flush=True)
    sender._run_task = real
    bump(); sender.push()
    print(f"rank {rank} step 5 ok version {sender.version}", flush=True)
    dist.barrier()
    sender.close()
    dist.destroy_process_group()
""")

WORKER = textwrap.dedent("""
    import sys, time, torch
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    params = inference_params(TINY, 1, 0)
    t0 = time.monotonic()
    try:
        recv = Receiver(params, mapping=preset_for(TINY).name, timeout=40)
    except Exception as e:
        print(f"worker setup failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: "
              + str(e).replace(chr(10), " | "), flush=True)
        sys.exit(3)
    print("worker version", recv.wait_version(5, 60), recv.state()["state"], flush=True)
    recv.close()
""")


def _run(tmp_path, case):
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "worker.py").write_text(WORKER)
    sport = free_port()
    env = store_env(sport)
    tr = python(*torchrun_args(tmp_path / "trainer.py", case), env=dict(env, WXFER_STORE=""), cwd=tmp_path)
    w = python(tmp_path / "worker.py", env=env, cwd=tmp_path)
    outs = outputs([tr, w], 150)
    return tr, w, outs


@pytest.mark.timeout(180)
def test_a_push_failure_on_one_rank_reaches_the_other_and_concurrent_pushes_are_refused(tmp_path):
    tr, w, (tout, wout) = _run(tmp_path, "push")
    assert tr.returncode == 0, tout[-4000:]
    for r in (0, 1):
        line = [ln for ln in tout.splitlines() if f"rank {r} step 2 " in ln]
        assert line and "did not fail" not in line[0], tout[-4000:]
        took = float(re.search(r"after ([\d.]+) s", line[0]).group(1))
        assert took < 3 + 2, line[0]  # within write_timeout (+ slack)
        assert "injected failure on rank 0" in line[0], line[0]
        if r == 1:
            assert "trainer rank 0 reports" in line[0], line[0]
        assert f"rank {r} step 3 ok" in tout, tout[-4000:]
        refused = [ln for ln in tout.splitlines() if f"rank {r} concurrent push" in ln]
        assert refused and "refused" in refused[0] and "another push()" in refused[0], tout[-4000:]
        assert f"rank {r} step 4 thread: ok" in tout and f"rank {r} step 5 ok version 5" in tout, tout[-4000:]
    assert w.returncode == 0 and "worker version 5 complete" in wout, wout[-3000:]


@pytest.mark.timeout(180)
def test_a_connect_failure_on_one_rank_fails_every_trainer_and_the_receiver(tmp_path):
    t0 = time.monotonic()
    tr, w, (tout, wout) = _run(tmp_path, "connect")
    for r in (0, 1):
        line = [ln for ln in tout.splitlines() if f"rank {r} setup failed" in ln]
        assert line and "SetupError" in line[0] and "no_such_option" in line[0], tout[-4000:]
    assert w.returncode == 3 and "worker setup failed" in wout, wout[-3000:]
    assert "SetupError" in wout and "no_such_option" in wout and "rank 1" in wout, wout[-3000:]
    took = float(re.search(r"failed after ([\d.]+) s", wout).group(1))
    assert took < 40, wout  # not its full timeout
    print(f"connect failure reached the receiver in {took:.1f} s (run {time.monotonic() - t0:.0f} s)")


@pytest.mark.timeout(180)
def test_trainer_ranks_given_different_mappings_are_refused_everywhere(tmp_path):
    tr, w, (tout, wout) = _run(tmp_path, "mapping")
    for r in (0, 1):
        line = [ln for ln in tout.splitlines() if f"rank {r} setup failed" in ln]
        assert line and "SetupError" in line[0] and "trainer rank 1 was given mapping" in line[0], tout[-4000:]
    assert w.returncode == 3 and "SetupError" in wout and "trainer rank 1 was given mapping" in wout, wout[-3000:]
