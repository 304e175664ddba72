"""The controller's side of setup without processes: merging the trainers' metadata (expert
parallelism), building the plan from receivers' metadata, and one rank's program."""

import base64

import pytest
import torch

from wxfer.runtime import program
from wxfer.runtime import prepare
from wxfer.runtime.control import SetupError
from wxfer.models import TINY, inference_params, preset_for
from wxfer.runtime.receiver import decode_param_descriptor, encode_param_descriptor


def _meta(name, shape, meshes, placements=("Shard(dim=0)",), dtype="float32"):
    return dict(
        name=name, shape=list(shape), dtype=dtype, meshes=[list(m) for m in meshes], placements=list(placements)
    )


def test_merge_unions_the_meshes_of_ranks_holding_a_parameter():
    dense = _meta("d", (8, 4), [(0, 1), (2, 3)], ("Replicate()", "Shard(dim=0)"))
    per_rank = [
        [dense, _meta("e0", (4, 4), [(0, 2)])],
        [dense, _meta("e1", (4, 4), [(1, 3)])],
        [dense, _meta("e0", (4, 4), [(0, 2)])],
        [dense, _meta("e1", (4, 4), [(1, 3)])],
    ]
    train, problems = program.merge_train_metadata(per_rank)
    by = {p.name: p for p in train}
    assert not problems
    assert by["d"].meshes == ((0, 1), (2, 3)) and by["e0"].meshes == ((0, 2),) and by["e1"].meshes == ((1, 3),)


def test_merge_reports_disagreeing_ranks_by_name():
    per_rank = [[_meta("w", (8, 4), [(0, 1)])], [_meta("w", (8, 5), [(0, 1)])]]
    _, problems = program.merge_train_metadata(per_rank)
    assert len(problems) == 1 and "training parameter w" in problems[0] and "rank 1" in problems[0]


def test_plain_tensors_are_producible_only_where_reported():
    rep = ("Replicate()",)
    per_rank = [[_meta("p", (3,), [(0,), (1,)], rep)], [], [_meta("p", (3,), [(0,), (1,), (2,)], rep)]]
    train, _ = program.merge_train_metadata(per_rank)
    assert train[0].meshes == ((0,), (2,))


def _worker_meta(rep, rank, tp, quant=None, missing=()):
    params = inference_params(TINY, tp, rank, quant)
    desc = {
        n: base64.b64encode(encode_param_descriptor(b"R%d" % (rep * tp + rank), 64 * i)).decode()
        for i, n in enumerate(params)
    }
    return dict(
        gpu=rep * tp + rank,
        replica=rep,
        rank=rank,
        tp=tp,
        replicas=2,
        ep=False,
        params={n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in params.items() if n not in missing},
        desc={n: d for n, d in desc.items() if n not in missing},
    )


def _train(world=2):
    from wxfer.models import train_model

    m = train_model(TINY)
    return [_meta(n, tuple(p.shape), [tuple(range(world))]) for n, p in m.named_parameters()], m


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_controller_plan_and_rank_programs(quant):
    metas, model = _train()
    train, problems = program.merge_train_metadata([metas, metas])
    assert not problems
    workers = [_worker_meta(rep, r, 2, quant) for rep in range(2) for r in range(2)]
    plan = program.build_controller_plan(train, workers, preset_for(TINY))
    assert plan.quant == quant and plan.replicas == 2 and plan.tp == 2
    plan = program.plan_from_bytes(program.plan_to_bytes(plan))  # what every rank receives
    senders = program.receivers_of(plan)
    assert sorted(senders) == [0, 1, 2, 3] and all(s for s in senders.values())
    params = dict(model.named_parameters())
    total = 0
    for rank in (0, 1):
        prog = program.RankProgram.from_plan(plan, rank, params)
        total += prog.bytes_per_step
        for ops in prog.groups:
            for op in ops:
                for desc, off, src, n in op.dests:
                    assert desc[:1] == b"R" and off >= 0 and 0 <= src and src + n <= op.nbytes
                buf = prepare.prepare(op, torch.device("cpu"))
                assert (buf is None) == (not op.sends)
                if buf is not None:
                    assert buf.numel() == op.nbytes
    assert total == int(plan.nbytes.sum())


def test_a_worker_lacking_a_parameter_is_named():
    metas, _ = _train()
    train, _ = program.merge_train_metadata([metas, metas])
    workers = [_worker_meta(0, r, 2, missing=("model.norm.weight",) if r else ()) for r in range(2)]
    for w in workers:
        w["replicas"] = 1
    with pytest.raises(ValueError, match="model.norm.weight: expected on replica 0 rank 1"):
        program.build_controller_plan(train, workers, preset_for(TINY))


def test_get_preset_forms():
    assert program.get_preset("qwen3-8b").name == "qwen3-8b"
    assert program.get_preset(dict(TINY)).arch == "qwen3"
    p = preset_for(TINY)
    assert program.get_preset(p) is p
    with pytest.raises(TypeError):
        program.get_preset(3)
    assert decode_param_descriptor(encode_param_descriptor(b"x", 5)) == (b"x", 5)
    assert issubclass(SetupError, RuntimeError)


def test_every_rank_checks_the_plan_it_loads_from_the_store():
    """A plan that decodes but leaves a destination byte unwritten (or a blob that does not
    decode) is refused by plan_from_bytes, which every trainer rank runs on the store's plan
    (ranks other than 0 had loaded it unchecked)."""
    import numpy as np

    metas, _ = _train()
    train, _ = program.merge_train_metadata([metas, metas])
    workers = [_worker_meta(rep, r, 2) for rep in range(2) for r in range(2)]
    plan = program.build_controller_plan(train, workers, preset_for(TINY))
    keep = np.arange(plan.n_transfers) != 5  # drop one transfer: its bytes are never written
    lost = plan.names[plan.dst[5]]
    for k in ("sender", "task", "shard", "replica", "infer_rank", "dst", "dst_offset", "nbytes", "src_offset"):
        setattr(plan, k, getattr(plan, k)[keep])
    data = program.plan_to_bytes(plan)
    with pytest.raises(SetupError, match=f"(?s)the plan from rank 0 fails its check.*{lost}.*never written"):
        program.plan_from_bytes(data, "the plan from rank 0")
    with pytest.raises(SetupError, match="the plan from rank 0 cannot be read: invalid plan bytes"):
        program.plan_from_bytes(data[:-3], "the plan from rank 0")
