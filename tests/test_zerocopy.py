"""wxfer.zerocopy: the batching policy (Batcher, batch_ends) against the loops it replaced: the
Sender's push loop and the simulator's model."""

import pytest
from hypothesis import given, settings, strategies as st

from wxfer.zerocopy import (
    COPY_BATCH,
    COPY_BATCH_BYTES,
    ZERO_COPY_BATCH,
    ZERO_COPY_BATCH_BYTES,
    Batcher,
    batch_ends,
    batches,
    copy_batch_full,
)

KINDS = st.sampled_from(["zero_copy", "copy", "packed", "staged", "direct", "collective_only"])


# --------------------------------------------------------------------------- batching


def _sender_loop(kinds, nbytes, size, max_bytes):
    """The Sender's push loop as it was written before the Batcher (sender.py at d26ada0): the
    batches of task indices it handed to Engine.submit_prepared."""
    out, batch, held = [], [], 0
    for i, k in enumerate(kinds):
        if k == "copy":
            continue
        if k == "zero_copy":
            batch.append(i)
            held += nbytes[i]
            if len(batch) >= size or held >= max_bytes:
                out.append(batch)
                batch, held = [], 0
            continue
        if batch:
            out.append(batch)
            batch, held = [], 0
    if batch:
        out.append(batch)
    return out


def _old_batch_ends(kinds, size, nbytes, max_bytes):
    """wxfer.plan.kinds.batch_ends as it was written before the Batcher (d26ada0)."""
    out: dict = {}
    n = last = 0
    b = 0.0
    size = max(1, int(size))
    for i, k in enumerate(list(kinds) + [None]):
        if k == "copy":
            continue
        if k == "zero_copy":
            n, last = n + 1, i
            b += float(nbytes[i]) if nbytes is not None else 0.0
            if n == size or (nbytes is not None and b >= max_bytes):
                out[i], n, b = (n, i), 0, 0.0
        elif n:
            out[i - 1], n, b = (n, last), 0, 0.0
    return out


def _batcher_loop(kinds, nbytes, size, max_bytes):
    """The push loop's shape with the Batcher (wxfer.runtime.sender): add each zero-copy task,
    hand over a full batch, take the open one before another kind and at the end."""
    b, out = Batcher(size, max_bytes), []
    for i, k in enumerate(kinds):
        if k == "copy":
            continue
        if k == "zero_copy":
            full = b.add(i, nbytes[i])
            if full is not None:
                out.append(full)
        elif len(b):
            out.append(b.take())
    if len(b):
        out.append(b.take())
    return out


@st.composite
def _groups(draw):
    n = draw(st.integers(0, 90))
    kinds = draw(st.lists(KINDS, min_size=n, max_size=n))
    big = draw(st.booleans())  # sizes around the byte bound, or small ones (cut by count)
    hi = 3 * (1 << 28) if big else 1 << 20
    nbytes = draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))
    size = draw(st.sampled_from([1, 2, 3, 7, ZERO_COPY_BATCH]))
    max_bytes = draw(st.sampled_from([1 << 20, 5 << 20, ZERO_COPY_BATCH_BYTES]))
    return kinds, nbytes, size, max_bytes


@settings(max_examples=300, deadline=None)
@given(_groups())
def test_the_batchers_batches_are_the_old_loops(g):
    kinds, nbytes, size, max_bytes = g
    want = _sender_loop(kinds, nbytes, size, max_bytes)
    assert _batcher_loop(kinds, nbytes, size, max_bytes) == want
    # the simulator's and the fit's batch_ends: the old function's, with and without bytes
    for nb in (nbytes, None):
        assert batch_ends(kinds, size, nb, max_bytes) == _old_batch_ends(kinds, size, nb, max_bytes)
    # and the same batches as the loop: each handed over after its last zero-copy task or
    # after the copy tasks that follow it, before the next task of another kind
    ends = batch_ends(kinds, size, nbytes, max_bytes)
    assert [last for _, (_, last) in sorted(ends.items())] == [b[-1] for b in want]
    assert [n for _, (n, _) in sorted(ends.items())] == [len(b) for b in want]
    for at, (_, last) in ends.items():
        assert at >= last and all(k == "copy" for k in kinds[last + 1 : at + 1])
    assert batches(kinds, size, nbytes) == [(b[0], len(b)) for b in _sender_loop(kinds, nbytes, size, 1 << 28)]


def test_batcher_cuts_by_count_and_by_bytes_and_keeps_no_items():
    b = Batcher(3, 100)
    assert b.add("a", 10) is None and b.add("b", 10) is None and len(b) == 2
    assert b.add("c", 0) == ["a", "b", "c"] and len(b) == 0 and b.nbytes == 0
    assert b.add("d", 99) is None and b.add("e", 1) == ["d", "e"]  # bytes reach the bound
    assert b.add("f", 500) == ["f"]  # one large task is not held back
    assert b.take() == [] and b.take() == []
    nb = Batcher(2, None)  # bytes not counted
    assert nb.add("x", 10**15) is None and nb.add("y", 10**15) == ["x", "y"]
    assert Batcher(0).size == 1 and Batcher(-5, None).add("z") == ["z"]
    d = Batcher()
    assert (d.size, d.max_bytes) == (ZERO_COPY_BATCH, ZERO_COPY_BATCH_BYTES)


def test_copy_launches_are_cut_at_the_range_count_or_the_bytes():
    assert not copy_batch_full(COPY_BATCH - 1, COPY_BATCH_BYTES - 1)
    assert copy_batch_full(COPY_BATCH, 0) and copy_batch_full(1, COPY_BATCH_BYTES)
    assert copy_batch_full(1, float(COPY_BATCH_BYTES))  # the simulator counts bytes as floats


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
