"""Metadata: live FSDP2 model (2 gloo processes on CPU), live inference worker, synthesized."""

import math
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from wxfer.mapping import get_preset
from wxfer.meta import Cluster, TrainParam, from_fsdp_model, from_inference_worker, synthesize, train_meshes
from wxfer.plan import build_plan


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_module(params):
    """An nn.Module tree whose named_parameters() are exactly `params` (HF names)."""
    root = torch.nn.Module()
    for name, (shape, dtype, _) in params.items():
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(*shape).to(getattr(torch, dtype))))
    return root


def _fsdp_worker(rank, world, port, outdir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=True), torch.nn.Linear(32, 8, bias=False))
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        meta = from_fsdp_model(model)
        # the metadata's claim: every rank of the mesh produces the full tensor with full_tensor()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        # a tiny Qwen3 with Hugging Face names, sharded per layer like a real job
        qwen = _hf_module(get_preset("qwen3-tiny").hf_params())
        for layer in qwen.model.layers.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(qwen, mesh=mesh)
        torch.save(
            {
                "meta": meta,
                "shapes": {n: tuple(t.shape) for n, t in full.items()},
                "local": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
                "qwen": from_fsdp_model(qwen),
            },
            os.path.join(outdir, f"{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_from_fsdp2_model_two_gloo_processes():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_fsdp_worker, args=(2, _free_port(), d), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]
    m0, m1 = res[0]["meta"], res[1]["meta"]
    assert m0 == m1  # every rank describes the same thing
    by = {p.name: p for p in m0}
    assert set(by) == {"0.weight", "0.bias", "1.weight"}
    assert by["0.weight"].shape == (32, 16) and by["0.weight"].dtype == "float32"
    assert by["0.weight"].meshes == ((0, 1),)
    assert by["0.weight"].placements == ("Shard(dim=0)",)
    assert by["1.weight"].shape == (8, 32)
    for n, p in by.items():
        assert res[0]["shapes"][n] == p.shape  # full_tensor() gives the global shape
        assert res[0]["local"][n][0] < p.shape[0]  # while each rank holds a shard
    # a plan straight from live FSDP2 metadata: both ranks of the mesh send
    qwen = res[1]["qwen"]
    assert qwen == res[0]["qwen"] and all(p.meshes == ((0, 1),) for p in qwen)
    s = synthesize("qwen3-tiny", Cluster(train_gpus=2, infer_gpus=4, infer_tp=2))
    plan = build_plan(qwen, s.workers, s.preset)
    assert plan.check() == [] and set(plan.sender.tolist()) == {0, 1}
    # one task per FSDP2 unit (the root, each decoder layer); one per component when asked
    layers = s.preset.config["num_hidden_layers"]
    assert len(plan.tasks) == 1 + layers and {t.name for t in plan.tasks} == {"root"} | {
        f"model.layers.{i}" for i in range(layers)
    }
    fine = build_plan(qwen, s.workers, s.preset, coarse=False)
    assert len(fine.tasks) == len(s.expanded.components)


def test_mesh_groups_for_hsdp_placements():
    from torch.distributed.tensor import Replicate, Shard
    from wxfer.meta import _mesh_groups

    # 2 replicas x 4 shards: each replica row can produce the tensor alone
    assert _mesh_groups([[0, 1, 2, 3], [4, 5, 6, 7]], (Replicate(), Shard(0))) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert _mesh_groups([[0, 1], [2, 3]], (Shard(0), Shard(1))) == ((0, 1, 2, 3),)
    assert _mesh_groups([[0, 1], [2, 3]], (Shard(0), Replicate())) == ((0, 2), (1, 3))


def test_from_inference_worker_with_descriptors():
    tensors = [
        ("a.weight", torch.empty(4, 8, dtype=torch.float8_e4m3fn)),
        ("a.weight_scale_inv", torch.empty(1, 1)),
        ("n.weight", torch.empty(8, dtype=torch.bfloat16)),
    ]
    w = from_inference_worker(tensors, replica=2, rank=1, tp=4, descriptors={"a.weight": b"\x01\x02"})
    assert w.gpu == 9 and w.params["a.weight"].dtype == "float8_e4m3fn" and w.params["a.weight"].nbytes == 32
    assert w.params["n.weight"].shape == (8,) and w.descriptors == {"a.weight": b"\x01\x02"}
    with pytest.raises(ValueError, match="unknown"):
        from_inference_worker(tensors, 0, 0, 1, descriptors={"zzz": b""})
    with pytest.raises(TypeError):
        from_inference_worker(tensors, 0, 0, 1, descriptors={"a.weight": "not bytes"})


def test_synthesize_kimi_k2_without_gpu():
    c = Cluster(train_gpus=256, infer_gpus=128, infer_tp=16, infer_ep=True, quant="fp8")
    s = synthesize("kimi-k2", c)
    n = sum(math.prod(p.shape) for p in s.train)
    assert 1.02e12 < n < 1.035e12
    by = {p.name: p for p in s.train}
    emb = by["model.embed_tokens.weight"]
    assert emb.shape == (163840, 7168) and len(emb.meshes) == 32 and emb.meshes[3] == tuple(range(24, 32))
    ex = by["model.layers.5.mlp.experts.7.down_proj.weight"]
    assert ex.shape == (7168, 2048) and ex.meshes == ((2, 130),)  # experts 6..8 on mesh 2
    assert {r // 8 for r in ex.meshes[0]} == {0, 16}  # across nodes
    assert len(s.workers) == 128 and s.workers[17].replica == 1 and s.workers[17].rank == 1
    w13 = s.workers[0].params["model.layers.1.mlp.experts.w13_weight"]
    assert w13.shape == (24, 4096, 7168) and w13.dtype == "float8_e4m3fn"


def test_train_meshes_and_cluster_validation():
    dense, experts = train_meshes(Cluster(train_gpus=16, dense_shard=8, expert_shard=4))
    assert dense == (tuple(range(8)), tuple(range(8, 16)))
    assert experts == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    with pytest.raises(ValueError, match="multiple of infer_tp"):
        Cluster(infer_gpus=6, infer_tp=4).replicas
    assert TrainParam("x", (2, 3), "bfloat16", ((0, 1), (2, 3))).ranks == (0, 1, 2, 3)


def test_wrapper_prefixes_are_dropped():
    from wxfer.meta import clean_name

    assert (
        clean_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert clean_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
