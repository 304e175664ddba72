"""Host cost of the push loop per task, on CPU (no GPU needed).

Two measurements, printed as one JSON object with the machine name:

* ``engine``: N small tasks written over libfabric (provider shm by default, in this
  process, to a target process) through ``Engine.submit(tensor, dests)`` per task (DLPack
  import and dest parsing every call), and through ``Engine.prepare`` once +
  ``Engine.submit_prepared`` (a registered Region source, dests validated once), and
  the time per task of the submission loop alone (then waited for).
* ``push``: a whole ``Sender.push()`` of a plain-tensor trainer (a Qwen3-shaped tiny model
  with many layers) to a ``Receiver`` in a thread, over fabric; ``last_submit_s`` (the host
  loop handing tasks to the engine) per task, median of the timed steps.

    python3 benchmarks/bench_push_host.py [--provider shm] [--tasks 2000] [--layers 28] [--steps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_engine(provider: str, ntasks: int, reps: int) -> dict:
    import torch
    from wxfer import _wxfer
    from wxfer.testing import connected_fabric

    size = 4096
    out = {}
    with connected_fabric(provider, [size * ntasks]) as (t, tgt):
        desc = tgt.descriptors[0]
        srcs = [torch.full((size,), i % 251, dtype=torch.uint8) for i in range(ntasks)]
        dests = [[(desc, i * size, 0, size)] for i in range(ntasks)]
        e = _wxfer.Engine(t, watermark=1 << 30, isolate=True)
        has_prepared = hasattr(e, "prepare")
        per = {"submit": [], "submit_prepared": []}
        prepared = None
        if has_prepared:
            t0 = time.perf_counter()
            regions = [t.register(s, export=False) for s in srcs]
            prepared = [e.prepare(r, d, tag=i) for i, (r, d) in enumerate(zip(regions, dests))]
            out["prepare_once_us_per_task"] = (time.perf_counter() - t0) / ntasks * 1e6
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(ntasks):
                e.submit(srcs[i], dests[i], tag=i, held=0)
            per["submit"].append((time.perf_counter() - t0) / ntasks * 1e6)
            e.wait(timeout=60)
            if has_prepared:
                t0 = time.perf_counter()
                e.submit_prepared(prepared)
                per["submit_prepared"].append((time.perf_counter() - t0) / ntasks * 1e6)
                e.wait(timeout=60)
        out["bytes_ok"] = tgt.read(0) == torch.cat(srcs).numpy().tobytes()
        e.close()
        del prepared
        out.update({k + "_us_per_task": statistics.median(v) for k, v in per.items() if v})
        out.update(tasks=ntasks, task_bytes=size, provider=provider)
    return out


def bench_push(provider: str, layers: int, steps: int) -> dict:
    import torch
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.models import TINY, inference_params, preset_for, train_model
    from wxfer.runtime import control
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import ONE_WORKER, in_thread

    cfg = dict(TINY, num_hidden_layers=layers)
    port = control.free_port()
    store = dist.TCPStore(  # noqa: F841 -- the store server lives as long as this reference
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    addr = "127.0.0.1:%d" % port
    params = inference_params(cfg, 1, 0, None)
    th, box = in_thread(
        Receiver,
        params,
        mapping=preset_for(cfg).name,
        store=addr,
        **ONE_WORKER,
        name="bench",
        timeout=60,
        transport="fabric",
        transport_options={"provider": provider},
    )
    model = train_model(cfg).to(torch.bfloat16)  # the inference dtype: every task zero-copy
    for p in model.parameters():
        p.requires_grad_(False)
    sender = Sender(model, mapping=preset_for(cfg), store=addr, name="bench", timeout=60, watermark="64MiB")
    th.join(60)
    if "error" in box:
        raise box["error"]
    recv = box["value"]
    ops = [op for g in sender.program.groups for op in g if op.sends]
    zc = sum(1 for op in ops if op.prep is not None and op.prep.zero_copy)
    sender.push()  # warm-up
    sub, tot = [], []
    for _ in range(steps):
        s = sender.push()
        sub.append(sender.last_submit_s)
        tot.append(s)
    ht = sender.host_times()
    res = dict(
        tasks=len(ops),
        zero_copy_tasks=zc,
        bytes_per_step=sender.bytes_per_step,
        last_submit_ms=statistics.median(sub) * 1e3,
        last_submit_us_per_task=statistics.median(sub) / max(1, len(ops)) * 1e6,
        push_ms=statistics.median(tot) * 1e3,
        trace_host_per_task_us=ht["per_task_us"],
        version=recv.version(),
        layers=layers,
        provider=provider,
    )
    sender.close()
    recv.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--only", choices=["engine", "push"], default=None)
    a = ap.parse_args()
    out = dict(machine=platform.node(), cpu=platform.processor() or platform.machine())
    if a.only in (None, "engine"):
        out["engine"] = bench_engine(a.provider, a.tasks, a.reps)
    if a.only in (None, "push"):
        out["push"] = bench_push(a.provider, a.layers, a.steps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
