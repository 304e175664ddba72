"""The trainer side's per-task operations and the one place that uses the plan's API.

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

from .receiver import decode_param_descriptor


# --------------------------------------------------------------------------- plan adapter


def get_preset(mapping):
    """A wxfer.mapping.Preset from a preset name, a Preset, or a Hugging Face config dict."""
    from .mapping import Preset, from_config, get_preset as _get
    if isinstance(mapping, Preset):
        return mapping
    if isinstance(mapping, str):
        return _get(mapping)
    if isinstance(mapping, dict):
        return from_config(mapping.get("name_or_path", "custom"), mapping)
    raise TypeError(f"wxfer: mapping must be a preset name, a wxfer.mapping.Preset or an HF config dict, "
                    f"got {type(mapping).__name__}")


def train_metadata(model) -> list[dict]:
    """This rank's view of the training parameters (JSON-able)."""
    from .meta import from_fsdp_model
    return [dict(name=p.name, shape=list(p.shape), dtype=p.dtype, meshes=[list(m) for m in p.meshes],
                 placements=list(p.placements)) for p in from_fsdp_model(model)]


def merge_train_metadata(per_rank: list[list[dict]]):
    """Union of the ranks' views: a parameter held by some ranks only (expert parallelism)
    is producible by the union of the meshes the ranks report.  Returns (TrainParams,
    problems)."""
    from .meta import TrainParam
    merged: dict[str, dict] = {}
    problems = []
    for rank, params in enumerate(per_rank):
        for p in params:
            q = merged.get(p["name"])
            if q is None:
                merged[p["name"]] = dict(p, meshes={tuple(m) for m in p["meshes"]}, seen=[rank])
                continue
            if q["shape"] != p["shape"] or q["dtype"] != p["dtype"]:
                problems.append(f"training parameter {p['name']}: rank {q['seen'][0]} has {q['shape']} {q['dtype']}, "
                                f"rank {rank} has {p['shape']} {p['dtype']}")
            q["meshes"] |= {tuple(m) for m in p["meshes"]}
            q["seen"].append(rank)
    out = []
    for n, q in merged.items():
        meshes = sorted(q["meshes"])
        if q["placements"] == ["Replicate()"] and all(len(m) == 1 for m in meshes):
            # a plain tensor: only ranks that reported it can produce it
            meshes = [(r,) for r in sorted(set(q["seen"]))]
        out.append(TrainParam(n, tuple(q["shape"]), q["dtype"], tuple(tuple(m) for m in meshes),
                              tuple(q["placements"])))
    return out, problems


def build_controller_plan(train_params, workers_meta: list[dict], mapping):
    """Rank 0: the plan from the merged training metadata and the receivers' metadata."""
    from .meta import from_inference_worker
    from .plan import build_plan
    from .receiver import _unb64
    preset = get_preset(mapping)
    workers = []
    quant = None
    for m in workers_meta:
        named = [(n, _Shape(s, d)) for n, (s, d) in m["params"].items()]
        if any(d == "float8_e4m3fn" for _, (s, d) in m["params"].items()):
            quant = "fp8"
        workers.append(from_inference_worker(named, m["replica"], m["rank"], m["tp"], m["ep"],
                                             {n: _unb64(d) for n, d in m["desc"].items()}, m["gpu"]))
    plan = build_plan(train_params, workers, preset, quant=quant)
    plan.check_deadlock_free()
    return plan


class _Shape:
    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


def plan_to_bytes(plan) -> bytes:
    return plan.to_bytes()


def plan_from_bytes(data: bytes):
    from .plan import Plan
    return Plan.from_bytes(data)


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
    sources: list                 # [(name, parameter)] in the task's order
    shards: list                  # [Shard] in packed order (src offsets contiguous from 0)
    dests: list                   # [(region descriptor, dst offset, src offset, nbytes)]
    nbytes: int                   # packed buffer size
    gpus: set = field(default_factory=set)
    idx: object = None            # the plan's transfer indices of this task on this rank

    @property
    def sends(self) -> bool:
        return bool(self.dests)


@dataclass
class RankProgram:
    rank: int
    groups: list                  # [[TaskOp]] per mesh group (possibly empty lists)
    gpus: list                    # receivers this rank writes to
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
                    raise KeyError(f"wxfer: trainer rank {rank} takes part in task {task.name} but does not "
                                   f"hold {missing}")
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
                ops.append(TaskOp(t, task.name, [(s, params[s]) for s in task.sources], shards, dests, off, tg,
                                  idx))
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
                    n += 1
        return n


def _dests(plan, idx, decoded) -> tuple[list, set, int]:
    """(destinations, inference gpus, bytes) of the plan's transfers `idx`."""
    dests, tg, total = [], set(), 0
    for i in idx.tolist():
        gpu = int(plan.gpu[i])
        key = plan.descriptors.get((gpu, plan.names[plan.dst[i]]))
        if key is None:
            raise KeyError(f"wxfer: the plan has no descriptor for {plan.names[plan.dst[i]]} on "
                           f"inference gpu {gpu}")
        if key not in decoded:
            decoded[key] = decode_param_descriptor(key)
        rdesc, base = decoded[key]
        dests.append((rdesc, base + int(plan.dst_offset[i]), int(plan.src_offset[i]), int(plan.nbytes[i])))
        tg.add(gpu)
        total += int(plan.nbytes[i])
    return dests, tg, total


# --------------------------------------------------------------------------- stages 1 and 2


def local_to_device(p, device):
    """Stage 1: this rank's shard of `p` on `device` (an H2D copy when it was offloaded)."""
    from torch.distributed.tensor import DTensor
    local = p._local_tensor if isinstance(p, DTensor) else p.detach()
    if local.device != device:
        local = local.to(device, non_blocking=True)
    return local


def full_tensor(p, local):
    """Stage 2a: the whole tensor, gathered over the parameter's mesh.

    The common FSDP2 placements (one ``Shard(0)`` mesh dimension, the others
    ``Replicate()``: FSDP, HSDP) go straight to one ``all_gather_single`` on that
    dimension's process group; anything else through ``DTensor.full_tensor()``.  Both give
    the same bytes (the rows of torch.chunk-style shards, in rank order)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return local
    g = _gather_spec(p)
    if g is not None and tuple(local.shape) == g[3]:
        return _gather_rows(local, g)
    if local is p._local_tensor:
        return p.full_tensor()           # not offloaded: the parameter itself
    d = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                           stride=p.stride())
    return d.full_tensor()


_GATHER_SPECS: dict = {}        # id(parameter) -> (weak reference, spec)


def _gather_spec(p):
    """(process group, group size, padded rows per rank, this rank's local shape, rows) when `p` is
    sharded by rows over exactly one mesh dimension and replicated over the others, else None.
    Static per parameter: computed once."""
    key = id(p)
    hit = _GATHER_SPECS.get(key)
    if hit is not None and hit[0]() is p:
        return hit[1]
    spec = None
    try:
        from torch.distributed.tensor import Replicate, Shard
        pls = tuple(p.placements)
        dims = [i for i, pl in enumerate(pls) if type(pl) is Shard and pl.dim == 0]
        others_ok = all(type(pl) is Replicate for i, pl in enumerate(pls) if i not in dims)
        if len(dims) == 1 and others_ok and len(p.shape) >= 1:
            mesh, d = p.device_mesh, dims[0]
            w = mesh.size(d)
            coord = mesh.get_local_rank(d)
            n = int(p.shape[0])
            c = -(-n // w)
            rows = max(0, min(c, n - coord * c))
            if w > 1:
                spec = (mesh.get_group(d), w, c, (rows,) + tuple(p.shape[1:]), n)
    except Exception:  # noqa: BLE001 -- anything unusual: the generic DTensor path
        spec = None
    import weakref
    if len(_GATHER_SPECS) > 100_000:                 # parameters of models long gone
        for k in [k for k, (ref, _) in _GATHER_SPECS.items() if ref() is None]:
            del _GATHER_SPECS[k]
    _GATHER_SPECS[key] = (weakref.ref(p), spec)     # no reference kept to the parameter
    return spec


def _gather_rows(local, g):
    import torch
    import torch.distributed as dist
    group, w, c, lshape, n = g
    rest = tuple(lshape[1:])
    if lshape[0] != c:                       # uneven shards: pad to c rows (torch.chunk)
        inp = local.new_zeros((c,) + rest)
        if lshape[0]:
            inp[:lshape[0]].copy_(local)
    else:
        inp = local.contiguous()
    out = torch.empty((w * c,) + rest, dtype=local.dtype, device=local.device)
    all_gather_single(out, inp, group=group)
    return out if n == w * c else out[:n]


def all_gather_single(out, inp, group=None, async_op=False):
    """torch.distributed.all_gather_single where torch has it (2.13 deprecates
    all_gather_into_tensor, its older name), else all_gather_into_tensor."""
    import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def pack(shards, fulls: dict):
    """Stage 2b: fusion, FP8 and packing -- the mapping's reference packing, shards in order."""
    from .mapping import pack_task
    return pack_task(shards, fulls)


def pack_into(shards, fulls: dict, nbytes: int, device):
    """The same bytes as ``pack`` (the mapping's reference packing), written straight into one
    buffer: one allocation, each piece copied (and cast) once, an FP8 piece quantized once for
    its fp8 and scale shards."""
    import torch
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    quant: dict = {}
    off = 0
    for sh in shards:
        off = pack_shard_into(sh, fulls, out, off, quant)
    if off != nbytes:
        raise AssertionError(f"packed {off} bytes, expected {nbytes}")
    return out


def pack_shard_into(sh, fulls: dict, out, off: int, quant: dict | None = None) -> int:
    """Write shard `sh`'s reference bytes into the uint8 tensor `out` at byte `off`; returns
    the offset after it.  `quant` caches FP8 quantizations per piece across shards."""
    import torch
    from .mapping.reference import _piece_tensor, quantize_fp8_block
    if quant is None:
        quant = {}
    start = off
    for pc in sh.pieces:
        t = _piece_tensor(pc, fulls)
        if sh.kind != "raw":
            qs = quant.get(pc)
            if qs is None:
                qs = quant[pc] = quantize_fp8_block(t)
            t = qs[0] if sh.kind == "fp8" else qs[1]
            dt = t.dtype
        else:
            dt = getattr(torch, sh.dtype)
        nb = t.numel() * dt.itemsize
        if nb:
            dst = out[off:off + nb]
            if off % dt.itemsize == 0 and (out.storage_offset() + off) % dt.itemsize == 0:
                dst.view(dt).view(t.shape).copy_(t)
            else:                        # unaligned: cast first, then copy the bytes
                dst.copy_(t.to(dt).contiguous().view(-1).view(torch.uint8))
        off += nb
    if off - start != sh.nbytes:
        raise AssertionError(f"shard {sh.dst}@{sh.offset}: packed {off - start} bytes, expected {sh.nbytes}")
    return off


def _whole(op: TaskOp, fulls: dict, fresh: set):
    """The packed buffer without a copy: the task is one raw shard of one whole source whose
    gathered tensor (fresh memory, not the parameter) already holds those bytes."""
    if len(op.shards) != 1:
        return None
    sh = op.shards[0]
    if sh.kind != "raw" or len(sh.pieces) != 1:
        return None
    pc = sh.pieces[0]
    if pc.src not in fresh:
        return None
    t = fulls[pc.src]
    if str(t.dtype) != "torch." + sh.dtype or not t.is_contiguous() or t.dim() not in (1, 2):
        return None
    if pc.r0 != 0 or pc.r1 != t.shape[0] or (t.dim() == 2 and (pc.c0 != 0 or pc.c1 != t.shape[1])):
        return None
    import torch
    return t.reshape(-1).view(torch.uint8)


def prepare(op: TaskOp, device):
    """Stages 1-2 of one task; returns the packed uint8 buffer (None when this rank only takes
    part in the collectives)."""
    import torch
    with torch.no_grad():
        fulls, fresh = {}, set()
        for name, p in op.sources:
            local = local_to_device(p, device)
            f = full_tensor(p, local)
            fulls[name] = f
            if f is not local and f.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
                fresh.add(name)
        if not op.sends:
            return None
        buf = _whole(op, fulls, fresh)
        if buf is None:
            buf = pack_into(op.shards, fulls, op.nbytes, device)
    if buf.numel() != op.nbytes:
        raise AssertionError(f"task {op.name}: packed {buf.numel()} bytes, plan says {op.nbytes}")
    return buf
