"""The host side of ``python -m wxfer calibrate``: the push's host and per-push costs,
fitted on the engine's traces of real pushes of the runtime's own task kinds.

A probe design is one small model pushed by a real `wxfer.Sender` (one trainer rank, this
process) to real Receivers (threads of this process) on the job's placement:

  same   the receivers on the trainer's GPU (colocated: cuda_ipc, the runtime writes packed
         tasks in place and copies small zero-copy tasks with batched copy kernels)
  gpu    the receivers on another GPU of this node (cuda_ipc writes through the engine)
  host   the receivers behind a network transport (fabric / verbs: engine writes); on the
         CPU the only placement (fabric tcp, as the CPU demo)

The designs differ in what the host cost columns see (wxfer.runtime.hostfit.COLUMNS): the
receivers' dtype (BF16: zero copy; FP8: packed or in place, quantized), TP 1 or 2 (twice the
pieces per task: row-parallel slices packed), coarse tasks (one FSDP2 unit per task, 7
parameters) or one task per component (1-3 parameters), copies on, off or only for the small
parameters (copies between engine writes), and packed tasks
through a send buffer (direct off) on the same GPU, a MoE layer (many pieces per parameter),
and on a GPU a model held in host memory (staged through an H2D copy).  All their samples
go into one non-negative least squares (hostfit.fit_designs), which reports how well they
separate the columns; a column no design exercised is reported unmeasured with the reason,
never 0.
"""

from __future__ import annotations

import os
import time

_TIMEOUT = 60.0
PLACEMENTS = ("same", "gpu", "host")


def default_placement(dev) -> str:
    """What calibrate measures when not told: the CPU: host (fabric); one GPU: same (the
    colocated job); several GPUs: gpu (a receiver on another GPU of the node)."""
    if dev.type != "cuda":
        return "host"
    import torch

    return "same" if torch.cuda.device_count() < 2 else "gpu"


def receiver_side(dev, placement: str) -> tuple:
    """(the receivers' device, their transport) for a placement."""
    import torch

    if placement not in PLACEMENTS:
        raise ValueError(f"calibrate: placement must be one of {PLACEMENTS}, got {placement!r}")
    if dev.type != "cuda":
        if placement != "host":
            raise ValueError(f"calibrate: placement {placement!r} needs a GPU; on the CPU it is 'host' (fabric)")
        return dev, "auto"
    if placement == "same":
        return dev, "auto"
    if placement == "gpu":
        n = torch.cuda.device_count()
        if n < 2:
            raise ValueError("calibrate: placement 'gpu' needs a second GPU on this node (found %d)" % n)
        return torch.device("cuda", (dev.index + 1) % n), "auto"
    from wxfer import _wxfer

    avail = _wxfer.backends()
    for t in ("verbs", "fabric"):
        if avail.get(t, (False, ""))[0]:
            return dev, t
    raise ValueError(
        "calibrate: placement 'host' needs a network transport here: "
        + "; ".join("%s: %s" % (t, avail.get(t, (False, "unknown"))[1]) for t in ("verbs", "fabric"))
    )


def designs_for(dev, placement: str, quick: bool) -> list:
    """The probe designs: name, model config, quant, tp, max_task_bytes, copy_max, offload."""
    from ..models import SMALL, TINY, TINY_MOE

    base = dict(SMALL if dev.type == "cuda" and not quick else TINY, num_hidden_layers=4)
    moe = dict(TINY_MOE, num_hidden_layers=2, num_experts=16)
    coarse = None  # the Sender's default bound: one FSDP2 unit per task
    out = [
        dict(name="bf16", cfg=base, quant=None, tp=1, max_task_bytes=coarse),
        dict(name="bf16-tp2", cfg=base, quant=None, tp=2, max_task_bytes=coarse),
        dict(name="fp8", cfg=base, quant="fp8", tp=1, max_task_bytes=coarse),
        dict(name="fp8-tp2-fine", cfg=base, quant="fp8", tp=2, max_task_bytes=1),
        dict(name="moe-fp8", cfg=moe, quant="fp8", tp=1, max_task_bytes=coarse),
    ]
    if placement == "same":  # (on the CPU only with the direct seams emulated: tests/test_calibrate_same.py)
        # the engine's zero-copy writes too (no copies), and packed tasks through a send buffer (direct off:
        # the packed kind's host columns, which a job on another GPU or host runs)
        out.append(dict(name="bf16-nocopy", cfg=base, quant=None, tp=1, max_task_bytes=coarse, copy_max=0))
        # copies between engine writes, as the rows' BF16 plans run (their large matrices zero copy, the
        # rest copied): a copy task's host time then falls into the next batch's gap.  Where every task
        # is copied (bf16), it is only in the push's tail, beside the push's own end work; on an H200
        # those tails alone gave 15.2 us per copy task against 3.5-8.4 us in the rows' own fits.
        h = base["hidden_size"]
        out.append(dict(name="bf16-mixed", cfg=base, quant=None, tp=1, max_task_bytes=coarse, copy_max=2 * h * h + 1))
        out.append(dict(name="fp8-packed", cfg=base, quant="fp8", tp=1, max_task_bytes=coarse, direct=False))
        out.append(dict(name="fp8-tp2-fine-packed", cfg=base, quant="fp8", tp=2, max_task_bytes=1, direct=False))
    if dev.type == "cuda":  # CPU-offloaded trainer: each source staged through an H2D copy
        out.append(dict(name="bf16-staged", cfg=base, quant=None, tp=1, max_task_bytes=coarse, offload=True))
    return out


# --------------------------------------------------------------------------- one Sender's traces


def trace_pushes(sender, pushes: int, copy_GBps=None, quant_GBps=None, between=None) -> tuple:
    """(a hostfit design dict, median push seconds, kinds) from `pushes` traced pushes of an
    existing `wxfer.Sender` after one warm-up push.  On CPU (the sender's device) a packed
    task's gap also holds its packing, taken out as the simulator charges it (the sources and
    the buffer at `quant_GBps` for a task with FP8 shards, else at `copy_GBps`); `between`
    (a callable, e.g. a training step) runs before each traced push, untimed."""
    import time as _t

    cpu = sender.device.type == "cpu"
    ops = {op.task: op for g in sender.program.groups for op in g}
    info = {
        t: (len(op.sources), sum(len(sh.pieces) for sh in op.shards if sh.kind != "scale")) for t, op in ops.items()
    }
    moved = {t: (sum(p.numel() * p.element_size() for _, p in op.sources) + op.nbytes) for t, op in ops.items()}
    fp8 = {t: any(sh.kind == "fp8" for sh in op.shards) for t, op in ops.items()}
    work = {}
    if cpu and copy_GBps:
        for t in ops:
            rate = quant_GBps if fp8[t] and quant_GBps else copy_GBps
            work[t] = moved[t] / (rate * 1e9)
    sender.push()  # warm-up
    kinds = sender.task_kinds()  # after a push: zero copy as decided there
    steps = getattr(sender, "steps", None)
    if steps is not None and hasattr(steps, "task_order"):
        order = steps.task_order()  # as the pushes run them (a task written in place may go first)
    else:  # a stand-in Sender: the plan's order
        order = [[op.task for op in g] for g in sender.program.groups]
    traced, push_s = [], []
    for _ in range(pushes):
        if between is not None:
            between()
        if sender.device.type == "cuda":
            import torch

            torch.cuda.synchronize(sender.device)
        sender.trace(clear=True)
        t0 = _t.perf_counter_ns()
        sender.push()
        t1 = _t.perf_counter_ns()
        traced.append((t0, t1, sender.trace()))
        push_s.append((t1 - t0) / 1e9)
    sizes = {t: op.nbytes for t, op in ops.items()}  # the zero-copy batches are cut by bytes too
    d = dict(pushes=traced, order=order, kinds=kinds, info=info, work=work, sizes=sizes, moved=moved, fp8=fp8)
    push_s.sort()
    return d, push_s[len(push_s) // 2], kinds


def host_costs(
    sender,
    pushes: int = 5,
    copy_GBps: float | None = None,
    write_GBps: float | None = None,
    quant_GBps: float | None = None,
    between=None,
) -> dict:
    """The push's host and fixed costs fitted on the engine's trace of `pushes` pushes of an
    existing `wxfer.Sender` (after one warm-up push), as the runtime submits (wxfer.runtime.
    hostfit): per zero-copy task and per submit_prepared batch, per packed task, parameter and
    piece, before the first task (the begin stamps) and after the last write (the end stamps);
    with `write_GBps`, the cost per write.  On a GPU, the device time of the packed tasks from
    the same trace (``trace_device``) is reported beside it.  This is the in-run fit of one
    model (bench_baselines' ``fitted_s``): its columns are only as separate as that model's
    tasks make them; calibrate's probe designs (measure_host) separate them."""
    from ..zerocopy import ZERO_COPY_BATCH
    from ..runtime import hostfit

    d, med, kinds = trace_pushes(sender, pushes, copy_GBps, quant_GBps, between)
    out = hostfit.fit_designs([d], ZERO_COPY_BATCH, write_GBps)
    if sender.device.type != "cpu":
        packed = {t for t, k in kinds.items() if k in ("packed", "staged")}
        out["trace_device"] = hostfit.device_times(d["pushes"], packed, d["moved"], d["fp8"])
    out.update(
        host_push_s=med,
        host_tasks=len(d["order"][0]) if len(d["order"]) == 1 else sum(len(g) for g in d["order"]),
        host_kinds={k: sum(1 for v in kinds.values() if v == k) for k in sorted(set(kinds.values()))},
    )
    return out


def hostfit_keys() -> tuple:
    """The Calibration fields host_costs() measures."""
    return (
        "host_task_s",
        "host_param_s",
        "host_piece_s",
        "host_zc_task_s",
        "host_zc_batch_s",
        "push_begin_s",
        "push_end_s",
        "begin_fence_s",
    )  # and host_direct_task_s / host_copy_task_s where the Sender had such tasks (else absent)


# --------------------------------------------------------------------------- the probe designs


def _receivers(d: dict, rdev, transport: str, addr: str, name: str) -> list:
    """The design's receivers (one replica of TP d["tp"]) constructed in threads: [(thread, box)]."""
    from ..models import inference_params, preset_for
    from ..runtime.receiver import Receiver
    from ..testing import in_thread

    cfg, tp = d["cfg"], d["tp"]
    preset = preset_for(cfg)
    boxes = []
    for r in range(tp):
        params = inference_params(cfg, tp, r, d["quant"], device=rdev)
        boxes.append(
            in_thread(
                Receiver,
                params,
                mapping=preset.name,
                store=addr,
                replica=0,
                rank=r,
                tp=tp,
                replicas=1,
                transport=transport,
                name=name,
                timeout=_TIMEOUT,
            )
        )
    return boxes


def probe(d: dict, dev, rdev, transport: str, addr: str, pushes: int, kernels: dict, inspect=None) -> tuple:
    """Run one design: receivers (threads) on `rdev`, a Sender here; (hostfit design, summary).
    inspect: a callable given the Sender before it is closed; its result is summary["inspect"]."""
    import torch

    from ..models import preset_for, train_model
    from ..runtime.sender import Sender

    cfg = d["cfg"]
    name = "calib%d-%s" % (os.getpid(), d["name"])
    preset = preset_for(cfg)
    boxes = _receivers(d, rdev, transport, addr, name)
    model = train_model(cfg, dtype=torch.bfloat16)  # in the receivers' dtype (BF16 training weights)
    for p in model.parameters():
        p.requires_grad_(False)
    if d.get("offload"):  # held in pinned host memory, stage 2 on the GPU: staged through H2D copies
        for p in model.parameters():
            p.data = p.data.pin_memory()
    else:
        model = model.to(dev)
    kw = {} if d.get("copy_max") is None else dict(copy_max=d["copy_max"])
    if d.get("direct") is not None:
        kw["direct"] = d["direct"]
    sender = None
    recvs = []
    try:
        sender = Sender(
            model,
            mapping=preset,
            store=addr,
            name=name,
            timeout=_TIMEOUT,
            device=dev,
            transport=transport,
            max_task_bytes=d["max_task_bytes"],
            **kw,
        )
        for th, box in boxes:
            th.join(_TIMEOUT)
            if "error" in box:
                raise box["error"]
            recvs.append(box["value"])
        got, med, kinds = trace_pushes(sender, pushes, kernels.get("copy_GBps"), kernels.get("quant_GBps"))
        summ = dict(
            push_s=med,
            tasks=len(kinds),
            kinds={k: sum(1 for v in kinds.values() if v == k) for k in sorted(set(kinds.values()))},
            params_per_task=sum(n for n, _ in got["info"].values()) / max(1, len(got["info"])),
            pieces_per_task=sum(n for _, n in got["info"].values()) / max(1, len(got["info"])),
        )
        if inspect is not None:
            summ["inspect"] = inspect(sender)
        return got, summ
    finally:
        if sender is not None:
            sender.close()
        for th, box in boxes:
            th.join(5)  # a receiver still waiting (the Sender failed early) ends on its own timeout: a daemon
            if "value" in box and box["value"] not in recvs:
                recvs.append(box["value"])
        for r in recvs:
            r.close()


def measure_host(dev, kernels: dict, quick: bool, placement: str, write_GBps=None, log=print) -> dict:
    """Host seconds per task / parameter / piece of each kind and per push, fitted on the
    traces of every probe design (designs_for) on `placement`, one fit over all of them."""
    from datetime import timedelta

    import torch.distributed as dist

    from ..zerocopy import ZERO_COPY_BATCH
    from ..runtime import control, hostfit

    rdev, transport = receiver_side(dev, placement)
    port = control.free_port()
    store = dist.TCPStore(  # noqa: F841 -- the store server lives as long as this reference
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=_TIMEOUT), wait_for_workers=False
    )
    addr = "127.0.0.1:%d" % port
    pushes = 3 if quick else (8 if dev.type == "cuda" else 5)
    designs, summary, errors = [], {}, {}
    for d in designs_for(dev, placement, quick):
        t0 = time.perf_counter()
        try:
            got, summ = probe(d, dev, rdev, transport, addr, pushes, kernels)
        except Exception as e:  # noqa: BLE001 -- the other designs stand; the columns it alone held are unmeasured
            errors[d["name"]] = "%s: %s" % (type(e).__name__, e)
            log("calibrate: probe %s failed: %s" % (d["name"], errors[d["name"]]))
            continue
        designs.append(got)
        summary[d["name"]] = dict(summ, seconds=time.perf_counter() - t0)
        log(
            "calibrate: probe %-13s %3d tasks (%s), %.1f params and %.1f pieces per task, push %.2f ms"
            % (
                d["name"],
                summ["tasks"],
                ", ".join("%d %s" % (n, k) for k, n in summ["kinds"].items()),
                summ["params_per_task"],
                summ["pieces_per_task"],
                summ["push_s"] * 1e3,
            )
        )
    if not designs:
        raise RuntimeError("every probe design failed: %s" % errors)
    out = hostfit.fit_designs(designs, ZERO_COPY_BATCH, write_GBps)
    for name, why in errors.items():  # say which design's failure may have left a column unmeasured
        for k in out["host_unmeasured"]:
            out["host_unmeasured"][k] += "; probe %s failed: %s" % (name, why[:200])
    out.update(host_probes=summary, host_probe_errors=errors, placement=placement, receiver_device=str(rdev))
    return out
