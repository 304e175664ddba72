"""Block-FP8 quantization straight into a packed buffer.

``quantize_into(out, jobs)`` quantizes every job (a 2-D source view and the byte offsets of
its e4m3 bytes and of its float32 scales in the uint8 buffer ``out``) with one launch of the
native kernel (csrc/prepare/wx_fp8_kernel.cu, compiled with NVRTC at first use; see
docs/prepare.md) on the current CUDA stream, or, where that kernel cannot run (CPU tensors,
no CUDA driver or libnvrtc, a GPU older than compute capability 8.9, ``WXFER_FP8=reference``),
with ``wxfer.mapping.reference.quantize_fp8_block`` and copies (on CPU tensors: the host
quantizer, csrc/prepare/wx_fp8_host.c, the same numerics in C). All give the same bytes.
``info()`` says which one would run and why; ``last()`` which one ran last.
"""

from __future__ import annotations

import array

from .nvrtc import Probe

_BLOCK = 128
_INLINE = 8  # pieces that travel in the launch's parameters (WX_FP8_INLINE)
_CODES = None  # torch dtype -> the kernel's dtype code
_calls = {"native": 0, "reference": 0}
_last: dict | None = None


def _torch():
    import torch

    return torch


def _codes():
    global _CODES
    if _CODES is None:
        torch = _torch()
        _CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
    return _CODES


_PROBE = Probe("WXFER_FP8", "reference", "the reference", "fp8_probe")


def _native_why(device, probe: bool = True) -> str | None:
    """None when the native kernel can quantize tensors on `device`, else why not. probe=False:
    "" when that is not known yet (the kernel has not been compiled for that device)."""
    return _PROBE.why(device, probe)


def info(device=None, probe: bool = True) -> dict:
    """{"quantizer": "native" | "reference", "reason": ...} for tensors on `device` (default:
    the current CUDA device; on a machine without CUDA, the reference and why), with the number
    of calls each quantizer served so far in this process. Probing a CUDA device loads libnvrtc
    and compiles the kernel (once); probe=False answers "none" instead when that has not
    happened yet."""
    torch = _torch()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None:
        why = "no CUDA device (torch.cuda.is_available() is False)"
    else:
        why = _native_why(torch.device(device), probe)
    if why == "":
        d = {
            "quantizer": "none",
            "reason": f"no FP8 piece quantized on {torch.device(device)} yet "
            "(the native kernel is compiled at first use)",
        }
    elif why is None:
        d = {
            "quantizer": "native",
            "reason": f"the NVRTC-compiled kernel runs on {torch.device(device)}",
        }
    else:
        d = {"quantizer": "reference", "reason": why}
    d.update(native_calls=_calls["native"], reference_calls=_calls["reference"])
    return d


def last() -> dict | None:
    """The quantizer of the last quantize_into call and why ({"quantizer", "reason"}), or None."""
    return None if _last is None else dict(_last)


def _norm(out, jobs):
    """[(2-D tensor, q_off or None, s_off or None)] of the non-empty jobs, checked against out."""
    if out.dim() != 1 or out.dtype != _torch().uint8 or not out.is_contiguous():
        raise ValueError(
            f"quantize_into: out must be a contiguous 1-D uint8 tensor, got {tuple(out.shape)} {out.dtype}"
        )
    return _checked(out.numel(), out.device, jobs)


def _checked(n: int, dev, jobs) -> list:
    """The non-empty jobs, each inside the n bytes of the output on `dev`."""
    res = []
    for i, job in enumerate(jobs):
        t, qo, so = job
        shape = t.shape
        if len(shape) != 2:
            raise ValueError(
                f"quantize_into: job {i}: FP8 block quantization needs a 2-D tensor, got shape {tuple(shape)}"
            )
        if t.device != dev:
            raise ValueError(f"quantize_into: job {i} is on {t.device}, out on {dev}")
        rows, cols = shape
        if rows == 0 or cols == 0:
            continue
        if qo is None:
            if so is None:
                continue
        elif qo < 0 or qo + rows * cols > n:
            _outside(i, rows, cols, "fp8", qo, rows * cols, n)
        if so is not None:
            nb = -(-rows // _BLOCK) * -(-cols // _BLOCK) * 4
            if so < 0 or so + nb > n:
                _outside(i, rows, cols, "scale", so, nb, n)
        res.append((t, qo, so))
    return res


def _outside(i, rows, cols, what, off, nb, n):
    raise ValueError(
        f"quantize_into: job {i} ({rows}x{cols}): its {what} bytes [{off}, {off + nb}) are not inside out ({n} bytes)"
    )


def quantize_into(out, jobs) -> str:
    """Quantize each job ``(tensor, fp8_offset | None, scale_offset | None)`` into the uint8
    tensor `out`: the e4m3 bytes (rows*cols, row-major) at fp8_offset and the float32 scales
    ([ceil(rows/128), ceil(cols/128)], row-major) at scale_offset, any alignment. The tensors
    are 2-D views (row/column slices, one expert of a 3-D tensor) on out's device. Returns the
    quantizer used ("native": one kernel launch on the current CUDA stream; "reference")."""
    return _run(out, _norm(out, jobs))


def _run(out, jobs, key=None) -> str:
    """quantize_into's work on checked jobs; with a key, the native piece table is kept for
    quantize_cached."""
    why = _native_why(out.device)
    if jobs and why is None:
        made = _native(out, jobs)
        if key is not None and made is not None:
            if len(_TABLES) >= _TABLES_MAX:
                _TABLES.clear()
            _TABLES[key] = (made[0], made[1], out.device, out.numel())
        _count("native", "one NVRTC-compiled kernel launch")
        return "native"
    host = _reference(out, jobs)
    if jobs:
        _count("reference", (why or "nothing to quantize") + ("; the host quantizer (wx_fp8_host.c)" if host else ""))
    return "reference"


def _count(kind: str, reason: str) -> None:
    global _last
    _calls[kind] += 1
    _last = {"quantizer": kind, "reason": reason}


def _reference(out, jobs) -> bool:
    """The jobs quantized off the GPU kernel: by the host quantizer (True) or torch (False)."""
    from ..mapping.reference import quantize_fp8_block

    torch = _torch()
    if _host(out, jobs):
        return True
    for t, qo, so in jobs:
        q, s = quantize_fp8_block(t)
        if qo is not None:
            out[qo : qo + q.numel()].copy_(q.view(-1).view(torch.uint8))
        if so is not None:
            out[so : so + s.numel() * 4].copy_(s.view(-1).view(torch.uint8))
    return False


def _not_host_rows(t, codes) -> bool:
    """`t` is not a host tensor of a known dtype in rows of unit column stride, each row at least
    its width apart (what wx_fp8_host reads)."""
    return (
        t.device.type != "cpu"
        or t.dtype not in codes
        or t.stride(1) != 1
        or (t.shape[0] > 1 and t.stride(0) < t.shape[1])
    )


def _host(out, jobs) -> bool:
    """The jobs quantized by the extension's host quantizer (csrc/prepare/wx_fp8_host.c: the
    reference's bytes in one pass, no temporaries) when out is in host memory, every source is
    a host view with unit column stride, and WXFER_FP8 is not "reference"; else False."""
    from .. import envs

    if out.device.type != "cpu" or envs.get("WXFER_FP8") == "reference":
        return False
    try:
        from .. import _wxfer
    except ImportError:
        return False
    if not hasattr(_wxfer, "fp8_host"):
        return False
    codes = _codes()
    if not out.is_contiguous() or any(_not_host_rows(t, codes) for t, _, _ in jobs):
        return False  # the reference takes what the host quantizer's rows-of-ld layout cannot
    base = out.data_ptr()
    nth = max(1, min(64, torch_threads()))
    for t, qo, so in jobs:
        rows, cols = t.shape
        q = 0 if qo is None else base + qo
        s = 0 if so is None else base + so
        _wxfer.fp8_host(t.data_ptr(), codes[t.dtype], t.stride(0) if rows > 1 else cols, rows, cols, q, s, nth)
    return True


def torch_threads() -> int:
    """The host quantizer's threads: torch's intra-op threads (what the reference would use)."""
    return int(_torch().get_num_threads())


def _raw_stream(device) -> int:
    """The current CUDA stream of `device` as a CUstream value (torch's private raw getter
    when it has one: no Stream object per call)."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:  # it takes an index: a bare torch.device("cuda") is the current device
        return raw(torch.cuda.current_device() if device.index is None else device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _native(out, jobs):
    """One launch over `jobs`. Returns (host table, device table or None) for reuse by
    quantize_cached when the launch read the jobs' own memory (no temporary made here), else
    None."""
    return _native_at(out.device, out.data_ptr(), out.numel(), jobs)


def _native_at(device, ptr: int, nbytes: int, jobs):
    """_native with the output given as `nbytes` bytes of device memory at address `ptr`."""
    table, keep, dev = _table(device, jobs)
    _launch_at(device, ptr, nbytes, table, dev)  # block until the copy ran
    return None if keep else (table, dev)  # else dev is freed in stream order by the allocator


def _table(device, jobs) -> tuple:
    """The kernel's piece table of checked `jobs`: (host table, the sources made contiguous or
    cast, to keep alive until the launch, its device copy or None when it travels inline)."""
    torch = _torch()
    codes = _codes()
    table = array.array("q")
    keep = []  # sources made contiguous / cast: alive until the launch
    tiles = 0
    for t, qo, so in jobs:
        rows, cols = t.shape
        code = codes.get(t.dtype)
        if code is None:  # the reference computes in float32 too: same bytes
            t = t.to(torch.float32)
            keep.append(t)
            code = codes[torch.float32]
        st = t.stride()
        if cols > 1 and st[1] != 1:
            t = t.contiguous()
            keep.append(t)
            st = t.stride()
        ld = st[0] if rows > 1 else cols
        table.extend((t.data_ptr(), code, ld, rows, cols, -1 if qo is None else qo, -1 if so is None else so, tiles))
        tiles += -(-rows // _BLOCK) * -(-cols // _BLOCK)
    dev = None
    if len(jobs) > _INLINE:  # else the table travels in the launch's parameters (no copy)
        host = torch.frombuffer(table, dtype=torch.int64)
        pinned = torch.empty(host.numel(), dtype=torch.int64, pin_memory=True)
        pinned.copy_(host)
        dev = pinned.to(device, non_blocking=True)  # stream-ordered; torch keeps the host
    return table, keep, dev


def _launch(out, table, dev) -> None:
    """One kernel launch on the current stream: the piece table inline (dev None) or in
    device memory (dev: its copy, already ordered on that stream)."""
    _launch_at(out.device, out.data_ptr(), out.numel(), table, dev)


def _launch_at(device, ptr: int, nbytes: int, table, dev) -> None:
    """_launch into `nbytes` bytes of device memory at address `ptr`."""
    from .. import _wxfer

    _wxfer.fp8_launch(device.index, _raw_stream(device), ptr, nbytes, table, 0 if dev is None else dev.data_ptr())


_TABLES: dict = {}  # key -> (host table, device table, device, out bytes)
_TABLES_MAX = 4096


def quantize_cached(out, key, build) -> str:
    """``quantize_into(out, build())``, where `key` (hashable) names the jobs exactly: the
    same sources (address, strides, dtype), shapes and offsets whenever the key is the same.
    The first call builds the native kernel's piece table; later calls with that key launch
    with it at once (no per-piece Python work: a task of 384 expert pieces costs one launch).
    The caller builds the key from what it knows is fixed (the plan's shards) and what may
    change (the sources' data_ptr and strides)."""
    ent = _TABLES.get(key)
    if ent is not None and ent[2] == out.device and ent[3] == out.numel() and _native_why(out.device) is None:
        _launch(out, ent[0], ent[1])
        _count("native", "one NVRTC-compiled kernel launch (piece table reused)")
        return "native"
    return _run(out, _norm(out, build()), key)


def quantize_span(ptr: int, nbytes: int, device, build, key) -> bool:
    """Native only: ``quantize_cached`` into the `nbytes` bytes of device memory at address
    `ptr` on `device` (memory no tensor of this process owns: another process's weights mapped
    here, wxfer.runtime.inplace), one launch on the current stream; build() gives the jobs with
    offsets relative to `ptr`, `key` names them and ptr. Returns False, having done nothing,
    where the native kernel cannot run on `device` (the caller then uses quantize_into)."""
    if _native_why(device) is not None:
        return False
    ent = _TABLES.get(key)
    if ent is not None and ent[2] == device and ent[3] == nbytes:
        _launch_at(device, ptr, nbytes, ent[0], ent[1])
        _count("native", "one NVRTC-compiled kernel launch (piece table reused)")
        return True
    jobs = _checked(nbytes, device, build())
    if not jobs:
        return True
    made = _native_at(device, ptr, nbytes, jobs)
    if made is not None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        _TABLES[key] = (made[0], made[1], device, nbytes)
    _count("native", "one NVRTC-compiled kernel launch")
    return True
