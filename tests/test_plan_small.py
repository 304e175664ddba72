"""Small plans written out by hand: 2 trainers, TP2 inference, fused qkv, FP8."""

import numpy as np
import pytest
import torch

from wxfer.mapping import Fuse, Ignore, Preset, pack_shard, quantize_fp8_block
from wxfer.meta import InferParam, InferWorker, TrainParam
from wxfer.plan import PlanError, build_plan
from helpers import small_dense  # tests/helpers.py

W, S = "attn.qkv.weight", "attn.qkv.weight_scale_inv"


def _preset(extra=()):
    return Preset(
        "hand",
        "custom",
        [Fuse(W, ("attn.q.weight", "attn.k.weight", "attn.v.weight"), heads=("n_heads", "n_kv", "n_kv")), *extra],
        config={"n_heads": 2, "n_kv": 1},
        quant="fp8",
    )


def _train(mesh=((0, 1),)):
    return [
        TrainParam("attn.q.weight", (256, 128), "bfloat16", mesh),
        TrainParam("attn.k.weight", (128, 128), "bfloat16", mesh),
        TrainParam("attn.v.weight", (128, 128), "bfloat16", mesh),
    ]


def _workers(replicas=1):
    params = {W: InferParam(W, (384, 128), "float8_e4m3fn"), S: InferParam(S, (3, 1), "float32")}
    return [
        InferWorker(rep, r, 2, False, dict(params), {W: bytes([rep, r])}) for rep in range(replicas) for r in range(2)
    ]


def _rows(plan):
    return [
        (
            int(plan.sender[i]),
            int(plan.task[i]),
            int(plan.replica[i]),
            int(plan.infer_rank[i]),
            plan.names[plan.dst[i]],
            int(plan.dst_offset[i]),
            int(plan.nbytes[i]),
            int(plan.src_offset[i]),
        )
        for i in range(plan.n_transfers)
    ]


def test_two_trainers_tp2_fused_qkv_fp8_one_replica():
    plan = build_plan(_train(), _workers(1), _preset())
    # one task (q, k, v fused) on mesh (0, 1); each rank of the inference TP group needs
    # [q_r | k | v] (the single KV head is replicated) as 384x128 FP8 + 3x1 float32 scales.
    assert len(plan.tasks) == 1 and plan.tasks[0].sources == ("attn.q.weight", "attn.k.weight", "attn.v.weight")
    assert plan.meshes == [(0, 1)] and plan.groups == [[0]]
    #          sender task replica rank dst  offset  length  src offset
    assert _rows(plan) == [
        (0, 0, 0, 0, W, 0, 49152, 0),
        (0, 0, 0, 0, S, 0, 12, 49152),
        (1, 0, 0, 1, W, 0, 49152, 0),
        (1, 0, 0, 1, S, 0, 12, 49152),
    ]
    assert plan.descriptors[(1, W)] == bytes([0, 1])
    plan.check()
    plan.check_deadlock_free()
    sched = plan.rank_schedule(1)
    assert [[t for t, _ in g] for g in sched] == [[0]] and list(sched[0][0][1]) == [2, 3]

    # the bytes each transfer carries rebuild exactly what the mapping says
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, (s, _) in plan.train_params.items()}
    dest = {}
    for rank in range(2):
        packed = {off: pack_shard(sh, full) for off, sh in plan.packed_shards(rank, 0)}
        buf = torch.cat([packed[o] for o in sorted(packed)])
        for i in np.flatnonzero(plan.sender == rank):
            t = plan.transfer(i)
            d = dest.setdefault((t["gpu"], t["dst"]), torch.zeros(49152 if t["dst"] == W else 12, dtype=torch.uint8))
            d[t["dst_offset"] : t["dst_offset"] + t["nbytes"]] = buf[t["src_offset"] : t["src_offset"] + t["nbytes"]]
    for r in range(2):
        q, s = quantize_fp8_block(
            torch.cat([full["attn.q.weight"][128 * r : 128 * (r + 1)], full["attn.k.weight"], full["attn.v.weight"]])
        )
        assert torch.equal(dest[(r, W)], q.view(torch.uint8).reshape(-1))
        assert torch.equal(dest[(r, S)], s.view(torch.uint8).reshape(-1))


def test_two_replicas_each_trainer_serves_one_replica():
    plan = build_plan(_train(), _workers(2), _preset())
    # trainer 0 feeds replica 0, trainer 1 replica 1, each visiting the inference ranks in
    # its own pseudo-random order (here both start with rank 1, on different GPUs).  The
    # packed buffer holds each shard once, in sending order.
    assert _rows(plan) == [
        (0, 0, 0, 1, W, 0, 49152, 0),
        (0, 0, 0, 1, S, 0, 12, 49152),
        (0, 0, 0, 0, W, 0, 49152, 49164),
        (0, 0, 0, 0, S, 0, 12, 98316),
        (1, 0, 1, 1, W, 0, 49152, 0),
        (1, 0, 1, 1, S, 0, 12, 49152),
        (1, 0, 1, 0, W, 0, 49152, 49164),
        (1, 0, 1, 0, S, 0, 12, 98316),
    ]
    assert list(plan.bytes_per_train_rank()) == [98328, 98328]
    assert list(plan.bytes_per_infer_gpu()) == [49164] * 4


def test_coverage_catches_a_missing_and_a_duplicated_byte():
    plan = build_plan(_train(), _workers(1), _preset())
    assert plan.check() == []
    plan.nbytes[0] -= 1  # last byte of rank 0's weight never written
    probs = plan.check(raise_=False)
    assert probs == [f"bytes [49151, 49152) of {W} on replica 0 rank 0 are never written"]
    with pytest.raises(PlanError, match="never written"):
        plan.check()
    plan.nbytes[0] += 1
    for k in ("sender", "task", "shard", "replica", "infer_rank", "dst", "dst_offset", "nbytes", "src_offset"):
        a = getattr(plan, k)
        setattr(plan, k, np.r_[a, a[3]])  # rank 1's scale written a second time
    probs = plan.check(raise_=False)
    assert probs == [f"bytes [0, 12) of {S} on replica 0 rank 1 are written twice"]
    plan.dst_offset[-1] = 4  # overlapping write that also runs past the end
    probs = plan.check(raise_=False)
    assert f"bytes [4, 16) of {S} on replica 0 rank 1 are outside the parameter (12 bytes)" in probs
    assert f"bytes [4, 12) of {S} on replica 0 rank 1 are written twice" in probs


def test_mismatches_listed_by_name():
    train = _train() + [
        TrainParam("attn.extra.weight", (4, 4), "bfloat16", ((0, 1),)),
        TrainParam("rotary.inv_freq", (4,), "float32", ((0, 1),)),
    ]
    workers = _workers(1)
    del workers[1].params[S]
    workers[0].params[W] = InferParam(W, (384, 64), "float8_e4m3fn")
    workers[0].params["lm_head.weight"] = InferParam("lm_head.weight", (4, 4), "bfloat16")
    with pytest.raises(PlanError) as ei:
        build_plan(train, workers, _preset(), ignore=[r"rotary\..*"])
    p = ei.value.problems
    assert "training parameter attn.extra.weight is not used by any rule and not ignored" in p
    assert f"{S}: expected on replica 0 rank 1 but the worker lacks it" in p
    assert any(x.startswith(f"{W} on replica 0 rank 0: worker has (384, 64)") for x in p)
    assert "lm_head.weight on replica 0 rank 0: no rule writes this destination" in p
    assert not any("rotary" in x for x in p)
    # declared in the mapping instead: the Ignore rule
    plan = build_plan(
        _train() + [TrainParam("rotary.inv_freq", (4,), "float32", ((0, 1),))],
        _workers(1),
        _preset([Ignore("", ("rotary.inv_freq",))]),
    )
    assert plan.ignored == ["rotary.inv_freq"]


def test_sources_on_different_meshes_are_refused():
    train = _train()
    train[2] = TrainParam("attn.v.weight", (128, 128), "bfloat16", ((2, 3),))
    with pytest.raises(PlanError, match="share no mesh"):
        build_plan(train, _workers(1), _preset())


def test_overlapping_meshes_get_separate_groups_and_deadlock_check_bites():
    pre = Preset("hand2", "custom", [Fuse("a", ("a",)), Fuse("b", ("b",)), Fuse("c", ("c",))], quant=None)
    train = [
        TrainParam("a", (8, 4), "bfloat16", ((0, 1),)),
        TrainParam("b", (8, 4), "bfloat16", ((1, 2),)),
        TrainParam("c", (8, 4), "bfloat16", ((3,),)),
    ]
    ws = [InferWorker(0, r, 2, False, {n: InferParam(n, (4, 4), "bfloat16") for n in "abc"}) for r in range(2)]
    plan = build_plan(train, ws, pre)
    gm = [sorted(plan.meshes[m] for m in g) for g in plan.groups]
    assert sorted(gm) == [[(0, 1), (3,)], [(1, 2)]]
    for g in plan.groups:  # meshes of one group are disjoint
        ranks = [r for m in g for r in plan.meshes[m]]
        assert len(ranks) == len(set(ranks))
    plan.check_deadlock_free()
    assert set(plan.sender.tolist()) == {0, 1, 2, 3}  # every trainer sends something
    # break the invariant: put the overlapping meshes in one group
    plan.groups = [[m for g in plan.groups for m in g]]
    with pytest.raises(RuntimeError, match="deadlock"):
        plan.check_deadlock_free()


def test_expected_destination_for_a_tiny_qwen3_end_to_end_reference():
    """The helpers the end-to-end test uses: replaying a plan's transfers from the
    reference packed buffers gives, on every GPU, the vLLM layout of the model."""
    from wxfer.meta import Cluster
    from wxfer.plan import expected_destination, packed_buffer, plan_for

    c = Cluster(train_gpus=2, infer_gpus=4, infer_tp=2)
    plan = plan_for("qwen3-tiny", c)
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, (s, _) in plan.train_params.items()}
    a = "model.layers.1.self_attn."
    for gpu in range(4):
        d = expected_destination(plan, gpu, full)
        r = gpu % 2
        qkv = d[a + "qkv_proj.weight"].view(torch.bfloat16).view(-1, 256)
        want = torch.cat(
            [
                full[a + "q_proj.weight"][128 * r : 128 * (r + 1)],
                full[a + "k_proj.weight"][64 * r : 64 * (r + 1)],
                full[a + "v_proj.weight"][64 * r : 64 * (r + 1)],
            ]
        )
        assert torch.equal(qkv, want)
        assert torch.equal(d["model.norm.weight"].view(torch.bfloat16), full["model.norm.weight"])
        assert set(d) == set(n for n in plan.names if plan.dest_nbytes[r, plan.names.index(n)] >= 0)
    t = int(plan.task[0])
    buf = packed_buffer(plan, int(plan.sender[0]), t, full)
    assert buf.numel() == max(
        int(plan.src_offset[i] + plan.nbytes[i])
        for i in range(plan.n_transfers)
        if plan.sender[i] == plan.sender[0] and plan.task[i] == t
    )


def test_inconsistent_workers_are_refused_by_name():
    ws = _workers(1)
    ws[1].tp = 4
    with pytest.raises(PlanError, match="tp=4"):
        build_plan(_train(), ws, _preset())
    ws = _workers(1)
    ws[1].rank = 5
    with pytest.raises(PlanError) as ei:
        build_plan(_train(), ws, _preset())
    assert "worker replica 0 rank 5: rank outside [0, 2) or negative replica" in ei.value.problems
    assert "no worker for replica 0 rank 1" in ei.value.problems
    ws = _workers(1) + _workers(1)[:1]
    with pytest.raises(PlanError, match="two workers claim replica 0 rank 0"):
        build_plan(_train(), ws, _preset())


def _layered(layers=3):
    from wxfer.mapping import from_config

    return from_config("layered", small_dense("Qwen3ForCausalLM", layers, head_dim=128, tie_word_embeddings=False))


def test_coarse_tasks_one_per_layer_and_destination_set_bytes_unchanged():
    """FSDP2 units: every component of a decoder layer on one mesh forms one task (split at
    max_task_bytes); the bytes every inference GPU receives are those of the per-component
    plan; on a one-rank mesh whole-row raw pieces stay tasks of their own (zero copy)."""
    from wxfer.meta import Cluster, synthesize
    from wxfer.plan import expected_destination

    pre = _layered()
    s = synthesize(pre, Cluster(train_gpus=2, infer_gpus=2, infer_tp=2, dense_shard=2, quant="fp8"))
    coarse = build_plan(s.train, s.workers, pre, quant="fp8")
    fine = build_plan(s.train, s.workers, pre, quant="fp8", coarse=False)
    layer_tasks = [t for t in coarse.tasks if ".layers." in t.sources[0]]
    assert sorted(t.name for t in layer_tasks) == [f"model.layers.{i}" for i in range(3)]
    assert all({n.split(".")[2] for n in t.sources} == {t.name.split(".")[-1]} for t in layer_tasks)
    assert len(coarse.tasks) == 3 + 1 and len(fine.tasks) > 3 * 6  # + the root unit
    assert sorted(n for t in coarse.tasks for n in t.sources) == sorted(n for t in fine.tasks for n in t.sources)
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(*sh, generator=g).to(torch.bfloat16) for n, (sh, _) in coarse.train_params.items()}
    for gpu in range(2):
        a, b = expected_destination(coarse, gpu, full), expected_destination(fine, gpu, full)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    coarse.check_deadlock_free()
    sm = coarse.summary()  # the notebook sees the grouping
    assert (
        sm["tasks"] == 4
        and sm["sources_per_task"] > 3
        and sm["largest_task_bytes"] == max(t.src_bytes for t in coarse.tasks)
    )
    assert "sources each" in coarse._repr_html_()
    try:
        frame = coarse.tasks_frame()
    except ImportError:
        frame = None
    if frame is not None:
        assert list(frame["name"])[1:] == [t.name for t in coarse.tasks][1:]
        assert int(frame["bytes_written"].sum()) == int(coarse.nbytes.sum())
    # the size bound splits a layer; a task exceeds it only when one component does
    bound = layer_tasks[0].src_bytes // 3
    small = build_plan(s.train, s.workers, pre, quant="fp8", max_task_bytes=bound)
    assert len(small.tasks) > len(coarse.tasks) + 3
    for t in small.tasks:
        assert t.src_bytes <= bound or len(fine_components(fine, t)) == 1, t.name
    # one trainer holding whole tensors, BF16: every task is one source and raw whole-row
    # pieces (zero copy), the fused qkv / gate_up cut at their sources, same bytes
    for tp in (1, 2):
        one = synthesize(pre, Cluster(train_gpus=1, infer_gpus=tp, infer_tp=tp, dense_shard=1))
        p1 = build_plan(one.train, one.workers, pre, quant=None)
        ref = build_plan(one.train, one.workers, pre, quant=None, coarse=False)
        direct = [
            t
            for t in p1.tasks
            if len(t.sources) == 1 and all(len(sh.pieces) == 1 and sh.kind == "raw" for sh in t.shards)
        ]
        rest = [t for t in p1.tasks if t not in direct]  # TP2: o_proj, down_proj split by columns
        assert [sorted(n.split(".")[-2] for n in t.sources) for t in rest] == (
            [] if tp == 1 else [["down_proj", "o_proj"]] * 3
        )
        qkv = [t for t in p1.tasks if t.name.endswith("qkv_proj.weight")]
        assert len(qkv) == 3 * 3 and all(len(t.shards) == tp for t in qkv)
        for gpu in range(tp):
            a, b = expected_destination(p1, gpu, full), expected_destination(ref, gpu, full)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        p1.check()


def fine_components(fine, task):
    """The per-component tasks of `fine` whose sources `task` holds."""
    return [t for t in fine.tasks if set(t.sources) <= set(task.sources)]
