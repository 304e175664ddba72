"""Stages 1 and 2 of a task on the trainer side: H2D of offloaded shards, full_tensor()
on the task's mesh, fusion, FP8 quantization and packing into the task's send buffer.

The plan adapter (``wxfer.runtime.program``) says what each task holds; this module only
turns a ``TaskOp`` into the bytes the engine writes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import taskpath
from ..zerocopy import merged_rows, zero_copy_dests
from .program import TaskOp, task_error

# --------------------------------------------------------------------------- the bound of a collective

_BOUND = threading.local()  # v: (seconds, whose) while a push runs its collectives (bounded)


@contextlib.contextmanager
def bounded(seconds: float, whose: str):
    """Every gloo collective of stage 2 run inside is bounded by `seconds` (issue 35.3): the
    row all-gathers are posted asynchronously and waited for by control.wait_work (a
    CollectiveError, interruptible), a generic DTensor.full_tensor() runs with its mesh's gloo
    groups' timeout lowered to `seconds`; `whose` ("trainer rank 0, step 3") names it.  Outside
    it (or on CUDA tensors: NCCL, waited for by the engine's events) they run as before."""
    prev = getattr(_BOUND, "v", None)
    _BOUND.v = (float(seconds), whose)
    try:
        yield
    finally:
        _BOUND.v = prev


def _all_gather(out, inp, group, what: str, prep=None, done: int = 0) -> None:
    """all_gather_single(out, inp) on `group`, bounded when a push set one (``bounded``);
    prep.done = `done` once it is posted (a failed rank's drain must not post it again)."""
    b = getattr(_BOUND, "v", None)
    if b is None or out.device.type != "cpu":
        all_gather_single(out, inp, group=group)
        if prep is not None:
            prep.done = done
        return
    from . import control

    work = all_gather_single(out, inp, group=group, async_op=True)
    if prep is not None:
        prep.done = done
    control.wait_work(work, b[0], f"{what} ({b[1]})")


@contextlib.contextmanager
def _gloo_bounded(p, local):
    """A generic full_tensor() of `p` within the push's bound: its mesh's gloo groups' timeout
    lowered for the call (and put back), so a rank dead or hung fails it within the bound."""
    b = getattr(_BOUND, "v", None)
    saved = []
    if b is not None and local.device.type == "cpu":
        from datetime import timedelta

        import torch
        import torch.distributed.distributed_c10d as c10d

        for g in p.device_mesh.get_all_groups():
            try:
                be = g._get_backend(torch.device("cpu"))
                saved.append((g, be.options._timeout))
                c10d._set_pg_timeout(timedelta(seconds=b[0]), g)
            except Exception:  # noqa: BLE001 -- not gloo: as before
                pass
    try:
        yield
    finally:
        for g, t in saved:
            c10d._set_pg_timeout(t, g)


# --------------------------------------------------------------------------- stages 1 and 2


def dtensor_local(p):
    """DTensor `p`'s local shard: the very tensor it holds, read as ``p._local_tensor`` (the one
    place wxfer reads it).  Not ``p.to_local()``: for a DTensor that is an nn.Parameter (FSDP2's
    parameters) torch 2.13's returns a new view at every call even under no_grad (with grad
    enabled, a view with an autograd node), where these callers need that same object
    (full_tensor tests identity) and no allocation per call (zero_copy_task checks it per task
    per push)."""
    return p._local_tensor


def local_to_device(p, device):
    """Stage 1: this rank's shard of `p` on `device` (an H2D copy when it was offloaded)."""
    local = _local(p)
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

    if not isinstance(p, DTensor) or (tuple(local.shape) == tuple(p.shape) and _is_whole(p)):
        return local  # this rank holds all of it (1-rank mesh, Replicate)
    g = _gather_spec(p)
    if g is not None and tuple(local.shape) == g[3]:
        return _gather_rows(local, g)
    with _gloo_bounded(p, local):
        if local is dtensor_local(p):
            return p.full_tensor()  # not offloaded: the parameter itself
        d = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        return d.full_tensor()


_GATHER_SPECS: dict = {}  # id(parameter) -> (weak reference, spec)


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

    if len(_GATHER_SPECS) > 100_000:  # parameters of models long gone
        for k in [k for k, (ref, _) in _GATHER_SPECS.items() if ref() is None]:
            del _GATHER_SPECS[k]
    _GATHER_SPECS[key] = (weakref.ref(p), spec)  # no reference kept to the parameter
    return spec


def _gather_rows(local, g):
    import torch

    group, w, c, lshape, n = g
    rest = tuple(lshape[1:])
    if lshape[0] != c:  # uneven shards: pad to c rows (torch.chunk)
        inp = local.new_zeros((c,) + rest)
        if lshape[0]:
            inp[: lshape[0]].copy_(local)
    else:
        inp = local.contiguous()
    out = torch.empty((w * c,) + rest, dtype=local.dtype, device=local.device)
    _all_gather(out, inp, group, f"the all-gather of a {tuple(lshape)} shard")
    return out if n == w * c else out[:n]


def all_gather_single(out, inp, group=None, async_op=False):
    """torch.distributed.all_gather_single where torch has it (2.13 deprecates
    all_gather_into_tensor, its older name), else all_gather_into_tensor."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def pack_into(shards, fulls: dict, nbytes: int, device):
    """The bytes of the mapping's reference packing (``wxfer.mapping.pack_task``), written
    straight into one buffer: one allocation, each raw piece copied (and cast) once, and every FP8 piece of the
    task quantized by one ``fp8.quantize_into`` call (one kernel launch on CUDA) that writes its
    fp8 bytes and its scales at their offsets. Where the plan's shards are the same objects
    from push to push (a Sender's tasks), where each piece goes is worked out once, and the
    kernel's piece table is reused while the sources stay at the same addresses."""
    import torch

    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _, raw, fp8_pieces, end, srcs = _layout(shards)
    if end != nbytes:
        raise AssertionError(f"packed {end} bytes, expected {nbytes}")
    _copy_raw(out, fulls, raw)
    if fp8_pieces:
        key = (id(shards), tuple((fulls[n].data_ptr(), tuple(fulls[n].stride()), fulls[n].dtype) for n in srcs))
        from . import fp8

        fp8.quantize_cached(out, key, lambda: _jobs(fulls, fp8_pieces))
    return out


def pack_shard_into(sh, fulls: dict, out, off: int) -> int:
    """Write shard `sh`'s reference bytes into the uint8 tensor `out` at byte `off`; returns
    the offset after it. An FP8 or scale shard's pieces are quantized in one call (each
    shard's part written directly)."""
    raw, fp8_pieces, end = _place((sh,), off)
    _copy_raw(out, fulls, raw)
    _quantize(out, fulls, fp8_pieces)
    return end


def _place(shards, off: int = 0) -> tuple:
    """Where the shards go from byte `off` on: (raw [(shard, offset, its pieces merged by
    merged_rows)], fp8_pieces {piece: ([fp8 offsets], [scale offsets])}, the end offset)."""
    raw, fp8_pieces = [], {}
    for sh in shards:
        start = off
        if sh.kind == "raw":
            raw.append((sh, off, merged_rows(sh.pieces)))
            off += sh.nbytes
            continue
        for pc in sh.pieces:
            slot = fp8_pieces.setdefault(pc, ([], []))
            slot[0 if sh.kind == "fp8" else 1].append(off)
            off += pc.rows * pc.cols if sh.kind == "fp8" else pc.scale_nbytes()
        if off - start != sh.nbytes:
            raise AssertionError(f"shard {sh.dst}@{sh.offset}: packed {off - start} bytes, expected {sh.nbytes}")
    return raw, fp8_pieces, off


_LAYOUTS: dict = {}  # id(shards) -> (shards, *_place(shards), the FP8 pieces' source names)


def _layout(shards) -> tuple:
    """_place(shards) once per shards object (plan shards live as long as the plan)."""
    hit = _LAYOUTS.get(id(shards))
    if hit is not None and hit[0] is shards:
        return hit
    raw, fp8_pieces, end = _place(shards)
    lay = (shards, raw, fp8_pieces, end, tuple(sorted({pc.src for pc in fp8_pieces})))
    if len(_LAYOUTS) > 65536:
        _LAYOUTS.clear()
    _LAYOUTS[id(shards)] = lay
    return lay


def _copy_raw(out, fulls: dict, raw) -> None:
    """Copy (and cast) the raw shards' pieces into `out` at their offsets."""
    import torch
    from ..mapping.reference import _piece_tensor

    for sh, off, pieces in raw:
        start = off
        dt = getattr(torch, sh.dtype)
        for pc in pieces:
            off += copy_piece(out, off, _piece_tensor(pc, fulls), dt)
        if off - start != sh.nbytes:
            raise AssertionError(f"shard {sh.dst}@{sh.offset}: packed {off - start} bytes, expected {sh.nbytes}")


def copy_piece(out, off: int, t, dt) -> int:
    """Copy (and cast to `dt`) the tensor `t` into the uint8 tensor `out` at byte `off`;
    returns the bytes written."""
    import torch

    nb = t.numel() * dt.itemsize
    if nb:
        dst = out[off : off + nb]
        if off % dt.itemsize == 0 and (out.storage_offset() + off) % dt.itemsize == 0:
            dst.view(dt).view(t.shape).copy_(t)
        else:  # unaligned: cast first, then copy the bytes
            dst.copy_(t.to(dt).contiguous().view(-1).view(torch.uint8))
    return nb


def _jobs(fulls: dict, fp8_pieces: dict) -> list:
    """The quantize_into jobs of the recorded FP8 pieces: a piece found in an fp8 shard and in a
    scale shard is one job writing both (a piece sent twice: one job per copy)."""
    from itertools import zip_longest
    from ..mapping.reference import _piece_tensor

    jobs = []
    for pc, (qs, ss) in fp8_pieces.items():
        t = _piece_tensor(pc, fulls)
        if t.dim() != 2:
            raise ValueError(
                f"FP8 piece {pc}: its source {pc.src!r} is {t.dim()}-D, FP8 block quantization needs a 2-D tensor"
            )
        for qo, so in zip_longest(qs, ss):
            jobs.append((t, qo, so))
    return jobs


def _quantize(out, fulls: dict, fp8_pieces: dict) -> None:
    """Quantize every recorded FP8 piece in one fp8.quantize_into call."""
    if not fp8_pieces:
        return
    from . import fp8

    fp8.quantize_into(out, _jobs(fulls, fp8_pieces))


def _whole(op: TaskOp, fulls: dict, fresh: set):
    """The packed buffer without a copy: the task is one raw shard that is all of its one
    gathered source (wxfer.taskpath: staged, "gathered_whole"), whose gathered tensor (fresh
    memory, not the parameter) holds those bytes as they are; None when it does not (packed)."""
    sh, src = op.shards[0], op.sources[0][0]
    t = fulls[src]
    if (
        src not in fresh
        or str(t.dtype) != "torch." + sh.dtype
        or not t.is_contiguous()
        or t.numel() * t.element_size() != sh.nbytes
    ):
        return None
    import torch

    return t.reshape(-1).view(torch.uint8)


def prepare(op: TaskOp, device):
    """Stages 1-2 of one task; returns the packed uint8 buffer (None when this rank only takes
    part in the collectives).  The Sender uses ``task_prep`` once and ``run`` every step."""
    import torch

    with torch.no_grad():
        prep = op.prep if op.prep is not None and op.prep.device == device else task_prep(op, device)
        buf = run(prep, op, device)
    return buf


# --------------------------------------------------------------------------- per task, once


@dataclass(slots=True)
class ZeroCopyTask:
    """A zero-copy task as the engine holds it (zero_copy_task), made once at the first push and
    read per task per push: the memory it was made for, to see that it has not moved.  Slots,
    not a NamedTuple: its fields read as fast as a tuple's items (a NamedTuple's: ~60 ns more
    per task per push on the 2-core VM)."""

    task: Any  # Engine.prepare's task
    param: Any  # the parameter (a DTensor or a tensor)
    dtensor: bool  # param is a DTensor (its local shard is the memory)
    data_ptr: int  # of that memory when it was registered
    numel: int


class TaskPrep:
    """What does not change between steps for one task on this rank: how each source is
    obtained (whole on this rank; in one coalesced row all-gather per process group and
    dtype; through DTensor otherwise), its path (wxfer.taskpath: the facts, the engine's path,
    the path it takes where the in-place writer can), whether the write reads the parameter's
    own memory (zero copy), the destinations as the engine takes them, the bytes it holds."""

    __slots__ = (
        "device",
        "facts",
        "path",
        "best",
        "whole",
        "gathers",
        "generic",
        "direct",
        "zero_copy",
        "dests",
        "held",
        "nparams",
        "event",
        "largest",
        "fast",
        "done",
        "gather_s",
    )

    def __init__(self, device):
        self.device = device
        self.whole: list = []  # [(name, parameter)]: this rank holds the whole tensor
        self.gathers: list = []  # [_Gather]
        self.generic: list = []  # [(name, parameter)]: DTensor.full_tensor()
        self.facts: taskpath.Facts | None = None  # what its path is decided from (task_prep)
        self.path: taskpath.Choice | None = None  # the engine's path (no in-place writer)
        self.best: taskpath.Choice | None = None  # the path where in-place writes can do it all
        self.direct = None  # source name when the buffer is that source's bytes
        self.zero_copy = False  # direct, and the parameter's own memory (no H2D)
        self.dests: list = []
        self.held = 0
        self.nparams = 0
        self.event = None
        self.largest = (0, "")  # (bytes, name) of the largest source
        self.fast: ZeroCopyTask | None = None  # zero copy: the Sender's, made at the first push
        # collectives (gathers, then generic full_tensor calls) of this task posted in the push
        # under way, counted as each returns: where a failed rank's drain resumes (steps.py)
        self.done = 0
        self.gather_s = 0.0  # the last gather()'s seconds (stage 1 and the collectives)


class _Gather:
    __slots__ = ("group", "w", "dtype", "items", "sizes", "total", "pads")

    def __init__(self, group, w, dtype):
        self.group, self.w, self.dtype = group, w, dtype
        self.items: list = []  # [(name, parameter, padded rows per rank, local rows, rest, rows)]
        self.sizes: list = []  # elements per rank of each item
        self.total = 0
        self.pads: list = []  # zero tensors padding uneven shards (made once)


def _is_whole(p) -> bool:
    """This rank holds all of `p`: a plain tensor, or a DTensor on a 1-rank mesh or replicated."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return True
    if p.device_mesh.size() == 1 or all(type(pl) is Replicate for pl in p.placements):
        return tuple(dtensor_local(p).shape) == tuple(p.shape)
    return False


_DTENSOR: list = []  # [torch's DTensor class], imported at the first _local (not per call: per task)


def _local(p):
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return dtensor_local(p) if isinstance(p, _DTENSOR[0]) else p.detach()


def task_prep(op: TaskOp, device) -> TaskPrep:
    """Decide once how task `op` is prepared on this rank (see TaskPrep)."""
    import math
    import torch

    prep = TaskPrep(device)
    prep.nparams = len(op.sources)
    by_group: dict = {}
    for name, p in op.sources:
        nb = p.numel() * p.element_size()
        if nb > prep.largest[0]:
            prep.largest = (nb, name)
        if _is_whole(p):
            prep.whole.append((name, p))
            continue
        g = _gather_spec(p)
        local = _local(p)
        if g is None or tuple(local.shape) != g[3]:
            prep.generic.append((name, p))
            continue
        group, w, c, lshape, n = g
        key = (id(group), w, p.dtype)
        gat = by_group.get(key)
        if gat is None:
            gat = by_group[key] = _Gather(group, w, p.dtype)
            prep.gathers.append(gat)
        rest = tuple(lshape[1:])
        gat.items.append((name, p, c, lshape[0], rest, n))
        gat.sizes.append(c * math.prod(rest))
        gat.total += c * math.prod(rest)
        if lshape[0] != c:
            gat.pads.append(torch.zeros((c - lshape[0]) * math.prod(rest), dtype=p.dtype, device=device))
    prep.dests = list(op.dests)
    prep.held = op.nbytes
    _decide(prep, op, device)
    return prep


def _decide(prep: TaskPrep, op: TaskOp, device) -> None:
    """Task `op`'s path on this rank (wxfer.taskpath.classify, from the facts of its tensors)
    and what it means for the bytes: the parameter's own (prep.direct: the source's name;
    prep.zero_copy: on the device, written from its memory, nothing held) or a buffer."""
    srcs = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in op.sources]
    lay = taskpath.layout(op.shards, srcs)
    held = len(op.sources) == 1 and bool(prep.whole)
    d, on_dev = None, True
    if op.sends and held and lay in (taskpath.WHOLE, taskpath.ROWS):
        d = _direct_dests(op, prep.whole[0][1])
        on_dev = _local(prep.whole[0][1]).device == device
    prep.facts = f = taskpath.Facts(op.sends, lay, held, on_dev, d is not None)
    prep.path, prep.best = taskpath.classify(f), taskpath.best(f)
    if f.own:
        name, p = prep.whole[0]
        prep.direct, prep.dests = name, d
        prep.zero_copy = prep.path.path == taskpath.ZERO_COPY
        prep.held = 0 if prep.zero_copy else p.numel() * p.element_size()


def _direct_dests(op: TaskOp, p):
    """The task's destinations with source offsets into the parameter's own bytes when every
    packed shard is one contiguous byte range of it in its dtype (wxfer.zerocopy: the rule and
    the offsets); None otherwise (the task is packed)."""
    local = _local(p)
    if not local.is_contiguous():
        return None
    dtype = str(local.dtype).removeprefix("torch.")
    return zero_copy_dests(op.shards, op.dests, op.sources[0][0], tuple(local.shape), dtype, local.element_size())


def zero_copy_task(op: TaskOp, device, transport, engine):
    """The engine's prepared task (``Engine.prepare``) of zero-copy task `op`, made at the
    first push (not at setup: FSDP2's lazy init may still move the sharded storage, and the
    Region would keep the old one alive): its parameter's memory registered once as a Region
    of `transport` (export=False), its destinations validated once.  Each call checks that
    the parameter still has the same memory (data_ptr and size); if not (``param.data =
    ...``), the task is decided again (``task_prep``) and registered again (the old storage
    is released then).  ``RankProgram.retarget`` drops ``op.prep``, so a
    restarted worker's tasks are prepared again for its new memory.  None when the task is
    not (or no longer) zero copy."""
    prep = op.prep
    fast = prep.fast
    if fast is not None:
        local = dtensor_local(fast.param) if fast.dtensor else fast.param
        if local.data_ptr() == fast.data_ptr and local.numel() == fast.numel:
            return fast.task
        prep = op.prep = task_prep(op, device)  # the memory moved: decide again
    if not prep.zero_copy or not op.sends:
        return None
    import torch
    from torch.distributed.tensor import DTensor

    p = prep.whole[0][1]
    is_dt = isinstance(p, DTensor)
    local = dtensor_local(p) if is_dt else p
    region = transport.register(local.detach().reshape(-1).view(torch.uint8), export=False)
    prep.fast = ZeroCopyTask(engine.prepare(region, prep.dests, tag=op.task), p, is_dt, local.data_ptr(), local.numel())
    return prep.fast.task


# --------------------------------------------------------------------------- per task, every step


def run(prep: TaskPrep, op: TaskOp, device):
    """Stages 1-2 of one task with its TaskPrep (call under torch.no_grad(), on the side
    stream): the packed uint8 buffer, the parameter's own bytes (zero copy), or None when
    this rank only takes part in the collectives."""
    import torch

    if prep.zero_copy:  # the parameter's own bytes: nothing to make
        return _local(prep.whole[0][1]).reshape(-1).view(torch.uint8)
    fulls, fresh = gather(prep, op, device)
    if not op.sends:
        return None
    if prep.direct is not None:
        return fulls[prep.direct].reshape(-1).view(torch.uint8)
    buf = _whole(op, fulls, fresh) if prep.path.reason == "gathered_whole" else None
    if buf is None:
        from .. import _wxfer

        try:
            buf = pack_into(op.shards, fulls, op.nbytes, device)
        except _wxfer.Error as e:  # the native quantizer's (fp8_host, fp8_launch): it knows no task
            raise task_error(op, e) from e
    if buf.numel() != op.nbytes:
        raise AssertionError(f"task {op.name}: packed {buf.numel()} bytes, plan says {op.nbytes}")
    return buf


def gather(prep: TaskPrep, op: TaskOp, device) -> tuple:
    """Stage 1 and the collectives of stage 2 of a task that is not zero copy: ({source name:
    its whole tensor on `device`}, the names of those in fresh memory, not the parameter's).
    prep.done counts its collectives as each returns."""
    t0 = time.perf_counter()
    fulls, fresh = {}, set()
    for name, p in prep.whole:
        local = _local(p)
        if local.device != device:
            local = local.to(device, non_blocking=True)
            fresh.add(name)
        fulls[name] = local
    prep.done = 0
    if prep.gathers or prep.generic:  # (a task whose sources are all whole here has none)
        collectives(prep, device, fulls, 0)
        fresh.update(it[0] for g in prep.gathers for it in g.items)
        fresh.update(name for name, _ in prep.generic)
    prep.gather_s = time.perf_counter() - t0  # stage 1 and the collectives (delta pushes' stats)
    return fulls, fresh


def collectives(prep: TaskPrep, device, fulls: dict | None = None, start: int = 0) -> None:
    """The collectives of a task from the `start`-th on (its row gathers, then its generic
    full_tensor() calls), prep.done counting each as it returns; the whole tensors into
    `fulls` (None: a drain's, thrown away).  A failed rank's drain calls it from prep.done so
    that the other ranks' collectives pair with the same ones (steps.py)."""
    out = {} if fulls is None else fulls
    i = 0
    for g in prep.gathers:
        if i >= start:
            _gather_many(g, out, device, prep, i + 1)
        i += 1
    for name, p in prep.generic:
        if i >= start:
            out[name] = full_tensor(p, local_to_device(p, device))
            prep.done = i + 1
        i += 1


def _gather_many(g: _Gather, fulls: dict, device, prep: TaskPrep | None = None, done: int = 0) -> None:
    """One all-gather for every row-sharded source of a process group and dtype (as FSDP2's
    unshard: the local shards concatenated, padded to equal rows), then each source's whole
    tensor copied out of the gathered ranks in one kernel."""
    import torch

    parts, k = [], 0
    for name, p, c, rows, rest, n in g.items:
        local = _local(p)
        if local.device != device:
            local = local.to(device, non_blocking=True)
        parts.append(local.reshape(-1))
        if rows != c:
            parts.append(g.pads[k])
            k += 1
    inp = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    out = torch.empty(g.w * g.total, dtype=g.dtype, device=device)
    more = f" and {len(g.items) - 1} more" if len(g.items) > 1 else ""
    _all_gather(out, inp, g.group, f"the all-gather of {g.items[0][0]}{more}", prep, done)
    del inp
    if len(g.items) == 1:
        name, p, c, rows, rest, n = g.items[0]
        full = out.view((g.w * c,) + rest)
        fulls[name] = full if n == g.w * c else full[:n]
        return
    outs = [torch.empty((g.w * c,) + rest, dtype=g.dtype, device=device) for _, _, c, _, rest, _ in g.items]
    torch.split_with_sizes_copy(out.view(g.w, g.total), g.sizes, dim=1, out=[o.view(g.w, -1) for o in outs])
    del out
    for (name, p, c, rows, rest, n), o in zip(g.items, outs):
        fulls[name] = o if n == g.w * c else o[:n]
