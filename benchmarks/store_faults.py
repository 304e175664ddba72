"""Issue 35.9: the TCPStore (hosted outside the trainers, in its own process) killed or stalled.

Each run: a store process, two FSDP2 trainer ranks (gloo over a PrefixStore of that store,
started without torchrun) and one inference worker in its own process (fabric tcp), TINY
model. Steps 1-2 are clean; the fault is one of

- kill-between: SIGKILL the store after step 2 returned on both ranks, before step 3;
- kill-mid:     SIGKILL the store inside step 3 (rank 0, right after its first all-gather);
- stall-mid:    SIGSTOP the store there, SIGCONT STALL_S later;
- stop-forever: SIGSTOP the store there, never continued.

Trainer rank 0 sends the signal (it knows the store's pid). Both ranks then push steps 3 and
4 (GAP_S apart: longer than a lease's staleness); every push is armed with
`faulthandler.dump_traceback_later(CAP_S, exit=True)`: one that has not returned CAP_S (3x the
push's bound) after it started dumps its stack and exits ("hung"). The worker polls `version()`
(1 ms, its own thread) and `state()` (50 ms), logs every change and the slowest call of each (a
`state()` call past CAP_S dumps its stack; the worker is killed CAP_S + 13 s after the trainers
exited: "hung"), and copies its weights whenever it first reads step 3 or 4 complete; this
script compares the copy with the reference packing of that step's saved weights.

    python benchmarks/store_faults.py --repeat 3 --out benchmarks/runs/cpu-2026-12-06-store-faults
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
import time

from common import fault_watch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TIMEOUT, WRITE_TIMEOUT = 8.0, 3.0
BOUND_S = TIMEOUT + 5.0 + (1.5 * WRITE_TIMEOUT + 1.0) + 2.0  # as fault_loop.py
CAP_S = 3 * BOUND_S
SETUP_S = 240.0
STALL_S = 5.0
STEPS = 4
POLL_AFTER_S = 3.0  # the worker polls on this long after the trainers exited
GAP_S = 10.0  # between steps 3 and 4: the leases outlive their 3 s staleness with the store down
CASES = ["kill-between", "kill-mid", "stall-mid", "stop-forever"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- trainer rank
def trainer(rank: int, store: str, case: str, store_pid: int, out: str) -> None:
    import faulthandler
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from wxfer.models import TINY, preset_for, shard_fsdp2, train_model
    from wxfer.runtime import prepare
    from wxfer.runtime.sender import Sender

    host, port = store.rsplit(":", 1)
    st = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", st), rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (2,)))
    sender = Sender(model, mapping=preset_for(TINY), store=store, timeout=TIMEOUT, write_timeout=WRITE_TIMEOUT)
    armed = {"on": False}

    def fault():
        armed["on"] = False
        sig = signal.SIGKILL if case.startswith("kill") else signal.SIGSTOP
        print(f"rank 0 store fault {case} at {time.time():.3f}", flush=True)
        os.kill(store_pid, sig)
        if case == "stall-mid":

            def cont():
                os.kill(store_pid, signal.SIGCONT)
                print(f"rank 0 store continued at {time.time():.3f}", flush=True)

            threading.Timer(STALL_S, cont).start()

    if rank == 0:
        real = prepare.all_gather_single

        def gather(*a, **k):
            r = real(*a, **k)
            if armed["on"]:
                fault()
            return r

        prepare.all_gather_single = gather
    for step in range(1, STEPS + 1):
        fault_watch.next_weights(model, step, GAP_S)
        if step >= 3:
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                torch.save(full, os.path.join(out, f"full{step}.pt"))
            dist.barrier()
            if step == 3 and rank == 0:
                if case == "kill-between":
                    fault()
                else:
                    armed["on"] = True
            dist.barrier()
        t0 = time.monotonic()
        faulthandler.dump_traceback_later(CAP_S, exit=True)
        try:
            sender.push()
            faulthandler.cancel_dump_traceback_later()
            print(f"rank {rank} step {step} ok after {time.monotonic() - t0:.2f} s at {time.time():.3f}", flush=True)
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            faulthandler.cancel_dump_traceback_later()
            msg = str(e).replace("\n", " | ")
            print(
                f"rank {rank} step {step} {type(e).__name__} after {time.monotonic() - t0:.2f} s "
                f"at {time.time():.3f}: {msg}",
                flush=True,
            )
    os._exit(0)


# --------------------------------------------------------------------------- inference worker
def worker(store: str, out: str) -> None:
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver

    params = inference_params(TINY, 1, 0)
    recv = Receiver(params, mapping=preset_for(TINY).name, store=store, timeout=60)
    fault_watch.say("ready")
    fault_watch.watch(recv, params, out, "", CAP_S, POLL_AFTER_S)
    os._exit(0)


# --------------------------------------------------------------------------- one run
def wrong_bytes(out: str, v: int) -> bool:
    import torch

    from wxfer.mapping import Layout, expand, pack_shard
    from wxfer.models import TINY, preset_for

    full = torch.load(os.path.join(out, f"full{v}.pt"))
    ex = expand(preset_for(TINY).rules, {n: tuple(t.shape) for n, t in full.items()}, Layout(1, False, None), TINY)
    got = torch.load(os.path.join(out, f"at{v}.pt"))
    for c in ex.components:
        for sh in c.shards:
            b = pack_shard(sh, full)
            if not torch.equal(got[sh.dst].reshape(-1).view(torch.uint8)[sh.offset : sh.offset + b.numel()], b):
                return True
    return False


def run(case: str, i: int, keep: str | None, provider: str = "tcp") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WXFER_FABRIC_PROVIDER=provider, WXFER_LOG="warning")
    port = free_port()
    store = "127.0.0.1:%d" % port
    out = tempfile.mkdtemp(prefix="store_faults_")
    me = [sys.executable, os.path.abspath(__file__)]
    host = subprocess.Popen(me + ["host", str(port)], env=env)
    time.sleep(0.5)
    logs = {n: open(os.path.join(out, n + ".log"), "w+") for n in ("rank0", "rank1", "worker")}
    ps = [
        subprocess.Popen(
            me + ["trainer", str(r), store, case, str(host.pid), out],
            env=env,
            stdout=logs[f"rank{r}"],
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    wk = subprocess.Popen(me + ["worker", store, out], env=env, stdout=logs["worker"], stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    killed = []
    while any(p.poll() is None for p in ps):  # each push bounds itself (faulthandler, CAP_S)
        if time.monotonic() - t0 > SETUP_S + STEPS * CAP_S + 30:
            for r, p in enumerate(ps):
                if p.poll() is None:
                    p.kill()
                    killed.append(r)
        time.sleep(0.2)
    open(os.path.join(out, "done"), "w").close()
    try:
        wk.wait(timeout=CAP_S + POLL_AFTER_S + 10)  # the worker's own dump fires at CAP_S inside a stuck call
    except subprocess.TimeoutExpired:
        wk.kill()
        killed.append("worker")
    host.kill()
    host.wait()
    text = fault_watch.read_logs(logs)
    t_fault = next((float(ln.rsplit(" at ", 1)[1]) for ln in text["rank0"].splitlines() if " store fault " in ln), None)
    res = dict(case=case, i=i, fault_at=t_fault, killed_by_script=killed, pushes={}, worker=[], wrong={})
    for r in (0, 1):
        for ln in text[f"rank{r}"].splitlines():
            if ln.startswith(f"rank {r} step "):
                parts = ln.split(" ")
                step, outc = int(parts[3]), parts[4]
                secs = float(ln.split(" after ")[1].split(" s")[0])
                at = float(ln.split(" at ", 1)[1].split(":")[0].split(" ")[0])
                msg = ln.split(": ", 1)[1] if ": " in ln else ""
                res["pushes"][f"{r}/{step}"] = dict(
                    outcome=outc,
                    s=secs,
                    after_fault_s=round(at - t_fault, 2) if t_fault and step >= 3 else None,
                    msg=msg[:600],
                )
        for step in range(1, STEPS + 1):
            if f"{r}/{step}" not in res["pushes"]:
                hung = "Timeout (" in text[f"rank{r}"]
                res["pushes"][f"{r}/{step}"] = dict(outcome="hung (stack dumped)" if hung else "no report")
                break
    res["worker"] = fault_watch.events(text["worker"], t_fault)
    for v in (3, 4):
        if os.path.exists(os.path.join(out, f"at{v}.pt")) and os.path.exists(os.path.join(out, f"full{v}.pt")):
            res["wrong"][v] = wrong_bytes(out, v)
    res["store_warnings"] = {n: t.count("TCPStore.cpp") for n, t in text.items()}
    res["dumps"] = {n: t[t.find("Timeout (") :][:4000] for n, t in text.items() if "Timeout (" in t}
    fault_watch.keep_logs(keep, f"{case}-{i}", text)
    return res


def summarize(r: dict) -> dict:
    p = r["pushes"]
    copied = [e["v"] for e in r["worker"] if e["ev"] == "copied"]
    end = next((e for e in r["worker"] if e["ev"] == "end"), {})
    return dict(
        case=r["case"],
        i=r["i"],
        r0_3=_push(p.get("0/3")),
        r1_3=_push(p.get("1/3")),
        r0_4=_push(p.get("0/4")),
        r1_4=_push(p.get("1/4")),
        worker_after=fault_watch.after(r["worker"]) or "-",
        complete=copied,
        wrong=[v for v, w in r["wrong"].items() if w],
        slowest=(
            f"version {end['slowest']['version']} s, state {end['slowest']['state']} s" if end else "worker killed"
        ),
        warnings=r["store_warnings"],
        hung=bool(r["dumps"]) or bool(r["killed_by_script"]),
    )


def _push(d):
    if d is None:
        return "-"
    if d["outcome"] == "ok":
        return f"ok {d['s']} s" + (f" (+{d['after_fault_s']} s)" if d.get("after_fault_s") is not None else "")
    if "s" in d:
        return f"{d['outcome']} after {d['s']} s (+{d['after_fault_s']} s)"
    return d["outcome"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--provider", default="tcp", help="the libfabric provider: tcp (default) or shm")
    ap.add_argument("--out", help="a folder for the raw logs and results.json")
    a = ap.parse_args(argv)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()}")
    print(
        f"provider {a.provider}, timeout {TIMEOUT} s, write_timeout {WRITE_TIMEOUT} s, "
        f"push bound {BOUND_S} s, hang cap {CAP_S} s"
    )
    rows, raw = [], []
    for i in range(a.repeat):
        for case in a.cases.split(","):
            r = run(case, i, a.out, a.provider)
            raw.append(r)
            s = summarize(r)
            rows.append(s)
            print(json.dumps(s), flush=True)
    print(
        "| case | # | rank 0 step 3 | rank 1 step 3 | rank 0 step 4 | rank 1 step 4 | worker after the fault | "
        "copied complete v | wrong bytes | slowest worker calls | c10d store warnings r0/r1/worker | hung |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        w = s["warnings"]
        print(
            f"| {s['case']} | {s['i']} | {s['r0_3']} | {s['r1_3']} | {s['r0_4']} | {s['r1_4']} | {s['worker_after']} | "
            f"{s['complete']} | {s['wrong'] or 'none'} | {s['slowest']} | "
            f"{w['rank0']}/{w['rank1']}/{w['worker']} | {'YES' if s['hung'] else 'no'} |"
        )
    if a.out:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(raw, f, indent=1)
    return 1 if any(s["hung"] or s["wrong"] for s in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        _, _, rk, st, ca, pid, od = sys.argv
        trainer(int(rk), st, ca, int(pid), od)
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "host":
        import torch.distributed as dist

        _st = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=True, wait_for_workers=False, use_libuv=True)
        time.sleep(SETUP_S + STEPS * CAP_S + 120)
    else:
        sys.exit(main())
