"""Declarative rules mapping training (Hugging Face) parameters to the inference layout.

A rule names its destination parameter and its source parameters with templates in
which ``{L}`` stands for a layer index and ``{E}`` for an expert index.  Expanding a
rule against the training metadata (names and global shapes) and an inference layout
(TP size, expert parallelism) yields, for every inference rank, the destination
parameters it owns and the *shards* that fill them.  A shard is one contiguous byte
region of one destination parameter on one inference rank, and the recipe that
produces its bytes from the full training tensors: an ordered tuple of `Piece`s
(2-D slices of sources) concatenated along rows, each cast or FP8-quantized.

Nothing here touches a GPU or torch; `wxfer.mapping.reference` turns a shard recipe
into bytes with torch ops.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

BLOCK = 128  # FP8 block size (rows and columns) of weight_scale_inv

DTYPE_SIZE = {
    "float8_e4m3fn": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


class MappingError(ValueError):
    """A mapping rule cannot be applied (wrong shapes, forbidden FP8 split...)."""


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZE[dtype]
    except KeyError:
        raise MappingError(f"unsupported dtype {dtype!r}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Piece(NamedTuple):
    """Rows [r0, r1) and columns [c0, c1) of source `src` (c0 = c1 = 0 for 1-D sources)."""

    src: str
    r0: int
    r1: int
    c0: int = 0
    c1: int = 0

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0

    def numel(self) -> int:
        return self.rows * (self.cols if self.c1 else 1)

    def scale_nbytes(self) -> int:
        """Bytes of this piece's float32 block scales (its own BLOCK x BLOCK grid)."""
        return cdiv(self.rows, BLOCK) * cdiv(self.cols, BLOCK) * 4


class Shard(NamedTuple):
    """One contiguous byte region of destination parameter `dst` on inference rank `rank`.

    kind: "raw" (cast to `dtype`), "fp8" (e4m3 bytes, each piece quantized on its own
    128x128 grid) or "scale" (the float32 weight_scale_inv rows of the same pieces).
    The bytes are the pieces' bytes concatenated in order (row-major).
    """

    rank: int
    dst: str
    offset: int
    nbytes: int
    kind: str
    dtype: str
    pieces: tuple[Piece, ...]


class Sized:
    """A parameter description with `shape` and `dtype`: its size in bytes."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class DestParam(Sized):
    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Component:
    """Training sources that must be prepared together, and the shards they produce."""

    sources: tuple[str, ...]
    shards: list[Shard]
    merge_key: object = None  # components with equal key on one mesh may merge into one task
    rule: str = ""


@dataclass(frozen=True)
class Layout:
    """Inference layout of one replica: TP size and whether experts are expert-parallel.

    expert_group: routed experts are emitted in components of this many consecutive
    experts (those a training mesh holds together), with their shards already merged;
    it changes no byte, only how many objects the expansion builds."""

    tp: int = 1
    ep: bool = False
    quant: str | None = None  # "fp8" or None (BF16)
    expert_group: int = 1


def scale_name(weight_name: str) -> str:
    return weight_name + "_scale_inv" if weight_name.endswith("weight") else weight_name + ".weight_scale_inv"


def _compile(template: str) -> re.Pattern:
    pat = re.escape(template)
    pat = pat.replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(pat + r"\Z")


def _suffix(template: str) -> str:
    """The literal tail of a template (after its last placeholder): a cheap pre-filter."""
    i = max(template.rfind("}"), -1)
    return template[i + 1 :]


def _fmt(template: str, b: Mapping[str, str]) -> str:
    return template.replace("{L}", b.get("L", "{L}")).replace("{E}", b.get("E", "{E}"))


class _Ctx:
    """Expansion context: shapes of training params, layout, config."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], layout: Layout, config: Mapping):
        self.shapes = shapes
        self.layout = layout
        self.config = config

    def shape(self, name: str, rule: str) -> tuple[int, ...]:
        try:
            return tuple(self.shapes[name])
        except KeyError:
            raise MappingError(f"rule {rule}: training parameter {name!r} is missing") from None


def _check_fp8_piece(p: Piece, full: tuple[int, ...], last: bool, dst: str, tp: int) -> None:
    """vLLM's rule: every split or fused boundary of an FP8 weight falls on a 128 boundary.

    Only the last piece of a destination may end on a partial block, and only where it
    ends the source too (no split)."""
    what = f"FP8 weight {p.src} -> {dst} with TP={tp}"
    if p.r0 % BLOCK or (p.rows % BLOCK and not (last and p.r1 == full[0])):
        raise MappingError(
            f"cannot split {what}: its rows [{p.r0}, {p.r1}) are not whole {BLOCK}-row blocks "
            f"({p.rows} rows per rank); choose a TP size that splits it in {BLOCK}-row blocks, "
            f"expert parallelism, or BF16"
        )
    if len(full) == 2 and (p.c0 % BLOCK or (p.cols % BLOCK and p.c1 != full[1])):
        raise MappingError(
            f"cannot split {what}: its columns [{p.c0}, {p.c1}) are not whole {BLOCK}-column "
            f"blocks ({p.cols} columns per rank)"
        )


def _make_shards(
    rank: int, dst: str, pieces: list[Piece], fulls: list[tuple[int, ...]], quant: bool, dtype: str, tp: int
) -> list[Shard]:
    """Shards filling a whole 2-D/1-D destination (and its scale) from `pieces`."""
    ncols = pieces[0].cols if pieces[0].c1 else 0
    if quant:
        for i, (p, f) in enumerate(zip(pieces, fulls)):
            _check_fp8_piece(p, f, i == len(pieces) - 1, dst, tp)
        rows = sum(p.rows for p in pieces)
        srows = sum(cdiv(p.rows, BLOCK) for p in pieces)
        return [
            Shard(rank, dst, 0, rows * ncols, "fp8", "float8_e4m3fn", tuple(pieces)),
            Shard(rank, scale_name(dst), 0, srows * cdiv(ncols, BLOCK) * 4, "scale", "float32", tuple(pieces)),
        ]
    n = sum(p.numel() for p in pieces)
    return [Shard(rank, dst, 0, n * dtype_size(dtype), "raw", dtype, tuple(pieces))]


@dataclass
class Rule:
    """Base class. `dst` and `srcs` are templates with {L} (layer) and {E} (expert)."""

    dst: str
    srcs: tuple[str, ...] = ()
    fp8: bool = True  # quantized to FP8 when the layout says quant="fp8" and it is 2-D
    dtype: str = "bfloat16"  # destination dtype when not quantized

    def anchors(self) -> tuple[str, ...]:
        return self.srcs[:1]

    def bindings(self, names: Iterable[str]) -> list[dict[str, str]]:
        pat = _compile(self.anchors()[0])
        tail = _suffix(self.anchors()[0])
        seen, out = set(), []
        for n in names:
            if not n.endswith(tail):
                continue
            m = pat.match(n)
            if m:
                key = m.group("L") if "L" in pat.groupindex else ""
                if key not in seen:
                    seen.add(key)
                    out.append(m.groupdict())
        out.sort(key=lambda b: int(b.get("L", 0) or 0))
        return out

    def source_templates(self) -> tuple[str, ...]:
        return self.srcs

    def expand(self, b: dict, ctx: _Ctx) -> tuple[list[DestParam], list[Component]]:  # pragma: no cover
        raise NotImplementedError


@dataclass
class Fuse(Rule):
    """Destination = sources concatenated along dim 0 ([q | k | v], [gate | up], ...).

    tp=True: column parallel -- every part is split over the TP ranks along dim 0 and each
    rank holds [part0_r | part1_r | ...].  `heads` gives, per part, the config key of its
    head count (e.g. "num_key_value_heads"); when TP exceeds that count, heads are
    replicated (rank r holds head r * heads // tp).  tp=False: replicated on every rank.
    A single source with tp=True is a plain column-parallel (or vocab-parallel) weight.
    """

    tp: bool = True
    heads: tuple[str | None, ...] = ()

    def expand(self, b, ctx):
        tp = ctx.layout.tp if self.tp else 1
        nranks = ctx.layout.tp
        srcs = [_fmt(s, b) for s in self.srcs]
        dst = _fmt(self.dst, b)
        fulls = [ctx.shape(s, dst) for s in srcs]
        ndim = len(fulls[0])
        if any(len(f) != ndim or (ndim == 2 and f[1] != fulls[0][1]) for f in fulls):
            raise MappingError(f"{dst}: sources {srcs} have incompatible shapes {fulls}")
        quant = ctx.layout.quant == "fp8" and self.fp8 and ndim == 2
        ncols = fulls[0][1] if ndim == 2 else 0
        params, shards = [], []
        for r in range(nranks):
            pieces = []
            for i, (s, f) in enumerate(zip(srcs, fulls)):
                hkey = self.heads[i] if i < len(self.heads) else None
                r0, r1 = _split_rows(f[0], r if self.tp else 0, tp, ctx.config.get(hkey) if hkey else None, s)
                pieces.append(Piece(s, r0, r1, 0, ncols))
            rows = sum(p.rows for p in pieces)
            shape = (rows, ncols) if ndim == 2 else (rows,)
            if quant:
                params.append(DestParam(r, dst, shape, "float8_e4m3fn"))
                params.append(
                    DestParam(
                        r, scale_name(dst), (sum(cdiv(p.rows, BLOCK) for p in pieces), cdiv(ncols, BLOCK)), "float32"
                    )
                )
            else:
                params.append(DestParam(r, dst, shape, self.dtype))
            shards += _make_shards(r, dst, pieces, fulls, quant, self.dtype, tp)
        return params, [Component(tuple(srcs), shards, None, dst)]


def _split_rows(n: int, r: int, tp: int, heads: int | None, src: str) -> tuple[int, int]:
    if tp == 1:
        return 0, n
    if heads:
        if n % heads:
            raise MappingError(f"{src}: {n} rows not divisible by {heads} heads")
        hd = n // heads
        if tp <= heads:
            if heads % tp:
                raise MappingError(f"{src}: {heads} heads cannot be split over TP={tp}")
            k = heads // tp
            return r * k * hd, (r + 1) * k * hd
        if tp % heads:
            raise MappingError(f"{src}: TP={tp} is not a multiple of its {heads} heads")
        h = r * heads // tp
        return h * hd, (h + 1) * hd
    if n % tp:
        raise MappingError(f"{src}: dim 0 of size {n} is not divisible by TP={tp}")
    k = n // tp
    return r * k, (r + 1) * k


@dataclass
class Row(Rule):
    """Row parallel: split dim 1 of one 2-D source over the TP ranks (o_proj, down_proj)."""

    def expand(self, b, ctx):
        tp = ctx.layout.tp
        src = _fmt(self.srcs[0], b)
        dst = _fmt(self.dst, b)
        full = ctx.shape(src, dst)
        if len(full) != 2 or full[1] % tp:
            raise MappingError(f"{src}: shape {full} cannot be split along dim 1 over TP={tp}")
        quant = ctx.layout.quant == "fp8" and self.fp8
        k = full[1] // tp
        params, shards = [], []
        for r in range(tp):
            p = Piece(src, 0, full[0], r * k, (r + 1) * k)
            if quant:
                _check_fp8_piece(p, full, True, dst, tp)
                params.append(DestParam(r, dst, (full[0], k), "float8_e4m3fn"))
                params.append(DestParam(r, scale_name(dst), (cdiv(full[0], BLOCK), cdiv(k, BLOCK)), "float32"))
                shards.append(Shard(r, dst, 0, full[0] * k, "fp8", "float8_e4m3fn", (p,)))
                shards.append(
                    Shard(r, scale_name(dst), 0, cdiv(full[0], BLOCK) * cdiv(k, BLOCK) * 4, "scale", "float32", (p,))
                )
            else:
                es = dtype_size(self.dtype)
                params.append(DestParam(r, dst, (full[0], k), self.dtype))
                shards.append(Shard(r, dst, 0, full[0] * k * es, "raw", self.dtype, (p,)))
        return params, [Component((src,), shards, None, dst)]


def _expert_split(prefix: str, E: int, inter: int, tp: int, ep: bool) -> tuple[int, int]:
    """(experts per rank, intermediate rows per rank) of one layer's routed experts."""
    if ep:
        if E % tp:
            raise MappingError(f"{prefix}: {E} experts cannot be split over EP={tp}")
        return E // tp, inter
    if inter % tp:
        raise MappingError(f"{prefix}: intermediate size {inter} not divisible by TP={tp}")
    return E, inter // tp


def _expert_params(prefix: str, tp: int, el: int, ir: int, hidden: int, quant: bool, wdt: str) -> list[DestParam]:
    w13, w2 = prefix + ".w13_weight", prefix + ".w2_weight"
    params = []
    for r in range(tp):
        params.append(DestParam(r, w13, (el, 2 * ir, hidden), wdt))
        params.append(DestParam(r, w2, (el, hidden, ir), wdt))
        if quant:
            params.append(DestParam(r, scale_name(w13), (el, cdiv(2 * ir, BLOCK), cdiv(hidden, BLOCK)), "float32"))
            params.append(DestParam(r, scale_name(w2), (el, cdiv(hidden, BLOCK), cdiv(ir, BLOCK)), "float32"))
    return params


def _expert_shards(per_rank: dict, prefix: str, ir: int, hidden: int, quant: bool, wdt: str) -> list[Shard]:
    """Shards of w13 / w2 (and their scales) from per_rank[r] = [(local expert, gate piece,
    up piece, down piece), ...]: one shard per run of consecutive local experts."""
    w13, w2 = prefix + ".w13_weight", prefix + ".w2_weight"
    w13s, w2s = scale_name(w13), scale_name(w2)
    es = 1 if quant else dtype_size(wdt)
    s13 = (cdiv(2 * ir, BLOCK) * cdiv(hidden, BLOCK) * 4) if quant else 0
    s2 = (cdiv(hidden, BLOCK) * cdiv(ir, BLOCK) * 4) if quant else 0
    n13, n2 = 2 * ir * hidden, hidden * ir
    shards: list[Shard] = []
    for r, items in per_rank.items():
        i = 0
        while i < len(items):  # runs of consecutive local experts
            j = i + 1
            while j < len(items) and items[j][0] == items[j - 1][0] + 1:
                j += 1
            run = items[i:j]
            le, n = run[0][0], len(run)
            p13 = tuple(p for it in run for p in (it[1], it[2]))
            p2 = tuple(it[3] for it in run)
            if quant:
                shards += [
                    Shard(r, w13, le * n13, n * n13, "fp8", wdt, p13),
                    Shard(r, w13s, le * s13, n * s13, "scale", "float32", p13),
                    Shard(r, w2, le * n2, n * n2, "fp8", wdt, p2),
                    Shard(r, w2s, le * s2, n * s2, "scale", "float32", p2),
                ]
            else:
                shards += [
                    Shard(r, w13, le * n13 * es, n * n13 * es, "raw", wdt, p13),
                    Shard(r, w2, le * n2 * es, n * n2 * es, "raw", wdt, p2),
                ]
            i = j
    return shards


def _check_fp8_experts(srcs, inter: int, hidden: int, ir: int, c0: int, prefix: str, tp: int) -> None:
    """The FP8 rule for one expert's slices (every expert has the same shapes and slices);
    srcs: the names of the gate, up and down sources of expert 0, for the message."""
    g = Piece(srcs[0], c0, c0 + ir, 0, hidden)
    u = Piece(srcs[1], c0, c0 + ir, 0, hidden)
    d = Piece(srcs[2], 0, hidden, c0, c0 + ir)
    _check_fp8_piece(g, (inter, hidden), False, prefix + ".w13_weight", tp)
    _check_fp8_piece(u, (inter, hidden), True, prefix + ".w13_weight", tp)
    _check_fp8_piece(d, (hidden, inter), True, prefix + ".w2_weight", tp)


def _ranks_of_expert(e: int, el: int, ir: int, tp: int, ep: bool):
    """(rank, local expert index, first intermediate row) for each rank holding expert e."""
    if ep:
        return [(e // el, e - (e // el) * el, 0)]
    return [(r, e, r * ir) for r in range(tp)]


@dataclass
class Experts(Rule):
    """Routed experts of one layer, one parameter per expert and projection (transformers 4:
    ``mlp.experts.{E}.gate_proj.weight``), into vLLM's fused-MoE tensors.

    srcs = (gate, up, down) templates with {L} and {E}; dst = prefix such as
    "model.layers.{L}.mlp.experts" giving "<prefix>.w13_weight" [local experts,
    2 x inter, hidden] ([gate | up] per expert) and "<prefix>.w2_weight" [local experts,
    hidden, inter].  With expert parallelism (Layout.ep) rank r holds experts
    [r*E/tp, (r+1)*E/tp) whole; otherwise every rank holds every expert, sliced along
    the intermediate dimension.
    """

    n_experts_key: str = "n_routed_experts"

    def bindings(self, names):
        pat = _compile(self.srcs[0])
        tail = _suffix(self.srcs[0])
        groups: dict[str, set[int]] = {}
        for n in names:
            if not n.endswith(tail):
                continue
            m = pat.match(n)
            if m:
                groups.setdefault(m.group("L"), set()).add(int(m.group("E")))
        return [{"L": L, "_experts": sorted(es)} for L, es in sorted(groups.items(), key=lambda kv: int(kv[0]))]

    def expand(self, b, ctx):
        tp, ep = ctx.layout.tp, ctx.layout.ep
        experts = b["_experts"]
        E = int(ctx.config.get(self.n_experts_key, ctx.config.get("num_local_experts", len(experts))))
        prefix = _fmt(self.dst, b)
        if experts != list(range(E)):
            raise MappingError(f"{prefix}: found experts {experts[:4]}... but config says {E}")
        inter, hidden = ctx.shape(_fmt(self.srcs[0], {**b, "E": "0"}), prefix)
        quant = ctx.layout.quant == "fp8" and self.fp8
        el, ir = _expert_split(prefix, E, inter, tp, ep)
        if quant:
            for r in range(1 if ep else tp):
                _check_fp8_experts(
                    [_fmt(x, {**b, "E": "0"}) for x in self.srcs], inter, hidden, ir, r * ir, prefix, 1 if ep else tp
                )
        wdt = "float8_e4m3fn" if quant else self.dtype
        params = _expert_params(prefix, tp, el, ir, hidden, quant, wdt)
        g = max(1, int(ctx.layout.expert_group))
        comps = []
        for gs in range(0, len(experts), g):
            names: list[str] = []
            per_rank: dict[int, list] = {}
            for e in experts[gs : gs + g]:
                gate, up, down = (_fmt(s, {**b, "E": str(e)}) for s in self.srcs)
                for s, want in ((gate, (inter, hidden)), (up, (inter, hidden)), (down, (hidden, inter))):
                    if ctx.shape(s, prefix) != want:
                        raise MappingError(f"{s}: shape {ctx.shape(s, prefix)} but expected {want}")
                names += (gate, up, down)
                for r, le, c0 in _ranks_of_expert(e, el, ir, tp, ep):
                    per_rank.setdefault(r, []).append(
                        (
                            le,
                            Piece(gate, c0, c0 + ir, 0, hidden),
                            Piece(up, c0, c0 + ir, 0, hidden),
                            Piece(down, 0, hidden, c0, c0 + ir),
                        )
                    )
            shards = _expert_shards(per_rank, prefix, ir, hidden, quant, wdt)
            comps.append(Component(tuple(names), shards, ("experts", prefix), prefix))
        return params, comps


@dataclass
class FusedExperts(Rule):
    """Routed experts of one layer stored as two 3-D parameters (transformers 5:
    ``mlp.experts.gate_up_proj`` [E, 2 x inter, hidden], [gate | up] per expert, and
    ``mlp.experts.down_proj`` [E, hidden, inter]; FSDP2 shards them along dim 0, the
    experts), into the same vLLM tensors as `Experts`, byte for byte.

    srcs = (gate_up, down) templates with {L}.  A piece addresses a source as the 2-D
    matrix [E x rows, cols] (expert e's rows follow expert e-1's), so expert e's gate is
    rows [e*2*inter, e*2*inter + inter) of gate_up; FP8 quantizes each piece, i.e. each
    expert's slice, on its own 128x128 grid."""

    n_experts_key: str = "n_routed_experts"

    def expand(self, b, ctx):
        tp, ep = ctx.layout.tp, ctx.layout.ep
        prefix = _fmt(self.dst, b)
        gu, dn = (_fmt(s, b) for s in self.srcs)
        sg, sd = ctx.shape(gu, prefix), ctx.shape(dn, prefix)
        if len(sg) != 3 or sg[1] % 2:
            raise MappingError(f"{gu}: shape {sg}, expected [experts, 2 x intermediate, hidden]")
        E, inter, hidden = sg[0], sg[1] // 2, sg[2]
        if sd != (E, hidden, inter):
            raise MappingError(f"{dn}: shape {sd} but expected {(E, hidden, inter)} (from {gu} {sg})")
        want = int(ctx.config.get(self.n_experts_key, ctx.config.get("num_local_experts", E)))
        if want != E:
            raise MappingError(f"{gu}: {E} experts but config says {self.n_experts_key}={want}")
        quant = ctx.layout.quant == "fp8" and self.fp8
        el, ir = _expert_split(prefix, E, inter, tp, ep)
        if quant:
            for r in range(1 if ep else tp):
                _check_fp8_experts(
                    (gu + " (gate)", gu + " (up)", dn), inter, hidden, ir, r * ir, prefix, 1 if ep else tp
                )
        wdt = "float8_e4m3fn" if quant else self.dtype
        per_rank: dict[int, list] = {}
        for e in range(E):
            g0, d0 = e * 2 * inter, e * hidden
            for r, le, c0 in _ranks_of_expert(e, el, ir, tp, ep):
                per_rank.setdefault(r, []).append(
                    (
                        le,
                        Piece(gu, g0 + c0, g0 + c0 + ir, 0, hidden),
                        Piece(gu, g0 + inter + c0, g0 + inter + c0 + ir, 0, hidden),
                        Piece(dn, d0, d0 + hidden, c0, c0 + ir),
                    )
                )
        shards = _expert_shards(per_rank, prefix, ir, hidden, quant, wdt)
        return (
            _expert_params(prefix, tp, el, ir, hidden, quant, wdt),
            [Component((gu, dn), shards, ("experts", prefix), prefix)],
        )


@dataclass
class Ignore(Rule):
    """Training parameters (templates in srcs, with {L} / {E}) deliberately not sent:
    ``Ignore("", ("model.layers.{L}.mlp.my_probe.weight",))``."""

    def bindings(self, names):
        return []


@dataclass
class Expanded:
    """Result of applying a mapping to training metadata for one inference layout."""

    layout: Layout
    dest: dict[int, dict[str, DestParam]]  # rank -> name -> param (ordered)
    components: list[Component]
    used: set[str]
    ignored: set[str]
    unmatched: list[str]  # training params no rule used nor ignored
    errors: list[str] = field(default_factory=list)

    def dest_bytes(self, rank: int | None = None) -> int:
        ranks = self.dest if rank is None else [rank]
        return sum(p.nbytes for r in ranks for p in self.dest[r].values())


def each_rule(
    rules: Sequence[Rule], shapes: Mapping[str, tuple[int, ...]], layout: Layout, config: Mapping
) -> Iterable[tuple[Rule, list[DestParam], list[Component], list[str], list[str]]]:
    """Each rule of `rules` applied alone to training params `shapes` (name -> global shape):
    (rule, its destinations, its components, the errors it raised, the training names it
    ignores (an Ignore rule's; [] for others)), with no check across rules (``expand`` does
    those).  What a digest of the rules' content hashes (wxfer.runtime.digest)."""
    ctx = _Ctx(shapes, layout, config)
    names = list(shapes)
    for rule in rules:
        params: list[DestParam] = []
        comps: list[Component] = []
        errors: list[str] = []
        ignored: list[str] = []
        if isinstance(rule, Ignore):
            pats = [_compile(t) for t in rule.srcs]
            ignored = [n for n in names if any(p.match(n) for p in pats)]
        for ps, cs in _applied(rule, names, ctx, errors):
            params += ps
            comps += cs
        yield rule, params, comps, errors, ignored


def _applied(rule: Rule, names: list, ctx, errors: list):
    """(destinations, components) of `rule` at each of its bindings over `names`; a binding it
    cannot expand adds its MappingError's text to `errors` instead."""
    for b in rule.bindings(names):
        try:
            yield rule.expand(b, ctx)
        except MappingError as e:
            errors.append(str(e))


def expand(
    rules: Sequence[Rule],
    shapes: Mapping[str, tuple[int, ...]],
    layout: Layout,
    config: Mapping,
    ignore: Iterable[str] = (),
    strict: bool = True,
) -> Expanded:
    """Apply `rules` to training params `shapes` (name -> global shape).

    Raises MappingError (listing every problem by name) when a rule cannot be applied,
    and (strict, the default) when a training parameter is read by no rule and listed by
    no `Ignore` rule (nor matched by a regular expression of `ignore`): every byte of the
    training model is either sent or deliberately left out.  strict=False reports such
    parameters in `unmatched` instead, for a caller that collects every problem first
    (the plan builder does, then refuses them all at once).
    """
    ctx = _Ctx(shapes, layout, config)
    names = list(shapes)
    dest: dict[int, dict[str, DestParam]] = {r: {} for r in range(layout.tp)}
    comps: list[Component] = []
    used: set[str] = set()
    errors: list[str] = []
    ign_pats = [_compile(t) for r in rules if isinstance(r, Ignore) for t in r.srcs]
    ign_pats += [re.compile(p) for p in ignore]
    for rule in rules:
        for params, cs in _applied(rule, names, ctx, errors):
            for p in params:
                if p.name in dest[p.rank]:
                    errors.append(f"destination {p.name} (rank {p.rank}) produced by two rules")
                dest[p.rank][p.name] = p
            for c in cs:
                dup = used.intersection(c.sources)
                if dup:
                    errors.append(f"training parameter(s) {sorted(dup)} used by two rules")
                used.update(c.sources)
            comps += cs
    if errors:
        raise MappingError("mapping failed:\n  " + "\n  ".join(errors))
    ignored = {n for n in names if n not in used and any(p.match(n) for p in ign_pats)}
    unmatched = [n for n in names if n not in used and n not in ignored]
    if strict and unmatched:
        more = f" (and {len(unmatched) - 20} more)" if len(unmatched) > 20 else ""
        raise MappingError(
            f"{len(unmatched)} training parameter(s) read by no rule: {', '.join(unmatched[:20])}{more}; add a "
            f"rule that reads them, or an Ignore rule listing them to leave them out on purpose"
        )
    return Expanded(layout, dest, comps, used, ignored, unmatched)
