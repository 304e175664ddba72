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
* ``copy``: the same push with every task taking the colocated rows' copy path (the 1.7B-class
  H100 row: 309 small zero-copy tasks copied straight into the receivers' memory in batched
  launches, each launch one external engine task; ``InPlaceWriter.queue_copy`` /
  ``flush_copies``).  Without CUDA the in-place writer is pointed at the Receiver's own CPU
  regions (in this process): its ``off()`` answers None and ``Transport.map`` is the region's
  address -- the product's loop, bindings, batches and engine tasks, with the batched copy
  done by ``torch._foreach_copy_`` on the host (the GPU's is one kernel launch), on TINY
  widths cut to 1/16 of the bytes (the same 311 tasks).  Printed:
  the submit phase per task, and the same with the copier's own time taken out (``loop``:
  what the H100 spends per task on the host besides its 12 launches).

    python3 benchmarks/bench_push_host.py [--provider shm] [--tasks 2000] [--layers 28] [--steps 7]
    python3 benchmarks/bench_push_host.py --only copy --compare /path/to/other/checkout  # before/after
    python3 benchmarks/bench_push_host.py --only copy --fsdp2  # DTensor sources (the H100 FSDP2 rows')

``--compare DIR`` runs the ``copy`` and ``push`` measurements with ``wxfer`` imported from DIR
(a checkout with its extension built) and from this checkout, alternated ``--rounds`` times,
in fresh processes, and prints both (``--fsdp2`` passed on to both: a base checkout without it
fails with argparse's message).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("WXFER_BENCH_ROOT") or HERE)  # --compare: the other checkout's wxfer


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


def bench_push(provider: str, layers: int, steps: int, copy: bool = False, fsdp2: bool = False) -> dict:
    import torch
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.models import TINY, inference_params, preset_for, train_model
    from wxfer.runtime import control
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import ONE_WORKER, in_thread

    cfg = dict(TINY, num_hidden_layers=layers)
    if copy:  # the same 311 tasks, 1/16 of the bytes: the host copier stands for one launch
        cfg.update(hidden_size=64, head_dim=32, intermediate_size=128, vocab_size=128)
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
    if fsdp2:  # the H100 rows' trainer: fully_shard per layer on a 1-rank mesh (DTensor sources)
        _fsdp2(model, store)
    for p in model.parameters():
        p.requires_grad_(False)
    sender = Sender(model, mapping=preset_for(cfg), store=addr, name="bench", timeout=60, watermark="64MiB")
    th.join(60)
    if "error" in box:
        raise box["error"]
    recv = box["value"]
    ops = [op for g in sender.program.groups for op in g if op.sends]
    zc = sum(1 for op in ops if op.prep is not None and op.prep.zero_copy)
    copier = _copy_path(sender, recv) if copy else None
    sender.push()  # warm-up
    sub, tot, loop, queue, launch = [], [], [], [], []
    for _ in range(steps):
        if copier is not None:
            copier.update(s=0.0, q=0.0, nq=0, f=0.0, nf=0)
        s = sender.push()
        sub.append(sender.last_submit_s)
        tot.append(s)
        if copier is not None:
            loop.append(sender.last_phases["submit"] - sender.last_phases["begin_stamps"] - copier["s"])
            queue.append(copier["q"] / max(1, copier["nq"]))
            launch.append((copier["f"] - copier["s"]) / max(1, copier["nf"]))
    ht = sender.host_times()
    res = dict(
        tasks=len(ops),
        zero_copy_tasks=zc,
        bytes_per_step=sender.bytes_per_step,
        last_submit_ms=statistics.median(sub) * 1e3,
        last_submit_us_per_task=statistics.median(sub) / max(1, len(ops)) * 1e6,
        # the least of the steps: the host work itself, where other processes share the cores
        last_submit_min_us_per_task=min(sub) / max(1, len(ops)) * 1e6,
        push_ms=statistics.median(tot) * 1e3,
        trace_host_per_task_us=ht["per_task_us"],
        version=recv.version(),
        bytes_ok=_landed(model, params, cfg),
        layers=layers,
        provider=provider,
        fsdp2=fsdp2,
    )
    if copier is not None:
        res.update(
            direct=sender.stats()["direct"],
            loop_ms=statistics.median(loop) * 1e3,
            loop_us_per_task=statistics.median(loop) / max(1, len(ops)) * 1e6,
            loop_min_us_per_task=min(loop) / max(1, len(ops)) * 1e6,
            # the parts, each timed around the call (~0.1 us per wrapper): queue_copy per task, or
            # queue_run per task it queued (without the launches they make), a launch's host
            # work but the copier's own
            queue_copy_us=statistics.median(queue) * 1e6,
            queue_copy_min_us=min(queue) * 1e6,
            launch_us=statistics.median(launch) * 1e6,
            launch_min_us=min(launch) * 1e6,
        )
    sender.close()
    recv.close()
    if fsdp2:
        dist.destroy_process_group()
    return res


def _fsdp2(model, store) -> None:
    """`model` sharded as bb_fsdp.py's trainer is (``fully_shard`` per decoder layer, then the
    root) on a 1-rank gloo mesh: its parameters are DTensors, as the H100 FSDP2 rows' are."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models.train import shard_fsdp2

    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp2", store), rank=0, world_size=1)
    shard_fsdp2(model, init_device_mesh("cpu", (1,)))


def _copy_path(sender, recv) -> dict:
    """Point `sender`'s in-place writer at `recv`'s CPU regions (same process) so that every
    zero-copy task takes the copy path; the batched copies' own seconds are summed in the
    returned dict's "s" (the host copier stands for the GPU's one launch)."""
    from wxfer.runtime import copies

    ip, rb = sender.inplace, recv.region_base
    ip.off = lambda: None
    ip._view = lambda r: (rb[bytes(r)], rb[bytes(r)].data_ptr())
    ip._map = lambda r, off, n: (rb[bytes(r)].data_ptr() + off, -1)
    timed = {"s": 0.0, "q": 0.0, "nq": 0, "f": 0.0, "nf": 0}
    real = copies.copy_ranges
    queue_copy, flush_copies = ip.queue_copy, ip.flush_copies

    def queue(op):
        t, f = time.perf_counter(), timed["f"]
        try:
            return queue_copy(op)
        finally:
            timed["q"] += time.perf_counter() - t - (timed["f"] - f)
            timed["nq"] += 1

    def flush():
        t, n = time.perf_counter(), len(ip.copy_q)
        try:
            return flush_copies()
        finally:
            timed["f"] += time.perf_counter() - t
            timed["nf"] += 1 if n else 0

    ip.queue_copy, ip.flush_copies = queue, flush
    queue_run = getattr(ip, "queue_run", None)  # (a checkout with it: a run of tasks in one call)
    if queue_run is not None:

        def run(ops, i):
            t, f, j = time.perf_counter(), timed["f"], i
            try:
                j = queue_run(ops, i)
                return j
            finally:
                timed["q"] += time.perf_counter() - t - (timed["f"] - f)
                timed["nq"] += j - i

        ip.queue_run = run

    def copy_ranges(device, items, *args, **kw):
        t = time.perf_counter()
        try:
            return real(device, items, *args, **kw)
        finally:
            timed["s"] += time.perf_counter() - t

    copies.copy_ranges = copy_ranges
    return timed


def _landed(model, params, cfg) -> bool:
    """Every inference parameter holds the trainer's bytes (read back to the HF layout)."""
    import torch
    from wxfer.models.infer import reconstruct_hf

    sd, got = model.state_dict(), reconstruct_hf(cfg, [params])
    sd = {n: getattr(t, "_local_tensor", t) for n, t in sd.items()}  # FSDP2 on one rank: the whole tensor
    return bool(got) and all(torch.equal(t, sd[n]) for n, t in got.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--only", choices=["engine", "push", "copy"], default=None)
    ap.add_argument("--fsdp2", action="store_true", help="push/copy: an FSDP2 trainer (DTensor sources)")
    from common.ab import add_compare, machine, wxfer_from

    add_compare(ap)
    a = ap.parse_args()

    out = machine()
    if a.compare:
        out.update(compare(a))
        print(json.dumps(out, indent=1))
        return
    out["wxfer_from"] = wxfer_from()
    if a.only in (None, "engine"):
        out["engine"] = bench_engine(a.provider, a.tasks, a.reps)
    if a.only in (None, "push"):
        out["push"] = bench_push(a.provider, a.layers, a.steps, fsdp2=a.fsdp2)
    if a.only in (None, "copy"):
        out["copy"] = bench_push(a.provider, a.layers, a.steps, copy=True, fsdp2=a.fsdp2)
    print(json.dumps(out, indent=1))


def compare(a) -> dict:
    """This script's push and copy measurements with wxfer from `a.compare` ("base") and from
    this checkout ("this"), alternated in fresh processes; the medians per task."""
    from common.ab import alternated

    only = [a.only] if a.only in ("push", "copy") else ["push", "copy"]
    shared = ["--provider", a.provider, "--layers", str(a.layers), "--steps", str(a.steps)]
    shared += ["--fsdp2"] if a.fsdp2 else []
    got = alternated(__file__, a.compare, HERE, a.rounds, {what: ["--only", what, *shared] for what in only})
    runs = {
        who: [dict(r[what], what=what, load_average=r["load_average"]) for what, r in rs] for who, rs in got.items()
    }
    keys = (
        "last_submit_us_per_task",
        "last_submit_min_us_per_task",
        "loop_us_per_task",
        "loop_min_us_per_task",
        "queue_copy_us",
        "queue_copy_min_us",
        "launch_us",
        "launch_min_us",
        "bytes_ok",
    )
    table = {}
    for who, rs in runs.items():
        for what in only:
            mine = [r for r in rs if r["what"] == what]
            table[f"{who}:{what}"] = {k: [r.get(k) for r in mine] for k in keys if k in mine[0]}
    return dict(base=os.path.abspath(a.compare), this=HERE, rounds=a.rounds, per_task_us=table, runs=runs)


if __name__ == "__main__":
    main()
