"""Notebook views of a plan: summary dict, pandas frame, HTML, plots (matplotlib optional)."""

from __future__ import annotations

import html

import numpy as np


def summary(plan) -> dict:
    per_train = plan.bytes_per_train_rank()
    per_gpu = plan.bytes_per_infer_gpu()
    return dict(
        preset=plan.preset,
        tasks=len(plan.tasks),
        transfers=plan.n_transfers,
        mesh_groups=len(plan.groups),
        meshes=len(plan.meshes),
        train_gpus=plan.train_world,
        infer_gpus=plan.infer_gpus,
        replicas=plan.replicas,
        tp=plan.tp,
        ep=plan.ep,
        quant=plan.quant or "bf16",
        params=int(sum(np.prod(s) for s, _ in plan.train_params.values())),
        bytes_per_replica=plan.bytes_per_replica(),
        bytes_total=int(plan.nbytes.sum()),
        max_bytes_per_infer_gpu=int(per_gpu.max()) if per_gpu.size else 0,
        max_bytes_per_train_gpu=int(per_train.max()) if per_train.size else 0,
        min_bytes_per_train_gpu=int(per_train.min()) if per_train.size else 0,
        idle_train_gpus=int((per_train == 0).sum()),
        build_s=round(plan.build_s, 3),
        largest_task_bytes=max((t.src_bytes for t in plan.tasks), default=0),
        sources_per_task=round(sum(len(t.sources) for t in plan.tasks) / max(1, len(plan.tasks)), 2),
    )


def tasks_frame(plan):
    """One row per task: its name (the FSDP2 unit, or the mapping rule), mesh, group,
    number of sources and shards, training bytes, bytes written."""
    import pandas as pd

    sent = (
        np.bincount(plan.task, weights=plan.nbytes, minlength=len(plan.tasks))
        if plan.n_transfers
        else np.zeros(len(plan.tasks))
    )
    return pd.DataFrame(
        {
            "task": [t.id for t in plan.tasks],
            "name": [t.name for t in plan.tasks],
            "mesh": [t.mesh for t in plan.tasks],
            "group": [t.group for t in plan.tasks],
            "sources": [len(t.sources) for t in plan.tasks],
            "shards": [len(t.shards) for t in plan.tasks],
            "src_bytes": [t.src_bytes for t in plan.tasks],
            "bytes_written": sent.astype(np.int64),
        }
    )


def to_pandas(plan):
    """One row per transfer (sorted by sender, then order)."""
    import pandas as pd

    names = np.array(plan.names, dtype=object)
    return pd.DataFrame(
        {
            "sender": plan.sender,
            "task": plan.task,
            "group": np.array([t.group for t in plan.tasks], np.int64)[plan.task] if plan.tasks else plan.task,
            "replica": plan.replica,
            "infer_rank": plan.infer_rank,
            "gpu": plan.gpu,
            "dst": names[plan.dst] if plan.n_transfers else names[:0],
            "dst_offset": plan.dst_offset,
            "nbytes": plan.nbytes,
            "src_offset": plan.src_offset,
        }
    )


def _gb(x):
    return f"{x / 1e9:,.2f} GB"


def repr_html(plan) -> str:
    s = summary(plan)
    rows = [
        ("preset", s["preset"]),
        ("parameters", f"{s['params'] / 1e9:,.1f} B"),
        ("training GPUs", s["train_gpus"]),
        ("inference", f"{s['replicas']} replicas x TP{s['tp']}{' (EP)' if s['ep'] else ''}, {s['quant']}"),
        ("bytes per replica", _gb(s["bytes_per_replica"])),
        ("tasks", f"{s['tasks']:,} ({s['sources_per_task']} sources each, largest {_gb(s['largest_task_bytes'])})"),
        ("mesh groups", s["mesh_groups"]),
        ("transfers", f"{s['transfers']:,}"),
        ("max bytes per inference GPU", _gb(s["max_bytes_per_infer_gpu"])),
        (
            "bytes per training GPU (min / max)",
            f"{_gb(s['min_bytes_per_train_gpu'])} / {_gb(s['max_bytes_per_train_gpu'])}",
        ),
        ("build time", f"{s['build_s']:.2f} s"),
    ]
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption>wxfer plan</caption>{body}</table>"


def plot_bytes(plan, ax=None):
    """Bar plots of bytes sent per trainer NIC and received per inference NIC."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(12, 3.5))
    a, b = ax
    t = plan.bytes_per_train_rank() / 1e9
    g = plan.bytes_per_infer_gpu() / 1e9
    a.bar(np.arange(t.size), t, width=1.0)
    a.set_xlabel("trainer rank")
    a.set_ylabel("GB sent")
    a.set_title("bytes per trainer NIC")
    b.bar(np.arange(g.size), g, width=1.0, color="tab:orange")
    b.set_xlabel("inference GPU")
    b.set_ylabel("GB received")
    b.set_title("bytes per inference NIC")
    return ax
