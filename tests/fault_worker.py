"""Helper processes for tests/test_faults.py (not a test module).

python tests/fault_worker.py receiver STORE NAME REPLICA REPLICAS OUT
    an inference worker (TINY model, TP 1): registers, then waits (bounded) for the
    store key test/dump/<gpu>, saves its parameters, version() and state() to
    OUT/<gpu>.pt, exits.  A dump request "wait N" first calls wait_version(N, 20) and
    saves what it raised (wait_error) and after how many seconds (wait_s).  "stay": saves,
    then keeps running (bounded, 120 s) until killed.  $FAULT_DEVICE (e.g. cuda:0): its
    parameters there, registered with cuda_ipc.  $FAULT_GATE (a raw store key): started
    early, its imports done, it constructs its Receiver only once the test sets that key
    (a restarted worker's process without a restart's 2-3 s of imports in the test's wait).
python tests/fault_worker.py trainer STORE NAME KILL_AFTER_TASKS
    a trainer (world 1): pushes step 1, changes the weights, and during step 2 kills
    itself with SIGKILL after KILL_AFTER_TASKS tasks were handed to the engine (0: right
    after step 1, between pushes).
"""

import os
import signal
import sys
import time

import torch

from wxfer.models import TINY, inference_params, preset_for

from helpers import frozen_model  # tests/helpers.py: this script's folder is on sys.path

T = 30.0


def receiver(store, name, replica, replicas, out):
    from wxfer.runtime import control
    from wxfer.runtime.receiver import Receiver

    gate = os.environ.get("FAULT_GATE")
    if gate:
        from datetime import timedelta

        import torch.distributed as dist

        host, port = store.rsplit(":", 1)
        raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
        raw.wait([gate], timedelta(seconds=120))
    params = inference_params(TINY, 1, 0)
    dev = os.environ.get("FAULT_DEVICE")
    if dev:
        params = {n: t.to(dev) for n, t in params.items()}
    r = Receiver(
        params,
        mapping=preset_for(TINY).name,
        store=store,
        name=name,
        replica=replica,
        replicas=replicas,
        tp=1,
        rank=0,
        timeout=T,
        transport="cuda_ipc" if dev and dev.startswith("cuda") else "auto",
    )
    print("ready", r.gpu, flush=True)
    ctl = r.ctl
    req = ctl.get("test/dump/%d" % r.gpu, "the test's dump request", 60).decode()
    extra = {}
    if req.startswith("wait "):
        t0 = time.monotonic()
        try:
            r.wait_version(int(req.split()[1]), 20)
            extra["wait_error"] = None
        except Exception as e:  # noqa: BLE001 -- handed to the test
            extra["wait_error"] = f"{type(e).__name__}: {e}"
        extra["wait_s"] = time.monotonic() - t0
    torch.save(dict(params=params, version=r.version(), state=r.state(), **extra), os.path.join(out, "%d.pt" % r.gpu))
    ctl.set("test/dumped/%d" % r.gpu, b"1")
    if req == "stay":
        time.sleep(120)  # written on until the test kills it
    r.close()
    del control


def model():
    """The trainers' model of these tests: TINY from seed 0, frozen."""
    return frozen_model(TINY, seed=0)


def trainer(store, name, kill_after):
    from wxfer.runtime.sender import Sender

    m = model()
    s = Sender(m, mapping=preset_for(TINY), store=store, name=name, timeout=T, write_timeout=10, watermark="64KiB")
    s.push()
    print("pushed 1", flush=True)
    if kill_after == 0:  # dies between pushes
        os.kill(os.getpid(), signal.SIGKILL)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)
    real, n = s._run_task, [0]

    def run_task(op, keep):
        real(op, keep)
        n[0] += 1
        if n[0] == kill_after:
            time.sleep(0.2)  # let the writes handed over so far land
            os.kill(os.getpid(), signal.SIGKILL)

    s._run_task = run_task
    s.push()
    print("pushed 2 (the kill did not happen)", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
