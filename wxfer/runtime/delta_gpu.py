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

The receiver's side: ``apply(buf, nrec, regions)`` applies a slot's records (delta.py's format,
in device memory) with the kernel ``wx_delta_apply`` (four phases on the current stream: the walk
over the heads, the count of each MASK record's bits and the check of each PAIRS offset, the
check of the counts, the apply), every record checked before any byte is written; one read back
(the answer) per call. ``apply_why(device)`` is None where it runs (any compute capability),
else the reason (``WXFER_DELTA_APPLY=torch`` forces delta.apply_records' torch ops).
"""

from __future__ import annotations

import array

from . import delta
from .nvrtc import Probe

SEG = 8192  # bytes of a range per segment of the count / emit kernels (WX_DELTA_SEG)
_PROBE = Probe("WXFER_DELTA_GPU", "torch", "the torch ops of wxfer.runtime.delta", "delta_probe")
_APPLY_PROBE = Probe("WXFER_DELTA_APPLY", "torch", "the torch apply of wxfer.runtime.delta", "delta_apply_probe")
# the answer of wx_delta_apply (state[0]): error bits (wx_delta.h WX_DELTA_AP_*)
AP_HEAD, AP_OVER, AP_BAD, AP_SEGS = 1, 2, 4, 8
AP_WORK = 64  # bytes of the walk's entry per record


def why(device, probe: bool = True) -> str | None:
    """None when the delta kernels run on `device`, else why not."""
    return _PROBE.why(device, probe)


def apply_why(device, probe: bool = True) -> str | None:
    """None when the apply kernel runs on `device`, else why not."""
    return _APPLY_PROBE.why(device, probe)


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


def apply_cap(rec_nbytes: int, nrec: int) -> int:
    """Segments of a slot's records at most (wx_delta.h WX_DELTA_AP_CAP)."""
    return int(rec_nbytes) // 1024 + int(nrec) + 1


_TABLES: dict = {}  # (device, the table's values) -> the table in device memory (its content is its key)


def region_table(regions, device):
    """The {base address, nbytes} table of the regions (uint8 tensors on `device`), in device
    memory (kept for the next call with the same regions: a receiver's are fixed); a region
    elsewhere or not contiguous is refused naming its index."""
    import torch

    flat = []
    for i, r in enumerate(regions):
        if r.device != device or not r.is_contiguous() or r.dtype != torch.uint8:
            raise ValueError(
                f"delta apply: region {i} is {r.dtype} on {r.device} (contiguous: {r.is_contiguous()}); the "
                f"kernel writes contiguous uint8 memory on {device}"
            )
        flat.extend((r.data_ptr(), r.numel()))
    key = (str(device), tuple(flat))
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) >= 16:
            _TABLES.pop(next(iter(_TABLES)))
        t = _TABLES[key] = _dev(array.array("Q", flat), device)
    return t


def apply(buf, nrec: int, regions, table=None) -> int:
    """Apply `nrec` records from the uint8 CUDA tensor `buf` (a slot's payload after its header,
    8-aligned) to `regions` (uint8 tensors on its device, by region index; `table`: their
    region_table, made here when None) with wx_delta_apply; returns the changed bytes written.
    Raises delta.DeltaError naming the first malformed record (nothing written then)."""
    import torch

    from .. import _wxfer

    dev = buf.device
    nrec = int(nrec)
    if nrec == 0:
        return 0
    if not buf.is_contiguous() or buf.data_ptr() % 8:
        raise ValueError("delta apply: the records must be contiguous and 8-aligned")
    if table is None:
        table = region_table(regions, dev)
    cap = apply_cap(buf.numel(), nrec)
    work = torch.empty(nrec * AP_WORK // 8, dtype=torch.int64, device=dev)
    state = torch.zeros(8, dtype=torch.int64, device=dev)
    counts = torch.zeros(cap, dtype=torch.int32, device=dev)
    segx = torch.zeros(cap + 1, dtype=torch.int64, device=dev)
    args = (
        buf.data_ptr(), buf.numel(), nrec, table.data_ptr(), len(regions), work.data_ptr(), state.data_ptr(),
        counts.data_ptr(), segx.data_ptr(), cap,
    )  # fmt: skip
    stream = _stream(dev)
    _wxfer.delta_apply_launch(dev.index, stream, 0, *args)
    torch.cumsum(counts, 0, dtype=torch.int64, out=segx[1:])
    _wxfer.delta_apply_launch(dev.index, stream, 1, *args)
    st = state.tolist()  # the one read back: waits for the apply
    if st[0]:
        raise _apply_error(buf, st, work, nrec)
    return int(st[4])


def _apply_error(buf, st, work, nrec):
    """The DeltaError of a refused apply, naming the record as delta.apply_records does."""
    err, i = int(st[0]), int(st[1])
    if err & AP_SEGS:
        return delta.DeltaError(f"delta apply: the records need more than {apply_cap(buf.numel(), nrec)} segments")
    # the walk stopped at the head at st[3]; the later phases name a record the walk entered
    p = int(st[3]) if st[5] else int(work.view(-1, AP_WORK // 8)[i, 6])
    if p + delta.REC.size > buf.numel():
        return delta.DeltaError(f"record {i}: its head at byte {p} overruns the {buf.numel()} bytes of records")
    region, enc, doff, n, c = delta.REC.unpack(buf[p : p + delta.REC.size].cpu().numpy().tobytes())
    what = f"record {region}/{enc} [{doff}, {doff + n})"
    if err & AP_HEAD:
        return delta.DeltaError(f"{what} outside the registered memory")
    if err & AP_OVER:
        return delta.DeltaError(f"{what}: its payload overruns the records")
    why = (
        f"{c} changed bytes of a range of {n}" if c > n
        else "an offset outside the range" if enc == delta.PAIRS
        else f"the mask does not hold {c} bits"
    )  # fmt: skip
    return delta.DeltaError(f"{what}: delta apply: {why}")
