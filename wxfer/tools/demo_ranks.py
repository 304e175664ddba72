"""The processes of ``python -m wxfer demo`` (wxfer/tools/demo.py starts them, spawned):
trainer ranks (FSDP2 over transformers' model, a Sender, a push after every step, the
digests of what every receiver must hold published to the store) and inference workers
(a Receiver on vLLM's layout, checking every byte against those digests after each step).
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback

TIMEOUT = 120.0


# --------------------------------------------------------------------------- helpers


def _preset_name(cfg: dict) -> str:
    from ..models import preset_for

    return preset_for(cfg).name


def _bytes_of(t):
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def _digest(b) -> str:
    return hashlib.sha1(b).hexdigest()


def _report_error(ctl, who: str) -> None:
    try:
        ctl.set("demo/error/" + who, traceback.format_exc()[-4000:])
    except Exception:  # noqa: BLE001
        pass


# --------------------------------------------------------------------------- trainers


def trainer_main(rank: int, world: int, a: dict) -> None:
    import torch.distributed as dist
    from ..runtime import control

    ctl = control.Control(control.resolve_store(a["store"], False, TIMEOUT), a["name"], TIMEOUT)
    try:
        _trainer(rank, world, a, ctl)
    except BaseException:
        _report_error(ctl, "trainer%d" % rank)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_trainer(rank: int, world: int, a: dict) -> str:
    """This process's torch.distributed (NCCL on its GPU, else gloo); the device type."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["master_port"]))
    torch.set_num_threads(1)
    if a["gpu"]:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev_type = "cuda" if a["gpu"] else "cpu"
    dist.init_process_group(
        "nccl" if a["gpu"] else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
    )
    return dev_type


def _meshes(dev_type: str, world: int, moe: bool):
    """(the FSDP2 mesh, the routed experts' mesh or None)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not moe:
        return init_device_mesh(dev_type, (world,)), None
    if world % 2:
        raise ValueError("--moe needs an even number of trainers (a 2 x N mesh)")
    # dense layers HSDP: sharded over the rows {0..N-1}, {N..2N-1}, replicated across them;
    # routed experts HSDP on the transposed mesh: sharded (dim 0, the experts) over the
    # columns {c, c+N}, replicated across them -- their own mesh groups
    mesh = init_device_mesh(dev_type, (2, world // 2), mesh_dim_names=("rep", "shard"))
    expert_mesh = DeviceMesh(
        dev_type, torch.arange(world).view(2, world // 2).T.contiguous(), mesh_dim_names=("erep", "eshard")
    )
    return mesh, expert_mesh


def _my_components(sender, model, a: dict, rank: int) -> list:
    """The mapping components whose expected shards this rank packs for the bit-for-bit check:
    those of which it is the lowest rank holding every source."""
    from ..mapping import Layout, expand
    from ..models import preset_for
    from ..runtime import control

    names = [n for n, _ in model.named_parameters()]
    all_names = control.gather_json(sender.group, names, sender.timeout, "the trainer ranks' parameter names")
    holders = {}
    for r, ns in enumerate(all_names):
        for n in ns:
            holders.setdefault(n, set()).add(r)
    ex = expand(
        preset_for(a["cfg"]).rules,
        {n: s for n, (s, _) in sender.plan.train_params.items()},
        Layout(a["tp"], a["ep"], "fp8" if a["fp8"] else None),
        a["cfg"],
    )
    return [c for c in ex.components if min(set.intersection(*(holders[s] for s in c.sources))) == rank]


def _train_step(model, opt, a: dict, rank: int, step: int, device) -> None:
    """One optimizer step on random tokens (the same on every run)."""
    import torch
    from ..models import logits as model_logits

    cfg = a["cfg"]
    gen = torch.Generator().manual_seed(step * 7919 + rank)
    ids = torch.randint(0, cfg["vocab_size"], (a["batch"], a["seq"] + 1), generator=gen).to(device)
    logits = model_logits(model, ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _change_step(model, rate: float, rank: int, step: int) -> None:
    """--change-rate: change about `rate` of the elements of this rank's shard of every parameter
    (by 7% and a little: their destination bytes change), the same on every run."""
    import torch
    from torch.distributed.tensor import DTensor
    from ..runtime.prepare import dtensor_local

    gen = torch.Generator().manual_seed(step * 7919 + rank)
    with torch.no_grad():
        for p in model.parameters():
            t = dtensor_local(p) if isinstance(p, DTensor) else p.data
            m = (torch.rand(t.shape, generator=gen) < rate).to(t.device)
            t[m] = t[m] * 1.07 + 0.001


def _timed_push(sender, step: int):
    """push() after a barrier: (the slowest rank's seconds, the bytes all ranks wrote; with
    delta, every rank's delta stats of the push summed)."""
    import torch.distributed as dist
    from ..runtime import control

    before = sender.engine.stats()["bytes_written"]
    # a blocking barrier: the ranks leave it together, so the step times that follow are
    # not skewed by a polling wait (the other waits here are bounded by sender.timeout)
    dist.barrier(group=sender.group)
    t = time.perf_counter()
    sender.push(version=step)
    dt = time.perf_counter() - t
    after = sender.engine.stats()["bytes_written"]
    d = None
    if sender.delta is not None:
        d = {k: v for k, v in sender.delta.last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    per = control.gather_json(sender.group, (dt, after - before, d), sender.timeout, f"step {step}'s times")
    if d is not None:
        d = {k: sum(x[2][k] for x in per) for k in d}
        ph = sender.last_phases  # the slowest rank's: until submitted (stages 1-2, compare, encode), landed
        tm = control.gather_json(sender.group, (ph.get("submit"), ph.get("writes")), sender.timeout, "phases")
        d["submit_s"], d["writes_s"] = max(x[0] or 0 for x in tm), max(x[1] or 0 for x in tm)
        sender.delta_step = d
    return max(x[0] for x in per), sum(x[1] for x in per)


def _publish_expected(ctl, model, mine, a: dict, rank: int, step: int, device, eval_ids) -> None:
    """The digests of the mapping's reference bytes of every destination shard this rank packs;
    after the last trained step (rank 0) the trainer's logits and full weights too."""
    import torch
    from ..mapping import pack_shard
    from ..models import logits as model_logits
    from ..runtime import prepare

    with torch.no_grad():
        # (offloaded shards go to the device first, as the sender's stage 1 does)
        fulls = {n: prepare.full_tensor(p, prepare.local_to_device(p, device)) for n, p in model.named_parameters()}
        exp = {}
        for c in mine:
            for s in c.shards:
                exp["%d|%s|%d|%d" % (s.rank, s.dst, s.offset, s.nbytes)] = _digest(_bytes_of(pack_shard(s, fulls)))
        ctl.set_json("demo/expect/%d/%d" % (step, rank), exp)
        if step == a["steps"]:  # logits of the last trained step (transformers' forward)
            out = model_logits(model, eval_ids)
            model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward
            if rank == 0:
                torch.save(
                    {
                        "ids": eval_ids.cpu(),
                        "logits": out.float().cpu(),
                        "weights": {n: f.detach().float().cpu() for n, f in fulls.items()},
                    },
                    os.path.join(a["dir"], "step%d_train.pt" % step),
                )


def _publish_step(ctl, a: dict, step: int, step_s: float, moved: int, train: bool, delta=None) -> None:
    """(rank 0) The step's time and bytes with every inference worker's check of it."""
    reports = [
        ctl.get_json("demo/report/%d/%d" % (step, gp), f"the check of inference worker gpu {gp} for step {step}")
        for gp in range(a["replicas"] * a["tp"])
    ]
    ctl.set_json("demo/step/%d" % step, dict(step_s=step_s, moved=moved, trained=train, reports=reports, delta=delta))


def _publish_result(ctl, sender, a: dict, rank: int, setup_s: float, step_s: list, moved: list) -> None:
    """Every rank's stats gathered, its trace written; rank 0 publishes the run's result."""
    from ..runtime import control

    stats = sender.stats()
    allstats = control.gather_json(
        sender.group,
        dict(
            bytes_per_step=sender.bytes_per_step,
            setup_s=setup_s,
            setup=sender.setup_s,
            held_peak=stats["held_peak"],
            receivers=stats["receivers"],
        ),
        sender.timeout,
        "the trainer ranks' stats",
    )
    if a.get("trace_dir"):
        sender.write_trace(os.path.join(a["trace_dir"], "wxfer-trainer%d.json" % rank))
    if rank == 0:
        ctl.set_json(
            "demo/result",
            dict(
                step_s=step_s,
                moved=moved,
                ranks=allstats,
                transport=sender.transport_name,
                tasks=len(sender.plan.tasks),
                groups=len(sender.plan.groups),
                transfers=sender.plan.n_transfers,
            ),
        )


def _trainer(rank, world, a, ctl):
    """A trainer rank: FSDP2 over transformers' model, a Sender, then per step train (but on
    --unchanged-step's last), push, publish what the receivers must hold."""
    import torch
    from ..models import preset_for, shard_fsdp2, train_model
    from ..runtime import control
    from ..runtime.sender import Sender

    dev_type = _init_trainer(rank, world, a)
    cfg = a["cfg"]
    model = train_model(cfg)  # transformers' own class, random weights (the same on every rank)
    mesh, expert_mesh = _meshes(dev_type, world, a["moe"])
    if a["gpu"]:
        model = model.cuda()
    shard_fsdp2(model, mesh, expert_mesh, offload=a["cpu_offload"])
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"])
    t0 = time.perf_counter()
    sender = Sender(
        model,
        mapping=preset_for(cfg),
        store=a["store"],
        name=a["name"],
        watermark=a["watermark"],
        timeout=TIMEOUT,
        transport=a["transport"],
        delta=a.get("delta", False),
    )
    sender.delta_step = None
    setup_s = time.perf_counter() - t0
    mine = _my_components(sender, model, a, rank)
    device = torch.device("cuda", torch.cuda.current_device()) if a["gpu"] else torch.device("cpu")
    g = torch.Generator().manual_seed(1234)
    eval_ids = torch.randint(0, cfg["vocab_size"], (2, 32), generator=g).to(device)
    step_s, moved = [], []
    nsteps = a["steps"] + (1 if a["unchanged_step"] else 0)
    for step in range(1, nsteps + 1):
        train = step <= a["steps"]
        if train and a.get("change_rate") is not None:
            _change_step(model, a["change_rate"], rank, step)
        elif train:
            _train_step(model, opt, a, rank, step, device)
        if a["gpu"]:
            torch.cuda.synchronize()
        if sender.delta is not None:  # a dense push in the same run, to compare (bench_delta.py)
            sender.delta.force_dense = step in a.get("dense_steps", ())
        dt, nb = _timed_push(sender, step)
        step_s.append(dt)
        moved.append(nb)
        _publish_expected(ctl, model, mine, a, rank, step, device, eval_ids)
        if rank == 0:
            _publish_step(ctl, a, step, step_s[-1], moved[-1], train, sender.delta_step)
        control.Barrier(sender.group, f"the demo's barrier in step {step}").wait(sender.timeout)
    _publish_result(ctl, sender, a, rank, setup_s, step_s, moved)
    control.Barrier(sender.group, "the demo's last barrier").wait(sender.timeout)
    sender.close()
    if rank == 0:
        ctl.set("demo/done", b"1")


# --------------------------------------------------------------------------- inference workers


def worker_main(gpu_index: int, a: dict) -> None:
    from ..runtime import control

    ctl = control.Control(control.resolve_store(a["store"], False, TIMEOUT), a["name"], TIMEOUT)
    try:
        _worker(gpu_index, a, ctl)
    except BaseException:
        _report_error(ctl, "worker%d" % gpu_index)
        raise


def _worker(gidx, a, ctl):
    import torch
    from ..models import inference_params
    from ..runtime.receiver import Receiver

    torch.set_num_threads(1)
    tp = a["tp"]
    replica, rank = divmod(gidx, tp)
    if a["gpu"]:
        dev = torch.device("cuda", (a["trainers"] + gidx) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    params = inference_params(a["cfg"], tp, rank, "fp8" if a["fp8"] else None, ep=a["ep"], device=dev)
    recv = Receiver(
        params,
        mapping=_preset_name(a["cfg"]),
        store=a["store"],
        replica=replica,
        rank=rank,
        tp=tp,
        replicas=a["replicas"],
        ep=a["ep"],
        name=a["name"],
        timeout=TIMEOUT,
        transport=a["transport"],
        delta_staging=a["delta_staging"] if a.get("delta") else 0,
    )
    prev = None
    nsteps = a["steps"] + (1 if a["unchanged_step"] else 0)
    for step in range(1, nsteps + 1):
        recv.wait_version(step, TIMEOUT)
        applied = recv.apply()  # delta: the step's records (nothing to do without a staging area)
        exp = {}
        for r in range(a["trainers"]):
            exp.update(ctl.get_json("demo/expect/%d/%d" % (step, r), f"trainer rank {r}'s expected shards"))
        blobs = {n: _bytes_of(t) for n, t in params.items()}
        covered = {n: 0 for n in params}
        bad, checked = [], 0
        for k, dg in exp.items():
            r, dst, off, nb = k.split("|")
            if int(r) != rank:
                continue
            off, nb = int(off), int(nb)
            checked += 1
            if dst not in blobs:
                bad.append(f"{dst} (missing here)")
                continue
            covered[dst] += nb
            if _digest(blobs[dst][off : off + nb]) != dg:
                bad.append(f"{dst}[{off}:{off + nb}]")
        unc = [n for n, c in covered.items() if c != len(blobs[n])]
        whole = _digest(b"".join(blobs[n] for n in sorted(blobs)))
        if step == a["steps"]:
            torch.save(
                {n: t.cpu() for n, t in params.items()}, os.path.join(a["dir"], "step%d_gpu%d.pt" % (step, gidx))
            )
        ctl.set_json(
            "demo/report/%d/%d" % (step, gidx),
            dict(
                gpu=gidx,
                ok=not bad and not unc,
                checked=checked,
                mismatches=bad[:20],
                n_mismatches=len(bad),
                not_covered=unc[:20],
                digest=whole,
                same_as_previous=(whole == prev),
                version=recv.version(),
                registration=recv.stats() if step == 1 else None,
                apply=applied,
            ),
        )
        prev = whole
    ctl.get("demo/done", "the trainers to finish", TIMEOUT)
    recv.close()
