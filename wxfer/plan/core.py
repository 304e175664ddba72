"""Building the static plan: tasks, mesh groups, sender choice, per-rank order.

Vocabulary
- task: the training sources prepared together on one mesh (one ``full_tensor()`` per
  source on every rank of the mesh), and the destination shards they produce.
- mesh group: meshes that are pairwise disjoint run their tasks in parallel; all trainer
  ranks pass a barrier between groups, so collectives on overlapping meshes never
  interleave.
- transfer: one one-sided write: trainer rank, task, destination (replica, inference
  rank, parameter), byte offset and length in the destination, and source offset in
  the sender's packed buffer of that task.
"""

from __future__ import annotations

import heapq
import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..mapping import Expanded, Layout, Preset, Shard, expand
from ..mapping.rules import Component
from ..meta import InferWorker, TrainParam
from ..zerocopy import contiguous_range, whole_rows

KINDS = ("raw", "fp8", "scale")


class PlanError(ValueError):
    """The plan cannot be built or does not cover the destination; lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:200]
        more = f"\n  ... and {len(self.problems) - 200} more" if len(self.problems) > 200 else ""
        super().__init__(f"{len(self.problems)} problem(s):\n  " + "\n  ".join(shown) + more)


@dataclass
class Task:
    id: int
    name: str
    sources: tuple[str, ...]
    mesh: int  # index into Plan.meshes
    group: int = -1
    src_bytes: int = 0  # bytes of the full training tensors (what full_tensor() gathers)
    shards: list[Shard] = field(default_factory=list)


# The transfer table: one int64 numpy column per field of Plan (below), in this order.
TRANSFER_COLUMNS = ("sender", "task", "shard", "replica", "infer_rank", "dst", "dst_offset", "nbytes", "src_offset")


@dataclass
class Plan:
    """The static schedule.  Transfer columns are numpy arrays sorted by (sender, order)."""

    tp: int
    replicas: int
    quant: str | None
    ep: bool
    train_world: int
    meshes: list[tuple[int, ...]]
    groups: list[list[int]]  # group -> mesh ids
    mesh_tasks: dict[int, list[int]]  # mesh -> ordered task ids (within its group)
    tasks: list[Task]
    names: list[str]  # destination parameter name table
    dest_nbytes: np.ndarray  # [tp, len(names)] bytes of each dest param per rank (-1 absent)
    gpu_of: np.ndarray  # [replicas, tp] global inference GPU index
    # transfers
    sender: np.ndarray
    task: np.ndarray
    shard: np.ndarray  # index into task.shards
    replica: np.ndarray
    infer_rank: np.ndarray
    dst: np.ndarray  # index into names
    dst_offset: np.ndarray
    nbytes: np.ndarray
    src_offset: np.ndarray
    train_params: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    descriptors: dict[tuple[int, str], bytes] = field(default_factory=dict)  # (gpu, name) -> bytes
    build_s: float = 0.0
    preset: str = ""

    # ---------------------------------------------------------------- views
    @property
    def n_transfers(self) -> int:
        return int(self.sender.size)

    @property
    def gpu(self) -> np.ndarray:
        return self.gpu_of[self.replica, self.infer_rank]

    @property
    def infer_gpus(self) -> int:
        return self.replicas * self.tp

    def bytes_per_train_rank(self) -> np.ndarray:
        return np.bincount(self.sender, weights=self.nbytes, minlength=self.train_world)

    def bytes_per_infer_gpu(self) -> np.ndarray:
        return np.bincount(self.gpu, weights=self.nbytes, minlength=int(self.gpu_of.max()) + 1)

    def bytes_per_replica(self) -> int:
        return int(self.dest_nbytes[self.dest_nbytes > 0].sum())

    def rank_schedule(self, rank: int) -> list[list[tuple[int, np.ndarray]]]:
        """For each mesh group, the ordered (task id, transfer indices sent by `rank`) that
        `rank` takes part in (it joins full_tensor() of every task of its mesh even when
        it sends nothing).  A barrier follows every group."""
        out = []
        sel = np.flatnonzero(self.sender == rank)
        by_task: dict[int, np.ndarray] = {}
        if sel.size:
            t = self.task[sel]
            cuts = np.flatnonzero(np.diff(t)) + 1
            for chunk in np.split(sel, cuts):
                by_task[int(self.task[chunk[0]])] = chunk
        for g in self.groups:
            lst = []
            for m in g:
                if rank in self.meshes[m]:
                    lst = [(t, by_task.get(t, np.empty(0, np.int64))) for t in self.mesh_tasks[m]]
                    break
            out.append(lst)
        return out

    def transfer(self, i: int) -> dict:
        """One transfer as a dict (for humans and tests)."""
        return dict(
            sender=int(self.sender[i]),
            task=int(self.task[i]),
            replica=int(self.replica[i]),
            infer_rank=int(self.infer_rank[i]),
            gpu=int(self.gpu[i]),
            dst=self.names[self.dst[i]],
            dst_offset=int(self.dst_offset[i]),
            nbytes=int(self.nbytes[i]),
            src_offset=int(self.src_offset[i]),
        )

    def packed_shards(self, rank: int, task: int) -> list[tuple[int, Shard]]:
        """(src offset, shard) of the packed buffer `rank` prepares for `task`."""
        sel = np.flatnonzero((self.sender == rank) & (self.task == task))
        seen: dict[int, int] = {}
        for i in sel:
            seen.setdefault(int(self.src_offset[i]), int(self.shard[i]))
        return [(off, self.tasks[task].shards[s]) for off, s in sorted(seen.items())]

    # notebook helpers live in wxfer.plan.notebook; serialization in wxfer.plan.serialize
    def to_bytes(self) -> bytes:
        from .serialize import encode

        return encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> "Plan":
        from .serialize import decode

        return decode(data)

    def check(self, workers: Sequence[InferWorker] | None = None, raise_: bool = True) -> list[str]:
        from .check import check_coverage

        problems = check_coverage(self, workers)
        if problems and raise_:
            raise PlanError(problems)
        return problems

    def check_deadlock_free(self) -> None:
        from .check import check_deadlock_free

        check_deadlock_free(self)

    def simulate(self, cluster):
        from .simulate import simulate

        return simulate(self, cluster)

    def summary(self) -> dict:
        from .notebook import summary

        return summary(self)

    def to_pandas(self):
        from .notebook import to_pandas

        return to_pandas(self)

    def tasks_frame(self):
        from .notebook import tasks_frame

        return tasks_frame(self)

    def _repr_html_(self) -> str:
        from .notebook import repr_html

        return repr_html(self)

    def plot_bytes(self, ax=None):
        from .notebook import plot_bytes

        return plot_bytes(self, ax)

    def __repr__(self) -> str:
        return (
            f"<Plan {self.preset or ''} tasks={len(self.tasks)} transfers={self.n_transfers} "
            f"groups={len(self.groups)} trainers={self.train_world} infer={self.replicas}x{self.tp}>"
        )


# ---------------------------------------------------------------------------- build


def _merge_shards(shards: list[Shard]) -> list[Shard]:
    """Merge shards that are adjacent in the same destination (consecutive experts)."""
    groups: dict[tuple, list[Shard]] = {}
    for sh in shards:
        groups.setdefault((sh.rank, sh.dst, sh.kind, sh.dtype), []).append(sh)
    out: list[Shard] = []
    for key in sorted(groups, key=lambda k: (k[0], k[1])):
        run = groups[key]
        if any(run[i].offset > run[i + 1].offset for i in range(len(run) - 1)):
            run = sorted(run, key=lambda x: x.offset)
        i = 0
        while i < len(run):
            j, end, pieces = i + 1, run[i].offset + run[i].nbytes, list(run[i].pieces)
            while j < len(run) and run[j].offset == end:
                end += run[j].nbytes
                pieces += run[j].pieces
                j += 1
            first = run[i]
            out.append(
                first
                if j == i + 1
                else Shard(
                    first.rank, first.dst, first.offset, end - first.offset, first.kind, first.dtype, tuple(pieces)
                )
            )
            i = j
    return out


def _deal(u_n: np.ndarray, ranks: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Sender of each unit: largest units first, each to the least loaded rank of the
    mesh (ties: the mesh order); once the ranks are level to within the next unit, the
    rest goes round robin (what the greedy rule does then anyway for equal units).
    Updates `load` in place."""
    o = np.argsort(-u_n, kind="stable")
    rk = ranks[np.argsort(load[ranks], kind="stable")]
    snd = np.empty(o.size, np.int64)
    m = rk.size
    if m == 1:
        snd[:] = rk[0]
        np.add.at(load, snd, u_n)
        return snd
    sizes = u_n[o].tolist()
    loc = load[rk].tolist()
    heap = [(v, i) for i, v in enumerate(loc)]
    heapq.heapify(heap)
    hi = max(loc)
    pick = np.empty(o.size, np.int64)
    k = 0
    n = len(sizes)
    while k < n:
        v, i = heap[0]
        if hi - v <= sizes[k] and all(x == sizes[k] for x in sizes[k : k + m]) and k + m <= n:
            break  # level: the next units go round robin
        heapq.heapreplace(heap, (v + sizes[k], i))
        hi = max(hi, v + sizes[k])
        pick[k] = i
        k += 1
    if k < n:
        order = [i for _, i in sorted(heap)]  # least loaded first
        pick[k:] = np.array(order, np.int64)[np.arange(n - k) % m]
    snd[o] = rk[pick]
    load += np.bincount(snd, u_n, load.size)
    return snd


def _src_offsets(snd, shard, sizes):
    """Offset of each unit's shard in its sender's packed buffer (each shard once, in
    order of first use)."""
    offs: dict = {}
    cur: dict = {}
    for s, sh in zip(snd, shard):
        k = (s, sh)
        v = offs.get(k)
        if v is None:
            v = cur.get(s, 0)
            offs[k] = v
            cur[s] = v + sizes[sh]
        yield v


def _packed_offsets(snd: np.ndarray, u_shard: np.ndarray, sb: np.ndarray) -> np.ndarray:
    if snd.size <= 256:
        return np.fromiter(_src_offsets(snd.tolist(), u_shard.tolist(), sb.tolist()), np.int64, snd.size)
    key = snd * sb.size + u_shard
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    fo = np.argsort(first)  # distinct (sender, shard) in order of first use
    sizes = sb[u_shard[first[fo]]]
    sfo = snd[first[fo]]
    cs = np.cumsum(sizes) - sizes
    newseg = np.concatenate(([True], sfo[1:] != sfo[:-1]))
    seg = np.cumsum(newseg) - 1
    off_u = np.empty(fo.size, np.int64)
    off_u[fo] = cs - cs[np.flatnonzero(newseg)][seg]
    return off_u[inv.reshape(-1)]


def _ag_nic_bytes(src_bytes: int, mesh: tuple[int, ...], gpus_per_node: int) -> float:
    """Bytes a ring all-gather puts on each rank's NIC (0 inside a node: NVLink)."""
    k = len(mesh)
    if k == 1 or len({r // gpus_per_node for r in mesh}) == 1:
        return 0.0
    return src_bytes * (k - 1) / k


def _mesh_options(comp_sources, params: Mapping[str, TrainParam]) -> tuple[tuple[int, ...], ...]:
    opts = None
    for s in comp_sources:
        m = set(params[s].meshes)
        opts = m if opts is None else opts & m
    return tuple(sorted(opts or ()))


_UNIT = re.compile(r"^(.*?\blayers\.\d+)\.")


def _unit_of(sources: Sequence[str]) -> str | None:
    """The FSDP2 ``fully_shard`` unit the sources belong to: the decoder layer prefix
    ``...layers.<L>`` shared by all of them, "" (the root unit) when none is in a layer,
    None when they span units."""
    units = set()
    for s in sources:
        m = _UNIT.match(s)
        units.add(m.group(1) if m else "")
    return units.pop() if len(units) == 1 else None


def _direct(c, params: Mapping[str, TrainParam], opts) -> bool:
    """A component whose bytes can be written from the training parameter's own memory
    (zero copy): one source, produced by one rank alone, every shard one contiguous byte
    range of it in its own dtype (wxfer.zerocopy.contiguous_range; any dimensionality).  Such a
    component stays a task of its own."""
    if len(c.sources) != 1 or not opts or any(len(m) != 1 for m in opts):
        return False
    src = c.sources[0]
    p = params[src]
    return all(contiguous_range(sh, src, p.shape, p.dtype) is not None for sh in c.shards)


_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def _split_direct(c, params: Mapping[str, TrainParam], opts):
    """A component of several sources whose raw shards are whole rows of their sources in
    the sources' own dtype (a BF16 fused qkv or gate_up, any TP; a layer's fused 3-D experts
    gate_up_proj and down_proj): one component per source, each shard cut where the source
    changes or its rows stop being contiguous (the same bytes at the same offsets), so that
    each is sent from its parameter's own memory, one write per contiguous range.  None when
    that does not apply."""
    if len(c.sources) < 2 or not opts or any(len(m) != 1 for m in opts):
        return None
    cuts: dict[str, list] = {}
    for sh in c.shards:
        off = sh.offset
        for pc in sh.pieces:
            src = params[pc.src]
            size = _ITEMSIZE.get(src.dtype)
            if sh.kind != "raw" or sh.dtype != src.dtype or size is None or not whole_rows(pc, src.shape):
                return None
            nb = pc.numel() * size
            lst = cuts.setdefault(pc.src, [])
            last = lst[-1] if lst else None
            if last is not None and last.offset + last.nbytes == off and last.dst == sh.dst and last.rank == sh.rank:
                if last.pieces[-1].r1 == pc.r0:  # the next rows of the same source: one range
                    lst[-1] = last._replace(nbytes=last.nbytes + nb, pieces=last.pieces + (pc,))
                    off += nb
                    continue
            lst.append(Shard(sh.rank, sh.dst, off, nb, "raw", sh.dtype, (pc,)))
            off += nb
        if off != sh.offset + sh.nbytes:
            return None
    return [Component((s,), cuts.get(s, []), None, c.rule) for s in c.sources]


def _grid(workers: Sequence[InferWorker]):
    """(sorted workers, tp, ep, replicas, gpu_of) of the inference side; PlanError on a hole
    or a disagreement."""
    workers = sorted(workers, key=lambda w: (w.replica, w.rank))
    if not workers:
        raise PlanError(["no inference workers"])
    tp, ep = workers[0].tp, workers[0].ep
    replicas = max(w.replica for w in workers) + 1
    problems = []
    gpu_of = np.full((replicas, tp), -1, np.int64)
    for w in workers:
        if w.tp != tp or w.ep != ep:
            problems.append(f"worker replica {w.replica} rank {w.rank}: tp={w.tp} ep={w.ep}, others tp={tp} ep={ep}")
            continue
        if not (0 <= w.rank < tp and w.replica >= 0):
            problems.append(f"worker replica {w.replica} rank {w.rank}: rank outside [0, {tp}) or negative replica")
            continue
        if gpu_of[w.replica, w.rank] >= 0:
            problems.append(f"two workers claim replica {w.replica} rank {w.rank}")
        assert w.gpu is not None  # InferWorker.__post_init__ sets it
        gpu_of[w.replica, w.rank] = w.gpu
    for rep, r in zip(*np.nonzero(gpu_of < 0)):
        problems.append(f"no worker for replica {rep} rank {r}")
    if problems:
        raise PlanError(problems)
    return workers, tp, ep, replicas, gpu_of


def _dest_tables(ex, workers, tp: int, problems: list, empty=frozenset()):
    """(names, name id, dest_nbytes [tp, names]); compares with what the workers hold.
    A parameter of no bytes that no rule reads (`empty`: training side) or writes (a
    worker's) has nothing to send: it is left out, not refused."""
    names = sorted({n for r in ex.dest for n in ex.dest[r]})
    name_id = {n: i for i, n in enumerate(names)}
    dest_nbytes = np.full((tp, len(names)), -1, np.int64)
    for r, d in ex.dest.items():
        for n, p in d.items():
            dest_nbytes[r, name_id[n]] = p.nbytes
    for n in ex.unmatched:
        if n not in empty:
            problems.append(f"training parameter {n} is not used by any rule and not ignored")
    validated = set()
    for w in workers:
        if (id(w.params), w.rank) in validated:  # replicas sharing one params dict
            continue
        validated.add((id(w.params), w.rank))
        exp = ex.dest[w.rank]
        for n, p in exp.items():
            q = w.params.get(n)
            if q is None:
                problems.append(f"{n}: expected on replica {w.replica} rank {w.rank} but the worker lacks it")
            elif tuple(q.shape) != tuple(p.shape) or q.dtype != p.dtype:
                problems.append(
                    f"{n} on replica {w.replica} rank {w.rank}: worker has {tuple(q.shape)} {q.dtype}, "
                    f"mapping produces {tuple(p.shape)} {p.dtype}"
                )
        for n in w.params:
            if n not in exp and w.params[n].nbytes != 0:
                problems.append(f"{n} on replica {w.replica} rank {w.rank}: no rule writes this destination")
    return names, name_id, dest_nbytes


def _make_tasks(ex, params: Mapping[str, TrainParam], max_task_bytes: int, coarse: bool, problems: list):
    """Tasks from the expansion's components, and each task's mesh options.

    Components of one FSDP2 unit (a decoder layer, or the root) that have one mesh and go
    to the same inference ranks form one task (one collective, one pack, one submit);
    with coarse=False only components with equal merge keys (consecutive experts) merge.
    A task grows until the next component would take it past max_task_bytes (a single
    larger component is a task alone).  Components that can be sent zero-copy stay alone."""
    pbytes = {n: p.nbytes for n, p in params.items()}
    pending: dict[object, list] = {}
    raw_tasks: list[tuple[str, list, tuple]] = []  # (name, components, mesh options)
    comps: list = []
    for c in ex.components:
        opts = _mesh_options(c.sources, params)
        if not opts:
            problems.append(f"{c.rule}: sources {list(c.sources)} share no mesh that can produce them all")
            continue
        split = _split_direct(c, params, opts) if coarse else None
        comps += [(x, _mesh_options(x.sources, params)) for x in split] if split else [(c, opts)]
    key: tuple | None
    name: str | None
    for c, opts in comps:
        key = name = None
        if len(opts) == 1 and not _direct(c, params, opts):
            unit = _unit_of(c.sources) if coarse else None
            if unit is not None:
                key, name = ("unit", unit, opts, frozenset(s.rank for s in c.shards)), unit or "root"
            elif c.merge_key is not None:
                key, name = (c.merge_key, opts), c.rule
        if key is None:
            raw_tasks.append((c.rule, [c], opts))
            continue
        size = sum(pbytes[s] for s in c.sources)
        lst = pending.get(key)
        if lst is None or lst[1] + size > max_task_bytes:
            lst = pending[key] = [[], 0]
            assert name is not None  # set with key
            raw_tasks.append((name, lst[0], opts))
        lst[0].append(c)
        lst[1] += size
    tasks: list[Task] = []
    options: list[tuple] = []
    for name, comps, opts in raw_tasks:
        if len(comps) == 1:
            name = comps[0].rule
        sources = tuple(dict.fromkeys(s for c in comps for s in c.sources))
        shards = _merge_shards([s for c in comps for s in c.shards]) if len(comps) > 1 else list(comps[0].shards)
        tasks.append(Task(len(tasks), name, sources, -1, -1, sum(pbytes[s] for s in sources), shards))
        options.append(opts)
    return tasks, options


def _choose_meshes(tasks, options, replicas: int, train_world: int, gpus_per_node: int):
    """Each task's mesh (balancing the all-gather and write bytes per rank); the mesh table."""
    meshes: list[tuple[int, ...]] = []
    mesh_id: dict[tuple[int, ...], int] = {}
    load = np.zeros(train_world, np.float64)
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].src_bytes * replicas)
    for i in order:
        t, opts = tasks[i], options[i]
        wbytes = float(sum(s.nbytes for s in t.shards)) * replicas
        if len(opts) == 1:
            m = opts[0]
        else:
            # ties go away from rank 0 (the controller also serves the TCPStore)
            sums = [load[list(o)].sum() + (0.5 if 0 in o else 0.0) for o in opts]
            m = opts[int(np.argmin(sums))]
        if m not in mesh_id:
            mesh_id[m] = len(meshes)
            meshes.append(m)
        t.mesh = mesh_id[m]
        load[list(m)] += _ag_nic_bytes(t.src_bytes, m, gpus_per_node) + wbytes / len(m)
    return meshes


def _mesh_groups(tasks, meshes):
    """Greedy colouring of the mesh overlap graph (biggest meshes first), lightest group
    first; each mesh's ordered task list, staggered between the meshes of a group."""
    mesh_bytes = np.zeros(len(meshes))
    for t in tasks:
        mesh_bytes[t.mesh] += t.src_bytes
    groups: list[list[int]] = []
    group_ranks: list[set] = []
    for m in sorted(range(len(meshes)), key=lambda m: (-mesh_bytes[m], m)):
        rs = set(meshes[m])
        for g, used in enumerate(group_ranks):
            if not used & rs:
                groups[g].append(m)
                used |= rs
                break
        else:
            groups.append([m])
            group_ranks.append(set(rs))
    # the lightest group first: its preparation is short, so writes start at once and
    # its (often large, dense) tasks drain while the heavier groups prepare
    groups.sort(key=lambda ms: (sum(mesh_bytes[m] for m in ms), ms[0]))
    group_of = {m: g for g, ms in enumerate(groups) for m in ms}
    mesh_tasks: dict[int, list[int]] = {m: [] for m in range(len(meshes))}
    for t in tasks:
        t.group = group_of[t.mesh]
        mesh_tasks[t.mesh].append(t.id)
    # stagger: mesh k starts its list at a different point so that meshes work on
    # different layers (and so different receivers) at the same moment
    for g in groups:
        for k, m in enumerate(g):
            lst = mesh_tasks[m]
            if len(lst) > 1:
                s = (k * len(lst)) // len(g)
                mesh_tasks[m] = lst[s:] + lst[:s]
    return groups, mesh_tasks


def _task_transfers(t: Task, ranks: np.ndarray, load: np.ndarray, replicas: int, tp: int, name_id) -> dict:
    """The transfers of one task: every (shard, replica) unit to a rank of the task's mesh,
    in a per-sender pseudo-random destination order, with packed source offsets (the columns
    of Plan's transfer table, TRANSFER_COLUMNS)."""
    S = len(t.shards)
    sb = np.array([s.nbytes for s in t.shards], np.int64)
    u_shard = np.repeat(np.arange(S), replicas)
    u_rep = np.tile(np.arange(replicas), S)
    u_n = sb[u_shard]
    snd = _deal(u_n, ranks, load)
    sh_rank = np.array([s.rank for s in t.shards], np.int64)
    sh_dst = np.array([name_id[s.dst] for s in t.shards], np.int64)
    sh_off = np.array([s.offset for s in t.shards], np.int64)
    u_gpu = u_rep * tp + sh_rank[u_shard]
    # per sender: a pseudo-random destination order that differs from sender to sender
    # and task to task, so that senders do not start on (and move through) the same
    # receivers at the same moment
    ti = t.id
    rot = ((u_gpu + 1) * 0x9E3779B1 + (snd + 1) * 0x85EBCA77 + (ti + 1) * 0xC2B2AE3D) & 0xFFFFFFFF
    o2 = np.lexsort((rot, snd))
    snd, u_shard, u_rep, u_n = snd[o2], u_shard[o2], u_rep[o2], u_n[o2]
    # source offsets: each sender packs every distinct shard it sends once
    src = _packed_offsets(snd, u_shard, sb)
    return dict(
        sender=snd,
        task=np.full(snd.size, ti, np.int64),
        shard=u_shard,
        replica=u_rep,
        infer_rank=sh_rank[u_shard],
        dst=sh_dst[u_shard],
        dst_offset=sh_off[u_shard],
        nbytes=u_n,
        src_offset=src,
    )


def _transfers(tasks, meshes, groups, mesh_tasks, replicas, tp, train_world, gpus_per_node, name_id) -> dict:
    """Every transfer, balancing bytes per trainer NIC (the all-gather bytes counted
    first), sorted by sender, then by the sender's task sequence (group, mesh order)."""
    load = np.zeros(train_world, np.float64)
    for t in tasks:
        m = meshes[t.mesh]
        load[list(m)] += _ag_nic_bytes(t.src_bytes, m, gpus_per_node)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in TRANSFER_COLUMNS}
    seq = np.zeros(len(tasks), np.int64)
    k = 0
    for g in groups:
        for m in g:
            ranks = np.array(meshes[m], np.int64)
            for ti in mesh_tasks[m]:
                seq[ti] = k
                k += 1
                if tasks[ti].shards:
                    for key, v in _task_transfers(tasks[ti], ranks, load, replicas, tp, name_id).items():
                        cols[key].append(v)
    cat = {k: (np.concatenate(v) if v else np.empty(0, np.int64)) for k, v in cols.items()}
    o = np.lexsort((np.arange(cat["task"].size), seq[cat["task"]], cat["sender"]))
    return {k: v[o] for k, v in cat.items()}


def build_plan(
    train: Sequence[TrainParam],
    workers: Sequence[InferWorker],
    preset: Preset,
    quant: str | None = "preset",
    ignore: Iterable[str] = (),
    expanded: Expanded | None = None,
    max_task_bytes: int = 1 << 30,
    check: bool = True,
    gpus_per_node: int = 8,
    coarse: bool = True,
) -> Plan:
    """Compute the plan.  quant: "fp8", None (BF16) or "preset" (the preset's choice).
    Raises PlanError listing every mismatch (by name) when the
    training params, the mapping and the inference workers do not agree.

    gpus_per_node tells which meshes all-gather over the NICs (those spanning nodes):
    their all-gather bytes count in the per-NIC balance.  coarse: one task per FSDP2 unit
    (decoder layer) and destination set, split at max_task_bytes of training bytes."""
    t0 = time.perf_counter()
    workers, tp, ep, replicas, gpu_of = _grid(workers)
    quant = preset.quant if quant == "preset" else quant  # None means BF16
    params = {p.name: p for p in train}
    from ..meta import expert_group_of

    lay = expanded.layout if expanded is not None else None
    if lay is not None and (lay.tp, lay.ep, lay.quant) == (tp, ep, quant) and not ignore:
        ex = expanded
    else:
        layout = Layout(tp, ep, quant, expert_group_of(train))
        ex = expand(preset.rules, {p.name: p.shape for p in train}, layout, preset.config, ignore, strict=False)
    assert ex is not None  # `expanded` is used only when it has a layout
    problems: list[str] = []
    empty = {p.name for p in train if p.nbytes == 0}
    names, name_id, dest_nbytes = _dest_tables(ex, workers, tp, problems, empty)
    tasks, options = _make_tasks(ex, params, max_task_bytes, coarse, problems)
    if problems:
        raise PlanError(problems)
    train_world = max((r for p in train for m in p.meshes for r in m), default=-1) + 1
    meshes = _choose_meshes(tasks, options, replicas, train_world, gpus_per_node)
    groups, mesh_tasks = _mesh_groups(tasks, meshes)
    c = _transfers(tasks, meshes, groups, mesh_tasks, replicas, tp, train_world, gpus_per_node, name_id)
    plan = Plan(
        tp=tp,
        replicas=replicas,
        quant=quant,
        ep=ep,
        train_world=train_world,
        meshes=meshes,
        groups=groups,
        mesh_tasks=mesh_tasks,
        tasks=tasks,
        names=names,
        dest_nbytes=dest_nbytes,
        gpu_of=gpu_of,
        **c,
        train_params={p.name: (tuple(p.shape), p.dtype) for p in train},
        ignored=sorted(set(ex.ignored) | (set(ex.unmatched) & empty)),
        preset=preset.name,
    )
    for w in workers:
        assert w.gpu is not None
        for n, d in w.descriptors.items():
            plan.descriptors[(int(w.gpu), n)] = d
    if check:
        plan.check(workers)
    plan.build_s = time.perf_counter() - t0
    return plan
