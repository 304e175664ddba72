"""Where one push's time goes on the GPU (issue 37: "the remaining gap explained from a
trace"): one extra push of a bench_baselines Sender, after its timed ones, under
torch.profiler (CUPTI: every kernel and copy on the device, the driver-API launches of
wxfer's NVRTC kernels and the engine thread's cuMemcpyAsync included), summed up as

  push_ms         the push's wall time under the profiler (a little above the timed pushes':
                  the profiler's own cost per launch)
  gpu_busy_ms     the union of every kernel / copy / memset interval inside the push
  kernels         total ms per kernel name (the five largest), copies_ms, memsets_ms
  lead_ms         from the push's start to the first device work (host work before any
                  write: the restart check, the begin stamps, the first launches)
  idle_ms         device idle time between the first and the last device work
  tail_ms         from the last device work's end to the push's return
  gaps            the three largest idle gaps inside, with what ran before and after
  overlap         the data copies (device-to-device memcpys and wx_copy_ranges) against the FP8
                  kernel (wx_fp8_quant), each as the union of its intervals: quant_ms, copy_ms,
                  beside_ms (both at once), copy_alone_ms (copies with no quantizer running), their
                  streams, which of the two started first, and begin_to_data_ms (from the end of
                  the first host-to-device copy, the begin stamp, to the first data op); and
                  per kernel its launch shape as CUPTI saw it (grid, registers, shared memory):
                  whether the large BF16 copies ran beside the quantizer (issue 37,
                  wxfer/runtime/overlap.py) or after it

Turned on by WXFER_BB_PROFILE=1 (bench_baselines' wxfer method on a CUDA device); the summary
goes into the row's figures (``profile``) and one line to stdout; the raw trace is not kept
(profile-<row>.json under --out only with WXFER_BB_PROFILE=keep).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def wanted(dev) -> bool:
    return getattr(dev, "type", None) == "cuda" and os.environ.get("WXFER_BB_PROFILE", "") not in ("", "0")


def _union(iv: list) -> float:
    tot, end = 0.0, None
    start = None
    for a, b in sorted(iv):
        if end is None or a > end:
            if end is not None:
                tot += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        tot += end - start
    return tot


def summarize(events: list, t0_us: float, t1_us: float) -> dict:
    """The summary (module docstring) of a Chrome trace's events inside [t0_us, t1_us]."""
    dev, raw = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        a = float(e["ts"])
        b = a + float(e.get("dur", 0))
        if b < t0_us or a > t1_us:
            continue
        dev.append((max(a, t0_us), min(b, t1_us), e["cat"], e.get("name", "")))
        raw.append(e)
    out = dict(push_ms=(t1_us - t0_us) / 1e3, device_ops=len(dev))
    if not dev:
        out.update(gpu_busy_ms=0.0, note="no device work inside the push (profiler saw none)")
        return out
    dev.sort()
    per: dict = {}
    for a, b, cat, name in dev:
        key = name if cat == "kernel" else cat
        per[key] = per.get(key, 0.0) + (b - a)
    busy = _union([(a, b) for a, b, _, _ in dev])
    first, last = dev[0][0], max(b for _, b, _, _ in dev)
    gaps, end, before = [], dev[0][1], dev[0][3]
    for a, b, _, name in dev[1:]:
        if a > end:
            gaps.append((a - end, before[:40], name[:40]))
        if b >= end:
            end, before = b, name
    gaps.sort(reverse=True)
    out.update(
        gpu_busy_ms=busy / 1e3,
        lead_ms=(first - t0_us) / 1e3,
        idle_ms=((last - first) - busy) / 1e3,
        tail_ms=(t1_us - last) / 1e3,
        copies_ms=per.pop("gpu_memcpy", 0.0) / 1e3,
        memsets_ms=per.pop("gpu_memset", 0.0) / 1e3,
        kernels={k[:60]: round(v / 1e3, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:5]},
        kernel_launches=sum(1 for d in dev if d[2] == "kernel"),
        gaps=[dict(ms=round(g / 1e3, 3), after=a, before=b) for g, a, b in gaps[:3]],
        overlap=overlap(raw, t0_us, t1_us),
    )
    return out


def _is_quant(e) -> bool:
    return e.get("cat") == "kernel" and e.get("name", "").startswith("wx_fp8_quant")


def _is_copy(e) -> bool:
    """A data copy: a device-to-device memcpy (the engine's cuda_ipc writes) or the batched copy
    kernel (the in-place copies); host-to-device copies are the version stamps."""
    n = e.get("name", "")
    return (e.get("cat") == "gpu_memcpy" and "DtoD" in n) or (e.get("cat") == "kernel" and n.startswith("wx_copy"))


def overlap(raw: list, t0_us: float, t1_us: float) -> dict:
    """The copies against the quantizer (module docstring, ``overlap``) of the device events
    `raw` (Chrome trace events) inside [t0_us, t1_us]."""

    def iv(keep):
        return [
            (max(float(e["ts"]), t0_us), min(float(e["ts"]) + float(e.get("dur", 0)), t1_us)) for e in raw if keep(e)
        ]

    q, c = iv(_is_quant), iv(_is_copy)
    uq, uc, both = _union(q), _union(c), _union(q + c)
    beside = uq + uc - both
    out = dict(quant_ms=uq / 1e3, copy_ms=uc / 1e3, beside_ms=beside / 1e3, copy_alone_ms=(uc - beside) / 1e3)
    out["copy_streams"] = sorted({str(e.get("tid")) for e in raw if _is_copy(e)})
    out["quant_streams"] = sorted({str(e.get("tid")) for e in raw if _is_quant(e)})
    if q and c:
        out["first"] = "copy" if min(c)[0] < min(q)[0] else "quant"
    h2d = sorted(float(e["ts"]) + float(e.get("dur", 0)) for e in raw if "HtoD" in e.get("name", ""))
    data = sorted(float(e["ts"]) for e in raw if _is_copy(e) or _is_quant(e))
    if h2d and data and data[0] >= h2d[0]:
        out["begin_to_data_ms"] = (data[0] - h2d[0]) / 1e3
    shapes = {}
    for e in raw:
        n, a = e.get("name", ""), e.get("args") or {}
        if e.get("cat") == "kernel" and n.startswith("wx_") and n not in shapes:
            shapes[n[:40]] = {k: a[k] for k in ("grid", "block", "registers per thread", "shared memory") if k in a}
    out["shapes"] = shapes
    return out


def profiled_push(s, dev, label: str, out_dir: str | None) -> dict:
    """One more push of Sender `s` under torch.profiler; its summary (see the module)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("wxfer.push"):
            t = time.perf_counter()
            s.push()
            wall = time.perf_counter() - t
        torch.cuda.synchronize(dev)
    keep = os.environ.get("WXFER_BB_PROFILE") == "keep" and out_dir
    path = os.path.join(out_dir, "profile-%s.json" % label) if keep else None
    with tempfile.TemporaryDirectory() as tmp:
        p = path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(p)
        with open(p) as f:
            d = json.load(f)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    win = [e for e in ev if e.get("name") == "wxfer.push" and e.get("ph") == "X"]
    if not win:
        return dict(error="the profiler's trace has no wxfer.push range", wall_ms=wall * 1e3)
    t0 = float(win[0]["ts"])
    r = summarize(ev, t0, t0 + float(win[0]["dur"]))
    r["wall_ms"] = wall * 1e3
    return r


def line(label: str, r: dict) -> str:
    """One line of the summary for the log (and, where the push quantized, one of the copies
    against the quantizer)."""
    if "error" in r or "note" in r:
        return "[profile] %s: %s" % (label, r.get("error") or r.get("note"))
    ks = ", ".join("%s %.2f" % (k, v) for k, v in r["kernels"].items())
    gs = "; ".join("%.2f ms after %s" % (g["ms"], g["after"]) for g in r["gaps"])
    s = (
        "[profile] %s: push %.2f ms; device busy %.2f ms (kernels: %s; copies %.2f ms, %d launches); "
        "lead %.2f ms, idle inside %.2f ms, tail %.2f ms; largest gaps: %s"
        % (label, r["push_ms"], r["gpu_busy_ms"], ks, r["copies_ms"], r["kernel_launches"],
           r["lead_ms"], r["idle_ms"], r["tail_ms"], gs)
    )  # fmt: skip
    o = r.get("overlap") or {}
    if o.get("quant_ms"):
        s += (
            "\n[profile] %s: copies vs quantizer: quant %.2f ms, copies %.2f ms, %.2f ms of them beside it, "
            "%.2f ms alone (first: %s; streams copy %s, quant %s); begin stamp -> first data op %s ms; shapes %s"
            % (label, o["quant_ms"], o["copy_ms"], o["beside_ms"], o["copy_alone_ms"], o.get("first", "-"),
               ",".join(o["copy_streams"]), ",".join(o["quant_streams"]),
               "%.3f" % o["begin_to_data_ms"] if "begin_to_data_ms" in o else "-", json.dumps(o["shapes"]))
        )  # fmt: skip
    return s
