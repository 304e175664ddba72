"""Compact, versioned binary form of a plan (handed from the controller to every rank).

Layout (little endian)::

    b"WXPLAN" | u16 version | u32 compressed length | u32 crc32 of the compressed bytes
    zlib( u32 header length | header (UTF-8 JSON: scalars, name tables, array directory)
          | the arrays, back to back, raw little-endian int64 / uint8 )

Decoding never trusts its input: a wrong magic, version, length, checksum, JSON, array
size or an index out of range raises ValueError.  It inflates the body piece by piece, each
piece no larger than what the part already read declares (the header length, then each
array's size) and the whole no larger than body_cap() of the compressed length, so a small
blob cannot make it allocate more than about MAX_RATIO times its own size.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import cast

import numpy as np

from ..mapping import Piece, Shard
from .core import KINDS, TRANSFER_COLUMNS, Plan, Task

MAGIC = b"WXPLAN"
VERSION = 1
_HEAD = struct.Struct("<6sHII")
# The plan's scalars, first in the header, in this order.
_SCALARS = ("tp", "replicas", "quant", "ep", "train_world", "preset", "build_s")
MAX_PAYLOAD = 1 << 32
MAX_RATIO = 128
DTYPES = ("float8_e4m3fn", "bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64")


def encode(plan: Plan) -> bytes:
    src_names = list(plan.train_params)
    src_id = {n: i for i, n in enumerate(src_names)}
    for t in plan.tasks:
        for s in t.sources:
            if s not in src_id:
                src_id[s] = len(src_names)
                src_names.append(s)
    name_id = {n: i for i, n in enumerate(plan.names)}
    arrays: dict[str, np.ndarray] = {}
    arrays["task_src_start"] = np.cumsum([0] + [len(t.sources) for t in plan.tasks]).astype(np.int64)
    arrays["task_src"] = np.array([src_id[s] for t in plan.tasks for s in t.sources], np.int64)
    arrays["task_shard_start"] = np.cumsum([0] + [len(t.shards) for t in plan.tasks]).astype(np.int64)
    shards = [s for t in plan.tasks for s in t.shards]
    sh = np.array(
        [
            (s.rank, name_id[s.dst], s.offset, s.nbytes, KINDS.index(s.kind), DTYPES.index(s.dtype), len(s.pieces))
            for s in shards
        ],
        np.int64,
    ).reshape(-1, 7)
    arrays["shard"] = sh.reshape(-1)
    arrays["piece"] = np.array(
        [(src_id[p.src], p.r0, p.r1, p.c0, p.c1) for s in shards for p in s.pieces], np.int64
    ).reshape(-1)
    for k in TRANSFER_COLUMNS:
        arrays["t_" + k] = np.asarray(getattr(plan, k), np.int64)
    arrays["dest_nbytes"] = plan.dest_nbytes.reshape(-1).astype(np.int64)
    arrays["gpu_of"] = plan.gpu_of.reshape(-1).astype(np.int64)
    descs = sorted(plan.descriptors.items())
    arrays["desc_key"] = np.array([(g, name_id.get(n, -1)) for (g, n), _ in descs], np.int64).reshape(-1)
    arrays["desc_len"] = np.array([len(d) for _, d in descs], np.int64)
    arrays["desc_blob"] = np.frombuffer(b"".join(d for _, d in descs), np.uint8)
    header = {k: getattr(plan, k) for k in _SCALARS}
    header.update(
        names=plan.names,
        src_names=src_names,
        n_train_params=len(plan.train_params),
        train_params=[[list(v[0]), v[1]] for v in plan.train_params.values()],
        ignored=plan.ignored,
        meshes=[list(m) for m in plan.meshes],
        groups=plan.groups,
        mesh_tasks=[plan.mesh_tasks[m] for m in range(len(plan.meshes))],
        tasks=[[t.name, t.mesh, t.group, t.src_bytes] for t in plan.tasks],
        arrays=[[k, "u1" if v.dtype == np.uint8 else "i8", int(v.size)] for k, v in arrays.items()],
    )
    hj = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(
        [struct.pack("<I", len(hj)), hj]
        + [np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")).tobytes() for v in arrays.values()]
    )
    comp = zlib.compress(body, 1)
    if len(body) > body_cap(len(comp)):  # what decode() would refuse: say so here, by the sizes
        raise ValueError(
            f"plan encoding: {len(body)} bytes compress to {len(comp)}, beyond the "
            f"{body_cap(len(comp))} bytes decode() accepts for that size"
        )
    return _HEAD.pack(MAGIC, VERSION, len(comp), zlib.crc32(comp)) + comp


def _fail(msg):
    raise ValueError(f"invalid plan bytes: {msg}")


def body_cap(ncomp: int) -> int:
    """The most bytes a plan of `ncomp` compressed bytes may inflate to: MAX_RATIO times
    that plus 1 MiB (a real plan inflates 18-29x: Kimi-K2 at 256 -> 128 GPUs, 28x), and
    never more than MAX_PAYLOAD, so a small hostile blob cannot claim gigabytes."""
    return min(MAX_PAYLOAD, MAX_RATIO * int(ncomp) + (1 << 20))


def decode(data: bytes) -> Plan:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"plan must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEAD.size:
        _fail(f"{len(data)} bytes is shorter than the {_HEAD.size}-byte header")
    magic, ver, n, crc = _HEAD.unpack_from(data)
    if magic != MAGIC:
        _fail("bad magic (not a wxfer plan)")
    if ver != VERSION:
        _fail(f"version {ver}, this wxfer reads version {VERSION}")
    comp = data[_HEAD.size :]
    if len(comp) != n:
        _fail(f"truncated or padded: {len(comp)} payload bytes, header says {n}")
    if zlib.crc32(comp) != crc:
        _fail("checksum mismatch")
    try:
        inf = _Inflater(comp)
        h, arrs = _read_body(inf)
        inf.finish()
        return _build(h, arrs)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- any structural problem is a ValueError
        raise ValueError(f"invalid plan bytes: {type(e).__name__}: {e}") from None


class _Inflater:
    """The body, inflated piece by piece: each piece only as large as the part already read
    declares, the whole no larger than body_cap() of the compressed size."""

    def __init__(self, comp: bytes):
        self.d = zlib.decompressobj()
        self.tail = comp
        self.ncomp = len(comp)
        self.cap = body_cap(len(comp))
        self.n = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.n + n > self.cap:
            _fail(
                f"{what} declares {n} bytes: the body would exceed {self.cap} bytes "
                f"({MAX_RATIO}x its {self.ncomp} compressed bytes plus 1 MiB)"
            )
        out = self.d.decompress(self.tail, n) if n else b""
        self.tail = self.d.unconsumed_tail
        if len(out) != n:
            _fail(f"{what}: the body ends after {len(out)} of the {n} bytes declared")
        self.n += n
        return out

    def finish(self) -> None:
        if self.d.decompress(self.tail, 1) or not self.d.eof or self.d.unused_data:
            _fail("trailing bytes after the arrays (or the payload does not decompress cleanly)")


def _read_body(inf: _Inflater) -> tuple[dict, dict]:
    (hl,) = struct.unpack("<I", inf.take(4, "the header length"))
    h = json.loads(inf.take(hl, "the header").decode())
    if not isinstance(h, dict):
        _fail("header is not an object")
    arrs = {}
    for k, dt, cnt in h["arrays"]:
        dtype = cast(np.dtype, {"u1": np.dtype("<u1"), "i8": np.dtype("<i8")}[dt])
        if not isinstance(cnt, int) or cnt < 0:
            _fail(f"array {k} has size {cnt!r}")
        raw = inf.take(cnt * dtype.itemsize, f"array {k}")
        arrs[k] = np.frombuffer(raw, dtype, cnt).astype(dtype.newbyteorder("="))
    return h, arrs


def _build(h: dict, arrs: dict) -> Plan:
    tp, R, world = int(h["tp"]), int(h["replicas"]), int(h["train_world"])
    names, src_names = list(h["names"]), list(h["src_names"])
    N, S = len(names), len(src_names)
    if tp < 1 or R < 1 or world < 1:
        _fail("non-positive sizes")
    meshes = [tuple(int(r) for r in m) for m in h["meshes"]]
    for m in meshes:
        if not m or min(m) < 0 or max(m) >= world:
            _fail("mesh rank out of range")
    tasks = _tasks(h, arrs, names, src_names, tp, len(meshes))
    T, shs = len(tasks), arrs["task_shard_start"]
    groups = [[int(m) for m in g] for g in h["groups"]]
    if sorted(m for g in groups for m in g) != list(range(len(meshes))):
        _fail("groups do not partition the meshes")
    mesh_tasks = {m: [int(t) for t in lst] for m, lst in enumerate(h["mesh_tasks"])}
    if len(mesh_tasks) != len(meshes) or sorted(t for l in mesh_tasks.values() for t in l) != list(range(T)):
        _fail("mesh task lists do not partition the tasks")
    cols = {k: arrs["t_" + k] for k in TRANSFER_COLUMNS}
    n = cols["sender"].size
    if any(v.size != n for v in cols.values()):
        _fail("transfer columns differ in length")
    if n:
        nsh = np.diff(shs)
        for k, hi in (("sender", world), ("task", T), ("replica", R), ("infer_rank", tp), ("dst", N)):
            if cols[k].min() < 0 or cols[k].max() >= hi:
                _fail(f"transfer {k} out of range")
        if (cols["shard"] < 0).any() or (cols["shard"] >= nsh[cols["task"]]).any():
            _fail("transfer shard out of range")
    dest_nbytes = arrs["dest_nbytes"]
    gpu_of = arrs["gpu_of"]
    if dest_nbytes.size != tp * N or gpu_of.size != R * tp:
        _fail("table sizes do not match tp/replicas/names")
    tpn = h["train_params"]
    if len(tpn) != int(h["n_train_params"]) or len(tpn) > S:
        _fail("training parameter table size")
    train_params = {src_names[i]: (tuple(int(x) for x in v[0]), str(v[1])) for i, v in enumerate(tpn)}
    descriptors = _descriptors(arrs, names)
    return Plan(
        tp=tp,
        replicas=R,
        quant=h["quant"],
        ep=bool(h["ep"]),
        train_world=world,
        meshes=meshes,
        groups=groups,
        mesh_tasks=mesh_tasks,
        tasks=tasks,
        names=names,
        dest_nbytes=dest_nbytes.reshape(tp, N),
        gpu_of=gpu_of.reshape(R, tp),
        **cols,
        train_params=train_params,
        ignored=[str(x) for x in h["ignored"]],
        descriptors=descriptors,
        build_s=float(h["build_s"]),
        preset=str(h["preset"]),
    )


def _tasks(h: dict, arrs: dict, names: list, src_names: list, tp: int, nmesh: int) -> list:
    N, S = len(names), len(src_names)
    T = len(h["tasks"])
    tss, ts = arrs["task_src_start"], arrs["task_src"]
    shs = arrs["task_shard_start"]
    sh = arrs["shard"].reshape(-1, 7)
    pc = arrs["piece"].reshape(-1, 5)
    _mono(tss, T, ts.size, "task sources")
    _mono(shs, T, sh.shape[0], "task shards")
    if ts.size and (ts.min() < 0 or ts.max() >= S):
        _fail("source index out of range")
    if sh.size and (
        sh[:, 0].min() < 0
        or sh[:, 0].max() >= tp
        or sh[:, 1].min() < 0
        or sh[:, 1].max() >= N
        or sh[:, 4].min() < 0
        or sh[:, 4].max() >= len(KINDS)
        or sh[:, 5].min() < 0
        or sh[:, 5].max() >= len(DTYPES)
        or sh[:, 6].min() < 0
    ):
        _fail("shard field out of range")
    if int(sh[:, 6].sum()) != pc.shape[0]:
        _fail("piece count mismatch")
    if pc.size and (pc[:, 0].min() < 0 or pc[:, 0].max() >= S):
        _fail("piece source out of range")
    pstart = np.r_[0, np.cumsum(sh[:, 6])]
    tasks = []
    shard_list = []
    for i, (rk, dn, off, nb, kd, dt, _) in enumerate(sh.tolist()):
        ps = tuple(Piece(src_names[a], b, c, d, e) for a, b, c, d, e in pc[pstart[i] : pstart[i + 1]].tolist())
        shard_list.append(Shard(rk, names[dn], off, nb, KINDS[kd], DTYPES[dt], ps))
    for i, (name, mesh, group, sb) in enumerate(h["tasks"]):
        if not 0 <= int(mesh) < nmesh:
            _fail("task mesh out of range")
        tasks.append(
            Task(
                i,
                str(name),
                tuple(src_names[j] for j in ts[tss[i] : tss[i + 1]]),
                int(mesh),
                int(group),
                int(sb),
                shard_list[shs[i] : shs[i + 1]],
            )
        )
    return tasks


def _descriptors(arrs: dict, names: list) -> dict:
    N = len(names)
    dk, dl, blob = arrs["desc_key"].reshape(-1, 2), arrs["desc_len"], arrs["desc_blob"]
    if dk.shape[0] != dl.size or int(dl.sum()) != blob.size or (dl < 0).any():
        _fail("descriptor table sizes")
    descriptors = {}
    p = 0
    for (g, nid), ln in zip(dk.tolist(), dl.tolist()):
        if not 0 <= nid < N:
            _fail("descriptor name out of range")
        descriptors[(g, names[nid])] = blob[p : p + ln].tobytes()
        p += ln
    return descriptors


def _mono(starts, count, total, what):
    if starts.size != count + 1 or starts[0] != 0 or starts[-1] != total or (np.diff(starts) < 0).any():
        _fail(f"{what} offsets are inconsistent")
