"""Many device-to-device copies in one launch.

``copy_ranges(device, items)`` copies every item (a destination and a source tensor of the
same byte count on one CUDA device, and their addresses) on the current CUDA stream with one
launch of the native batched copy kernel (csrc/prepare/wx_copy_kernel.cu, compiled with NVRTC
at first use, as the FP8 kernel is; docs/prepare.md), or, where that kernel cannot run (no
CUDA driver or libnvrtc, ``WXFER_COPY=torch``), with one ``torch._foreach_copy_``. Both give
the same bytes; the kernel moves them at about the on-device copy's rate, torch's batched copy
at about half of it on an H200 (benchmarks/README.md). The range table is uploaded once per
distinct batch and kept on the device (a push copies the same ranges every step).
``info()`` says which copier would run and why; ``last()`` which one ran last.
"""

from __future__ import annotations

import array

from .nvrtc import Probe

CHUNK = 64 << 10  # = WX_COPY_CHUNK in csrc/prepare/wx_copy.h
TABLES_KEPT = 256  # device range tables kept (one per distinct batch and stream)
_calls = {"native": 0, "torch": 0}
_last: dict | None = None
_tables: dict = {}  # (stream, table bytes) -> the table in device memory


_PROBE = Probe("WXFER_COPY", "torch", "torch._foreach_copy_", "copy_probe")


def _native_why(device, probe: bool = True) -> str | None:
    """None when the native kernel can copy on `device`, else why not; probe=False: "" when
    that is not known yet."""
    return _PROBE.why(device, probe)


def info(device=None, probe: bool = True) -> dict:
    """{"copier": "native" | "torch._foreach_copy_" | "none", "reason": ...} for tensors on
    `device` (default: the current CUDA device), with the launches each served so far."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    why = (
        "no CUDA device (torch.cuda.is_available() is False)"
        if device is None
        else _native_why(torch.device(device), probe)
    )
    if why == "":
        d = {"copier": "none", "reason": "no batched copy on this device yet (the kernel is compiled at first use)"}
    elif why is None:
        from .. import _wxfer

        d = {"copier": "native", "reason": f"the NVRTC-compiled kernel runs on {torch.device(device)}"}
        d.update(_wxfer.copy_settings())
    else:
        d = {"copier": "torch._foreach_copy_", "reason": why}
    d.update(native_calls=_calls["native"], torch_calls=_calls["torch"])
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


def copy_ranges(device, items) -> str:
    """Copy every item [(dst tensor, src tensor, dst address, src address, nbytes)] on the
    current stream of CUDA `device` in one launch; returns the copier that ran ("native" or
    "torch._foreach_copy_"). The tensors are byte views (the fallback copies them)."""
    global _last
    if not items:
        return "none"
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    why = _native_why(device)
    if why is None:
        _native(device, items)
        _calls["native"] += 1
        _last = {"copier": "native", "reason": f"the NVRTC-compiled kernel runs on {device}"}
        return "native"
    torch._foreach_copy_([i[0] for i in items], [i[1] for i in items])
    _calls["torch"] += 1
    _last = {"copier": "torch._foreach_copy_", "reason": why}
    return "torch._foreach_copy_"


def _native(device, items) -> None:
    import torch

    from .. import _wxfer
    from .fp8 import _raw_stream

    stream = _raw_stream(device)
    t = table(items)
    key = (stream, t.tobytes())
    dev = _tables.get(key)
    if dev is None:
        if len(_tables) >= TABLES_KEPT:
            _tables.clear()  # freed in stream order: later work on these streams comes after the kernels
        dev = torch.frombuffer(bytearray(key[1]), dtype=torch.uint8).to(device, non_blocking=True)
        _tables[key] = dev
    _wxfer.copy_launch(device.index, stream, t, dev.data_ptr())
