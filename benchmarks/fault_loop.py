"""Issue 35.3: a trainer rank that dies, hangs or raises inside a posted push, many times.

Each iteration: two FSDP2 trainer ranks (gloo, started here without torchrun, so that the
fault is the only thing that ends a rank) push the TINY model to one inference worker in its
own process (fabric tcp); steps 1-2 are clean, and in step 3 trainer rank 1 meets one fault
at a random point:

- kill: SIGKILL, at a random hook (before or after one of its all-gathers, at the pack, in
  its writes' wait) or after a random delay in [0, 1.2 x its clean push];
- stop: SIGSTOP right before one of its all-gathers (a hung rank: its sockets stay open),
  SIGKILLed by this script once rank 0 reported;
- raise: RuntimeError at the watermark's reserve, before one of its all-gathers, at the pack or
  in its writes' wait (rank 1 drains; both ranks push step 4 after it);
- sigint: KeyboardInterrupt inside the wait of one of its all-gathers (Ctrl-C), after which
  rank 1 exits as a user's script would.

The store: hosted by trainer rank 0 ("rank0") or by this script ("outside"). Recorded per
iteration: rank 0's outcome of step 3 and its seconds, whether it named trainer rank 1,
how long after the fault the worker's state() read torn (or dropped), and whether the worker
ever read step 3 complete over bytes that differ from the reference packing.  A push that
outlives BOUND_S (timeout + the roll call + the writes' bound + 2 s) fails the iteration;
one that has not returned BOUND_S + 10 s after the step before it did is killed and
counted "hung".

    python benchmarks/fault_loop.py --iterations 50            # half each store placement
    python benchmarks/fault_loop.py --iterations 4 --faults stop --store rank0

Prints one line per iteration and the table; exits 1 when any iteration broke a rule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's wxfer (reference() here; PYTHONPATH in the children)
TIMEOUT, WRITE_TIMEOUT = 8.0, 3.0
BOUND_S = TIMEOUT + 5.0 + (1.5 * WRITE_TIMEOUT + 1.0) + 2.0
LIMIT_S = 240.0  # a launch's setup (3 processes, on a loaded 2-core VM)
STEP = 3  # the step with the fault (raise: steps 3, 5, .. 3 + 2 (RAISES - 1), the others clean)
RAISES = 6  # faulted steps of one "raise" launch (rank 1 lives on: each is one iteration)
HOOKS = {
    "kill": ["gather", "after-gather", "pack", "wait", "timer"],
    "stop": ["gather"],
    "raise": ["reserve", "gather", "pack", "wait"],
    "sigint": ["gather-wait"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- trainer rank
def trainer(rank: int, store: str, fault: str, hooks: str, nths: str, frac: float, out: str) -> None:
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from wxfer.models import TINY, preset_for, shard_fsdp2, train_model
    from wxfer.runtime import control, prepare
    from wxfer.runtime.sender import Sender

    from datetime import timedelta

    hooks_l, nths_l = hooks.split(","), [int(x) for x in nths.split(",")]
    faulted = [STEP + 2 * k for k in range(len(hooks_l))]
    if store == "rank0":
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        wx_store = None  # hosted by trainer rank 0 ($WXFER_STORE_PORT)
    else:
        host, port = store.rsplit(":", 1)
        st = dist.TCPStore(host, int(port), is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("pg", st), rank=rank, world_size=2, timeout=timedelta(seconds=60)
        )
        wx_store = store
    torch.manual_seed(0)
    model = shard_fsdp2(train_model(TINY), init_device_mesh("cpu", (2,)))
    sender = Sender(model, mapping=preset_for(TINY), store=wx_store, timeout=TIMEOUT, write_timeout=WRITE_TIMEOUT)
    armed = {"on": False, "n": 0, "hook": None, "nth": 0, "step": 0}

    def act():
        armed["on"] = False
        hook = armed["hook"]
        print(f"rank {rank} fault {fault}@{hook} step {armed['step']} at {time.time():.3f}", flush=True)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "sigint":
            raise KeyboardInterrupt
        raise RuntimeError(f"injected {hook} failure on trainer rank {rank}")

    def at(name, real, after=False):
        def call(*a, **k):
            if armed["on"] and armed["hook"] == name:
                armed["n"] += 1
                if armed["n"] == armed["nth"] and not after:
                    act()
            r = real(*a, **k)
            if armed["on"] and after and armed["hook"] == "after-gather" and armed["n"] == armed["nth"]:
                act()
            return r

        return call

    if rank == 1:
        eng = sender.runner.engine

        class Engine:
            reserve = staticmethod(at("reserve", eng.reserve))
            wait = staticmethod(at("wait", eng.wait))

            def __getattr__(self, k):
                return getattr(eng, k)

        sender.runner.engine = sender.steps.engine = Engine()
        prepare.all_gather_single = at("gather", prepare.all_gather_single)
        if "after-gather" in hooks_l:
            prepare.all_gather_single = at("after-gather", prepare.all_gather_single, after=True)
        prepare.pack_into = at("pack", prepare.pack_into)
        control.wait_work = at("gather-wait", control.wait_work)
    took = []
    last = faulted[-1] + (1 if fault == "raise" else 0)
    for step in range(1, last + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        if step in faulted:
            k = faulted.index(step)
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                torch.save(full, os.path.join(out, "full.pt"))
            dist.barrier()
            if rank == 1:
                armed.update(on=True, n=0, hook=hooks_l[k], nth=nths_l[k], step=step)
                if hooks_l[k] == "timer":
                    d = frac * 1.2 * sorted(took)[len(took) // 2]
                    threading.Timer(d, act).start()
        t0 = time.monotonic()
        try:
            sender.push()
            armed["on"] = False  # a hook not reached in the faulted step: no fault in the next
            took.append(time.monotonic() - t0)
            print(f"rank {rank} step {step} ok after {time.monotonic() - t0:.2f} s at {time.time():.3f}", flush=True)
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            armed["on"] = False
            msg = str(e).replace("\n", " | ")
            print(
                f"rank {rank} step {step} {type(e).__name__} after {time.monotonic() - t0:.2f} s "
                f"at {time.time():.3f}: {msg}",
                flush=True,
            )
            if not isinstance(e, Exception) or fault != "raise":
                os._exit(3)  # as a user's script would: the group is gone
    os._exit(0)  # no teardown collectives: rank 1 may be gone


# --------------------------------------------------------------------------- inference worker
def worker(store: str, out: str) -> None:
    import torch

    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.runtime.receiver import Receiver

    params = inference_params(TINY, 1, 0)
    recv = Receiver(params, mapping=preset_for(TINY).name, store=store, timeout=60)
    res = {"seen": [], "torn_at": None, "torn": None, "complete_at_step": False}
    seen, t_state = set(), 0.0
    deadline = time.monotonic() + LIMIT_S + 30
    while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "done")):
        v = recv.version()
        if v == STEP and not res["complete_at_step"]:
            torch.save({k: t.clone() for k, t in params.items()}, os.path.join(out, "at_step.pt"))
            if recv.version() == STEP:  # still complete after the copy: the copy is that step's
                res["complete_at_step"] = True
        seen.add(v)
        if res["torn_at"] is None and time.monotonic() - t_state > 0.02 and max(seen) >= STEP - 1:
            t_state = time.monotonic()
            st = recv.state()
            if st["state"] in ("torn", "dropped"):
                res["torn_at"], res["torn"] = time.time(), st["state"] + ": " + st["message"][:300]
        time.sleep(0.001)
    res["seen"] = sorted(seen)
    with open(os.path.join(out, "worker.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)


# --------------------------------------------------------------------------- one iteration
def reference(out: str) -> dict:
    """The bytes the worker must hold at step 3 (the reference packing of the saved weights)."""
    import torch

    from wxfer.mapping import Layout, expand, pack_shard
    from wxfer.models import TINY, preset_for

    full = torch.load(os.path.join(out, "full.pt"))
    ex = expand(preset_for(TINY).rules, {n: tuple(t.shape) for n, t in full.items()}, Layout(1, False, None), TINY)
    return {(sh.dst, sh.offset): pack_shard(sh, full) for c in ex.components for sh in c.shards}


def wrong_bytes(out: str) -> bool:
    import torch

    got = torch.load(os.path.join(out, "at_step.pt"))
    for (dst, off), b in reference(out).items():
        if not torch.equal(got[dst].reshape(-1).view(torch.uint8)[off : off + b.numel()], b):
            return True
    return False


def iteration(i: int, store_mode: str, fault: str, rng: random.Random, hook=None, nth=None) -> list:
    """One launch (`hook`, `nth`: the fault's point, else drawn from `rng`); its records (one
    per faulted step: "raise" has RAISES of them)."""
    n = RAISES if fault == "raise" else 1
    hooks = [rng.choice(HOOKS[fault]) if hook is None else hook for _ in range(n)]
    # TINY, two ranks: 4 row all-gathers a push per rank (more: not reached), fewer packs, reserves
    # (raise: its writes' wait, the first; the second waits for the end stamps, after the flag)
    nths = [rng.randint(1, 4 if "gather" in h else 1 if h == "wait" else 2) if nth is None else nth for h in hooks]
    frac = rng.random()
    t_launch = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WXFER_FABRIC_PROVIDER="tcp", WXFER_LOG="warning")
    host_proc = None
    port = free_port()
    if store_mode == "rank0":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WXFER_STORE_PORT=str(port), WXFER_STORE="")
        wstore = "127.0.0.1:%d" % port
    else:
        wstore = "127.0.0.1:%d" % port
        host_proc = subprocess.Popen([sys.executable, __file__, "host", str(port)], env=env)
        time.sleep(0.5)
    out = tempfile.mkdtemp(prefix="fault_loop_")
    me = [sys.executable, os.path.abspath(__file__)]
    trainer_store = "rank0" if store_mode == "rank0" else wstore
    ps = [
        subprocess.Popen(
            me + ["trainer", str(r), trainer_store, fault, ",".join(hooks), ",".join(map(str, nths)), repr(frac), out],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    wk = subprocess.Popen(
        me + ["worker", wstore, out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    res = dict(i=i, store=store_mode)
    t_start = time.monotonic()
    lines0 = []
    t_ready = None  # when rank 0 reported the step before the first faulted one
    try:
        while True:  # rank 0's output, line by line, until it exits or a push hangs
            import select

            left = LIMIT_S - (time.monotonic() - t_start)
            if t_ready is not None:  # each faulted push and the clean one after it, within the bound
                left = t_ready + (BOUND_S + 10.0) * (n + 1) - time.monotonic()
            if left <= 0:
                res["outcome"] = "hung"
                break
            r, _, _ = select.select([ps[0].stdout], [], [], min(left, 1.0))
            if r:
                line = ps[0].stdout.readline()
                if not line:
                    break
                lines0.append(line.rstrip())
                if line.startswith(f"rank 0 step {STEP - 1} "):
                    t_ready = time.monotonic()
                if fault == "stop" and line.startswith(f"rank 0 step {STEP} "):
                    break
    finally:
        for p in ps:  # a stopped rank 1 is killed here (after rank 0 reported), as is a hung rank
            if p.poll() is None:
                time.sleep(0.2 if fault == "raise" else 0)
                try:
                    p.wait(timeout=30 if fault == "raise" else 0.1)
                except subprocess.TimeoutExpired:
                    p.kill()
        open(os.path.join(out, "done"), "w").close()
        try:
            wk.wait(timeout=30)
        except subprocess.TimeoutExpired:
            wk.kill()
        if host_proc is not None:
            host_proc.kill()
    out1 = ps[1].stdout.read()
    wout = wk.stdout.read()
    try:
        with open(os.path.join(out, "worker.json")) as f:
            w = json.load(f)
    except OSError:
        w = {"seen": [], "torn_at": None, "torn": None, "complete_at_step": False, "error": wout[-1500:]}
    fired = {}  # faulted step -> the fault's wall time
    for ln in out1.splitlines():
        if " fault " in ln and " step " in ln:
            fired[int(ln.split(" step ")[1].split(" ")[0])] = float(ln.rsplit(" at ", 1)[1])
    setup_done = any(ln.startswith("rank 0 step 1 ") for ln in lines0)
    recs = []
    for k in range(n):
        step = STEP + 2 * k
        where = f"#{nths[k]}" if hooks[k] != "timer" else f"~{frac:.2f}"
        r = dict(res, step=step, fault=f"{fault}@{hooks[k]}{where}")
        line = next((ln for ln in lines0 if ln.startswith(f"rank 0 step {step} ")), None)
        r["fault_fired"] = step in fired
        if not setup_done:
            r["outcome"] = "setup did not finish" if res.get("outcome") == "hung" else "setup failed"
        elif line is None:
            r["outcome"] = res.get("outcome", "no report (rank 0 exited)")
        else:
            r["outcome"] = line.split(" ")[4]
            r["seconds"] = float(line.split(" after ")[1].split(" s")[0])
            r["message"] = line.split(": ", 1)[1] if ": " in line else ""
            r["names_rank1"] = "trainer rank 1" in r["message"]
        if fault == "raise":
            nxt = next((ln for ln in lines0 if ln.startswith(f"rank 0 step {step + 1} ")), "")
            r["next_step"] = nxt.split(" ")[4] if nxt else "missing"
        first = k == 0
        r["torn_after_s"] = (
            round(w["torn_at"] - fired[step], 2) if first and w["torn_at"] is not None and step in fired else None
        )
        r["torn"] = w["torn"] if first else None
        if fault == "raise":  # every faulted step is broken (before the flag): never complete
            r["complete_at_step"] = step in w["seen"]
            r["complete_wrong"] = r["complete_at_step"] and step in fired
        else:
            r["complete_at_step"] = bool(w["complete_at_step"])
            r["complete_wrong"] = r["complete_at_step"] and wrong_bytes(out)
        if not setup_done:
            r["pass"] = None  # no push ran: not a push that outlived its bound (counted apart)
        else:
            ok = r["outcome"] != "hung" and not r["complete_wrong"]
            ok = ok and (r.get("seconds") is None or r["seconds"] <= BOUND_S)
            if r["fault_fired"] and r["outcome"] not in ("ok", "hung") and line is not None:
                ok = ok and r.get("names_rank1", False)
            if fault == "raise" and r["fault_fired"]:
                ok = ok and r["next_step"] == "ok"
            r["pass"] = ok
        if not r["fault_fired"]:
            r["note"] = "the fault's hook was not reached (rank 1 finished the step)"
        r["launch_s"] = round(time.monotonic() - t_launch, 1)
        if not r["pass"]:
            r["rank0_tail"] = "\n".join(lines0[-5:])
            r["rank1_tail"] = out1[-1500:]
        recs.append(r)
    return recs


def table(rows: list) -> str:
    out = [
        "| store | fault | n | no push (setup failed) | rank 0 raised | rank 0 ok | hung | max s raised (bound %.1f) | "
        "named rank 1 | torn read (max s after the fault) | complete over wrong bytes | passed |" % BOUND_S,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["store"], r["fault"].split("@")[0]) for r in rows})
    for store, fault in keys:
        rs = [r for r in rows if r["store"] == store and r["fault"].split("@")[0] == fault]
        nopush = [r for r in rs if r["pass"] is None]
        raised = [r for r in rs if r["outcome"] not in ("ok", "hung") and r["pass"] is not None]
        secs = [r["seconds"] for r in rs if r.get("seconds") is not None and r["outcome"] != "ok"]
        torn = [r["torn_after_s"] for r in rs if r.get("torn_after_s") is not None]
        out.append(
            f"| {store} | {fault} | {len(rs)} | {len(nopush)} | {len(raised)} | "
            f"{sum(r['outcome'] == 'ok' for r in rs)} | "
            f"{sum(r['outcome'] == 'hung' for r in rs)} | {max(secs) if secs else '-'} | "
            f"{sum(bool(r.get('names_rank1')) for r in raised)}/{len(raised)} | "
            f"{len(torn)} ({max(torn) if torn else '-'}) | {sum(r['complete_wrong'] for r in rs)} | "
            f"{sum(r['pass'] is True for r in rs)}/{sum(r['pass'] is not None for r in rs)} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=34, help="launches (a raise launch: RAISES iterations)")
    ap.add_argument("--store", choices=["rank0", "outside", "both"], default="both")
    ap.add_argument("--faults", default="kill,stop,raise,sigint", help="comma-separated: kill,stop,raise,sigint")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--json", help="write every iteration's record here")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    faults = a.faults.split(",")
    stores = ["rank0", "outside"] if a.store == "both" else [a.store]
    rows = []
    for i in range(a.iterations):
        for r in iteration(i, stores[i % len(stores)], faults[(i // len(stores)) % len(faults)], rng):
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("rank1_tail",)}), flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        _, _, rk, st, fa, hk, nt, fr, od = sys.argv
        trainer(int(rk), st, fa, hk, nt, float(fr), od)
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "host":
        import torch.distributed as dist

        _st = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=True, wait_for_workers=False, use_libuv=True)
        time.sleep(LIMIT_S + 120)
    else:
        sys.exit(main())
