"""wxfer.zerocopy: the zero-copy rule (each shard one contiguous run of whole rows of its one
source, in its dtype) against the mapping's reference bytes, and the batching policy (Batcher,
batch_ends) against the loops it replaced: the Sender's push loop and the simulator's model."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from wxfer import envs
from wxfer.mapping import Piece, Shard
from wxfer.mapping.reference import pack_task
from wxfer.zerocopy import (
    COPY_BATCH,
    COPY_BATCH_BYTES,
    ZERO_COPY_BATCH,
    ZERO_COPY_BATCH_BYTES,
    Batcher,
    all_of_it,
    batch_ends,
    batches,
    contiguous_range,
    COPY_FIRST_BYTES,
    copy_batch_full,
    merged_rows,
    whole_rows,
    zero_copy,
    zero_copy_dests,
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


def test_copy_launches_ramp_up_from_the_first_launchs_bytes(monkeypatch):
    """WXFER_DIRECT_COPY_FIRST: a push's first launch closes at that many bytes, each next at
    twice the last, up to COPY_BATCH_BYTES; 0 (the default) keeps COPY_BATCH_BYTES for each."""
    mib = 1 << 20
    sizes = range(0, COPY_BATCH_BYTES + 1, mib)
    caps = [next(b for b in sizes if copy_batch_full(1, b, i, 32 * mib)) for i in range(5)]
    assert caps == [32 * mib, 64 * mib, 128 * mib, 256 * mib, COPY_BATCH_BYTES]
    assert not copy_batch_full(1, 31 * mib, 0, 32 * mib) and copy_batch_full(COPY_BATCH, 0, 0, 32 * mib)
    assert not copy_batch_full(1, COPY_BATCH_BYTES - 1, 0, 0) and not copy_batch_full(1, 100 * mib, 10**6, 0)
    assert copy_batch_full(1, COPY_BATCH_BYTES, 10**6, 1)  # no overflow far out
    monkeypatch.delenv("WXFER_DIRECT_COPY_FIRST", raising=False)
    assert envs.size("WXFER_DIRECT_COPY_FIRST", COPY_FIRST_BYTES) == COPY_FIRST_BYTES == 0
    monkeypatch.setenv("WXFER_DIRECT_COPY_FIRST", "32MiB")
    assert envs.size("WXFER_DIRECT_COPY_FIRST", COPY_FIRST_BYTES) == 32 * mib
    monkeypatch.setenv("WXFER_DIRECT_COPY_FIRST", "lots")
    with pytest.raises(ValueError, match=r"WXFER_DIRECT_COPY_FIRST must be a size in bytes .* got 'lots'"):
        envs.size("WXFER_DIRECT_COPY_FIRST", 0)


# --------------------------------------------------------------------------- the rule


def _raw(pieces, nbytes, dtype="bfloat16"):
    return Shard(0, "w", 0, nbytes, "raw", dtype, tuple(pieces))


def test_merged_rows_joins_consecutive_rows_of_one_source_only():
    ps = [Piece("a", 0, 2, 0, 8), Piece("a", 2, 5, 0, 8), Piece("a", 6, 7, 0, 8), Piece("b", 7, 9, 0, 8)]
    assert merged_rows(ps) == (Piece("a", 0, 5, 0, 8), Piece("a", 6, 7, 0, 8), Piece("b", 7, 9, 0, 8))
    cols = [Piece("a", 0, 2, 0, 4), Piece("a", 2, 4, 0, 4), Piece("a", 4, 6, 4, 8)]
    assert merged_rows(cols) == (Piece("a", 0, 4, 0, 4), Piece("a", 4, 6, 4, 8))
    assert merged_rows([]) == ()
    assert whole_rows(Piece("a", 3, 9), (100,)) and whole_rows(Piece("a", 0, 1, 0, 8), (2, 3, 8))
    assert not whole_rows(Piece("a", 0, 1, 0, 4), (2, 8))


def test_the_rule_refuses_column_slices_casts_gaps_and_other_sources():
    shape = (6, 4)
    ok = _raw([Piece("w", 0, 2, 0, 4), Piece("w", 2, 3, 0, 4)], 3 * 4 * 2)
    assert contiguous_range(ok, "w", shape, "bfloat16") == Piece("w", 0, 3, 0, 4)
    assert zero_copy([ok], "w", shape, "bfloat16") and not zero_copy([], "w", shape, "bfloat16")
    bad = {
        "columns": _raw([Piece("w", 0, 6, 0, 2)], 6 * 2 * 2),
        "a gap": _raw([Piece("w", 0, 2, 0, 4), Piece("w", 3, 4, 0, 4)], 3 * 4 * 2),
        "out of order": _raw([Piece("w", 2, 3, 0, 4), Piece("w", 0, 2, 0, 4)], 3 * 4 * 2),
        "a cast": _raw([Piece("w", 0, 6, 0, 4)], 6 * 4 * 4, "float32"),
        "another source": _raw([Piece("v", 0, 6, 0, 4)], 6 * 4 * 2),
        "fp8": Shard(0, "w", 0, 24, "fp8", "float8_e4m3fn", (Piece("w", 0, 6, 0, 4),)),
        "no pieces": _raw([], 0),
    }
    for why, sh in bad.items():
        assert contiguous_range(sh, "w", shape, "bfloat16") is None, why
        assert not zero_copy([ok, sh], "w", shape, "bfloat16"), why
    assert all_of_it([_raw([Piece("w", 0, 3, 0, 4), Piece("w", 3, 6, 0, 4)], 48)], "w", shape, "bfloat16")
    assert not all_of_it([ok], "w", shape, "bfloat16")  # 3 of 6 rows
    assert not all_of_it([ok, ok], "w", shape, "bfloat16")  # two shards
    # a fused 3-D [E, 2I, H] source: rows are E x 2I; all of it, in per-expert pieces
    experts = [Piece("e", r, r + 4, 0, 8) for r in range(0, 12, 4)]
    assert all_of_it([_raw(experts, 12 * 8 * 2)], "e", (3, 4, 8), "bfloat16")


@st.composite
def _task(draw):
    """A source (1-, 2- or 3-D) and shards of it: runs of whole rows (one range each), cut
    into pieces at random; sometimes spoiled (a column slice, a gap, a wrong size)."""
    dim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=dim, max_size=dim)))
    rows = shape[0] if dim == 1 else int(torch.tensor(shape[:-1]).prod())
    cols = shape[-1] if dim >= 2 else 0
    shards, spoiled = [], False
    for _ in range(draw(st.integers(1, 3))):
        r0 = draw(st.integers(0, rows - 1))
        r1 = draw(st.integers(r0 + 1, rows))
        cuts = sorted(set(draw(st.lists(st.integers(r0 + 1, r1), max_size=3))) | {r1})
        pieces, a = [], r0
        for b in cuts:
            pieces.append(Piece("p", a, b, 0, cols))
            a = b
        nbytes = (r1 - r0) * (cols or 1) * 2
        how = draw(st.sampled_from(["ok"] * 6 + ["cols", "gap", "size"]))
        if how == "cols" and cols > 1:
            pieces[0] = pieces[0]._replace(c1=cols - 1)
            nbytes -= pieces[0].rows * 2
            spoiled = True
        elif how == "gap" and len(pieces) > 1 and pieces[1].rows > 1:
            pieces[1] = pieces[1]._replace(r0=pieces[1].r0 + 1)
            nbytes -= (cols or 1) * 2
            spoiled = True
        elif how == "size":
            nbytes += 2
            spoiled = True
        shards.append(_raw(pieces, nbytes))
    return shape, shards, spoiled, draw(st.randoms(use_true_random=False))


@settings(max_examples=200, deadline=None)
@given(_task())
def test_zero_copy_dests_point_at_the_reference_bytes(t):
    shape, shards, spoiled, rnd = t
    src = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    total = sum(sh.nbytes for sh in shards)
    dests, pos = [], 0
    for i, sh in enumerate(shards):  # destination ranges inside each shard's bytes of the buffer
        a = rnd.randrange(0, max(1, sh.nbytes))
        n = rnd.randrange(0, sh.nbytes - a + 1)
        dests.append((f"r{i}", rnd.randrange(0, 1 << 20), pos + a, n))
        pos += sh.nbytes
    out = zero_copy_dests(shards, dests, "p", shape, "bfloat16", 2)
    if spoiled:
        assert out is None
        return
    assert out is not None and len(out) == len(dests)
    packed = pack_task(shards, {"p": src}).numpy().tobytes()
    assert len(packed) == total
    mem = src.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for (rd, doff, soff, n), (rd2, doff2, own, n2) in zip(dests, out):
        assert (rd2, doff2, n2) == (rd, doff, n)
        assert mem[own : own + n] == packed[soff : soff + n]
    # a destination range across two shards' bytes is not one range of the source
    if len(shards) > 1 and shards[0].nbytes and shards[1].nbytes:
        across = [("x", 0, shards[0].nbytes - 1, 2)]
        got = zero_copy_dests(shards, across, "p", shape, "bfloat16", 2)
        assert got is None


def test_zero_copy_dests_refuse_rows_outside_the_source():
    sh = _raw([Piece("p", 2, 5, 0, 4)], 3 * 4 * 2)
    assert zero_copy_dests([sh], [("r", 0, 0, 24)], "p", (5, 4), "bfloat16", 2) == [("r", 0, 2 * 8, 24)]
    assert zero_copy_dests([sh], [("r", 0, 0, 24)], "p", (4, 4), "bfloat16", 2) is None  # rows [2, 5) of 4
    assert zero_copy_dests([], [], "p", (4, 4), "bfloat16", 2) is None


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
