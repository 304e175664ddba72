"""Zero copy for transformers 5's fused MoE experts (issue 13.3): a layer's
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] already hold
the bytes of vLLM's w13 / w2 when one rank holds them whole and the inference side takes
whole experts (TP 1, or EP); the plan then cuts the layer's experts component at its
sources, and each is written from the parameter's own memory (the mapping's per-expert row
pieces merged into one range).  Column-sliced (TP without EP), transposed and FP8 layouts
stay packed.  Every case lands the mapping's reference bytes, over fabric tcp, from plain
tensors and from FSDP2 on a 1-rank mesh (a trainer process)."""

import multiprocessing as mp
import os

import pytest
import torch

from wxfer import _wxfer
from wxfer.mapping import Layout, Piece, Shard, expand, pack_shard, pack_task
from wxfer.models import TINY_MOE, preset_for, train_model
from wxfer.runtime import prepare, program
from helpers import gpu_receiver, joined, receivers_in_threads, reporting  # tests/helpers.py
from wxfer.zerocopy import merged_rows

FABRIC = _wxfer.backends()["fabric"][0]
T = 30.0
CPU = torch.device("cpu")
GU, DN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def _model():
    m = train_model(TINY_MOE, seed=1, dtype=torch.bfloat16)  # the inference dtype
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _plan(tp=1, quant=None, ep=False, mesh=(0,)):
    from wxfer.meta import InferParam, InferWorker, TrainParam
    from wxfer.models.infer import inference_layout
    from wxfer.plan import build_plan

    with torch.device("meta"):
        m = train_model(TINY_MOE)
    train = [TrainParam(n, tuple(p.shape), "bfloat16", (mesh,)) for n, p in m.named_parameters()]
    lay = inference_layout(TINY_MOE, tp, quant, ep)
    workers = [
        InferWorker(
            0, r, tp, ep, {n: InferParam(n, d.shape, d.dtype) for n, d in lay[r].items()}, {n: b"d" for n in lay[r]}
        )
        for r in range(tp)
    ]
    return [build_plan(train, workers, preset_for(TINY_MOE), quant=quant, coarse=c) for c in (True, False)]


def _expert_tasks(plan):
    return [t for t in plan.tasks if any(s.endswith((GU, DN)) for s in t.sources)]


@pytest.mark.parametrize(
    "tp,ep,quant,split",
    [(1, False, None, True), (2, True, None, True), (2, False, None, False), (1, False, "fp8", False)],
)
def test_plan_cuts_a_layers_experts_at_their_sources_when_each_is_one_range(tp, ep, quant, split):
    from wxfer.plan import expected_destination

    plan, fine = _plan(tp, quant, ep)
    ex = _expert_tasks(plan)
    L, E = TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts"]
    if split:  # one task per fused parameter, each destination one shard of 2E (or E) row pieces
        assert len(ex) == 2 * L and all(len(t.sources) == 1 for t in ex)
        for t in ex:
            assert len(t.shards) == tp
            per = (2 if t.sources[0].endswith(GU) else 1) * E // (tp if ep else 1)
            assert all(sh.kind == "raw" and len(sh.pieces) == per for sh in t.shards)
            assert all(len(merged_rows(sh.pieces)) == 1 for sh in t.shards)
    else:  # TP without EP (w2 sliced by columns), FP8: the layer's experts are packed with the layer
        assert len(ex) == L and all({GU, DN} <= {s.split(".", 3)[-1] for s in t.sources} for t in ex)
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(*sh, generator=g).to(torch.bfloat16) for n, (sh, _) in plan.train_params.items()}
    for gpu in range(tp):  # the same bytes as one task per mapping component
        a, b = expected_destination(plan, gpu, full), expected_destination(fine, gpu, full)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plan.check()
    # sharded over two trainers: gathered, packed with the layer, as before
    two, _ = _plan(tp, quant, ep, mesh=(0, 1))
    assert all(len(t.sources) > 1 for t in _expert_tasks(two))


def _op(w, shards, dests):
    nb = sum(s.nbytes for s in shards)
    return program.TaskOp(0, "experts", [("w", w)], list(shards), dests, nb)


def test_a_3d_source_in_row_pieces_is_written_from_its_own_memory():
    """The pieces of a fused [E, 2I, H] gate_up_proj, per expert and half, merge into one range
    of the parameter: the write reads it in place; a gap, a reordering, a column slice, a
    cast or a transposed (non-contiguous) parameter is packed, with the reference's bytes."""
    E, R, H = 3, 4, 5  # R = 2I rows per expert
    w = torch.nn.Parameter(torch.randn(E, R, H).to(torch.bfloat16), requires_grad=False)

    def shard(*pcs, kind="raw", dtype="bfloat16"):
        n = sum(p.numel() for p in pcs) * (2 if dtype == "bfloat16" else 4)
        return Shard(0, "w13", 0, n, kind, dtype, tuple(pcs))

    halves = [Piece("w", e * R + h * R // 2, e * R + (h + 1) * R // 2, 0, H) for e in range(E) for h in (0, 1)]
    tail = shard(*halves[2:])  # experts 1, 2 (an EP rank's share), packed first
    head = shard(*halves[:2])
    nt = tail.nbytes
    op = _op(w, [tail, head], [(b"a", 0, 0, nt), (b"b", 0, nt + 6, head.nbytes - 6)])
    prep = prepare.task_prep(op, CPU)
    assert prep.direct == "w" and prep.zero_copy and prep.held == 0
    assert [d[2] for d in prep.dests] == [R * H * 2, 6]  # offsets in the parameter's bytes
    with torch.no_grad():
        buf = prepare.run(prep, op, CPU)
    assert buf.data_ptr() == w.data_ptr()
    ref = pack_task(op.shards, {"w": w.detach()})
    for (_, _, s0, n), (_, _, s1, _) in zip(op.dests, prep.dests):
        assert torch.equal(buf[s1 : s1 + n], ref[s0 : s0 + n])
    t = torch.nn.Parameter(torch.randn(E, H, R).to(torch.bfloat16).transpose(1, 2), requires_grad=False)
    cases = [
        (w, shard(halves[0], halves[2])),  # a gap (the up half of expert 0 left out)
        (w, shard(halves[1], halves[0])),  # not in row order
        (w, shard(Piece("w", 0, R, 0, H - 1))),  # a column slice
        (w, shard(*halves, dtype="float32")),  # a cast
        (t, shard(*halves)),  # the same rows of a transposed parameter
    ]
    for src, sh in cases:
        o = _op(src, [sh], [(b"a", 0, 0, sh.nbytes)])
        p = prepare.task_prep(o, CPU)
        assert p.direct is None and not p.zero_copy and p.held == o.nbytes, sh
        with torch.no_grad():
            assert torch.equal(prepare.run(p, o, CPU), pack_task([sh], {"w": src.detach()}))


def _expected(weights: dict, tp: int, quant, ep: bool) -> list:
    """[(rank, destination, offset, bytes)]: the mapping's reference bytes of `weights`."""
    full = {n: t.detach() for n, t in weights.items()}
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    ex = expand(preset_for(TINY_MOE).rules, shapes, Layout(tp, ep, quant), TINY_MOE)
    return [(sh.rank, sh.dst, sh.offset, pack_shard(sh, full)) for c in ex.components for sh in c.shards]


def _landed(weights, params, tp, quant=None, ep=False):
    bad = [
        (r, dst)
        for r, dst, off, b in _expected(weights, tp, quant, ep)
        if not torch.equal(params[r][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b)
    ]
    return not bad


def _receivers(addr, name, tp, quant, ep):
    return receivers_in_threads(TINY_MOE, addr, name, tp, quant, ep, timeout=T, verify=True)


def _joined(ths):
    return joined(ths, T)


def _expert_ops(sender):
    return [
        op for g in sender.program.groups for op in g if op.sends and any(s.endswith((GU, DN)) for s, _ in op.sources)
    ]


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
@pytest.mark.parametrize("tp,ep,quant", [(1, False, None), (2, True, None), (2, False, None), (1, False, "fp8")])
def test_plain_tensor_push_of_fused_experts(store, tp, ep, quant):
    """Plain tensors: with whole experts per inference rank the fused expert tasks are zero
    copy (prepared engine tasks over the parameters' memory, nothing held), follow a
    parameter given new memory, and verify; column-sliced and FP8 experts are packed. The
    receivers hold the mapping's reference bytes after every push."""
    from wxfer.runtime.sender import Sender

    _, addr = store
    name = f"moe{tp}{int(ep)}{quant}"
    params, ths = _receivers(addr, name, tp, quant, ep)
    model = _model()
    sender = Sender(
        model, mapping=preset_for(TINY_MOE), store=addr, name=name, timeout=T, write_timeout=5, watermark="1MiB"
    )
    recvs = _joined(ths)
    zc = quant is None and (tp == 1 or ep)
    if zc and tp == 1:  # and so is every other task of this model (at TP 2 o_proj is column-sliced)
        assert all(op.prep.zero_copy for g in sender.program.groups for op in g if op.sends)
    ops = _expert_ops(sender)
    assert len(ops) == TINY_MOE["num_hidden_layers"] * (2 if zc else 1)
    assert all(op.prep.zero_copy == zc and (op.prep.held == 0) == zc for op in ops)
    weights = dict(model.named_parameters())
    sender.push(verify=True)
    assert all(r.version() == 1 for r in recvs) and sender.last_verify is not None
    assert _landed(weights, params, tp, quant, ep)
    if not zc:
        assert all(op.prep.fast is None for op in ops)
    else:
        first = {op.task: op.prep.fast.task for op in ops}
        assert all(op.prep.fast.task.nbytes == op.sources[0][1].numel() * 2 for op in ops)
        with torch.no_grad():  # in place: the same prepared tasks, the new bytes
            for p in model.parameters():
                p.mul_(-2.0)
        sender.push()
        assert _landed(weights, params, tp, quant, ep)
        assert all(op.prep.fast.task is first[op.task] for op in ops)
        gu = model.model.layers[1].mlp.experts.gate_up_proj
        gu.data = gu.data.clone() + 1  # new memory: its task registers it again
        sender.push(verify=True)
        assert _landed(weights, params, tp, quant, ep) and sender.last_verify is not None
        moved = [op for op in ops if op.prep.fast.task is not first[op.task]]
        assert [op.sources[0][1] for op in moved] == [gu] and moved[0].prep.zero_copy
        # new memory that is not one range (the same values, stored transposed): packed now
        gu.data = (gu.data * 0.5).transpose(1, 2).contiguous().transpose(1, 2)
        sender.push(verify=True)
        assert _landed(weights, params, tp, quant, ep) and sender.last_verify is not None
        assert not moved[0].prep.zero_copy and moved[0].prep.held == moved[0].nbytes
    sender.close()
    for r in recvs:
        r.close()


def _fsdp_trainer(addr, port, name, q_in, q_out):
    """A 1-rank FSDP2 trainer: pushes, reports its expert tasks and weights, moves one fused
    parameter's memory (torch.utils.swap_tensors: FSDP2's DTensor keeps its local tensor on
    ``p.data = ...``), pushes again with verify."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from wxfer.models import shard_fsdp2
    from wxfer.runtime.sender import Sender

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = shard_fsdp2(_model(), init_device_mesh("cpu", (1,)))
        sender = Sender(model, mapping=preset_for(TINY_MOE), store=addr, name=name, timeout=T, watermark="1MiB")

        def state():
            ops = _expert_ops(sender)
            whole = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
            fast = [op.prep.fast.task if op.prep.fast else None for op in ops]
            return whole, [(op.sources[0][0], op.prep.zero_copy, op.prep.held) for op in ops], fast

        sender.push(version=1, verify=True)
        whole, info, fast1 = state()
        q_out.put((whole, info, sender.last_verify is not None, [f is not None for f in fast1]))
        q_in.get(timeout=T)
        p = model.model.layers[0].mlp.experts.down_proj
        new = DTensor.from_local(p.to_local().detach() * 3, p.device_mesh, p.placements, run_check=False)
        torch.utils.swap_tensors(p, torch.nn.Parameter(new, requires_grad=p.requires_grad))
        sender.push(version=2, verify=True)
        whole, info, fast2 = state()
        moved = [i for i, (a, b) in enumerate(zip(fast1, fast2)) if a is not b]
        q_out.put((whole, info, sender.last_verify is not None, [info[i][0] for i in moved]))
        q_in.get(timeout=T)
        sender.close()
    except BaseException as e:  # noqa: BLE001
        q_out.put(repr(e))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
@pytest.mark.timeout(180)
def test_fsdp2_one_rank_mesh_fused_experts_are_zero_copy(store):
    from wxfer.runtime import control

    _, addr = store
    params, ths = _receivers(addr, "fsdp-moe", 1, None, False)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_fsdp_trainer, args=(addr, control.free_port(), "fsdp-moe", q_in, q_out))
    proc.start()
    try:
        (recv,) = _joined(ths)
        for v in (1, 2):
            got = q_out.get(timeout=3 * T)
            assert not isinstance(got, str), got
            whole, info, verified, extra = got
            assert recv.wait_version(v, T) == v and verified
            # both fused parameters of both layers: their own tasks, zero copy, holding nothing
            assert sorted(n for n, _, _ in info) == sorted(f"model.layers.{i}.{k}" for i in range(2) for k in (GU, DN))
            assert all(zc and held == 0 for _, zc, held in info), info
            assert _landed(whole, params, 1)
            if v == 1:
                assert all(extra)  # registered at the first push
            else:
                assert extra == [f"model.layers.0.{DN}"]  # the moved parameter only, registered again
                assert torch.equal(
                    whole[f"model.layers.0.{DN}"].view(torch.uint8),
                    params[0]["model.layers.0.mlp.experts.w2_weight"].view(torch.uint8),
                )
            q_in.put("go")
        proc.join(T)
        assert proc.exitcode == 0, proc.exitcode
        recv.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _gpu_receiver(addr, name, q_in, q_out):
    params, r = gpu_receiver(TINY_MOE, addr, name, T, verify=True)
    for v in (1, 2):
        assert r.wait_version(v, T) == v
        q_out.put({n: t.cpu() for n, t in params.items()})
        q_in.get(timeout=T)
    r.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_fused_experts_zero_copy_over_cuda_ipc(store):
    """On one GPU (trainer here, receiver in a spawned process, cuda_ipc): the fused expert
    tasks are zero copy (registered CUDA memory of the parameters, no extra GPU memory), land
    the reference bytes, and a parameter given new memory is registered again."""
    from wxfer.runtime.sender import Sender

    _, addr = store
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    with torch.device(dev):
        model = _model()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=reporting, args=(_gpu_receiver, addr, "gpu-moe", q_in, q_out), daemon=True)
    proc.start()
    try:
        s = Sender(model, mapping=preset_for(TINY_MOE), store=addr, name="gpu-moe", timeout=T)
        ops = _expert_ops(s)
        assert len(ops) == 2 * TINY_MOE["num_hidden_layers"] and all(op.prep.zero_copy for op in ops)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        s.push(verify=True)
        torch.cuda.synchronize(dev)
        extra = torch.cuda.max_memory_allocated(dev) - base
        got = q_out.get(timeout=T)
        assert not isinstance(got, str), got
        assert _landed({n: p.detach().cpu() for n, p in model.named_parameters()}, [got], 1)
        assert all(op.prep.fast is not None for op in ops) and s.last_verify is not None
        assert all(op.prep.zero_copy for g in s.program.groups for op in g if op.sends)
        assert extra < 1 << 20, extra  # every task zero copy: no packed buffer
        first = {op.task: op.prep.fast.task for op in ops}
        gu = model.model.layers[0].mlp.experts.gate_up_proj
        gu.data = gu.data.clone() * 2
        q_in.put(1)
        s.push(verify=True)
        got = q_out.get(timeout=T)
        assert not isinstance(got, str), got
        assert _landed({n: p.detach().cpu() for n, p in model.named_parameters()}, [got], 1)
        assert [op.sources[0][1] for op in ops if op.prep.fast.task is not first[op.task]] == [gu]
        s.close()
        q_in.put(1)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
