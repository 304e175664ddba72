"""The kind of work each task is on its sender (wxfer.plan.kinds) and the Sender's batches of
zero-copy tasks, decided from the plan and the trainers' parameter metadata."""

from collections import Counter

from wxfer.meta import Cluster, synthesize
from wxfer.plan import build_plan
from wxfer.plan.kinds import task_kinds
from wxfer.zerocopy import batches


def _one_rank(preset, quant=None, fused=False, tp=1):
    c = Cluster(
        train_gpus=1, infer_gpus=tp, infer_tp=tp, quant=quant, gpus_per_node=max(1, tp), dense_shard=1, expert_shard=1
    )
    s = synthesize(preset, c, fused_experts=fused)
    return build_plan(s.train, s.workers, s.preset, quant=quant, expanded=s.expanded), s.train


def test_the_one_gpu_benchmark_rows_zero_copy_counts():
    # the counts the H200 benchmark's Senders reported (2026-12-01, benchmarks/runs/h200-2026-12-01-1144): 8B BF16 399
    # of 399 zero copy, 8B FP8 147 of 183 (36 direct), 30B-A3B BF16 (fused 3-D experts, cut at their
    # two sources) 531 of 531, 30B-A3B FP8 243 of 339 (96 direct)
    for preset, q, fused, want in (
        ("qwen3-8b", None, False, {"zero_copy": 399}),
        ("qwen3-8b", "fp8", False, {"zero_copy": 147, "packed": 36}),
        ("qwen3-30b-a3b", None, True, {"zero_copy": 531}),
        ("qwen3-30b-a3b", "fp8", True, {"zero_copy": 243, "packed": 96}),
    ):
        plan, train = _one_rank(preset, q, fused)
        assert Counter(task_kinds(plan, train).values()) == want, preset
        direct = Counter(task_kinds(plan, train, direct=True, copy_max=0).values())
        assert direct == {("direct" if k == "packed" else k): n for k, n in want.items()}, preset
        assert set(task_kinds(plan).values()) == {"packed"}  # no metadata: the old model
        assert task_kinds(plan, {p.name: (p.shape, p.dtype) for p in train}) == task_kinds(plan, train)


def test_small_zero_copy_tasks_are_copy_where_direct_is_possible():
    # the counts the H200 benchmark's Senders reported at 11:58 UTC (benchmarks/runs/h200-2026-12-01-1158: direct copies
    # and zero_copy_tasks): 8B BF16 217 copies of 399 zero copy, 8B FP8 145 of 147, 30B-A3B BF16 433 of 531
    from wxfer.plan.kinds import packed_bytes
    from wxfer.zerocopy import COPY_MAX

    for preset, q, fused, want in (
        ("qwen3-8b", None, False, {"copy": 217, "zero_copy": 182}),
        ("qwen3-8b", "fp8", False, {"copy": 145, "zero_copy": 2, "direct": 36}),
        ("qwen3-30b-a3b", None, True, {"copy": 433, "zero_copy": 98}),
    ):
        plan, train = _one_rank(preset, q, fused)
        k = task_kinds(plan, train, direct=True)
        assert Counter(k.values()) == want, preset
        nb = packed_bytes(plan)
        assert all((nb[t] < COPY_MAX) == (v == "copy") for t, v in k.items() if v in ("copy", "zero_copy"))
        assert "copy" not in task_kinds(plan, train).values()  # not without direct
        assert "copy" not in task_kinds(plan, train, cpu_offload=True, direct=True).values()  # staged
    k = task_kinds(plan, train, direct=True, copy_max=1 << 40)
    assert Counter(k.values()) == {"copy": 531}


def test_copy_tasks_leave_the_zero_copy_batch_open():
    from wxfer.zerocopy import batch_ends

    z, c, p = "zero_copy", "copy", "packed"
    # handed over after the copies that follow it, before the packed task; at the group's end
    assert batch_ends([z, c, z, c, c, p, z, c]) == {4: (2, 2), 7: (1, 6)}
    assert batch_ends([z, c, z], 2) == {2: (2, 2)}  # the size-th zero-copy task
    assert batch_ends([c, c]) == {} and batches([z, c, z, p]) == [(0, 2)]


def test_offloaded_whole_rows_are_staged_and_column_slices_packed():
    plan, train = _one_rank("qwen3-tiny")
    zc = {t for t, k in task_kinds(plan, train).items() if k == "zero_copy"}
    off = task_kinds(plan, train, cpu_offload=True)
    assert zc and all(off[t] == "staged" for t in zc)  # H2D into fresh memory, written from there
    plan2, train2 = _one_rank("qwen3-tiny", tp=2)
    k2 = task_kinds(plan2, train2)
    srcs = {t.id: " ".join(t.sources) for t in plan2.tasks}
    # row-parallel weights are column slices at TP2: packed (one task per layer); norms and
    # column-parallel weights (whole rows): zero copy, one task per source
    assert all(k2[t] == "packed" for t in k2 if "o_proj" in srcs[t]) and any("o_proj" in v for v in srcs.values())
    assert all(k2[t] == "zero_copy" for t in k2 if "norm" in srcs[t] or "q_proj" in srcs[t])


def test_gathered_whole_tensor_is_staged():
    c = Cluster(train_gpus=2, infer_gpus=1, infer_tp=1, gpus_per_node=2, dense_shard=2, expert_shard=1)
    s = synthesize("qwen3-tiny", c)
    plan = build_plan(s.train, s.workers, s.preset, expanded=s.expanded, coarse=False)
    k = task_kinds(plan, s.train)
    assert "zero_copy" not in k.values()  # every mesh has two ranks: gathered
    one = [t for t in plan.tasks if len(t.sources) == 1 and len(t.shards) == 1]
    assert one and all(k[t.id] == "staged" for t in one)


def test_batches_follow_the_sender_loop():
    z, p = "zero_copy", "packed"
    assert batches([z] * 5, 2) == [(0, 2), (2, 2), (4, 1)]
    assert batches([z, z, p, z, "collective_only", z, z], 32) == [(0, 2), (3, 1), (5, 2)]
    assert batches([p, p], 32) == [] and batches([], 4) == []
    assert batches([z] * 64) == [(0, 32), (32, 32)]
    # and by bytes (the Sender hands a batch over once its tasks reach ZERO_COPY_BATCH_BYTES)
    mb = 1 << 20
    assert batches([z] * 4, 32, [10 * mb, 250 * mb, mb, mb]) == [(0, 2), (2, 2)]
    assert batches([z, "copy", z, z], 32, [300 * mb, 10**12, mb, mb]) == [(0, 1), (2, 2)]  # a copy's bytes do not count


def test_the_fit_reads_the_senders_stamp_tag():
    from wxfer.runtime import hostfit
    from wxfer.runtime.tasks import STAMP_TAG

    assert hostfit.STAMP_TAG == STAMP_TAG


def test_auto_kinds_come_from_the_plans_own_training_parameters():
    import pytest
    from wxfer.plan.simulate import simulate

    plan, train = _one_rank("qwen3-tiny")
    assert plan.train_params and task_kinds(plan, plan.train_params) == task_kinds(plan, train)
    c = Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, gpus_per_node=1, dense_shard=1, expert_shard=1)
    auto = simulate(plan, c, kinds="auto", record=False)
    assert auto.simulated_s == simulate(plan, c, kinds=task_kinds(plan, train), record=False).simulated_s
    assert auto.terms["zero_copy_tasks"] == len(plan.tasks)
    with pytest.raises(ValueError, match="kinds must be"):
        simulate(plan, c, kinds="zero_copy")
