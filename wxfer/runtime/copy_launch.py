"""The batched copies' fast paths (issue 37): a run of copy tasks queued in one loop
(``queue_run``), and the batched copy launches of a push (``InPlaceWriter.flush_copies``), made
once and launched again push after push.  Issue 37: the 1.7B-class push's 11 launches took 50-100 us of host time
each on one H100.  A push queues the same copies in the same batches every step, so the i-th
launch of a push keeps what the i-th launch of the last push made:

- the kernel's range table (``copies.table``) and its copy in device memory on the side stream
  (``copies.device_table``): launched again by ``copies.launch_at``, without the copier's choice,
  the stream's lookup and the table's hash each launch (the push's first launch goes through
  ``copies.copy_ranges``: the copier is chosen once per push, and a table on another stream is
  not reused);
- its engine destinations decoded and validated once (``Engine.prepare_external``), not per
  launch (~0.3 us each on the 2-core VM: 104 of them per launch there); a destination the
  transport refuses raises before the launch, so nothing is copied;
- the CUDA event recorded after it (``InPlaceWriter._copy_event``'s reasoning: the push before
  was waited for).

They are reused while the launch's queued copies are the same objects (the cached bindings'
tuples: the same receivers, addresses and sizes; a binding made again has new ones, and a
receiver skipped leaves a shorter list): anything else makes the launch again.  ``clear``
(a restarted worker, close) drops them all."""

from __future__ import annotations

import operator

from ..zerocopy import copy_batch_full
from . import copies


def queue_run(w, ops: list, i: int) -> int:
    """``InPlaceWriter.queue_run``: queue_copy's fast path over consecutive tasks ``ops[i]``,
    ``ops[i + 1]``, ... in one loop -- this push copies (``copy_live``), and each task's cached
    binding is for its prep and its source's memory (``data_ptr``, ``numel``: checked for every
    task), of fewer bytes than copy_max -- with the same queue, bytes, counters and launches as
    queue_copy (a batch launched as it fills: ``flush_copies``).  Returns the index of the first
    task not queued (`i`: none), which the caller runs the usual way (queue_copy and the rest).
    Issue 37: the 1.7B-class push's 309 copy tasks, each a call of queue_copy from the step
    loop's per-task body.  Such tasks have no collective (the rank holds each source whole), so
    a failure's drain needs no per-task position inside the run (the step loop's ``state``)."""
    if not w.copy_live:
        return i
    plans, cm, q, nb = w.copy_plans, w.copy_max, w.copy_q, w.copy_q_bytes
    j, n, k = i, len(ops), 0  # k: tasks queued since the counters were last written
    while j < n:
        op = ops[j]
        prep = op.prep
        hit = plans.get(op.task)
        if hit is None or hit[0] is not prep or hit[3] is None or op.nbytes >= cm:
            break
        src = prep.whole[0][1]
        src = getattr(src, "_local_tensor", src)
        if hit[1] != src.data_ptr() or hit[2] != src.numel():
            break  # the memory moved: bound again by queue_copy
        if j == i and w.counted != w.version:
            w._count_push()  # (this push's counters, reset at its first in-place decision)
        prep.done = 0  # (the step loop's per-task reset: none of its collectives posted)
        q.extend(hit[3])
        nb += hit[5]
        k += 1
        j += 1
        if copy_batch_full(len(q), nb, w.host["launches"], w.copy_first):
            w.copy_q_bytes = nb
            w.n["copies"] += k
            k = 0
            w.flush_copies()
            q, nb = w.copy_q, w.copy_q_bytes  # (a new list)
    w.copy_q_bytes = nb
    w.n["copies"] += k
    return j


class Launch:
    """One launch: its queued copies [(gpu, engine destination, item)], the kernel's items and
    range table, the engine's prepared destinations (and the engine that made them), and the
    range table in device memory with the stream it was uploaded on (None until a native launch)."""

    __slots__ = ("q", "items", "table", "prepared", "engine", "at")

    def __init__(self, q: list, engine, tag: int):
        self.q = q
        self.items = [c[2] for c in q]
        self.table = copies.table(self.items)
        self.engine = engine
        # validated before anything is launched (a refusal raises here: nothing copied)
        self.prepared = engine.prepare_external([c[1] for c in q], tag=tag)
        self.at: tuple | None = None  # (CUstream, the table in device memory) once launched natively


class Launches:
    """The launches of a push, by their index, for an InPlaceWriter (its engine, device)."""

    def __init__(self, writer, tag: int):
        self.w, self.tag = writer, tag
        self.recs: list = []
        self.events: list = []  # the CUDA event recorded after each launch (InPlaceWriter._copy_event)
        self.native = False  # this push's first launch ran the native kernel (``start`` resets it)

    def start(self) -> None:
        """A push begins: its first launch chooses the copier again (copies.copy_ranges)."""
        self.native = False

    def get(self, i: int, q: list) -> Launch:
        """The push's `i`-th launch of queued copies `q`: the last push's when `q` are the same
        objects and its engine is the same, else made now (and kept for the next push)."""
        recs = self.recs
        if i < len(recs):
            r = recs[i]
            if r.engine is self.w.engine and len(r.q) == len(q) and all(map(operator.is_, r.q, q)):
                return r
        r = Launch(q, self.w.engine, self.tag)
        if i < len(recs):
            recs[i] = r
        elif i == len(recs):
            recs.append(r)
        return r

    def launch(self, r: Launch) -> str:
        """`r`'s copies on the current stream of the writer's device; returns the copier that ran."""
        dev = self.w.device
        if self.native and r.at is not None:
            from .fp8 import _raw_stream

            stream = _raw_stream(dev)
            if r.at[0] == stream:
                copies.launch_at(dev, stream, r.table, r.at[1])
                return "native"
        ran = copies.copy_ranges(dev, r.items, ranges=r.table)
        self.native = ran == "native"
        if self.native:
            from .fp8 import _raw_stream

            stream = _raw_stream(dev)
            r.at = (stream, copies.device_table(dev, stream, r.table))  # (the one copy_ranges used)
        return ran

    def clear(self) -> None:
        self.recs.clear()
