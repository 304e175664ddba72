"""Delta pushes (issue 36): send only the destination bytes that changed since the last push.

The trainer keeps a *shadow* of what it last wrote, in the destination's format (its own share,
after fusion and FP8 quantization: the bytes of each task's send buffer).  Each push compares a
task's fresh bytes with its shadow and, per task, picks the cheaper of

  * dense: the task's bytes written as usual (the first push, after any failure, to a worker
    restarted or asking for a resync, or where the records would cost more than the bytes);
  * records: the changed bytes of each destination range, as index/value pairs (u32 offset +
    the byte) or a bitmask of the range plus the changed bytes, whichever is smaller, written
    one-sided into the receiver's staging area (``Receiver(delta_staging=...)``) and applied
    there by ``Receiver.apply()`` (in vLLM: ``finish_weight_update``) once the step is complete.

Byte-level records with absolute values: applying a step's records over that step's memory, or
twice, leaves the same bytes, and the receiver's memory after apply() equals a dense push's.

Staging layout (per receiver, one slot per trainer rank that writes it, in the rank order of
the plan's sender list, ``delta_bytes // senders`` bytes each, 8-aligned): a 48-byte header
(magic, version, last_rec, nrec, nbytes, 0) then ``nrec`` records, each a 32-byte head (region
index, encoding, destination offset, range length, changed count) and its payload (pairs: u32
offsets then the bytes, each padded to 8; mask: the bitmask, little-endian bit order, then the
bytes).  ``last_rec`` is the version of the last earlier push whose slot held records (-1: none
since a dense push): a receiver that did not apply those cannot apply these (DeltaError; it
asks the trainers for a dense push through the store, ``delta/resync``).
"""

from __future__ import annotations

import base64
import logging
import struct
import time

log = logging.getLogger(__name__)

MAGIC = 0x3154_4C45_4458_5857  # "WXDELT1" little-endian
HEAD = struct.Struct("<QqqQQQ")  # magic, version, last_rec, nrec, nbytes (payload after the header), 0
REC = struct.Struct("<IIQQQ")  # region index, encoding, offset, length, changed count
PAIRS, MASK = 0, 1
DELTA_TAG = 1 << 61  # engine tag of the record writes


class DeltaError(RuntimeError):
    """This receiver cannot apply the records in its staging area (it missed earlier ones)."""


def pad8(n: int) -> int:
    return (int(n) + 7) & ~7


def pairs_size(c: int) -> int:
    return REC.size + pad8(4 * c) + pad8(c)


def mask_size(n: int, c: int) -> int:
    return REC.size + pad8((n + 7) // 8) + pad8(c)


def record_size(n: int, c: int) -> int:
    """Bytes of the smaller record of a range of `n` bytes with `c` changed (0: no record)."""
    return 0 if c == 0 else min(pairs_size(c), mask_size(n, c))


# --------------------------------------------------------------------------- encode / apply


def changed(new, old):
    """(bool mask, count) of the bytes of uint8 tensors `new` and `old` that differ."""
    d = new != old
    return d, int(d.sum())


def encode(new, d, c: int, region: int, doff: int):
    """The record (a uint8 tensor on new's device) of range `new` (uint8) whose changed bytes are
    `d` (bool, `c` of them), to be applied at byte `doff` of region index `region`."""
    import torch

    n = new.numel()
    enc = PAIRS if pairs_size(c) <= mask_size(n, c) else MASK
    size = pairs_size(c) if enc == PAIRS else mask_size(n, c)
    out = torch.empty(size, dtype=torch.uint8, device=new.device)
    out[: REC.size] = torch.frombuffer(bytearray(REC.pack(region, enc, doff, n, c)), dtype=torch.uint8).to(new.device)
    p = REC.size
    if enc == PAIRS:
        idx = d.nonzero().view(-1)
        out[p : p + 4 * c] = idx.to(torch.int32).view(torch.uint8)
        out[p + 4 * c : p + pad8(4 * c)] = 0
        p += pad8(4 * c)
        vals = new.index_select(0, idx)
    else:
        m = (n + 7) // 8
        bits = torch.zeros(m * 8, dtype=torch.uint8, device=new.device)
        bits[:n] = d
        w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=new.device)
        out[p : p + m] = (bits.view(m, 8) * w).sum(1, dtype=torch.uint8)
        out[p + m : p + pad8(m)] = 0
        p += pad8(m)
        vals = new[d]
    out[p : p + c] = vals
    out[p + c :] = 0
    return out


def applier(buf, regions: list) -> tuple:
    """How apply_records applies records in `buf` to `regions`, and why not natively: ("kernel",
    None) on a CUDA device where wx_delta_apply runs (delta_gpu.apply: every region contiguous
    on that device); ("host", None) on host memory (wx_delta_host.c, one C call per record);
    else ("torch", the reason)."""
    if buf.device.type == "cuda":
        from . import delta_gpu

        why = delta_gpu.apply_why(buf.device) if regions else "no regions"
        if why is None:
            bad = [
                i for i, r in enumerate(regions)
                if r.device != buf.device or not r.is_contiguous() or str(r.dtype) != "torch.uint8"
            ]  # fmt: skip
            if not bad:
                return "kernel", None
            why = f"region {bad[0]} is not contiguous uint8 memory on {buf.device}"
        return "torch", why
    if _native_apply(buf, regions) is not None:
        return "host", None
    return "torch", "the records or a region are not contiguous host memory, or the extension lacks delta_apply"


def apply_records(buf, nrec: int, regions: list, how: str | None = None) -> int:
    """Apply `nrec` records from uint8 tensor `buf` (the payload after a slot's header) to
    `regions` (uint8 tensors, by region index); returns the bytes written. how: applier()'s
    choice (None: asked here); "torch" forces the torch ops."""
    import torch

    if (how or applier(buf, regions)[0]) == "kernel":
        from . import delta_gpu

        return delta_gpu.apply(buf, nrec, regions) if nrec else 0
    heads = buf.cpu() if buf.device.type != "cpu" else buf
    native = _native_apply(buf, regions) if how != "torch" else None
    p, total = 0, 0
    for _ in range(nrec):
        region, enc, doff, n, c = REC.unpack(heads[p : p + REC.size].numpy().tobytes())
        if region >= len(regions) or doff + n > regions[region].numel() or enc not in (PAIRS, MASK):
            raise DeltaError(f"record {region}/{enc} [{doff}, {doff + n}) outside the registered memory")
        dst = regions[region][doff : doff + n]
        p += REC.size
        if native is not None:  # host memory: one C call per record (csrc/prepare/wx_delta_host.c)
            size = (pairs_size(c) if enc == PAIRS else mask_size(n, c)) - REC.size
            if p + size > buf.numel():
                raise DeltaError(f"record {region}/{enc} [{doff}, {doff + n}): its payload overruns the records")
            try:
                native(buf.data_ptr() + p, size, enc, n, c, dst.data_ptr())
            except Exception as e:  # noqa: BLE001 -- the extension's Error: a malformed record
                raise DeltaError(f"record {region}/{enc} [{doff}, {doff + n}): {e}") from None
            p += size
            total += c
            continue
        if enc == PAIRS:
            idx = buf[p : p + 4 * c].view(torch.int32).long() & 0xFFFFFFFF  # u32 offsets: 2^31 and up too
            p += pad8(4 * c)
            dst[idx] = buf[p : p + c]
        else:
            m = (n + 7) // 8
            bits = buf[p : p + m]
            w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=buf.device)
            sel = ((bits.unsqueeze(1) & w) != 0).view(-1)[:n]
            p += pad8(m)
            dst[sel] = buf[p : p + c]
        p += pad8(c)
        total += c
    return total


def _native_apply(buf, regions):
    """The extension's delta_apply when the records and every region are contiguous host
    memory, else None (the torch path)."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    if any(r.device.type != "cpu" or not r.is_contiguous() for r in regions):
        return None
    try:
        from .. import _wxfer
    except ImportError:
        return None
    return getattr(_wxfer, "delta_apply", None)


# --------------------------------------------------------------------------- the receiver's side


class Staging:
    """A receiver's staging area for delta records: `nbytes` registered bytes (0: none), its
    slots (one per trainer rank writing here, known after the handshakes) and what was applied."""

    def __init__(self, receiver, nbytes: int):
        import torch

        self.r = receiver
        self.nbytes = pad8(int(nbytes))
        self.buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=receiver.device)
        self.region = receiver.transport.register(self.buf, export=True)
        self.applied: dict = {}  # sender rank -> version of the last slot applied
        self.applied_rec: dict = {}  # sender rank -> version of the last records applied
        self.applier, self.applier_why = None, None  # delta.applier's answer, at the first records
        self.last = dict(applied_s=0.0, records=0, bytes=0, changed=0, version=-1)
        self.total = dict(applied_s=0.0, records=0, bytes=0, changed=0, applies=0)

    def meta(self, regions: list) -> dict:
        return dict(
            delta=base64.b64encode(bytes(self.region.descriptor)).decode(),
            delta_bytes=self.nbytes,
            delta_regions=[base64.b64encode(bytes(r.descriptor)).decode() for r in regions],
        )

    def slot(self, i: int, n: int) -> tuple:
        size = (self.nbytes // max(n, 1)) & ~7
        return i * size, size

    def apply(self, regions: list, version: int | None = None, only: int | None = None) -> dict:
        """Apply the records of every slot whose header is of step `version` (default: the
        receiver's complete version; nothing while a step is being written) and not applied
        yet (`only`: that trainer rank's slot alone: verify's check of its writes, which landed).
        Returns {records, bytes, changed, applied_s, version}."""
        v = self.r.version() if version is None else int(version)
        t0 = time.perf_counter()
        out = dict(records=0, bytes=0, changed=0, version=v)
        if v >= 0:
            senders = list(self.r.senders)
            for i, s in enumerate(senders):
                if only is not None and s != only:
                    continue
                off, size = self.slot(i, len(senders))
                head = HEAD.unpack(self.buf[off : off + HEAD.size].cpu().numpy().tobytes())
                magic, hv, last_rec, nrec, nb, _ = head
                if magic != MAGIC or hv != v or self.applied.get(s, -1) >= hv:
                    continue
                # the bytes this step did not write (unchanged tasks, scattered ones: the
                # scatter stores only the changed bytes) are right only over the records of
                # step last_rec: required whether or not this step has records of its own
                if last_rec >= 0 and self.applied_rec.get(s, -1) != last_rec:
                    self._resync(s, last_rec, hv)
                if HEAD.size + nb > size:
                    raise DeltaError(f"trainer rank {s}'s records ({nb} bytes) overrun its slot of {size} bytes")
                payload = self.buf[off + HEAD.size : off + HEAD.size + nb]
                if nrec and self.applier is None:
                    self._choose(payload, regions)
                out["changed"] += apply_records(payload, nrec, regions, self.applier)
                out["records"] += nrec
                out["bytes"] += nb
                self.applied[s] = hv
                if nrec:
                    self.applied_rec[s] = hv
        if self.r.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.r.device)
        out["applied_s"] = time.perf_counter() - t0
        self.last = out
        for k in ("records", "bytes", "changed", "applied_s"):
            self.total[k] += out[k]
        self.total["applies"] += 1
        return out

    def _choose(self, payload, regions: list) -> None:
        """The applier of this receiver's records (delta.applier), chosen once and logged."""
        self.applier, self.applier_why = applier(payload, regions)
        if self.applier_why is None:
            log.info("wxfer.Receiver gpu %s: delta records applied by the %s path", self.r.gpu, self.applier)
        else:
            log.warning(
                "wxfer.Receiver gpu %s: delta records applied by torch ops on %s (%s)",
                self.r.gpu,
                payload.device,
                self.applier_why,
            )

    def stats(self) -> dict:
        d = dict(staging_bytes=self.nbytes, last=dict(self.last), total=dict(self.total), applier=self.applier)
        if self.applier_why is not None:
            d["applier_why"] = self.applier_why
        return d

    def unapplied(self, v: int) -> list:
        """The trainer ranks whose slot of step `v` this worker has not applied (its header is of
        another step: a later push began writing it, or it never came)."""
        return [s for s in self.r.senders if self.applied.get(s, -1) < int(v)]

    def ask_resync(self, v: int) -> None:
        """Ask every trainer for a dense push to this worker (read at each push's start)."""
        ctl = self.r.ctl
        ctl.set("delta/resync/%d" % self.r.gpu, str(v).encode())
        ctl.add("delta/resync", 1)

    def _resync(self, s: int, last_rec: int, v: int) -> None:
        self.ask_resync(v)
        raise DeltaError(
            f"wxfer.Receiver gpu {self.r.gpu}: the delta of step {v} from trainer rank {s} builds on the "
            f"records of step {last_rec}, which this worker did not apply (apply() after every push); "
            "its weights are stale until the next push, which the trainers send dense"
        )

    def close(self) -> None:
        try:
            self.region.close()
        except Exception:  # noqa: BLE001
            pass
