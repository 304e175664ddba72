"""Several trainer GPUs: wxfer against the rank-0 broadcast, and the simulator against both
(issue 9).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 benchmarks/bench_scale.py --layout 8gpu --out benchmarks/scale-8gpu --json
    python3 benchmarks/bench_scale.py --layout 4gpu --out benchmarks/scale-4gpu --json
    python benchmarks/bench_scale.py --dry-run --json          # CPU: gloo, fabric tcp, tiny models

Layouts (trainer i on GPU i; receiver j = replica * tp + rank):
  8gpu  4 trainers (FSDP2 over 4) on GPUs 0-3 -> 2 replicas x TP2 on GPUs 4-7 (disaggregated)
  4gpu  4 trainers on GPUs 0-3, 2 replicas x TP2 on the same GPUs 0-3 (colocated)
  2gpu  2 trainers on GPUs 0-1, 1 replica x TP2 on GPUs 0-1 (colocated; a dry run on 2 GPUs)
  (--trainers / --replicas / --tp / --colocated build any other)

Per configuration (model x BF16/FP8 on the inference side), in fresh processes each time:
  wxfer   N trainer processes (FSDP2 ``fully_shard`` over N ranks, real shapes, weights made
          on the meta device and filled with deterministic random values per parameter)
          call ``Sender.push()``; the step time is the slowest rank's; after --warmup, the
          median of --reps.  Measured in the same processes: the write link (a peer copy
          trainer 0 GPU -> receiver 0 GPU; CPU: a memcpy), the trainers' all-gather
          bandwidth (all_gather_into_tensor of 256 MiB) and an on-device copy; with them,
          ``wxfer.plan.simulate`` predicts the step for the plan the trainers use.
  rank0   the same weights as plain row shards; per ~1 GiB bucket every trainer all-gathers
          its parameters (what ``full_tensor()`` does), trainer 0 packs the bucket and
          broadcasts it (NCCL; CPU: gloo; double-buffered) to every inference rank, which
          writes its TP shards (fusion, FP8 quantization) into its own layout.  Needs one
          GPU per process: on a colocated GPU layout NCCL refuses two ranks on one GPU, so
          it is reported as not run there.
Every inference rank's memory is compared after each method (per-parameter byte sums).
Outputs (--out): results.json, table.md, machine.txt; --json prints one JSON object last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bb_patterns as bp  # noqa: E402  -- the rank-0 buckets
from common import baselines as bb  # noqa: E402  -- models, machine description

LAYOUTS = {
    "8gpu": dict(trainers=4, replicas=2, tp=2, colocated=False),
    "4gpu": dict(trainers=4, replicas=2, tp=2, colocated=True),
    "2gpu": dict(trainers=2, replicas=1, tp=2, colocated=True),
}
MiB = 1 << 20


# --------------------------------------------------------------------------- shared pieces


def weight(name: str, shape, dtype, dev):
    """The full tensor of training parameter `name`: deterministic, the same in every process."""
    import torch

    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(tuple(shape), generator=g, device=dev, dtype=torch.float32)
    t = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.02)
    return t.to(dtype)


def rows(full, n: int, r: int):
    """Rank r's row shard of `full` (torch.chunk over dim 0, as FSDP2's Shard(0))."""
    ch = full.chunk(n, 0)
    return ch[r] if r < len(ch) else full[:0]


def device_of(a: dict, role: str, i: int):
    import torch

    if a["dry_run"]:
        return torch.device("cpu")
    g = i if role == "trainer" or a["colocated"] else a["trainers"] + i
    return torch.device("cuda", g)


def timed(fn, dev, reps: int = 3) -> float:
    fn()
    bb.sync_dev(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        bb.sync_dev(dev)
        best = min(best, time.perf_counter() - t)
    return best


# --------------------------------------------------------------------------- processes


def _child(role: str, i: int, phase: str, a: dict, cfg: dict) -> None:
    from wxfer.runtime import control

    ctl = control.Control(control.resolve_store(a["store"], False, a["timeout"]), a["name"], a["timeout"])
    try:
        import torch

        torch.set_num_threads(1 if a["dry_run"] else 4)
        dev = device_of(a, role, i)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        (_wxfer_phase if phase == "wxfer" else _rank0_phase)(role, i, a, cfg, dev, ctl)
    except BaseException:  # noqa: BLE001 -- reported to the parent through the store
        ctl.set("err/%s/%s%d" % (phase, role, i), traceback.format_exc()[-3000:])
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _pg(a, phase, rank, world):
    import torch.distributed as dist
    from wxfer.runtime import control

    store = control.resolve_store(a["store"], False, a["timeout"])
    backend = "gloo" if a["dry_run"] else ("nccl" if phase == "wxfer" else "cpu:gloo,cuda:nccl")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/%s/%s" % (a["name"], phase), store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=a["timeout"]),
    )


def _wxfer_phase(role, i, a, cfg, dev, ctl):
    import torch
    import torch.distributed as dist
    from wxfer.runtime import prepare
    from wxfer.runtime.receiver import Receiver

    conf, preset = bb.model_spec(cfg["model"])
    quant = "fp8" if cfg["quant"] == "fp8" else None
    tp, name = a["tp"], a["name"] + "_wx"
    if role == "receiver":
        params = bb.infer_params(bb.expanded(preset, conf, quant, tp), dev, i % tp)
        bb.reset(params)
        r = Receiver(
            params,
            mapping=preset.name,
            store=a["store"],
            replica=i // tp,
            rank=i % tp,
            tp=tp,
            replicas=a["replicas"],
            name=name,
            timeout=a["timeout"],
        )
        ctl.get("wx/done", "the trainers' wxfer steps", a["timeout"])
        bb.sync_dev(dev)
        ctl.set_json("sum/wxfer/%d" % i, dict(sums=bb.checksums(params), version=r.version()))
        r.close()
        return
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import shard_fsdp2, train_model
    from wxfer.runtime.sender import Sender
    from wxfer.meta import Cluster
    from wxfer.plan.simulate import simulate

    n = a["trainers"]
    _pg(a, "wxfer", i, n)
    with torch.device("meta"):
        model = train_model(conf)  # transformers' class (MoE: experts fused 3-D, as transformers 5)
    model = model.to(torch.bfloat16)
    shard_fsdp2(model, init_device_mesh(dev.type, (n,)))
    model.to_empty(device=dev)
    with torch.no_grad():
        for pn, p in model.named_parameters():
            loc = p._local_tensor if hasattr(p, "_local_tensor") else p
            want = rows(weight(pn, p.shape, p.dtype, dev), n, i)
            if tuple(loc.shape) != tuple(want.shape):
                raise RuntimeError(f"{pn}: FSDP2 local shard {tuple(loc.shape)}, expected {tuple(want.shape)}")
            loc.copy_(want)
    bb.sync_dev(dev)
    # bandwidths for the simulator, measured here
    bw = {}
    if i == 0:
        n_b = 64 * MiB if a["dry_run"] else 1 << 30
        src = torch.empty(n_b, dtype=torch.uint8, device=dev).fill_(3)
        # the write link: to the first receiver on another GPU (colocated: one not on ours)
        devs = [device_of(a, "receiver", j) for j in range(a["replicas"] * a["tp"])]
        dst_dev = next((d for d in devs if d != dev), devs[0])
        dst = torch.empty(n_b, dtype=torch.uint8, device=dst_dev)
        bw["write_GBps"] = n_b / timed(lambda: dst.copy_(src, non_blocking=True), dst_dev) / 1e9
        dst2 = torch.empty_like(src)
        bw["mem_GBps"] = 2 * n_b / timed(lambda: dst2.copy_(src), dev) / 1e9
        del src, dst, dst2
    if n > 1:
        per = (16 if a["dry_run"] else 256) * MiB // n
        inp = torch.empty(per, dtype=torch.uint8, device=dev)
        out = torch.empty(per * n, dtype=torch.uint8, device=dev)
        t = timed(lambda: prepare.all_gather_single(out, inp), dev)
        bw["allgather_GBps"] = per * (n - 1) / t / 1e9  # bytes into each rank over its link
        del inp, out
    s = Sender(
        model,
        mapping=preset,
        store=a["store"],
        name=name,
        watermark=a["watermark"],
        timeout=a["timeout"],
        write_timeout=a["timeout"],
    )
    times = []
    for k in range(a["warmup"] + a["reps"]):
        bb.sync_dev(dev)
        dist.barrier()
        t = time.perf_counter()
        s.push()
        dt = time.perf_counter() - t
        allt = [None] * n
        dist.all_gather_object(allt, dt)
        if k >= a["warmup"]:
            times.append(max(allt))
    nbytes = [None] * n
    dist.all_gather_object(nbytes, s.bytes_per_step)
    if i == 0:
        res = dict(
            bb.summary(times, sum(nbytes)),
            bytes=sum(nbytes),
            bytes_per_rank=nbytes,
            tasks=len(s.plan.tasks),
            transport=s.transport_name,
            bandwidths=bw,
        )
        if a.get("out"):
            s.write_trace(os.path.join(a["out"], "trace-%s-%s.json" % (cfg["model"], cfg["quant"])))
        c = Cluster(
            train_gpus=n,
            infer_gpus=a["replicas"] * tp,
            infer_tp=tp,
            gpus_per_node=1 << 20,
            nvlink_GBps=bw.get("allgather_GBps", bw["mem_GBps"]),
            mem_GBps=bw["mem_GBps"],
            write_GBps=bw["write_GBps"],
            watermark_bytes=bb.parse_size(a["watermark"]),
        )
        sim = simulate(s.plan, c, record=False, kinds="auto")
        res["simulated"] = dict(seconds=sim.simulated_s, lower_bound_s=sim.lower_bound_s, bottleneck=sim.bottleneck)
        ctl.set_json("res/wxfer", res)
    dist.barrier()
    ctl.set("wx/done", b"1")
    s.close()


def _rank0_phase(role, i, a, cfg, dev, ctl):
    import torch
    import torch.distributed as dist
    from wxfer.runtime import prepare
    from wxfer.mapping import Layout, expand

    conf, preset = bb.model_spec(cfg["model"])
    quant = "fp8" if cfg["quant"] == "fp8" else None
    n, tp = a["trainers"], a["tp"]
    m = a["replicas"] * tp
    g = i if role == "trainer" else n + i
    _pg(a, "rank0", g, n + m)
    tgroup = dist.new_group(list(range(n)))
    bgroup = dist.new_group([0] + list(range(n, n + m)))
    hf = preset.hf_params(conf, fused_experts=True)  # the names of the transformers 5 model
    ex = expand(preset.rules, {s: sh for s, (sh, _, _) in hf.items()}, Layout(tp, False, quant), conf)
    meta = {s: (tuple(sh), getattr(torch, dt)) for s, (sh, dt, _) in hf.items()}
    sizes = {s: int(torch.Size(sh).numel()) * torch.empty(0, dtype=dt).element_size() for s, (sh, dt) in meta.items()}
    cap, plan = bp.buckets(ex, sizes, a["bucket"])
    trainer = role == "trainer"
    if trainer:
        shards = {}
        for s, (sh, dt) in meta.items():
            full = weight(s, sh, dt, dev)
            per = -(-sh[0] // n)  # padded rows per rank, for the all-gather
            loc = rows(full, n, i)
            pad = torch.zeros((per,) + tuple(sh[1:]), dtype=dt, device=dev)
            pad[: loc.shape[0]].copy_(loc)
            shards[s] = pad
            del full
    else:
        params = bb.infer_params(ex, dev, i % tp)
        bb.reset(params)
    bufs = [torch.empty(cap, dtype=torch.uint8, device=dev) for _ in range(2)] if (g == 0 or not trainer) else None

    def gather(s):
        sh, dt = meta[s]
        loc = shards[s]
        out = torch.empty((loc.shape[0] * n,) + tuple(loc.shape[1:]), dtype=dt, device=dev)
        if n > 1:
            prepare.all_gather_single(out, loc, group=tgroup)
        else:
            out.copy_(loc)
        return out[: sh[0]]

    def step():
        works = [None] * len(plan)
        for k, (used, bucket) in enumerate(plan):
            if trainer:
                if g == 0 and k >= 2:
                    works[k - 2].wait()  # double buffering: slot k % 2 free again
                for c, offs in bucket:
                    for s, o in offs.items():
                        full = gather(s)  # every trainer: full_tensor()
                        if g == 0:
                            bufs[k % 2][o : o + sizes[s]].view(full.dtype).view(full.shape).copy_(full)
                if g == 0:
                    works[k] = dist.broadcast(bufs[k % 2][:used], src=0, group=bgroup, async_op=True)
            else:
                b = bufs[k % 2][:used]
                dist.broadcast(b, src=0, group=bgroup)
                for c, offs in bucket:
                    fulls = bp._fulls_in(b, offs, sizes, meta)
                    for sh in c.shards:
                        if sh.rank == i % tp:
                            prepare.pack_shard_into(sh, fulls, bb.as_bytes(params[sh.dst]), sh.offset)
        for w in works:
            if w is not None:
                w.wait()

    def barrier():
        dist.all_reduce(torch.zeros(1))  # CPU tensor: gloo, every process

    times = []
    for k in range(a["warmup"] + a["reps"]):
        bb.sync_dev(dev)
        barrier()
        t = time.perf_counter()
        step()
        bb.sync_dev(dev)
        barrier()
        if k >= a["warmup"]:
            times.append(time.perf_counter() - t)
    if trainer and g == 0:
        ctl.set_json("res/rank0", dict(bb.summary(times, 1), buckets=len(plan), bucket_bytes=cap))
    if not trainer:
        ctl.set_json("sum/rank0/%d" % i, dict(sums=bb.checksums(params)))
    barrier()


# --------------------------------------------------------------------------- the parent


def _phase(ctx, a, cfg, phase, timeout) -> dict:
    from wxfer.runtime import control

    procs = [ctx.Process(target=_child, args=("trainer", r, phase, a, cfg), daemon=True) for r in range(a["trainers"])]
    procs += [
        ctx.Process(target=_child, args=("receiver", j, phase, a, cfg), daemon=True)
        for j in range(a["replicas"] * a["tp"])
    ]
    for p in procs:
        p.start()
    ctl = control.Control(control.resolve_store(a["store"], False, a["timeout"]), a["name"], a["timeout"])
    m = a["replicas"] * a["tp"]
    t0 = time.monotonic()
    try:
        while True:
            if ctl.check("res/%s" % phase) and all(ctl.check("sum/%s/%d" % (phase, j)) for j in range(m)):
                res = ctl.get_json("res/%s" % phase, "result")
                res["sums"] = [ctl.get_json("sum/%s/%d" % (phase, j), "sums") for j in range(m)]
                for p in procs:
                    p.join(30)
                return res
            errs = {
                w: ctl.get("err/%s/%s" % (phase, w), "error").decode(errors="replace")
                for w in [f"trainer{r}" for r in range(a["trainers"])] + [f"receiver{j}" for j in range(m)]
                if ctl.check("err/%s/%s" % (phase, w))
            }
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if errs or dead or time.monotonic() - t0 > timeout:
                time.sleep(1.0 if not errs else 0.5)
                why = "; ".join(f"{w}: {e.strip().splitlines()[-1]}" for w, e in sorted(errs.items())) or (
                    f"{len(dead)} process(es) died" if dead else f"over {timeout:.0f} s"
                )
                return dict(error=why)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)


def run(args) -> dict:
    import multiprocessing as mp
    import torch

    for k, v in bb.NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    lay = dict(LAYOUTS[args.layout]) if args.layout else dict(trainers=2, replicas=1, tp=2, colocated=True)
    for k in ("trainers", "replicas", "tp"):
        if getattr(args, k):
            lay[k] = getattr(args, k)
    if args.colocated is not None:
        lay["colocated"] = args.colocated
    need = lay["trainers"] if lay["colocated"] else lay["trainers"] + lay["replicas"] * lay["tp"]
    need = max(need, lay["replicas"] * lay["tp"])
    if not args.dry_run and torch.cuda.device_count() < need:
        raise SystemExit(
            f"this layout needs {need} GPUs, this machine has {torch.cuda.device_count()} "
            "(--dry-run runs it on the CPU)"
        )
    models = args.models.split(",") if args.models else list(bb.CPU_MODELS if args.dry_run else bb.GPU_MODELS)
    configs = [dict(model=mo, quant=q) for mo in models for q in args.quant.split(",")]
    store, run = bb.run_store(args)  # (the store server lives as long as this reference)
    out = os.path.abspath(args.out) if args.out else None
    if out:
        os.makedirs(out, exist_ok=True)
    base = dict(
        lay,
        **run,
        watermark=args.watermark,
        out=out,
        bucket=bb.parse_size(args.bucket or ("1MiB" if args.dry_run else "1GiB")),
    )
    mach = bb.machine(args.dry_run)
    ctx = mp.get_context("spawn")
    results, t_start = [], time.perf_counter()
    for ci, cfg in enumerate(configs):
        r = dict(config=cfg, layout=lay)
        if time.perf_counter() - t_start > args.max_s:
            r["error"] = "not run: --max-s reached"
            results.append(r)
            continue
        a = dict(base, name="bs%d_%d" % (os.getpid(), ci))
        r["wxfer"] = _phase(ctx, a, cfg, "wxfer", args.config_timeout)
        if lay["colocated"] and not args.dry_run:
            r["rank0"] = dict(error="not run: NCCL refuses two ranks on one GPU (colocated layout)")
        else:
            r["rank0"] = _phase(ctx, a, cfg, "rank0", args.config_timeout)
        w, z = r["wxfer"], r["rank0"]
        if "seconds" in w and "seconds" in z:
            z["gbps"] = w["bytes"] / z["seconds"] / 1e9
            r["rank0_over_wxfer"] = z["seconds"] / w["seconds"]
            r["check"] = [x["sums"] for x in w["sums"]] == [x["sums"] for x in z["sums"]]
        if "seconds" in w:
            r["sim_over_measured"] = w["simulated"]["seconds"] / w["seconds"]
            r["wxfer_written"] = all(s["version"] == args.warmup + args.reps for s in w["sums"])
        results.append(r)
        print(
            f"[{time.perf_counter() - t_start:.0f} s] {cfg['model']} {cfg['quant']}: "
            + "; ".join(
                f"{k} {v['seconds']:.4f} s" if "seconds" in v else f"{k} {v.get('error')}"
                for k, v in (("wxfer", w), ("rank0", z))
            ),
            flush=True,
        )
        _write(out, results, mach)
    return dict(layout=lay, results=results, machine=mach, table=table(results))


def table(results: list) -> str:
    lines = [
        "| model | quant | senders | wxfer s | wxfer GB/s | rank0 s | rank0 / wxfer | simulated s | sim / measured "
        "| bottleneck (sim) | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        w, z, c = r.get("wxfer", {}), r.get("rank0", {}), r["config"]
        f = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"
        lines.append(
            f"| {c['model']} | {c['quant']} | {r['layout']['trainers']} | {f(w, 'seconds', '.4f')} | {f(w, 'gbps', '.1f')} "  # noqa: E501
            f"| {f(z, 'seconds', '.4f') if 'seconds' in z else z.get('error', '-')[:60]} "
            f"| {f(r, 'rank0_over_wxfer', '.2f')} | {f(w.get('simulated', {}), 'seconds', '.4f')} "
            f"| {f(r, 'sim_over_measured', '.2f')} | {w.get('simulated', {}).get('bottleneck', '-')} "
            f"| {('ok' if r.get('check') else 'MISMATCH') if 'check' in r else '-'} |"
        )
    return "\n".join(lines)


def _write(out, results, mach) -> None:
    if not out:
        return
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(results=results, machine=mach), f, indent=1, default=str)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(results) + "\n")
    with open(os.path.join(out, "machine.txt"), "w") as f:
        f.write(json.dumps(mach, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None, help="default: 2gpu's shape")
    ap.add_argument("--trainers", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo, fabric tcp, tiny models")
    ap.add_argument("--models", default=None, help="comma list (default qwen3-8b,qwen3-30b-a3b; dry run tiny,tiny-moe)")
    ap.add_argument("--quant", default="bf16,fp8")
    bb.step_options(ap, 3)
    ap.add_argument("--bucket", default=None, help="rank-0 bucket size (default 1GiB; dry run 1MiB)")
    ap.add_argument("--watermark", default="2GiB")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--config-timeout", type=float, default=400.0, help="one phase of one configuration")
    ap.add_argument("--max-s", type=float, default=560.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args)
    print(res["table"])
    if args.json:
        print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
