"""The trainers and the wxfer measurement of bench_baselines.py (issue 13.5).

Trainers (rank 0 of bench_baselines' two processes):
  plain          plain tensors with Hugging Face names (bench_baselines.train_params);
  fsdp2          transformers' own model class (Qwen3ForCausalLM, Qwen3MoeForCausalLM) built
                 from the config with random weights, ``fully_shard`` per decoder layer, then
                 the model, on a 1-rank mesh of its own process group;
  fsdp2-offload  the same with ``CPUOffloadPolicy`` (sharded parameters in pinned host memory).
Between two pushes the trainer trains: one forward/backward on 64 tokens and an SGD step
("sgd"), or, where that does not fit beside a colocated receiver (MoE) or would time the
CPU (offload), an in-place update of every parameter ("in-place", what optimizer.step()
does to the memory).  When the mapping leaves parameters of transformers' class unmatched
(fused 3-D experts before wxfer.mapping knows them), the configuration falls back to the
plain trainer and says so.

wxfer is measured once per watermark (fresh Sender and Receiver each): median push of
the timed steps, the peak extra GPU memory of a push (max_memory_allocated during it minus
what was allocated before), and the host time per task and per parameter from the engine
trace of the last step; then, with --copy-max, once per value of Sender(copy_max=...) at the
first watermark (the same figures, as many timed steps as the headline).
"""

from __future__ import annotations

import os
import time

import bb_profile

HF_CLASSES = {
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
GiB = 1 << 30


def hf_class(conf: dict):
    """(model class, config object) of transformers for a benchmark config dict."""
    import transformers

    arch = conf["architectures"][0]
    cfg_name, cls_name = HF_CLASSES[arch]
    kw = {k: v for k, v in conf.items() if k != "architectures"}
    return getattr(transformers, cls_name), getattr(transformers, cfg_name)(**kw)


def mapping_gaps(preset, conf: dict, quant, want_dest: dict) -> list[str]:
    """Why the mapping cannot send transformers' class for this config (empty: it can):
    training parameters no rule uses, mapping errors, or a destination layout other than
    the one the receiver holds (built from the checkpoint names)."""
    import torch
    from wxfer.mapping import Layout, expand

    try:
        cls, cfg = hf_class(conf)
        with torch.device("meta"):
            m = cls(cfg)
        shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
        ex = expand(preset.rules, shapes, Layout(1, False, quant), conf)
    except Exception as e:  # noqa: BLE001 -- any refusal is a reason to fall back
        return [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    gaps = [f"unmatched training parameter {n}" for n in ex.unmatched[:5]]
    if len(ex.unmatched) > 5:
        gaps.append(f"... {len(ex.unmatched)} unmatched in all")
    got = {n: (tuple(d.shape), d.dtype) for n, d in ex.dest[0].items()}
    want = {n: (tuple(d.shape), d.dtype) for n, d in want_dest.items()}
    if not gaps and got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:3]
        gaps.append(f"destination layout differs from the receiver's: {diff}")
    return gaps


def fsdp2_model(conf: dict, dev, offload: bool, seed: int = 0):
    """transformers' class with random BF16 weights on `dev`, fully_shard per decoder layer
    then the model, on a 1-rank mesh (torch.distributed must be initialized)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cls, cfg = hf_class(conf)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    mesh = init_device_mesh(dev.type, (1,))
    kw = dict(mesh=mesh)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=dev.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


class Trainer:
    """One training step between two pushes (not timed)."""

    def __init__(self, model, kind: str, dev, vocab: int):
        import torch

        self.model, self.kind, self.dev = model, kind, dev
        self.params = [p for _, p in model.named_parameters()]
        self.opt = torch.optim.SGD(self.params, lr=1e-4) if kind == "sgd" else None
        self.ids = torch.randint(0, vocab, (1, 64), device=dev)
        self.sign = 1.0

    def step(self) -> None:
        import torch

        if self.kind == "sgd":
            out = self.model(input_ids=self.ids)
            out.logits.float().square().mean().backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        from torch.distributed.tensor import DTensor

        self.sign = -self.sign
        with torch.no_grad():
            for p in self.params:
                (p._local_tensor if isinstance(p, DTensor) else p).mul_(1.0 + self.sign * 2**-7)


def train_kind(cfg: dict, arch: str, dry_run: bool) -> str:
    if cfg["trainer"] == "plain" or "Moe" in arch or (cfg["trainer"] == "fsdp2-offload" and not dry_run):
        return "in-place"
    return "sgd"


def copy_bound(nbytes: int, src_dev, dst_dev, warmup: int, reps: int, pinned: bool = False) -> dict:
    """Seconds of each of `reps` copies of nbytes in 1 GiB pieces after `warmup` (the link
    bound; pinned: H2D from pinned host memory, the bound of a CPU-offloaded trainer)."""
    import torch
    from common.baselines import copy_through

    piece = min(GiB, max(1, nbytes))
    src = torch.empty(piece, dtype=torch.uint8, device=src_dev, pin_memory=pinned).fill_(7)
    dst = torch.empty(piece, dtype=torch.uint8, device=dst_dev)
    times = []
    for i in range(warmup + reps):
        _sync(dst_dev)
        t = time.perf_counter()
        copy_through(dst, src, nbytes)
        _sync(dst_dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_start(dev):
    import torch

    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return base


def _peak_end(dev, base):
    import torch

    if base is None:
        return None
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - base)


def wxfer_runs(a: dict) -> list:
    """The fresh Senders (and Receivers) of one configuration, in order: [(watermark, copy_max)]
    -- one per watermark (copy_max None: the Sender's default), then the copy_max sweep
    (``a["copy_max"]``, bench_baselines --copy-max) at the first watermark.  Index i's are
    named "<name>_w<i>" and end with the key wx_done/<ci>/<i>."""
    wms = a["watermarks"]
    return [(wm, None) for wm in wms] + [(wms[0], v) for v in a.get("copy_max") or ()]


def _steps(s, trainer, n: int, warmup: int, dev) -> tuple:
    """`n` pushes of Sender `s` (trained in between): (seconds of those after `warmup`, their
    peak extra memory, the last push's engine trace)."""
    times, peaks = [], []
    for i in range(n):
        if trainer is not None and i:
            trainer.step()
        if i == n - 1:
            s.trace(clear=True)
        base = _peak_start(dev)
        _sync(dev)
        t = time.perf_counter()
        s.push()
        dt = time.perf_counter() - t
        peak = _peak_end(dev, base)
        if i >= warmup:
            times.append(dt)
            if peak is not None:
                peaks.append(peak)
    return times, peaks, s.trace()


def _figures(s, wm: int, times, peaks, recs, summ) -> dict:
    largest = max((op.prep.held for g in s.program.groups for op in g if op.prep is not None), default=0)
    zero = sum(1 for g in s.program.groups for op in g if op.prep is not None and op.prep.zero_copy)
    r = dict(
        summ(times, s.bytes_per_step),
        watermark=s.watermark,
        peak_extra=max(peaks) if peaks else None,
        largest_task=largest,
        tasks=len(s.plan.tasks),
        zero_copy_tasks=zero,
        direct=s.stats()["direct"],  # tasks packed straight into the receivers (WXFER_DIRECT=0: off), copy_max
        host=s.host_times(recs),
        submit_s=s.last_submit_s,
        phases=dict(s.last_phases),
        bytes_per_step=s.bytes_per_step,
        transport=s.transport_name,
    )
    r["within_watermark"] = None if r["peak_extra"] is None else r["peak_extra"] <= wm + largest + (1 << 20)
    return r


def wxfer_trainer(model, trainer, preset, store, ctl, name: str, ci: int, a: dict, dev, summ, trace_path) -> tuple:
    """Rank 0: a fresh Sender per run of wxfer_runs(a); steps (trained in between), peak extra
    memory, host times.  Returns ({watermark: figures}, {copy_max: figures}); the first
    watermark's are the headline (with the simulator's prediction); the sweep's Senders time
    as many steps as it (``a["reps"]`` after ``a["warmup"]``), each with Sender(copy_max=...)."""
    from wxfer.runtime.sender import Sender

    byw, bycm = {}, {}
    for wi, (wm, cm) in enumerate(wxfer_runs(a)):
        kw = {} if cm is None else dict(copy_max=cm)
        s = Sender(
            model,
            mapping=preset,
            store=store,
            name="%s_w%d" % (name, wi),
            watermark=wm,
            timeout=a["timeout"],
            write_timeout=a["timeout"],
            transport_options=a.get("transport_options") or None,
            **kw,
        )
        try:
            head = wi == 0 or cm is not None
            n = a["warmup"] + (a["reps"] if head else max(1, a["reps"] // 2))
            times, peaks, recs = _steps(s, trainer, n, a["warmup"], dev)
            if trace_path and wi == 0:
                s.write_trace(trace_path)
            r = _figures(s, wm, times, peaks, recs, summ)
            if bb_profile.wanted(dev):  # one more push under torch.profiler: where its time goes
                label = "%s-w%d" % (os.path.basename(trace_path or name)[6:-5] or name, wi)
                r["profile"] = bb_profile.profiled_push(s, dev, label, a.get("out"))
                print(bb_profile.line(label, r["profile"]), flush=True)
            if wi == 0:
                import bb_predict

                r.update(bb_predict.predicted(s, dev, a))  # before the fit's pushes: from the calibration alone
                r.update(simulated(s, dev, a, trainer.step if trainer is not None else None))
                if "simulated_s" in r:
                    r["fitted_s"] = r["simulated_s"]  # the in-run fit (simulated_s: its older name)
            if cm is None:
                byw[str(wm)] = r
            else:
                bycm[str(cm)] = r
        finally:
            ctl.set("wx_done/%d/%d" % (ci, wi), b"1")
            s.close()
    return byw, bycm


_KERNELS: dict = {}


def _kernels(dev) -> dict:
    """The quantizer's rate and per-launch cost and the copy rate on this device (once per
    process: wxfer.tools.calibrate.measure_kernels)."""
    from wxfer.tools.calibrate import measure_kernels

    if dev.type not in _KERNELS:
        _KERNELS[dev.type] = measure_kernels(dev, quick=dev.type == "cpu")
    return _KERNELS[dev.type]


def _offloaded(sender, dev) -> bool:
    from torch.distributed.tensor import DTensor

    for p in sender.params.values():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if local.device.type != dev.type:
            return True
    return False


def simulated(sender, dev, a: dict, step=None) -> dict:
    """The simulator's prediction of this push (issue 15): the trainers' own plan, each task
    simulated as this Sender runs it (Sender.task_kinds(): zero copy, packed, staged), with a
    calibration measured in this run: the host and per-push costs fitted on this Sender's own
    trace (a few more pushes, each after a training step `step` as the timed ones; per
    zero-copy batch and task, per packed task / parameter / piece, per direct task, the begin
    and end stamps and the begin fence, the engine's posting gap per write and the write path's
    time per write beyond the link's rate), the quantizer and copy rates on this device,
    the write path at the link bound measured for this configuration (`a["_link_GBps"]`:
    colocated writes are on-device copies), and for an offloaded trainer the pinned H2D rate
    measured by its bound (`a["_h2d_GBps"]`).  Colocated on one GPU, the kernels and the writes
    share its memory (Calibration.device_shared).  Returns simulated_s and, to judge the model,
    its terms (each on the busiest rank) and every figure it used."""
    k: dict = {}
    try:
        from collections import Counter
        from dataclasses import replace
        from wxfer.meta import Calibration
        from wxfer.plan.calibrate import TERMS, run, to_dict
        from wxfer.tools.calibrate import host_costs, hostfit_keys

        k = _kernels(dev)
        cfg = a.get("_cfg") or {}
        link = a.get("_link_GBps") or k["copy_GBps"]
        offload = dev.type == "cuda" and _offloaded(sender, dev)
        h2d = a.get("_h2d_GBps") if offload else None
        cpu = dev.type == "cpu"
        # the fitted pushes follow a training step (`step`), as the timed ones do
        h = host_costs(sender, 3, k["copy_GBps"], link, k["quant_GBps"], between=step)
        if dev.type == "cpu" and h.get("trace_write_GBps"):
            # CPU dry run: the link bound is a memcpy, the writes go through fabric tcp: their rate and
            # per-write cost from the Sender's own trace instead
            link = h["trace_write_GBps"]
            h["write_call_s"] = h["trace_write_call_s"]
        kinds = sender.task_kinds()  # zero_copy, packed, direct (straight into the receivers), ...
        cal = Calibration(
            name="bench-same-run",
            pack_launch_s=k["pack_launch_s"],
            launch_per_piece="native" not in k["quantizer"],
            quant_GBps=k["quant_GBps"],
            quant_small_GBps=k.get("quant_small_GBps"),
            copy_GBps=k["copy_GBps"],
            copy_batch_GBps=k.get("copy_batch_GBps"),
            write_GBps=link,
            write_call_s=h.get("write_call_s", 0.0),
            # the write path's time per write beyond the link's rate, from the same trace (a GPU: the
            # engine's posting stamps; on the CPU the trace's own rate above already holds it)
            write_dev_s=0.0 if cpu else h.get("write_dev_s", 0.0),
            h2d_GBps=h2d,
            serial=True,
            host_sync=cpu,
            cpu_shared=cpu,
            device_shared=not cpu and cfg.get("layout") == "colocated",
            source="bench_baselines, measured in the same run",
            # a column no traced task held is unmeasured (the simulator refuses it by name where charged)
            unmeasured={x: v for x, v in (h.get("host_unmeasured") or {}).items() if x in TERMS},
            host_direct_task_s=h.get("host_direct_task_s"),  # fitted where the Sender had direct tasks
            host_copy_task_s=h.get("host_copy_task_s"),  # and copy tasks (small zero copy, batched copies)
            **{x: h[x] for x in hostfit_keys() if x in h},
        )
        kw = dict(kinds=kinds, cpu_offload=offload, watermark_bytes=sender.watermark or (1 << 50))
        r = run(sender.plan, cal, **kw)
        # beside it, to judge that one term: the same with the kernels and the writes not sharing the GPU
        apart = run(sender.plan, replace(cal, device_shared=False), **kw) if cal.device_shared else r
        return dict(
            r.record("bound_by", "terms", "stage_busy_s"),
            simulated_unshared_s=apart.simulated_s,
            simulated_kinds=dict(Counter(kinds.values())),
            simulated_calibration=dict(to_dict(cal), quantizer=k["quantizer"], h2d_measured=h2d is not None),
            simulated_fit={x: v for x, v in h.items() if x not in hostfit_keys()},
        )
    except Exception as e:  # noqa: BLE001 -- the measurement stands without it
        # the kernels' figures measured before the failure, for an offline check (benchmarks/sim_check.py)
        rates = {
            x: k[x]
            for x in ("quant_GBps", "quant_small_GBps", "copy_GBps", "copy_batch_GBps", "pack_launch_s", "quantizer")
            if x in k
        }
        return dict(simulated_error=f"{type(e).__name__}: {e}", simulated_rates=rates)


def wxfer_receiver(params, preset, store, ctl, name: str, ci: int, a: dict, dev, reset, checksums) -> list:
    """Rank 1: a fresh Receiver per run of wxfer_runs(a) (each watermark, then the copy_max
    sweep); the checksums after the last one's steps (the weights the baselines send next)."""
    from wxfer.runtime.receiver import Receiver

    sums = None
    for wi, _ in enumerate(wxfer_runs(a)):
        reset(params)
        r = Receiver(params, mapping=preset.name, store=store, name="%s_w%d" % (name, wi), timeout=a["timeout"])
        try:
            ctl.get("wx_done/%d/%d" % (ci, wi), "the trainer's wxfer steps", a["timeout"])
            _sync(dev)
            sums = checksums(params)
        finally:
            r.close()
    return sums


def reference_checksums(ex, fulls: dict, dev) -> list:
    """Per destination parameter of inference rank 0 (sorted by name, as bench_baselines'
    checksums), the byte sum of what wxfer.mapping's reference packing makes from the
    trainer's whole tensors: the receiver must hold exactly that.  One destination at a
    time (one buffer of its size)."""
    import torch
    from wxfer.runtime import prepare

    by: dict = {}
    for c in ex.components:
        for sh in c.shards:
            if sh.rank == 0:
                by.setdefault(sh.dst, []).append(sh)
    out = []
    with torch.no_grad():
        for n, d in sorted(ex.dest[0].items()):
            buf = torch.full((d.nbytes,), 0xFF, dtype=torch.uint8, device=dev)
            for sh in by.get(n, []):
                prepare.pack_shard_into(sh, fulls, buf, sh.offset)
            out.append(int(buf.sum(dtype=torch.int64)))
            del buf
    return out


def init_group(store, name: str, gpu: bool, timeout: float) -> None:
    """The trainer's own 1-rank process group (FSDP2 needs one; the receiver is not in it)."""
    import datetime
    import torch.distributed as dist

    if dist.is_initialized():  # left by a configuration that failed
        dist.destroy_process_group()
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if gpu else "gloo",
        store=dist.PrefixStore("fsdp/%s" % name, store),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout),
    )
