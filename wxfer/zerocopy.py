"""The zero-copy rule and the batching policy, written once for the plan, the runtime, the
simulator and the host-cost fit.  Pure Python: no torch, no numpy.

The rule: a task is written from its training parameter's own memory (zero copy) when each
of its packed shards is one contiguous run of whole rows of its one source, in the source's
dtype.  A source of any dimensionality is seen as the row-major matrix
[prod(shape[:-1]), shape[-1]] (a 1-D source: its elements are the rows), so whole rows are one
byte range of its memory; runs of consecutive rows (the per-expert pieces of a fused 3-D
gate_up_proj) are merged into one range first (``merged_rows``).

The batching: the Sender hands its zero-copy tasks to the engine in batches, one
``Engine.submit_prepared`` call per ``ZERO_COPY_BATCH`` tasks or once their bytes reach
``ZERO_COPY_BATCH_BYTES``, before a task of another kind and at the mesh group's end (copy
tasks do not cut a batch).  The small zero-copy tasks it copies itself (``copy``, fewer bytes
than ``COPY_MAX``) go out in batched copy launches of ``COPY_BATCH`` ranges or
``COPY_BATCH_BYTES``.  ``Batcher`` is that policy; the runtime's loop (wxfer.runtime.sender)
and the model of it (``batch_ends``: wxfer.plan.sim_stages, wxfer.runtime.hostfit) both use it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

ZERO_COPY_BATCH = 32  # zero-copy tasks per Engine.submit_prepared call (the first writes start early)
ZERO_COPY_BATCH_BYTES = 256 << 20  # ... or fewer, once their bytes reach this (a large write is not held back)
COPY_MAX = 32 << 20  # zero-copy tasks of fewer bytes are copied by kernels (wxfer.runtime.inplace.copy_max)
COPY_BATCH = 128  # copied tasks' ranges per batched copy launch (wxfer.runtime.copies)
COPY_BATCH_BYTES = 256 << 20  # ... or fewer, once their bytes reach this (the GPU starts on them)
COPY_FIRST_BYTES = 0  # a push's first launch closes at this many bytes, each next at twice the last (0: off)


# --------------------------------------------------------------------------- the rule


def merged_rows(pieces: Sequence) -> tuple:
    """The pieces with each run of consecutive row ranges of one source (same columns) merged
    into one piece: the same bytes (row-major slices concatenated in order) -- 128 experts of
    a fused gate_up_proj [E, 2I, H] are 256 pieces of rows of one [E x 2I, H] matrix."""
    out: list = []
    for pc in pieces:
        if out:
            last = out[-1]
            if last.src == pc.src and last.r1 == pc.r0 and (last.c0, last.c1) == (pc.c0, pc.c1):
                out[-1] = last._replace(r1=pc.r1)
                continue
        out.append(pc)
    return tuple(out)


def whole_rows(pc, shape: Sequence[int]) -> bool:
    """Piece `pc` is whole rows of a source of `shape` (see the module's docstring), so its
    bytes are one contiguous range of the source's row-major memory."""
    return len(shape) < 2 or (pc.c0 == 0 and pc.c1 == shape[-1])


def contiguous_range(shard, src: str, shape: Sequence[int], dtype: str):
    """The one piece (its pieces merged) that `shard` is when it is one contiguous run of whole
    rows of source `src` of `shape`, raw in the source's `dtype` (a name such as "bfloat16");
    None otherwise."""
    if shard.kind != "raw" or shard.dtype != dtype:
        return None
    run = merged_rows(shard.pieces)
    if len(run) != 1 or run[0].src != src or not whole_rows(run[0], shape):
        return None
    return run[0]


def zero_copy(shards: Sequence, src: str, shape: Sequence[int], dtype: str) -> bool:
    """Every shard (at least one) is one contiguous range of source `src` in its own dtype: the
    bytes can be written from the parameter's own memory."""
    return bool(shards) and all(contiguous_range(sh, src, shape, dtype) is not None for sh in shards)


def rows_of(shape: Sequence[int]) -> int:
    """Rows of a source of `shape` seen as a matrix (a 1-D source: its elements)."""
    rows = 1
    for d in shape[:-1] if len(shape) >= 2 else shape:
        rows *= d
    return rows


def all_of_it(shards: Sequence, src: str, shape: Sequence[int], dtype: str) -> bool:
    """One raw shard that is the whole source in its own dtype (its bytes are the source's)."""
    if len(shards) != 1:
        return False
    pc = contiguous_range(shards[0], src, shape, dtype)
    return pc is not None and pc.r0 == 0 and pc.r1 == rows_of(shape)


def zero_copy_dests(shards: Sequence, dests: Sequence, src: str, shape: Sequence[int], dtype: str, itemsize: int):
    """The task's destinations ``(region, dst offset, src offset, bytes)`` with their source
    offsets turned from the packed buffer's into the source's own bytes, when every shard is
    one contiguous range of `src` (a contiguous tensor of `shape`, `dtype`, `itemsize` bytes an
    element) whose bytes match the shard's size and lie inside the source; None otherwise (the
    task is packed).  The packed buffer holds the shards back to back in order."""
    if not shards:
        return None
    row = itemsize * ((shape[-1] if len(shape) >= 2 else 0) or 1)
    total = math.prod(shape) * itemsize
    starts, pos = [], 0
    for sh in shards:
        pc = contiguous_range(sh, src, shape, dtype)
        if pc is None or pc.rows * row != sh.nbytes or pc.r0 < 0 or pc.r1 * row > total:
            return None
        starts.append((pos, pos + sh.nbytes, pc.r0 * row))
        pos += sh.nbytes
    out = []
    for rdesc, doff, soff, n in dests:
        for a, b, base in starts:
            if a <= soff and soff + n <= b:
                out.append((rdesc, doff, base + soff - a, n))
                break
        else:
            return None
    return out


# --------------------------------------------------------------------------- the batching


class Batcher:
    """Items gathered into batches: a batch is full at its `size`-th item or once its items'
    bytes reach `max_bytes` (None: bytes not counted).  ``add`` returns the full batch (and
    starts a new one), ``take`` the batch so far (before a task of another kind, at a group's
    end).  Used per task per push: kept small (about 0.15 us an add on the 2-core VM, against
    0.05 us for the loop's own list and counter it replaced)."""

    __slots__ = ("size", "max_bytes", "items", "nbytes")

    def __init__(self, size: int = ZERO_COPY_BATCH, max_bytes: int | None = ZERO_COPY_BATCH_BYTES):
        self.size = max(1, int(size))
        self.max_bytes: float = math.inf if max_bytes is None else max_bytes
        self.items: list = []
        self.nbytes = 0

    def add(self, item: Any, nbytes=0) -> list | None:
        """Add `item` of `nbytes`; the batch when it is full now, else None."""
        items = self.items
        items.append(item)
        held = self.nbytes = self.nbytes + nbytes
        if len(items) >= self.size or held >= self.max_bytes:
            self.items, self.nbytes = [], 0
            return items
        return None

    def take(self) -> list:
        """The batch so far (possibly empty); the next one starts empty."""
        out = self.items
        self.items, self.nbytes = [], 0
        return out

    def __len__(self) -> int:
        return len(self.items)


def copy_batch_full(ranges: int, nbytes, launch: int = 0, first: int = 0) -> bool:
    """The queued copies (`ranges` destination ranges of `nbytes` bytes) fill one batched copy
    launch, the push's `launch`-th (from 0): launch them now.  With `first` (bytes, > 0) the
    launches ramp up: the first closes at `first` bytes, each next at twice the last, up to
    ``COPY_BATCH_BYTES`` (so the GPU starts on a push's copies after a few tasks, not after
    ``COPY_BATCH_BYTES`` of them; $WXFER_DIRECT_COPY_FIRST, ``envs.size``)."""
    cap = COPY_BATCH_BYTES if first <= 0 else min(COPY_BATCH_BYTES, first << min(max(launch, 0), 30))
    return ranges >= COPY_BATCH or nbytes >= cap


def batch_ends(
    kinds: Sequence, size: int = ZERO_COPY_BATCH, nbytes=None, max_bytes: int = ZERO_COPY_BATCH_BYTES
) -> dict:
    """The Sender's zero-copy batches over one mesh group's tasks in order (``kinds``: the
    kind of each, see wxfer.plan.kinds): {index of the task after whose host work the batch is
    handed to the engine: (its zero-copy tasks, index of its last one)}.  Cut by a ``Batcher``
    of `size` and, where ``nbytes`` (each task's bytes) is given, `max_bytes`; also before a
    task of another kind and at the group's end; copy tasks do not cut it (the Sender queues
    their copies and goes on), so it can be handed over after some."""
    out: dict = {}
    b = Batcher(size, None if nbytes is None else max_bytes)
    for i, k in enumerate(list(kinds) + [None]):
        if k == "copy":
            continue
        if k == "zero_copy":
            full = b.add(i, nbytes[i] if nbytes is not None else 0)
            if full is not None:
                out[i] = (len(full), i)
        elif len(b):
            full = b.take()
            out[i - 1] = (len(full), full[-1])  # before task i (or the group's end)
    return out


def batches(kinds: Sequence, size: int = ZERO_COPY_BATCH, nbytes=None) -> list:
    """batch_ends as [(first, count)]: the index of each batch's first task and its zero-copy
    tasks (consecutive unless copy tasks lie between them)."""
    out = []
    for _, (n, last) in sorted(batch_ends(kinds, size, nbytes).items()):
        zs = [j for j in range(last + 1) if kinds[j] == "zero_copy"]
        out.append((zs[-n], n))
    return out
