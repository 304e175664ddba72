"""The control plane's growth (issue 24): setup time, store operations and bytes per rank,
plan bytes per rank and the fixed cost of a push, against the number of trainer ranks and
receivers, on the CPU (tiny tensors, gloo, fabric tcp), with a fitted growth law and what it
predicts at 256 trainers -> 128 receivers.

    python benchmarks/bench_control.py --json                       # 1+1 .. 16+16 ranks, ~2 min on 2 cores
    python benchmarks/bench_control.py --sizes 1x1,2x2,4x4 --json   # T x R

Per configuration T x R, in fresh processes: T trainer processes (one gloo group, each a
plain replica of a tiny Qwen3: any rank can send any task, the plan spreads them) and R
receivers (replicas of TP2, threads of ceil(R/8) processes), one TCPStore hosted by this
process.  Every process counts the store operations its wxfer.runtime.control.Control
makes (each set / get / add / check is one round trip to the store's host, polls included)
and their bytes (values written and read), during setup (Sender / Receiver construction)
and during the pushes; the trainers time their setup and --steps pushes (the fixed cost of
a push: the tensors are tiny).  The growth law of each figure is fitted as a + b x N^k over
N = T + R on the T = R runs (k: the log-log slope between the two largest), extrapolated to
256 + 128; and as a + b T + c R + d T R over every run (d: the part that grows with the product,
faster than linear in the ranks).  k > 1.15 is flagged as faster than linear.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

TIMEOUT = 120.0
PER_PROC = 8  # receivers per receiver process (threads)


class _Counting:
    """A store that counts the round trips and bytes of the calls made through it."""

    def __init__(self, store, box: dict):
        self._s, self._box = store, box

    def _n(self, op: str, nbytes: int = 0) -> None:
        b = self._box
        b["ops"] = b.get("ops", 0) + 1
        b["bytes"] = b.get("bytes", 0) + nbytes
        b[op] = b.get(op, 0) + 1

    def set(self, k, v):
        self._n("set", len(k) + len(v))
        return self._s.set(k, v)

    def get(self, k):
        v = self._s.get(k)
        self._n("get", len(k) + len(v))
        return v

    def add(self, k, n):
        self._n("add", len(k) + 8)
        return self._s.add(k, n)

    def check(self, keys):
        self._n("check", sum(len(k) for k in keys))
        return self._s.check(keys)

    def __getattr__(self, name):
        return getattr(self._s, name)


def _install(box: dict) -> None:
    """Count every Control's store calls in this process (into `box`)."""
    from wxfer.runtime import control

    init = control.Control.__init__

    def counted(self, store, *a, **kw):
        init(self, _Counting(store, box), *a, **kw)

    control.Control.__init__ = counted


def _snap(box: dict) -> dict:
    """The counts so far: ops (set, get, add: the reads and writes the protocol makes), polls
    (check: waiting for a key, as many as the wait is long), bytes."""
    out = {k: box.get(k, 0) for k in ("bytes", "set", "get", "add", "check")}
    out.update(ops=out["set"] + out["get"] + out["add"], polls=out["check"])
    return out


def _trainer(rank: int, T: int, addr: str, name: str, steps: int, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    box: dict = {}
    try:
        _install(box)
        from wxfer.models import TINY, preset_for, train_model
        from wxfer.runtime.sender import Sender

        host, port = addr.rsplit(":", 1)
        st = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg/" + name, st),
            rank=rank,
            world_size=T,
            timeout=datetime.timedelta(seconds=TIMEOUT),
        )
        model = train_model(TINY, dtype=torch.bfloat16)
        for p in model.parameters():
            p.requires_grad_(False)
        t0 = time.perf_counter()
        s = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=TIMEOUT, device="cpu")
        setup = time.perf_counter() - t0
        at_setup = _snap(box)
        plan_bytes = len(s.plan.to_bytes())
        s.push()  # warm-up
        before = _snap(box)
        ts = []
        for _ in range(steps):
            dist.barrier()
            t1 = time.perf_counter()
            s.push()
            ts.append(time.perf_counter() - t1)
        after = _snap(box)
        ts.sort()
        q.put(
            dict(
                role="trainer",
                rank=rank,
                setup_s=setup,
                setup_parts=dict(s.setup_s),
                setup_store=at_setup,
                push_store={k: (after[k] - before[k]) / steps for k in after},
                plan_bytes=plan_bytes,
                push_s=ts[len(ts) // 2],
                tasks=len(s.plan.tasks),
                transfers=int(s.plan.n_transfers),
            )
        )
        dist.barrier()
        s.close()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        q.put(dict(role="trainer", rank=rank, error="%s: %s" % (type(e).__name__, e)))


def _receivers(first: int, n: int, R: int, tp: int, addr: str, name: str, q) -> None:
    import torch

    torch.set_num_threads(1)
    box: dict = {}
    try:
        _install(box)
        from wxfer.models import TINY, inference_params, preset_for
        from wxfer.runtime.receiver import Receiver
        from wxfer.testing import in_thread

        preset = preset_for(TINY).name
        runs = []
        t0 = time.perf_counter()
        for g in range(first, first + n):
            params = inference_params(TINY, tp, g % tp, None)
            runs.append(
                in_thread(
                    Receiver,
                    params,
                    mapping=preset,
                    store=addr,
                    replica=g // tp,
                    rank=g % tp,
                    tp=tp,
                    replicas=R // tp,
                    name=name,
                    timeout=TIMEOUT,
                )
            )
        recvs = []
        for th, b in runs:
            th.join(TIMEOUT)
            if "error" in b:
                raise b["error"]
            recvs.append(b["value"])
        setup = time.perf_counter() - t0
        at_setup = _snap(box)
        q.put(dict(role="receivers", first=first, n=n, setup_s=setup, setup_store=at_setup))
        from wxfer.runtime.control import Control

        Control(_plain_store(addr), name + "/bench", TIMEOUT).get("done", "the benchmark's end", TIMEOUT)
        for r in recvs:
            r.close()
    except Exception as e:  # noqa: BLE001
        q.put(dict(role="receivers", first=first, n=n, error="%s: %s" % (type(e).__name__, e)))


def _plain_store(addr: str):
    import datetime

    import torch.distributed as dist

    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))


def run_one(T: int, R: int, steps: int) -> dict:
    import datetime
    import multiprocessing as mp

    import torch.distributed as dist

    from wxfer.runtime import control
    from wxfer.testing import stop_process  # noqa: F401 -- (processes are joined below)

    tp = 2 if R % 2 == 0 else 1
    port = control.free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT), wait_for_workers=False
    )
    addr = "127.0.0.1:%d" % port
    name = "ctl%d_%dx%d" % (os.getpid(), T, R)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_receivers, args=(f, min(PER_PROC, R - f), R, tp, addr, name, q))
        for f in range(0, R, PER_PROC)
    ]
    procs += [ctx.Process(target=_trainer, args=(r, T, addr, name, steps, q)) for r in range(T)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    got, errors = [], []
    want = T + len(range(0, R, PER_PROC))
    deadline = time.monotonic() + TIMEOUT * 2
    while len(got) + len(errors) < want and time.monotonic() < deadline:
        try:
            m = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001 -- queue.Empty: check for dead processes
            if not any(p.is_alive() for p in procs):
                break
            continue
        (errors if "error" in m else got).append(m)
    control.Control(store, name + "/bench", TIMEOUT).set("done", b"1")
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
    wall = time.perf_counter() - t0
    tr = [m for m in got if m["role"] == "trainer"]
    rc = [m for m in got if m["role"] == "receivers"]
    out = dict(trainers=T, receivers=R, tp=tp, wall_s=wall, errors=[m["error"] for m in errors])
    if len(tr) == T and rc:
        r0 = next(m for m in tr if m["rank"] == 0)
        others = [m for m in tr if m["rank"] != 0] or [r0]
        nrecv = sum(m["n"] for m in rc)
        out.update(
            setup_s=max(m["setup_s"] for m in tr),
            plan_s=max(m["setup_parts"].get("plan", 0.0) for m in tr),
            plan_bytes=r0["plan_bytes"],
            tasks=r0["tasks"],
            transfers=r0["transfers"],
            push_s=max(m["push_s"] for m in tr),
            rank0_setup_ops=r0["setup_store"]["ops"],
            rank0_setup_bytes=r0["setup_store"]["bytes"],
            rank0_setup_polls=r0["setup_store"]["polls"],
            trainer_setup_ops=max(m["setup_store"]["ops"] for m in others),
            trainer_setup_polls=max(m["setup_store"]["polls"] for m in others),
            trainer_setup_bytes=max(m["setup_store"]["bytes"] for m in others),
            receiver_setup_ops=sum(m["setup_store"]["ops"] for m in rc) / max(nrecv, 1),
            receiver_setup_bytes=sum(m["setup_store"]["bytes"] for m in rc) / max(nrecv, 1),
            receiver_setup_polls=sum(m["setup_store"]["polls"] for m in rc) / max(nrecv, 1),
            store_setup_bytes=sum(m["setup_store"]["bytes"] for m in tr + rc),
            store_setup_ops=sum(m["setup_store"]["ops"] for m in tr + rc),
            push_ops_per_rank=max(m["push_store"]["ops"] for m in tr),
        )
    del store
    return out


FIGURES = (
    "setup_s",
    "plan_bytes",
    "rank0_setup_ops",
    "rank0_setup_bytes",
    "trainer_setup_ops",
    "trainer_setup_bytes",
    "receiver_setup_ops",
    "receiver_setup_bytes",
    "store_setup_ops",
    "store_setup_bytes",
    "receiver_setup_polls",
    "push_s",
    "push_ops_per_rank",
)


def growth(rows: list, key: str, at: tuple = (256, 128)) -> dict:
    """The figure's growth in N = T + R: the local exponent k, the log-log slope between the
    two largest runs (a fixed part weighs little there), and the law y = y_max x (N /
    N_max)^k extrapolated from the largest run to `at`; k over all runs beside it.  A figure
    that does not grow (k < 0.1) is "constant"."""
    import numpy as np

    pts = sorted((r["trainers"] + r["receivers"], float(r[key])) for r in rows if key in r)
    if len(pts) < 3 or any(y <= 0 for _, y in pts):
        return dict(law=None)
    (n1, y1), (n2, y2) = pts[-2], pts[-1]
    k = math.log(y2 / y1) / math.log(n2 / n1)
    k_all = float(np.polyfit(np.log([n for n, _ in pts]), np.log([y for _, y in pts]), 1)[0])
    N = at[0] + at[1]
    if abs(k) < 0.1:
        return dict(law="constant", k=float(k), k_all=k_all, predicted=float(y2), faster_than_linear=False)
    return dict(
        law="%.4g x (N / %d)^%.2f" % (y2, n2, k),
        k=float(k),
        k_all=k_all,
        predicted=float(y2 * (N / n2) ** k),
        faster_than_linear=bool(k > 1.15),
    )


def bilinear(rows: list, key: str, at: tuple = (256, 128)) -> dict:
    """y = a + b T + c R + d T R by least squares over every run (the diagonal and the
    off-diagonal ones separate T from R); d's share of the prediction at `at` says whether
    the product (faster than linear in the ranks) matters there."""
    import numpy as np

    pts = [(r["trainers"], r["receivers"], float(r[key])) for r in rows if key in r]
    if len(pts) < 5:
        return {}
    A = np.array([[1.0, t, r, t * r] for t, r, _ in pts])
    y = np.array([v for _, _, v in pts])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    T, R = at
    terms = coef * np.array([1.0, T, R, T * R])
    pred = float(terms.sum())
    return dict(
        coef=dict(a=float(coef[0]), per_trainer=float(coef[1]), per_receiver=float(coef[2]), per_pair=float(coef[3])),
        predicted=pred,
        pair_share=float(terms[3] / pred) if pred else 0.0,
    )


def table(rows: list, laws: dict) -> str:
    cols = [
        "trainers",
        "receivers",
        "setup_s",
        "plan_bytes",
        "rank0_setup_ops",
        "trainer_setup_ops",
        "trainer_setup_bytes",
        "receiver_setup_ops",
        "receiver_setup_bytes",
        "receiver_setup_polls",
        "store_setup_ops",
        "store_setup_bytes",
        "push_s",
        "push_ops_per_rank",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    lines += [
        "",
        "| figure | growth law (N = T + R, T = R runs) | exponent (two largest / all) | at 256 -> 128 | "
        "a + b T + c R + d T R | at 256 -> 128 | T R share there |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in laws.items():
        bl = v.get("bilinear") or {}
        c = bl.get("coef")
        lin = "%.3g + %.3g T + %.3g R + %.3g T R" % tuple(c.values()) if c else "-"
        lines.append(
            "| %s | %s | %s | %s | %s | %s | %s |"
            % (
                k,
                v.get("law") or "-",
                "%.2f / %.2f" % (v["k"], v["k_all"]) if "k" in v else "-",
                _fmt(v.get("predicted")),
                lin,
                _fmt(bl.get("predicted")),
                "%.0f%%" % (100 * bl["pair_share"]) if c else "-",
            )
        )
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "%.4g" % v
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1x1,2x2,4x4,8x8,16x16", help="comma list of TxR (trainers x receivers)")
    ap.add_argument("--steps", type=int, default=5, help="timed pushes per configuration (after one warm-up)")
    ap.add_argument("--out", default=None, help="write results.json and table.md here")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    a = ap.parse_args(argv)
    rows = []
    for s in a.sizes.split(","):
        T, R = (int(x) for x in s.split("x"))
        t0 = time.perf_counter()
        r = run_one(T, R, a.steps)
        rows.append(r)
        print(
            "%dx%d: %s in %.0f s"
            % (T, R, "ok" if "setup_s" in r else "failed: %s" % r["errors"][:2], time.perf_counter() - t0),
            flush=True,
        )
    diag = [r for r in rows if r["trainers"] == r["receivers"]]
    laws = {k: dict(growth(diag, k), bilinear=bilinear(rows, k)) for k in FIGURES}
    txt = table(rows, laws)
    print(txt)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    res = dict(rows=rows, laws=laws, load_average=load, cpus=os.cpu_count())
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "table.md"), "w") as f:
            f.write(txt + "\n")
    if a.json:
        print(json.dumps(res))
    return 0 if all("setup_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
