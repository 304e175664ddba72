"""Copy tasks (wxfer.runtime.inplace.InPlaceWriter.queue_copy: a small zero-copy task's ranges copied straight
into the receivers' mapped memory by batched torch._foreach_copy_ launches on cuda_ipc
colocated) in the simulator and in the fit: host cost per task, one launch per COPY_BATCH
ranges at the copy rate over 2 x bytes on the side stream in order with the direct kernels, no
write, no posting, the push's first direct or copy task waiting for the engine; no trace
record, their host time in the next record's gap, the zero-copy batch left open."""

import random

import numpy as np
import pytest
from one_trainer import one_trainer_plan  # tests/one_trainer.py

from wxfer.meta import Calibration, Cluster, synthesize
from wxfer.plan.kinds import task_kinds
from wxfer.plan.simulate import simulate
from wxfer.runtime.hostfit import STAMP_TAG, fit
from wxfer.runtime.inplace import COPIES_TAG
from wxfer.zerocopy import COPY_BATCH, COPY_BATCH_BYTES

FAST = dict(nic_gbps=8000.0, nvlink_GBps=1e4, mem_GBps=1e5, pcie_GBps=1e4)
ZERO = dict(host_param_s=0.0, host_zc_task_s=0.0, pack_launch_s=0.0, launch_per_piece=False)
US = 1000  # ns


def _one(cal, quant=None, write_GBps=1e5):
    return one_trainer_plan("qwen3-8b", quant, dict(ZERO, **cal), dict(direct=True), write_GBps=write_GBps, **FAST)


def _launches(plan, kinds, first: int = 0) -> list:
    """[bytes of each batched copy launch] as the Sender issues them: its ranges queued task by
    task, launched once COPY_BATCH are queued (or COPY_BATCH_BYTES; with `first`, the push's
    n-th launch at min(first * 2**n, COPY_BATCH_BYTES)) and at each mesh group's end."""
    ranges = np.bincount(plan.task, minlength=len(plan.tasks))
    nbytes = np.bincount(plan.task, plan.nbytes, len(plan.tasks))
    out = []
    for g in plan.rank_schedule(0):
        q, b = 0, 0.0
        for t, _ in g:
            if kinds[t] == "copy":
                q, b = q + int(ranges[t]), b + float(nbytes[t])
                cap = COPY_BATCH_BYTES if not first else min(COPY_BATCH_BYTES, first << len(out))
                if q >= COPY_BATCH or b >= cap:
                    out.append(b)
                    q, b = 0, 0.0
        if q:
            out.append(b)
    return out


def _spans(r, stage):
    return sorted((s, e, t) for st, rk, t, s, e in r.timeline if st == stage and rk == 0)


def test_copy_tasks_cost_their_host_their_launches_and_no_engine_write():
    rate, launch, host = 1000.0, 50e-6, 3e-6
    cal = dict(copy_GBps=rate, pack_launch_s=launch, host_copy_task_s=host, write_call_s=1e-6)
    cal.update(push_begin_s=1e-3, begin_fence_s=2e-3)
    c, plan, kinds = _one(cal)
    copies = [t for t, k in kinds.items() if k == "copy"]
    assert copies and "zero_copy" in kinds.values()
    r = simulate(plan, c, kinds=kinds, record=True)
    assert r.terms["copy_tasks"] == len(copies)
    lb = _launches(plan, kinds)
    assert len(lb) >= 2
    assert r.terms["kernel_s"] == pytest.approx(len(lb) * launch + 2 * sum(lb) / (rate * 1e9), rel=1e-6)
    assert r.stage_busy_s["host"] == pytest.approx(len(copies) * host, rel=1e-6)  # zero copy: 0 here
    zc = np.isin(plan.task, copies, invert=True)
    assert r.terms["post_s"] == pytest.approx(int(zc.sum()) * 1e-6)  # only the engine's writes are posted
    assert r.terms["write_s"] == pytest.approx(plan.nbytes[zc].sum() / 1e14, rel=1e-6)
    q = _spans(r, "quant")
    assert len(q) == len(lb) and q[0][0] >= 3e-3 - 1e-12  # the first waited for the begin stamps (a fence)
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(q, q[1:]))  # one stream
    assert r.simulated_s >= q[-1][1]  # the end stamps wait for the side stream
    # without the copies (copy_max 0) the same tasks are engine writes, posted one by one
    c0, _, _ = _one(cal)
    k0 = task_kinds(plan, {p.name: p for p in synthesize("qwen3-8b", c0).train}, direct=True, copy_max=0)
    r0 = simulate(plan, c0, kinds=k0)
    assert r0.terms["copy_tasks"] == 0 and r0.terms["post_s"] == pytest.approx(plan.n_transfers * 1e-6)


def test_the_simulator_ramps_its_copy_launches_as_the_sender_does(monkeypatch):
    """WXFER_DIRECT_COPY_FIRST: the simulated launches are the Sender's (the first closes at
    that many bytes, each next at twice the last): more of them, the first smaller and
    started earlier than without it."""
    cal = dict(copy_GBps=1000.0, pack_launch_s=50e-6, host_copy_task_s=3e-6, write_call_s=1e-6)
    c, plan, kinds = _one(cal)
    base = simulate(plan, c, kinds=kinds, record=True)
    monkeypatch.setenv("WXFER_DIRECT_COPY_FIRST", "16MiB")
    r = simulate(plan, c, kinds=kinds, record=True)
    lb, l0 = _launches(plan, kinds, 16 << 20), _launches(plan, kinds)
    assert len(lb) > len(l0) and lb[0] < l0[0] and sum(lb) == pytest.approx(sum(l0))
    q, q0 = _spans(r, "quant"), _spans(base, "quant")
    assert len(q) == len(lb) and len(q0) == len(l0)
    assert q[0][1] - q[0][0] < q0[0][1] - q0[0][0] and q[0][0] <= q0[0][0]


def test_copies_and_direct_kernels_share_the_side_stream_in_order():
    rate = 800.0
    cal = dict(copy_GBps=rate, quant_GBps=rate, quant_small_GBps=rate, host_copy_task_s=2e-6, host_direct_task_s=5e-6)
    c, plan, kinds = _one(cal, quant="fp8")
    assert {"copy", "direct"} <= set(kinds.values())
    r = simulate(plan, c, kinds=kinds, record=True)
    q = _spans(r, "quant")
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(q, q[1:]))
    direct = [t for t in plan.tasks if kinds[t.id] == "direct"]
    work = sum(t.src_bytes + sum(sh.nbytes for sh in t.shards) for t in direct) / (rate * 1e9)
    lb = _launches(plan, kinds)
    assert r.terms["kernel_s"] == pytest.approx(work + 2 * sum(lb) / (rate * 1e9), rel=1e-6)
    assert r.terms["direct_tasks"] == len(direct) and r.terms["copy_tasks"] == len(
        [k for k in kinds.values() if k == "copy"]
    )


# ------------------------------------------------------------------ the fit, on a synthetic trace
COST = dict(zc=5e-6, batch=20e-6, copy=7e-6, task=30e-6, param=10e-6)


def _program(n=60, seed=3):
    rnd = random.Random(seed)
    kinds = {t: rnd.choice(["zero_copy", "zero_copy", "copy", "copy", "copy", "packed"]) for t in range(n)}
    kinds[0], kinds[1] = "zero_copy", "copy"  # the first copy comes while a batch is open
    info = {t: (rnd.randint(1, 3), 0) for t in range(n)}
    return [list(range(n))], kinds, info


def _push(order, kinds, info, t0, batch=3):
    """(t0, t1, records) of one push as the runtime traces it: copy tasks leave no record of their
    own; their launch (at the group's end) is one external record, ready at its CUDA event
    2 ms on, and the end stamps a plain fence after it."""
    ns = lambda s: int(round(s * 1e9))  # noqa: E731
    recs = [dict(tag=STAMP_TAG, t_submit=t0 + 300 * US, t_admit=t0 + 300 * US, t_ready=t0 + 300 * US)]
    recs[0].update(t_post_first=t0 + 310 * US, t_post_last=t0 + 310 * US, t_done=t0 + 800 * US, bytes=8, held=0)
    host, pending = t0 + 300 * US, []

    def rec(t, at):
        r = dict(tag=t, t_submit=at, t_admit=at, t_ready=at, t_post_first=at + 5 * US, t_post_last=at + 5 * US)
        r.update(t_done=at + 50 * US, bytes=4096, nwrites=1, held=0)
        recs.append(r)

    def submit():
        nonlocal host, pending
        host += ns(COST["batch"])
        for t in pending:
            rec(t, host)
        pending = []

    for t in order[0]:
        k = kinds[t]
        if k == "zero_copy":
            host += ns(COST["zc"])
            pending.append(t)
            if len(pending) == batch:
                submit()
        elif k == "copy":
            # queued (the begin stamps are waited for at the first launch, at the group's end here:
            # landed long before, no wait)
            host += ns(COST["copy"])
        else:
            if pending:
                submit()
            host += ns(COST["task"] + info[t][0] * COST["param"])
            rec(t, host)
    if pending:
        submit()
    ncopy = sum(1 for k in kinds.values() if k == "copy")
    launch = dict(tag=COPIES_TAG, kind="external", t_submit=host + 40 * US, t_admit=host + 40 * US)
    launch.update(t_ready=host + 2000 * US, t_post_first=host + 2000 * US, t_post_last=host + 2000 * US)
    launch.update(t_done=host + 2000 * US, bytes=4096 * ncopy, nwrites=1, held=0)
    recs.append(launch)
    end = dict(tag=STAMP_TAG, t_submit=host + 50 * US, t_admit=host + 50 * US, t_ready=host + 50 * US)
    end.update(t_post_first=host + 2005 * US, t_post_last=host + 2005 * US, t_done=host + 2030 * US, bytes=8, held=0)
    recs.append(end)
    return t0, end["t_done"] + 100 * US, recs


def test_copy_tasks_without_records_are_fitted_from_the_gaps():
    order, kinds, info = _program()
    pushes = [_push(order, kinds, info, k * 10**9) for k in range(2)]
    assert not any(r["tag"] in {t for t, k in kinds.items() if k == "copy"} for _, _, rs in pushes for r in rs)
    assert all(any(r.get("kind") == "external" for r in rs) for _, _, rs in pushes)  # the launches
    f = fit(pushes, order, kinds, info, batch=3, write_GBps=100.0)
    assert f["host_copy_task_s"] == pytest.approx(COST["copy"], rel=1e-3)
    assert f["host_zc_task_s"] == pytest.approx(COST["zc"], rel=1e-3)
    assert f["host_zc_batch_s"] == pytest.approx(COST["batch"], rel=1e-3)
    assert f["host_param_s"] == pytest.approx(COST["param"], rel=1e-3)
    assert "host_direct_task_s" not in f  # no direct task
    assert f["push_end_s"] == pytest.approx(130e-6)  # from the copy launch's event (the side stream's copies)
    # without copy tasks the column is not fitted
    kz = {t: ("packed" if k == "packed" else "zero_copy") for t, k in kinds.items()}
    with pytest.raises(ValueError, match="has no trace record"):
        fit(pushes, order, kz, info, batch=3)  # read as engine zero copy, a batch's last task has no record


def test_copy_max_defaults_to_the_plans_bound(monkeypatch):
    from wxfer.runtime import inplace as direct
    from wxfer.zerocopy import COPY_MAX

    monkeypatch.delenv("WXFER_DIRECT_COPY_MAX", raising=False)
    assert direct.copy_max() == COPY_MAX == 32 << 20
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "  ")  # blank: the default too
    assert direct.copy_max() == COPY_MAX


def test_copy_max_values_and_the_plans_no_bound(monkeypatch):
    """direct.copy_max: the Sender's argument over $WXFER_DIRECT_COPY_MAX, sizes, 0, "all" / -1
    (no bound, in the variable too); a bad value names what was wrong; the plan's task_kinds
    reads -1 as the Sender does (every zero-copy task a copy, as a very large bound)."""
    from wxfer.runtime import inplace as direct

    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "64k")
    assert direct.copy_max() == 64 << 10 and direct.copy_max("1MiB") == 1 << 20 and direct.copy_max(0) == 0
    assert direct.copy_max(4096) == 4096 and direct.copy_max("all") == direct.copy_max(-1) == direct.COPY_ALL
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", " ALL ")
    assert direct.copy_max() == direct.COPY_ALL and direct.copy_max(7) == 7
    bads = (("lots", ValueError), (-2, ValueError), ("1.5MiB", ValueError), (1.0, TypeError), (True, TypeError))
    for bad, err in bads:
        with pytest.raises(err, match=r"wxfer.Sender: copy_max must be .* got "):
            direct.copy_max(bad)
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "some")
    with pytest.raises(ValueError, match=r"WXFER_DIRECT_COPY_MAX must be .* got 'some'"):
        direct.copy_max()
    c, plan, kinds = _one({})
    train = {p.name: p for p in synthesize("qwen3-8b", c).train}
    zc = {t for t, k in kinds.items() if k in ("copy", "zero_copy")}
    assert {t for t, k in kinds.items() if k == "zero_copy"}  # the default bound leaves some to the engine
    k = task_kinds(plan, train, direct=True, copy_max=-1)
    assert {t for t, v in k.items() if v == "copy"} == zc
    assert k == task_kinds(plan, train, direct=True, copy_max=direct.COPY_ALL)


def test_the_batched_copies_have_their_own_rate_when_it_was_measured():
    """copy_batch_GBps (calibrate measures torch._foreach_copy_ of 128 ranges) times the copy
    kind's launches; without it they run at the on-device copy rate."""
    from dataclasses import replace

    from wxfer.plan.sim_stages import _StageModel

    cal = Calibration(copy_GBps=4000.0, pack_launch_s=0.0)
    c = Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, calibration=cal)
    nb = 1 << 30
    assert _StageModel(c).copy_s(nb) == pytest.approx(2 * nb / 4000e9)
    c2 = Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, calibration=replace(cal, copy_batch_GBps=2000.0))
    assert _StageModel(c2).copy_s(nb) == pytest.approx(2 * nb / 2000e9)


def test_calibrate_measures_the_batched_copies():
    import torch

    from wxfer.tools.calibrate import measure_kernels

    k = measure_kernels(torch.device("cpu"), quick=True)
    assert k["copy_batch_GBps"] > 0 and k["copy_GBps"] > 0


def test_a_copy_launch_costs_the_host_its_own_work_and_per_range():
    """host_copy_launch_s / host_copy_range_s (calibrate measures them apart): charged on the host
    at each batched launch, the launch issued after it; None (an in-run fit): nothing apart."""
    host, fixed, per = 3e-6, 40e-6, 0.5e-6
    cal = dict(copy_GBps=1000.0, pack_launch_s=0.0, host_copy_task_s=host, write_call_s=1e-6)
    c0, plan, kinds = _one(cal)
    c1, _, _ = _one(dict(cal, host_copy_launch_s=fixed, host_copy_range_s=per))
    copies = [t for t, k in kinds.items() if k == "copy"]
    ranges = int(np.isin(plan.task, copies).sum())
    lb = _launches(plan, kinds)
    a = simulate(plan, c0, kinds=kinds, record=True)
    b = simulate(plan, c1, kinds=kinds, record=True)
    assert a.stage_busy_s["host"] == pytest.approx(len(copies) * host, rel=1e-6)
    assert b.stage_busy_s["host"] == pytest.approx(len(copies) * host + len(lb) * fixed + ranges * per, rel=1e-6)
    qa, qb = _spans(a, "quant"), _spans(b, "quant")
    assert len(qa) == len(qb) == len(lb)
    # the first launch issued after its own host work (its ranges: at least one, at most COPY_BATCH)
    assert qa[0][0] + fixed + per - 1e-12 <= qb[0][0] <= qa[0][0] + fixed + COPY_BATCH * per + 1e-12
    assert b.simulated_s > a.simulated_s
