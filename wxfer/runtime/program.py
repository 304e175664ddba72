"""The plan adapter: the one place on the trainer side that uses the plan's API.

Plan adapter (``build_controller_plan``, ``RankProgram.from_plan``): merge the trainers'
metadata, build and check the plan with ``wxfer.plan.build_plan``, and turn this rank's
part of it into a replayable program: for every mesh group, the ordered tasks this rank
takes part in, each with its source parameters, its packed shards and its write list.

Stages of one task (the native Engine owns the queues, the watermark and the order):
  1. H2D: a parameter's local shard is copied to the compute device when FSDP2 keeps it
     on the CPU (CPUOffloadPolicy);
  2. full_tensor() on the task's mesh, fusion, FP8 quantization and packing with the
     mapping's reference packing function (on a side CUDA stream on GPUs);
  3. Engine.submit: the packed buffer and its writes, gated on a CUDA event; admitted
     under the watermark;
  4. (in the sender) an asynchronous gloo barrier after the last full_tensor() of a
     mesh group, waited for before the next group's first collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .param_desc import decode_param_descriptor
from .control import SetupError


# --------------------------------------------------------------------------- plan adapter


def get_preset(mapping):
    """A wxfer.mapping.Preset from a preset name, a Preset, or a Hugging Face config dict."""
    from ..mapping import Preset, from_config, get_preset as _get

    if isinstance(mapping, Preset):
        return mapping
    if isinstance(mapping, str):
        return _get(mapping)
    if isinstance(mapping, dict):
        return from_config(mapping.get("name_or_path", "custom"), mapping)
    raise TypeError(
        f"wxfer: mapping must be a preset name, a wxfer.mapping.Preset or an HF config dict, "
        f"got {type(mapping).__name__}"
    )


def train_metadata(model) -> list[dict]:
    """This rank's view of the training parameters (JSON-able)."""
    from ..meta import from_fsdp_model

    return [
        dict(
            name=p.name,
            shape=list(p.shape),
            dtype=p.dtype,
            meshes=[list(m) for m in p.meshes],
            placements=list(p.placements),
        )
        for p in from_fsdp_model(model)
    ]


def merge_train_metadata(per_rank: list[list[dict]]):
    """Union of the ranks' views: a parameter held by some ranks only (expert parallelism)
    is producible by the union of the meshes the ranks report.  Returns (TrainParams,
    problems)."""
    from ..meta import TrainParam

    merged: dict[str, dict] = {}
    problems = []
    for rank, params in enumerate(per_rank):
        for p in params:
            q = merged.get(p["name"])
            if q is None:
                merged[p["name"]] = dict(p, meshes={tuple(m) for m in p["meshes"]}, seen=[rank])
                continue
            if q["shape"] != p["shape"] or q["dtype"] != p["dtype"]:
                problems.append(
                    f"training parameter {p['name']}: rank {q['seen'][0]} has {q['shape']} {q['dtype']}, "
                    f"rank {rank} has {p['shape']} {p['dtype']}"
                )
            q["meshes"] |= {tuple(m) for m in p["meshes"]}
            q["seen"].append(rank)
    out = []
    for n, q in merged.items():
        meshes = sorted(q["meshes"])
        if q["placements"] == ["Replicate()"] and all(len(m) == 1 for m in meshes):
            # a plain tensor: only ranks that reported it can produce it
            meshes = [(r,) for r in sorted(set(q["seen"]))]
        out.append(
            TrainParam(n, tuple(q["shape"]), q["dtype"], tuple(tuple(m) for m in meshes), tuple(q["placements"]))
        )
    return out, problems


def expand_for(train_params, workers_meta: list[dict], mapping):
    """Rank 0: the expansion of `mapping` over the merged training metadata for the workers'
    layout (the one the plan is built from; ``digest.compare_params`` checks each worker by it)."""
    from ..mapping.rules import Layout, expand
    from ..meta import expert_group_of
    from . import digest

    preset, first = get_preset(mapping), workers_meta[0]
    quant = next((q for q in map(lambda m: digest.quant_of(m["params"]), workers_meta) if q), None)
    layout = Layout(first["tp"], first["ep"], quant, expert_group_of(train_params))
    return expand(preset.rules, {p.name: p.shape for p in train_params}, layout, preset.config, strict=False)


def build_controller_plan(
    train_params, workers_meta: list[dict], mapping, max_task_bytes: int = 1 << 30, expanded=None
):
    """Rank 0: the plan from the merged training metadata and the receivers' metadata
    (`expanded`: ``expand_for``'s, else expanded here)."""
    from ..meta import from_inference_worker
    from ..plan import build_plan
    from .param_desc import _unb64

    preset = get_preset(mapping)
    workers = []
    quant = None
    for m in workers_meta:
        named = [(n, _Shape(s, d)) for n, (s, d) in m["params"].items()]
        if any(d == "float8_e4m3fn" for _, (s, d) in m["params"].items()):
            quant = "fp8"
        workers.append(
            from_inference_worker(
                named, m["replica"], m["rank"], m["tp"], m["ep"], {n: _unb64(d) for n, d in m["desc"].items()}, m["gpu"]
            )
        )
    plan = build_plan(train_params, workers, preset, quant=quant, max_task_bytes=max_task_bytes, expanded=expanded)
    plan.check_deadlock_free()
    return plan


class _Shape:
    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


def plan_to_bytes(plan) -> bytes:
    return plan.to_bytes()


def plan_from_bytes(data: bytes, where: str = "the plan in the store"):
    """The plan every trainer rank loads from the store, decoded (bounded, ValueError on
    malformed bytes) and checked (every destination byte written exactly once, in range, by
    a sender of its mesh), on every rank: SetupError naming `where` and the problems."""
    from ..plan import Plan

    try:
        plan = Plan.from_bytes(data)
        problems = plan.check(raise_=False)
    except ValueError as e:
        raise SetupError(f"wxfer: {where} cannot be read: {e}") from e
    if problems:
        shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        raise SetupError(f"wxfer: {where} fails its check ({len(problems)} problem(s)):\n  {shown}")
    return plan


def receivers_of(plan) -> dict[int, list[int]]:
    """gpu -> sorted trainer ranks writing to it."""
    import numpy as np

    out: dict[int, list[int]] = {int(g): [] for g in plan.gpu_of.reshape(-1)}
    if plan.n_transfers:
        pairs = np.unique(np.stack([plan.gpu, plan.sender], 1), axis=0)
        for g, s in pairs.tolist():
            out[int(g)].append(int(s))
    return out


# --------------------------------------------------------------------------- this rank's program


@dataclass
class TaskOp:
    task: int
    name: str
    sources: list  # [(name, parameter)] in the task's order
    shards: list  # [Shard] in packed order (src offsets contiguous from 0)
    dests: list  # [(region descriptor, dst offset, src offset, nbytes)]
    nbytes: int  # packed buffer size
    gpus: set = field(default_factory=set)
    idx: object = None  # the plan's transfer indices of this task on this rank
    prep: object = None  # wxfer.runtime.prepare.TaskPrep (made once by the Sender)

    @property
    def sends(self) -> bool:
        return bool(self.dests)


def task_error(op: TaskOp, e: OSError) -> OSError:
    """`e` (an OSError of a native call made for task `op`: _wxfer.Error) again, of its type
    and errno, its message naming the task (the native call knows only its pointers)."""
    return type(e)(e.errno, f"task {op.task} ({op.name}): {e.strerror}")


@dataclass
class RankProgram:
    rank: int
    groups: list  # [[TaskOp]] per mesh group (possibly empty lists)
    gpus: list  # receivers this rank writes to
    bytes_per_step: int

    @staticmethod
    def from_plan(plan, rank: int, params: dict) -> "RankProgram":
        """params: training name -> parameter object (DTensor or tensor) on this rank."""
        decoded: dict[bytes, tuple[bytes, int]] = {}
        groups, gpus, total = [], set(), 0
        for g in plan.rank_schedule(rank):
            ops = []
            for t, idx in g:
                task = plan.tasks[t]
                missing = [s for s in task.sources if s not in params]
                if missing:
                    raise KeyError(
                        f"wxfer: trainer rank {rank} takes part in task {task.name} but does not hold {missing}"
                    )
                packed = plan.packed_shards(rank, t)
                shards, off = [], 0
                for o, sh in packed:
                    if o != off:
                        raise AssertionError(f"task {task.name}: packed shard offsets not contiguous at {o}")
                    shards.append(sh)
                    off += sh.nbytes
                dests, tg, n = _dests(plan, idx, decoded)
                total += n
                gpus |= tg
                ops.append(TaskOp(t, task.name, [(s, params[s]) for s in task.sources], shards, dests, off, tg, idx))
            groups.append(ops)
        return RankProgram(rank, groups, sorted(gpus), total)

    def retarget(self, plan, gpu: int) -> int:
        """Rebuild the destinations of the tasks that write to inference `gpu` from the
        plan's descriptors (after a restarted worker registered new memory); every other
        destination is left as it is.  Returns the number of tasks changed."""
        decoded: dict[bytes, tuple[bytes, int]] = {}
        n = 0
        for ops in self.groups:
            for op in ops:
                if gpu in op.gpus:
                    op.dests, op.gpus, _ = _dests(plan, op.idx, decoded)
                    op.prep = None  # its destinations changed: prepared again
                    n += 1
        return n


def _dests(plan, idx, decoded) -> tuple[list, set, int]:
    """(destinations, inference gpus, bytes) of the plan's transfers `idx`."""
    dests, tg, total = [], set(), 0
    for i in idx.tolist():
        gpu = int(plan.gpu[i])
        key = plan.descriptors.get((gpu, plan.names[plan.dst[i]]))
        if key is None:
            raise KeyError(f"wxfer: the plan has no descriptor for {plan.names[plan.dst[i]]} on inference gpu {gpu}")
        if key not in decoded:
            decoded[key] = decode_param_descriptor(key)
        rdesc, base = decoded[key]
        dests.append((rdesc, base + int(plan.dst_offset[i]), int(plan.src_offset[i]), int(plan.nbytes[i])))
        tg.add(gpu)
        total += int(plan.nbytes[i])
    return dests, tg, total
