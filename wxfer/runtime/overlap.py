"""The large zero-copy tasks of a quantizing push copied beside the FP8 kernel (issue 37; the
in-place writer's ``Overlap``, wxfer.runtime.inplace).

Why.  Colocated, a push that quantizes in place (wxfer.runtime.inplace) also has zero-copy
tasks the FP8 layout keeps in BF16 -- Qwen3-8B: the embeddings and lm_head, 2 x 1.24 GB,
tasks 0 and 1 of its plan.  Too large for the batched copies (``copy_max``), they were engine
writes: one ``cuMemcpyAsync`` each (split over the cuda_ipc transport's streams), posted by the
engine as soon as the begin stamps' fence finished -- the moment the Sender's thread, waiting for
that same fence, launches its first quantizer kernel on the side stream.  Different streams, no
event or fence between them, and yet they ran one after the other (one H100, the profiled push
of benchmarks/runs/h100-2026-12-07-b: busy 9.74 ms = the quantizer's 8.14 ms + 1.6 ms of copies,
the kernels at their standalone rate, the copies straight after the begin stamp, the host done
launching long before the device was).  Our reading: the copies came first and held the SMs
(a copy within one GPU runs at its memory's rate, as a kernel does), and the quantizer's
persistent grid (2 CTAs of 256 threads and 96 KiB of shared memory per SM,
csrc/prepare/wx_fp8.c) started only where they left room; bb_profile's ``overlap`` figures
(which began first, the time beside and alone) check it on the next GPU run.  The
quantizer alone moves about 2.65 TB/s where a copy moves 3.0 (that H100): the copies can take
the rest of the memory's bandwidth while it runs -- but not on the SMs: the quantizer's 2 CTAs
of 256 threads use 128 registers a thread (ptxas -v of wx_fp8_kernel.cu for sm_90, nvcc 13.0;
its launch bound allows that many),
65,536 registers, the whole register file of an SM, so no other CTA (a copy kernel's, or the
driver's copy if it runs on the SMs) is resident beside them while a quantizer launch runs.
The copy engines need no SM.

How.  In a push after one that launched the quantizer in place (``start``: the first push of a
Sender keeps the engine path), a zero-copy task that ``InPlaceWriter.queue_copy`` would leave
to the engine only for its size, every destination mapped, is queued here instead (``take``).
The queue is launched (``launch``) after ``after()`` quantizer launches of the push (default 4,
counted from the first one that found copies queued) -- else at its mesh group's end
(``InPlaceWriter.end_group``) -- on a second stream of its own, by ``mode()``:
"engines" (``WXFER_DIRECT_OVERLAP=engines`` or 1; the default where the driver has the batched copy) one
``cuMemcpyBatchAsync`` with the driver's hint to run it beside the
SMs' work (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``: the copy engines; each range cut into
copies of ``PIECE`` bytes, which the driver may spread over several engines; a driver without
the batched copy (before 12.8) gets "kernel"); "kernel" one launch of the batched copy kernel
(wxfer.runtime.copies) with a small persistent grid (``ctas()`` CTAs per SM, default 2: they take
an SM between two quantizer launches and keep it, the next launch running beside them with one
CTA there instead of two -- measured against "engines" by ``gpu_perf.sh fp8``).

Why after a few launches, not right after the first (issue 37): the driver's batch took 0.46 ms
of host time on the H100 (``stats()["direct"]["overlap"]["host_s"]``, benchmarks/runs/
h100-2026-12-07-d), while one layer's quantizer launch (Qwen3-8B, 2 GiB watermark) runs about
0.23 ms: launched right after the first quantizer, the second came 0.6 ms after it and the SMs
waited, the copies running alone meanwhile (0.59 ms of the profiled push's 8.94 ms busy).  After
four launches about 0.6 ms of quantizer work is queued (the host submits a layer in about
0.08 ms), more than the batch's host time: the copies still run beside the rest of the
quantizer (7 ms of it there; they need about 3 ms beside it).

Order (docs/cuda_ipc.md).  The second stream waits for an event recorded on the side stream
right after the push's begin stamps (``mark``, from ``InPlaceWriter._begin``: written on the
side stream, or waited for on the host or by the side stream's device wait), before any
quantizer launch (``gate``; else one recorded before the first quantizer launch that found the
copies queued): after the push's start (the training stream's work) and after the begin stamps,
not after the quantizer.
The copies are one external engine task (tag ``OVERLAP_TAG``) waiting for their own event:
the end stamps' fence is posted only after it, as after every in-place write.  At the group's
end (``end_group``) the side stream waits for that event, so the training stream, which waits
for the side stream when push() returns, does not change a source before it was read.  A
receiver that failed or was dropped is not written (as the batched copies).
Off: ``WXFER_DIRECT_OVERLAP=0``, or unset where the driver has no batched copy (the engine
writes them, as before)."""

from __future__ import annotations

import logging
import time

from .. import envs

log = logging.getLogger(__name__)

MODES = ("engines", "kernel")
OVERLAP_TAG = (1 << 62) + 2  # engine tag of a launch of these copies (COPIES_TAG + 1)
CTAS = 2  # CTAs per SM of the copy kernel's grid beside the quantizer
AFTER = 4  # quantizer launches queued before the copies are launched (``after()``)
PIECE = 64 << 20  # "engines": a range cut into copies of at most this (the driver may spread them)


def mode() -> str | None:
    """$WXFER_DIRECT_OVERLAP: "engines" (also 1/on, and the default), "kernel", or None for 0/off.
    The default is "engines" where the driver's batched copy is there (``Overlap``: unset and
    without it, off), from one A/B on one H100 (benchmarks/gpu_ab.sh, runs/h100-2026-12-07-e:
    the 8B FP8 FSDP2 row 10.07 / 11.53 ms with it against 10.66 / 14.32 ms without, at the
    2 GiB / 256 MiB watermarks)."""
    v = envs.get("WXFER_DIRECT_OVERLAP", "").strip().lower()
    if v == "":
        return MODES[0]
    if v in envs.OFF:
        return None
    if v in ("1", "on", "true", "yes"):
        return MODES[0]
    if v not in MODES:
        raise ValueError(f"WXFER_DIRECT_OVERLAP must be engines, kernel or 0 (off), got {v!r}")
    return v


def enabled() -> bool:
    """Whether $WXFER_DIRECT_OVERLAP turns the overlap on."""
    return mode() is not None


def _int_env(name: str, default: int, lo: int, hi: int) -> int:
    """$`name` as an int from `lo` to `hi` (`default` when unset); a ValueError naming it else."""
    v = envs.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = lo - 1
    if not lo <= n <= hi:
        raise ValueError(f"{name} must be an int from {lo} to {hi}, got {v!r}")
    return n


def ctas() -> int:
    """$WXFER_DIRECT_OVERLAP_CTAS: the copy kernel's CTAs per SM beside the quantizer (1-64)."""
    return _int_env("WXFER_DIRECT_OVERLAP_CTAS", CTAS, 1, 64)


def after() -> int:
    """$WXFER_DIRECT_OVERLAP_AFTER: the quantizer launches of a push (from the first that found
    copies queued) after which the copies are launched (1-1000; 1: right after the first)."""
    return _int_env("WXFER_DIRECT_OVERLAP_AFTER", AFTER, 1, 1000)


def pieces(items, piece: int = PIECE) -> list:
    """`items` [(dst, src, dst address, src address, nbytes)] with every range cut into copies of
    at most `piece` bytes, as addresses only (dst, src None: for the driver's batch alone)."""
    out = []
    for _d, _s, dp, sp, n in items:
        for a in range(0, n, piece):
            out.append((None, None, dp + a, sp + a, min(piece, n - a)))
    return out


class Overlap:
    """The in-place writer's deferred large copies (module docstring).  `writer`: the
    InPlaceWriter (its device, side stream, links, engine and ``_submit``)."""

    def __init__(self, writer):
        self.w = writer
        self.mode = mode()
        if self.mode and not envs.get("WXFER_DIRECT_OVERLAP", "").strip():  # the default: the driver's copy only
            from . import copies

            self.mode = None if copies.driver_why(writer.device) else self.mode
        self.on = self.mode is not None
        self.ctas = ctas()
        self.after = after()
        self.ran = None  # the copier of the last launch (wxfer.runtime.copies)
        self.live = False  # this push defers (``start``)
        self.q: list = []  # [(gpu, engine destination, copy item)] queued
        self.q_tasks = 0
        self.quant = 0  # quantizer launches in place in this push so far
        self.last_quant = 0  # ... in the push before
        self.stream = None  # the second CUDA stream (made at the first launch)
        self.gated = None  # the gate of the copies queued, taken and not launched yet (``gate``)
        self.gated_n = 0  # ... quantizer launches since it was taken
        self.gate_ev = None  # a gate's CUDA event recorded before a quantizer launch (no ``mark``)
        self.early = None  # this push's gate recorded right after its begin stamps (``mark``)
        self.early_ev = None  # its CUDA event, made once and recorded again each push
        self.events: list = []  # the CUDA event of each launch of a push, reused
        self.unjoined: list = []  # events of launches the side stream has not waited for yet
        self.n = {"tasks": 0, "bytes": 0, "launches": 0}
        self.host_s = 0.0

    def start(self, live: bool) -> None:
        """A push begins; `live`: the writer copies at all this push (direct on, verify off)."""
        self.last_quant, self.quant = self.quant, 0
        self.live = bool(live and self.on and self.last_quant > 0)
        self.q, self.q_tasks, self.unjoined = [], 0, []
        self.gated, self.gated_n, self.early = None, 0, None
        self.n = {"tasks": 0, "bytes": 0, "launches": 0}
        self.host_s = 0.0

    def mark(self) -> None:
        """The push's begin stamps are ordered before the side stream's next work (written on
        it, or waited for): when this push defers copies, an event recorded on the side stream
        now -- the earliest point they may start from, before any quantizer launch -- their gate."""
        if not self.live or self.early is not None or self.w.stream is None:
            return
        if self.early_ev is None:
            import torch

            self.early_ev = torch.cuda.Event()
        self.early_ev.record(self.w.stream)  # (the last push's launches waited on its last record)
        self.early = self.early_ev

    def next_live(self) -> bool:
        """Between pushes: whether the next one defers (this one launched the quantizer; the
        writer's copy_why, so that Sender.task_kinds() says "copy" for these tasks)."""
        return self.on and self.quant > 0

    def take(self, hit) -> bool:
        """Queue a zero-copy task's copies (its binding `hit`, InPlaceWriter._copy_bind, every
        destination mapped) when this push defers them; False: the engine writes it."""
        if not self.live or hit is None or hit[3] is None:
            return False
        self.q.extend(hit[3])
        self.q_tasks += 1
        self.n["tasks"] += 1
        return True

    def gate(self):
        """Before a quantizer launch (the begin stamps waited for) or at the group's end: when
        copies are queued, what the second stream will wait for, kept until they are launched --
        the push's event recorded right after its begin stamps (``mark``), else one recorded on
        the side stream now (True without a stream: the host runs every write in order); else
        None."""
        if not self.q:
            return None
        if self.gated is not None:
            return self.gated
        if self.w.stream is None:
            self.gated = True
        elif self.early is not None:
            self.gated = self.early
        else:
            if self.gate_ev is None:
                import torch

                self.gate_ev = torch.cuda.Event()
            self.gate_ev.record(self.w.stream)  # (the launch before waited on its last record)
            self.gated = self.gate_ev
        self.gated_n = 0
        return self.gated

    def quantized(self, skip: frozenset) -> None:
        """After a quantizer launch in place: counted; the copies queued are launched once
        ``after`` quantizer launches followed their gate (work the SMs have queued while the
        host makes the copies' call).  `skip`: the receivers not to write."""
        self.quant += 1
        if self.gated is None:
            return
        self.gated_n += 1
        if self.gated_n >= self.after:
            self.launch(self.gated, skip)

    def launch(self, gate, skip: frozenset) -> None:
        """The queued copies, one launch on the second stream after `gate` (``gate()``), handed
        to the engine as one external task; the receivers in `skip` are not written."""
        from . import copies

        t0 = time.perf_counter()
        q, self.q, self.q_tasks = self.q, [], 0
        self.gated, self.gated_n = None, 0
        live = [c for c in q if c[0] not in skip] if skip else q
        self.w.n["skipped_writes"] += len(q) - len(live)
        if not live:
            return
        items = [c[2] for c in live]
        i = self.n["launches"]
        if self.w.stream is None:  # the host: in order with everything else
            self.ran = copies.copy_ranges(self.w.device, items)
            self.w._submit([c[1] for c in live], OVERLAP_TAG)
        else:
            import torch

            if self.stream is None:
                self.stream = torch.cuda.Stream(self.w.device)
            self.stream.wait_event(gate)
            with torch.cuda.stream(self.stream):
                self._copy(copies, items)
            ev = self._event(i)
            ev.record(self.stream)
            self.unjoined.append(ev)
            self.w.launched = True
            self.w.engine.submit_external([c[1] for c in live], event=ev, device=self.w.device.index, tag=OVERLAP_TAG)
        self.n["launches"] += 1
        self.n["bytes"] += sum(c[2][4] for c in live)
        self.host_s += time.perf_counter() - t0

    def _copy(self, copies, items) -> None:
        """The copies on the current (second) stream, by the mode; the driver refusing its batch
        (a hint it does not take, or memory it does not copy that way) sends this Sender to the
        kernel for good, logged: the same bytes, so the kernel copies them all again."""
        if self.mode == "engines" and copies.driver_why(self.w.device) is None:
            try:
                self.ran = copies.copy_ranges(self.w.device, pieces(items), copier="driver", beside=True)
                return
            except Exception as e:  # noqa: BLE001 -- the kernel below gives the same bytes
                log.warning("wxfer: the copies beside the quantizer go to the copy kernel: %s", e)
                self.mode = "kernel"
        self.ran = copies.copy_ranges(self.w.device, items, ctas=self.ctas)

    def _event(self, i: int):
        """The CUDA event of a push's `i`-th launch, made once and reused (the push before was
        waited for)."""
        import torch

        while len(self.events) <= i:
            self.events.append(torch.cuda.Event())
        return self.events[i]

    def end_group(self, skip_of) -> None:
        """A mesh group's end: the copies still queued launched (after the side stream's work
        so far), then the side stream waits for every launch of the group (the sources are
        read before the training stream, which waits for the side stream, goes on).
        `skip_of()`: the receivers not to write now."""
        if self.q:
            self.launch(self.gate(), skip_of())  # (the gate recorded before a quantizer, if any)
        if self.unjoined and self.w.stream is not None:
            for ev in self.unjoined:
                self.w.stream.wait_event(ev)
        self.unjoined = []

    def pending(self):
        """The second stream when it has work this push (InPlaceWriter.abandon waits for it)."""
        return self.stream if self.n["launches"] and self.stream is not None else None

    def drop(self) -> None:
        """A failing push: nothing queued is launched."""
        self.q, self.q_tasks, self.unjoined = [], 0, []
        self.gated, self.gated_n, self.early = None, 0, None

    def stats(self) -> dict | None:
        """stats()["direct"]["overlap"] of the last push, or None when it deferred nothing."""
        if not self.n["tasks"]:
            return None
        return dict(self.n, mode=self.mode, copier=self.ran, ctas=self.ctas, after=self.after, host_s=self.host_s)
