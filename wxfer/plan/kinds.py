"""What kind of work each task of a plan is on its sending rank, as the runtime does it.

The simulator charges each kind its own stages (wxfer.plan.simulate):

  zero_copy        the rank writes the parameter's own memory (wxfer.runtime.prepare: one
                   source held whole on this rank, every shard whole rows of it in its own
                   dtype, on the device): no gather, no pack, no buffer, no watermark; the
                   Sender prepares it once (Engine.prepare) and submits it in batches
                   (Engine.submit_prepared, wxfer.zerocopy.batch_ends); host cost per task and per batch
  staged           the bytes are written from fresh memory without packing: a gathered source
                   whose one shard is all of it, or an offloaded zero-copy-shaped source after
                   its H2D copy; held under the watermark, no pack kernel
  packed           gathered (if its mesh has several ranks), then fused / quantized / packed into
                   a buffer admitted under the watermark before it is made; host cost per task,
                   per parameter and per piece, the kernel at a rate with a per-launch cost
  direct           a packed (or gathered) task whose kernel writes straight into the receivers'
                   memory (wxfer.runtime.inplace: cuda_ipc, receivers on the writer's GPU): no
                   staging buffer, no engine write; the simulator charges its host cost per task
                   and its kernel (sources read + packed bytes written at the quantizer's or the
                   copy rate); the push's first one waits until the begin stamps landed
  collective_only  the rank takes part in the task's collective but sends nothing
  copy             a zero-copy task of fewer bytes than the Sender's ``copy_max`` (default ``COPY_MAX``)
                   where direct is possible: not an engine write; its destination ranges are
                   copied straight into the receivers' mapped memory by batched copy kernels
                   (wxfer.runtime.copies, up to ``COPY_BATCH`` ranges or ``COPY_BATCH_BYTES`` per launch) on the side
                   stream, in order with the direct kernels; no trace record, no posting, no
                   watermark; the push's first launch of them waits for the begin stamps

``task_kinds(plan, params)`` gives, from the plan and the trainers' parameter metadata (shape
and dtype per name), what the runtime decides per task on each rank: both ask
``wxfer.taskpath.classify`` (``task_choices``: the reasons too); a ``wxfer.Sender`` reports
what it decided (``Sender.task_kinds()``), which takes precedence.  Pure Python.
"""

from __future__ import annotations

from .. import taskpath
from ..zerocopy import COPY_MAX

KINDS = taskpath.PATHS


def _shape_dtype(p):
    if isinstance(p, dict):
        return tuple(p["shape"]), str(p["dtype"])
    if isinstance(p, (tuple, list)):
        return tuple(p[0]), str(p[1])
    return tuple(p.shape), str(p.dtype).replace("torch.", "")


def task_choice(
    task,
    mesh_size: int,
    params,
    cpu_offload: bool = False,
    direct: bool = False,
    nbytes: int | None = None,
    copy_max: int = COPY_MAX,
    shards=None,
) -> taskpath.Choice:
    """The path of `task` on a rank that sends `shards` of it (None: all of its shards, as
    the one rank of a 1-rank mesh does), and why (wxfer.taskpath).
    params: training name -> (shape, dtype) (a TrainParam, a dict or a pair); None: not known
    (packed; direct: direct).  mesh_size 1: the rank holds its sources whole.  direct: the
    Sender writes tasks straight into the receivers (cuda_ipc, every receiver on the writer's
    GPU, every piece inside a destination): a task that is not the parameter's own bytes is
    direct, and a zero-copy task of fewer than `copy_max` bytes (`nbytes`: its packed bytes on
    the rank; None: not known, zero copy; copy_max 0: none, -1: no bound, as the Sender's) is
    copy (wxfer.runtime.inplace.InPlaceWriter.queue_copy)."""
    srcs = [(n, *_shape_dtype(params[n])) if params is not None and n in params else None for n in task.sources]
    f = taskpath.Facts(
        sends=True,
        layout=taskpath.layout(task.shards if shards is None else shards, srcs),
        held=mesh_size == 1,
        on_device=not cpu_offload,
    )
    small = nbytes is not None and (copy_max < 0 or nbytes < copy_max)
    in_place = None if direct else "off"
    copy = None if direct and small else ("off" if not direct else "not fewer bytes than copy_max")
    return taskpath.classify(f, in_place, copy)


def packed_bytes(plan) -> list:
    """Per task: the bytes of the packed buffer its (first) sending rank makes (its transfers'
    end offsets; = wxfer.runtime.program.TaskOp.nbytes), 0 where it has no transfer."""
    out = [0] * len(plan.tasks)
    for t, o, n in zip(plan.task.tolist(), plan.src_offset.tolist(), plan.nbytes.tolist()):
        out[t] = max(out[t], int(o) + int(n))
    return out


def task_choices(plan, params=None, cpu_offload: bool = False, direct: bool = False, copy_max: int = COPY_MAX) -> dict:
    """{task id: wxfer.taskpath.Choice} on the ranks that send it: task_kinds with the reasons."""
    if params is not None and not isinstance(params, dict):
        params = {p.name: p for p in params}
    nb = packed_bytes(plan) if direct and copy_max != 0 else [None] * len(plan.tasks)
    sent = rank_shards(plan)
    return {
        t.id: task_choice(t, len(plan.meshes[t.mesh]), params, cpu_offload, direct, nb[t.id], copy_max, sent.get(t.id))
        for t in plan.tasks
    }


def rank_shards(plan) -> dict:
    """{task: the shards its lowest sending rank packs} for the tasks of meshes of several
    ranks (each rank sends its share of the task's shards: a replicated norm's one shard per
    inference TP rank is sent by one trainer rank each); a 1-rank mesh's rank sends them all."""
    multi = {t.id for t in plan.tasks if len(plan.meshes[t.mesh]) > 1}
    if not multi:
        return {}
    rows = [
        (t, r, o, s)
        for t, r, o, s in zip(*(a.tolist() for a in (plan.task, plan.sender, plan.src_offset, plan.shard)))
        if t in multi
    ]
    low: dict = {}
    for t, r, _, _ in rows:
        if r < low.get(t, r + 1):
            low[t] = r
    offs: dict = {}
    for t, r, o, s in rows:
        if r == low[t]:
            offs.setdefault(t, {}).setdefault(o, s)
    return {t: [plan.tasks[t].shards[s] for _, s in sorted(d.items())] for t, d in offs.items()}


def task_kinds(plan, params=None, cpu_offload: bool = False, direct: bool = False, copy_max: int = COPY_MAX) -> dict:
    """{task id: kind} on the ranks that send it.  params: the trainers' parameters by name
    (TrainParam objects, a {name: TrainParam} dict, or {name: (shape, dtype)}); None: every
    task packed (the simulator's model before the runtime had zero-copy tasks); direct and
    copy_max (the Sender's copy_max, ``stats()["direct"]["copy_max"]``; 0: no copies, -1: no
    bound): see task_choice (the runtime's own tests, wxfer.runtime.inplace.decompose and
    Transport.map, can still send a task the staging or the engine's way: a Sender's
    task_kinds() says what it did)."""
    return {t: c.path for t, c in task_choices(plan, params, cpu_offload, direct, copy_max).items()}
