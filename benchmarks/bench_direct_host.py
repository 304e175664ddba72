"""The host's part of a colocated FP8 push written in place, on CPU (no GPU needed; issue 37).

The Qwen3-8B FP8 FSDP2 row on one H100 (benchmarks/runs/h100-2026-12-07-d) is its quantizer
(8.35 ms of kernels) plus what the host adds: the time from the push's start to the first
quantizer launch, and the gaps where the SMs wait for the host.  This stands in for that host
work: a Qwen3-shaped BF16 model with the 8B's 36 layers at tiny widths, into FP8 at TP1 -- the
same 183 tasks (embeddings, lm_head, 145 norms, 36 layers) -- pushed by a Sender to a Receiver
in this process over fabric, the in-place writer pointed at the Receiver's own CPU regions (as
bench_push_host.py --only copy: its ``off()`` answers None, ``Transport.map`` is the region's
address), the quantizer's GPU path taken (``fp8._native_why`` None: the cached piece tables,
the keys) with its launch a no-op (so no bytes land: the figures only), the begin stamps in
stream order (WXFER_BEGIN_WAIT=stream) and the embeddings and lm_head copied beside the
quantizer (WXFER_DIRECT_OVERLAP=engines, copy_max cut under their size; the copies themselves
by torch on the host).  Printed, per push (median and least of --steps):

* ``first_launch_us``: the push's start to its first quantizer launch (the H100 row: about
  0.75 ms, most of its lead);
* ``direct_task_us``: between two quantizer launches (one layer's host work, in place);
* ``order``: the first tasks of the first mesh group as the push runs them.

The CUDA calls (the event records, the launches, the fill of the begin stamps) are not in
these figures; a CPU core of this kind is not the H100 host's.  Compare trees with --compare.

    python3 benchmarks/bench_direct_host.py [--layers 36] [--steps 30] [--max-task-bytes N]
    python3 benchmarks/bench_direct_host.py --compare /path/to/other/checkout [--rounds 3]
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


def _emulate() -> tuple:
    """The in-place writer's CUDA seams pointed at a receiver's CPU regions: ({descriptor: its
    tensor}, {address: tensor}) for the caller to fill once the receiver is up (before the first
    push).  Set before the Sender is made: its runner decides the begin stamps' order then."""
    from wxfer.runtime.inplace import InPlaceWriter

    by_desc: dict = {}
    by_addr: dict = {}
    InPlaceWriter.off = lambda self: None if self.enabled else "off"
    InPlaceWriter._map = lambda self, r, off, nb: (by_desc[bytes(r)].data_ptr() + off, self.device.index)
    InPlaceWriter._tensor = lambda self, addr, n: by_addr[addr]
    return by_desc, by_addr


def bench(layers: int, steps: int, max_task_bytes: int | None) -> dict:
    os.environ.setdefault("WXFER_BEGIN_WAIT", "stream")
    os.environ.setdefault("WXFER_DIRECT_OVERLAP", "engines")
    import torch
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.models import TINY, inference_params, preset_for, train_model
    from wxfer.runtime import control, fp8
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import ONE_WORKER, in_thread

    cfg = dict(TINY, num_hidden_layers=layers, hidden_size=128, num_attention_heads=1, num_key_value_heads=1)
    cfg.update(head_dim=128, intermediate_size=256, vocab_size=256)
    port = control.free_port()
    store = dist.TCPStore(  # noqa: F841 -- the store server lives as long as this reference
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    addr = "127.0.0.1:%d" % port
    params = inference_params(cfg, 1, 0, "fp8")
    th, box = in_thread(
        Receiver, params, mapping=preset_for(cfg).name, store=addr, **ONE_WORKER, name="bench", timeout=60,
        transport="fabric", transport_options={"provider": "tcp"},
    )  # fmt: skip
    model = train_model(cfg).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    kw = {} if max_task_bytes is None else dict(max_task_bytes=max_task_bytes)
    by_desc, by_addr = _emulate()
    # copy_max under the embeddings' 64 KiB: they and lm_head are "large" (copied beside the quantizer)
    s = Sender(model, mapping=preset_for(cfg), store=addr, name="bench", timeout=60, copy_max=40000, **kw)
    th.join(60)
    if "error" in box:
        raise box["error"]
    recv = box["value"]
    by_desc.update(recv.region_base)
    by_desc[bytes(recv.stamp_region.descriptor)] = recv.stamps.view(torch.uint8)
    by_addr.update((t.data_ptr(), t) for t in by_desc.values())
    launches: list = []
    fp8._native_why = lambda device, probe=True: None  # the GPU path's Python ...
    fp8._launch_at = lambda *a: launches.append(time.perf_counter())  # ... its launch a no-op
    for _ in range(3):  # warm-up (the second push on defers the large copies)
        s.push()
    first, per = [], []
    for _ in range(steps):
        time.sleep(0.005)  # a training step's stand-in: nothing rests on pushes back to back
        launches.clear()
        t0 = time.perf_counter()
        s.push()
        first.append(launches[0] - t0)
        per.append(statistics.median(b - a for a, b in zip(launches, launches[1:])))
    ops = [op for g in s.program.groups for op in g if op.sends]
    st = getattr(s, "steps", None)
    order = st.task_order()[0][:3] if hasattr(st, "task_order") else [op.task for op in s.program.groups[0][:3]]
    d = s.stats()["direct"]
    res = dict(
        tasks=len(ops),
        direct_tasks=d.get("tasks"),
        copies=d.get("copies"),
        overlap=d.get("overlap"),
        launches_per_push=len(launches),
        first_launch_us=round(statistics.median(first) * 1e6, 1),
        first_launch_min_us=round(min(first) * 1e6, 1),
        direct_task_us=round(statistics.median(per) * 1e6, 1),
        direct_task_min_us=round(min(per) * 1e6, 1),
        order=order,
        begin=d.get("begin"),
        layers=layers,
    )
    s.close()
    recv.close()
    return res


def compare(a) -> dict:
    """bench() with wxfer from `a.compare` ("base") and from this checkout ("this"), alternated
    in fresh processes."""
    from common.ab import alternated

    args = ["--layers", str(a.layers), "--steps", str(a.steps)]
    if a.max_task_bytes:
        args += ["--max-task-bytes", str(a.max_task_bytes)]
    got = alternated(__file__, a.compare, HERE, a.rounds, {"": args})
    runs = {who: [r["direct"] for _, r in rs] for who, rs in got.items()}
    keys = ("first_launch_us", "first_launch_min_us", "direct_task_us", "direct_task_min_us", "order")
    table = {who: {k: [r[k] for r in rs] for k in keys} for who, rs in runs.items()}
    return dict(base=os.path.abspath(a.compare), this=HERE, rounds=a.rounds, table=table, runs=runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-task-bytes", type=int, default=None, help="Sender(max_task_bytes=): split the layers")
    from common.ab import add_compare, machine, wxfer_from

    add_compare(ap)
    a = ap.parse_args()

    out = machine()
    if a.compare:
        out.update(compare(a))
    else:
        out["wxfer_from"] = wxfer_from()
        out["direct"] = bench(a.layers, a.steps, a.max_task_bytes)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
