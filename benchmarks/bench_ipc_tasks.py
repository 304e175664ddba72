#!/usr/bin/env python3
"""A push's writes alone over cuda_ipc on one GPU: the task sizes of a model's plan, written
the way the Sender writes zero-copy tasks (``Engine.prepare`` once, ``submit_prepared`` in
batches of 32 after one CUDA event), for several variants of the backend's options, each in
a fresh writer process; against the on-device copies of the same sizes in one process (one
``copy_`` per task on one stream) and one copy of all the bytes, measured in the same run.

    python3 benchmarks/bench_ipc_tasks.py --model qwen3-8b [--variants "default;streams=1;pick=least"] [--json]

It tells the data path's own cost (posting, stream choice, completion polling) apart from
stage 2: no gather, no packing, no Python per task beyond what the Sender does for zero-copy
tasks. The sizes are those of ``wxfer.plan.plan_for(model, 1 trainer -> 1 x TP1)``'s tasks, in
plan order. Needs torch with CUDA.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cuda_ipc import machine, receiver, run_job  # noqa: E402
from wxfer.zerocopy import ZERO_COPY_BATCH  # noqa: E402

BATCH = ZERO_COPY_BATCH  # tasks per submit_prepared call, as the Sender's


def task_sizes(model: str, quant: str | None) -> list:
    from wxfer.meta import Cluster
    from wxfer.plan import plan_for

    plan = plan_for(model, Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, quant=quant))
    return [sum(int(s.nbytes) for s in t.shards) for t in plan.tasks]


def _offsets(sizes):
    out, o = [], 0
    for n in sizes:
        out.append(o)
        o += (n + 255) // 256 * 256
    return out, o


def _raw(job):
    import torch

    sizes, reps = job["sizes"], job["reps"]
    offs, total = _offsets(sizes)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=0)
    dst = torch.empty_like(src)
    views = [(dst[o : o + n], src[o : o + n]) for o, n in zip(offs, sizes)]

    def per_task():
        for d, s in views:
            d.copy_(s)

    def whole():
        dst.copy_(src)

    res = {}
    for name, fn in (("per_task_copy", per_task), ("one_copy", whole)):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts)
    return res


def _ours(job):
    import torch
    from wxfer import _wxfer

    sizes, reps = job["sizes"], job["reps"]
    offs, total = _offsets(sizes)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=0)
    opts = dict(job["opts"])
    opts.setdefault("device", "0")
    t = _wxfer.Transport("cuda_ipc", opts)
    peer, req = t.connect_request(job["blob"])
    t.connect_finish(peer, req)
    region = t.register(src, export=False)
    eng = _wxfer.Engine(t, timeout=120, isolate=True)
    tasks = [eng.prepare(region, [(job["desc"], o, o, n)], tag=i) for i, (o, n) in enumerate(zip(offs, sizes))]
    stream = torch.cuda.Stream()

    def push():
        ev = torch.cuda.Event()
        ev.record(stream)
        for i in range(0, len(tasks), BATCH):
            eng.submit_prepared(tasks[i : i + BATCH], event=ev.cuda_event, device=0)
        eng.wait(timeout=120)
        eng.reap()

    push()
    ts, submit = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev = torch.cuda.Event()
        ev.record(stream)
        for i in range(0, len(tasks), BATCH):
            eng.submit_prepared(tasks[i : i + BATCH], event=ev.cuda_event, device=0)
        t1 = time.perf_counter()
        eng.wait(timeout=120)
        eng.reap()
        ts.append(time.perf_counter() - t0)
        submit.append(t1 - t0)
    info = t.info()
    eng.close()
    t.close()
    job["conn"].send("check")
    got = job["conn"].recv()
    want = int(src[: 1 << 20].to(torch.int64).sum().item())
    return {
        "seconds": statistics.median(ts),
        "submit_s": statistics.median(submit),
        "info": info,
        "check": "ok" if got == want else "MISMATCH (%d != %d)" % (got, want),
    }


def _job(job):
    """One job of this benchmark in a fresh process (bench_cuda_ipc.run_job)."""
    return _raw(job) if job["kind"] == "raw" else _ours(job)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "fp8"), help="the plan's inference side")
    ap.add_argument("--variants", default="default;max_inflight=64,poll_us=0,pick=rr;streams=1;streams=2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch

    if not torch.cuda.is_available():
        print("bench_ipc_tasks: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 2
    sizes = task_sizes(a.model, None if a.quant == "bf16" else "fp8")
    _, total = _offsets(sizes)
    m = machine()
    print("machine: %s | driver %s | torch %s" % (", ".join(m["gpus"]), m.get("driver"), m["torch"]))
    print("%s %s: %d tasks, %.2f GB (largest %.1f MB)" % (a.model, a.quant, len(sizes), total / 1e9, max(sizes) / 1e6))
    ctx = mp.get_context("spawn")
    rc, rchild = ctx.Pipe()
    rq = ctx.Queue()  # unused by this benchmark; kept referenced while the receiver starts
    rx = ctx.Process(target=receiver, args=(rchild, 0, total, rq))
    rx.start()
    if not rc.poll(120):
        print("receiver process failed to start")
        rx.kill()
        return 1
    blob, desc = rc.recv()
    base = {"sizes": sizes, "reps": a.reps}
    raw = run_job(ctx, dict(base, kind="raw"), body=_job)
    if "error" in raw:
        print("bound job failed: %s\n%s" % (raw["error"], raw.get("trace", "")))
        return 1
    print(
        "bounds (one process): per-task copies %.2f ms, one copy %.2f ms (%.0f GB/s)"
        % (raw["per_task_copy"] * 1e3, raw["one_copy"] * 1e3, total / raw["one_copy"] / 1e9)
    )
    print(
        "  %-36s %9s %9s %8s %12s %12s  %s" % ("variant", "ms", "GB/s", "submit", "/ task copy", "/ one copy", "check")
    )
    rows = []
    for v in a.variants.split(";"):
        opts = {} if v in ("", "default") else dict(kv.split("=", 1) for kv in v.split(","))
        r = run_job(ctx, dict(base, kind="ours", opts=opts, blob=blob, desc=desc, conn=rc), body=_job)
        r["variant"] = v
        rows.append(r)
        if "error" in r:
            print("  %-36s ERROR %s" % (v, r["error"]))
            continue
        print(
            "  %-36s %9.2f %9.0f %8.2f %12.2f %12.2f  %s"
            % (
                v,
                r["seconds"] * 1e3,
                total / r["seconds"] / 1e9,
                r["submit_s"] * 1e3,
                raw["per_task_copy"] / r["seconds"],
                raw["one_copy"] / r["seconds"],
                r["check"],
            )
        )
    rc.send("exit")
    rx.join(60)
    if a.json:
        print("JSON " + json.dumps({"machine": m, "model": a.model, "quant": a.quant, "bounds": raw, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
