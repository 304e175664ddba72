"""A destination map traced from an inference engine's own loader, as plain data, and the plan's
``Shard`` / ``Piece`` form built from it (issue 34.1).

``TracedMap`` (one inference rank): for every parameter the loader writes, runs
``(destination element, source global id, length)`` in int64 numpy arrays, where a global id is
``checkpoint number << SHIFT | element`` (row-major elements of the checkpoint tensor); constant
regions (``fill_`` at load: vocab padding); and the writes the tracer could not express, by name.
A parameter whose checkpoint part is whole rows of one range and whose rest is constant (the
padded vocabulary rows) is written as that window only (``window`` / ``dest_shape``): the worker
registers the rows the checkpoint fills and the padding stays as vLLM's loader left it.
It is made by ``wxfer.integrations.vllm.trace`` on a worker, travels as ``to_bytes()`` with its
``digest()`` (SHA-256 of those canonical bytes: names, shapes, dtypes and every run), and on the
trainers ``traced_preset({rank: map})`` turns the maps into a ``Preset`` whose single rule
(``Traced``) expands into the same ``DestParam`` / ``Component`` / ``Shard`` objects the
hand-written rules produce, so the planner and the engine are unchanged.

Sources address as in the rules: a 1-D checkpoint tensor by elements ``Piece(src, e0, e1)``, any
other as the 2-D matrix ``[prod(shape[:-1]), shape[-1]]``.  A parameter of float8_e4m3fn written
from a float8 checkpoint tensor ``X`` becomes ``fp8`` shards of ``X`` (the trainer quantizes its
BF16 ``X``); the float32 parameter written from ``X_scale_inv`` becomes ``scale`` shards of the same
pieces, checked element by element against the traced scale runs.  numpy only; no torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from .rules import BLOCK, Component, DestParam, MappingError, Piece, Rule, Shard, _check_fp8_piece, cdiv, dtype_size

SHIFT = 40
MASK = (1 << SHIFT) - 1
FORMAT = 1


def compress_runs(d, s, n):
    """(dst starts, src starts, lengths) sorted by destination, adjacent runs that continue on
    both sides merged."""
    d, s, n = (np.asarray(x, np.int64) for x in (d, s, n))
    if not len(d):
        return d, s, n
    o = np.argsort(d, kind="stable")
    d, s, n = d[o], s[o], n[o]
    brk = np.ones(len(d), bool)
    brk[1:] = (d[:-1] + n[:-1] != d[1:]) | (s[:-1] + n[:-1] != s[1:])
    starts = np.flatnonzero(brk)
    return d[starts], s[starts], np.add.reduceat(n, starts)


def _b64(a) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, "<i8").tobytes(), 6)).decode()


def _unb64(s: str):
    return np.frombuffer(zlib.decompress(base64.b64decode(s)), "<i8").astype(np.int64)


@dataclass(eq=False)  # numpy arrays inside: compared by digest()
class TracedMap:
    rank: int
    sources: dict  # checkpoint name -> (shape, dtype), in checkpoint order (ids index it)
    params: dict  # parameter name -> (shape, dtype): every parameter and buffer of the model
    runs: dict  # parameter name -> (dst starts, src global ids, lengths)
    const: dict = field(default_factory=dict)  # parameter -> [(elements, value)]
    problems: dict = field(default_factory=dict)  # parameter (or "checkpoint:<name>") -> [why]
    seconds: float = 0.0
    where: str = ""

    # ---- facts
    def names(self) -> list[str]:
        return list(self.sources)

    def src_name(self, gid: int) -> str:
        return self.names()[int(gid) >> SHIFT]

    def written(self) -> list[str]:
        """The parameters written from the checkpoint (those the plan fills)."""
        return [n for n in self.params if n in self.runs]

    def sources_into(self, params) -> set:
        names = self.names()
        out: set = set()
        for p in params:
            if p in self.runs:
                out.update(names[i] for i in np.unique(self.runs[p][1] >> SHIFT))
        return out

    def numel(self, p: str) -> int:
        return math.prod(self.params[p][0])

    def window(self, p: str):
        """(first, end) elements of the part of `p` the checkpoint fills where the rest is set to
        a constant at load (vocab padding: the rows past the vocabulary); None when the
        checkpoint fills all of it.  Raises MappingError where that part is not whole rows of one
        contiguous range (the plan writes it as a parameter of its own shape)."""
        if not self.const.get(p):
            return None
        d, _, n = self.runs[p]
        a, b = int(d[0]), int(d[-1] + n[-1])
        shape = self.params[p][0]
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        if int(n.sum()) != b - a or a % row or b % row:
            raise MappingError(f"{p}: the checkpoint fills elements [{a}, {b}) in part or not in whole rows")
        return a, b

    def dest_shape(self, p: str) -> tuple:
        """The shape the plan writes in `p`: its own, or its window's rows."""
        shape = tuple(self.params[p][0])
        w = self.window(p)
        if w is None:
            return shape
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        return ((w[1] - w[0]) // row,) + shape[1:]

    def check_coverage(self) -> None:
        """Adds a problem for a parameter written twice at one element, or written in part with
        elements neither the checkpoint nor a constant fills, or with a constant region the plan
        cannot leave out (not rows past one contiguous written window)."""
        for p, (d, _, n) in self.runs.items():
            if len(d) > 1 and np.any(d[:-1] + n[:-1] > d[1:]):
                self.problems.setdefault(p, []).append("some elements are written twice by the loader")
            covered = int(n.sum())
            const = sum(len(el) for el, _ in self.const.get(p, []))
            for el, _ in self.const.get(p, []):
                i = np.searchsorted(d, el, "right") - 1
                if np.any((i >= 0) & (el < d[np.maximum(i, 0)] + n[np.maximum(i, 0)])):
                    self.problems.setdefault(p, []).append(
                        "the loader sets elements to a constant that it also writes from the checkpoint"
                    )
                    break
            if covered + const < self.numel(p):
                self.problems.setdefault(p, []).append(
                    f"{self.numel(p) - covered - const} of {self.numel(p)} elements written by no checkpoint tensor"
                )
            if const:
                try:
                    self.window(p)
                except MappingError as e:
                    self.problems.setdefault(p, []).append(
                        f"{const} element(s) set to a constant at load and {e}: the plan cannot leave them out"
                    )

    def elements(self, p: str):
        """(destination elements, source global ids) of parameter `p`, one per element."""
        d, s, n = self.runs[p]
        if not len(d):
            e = np.zeros(0, np.int64)
            return e, e
        rep = np.repeat(np.arange(len(d)), n)
        off = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        return d[rep] + off, s[rep] + off

    # ---- travel
    def to_bytes(self) -> bytes:
        doc = dict(
            format=FORMAT,
            rank=self.rank,
            sources=[[n, list(s), dt] for n, (s, dt) in self.sources.items()],
            params=[[n, list(s), dt] for n, (s, dt) in self.params.items()],
            runs={p: [_b64(a) for a in r] for p, r in sorted(self.runs.items())},
            const={p: [[_b64(el), v] for el, v in c] for p, c in sorted(self.const.items())},
            problems={k: list(v) for k, v in sorted(self.problems.items())},
        )
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """SHA-256 of `to_bytes()` (the content: every name, shape, dtype and run), computed once."""
        if "_digest" not in self.__dict__:
            self.__dict__["_digest"] = hashlib.sha256(self.to_bytes()).hexdigest()
        return self.__dict__["_digest"]

    def __repr__(self) -> str:
        return f"TracedMap(rank={self.rank}, params={len(self.runs)}, sha256={self.digest()})"

    @classmethod
    def from_bytes(cls, data: bytes, digest: str | None = None, where: str = "a traced map") -> "TracedMap":
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"wxfer: {where}: its bytes do not match their digest {digest[:12]}")
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"wxfer: {where}: format {doc.get('format')!r}, this wxfer reads {FORMAT}")
        return cls(
            rank=int(doc["rank"]),
            sources={n: (tuple(s), dt) for n, s, dt in doc["sources"]},
            params={n: (tuple(s), dt) for n, s, dt in doc["params"]},
            runs={p: tuple(_unb64(a) for a in r) for p, r in doc["runs"].items()},
            const={p: [(_unb64(el), v) for el, v in c] for p, c in doc["const"].items()},
            problems=doc["problems"],
        )


# --------------------------------------------------------------------------- runs -> pieces


def _grid(shape) -> tuple[int, int]:
    """(rows, cols) a source is addressed as; cols 0 for a 1-D (or 0-D) source."""
    if len(shape) <= 1:
        return (shape[0] if shape else 1), 0
    return math.prod(shape[:-1]), shape[-1]


def _run_pieces(src: str, shape, e: int, L: int) -> list[Piece]:
    rows, cols = _grid(shape)
    if not cols:
        return [Piece(src, e, e + L)]
    out = []
    while L > 0:
        r, c = divmod(e, cols)
        if c or L < cols:
            k = min(L, cols - c)
            out.append(Piece(src, r, r + 1, c, c + k))
        else:
            k = (L // cols) * cols
            out.append(Piece(src, r, r + k // cols, 0, cols))
        e, L = e + k, L - k
    return out


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if q is not None and q.src == p.src and q.c1 and (q.c0, q.c1) == (p.c0, p.c1) and q.r1 == p.r0:
            out[-1] = Piece(q.src, q.r0, p.r1, q.c0, q.c1)
        elif q is not None and q.src == p.src and not q.c1 and not p.c1 and q.r1 == p.r0:
            out[-1] = Piece(q.src, q.r0, p.r1)
        else:
            out.append(p)
    return out


def _regions(m: TracedMap, p: str):
    """[(first element, [Piece])] per maximal contiguous destination region of `p`."""
    d, s, n = m.runs[p]
    names = m.names()
    out: list = []
    for i in range(len(d)):
        src = names[int(s[i]) >> SHIFT]
        ps = _run_pieces(src, m.sources[src][0], int(s[i]) & MASK, int(n[i]))
        if out and out[-1][1] == int(d[i]):
            out[-1][2].extend(ps)
            out[-1][1] += int(n[i])
        else:
            out.append([int(d[i]), int(d[i]) + int(n[i]), ps])
    return [(a, _merge(ps)) for a, _, ps in out]


def _scale_ids(m: TracedMap, pieces) -> np.ndarray:
    """Global ids, in the scale parameter's order, of the block scales of `pieces` (each on its
    own grid, which is the checkpoint's grid where it starts on a block boundary)."""
    ids = []
    for pc in pieces:
        sname = pc.src + "_scale_inv"
        if sname not in m.sources:
            raise MappingError(f"{pc.src}: FP8 weight without {sname} in the checkpoint")
        scols = _grid(m.sources[sname][0])[1] or 1
        rb = np.arange(cdiv(pc.rows, BLOCK)) + pc.r0 // BLOCK
        cb = np.arange(cdiv(pc.cols, BLOCK)) + pc.c0 // BLOCK
        ids.append(((rb[:, None] * scols + cb[None, :]).reshape(-1)) + (m.names().index(sname) << SHIFT))
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def rank_shards(m: TracedMap, skip=()) -> tuple[list[DestParam], list[Shard], list[str]]:
    """(destinations, shards, problems) of one rank's map; parameters in `skip` left out."""
    params, shards, problems = [], [], []
    scale_of = {}  # scale parameter -> weight parameter
    for p in m.written():
        if p in skip:
            continue
        if p in m.problems:
            problems += [f"{p} (rank {m.rank}): {w}" for w in m.problems[p]]
            continue
        shape, dt = m.params[p]
        srcs = m.sources_into([p])
        if dt == "float32" and srcs and all(s.endswith("_scale_inv") for s in srcs):
            scale_of[p] = srcs
            continue
        kind = "raw"
        if dt == "float8_e4m3fn":
            if not all(m.sources[s][1] == "float8_e4m3fn" for s in srcs):
                problems.append(f"{p} (rank {m.rank}): float8 parameter written from a non-FP8 checkpoint tensor")
                continue
            kind = "fp8"
        es = dtype_size(dt)
        params.append(DestParam(m.rank, p, m.dest_shape(p), dt))
        base = (m.window(p) or (0, 0))[0]  # the plan writes the window as its own parameter
        for first, pieces in _regions(m, p):
            first -= base
            n = sum(pc.numel() for pc in pieces)
            if kind == "fp8":
                for i, pc in enumerate(pieces):
                    try:
                        _check_fp8_piece(pc, tuple(m.sources[pc.src][0]), i == len(pieces) - 1, p, 0)
                    except MappingError as e:
                        problems.append(f"{p} (rank {m.rank}): {e}")
            shards.append(Shard(m.rank, p, first * es, n * es, kind, dt, tuple(pieces)))
    fp8 = [sh for sh in shards if sh.kind == "fp8"]
    for sp, srcs in scale_of.items():
        weights = {s[: -len("_scale_inv")] for s in srcs}
        mine = [sh for sh in fp8 if {pc.src for pc in sh.pieces} <= weights]
        dst, ids = m.elements(sp)
        where = {int(g): int(e) for e, g in zip(dst, ids)}
        shape, dt = m.params[sp]
        params.append(DestParam(m.rank, sp, tuple(shape), dt))
        done = 0
        for sh in mine:
            want = _scale_ids(m, sh.pieces)
            at = where.get(int(want[0])) if len(want) else None
            got = None if at is None else np.array([where.get(int(g), -1) for g in want])
            if at is None or got is None or not np.array_equal(got, np.arange(at, at + len(want))):
                problems.append(
                    f"{sp} (rank {m.rank}): the scales vLLM's loader lays are not those of {sh.dst}'s pieces"
                )
                break
            shards.append(Shard(m.rank, sp, at * 4, len(want) * 4, "scale", "float32", sh.pieces))
            done += len(want)
        else:
            if done != math.prod(shape):
                left = math.prod(shape) - done
                problems.append(f"{sp} (rank {m.rank}): {left} scale element(s) not of any FP8 piece")
    return params, shards, problems


def _components(shards: list[Shard]) -> list[Component]:
    """Shards grouped by shared sources (union-find): each training tensor in one component."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for sh in shards:
        key = "dst:" + sh.dst
        for pc in sh.pieces:
            a, b = find(key), find("src:" + pc.src)
            if a != b:
                parent[a] = b
    groups: dict[str, list[Shard]] = {}
    for sh in shards:
        groups.setdefault(find("dst:" + sh.dst), []).append(sh)
    out = []
    for g in groups.values():
        srcs = tuple(dict.fromkeys(pc.src for sh in g for pc in sh.pieces))
        out.append(Component(srcs, g, None, g[0].dst))
    return out


@dataclass(eq=False)
class Traced(Rule):
    """The rule of a traced preset: every destination of every rank, from the workers' maps."""

    maps: dict = field(default_factory=dict)  # inference rank -> TracedMap
    skip: tuple = ()

    def bindings(self, names):
        return [{}]

    def __repr__(self) -> str:  # what mapping digests hash: the maps' content digests, never their arrays
        maps = ", ".join(f"{r}: {self.maps[r].digest()}" for r in sorted(self.maps))
        return f"Traced(maps={{{maps}}}, skip={self.skip!r})"

    def expand(self, b, ctx):
        tp = ctx.layout.tp
        if sorted(self.maps) != list(range(tp)):
            raise MappingError(f"traced map: ranks {sorted(self.maps)} but the inference layout has TP={tp}")
        params, shards, problems = [], [], []
        for r in range(tp):
            p, s, pr = rank_shards(self.maps[r], self.skip)
            params += p
            shards += s
            problems += pr
        for sh in shards:
            for pc in sh.pieces:
                want = self.maps[sh.rank].sources[pc.src][0]
                have = ctx.shapes.get(pc.src)
                if have is None:
                    problems.append(f"{sh.dst}: the training model lacks checkpoint tensor {pc.src} (shape {want})")
                elif tuple(have) != tuple(want):
                    problems.append(f"{pc.src}: training shape {tuple(have)}, the checkpoint vLLM traced {tuple(want)}")
        if problems:
            raise MappingError("traced map:\n  " + "\n  ".join(sorted(set(problems))[:40]))
        return params, _components(shards)


def traced_preset(maps: dict, name: str = "traced", config: dict | None = None, skip=()):
    """A ``Preset`` whose one rule expands the workers' traced maps ({inference rank: map})."""
    from .presets import Preset

    quant = "fp8" if any(dt == "float8_e4m3fn" for m in maps.values() for _, dt in m.params.values()) else None
    return Preset(name, "traced", [Traced("", (), maps=dict(maps), skip=tuple(skip))], dict(config or {}), quant=quant)


# --------------------------------------------------------------------------- element maps (tests)


def shard_elements(sh: Shard, shapes: dict):
    """(destination elements, source names array, source elements) of one shard: what every
    element of its region holds, from the pieces (scales: the piece's block on the source's grid,
    named ``<source>_scale_inv``)."""
    dst, names, srcs = [], [], []
    es = 4 if sh.kind == "scale" else dtype_size(sh.dtype)
    pos = sh.offset // es
    for pc in sh.pieces:
        rows, cols = _grid(shapes[pc.src])
        if sh.kind == "scale":
            scols = cdiv(cols, BLOCK)
            rb = np.arange(cdiv(pc.rows, BLOCK)) + pc.r0 // BLOCK
            cb = np.arange(cdiv(pc.cols, BLOCK)) + pc.c0 // BLOCK
            e = (rb[:, None] * scols + cb[None, :]).reshape(-1)
            nm = pc.src + "_scale_inv"
        elif cols:
            e = (np.arange(pc.r0, pc.r1)[:, None] * cols + np.arange(pc.c0, pc.c1)[None, :]).reshape(-1)
            nm = pc.src
        else:
            e = np.arange(pc.r0, pc.r1)
            nm = pc.src
        dst.append(np.arange(pos, pos + len(e)))
        names.append(np.full(len(e), nm, dtype=object))
        srcs.append(e)
        pos += len(e)
    return np.concatenate(dst), np.concatenate(names), np.concatenate(srcs)


def element_table(shards, shapes: dict) -> dict:
    """(rank, destination) -> sorted list of (element, source name, source element, kind, dtype)."""
    out: dict = {}
    for sh in shards:
        d, nm, e = shard_elements(sh, shapes)
        kind = "scale" if sh.kind == "scale" else "data"
        out.setdefault((sh.rank, sh.dst), []).extend(zip(d.tolist(), nm.tolist(), e.tolist(), [kind] * len(d)))
    return {k: sorted(v) for k, v in out.items()}
