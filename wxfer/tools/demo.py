"""``python -m wxfer demo``: the whole product on one machine.

Spawns trainer processes (FSDP2 ``fully_shard``; gloo on CPU, NCCL on GPUs) training
transformers' own ``Qwen3ForCausalLM`` (``--moe``: ``Qwen3MoeForCausalLM``, experts fused
3-D as transformers 5 stores them) built from a small config with random weights, and
inference worker processes holding the same model in vLLM's layout (fused qkv / gate_up /
w13, TP or EP shards, FP8 block weights with ``--fp8``).  Trainers train a few steps on
random data and ``push()`` after each; then

  (a) every inference worker checks that each of its parameters equals, bit for bit,
      what the mapping's reference packing makes of the trainers' current weights;
  (b) this process rebuilds each replica's model from its shards (de-fuse, gather TP,
      dequantize), runs it through the transformers model's own forward and compares its
      logits with the trainer's, within FP8 tolerance.

Prints per-step push time and GB/s; ``--json`` prints one JSON object last, with
``simulated_s``: the simulator on the trainers' own plan, calibrated on this machine right
after the run (``python -m wxfer calibrate --quick``; ``--no-simulate`` skips it), or
predicted from a calibration made before, in its own process (``--calibration FILE``:
``python -m wxfer calibrate --json --out FILE``); ``load_average`` says how busy the
machine was (before the run, after it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback

from .. import envs

TIMEOUT = 120.0


# --------------------------------------------------------------------------- helpers


def _cfg(size: str, moe: bool) -> dict:
    from ..models import CONFIGS

    return dict(CONFIGS["tiny-moe" if moe else size])


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


def _trainer_main(rank: int, world: int, a: dict) -> None:
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


def _trainer(rank, world, a, ctl):
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh
    from ..runtime import control, prepare
    from ..mapping import Layout, expand, pack_shard
    from ..models import logits as model_logits, preset_for, shard_fsdp2, train_model
    from ..runtime.sender import Sender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["master_port"]))
    torch.set_num_threads(1)
    gpu = a["gpu"]
    if gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev_type = "cuda"
    else:
        dev_type = "cpu"
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT))
    cfg = a["cfg"]
    model = train_model(cfg)  # transformers' own class, random weights (the same on every rank)
    if a["moe"]:
        if world % 2:
            raise ValueError("--moe needs an even number of trainers (a 2 x N mesh)")
        from torch.distributed.device_mesh import DeviceMesh

        # dense layers HSDP: sharded over the rows {0..N-1}, {N..2N-1}, replicated across them;
        # routed experts HSDP on the transposed mesh: sharded (dim 0, the experts) over the
        # columns {c, c+N}, replicated across them -- their own mesh groups
        mesh = init_device_mesh(dev_type, (2, world // 2), mesh_dim_names=("rep", "shard"))
        expert_mesh = DeviceMesh(
            dev_type, torch.arange(world).view(2, world // 2).T.contiguous(), mesh_dim_names=("erep", "eshard")
        )
    else:
        mesh = init_device_mesh(dev_type, (world,))
        expert_mesh = None
    if gpu:
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
    )
    setup_s = time.perf_counter() - t0
    # who packs which expected shard for the bit-for-bit check: the lowest rank holding
    # every source of a mapping component
    names = [n for n, _ in model.named_parameters()]
    all_names = control.gather_json(sender.group, names, sender.timeout, "the trainer ranks' parameter names")
    holders = {}
    for r, ns in enumerate(all_names):
        for n in ns:
            holders.setdefault(n, set()).add(r)
    preset = preset_for(cfg)
    ex = expand(
        preset.rules,
        {n: s for n, (s, _) in sender.plan.train_params.items()},
        Layout(a["tp"], a["ep"], "fp8" if a["fp8"] else None),
        cfg,
    )
    mine = [c for c in ex.components if min(set.intersection(*(holders[s] for s in c.sources))) == rank]
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    g = torch.Generator().manual_seed(1234)
    eval_ids = torch.randint(0, cfg["vocab_size"], (2, 32), generator=g).to(device)
    step_s, moved = [], []
    nsteps = a["steps"] + (1 if a["unchanged_step"] else 0)
    for step in range(1, nsteps + 1):
        train = step <= a["steps"]
        if train:
            gen = torch.Generator().manual_seed(step * 7919 + rank)
            ids = torch.randint(0, cfg["vocab_size"], (a["batch"], a["seq"] + 1), generator=gen).to(device)
            logits = model_logits(model, ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        before = sender.engine.stats()["bytes_written"]
        # a blocking barrier: the ranks leave it together, so the step times that follow are
        # not skewed by a polling wait (the other waits here are bounded by sender.timeout)
        dist.barrier(group=sender.group)
        t = time.perf_counter()
        sender.push(version=step)
        dt = time.perf_counter() - t
        after = sender.engine.stats()["bytes_written"]
        per = control.gather_json(sender.group, (dt, after - before), sender.timeout, f"step {step}'s times")
        step_s.append(max(x[0] for x in per))
        moved.append(sum(x[1] for x in per))
        # expectations: the mapping's reference bytes of every destination shard
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
            del fulls
        if rank == 0:
            reports = [
                ctl.get_json(
                    "demo/report/%d/%d" % (step, gp), f"the check of inference worker gpu {gp} for step {step}"
                )
                for gp in range(a["replicas"] * a["tp"])
            ]
            ctl.set_json(
                "demo/step/%d" % step, dict(step_s=step_s[-1], moved=moved[-1], trained=train, reports=reports)
            )
        control.Barrier(sender.group, f"the demo's barrier in step {step}").wait(sender.timeout)
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
    control.Barrier(sender.group, "the demo's last barrier").wait(sender.timeout)
    sender.close()
    if rank == 0:
        ctl.set("demo/done", b"1")


# --------------------------------------------------------------------------- inference workers


def _worker_main(gpu_index: int, a: dict) -> None:
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
    )
    prev = None
    nsteps = a["steps"] + (1 if a["unchanged_step"] else 0)
    for step in range(1, nsteps + 1):
        recv.wait_version(step, TIMEOUT)
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
            ),
        )
        prev = whole
    ctl.get("demo/done", "the trainers to finish", TIMEOUT)
    recv.close()


# --------------------------------------------------------------------------- the parent


def run_demo(
    trainers: int | None = None,
    replicas: int = 2,
    tp: int = 2,
    steps: int = 3,
    fp8: bool = False,
    cpu_offload: bool = False,
    moe: bool = False,
    size: str = "small",
    unchanged_step: bool = False,
    ep: bool = False,
    batch: int = 4,
    seq: int = 64,
    lr: float = 1e-3,
    watermark: str = "256MiB",
    transport: str = "auto",
    trace_dir: str | None = None,
    timeout: float = 600.0,
    log=print,
    simulate: bool = False,
    calibration: str | None = None,
) -> dict:
    import multiprocessing as mp
    import torch
    from datetime import timedelta
    import torch.distributed as dist
    from ..runtime import control
    from ..models import logits_close, logits_from_shards, logits_of_weights

    gpu = torch.cuda.is_available() and envs.get("WXFER_DEMO_CPU") != "1"
    if trainers is None:
        trainers = min(2, torch.cuda.device_count()) if gpu else 2
    if gpu and trainers > torch.cuda.device_count():
        raise ValueError(
            f"--trainers {trainers} needs {trainers} GPUs (NCCL: one rank per GPU), this machine "
            f"has {torch.cuda.device_count()}; use fewer trainers or WXFER_DEMO_CPU=1"
        )
    port = control.free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=TIMEOUT), wait_for_workers=False)
    name = "demo%d" % os.getpid()
    ctl = control.Control(store, name, TIMEOUT)
    tmp = tempfile.mkdtemp(prefix="wxfer-demo-")
    cfg = _cfg(size, moe)
    a = dict(
        store="127.0.0.1:%d" % port,
        name=name,
        master_port=control.free_port(),
        cfg=cfg,
        tp=tp,
        replicas=replicas,
        trainers=trainers,
        steps=steps,
        fp8=fp8,
        cpu_offload=cpu_offload,
        moe=moe,
        ep=ep,
        unchanged_step=unchanged_step,
        batch=batch,
        seq=seq,
        lr=lr,
        watermark=watermark,
        gpu=gpu,
        transport=transport,
        dir=tmp,
        trace_dir=trace_dir,
    )
    ctx = mp.get_context("spawn")
    procs = []
    t_start = time.perf_counter()
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        for g in range(replicas * tp):
            procs.append(("inference worker gpu %d" % g, ctx.Process(target=_worker_main, args=(g, a), daemon=True)))
        for r in range(trainers):
            procs.append(("trainer rank %d" % r, ctx.Process(target=_trainer_main, args=(r, trainers, a), daemon=True)))
        for _, p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        shown = 0
        failed = None
        while True:
            while ctl.check("demo/step/%d" % (shown + 1)):
                shown += 1
                s = ctl.get_json("demo/step/%d" % shown, "step report")
                ok = all(r["ok"] for r in s["reports"])
                log(
                    "step %d%s: push %.3f s, %d bytes, %.3f GB/s, receivers bit-exact: %s"
                    % (
                        shown,
                        "" if s["trained"] else " (nothing changed)",
                        s["step_s"],
                        s["moved"],
                        s["moved"] / max(s["step_s"], 1e-9) / 1e9,
                        ok,
                    )
                )
            alive = [p for _, p in procs if p.is_alive()]
            bad = [(w, p.exitcode) for w, p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if bad:
                failed = bad
                break
            if not alive:
                break
            if time.monotonic() > deadline:
                failed = [("timeout", f"the demo did not finish within {timeout:.0f} s")]
                break
            time.sleep(0.05)
        if failed:
            # let the others fail too (setup errors reach every process), then collect them
            end = time.monotonic() + 15
            while any(p.is_alive() for _, p in procs) and time.monotonic() < end:
                time.sleep(0.1)
            errs = {}
            for k in ["trainer%d" % r for r in range(trainers)] + ["worker%d" % g for g in range(replicas * tp)]:
                if ctl.check("demo/error/" + k):
                    errs[k] = ctl.get("demo/error/" + k, "error").decode(errors="replace")
            msg = "; ".join("%s exited with %s" % (w, c) for w, c in failed)
            for k, e in errs.items():
                log("---- %s failed:\n%s" % (k, e.rstrip()))
            raise RuntimeError("wxfer demo failed: " + msg)
        res = ctl.get_json("demo/result", "the trainers' result")
        total_s = time.perf_counter() - t_start
        per_step = [ctl.get_json("demo/step/%d" % s, "step report") for s in range(1, len(res["step_s"]) + 1)]
        bitexact = all(r["ok"] for s in per_step for r in s["reports"])
        # (b) logits of every replica, rebuilt from its shards, against the trainer's
        logit_err = []
        logits_ok = True
        # the reference: transformers' forward of the trainers' weights at the inference side's
        # BF16 precision (the trainers' own FSDP2 forward in float32 is reported beside it)
        ref = torch.load(os.path.join(tmp, "step%d_train.pt" % steps))
        ref_logits = logits_of_weights(cfg, ref["weights"], ref["ids"], torch.bfloat16)
        train_err = []
        for rep in range(replicas):
            shards = [torch.load(os.path.join(tmp, "step%d_gpu%d.pt" % (steps, rep * tp + r))) for r in range(tp)]
            got = logits_from_shards(cfg, shards, ref["ids"], ep)
            ok, err = logits_close(ref_logits, got, "fp8" if fp8 else None)
            logits_ok &= ok
            logit_err.append(round(err, 5))
            train_err.append(round(logits_close(ref["logits"], got, None)[1], 5))
        unchanged_ok = None
        if unchanged_step:
            last, prev = per_step[-1], per_step[-2]
            unchanged_ok = last["moved"] == prev["moved"] and all(r["same_as_previous"] for r in last["reports"])
        bps = sum(r["bytes_per_step"] for r in res["ranks"])
        step_s = res["step_s"]
        best = min(step_s)
        out = dict(
            steps=len(step_s),
            verified=bool(bitexact and logits_ok and unchanged_ok is not False),
            bitexact=bitexact,
            logits_ok=logits_ok,
            logits_rel_err=logit_err,
            logits_rel_err_fp32=train_err,
            unchanged_ok=unchanged_ok,
            transport=res["transport"],
            bytes_per_step=bps,
            moved_bytes=res["moved"],
            step_s=step_s,
            gbps=bps / best / 1e9,
            gbps_mean=bps * len(step_s) / sum(step_s) / 1e9,
            trainers=trainers,
            replicas=replicas,
            tp=tp,
            fp8=fp8,
            cpu_offload=cpu_offload,
            moe=moe,
            ep=ep,
            model=size if not moe else "tiny-moe",
            tasks=res["tasks"],
            mesh_groups=res["groups"],
            transfers=res["transfers"],
            setup_s=max(r["setup_s"] for r in res["ranks"]),
            held_peak=max(r["held_peak"] for r in res["ranks"]),
            total_s=total_s,
            load_average=dict(before=load0, after=os.getloadavg() if hasattr(os, "getloadavg") else None),
            device="cuda" if gpu else "cpu",
            machine="%s, %s, %d CPUs" % (platform.node(), platform.machine(), os.cpu_count() or 0),
            mismatches=[m for s in per_step for r in s["reports"] for m in r["mismatches"]][:20],
            receiver_regions=[
                (r["registration"]["params"], r["registration"]["regions"], r["registration"]["register_mode"])
                for r in per_step[0]["reports"]
            ],
        )
        if simulate:  # the simulator on the trainers' own plan, calibrated here after the run (issue 15)
            from .calibrate import simulate_measured

            plan = control.decode_result(ctl.get("plan", "the trainers' plan"), "trainer rank 0 (controller)")
            out.update(simulate_measured(plan, calibration, log=log))
            out["simulated_from"] = calibration or "calibrate --quick in this process, after the run"
            if "simulated_s" in out:
                out["simulated_vs_median"] = out["simulated_s"] / sorted(step_s)[len(step_s) // 2]
                log(
                    "simulated %.3f s (bound by %s) against a median push of %.3f s"
                    % (out["simulated_s"], out["simulated_bound_by"], sorted(step_s)[len(step_s) // 2])
                )
            else:
                log("not simulated: " + out["simulated_error"])
        log(
            "wxfer demo: %d trainers -> %d replicas x TP%d (%s%s%s), %s: %d bytes/step, best %.3f s "
            "(%.3f GB/s), bit-exact %s, logits %s%s, verified=%s"
            % (
                trainers,
                replicas,
                tp,
                "FP8" if fp8 else "BF16",
                ", CPU offload" if cpu_offload else "",
                ", MoE expert sub-mesh" + (", EP inference" if ep else "") if moe else "",
                out["transport"],
                bps,
                best,
                out["gbps"],
                bitexact,
                "ok (max rel err %.3g)" % max(logit_err) if logits_ok else "MISMATCH %s" % logit_err,
                "" if unchanged_ok is None else ", unchanged step identical %s" % unchanged_ok,
                out["verified"],
            )
        )
        return out
    finally:
        for _, p in procs:
            if p.is_alive():
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m wxfer demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", type=int, default=None, help="default 2 (on GPUs: min(2, GPUs))")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 block weights on the inference side")
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy on the trainers")
    ap.add_argument(
        "--moe",
        action="store_true",
        help="tiny Qwen3-MoE (transformers 5 fused experts), experts on their own mesh of a 2 x N trainer mesh",
    )
    ap.add_argument("--ep", action="store_true", help="with --moe: expert-parallel inference layout")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument(
        "--unchanged-step",
        action="store_true",
        help="push once more without training: same bytes, receivers bit-identical",
    )
    ap.add_argument("--watermark", default="256MiB")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--trace-dir", default=None, help="write a Chrome trace per trainer rank here")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument(
        "--no-simulate", action="store_true", help="skip calibrating this machine and simulating the plan (simulated_s)"
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="simulate from this calibration (a file of python -m wxfer calibrate --json --out FILE, made "
        "before, in its own process) instead of calibrating in this process after the run",
    )
    args = ap.parse_args(argv)
    try:
        res = run_demo(
            args.trainers,
            args.replicas,
            args.tp,
            args.steps,
            args.fp8,
            args.cpu_offload,
            args.moe,
            args.size,
            args.unchanged_step,
            ep=args.ep,
            watermark=args.watermark,
            transport=args.transport,
            trace_dir=args.trace_dir,
            timeout=args.timeout,
            simulate=not args.no_simulate,
            calibration=args.calibration,
        )
    except Exception as e:  # noqa: BLE001
        print("wxfer demo: %s" % e, file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    dict(steps=0, verified=False, error=str(e), transport="", bytes_per_step=0, step_s=[], gbps=0.0)
                )
            )
        return 1
    if args.json:
        print(json.dumps(res))
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
