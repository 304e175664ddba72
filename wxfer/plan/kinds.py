"""What kind of work each task of a plan is on its sending rank, as the runtime does it.

The simulator charges each kind its own stages (wxfer.plan.simulate):

  zero_copy        the rank writes the parameter's own memory (wxfer.runtime.prepare: one
                   source held whole on this rank, every shard whole rows of it in its own
                   dtype, on the device): no gather, no pack, no buffer, no watermark; the
                   Sender prepares it once (Engine.prepare) and submits it in batches of
                   ``ZERO_COPY_BATCH`` (Engine.submit_prepared); host cost per task and per batch
  staged           the bytes are written from fresh memory without packing: a gathered source
                   whose one shard is all of it, or an offloaded zero-copy-shaped source after
                   its H2D copy; held under the watermark, no pack kernel
  packed           gathered (if its mesh has several ranks), then fused / quantized / packed into
                   a buffer admitted under the watermark before it is made; host cost per task,
                   per parameter and per piece, the kernel at a rate with a per-launch cost
  direct           (reserved) packed by a kernel that writes straight into the receivers' memory:
                   no staging buffer, no separate write; the simulator charges its kernel (at
                   least its bytes at the write rate) and counts its bytes as written then
  collective_only  the rank takes part in the task's collective but sends nothing

``task_kinds(plan, params)`` decides from the plan and the trainers' parameter metadata
(shape and dtype per name) what the runtime decides per task on each rank (the same rules
as ``wxfer.runtime.prepare.task_prep`` and ``_direct_dests``); a ``wxfer.Sender`` reports
what it decided (``Sender.task_kinds()``), which takes precedence.  Pure Python.
"""

from __future__ import annotations

KINDS = ("zero_copy", "staged", "packed", "direct", "collective_only")
ZERO_COPY_BATCH = 32  # = wxfer.runtime.sender.FAST_BATCH (a test holds them equal)


def _shape_dtype(p):
    if isinstance(p, dict):
        return tuple(p["shape"]), str(p["dtype"])
    if isinstance(p, (tuple, list)):
        return tuple(p[0]), str(p[1])
    return tuple(p.shape), str(p.dtype).replace("torch.", "")


def _whole_rows(shards, shape, dtype) -> bool:
    """Every shard one raw piece of whole rows of a <= 2-D source, in the source's dtype."""
    if len(shape) > 2 or not shards:
        return False
    cols = shape[1] if len(shape) == 2 else 0
    for sh in shards:
        if sh.kind != "raw" or sh.dtype != dtype or len(sh.pieces) != 1:
            return False
        pc = sh.pieces[0]
        if cols and (pc.c0 != 0 or pc.c1 != cols):
            return False
    return True


def _all_of_it(shards, shape, dtype) -> bool:
    """One raw shard that is the whole source in its own dtype (prepare._whole)."""
    if len(shards) != 1 or not _whole_rows(shards, shape, dtype):
        return False
    pc = shards[0].pieces[0]
    return pc.r0 == 0 and pc.r1 == (shape[0] if shape else 1)


def task_kind(task, mesh_size: int, params, cpu_offload: bool = False) -> str:
    """The kind of `task` on a rank that sends its shards (see the module's docstring).
    params: training name -> (shape, dtype) (a TrainParam, a dict or a pair); None: packed."""
    if params is None or len(task.sources) != 1 or task.sources[0] not in params:
        return "packed"
    shape, dtype = _shape_dtype(params[task.sources[0]])
    if mesh_size == 1 and _whole_rows(task.shards, shape, dtype):
        return "staged" if cpu_offload else "zero_copy"
    if _all_of_it(task.shards, shape, dtype):
        return "staged"
    return "packed"


def task_kinds(plan, params=None, cpu_offload: bool = False) -> dict:
    """{task id: kind} on the ranks that send it.  params: the trainers' parameters by name
    (TrainParam objects, a {name: TrainParam} dict, or {name: (shape, dtype)}); None: every
    task packed (the simulator's model before the runtime had zero-copy tasks)."""
    if params is not None and not isinstance(params, dict):
        params = {p.name: p for p in params}
    return {t.id: task_kind(t, len(plan.meshes[t.mesh]), params, cpu_offload) for t in plan.tasks}


def batches(kinds: list, size: int = ZERO_COPY_BATCH) -> list:
    """The Sender's zero-copy batches over one mesh group's tasks in order (``kinds``: the
    kind of each): [(first, count)] of consecutive zero-copy tasks, cut every `size` tasks
    and at each task of another kind (the Sender submits the batch before it)."""
    out, start = [], None
    size = max(1, int(size))
    for i, k in enumerate(list(kinds) + [None]):
        if k == "zero_copy":
            if start is None:
                start = i
            if i - start + 1 == size:
                out.append((start, size))
                start = None
        elif start is not None:
            out.append((start, i - start))
            start = None
    return out
