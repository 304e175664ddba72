"""The simulator's model of each kind of task as the runtime runs it: zero-copy tasks (host
time per task and per submit_prepared batch, no buffer, no watermark), packed tasks (the
kernel's launches and rate), the engine's FIFO with a cost per write, the begin and end
costs of a push, H2D on the rank's one stream, and a GPU shared by the kernels and the writes."""

import numpy as np
import pytest
from one_trainer import one_trainer_plan  # tests/one_trainer.py

from wxfer.zerocopy import batches
from wxfer.plan.simulate import simulate

FAST = dict(nic_gbps=8000.0, nvlink_GBps=1e4, mem_GBps=1e5, pcie_GBps=1e4, write_GBps=1e5)
ZERO = dict(host_param_s=0.0, host_zc_task_s=0.0, pack_launch_s=0.0, quant_GBps=None, launch_per_piece=False)


def _one(preset="qwen3-tiny", quant=None, cal=None, **kw):
    return one_trainer_plan(preset, quant, dict(ZERO, **(cal or {})), None, **dict(FAST, **kw))


def _acts(r):
    """(task, start of its writes) of rank 0, in the order the engine got them."""
    return sorted(((ti, s) for st, rk, ti, s, e in r.timeline if st == "write" and rk == 0), key=lambda x: x[1])


def test_zero_copy_tasks_cost_host_time_per_task_and_per_batch():
    c, plan, kinds = _one("qwen3-8b", cal=dict(host_zc_task_s=1e-4, host_zc_batch_s=1e-3))
    assert set(kinds.values()) == {"zero_copy"} and len(plan.tasks) == 399
    r = simulate(plan, c, kinds=kinds)
    sched = [t for t, _ in plan.rank_schedule(0)[0]]
    size = np.bincount(plan.task, plan.nbytes, len(plan.tasks))  # one receiver: a task's bytes
    bs = batches([kinds[t] for t in sched], nbytes=[size[t] for t in sched])
    # cut at 32 tasks or 256 MiB (wxfer.zerocopy.ZERO_COPY_BATCH / ZERO_COPY_BATCH_BYTES): more than by count
    assert len(bs) > len(batches([kinds[t] for t in sched])) == 13  # 12 x 32 + 15
    host = 399 * 1e-4 + len(bs) * 1e-3
    assert r.stage_busy_s["host"] == pytest.approx(host)
    assert host < r.simulated_s < host * 1.02 + 1e-3  # the last batch's writes after it
    assert r.terms["kernel_s"] == 0.0 and r.terms["zero_copy_tasks"] == 399
    # a batch's jobs go to the engine together, when its last task was handled
    starts = sorted({round(s, 9) for _, s in _acts(r)})
    assert len(starts) == len(bs)
    assert np.diff(starts) == pytest.approx([n * 1e-4 + 1e-3 for _, n in bs[1:]])
    # the same plan simulated as packed tasks (no kinds: the old model) pays a buffer copy each
    assert simulate(plan, c).terms["kernel_s"] > 0


def test_zero_copy_tasks_hold_nothing_under_the_watermark():
    c, plan, kinds = _one("qwen3-8b", watermark_bytes=1)
    r = simulate(plan, c, kinds=kinds)
    assert len(_acts(r)) == len(plan.tasks)  # one job per task, none waited for another's writes
    assert r.simulated_s == pytest.approx(r.lower_bound_s, rel=0.05)


def test_the_engine_posts_in_order_at_a_cost_per_write():
    c, plan, kinds = _one("qwen3-8b", "fp8", cal=dict(write_call_s=1e-4, host_zc_task_s=1e-6))
    assert {"zero_copy", "packed"} <= set(kinds.values())
    r = simulate(plan, c, kinds=kinds)
    acts = _acts(r)
    order = [t for t, _ in plan.rank_schedule(0)[0]]
    assert [t for t, _ in acts] == order  # FIFO: submission order, packed and zero copy alike
    nw = np.bincount(plan.task, minlength=len(plan.tasks))
    gaps = np.diff([s for _, s in acts])
    assert (gaps >= nw[[t for t, _ in acts[1:]]] * 1e-4 - 1e-12).all()
    assert r.simulated_s >= plan.n_transfers * 1e-4


def test_begin_and_end_of_a_push():
    c, plan, kinds = _one(cal=dict(host_zc_task_s=1e-5))
    a = simulate(plan, c, kinds=kinds)
    c2, _, _ = _one(cal=dict(host_zc_task_s=1e-5, push_begin_s=0.125, push_end_s=0.25))
    b = simulate(plan, c2, kinds=kinds)
    assert b.simulated_s == pytest.approx(a.simulated_s + 0.375, rel=1e-3)
    assert min(s for _, s in _acts(b)) >= 0.125  # nothing is handed to the engine before the begin
    assert b.terms["stamps_s"] == pytest.approx(0.375)


def test_packing_launches_per_task_with_the_native_kernel():
    c, plan, kinds = _one(quant="fp8", cal=dict(pack_launch_s=1e-3, launch_per_piece=True))
    from wxfer.plan.simulate import _jobs

    jb = _jobs(plan, 1, kinds)
    packed = np.array([k == "packed" for k in (kinds[int(t)] for t in jb.task)])
    per_piece = simulate(plan, c, kinds=kinds).terms["kernel_s"]
    assert per_piece == pytest.approx(jb.pieces[packed].sum() * 1e-3, rel=0.01)
    c2, _, _ = _one(quant="fp8", cal=dict(pack_launch_s=1e-3, launch_per_piece=False))
    native = simulate(plan, c2, kinds=kinds).terms["kernel_s"]
    assert native == pytest.approx(jb.launches[packed].sum() * 1e-3, rel=0.01)
    assert jb.launches[packed].sum() < jb.pieces[packed].sum()  # an FP8 task's pieces: one launch
    assert (jb.launches[packed] >= 1).all()


def test_offloaded_h2d_runs_on_the_ranks_stream_before_its_gather_and_packing():
    cal = dict(copy_GBps=0.2, quant_GBps=0.2)
    c, plan, kinds = _one(quant="fp8", cpu_offload=True, pcie_GBps=0.1, cal=cal)
    assert "zero_copy" not in kinds.values() and {"staged", "packed"} <= set(kinds.values())
    r = simulate(plan, c, kinds=kinds)
    h2d = sum(t.src_bytes for t in plan.tasks) / 0.1e9
    assert r.terms["h2d_s"] == pytest.approx(h2d, rel=1e-6)
    spans = sorted((s, e, st) for st, rk, ti, s, e in r.timeline if st in ("h2d", "quant"))
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))  # one stream: never overlapping
    packs = sum(e - s for s, e, st in spans if st == "quant")
    assert r.simulated_s == pytest.approx(h2d + packs, rel=0.02)
    # H2D on a stream of its own (serial=False) runs ahead of the packing
    c3, _, _ = _one(quant="fp8", cpu_offload=True, pcie_GBps=0.1, cal=dict(cal, serial=False))
    assert simulate(plan, c3, kinds=kinds).simulated_s < r.simulated_s * 0.9


def test_kernels_and_writes_share_one_gpu():
    cal = dict(copy_GBps=1.0, quant_GBps=1.0)
    c, plan, kinds = _one("qwen3-tiny", "fp8", cal=cal, write_GBps=1.0)
    apart = simulate(plan, c, kinds=kinds)
    c2, _, _ = _one("qwen3-tiny", "fp8", cal=dict(cal, device_shared=True), write_GBps=1.0)
    shared = simulate(plan, c2, kinds=kinds)
    assert shared.simulated_s == pytest.approx(shared.terms["kernel_s"] + shared.terms["write_s"], rel=0.01)
    assert shared.simulated_s > apart.simulated_s * 1.1


def test_direct_tasks_pack_into_the_receivers_without_a_buffer_or_a_write():
    cal = dict(copy_GBps=1.0, quant_GBps=1.0)
    c, plan, kinds = _one("qwen3-tiny", "fp8", cal=cal, write_GBps=1.0, watermark_bytes=1)
    packed = [t for t, k in kinds.items() if k == "packed"]
    direct = {t: ("direct" if t in packed else k) for t, k in kinds.items()}
    a = simulate(plan, c, kinds=kinds)
    b = simulate(plan, c, kinds=direct)
    from wxfer.plan.simulate import _jobs

    jb = _jobs(plan, 1, direct)
    sel = np.isin(jb.task, packed)
    assert jb.wbytes[sel].sum() <= sel.sum() * 8  # their bytes are written by the kernel
    rest = plan.nbytes[~np.isin(plan.task, packed)].sum() / 1e9  # the others' writes at 1 GB/s
    assert b.terms["write_s"] == pytest.approx(rest, rel=0.01) and a.terms["write_s"] > 2 * rest
    assert b.terms["kernel_s"] == pytest.approx(a.terms["kernel_s"])  # at 1 GB/s the kernel, not the link, bounds
    assert b.simulated_s < a.simulated_s


def test_experts_quantize_at_the_small_piece_rate():
    cal = dict(quant_GBps=1000.0, copy_GBps=1e5)
    c, plan, kinds = _one("qwen3-30b-a3b", "fp8", cal=cal)
    one = simulate(plan, c, kinds=kinds, record=False).terms["kernel_s"]
    c2, _, _ = _one("qwen3-30b-a3b", "fp8", cal=dict(cal, quant_small_GBps=500.0))
    slow = simulate(plan, c2, kinds=kinds, record=False).terms["kernel_s"]
    from wxfer.plan.simulate import _jobs

    jb = _jobs(plan, 1, kinds)
    small = jb.fp8 & (jb.fp8_piece_elems <= 4e6)
    assert small.any() and not small[jb.fp8].all()  # the experts (768 x 2048 pieces), not the attention weights
    work = [(plan.tasks[int(t)].src_bytes + p) for t, p, s in zip(jb.task, jb.packed, small) if s]
    assert slow - one == pytest.approx(sum(work) / 500e9 - sum(work) / 1000e9, rel=0.01)
