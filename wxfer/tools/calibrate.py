"""``python -m wxfer calibrate``: measure the simulator's figures on this machine.

Measures, in well under a minute (``--quick``: a few seconds of work plus one helper
process), on the GPU when torch.cuda is available, else on the CPU:

- the FP8 quantizer (``wxfer.runtime.fp8.quantize_into`` when present, else the reference
  ``wxfer.mapping.reference.quantize_fp8_block``): rate on a large tensor, cost per launch
  on a 128 x 128 one; and the on-device copy rate (BF16 packing);
- an all-gather between two processes (gloo on CPU; NCCL on GPUs, one per process, the
  same GPU twice when there is only one): cost per call and bus rate;
- writes through the transport the receivers would pick (fabric tcp on CPU, cuda_ipc on
  GPUs) between two processes, with wxfer's own Transport and Engine: cost per write and rate;
- the host cost of a task, from the trace of a short real push (a Sender and a Receiver
  in this process, one trainer rank): per task / parameter / piece by least squares over
  its tasks, and the push's fixed cost (before the first task, after the last write).

Prints the calibration (``--json``: one JSON object last); ``--out FILE`` writes it for
``python -m wxfer plan --calibration FILE`` and `wxfer.plan.calibrate.load`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from .calibrate_host import PLACEMENTS, default_placement, host_costs, hostfit_keys, measure_host, receiver_side
from .calibrate_writes import write_rates
from ..runtime.hostfit import HOST_COSTS
from ..testing import connect_helper, expect, serve, spawn_helper, stop_process

__all__ = ["PLACEMENTS", "default_placement", "host_costs", "hostfit_keys", "measure", "measure_host", "main"]
_TIMEOUT = 60.0


def _sync(dev):
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _timed(fn, dev, iters: int) -> float:
    """Median seconds of fn() over `iters` runs after one warm-up."""
    fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


# --------------------------------------------------------------------------- quantizer, copy


def _quantizer():
    """(name, fn(bf16 2-D tensor)) of the quantizer the runtime uses."""
    try:
        from ..runtime import fp8 as _fp8  # the native one-pass kernel, where built

        qi = _fp8.quantize_into
    except Exception as e:  # noqa: BLE001 -- not there: the reference
        why = f"wxfer.runtime.fp8.quantize_into unavailable ({type(e).__name__})"
        qi = None
    if qi is not None:
        import torch
        from ..mapping.reference import FP8_MAX  # noqa: F401 -- same definition

        def native(w):
            # the packing's own call: fp8 bytes then the float32 scales, in one uint8 buffer
            rows, cols = w.shape
            nq = rows * cols
            out = torch.empty(nq + 4 * (-(-rows // 128)) * (-(-cols // 128)), dtype=torch.uint8, device=w.device)
            kind = qi(out, [(w, 0, nq)])
            return out, kind

        probe = torch.ones(128, 128, dtype=torch.bfloat16)
        try:
            native(probe)
            return "wxfer.runtime.fp8.quantize_into", native
        except Exception as e:  # noqa: BLE001
            why = f"wxfer.runtime.fp8.quantize_into(out, jobs) failed: {type(e).__name__}: {e}"
    from ..mapping.reference import quantize_fp8_block

    return "wxfer.mapping.reference.quantize_fp8_block (%s)" % why, quantize_fp8_block


def measure_kernels(dev, quick: bool) -> dict:
    import torch

    name, q = _quantizer()
    n = 1024 if quick else (2048 if dev.type == "cpu" else 8192)
    w = torch.randn(n, n, device=dev).to(torch.bfloat16)
    iters = 3 if quick else 7
    # each kernel figure from the device's time per call (wxfer.tools.calibrate._dev_time: a push
    # overlaps its host's issuing with earlier launches); the host-timed calls scattered by tens of
    # microseconds on a 0.1 ms kernel (the H200 quantizer read 2.0-3.5 TB/s from run to run)
    t_big = _dev_time(lambda: q(w), dev, iters)
    if name == "wxfer.runtime.fp8.quantize_into":
        name += " (%s)" % q(w)[1]  # which of its quantizers ran on this device
    small = torch.randn(128, 128, device=dev).to(torch.bfloat16)
    t_small_call = _timed(lambda: q(small), dev, iters * 4)  # one call from Python, timed to its sync
    dev_launch = _device_launch_s(lambda: q(small), dev)
    t_small = t_small_call if dev_launch is None else dev_launch
    # t = launch + bytes / rate through the two sizes; bytes = BF16 read + FP8 written (as issue 13 counts)
    b_big, b_small = w.numel() * 3, small.numel() * 3
    rate = (b_big - b_small) / max(t_big - t_small, 1e-9)
    call = max(0.0, t_small_call - b_small / rate)
    launch = t_small - b_small / rate  # what a launch costs the stream (the host's share is the host fit's)
    grouped = _grouped_rate(dev, quick, iters, t_small)
    src = torch.empty(n * n * 4, dtype=torch.uint8, device=dev)
    # into fresh memory each time, as the packing does (one new buffer per task)
    t_copy = _dev_time(lambda: torch.empty_like(src).copy_(src), dev, iters)
    # the batched small copies of zero-copy tasks (wxfer.runtime.inplace.InPlaceWriter.flush_copies): 128
    # ranges of 1/128 of the buffer each, one launch of what the runtime uses (wxfer.runtime.copies:
    # the native kernel, else torch._foreach_copy_; read + write counted)
    from ..runtime import copies

    dst = torch.empty_like(src)
    k = src.numel() // 128
    items = [
        (d, s, d.data_ptr(), s.data_ptr(), k)
        for d, s in ((dst[i * k : (i + 1) * k], src[i * k : (i + 1) * k]) for i in range(128))
    ]
    copier = copies.copy_ranges(dev, items)
    # the device's time per launch (queued behind a spinning kernel: the host's issuing, which a
    # push overlaps with earlier launches, taken out), else the call timed to its sync
    t_batch = _device_launch_s(lambda: copies.copy_ranges(dev, items), dev, n=8) or _timed(
        lambda: copies.copy_ranges(dev, items), dev, iters
    )
    # (on the CPU the call is the copy itself, and copy tasks need cuda_ipc's mapped memory: not measured)
    launch_host = _copy_launch_host(dev, items, iters) if dev.type == "cuda" else {}
    return dict(
        **launch_host,
        quantizer=name,
        quant_GBps=rate / 1e9,
        pack_launch_s=max(0.0, launch),
        pack_launch_fit_s=launch,  # before the clamp (<= 0: the calibration names it unmeasured)
        pack_launch_samples=iters * 4 if dev_launch is None else 1,
        copy_GBps=2 * src.numel() / t_copy / 1e9,
        copy_batch_GBps=2 * 128 * k / t_batch / 1e9,
        copier=copier,
        quant_shape=[n, n],
        quant_s=t_big,
        quant_small_s=t_small,
        pack_call_s=call,
        device_launch_s=dev_launch,
        **grouped,
    )


def _copy_launch_host(dev, items, iters: int) -> dict:
    """The host's work per batched copy launch of copy tasks (wxfer.runtime.copies.copy_ranges,
    as wxfer.runtime.inplace.InPlaceWriter.flush_copies calls it: the range table, cached push after push,
    and the launch): host seconds of the call (not its sync) with all of `items` (128 ranges, a
    full launch) and with 16 of them; a fixed part and a part per range through the two."""
    from ..runtime import copies

    def host(its):
        ts = []
        for _ in range(4 * iters + 1):
            _sync(dev)
            t0 = time.perf_counter()
            copies.copy_ranges(dev, its)
            ts.append(time.perf_counter() - t0)
        ts = sorted(ts[1:])
        return ts[len(ts) // 2]

    n_all, n_few = len(items), 16
    t_all, t_few = host(items), host(items[:n_few])
    per = max(0.0, (t_all - t_few) / (n_all - n_few))
    _sync(dev)
    return dict(
        host_copy_launch_s=max(0.0, t_few - n_few * per),
        host_copy_range_s=per,
        copy_launch_host_s={str(n_all): t_all, str(n_few): t_few},
    )


def _grouped_rate(dev, quick: bool, iters: int, t_call: float = 0.0) -> dict:
    """The quantizer on many small pieces in one call, as a MoE layer's experts are packed:
    128 experts of 768 x 2048 (Qwen3-30B-A3B's, 1.6 M elements each; quick or CPU: 16 of
    256 x 512) from one 3-D tensor into one buffer; effective rate (BF16 read + FP8 written),
    the cost of a call (`t_call`: a 128 x 128 one) taken out."""
    import torch

    try:
        from ..runtime import fp8 as _fp8
    except Exception:  # noqa: BLE001 -- no such module: not measured
        return {}
    E, R, C = (16, 256, 512) if quick or dev.type == "cpu" else (128, 768, 2048)
    x = torch.randn(E, R, C, device=dev, dtype=torch.bfloat16)  # 0.4 GB: made in BF16 (a colocated 30B row is tight)
    nq, ns = R * C, 4 * (-(-R // 128)) * (-(-C // 128))
    out = torch.empty(E * (nq + ns), dtype=torch.uint8, device=dev)
    jobs = [(x[e], e * nq, E * nq + e * ns) for e in range(E)]
    # as the Sender packs a task push after push: the kernel's piece table made once, then reused
    key = ("calibrate", x.data_ptr(), E, R, C)
    t = _dev_time(lambda: _fp8.quantize_cached(out, key, lambda: jobs), dev, iters)
    # the rate from the slope between all the experts and half of them (a call's fixed cost, its
    # launch and the sync that times it, cancels; `t_call` is the fallback where the two are too close)
    half = jobs[: E // 2]
    t2 = _dev_time(lambda: _fp8.quantize_cached(out, key + ("half",), lambda: half), dev, iters)
    if t - t2 > 0.2 * t:
        rate = 3 * (x.numel() - x[: E // 2].numel()) / (t - t2)
    else:
        rate = 3 * x.numel() / (t - t_call if t > 2 * t_call else t)
    return dict(
        quant_small_GBps=rate / 1e9, quant_small_shape=[E, R, C], quant_small_grouped_s=t, quant_small_half_s=t2
    )


def _dev_time(fn, dev, iters: int) -> float:
    """Seconds of the device per call of `fn` (_device_launch_s over at least 8 calls), where it
    can be measured; else the median call timed to its sync (_timed: the CPU)."""
    t = _device_launch_s(fn, dev, n=max(8, iters))
    return t if t is not None else _timed(fn, dev, iters)


def _device_launch_s(fn, dev, n: int = 64):
    """Seconds of the device's stream per call of `fn` (a small kernel), with the host's
    issuing taken out: the calls are queued behind a spinning kernel (torch.cuda._sleep) and
    timed between CUDA events.  None on CPU, or when the host had not queued them all before
    the stream reached them (then the figure would be the host's)."""
    import torch

    if dev.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return None
    fn()
    torch.cuda.synchronize(dev)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e8))  # ~0.1 s at ~2 GHz: time for the host to queue every call
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    queued = not e0.query()  # the stream was still spinning when the last call was queued
    torch.cuda.synchronize(dev)
    return e0.elapsed_time(e1) / 1e3 / n if queued else None


# --------------------------------------------------------------------------- the helper process


def _helper_main(conn, transport: str, opts: dict, size: int, device: str, ag: dict) -> None:
    """Rank 1 of the all-gather, and the write target (registered memory, answers the handshake;
    the helper protocol of wxfer.testing)."""
    import torch
    from wxfer import _wxfer

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        t = _wxfer.Transport(transport, opts)
        buf = torch.zeros(size, dtype=torch.uint8, device=dev)
        region = t.register(buf, export=True)
        conn.send(("ready", t.export(), region.descriptor))
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return

    live = [True]

    def allgather():
        if live[0]:  # the writes are done: no transport threads during the all-gather
            region.close()
            t.close()
            live[0] = False
        _allgather_rank(1, ag, dev)
        return ("done",)

    serve(conn, t, {"allgather": allgather}, _TIMEOUT)
    if live[0]:
        region.close()
        t.close()


def _allgather_rank(rank: int, ag: dict, dev) -> dict:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from ..runtime.prepare import all_gather_single

    dist.init_process_group(
        ag["backend"],
        init_method="tcp://127.0.0.1:%d" % ag["port"],
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=_TIMEOUT),
    )
    try:
        inps = {n: torch.ones(n, dtype=torch.uint8, device=dev) for n in ag["sizes"]}
        times = {n: [] for n in ag["sizes"]}
        dist.barrier()
        for it in range(ag["iters"] + 1):
            # rounds over every size, so that a burst of load elsewhere hits all sizes alike; each into a
            # fresh output, as full_tensor() does
            for n, inp in inps.items():
                dist.barrier()  # both ranks start together (not timed)
                t0 = time.perf_counter()
                all_gather_single(torch.empty(2 * n, dtype=torch.uint8, device=dev), inp)
                _sync(dev)
                if it:  # round 0 is the warm-up
                    times[n].append(time.perf_counter() - t0)
        out = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
        return out
    finally:
        dist.destroy_process_group()


def _expect(conn, what):
    return expect(conn, what, "calibrate", _TIMEOUT)


def measure_links(dev, quick: bool, placement: str = "") -> dict:
    """Writes through the transport the placement's receivers take (wxfer.tools.calibrate_host.
    receiver_side: same GPU, another GPU, a network transport) and an all-gather, against one
    helper process (on the receivers' device)."""
    import torch
    from wxfer import _wxfer
    from ..runtime import control
    from ..runtime.receiver import transport_choice

    placement = placement or default_placement(dev)
    rdev, want = receiver_side(dev, placement)
    tname, opts = transport_choice(want, dev.type)
    # a GPU: 8 x 256 MiB in flight, 2 GiB (about 1 ms at the on-device rate: well above the wait's granularity)
    size = ((64 << 20) if quick else (256 << 20)) if dev.type == "cuda" else ((8 << 20) if quick else (64 << 20))
    ngpu = torch.cuda.device_count() if dev.type == "cuda" else 0
    hdev = str(rdev)
    sizes = [256, 256 << 10, 1 << 20, size // 2] if quick else [256, 64 << 10, 256 << 10, 1 << 20, 4 << 20, size // 2]
    ag = dict(backend="nccl" if ngpu else "gloo", port=control.free_port(), sizes=sizes, iters=11 if quick else 21)
    parent, proc = spawn_helper(_helper_main, tname, opts, size, hdev, ag)
    out = dict(transport=tname, transport_options=opts, write_bytes=size, helper_device=hdev, placement=placement)
    try:
        _, blob, desc = _expect(parent, "ready")
        t = _wxfer.Transport(tname, opts)
        connect_helper(t, parent, blob, "calibrate")
        eng = _wxfer.Engine(t, timeout=_TIMEOUT)
        src = torch.ones(size, dtype=torch.uint8, device=dev)
        region = t.register(src, export=False)
        out.update(write_rates(eng, region, desc, size, dev, quick))
        region.close()
        eng.close()
        t.close()
        if dev.type == "cuda" and ngpu < 2:
            # NCCL takes one rank per GPU; on one GPU the trainers' meshes have one rank (no collective)
            why = "one GPU: NCCL needs a GPU per rank (a one-GPU job's meshes have one rank: no all-gather)"
            out.update(allgather_backend="none", allgather_unmeasured=why, coll_call_s=None, allgather_GBps=None)
            return out
        # the all-gather: this process is rank 0, the helper rank 1
        parent.send(("allgather",))
        a = _allgather_rank(0, ag, dev)
        _expect(parent, "done")
        # t = per call + received bytes / bus rate (each of the 2 ranks receives the other's half);
        # the simulator charges (k-1)/k of the gathered bytes at that rate
        # per call + bytes / rate by least squares in relative terms over the sizes from 64 KiB on (each
        # size weighs alike); the smallest (the first of each round after the barrier, which holds the
        # two ranks' skew leaving it) is kept in the details, not fitted
        import numpy as np

        big = sizes[1:]
        n = np.array(big, float)
        tt = np.array([a[x] for x in big])
        coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1) / tt[:, None], np.ones_like(tt), rcond=None)
        call, slope = float(coef[0]), float(coef[1])
        if call < 0 or slope <= 0:  # not a line: the smallest as the call, the slope through the others
            call = a[sizes[0]]
            slope = sum(x * (a[x] - call) for x in big) / sum(x * x for x in big)
        out.update(
            allgather_backend=ag["backend"],
            allgather_s={str(n): a[n] for n in sizes},
            coll_call_s=float(call),
            allgather_GBps=1.0 / max(float(slope), 1e-15) / 1e9,
        )
    finally:
        stop_process(parent, proc)
    return out


# --------------------------------------------------------------------------- host cost of a task


def measure_h2d(dev, quick: bool) -> dict:
    """Pinned host-to-device copies (a CPU-offloaded trainer's stage 1): the rate from the
    slope between two sizes, the cost per copy from the smaller one (the device's time)."""
    import torch

    if dev.type != "cuda":
        return {}
    big, small = (64 << 20, 1 << 20) if quick else (256 << 20, 1 << 20)
    hb = torch.empty(big, dtype=torch.uint8).pin_memory()
    db = torch.empty(big, dtype=torch.uint8, device=dev)
    t_big = _dev_time(lambda: db.copy_(hb, non_blocking=True), dev, 5)
    t_small = _dev_time(lambda: db[:small].copy_(hb[:small], non_blocking=True), dev, 16)
    rate = (big - small) / max(t_big - t_small, 1e-9)
    return dict(
        h2d_GBps=rate / 1e9, h2d_call_s=max(0.0, t_small - small / rate), h2d_s={str(big): t_big, str(small): t_small}
    )


# --------------------------------------------------------------------------- all of it


# the Calibration fields each measurement fills (what is unmeasured when it fails)
_KERNEL_TERMS = ("pack_launch_s", "quant_GBps", "quant_small_GBps", "copy_GBps", "copy_batch_GBps")
_LINK_TERMS = ("write_GBps", "write_call_s", "coll_call_s", "allgather_GBps")
_HOST_TERMS = HOST_COSTS + (
    "push_begin_s",
    "push_end_s",
    "begin_fence_s",
    "write_dev_s",
)


def _us(v: float) -> str:
    """A measured cost for the log: microseconds, or what a value <= 0 means here."""
    return (
        "%.2f us" % (v * 1e6) if v > 0 else "%.3g us, <= 0 (unmeasured unless another figure replaces it)" % (v * 1e6)
    )


def _nonpositive_why(det: dict) -> dict:
    """term -> why, for a term whose measurement came out <= 0 (wxfer.plan.calibrate.strict
    names it unmeasured with this): how it was measured and over how many samples."""
    held = (det.get("host_conditioning") or {}).get("samples") or {}
    out = {
        k: "the host fit (non-negative least squares over %d samples, %d of them holding it) put it at %s: "
        "not separable from the other host terms on this machine"
        % (det.get("host_samples", 0), held.get(k, 0), det.get(k))
        for k in HOST_COSTS
    }
    out["pack_launch_s"] = "%.3g s, a small call's time less its bytes at the fitted rate (%s samples)" % (
        det.get("pack_launch_fit_s", 0.0),
        det.get("pack_launch_samples", "?"),
    )
    out["write_call_s"] = "from %s (%s samples)" % (
        det.get("write_call_from", "the link"),
        det.get("write_samples", "the link probe's"),
    )
    out["write_dev_s"] = "from %s" % det.get("write_dev_from", "the link probe")
    for k in ("push_begin_s", "push_end_s", "begin_fence_s"):
        out[k] = "the median over the probes' %d pushes" % det.get("host_pushes", 0)
    return out


# a measured calibration's push_fixed_s: the older single fixed cost per push, measured apart here
PUSH_FIXED_WHY = (
    "not a term of its own here: the fixed cost per push is measured apart (push_begin_s, begin_fence_s, push_end_s)"
)


def _calibration(det: dict, unmeasured: dict, dev, placement: str, quick: bool) -> tuple:
    """(the Calibration of what `det` measured, the machine's description); `unmeasured`:
    term -> why, for the terms not measured (those of them that are Calibration terms).  A
    term that came out <= 0 is None, named unmeasured with its samples (never a 0.0)."""
    import torch

    from ..meta import Calibration

    machine = "%s, %s, %d CPUs" % (platform.node(), platform.machine(), os.cpu_count() or 0)
    if dev.type == "cuda":
        machine += ", " + torch.cuda.get_device_name(dev)
    if hasattr(os, "getloadavg"):
        machine += ", load average %.1f" % os.getloadavg()[0]
    meas = {
        k: det[k]
        for k in _HOST_TERMS + _LINK_TERMS + ("h2d_GBps", "h2d_call_s", "host_copy_launch_s", "host_copy_range_s")
        if det.get(k) is not None
    }
    from ..plan.calibrate import TERMS, strict

    un = {k: v for k, v in unmeasured.items() if k not in meas and k in TERMS}
    un.setdefault("push_fixed_s", PUSH_FIXED_WHY)
    given = ("pack_launch_s", "quant_GBps", "quant_small_GBps", "copy_GBps", "copy_batch_GBps")
    # every term named: what was not measured is None with its reason, never a default's figure
    for k in sorted(TERMS - set(meas) - set(given)):
        meas[k] = None
        un.setdefault(k, "no measurement of `calibrate` filled it")
    for k in given:
        if det.get(k) is None:
            un.setdefault(k, "no measurement of `calibrate` filled it")
    cal = Calibration(
        name="measured-%s-%s" % (dev.type, placement),
        pack_launch_s=det["pack_launch_s"],
        launch_per_piece="native" not in det["quantizer"],  # the native kernel: one launch for a task's FP8 pieces
        quant_GBps=det["quant_GBps"],
        quant_small_GBps=det.get("quant_small_GBps"),
        copy_GBps=det["copy_GBps"],
        copy_batch_GBps=det.get("copy_batch_GBps"),
        serial=True,
        host_sync=dev.type == "cpu",
        cpu_shared=dev.type == "cpu",
        device_shared=dev.type == "cuda" and placement == "same",
        source="measured by `python -m wxfer calibrate%s --placement %s` on %s, %s"
        % (" --quick" if quick else "", placement, machine, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
        unmeasured=un,
        assumptions={},
        **meas,
    )
    return strict(cal, _nonpositive_why(det)), machine


def _host_part(dev, det: dict, quick: bool, placement: str, unmeasured: dict, log) -> None:
    """measure_host into `det` (its unmeasured columns into `unmeasured`); the write path's
    per-write figure from the probes' posting gaps where they had any, else the link's."""
    link_call = det.get("write_call_s")
    try:
        det.update(measure_host(dev, det, quick, placement, det.get("write_GBps"), log=log))
        unmeasured.update(det["host_unmeasured"])
        if dev.type == "cuda" and det.get("write_dev_link_s") is not None:
            # the probes' small writes are paced by their posting (their busy periods moved ~50 GB/s
            # on an H200): beyond their bytes they held the posting gap, which write_call_s already
            # charges; the device's own time per write is the link probe's (device-bound writes)
            det["probe_write_dev_s"] = det.get("write_dev_s")
            det["write_dev_s"] = det["write_dev_link_s"]
            det["write_dev_from"] = "the link probe (%d writes of 1/8 the size against %d)" % (
                det["write_cut_n"],
                det["write_inflight"],
            )
        else:
            det["write_dev_from"] = "the probes' write busy periods"
        if not det.get("write_samples") and link_call is not None:  # no posting gap seen: the link's figure
            det["write_call_s"] = link_call
        det["write_call_from"] = "the probes' engine posting gaps" if det.get("write_samples") else "the link"
        cond = det["host_conditioning"]
        log(
            "calibrate: host %s; %.2f ms before the first task, %.2f ms after the last data; fit over %d samples, "
            "condition %.3g%s"
            % (
                ", ".join("%s %s" % (k[:-2], _us(det[k])) for k in HOST_COSTS if det.get(k) is not None),
                det["push_begin_s"] * 1e3,
                det["push_end_s"] * 1e3,
                det["host_samples"],
                cond["condition"] if cond["condition"] is not None else float("nan"),
                "; unmeasured: " + ", ".join(sorted(det["host_unmeasured"])) if det["host_unmeasured"] else "",
            )
        )
    except Exception as e:  # noqa: BLE001 -- keep the rest; say why
        det["host_error"] = f"{type(e).__name__}: {e}"
        unmeasured.update({k: "the host probes failed: " + det["host_error"] for k in _HOST_TERMS})
        log("calibrate: host cost not measured: " + det["host_error"])


def measure(quick: bool = False, device: str | None = None, log=print, placement: str | None = None) -> tuple:
    """(Calibration, details dict) measured here, with the receivers on `placement` (same /
    gpu / host, wxfer.tools.calibrate_host; None: default_placement).  Every term it could
    not measure is in the calibration's ``unmeasured`` with the reason (the simulator refuses
    a plan that needs one), never a 0."""
    import torch

    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)  # as the demo's trainers (and one rank per core) run
    placement = placement or default_placement(dev)
    receiver_side(dev, placement)  # refuses a placement this machine cannot take, before anything runs
    det: dict = dict(device=str(dev), quick=quick, placement=placement)
    unmeasured: dict = {}
    det.update(measure_kernels(dev, quick))
    log(
        "calibrate: quantizer %.1f GB/s, %s per launch; copy %.1f GB/s, batched copies %s GB/s, "
        "their host work %s"
        % (
            det["quant_GBps"],
            _us(det["pack_launch_fit_s"]),
            det["copy_GBps"],
            "%.1f" % det["copy_batch_GBps"] if det.get("copy_batch_GBps") else "-",
            "%s per launch + %s per range" % (_us(det["host_copy_launch_s"]), _us(det["host_copy_range_s"]))
            if "host_copy_launch_s" in det
            else "not measured (no GPU)",
        )
    )
    if "host_copy_launch_s" not in det:
        why = "no GPU: copy tasks need receivers' memory mapped on the trainer's GPU (cuda_ipc)"
        unmeasured.update(host_copy_launch_s=why, host_copy_range_s=why)
    if "quant_small_GBps" not in det:
        unmeasured["quant_small_GBps"] = "wxfer.runtime.fp8 unavailable: the grouped quantizer was not run"
    try:
        det.update(measure_links(dev, quick, placement))
        log(
            "calibrate: %s writes (receiver on %s) %.2f GB/s with %d in flight (one write alone %.2f GB/s), "
            "%s per write, %s us more on the link per write; "
            "%s all-gather %s GB/s, %s us per call"
            % (
                det["transport"],
                det["helper_device"],
                det["write_GBps"],
                det["write_inflight"],
                det["write_single_GBps"],
                _us(det["write_call_s"]),
                "%.2f" % (det["write_dev_link_s"] * 1e6) if det.get("write_dev_link_s") is not None else "-",
                det["allgather_backend"],
                "%.2f" % det["allgather_GBps"] if det.get("allgather_GBps") else "-",
                "%.1f" % (det["coll_call_s"] * 1e6) if det.get("coll_call_s") is not None else "-",
            )
        )
        if det.get("allgather_unmeasured"):
            unmeasured.update(coll_call_s=det["allgather_unmeasured"], allgather_GBps=det["allgather_unmeasured"])
    except Exception as e:  # noqa: BLE001 -- keep the rest; say why
        det["links_error"] = f"{type(e).__name__}: {e}"
        unmeasured.update({k: "the link measurement failed: " + det["links_error"] for k in _LINK_TERMS})
        log("calibrate: links not measured: " + det["links_error"])
    h2d = measure_h2d(dev, quick)
    det.update(h2d)
    if not h2d:
        why = "no GPU: nothing is offloaded to host memory here"
        unmeasured.update(h2d_GBps=why, h2d_call_s=why)
    _host_part(dev, det, quick, placement, unmeasured, log)
    if "write_dev_s" not in det and "write_dev_s" not in unmeasured:
        unmeasured["write_dev_s"] = "the probes' traces had no engine posting stamps"
    for k in ("host_direct_task_s", "host_copy_task_s"):  # None: the simulator uses another figure (by name)
        if k in unmeasured and k not in det:
            unmeasured[k] += " (the simulator then charges %s)" % (
                "the packed task's host figures" if "direct" in k else "host_zc_task_s"
            )
    cal, machine = _calibration(det, unmeasured, dev, placement, quick)
    det.update(machine=machine, calibrate_s=time.perf_counter() - t0)
    return cal, det


def simulate_measured(plan, calibration=None, quick: bool = True, log=print) -> dict:
    """For a benchmark or the demo: simulate `plan` (a Plan or its bytes: the trainers' own) with
        `calibration` (a Calibration, a name, a path) or, when None, one measured now on this
        machine.  Returns dict(simulated_s, lower_bound_s, bound_by, calibration: its dict), or
    simulated_error (naming the unmeasured term) in place of the figures."""
    from ..plan import Plan
    from ..plan.calibrate import assume, cluster_for, fits_at_zero, get, to_dict
    from ..plan.simulate import simulate

    if isinstance(plan, (bytes, bytearray)):
        plan = Plan.from_bytes(bytes(plan))
    if calibration is None:
        cal, det = measure(quick=quick, log=log)
    else:
        cal, det = get(calibration), {}
    # a term whose fit came out <= 0 here: taken at 0, by name (simulated_assumptions)
    cal = assume(cal, why="its fit came out <= 0", **dict.fromkeys(fits_at_zero(cal), 0.0))
    try:
        r = simulate(plan, cluster_for(plan, cal), steps=400, record=False, kinds="auto")
    except ValueError as e:  # a term this plan needs that the calibration did not measure, by name
        return dict(simulated_error=str(e), calibration=dict(to_dict(cal), measured=det))
    return dict(
        r.record("lower_bound_s", "bound_by", "stage_busy_s", "assumptions"),
        calibration=dict(to_dict(cal), measured=det),
    )


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m wxfer calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (a few seconds)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    ap.add_argument("--out", default=None, help="write the calibration (JSON) here")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="where the job's receivers are: same (the trainer's GPU, colocated), gpu (another GPU of the node), "
        "host (a network transport); default: the CPU host, one GPU same, several GPUs gpu",
    )
    args = ap.parse_args(argv)
    from ..plan.calibrate import TERMS, save, to_dict

    try:
        log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
        cal, det = measure(args.quick, args.device, log=log, placement=args.placement)
    except Exception as e:  # noqa: BLE001
        print("wxfer calibrate: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return 1
    if args.out:
        save(cal, args.out, extra=dict(measured=det))
    if args.json:
        print(json.dumps(dict(to_dict(cal), measured=det)))
    else:
        for k, v in to_dict(cal).items():
            if k in ("unmeasured", "assumptions"):
                continue
            src, why = cal.source_of(k) if k in TERMS else ("", "")
            print("%16s: %s%s" % (k, v, "  (%s: %s)" % (src, why) if src in ("unmeasured", "assumed") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
