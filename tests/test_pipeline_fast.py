"""The trainer's fast per-task paths give the mapping's reference bytes exactly: packing
straight into one buffer (prepare.pack_into: casts, FP8 quantized once for fp8 + scale,
unaligned pieces, 1-D pieces) and the direct all-gather of row-sharded DTensors
(prepare.full_tensor), uneven shards included, against DTensor.full_tensor()."""
import os
import socket

import pytest
import torch

from wxfer.runtime import program
from wxfer.runtime import prepare
from wxfer.mapping.reference import pack_task
from wxfer.mapping.rules import Piece, Shard


def _fulls():
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(300, 260, generator=g, dtype=torch.float32),
            "b": torch.randn(300, 260, generator=g).to(torch.bfloat16),
            "n": torch.randn(257, generator=g).to(torch.bfloat16),
            "odd": torch.randn(5, 3, generator=g).to(torch.bfloat16)}


def _nb(kind, dtype, pcs):
    n = 0
    for p in pcs:
        if kind == "scale":
            n += -(-p.rows // 128) * -(-p.cols // 128) * 4
        else:
            n += p.numel() * (1 if kind == "fp8" else getattr(torch, dtype).itemsize)
    return n


def _shard(kind, dtype, *pcs):
    return Shard(0, "d", 0, _nb(kind, dtype, pcs), kind, dtype, tuple(pcs))


def test_pack_into_matches_the_reference_packing():
    fulls = _fulls()
    shards = [
        _shard("raw", "bfloat16", Piece("a", 0, 300, 0, 260)),             # float32 -> bf16 cast
        _shard("fp8", "float8_e4m3fn", Piece("b", 0, 200, 0, 130)),       # odd size: unaligned after
        _shard("raw", "bfloat16", Piece("b", 10, 20, 3, 250), Piece("odd", 1, 4, 0, 3)),
        _shard("scale", "float32", Piece("b", 0, 200, 0, 130)),           # same piece: quantized once
        _shard("raw", "bfloat16", Piece("n", 5, 200)),                      # 1-D
        _shard("fp8", "float8_e4m3fn", Piece("a", 100, 300, 7, 260)),
        _shard("raw", "float32", Piece("b", 0, 3, 0, 260)),                 # bf16 -> float32
    ]
    total = sum(s.nbytes for s in shards)
    ref = pack_task(shards, fulls)
    got = prepare.pack_into(shards, fulls, total, torch.device("cpu"))
    assert got.dtype == torch.uint8 and got.numel() == total == ref.numel()
    assert torch.equal(got, ref)
    with pytest.raises(AssertionError, match="expected"):
        prepare.pack_into(shards, fulls, total + 1, torch.device("cpu"))


def test_whole_task_is_sent_without_a_copy_only_from_fresh_memory():
    full = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    sh = _shard("raw", "bfloat16", Piece("w", 0, 8, 0, 8))
    op = program.TaskOp(0, "t", [("w", None)], [sh], [(b"", 0, 0, sh.nbytes)], sh.nbytes)
    buf = prepare._whole(op, {"w": full}, {"w"})
    assert buf is not None and buf.data_ptr() == full.data_ptr() and torch.equal(buf, pack_task([sh], {"w": full}))
    assert prepare._whole(op, {"w": full}, set()) is None             # the parameter itself: copied
    cast = _shard("raw", "float32", Piece("w", 0, 8, 0, 8))
    op2 = program.TaskOp(0, "t", [("w", None)], [cast], [(b"", 0, 0, cast.nbytes)], cast.nbytes)
    assert prepare._whole(op2, {"w": full}, {"w"}) is None


def _gather_main(rank, world, port, q):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard as DShard, distribute_tensor
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        out = []
        mesh = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("rep", "shard"))
        for rows in (8, 7, 5, 1, 3):          # even, uneven, a rank holding nothing
            full = torch.randn(rows, 6).to(torch.bfloat16)
            for m, pl in ((mesh, [DShard(0)]), (mesh2, [Replicate(), DShard(0)])):
                d = distribute_tensor(full, m, pl)
                assert prepare._gather_spec(d) is not None
                fast = prepare.full_tensor(d, d._local_tensor)
                out.append(torch.equal(fast, d.full_tensor()) and torch.equal(fast, full))
        v = distribute_tensor(torch.randn(9), mesh, [DShard(0)])
        out.append(torch.equal(prepare.full_tensor(v, v._local_tensor), v.full_tensor()))
        c = distribute_tensor(torch.randn(4, 6), mesh, [DShard(1)])          # not rows: generic path
        out.append(prepare._gather_spec(c) is None and torch.equal(prepare.full_tensor(c, c._local_tensor),
                                                                      c.full_tensor()))
        q.put((rank, out))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put((rank, repr(e)))


@pytest.mark.timeout(120)
def test_direct_all_gather_matches_dtensor_full_tensor():
    import multiprocessing as mp
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gather_main, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=100) for _ in procs)
    for p in procs:
        p.join(30)
    for r in range(3):
        assert isinstance(res[r], list), res[r]
        assert res[r] and all(res[r]), (r, res[r])
