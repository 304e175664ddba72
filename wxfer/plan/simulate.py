"""Flow-level simulation of one weight update following a plan on a modelled cluster.

Stages per task (a task's mesh runs its tasks in plan order; mesh groups are separated
by a barrier over all trainer ranks: the next group starts once every all-gather of the
group ended and every rank's host was done with its tasks of the group, plus `barrier_s`;
the runtime's barrier is the hosts', issued after a rank's last task of the group):

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

from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np

from .sim_net import _Jobs, _jobs, _Network, _waterfill  # noqa: F401 -- the parts, tested alone
from .kinds import KINDS
from .sim_stages import _Meshes, _StageModel


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
    terms: dict = field(default_factory=dict)  # per-term seconds on the busiest rank (host, kernel, write, ...)
    assumptions: dict = field(default_factory=dict)  # calibration terms used as assumptions, not measured: why

    @property
    def bound_by(self) -> str:
        """The stage with the most seconds on its busiest rank (or the links' lower bound)."""
        b = self.stage_busy_s
        return max(b, key=b.__getitem__) if b else "links"

    def utilisation(self) -> dict:
        """Per link kind: bytes / (bandwidth x simulated time) for each link."""
        return {k: v / (self.link_bw[k] * self.simulated_s) for k, v in self.link_bytes.items()}

    def record(self, *names: str) -> dict:
        """This run as a measurement's record keeps it: simulated_s, then simulated_<name> for
        each of `names` (an attribute: bound_by, stage_busy_s, terms, lower_bound_s, ...)."""
        return dict(simulated_s=self.simulated_s, **{"simulated_" + n: getattr(self, n) for n in names})

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
            terms=self.terms,
            assumptions=self.assumptions,
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


def _kinds(plan, cluster, kinds) -> dict | None:
    """simulate()'s kinds: a dict as given, "auto" decided from the plan's training parameters."""
    if not isinstance(kinds, str):
        return kinds
    if kinds != "auto":
        raise ValueError(f"simulate: kinds must be a dict, 'auto' or None, got {kinds!r}")
    from .kinds import task_kinds

    return task_kinds(plan, plan.train_params or None, cluster.cpu_offload)


def _totals(plan, cluster, meshes: _Meshes, jobs: _Jobs, lb: float, last_write: float) -> tuple:
    """(simulated seconds, busiest rank's seconds per stage, terms) once the events ran: the
    last write or stage-2 event, the shared-core / shared-GPU floors, the per-push costs."""
    stage_end, cal, world = meshes.stage_end, cluster.cal, plan.train_world
    total = max(last_write, stage_end["allgather"], stage_end["quant"], float(meshes.host_free.max(initial=0.0)))
    # each rank's separate writes (a direct task's kernel does its own): bytes at the write rate plus
    # the write path's own time per write; and the engine's posting of them (overlapping the link)
    nw = np.zeros(world)
    wr = np.zeros(world)
    if jobs.n:
        assert jobs.nwrites is not None
        nw = np.bincount(jobs.rank, jobs.nwrites, world).astype(float)
        wr = np.bincount(jobs.rank, jobs.wbytes, world) / cluster.write_bw
    fence = cal.begin_fence_s
    if cal.cpu_shared:  # stage 2 and the writes take turns on the same cores
        # the write rate was measured with one writer and one target using the machine's cores: every
        # trainer's writes take turns on them (all bytes / that rate)
        per_rank = cast(np.ndarray, sum(meshes.busy_s.values()))  # busy_s is never empty: not the 0 start
        wl = float(plan.nbytes.sum()) / cluster.write_bw if plan.n_transfers else 0.0
        total = max(total, cal.push_begin_s + (float(per_rank.max()) if per_rank.size else 0.0) + wl)
    if cal.device_shared and world:  # a rank's kernels and its writes' bytes share its GPU's memory (neither
        # starts before the begin stamps landed: the writes wait for the fence, a direct kernel for the engine)
        total = max(total, cal.push_begin_s + fence + float((meshes.busy_s["pack"] + wr).max()))
    total += cal.push_end_s + cal.push_fixed_s
    busy = {k: float(v.max()) if v.size else 0.0 for k, v in meshes.busy_s.items()}
    # H2D: seconds on the busiest rank's stream (serial), else when its own stream ended
    busy["h2d"] = float(meshes.h2d_busy.max(initial=0.0)) if not meshes.h2d_stream else stage_end["h2d"]
    busy["links"] = lb
    busy["push_fixed"] = cal.push_fixed_s + cal.push_begin_s + cal.push_end_s + fence
    terms = dict(  # each term on its busiest trainer rank, seconds (not a sum: stages overlap)
        host_s=busy["host"],
        kernel_s=busy["pack"],
        allgather_s=busy["allgather"],
        h2d_s=busy["h2d"],
        write_s=float((wr + nw * cal.write_dev_s).max(initial=0.0)),  # the writes on the link (+ write_dev_s each)
        post_s=float((nw * cal.write_call_s).max(initial=0.0)),  # the engine posting them, meanwhile
        stamps_s=cal.push_begin_s + fence + cal.push_end_s + cal.push_fixed_s,
        direct_tasks=int((meshes.kind == KINDS.index("direct")).sum()),
        links_s=lb,
        zero_copy_tasks=int((meshes.kind == KINDS.index("zero_copy")).sum()),
        copy_tasks=int((meshes.kind == KINDS.index("copy")).sum()),
        jobs=int(jobs.n),
    )
    return total, busy, terms


# the calibration terms each kind of task is charged (wxfer.plan.kinds; check_terms)
_KIND_TERMS = {
    "zero_copy": ("host_zc_task_s", "host_zc_batch_s", "write_call_s", "write_dev_s"),
    "staged": ("host_task_s", "host_param_s", "write_call_s", "write_dev_s"),
    "packed": ("host_task_s", "host_param_s", "host_piece_s", "pack_launch_s", "write_call_s", "write_dev_s"),
    "direct": ("host_direct_task_s", "pack_launch_s"),
    "collective_only": ("host_task_s", "host_param_s"),
    "copy": ("host_copy_task_s", "pack_launch_s", "copy_batch_GBps"),
}


def needed_terms(plan, cluster, kinds) -> dict:
    """{calibration term: what in this plan charges it} for a simulation of `plan` on
    `cluster` with these task kinds (a dict; None: every task packed)."""
    need = {k: "every push" for k in ("push_begin_s", "push_end_s", "begin_fence_s")}
    ks = dict(kinds) if kinds is not None else {t.id: "packed" for t in plan.tasks}
    cal = cluster.cal
    if cal.write_GBps is not None:  # the cluster's write path is the calibration's (Calibration.apply)
        need["write_GBps"] = "every write"
    for t in plan.tasks:
        k = ks.get(t.id, "packed")
        terms = list(_KIND_TERMS.get(k, ()))
        if k == "direct" and cal.host_direct_task_s is None:
            terms = ["host_task_s", "host_param_s", "host_piece_s", "pack_launch_s"]
        if k == "copy" and cal.host_copy_task_s is None:
            terms[0] = "host_zc_task_s"
        if k in ("packed", "direct"):
            fp8 = any(sh.kind == "fp8" for sh in t.shards)
            terms.append("quant_GBps" if fp8 else "copy_GBps")
        if len(plan.meshes[t.mesh]) > 1:
            terms += ["coll_call_s", "allgather_GBps"]
        if cluster.cpu_offload:
            terms += ["h2d_call_s", "h2d_GBps"]
        for x in terms:
            need.setdefault(x, "%s task %d (%s)" % (k, t.id, t.sources[0] if t.sources else "-"))
    return need


def check_terms(plan, cluster, kinds) -> dict:
    """The assumptions this simulation uses ({term: why}); raises ValueError naming every
    term it needs (Calibration.need) that its calibration marks unmeasured
    (Calibration.unmeasured) and no assumption covers (wxfer.plan.calibrate.assume)."""
    cal = cluster.cal
    need = needed_terms(plan, cluster, kinds)
    missing = {}
    for k in sorted(need):
        try:
            cal.need(k, need[k])
        except ValueError as e:
            missing[k] = str(e)
    if missing:
        raise ValueError(
            "calibration %r did not measure what this plan needs:\n  " % cal.name
            + "\n  ".join(missing.values())
            + "\n(measure it on a placement that runs such tasks, or give it a value with "
            "wxfer.plan.calibrate.assume(cal, why=..., %s=...); python -m wxfer plan: --assume %s=VALUE)"
            % (sorted(missing)[0], sorted(missing)[0])
        )
    return {k: cal.assumptions[k] for k in need if k in cal.assumptions}


def _charged(cluster):
    """`cluster` with its calibration's None terms (those with no other meaning, NEED_VALUE)
    at 0.0: check_terms found that no task of this plan charges them."""
    from ..meta import NEED_VALUE

    cal = cluster.cal
    put = {k: 0.0 for k in NEED_VALUE if getattr(cal, k) is None}
    return replace(cluster, calibration=replace(cal, **put)) if put else cluster


def _check_write_path(plan, cluster) -> None:
    """Cluster.write_GBps is a one-node model: refuse a plan whose all-gathers cross nodes."""
    gpn = cluster.gpus_per_node
    if cluster.write_GBps is not None and any(len({r // gpn for r in plan.meshes[t.mesh]}) > 1 for t in plan.tasks):
        raise ValueError(
            "Cluster.write_GBps models writes inside one node, but this plan has all-gathers across "
            "nodes (they would share the write path's capacity in this model)"
        )


def _run(meshes: _Meshes, net: _Network, dt: float, max_steps: int) -> tuple:
    """The event loop: (network steps taken, last write's end, (step times, write bytes, all-gather
    bytes per step)) once every job, ring and mesh finished; RuntimeError past `max_steps`."""
    now, nstep, last_write = 0.0, 0, 0.0
    tr_t, tr_w, tr_ag = [], [], []
    while True:
        meshes.start(now + dt, net)
        net.queue(meshes.ready_jobs(now))
        for j, te in meshes.direct_done(now):
            meshes.job_done(j, te)
            last_write = max(last_write, te)
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
        for m, ti, s, te in rings_done:
            meshes.ring_end(m, ti, s, te)
        now += dt
        nstep += 1
        if nstep > max_steps:
            raise RuntimeError("simulation did not finish (more than 200x the lower bound)")
    return nstep, last_write, (tr_t, tr_w, tr_ag)


def simulate(
    plan,
    cluster,
    steps: int = 1500,
    record: bool = True,
    kinds: dict | str | None = None,
    host_waits_pack: bool = False,
) -> SimResult:
    """Predict one update of `plan` on `cluster` (a wxfer.meta.Cluster).

    steps: network time steps per lower bound (accuracy vs. speed); record: keep the
    per-stage timeline (for `timeline_frame()` / `plot_timeline()`); kinds: task -> kind of
    work on its senders (wxfer.plan.kinds; a Sender's ``task_kinds()``), "auto": as the
    runtime decides them from the plan's training parameters (``task_kinds(plan,
    plan.train_params, cluster.cpu_offload)``), None: every task packed (the model before
    zero-copy tasks); host_waits_pack: each rank's host waits for every packing it issued before
    its next task (a delta push on a GPU reads back each task's count of changed bytes,
    wxfer.plan.delta)."""
    import time as _time

    w0 = _time.perf_counter()
    world, ngpu = plan.train_world, int(plan.gpu_of.max()) + 1
    _check_write_path(plan, cluster)
    kinds = _kinds(plan, cluster, kinds)
    assumed = check_terms(plan, cluster, kinds)
    cluster = _charged(cluster)
    lbytes, lbw = _links(plan, cluster)
    lb, bname = lower_bound(plan, cluster)
    jobs = _jobs(plan, ngpu, kinds)
    net = _Network(
        jobs,
        world,
        ngpu,
        cluster.nic_GBps * 1e9,
        cluster.write_bw,
        cluster.max_posted_bytes,
        cluster.write_latency_s,
        float(getattr(cluster.cal, "write_dev_s", 0.0)),
    )
    model = _StageModel(cluster)
    model.host_waits = bool(host_waits_pack)
    meshes = _Meshes(plan, cluster, model, jobs, record)
    dt = max(lb, 1e-6) / steps
    nstep, last_write, (tr_t, tr_w, tr_ag) = _run(meshes, net, dt, steps * 200)
    stage_end = meshes.stage_end
    stage_end["write"] = last_write
    cal = cluster.cal
    total, busy, terms = _totals(plan, cluster, meshes, jobs, lb, last_write)
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
        cal.name,
        terms,
        assumed,
    )
