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

import numpy as np


@dataclass
class SimResult:
    simulated_s: float
    lower_bound_s: float
    bottleneck: str
    link_bytes: dict                       # link kind -> array of bytes per link
    link_bw: dict                          # link kind -> bandwidth (bytes/s)
    stage_end_s: dict                      # stage -> time the last event of that stage ends
    timeline: list = field(default_factory=list)   # (stage, rank, task, start, end)
    steps: int = 0
    sim_wall_s: float = 0.0
    trace: dict = field(default_factory=dict)      # per network step: t, bytes into inference / out of trainers

    def utilisation(self) -> dict:
        """Per link kind: bytes / (bandwidth x simulated time) for each link."""
        return {k: v / (self.link_bw[k] * self.simulated_s) for k, v in self.link_bytes.items()}

    def summary(self) -> dict:
        u = self.utilisation()
        return dict(simulated_s=self.simulated_s, lower_bound_s=self.lower_bound_s,
                    ratio=self.simulated_s / self.lower_bound_s if self.lower_bound_s else float("nan"),
                    bottleneck=self.bottleneck,
                    max_utilisation={k: float(v.max()) if v.size else 0.0 for k, v in u.items()},
                    mean_utilisation={k: float(v.mean()) if v.size else 0.0 for k, v in u.items()},
                    stage_end_s=self.stage_end_s)

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
    ag_send = np.zeros(world)                   # cross-node all-gathers, over the NICs
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
    if cluster.write_GBps is not None:     # writes on their own path: NIC carries only all-gathers
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


def simulate(plan, cluster, steps: int = 1500, record: bool = True) -> SimResult:
    """Predict one update of `plan` on `cluster` (a wxfer.meta.Cluster).

    steps: network time steps per lower bound (accuracy vs. speed); record: keep the
    per-stage timeline (for `timeline_frame()` / `plot_timeline()`)."""
    import time as _time
    w0 = _time.perf_counter()
    world, ngpu = plan.train_world, int(plan.gpu_of.max()) + 1
    gpn = cluster.gpus_per_node
    nic = cluster.nic_GBps * 1e9
    nvl_bw, pcie_bw, mem_bw = cluster.nvlink_GBps * 1e9, cluster.pcie_GBps * 1e9, cluster.mem_GBps * 1e9
    wm = float(cluster.watermark_bytes)
    lbytes, lbw = _links(plan, cluster)
    lb, bname = lower_bound(plan, cluster)

    # ---- jobs: (sender, task) runs of the transfer table; entries: (job, gpu) aggregates
    n = plan.n_transfers
    gpu = plan.gpu
    if n:
        brk = np.r_[True, (plan.sender[1:] != plan.sender[:-1]) | (plan.task[1:] != plan.task[:-1])]
        job_of = np.cumsum(brk) - 1
        js = np.flatnonzero(brk)
        job_rank, job_task = plan.sender[js], plan.task[js]
        job_packed = np.zeros(js.size)
        np.maximum.at(job_packed, job_of, (plan.src_offset + plan.nbytes).astype(float))
        ekey = job_of * ngpu + gpu
        ukey, einv = np.unique(ekey, return_inverse=True)
        ebytes = np.bincount(einv.reshape(-1), plan.nbytes, ukey.size).astype(float)
        ejob, egpu = ukey // ngpu, ukey % ngpu
    else:
        job_rank = job_task = np.empty(0, np.int64)
        job_packed = np.empty(0)
        ejob = egpu = np.empty(0, np.int64)
        ebytes = np.empty(0)
    J = job_rank.size
    E = ejob.size
    # pairs (sender, receiver); each pair is a FIFO of its entries in the sender's job order
    pkeys, epair = np.unique(job_rank[ejob] * ngpu + egpu, return_inverse=True)
    epair = epair.reshape(-1)
    pair_rank, pair_gpu = pkeys // ngpu, pkeys % ngpu
    P = pkeys.size
    order = np.lexsort((ejob, epair))                  # FIFO positions
    pos_of = np.empty(E, np.int64)
    pos_of[order] = np.arange(E)
    srem = ebytes[order].copy()                         # remaining bytes by FIFO position
    ssize = ebytes[order]
    sentry = order
    pstart = np.searchsorted(epair[order], np.arange(P))
    head = pstart.copy()                                # first unfinished position of each pair
    pend = pstart.copy()                                # one past the last posted position
    pair_rem = np.zeros(P)
    job_entries_left = np.bincount(ejob, minlength=J)
    job_start = np.searchsorted(ejob, np.arange(J))     # ejob is sorted (ukey sorted)
    job_end = np.searchsorted(ejob, np.arange(J), side="right")
    jobs_of_task = {}
    for j in range(J):
        jobs_of_task.setdefault(int(job_task[j]), []).append(j)

    # ---- mesh / rank state
    task_mesh = np.array([t.mesh for t in plan.tasks], np.int64)
    mesh_intra = [len({r // gpn for r in m}) == 1 for m in plan.meshes]
    if cluster.write_GBps is not None and not all(mesh_intra[t.mesh] for t in plan.tasks if len(plan.meshes[t.mesh]) > 1):
        raise ValueError("Cluster.write_GBps models writes inside one node, but this plan has all-gathers across "
                         "nodes (they would share the write path's capacity in this model)")
    group_of_mesh = {m: g for g, ms in enumerate(plan.groups) for m in ms}
    G = len(plan.groups)
    group_left = np.zeros(G, np.int64)
    for t in plan.tasks:
        group_left[t.group] += 1
    release = np.full(G + 1, np.inf)
    release[0] = 0.0
    for g in range(G):                      # empty groups release at once
        if group_left[g] == 0:
            release[g + 1] = release[g]
    # h2d stream per rank follows the rank's task order across groups
    h2d_done = {}
    if cluster.cpu_offload:
        hfree = np.zeros(world)
        for g in plan.groups:
            for m in g:
                k = len(plan.meshes[m])
                for ti in plan.mesh_tasks[m]:
                    for r in plan.meshes[m]:
                        d = plan.tasks[ti].src_bytes / k / pcie_bw
                        h2d_done[(r, ti)] = hfree[r] + d
                        hfree[r] += d
    timeline = []
    if record and cluster.cpu_offload:
        for (r, ti), e in h2d_done.items():
            timeline.append(("h2d", r, ti, e - plan.tasks[ti].src_bytes / len(plan.meshes[task_mesh[ti]]) / pcie_bw, e))
    mem = np.zeros(world)
    quant_free = np.zeros(world)
    job_act_time = np.full(J, np.inf)
    job_done_time = np.full(J, np.inf)
    packed_of = {}
    for j in range(J):
        packed_of[(int(job_rank[j]), int(job_task[j]))] = job_packed[j]
    mptr = {m: 0 for m in range(len(plan.meshes))}
    mbusy = {m: 0.0 for m in range(len(plan.meshes))}     # time the mesh's last all-gather ended
    inflight_ag = {}                                       # mesh -> (task, start, flow ids)
    ag_src, ag_dst, ag_rem, ag_mesh = [], [], [], []
    stage_end = {"h2d": max(h2d_done.values(), default=0.0), "allgather": 0.0, "quant": 0.0, "write": 0.0}
    pending_act = []                                       # (time, job) not yet active

    def need(m, ti):
        P = plan.tasks[ti].src_bytes
        return {r: P + packed_of.get((r, ti), 0.0) for r in plan.meshes[m]}

    def finish_ag(m, ti, t_end):
        """All-gather of task ti done at t_end: quantize on senders, free full tensors."""
        nonlocal stage_end
        P = plan.tasks[ti].src_bytes
        stage_end["allgather"] = max(stage_end["allgather"], t_end)
        for r in plan.meshes[m]:
            pk = packed_of.get((r, ti), 0.0)
            if pk > 0:
                q0 = max(t_end, quant_free[r])
                q1 = q0 + (P + pk) / mem_bw
                quant_free[r] = q1
                stage_end["quant"] = max(stage_end["quant"], q1)
                if record:
                    timeline.append(("quant", r, ti, q0, q1))
            mem[r] -= P
        for j in jobs_of_task.get(ti, ()):
            job_act_time[j] = quant_free[job_rank[j]]
            pending_act.append(j)
        mbusy[m] = t_end
        g = group_of_mesh[m]
        group_left[g] -= 1
        if group_left[g] == 0:
            release[g + 1] = stage_end["allgather"] + cluster.barrier_s
            for g2 in range(g + 1, G):   # cascade over empty groups
                if group_left[g2] == 0:
                    release[g2 + 1] = release[g2 + 1 - 1]
                else:
                    break

    def ready_time(m):
        ti = plan.mesh_tasks[m][mptr[m]]
        s = max(mbusy[m], release[group_of_mesh[m]])
        if cluster.cpu_offload:
            s = max(s, max(h2d_done[(r, ti)] for r in plan.meshes[m]))
        return s

    def try_start(m, now):
        """Start as many all-gathers on mesh m as possible up to time `now`."""
        lst = plan.mesh_tasks[m]
        while mptr[m] < len(lst) and m not in inflight_ag:
            ti = lst[mptr[m]]
            s = ready_time(m)
            if s > now:
                return
            nd = need(m, ti)
            if any(mem[r] > 0 and mem[r] + v > wm for r, v in nd.items()):
                return
            for r, v in nd.items():
                mem[r] += v
            mptr[m] += 1
            ranks = plan.meshes[m]
            k = len(ranks)
            P = plan.tasks[ti].src_bytes
            if k == 1 or mesh_intra[m]:
                e = s + (P * (k - 1) / k) / nvl_bw
                if record:
                    for r in ranks:
                        timeline.append(("allgather", r, ti, s, e))
                finish_ag(m, ti, e)
            else:
                ids = []
                for i in range(k):
                    ids.append(len(ag_src))
                    ag_src.append(ranks[i])
                    ag_dst.append(ranks[(i + 1) % k])
                    ag_rem.append(P * (k - 1) / k)
                    ag_mesh.append(m)
                    ag_live_set.add(ids[-1])
                inflight_ag[m] = (ti, s, ids)
                return

    dt = max(lb, 1e-6) / steps
    now = 0.0
    wbw = cluster.write_bw
    cap = np.concatenate([np.full(world, wbw), np.full(world, nic), np.full(ngpu, wbw)])
    jobs_left = J
    nstep = 0
    ag_done_ids = set()
    ag_live_set = set()
    max_steps = steps * 200
    last_write = 0.0
    open_meshes = list(range(len(plan.meshes)))
    tr_t, tr_w, tr_ag = [], [], []
    gpu_finish = np.zeros(ngpu)
    from collections import deque
    queued = [deque() for _ in range(world)]          # packed jobs waiting to be posted
    posted = np.zeros(world, np.int64)                # jobs with writes in flight, per rank
    posted_bytes = np.zeros(world)
    job_wbytes = np.bincount(ejob, ebytes, J) if J else np.zeros(0)
    post_ranks: set = set()
    max_posted = float(cluster.max_posted_bytes)
    while True:
        for m in open_meshes:
            try_start(m, now + dt)
        open_meshes = [m for m in open_meshes if mptr[m] < len(plan.mesh_tasks[m])]
        # activate jobs whose packing finished by `now`
        if pending_act:
            ready = [j for j in pending_act if job_act_time[j] <= now]
            if ready:
                pending_act[:] = [j for j in pending_act if job_act_time[j] > now]
                for j in sorted(ready):
                    r = int(job_rank[j])
                    queued[r].append(j)
                    post_ranks.add(r)
        if post_ranks:
            for r in post_ranks:
                q = queued[r]
                while q and (posted[r] == 0 or posted_bytes[r] + job_wbytes[q[0]] <= max_posted):
                    j = q.popleft()
                    posted[r] += 1
                    posted_bytes[r] += job_wbytes[j]
                    es = np.arange(job_start[j], job_end[j])
                    ps, poss = epair[es], pos_of[es]
                    if (poss != pend[ps]).any():
                        raise RuntimeError("writes posted out of FIFO order")
                    pend[ps] += 1
                    pair_rem[ps] += srem[poss]
            post_ranks.clear()
        ag_live = sorted(ag_live_set)
        if jobs_left == 0 and not inflight_ag and all(mptr[m] >= len(plan.mesh_tasks[m]) for m in mptr):
            break
        ap = np.flatnonzero(pend > head)               # pairs with posted, unfinished writes
        if ap.size == 0 and not ag_live and not any(queued[r] for r in range(world)):
            # nothing flows: jump to the next stage event
            cands = [job_act_time[j] for j in pending_act]
            for m in mptr:
                if mptr[m] < len(plan.mesh_tasks[m]) and m not in inflight_ag:
                    cands.append(ready_time(m))
            nxt = min([c for c in cands if c > now], default=np.inf)
            if not np.isfinite(nxt):
                raise RuntimeError("simulation stalled (watermark smaller than one task?)")
            now = nxt
            continue
        # ---- one network step
        nap = ap.size
        agi = np.array(ag_live, np.int64)
        fa = pair_rank[ap]
        fb = 2 * world + pair_gpu[ap]
        dem = np.maximum(pair_rem[ap], 0.0)
        if agi.size:
            fa = np.concatenate([fa, np.array(ag_src, np.int64)[agi]])
            fb = np.concatenate([fb, world + np.array(ag_dst, np.int64)[agi]])
            dem = np.concatenate([dem, np.array(ag_rem)[agi]])
        alloc = _waterfill(fa, fb, cap * dt, dem)
        palloc = alloc[:nap]
        tr_t.append(now)
        tr_w.append(float(palloc.sum()))
        tr_ag.append(float(alloc[nap:].sum()))
        # FIFO inside each pair: consume head entries until the pair's bytes are spent
        left = palloc.copy()
        used = np.zeros(nap)
        while nap:
            sel = np.flatnonzero((left > 0) & (head[ap] < pend[ap]))
            if sel.size == 0:
                break
            p_, h_ = ap[sel], head[ap[sel]]
            take = np.minimum(srem[h_], left[sel])
            srem[h_] -= take
            pair_rem[p_] -= take
            left[sel] -= take
            used[sel] += take
            fin = srem[h_] <= 1e-6 * np.maximum(ssize[h_], 1.0)
            if not fin.any():
                break
            hf, pf = h_[fin], p_[fin]
            pair_rem[pf] -= srem[hf]
            srem[hf] = 0.0
            head[pf] += 1
            tend = now + dt * np.minimum(used[sel][fin] / np.maximum(palloc[sel][fin], 1e-30), 1.0)
            np.maximum.at(gpu_finish, pair_gpu[pf], tend)
            for e, te in zip(sentry[hf].tolist(), tend.tolist()):
                j = int(ejob[e])
                job_entries_left[j] -= 1
                if job_entries_left[j] == 0:
                    te2 = te + cluster.write_latency_s
                    job_done_time[j] = te2
                    jobs_left -= 1
                    r = int(job_rank[j])
                    mem[r] -= job_packed[j]
                    posted[r] -= 1
                    posted_bytes[r] -= job_wbytes[j]
                    if queued[r]:
                        post_ranks.add(r)
                    last_write = max(last_write, te2)
                    if record:
                        timeline.append(("write", r, int(job_task[j]), job_act_time[j], te2))
        # all-gather flows
        for q, i in enumerate(agi.tolist()):
            got = alloc[nap + q]
            ag_rem[i] -= got
            if ag_rem[i] <= 1e-6 * max(got, 1):
                ag_done_ids.add(i)
                ag_live_set.discard(i)
        for m in list(inflight_ag):
            ti, s, ids = inflight_ag[m]
            if all(i in ag_done_ids for i in ids):
                del inflight_ag[m]
                e = now + dt
                if record:
                    for r in plan.meshes[m]:
                        timeline.append(("allgather", r, ti, s, e))
                finish_ag(m, ti, e)
        now += dt
        nstep += 1
        if nstep > max_steps:
            raise RuntimeError("simulation did not finish (more than 200x the lower bound)")
    total = max(last_write, stage_end["allgather"], stage_end["quant"])
    stage_end["write"] = last_write
    trace = dict(t=np.array(tr_t), dt=dt, write_bytes=np.array(tr_w), allgather_bytes=np.array(tr_ag),
                 infer_capacity=ngpu * wbw * dt, infer_finish_s=gpu_finish)
    return SimResult(total, lb, bname, lbytes, lbw, stage_end, timeline, nstep, _time.perf_counter() - w0, trace)
