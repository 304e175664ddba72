"""Engine.prepare / Engine.submit_prepared (a Region source and its destinations validated
once, submitted every step), and the Sender's zero-copy tasks that use them: every byte
lands over fabric tcp, a parameter whose memory moved is registered again, verify mode,
and a restarted worker's tasks re-pointed at its new memory."""

import gc
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, inference_params, preset_for, train_model
from wxfer.runtime import control
from wxfer.runtime.receiver import Receiver
from helpers import landed  # tests/helpers.py
from wxfer.testing import connected_fabric, in_thread

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
T = 20.0


def test_prepared_tasks_write_every_byte_and_keep_their_source_alive():
    size, n = 1000, 5
    with connected_fabric("tcp", [size * n]) as (t, tgt):
        desc = tgt.descriptors[0]
        e = _wxfer.Engine(t, watermark=1 << 20, isolate=True)
        srcs = [torch.full((size,), i + 1, dtype=torch.uint8) for i in range(n)]
        regions = [t.register(s, export=False) for s in srcs]
        # two destinations per task: each half of the source to its own place
        tasks = [
            e.prepare(r, [(desc, i * size, 0, 400), (desc, i * size + 400, 400, size - 400)], tag=10 + i)
            for i, r in enumerate(regions)
        ]
        assert [p.tag for p in tasks] == [10, 11, 12, 13, 14] and tasks[0].nbytes == size
        assert tasks[0].region is regions[0]
        assert e.submit_prepared(tasks) == n
        e.wait(timeout=T)
        assert tgt.read(0) == torch.cat(srcs).numpy().tobytes()
        assert e.stats()["held_peak"] == 0  # a Region's memory is not held by the engine
        # the same tasks again after the sources changed in place: the new bytes
        for s in srcs:
            s.add_(100)
        # the engine keeps each task's Region (so its memory) alive until its writes completed
        want = torch.cat(srcs).numpy().tobytes()
        e.submit_prepared(tasks)
        del tasks, regions, srcs
        gc.collect()
        e.wait(timeout=T)
        assert tgt.read(0) == want
        recs = [r for r in e.trace() if r["tag"] >= 10]
        assert len(recs) == 2 * n and all(r["status"] == 0 and r["bytes"] == size for r in recs)

        # refused, naming what is wrong; nothing is submitted past a refusal
        src = torch.zeros(size, dtype=torch.uint8)
        with pytest.raises(TypeError, match="src must be a Region"):
            e.prepare(src, [(desc, 0, 0, size)])
        r = t.register(src, export=False)
        with pytest.raises(Exception, match=r"dests\[0\] \(tag 7\)"):
            e.prepare(r, [(desc, 0, 0, size + 1)], tag=7)  # past the source's end
        with pytest.raises(Exception, match=r"dests\[0\] \(tag 8\)"):
            e.prepare(r, [(desc, size * n - 10, 0, 20)], tag=8)  # past the destination's end
        with pytest.raises(TypeError, match=r"dests\[0\] must be"):
            e.prepare(r, [(desc, 0)])
        ok = e.prepare(r, [(desc, 0, 0, size)], tag=1)
        before = e.stats()["submitted"]
        with pytest.raises(TypeError, match=r"tasks\[1\] is a int, not a Prepared"):
            e.submit_prepared([ok, 5])
        e.wait(timeout=T)
        assert e.stats()["submitted"] == before + 1  # tasks[0] went, nothing after
        r.close()
        with pytest.raises(ValueError, match=r"tasks\[0\] \(tag 1\): its Region is closed"):
            e.submit_prepared([ok])
        # another engine of another transport refuses the task
        with connected_fabric("tcp", [64]) as (t2, _):
            e2 = _wxfer.Engine(t2)
            r2 = t.register(torch.zeros(64, dtype=torch.uint8), export=False)
            p2 = e.prepare(r2, [])
            with pytest.raises(ValueError, match="another transport"):
                e2.submit_prepared([p2])
            with pytest.raises(ValueError, match="another transport"):
                e2.prepare(r2, [])
            e2.close()
        e.close()


def _bf16_model():
    torch.manual_seed(0)
    m = train_model(TINY).to(torch.bfloat16)  # the inference dtype: every task is zero copy
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def test_zero_copy_push_uses_prepared_tasks_and_follows_moved_memory_and_restarts(store):
    from wxfer.runtime.sender import Sender

    s, addr = store
    name = "fast"
    kw = dict(mapping=preset_for(TINY).name, store=addr, replica=0, tp=2, replicas=1, name=name, timeout=T, verify=True)
    params = [inference_params(TINY, 2, r) for r in range(2)]
    ths = [in_thread(Receiver, params[r], rank=r, **kw) for r in range(2)]
    model = _bf16_model()
    sender = Sender(
        model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, write_timeout=5, watermark="1MiB"
    )
    recvs = []
    for th, box in ths:
        th.join(T)
        assert "error" not in box, box.get("error")
        recvs.append(box["value"])
    every = [op for g in sender.program.groups for op in g if op.sends]
    ops = [op for op in every if op.prep.zero_copy]
    # tp=2: the column-sliced (row-parallel) weights are packed; the rest is zero copy, so
    # a push interleaves prepared batches with packed tasks
    assert len(ops) > len(every) // 2 and len(ops) < len(every)
    assert all(op.prep.fast is None for op in every)  # registered at the first push
    sender.push()
    assert [r.version() for r in recvs] == [1, 1]
    assert landed(model, params[0], 0) and landed(model, params[1], 1)
    assert all(op.prep.fast is not None for op in ops)
    assert all(op.prep.fast is None for op in every if not op.prep.zero_copy)
    first = {op.task: op.prep.fast.task for op in ops}

    # in place: the same prepared tasks, the new bytes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sender.push()
    assert sender.version == 2
    assert landed(model, params[0], 0) and landed(model, params[1], 1)
    assert all(op.prep.fast.task is first[op.task] for op in ops)

    # a parameter given new memory: its task's source is registered again
    w = model.model.norm.weight
    w.data = w.data.clone() * 3
    sender.push(verify=True)
    assert landed(model, params[0], 0) and landed(model, params[1], 1)
    moved = [op for op in ops if op.prep.fast.task is not first[op.task]]
    assert moved and all(op.sources[0][1] is w for op in moved)
    assert sender.last_verify is not None

    # a restarted worker gpu 1: its tasks' prepared destinations point at its new memory
    ctl = control.Control(s, name, T)
    old = params[1]
    params[1] = inference_params(TINY, 2, 1)
    th, box = in_thread(Receiver, params[1], rank=1, **kw)
    e = ctl.add("infer/epoch/1", 0) + 1
    deadline = time.monotonic() + T
    while not ctl.check("infer/1/e%d" % e):
        assert time.monotonic() < deadline and th.is_alive(), box
        time.sleep(0.01)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    sender.push()
    th.join(T)
    assert "error" not in box, box.get("error")
    new = box["value"]
    assert new.version() == 4 and recvs[0].version() == 4 and recvs[1].version() == 3
    assert landed(model, params[1], 1) and landed(model, params[0], 0)
    assert not landed(model, old, 1)  # the replaced worker is no longer written
    sender.close()
    for r in recvs + [new]:
        r.close()


def test_a_prepared_task_to_a_vanished_peer_fails_naming_its_tag_and_peer():
    from wxfer.testing import TargetProcess

    opts = {"provider": "tcp"}
    tgt = TargetProcess("fabric", opts, [4 << 20])
    t = _wxfer.Transport("fabric", opts)
    eng = _wxfer.Engine(t, timeout=3.0, isolate=True)
    try:
        peer = tgt.connect(t)
        desc = tgt.descriptors[0]
        srcs = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(4)]
        tasks = [
            eng.prepare(t.register(s, export=False), [(desc, i << 20, 0, 1 << 20)], tag=40 + i)
            for i, s in enumerate(srcs)
        ]
        tgt.kill()
        t0 = time.monotonic()
        eng.submit_prepared(tasks)
        eng.wait(timeout=30)  # isolate: the peer fails alone, reported by failed_peers()
        assert time.monotonic() - t0 < 20
        failed = eng.failed_peers()
        assert len(failed) == 1, failed
        err = failed[0]
        assert err.peer == peer and err.tag in (40, 41, 42, 43) and err.errno > 0, (err.peer, err.tag, str(err))
        assert "(tag %d)" % err.tag in str(err), str(err)
        recs = eng.trace()
        assert sorted(r["tag"] for r in recs) == [40, 41, 42, 43]
    finally:
        eng.close()
        t.close()
