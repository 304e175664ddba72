"""Issue 17.5: every wait ends by the deadline it names and honours Ctrl-C within ~100 ms.
The store connect with nothing listening; a store wait and a gloo wait interrupted by
SIGINT in a real process."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from wxfer.runtime import control
from wxfer.runtime.control import SetupError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_store_connect_ends_by_its_timeout():
    import torch.distributed  # noqa: F401 -- not counted in the wait

    port = control.free_port()
    t0 = time.monotonic()
    with pytest.raises(SetupError, match="within 2 s"):
        control.resolve_store("127.0.0.1:%d" % port, False, 2)
    took = time.monotonic() - t0
    assert 1.9 < took < 2.6, took  # torch's own retries took 2.1-2.6x


WAITER = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.runtime import control
    kind, port = sys.argv[1], int(sys.argv[2])
    st = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    if kind == "store":
        ctl = control.Control(st, "w", 60)
        wait = lambda: ctl.get("never", "a key nobody sets")
    else:                       # a barrier whose other rank never arrives (it sleeps)
        import subprocess
        other = subprocess.Popen([sys.executable, "-c", (
            "import time; from datetime import timedelta; import torch.distributed as dist; "
            f"st = dist.TCPStore('127.0.0.1', {port}, is_master=False, timeout=timedelta(seconds=60)); "
            "dist.init_process_group('gloo', store=st, rank=1, world_size=2); time.sleep(30)")])
        dist.init_process_group("gloo", store=st, rank=0, world_size=2, timeout=timedelta(seconds=60))
        if kind == "gloo":
            wait = lambda: control.Barrier(dist.group.WORLD, "a barrier").wait(60)
        else:                   # the exchange of failure reports / setup results
            wait = lambda: control.gather_strings(dist.group.WORLD, "report", 60, "the reports")
    print("waiting", flush=True)
    t0 = time.monotonic()
    try:
        wait()
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - t0:.2f} s", flush=True)
    if kind != "store":
        other.kill()
    import os
    os._exit(0)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["store", "gloo", "gather"])
def test_ctrl_c_in_a_wait_is_honoured_at_once(tmp_path, kind):
    (tmp_path / "w.py").write_text(WAITER)
    p = subprocess.Popen(
        [sys.executable, str(tmp_path / "w.py"), kind, str(control.free_port())],
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "waiting"
        time.sleep(0.5)  # inside the wait by then (it prints "waiting" right before it)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=20)[0]
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert "KeyboardInterrupt after" in out, out
    assert took < 2.0, (took, out)  # not at the wait's 60 s deadline


INNER = (
    "import signal, sys; "
    "print('SIGINT ignored at start:', signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True); "
    "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]]))"
)


@pytest.mark.timeout(120)
def test_the_suite_started_in_the_background_still_gives_its_children_ctrl_c():
    """A script's `make test > log &` (a shell without job control) starts pytest with SIGINT
    ignored; Python leaves it so and every child the tests spawn inherited it, so the Ctrl-C
    tests timed out (CI runs of 2026-12-07, first blamed on the pid waiter).  tests/conftest.py
    gives SIGINT back its default; here the store case runs in a pytest started exactly so."""
    node = "tests/test_waits.py::test_ctrl_c_in_a_wait_is_honoured_at_once[store]"
    r = subprocess.run(
        ["sh", "-c", '"$0" -c "$1" "$2" & wait $!', sys.executable, INNER, node],
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=100,
    )
    assert "SIGINT ignored at start: True" in r.stdout, r.stdout  # the case this is about
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]


GATHER = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.runtime import control
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    st = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60), wait_for_workers=False)
    dist.init_process_group("gloo", store=st, rank=rank, world_size=3, timeout=timedelta(seconds=600))
    ctl = control.Control(st, "g", 60)
    control.publish_who(ctl, rank)
    got = control.gather_strings(dist.group.WORLD, None if rank == 1 else "r%d " % rank + "x" * 5000, 10, "r")
    assert got == ["r0 " + "x" * 5000, None, "r2 " + "x" * 5000], [g and g[:8] for g in got]
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dies; rank 1 sleeps (hung), rank 0 waits
    if rank == 1:
        time.sleep(30)
    t0 = time.monotonic()
    try:
        control.gather_strings(dist.group.WORLD, "again", 2, "the reports")
    except control.CollectiveError as e:
        print(f"gather ended after {time.monotonic() - t0:.2f} s: {e}", flush=True)
    t0 = time.monotonic()
    gone = control.roll_call(ctl, "rc", 0, 3, 1.0)
    print(f"roll call after {time.monotonic() - t0:.2f} s: {gone}", flush=True)
    os._exit(0)
""")


@pytest.mark.timeout(60)
def test_gathering_reports_is_bounded_and_a_roll_call_names_the_ranks_gone(tmp_path):
    """Issue 17.3/17.5: the exchange of failure reports (gather_strings, replacing
    dist.all_gather_object, which waits for gloo's 30-minute default) ends at its own bound
    when a rank died (rank 2, SIGKILL) or hangs (rank 1); the roll call names both with
    their pid and host (issue 17.7: a dead trainer named by rank, not a raw gloo error)."""
    import socket

    (tmp_path / "g.py").write_text(GATHER)
    port = control.free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "g.py"), str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(3)
    ]
    try:
        out = procs[0].communicate(timeout=40)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    m = re.search(r"gather ended after ([0-9.]+) s: .*the reports", out)
    assert m and float(m.group(1)) < 2 + 1.5, out
    m = re.search(r"roll call after ([0-9.]+) s: (.*)", out)
    assert m and float(m.group(1)) < 1 + 1.0, out
    host = socket.gethostname()
    assert m.group(2) == str([f"trainer rank {r} (pid {procs[r].pid}, host {host})" for r in (1, 2)]), out


def _tiny():
    import torch
    from wxfer.models import TINY, train_model

    torch.manual_seed(0)
    return train_model(TINY)


@pytest.mark.timeout(60)
def test_host_store_takes_a_bool_or_0_1_and_refuses_anything_else():
    from wxfer.models import TINY, preset_for
    from wxfer.runtime.sender import Sender

    with pytest.raises(TypeError, match="host_store must be True, False or None, got 'yes'"):
        Sender(_tiny(), mapping=preset_for(TINY), store="127.0.0.1:1", host_store="yes", timeout=1)
    # 1 means True: this process hosts the store (then waits, bounded, for a worker)
    port = control.free_port()
    t0 = time.monotonic()
    with pytest.raises(SetupError, match="inference worker gpu 0"):
        Sender(_tiny(), mapping=preset_for(TINY), store="127.0.0.1:%d" % port, host_store=1, timeout=1)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_a_huge_layout_claim_is_refused_quickly(store):
    from wxfer.models import TINY, preset_for
    from wxfer.runtime.sender import Sender

    s, addr = store
    ctl = control.Control(s, "huge", 5)
    ctl.set_json("infer/0", dict(replicas=10**9, tp=1, gpu=0))
    ctl.add("infer/count", 1)
    t0 = time.monotonic()
    with pytest.raises(SetupError, match="says replicas=1000000000 tp=1: 1000000000 workers, more than 65536"):
        Sender(_tiny(), mapping=preset_for(TINY), store=addr, name="huge", timeout=1)
    assert time.monotonic() - t0 < 10


def test_descriptor_decoders_raise_a_value_error():
    from wxfer import _wxfer

    for fn in (_wxfer.decode_descriptor, _wxfer.decode_export):
        with pytest.raises(ValueError) as ei:
            fn(b"\x01\x02garbage")
        assert isinstance(ei.value, _wxfer.Error) and ei.value.errno > 0, ei.value


@pytest.mark.timeout(60)
def test_a_bad_stamp_descriptor_is_named_as_the_version_stamps(store):
    """Issue 17.7: a garbage stamp descriptor in a worker's metadata is reported as the
    version stamps of that worker, not as `tag 4611686018427387904`."""
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import in_thread

    s, addr = store
    th, box = in_thread(
        Receiver, inference_params(TINY, 1, 0), mapping=preset_for(TINY).name, store=addr, name="badstamp", timeout=20
    )
    sender = Sender(_tiny(), mapping=preset_for(TINY), store=addr, name="badstamp", timeout=20, write_timeout=3)
    th.join(20)
    g, (desc, off, soff, n) = next(iter(sender.links.begin_dest.items()))
    sender.links.begin_dest[g] = (b"\x00" * len(desc), off, soff, n)
    with pytest.raises(RuntimeError) as ei:
        sender.push()
    msg = str(ei.value)
    assert "the begin version stamps to inference workers [0] were refused" in msg, msg
    assert "4611686018427387904" not in msg, msg
    sender.close()
    box["value"].close()
