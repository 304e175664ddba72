"""The simulator's model of a push with direct tasks (wxfer.runtime.inplace: packed straight into
the receivers' memory on cuda_ipc colocated) and of the begin stamps as an engine fence: no
data write posted before the stamps landed, the push's first direct task waiting for the
engine's earlier writes, a direct task's host cost per task and its kernel at the quantizer's
rate with no write and no posting, and the write path's own time per write."""

from types import SimpleNamespace

import numpy as np
import pytest
from one_trainer import one_trainer_plan  # tests/one_trainer.py

from wxfer.plan.simulate import simulate

FAST = dict(nic_gbps=8000.0, nvlink_GBps=1e4, mem_GBps=1e5, pcie_GBps=1e4)
ZERO = dict(host_param_s=0.0, host_zc_task_s=0.0, pack_launch_s=0.0, launch_per_piece=False)


def _one(cal=None, write_GBps=1e5, preset="qwen3-8b", quant="fp8", copy_max=0):
    kinds = dict(direct=True, copy_max=copy_max)
    return one_trainer_plan(preset, quant, dict(ZERO, **(cal or {})), kinds, write_GBps=write_GBps, **FAST)


def _spans(r, stage):
    return sorted((s, e, t) for st, rk, t, s, e in r.timeline if st == stage and rk == 0)


def test_the_first_direct_task_waits_for_the_begin_stamps_and_no_write_precedes_the_fence():
    c, plan, kinds = _one(dict(quant_GBps=1000.0, push_begin_s=1e-3, begin_fence_s=2e-3), write_GBps=100.0)
    order = [t for t, _ in plan.rank_schedule(0)[0]]
    first = next(i for i, t in enumerate(order) if kinds[t] == "direct")
    assert first > 0 and "zero_copy" in {kinds[t] for t in order[:first]}
    r = simulate(plan, c, kinds=kinds)
    writes = _spans(r, "write")
    assert min(s for s, _, _ in writes) >= 3e-3 - 1e-12  # begin + fence
    before = max(e for s, e, t in writes if t in order[:first])
    q = _spans(r, "quant")
    # the first kernel starts once the begin stamps landed (the Sender waits for that fence alone),
    # while the engine still writes the zero-copy tasks submitted before it
    assert q[0][2] == order[first] and 3e-3 - 1e-12 <= q[0][0] < before
    # the zero-copy tasks after the direct ones are written while the kernels run (the host went on)
    after = [s for s, _, t in writes if t in order[first:] and kinds[t] == "zero_copy"]
    assert after and min(after) < q[-1][1]
    assert r.terms["direct_tasks"] == sum(1 for k in kinds.values() if k == "direct")


def test_a_direct_task_costs_its_host_per_task_and_its_kernel_without_a_write():
    rate = 500.0
    c, plan, kinds = _one(dict(quant_GBps=rate, quant_small_GBps=rate, host_direct_task_s=1e-3, write_call_s=1e-4))
    r = simulate(plan, c, kinds=kinds)
    direct = [t for t in plan.tasks if kinds[t.id] == "direct"]
    work = sum(t.src_bytes + sum(sh.nbytes for sh in t.shards) for t in direct) / (rate * 1e9)
    assert r.terms["kernel_s"] == pytest.approx(work, rel=1e-6)  # sources read + packed written, no write
    assert r.stage_busy_s["host"] == pytest.approx(len(direct) * 1e-3, rel=1e-6)  # zero copy: no host cost here
    zc_writes = int(np.isin(plan.task, [t.id for t in plan.tasks if kinds[t.id] == "zero_copy"]).sum())
    assert r.terms["post_s"] == pytest.approx(zc_writes * 1e-4)  # the engine posts only the zero-copy writes
    zc_bytes = plan.nbytes[np.isin(plan.task, [t.id for t in direct], invert=True)].sum()
    assert r.terms["write_s"] == pytest.approx(zc_bytes / 1e14, rel=1e-6)
    # without a measured direct host cost, a packed task's figures (per task / parameter / piece)
    c2, _, _ = _one(dict(quant_GBps=rate, quant_small_GBps=rate, host_task_s=2e-3))
    assert simulate(plan, c2, kinds=kinds).stage_busy_s["host"] == pytest.approx(len(direct) * 2e-3, rel=1e-6)


def test_the_write_path_time_per_write_beyond_its_bytes():
    c, plan, kinds = _one(preset="qwen3-8b", quant=None, write_GBps=2000.0)
    assert set(kinds.values()) == {"zero_copy"}
    a = simulate(plan, c, kinds=kinds)
    c2, _, _ = _one(dict(write_dev_s=20e-6), preset="qwen3-8b", quant=None, write_GBps=2000.0)
    b = simulate(plan, c2, kinds=kinds)
    assert b.simulated_s - a.simulated_s == pytest.approx(plan.n_transfers * 20e-6, rel=0.05)
    assert b.terms["write_s"] - a.terms["write_s"] == pytest.approx(plan.n_transfers * 20e-6)


def test_the_classifier_and_the_senders_task_kinds_say_direct():
    from wxfer import taskpath as tp
    from wxfer.runtime.tasks import TaskRunner

    op = SimpleNamespace(sends=True, sources=[("a", None), ("b", None)], shards=[], task=7, name="t7")
    f = tp.Facts(True, tp.FUSED, held=False)
    prep = SimpleNamespace(facts=f, best=tp.best(f))
    assert tp.classify(f).path == "packed" and tp.classify(f, in_place=None).path == "direct"
    own = tp.Facts(True, tp.WHOLE, on_device=False)  # an offloaded source's own bytes: staged
    assert tp.classify(own, in_place=None) == ("staged", "offloaded")
    op.prep = prep

    class InPlace:  # what task_kinds asks of the in-place writer
        verify = False
        why_off = None

        def off(self):
            return self.why_off

        def plan_of(self, o):
            return (object(), None) if o is op else (None, "no")

    ip = InPlace()
    cpu = __import__("torch").device("cpu")
    s = TaskRunner(None, None, cpu, None, 0, SimpleNamespace(groups=[[op]]), None, ip, 1.0)
    assert s.task_kinds() == {7: "direct"}
    ip.why_off = "transport 'fabric': only cuda_ipc maps the receivers' memory"
    assert s.task_kinds() == {7: "packed"}
    ip.why_off, ip.verify = None, True  # verify sends every task the staging way
    assert s.task_kinds() == {7: "packed"}
