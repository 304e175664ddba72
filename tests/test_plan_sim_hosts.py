"""The simulator's hosts between tasks and between mesh groups (issue 36's Kimi-K2 restatement):
the runtime's barrier between mesh groups is the hosts' (each rank issues it after its last task
of the group, wxfer.runtime.steps), and a delta push's host waits for each task's packing (it
reads back the count of changed bytes, wxfer.runtime.delta_send)."""

from dataclasses import replace

import pytest

from wxfer.meta import Cluster
from wxfer.plan import plan_for
from wxfer.plan.calibrate import CALIBRATIONS
from wxfer.plan.delta import delta_terms, simulate_delta
from wxfer.plan.simulate import simulate

FREE = CALIBRATIONS["free-stage2"]


def _two_groups(cal):
    c = Cluster(
        train_gpus=8,
        infer_gpus=4,
        infer_tp=2,
        quant="fp8",
        gpus_per_node=8,
        expert_shard=4,
        infer_ep=True,
        watermark_bytes=1 << 40,
        barrier_s=0.25,
        calibration=cal,
    )
    plan = plan_for("qwen3-30b-a3b", c)
    assert len(plan.groups) >= 2
    return plan, c


def test_the_next_group_waits_for_every_host_to_reach_the_barrier():
    # host-bound: 5 ms of host work per packed piece, issued after each all-gather, so the hosts
    # finish group 0 long after its last all-gather ended; the next group waits for the hosts
    plan, c = _two_groups(replace(FREE, host_piece_s=5e-3))
    r = simulate(plan, c, steps=200, record=True)
    g0 = {ti for m in plan.groups[0] for ti in plan.mesh_tasks[m]}
    ag = [(ti, s, e) for st, _, ti, s, e in r.timeline if st == "allgather"]
    q0 = [s for st, _, ti, s, e in r.timeline if st == "quant" and ti in g0]  # packed once the host issued it
    last_ag0 = max(e for ti, s, e in ag if ti in g0)
    first1 = min(s for ti, s, e in ag if ti not in g0)
    assert max(q0) > last_ag0 + 1e-3  # the hosts are the later ones here
    assert first1 >= max(q0) + 0.25 - 1e-12
    # not host-bound: the barrier after the last all-gather, as before
    plan, c = _two_groups(FREE)
    r = simulate(plan, c, steps=200, record=True)
    ag = [(ti, s, e) for st, _, ti, s, e in r.timeline if st == "allgather"]
    last_ag0 = max(e for ti, s, e in ag if ti in g0)
    assert min(s for ti, s, e in ag if ti not in g0) == pytest.approx(last_ag0 + 0.25)


def _chain(host_waits: bool):
    # one 2-rank mesh per group; slow packing (50 GB/s) and 2 ms of host work per task
    cal = replace(FREE, quant_GBps=50.0, copy_GBps=50.0, host_task_s=2e-3, serial=True)
    c = Cluster(train_gpus=2, infer_gpus=2, infer_tp=1, quant="fp8", gpus_per_node=2, dense_shard=2, calibration=cal)
    plan = plan_for("qwen3-tiny", c)
    r = simulate(plan, c, steps=200, record=True, host_waits_pack=host_waits)
    gaps = []
    for rank in range(plan.train_world):
        ev = sorted((s, e, st) for st, rk, _, s, e in r.timeline if rk == rank and st in ("allgather", "quant"))
        last_q = None
        for s, e, st in ev:
            if st == "allgather" and last_q is not None:
                gaps.append(s - last_q)
            if st == "quant":
                last_q = e
    return r, gaps


def test_a_delta_push_host_waits_for_each_packing_before_its_next_task():
    r, gaps = _chain(True)
    assert gaps and min(gaps) >= 2e-3 - 1e-12  # the next gather: the host's 2 ms after the packing ended
    r0, gaps0 = _chain(False)
    assert min(gaps0) < 2e-3  # the host ran ahead: its work overlapped the packing
    assert r.simulated_s > r0.simulated_s


def test_the_delta_push_at_every_byte_is_the_dense_push_with_the_hosts_waiting():
    # the records are the bytes (rate 0.9) and the compare free: the delta simulation is the
    # dense one with each host waiting for its packings, plus the apply
    c = Cluster(train_gpus=2, infer_gpus=2, infer_tp=1, quant="fp8", gpus_per_node=2, dense_shard=2)
    plan = plan_for("qwen3-tiny", c)
    dense = simulate(plan, c, steps=200, record=False, kinds="auto")
    waits = simulate(plan, c, steps=200, record=False, kinds="auto", host_waits_pack=True)
    out = simulate_delta(plan, c, delta_terms(0.9, 1e9), dense.simulated_s, dense.lower_bound_s, steps=200)
    assert out["delta_records_fraction"] == 1.0
    assert out["delta_simulated_s"] == pytest.approx(waits.simulated_s, rel=1e-5)
    assert waits.simulated_s >= dense.simulated_s
    assert out["delta_s"] == pytest.approx(out["delta_simulated_s"] + out["delta_apply_s"], rel=1e-4)
    assert "compare: given" in out["delta_terms"]["source"] and "apply: measured" in out["delta_terms"]["source"]
    assert "apply_per_record_s" in out["delta_not_measured"]
