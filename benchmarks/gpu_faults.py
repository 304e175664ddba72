"""Issue 35.9, the cuda_ipc rows of the fault matrix (docs/faults.md), on one GPU.

Each run: a TCPStore in its own process, one trainer (world 1: one GPU has no trainer
collective; the all-gather rows are fabric's, benchmarks/fault_loop.py) and two inference
workers (replicas 0 and 1), each in its own process on cuda:0, over cuda_ipc; the TINY model.
Steps 1-2 are clean; step 3 meets the fault; step 4 comes GAP_S later (past a lease's bound):

- recv-kill-mid / recv-stop-mid: worker 1 SIGKILLed / SIGSTOPped (SIGCONT STALL_S later)
  inside step 3, after the trainer's first task;
- trainer-kill-mid: the trainer SIGKILLs itself there (no step 4);
- raise-before / raise-inside / raise-after: a RuntimeError before the first task, after the
  first task, in the engine's wait for the writes;
- store-kill-mid / store-stall-mid / store-stop-forever: the store SIGKILLed, SIGSTOPped for
  STALL_S, SIGSTOPped for good, after the trainer's first task.

Recorded: each push's outcome, seconds and message; each worker's state()/version() changes
after the fault (and its slowest state() call); whether a worker read a step complete over
bytes that differ from the reference packing of that step's weights (its copy, taken at a
complete version(), against wxfer.mapping's packing of the trainer's saved weights).  A push
or a state() call past CAP_S dumps its stack and counts as hung.

    OUT=/tmp/f python3 benchmarks/gpu_faults.py --out $OUT/gpu_faults      # about 4 min on an H100
    python benchmarks/gpu_faults.py --device cpu                            # the same over fabric tcp
    WXFER_TRANSPORT=verbs WXFER_LIBIBVERBS=csrc/testing/libwxemu_verbs.so \
        python benchmarks/gpu_faults.py --device cpu                        # over the emulated verbs NIC
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from common import fault_watch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TIMEOUT, WRITE_TIMEOUT = 8.0, 3.0
CAP_S = 3 * (TIMEOUT + 5.0 + 1.5 * WRITE_TIMEOUT + 1.0 + 2.0)
STALL_S, GAP_S, POLL_AFTER_S, STEPS = 5.0, 5.0, 3.0, 4
CASES = [
    "recv-kill-mid",
    "recv-stop-mid",
    "trainer-kill-mid",
    "raise-before",
    "raise-inside",
    "raise-after",
    "store-kill-mid",
    "store-stall-mid",
    "store-stop-forever",
]


def host(port: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    st = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    time.sleep(3600)
    del st


# --------------------------------------------------------------------------- the trainer
def trainer(store: str, case: str, pids: str, out: str) -> None:
    import faulthandler

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fault_worker

    from wxfer.models import TINY, preset_for
    from wxfer.runtime.sender import Sender

    store_pid, worker1 = (int(x) for x in pids.split(","))
    dev = os.environ.get("FAULTS_DEVICE", "cuda:0")
    model = fault_worker.model().to(dev)
    sender = Sender(
        model, mapping=preset_for(TINY), store=store, timeout=TIMEOUT, write_timeout=WRITE_TIMEOUT, device=dev
    )
    armed = {"on": False, "n": 0}
    print(f"trainer transport {sender.transport_name}", flush=True)

    def fault(where: str) -> None:
        armed["on"] = False
        print(f"trainer fault {case} ({where}) at {time.time():.3f}", flush=True)
        if case.startswith("raise"):
            raise RuntimeError(f"injected {case} failure on the trainer")
        if case == "trainer-kill-mid":
            os.kill(os.getpid(), signal.SIGKILL)
        pid = worker1 if case.startswith("recv") else store_pid
        os.kill(pid, signal.SIGKILL if "kill" in case else signal.SIGSTOP)
        if case in ("recv-stop-mid", "store-stall-mid"):
            threading.Timer(STALL_S, os.kill, (pid, signal.SIGCONT)).start()

    real_task, eng = sender._run_task, sender.runner.engine

    def run_task(op, keep):
        if armed["on"] and case == "raise-before":
            fault("before the first task")
        real_task(op, keep)
        armed["n"] += 1
        if armed["on"] and case not in ("raise-before", "raise-after"):
            fault("after the first task")

    class Engine:  # raise-after: in the engine's wait for the writes
        def wait(self, *a, **k):
            if armed["on"] and case == "raise-after":
                fault("in the writes' wait")
            return eng.wait(*a, **k)

        def __getattr__(self, k):
            return getattr(eng, k)

    sender._run_task = run_task
    sender.runner.engine = sender.steps.engine = Engine()
    last = 3 if case == "trainer-kill-mid" else STEPS
    for step in range(1, last + 1):
        fault_watch.next_weights(model, step, GAP_S)
        if step >= 3:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(out, f"full{step}.pt"))
            armed["on"] = step == 3
        t0 = time.monotonic()
        faulthandler.dump_traceback_later(CAP_S, exit=True)
        try:
            sender.push()
            print(f"trainer step {step} ok after {time.monotonic() - t0:.3f} s at {time.time():.3f}", flush=True)
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            msg = str(e).replace("\n", " | ")
            took = time.monotonic() - t0
            print(f"trainer step {step} {type(e).__name__} after {took:.3f} s at {time.time():.3f}: {msg}", flush=True)
        faulthandler.cancel_dump_traceback_later()
    print(f"trainer watcher: {sender.stats().get('watcher')}", flush=True)
    os._exit(0)


# --------------------------------------------------------------------------- a worker
def worker(store: str, replica: int, out: str) -> None:
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver

    dev = os.environ.get("FAULTS_DEVICE", "cuda:0")
    params = {k: v.to(dev) for k, v in inference_params(TINY, 1, 0).items()}
    recv = Receiver(
        params,
        mapping=preset_for(TINY).name,
        store=store,
        replica=replica,
        replicas=2,
        tp=1,
        rank=0,
        timeout=60,
        transport="cuda_ipc" if dev.startswith("cuda") else "auto",
    )
    fault_watch.say("ready")
    fault_watch.watch(recv, params, out, f"_{replica}", CAP_S, POLL_AFTER_S)
    os._exit(0)


# --------------------------------------------------------------------------- one run
def wrong_bytes(out: str, v: int, replica: int) -> bool:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fault_worker
    from test_faults import _expected

    m = fault_worker.model()
    m.load_state_dict(torch.load(os.path.join(out, f"full{v}.pt")))
    got = torch.load(os.path.join(out, f"at{v}_{replica}.pt"))
    ex = _expected(m)
    return any(not torch.equal(got[d].reshape(-1).view(torch.uint8)[o : o + b.numel()], b) for d, o, b in ex)


def run(case: str, keep: str | None) -> dict:
    from wxfer.runtime.control import free_port

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WXFER_LOG="warning")
    port = free_port()
    store, out, me = "127.0.0.1:%d" % port, tempfile.mkdtemp(prefix="gpu_faults_"), [sys.executable, __file__]
    hp = subprocess.Popen(me + ["host", str(port)], env=env)
    deadline = time.monotonic() + 60
    while True:  # the store accepts (importing torch takes seconds on a loaded machine)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and hp.poll() is None, "the store process did not start"
            time.sleep(0.1)
    logs = {n: open(os.path.join(out, n + ".log"), "w+") for n in ("trainer", "w0", "w1")}
    wks = [
        subprocess.Popen(me + ["worker", store, str(q), out], env=env, stdout=logs[f"w{q}"], stderr=subprocess.STDOUT)
        for q in (0, 1)
    ]
    tr = subprocess.Popen(
        me + ["trainer", store, case, f"{hp.pid},{wks[1].pid}", out],
        env=env,
        stdout=logs["trainer"],
        stderr=subprocess.STDOUT,
    )
    killed = []
    try:
        tr.wait(timeout=120 + STEPS * CAP_S)
    except subprocess.TimeoutExpired:
        tr.kill()
        killed.append("trainer")
    open(os.path.join(out, "done"), "w").close()
    for q, w in enumerate(wks):
        w.send_signal(signal.SIGCONT)
        try:
            w.wait(timeout=CAP_S + POLL_AFTER_S + 10)
        except subprocess.TimeoutExpired:
            w.kill()
            killed.append(f"w{q}")
    hp.send_signal(signal.SIGCONT)
    hp.kill()
    hp.wait()
    text = fault_watch.read_logs(logs)
    faults = [ln for ln in text["trainer"].splitlines() if ln.startswith("trainer fault ")]
    t_fault = float(faults[0].rsplit(" at ", 1)[1]) if faults else None
    res = dict(case=case, fault_at=t_fault, killed_by_script=killed, pushes={}, workers={}, wrong={})
    for ln in text["trainer"].splitlines():
        if ln.startswith("trainer step "):
            p = ln.split(" ")
            secs = float(ln.split(" after ")[1].split(" s")[0])
            msg = ln.split(": ", 1)[1] if ": " in ln else ""
            res["pushes"][int(p[2])] = dict(outcome=p[3], s=secs, msg=msg[:500])
        if ln.startswith("trainer transport "):
            res["transport"] = ln.split(" ", 2)[2]
        if ln.startswith("trainer watcher: "):
            res["watcher"] = ln.split(": ", 1)[1]
    for q in (0, 1):
        evs = fault_watch.events(text[f"w{q}"], t_fault)
        res["workers"][q] = evs
        for v in (3, 4):
            if os.path.exists(os.path.join(out, f"at{v}_{q}.pt")):
                res["wrong"][f"{q}@{v}"] = wrong_bytes(out, v, q)
    res["hung"] = bool(killed) or any("Timeout (" in t for t in text.values())
    fault_watch.keep_logs(keep, case, text)
    return res


def summary(r: dict) -> dict:
    def push(v):
        d = r["pushes"].get(v)
        return "-" if d is None else f"{d['outcome']} {d['s']} s" + (f": {d['msg'][:220]}" if d["msg"] else "")

    end = {q: next((e for e in r["workers"].get(q, []) if e["ev"] == "end"), {}) for q in (0, 1)}
    return dict(
        case=r["case"],
        transport=r.get("transport"),
        step3=push(3),
        step4=push(4),
        w0=fault_watch.after(r["workers"].get(0, [])) or "-",
        w1=fault_watch.after(r["workers"].get(1, [])) or "-",
        complete=sorted(r["wrong"]),
        wrong=[k for k, w in r["wrong"].items() if w],
        slowest_state_s={q: e.get("slowest", {}).get("state") for q, e in end.items()},
        watcher=r.get("watcher"),
        hung=r["hung"],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", help="a folder for the raw logs and results.json")
    ap.add_argument("--device", default="cuda:0", help="cpu: the same runs over fabric tcp (a check of this script)")
    a = ap.parse_args(argv)
    import torch

    os.environ["FAULTS_DEVICE"] = a.device
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_faults: no CUDA device here: nothing run")
        return 2
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    cpu = "CPU, transport " + os.environ.get("WXFER_TRANSPORT", "auto (fabric tcp)")
    what = f"{torch.cuda.get_device_name(0)}; cuda_ipc, one GPU" if a.device.startswith("cuda") else cpu
    print(f"machine: {platform.node()} {what}, world 1")
    print(f"timeout {TIMEOUT} s, write_timeout {WRITE_TIMEOUT} s, hang cap {CAP_S} s, stall {STALL_S} s")
    rows, bad = [], 0
    for case in a.cases.split(","):
        t0 = time.monotonic()
        r = run(case, a.out)
        s = summary(r)
        rows.append(r)
        print(json.dumps(s), f"({time.monotonic() - t0:.0f} s)", flush=True)
        bad += bool(s["wrong"]) or s["hung"]
    if a.out:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{len(rows)} runs; {bad} hung or read complete over wrong bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "host":
        host(int(sys.argv[2]))
    elif mode == "trainer":
        trainer(*sys.argv[2:6])
    elif mode == "worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main())
