"""The destination map traced from vLLM's own loader (issue 34.1).

``trace_load(model, checkpoint)`` runs the model's own ``load_weights`` over *fake* checkpoint
tensors that carry only a name, a shape and a dtype, and records every write into the storage of
a parameter (or buffer): which elements of which checkpoint tensor land in which elements of which
parameter.  Nothing is read (no checkpoint data exists), nothing is allocated beyond index
arithmetic, and no write is executed: the live parameters keep their bytes.

How: a ``TorchDispatchMode`` sees every aten op the loader runs.  A fake checkpoint tensor
(``_Fake``, a wrapper subclass holding no data) carries an *index map*: lazily, a meta tensor
that is a strided view of a meta tensor of the checkpoint's shape (view ops -- narrow/slice,
select, view, reshape, t, transpose, chunk/split, expand, unsqueeze... -- run on it and compose
the strides for free); or, once a non-view op needs it (cat, stack, indexing by a tensor, a
contiguous copy of a strided view), a materialized int64 tensor of global ids (checkpoint number
<< 40 | element).  Casts (``to``/``_to_copy``/``clone``/``contiguous``) keep the map and change
only the dtype.  A ``copy_`` (also what ``param[...] = w`` and ``param.data.copy_(w)`` become)
whose destination aliases a parameter's storage records (parameter, destination element) <-
(checkpoint tensor, source element) as runs and returns without writing.  ``fill_`` of a
parameter with a constant is recorded as a constant region (vocab padding).  Anything else that
touches a fake tensor (arithmetic: computed on meta tensors for its shape and
carried as a *computed* value; ``item()``; a copy into a temporary) or writes a parameter from
something that is not the checkpoint is *unexpressible*: it is reported by the name of the
parameter it is written into (or, when none is known, of the checkpoint tensor), never dropped.

The result, a ``wxfer.mapping.traced.TracedMap``, is plain data (numpy arrays of runs); it
travels to the trainers and becomes the plan's ``Shard``s there (``wxfer.mapping.traced``).
torch is imported when a trace runs; vLLM never (the model is whatever has ``load_weights``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ...mapping.traced import SHIFT, TracedMap, compress_runs


class Unexpressible(Exception):
    """An op on a fake checkpoint tensor (or a write into a parameter) the tracer cannot express."""


def _torch():
    import torch

    return torch


def _fake_class():
    torch = _torch()
    if "cls" in _FAKE:
        return _FAKE["cls"]

    class _Fake(torch.Tensor):
        """A checkpoint tensor with no data: `idx` maps its elements to checkpoint elements."""

        @staticmethod
        def __new__(cls, idx, dtype, nid, why=None):
            r = torch.Tensor._make_wrapper_subclass(cls, tuple(idx.shape), dtype=dtype, device="cpu")
            # nid: checkpoint number (idx a lazy meta view), -1 (idx materialized global ids) or
            # -2 (computed from checkpoint tensors: idx a meta tensor of its shape, why says how)
            r.idx, r.nid, r.why = idx, nid, why
            return r

        def __repr__(self):
            return f"FakeCheckpointTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise Unexpressible(f"{func} on a checkpoint tensor outside the trace")

    _FAKE["cls"] = _Fake
    return _Fake


_FAKE: dict = {}


def _ids(f):
    """int64 global ids (checkpoint << SHIFT | element) of fake `f`, materialized, f's shape."""
    torch = _torch()
    if f.nid == -2:
        raise Unexpressible(f.why)
    if f.nid < 0:
        return f.idx
    m = f.idx
    out = torch.full((), m.storage_offset(), dtype=torch.int64)
    for k, (n, s) in enumerate(zip(m.shape, m.stride())):
        shape = [1] * m.dim()
        shape[k] = n
        out = out + (torch.arange(n, dtype=torch.int64) * s).view(shape)
    return (out + (f.nid << SHIFT)).expand(tuple(m.shape)).contiguous()


# ops that keep each element where it is (a cast or a copy): the map is kept, the dtype changes
_SAME = {"_to_copy", "clone", "contiguous", "to", "detach", "alias", "lift_fresh", "_copy_from"}
# non-view ops that only move elements: run on the materialized ids
_GATHER = {
    "cat",
    "stack",
    "index",
    "index_select",
    "gather",
    "flip",
    "roll",
    "repeat",
    "_unsafe_view",
    "view_copy",
    "reshape",
    "repeat_interleave",
    "split_with_sizes_copy",
    "unbind_copy",
    "permute_copy",
    "transpose_copy",
    "t_copy",
    "narrow_copy",
    "slice_copy",
    "select_copy",
    "unsqueeze_copy",
    "squeeze_copy",
    "expand_copy",
}


def _mode_class():
    if "mode" in _FAKE:
        return _FAKE["mode"]
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    Fake = _fake_class()
    aten = torch.ops.aten

    class TraceMode(TorchDispatchMode):
        def __init__(self, tracer):
            super().__init__()
            self.t = tracer

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            leaves, _ = tree_flatten((args, kwargs))
            fakes = [a for a in leaves if isinstance(a, Fake)]
            name = func.overloadpacket.__name__
            mutated = _mutated_arg(func, args)
            if mutated is not None and not isinstance(mutated, Fake):
                owner = self.t.owner(mutated)
                if owner is not None:
                    return self.t.write(owner, func, name, args, kwargs, fakes)
                if fakes:
                    self.t.fail(None, fakes, f"{name}: a checkpoint tensor copied into a temporary")
                    return args[0]
            if not fakes:
                return func(*args, **kwargs)
            if mutated is not None:  # an in-place op on a fake checkpoint tensor itself
                raise Unexpressible(f"in-place {name} on a checkpoint tensor")
            if func.is_view and isinstance(args[0], Fake) and (name != "view" or _same_dtype(args)):
                f = args[0]
                sub = tree_map(lambda a: a.idx if isinstance(a, Fake) else a, (args, kwargs))
                out = func(*sub[0], **sub[1])
                return tree_map(lambda o: Fake(o, f.dtype, f.nid, f.why) if isinstance(o, torch.Tensor) else o, out)
            if name in _SAME:
                f = args[0]
                dt = kwargs.get("dtype") or (args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else f.dtype)
                if f.nid >= 0 and not f.idx.is_contiguous():  # a contiguous copy of a strided view
                    return Fake(_ids(f), dt, -1)
                if f.nid == -2:
                    return Fake(torch.empty(tuple(f.shape), dtype=dt, device="meta"), dt, -2, f.why)
                return Fake(f.idx, dt, f.nid, f.why)
            if name in _GATHER:
                dt = fakes[0].dtype
                sub = tree_map(lambda a: _ids(a) if isinstance(a, Fake) else a, (args, kwargs))
                out = func(*sub[0], **sub[1])
                return tree_map(lambda o: Fake(o, dt, -1) if isinstance(o, torch.Tensor) else o, out)
            if func in (aten.is_same_size.default, aten.is_contiguous.default):
                return func(*tree_map(lambda a: a.idx if isinstance(a, Fake) else a, args))
            return self.t.computed(func, args, kwargs, fakes)

    _FAKE["mode"] = TraceMode
    return TraceMode


def _same_dtype(args) -> bool:
    torch = _torch()
    return not (len(args) > 1 and isinstance(args[1], torch.dtype) and args[1] != args[0].dtype)


def _mutated_arg(func, args):
    """The tensor an op writes (its first mutable argument), or None for a functional op."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(args):
            return args[i]
    return None


class Tracer:
    """One trace: the parameters' storages, the checkpoint tensors, and what was recorded."""

    def __init__(self, model, checkpoint):
        torch = _torch()
        self.torch = torch
        self.tensors = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.tensors.setdefault(id(p), (n, p))
        for n, b in model.named_buffers(remove_duplicate=False):
            self.tensors.setdefault(id(b), ("buffer:" + n, b))
        self.by_storage = {}
        for n, t in self.tensors.values():
            if t.device.type == "meta" or t.numel() == 0:
                continue
            self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((n, t))
        self.ckpt = list(checkpoint)
        self.nid = {n: i for i, (n, _, _) in enumerate(self.ckpt)}
        self.runs: dict[str, list] = {}
        self.const: dict[str, list] = {}
        self.problems: dict[str, list] = {}
        self.current = None

    def owner(self, t):
        """(name, parameter) whose storage `t` aliases, or None."""
        if t.device.type == "meta" or isinstance(t, _fake_class()):
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        cands = self.by_storage.get(ptr)
        if not cands:
            return None
        off = t.storage_offset() * t.element_size()
        for n, p in cands:
            base = p.storage_offset() * p.element_size()
            if base <= off < base + p.numel() * p.element_size():
                return n, p
        return cands[0]

    def computed(self, func, args, kwargs, fakes):
        """A value computed from checkpoint tensors (arithmetic...): its shape from the op on meta
        tensors, and why it cannot be expressed, said against the parameter it is written into."""
        torch = self.torch
        Fake = _fake_class()
        from torch.utils._pytree import tree_map

        names = sorted({self.ckpt[f.nid][0] for f in fakes if f.nid >= 0} | {f.why or "" for f in fakes if f.nid < 0})
        why = f"written from {func} computed from checkpoint tensor(s) {', '.join(n for n in names if n)}"

        def meta(a):
            if isinstance(a, Fake):
                return torch.empty(tuple(a.shape), dtype=a.dtype, device="meta")
            return a.to("meta") if isinstance(a, torch.Tensor) else a

        try:
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        except Exception as e:  # noqa: BLE001 -- the op has no meta kernel
            raise Unexpressible(f"{why} ({type(e).__name__} on meta tensors)") from e
        return tree_map(lambda o: Fake(o, o.dtype, -2, why) if isinstance(o, torch.Tensor) else o, out)

    def fail(self, pname, fakes, why):
        names = sorted({self.ckpt[f.nid][0] for f in fakes if f.nid >= 0}) or [self.current or "?"]
        key = pname or ("checkpoint:" + ",".join(names))
        self.problems.setdefault(key, []).append(f"{why} (checkpoint {', '.join(names)})")

    def write(self, owner, func, name, args, kwargs, fakes):
        pname, p = owner
        dst = args[0]
        Fake = _fake_class()
        if name == "copy_" and isinstance(args[1], Fake) and len(fakes) == 1:
            try:
                self._copy(pname, p, dst, args[1])
            except Unexpressible as e:
                self.fail(pname, fakes, str(e))
            return dst
        val = args[1] if name == "fill_" and len(args) > 1 else 0.0
        if name in ("fill_", "zero_") and not fakes and not isinstance(val, self.torch.Tensor):
            self.const.setdefault(pname, []).append((_dst_elements(p, dst), float(val)))
            return dst
        if name == "index_put_" and isinstance(args[2], Fake):
            try:
                self._index_put(pname, p, dst, args[1], args[2])
            except Unexpressible as e:
                self.fail(pname, fakes, str(e))
            return dst
        what = "from a checkpoint tensor" if fakes else "from a value that is not a checkpoint tensor"
        self.fail(pname, fakes, f"{name} writes it {what}")
        return dst

    def _copy(self, pname, p, dst, src):
        if src.nid == -2:
            raise Unexpressible(src.why)
        if dst.dtype != p.dtype:
            raise Unexpressible(f"copy_ into a {dst.dtype} view of a {p.dtype} parameter")
        shape = tuple(dst.shape)
        base = dst.storage_offset() - p.storage_offset()
        dstr = tuple(dst.stride())
        if src.nid >= 0:
            m = src.idx.expand(shape) if tuple(src.idx.shape) != shape else src.idx
            runs = _strided_runs(shape, base, dstr, m.storage_offset(), tuple(m.stride()))
            d, s, n = runs
            s = s + (src.nid << SHIFT)
        else:
            ids = src.idx.expand(shape).contiguous().numpy().reshape(-1)
            d = _dst_elements(p, dst)
            s = ids
            n = np.ones_like(d)
        self.runs.setdefault(pname, []).append((d, s, n))

    def _index_put(self, pname, p, dst, indices, src):
        torch = self.torch
        pos = torch.from_numpy(_dst_elements(p, dst)).view(tuple(dst.shape))
        d = pos[tuple(indices)]
        s = _ids(src).expand(tuple(d.shape)).contiguous()
        d, s = d.reshape(-1).numpy(), s.reshape(-1).numpy()
        self.runs.setdefault(pname, []).append((d, s, np.ones_like(d)))

    def run(self, model):
        """Feed the fake checkpoint through `model.load_weights`; a checkpoint tensor whose load
        raises is reported by name and the load goes on with the next one."""
        torch = self.torch
        Fake = _fake_class()
        mode = _mode_class()(self)
        todo = list(range(len(self.ckpt)))
        while todo:
            done = []

            def gen():
                for i in todo:
                    n, shape, dtype = self.ckpt[i]
                    self.current = n
                    done.append(i)
                    meta = torch.empty(tuple(shape), dtype=_dtype(dtype), device="meta")
                    yield n, Fake(meta, _dtype(dtype), i)

            try:
                with torch.no_grad(), mode:
                    model.load_weights(gen())
                todo = []
            except Exception as e:  # noqa: BLE001 -- reported by name, the rest goes on
                bad = done[-1] if done else todo[0]
                self.problems.setdefault("checkpoint:" + self.ckpt[bad][0], []).append(
                    f"load_weights raised {type(e).__name__}: {str(e)[:300]}"
                )
                todo = todo[todo.index(bad) + 1 :]


def _dtype(name):
    torch = _torch()
    return getattr(torch, str(name).replace("torch.", ""))


def _dst_elements(p, dst):
    """The parameter elements (flat, row-major) `dst` (a view of p's storage) covers, in dst's
    order: offset + sum(index x stride), as many as dst has (never the whole parameter)."""
    out = np.array([dst.storage_offset() - p.storage_offset()], np.int64)
    for n, st in zip(dst.shape, dst.stride()):
        out = (out[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    return out


def _strided_runs(shape, doff, dstr, soff, sstr):
    """(dst starts, src starts, lengths) of copying a strided source view into a strided
    destination view of the same shape: dims of size 1 dropped, adjacent dims merged where both
    sides are contiguous across them, the innermost dim a run when both have stride 1."""
    dims = [(n, a, b) for n, a, b in zip(shape, dstr, sstr) if n != 1]
    if any(n == 0 for n in shape):
        e = np.zeros(0, np.int64)
        return e, e, e
    merged = []
    for n, a, b in dims:
        if merged and merged[-1][1] == a * n and merged[-1][2] == b * n:
            m = merged.pop()
            merged.append((m[0] * n, a, b))
        else:
            merged.append((n, a, b))
    L = 1
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        L = merged.pop()[0]
    d = np.array([doff], np.int64)
    s = np.array([soff], np.int64)
    for n, a, b in merged:
        k = np.arange(n, dtype=np.int64)
        d = (d[:, None] + k[None, :] * a).reshape(-1)
        s = (s[:, None] + k[None, :] * b).reshape(-1)
    return d, s, np.full(d.shape, L, np.int64)


def trace_load(model, checkpoint, rank: int = 0, where: str = "") -> TracedMap:
    """The destination map of `model` (anything with ``load_weights`` and parameters) for the
    checkpoint tensors `checkpoint` [(name, shape, dtype)]: see the module docstring."""
    t0 = time.perf_counter()
    tr = Tracer(model, checkpoint)
    tr.run(model)
    params = {}
    for n, p in tr.tensors.values():
        params[n] = (tuple(p.shape), str(p.dtype).replace("torch.", ""))
    runs = {}
    for n, parts in tr.runs.items():
        d = np.concatenate([x[0] for x in parts])
        s = np.concatenate([x[1] for x in parts])
        ln = np.concatenate([x[2] for x in parts])
        runs[n] = compress_runs(d, s, ln)
    const = {n: [(np.unique(el), v) for el, v in parts] for n, parts in tr.const.items()}
    m = TracedMap(
        rank=rank,
        sources={n: (tuple(s), str(dt).replace("torch.", "")) for n, s, dt in tr.ckpt},
        params=params,
        runs=runs,
        const=const,
        problems={k: v for k, v in tr.problems.items()},
    )
    m.check_coverage()
    m.seconds = time.perf_counter() - t0
    m.where = where
    return m


def checkpoint_of_dir(path: str):
    """[(name, shape, dtype)] of the safetensors files in the HF directory `path`, from their
    headers only (the first 8 bytes give the header's length; no tensor data is read)."""
    import glob
    import json
    import os
    import struct

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"wxfer trace: no *.safetensors in {path!r}")
    out = []
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn"}
    names.update({"I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64", "BOOL": "bool"})
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                raise ValueError(f"wxfer trace: {f}: safetensors header of {n} bytes")
            hdr = json.loads(fh.read(n))
        for k, v in hdr.items():
            if k == "__metadata__":
                continue
            out.append((k, tuple(v["shape"]), names.get(v["dtype"], v["dtype"].lower())))
    return out


def fp8_checkpoint_names(checkpoint, fp8_weights, block: int = 128):
    """An FP8 block checkpoint's entries for a BF16 one: each weight of `fp8_weights` stored as
    float8_e4m3fn with ``<name>_scale_inv`` [ceil(rows/128), ceil(cols/128)] float32 (what vLLM's
    loader of such a checkpoint reads)."""
    out = []
    for n, shape, dt in checkpoint:
        if n in fp8_weights and len(shape) == 2:
            out.append((n, shape, "float8_e4m3fn"))
            out.append((n + "_scale_inv", (math.ceil(shape[0] / block), math.ceil(shape[1] / block)), "float32"))
        else:
            out.append((n, shape, dt))
    return out


def trace_model(model, checkpoint, rank: int = 0, where: str = "") -> TracedMap:
    """`trace_load`, and for a model with float8_e4m3fn parameters whose checkpoint lists no
    ``*_scale_inv`` (a BF16 checkpoint's names): traced again over the FP8 block checkpoint's
    names, the weights that landed in float8 parameters quantized."""
    m = trace_load(model, checkpoint, rank, where)
    fp8 = {n for n, (s, d) in m.params.items() if d == "float8_e4m3fn"}
    if not fp8 or any(n.endswith("_scale_inv") for n, _, _ in checkpoint):
        return m
    q = m.sources_into(fp8)
    return trace_load(model, fp8_checkpoint_names(checkpoint, q), rank, where)
