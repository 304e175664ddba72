"""Property tests: random models, meshes and TP sizes -- coverage always holds, the
per-rank lists never deadlock against the mesh-group barriers, bytes balance."""

import random

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from wxfer.mapping import from_config
from wxfer.meta import Cluster, TrainParam, synthesize
from wxfer.plan import Plan, build_plan
from helpers import small_dense  # tests/helpers.py

ARCHS = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@st.composite
def models(draw):
    arch = draw(st.sampled_from(sorted(ARCHS)))
    tp = draw(st.sampled_from([1, 2, 4]))
    quant = draw(st.sampled_from([None, "fp8"]))
    ep = draw(st.booleans())
    n_kv = draw(st.sampled_from([1, 2, 4]))
    heads = n_kv * draw(st.sampled_from([1, 2, 4]))
    if heads % tp:
        heads = tp * n_kv
    cfg = dict(
        architectures=[ARCHS[arch]],
        hidden_size=128 * draw(st.integers(1, 3)),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=n_kv,
        head_dim=128,
        intermediate_size=128 * tp * draw(st.integers(1, 2)),
        vocab_size=64 * tp * draw(st.integers(1, 3)),
        tie_word_embeddings=draw(st.booleans()),
    )
    if arch == "qwen3_moe":
        cfg.update(num_experts=tp * draw(st.integers(1, 3)), moe_intermediate_size=128 * tp)
    if arch == "deepseek_v3":
        h = 2 * tp * draw(st.integers(1, 2))
        cfg.update(
            num_attention_heads=h,
            num_key_value_heads=h,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=draw(st.integers(0, 1)),
            n_routed_experts=tp * draw(st.integers(1, 3)),
            n_shared_experts=1,
            moe_intermediate_size=128 * tp,
        )
    return cfg, tp, quant, ep


@st.composite
def clusters(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return dict(
        train_gpus=world,
        gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        dense_shard=draw(st.sampled_from(divs)),
        expert_shard=draw(st.sampled_from(divs)),
        replicas=draw(st.integers(1, 3)),
    )


def _random_meshes(train, world, seed):
    """Random mesh options per layer / expert: one random subset, or disjoint replicas."""
    rnd = random.Random(seed)
    by_group = {}
    out = []
    for p in train:
        parts = p.name.split(".")
        key = ".".join(parts[:6]) if ".experts." in p.name else ".".join(parts[:3]) if "layers" in p.name else p.name
        if key not in by_group:
            ranks = list(range(world))
            rnd.shuffle(ranks)
            if rnd.random() < 0.5:
                k = rnd.randint(1, world)
                by_group[key] = (tuple(sorted(ranks[:k])),)
            else:
                k = rnd.choice([d for d in range(1, world + 1) if world % d == 0])
                by_group[key] = tuple(tuple(sorted(ranks[i : i + k])) for i in range(0, world, k))
        out.append(TrainParam(p.name, p.shape, p.dtype, by_group[key]))
    return out


def _check(plan: Plan, ex, workers):
    plan.check(workers)  # raises PlanError on any coverage problem
    plan.check_deadlock_free()
    for g in plan.groups:
        ranks = [r for m in g for r in plan.meshes[m]]
        assert len(ranks) == len(set(ranks)), "meshes of a group must be disjoint"
    got = plan.bytes_per_infer_gpu()
    for w in workers:
        assert got[w.gpu] == ex.dest_bytes(w.rank)
    # senders belong to the task's mesh and src offsets stay inside the packed buffer
    for t in plan.tasks[:50]:
        for r in set(plan.sender[plan.task == t.id].tolist()):
            assert r in plan.meshes[t.mesh]
            buf = sum(s.nbytes for _, s in plan.packed_shards(r, t.id))
            sel = (plan.sender == r) & (plan.task == t.id)
            assert (plan.src_offset[sel] + plan.nbytes[sel]).max() <= buf
    back = Plan.from_bytes(plan.to_bytes())
    assert np.array_equal(back.sender, plan.sender) and np.array_equal(back.dst_offset, plan.dst_offset)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), clusters(), st.booleans(), st.integers(0, 2**16))
def test_random_models_and_meshes_cover_and_never_deadlock(model, cl, random_meshes, seed):
    cfg, tp, quant, ep = model
    reps = cl.pop("replicas")
    cluster = Cluster(infer_gpus=tp * reps, infer_tp=tp, infer_ep=ep, quant=quant, **cl)
    pre = from_config("prop", cfg)
    s = synthesize(pre, cluster)
    train = _random_meshes(s.train, cluster.train_gpus, seed) if random_meshes else s.train
    ex = s.expanded
    plan = build_plan(
        train,
        s.workers,
        pre,
        quant=quant,
        gpus_per_node=cluster.gpus_per_node,
        max_task_bytes=random.Random(seed).choice([1 << 20, 1 << 30]),
    )
    _check(plan, ex, s.workers)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 3), st.integers(0, 2**16))
def test_overlapping_random_meshes_group_and_balance(world, layers, seed):
    """Every layer on its own random mesh (heavy overlap): still covered and deadlock-free;
    when every rank can produce every tensor alone, the tasks spread over all trainers."""
    pre = from_config("prop", small_dense("LlamaForCausalLM", layers, head_dim=64))
    cluster = Cluster(train_gpus=world, infer_gpus=4, infer_tp=2, dense_shard=1, expert_shard=1)
    s = synthesize(pre, cluster)
    train = _random_meshes(s.train, world, seed)
    plan = build_plan(train, s.workers, pre)
    _check(plan, s.expanded, s.workers)
    # HSDP-style options on every rank: the sender choice spreads over all trainers
    full = [TrainParam(p.name, p.shape, p.dtype, tuple((r,) for r in range(world))) for p in s.train]
    plan2 = build_plan(full, s.workers, pre)
    _check(plan2, s.expanded, s.workers)
    per = plan2.bytes_per_train_rank()
    assert (per > 0).sum() == min(world, len(plan2.tasks))  # a task is prepared on one mesh
    biggest = max(plan2.nbytes[plan2.task == t.id].sum() for t in plan2.tasks)
    assert per.max() <= max(per.mean() * 1.5, biggest)  # balanced up to one task
