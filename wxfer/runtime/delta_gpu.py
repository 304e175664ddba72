"""Delta pushes on the GPU (issue 36): the compare with the shadow and the records in native
kernels (csrc/prepare/wx_delta*.cu, compiled with NVRTC at first use like the FP8 kernel).

Each call updates the shadow (a uint8 CUDA tensor: what this rank last wrote) to the fresh bytes
in place and ORs bit i of a bitmask (``bits_for``: int32 words, zeroed) for every byte i of the
shadow that changed:

* ``quantize_compare(shadow, bits, jobs)``: the FP8 kernel's work (``fp8.quantize_into``'s jobs,
  offsets into the shadow) fused with the compare: the same bytes and scales, bit for bit, the
  old bytes read once, only the changed ones written;
* ``compare(shadow, bits, buf, layout)``: fresh bytes already made (BF16, packed buffers):
  layout ``[(offset in buf, nbytes, offset in shadow)]``.

Then ``count(bits, ranges)`` gives the changed bytes of each shadow range ``[(offset, nbytes)]``
(one device-to-host read) and ``emit(shadow, counted, recs)`` writes each record, byte for byte
what ``delta.encode`` makes of the same range (PAIRS or MASK, whichever is smaller, in byte
order); or ``scatter(shadow, bits, targets)`` stores each changed byte of a range straight at
its destination (the receiver's memory, mapped here: docs/delta.md). ``why(device)`` is None
where the kernels run, else the reason (``WXFER_DELTA_GPU=torch`` forces the torch ops of
delta.py).
"""

from __future__ import annotations

import array

from . import delta
from .nvrtc import Probe

SEG = 8192  # bytes of a range per segment of the count / emit kernels (WX_DELTA_SEG)
_PROBE = Probe("WXFER_DELTA_GPU", "torch", "the torch ops of wxfer.runtime.delta", "delta_probe")


def why(device, probe: bool = True) -> str | None:
    """None when the delta kernels run on `device`, else why not."""
    return _PROBE.why(device, probe)


def bits_for(nbytes: int, device):
    """A zeroed bitmask for a shadow of `nbytes` bytes (one word past the end, as the kernels
    read)."""
    import torch

    return torch.zeros((int(nbytes) + 31) // 32 + 1, dtype=torch.int32, device=device)


def _segs(n: int) -> int:
    return (int(n) + SEG - 1) // SEG


def _stream(device) -> int:
    from .fp8 import _raw_stream

    return _raw_stream(device)


def _dev(table: array.array, device):
    """The table's bytes in device memory, copied on the current stream (kept by the caller
    until the launch is ordered after it)."""
    import torch

    host = torch.frombuffer(table, dtype=torch.int64)
    pinned = torch.empty(host.numel(), dtype=torch.int64, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def quantize_compare(shadow, bits, jobs) -> None:
    """The FP8 jobs ``(tensor, fp8_offset | None, scale_offset | None)`` quantized into the
    shadow, compared with what it held: the changed bytes written and marked in `bits`."""
    from .. import _wxfer
    from .fp8 import _checked, _table

    dev = shadow.device
    jobs = _checked(shadow.numel(), dev, jobs)
    if not jobs:
        return
    table, keep, dtab = _table(dev, jobs)
    _wxfer.delta_quant_launch(
        dev.index, _stream(dev), shadow.data_ptr(), shadow.numel(), table,
        0 if dtab is None else dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4,
    )  # fmt: skip
    del keep, dtab  # freed in stream order


def compare(shadow, bits, buf, layout) -> None:
    """Each range ``(offset in buf, nbytes, offset in shadow)`` of the uint8 tensor `buf`
    compared with the shadow's bytes at its offset: the changed ones written and marked."""
    from .. import _wxfer

    dev = shadow.device
    table, seg = array.array("Q"), 0
    b0, s0 = buf.data_ptr(), shadow.data_ptr()
    for soff, n, so in layout:
        if soff < 0 or so < 0 or soff + n > buf.numel() or so + n > shadow.numel():
            raise ValueError(f"delta compare: range {soff}+{n} -> {so} outside buf or shadow")
        table.extend((s0 + so, b0 + soff, n, seg, so))
        seg += _segs(n)
    dtab = _dev(table, dev)
    _wxfer.delta_launch(0, dev.index, _stream(dev), table, dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4)


def count(bits, ranges) -> tuple:
    """The changed bytes of each shadow range ``(offset, nbytes)`` (a list, read back once) and
    what ``emit`` needs of them."""
    import torch

    from .. import _wxfer

    dev = bits.device
    table, seg0 = array.array("Q"), []
    seg = 0
    for so, n in ranges:
        table.extend((so, n, seg))
        seg0.append(seg)
        seg += _segs(n)
    counts = torch.empty(seg, dtype=torch.int32, device=dev)
    dtab = _dev(table, dev)
    _wxfer.delta_launch(
        1, dev.index, _stream(dev), table, dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4,
        counts.data_ptr(), seg,
    )  # fmt: skip
    segx = torch.zeros(seg + 1, dtype=torch.int64, device=dev)
    segx[1:] = torch.cumsum(counts, 0, dtype=torch.int64)
    ends = torch.tensor([s + _segs(n) for s, (_, n) in zip(seg0, ranges)] + seg0, dtype=torch.int64).to(dev)
    both = segx.index_select(0, ends).tolist()
    k = len(ranges)
    cs = [int(both[i] - both[k + i]) for i in range(k)]
    return cs, dict(bits=bits, segx=segx, seg0=seg0, ranges=list(ranges), cs=cs)


def emit(shadow, counted: dict, recs) -> list:
    """The records ``(range index, region, destination offset)`` of ranges counted by `count`
    (each with changed bytes), as uint8 tensors (views of one buffer), each equal to
    ``delta.encode`` of that range."""
    import torch

    from .. import _wxfer

    cs = counted["cs"]
    ranges, seg0 = counted["ranges"], counted["seg0"]
    table, spans = array.array("Q"), []
    off = seg = 0
    for i, region, doff in recs:
        so, n = ranges[i]
        c = cs[i]
        enc = delta.PAIRS if delta.pairs_size(c) <= delta.mask_size(n, c) else delta.MASK
        size = delta.pairs_size(c) if enc == delta.PAIRS else delta.mask_size(n, c)
        table.extend((off, so, n, seg, seg0[i], c, int(region) | (enc << 32), int(doff)))
        spans.append((off, size))
        off += size
        seg += _segs(n)
    if not spans:
        return []
    dev = shadow.device
    out = torch.zeros(off, dtype=torch.uint8, device=dev)
    bits, segx = counted["bits"], counted["segx"]
    dtab = _dev(table, dev)
    _wxfer.delta_launch(
        2, dev.index, _stream(dev), table, dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4,
        shadow.data_ptr(), shadow.numel(), segx.data_ptr(), segx.numel(), out.data_ptr(), off,
    )  # fmt: skip
    return [out[o : o + s] for o, s in spans]


def scatter(shadow, bits, targets) -> None:
    """Each target ``(destination address, offset in the shadow, nbytes)``: the bytes of that
    shadow range whose bit is set, stored at the same offset from the destination address (a
    receiver's memory mapped in this context, or any device memory), on the current stream."""
    from .. import _wxfer

    dev = shadow.device
    table, seg = array.array("Q"), 0
    for addr, so, n in targets:
        if so < 0 or n < 1 or so + n > shadow.numel():
            raise ValueError(f"delta scatter: shadow range {so}+{n} outside the {shadow.numel()}-byte shadow")
        table.extend((int(addr), int(so), int(n), seg))
        seg += _segs(n)
    if not targets:
        return
    dtab = _dev(table, dev)
    _wxfer.delta_launch(
        3, dev.index, _stream(dev), table, dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4,
        shadow.data_ptr(), shadow.numel(),
    )  # fmt: skip


def compare_count(shadow, buf, layout) -> tuple:
    """``compare`` then ``count`` of the layout's shadow ranges: (changed bytes per range,
    the state ``emit`` takes)."""
    bits = bits_for(shadow.numel(), shadow.device)
    compare(shadow, bits, buf, layout)
    return count(bits, [(so, n) for _, n, so in layout])
