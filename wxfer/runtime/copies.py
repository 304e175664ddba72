"""Many device-to-device copies in one call.

``copy_ranges(device, items)`` copies every item (a destination and a source tensor of the
same byte count on one CUDA device, and their addresses) on the current CUDA stream with one
launch of the native batched copy kernel (csrc/prepare/wx_copy_kernel.cu, compiled with NVRTC
at first use, as the FP8 kernel is; docs/prepare.md), or with one call of the driver's own
batched copy (``cuMemcpyBatchAsync``, CUDA 12.8+ drivers), whichever ``COPIER`` names (the one
switch: "kernel" or "driver"; ``copy_ranges(copier=)`` overrides it per call), or, where
neither can run (no CUDA driver or libnvrtc, ``WXFER_COPY=torch``), with one
``torch._foreach_copy_``. All give the same bytes; the kernel moves them at about the
on-device copy's rate, torch's batched copy at about half of it on an H200
(benchmarks/README.md; benchmarks/bench_copies.py measures all three beside the bound). The
kernel's range table is uploaded once per distinct batch and kept on the device (a push copies
the same ranges every step: ``device_table``; ``launch_at`` launches again a table its caller
kept, wxfer.runtime.copy_launch). ``info()`` says which copier would run and why; ``last()`` which
one ran last.
"""

from __future__ import annotations

import array

from .nvrtc import Probe

CHUNK = 64 << 10  # = WX_COPY_CHUNK in csrc/prepare/wx_copy.h
# The product path: "kernel" (the batched copy kernel) or "driver" (cuMemcpyBatchAsync). The
# kernel until the H200 numbers of benchmarks/bench_copies.py say otherwise; a driver without
# cuMemcpyBatchAsync (older than 12.8) falls back to the kernel.
COPIER = "kernel"
COPIERS = ("kernel", "driver")
TABLES_KEPT = 256  # device range tables kept (one per distinct batch and stream)
_calls = {"native": 0, "driver": 0, "torch": 0}
_last: dict | None = None
_tables: dict = {}  # (stream, table bytes) -> the table in device memory
_batch_ok: dict = {}  # CUDA ordinal -> None (cuMemcpyBatchAsync there) or why not


_PROBE = Probe("WXFER_COPY", "torch", "torch._foreach_copy_", "copy_probe")


def _native_why(device, probe: bool = True) -> str | None:
    """None when the native kernel can copy on `device`, else why not; probe=False: "" when
    that is not known yet."""
    return _PROBE.why(device, probe)


def driver_why(device) -> str | None:
    """None when the driver's cuMemcpyBatchAsync can copy on CUDA `device`, else why not
    (asked of the extension once per device)."""
    if device.type != "cuda":
        return f"tensors on {device.type}: the driver's batched copy runs on CUDA devices only"
    if device.index not in _batch_ok:
        try:
            from .. import _wxfer
        except ImportError as e:
            return f"the native extension wxfer._wxfer is not built ({e})"
        ok, why = _wxfer.copy_batch_probe(device.index)
        _batch_ok[device.index] = None if ok else why
    return _batch_ok[device.index]


def _pick(device, copier: str | None, probe: bool = True) -> tuple:
    """(what runs: "native" | "driver" | "torch._foreach_copy_" | "none", why) on `device`. The
    driver's batch needs no kernel: the kernel is compiled only where it is what runs."""
    copier = COPIER if copier is None else copier
    if copier not in COPIERS:
        raise ValueError(f"copies: copier must be one of {COPIERS}, got {copier!r}")
    dwhy = None
    if copier == "driver" and device.type == "cuda" and _PROBE.allowed():
        dwhy = driver_why(device)
        if dwhy is None:
            return "driver", f"cuMemcpyBatchAsync of the CUDA driver on {device}"
    why = _native_why(device, probe)
    if why == "":
        return "none", "no batched copy on this device yet (the kernel is compiled at first use)"
    if why is None:
        return "native", f"the NVRTC-compiled kernel runs on {device}" + (f" (no driver batch: {dwhy})" if dwhy else "")
    return "torch._foreach_copy_", why + (f"; and {dwhy}" if dwhy else "")


def info(device=None, probe: bool = True, copier: str | None = None) -> dict:
    """{"copier": "native" | "driver" | "torch._foreach_copy_" | "none", "reason": ...} for
    tensors on `device` (default: the current CUDA device) with `copier` (default ``COPIER``),
    with the launches each served so far."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None:
        d = {"copier": "torch._foreach_copy_", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    else:
        ran, why = _pick(torch.device(device), copier, probe)
        d = {"copier": ran, "reason": why}
        if ran == "native":
            from .. import _wxfer

            d.update(_wxfer.copy_settings())
    d.update(native_calls=_calls["native"], driver_calls=_calls["driver"], torch_calls=_calls["torch"])
    return d


def last() -> dict | None:
    """The copier of the last copy_ranges call and why ({"copier", "reason"}), or None."""
    return None if _last is None else dict(_last)


def table(items) -> array.array:
    """The kernel's range table of `items` [(dst, src, dst address, src address, nbytes)]:
    4 x uint64 per range (dst, src, nbytes, chunk0), chunk0 the chunks of CHUNK bytes before it."""
    t = array.array("Q")
    chunk0 = 0
    for _d, _s, dp, sp, n in items:
        t.extend((dp, sp, n, chunk0))
        chunk0 += (n + CHUNK - 1) // CHUNK
    return t


def copy_ranges(
    device, items, copier: str | None = None, ranges: array.array | None = None, ctas: int = 0, beside: bool = False
) -> str:
    """Copy every item [(dst tensor, src tensor, dst address, src address, nbytes)] on the
    current stream of CUDA `device` in one call; returns the copier that ran ("native",
    "driver" or "torch._foreach_copy_"). `copier`: "kernel" or "driver" (default ``COPIER``).
    The tensors are byte views (the fallback copies them). `ranges`: ``table(items)`` made
    by the caller (kept from an earlier launch of the same items), else made here. `ctas`:
    the native kernel's CTAs per SM (0: its own; a few leave room for a kernel beside it,
    wxfer.runtime.overlap); `beside`: the driver's batch is asked to run beside the SMs' work
    (its copy engines: ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, a hint); each only
    where that copier runs."""
    global _last
    if not items:
        return "none"
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ran, why = _pick(device, copier)
    if ran == "native":
        _native(device, items, ranges, ctas)
        _calls["native"] += 1
    elif ran == "driver":
        _driver(device, items, beside)
        _calls["driver"] += 1
    else:
        ran = "torch._foreach_copy_"
        torch._foreach_copy_([i[0] for i in items], [i[1] for i in items])
        _calls["torch"] += 1
    _last = {"copier": ran, "reason": why}
    return ran


def _driver(device, items, beside: bool = False) -> None:
    from .. import _wxfer
    from .fp8 import _raw_stream

    triples = array.array("Q")
    for i in items:
        triples.extend(i[2:])
    if beside:
        _wxfer.copy_batch(device.index, _raw_stream(device), triples, True)
    else:
        _wxfer.copy_batch(device.index, _raw_stream(device), triples)


def device_table(device, stream: int, t: array.array):
    """Range table `t` in the memory of CUDA `device` (a uint8 tensor), uploaded on `stream` (a
    CUstream value: the launches that read it go on that stream) once per distinct table.  The
    upload runs on torch's current stream, so `stream` must be it (checked where it uploads)."""
    import torch

    from .fp8 import _raw_stream

    key = (stream, t.tobytes())
    dev = _tables.get(key)
    if dev is None:
        cur = _raw_stream(device)
        if cur != stream:
            raise ValueError(f"copies.device_table: stream {stream:#x} is not {device}'s current stream {cur:#x}")
        if len(_tables) >= TABLES_KEPT:
            _tables.clear()  # freed in stream order: later work on these streams comes after the kernels
        dev = torch.frombuffer(bytearray(key[1]), dtype=torch.uint8).to(device, non_blocking=True)
        _tables[key] = dev
    return dev


def launch_at(device, stream: int, t: array.array, dev) -> None:
    """One launch of the native kernel over range table `t` on `stream` of CUDA `device`, its copy
    `dev` in device memory made by ``device_table`` on that stream (kept by the caller: the same
    launch push after push, wxfer.runtime.copy_launch); the copier that ran recorded as
    copy_ranges records it.  The caller has had copy_ranges run "native" on `device` (this push)."""
    global _last
    from .. import _wxfer

    _wxfer.copy_launch(device.index, stream, t, dev.data_ptr())
    _calls["native"] += 1
    _last = _NATIVE_AGAIN


_NATIVE_AGAIN = {"copier": "native", "reason": "the NVRTC-compiled kernel (its device table kept by the caller)"}


def _native(device, items, ranges=None, ctas: int = 0) -> None:
    from .. import _wxfer
    from .fp8 import _raw_stream

    stream = _raw_stream(device)
    t = table(items) if ranges is None else ranges
    dev = device_table(device, stream, t)
    if ctas:
        _wxfer.copy_launch(device.index, stream, t, dev.data_ptr(), int(ctas))
    else:
        _wxfer.copy_launch(device.index, stream, t, dev.data_ptr())
