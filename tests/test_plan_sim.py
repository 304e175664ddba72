"""The simulator: never below the lower bound, close to it when balanced, models each stage.

The link-model tests use the "free-stage2" calibration (no host time, stage 2 at memory
speed) so that the bound they check is the links'; the calibrated terms are tested in
tests/test_plan_calibrate.py."""

import pytest
from hypothesis import given, settings, strategies as st

from wxfer.meta import Cluster
from wxfer.plan import plan_for
from wxfer.plan.calibrate import CALIBRATIONS
from wxfer.plan.simulate import lower_bound, simulate

FREE = CALIBRATIONS["free-stage2"]


def test_one_trainer_one_gpu_is_bytes_over_bandwidth():
    c = Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, nic_gbps=8.0, calibration=FREE)  # 1 GB/s
    plan = plan_for("qwen3-tiny", c)
    r = simulate(plan, c)
    nbytes = plan.nbytes.sum()
    assert r.lower_bound_s == pytest.approx(nbytes / 1e9)
    assert r.bottleneck.startswith(("train_nic_send", "infer_nic_recv"))
    assert r.lower_bound_s <= r.simulated_s < r.lower_bound_s * 1.05
    assert set(s for s, *_ in r.timeline) == {"allgather", "quant", "write"}


def test_balanced_plan_is_close_to_the_bound():
    c = Cluster(train_gpus=16, infer_gpus=8, infer_tp=2, quant="fp8", calibration=FREE)
    plan = plan_for("qwen3-8b", c)
    r = simulate(plan, c)
    s = r.summary()
    assert s["bottleneck"].startswith("infer_nic_recv")
    assert 1.0 <= s["ratio"] < 1.03
    assert s["max_utilisation"]["infer_nic_recv"] <= 1.0 + 1e-9
    assert s["max_utilisation"]["infer_nic_recv"] > 0.97
    # a measurement's record of the run (tools/calibrate.py, benchmarks/bb_fsdp.py): simulated_<name>
    rec = r.record("lower_bound_s", "bound_by")
    assert list(rec) == ["simulated_s", "simulated_lower_bound_s", "simulated_bound_by"]
    assert rec["simulated_s"] == r.simulated_s and rec["simulated_lower_bound_s"] == r.lower_bound_s
    assert rec["simulated_bound_by"] == r.bound_by in r.stage_busy_s


def test_cross_node_allgathers_and_offload_count_in_the_bound():
    pre = "qwen3-30b-a3b"
    c = Cluster(
        train_gpus=4,
        gpus_per_node=1,
        dense_shard=1,
        expert_shard=4,
        infer_gpus=1,
        infer_tp=1,
        quant="fp8",
        infer_ep=True,
        nic_gbps=400,
        cpu_offload=True,
        pcie_GBps=5.0,
    )
    plan = plan_for(pre, c)
    r = simulate(plan, c, steps=300)
    assert r.link_bytes["train_nic_recv"].max() > 0  # experts gathered over the NICs
    assert "pcie" in r.link_bytes and r.stage_end_s["h2d"] > 0
    assert r.bottleneck.startswith("pcie")  # 5 GB/s PCIe is the slowest link
    assert r.simulated_s >= r.lower_bound_s
    lb, name = lower_bound(plan, c)
    assert lb == r.lower_bound_s and name == r.bottleneck


def test_a_tight_watermark_and_barriers_slow_things_down_but_finish():
    c = Cluster(
        train_gpus=8,
        infer_gpus=4,
        infer_tp=2,
        quant="fp8",
        gpus_per_node=2,
        dense_shard=2,
        expert_shard=4,
        infer_ep=True,
        calibration=FREE,
    )
    plan = plan_for("qwen3-30b-a3b", c)
    fast = simulate(plan, c, steps=300, record=False)
    c.watermark_bytes = 1
    slow = simulate(plan, c, steps=300, record=False)
    assert len(plan.groups) >= 2
    assert slow.simulated_s > fast.simulated_s >= fast.lower_bound_s


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.integers(1, 3), st.booleans())
def test_never_below_the_lower_bound(train, tp, reps, offload):
    c = Cluster(
        train_gpus=train,
        infer_gpus=tp * reps,
        infer_tp=tp,
        gpus_per_node=2,
        dense_shard=min(2, train),
        expert_shard=min(2, train),
        cpu_offload=offload,
    )
    plan = plan_for("qwen3-tiny", c)
    r = simulate(plan, c, steps=200, record=False)
    assert r.simulated_s >= r.lower_bound_s * (1 - 1e-9)


def test_writes_inside_a_node_use_the_write_path_bandwidth():
    """Issue 9's 8-GPU layout: 4 FSDP trainers and 2 x TP2 receivers on one node, writing over
    NVLink (cuda_ipc): with write_GBps the bound and the simulation follow that rate, not the
    NIC's; a plan with all-gathers across nodes is refused in that mode."""
    c = Cluster(
        train_gpus=4, infer_gpus=4, infer_tp=2, gpus_per_node=8, dense_shard=4, write_GBps=390.0, calibration=FREE
    )
    plan = plan_for("qwen3-8b", c)
    r = simulate(plan, c)
    per_gpu = max(plan.nbytes[plan.gpu == g].sum() for g in range(4))
    per_rank = max(plan.nbytes[plan.sender == s].sum() for s in range(4))
    assert r.link_bytes["train_send"].max() == per_rank and r.link_bytes["infer_recv"].max() == per_gpu
    assert r.link_bw["train_send"] == r.link_bw["infer_recv"] == 390e9
    ag = r.link_bytes["nvlink"].max() / 370e9  # the all-gathers, inside the node
    assert r.link_bytes["train_nic_send"].max() == 0  # nothing on the NICs
    assert r.lower_bound_s == pytest.approx(max(per_gpu / 390e9, per_rank / 390e9, ag), rel=1e-6)
    assert r.lower_bound_s <= r.simulated_s < 1.1 * r.lower_bound_s
    nic = simulate(
        plan, Cluster(train_gpus=4, infer_gpus=4, infer_tp=2, gpus_per_node=8, dense_shard=4, calibration=FREE)
    )
    # 50 GB/s NICs against 390 GB/s writes (whose bound is the 370 GB/s all-gather here):
    # the NICs' bytes, balanced to within 2%, set the time
    assert nic.bottleneck.startswith("train_nic_send") and nic.simulated_s > 4.5 * r.simulated_s
    assert nic.simulated_s < 1.03 * nic.lower_bound_s
    with pytest.raises(ValueError, match="across nodes"):
        c2 = Cluster(train_gpus=16, infer_gpus=4, infer_tp=2, gpus_per_node=8, write_GBps=390.0, expert_shard=2)
        simulate(plan_for("qwen3-30b-a3b", c2), c2)
