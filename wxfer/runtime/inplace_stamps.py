"""The begin stamps of the in-place writes in stream order (``WXFER_BEGIN_WAIT=stream``, the
default; the in-place writer's part, ``StampOrder``, mixed into wxfer.runtime.inplace's
``InPlaceWriter``).

Before a push's first in-place write, each receiver's begin stamp, mapped here once through the
same ``Transport.map`` as its weights, is filled with the push's version by one small kernel
on the side stream, the stream every in-place write of the push is launched on.  Why that is
as safe as waiting for the engine's begin-stamp fence (docs/cuda_ipc.md):

* a receiver reads a step complete only when its begin and end stamps both say it
  (``Receiver.version``).  Every in-place byte of the push is queued after the fill on the same
  stream, so none reaches a receiver before its begin stamp says the new version while its end
  stamp still says the old one: a reader reads torn, never the old step over new bytes;
* the end stamps are the engine's fence after every task, and each in-place write is an
  external task that finishes on its CUDA event, recorded after its launch on that stream, so
  they land after the fill and after every in-place byte.  The engine's own begin stamp writes
  the same value (either may land first) and still orders the engine's own writes; the previous
  push was waited for before this one starts, so the fill cannot overtake its end stamps;
* a receiver whose engine begin stamp fails during the push reads torn (the fill wrote its
  stamp; its end stamp is not written), where the host wait would have skipped it;
* a receiver skipped at the fill (failed or dropped) gets no in-place write for the rest of
  the push (``unstamped``); a receiver whose stamp cannot be mapped here (on another GPU: the
  transport refuses it) is not filled, and then none of its memory is written in place either:
  a region of it not yet mapped is refused (``_stamp_check``: its tasks go the engine's way),
  and one mapped already sends the push back to the host wait;
* nothing here waits on a value the host or the engine sets, so a fence word the engine holds
  (a late receiver, or its sticky error until close) cannot stall this stream, nor the training
  stream that waits for it at the end of ``push()``, nor other streams behind it in a hardware
  queue they share.
"""

from __future__ import annotations

from typing import Any


class _NotInPlace(Exception):
    pass


class StampOrder:
    """Uses the writer's ``links``, ``engine``, ``device``, ``views`` and its ``_map`` /
    ``_view``; keeps ``stamp_views`` ({gpu: (begin stamp destination, an int64 view of it mapped
    here, or None)}) and ``unstamped`` (the receivers not filled this push)."""

    links: Any
    engine: Any
    device: Any
    views: dict
    stamp_views: dict
    unstamped: frozenset
    _map: Any
    _view: Any

    def stamp_begin(self, dests: dict, version: int) -> str | None:
        """This push's begin stamps ({gpu: begin stamp destination}) filled with `version` on the
        current (side) stream ahead of its in-place writes, to each receiver not skipped (failed
        or dropped) whose stamp is mapped here.  None, or why not (nothing launched yet: the
        caller waits on the host instead): a receiver whose memory is mapped here already but
        whose stamp is not."""
        skip = self.links.skipped(self.engine) if dests else frozenset()
        todo = []
        for g, d in dests.items():
            if g in skip:
                continue
            hit = self.stamp_views.get(g)
            if hit is None or hit[0] is not d:
                hit = self.stamp_views[g] = (d, self._stamp_view(d))
            if hit[1] is not None:
                todo.append(hit[1])
            elif any(self.links.gpu_of_region.get(r) == g for r in self.views):
                return f"inference worker gpu {g}: its memory is mapped here, its begin stamp is not"
        self.unstamped = skip  # (not filled: not written this push, whatever comes later)
        for t in todo:
            t.fill_(version)  # (the value is the kernel's argument, not read from host memory later)
        return None

    def _stamp_view(self, dest):
        """An int64 view of begin stamp `dest` (region, offset, _, 8) mapped on this GPU, or None
        (the transport refuses it: another GPU; or not one aligned int64)."""
        import torch

        rdesc, off, nb = bytes(dest[0]), int(dest[1]), int(dest[3])
        if nb != 8 or off % 8:
            return None
        try:
            addr, dev = self._map(rdesc, off, nb)
            if dev != self.device.index:
                return None
            view, base = self._view(rdesc)
        except _NotInPlace:
            return None
        if addr != base + off or base % 8:
            return None
        return view[off : off + 8].view(torch.int64)

    def _stamp_check(self, rdesc: bytes) -> None:
        """Before region `rdesc` is first mapped for in-place writes: refused (_NotInPlace) when
        its worker's begin stamp was found not mapped here (stamp_begin cannot fill it)."""
        hit = self.stamp_views.get(self.links.gpu_of_region.get(bytes(rdesc)))
        if hit is not None and hit[1] is None:
            raise _NotInPlace("its worker's begin stamp is not mapped here (the stream order writes it)")

    def _skip(self) -> frozenset:
        """Not to write now: failed or dropped (Links.skipped), or not stamped (stamp_begin)."""
        skip = self.links.skipped(self.engine)
        return skip | self.unstamped if self.unstamped else skip
