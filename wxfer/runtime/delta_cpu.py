"""Delta pushes on the CPU (issue 36): compare, encode and shadow update in native code.

``encode(writer, op, buf, dests, sh, gpus)`` is ``DeltaWriter._encode`` for a task whose bytes
are in host memory: per distinct source range one pass (``delta_scan``: the changed count and
their offsets, no bool temporary), the same per-task choice (records or dense, by cost), then
per destination range the record (``delta_encode``: byte for byte ``delta.encode``'s format,
written straight into the record tensor) and the shadow brought up to date with the changed
bytes alone (``delta_sync``; the whole range when there were too many to keep their offsets).
The GIL is released in each call (csrc/prepare/wx_delta_host.c)."""

from __future__ import annotations

import time

from . import delta
from .program import task_error


def available(device) -> bool:
    """The native CPU path serves tensors on `device` (a CPU device, the extension built with it)."""
    if device.type != "cpu":
        return False
    try:
        from .. import _wxfer
    except ImportError:
        return False
    return hasattr(_wxfer, "delta_scan")


def _cap(n: int) -> int:
    """Offsets kept per range: enough for any range whose record is index/value pairs."""
    return min(n, n // 32 + 16)


def scan(cur, old):
    """(changed count, int32 offsets tensor or None when more than _cap) of uint8 host tensors."""
    import torch
    from .. import _wxfer

    n = int(cur.numel())
    cap = _cap(n)
    idx = torch.empty(cap, dtype=torch.int32)  # untouched pages are never faulted in
    c = _wxfer.delta_scan(cur.data_ptr(), old.data_ptr(), n, idx.data_ptr(), cap)
    return c, (idx if c <= cap else None)


def record(cur, old, c: int, idx, region: int, doff: int):
    """The record (uint8 tensor) of range `cur` against `old` with `c` changed bytes."""
    import torch
    from .. import _wxfer

    n = int(cur.numel())
    size = delta.record_size(n, c)
    out = torch.empty(size, dtype=torch.uint8)
    ip = 0 if idx is None else idx.data_ptr()
    _wxfer.delta_encode(cur.data_ptr(), old.data_ptr(), n, c, ip, int(region), int(doff), out.data_ptr(), size)
    return out


def encode(w, op, buf, dests, sh, gpus) -> tuple:
    """({gpu: [records]} or None, why): DeltaWriter._encode's result; the shadow of the task is
    equal to `buf` on return either way (the caller skips its copy).  A native call's failure
    is raised naming the task (program.task_error)."""
    from .. import _wxfer

    try:
        return _encode(w, op, buf, dests, sh, gpus)
    except _wxfer.Error as e:
        raise task_error(op, e) from e


def _encode(w, op, buf, dests, sh, gpus) -> tuple:
    from .. import _wxfer

    old = sh[1]
    st = w.step
    t0 = time.perf_counter()
    per_range = {}
    for soff, n, so in sh[0]:
        c, idx = scan(buf[soff : soff + n], old[so : so + n])
        per_range[soff] = (so, n, c, idx)
        st["compared_bytes"] += n
        st["changed_bytes"] += c
    t1 = time.perf_counter()
    st["compare_s"] += t1 - t0
    need: dict = {}
    dense = 0
    for (rdesc, doff, soff, n), g in zip(dests, gpus):
        need[g] = need.get(g, 0) + delta.record_size(int(n), per_range[int(soff)][2])
        dense += int(n)
    rec_bytes = sum(need.values())
    cst = w.costs
    t_rec = rec_bytes / w.link_Bps + rec_bytes / cst["apply_Bps"] + rec_bytes / cst["encode_Bps"]
    out, why = {}, None
    if t_rec >= dense / w.link_Bps:
        out, why = None, "cost"
    elif any(need[g] > w.room[g] for g in need):
        out, why = None, "slot_full"
    else:
        for (rdesc, doff, soff, n), g in zip(dests, gpus):
            so, n, c, idx = per_range[int(soff)]
            if c == 0:
                continue
            ri = w._region_index(g).get(bytes(rdesc))
            if ri is None:
                out, why = None, "no_staging"
                break
            out.setdefault(g, []).append(record(buf[int(soff) : int(soff) + n], old[so : so + n], c, idx, ri, doff))
        if out is not None:
            for g, v in need.items():
                w.room[g] -= v
    for soff, (so, n, c, idx) in per_range.items():  # the shadow = buf: its changed bytes only
        if c:
            _wxfer.delta_sync(buf[soff : soff + n].data_ptr(), old[so : so + n].data_ptr(), n, c,
                              0 if idx is None else idx.data_ptr())  # fmt: skip
    return out, why


def sample(n: int, rate: float, device=None) -> tuple:
    """The calibrations' sample (this one and delta_send.calibrate_costs'): (old, new) uint8
    tensors of `n` random bytes (seed 0) on `device`, `new` with max(1, n * rate) of them flipped."""
    import torch

    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)
    new = old.clone()
    new[torch.randperm(n, generator=g)[: max(1, int(n * rate))].to(device)] ^= 1
    return old, new


def rates(rec_bytes: int, encode_s: float, apply_s: float, n: int, compare_s: float, rate: float, **more) -> dict:
    """A calibration's costs: encode and apply throughput (record bytes per second, a record of
    `rec_bytes` encoded in `encode_s` and applied in `apply_s`), compare throughput (`n` sample
    bytes in `compare_s`), the sample's size and change rate, and `more`."""
    return dict(
        encode_Bps=rec_bytes / max(encode_s, 1e-9),
        apply_Bps=rec_bytes / max(apply_s, 1e-9),
        compare_Bps=n / max(compare_s, 1e-9),
        sample_bytes=n,
        rate=rate,
        **more,
    )


def calibrate(n: int = 1 << 22, rate: float = 0.01) -> dict:
    """delta_send.calibrate_costs on the CPU with the native encode (what the pushes run)."""
    old, new = sample(n, rate)
    dst = old.clone()
    best_s = best_e = best_a = float("inf")
    rec = None
    for _ in range(3):
        t0 = time.perf_counter()
        c, idx = scan(new, old)
        t1 = time.perf_counter()
        rec = record(new, old, c, idx, 0, 0)
        t2 = time.perf_counter()
        delta.apply_records(rec, 1, [dst])
        t3 = time.perf_counter()
        best_s, best_e, best_a = min(best_s, t1 - t0), min(best_e, t2 - t1), min(best_a, t3 - t2)
    return rates(rec.numel(), best_e, best_a, n, best_s, rate, native=True)
