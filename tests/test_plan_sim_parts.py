"""The simulator's parts, each alone: the water-filling step, the write network (FIFOs,
posting window, rings), the stage model and the order of stage events."""

import numpy as np
import pytest

from wxfer.meta import Cluster
from wxfer.plan import plan_for
from wxfer.plan.simulate import _jobs, _Jobs, _Meshes, _Network, _StageModel, _waterfill


# ---------------------------------------------------------------- water-filling


def test_waterfill_shares_a_link_equally():
    # two flows 0->link2, 1->link2: link 2 (capacity 10) is the bottleneck
    alloc = _waterfill(np.array([0, 1]), np.array([2, 2]), np.array([100.0, 100.0, 10.0]), np.array([50.0, 50.0]))
    assert alloc == pytest.approx([5.0, 5.0])


def test_waterfill_is_work_conserving_when_a_flow_needs_less():
    alloc = _waterfill(np.array([0, 1]), np.array([2, 2]), np.array([100.0, 100.0, 10.0]), np.array([2.0, 50.0]))
    assert alloc == pytest.approx([2.0, 8.0])  # the short flow's unused share goes to the other


def test_waterfill_max_min_over_two_bottlenecks():
    # flows a: 0->3, b: 0->4, c: 1->4; link 0 = 6, link 4 = 4: b and c split link 4 (2 each), a gets 4 of link 0
    cap = np.array([6.0, 100.0, 100.0, 100.0, 4.0])
    alloc = _waterfill(np.array([0, 0, 1]), np.array([3, 4, 4]), cap, np.full(3, 100.0))
    assert alloc == pytest.approx([4.0, 2.0, 2.0])
    assert (np.bincount([0, 0, 1, 3, 4, 4], np.r_[alloc, alloc], 5) <= cap + 1e-9).all()


def test_waterfill_no_flows():
    assert _waterfill(np.empty(0, np.int64), np.empty(0, np.int64), np.ones(3), np.empty(0)).size == 0


# ---------------------------------------------------------------- the network


def _two_jobs(sizes=(100.0, 100.0), gpus=(0, 0)):
    """Rank 0 has two jobs (tasks 0 and 1), one entry each, to `gpus`."""
    J = len(sizes)
    gpus = gpus[:J]
    ej = np.arange(J)
    return _Jobs(
        rank=np.zeros(J, np.int64),
        task=np.arange(J),
        packed=np.array(sizes, float),
        ejob=ej,
        egpu=np.array(gpus, np.int64),
        ebytes=np.array(sizes, float),
        start=ej,
        end=ej + 1,
        wbytes=np.array(sizes, float),
        of_task={j: [j] for j in range(J)},
        packed_of={(0, j): sizes[j] for j in range(J)},
    )


def _run(net, dt=1.0, limit=1000):
    done, now = {}, 0.0
    while net.jobs_left and limit:
        if net.post_ranks:
            net.post()
        ap = net.active_pairs()
        jobs_done, _, _, _ = net.step(ap, now, dt)
        done.update(jobs_done)
        now += dt
        limit -= 1
    return done


def test_a_pair_is_fifo_and_finishes_at_bytes_over_bandwidth():
    jb = _two_jobs()
    net = _Network(jb, world=1, ngpu=1, nic_bw=10.0, write_bw=10.0, max_posted=1e9, write_latency_s=0.0)
    net.queue([1, 0])  # queued in job order whatever the call order
    assert list(net.queued[0]) == [0, 1]
    done = _run(net)
    assert done[0] == pytest.approx(10.0) and done[1] == pytest.approx(20.0)  # 100 B each at 10 B/s, in order


def test_posting_window_holds_back_the_next_job():
    jb = _two_jobs(gpus=(0, 1))  # different receivers: could run side by side
    net = _Network(jb, world=1, ngpu=2, nic_bw=1e9, write_bw=10.0, max_posted=150.0, write_latency_s=0.0)
    net.queue([0, 1])
    net.post()
    assert net.posted[0] == 1 and list(net.queued[0]) == [1]  # 100 + 100 > 150: one at a time
    done = _run(net)
    assert done[1] == pytest.approx(20.0)
    wide = _Network(jb, world=1, ngpu=2, nic_bw=1e9, write_bw=20.0, max_posted=1e9, write_latency_s=0.0)
    wide.queue([0, 1])
    d2 = _run(wide)  # both posted: the sender's 20 B/s shared
    assert d2[0] == pytest.approx(10.0) and d2[1] == pytest.approx(10.0)


def test_write_latency_is_added_and_out_of_order_posting_is_refused():
    jb = _two_jobs()
    net = _Network(jb, world=1, ngpu=1, nic_bw=10.0, write_bw=10.0, max_posted=1e9, write_latency_s=0.5)
    net.queue([0])
    assert _run(net, limit=10)[0] == pytest.approx(10.5)
    bad = _Network(jb, world=1, ngpu=1, nic_bw=10.0, write_bw=10.0, max_posted=1e9, write_latency_s=0.0)
    bad.queued[0].append(1)  # job 1 before job 0 of the same pair
    bad.post_ranks.add(0)
    with pytest.raises(RuntimeError, match="out of FIFO order"):
        bad.post()


def test_rings_use_the_nic_receive_links():
    jb = _two_jobs(sizes=())
    net = _Network(jb, world=2, ngpu=1, nic_bw=5.0, write_bw=5.0, max_posted=1e9, write_latency_s=0.0)
    net.add_ring(m=3, ti=7, start=0.0, ranks=(0, 1), nbytes=10.0)
    assert not net.idle(net.active_pairs())
    rings = []
    for step in range(3):
        _, rd, _, agb = net.step(net.active_pairs(), float(step), 1.0)
        rings += rd
    assert rings == [(3, 7, 0.0, 2.0)] and not net.rings and not net.ag_live  # 10 B per flow at 5 B/s: 2 steps


def test_a_ring_ends_where_its_last_byte_moved_not_at_a_step_boundary():
    # 10 B per flow at 5 B/s from t = 0.3 with 0.7 s steps: 2 s of bytes, so it ends at 2.3 s, not
    # at the end of a step (2.8 s), and moves nothing before its start (the first step's 0.3 s)
    jb = _two_jobs(sizes=())
    net = _Network(jb, world=2, ngpu=1, nic_bw=5.0, write_bw=5.0, max_posted=1e9, write_latency_s=0.0)
    net.add_ring(m=3, ti=7, start=0.3, ranks=(0, 1), nbytes=10.0)
    rings, moved, now = [], [], 0.0
    while net.rings:
        _, rd, _, agb = net.step(net.active_pairs(), now, 0.7)
        rings += rd
        moved.append(agb)
        now += 0.7
    assert moved[0] == pytest.approx(2 * 5.0 * 0.4)  # two flows, 0.4 s of the first step
    assert len(rings) == 1 and rings[0][:3] == (3, 7, 0.3)
    assert rings[0][3] == pytest.approx(2.3)


# ---------------------------------------------------------------- the stage model


def test_stage_model_formulas():
    from wxfer.plan.calibrate import CALIBRATIONS

    c = Cluster(pcie_GBps=10.0, nvlink_GBps=100.0, mem_GBps=1000.0, calibration=CALIBRATIONS["free-stage2"])

    class T:
        src_bytes = 8e9
        sources = ("a", "b")

    m = _StageModel(c)
    assert m.h2d_s(T, 4) == pytest.approx(2e9 / 10e9)
    assert m.allgather_s(T, 4) == pytest.approx(6e9 / 100e9)
    assert m.allgather_s(T, 1) == 0.0
    assert m.ring_bytes(T, 2) == 4e9
    assert m.pack_s(T, 2e9) == pytest.approx(10e9 / 1000e9)
    assert m.pack_s(T, 2e9, src_read=4e9) == pytest.approx(6e9 / 1000e9)  # the rank's own pieces read
    assert m.host_gather_s(T) == 0.0 and m.write_post_s(10) == 0.0 and not m.serial
    from wxfer.meta import Calibration

    cal = Calibration(
        host_task_s=1.0,
        host_param_s=0.5,
        host_piece_s=0.25,
        pack_launch_s=0.125,
        quant_GBps=100.0,
        copy_GBps=500.0,
        coll_call_s=0.01,
        write_call_s=0.001,
        h2d_call_s=0.1,
    )
    m = _StageModel(Cluster(pcie_GBps=10.0, nvlink_GBps=100.0, calibration=cal))
    assert m.host_gather_s(T) == 1.0 + 2 * 0.5  # per task + per source
    assert m.host_pack_s(4) == 1.0  # per piece
    assert m.h2d_s(T, 4) == pytest.approx(2 * 0.1 + 2e9 / 10e9)
    assert m.allgather_s(T, 4) == pytest.approx(2 * 0.01 + 6e9 / 100e9)
    assert m.allgather_s(T, 1) == 0.0  # no collective on a 1-rank mesh
    assert m.pack_s(T, 2e9, pieces=3, fp8=True) == pytest.approx(3 * 0.125 + 10e9 / 100e9)
    assert m.pack_s(T, 2e9, pieces=3, fp8=False) == pytest.approx(3 * 0.125 + 10e9 / 500e9)
    assert m.write_post_s(10) == pytest.approx(0.01) and m.serial


# ---------------------------------------------------------------- the order of events


def _meshes(preset="qwen3-tiny", **kw):
    kw = dict(dict(train_gpus=4, infer_gpus=2, infer_tp=2, gpus_per_node=2, dense_shard=2, expert_shard=2), **kw)
    from wxfer.plan.calibrate import CALIBRATIONS

    c = Cluster(**kw, calibration=CALIBRATIONS["free-stage2"])
    plan = plan_for(preset, c)
    ngpu = int(plan.gpu_of.max()) + 1
    jb = _jobs(plan, ngpu)
    net = _Network(jb, plan.train_world, ngpu, c.nic_GBps * 1e9, c.write_bw, c.max_posted_bytes, c.write_latency_s)
    return plan, c, jb, net, _Meshes(plan, c, _StageModel(c), jb, record=True)


def test_jobs_group_the_transfer_table_by_sender_and_task():
    plan, _, jb, _, _ = _meshes()
    assert jb.wbytes.sum() == plan.nbytes.sum()
    for j in range(jb.n):
        sel = (plan.sender == jb.rank[j]) & (plan.task == jb.task[j])
        assert jb.wbytes[j] == plan.nbytes[sel].sum()
        assert jb.packed[j] == (plan.src_offset[sel] + plan.nbytes[sel]).max()
        assert (np.diff(jb.egpu[jb.start[j] : jb.end[j]]) > 0).all()  # one entry per receiver


def test_a_rank_of_a_mesh_reads_only_the_sources_of_its_own_pieces():
    # two ranks share each task (one destination per piece: infer TP1): each packs only the pieces it
    # sends, so between them they read each task's sources once, not twice
    plan, _, jb, _, _ = _meshes(train_gpus=2, gpus_per_node=2, dense_shard=2, infer_gpus=1, infer_tp=1)
    assert jb.src_read is not None
    two = 0
    for t in plan.tasks:
        js = jb.of_task.get(t.id, [])
        assert sum(jb.src_read[j] for j in js) == pytest.approx(t.src_bytes)
        if len(js) == 2:
            two += 1
            assert all(jb.src_read[j] < t.src_bytes for j in js)
    assert two > 0


def test_allgathers_follow_plan_order_and_packing_follows_them():
    plan, c, jb, net, ms = _meshes()
    ms.start(1.0, net)  # everything ready by t = 1 s: intra-node meshes
    assert ms.finished()
    ag = [(r, ti, s, e) for st, r, ti, s, e in ms.timeline if st == "allgather"]
    for m, lst in plan.mesh_tasks.items():
        r0 = plan.meshes[m][0]
        starts = [s for r, ti, s, e in ag if r == r0 and ti in lst]
        ends = {ti: e for r, ti, s, e in ag if r == r0}
        assert starts == sorted(starts)  # plan order, one after the other
        seq = [ends[ti] for ti in lst]
        assert seq == sorted(seq)
    q = {(r, ti): (s, e) for st, r, ti, s, e in ms.timeline if st == "quant"}
    agend = {(r, ti): e for r, ti, s, e in ag}
    for (r, ti), (s, e) in q.items():
        assert s >= agend[(r, ti)] - 1e-15 and e > s
    for j in range(jb.n):
        assert ms.act_time[j] == q[(int(jb.rank[j]), int(jb.task[j]))][1]  # ready when packed


def test_next_group_waits_for_the_barrier():
    plan, c, jb, net, ms = _meshes(
        "qwen3-30b-a3b",
        barrier_s=0.25,
        train_gpus=8,
        gpus_per_node=8,
        watermark_bytes=1 << 40,
        infer_gpus=4,
        quant="fp8",
        expert_shard=4,
        infer_ep=True,
    )
    assert len(plan.groups) >= 2
    ms.start(10.0, net)
    assert not ms.finished()  # group 1's meshes were tried before group 0 ended
    ms.start(10.0, net)  # (the event loop calls start() at every step)
    assert ms.finished()
    g0 = {ti for m in plan.groups[0] for ti in plan.mesh_tasks[m]}
    ag = [(ti, s, e) for st, r, ti, s, e in ms.timeline if st == "allgather"]
    last0 = max(e for ti, s, e in ag if ti in g0)
    first1 = min(s for ti, s, e in ag if ti not in g0)
    assert first1 == pytest.approx(last0 + 0.25)


def test_watermark_stops_the_next_allgather_until_buffers_are_released():
    plan, c, jb, net, ms = _meshes(watermark_bytes=1)
    ms.start(10.0, net)
    started = sum(1 for st, *_ in ms.timeline if st == "allgather")
    assert 0 < started < len(plan.tasks) * 2  # one task per mesh, then held
    assert not ms.finished()
    # the first task's writes landing releases its buffers: the mesh goes on
    before = sum(ms.ptr.values())
    for j in ms.ready_jobs(10.0):
        ms.job_done(j, 10.0)
    ms.start(10.0, net)
    assert sum(ms.ptr.values()) > before
