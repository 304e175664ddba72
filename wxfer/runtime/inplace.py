"""In-place writes (issue 13, cuda_ipc; the Sender's ``InPlaceWriter``): stage 2 straight into
the receivers' memory.  A packed task whose every destination is a range the cuda_ipc
transport has mapped on the writer's own GPU (trainer and receiver colocated on one GPU) is
not packed into a send buffer and then copied by the engine: its raw pieces are copied (and
cast) and its FP8 pieces quantized by the native kernel (``fp8.quantize_span``, one launch per
task) at their final addresses in the receivers' weights, on the Sender's side stream.  3
bytes of memory traffic per BF16->FP8 element instead of 5, and nothing held under the
watermark.  A small zero-copy task is copied there in batches (``queue_copy``).

What decides it, per task, once (``decompose``, CPU-testable): every piece of the packed
layout (``prepare._layout``: raw pieces merged by rows, each FP8 piece's e4m3 bytes and its
scales) must lie wholly inside each destination range that covers it; a destination
boundary through a piece sends the task the staging way.  Several destinations of one
packed range (replicas) are each written, their piece at their own offsets.  Then each
target range is checked by the transport (``Transport.map``: the key one the peer exported,
the range inside its region, the memory on the writer's GPU), and each region is seen as a
torch uint8 tensor over its mapped address (``__cuda_array_interface__``, no copy).

Ordering (docs/cuda_ipc.md): each in-place write (a packed task's copies and quantizer launch,
a batched copy launch) is an engine task of the external kind (``Engine.submit_external``) to
the peers it wrote, waiting for a CUDA event recorded after it on the side stream (on the
host, without CUDA, signalled done at once: ``complete_external``).  So the engine finishes
it after the begin stamps' fence, holds the end stamps' fence (a plain one) until it landed,
applies its deadline, skips a peer that failed, counts its bytes (``bytes_external``) and
traces it (kind "external"); ``push()``'s wait is the engine's.  The engine orders its tasks,
not this process's kernels, and a kernel that ran before a receiver's begin stamp landed would
make a torn read look complete: the first launch of a push comes after its begin stamps, written
on the side stream ahead of it (``stamp_begin``, opt-in) or waited for (TaskRunner._wait_begin, the default).
A receiver that failed or was dropped is not written (no kernel can be called back) nor named
in the task.  Off with ``Sender(direct=False)`` or
``WXFER_DIRECT=0`` (the user-facing name, and ``stats()["direct"]``, are kept); with verify on
a push goes the staging way (a checksum of the receiver's own memory would prove nothing).
"""

from __future__ import annotations

import logging
import struct
import itertools
import time
from itertools import zip_longest

from .. import envs, taskpath
from ..zerocopy import COPY_FIRST_BYTES, COPY_MAX, copy_batch_full
from . import fp8 as _fp8  # (the module: tests and the bench replace its functions)
from . import prepare
from .copy_launch import Launches, queue_run
from .inplace_stamps import StampOrder, _NotInPlace
from .overlap import Overlap

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


log = logging.getLogger(__name__)

# at most this long a failing push waits for its in-place writes (InPlaceWriter.abandon)
ABANDON_BOUND_S = 60.0


def stream_done_within(stream, bound: float) -> bool:
    """Whether the work queued on CUDA `stream` so far finishes within `bound` seconds
    (an event recorded now, polled; no unbounded synchronize)."""
    ev = stream.record_event()
    end = time.monotonic() + bound
    while not ev.query():
        if time.monotonic() >= end:
            return False
        time.sleep(0.0005)
    return True


COPY_ALL = 1 << 62  # copy_max "all" / -1: no upper bound (every task has fewer bytes)
COPIES_TAG = (1 << 62) + 1  # engine tag of a batched copy launch (plan tasks: their index; stamps: 1 << 62)
_TOO_BIG = "not fewer bytes than copy_max"  # (_copy_check; the overlap takes such a task)


def copy_max(value=None) -> int:
    """Zero-copy tasks of fewer bytes than this are copied straight into the receivers' memory
    by batched copy kernels instead of one engine write each: the Sender's ``copy_max``
    argument; None: $WXFER_DIRECT_COPY_MAX (bytes, e.g. 1MiB; default 32 MiB); 0: never;
    "all" or -1: no upper bound (``COPY_ALL``: every zero-copy task whose destinations are all
    mapped).  Each engine write costs about 10 us of driver calls on the post thread (the
    1.7B-class push's 311 writes were posted over 5 ms for a 2 ms copy)."""
    what = "copy_max"
    if value is None:
        value, what = envs.get("WXFER_DIRECT_COPY_MAX", "").strip(), "$WXFER_DIRECT_COPY_MAX"
        if not value:
            return COPY_MAX
    must = f"wxfer.Sender: {what} must be a size in bytes (an int >= 0 or e.g. '1MiB'), 'all' or -1 (no bound)"
    if isinstance(value, str):
        v = value.strip()
        if v.lower() in ("all", "-1"):
            return COPY_ALL
        from .. import _wxfer

        try:
            return int(_wxfer.parse_size(v))
        except ValueError:
            raise ValueError(f"{must}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{must} (or None), got {type(value).__name__} {value!r}")
    if value == -1:
        return COPY_ALL
    if value < 0:
        raise ValueError(f"{must}, got {value!r}")
    return int(value)


def enabled(direct) -> bool:
    """The Sender's ``direct`` argument; None: $WXFER_DIRECT (on unless 0/off/false/no)."""
    if direct is None:
        return envs.on("WXFER_DIRECT")
    if direct not in (True, False):
        raise TypeError(f"wxfer.Sender: direct must be True, False or None, got {direct!r}")
    return bool(direct)


def region_nbytes(desc: bytes) -> int:
    """The length of the region a descriptor names (csrc/transport/wx_desc.h: an 8-byte header
    "WXD" version kind, u32 address length, the address, then u64 key, rbase, len, ...)."""
    d = bytes(desc)
    if len(d) < 12 or d[:3] != b"WXD":
        raise ValueError("not a wxfer region descriptor")
    (alen,) = _U32.unpack_from(d, 8)
    if len(d) < 12 + alen + 24:
        raise ValueError("region descriptor truncated")
    return _U64.unpack_from(d, 12 + alen + 16)[0]


def _items(shards) -> tuple | str:
    """(raw items, fp8 items) of the packed layout: raw [(start, nbytes, piece, dtype)]; fp8
    [(piece, [(q start, q bytes)], [(s start, s bytes)])] -- or why the sizes do not add up."""
    import torch

    _, raw, fp8_pieces, end, _ = prepare._layout(shards)
    items = []
    for sh, off, pieces in raw:
        start, isz = off, getattr(torch, sh.dtype).itemsize
        for pc in pieces:
            nb = pc.numel() * isz
            items.append((off, nb, pc, sh.dtype))
            off += nb
        if off - start != sh.nbytes:
            return f"shard {sh.dst}@{sh.offset}: pieces of {off - start} bytes, the shard {sh.nbytes}"
    fp8 = []
    for pc, (qs, ss) in fp8_pieces.items():
        sb = pc.scale_nbytes()
        fp8.append((pc, [(q, pc.rows * pc.cols) for q in qs], [(s, sb) for s in ss]))
    return items, fp8


def _targets(a: int, nb: int, dests) -> list | str:
    """[(region descriptor, offset in it)] of the destinations holding packed bytes [a, a+nb)
    whole, or why not (a destination boundary through them)."""
    out = []
    for rdesc, doff, soff, n in dests:
        if soff <= a and a + nb <= soff + n:
            out.append((bytes(rdesc), int(doff) + a - int(soff)))
        elif a < soff + n and soff < a + nb:
            return f"packed bytes [{a}, {a + nb}) straddle the boundary of a destination [{soff}, {soff + n})"
    return out


def decompose(shards, dests) -> tuple | str:
    """What each destination range of a packed task receives, piece by piece, or why the task
    cannot be written that way (a str).  Returns (raw, fp8): raw [(piece, dtype, [(region
    descriptor, offset)])] -- one copy per target; fp8 [(piece, [q targets], [scale
    targets])] -- one quantizer job per pair (as ``prepare._jobs``: the i-th e4m3 target with
    the i-th scale target).  Pieces no destination covers are left out (nothing sends them)."""
    got = _items(shards)
    if isinstance(got, str):
        return got
    items, fp8_items = got
    dests = [d for d in dests if int(d[3]) > 0]
    raw = []
    for a, nb, pc, dtype in items:
        if nb == 0:
            continue
        t = _targets(a, nb, dests)
        if isinstance(t, str):
            return t
        if t:
            raw.append((pc, dtype, t))
    fp8 = []
    for pc, qs, ss in fp8_items:
        if pc.rows == 0 or pc.cols == 0:
            continue
        qt, st = [], []
        for ranges, acc in ((qs, qt), (ss, st)):
            for a, nb in ranges:
                t = _targets(a, nb, dests)
                if isinstance(t, str):
                    return t
                acc.extend(t)
        if qt or st:
            fp8.append((pc, qt, st))
    return raw, fp8


def _ranges(layout) -> list:
    """Every (region descriptor, offset, nbytes) the layout writes."""
    raw, fp8 = layout
    import torch

    out = []
    for pc, dtype, ts in raw:
        nb = pc.numel() * getattr(torch, dtype).itemsize
        out.extend((r, o, nb) for r, o in ts)
    for pc, qt, st in fp8:
        out.extend((r, o, pc.rows * pc.cols) for r, o in qt)
        out.extend((r, o, pc.scale_nbytes()) for r, o in st)
    return out


def _fp8_source(pc, fulls: dict):
    """FP8 piece `pc`'s 2-D source view in `fulls` (a ValueError naming it otherwise)."""
    from ..mapping.reference import _piece_tensor

    t = _piece_tensor(pc, fulls)
    if t.dim() != 2:
        raise ValueError(f"FP8 piece {pc}: its source {pc.src!r} is {t.dim()}-D, FP8 needs a 2-D tensor")
    return t


def _fp8_jobs(plan, fulls: dict, jobs: list, lo: int) -> list:
    """The quantizer's jobs [(source view, e4m3 offset | None, scales offset | None)] of `jobs`
    (InPlaceWriter._jobs), the offsets from address `lo` (built only where no piece table is kept)."""
    regions = plan.regions

    def at(x):
        return None if x is None else regions[x[0]].data_ptr() + x[1] - lo

    return [(_fp8_source(pc, fulls), at(q), at(s)) for pc, q, s in jobs]


class _Mapped:
    """A region of another process, mapped here, as torch sees device memory it does not own."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


class _Plan:
    """One task's in-place layout, with each target's region view."""

    __slots__ = ("raw", "fp8", "regions", "srcs", "spans", "uid", "event")
    _uids = itertools.count()

    def __init__(self, raw, fp8, regions):
        self.raw, self.fp8, self.regions = raw, fp8, regions
        self.srcs = tuple(sorted({pc.src for pc, _, _ in fp8}))
        self.spans: dict = {}  # skipped gpus -> InPlaceWriter._jobs
        self.uid = next(_Plan._uids)  # names its quantizer table (an id() may be reused)
        self.event = None  # recorded after its writes, each push (InPlaceWriter._submit)


def options(direct, copy_max_arg) -> tuple:
    """(enabled, copy_max) from the Sender's ``direct`` and ``copy_max`` arguments, checked
    before anything is set up (a bad value raises naming it)."""
    cm = copy_max(copy_max_arg)  # first: a bad value raises before anything is set up
    return enabled(direct), cm


class InPlaceWriter(StampOrder):
    """The Sender's in-place writes (a collaborator): packed tasks written straight into the
    receivers' mapped memory, small zero-copy tasks copied there in batches.

    enabled, copy_max: from ``options``; device, stream: where stage 2 runs (the side stream
    the kernels go on); transport, transport_name: the writer's transport (only cuda_ipc maps);
    engine: the step's engine (its failed peers are not written); links: this rank's workers
    (wxfer.runtime.links.Links: whose region is which, who is dropped).  ``start`` begins a push."""

    def __init__(self, enabled, copy_max, device, stream, transport, transport_name, engine, links):
        self.enabled, self.copy_max = bool(enabled), int(copy_max)
        self.device, self.stream = device, stream
        self.transport, self.transport_name, self.engine, self.links = transport, transport_name, engine, links
        self.version = 0  # the push under way (``start``)
        self.verify = False  # whether it verifies (every task the staging way)
        self.wait_begin = None  # waits until its begin stamps landed (``start``)
        self.begun = False  # ... and whether that was waited for
        self.views: dict = {}  # region descriptor -> (uint8 tensor over it, address)
        self.plans: dict = {}  # task -> (its dests list, _Plan or None, why not)
        self.counted = None  # the push the counters are of
        self.n = {"tasks": 0, "copies": 0, "staged": 0, "skipped_writes": 0}
        self.total = 0
        self.why: dict = {}  # why tasks went the staging way -> how many (this push)
        self.launched = False  # in-place work handed to the engine since the last abandon()
        self.copy_plans: dict = {}  # task -> (prep, src data_ptr, numel, [queued copy] or None, why not)
        # queued small copies [(gpu, engine destination, (dst, src, dst addr, src addr, n))] (flush_copies)
        self.copy_q: list = []
        self.copy_q_bytes = 0  # their bytes
        self.copy_first = 0  # bytes of a push's first launch, each next twice the last (0: COPY_BATCH_BYTES each)
        self.copier = None  # what the last batch of copies ran on (wxfer.runtime.copies)
        self.copy_live = False  # this push copies (``_copies_on``)
        self.launches = Launches(self, COPIES_TAG)  # each launch of a push, kept for the next (copy_launch.py)
        # this push's batched copy launches, their host seconds, the copy bindings it made
        # (stats()["direct"]["last_push"]; a push after the first should make none)
        self.host = {"launches": 0, "launch_s": 0.0, "begin_wait_s": 0.0, "copy_s": 0.0, "submit_s": 0.0, "bound": 0}
        self.stamp_views: dict = {}  # gpu -> (begin stamp destination, its int64 view or None) (stamp_begin)
        self.unstamped = frozenset()  # the receivers stamp_begin skipped this push: not written in place
        links.on_adopt.append(self.forget)  # a restarted worker: the old one's maps are dropped
        self.overlap = Overlap(self)  # large copies beside the quantizer (wxfer.runtime.overlap)

    def start(self, version: int, verify: bool, wait_begin) -> None:
        """A push begins: its number, whether it verifies, and `wait_begin()`, which returns
        once its begin stamps landed (waited for before its first in-place write)."""
        self.version, self.verify, self.wait_begin, self.begun = version, bool(verify), wait_begin, False
        self.unstamped = frozenset()
        self.launched = False  # the last push's writes were waited for by the engine
        self.host = {"launches": 0, "launch_s": 0.0, "begin_wait_s": 0.0, "copy_s": 0.0, "submit_s": 0.0, "bound": 0}
        # the first launch's bytes, ramping up (zerocopy.copy_batch_full)
        self.copy_first = envs.size("WXFER_DIRECT_COPY_FIRST", COPY_FIRST_BYTES)
        self._copies_on()
        self.launches.start()
        self.overlap.start(self.copy_live)

    def switch(self, on: bool) -> None:
        """Turn the in-place writes on or off (``Sender.direct``), from the next task on."""
        self.enabled = bool(on)
        self._copies_on()

    def _copies_on(self) -> None:
        """Whether this push copies at all (in-place writes on, verify off), decided once per
        push (``start``, ``switch``) for queue_copy's per-task fast path (issue 37)."""
        self.copy_live = self.off() is None and not self.verify

    def off(self) -> str | None:
        """Why no task of this Sender can be written in place, or None."""
        if not self.enabled:
            return "off (Sender(direct=False) or WXFER_DIRECT=0)"
        if self.transport_name != "cuda_ipc":
            return f"transport {self.transport_name!r}: only cuda_ipc maps the receivers' memory"
        if self.device.type != "cuda" or self.stream is None:
            return f"stage 2 runs on {self.device}, not a CUDA device"
        return None

    def _count_push(self) -> None:
        """This push's counters (stats()['direct']), reset at its first in-place decision."""
        if self.counted != self.version:
            self.counted = self.version
            self.n = {"tasks": 0, "copies": 0, "staged": 0, "skipped_writes": 0}
            self.why = {}

    def _begin(self) -> None:
        """Before this push's first write straight into a receiver: the begin stamps are an
        engine fence, which orders the engine's writes, not this process's kernels -- wait
        until they landed (``start``'s wait_begin: that fence task alone, not the engine's
        writes submitted since; with no stamps, until everything submitted so far did)."""
        if not self.begun:
            self.wait_begin()
            self.begun = True
            self.overlap.mark()  # (the large copies' gate: after the stamps, before any quantizer)

    def external_begin(self) -> frozenset:
        """Before another part of this rank writes straight into the receivers' memory (the
        delta writer's scatter, wxfer.runtime.delta_scatter): the begin stamps waited for (once
        a push, as before an in-place write), then the receivers not to write (failed or
        dropped by now)."""
        self._begin()
        return self._skip()

    def external_done(self, dests, tag: int) -> None:
        """Those writes, just launched on the side stream to `dests` (the receivers not
        skipped), handed to the engine as one external task, as an in-place task's are."""
        self._submit(dests, tag)

    def write_task(self, op) -> bool:
        """Run packed task `op` straight into the receivers' memory when it can be; False: the
        caller runs it the staging way (admitted under the watermark, packed, submitted)."""
        self._count_push()
        prep = op.prep
        if prep.best.path != taskpath.DIRECT:
            return False  # the engine writes the source's own bytes: nothing packed
        why = self.off() or ("verify is on" if self.verify else None)
        plan = None
        if why is None:
            plan, why = self.plan_of(op)
        if taskpath.classify(prep.facts, why).path != taskpath.DIRECT:
            self.n["staged"] += 1
            self.why[why] = self.why.get(why, 0) + 1
            return False
        fulls, _ = prepare.gather(prep, op, self.device)
        self._begin()  # after the gathers were queued: the stamps land meanwhile
        skip = self._skip()
        ovl = self.overlap
        if plan.fp8:
            ovl.gate()  # (before the quantizer: the copies queued do not wait for it)
        self._write(op, plan, fulls, skip)
        self._submit(self._live(op.dests, skip), op.task, plan)
        if plan.fp8:
            ovl.quantized(skip)  # the large copies queued, beside the quantizer once it has work queued
        self.n["tasks"] += 1
        self.total += 1
        return True

    def queue_copy(self, op) -> bool:
        """Queue zero-copy task `op`'s copies into the receivers' mapped memory when it is small
        (fewer bytes than copy_max()) and every destination is mapped here; False: the engine
        writes it (``_fast_task``). The copies go out in batches (``flush_copies``).  Per task
        per push: the classifier's answer for a copy candidate (``prep.best``, decided once) is
        copy exactly when ``copy_why`` finds nothing against it.  Its fast path (this push
        copies, and the task's binding is cached for the same prep and memory) does not make
        again the checks that cannot have changed since that binding was made (issue 37: the
        per-task Python of the 1.7B-class push's 309 copy tasks)."""
        prep = op.prep
        hit = self.copy_plans.get(op.task)
        if self.copy_live and hit is not None and hit[0] is prep and hit[3] is not None and op.nbytes < self.copy_max:
            src = prep.whole[0][1]
            src = getattr(src, "_local_tensor", src)
            if hit[1] != src.data_ptr() or hit[2] != src.numel():
                hit = None  # the memory moved: bound again by _copy_check
        else:
            hit = None
        if hit is None:
            why, hit = self._copy_check(op)
            if why is _TOO_BIG and self.overlap.live:
                return self._defer(op)
            if hit is not None:
                self._count_push()
            if why is not None:
                if hit is not None:  # a destination not mapped here: counted
                    self.why[why] = self.why.get(why, 0) + 1
                return False
        elif self.counted != self.version:
            self._count_push()
        q = self.copy_q
        q.extend(hit[3])  # the begin stamps are waited for at the launch, not here
        self.copy_q_bytes += hit[5]  # bytes written (every destination), as the simulator counts
        self.n["copies"] += 1  # zero-copy tasks copied this way (not in "tasks", "total")
        if copy_batch_full(len(q), self.copy_q_bytes, self.host["launches"], self.copy_first):
            self.flush_copies()
        return True

    queue_run = queue_run  # queue_copy's fast path over a run of tasks (copy_launch.py)

    def _defer(self, op) -> bool:
        """A zero-copy task too large for the batched copies, in a push that quantizes: copied
        beside the quantizer (wxfer.runtime.overlap) when every destination is mapped; False:
        the engine writes it."""
        hit = self._copy_hit(op)
        if hit[3] is None:
            return False
        self._count_push()
        return self.overlap.take(hit)

    def end_group(self) -> None:
        """A mesh group's end: the queued small copies launched, then the large ones still
        queued (wxfer.runtime.overlap, after the begin stamps), the side stream joined to them."""
        self.flush_copies()
        if self.overlap.q:
            self._begin()
        self.overlap.end_group(lambda: self.links.skipped(self.engine))

    def copy_why(self, op) -> str | None:
        """Why a push does not copy zero-copy task `op` straight into the receivers' memory, or
        None (queue_copy's tests without its side effects; the binding is cached as there): the
        copy fact of wxfer.taskpath.classify, what Sender.task_kinds() reports "copy" from."""
        why = self._copy_check(op)[0]
        if why is _TOO_BIG and self.overlap.next_live() and self.off() is None and not self.verify:  # overlap.py
            why = self._copy_hit(op)[4]
        return why

    def _copy_check(self, op) -> tuple:
        """(why not copied or None, the task's binding where it was looked at): a copy
        candidate (the classifier's best path, ``prep.best``, is copy) of fewer bytes than
        copy_max, in-place writes on, verify off, every destination mapped here."""
        prep = op.prep
        if prep is None or prep.best.path != taskpath.COPY:
            return "not a zero-copy task on the device", None
        if op.nbytes >= self.copy_max:
            return _TOO_BIG, None
        why = self.off() or ("verify is on" if self.verify else None)
        if why is not None:
            return why, None
        hit = self._copy_hit(op)
        return hit[4], hit

    def _copy_hit(self, op) -> tuple:
        """The cached _copy_bind of zero-copy task `op`, bound again when its memory moved."""
        prep = op.prep
        src = prep.whole[0][1]
        src = getattr(src, "_local_tensor", src)
        hit = self.copy_plans.get(op.task)
        if hit is None or hit[0] is not prep or hit[1] != src.data_ptr() or hit[2] != src.numel():
            hit = self.copy_plans[op.task] = self._copy_bind(prep, src)
            self.host["bound"] += 1  # (each push should make none after the first: stats' last_push)
        return hit

    def _copy_bind(self, prep, src) -> tuple:
        """(prep, data_ptr, numel, [(gpu, engine destination, (destination view, source view,
        their addresses, nbytes))] or None, why not, the bytes of them all) of a zero-copy
        task: each destination range checked by the transport (Transport.map)."""
        import torch

        flat = src.detach().reshape(-1).view(torch.uint8)
        items = []
        try:
            for rdesc, doff, soff, n in prep.dests:
                view, base = self._view(rdesc)
                addr, _ = self._map(rdesc, doff, n)
                if addr != base + doff:
                    raise _NotInPlace(f"[{doff}, +{n}) of a region is mapped at {addr:#x}, not {base + doff:#x}")
                d, sv = view[doff : doff + n], flat[soff : soff + n]
                gpu = self.links.gpu_of_region.get(bytes(rdesc))
                items.append((gpu, (rdesc, doff, soff, n), (d, sv, d.data_ptr(), sv.data_ptr(), n)))
        except _NotInPlace as e:
            return (prep, src.data_ptr(), src.numel(), None, str(e), 0)
        return (prep, src.data_ptr(), src.numel(), items, None, sum(c[1][3] for c in items))

    def flush_copies(self) -> None:
        """The queued small copies, in one batched launch (wxfer.runtime.copies: the native
        kernel, else torch._foreach_copy_) on the current (side) stream, handed to the engine as
        one external task (tag ``COPIES_TAG``); the receivers failed or dropped by now are not
        written (a copy queued before its receiver failed is skipped, as an in-place task
        launched after it is)."""
        if not self.copy_q:
            return
        t0 = time.perf_counter()
        q, self.copy_q, self.copy_q_bytes = self.copy_q, [], 0
        # the begin stamps first (late: the engine's writes queued meanwhile were not held up), then
        # the receivers to skip: one that failed while its begin stamp was written is not copied to
        self._begin()
        t1 = time.perf_counter()
        skip = self._skip()
        live = [c for c in q if c[0] not in skip] if skip else q
        self.n["skipped_writes"] += len(q) - len(live)
        host = self.host
        if live:
            i = host["launches"]
            launch = self.launches.get(i, live)  # the last push's i-th when the same (copy_launch.py)
            t2 = time.perf_counter()
            self.copier = self.launches.launch(launch)
            t3 = time.perf_counter()
            self._submit(launch.prepared, COPIES_TAG, event=self._copy_event(i))
            host["copy_s"] += t3 - t2  # the copier's call (on a GPU: the kernel's launch)
            host["submit_s"] += time.perf_counter() - t3  # its event recorded, its engine task
            host["launches"] += 1
        host["begin_wait_s"] += t1 - t0
        host["launch_s"] += time.perf_counter() - t0

    def _copy_event(self, i: int):
        """The CUDA event recorded after a push's `i`-th batched copy launch (made once, reused
        every push as a packed task's own is: the push before was waited for), or None (CPU)."""
        if self.stream is None:
            return None
        evs = self.launches.events
        while len(evs) <= i:
            import torch

            evs.append(torch.cuda.Event())
        return evs[i]

    def _live(self, dests, skip: frozenset) -> list:
        """`dests` but those to the receivers in `skip` (not written: not the engine's)."""
        if not skip:
            return dests
        gpu = self.links.gpu_of_region
        return [d for d in dests if gpu.get(bytes(d[0])) not in skip]

    def _submit(self, dests, tag: int, plan: _Plan | None = None, event=None) -> None:
        """The writes just launched to `dests` (a list, or an ``Engine.prepare_external`` of
        them: copy_launch.py), handed to the engine as one external task: with
        a side stream, after a CUDA event recorded on it (`plan`'s own or `event`, re-recorded
        each push; else a new one; the engine holds it until reaped); without one (the CPU) they
        ran on the host and are done, signalled so at once.  The engine orders, skips, bounds
        and traces it."""
        if not dests:
            return
        eng = self.engine
        if self.stream is None:
            eng.complete_external(eng.submit_external(dests, tag=tag))
            return
        ev = event if plan is None else plan.event
        if ev is None:
            import torch

            ev = torch.cuda.Event()
            if plan is not None:
                plan.event = ev
        ev.record(self.stream)
        self.launched = True
        eng.submit_external(dests, event=ev, device=self.device.index, tag=tag)

    def plan_of(self, op) -> tuple:
        """(_Plan or None, why not) of task `op`, decided once per set of destinations."""
        hit = self.plans.get(op.task)
        if hit is not None and hit[0] is op.dests:
            return hit[1], hit[2]
        plan, why = None, None
        lay = decompose(op.shards, op.dests)
        if isinstance(lay, str):
            why = lay
        else:
            try:
                plan = self._bind(lay)
            except _NotInPlace as e:
                why = str(e)
        self.plans[op.task] = (op.dests, plan, why)
        return plan, why

    def _bind(self, lay) -> _Plan:
        """The layout with its regions' views, every target range checked by the transport."""
        regions = {}
        for rdesc, off, nb in _ranges(lay):
            view, base = self._view(rdesc)
            addr, dev = self._map(rdesc, off, nb)
            if addr != base + off:
                raise _NotInPlace(f"the transport maps [{off}, +{nb}) of a region at {addr:#x}, not {base + off:#x}")
            regions[rdesc] = view
        return _Plan(lay[0], lay[1], regions)

    def _view(self, rdesc: bytes):
        """(uint8 tensor over the whole mapped region, its address), made once per region."""
        hit = self.views.get(rdesc)
        if hit is not None:
            return hit
        self._stamp_check(rdesc)  # (its worker's begin stamp mapped, where the stream writes it)
        try:
            n = region_nbytes(rdesc)
        except ValueError as e:
            raise _NotInPlace(str(e)) from e
        addr, dev = self._map(rdesc, 0, n)
        if dev != self.device.index:
            raise _NotInPlace(f"the region is mapped on cuda:{dev}, stage 2 runs on {self.device}")
        view = self._tensor(addr, n)
        if view.device != self.device or view.data_ptr() != addr or view.numel() != n:
            raise _NotInPlace(f"torch saw the mapped region as {view.device} {view.data_ptr():#x}, not a view")
        self.views[rdesc] = (view, addr)
        return view, addr

    def _map(self, rdesc: bytes, off: int, nb: int) -> tuple:
        """(address here, CUDA ordinal) of [off, off+nb) of a receiver's region: the transport
        checks it as it checks a write (Transport.map); a refusal sends the task the staging way."""
        try:
            return self.transport.map(rdesc, off, nb)
        except Exception as e:  # noqa: BLE001 -- the task goes the staging way, saying why
            raise _NotInPlace(f"{type(e).__name__}: {e}") from e

    def _tensor(self, addr: int, n: int):
        """A uint8 tensor over `n` bytes of mapped device memory at `addr` (no copy: checked by
        the caller). torch reads the interface's typestr through numpy."""
        import torch

        try:
            return torch.as_tensor(_Mapped(addr, n), device=self.device)
        except Exception as e:  # noqa: BLE001 -- the task goes the staging way, saying why
            raise _NotInPlace(f"torch.as_tensor(__cuda_array_interface__) failed: {type(e).__name__}: {e}") from e

    def _write(self, op, plan: _Plan, fulls: dict, skip: frozenset) -> None:
        """The task's raw copies and one quantizer launch, on the current (side) stream."""
        if plan.raw:
            self._write_raw(plan, fulls, skip)
        if plan.fp8:
            self._quantize(plan, fulls, skip)

    def _write_raw(self, plan: _Plan, fulls: dict, skip: frozenset) -> None:
        """The task's raw pieces copied (and cast) to their targets but in `skip`."""
        import torch

        from ..mapping.reference import _piece_tensor

        copy_piece = prepare.copy_piece
        gpu = self.links.gpu_of_region
        for pc, dtype, ts in plan.raw:
            t = _piece_tensor(pc, fulls)
            dt = getattr(torch, dtype)
            for r, off in ts:
                if gpu.get(r) in skip:
                    self.n["skipped_writes"] += 1
                else:
                    copy_piece(plan.regions[r], off, t, dt)

    def _jobs(self, plan: _Plan, skip: frozenset) -> tuple:
        """([(piece, (region, offset) | None, (region, offset) | None)], lowest address, span
        to the end of the last region written, targets skipped): the FP8 jobs to the
        receivers not skipped."""
        gpu = self.links.gpu_of_region
        jobs, skipped = [], 0
        for pc, qt, st in plan.fp8:
            q2 = [x for x in qt if gpu.get(x[0]) not in skip]
            s2 = [x for x in st if gpu.get(x[0]) not in skip]
            skipped += len(qt) + len(st) - len(q2) - len(s2)
            jobs.extend((pc, q, s) for q, s in zip_longest(q2, s2))
        lo, hi = None, 0
        for _, q, s in jobs:
            for x in (q, s):
                if x is not None:
                    view = plan.regions[x[0]]
                    a = view.data_ptr() + x[1]
                    lo = a if lo is None or a < lo else lo
                    hi = max(hi, view.data_ptr() + view.numel())
        return jobs, lo, 0 if lo is None else hi - lo, skipped

    def _quantize(self, plan: _Plan, fulls: dict, skip: frozenset) -> None:
        """Every FP8 job of the task: one native launch over the span of the regions it writes
        (offsets from the lowest address), else the reference per region on region tensors."""
        hit = plan.spans.get(skip)
        if hit is None:
            hit = plan.spans[skip] = self._jobs(plan, skip)
        jobs, lo, span, skipped = hit
        self.n["skipped_writes"] += skipped
        if not jobs:
            return
        # the sources' memory (address, strides: a tuple, dtype) names the launch's piece table
        srcs = tuple((t.data_ptr(), t.stride(), t.dtype) for t in map(fulls.__getitem__, plan.srcs))
        key = ("inplace", plan.uid, skip, srcs)
        if _fp8.quantize_span(lo, span, self.device, lambda: _fp8_jobs(plan, fulls, jobs, lo), key):
            return
        for r, view in plan.regions.items():  # no native kernel: the reference, per region
            part = [
                (_fp8_source(pc, fulls), q[1] if q and q[0] == r else None, s[1] if s and s[0] == r else None)
                for pc, q, s in jobs
            ]
            part = [j for j in part if j[1] is not None or j[2] is not None]
            if part:
                _fp8.quantize_into(view, part)

    def abandon(self, bound: float = ABANDON_BOUND_S) -> bool:
        """A failing push: its in-place writes land before it raises (best effort: a failed
        engine need not have waited for their events), waited for at most `bound` seconds: a
        stream behind a begin-stamp device wait whose fence word the engine holds (a receiver
        not fenced yet, or the engine's error: ``Engine.word_state``) does not pass before the
        word goes on, and an unbounded synchronize would hang the push.  False: still running
        at the bound (logged, naming the held word's receiver)."""
        self.copy_q, self.copy_q_bytes = [], 0
        self.overlap.drop()
        done = True
        try:
            if self.launched and self.stream is not None:
                done = stream_done_within(self.stream, bound)
                second = self.overlap.pending()  # the large copies' own stream
                if done and second is not None:
                    done = stream_done_within(second, bound)
        except Exception:  # noqa: BLE001 -- the device itself failed; the push's error says more
            pass
        if not done:
            held = self.engine.word_state() if hasattr(self.engine, "word_state") else None
            log.warning(
                "wxfer: step %d: the in-place writes did not finish within %.1f s of the push's "
                "failure (the fence word %s): the push raises without them",
                self.version,
                bound,
                "is not held" if held is None else f"is held for peer {held[0]} ({held[1]}), {held[2]:.1f} s",
            )
        self.launched = False
        return done

    def stats(self) -> dict:
        cm = -1 if self.copy_max >= COPY_ALL else self.copy_max  # -1: no bound ("all")
        d = dict(self.n, enabled=self.enabled, total=self.total, copy_max=cm)
        if self.copier is not None:
            d["copier"] = self.copier  # the batched copies' last launch (wxfer.runtime.copies)
        if self.host["launches"]:
            d["last_push"] = dict(self.host)  # its batched copy launches' host seconds
        ovl = self.overlap.stats()
        if ovl:
            d["overlap"] = ovl  # the last push's large copies beside the quantizer
        off = self.off()
        if off:
            d["why_not"] = off
        if self.why:
            d["staged_why"] = dict(sorted(self.why.items(), key=lambda kv: -kv[1])[:5])
        return d

    def forget(self, gpu: int, regions) -> None:
        """Inference worker `gpu` was replaced by its restart: drop the views of its old
        `regions` (region descriptors) and every binding that wrote there (bound again to the
        new worker's memory at the next use)."""
        regions = {bytes(r) for r in regions}
        for r in regions:
            self.views.pop(r, None)
        self.stamp_views.pop(gpu, None)
        for task, (_, plan, _) in list(self.plans.items()):
            if plan is not None and regions & {bytes(r) for r in plan.regions}:
                del self.plans[task]
        for task, hit in list(self.copy_plans.items()):
            if hit[3] and any(c[0] == gpu for c in hit[3]):
                del self.copy_plans[task]
        self.launches.clear()  # (made again at the next launches)

    def close(self) -> None:
        """Forget the views of the mapped regions (before the transport unmaps them)."""
        self.views.clear()
        self.stamp_views.clear()
        self.plans.clear()
        self.copy_plans.clear()
        self.launches.clear()
