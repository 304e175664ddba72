"""Flow-level simulation of one weight update following a plan on a modelled cluster.

Stages per task (a task's mesh runs its tasks in plan order; mesh groups are separated
by a barrier over all trainer ranks):

1. H2D: with CPU offload, each rank copies its local shard over PCIe (a sequential
   stream per rank that may run ahead of the other stages).
2. full_tensor(): an all-gather on the task's mesh -- over NVLink when the mesh lies in
   one node, else a ring over the NICs, sharing them with the writes.  A mesh starts its
   next all-gather only when every rank of it has room under the watermark for the full
   tensor plus its packed buffer.
3. fuse / quantize / pack on each sending rank at memory speed (one stream per rank).
4. one-sided writes: each rank keeps at most `max_posted_bytes` of writes posted (at
   least one task's; tasks in plan order); per (sender, receiver) pair FIFO, all pairs
   sharing the NICs by
   iterative water-filling (an approximation of max-min fairness that is work-conserving:
   every unfinished flow is stopped by a saturated link or by its own demand).

Time advances in fixed steps (`steps` per lower bound) for the network; the stage
events are computed exactly.  The packed buffer of a job is released when its last
write completes.

The lower bound is the largest, over every link that carries bytes (trainer NIC send
and receive, inference NIC receive, NVLink, PCIe), of bytes / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np


@dataclass
class SimResult:
    simulated_s: float
    lower_bound_s: float
    bottleneck: str
    link_bytes: dict  # link kind -> array of bytes per link
    link_bw: dict  # link kind -> bandwidth (bytes/s)
    stage_end_s: dict  # stage -> time the last event of that stage ends
    timeline: list = field(default_factory=list)  # (stage, rank, task, start, end)
    steps: int = 0
    sim_wall_s: float = 0.0
    trace: dict = field(default_factory=dict)  # per network step: t, bytes into inference / out of trainers
    stage_busy_s: dict = field(default_factory=dict)  # stage -> busiest rank's seconds in it (links: the bound)
    calibration: str = ""

    @property
    def bound_by(self) -> str:
        """The stage with the most seconds on its busiest rank (or the links' lower bound)."""
        b = self.stage_busy_s
        return max(b, key=b.__getitem__) if b else "links"

    def utilisation(self) -> dict:
        """Per link kind: bytes / (bandwidth x simulated time) for each link."""
        return {k: v / (self.link_bw[k] * self.simulated_s) for k, v in self.link_bytes.items()}

    def summary(self) -> dict:
        u = self.utilisation()
        return dict(
            simulated_s=self.simulated_s,
            lower_bound_s=self.lower_bound_s,
            ratio=self.simulated_s / self.lower_bound_s if self.lower_bound_s else float("nan"),
            bottleneck=self.bottleneck,
            bound_by=self.bound_by,
            calibration=self.calibration,
            stage_busy_s=self.stage_busy_s,
            max_utilisation={k: float(v.max()) if v.size else 0.0 for k, v in u.items()},
            mean_utilisation={k: float(v.mean()) if v.size else 0.0 for k, v in u.items()},
            stage_end_s=self.stage_end_s,
        )

    def timeline_frame(self):
        import pandas as pd

        return pd.DataFrame(self.timeline, columns=["stage", "rank", "task", "start", "end"])

    def plot_timeline(self, ax=None, max_ranks: int = 64):
        """Gantt chart of the stages for the first `max_ranks` trainer ranks."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(12, 5))
        colors = {"h2d": "tab:gray", "allgather": "tab:blue", "quant": "tab:green", "write": "tab:orange"}
        off = {"h2d": -0.3, "allgather": -0.1, "quant": 0.1, "write": 0.3}
        for stage in colors:
            rows = [(r, s, e) for st, r, _, s, e in self.timeline if st == stage and r < max_ranks]
            if rows:
                a = np.array(rows, float)
                ax.hlines(a[:, 0] + off[stage], a[:, 1], a[:, 2], colors=colors[stage], lw=2, label=stage)
        ax.axvline(self.lower_bound_s, color="k", ls="--", lw=1, label="lower bound")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("trainer rank")
        ax.legend(loc="upper right")
        return ax

    def plot_utilisation(self, ax=None):
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.5))
        u = {k: v for k, v in self.utilisation().items() if v.size}
        ax.boxplot(list(u.values()))
        ax.set_xticks(range(1, len(u) + 1), list(u))
        ax.set_ylabel("utilisation")
        return ax


def _waterfill(fa, fb, cap, demand, iters=16):
    """Bytes per flow for one step: flows over links (fa, fb), link capacities `cap`."""
    F = fa.size
    alloc = np.zeros(F)
    if F == 0:
        return alloc
    L = cap.size
    rem = cap.copy()
    idx = np.flatnonzero(demand > 0)
    for _ in range(iters):
        if idx.size == 0:
            break
        a, b = fa[idx], fb[idx]
        cnt = np.bincount(a, minlength=L) + np.bincount(b, minlength=L)
        share = rem / np.maximum(cnt, 1)
        give = np.minimum(np.minimum(share[a], share[b]), demand[idx] - alloc[idx])
        alloc[idx] += give
        rem -= np.bincount(a, give, L) + np.bincount(b, give, L)
        sat = rem <= cap * 1e-9
        keep = (alloc[idx] < demand[idx] * (1 - 1e-9)) & ~sat[a] & ~sat[b]
        idx = idx[keep]
    return alloc


def _links(plan, cluster):
    """Bytes per link from the plan alone (used for the lower bound and utilisation)."""
    world, ngpu = plan.train_world, int(plan.gpu_of.max()) + 1
    gpn = cluster.gpus_per_node
    writes = np.bincount(plan.sender, plan.nbytes, world).astype(float)
    ag_send = np.zeros(world)  # cross-node all-gathers, over the NICs
    recv_t = np.zeros(world)
    nvl = np.zeros(world)
    pcie = np.zeros(world)
    for t in plan.tasks:
        m = plan.meshes[t.mesh]
        k = len(m)
        if cluster.cpu_offload:
            pcie[list(m)] += t.src_bytes / k
        if k == 1:
            continue
        b = t.src_bytes * (k - 1) / k
        if len({r // gpn for r in m}) == 1:
            nvl[list(m)] += b
        else:
            ag_send[list(m)] += b
            recv_t[list(m)] += b
    recv_i = np.bincount(plan.gpu, plan.nbytes, ngpu).astype(float)
    nic, w = cluster.nic_GBps * 1e9, cluster.write_bw
    if cluster.write_GBps is not None:  # writes on their own path: NIC carries only all-gathers
        lb = dict(train_send=writes, infer_recv=recv_i, train_nic_send=ag_send, train_nic_recv=recv_t, nvlink=nvl)
        bw = dict(train_send=w, infer_recv=w, train_nic_send=nic, train_nic_recv=nic)
    else:
        lb = dict(train_nic_send=writes + ag_send, train_nic_recv=recv_t, infer_nic_recv=recv_i, nvlink=nvl)
        bw = dict(train_nic_send=nic, train_nic_recv=nic, infer_nic_recv=nic)
    bw["nvlink"] = cluster.nvlink_GBps * 1e9
    if cluster.cpu_offload:
        lb["pcie"] = pcie
        bw["pcie"] = cluster.pcie_GBps * 1e9
    return lb, bw


def lower_bound(plan, cluster) -> tuple[float, str]:
    lb, bw = _links(plan, cluster)
    best, name = 0.0, ""
    for k, v in lb.items():
        if v.size and v.max() / bw[k] > best:
            best, name = float(v.max() / bw[k]), f"{k}[{int(v.argmax())}]"
    return best, name


# --------------------------------------------------------------------------- parts
#
# simulate() below is an event loop over four parts, each tested alone:
#   _jobs        the (sender, task) jobs of the transfer table and their writes per receiver
#   _Network     the writes (per (sender, receiver) FIFOs, a posting window per rank) and the
#                cross-node all-gather ring flows, advanced one water-filled step at a time
#   _StageModel  how long each stage of one task takes (H2D, all-gather, quantize/pack)
#   _Meshes      the order of stage events: all-gathers per mesh in plan order under the
#                watermark and the group barriers, packing per rank, the jobs it makes ready


@dataclass
class _Jobs:
    """(sender, task) runs of the transfer table ("jobs") and their writes summed per
    receiver GPU ("entries", sorted by job)."""

    rank: np.ndarray  # [J] sending trainer rank
    task: np.ndarray  # [J] plan task
    packed: np.ndarray  # [J] bytes of the job's packed buffer
    ejob: np.ndarray  # [E] job of each entry
    egpu: np.ndarray  # [E] receiving GPU of each entry
    ebytes: np.ndarray  # [E] bytes
    start: np.ndarray  # [J] first entry of the job
    end: np.ndarray  # [J] one past its last entry
    wbytes: np.ndarray  # [J] bytes the job writes
    of_task: dict  # task -> [job]
    packed_of: dict  # (rank, task) -> packed bytes
    pieces: np.ndarray | None = None  # [J] pieces the job packs (one launch each; an FP8 piece once for fp8 + scale)
    fp8: np.ndarray | None = None  # [J] whether it quantizes
    nwrites: np.ndarray | None = None  # [J] transfers (one write each)
    job_of: dict | None = None  # (rank, task) -> job

    @property
    def n(self) -> int:
        return int(self.rank.size)


def _jobs(plan, ngpu: int) -> _Jobs:
    n = plan.n_transfers
    if n:
        brk = np.r_[True, (plan.sender[1:] != plan.sender[:-1]) | (plan.task[1:] != plan.task[:-1])]
        job_of = np.cumsum(brk) - 1
        js = np.flatnonzero(brk)
        jrank, jtask = plan.sender[js], plan.task[js]
        packed = np.zeros(js.size)
        np.maximum.at(packed, job_of, (plan.src_offset + plan.nbytes).astype(float))
        ukey, einv = np.unique(job_of * ngpu + plan.gpu, return_inverse=True)
        ebytes = np.bincount(einv.reshape(-1), plan.nbytes, ukey.size).astype(float)
        ejob, egpu = ukey // ngpu, ukey % ngpu
    else:
        jrank = jtask = ejob = egpu = np.empty(0, np.int64)
        packed = ebytes = np.empty(0)
    J = jrank.size
    of_task: dict = {}
    for j in range(J):
        of_task.setdefault(int(jtask[j]), []).append(j)
    pieces, fp8, nwrites = _job_pieces(plan, job_of if n else np.empty(0, np.int64), J)
    return _Jobs(
        jrank,
        jtask,
        packed,
        ejob,
        egpu,
        ebytes,
        np.searchsorted(ejob, np.arange(J)),
        np.searchsorted(ejob, np.arange(J), side="right"),
        np.bincount(ejob, ebytes, J) if J else np.zeros(0),
        of_task,
        {(int(jrank[j]), int(jtask[j])): packed[j] for j in range(J)},
        pieces,
        fp8,
        nwrites,
        {(int(jrank[j]), int(jtask[j])): j for j in range(J)},
    )


def _job_pieces(plan, job_of, J: int):
    """Per job: pieces packed (each distinct shard of its buffer once; a scale shard shares its
    fp8 shard's quantization), whether any is FP8, and its number of writes."""
    nwrites = np.bincount(job_of, minlength=J).astype(np.int64) if J else np.zeros(0, np.int64)
    pieces = np.zeros(J, np.int64)
    fp8 = np.zeros(J, bool)
    if not J:
        return pieces, fp8, nwrites
    key = job_of * (int(plan.src_offset.max()) + 1) + plan.src_offset  # one per packed shard
    _, first = np.unique(key, return_index=True)
    for i in first.tolist():
        sh = plan.tasks[int(plan.task[i])].shards[int(plan.shard[i])]
        j = int(job_of[i])
        if sh.kind == "fp8":
            fp8[j] = True
        if sh.kind != "scale":
            pieces[j] += len(sh.pieces)
    return pieces, fp8, nwrites


class _Network:
    """The flows on the links: every job's writes, as per (sender, receiver) FIFOs of its
    entries in the sender's job order, and the ring flows of cross-node all-gathers.

    Links: [0, world) trainer send side (the write path), [world, 2 world) trainer NIC
    receive side (rings), [2 world, 2 world + ngpu) inference receive side.  A rank posts
    its queued jobs in order while it has fewer than `max_posted` bytes posted (at least one
    job).  `step()` moves one time step of bytes."""

    def __init__(
        self,
        jobs: _Jobs,
        world: int,
        ngpu: int,
        nic_bw: float,
        write_bw: float,
        max_posted: float,
        write_latency_s: float,
    ):
        from collections import deque

        self.jobs, self.world, self.ngpu = jobs, world, ngpu
        self.write_latency_s = write_latency_s
        self.max_posted = float(max_posted)
        self.cap = np.concatenate([np.full(world, write_bw), np.full(world, nic_bw), np.full(ngpu, write_bw)])
        E = jobs.ejob.size
        pkeys, epair = np.unique(jobs.rank[jobs.ejob] * ngpu + jobs.egpu, return_inverse=True)
        self.epair = epair.reshape(-1)
        self.pair_rank, self.pair_gpu = pkeys // ngpu, pkeys % ngpu
        P = pkeys.size
        order = np.lexsort((jobs.ejob, self.epair))  # FIFO positions
        self.pos_of = np.empty(E, np.int64)
        self.pos_of[order] = np.arange(E)
        self.srem = jobs.ebytes[order].copy()  # remaining bytes by FIFO position
        self.ssize = jobs.ebytes[order]
        self.sentry = order
        pstart = np.searchsorted(self.epair[order], np.arange(P))
        self.head = pstart.copy()  # first unfinished position of each pair
        self.pend = pstart.copy()  # one past the last posted position
        self.pair_rem = np.zeros(P)
        self.entries_left = np.bincount(jobs.ejob, minlength=jobs.n)
        self.queued: list[deque] = [deque() for _ in range(world)]  # packed jobs waiting to be posted
        self.posted = np.zeros(world, np.int64)
        self.posted_bytes = np.zeros(world)
        self.post_ranks: set = set()
        self.jobs_left = jobs.n
        self.gpu_finish = np.zeros(ngpu)
        # ring flows of cross-node all-gathers
        self.ag_src: list = []
        self.ag_dst: list = []
        self.ag_rem: list = []
        self.ag_live: set = set()
        self.ag_done: set = set()
        self.rings: dict = {}  # mesh -> (task, start, flow ids)

    # ---- writes
    def queue(self, jobs_ready) -> None:
        """Jobs whose buffers are packed, in job order, join their rank's posting queue."""
        for j in sorted(jobs_ready):
            r = int(self.jobs.rank[j])
            self.queued[r].append(j)
            self.post_ranks.add(r)

    def post(self) -> None:
        jb = self.jobs
        for r in self.post_ranks:
            q = self.queued[r]
            while q and (self.posted[r] == 0 or self.posted_bytes[r] + jb.wbytes[q[0]] <= self.max_posted):
                j = q.popleft()
                self.posted[r] += 1
                self.posted_bytes[r] += jb.wbytes[j]
                es = np.arange(jb.start[j], jb.end[j])
                ps, poss = self.epair[es], self.pos_of[es]
                if (poss != self.pend[ps]).any():
                    raise RuntimeError("writes posted out of FIFO order")
                self.pend[ps] += 1
                self.pair_rem[ps] += self.srem[poss]
        self.post_ranks.clear()

    def active_pairs(self) -> np.ndarray:
        return np.flatnonzero(self.pend > self.head)

    def idle(self, ap) -> bool:
        return ap.size == 0 and not self.ag_live and not any(self.queued)

    # ---- rings
    def add_ring(self, m: int, ti: int, start: float, ranks, nbytes: float) -> None:
        ids = []
        k = len(ranks)
        for i in range(k):
            ids.append(len(self.ag_src))
            self.ag_src.append(ranks[i])
            self.ag_dst.append(ranks[(i + 1) % k])
            self.ag_rem.append(nbytes)
            self.ag_live.add(ids[-1])
        self.rings[m] = (ti, start, ids)

    # ---- one step
    def _consume(self, ap, palloc, now: float, dt: float) -> list:
        """FIFO inside each pair: spend each pair's bytes on its head entries.  Returns
        [(entry, end time)] of the entries finished in this step."""
        head, pend, srem = self.head, self.pend, self.srem
        nap = ap.size
        left = palloc.copy()
        used = np.zeros(nap)
        done: list = []
        while nap:
            sel = np.flatnonzero((left > 0) & (head[ap] < pend[ap]))
            if sel.size == 0:
                break
            p_, h_ = ap[sel], head[ap[sel]]
            take = np.minimum(srem[h_], left[sel])
            srem[h_] -= take
            self.pair_rem[p_] -= take
            left[sel] -= take
            used[sel] += take
            fin = srem[h_] <= 1e-6 * np.maximum(self.ssize[h_], 1.0)
            if not fin.any():
                break
            hf, pf = h_[fin], p_[fin]
            self.pair_rem[pf] -= srem[hf]
            srem[hf] = 0.0
            head[pf] += 1
            tend = now + dt * np.minimum(used[sel][fin] / np.maximum(palloc[sel][fin], 1e-30), 1.0)
            np.maximum.at(self.gpu_finish, self.pair_gpu[pf], tend)
            done.extend(zip(self.sentry[hf].tolist(), tend.tolist()))
        return done

    def step(self, ap, now: float, dt: float):
        """Move one step of bytes.  Returns (finished jobs [(job, end time)], finished rings
        [(mesh, task, start)], bytes written, bytes of rings)."""
        agi = np.array(sorted(self.ag_live), np.int64)
        nap = ap.size
        fa = self.pair_rank[ap]
        fb = 2 * self.world + self.pair_gpu[ap]
        dem = np.maximum(self.pair_rem[ap], 0.0)
        if agi.size:
            fa = np.concatenate([fa, np.array(self.ag_src, np.int64)[agi]])
            fb = np.concatenate([fb, self.world + np.array(self.ag_dst, np.int64)[agi]])
            dem = np.concatenate([dem, np.array(self.ag_rem)[agi]])
        alloc = _waterfill(fa, fb, self.cap * dt, dem)
        palloc = alloc[:nap]
        jobs_done = []
        for e, te in self._consume(ap, palloc, now, dt):
            j = int(self.jobs.ejob[e])
            self.entries_left[j] -= 1
            if self.entries_left[j] == 0:
                self.jobs_left -= 1
                r = int(self.jobs.rank[j])
                self.posted[r] -= 1
                self.posted_bytes[r] -= self.jobs.wbytes[j]
                if self.queued[r]:
                    self.post_ranks.add(r)
                jobs_done.append((j, te + self.write_latency_s))
        for q, i in enumerate(agi.tolist()):
            got = alloc[nap + q]
            self.ag_rem[i] -= got
            if self.ag_rem[i] <= 1e-6 * max(got, 1):
                self.ag_done.add(i)
                self.ag_live.discard(i)
        rings_done = []
        for m in list(self.rings):
            ti, s, ids = self.rings[m]
            if all(i in self.ag_done for i in ids):
                del self.rings[m]
                rings_done.append((m, ti, s))
        return jobs_done, rings_done, float(palloc.sum()), float(alloc[nap:].sum())


class _StageModel:
    """Seconds of each stage of one task: the cluster's bandwidths plus its calibration's
    per-call costs and rates (wxfer.meta.Calibration)."""

    def __init__(self, cluster):
        cal = cluster.cal
        self.cal = cal
        self.offload = bool(cluster.cpu_offload)
        self.pcie_bw = cluster.pcie_GBps * 1e9
        self.nvl_bw = cluster.nvlink_GBps * 1e9
        self.mem_bw = cluster.mem_GBps * 1e9
        self.copy_bw = self.mem_bw if cal.copy_GBps is None else cal.copy_GBps * 1e9
        self.quant_bw = self.mem_bw if cal.quant_GBps is None else cal.quant_GBps * 1e9
        self.barrier_s = float(cluster.barrier_s)
        self.serial, self.host_sync = bool(cal.serial), bool(cal.host_sync)

    def h2d_s(self, task, k: int) -> float:
        """Copy this rank's 1/k of the task's sources over PCIe (one copy per source)."""
        return self.cal.h2d_call_s * len(task.sources) + task.src_bytes / k / self.pcie_bw

    def host_gather_s(self, task) -> float:
        """Host work before the task's collectives: per task and per source parameter."""
        return self.cal.host_task_s + self.cal.host_param_s * len(task.sources)

    def host_pack_s(self, pieces: int) -> float:
        """Host work to issue the packing of `pieces` pieces."""
        return self.cal.host_piece_s * pieces

    def coll_call_s(self, task, k: int) -> float:
        return self.cal.coll_call_s * len(task.sources) if k > 1 else 0.0

    def allgather_s(self, task, k: int) -> float:
        """An all-gather inside a node (or none, k == 1): each rank receives (k-1)/k."""
        return self.coll_call_s(task, k) + (task.src_bytes * (k - 1) / k) / self.nvl_bw

    def ring_bytes(self, task, k: int) -> float:
        """Bytes each ring flow of a cross-node all-gather carries."""
        return task.src_bytes * (k - 1) / k

    def pack_s(self, task, packed: float, pieces: int = 0, fp8: bool = False) -> float:
        """Fuse / quantize / pack: one launch per piece, the full tensors read and the packed
        buffer written at the quantizer's rate (FP8) or the copy rate."""
        return self.cal.pack_launch_s * pieces + (task.src_bytes + packed) / (self.quant_bw if fp8 else self.copy_bw)

    def write_post_s(self, nwrites: int) -> float:
        return self.cal.write_call_s * nwrites


class _Meshes:
    """The order of stage events.  A mesh runs its tasks' all-gathers in plan order, the
    next one when the previous ended, its group was released (the previous group's last
    all-gather ended, plus the barrier), its ranks' H2D of the task is done (offload), and
    every rank of it has room under the watermark for the full tensor and its packed
    buffer.  A sending rank packs each task after its all-gather, one task at a time; the
    task's jobs are ready when their rank's packing is done."""

    def __init__(self, plan, cluster, model: _StageModel, jobs: _Jobs, record: bool):
        self.plan, self.model, self.jobs, self.record = plan, model, jobs, record
        world, gpn = plan.train_world, cluster.gpus_per_node
        self.wm = float(cluster.watermark_bytes)
        self.intra = [len({r // gpn for r in m}) == 1 for m in plan.meshes]
        self.group_of_mesh = {m: g for g, ms in enumerate(plan.groups) for m in ms}
        G = len(plan.groups)
        self.G = G
        self.group_left = np.zeros(G, np.int64)
        for t in plan.tasks:
            self.group_left[t.group] += 1
        self.release = np.full(G + 1, np.inf)
        self.release[0] = 0.0
        for g in range(G):  # empty groups release at once
            if self.group_left[g] == 0:
                self.release[g + 1] = self.release[g]
        self.timeline: list = []
        self.h2d_done = self._h2d() if model.offload else {}
        self.mem = np.zeros(world)
        self.quant_free = np.zeros(world)  # end of the rank's last packing
        self.host_free = np.zeros(world)  # when the rank's host is done with its last task
        self.dev_free = np.zeros(world)  # serial: end of the rank's last gather or packing
        self.busy_s = {k: np.zeros(world) for k in ("host", "allgather", "pack")}  # seconds per rank
        self.ptr = {m: 0 for m in range(len(plan.meshes))}
        self.busy = {m: 0.0 for m in range(len(plan.meshes))}  # end of the mesh's last all-gather
        self.open = list(range(len(plan.meshes)))
        self.act_time = np.full(jobs.n, np.inf)
        self.pending: list = []  # jobs packed later than now
        self.stage_end = {"h2d": max(self.h2d_done.values(), default=0.0), "allgather": 0.0, "quant": 0.0, "write": 0.0}

    def _h2d(self) -> dict:
        """(rank, task) -> end of its H2D: one stream per rank, in the rank's task order."""
        plan = self.plan
        done, free = {}, np.zeros(plan.train_world)
        for g in plan.groups:
            for m in g:
                k = len(plan.meshes[m])
                for ti in plan.mesh_tasks[m]:
                    d = self.model.h2d_s(plan.tasks[ti], k)
                    for r in plan.meshes[m]:
                        done[(r, ti)] = free[r] + d
                        free[r] += d
                        if self.record:
                            self.timeline.append(("h2d", r, ti, done[(r, ti)] - d, done[(r, ti)]))
        return done

    def finished(self) -> bool:
        return all(self.ptr[m] >= len(self.plan.mesh_tasks[m]) for m in self.ptr)

    def ready_time(self, m: int) -> float:
        """When mesh m's next all-gather can start: the mesh, its group, its H2D, every rank's
        host having issued it (and, serial, every rank's stream free)."""
        ti = self.plan.mesh_tasks[m][self.ptr[m]]
        s = max(self.busy[m], self.release[self.group_of_mesh[m]])
        ranks = self.plan.meshes[m]
        if self.model.offload:
            s = max(s, max(self.h2d_done[(r, ti)] for r in ranks))
        hg = self.model.host_gather_s(self.plan.tasks[ti])
        if hg > 0:
            s = max(s, max(self.host_free[r] for r in ranks) + hg)
        if self.model.serial:
            s = max(s, max(self.dev_free[r] for r in ranks))
        return s

    def start(self, now: float, net: _Network) -> None:
        """Start every all-gather that can start up to `now` (rings go to the network)."""
        for m in self.open:
            self._start_mesh(m, now, net)
        self.open = [m for m in self.open if self.ptr[m] < len(self.plan.mesh_tasks[m])]

    def _start_mesh(self, m: int, now: float, net: _Network) -> None:
        plan, lst = self.plan, self.plan.mesh_tasks[m]
        while self.ptr[m] < len(lst) and m not in net.rings:
            ti = lst[self.ptr[m]]
            s = self.ready_time(m)
            if s > now:
                return
            P = plan.tasks[ti].src_bytes
            nd = {r: P + self.jobs.packed_of.get((r, ti), 0.0) for r in plan.meshes[m]}
            if any(self.mem[r] > 0 and self.mem[r] + v > self.wm for r, v in nd.items()):
                return
            for r, v in nd.items():
                self.mem[r] += v
            self.ptr[m] += 1
            ranks = plan.meshes[m]
            k = len(ranks)
            if k == 1 or self.intra[m]:
                e = s + self.model.allgather_s(plan.tasks[ti], k)
                self.end_allgather(m, ti, s, e)
            else:
                net.add_ring(m, ti, s, ranks, self.model.ring_bytes(plan.tasks[ti], k))
                return

    def ring_end(self, m: int, ti: int, start: float, t_flows: float) -> None:
        """A cross-node all-gather's ring flows finished at t_flows (plus its per-call cost)."""
        k = len(self.plan.meshes[m])
        self.end_allgather(m, ti, start, t_flows + self.model.coll_call_s(self.plan.tasks[ti], k))

    def end_allgather(self, m: int, ti: int, start: float, t_end: float) -> None:
        """All-gather of task ti ended: pack on the senders, free the full tensors, release
        the next group when this was its group's last."""
        plan, jb = self.plan, self.jobs
        assert jb.job_of is not None and jb.pieces is not None and jb.fp8 is not None and jb.nwrites is not None
        task = plan.tasks[ti]
        if self.record:
            for r in plan.meshes[m]:
                self.timeline.append(("allgather", r, ti, start, t_end))
        self.stage_end["allgather"] = max(self.stage_end["allgather"], t_end)
        md = self.model
        hg = md.host_gather_s(task)
        for r in plan.meshes[m]:
            j = jb.job_of.get((r, ti))
            # the host after issuing the gather (host_sync: after waiting for it)
            hr = t_end if md.host_sync else self.host_free[r] + hg
            self.busy_s["host"][r] += hg
            self.busy_s["allgather"][r] += t_end - start
            if j is not None and jb.packed[j] > 0:
                pieces = int(jb.pieces[j])
                hp = hr + md.host_pack_s(pieces)
                q0 = max(t_end, self.quant_free[r], hp)
                q1 = q0 + md.pack_s(task, jb.packed[j], pieces, bool(jb.fp8[j]))
                self.quant_free[r] = q1
                self.dev_free[r] = q1
                self.host_free[r] = q1 if md.host_sync else hp
                self.busy_s["host"][r] += md.host_pack_s(pieces)
                self.busy_s["pack"][r] += q1 - q0
                self.stage_end["quant"] = max(self.stage_end["quant"], q1)
                if self.record:
                    self.timeline.append(("quant", r, ti, q0, q1))
            else:
                self.host_free[r] = hr
                self.dev_free[r] = max(self.dev_free[r], t_end)
            if j is not None:
                self.act_time[j] = max(self.quant_free[r], self.host_free[r]) + md.write_post_s(int(jb.nwrites[j]))
                self.pending.append(j)
            self.mem[r] -= task.src_bytes
        self.busy[m] = t_end
        g = self.group_of_mesh[m]
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.release[g + 1] = self.stage_end["allgather"] + self.model.barrier_s
            for g2 in range(g + 1, self.G):  # cascade over empty groups
                if self.group_left[g2] == 0:
                    self.release[g2 + 1] = self.release[g2]
                else:
                    break

    def ready_jobs(self, now: float) -> list:
        """Jobs packed by `now` (removed from the pending list)."""
        if not self.pending:
            return []
        ready = [j for j in self.pending if self.act_time[j] <= now]
        if ready:
            self.pending[:] = [j for j in self.pending if self.act_time[j] > now]
        return ready

    def job_done(self, j: int, t: float) -> None:
        """The job's last write landed at t: its packed buffer is released."""
        r = int(self.jobs.rank[j])
        self.mem[r] -= self.jobs.packed[j]
        if self.record:
            self.timeline.append(("write", r, int(self.jobs.task[j]), self.act_time[j], t))

    def next_event(self, now: float, net: _Network) -> float:
        """The next stage event after `now` (nothing flows until then)."""
        cands = [self.act_time[j] for j in self.pending]
        for m in self.ptr:
            if self.ptr[m] < len(self.plan.mesh_tasks[m]) and m not in net.rings:
                cands.append(self.ready_time(m))
        nxt = min([c for c in cands if c > now], default=np.inf)
        if not np.isfinite(nxt):
            raise RuntimeError("simulation stalled (watermark smaller than one task?)")
        return nxt


def simulate(plan, cluster, steps: int = 1500, record: bool = True) -> SimResult:
    """Predict one update of `plan` on `cluster` (a wxfer.meta.Cluster).

    steps: network time steps per lower bound (accuracy vs. speed); record: keep the
    per-stage timeline (for `timeline_frame()` / `plot_timeline()`)."""
    import time as _time

    w0 = _time.perf_counter()
    world, ngpu = plan.train_world, int(plan.gpu_of.max()) + 1
    gpn = cluster.gpus_per_node
    if cluster.write_GBps is not None and any(len({r // gpn for r in plan.meshes[t.mesh]}) > 1 for t in plan.tasks):
        raise ValueError(
            "Cluster.write_GBps models writes inside one node, but this plan has all-gathers across "
            "nodes (they would share the write path's capacity in this model)"
        )
    lbytes, lbw = _links(plan, cluster)
    lb, bname = lower_bound(plan, cluster)
    jobs = _jobs(plan, ngpu)
    net = _Network(
        jobs, world, ngpu, cluster.nic_GBps * 1e9, cluster.write_bw, cluster.max_posted_bytes, cluster.write_latency_s
    )
    meshes = _Meshes(plan, cluster, _StageModel(cluster), jobs, record)
    dt = max(lb, 1e-6) / steps
    now, nstep, max_steps, last_write = 0.0, 0, steps * 200, 0.0
    tr_t, tr_w, tr_ag = [], [], []
    while True:
        meshes.start(now + dt, net)
        net.queue(meshes.ready_jobs(now))
        if net.post_ranks:
            net.post()
        if net.jobs_left == 0 and not net.rings and meshes.finished():
            break
        ap = net.active_pairs()
        if net.idle(ap):
            now = meshes.next_event(now, net)
            continue
        jobs_done, rings_done, wb, agb = net.step(ap, now, dt)
        tr_t.append(now)
        tr_w.append(wb)
        tr_ag.append(agb)
        for j, te in jobs_done:
            meshes.job_done(j, te)
            last_write = max(last_write, te)
        for m, ti, s in rings_done:
            meshes.ring_end(m, ti, s, now + dt)
        now += dt
        nstep += 1
        if nstep > max_steps:
            raise RuntimeError("simulation did not finish (more than 200x the lower bound)")
    stage_end = meshes.stage_end
    total = max(last_write, stage_end["allgather"], stage_end["quant"])
    if cluster.cal.cpu_shared:  # stage 2 and the writes take turns on the same cores
        # the write rate was measured with one writer and one target using the machine's cores: every
        # trainer's writes take turns on them (all bytes / that rate)
        per_rank = cast(np.ndarray, sum(meshes.busy_s.values()))  # busy_s is never empty: not the 0 start
        wl = float(plan.nbytes.sum()) / cluster.write_bw if plan.n_transfers else 0.0
        total = max(total, (float(per_rank.max()) if per_rank.size else 0.0) + wl)
    total += cluster.cal.push_fixed_s
    stage_end["write"] = last_write
    busy = {k: float(v.max()) if v.size else 0.0 for k, v in meshes.busy_s.items()}
    busy["h2d"] = stage_end["h2d"]
    busy["links"] = lb
    busy["push_fixed"] = cluster.cal.push_fixed_s
    trace = dict(
        t=np.array(tr_t),
        dt=dt,
        write_bytes=np.array(tr_w),
        allgather_bytes=np.array(tr_ag),
        infer_capacity=ngpu * cluster.write_bw * dt,
        infer_finish_s=net.gpu_finish,
    )
    return SimResult(
        total,
        lb,
        bname,
        lbytes,
        lbw,
        stage_end,
        meshes.timeline,
        nstep,
        _time.perf_counter() - w0,
        trace,
        busy,
        cluster.cal.name,
    )
