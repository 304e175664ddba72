"""The stage side of the simulator (wxfer.plan.simulate): how long each stage of one task
takes (`_StageModel`) and the order of stage events on the trainer ranks (`_Meshes`).
Split out of simulate.py; see its docstring for the model."""

from __future__ import annotations

import numpy as np

from .sim_net import _Jobs, _Network


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
