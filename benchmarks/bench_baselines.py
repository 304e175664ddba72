"""wxfer against the common approaches, side by side on the same devices in one run (issue 7).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python benchmarks/bench_baselines.py --out benchmarks/baselines --json      # 2 GPUs
    python benchmarks/bench_baselines.py --layouts colocated --out DIR --json        # 1 GPU, ~4 min
    python benchmarks/bench_baselines.py --dry-run --json                           # CPU, tiny models

Modules: the baselines' steps in bb_patterns.py, the parent's supervisor (spawn, collect,
restart after a failure: the one retry loop) in common/supervise.py (shared with
bench_ckpt_engine.py); what the other benchmarks import of these models, parameters and
the machine description in common/baselines.py.

Trainers (bb_fsdp.py): plain tensors, or FSDP2 on transformers' own model classes (with
CPU offload for one row); wxfer is measured for two watermarks (peak extra memory, host
time per task and per parameter), and with --copy-max once more per Sender(copy_max=...)
value at the first watermark; tables in bb_report.py.

Two processes: a trainer (rank 0, GPU 0) holding a model with Hugging Face names and
random weights of the real shapes, and one inference worker (rank 1, GPU 1 "disagg", or
GPU 0 as well "colocated") holding the inference layout of the mapping preset (vLLM
names, fused qkv / gate_up / experts, BF16 or FP8 with block scales).  Per configuration
(model x quantization x layout), after warm-up, the median of --reps steps of:

  link      the link bound: a raw copy of the bytes the inference worker must receive
            (GPU 0 -> GPU 1 peer copy in one process; on one GPU an on-device copy), in
            1 GiB pieces;
  wxfer     Sender.push() (the plan, the pipeline, one-sided writes through the engine);
  rank0     the rank-0 pattern (verl, slime, OpenRLHF, AReaL): full_tensor() on the
            trainer, buckets of about 1 GiB (double-buffered) broadcast over NCCL (CPU:
            gloo; colocated: one shared CUDA IPC bucket pair, since NCCL refuses two ranks on
            one GPU) to the inference rank, which copies every tensor of a bucket into its
            own layout (fusion, TP slice, FP8 quantization on the inference side);
  per-tensor one call (a pickled message) and one transfer (a broadcast; colocated: a CUDA
            IPC handle) per training tensor; the inference rank copies into its layout once
            a fused parameter's sources are all in.

Every method ends with the inference worker's memory checked against wxfer's (per-parameter
byte sums, memory reset to 0xFF before each method).  Outputs in --out: results.json,
table.md, chart.png, trace-<config>.json (wxfer's per-stage Chrome trace of one step),
machine.txt; the table is printed; --json prints one JSON object last.

A configuration whose processes fail or exceed --config-timeout is reported as an error
and the run goes on with the next one (fresh processes); --max-s bounds the whole run, and
results are written after every configuration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import bb_fsdp
import bb_memory
import bb_report
from bb_patterns import _STATE, _Link, _per_tensor, _rank0
from bb_predict import calibrations
from common import supervise
from common.baselines import (  # noqa: F401 -- ROOT: the checkout, for the children's sys.path
    CPU_MODELS,
    GPU_MODELS,
    NO_MULTICAST,
    ROOT,
    cfg_name,
    checksums,
    copy_through,
    expanded,
    infer_params,
    machine,
    model_spec,
    parse_size,
    reset,
    run_store,
    step_options,
    summary,
    sync_dev,
    train_params,
)

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

METHODS = ("link", "wxfer", "rank0", "per-tensor")
GiB = 1 << 30


# --------------------------------------------------------------------------- models


class _Model:
    """What wxfer.Sender needs of a model: named_parameters() (plain tensors: one trainer rank)."""

    def __init__(self, params: dict):
        self._p = params

    def named_parameters(self):
        return list(self._p.items())


# --------------------------------------------------------------------------- the two processes


def _proc(rank: int, a: dict, configs: list, q) -> None:
    supervise.child(_proc_main, rank, q, a, configs)


def _proc_main(rank: int, a: dict, configs: list) -> None:
    import torch
    from wxfer.runtime import control

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    store = control.resolve_store(a["store"], False, a["timeout"])
    ctl = control.Control(store, a["name"], a["timeout"])
    gpu = not a["dry_run"]
    if not gpu:
        torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors shared by name
    for ci, cfg in configs:
        layout = cfg["layout"]
        if gpu:
            dev = torch.device("cuda", 0 if (rank == 0 or layout == "colocated") else 1)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        ctl.set("at/%d/%d" % (ci, rank), b"setup")
        _STATE.clear()
        res = _run_config(rank, ci, cfg, a, dev, store, ctl)
        ctl.set("at/%d/%d" % (ci, rank), b"done")
        if rank == 0:
            ctl.set_json("res/%d" % ci, res)
        _STATE.clear()
        import gc

        gc.collect()  # FSDP2 modules hold reference cycles: free them now
        if gpu:
            torch.cuda.empty_cache()


def _run_config(rank, ci, cfg, a, dev, store, ctl):
    import torch
    import torch.distributed as dist

    gpu = dev.type == "cuda"
    quant = "fp8" if cfg["quant"] == "fp8" else None
    shared = cfg["layout"] == "colocated"  # shared-memory handles instead of broadcasts
    conf, preset = model_spec(cfg["model"])
    ex = expanded(preset, conf, quant)
    dest_bytes = ex.dest_bytes(0)
    methods = [m for m in a["methods"] if (ci, m) not in {tuple(x) for x in a["skip"]}]
    res = dict(config=cfg, dest_bytes=dest_bytes, methods={}, errors={})
    trainer = rank == 0
    kind = cfg.get("trainer", "plain")
    if kind != "plain":  # the baselines are defined for plain tensors
        methods = [m for m in methods if m not in ("rank0", "per-tensor")]
        if kind == "fsdp2-offload":
            methods.insert(1, "h2d")
    t0 = time.perf_counter()
    a["_cfg"] = cfg  # bb_fsdp.simulated: the layout; the bounds measured for this configuration only
    a.pop("_h2d_GBps", None)
    name = "%s_%d" % (a["name"], ci)  # fresh per attempt: no stale keys after a retry
    model = stepper = None
    group = False
    if trainer:
        params, model, stepper, group = _make_trainer(res, cfg, kind, conf, preset, quant, ex, dev, store, name, a)
        res["train_bytes"] = sum(t.numel() * t.element_size() for t in params.values())
        res["train_tensors"] = len(params)
    else:
        params = infer_params(ex, dev)
    sync_dev(dev)
    res["alloc_s"] = time.perf_counter() - t0
    sums = {}

    def mark(m):
        ctl.set("at/%d/%d" % (ci, rank), m.encode())

    # ---- 1. link bound (trainer process only)
    if "link" in methods and trainer:
        mark("link")
        dst_dev = torch.device("cuda", 1 if cfg["layout"] == "disagg" else 0) if gpu else dev
        piece = min(GiB, dest_bytes)
        src = torch.empty(piece, dtype=torch.uint8, device=dev).fill_(7)
        dst = torch.empty(piece, dtype=torch.uint8, device=dst_dev)
        times = []
        for i in range(a["warmup"] + a["reps"]):
            sync_dev(dev), sync_dev(dst_dev)
            t = time.perf_counter()
            copy_through(dst, src, dest_bytes)
            sync_dev(dev), sync_dev(dst_dev)
            if i >= a["warmup"]:
                times.append(time.perf_counter() - t)
        res["methods"]["link"] = summary(times, dest_bytes)
        a["_link_GBps"] = res["methods"]["link"]["gbps"]
        del src, dst
    if "h2d" in methods and trainer and gpu:  # the bound of a CPU-offloaded trainer
        mark("h2d")
        nb = res["train_bytes"]
        res["methods"]["h2d"] = summary(
            bb_fsdp.copy_bound(nb, torch.device("cpu"), dev, a["warmup"], a["reps"], pinned=True), nb
        )
        a["_h2d_GBps"] = res["methods"]["h2d"]["gbps"]  # the simulator's H2D rate (bb_fsdp.simulated)

    # ---- 2. wxfer: a fresh Sender and Receiver per watermark (bb_fsdp)
    if "wxfer" in methods:
        mark("wxfer")
        if trainer:
            tpath = os.path.join(a["out"], "trace-%s.json" % cfg_name(cfg)) if a.get("out") else None
            byw, bycm = bb_fsdp.wxfer_trainer(model, stepper, preset, store, ctl, name, ci, a, dev, summary, tpath)
            head = byw[str(a["watermarks"][0])]
            res["wxfer_by_watermark"] = byw
            if bycm:
                res["wxfer_by_copy_max"] = bycm  # the sweep: the receiver's checksums are after its last
            res["methods"]["wxfer"] = {k: head[k] for k in ("seconds", "best", "times", "gbps")}
            res["wxfer_tasks"], res["wxfer_transport"] = head["tasks"], head["transport"]
            res["wxfer_bytes_per_step"] = head["bytes_per_step"]
            sums["wxfer"] = ctl.get_json("sum/%d/wxfer" % ci, "the inference rank's checksums after wxfer")
        else:
            ctl.set_json(
                "sum/%d/wxfer" % ci,
                bb_fsdp.wxfer_receiver(params, preset, store, ctl, name, ci, a, dev, reset, checksums),
            )
    if group:
        dist.destroy_process_group()

    # ---- 3, 4: the baselines share one process group (gloo; NCCL for CUDA data when disagg)
    base = [m for m in methods if m in ("rank0", "per-tensor")]
    if base:
        backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"
        mark("baselines-setup")
        if dist.is_initialized():  # left by a configuration that failed
            dist.destroy_process_group()
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg/%s" % name, store),
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=a["timeout"]),
        )
        link = _Link(rank)
        try:
            sizes = None
            if trainer:
                sizes = {n: t.numel() * t.element_size() for n, t in params.items()}
            sizes = link.obj(sizes)
            meta = link.obj({n: (tuple(t.shape), t.dtype) for n, t in params.items()} if trainer else None)
            for m in base:
                mark(m)
                if not trainer and os.environ.get("BB_FAIL_METHOD") == m:  # tests: a failing method
                    raise RuntimeError(f"injected failure in {m}")
                fn = _rank0 if m == "rank0" else _per_tensor
                if not trainer:
                    reset(params)
                link.barrier()
                times = []
                reps = a["reps"] if m == "rank0" else min(a["reps"], a["per_tensor_reps"])
                for i in range(a["warmup"] + reps):
                    link.barrier()
                    t = time.perf_counter()
                    fn(link, ex, params, sizes, meta, dev, a, shared, i)
                    sync_dev(dev)
                    link.barrier()
                    if i >= a["warmup"]:
                        times.append(time.perf_counter() - t)
                got = link.obj(checksums(params) if not trainer else None, src=1)
                if trainer:
                    res["methods"][m] = summary(times, dest_bytes)
                    sums[m] = got
        finally:
            dist.destroy_process_group()
    if trainer and "wxfer" in sums:
        res["checks"] = {m: (v == sums["wxfer"]) for m, v in sums.items() if m != "wxfer"}
        res["checks"]["wxfer_written"] = bool(sums["wxfer"]) and all(
            v != 0xFF * n for v, n in zip(sums["wxfer"], _sizes_sorted(ex))
        )
        # the receiver holds the mapping's reference bytes of the trainer's final weights
        res["checks"]["reference"] = (
            bb_fsdp.reference_checksums(_ex_of(ex, params, preset, conf, quant), params, dev) == sums["wxfer"]
        )
    return res


def _ex_of(ex, params: dict, preset, conf, quant):
    """`ex` (the mapping over the checkpoint's names), or the same mapping over the trainer's
    own names where they differ (transformers 5's fused experts): the same destinations."""
    srcs = {pc.src for c in ex.components for sh in c.shards for pc in sh.pieces}
    if set(params) <= srcs:
        return ex
    from wxfer.mapping import Layout, expand

    return expand(preset.rules, {n: tuple(t.shape) for n, t in params.items()}, Layout(1, False, quant), conf)


def _make_trainer(res, cfg, kind, conf, preset, quant, ex, dev, store, name, a):
    """(training tensors by name, model for the Sender, training stepper, own process group?)
    of the configuration's trainer; FSDP2 on transformers' class falls back to plain tensors
    (with a printed note) when the mapping cannot send that class's parameters."""
    if kind != "plain":
        gaps = bb_fsdp.mapping_gaps(preset, conf, quant, ex.dest[0])
        if gaps:
            note = (
                f"{cfg_name(cfg)}: transformers' {conf['architectures'][0]} is not sent by this mapping "
                f"({'; '.join(gaps[:3])}): the plain-tensor trainer instead"
            )
            print("note:", note, flush=True)
            res["note"], kind = note, "plain"
    res["trainer_used"] = kind
    if kind == "plain":
        params = train_params(preset, conf, dev)
        res["train_step"] = "in-place"
        return params, _Model(params), bb_fsdp.Trainer(_Model(params), "in-place", dev, conf["vocab_size"]), False
    bb_fsdp.init_group(store, name, dev.type == "cuda", a["timeout"])
    model = bb_fsdp.fsdp2_model(conf, dev, kind == "fsdp2-offload")
    res["train_step"] = bb_fsdp.train_kind(cfg, conf["architectures"][0], a["dry_run"])
    from torch.distributed.tensor import DTensor

    params = {n: (p._local_tensor if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
    return params, model, bb_fsdp.Trainer(model, res["train_step"], dev, conf["vocab_size"]), True


def _sizes_sorted(ex):
    return [d.nbytes for _, d in sorted(ex.dest[0].items())]


# --------------------------------------------------------------------------- the parent


# the default configurations (each layout): (model, quant, trainer)
GPU_CONFIGS = [
    ("qwen3-8b", "bf16", "plain"),
    ("qwen3-8b", "bf16", "fsdp2"),
    ("qwen3-8b", "fp8", "fsdp2"),
    ("qwen3-1.7b", "bf16", "fsdp2"),
    ("qwen3-1.7b", "bf16", "fsdp2-offload"),
    ("qwen3-30b-a3b", "bf16", "fsdp2"),
    ("qwen3-30b-a3b", "fp8", "fsdp2"),
]
CPU_CONFIGS = [(m, q, "plain") for m in CPU_MODELS for q in ("bf16", "fp8")]
CPU_EXTRA = [("tiny", "bf16", "fsdp2"), ("tiny-moe", "fp8", "fsdp2")]  # colocated only


def configs_for(args, layouts) -> list:
    """The curated list, or the cross product of what --models / --quant / --trainers name."""
    if args.models or args.quant or args.trainers:
        models = args.models.split(",") if args.models else list(CPU_MODELS if args.dry_run else GPU_MODELS)
        quants = (args.quant or "bf16,fp8").split(",")
        trainers = (args.trainers or "plain").split(",")
        return [
            dict(model=m, quant=q, layout=l, trainer=t)
            for l in layouts
            for t in trainers
            for m in models
            for q in quants
        ]
    out = []
    for l in layouts:
        base = CPU_CONFIGS + (CPU_EXTRA if l == "colocated" else []) if args.dry_run else GPU_CONFIGS
        out += [dict(model=m, quant=q, layout=l, trainer=t) for m, q, t in base]
    if args.curated:  # the curated configurations of these models only
        keep = set(args.curated.split(","))
        out = [c for c in out if c["model"] in keep]
    return out


def table(results: list) -> str:
    return bb_report.table(results, cfg_name)


def chart(results: list, path: str) -> bool:
    return bb_report.chart(results, path, cfg_name)


def _copy_maxes(v: str) -> list:
    """--copy-max: the comma list of Sender(copy_max=...) values, each checked here (a size,
    0, "all" or -1), kept as typed (their results' keys)."""
    from wxfer.runtime.inplace import copy_max

    out = [x.strip() for x in v.split(",") if x.strip()]
    for x in out:
        try:
            copy_max(x)
        except ValueError as e:
            raise SystemExit(f"--copy-max {x!r}: {e}") from None
    return out


def _mark_of(ctl, ci: int, rank: int) -> str:
    """The last step rank `rank` marked in configuration `ci` ("-": none)."""
    key = "at/%d/%d" % (ci, rank)
    return ctl.get(key, "at").decode() if ctl.check(key) else "-"


def _why(f, procs) -> str:
    """What a failed configuration says: the children's errors (last lines) when they came
    first; else a timeout or the exit codes, or the full error a child reported meanwhile."""
    if f.reported:
        return "; ".join(f"rank {k}: {v.strip().splitlines()[-1]}" for k, v in sorted(f.errs.items(), reverse=True))
    why = (
        "timed out"
        if f.over
        else "a process exited (exit codes %s; -9: killed, e.g. out of host memory)" % [x.exitcode for x in procs]
    )
    for r, err in f.errs.items():
        why = f"rank {r}: {err}"
    return why


def _refused(ci: int, configs: list, args, a: dict, results: list) -> bool:
    """A colocated GPU configuration that would not fit GPU 0's free memory (bb_memory): its
    one-line refusal printed and recorded as its result instead of an OOM trace."""
    cfg = configs[ci]
    if args.dry_run or cfg["layout"] != "colocated":
        return False
    if "_free" not in a:
        a["_free"] = parse_size(args.gpu_free) if args.gpu_free else bb_memory.gpu_free(0)
    parts = bb_memory.need(cfg, a["watermarks"])
    why = bb_memory.refusal(cfg_name(cfg), parts, a["_free"])
    if why is None:
        return False
    print(why, flush=True)
    results[ci] = dict(config=cfg, methods={}, errors={}, error=why, memory=dict(parts, free=a["_free"]))
    return True


def run(args) -> dict:
    import multiprocessing as mp
    import signal

    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    signal.signal(signal.SIGTERM, supervise._kill_children)
    layouts = args.layouts.split(",") if args.layouts else ["disagg", "colocated"]
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; known: {METHODS}")
    # the disaggregated layout first (the headline), dense before MoE
    configs = configs_for(args, layouts)
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
    store, run = run_store(args)
    a = dict(
        run,
        name="bb%d" % os.getpid(),
        methods=methods,
        per_tensor_reps=args.per_tensor_reps,
        bucket=parse_size(args.bucket or ("1MiB" if args.dry_run else "1GiB")),
        watermarks=[parse_size(args.watermark), parse_size(args.watermark2)],
        copy_max=_copy_maxes(getattr(args, "copy_max", "")),
        out=os.path.abspath(out) if out else None,
        skip=[],
        transport_options=dict(kv.split("=", 1) for kv in args.transport_options.split(",") if kv),
    )
    # the rows that do not fit one GPU colocated: said up front, skipped (bb_memory)
    results: list = [None] * len(configs)
    todo = [ci for ci in range(len(configs)) if not _refused(ci, configs, args, a, results)]
    mach = machine(args.dry_run)
    # predicted_s: a calibration made before any configuration runs (bb_fsdp.predicted), by placement
    a["calibrations"] = calibrations(args, layouts, out)
    mach["calibrations"] = {k: v.get("file") or v.get("error") for k, v in a["calibrations"].items()}
    t_start = time.perf_counter()

    def got(ctl, ci):
        r = ctl.get_json("res/%d" % ci, "result")
        r["dry_run"] = args.dry_run
        if results[ci]:  # errors of methods skipped on an earlier attempt
            r["errors"] = dict(results[ci].get("errors", {}), **r.get("errors", {}))
        results[ci] = r
        _write(out, results, mach, args)
        print(
            f"[{time.perf_counter() - t_start:.0f} s] {cfg_name(configs[ci])}: "
            + ", ".join(f"{m} {v['seconds']:.4f} s" for m, v in r["methods"].items()),
            flush=True,
        )

    def failed(ctl, ci, why, procs, _stacks):
        # where each rank was (its last mark): which step a process left
        marks = [_mark_of(ctl, ci, r) for r in (0, 1)]
        why += f" [rank 0 at {marks[0]}, rank 1 at {marks[1]}]"
        at = marks[0] if marks[0] != "-" else False
        if at in METHODS and at != "link" and [ci, at] not in a["skip"]:
            # skip the failing method and retry the configuration with fresh processes
            a["skip"].append([ci, at])
            prev = results[ci] or dict(config=configs[ci], methods={}, errors={})
            prev.setdefault("errors", {})[at] = why.strip().splitlines()[-1] if why.strip() else why
            results[ci] = prev
        else:
            results[ci] = dict(config=configs[ci], methods={}, errors={}, error=why)
            todo.remove(ci)
        print(
            f"{cfg_name(configs[ci])}: {at or 'setup'} failed: {why.strip().splitlines()[-1] if why.strip() else why}",
            flush=True,
        )

    supervise.run_attempts(
        mp.get_context("spawn"),
        _proc,
        a,
        store,
        "bb%d" % os.getpid(),
        args.timeout,
        todo,
        lambda todo: [(ci, configs[ci]) for ci in todo],
        got,
        lambda item_s: item_s > args.config_timeout or time.perf_counter() - t_start > args.max_s,
        lambda ctl, f, procs, _s: _why(f, procs),
        failed,
        more=lambda: time.perf_counter() - t_start < args.max_s,
        settle=1.0,
        poll=0.2,
        stop_wait=5,
        kill=False,
    )
    for ci in todo:
        results[ci] = results[ci] or dict(config=configs[ci], methods={}, errors={}, error="not run: --max-s reached")
    # merge errors recorded before a retry into the retried result
    res = dict(
        machine=mach, results=results, table=table(results), total_s=time.perf_counter() - t_start, dry_run=args.dry_run
    )
    _write(out, results, mach, args)
    return res


def _write(out, results, mach, args) -> None:
    if not out:
        return
    done = [r for r in results if r is not None]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(machine=mach, results=done, dry_run=args.dry_run, argv=sys.argv[1:]), f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(done) + "\n")
    with open(os.path.join(out, "machine.txt"), "w") as f:
        for k, v in mach.items():
            f.write(f"{k}: {v}\n")
    chart(done, os.path.join(out, "chart.png"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: tiny models, gloo instead of NCCL, CPU tensors, fabric transport (seconds)",
    )
    ap.add_argument(
        "--curated", default=None, help="comma list of models: the curated configurations of these models only"
    )
    ap.add_argument("--models", default=None, help="comma list (default qwen3-8b,qwen3-30b-a3b; dry run tiny,tiny-moe)")
    ap.add_argument("--quant", default=None, help="comma list of bf16, fp8 (inference side)")
    ap.add_argument(
        "--trainers",
        default=None,
        help="comma list of plain, fsdp2, fsdp2-offload (with --models or "
        "--quant: their cross product; default: the curated list)",
    )
    ap.add_argument(
        "--layouts",
        default=None,
        help="disagg (GPU 0 -> GPU 1), colocated (one GPU); default both "
        "(dry run: separate CPU processes; colocated shares memory)",
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    step_options(ap, 5, " per method")
    ap.add_argument(
        "--per-tensor-reps",
        type=int,
        default=1,
        help="timed steps of the per-tensor pattern (slow: one call per tensor, 18,867 on the MoE)",
    )
    ap.add_argument(
        "--bucket",
        default=None,
        help="rank-0 bucket size, grown to the largest fused parameter (default 1GiB; dry run 1MiB)",
    )
    ap.add_argument("--watermark", default="2GiB", help="wxfer Sender watermark (the timed steps)")
    ap.add_argument("--watermark2", default="256MiB", help="a second watermark: peak memory and steps again")
    ap.add_argument(
        "--copy-max",
        default="",
        help="comma list of Sender(copy_max=...) values (e.g. 0,1MiB,32MiB,all): after the watermarks, one "
        "fresh Sender each at the first watermark, --reps steps (results' wxfer_by_copy_max); default none",
    )
    ap.add_argument(
        "--gpu-free",
        default=None,
        help="free bytes of GPU 0 for the colocated rows' memory check (bytes or a size such as 75GiB; "
        "default: nvidia-smi's figure)",
    )
    ap.add_argument("--transport-options", default="", help="k=v,k=v: the trainers' transport options (e.g. streams=1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="every wait inside a configuration")
    ap.add_argument("--config-timeout", type=float, default=240.0, help="one configuration, all methods")
    ap.add_argument("--max-s", type=float, default=560.0, help="the whole run (results so far are written)")
    ap.add_argument("--out", default=None, help="directory for results.json, table.md, chart.png, traces")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument(
        "--calibration",
        default="auto",
        help="predicted_s from this calibrate file (python -m wxfer calibrate --json --out FILE, its placement "
        "same for colocated rows, gpu for disagg ones); auto (default): one calibrate per placement at the start, "
        "in its own process; none: no prediction (fitted_s, the in-run fit, is reported either way)",
    )
    args = ap.parse_args(argv)
    res = run(args)
    print(res["table"])
    if args.dry_run:
        print("(CPU dry run: tiny models over gloo / fabric tcp on this machine; these are not GPU figures)")
    if args.json:
        print(json.dumps(dict(res, table=None)))
    # a row skipped for memory (bb_memory: said up front) is not a failure
    ok = all(
        r.get("memory") or (r.get("methods") and not r.get("error") and not r.get("errors")) for r in res["results"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
