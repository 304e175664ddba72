"""The stage side of the simulator (wxfer.plan.simulate): how long each stage of one task
takes (`_StageModel`) and the order of stage events on the trainer ranks (`_Meshes`).
Split out of simulate.py; see its docstring for the model."""

from __future__ import annotations

import os

import numpy as np

from ..zerocopy import COPY_FIRST_BYTES, batch_ends, copy_batch_full
from .kinds import KINDS
from .sim_net import _Jobs, _Network


def _copy_first() -> int:
    """$WXFER_DIRECT_COPY_FIRST as the runtime reads it (``envs.size``), for the simulated batched
    copy launches to ramp as the Sender's do; wxfer.envs (which loads the native extension for
    its C table) is imported only where the variable is set: a plan imports no extension."""
    if not os.environ.get("WXFER_DIRECT_COPY_FIRST", "").strip():
        return COPY_FIRST_BYTES
    from .. import envs

    return envs.size("WXFER_DIRECT_COPY_FIRST", COPY_FIRST_BYTES)


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
        self.copy_batch_bw = self.copy_bw if cal.copy_batch_GBps is None else cal.copy_batch_GBps * 1e9
        self.quant_bw = self.mem_bw if cal.quant_GBps is None else cal.quant_GBps * 1e9
        self.quant_small_bw = self.quant_bw if cal.quant_small_GBps is None else cal.quant_small_GBps * 1e9
        self.small_elems = float(cal.small_piece_elems)
        self.barrier_s = float(cluster.barrier_s)
        self.serial, self.host_sync = bool(cal.serial), bool(cal.host_sync)
        # the host waits for each task's packing before it goes on (a delta push on a GPU: it reads back
        # the count of changed bytes per task, wxfer.runtime.delta_send); set by simulate(host_waits_pack=)
        self.host_waits = False
        self.zc_batch = max(1, int(cal.zc_batch))
        self.write_bw = cluster.write_bw
        self.begin_s = float(cal.push_begin_s)
        self.fence_s = float(getattr(cal, "begin_fence_s", 0.0))  # the begin stamps land: writes may post
        hd = getattr(cal, "host_direct_task_s", None)
        self.host_direct = None if hd is None else float(hd)
        hc = getattr(cal, "host_copy_task_s", None)
        self.host_copy = float(cal.host_zc_task_s if hc is None else hc)
        self.copy_launch_host = float(getattr(cal, "host_copy_launch_s", None) or 0.0)
        self.copy_range_host = float(getattr(cal, "host_copy_range_s", None) or 0.0)

    def h2d_s(self, task, k: int) -> float:
        """Copy this rank's 1/k of the task's sources over PCIe (one copy per source)."""
        return self.cal.h2d_call_s * len(task.sources) + task.src_bytes / k / self.pcie_bw

    def host_gather_s(self, task) -> float:
        """Host work before the task's collectives: per task and per source parameter."""
        return self.cal.host_task_s + self.cal.host_param_s * len(task.sources)

    def host_pack_s(self, pieces: int) -> float:
        """Host work to issue the packing of `pieces` pieces."""
        return self.cal.host_piece_s * pieces

    def host_parts(self, task, pieces: int, direct: bool) -> tuple:
        """(host seconds before the task's collectives, host seconds to issue its packing): a
        packed task's per task / parameter / piece, a direct task's per task (all before its
        kernel; a packed task's figures when host_direct_task_s is not measured)."""
        if direct and self.host_direct is not None:
            return self.host_direct, 0.0
        return self.host_gather_s(task), self.host_pack_s(pieces)

    def coll_call_s(self, task, k: int) -> float:
        return self.cal.coll_call_s * len(task.sources) if k > 1 else 0.0

    def allgather_s(self, task, k: int) -> float:
        """An all-gather inside a node (or none, k == 1): each rank receives (k-1)/k."""
        return self.coll_call_s(task, k) + (task.src_bytes * (k - 1) / k) / self.nvl_bw

    def ring_bytes(self, task, k: int) -> float:
        """Bytes each ring flow of a cross-node all-gather carries."""
        return task.src_bytes * (k - 1) / k

    def pack_s(
        self,
        task,
        packed: float,
        pieces: int = 0,
        fp8: bool = False,
        piece_elems: float = 0.0,
        src_read: float | None = None,
    ) -> float:
        """Fuse / quantize / pack: `pieces` launches (see launches()), the sources read (`src_read`:
        the bytes of the rank's own pieces of the full tensors; None: all of the task's sources)
        and the packed buffer written at the quantizer's rate (FP8; its rate on small pieces when
        they average at most small_piece_elems elements) or the copy rate."""
        bw = self.copy_bw
        if fp8:
            bw = self.quant_small_bw if 0 < piece_elems <= self.small_elems else self.quant_bw
        read = task.src_bytes if src_read is None else src_read
        return self.cal.pack_launch_s * pieces + (read + packed) / bw

    def launches(self, pieces: int, merged: int) -> int:
        """Kernel launches of a packing: one per piece (the reference quantizer), or the native
        packing's (`merged`: a copy per merged raw piece, one launch for all FP8 pieces)."""
        return pieces if self.cal.launch_per_piece else merged

    def write_post_s(self, nwrites: int) -> float:
        return self.cal.write_call_s * nwrites

    def copy_s(self, nbytes: float) -> float:
        """One batched copy launch (wxfer.runtime.copies, up to COPY_BATCH ranges) on the side
        stream: its per-launch cost (pack_launch_s, the kernels' measured launch cost) and the
        ranges read and written (2 x bytes) at the batched copies' rate (copy_batch_GBps; else the
        on-device copy's)."""
        return self.cal.pack_launch_s + 2.0 * nbytes / self.copy_batch_bw

    def zc_host_s(self, last_of_batch: bool) -> float:
        """Host work of one zero-copy task (and of its submit_prepared call when it is the last
        of its batch)."""
        return self.cal.host_zc_task_s + (self.cal.host_zc_batch_s if last_of_batch else 0.0)


_ZC, _STAGED, _PACKED, _DIRECT, _COLL, _COPY = (KINDS.index(k) for k in KINDS)


class _Meshes:
    """The order of stage events.  A mesh runs its tasks' all-gathers in plan order, the
    next one when the previous ended, its group was released (the previous group's last
    all-gather ended and every rank's host was done with its tasks of that group, plus the
    barrier; the host starts the task's work only then), its ranks' host has issued it (after its earlier
    tasks and its admission under the watermark), its ranks' H2D of the task is done
    (offload: on the rank's one stream before the gather when serial, else a stream of its
    own), and every sending rank has room under the watermark for its buffer (what the
    engine holds: nothing for a zero-copy task).  A sending rank packs each task after its
    all-gather, one task at a time (reading its own pieces of the full tensors; with
    host_waits, its host waits for the packing before its next task: a delta push's count read
    back); a zero-copy task costs only host time, its batch's jobs
    are handed over when the batch's last task is; jobs become ready in their rank's order
    (the engine's FIFO), each after its predecessor's writes were posted."""

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
        b0 = model.begin_s
        self.release = np.full(G + 1, np.inf)
        self.release[0] = b0
        # per mesh group: when the last of its ranks' hosts was done with its tasks (the runtime's
        # barrier is the hosts': each rank issues it after its last task of the group)
        self.group_host = np.full(G, b0)
        for g in range(G):  # empty groups release at once
            if self.group_left[g] == 0:
                self.release[g + 1] = self.release[g]
        self.timeline: list = []
        self.kind = jobs.kind if jobs.kind is not None else np.full(jobs.n, _PACKED)
        self.h2d_stream = model.offload and not model.serial  # H2D on a stream of its own
        self.h2d_done = self._h2d() if self.h2d_stream else {}
        self.mem = np.zeros(world)
        self.held = np.zeros(jobs.n)  # what each job holds under the watermark
        self.mem_free_t = np.zeros(world)  # when the rank's last buffer was released
        self.admit_t: dict = {}  # mesh -> when its ranks were admitted after the watermark held them
        self.blocked: set = set()
        self.quant_free = np.full(world, b0)  # end of the rank's last packing
        self.host_free = np.full(world, b0)  # when the rank's host is done with its last task
        self.dev_free = np.full(world, b0)  # serial: end of the rank's last H2D, gather or packing
        # when the rank's engine posted its last job's writes: none before the begin stamps landed (a fence)
        self.post_free = np.full(world, b0 + model.fence_s)
        self.out_n = np.zeros(world, np.int64)  # jobs handed to the rank's engine, not yet done
        self.out_done = np.full(world, b0 + model.fence_s)  # when the last of them landed
        self.waited = np.zeros(world, bool)  # the rank's first direct task waited for its begin stamps
        self.begin_landed = b0 + model.fence_s
        self.direct_pend: list = []  # direct jobs, done at their act_time (their kernel's end)
        self.busy_s = {k: np.zeros(world) for k in ("host", "allgather", "pack")}  # seconds per rank
        self.h2d_busy = np.zeros(world)
        self.ptr = {m: 0 for m in range(len(plan.meshes))}
        self.busy = {m: 0.0 for m in range(len(plan.meshes))}  # end of the mesh's last all-gather
        self.open = list(range(len(plan.meshes)))
        self.act_time = np.full(jobs.n, np.inf)
        self.pending: list = []  # jobs packed later than now
        self.zc_last, self.group_last = self._zc_batches()
        self.zc_open: list = [[] for _ in range(world)]  # zero-copy jobs of the rank's open batch
        self.copy_open: list = [[] for _ in range(world)]  # copy jobs queued, not yet launched
        self.copy_n = np.zeros(world, np.int64)  # their ranges
        self.copy_b = np.zeros(world)  # and bytes
        self.copy_launches = np.zeros(world, np.int64)  # the rank's batched copy launches so far
        self.copy_first = _copy_first()  # their ramp, as the runtime's
        self.stage_end = {"h2d": max(self.h2d_done.values(), default=0.0), "allgather": 0.0, "quant": 0.0, "write": 0.0}

    def _h2d(self) -> dict:
        """(rank, task) -> end of its H2D on a stream of its own (not serial), in the rank's
        task order."""
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

    def _zc_batches(self) -> tuple:
        """(the zero-copy jobs that end a batch (wxfer.zerocopy.batch_ends over each rank's
        tasks of a mesh group, in the rank's order), the last job of each rank's mesh group
        where it has copy jobs: its queued copies are launched after it)."""
        jb, out, last = self.jobs, set[int](), set[int]()
        sel = (self.kind == _ZC) | (self.kind == _COPY)
        if jb.job_of is None or not sel.any():
            return out, last
        names = {_ZC: "zero_copy", _COPY: "copy"}
        for r in np.unique(jb.rank[sel]).tolist():
            for g in self.plan.rank_schedule(r):
                js = [jb.job_of.get((r, t)) for t, _ in g]
                ks = [names.get(int(self.kind[j]), "other") if j is not None else "other" for j in js]
                nb = [float(jb.packed[j]) if j is not None else 0.0 for j in js]
                out.update(js[i] for i in batch_ends(ks, self.model.zc_batch, nb))  # (a copy job's, possibly)
                own = [j for j in js if j is not None]
                if "copy" in ks and own:
                    last.add(own[-1])
        return out, last

    def _kind(self, m: int, ti: int) -> int:
        """The kind (index into KINDS) of task ti on mesh m's first rank (collective only: none)."""
        if self.jobs.job_of is None:
            return _PACKED
        j = self.jobs.job_of.get((self.plan.meshes[m][0], ti))
        return _COLL if j is None else int(self.kind[j])

    def _engine_idle(self, m: int, ti: int) -> float:
        """When the ranks of mesh m may start task ti: 0, or for a rank's first direct task the
        time its begin stamps landed (the Sender waits for that fence task alone,
        Engine.wait(fence=...): an engine fence orders only the engine's writes; copy tasks wait
        at their first launch instead, _copy_flush)."""
        if self._kind(m, ti) != _DIRECT:
            return 0.0
        ranks = [r for r in self.plan.meshes[m] if not self.waited[r]]
        return float(self.begin_landed) if ranks else 0.0

    def _zero_copy(self, m: int, ti: int) -> bool:
        ranks = self.plan.meshes[m]
        if len(ranks) != 1 or self.jobs.job_of is None:
            return False
        j = self.jobs.job_of.get((ranks[0], ti))
        return j is not None and self.kind[j] in (_ZC, _COPY)  # host time only here

    def _held(self, r: int, ti: int) -> float:
        j = self.jobs.job_of.get((r, ti)) if self.jobs.job_of is not None else None
        if j is None or self.kind[j] in (_ZC, _DIRECT, _COPY):
            return 0.0
        return float(self.jobs.packed[j])

    def finished(self) -> bool:
        return not self.direct_pend and all(self.ptr[m] >= len(self.plan.mesh_tasks[m]) for m in self.ptr)

    def direct_done(self, now: float) -> list:
        """[(job, end)] of the direct jobs whose kernel ended by `now` (removed)."""
        if not self.direct_pend:
            return []
        done = [(j, float(self.act_time[j])) for j in self.direct_pend if self.act_time[j] <= now]
        if done:
            self.direct_pend[:] = [j for j in self.direct_pend if self.act_time[j] > now]
        return done

    def _h2d_span(self, r: int, m: int, ti: int, adm: float) -> tuple:
        """Serial offload: (start, end) of rank r's H2D of task ti on its stream (issued by the
        host after its admission at `adm`)."""
        md = self.model
        h = max(self.host_free[r], adm) + md.host_gather_s(self.plan.tasks[ti])
        d0 = max(self.dev_free[r], h)
        return d0, d0 + md.h2d_s(self.plan.tasks[ti], len(self.plan.meshes[m]))

    def ready_time(self, m: int) -> float:
        """When mesh m's next all-gather can start: the mesh, its group, its H2D, every rank's
        host having issued it (and, serial, every rank's stream free)."""
        ti = self.plan.mesh_tasks[m][self.ptr[m]]
        s = max(self.busy[m], self.release[self.group_of_mesh[m]])
        ranks = self.plan.meshes[m]
        if self._zero_copy(m, ti):  # no device work: when the host gets to it (a copy: the engine's wait)
            return max(s, self.host_free[ranks[0]], self._engine_idle(m, ti))
        if self.h2d_stream:
            s = max(s, max(self.h2d_done[(r, ti)] for r in ranks))
        hg = self.model.host_parts(self.plan.tasks[ti], 0, self._kind(m, ti) == _DIRECT)[0]
        # (the host does the task's work after the barrier before its group: it waits for it first)
        adm = max(self.admit_t.get(m, 0.0), self._engine_idle(m, ti), self.release[self.group_of_mesh[m]])
        if hg > 0 or adm > 0:
            s = max(s, max(max(self.host_free[r], adm) for r in ranks) + hg)
        if self.model.serial and (len(ranks) > 1 or self.model.offload):  # a collective or an H2D on the stream
            # (one rank, no H2D: nothing on the stream before its packing, which waits for the stream itself)
            s = max(s, max(self.dev_free[r] for r in ranks))
            if self.model.offload:
                s = max(s, max(self._h2d_span(r, m, ti, adm)[1] for r in ranks))
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
            ranks = plan.meshes[m]
            nd = {r: self._held(r, ti) for r in ranks}
            if any(self.mem[r] > 0 and v > 0 and self.mem[r] + v > self.wm for r, v in nd.items()):
                self.blocked.add(m)  # the hosts wait in Engine.reserve
                return
            if m in self.blocked:  # admitted when the last buffer was released: start from there
                self.blocked.discard(m)
                self.admit_t[m] = max(float(self.mem_free_t[r]) for r in ranks)
                s = self.ready_time(m)
                if s > now:
                    return
            for r, v in nd.items():
                self.mem[r] += v
                j = self.jobs.job_of.get((r, ti)) if self.jobs.job_of is not None else None
                if j is not None:
                    self.held[j] = v
            if self._kind(m, ti) == _DIRECT:  # a rank's first one: the host waited for the begin stamps
                idle = self._engine_idle(m, ti)
                for r in ranks:
                    self.host_free[r] = max(self.host_free[r], idle)
                    self.waited[r] = True
            self.ptr[m] += 1
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

    def _post(self, j: int, r: int, ready: float) -> None:
        """Job j is ready at `ready`: the engine posts its writes after the rank's earlier jobs'
        (a direct job has none: its kernel wrote the receivers; it ends when the kernel did)."""
        assert self.jobs.nwrites is not None
        if self.kind[j] == _DIRECT:  # not the engine's: done when its kernel is (direct_done)
            self.act_time[j] = ready
            self.direct_pend.append(j)
            return
        else:
            t = max(ready, self.post_free[r]) + self.model.write_post_s(int(self.jobs.nwrites[j]))
            self.post_free[r] = t
            self.act_time[j] = t
            self.out_n[r] += 1
        self.pending.append(j)

    def _zero_copy_end(self, r: int, j: int, s: float) -> None:
        """A zero-copy or copy task on rank r reached by its host at s: host time only (and the
        submit_prepared call where the open batch is handed to the engine, all at once: after
        its last task, or after the copy tasks that follow it); a copy task's ranges are queued,
        launched once COPY_BATCH of them are (or COPY_BATCH_BYTES) and at the mesh group's end
        (wxfer.runtime.inplace.InPlaceWriter.queue_copy)."""
        end, copy = j in self.zc_last, self.kind[j] == _COPY
        md = self.model
        cost = (md.host_copy + (self.model.cal.host_zc_batch_s if end else 0.0)) if copy else md.zc_host_s(end)
        h = max(self.host_free[r], s) + cost
        self.busy_s["host"][r] += h - max(self.host_free[r], s)
        self.host_free[r] = h
        if copy:
            assert self.jobs.xwrites is not None and self.jobs.xbytes is not None
            self.copy_open[r].append(j)
            self.copy_n[r] += int(self.jobs.xwrites[j])
            self.copy_b[r] += float(self.jobs.xbytes[j])
            if copy_batch_full(self.copy_n[r], self.copy_b[r], int(self.copy_launches[r]), self.copy_first):
                self._copy_flush(r, h)
        else:
            self.zc_open[r].append(j)
        if end:
            for jj in self.zc_open[r]:
                self._post(jj, r, h)
            self.zc_open[r] = []
        if j in self.group_last:  # the mesh group's end: the queued copies go out
            self._copy_flush(r, h)

    def _copy_flush(self, r: int, t: float) -> None:
        """Rank r's queued copies in one launch issued at t on its side stream (after its earlier
        kernels: the direct ones and earlier copies); its jobs end with the launch."""
        js = self.copy_open[r]
        if not js:
            return
        assert self.jobs.xbytes is not None
        if not self.waited[r]:  # the rank's first launch: its host waits for the begin stamps first
            self.waited[r] = True
            if self.begin_landed > t:
                self.host_free[r] = max(self.host_free[r], self.begin_landed)
                t = self.begin_landed
        # the launch's own host work (its range table, the launch: host_copy_launch_s / _range_s)
        hl = self.model.copy_launch_host + self.model.copy_range_host * self.copy_n[r]
        if hl:
            t = max(t, float(self.host_free[r])) + hl
            self.host_free[r] = t
            self.busy_s["host"][r] += hl
        k0 = max(t, self.quant_free[r])
        k1 = k0 + self.model.copy_s(float(sum(self.jobs.xbytes[j] for j in js)))
        self.quant_free[r] = k1
        self.dev_free[r] = max(self.dev_free[r], k1)
        self.busy_s["pack"][r] += k1 - k0
        self.stage_end["quant"] = max(self.stage_end["quant"], k1)
        if self.record:
            self.timeline.append(("quant", r, int(self.jobs.task[js[-1]]), k0, k1))
        for jj in js:
            self.act_time[jj] = k1
            self.direct_pend.append(jj)
        self.copy_open[r], self.copy_n[r], self.copy_b[r] = [], 0, 0.0
        self.copy_launches[r] += 1

    def end_allgather(self, m: int, ti: int, start: float, t_end: float) -> None:
        """All-gather of task ti ended: pack on the senders, release the next group when this
        was its group's last."""
        plan, jb, md = self.plan, self.jobs, self.model
        assert jb.job_of is not None and jb.pieces is not None and jb.fp8 is not None and jb.nwrites is not None
        assert jb.launches is not None
        task = plan.tasks[ti]
        zc = self._zero_copy(m, ti)
        if self.record and not zc:
            for r in plan.meshes[m]:
                self.timeline.append(("allgather", r, ti, start, t_end))
        self.stage_end["allgather"] = max(self.stage_end["allgather"], t_end)
        adm = max(self.admit_t.pop(m, 0.0), float(self.release[self.group_of_mesh[m]]))  # (after the barrier)
        for r in plan.meshes[m]:
            j = jb.job_of.get((r, ti))
            direct = j is not None and self.kind[j] == _DIRECT
            hg, hpk = md.host_parts(task, int(jb.pieces[j]) if j is not None else 0, direct)
            if zc:
                assert j is not None
                self._zero_copy_end(r, j, start)
                continue
            if md.serial and md.offload:
                d0, d1 = self._h2d_span(r, m, ti, adm)
                self.h2d_busy[r] += d1 - d0
                self.stage_end["h2d"] = max(self.stage_end["h2d"], d1)
                if self.record:
                    self.timeline.append(("h2d", r, ti, d0, d1))
            h0 = max(self.host_free[r], adm)
            # the host after issuing the gather (host_sync: after waiting for it)
            hr = t_end if md.host_sync else h0 + hg
            self.busy_s["host"][r] += hg
            self.busy_s["allgather"][r] += t_end - start
            if j is not None and self.kind[j] != _STAGED and jb.packed[j] > 0:
                pieces = int(jb.pieces[j])
                hp = hr + hpk
                q0 = max(t_end, self.quant_free[r], hp)
                pe = float(jb.fp8_piece_elems[j]) if jb.fp8_piece_elems is not None else 0.0
                # direct: the same kernel, its output at the receivers' addresses (sources read + packed written)
                rd = float(jb.src_read[j]) if jb.src_read is not None else None
                q = md.pack_s(task, jb.packed[j], md.launches(pieces, int(jb.launches[j])), bool(jb.fp8[j]), pe, rd)
                q1 = q0 + q
                self.quant_free[r] = q1
                self.dev_free[r] = q1
                self.host_free[r] = q1 if md.host_sync or md.host_waits else hp
                self.busy_s["host"][r] += hpk
                self.busy_s["pack"][r] += q1 - q0
                self.stage_end["quant"] = max(self.stage_end["quant"], q1)
                if self.record:
                    self.timeline.append(("quant", r, ti, q0, q1))
                ready = max(self.quant_free[r], self.host_free[r])
            else:  # nothing to pack: sent as gathered (staged), or only the collective
                self.host_free[r] = hr
                self.dev_free[r] = max(self.dev_free[r], t_end)
                ready = max(t_end, hr)
            if j is not None:
                self._post(j, r, ready)
                if j in self.group_last:
                    self._copy_flush(r, float(self.host_free[r]))
        self.busy[m] = t_end
        g = self.group_of_mesh[m]
        self.group_host[g] = max(self.group_host[g], max(float(self.host_free[r]) for r in plan.meshes[m]))
        self.group_left[g] -= 1
        if self.group_left[g] == 0:  # every all-gather of the group ended and every host reached the barrier
            self.release[g + 1] = max(self.stage_end["allgather"], self.group_host[g]) + self.model.barrier_s
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
        """The job's last write landed at t: its buffer is released."""
        r = int(self.jobs.rank[j])
        self.mem[r] -= self.held[j]
        self.mem_free_t[r] = max(self.mem_free_t[r], t)
        if self.kind[j] not in (_DIRECT, _COPY):
            self.out_n[r] -= 1
            self.out_done[r] = max(self.out_done[r], t)
        if self.record:
            self.timeline.append(("write", r, int(self.jobs.task[j]), self.act_time[j], t))

    def next_event(self, now: float, net: _Network) -> float:
        """The next stage event after `now` (nothing flows until then)."""
        cands = [self.act_time[j] for j in self.pending + self.direct_pend]
        for m in self.ptr:
            if self.ptr[m] < len(self.plan.mesh_tasks[m]) and m not in net.rings:
                cands.append(self.ready_time(m))
        nxt = min([c for c in cands if c > now], default=np.inf)
        if not np.isfinite(nxt):
            raise RuntimeError("simulation stalled (watermark smaller than one task?)")
        return nxt
