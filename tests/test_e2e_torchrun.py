"""Under torchrun, with no store given: trainer rank 0 hosts the TCPStore at
$MASTER_ADDR:$WXFER_STORE_PORT, the inference workers (separate processes, not in the
trainers' process group) find it through $WXFER_STORE."""

import os
import textwrap

import pytest

from wxfer import _wxfer
from wxfer.runtime.control import free_port
from helpers import ONE_WRITE_PER_LINE, child_env, store_env, torchrun_args, outputs, python  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")

TRAINER = ONE_WRITE_PER_LINE + textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import TINY, train_model, preset_for, shard_fsdp2
    from wxfer.runtime.sender import Sender
    dist.init_process_group("gloo")
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (dist.get_world_size(),)))
    sender = Sender(model, mapping=preset_for(TINY), timeout=60)      # store=None: rank 0 hosts it
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sender.push()
    # one write per line: both ranks share torchrun's stdout (unbuffered)
    print(f"rank {dist.get_rank()} pushed {sender.bytes_per_step}", flush=True)
    dist.barrier()
    sender.close()
    dist.destroy_process_group()
""")

WORKER = textwrap.dedent("""
    import sys, torch
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    rank, broken = int(sys.argv[1]), sys.argv[2] == "broken"
    params = inference_params(TINY, 2, rank)
    if broken and rank == 1:
        del params["model.layers.1.mlp.down_proj.weight"]
    recv = Receiver(params, mapping=preset_for(TINY).name, replica=0, rank=rank, tp=2, replicas=1, timeout=60)
    print("worker", rank, "version", recv.wait_version(2, 60), flush=True)
    nan = sum(int(torch.isnan(t.float()).sum()) for t in params.values())
    print("worker", rank, "nan", nan, flush=True)
    recv.close()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["ok", "broken"])
def test_sender_under_torchrun_hosts_the_store(tmp_path, case):
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "worker.py").write_text(WORKER)
    sport = free_port()
    env = child_env(
        PYTHONPATH=ROOT,
        WXFER_STORE_PORT=str(sport),
        WXFER_STORE="127.0.0.1:%d" % sport,
        OMP_NUM_THREADS="1",
    )
    tr = python(*torchrun_args(tmp_path / "trainer.py"), env=dict(env, WXFER_STORE=""), cwd=tmp_path)
    ws = [python(tmp_path / "worker.py", r, case, env=env, cwd=tmp_path) for r in range(2)]
    outs = outputs([tr] + ws, 150)
    if case == "broken":
        # the controller's error is raised on both trainer ranks and in both workers, by name
        bad = "model.layers.1.mlp.down_proj.weight: expected on replica 0 rank 1 but the worker lacks it"
        assert tr.returncode != 0 and ws[0].returncode != 0 and ws[1].returncode != 0
        for r in (0, 1):  # torchrun prefixes each rank's traceback lines with [rankN]
            assert any(ln.startswith(f"[rank{r}]") and "SetupError" in ln for ln in outs[0].splitlines()), outs[0][
                -3000:
            ]
        assert bad in outs[0]
        for out in outs[1:]:
            assert "SetupError" in out and bad in out, out[-3000:]
        return
    assert tr.returncode == 0, outs[0][-3000:]
    assert "rank 0 pushed" in outs[0] and "rank 1 pushed" in outs[0]
    for r, (p, out) in enumerate(zip(ws, outs[1:])):
        assert p.returncode == 0, out[-3000:]
        assert f"worker {r} version 2" in out and f"worker {r} nan 0" in out


FAULT_TRAINER = ONE_WRITE_PER_LINE + textwrap.dedent("""
    import time, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import TINY, train_model, preset_for, shard_fsdp2
    from wxfer.runtime.sender import Sender
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (dist.get_world_size(),)))
    sender = Sender(model, mapping=preset_for(TINY), timeout=60, write_timeout=3)
    ctl = sender.ctl
    def bump():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    bump(); sender.push()
    ctl.set("test/step1/%d" % rank, b"1")
    ctl.get("test/killed", "the test killing worker gpu 1", 60)
    bump()
    t0 = time.monotonic()
    try:
        sender.push()
        print(f"rank {rank} step 2 did not fail", flush=True)
    except RuntimeError as e:
        named = "inference worker gpu 1 (replica 0 rank 1" in str(e)
        print(f"rank {rank} step 2 failed after {time.monotonic() - t0:.1f} s, naming gpu 1: {named}; "
              + str(e).splitlines()[0], flush=True)
    ctl.set("test/step2/%d" % rank, b"1")
    ctl.get("test/restarted", "the test restarting worker gpu 1", 60)
    bump(); sender.push()
    print(f"rank {rank} step 3 ok rejoined {sender.stats()['rejoined']}", flush=True)
    dist.barrier()
    sender.close()
    dist.destroy_process_group()
""")

FAULT_WORKER = textwrap.dedent("""
    import sys, torch
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    rank, want = int(sys.argv[1]), int(sys.argv[2])
    params = inference_params(TINY, 2, rank)
    recv = Receiver(params, mapping=preset_for(TINY).name, replica=0, rank=rank, tp=2, replicas=1, timeout=60)
    print("worker", rank, "epoch", recv.epoch, "senders", recv.senders, flush=True)
    print("worker", rank, "version", recv.wait_version(want, 60), flush=True)
    recv.ctl.get("test/done/%d" % rank, "the test's go-ahead", 60)
    recv.close()
""")


@pytest.mark.timeout(240)
def test_two_trainers_both_name_a_killed_worker_and_both_take_its_restart(tmp_path):
    """FSDP2 over two trainer ranks.  Worker gpu 1 is killed between steps: in step 2 every
    trainer raises naming it, within write_timeout + slack (the ranks that write to it see
    it; the others learn it from them, so an SPMD loop stays in step) while gpu 0 gets
    every byte; then a new process for gpu 1 registers again and step 3 reaches it from
    its writers, with no restart of theirs."""
    import signal
    import time
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.runtime.control import Control

    (tmp_path / "trainer.py").write_text(FAULT_TRAINER)
    (tmp_path / "worker.py").write_text(FAULT_WORKER)
    sport = free_port()
    env = store_env(sport)

    def spawn(*args, env):
        return python(*args, env=env, cwd=tmp_path)

    tr = spawn(
        *torchrun_args(tmp_path / "trainer.py"),
        env=dict(env, WXFER_STORE=""),
    )
    ws = [spawn(tmp_path / "worker.py", 0, 3, env=env), spawn(tmp_path / "worker.py", 1, 99, env=env)]
    procs = [tr] + ws
    try:
        deadline = time.monotonic() + 120
        while True:  # trainer rank 0 hosts the store: connect once it is up
            try:
                ctl = Control(
                    dist.TCPStore(
                        "127.0.0.1", sport, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
                    ),
                    "default",
                    60,
                )
                break
            except Exception:  # noqa: BLE001
                assert time.monotonic() < deadline and tr.poll() is None
                time.sleep(0.5)
        for r in (0, 1):
            ctl.get("test/step1/%d" % r, f"trainer rank {r}'s step 1", 120)
        ws[1].send_signal(signal.SIGKILL)
        ws[1].wait(10)
        ctl.set("test/killed", b"1")
        for r in (0, 1):
            ctl.get("test/step2/%d" % r, f"trainer rank {r}'s step 2", 60)
        ws.append(spawn(tmp_path / "worker.py", 1, 3, env=env))
        procs.append(ws[-1])
        while not ctl.check("infer/1/e1"):
            assert ws[-1].poll() is None
            time.sleep(0.05)
        ctl.set("test/restarted", b"1")
        for r in (0, 1):
            ctl.set("test/done/%d" % r, b"1")
        outs = [p.communicate(timeout=120)[0] for p in (tr, ws[0], ws[2])]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert tr.returncode == 0, outs[0][-3000:]
    for r in (0, 1):
        line = [ln for ln in outs[0].splitlines() if f"rank {r} step 2" in ln]
        assert line and "failed after" in line[0] and "naming gpu 1: True" in line[0], outs[0]
        assert float(line[0].split("failed after ")[1].split(" s")[0]) < 3 + 5, line
    import re

    rejoined = {int(r): int(n) for r, n in re.findall(r"rank (\d) step 3 ok rejoined (\d)", outs[0])}
    assert sorted(rejoined) == [0, 1], outs[0][-3000:]
    assert ws[0].returncode == 0 and "worker 0 version 3" in outs[1], outs[1]
    m = re.search(r"worker 1 epoch 1 senders \[([\d, ]*)\]", outs[2])
    assert ws[2].returncode == 0 and m and "worker 1 version 3" in outs[2], outs[2]
    writers = {int(x) for x in m.group(1).split(",")}
    assert writers and {r for r, n in rejoined.items() if n == 1} == writers, (rejoined, writers)


DEAD_TRAINER = ONE_WRITE_PER_LINE + textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import TINY, train_model, preset_for, shard_fsdp2
    from wxfer.runtime.sender import Sender
    when = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (dist.get_world_size(),)))
    sender = Sender(model, mapping=preset_for(TINY), timeout=60, write_timeout=3)
    def bump():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    bump(); sender.push()
    print(f"rank {rank} pid {os.getpid()} step 1 ok", flush=True)
    dist.barrier()
    if rank == 1 and when == "between":
        os.kill(os.getpid(), signal.SIGKILL)  # dies between pushes
    if rank == 1 and when == "mid":
        real = sender._run_task
        def run_task(op, keep):  # dies in step 2, after its first task
            real(op, keep)
            os.kill(os.getpid(), signal.SIGKILL)
        sender._run_task = run_task
    if when == "between":
        time.sleep(0.5)
    bump()
    t0 = time.monotonic()
    try:
        sender.push()
        print("rank 0 step 2 did not fail", flush=True)
    except Exception as e:
        print(f"rank 0 step 2 failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: "
              + str(e).replace(chr(10), " | "), flush=True)
    for r in (0, 1):  # the store lives here: let the workers read what was recorded
        sender.ctl.get("test/seen/%d" % r, f"worker {r}'s report", 60)
    os._exit(0)
""")

DEAD_TRAINER_WORKER = textwrap.dedent("""
    import sys
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver, TornError
    rank = int(sys.argv[1])
    recv = Receiver(inference_params(TINY, 2, rank), mapping=preset_for(TINY).name, replica=0, rank=rank, tp=2,
                    replicas=1, timeout=60)
    try:  # (when rank 1 dies mid-push, step 2 may be torn before this worker saw step 1)
        print("worker", rank, "version", recv.wait_version(1, 60), flush=True)
        recv.wait_version(2, 30)
        print("worker", rank, "no TornError", flush=True)
    except TornError as e:
        print("worker", rank, "TornError:", str(e).replace(chr(10), " | "), flush=True)
    print("worker", rank, "state:", recv.state()["message"].replace(chr(10), " | "), flush=True)
    recv.ctl.set("test/seen/%d" % rank, b"1")
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["between", "mid"])
def test_a_dead_trainer_rank_is_named_by_rank_on_the_others_and_the_receivers(tmp_path, when):
    """Issue 17.2/17.7: trainer rank 1 is SIGKILLed between pushes, or in the middle of step 2
    after its first task (two plain processes, not torchrun, whose agent would end rank 0
    too).  Rank 0's push of step 2 raises naming
    `trainer rank 1 (pid N, host H) died or hung` (not a raw gloo error), and both
    receivers' wait_version raises TornError, and their state() says the same."""
    import re
    import socket

    (tmp_path / "trainer.py").write_text(DEAD_TRAINER)
    (tmp_path / "worker.py").write_text(DEAD_TRAINER_WORKER)
    sport, mport = free_port(), free_port()
    env = child_env(
        PYTHONPATH=ROOT,
        WXFER_STORE_PORT=str(sport),
        OMP_NUM_THREADS="1",
        WXFER_FABRIC_PROVIDER="tcp",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(mport),
        WORLD_SIZE="2",
    )

    def spawn(script, *args, **extra):
        return python(tmp_path / script, *args, env=dict(env, **extra), cwd=tmp_path)

    trainers = [spawn("trainer.py", when, RANK=str(r), LOCAL_RANK=str(r)) for r in (0, 1)]
    workers = [spawn("worker.py", r, WXFER_STORE="127.0.0.1:%d" % sport) for r in (0, 1)]
    outs = outputs(trainers + workers, 150)
    host = socket.gethostname()
    named = f"trainer rank 1 (pid {trainers[1].pid}, host {host}) died or hung"
    assert trainers[1].returncode == -9 and "rank 1 pid" in outs[1], outs[1][-2000:]
    m = re.search(r"rank 0 step 2 failed after ([0-9.]+) s: (.*)", outs[0])
    assert m and named in m.group(2), outs[0][-3000:]
    assert float(m.group(1)) < 3 + 5 + 5, m.group(0)
    for r in (0, 1):
        out = outs[2 + r]
        assert when == "mid" or f"worker {r} version 1" in out, out[-2000:]
        # named by the survivor's record ("died or hung"), or first by the worker itself: its pid
        # read on this host (issue 25 item 6: "died: its process (pid N) has exited")
        who = re.escape(f"trainer rank 1 (pid {trainers[1].pid}, host {host}) died")
        assert re.search(rf"worker {r} TornError: .*{who}", out), out[-2000:]
        assert re.search(rf"worker {r} state: .*{who}", out), out[-2000:]
