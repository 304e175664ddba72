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
from wxfer.mapping.rules import Piece
from helpers import random_fulls, shard as _shard  # tests/helpers.py
from wxfer.zerocopy import merged_rows


def _fulls():
    return random_fulls(7, odd=(5, 3))


def test_pack_into_matches_the_reference_packing():
    fulls = _fulls()
    shards = [
        _shard("raw", "bfloat16", Piece("a", 0, 300, 0, 260)),  # float32 -> bf16 cast
        _shard("fp8", "float8_e4m3fn", Piece("b", 0, 200, 0, 130)),  # odd size: unaligned after
        _shard("raw", "bfloat16", Piece("b", 10, 20, 3, 250), Piece("odd", 1, 4, 0, 3)),
        _shard("scale", "float32", Piece("b", 0, 200, 0, 130)),  # same piece: quantized once
        _shard("raw", "bfloat16", Piece("n", 5, 200)),  # 1-D
        _shard("fp8", "float8_e4m3fn", Piece("a", 100, 300, 7, 260)),
        _shard("raw", "float32", Piece("b", 0, 3, 0, 260)),  # bf16 -> float32
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
    assert prepare._whole(op, {"w": full}, set()) is None  # the parameter itself: copied
    cast = _shard("raw", "float32", Piece("w", 0, 8, 0, 8))
    op2 = program.TaskOp(0, "t", [("w", None)], [cast], [(b"", 0, 0, cast.nbytes)], cast.nbytes)
    assert prepare._whole(op2, {"w": full}, {"w"}) is None


def test_zero_copy_task_reads_the_parameter_itself():
    """One source held whole, raw whole-row pieces in its own dtype, in any packed order:
    the write reads the parameter's memory, each destination's source offset moved to its
    piece's bytes there; anything else (a cast, a column slice) is packed."""
    w = torch.nn.Parameter(torch.randn(8, 6).to(torch.bfloat16))
    top = _shard("raw", "bfloat16", Piece("w", 0, 4, 0, 6))
    bot = _shard("raw", "bfloat16", Piece("w", 4, 8, 0, 6))
    n = top.nbytes
    # packed order: bottom half first; the second destination reads a part of the top half
    op = program.TaskOp(0, "t", [("w", w)], [bot, top], [(b"a", 0, 0, n), (b"b", 0, n + 12, n - 12)], 2 * n)
    prep = prepare.task_prep(op, torch.device("cpu"))
    assert prep.direct == "w" and prep.zero_copy and prep.held == 0
    with torch.no_grad():
        buf = prepare.run(prep, op, torch.device("cpu"))
    assert buf.data_ptr() == w.data_ptr()
    ref = pack_task([bot, top], {"w": w.detach()})
    for (_, _, s0, ln), (_, _, s1, _) in zip(op.dests, prep.dests):
        assert torch.equal(buf[s1 : s1 + ln], ref[s0 : s0 + ln])
    assert [d[2] for d in prep.dests] == [n, 12]
    cast = _shard("raw", "float32", Piece("w", 0, 8, 0, 6))
    op2 = program.TaskOp(0, "t", [("w", w)], [cast], [(b"", 0, 0, cast.nbytes)], cast.nbytes)
    cols = _shard("raw", "bfloat16", Piece("w", 0, 8, 0, 3))
    op3 = program.TaskOp(0, "t", [("w", w)], [cols], [(b"", 0, 0, cols.nbytes)], cols.nbytes)
    for o in (op2, op3):
        p = prepare.task_prep(o, torch.device("cpu"))
        assert p.direct is None and p.held == o.nbytes
        with torch.no_grad():
            assert torch.equal(prepare.run(p, o, torch.device("cpu")), pack_task(o.shards, {"w": w.detach()}))


def test_host_times_from_a_trace():
    from wxfer.runtime.trace import host_times, to_chrome

    recs = [
        dict(
            id=i,
            tag=i,
            bytes=10,
            held=10,
            ndests=1,
            nwrites=1,
            status=0,
            t_submit=1000 + 100 * i + 40,
            t_admit=1000 + 100 * i,
            t_ready=1000 + 100 * i + 50,
            t_post_first=1000 + 100 * i + 60,
            t_post_last=1000 + 100 * i + 60,
            t_done=1000 + 100 * i + 90,
        )
        for i in range(4)
    ]
    recs.append(dict(recs[0], tag=99, t_admit=5000, t_submit=4990))  # not reserved: no host time
    h = host_times(recs, {0: 2, 1: 2, 2: 4, 3: 2}, skip_tags={99})
    assert h["tasks"] == 4 and h["params"] == 10 and h["host_s"] == pytest.approx(160e-9)
    assert h["per_task_us"] == pytest.approx(0.04) and h["per_param_us"] == pytest.approx(0.016)
    ev = [e for e in to_chrome(recs)["traceEvents"] if e["ph"] == "X"]
    assert sum(e["cat"] == "prepare" for e in ev) == 4


def _gather_main(rank, world, port, q):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard as DShard, distribute_tensor

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        out = []
        mesh = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("rep", "shard"))
        for rows in (8, 7, 5, 1, 3):  # even, uneven, a rank holding nothing
            full = torch.randn(rows, 6).to(torch.bfloat16)
            for m, pl in ((mesh, [DShard(0)]), (mesh2, [Replicate(), DShard(0)])):
                d = distribute_tensor(full, m, pl)
                assert prepare._gather_spec(d) is not None
                fast = prepare.full_tensor(d, d._local_tensor)
                out.append(torch.equal(fast, d.full_tensor()) and torch.equal(fast, full))
        v = distribute_tensor(torch.randn(9), mesh, [DShard(0)])
        out.append(torch.equal(prepare.full_tensor(v, v._local_tensor), v.full_tensor()))
        c = distribute_tensor(torch.randn(4, 6), mesh, [DShard(1)])  # not rows: generic path
        out.append(
            prepare._gather_spec(c) is None and torch.equal(prepare.full_tensor(c, c._local_tensor), c.full_tensor())
        )
        # a coarse task: one all-gather for all row-sharded sources of a dtype (uneven rows, 1-D,
        # a rank holding nothing), DTensor for the rest; the packed bytes are the reference's
        fulls = {
            "w1": torch.randn(8, 6).to(torch.bfloat16),
            "w2": torch.randn(7, 130).to(torch.bfloat16),
            "n": torch.randn(5).to(torch.bfloat16),
            "one": torch.randn(1, 6).to(torch.bfloat16),
            "f": torch.randn(4, 6),
            "cols": torch.randn(4, 6).to(torch.bfloat16),
        }
        srcs = [(k, distribute_tensor(v, mesh, [DShard(1) if k == "cols" else DShard(0)])) for k, v in fulls.items()]
        shards = [
            _shard("raw", "bfloat16", Piece("w1", 0, 8, 0, 6), Piece("one", 0, 1, 0, 6)),
            _shard("fp8", "float8_e4m3fn", Piece("w2", 1, 7, 0, 130)),
            _shard("scale", "float32", Piece("w2", 1, 7, 0, 130)),
            _shard("raw", "bfloat16", Piece("n", 1, 5)),
            _shard("raw", "float32", Piece("f", 0, 4, 2, 6)),
            _shard("raw", "bfloat16", Piece("cols", 0, 4, 1, 5)),
        ]
        nb = sum(x.nbytes for x in shards)
        op = program.TaskOp(0, "coarse", srcs, shards, [(b"", 0, 0, nb)], nb)
        prep = prepare.task_prep(op, torch.device("cpu"))
        out.append(
            len(prep.gathers) == 2
            and sorted(len(g.items) for g in prep.gathers) == [1, 4]
            and [n for n, _ in prep.generic] == ["cols"]
            and prep.direct is None
        )
        for _ in range(2):  # the same TaskPrep every step
            with torch.no_grad():
                got = prepare.run(prep, op, torch.device("cpu"))
            out.append(torch.equal(got, pack_task(shards, fulls)))
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


def test_consecutive_raw_pieces_of_one_source_are_copied_as_one():
    """A raw shard whose pieces are consecutive row ranges of one source (transformers 5's
    fused experts: expert e's gate and up rows follow expert e-1's) is packed with one copy,
    byte for byte the reference's; pieces that are not contiguous stay apart."""
    import torch
    from wxfer.mapping import Piece, Shard, pack_shard
    from wxfer.runtime import prepare

    E, inter, hidden = 4, 3, 5
    gu = torch.randn(E, 2 * inter, hidden).to(torch.bfloat16)
    other = torch.randn(7, hidden).to(torch.bfloat16)
    pieces = []
    for e in range(E):
        pieces += [
            Piece("gu", e * 2 * inter, e * 2 * inter + inter, 0, hidden),
            Piece("gu", e * 2 * inter + inter, (e + 1) * 2 * inter, 0, hidden),
        ]
    pieces += [
        Piece("o", 0, 2, 0, hidden),
        Piece("o", 4, 7, 0, hidden),
        Piece("o", 2, 4, 0, hidden),
        Piece("o", 0, 3, 1, 4),
        Piece("o", 3, 5, 1, 4),
    ]
    nbytes = sum(p.rows * p.cols for p in pieces) * 2
    sh = Shard(dst="w", rank=0, offset=0, nbytes=nbytes, kind="raw", dtype="bfloat16", pieces=tuple(pieces))
    merged = merged_rows(sh.pieces)
    assert merged[0] == Piece("gu", 0, E * 2 * inter, 0, hidden)  # 8 pieces -> 1
    assert len(merged) == 1 + 3 + 1  # o[0:2], o[4:7], o[2:4] stay apart; the two column slices merge
    fulls = {"gu": gu, "o": other}
    out = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    assert prepare.pack_shard_into(sh, fulls, out, 0) == nbytes
    assert torch.equal(out, pack_shard(sh, fulls))


def test_offloaded_fused_experts_take_one_h2d_copy_per_source():
    """Stage 1 of a task whose sources are offloaded (host tensors, as FSDP2's CPUOffloadPolicy
    keeps them): one host-to-device copy per source, not one per expert or piece, even for
    transformers 5's fused 3-D experts whose w13 shard is 2 x E pieces; the packed bytes are the
    reference's.  The compute device here is "meta" (a second device on a CPU machine): the
    copies are counted at the dispatcher."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from wxfer.mapping import Layout, expand
    from wxfer.models import TINY_MOE, preset_for

    preset = preset_for(TINY_MOE)
    hp = preset.hf_params(TINY_MOE, fused_experts=True)
    ex = expand(preset.rules, {n: s for n, (s, _, _) in hp.items()}, Layout(1, False, None), TINY_MOE)
    comps = [c for c in ex.components if c.shards and c.sources[0].startswith("model.layers.0.")]
    shards = [sh for c in comps for sh in c.shards if sh.rank == 0]
    names = list(dict.fromkeys(s for c in comps for s in c.sources))  # one layer: the plan's coarse task
    assert any(len(sh.pieces) >= 2 * TINY_MOE["num_experts"] for sh in shards)  # fused experts: many pieces
    g = torch.Generator().manual_seed(3)
    params = {n: torch.randn(hp[n][0], generator=g).to(torch.bfloat16) for n in names}
    total = sum(sh.nbytes for sh in shards)
    op = program.TaskOp(0, "layer0", [(n, params[n]) for n in names], shards, [(b"", 0, 0, total)], total)

    class Copies(TorchDispatchMode):
        n = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device != dst.device:
                Copies.n += 1
                Copies.nbytes += src.numel() * src.element_size()
            return out

    meta = torch.device("meta")
    with torch.no_grad():
        prep = prepare.task_prep(op, meta)
        assert not prep.zero_copy and len(prep.whole) == len(names)
        with Copies():
            buf = prepare.run(prep, op, meta)
    assert buf.device == meta and buf.numel() == total
    assert Copies.n == len(names), (Copies.n, len(names))
    assert Copies.nbytes == sum(t.numel() * t.element_size() for t in params.values())
    with torch.no_grad():
        got = prepare.run(prepare.task_prep(op, torch.device("cpu")), op, torch.device("cpu"))
    assert torch.equal(got, pack_task(shards, params))
