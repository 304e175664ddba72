"""Checks run before anything is sent: byte coverage and deadlock freedom."""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np


def check_coverage(plan, workers: Sequence | None = None) -> list[str]:
    """Every byte of every destination parameter on every inference GPU written exactly
    once; every training parameter used or explicitly ignored; transfers inside their
    destination; workers (when given) hold exactly the destination parameters.
    Returns the list of problems, by name (empty when the plan is sound)."""
    probs: list[str] = []
    tp, R, N = plan.tp, plan.replicas, len(plan.names)
    used = {s for t in plan.tasks for s in t.sources}
    for n in plan.train_params:
        if n not in used and n not in plan.ignored:
            probs.append(f"training parameter {n} is neither sent nor ignored")
    if plan.n_transfers and (plan.nbytes <= 0).any():
        for i in np.flatnonzero(plan.nbytes <= 0)[:50]:
            probs.append(f"transfer {i} to {plan.names[plan.dst[i]]} has length {plan.nbytes[i]}")
    # sort transfers by (replica, rank, dst, offset) and walk intervals
    key = (plan.replica * tp + plan.infer_rank) * N + plan.dst
    o = np.lexsort((plan.dst_offset, key))
    k, off, n = key[o], plan.dst_offset[o], plan.nbytes[o]
    end = off + n
    size = plan.dest_nbytes[plan.infer_rank[o], plan.dst[o]] if o.size else np.empty(0, np.int64)

    def where(kk):
        rr, d = divmod(int(kk), N)
        rep, r = divmod(rr, tp)
        return f"{plan.names[d]} on replica {rep} rank {r}"

    bad = np.flatnonzero((size < 0) | (end > size) | (off < 0))
    for i in bad[:100]:
        probs.append(f"bytes [{off[i]}, {end[i]}) of {where(k[i])} are outside the parameter ({max(size[i], 0)} bytes)")
    if o.size:
        new = np.r_[True, k[1:] != k[:-1]]
        grp = np.cumsum(new) - 1
        big = int(max(end.max(), size.max(), 0)) + 1
        run = np.maximum.accumulate(end + grp * big) - grp * big  # running max of ends per group
        prev_end = np.where(new, 0, np.r_[0, run[:-1]])
        gap = np.flatnonzero(off > prev_end)
        dup = np.flatnonzero(off < prev_end)
        for i in gap[:100]:
            probs.append(f"bytes [{prev_end[i]}, {off[i]}) of {where(k[i])} are never written")
        for i in dup[:100]:
            probs.append(f"bytes [{off[i]}, {min(prev_end[i], end[i])}) of {where(k[i])} are written twice")
        starts = np.flatnonzero(new)
        last = np.r_[starts[1:] - 1, end.size - 1]
        short = last[run[last] < size[last]]
        for i in short[:100]:
            probs.append(f"bytes [{run[i]}, {size[i]}) of {where(k[i])} are never written")
        covered = np.unique(k[starts])
    else:
        covered = np.empty(0, np.int64)
    # destinations never touched at all
    rr, dd = np.nonzero(plan.dest_nbytes > 0)
    want = ((np.arange(R)[:, None] * tp + rr[None, :]) * N + dd[None, :]).reshape(-1)
    for kk in want[~np.isin(want, covered)][:200]:
        probs.append(f"{where(kk)} is never written")
    if workers is not None:
        name_id = {n: i for i, n in enumerate(plan.names)}
        seen = set()
        for w in workers:
            if (id(w.params), w.rank) in seen:  # replicas sharing one params dict
                continue
            seen.add((id(w.params), w.rank))
            for nme, p in ((n, q) for n, q in w.params.items() if q.nbytes or n in name_id):  # 0 bytes: left out
                d = name_id.get(nme, -1)
                if d < 0 or plan.dest_nbytes[w.rank, d] < 0:
                    probs.append(f"{nme} on replica {w.replica} rank {w.rank}: no transfer writes it")
                elif p.nbytes != plan.dest_nbytes[w.rank, d]:
                    probs.append(
                        f"{nme} on replica {w.replica} rank {w.rank}: worker has {p.nbytes} bytes, "
                        f"plan writes {plan.dest_nbytes[w.rank, d]}"
                    )
    # senders must belong to their task's mesh
    if plan.n_transfers:
        mesh_of = np.array([t.mesh for t in plan.tasks], np.int64)
        member = np.zeros((len(plan.meshes), plan.train_world), bool)
        for m, ranks in enumerate(plan.meshes):
            member[m, list(ranks)] = True
        ok = member[mesh_of[plan.task], plan.sender]
        for i in np.flatnonzero(~ok)[:50]:
            probs.append(f"transfer {i}: rank {plan.sender[i]} is not in the mesh of task {plan.task[i]}")
    return probs


def check_deadlock_free(plan) -> None:
    """Replay every rank's ordered list (collectives per task, barrier after each mesh
    group) with a blocking-collective model; raise RuntimeError on a deadlock."""
    world = plan.train_world
    seqs = []
    for r in range(world):
        ops = []
        for g, lst in enumerate(plan.rank_schedule(r)):
            for t, _ in lst:
                ops.append(("task", t))
            ops.append(("barrier", g))
        seqs.append(ops)
    pos = [0] * world
    waiting: dict[tuple, set] = {}
    mesh_of = [t.mesh for t in plan.tasks]
    ready = deque(range(world))
    done = 0
    while ready:
        r = ready.popleft()
        if pos[r] >= len(seqs[r]):
            continue
        op = seqs[r][pos[r]]
        need = set(plan.meshes[mesh_of[op[1]]]) if op[0] == "task" else set(range(world))
        if r not in need:
            raise RuntimeError(f"rank {r} runs task {op[1]} but is not in its mesh")
        w = waiting.setdefault(op, set())
        w.add(r)
        if w == need:
            del waiting[op]
            for q in need:
                pos[q] += 1
                if pos[q] >= len(seqs[q]):
                    done += 1
                else:
                    ready.append(q)
    if done != world:
        stuck = {r: seqs[r][pos[r]] for r in range(world) if pos[r] < len(seqs[r])}
        raise RuntimeError(f"deadlock: {len(stuck)} ranks blocked, e.g. {dict(list(stuck.items())[:8])}")
