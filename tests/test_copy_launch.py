"""The batched copy launches kept from one push to the next (wxfer/runtime/copy_launch.py): the
engine's destinations of a launch validated once (Engine.prepare_external) and reused while its
queued copies are the same bindings; made again when a task's memory moved, a receiver is
skipped, after a restart (forget); a destination the engine refuses raises before anything is
copied.  On a GPU (marker gpu): the second push's launches reuse the range table in device
memory (copies.launch_at) and copy the new bytes; a launch on another stream uploads its own."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from wxfer.runtime import copies  # noqa: E402
from wxfer.runtime import inplace as direct  # noqa: E402
from wxfer.runtime.copy_launch import Launches  # noqa: E402
from test_direct import _COPY, _CopySender  # noqa: E402


def _ops(srcs, region=b"g0", also=None):
    """Zero-copy tasks of `srcs`, task i to bytes [16 i, 16 i + 16) of `region` (and of `also`)."""
    out = []
    for i, src in enumerate(srcs):
        dests = [(region, 16 * i, 0, 16)] + ([(also, 16 * i, 0, 16)] if also else [])
        prep = SimpleNamespace(whole=[("w", src)], dests=dests, best=_COPY)
        out.append(SimpleNamespace(prep=prep, sends=True, nbytes=16, task=i))
    return out


def _push(s, version, ops):
    s.start(version, False, lambda: None)
    for op in ops:
        assert s.queue_copy(op)
    s.flush_copies()


def test_a_launchs_destinations_are_validated_once_while_its_bindings_are_the_same():
    regions = {b"g0": torch.zeros(64, dtype=torch.uint8), b"g1": torch.zeros(64, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0, b"g1": 1})
    srcs = [torch.full((16,), i + 1, dtype=torch.uint8) for i in range(3)]
    ops = _ops(srcs, also=b"g1")
    _push(s, 1, ops)
    assert len(s.engine.prepared) == 1
    for src in srcs:
        src.add_(10)  # the next step's bytes, same memory
    _push(s, 2, ops)
    assert len(s.engine.prepared) == 1  # the same launch: not validated again
    h = s.stats()["last_push"]  # the launch's host seconds, in parts
    assert h["launches"] == 1 and h["copy_s"] > 0 and h["submit_s"] > 0
    assert h["launch_s"] >= h["begin_wait_s"] + h["copy_s"] + h["submit_s"]
    assert s.engine.tasks[0] == s.engine.tasks[1] and s.engine.tasks[1][1] == direct.COPIES_TAG
    assert [int(regions[g][32]) for g in (b"g0", b"g1")] == [13, 13]  # the new bytes landed
    ops[1].prep.whole = [("w", torch.full((16,), 7, dtype=torch.uint8))]  # task 1's memory moved
    _push(s, 3, ops)
    assert len(s.engine.prepared) == 2 and int(regions[b"g0"][16]) == 7
    s.links.failed = [SimpleNamespace(peer=11)]  # receiver gpu 1 failed: a launch without it
    srcs[0].fill_(99)
    _push(s, 4, ops)
    assert len(s.engine.prepared) == 3 and {d[0] for d in s.engine.tasks[-1][0]} == {b"g0"}
    assert (int(regions[b"g0"][0]), int(regions[b"g1"][0])) == (99, 11)  # not written to gpu 1
    s.links.failed = []
    _push(s, 5, ops)
    _push(s, 6, ops)
    assert len(s.engine.prepared) == 4  # both receivers again, then kept
    s.forget(1, [b"g1"])  # a restarted worker: made again
    _push(s, 7, ops)
    assert len(s.engine.prepared) == 5
    assert all(t[1] == direct.COPIES_TAG for t in s.engine.tasks) and len(s.engine.tasks) == 7


def test_a_refused_destination_raises_before_anything_is_copied():
    """The engine validates a launch's destinations before the launch (prepare_external): a
    refusal raises out of flush_copies with nothing written and no engine task."""
    regions = {b"g0": torch.zeros(64, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})

    def refuse(dests, tag=0):
        raise ValueError("write refused: remote range outside the region")

    s.engine.prepare_external = refuse
    s.start(1, False, lambda: None)
    assert s.queue_copy(_ops([torch.full((16,), 5, dtype=torch.uint8)])[0])
    with pytest.raises(ValueError, match="write refused"):
        s.flush_copies()
    assert int(regions[b"g0"].count_nonzero()) == 0 and s.engine.tasks == []


def test_a_launch_of_another_engine_is_made_again():
    regions = {b"g0": torch.zeros(64, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})
    ops = _ops([torch.full((16,), 5, dtype=torch.uint8)])
    _push(s, 1, ops)
    first = s.launches.recs[0]
    s.engine = type(s.engine)()  # (a Sender's new engine)
    _push(s, 2, ops)
    assert s.launches.recs[0] is not first and len(s.engine.prepared) == 1


def test_a_kept_launch_reuses_its_device_table_only_on_its_stream_after_this_pushs_choice(monkeypatch):
    """The native path's logic without a GPU (the copier, the stream and the launch stood in):
    each push's first launch goes through copy_ranges (the copier chosen again, the table in
    device memory looked up on the current stream); a later launch of a kept record on the same
    stream is copies.launch_at with that table; on another stream, copy_ranges again; a push
    whose copier is not native never takes it."""
    from wxfer.runtime import fp8

    stream, ran, log = [7], ["native"], []
    monkeypatch.setattr(fp8, "_raw_stream", lambda dev: stream[0])
    monkeypatch.setattr(copies, "copy_ranges", lambda dev, items, ranges=None: (log.append("ranges"), ran[0])[1])
    monkeypatch.setattr(copies, "device_table", lambda dev, st, t: ("table", st))
    monkeypatch.setattr(copies, "launch_at", lambda dev, st, t, d: log.append(("at", st, d)))
    writer = SimpleNamespace(device=torch.device("cuda", 0), engine=SimpleNamespace(prepare_external=lambda d, tag: d))
    ls = Launches(writer, direct.COPIES_TAG)
    q = [(0, ("g", 0, 0, 16), (None, None, 1 << 20, 2 << 20, 16))]
    ls.start()
    assert [ls.launch(ls.get(0, q)) for _ in range(2)] == ["native", "native"]
    assert log == ["ranges", ("at", 7, ("table", 7))]
    ls.start()  # the next push: its first launch chooses again
    ls.launch(ls.get(0, q))
    stream[0] = 9  # another stream: not the table uploaded on 7
    ls.launch(ls.get(0, q))
    ls.launch(ls.get(0, q))
    assert log[2:] == ["ranges", "ranges", ("at", 9, ("table", 9))]
    ran[0] = "torch._foreach_copy_"  # (WXFER_COPY=torch set meanwhile)
    ls.start()
    assert [ls.launch(ls.get(0, q)) for _ in range(2)] == ["torch._foreach_copy_"] * 2 and log[5:] == ["ranges"] * 2


@pytest.mark.gpu
def test_the_next_pushs_launches_reuse_their_device_table_on_the_same_stream():
    """On a GPU: a push's second launch of the same copies runs copies.launch_at (the range table
    uploaded at the first), copying the new bytes; on another stream it goes through
    copy_ranges (its own table there); the copier is chosen again at each push's start."""
    from helpers import native_gpu  # tests/helpers.py

    dev = native_gpu(copies.info, "copier", "the native copy kernel")
    src = torch.arange(4096, dtype=torch.uint8, device=dev)
    dst = torch.zeros(8192, dtype=torch.uint8, device=dev)
    items = [(dst[i * 512 : (i + 1) * 512], src[i * 512 : (i + 1) * 512]) for i in range(8)]
    q = [(0, ("g", i), (d, s_, d.data_ptr(), s_.data_ptr(), 512)) for i, (d, s_) in enumerate(items)]
    writer = SimpleNamespace(device=dev, engine=SimpleNamespace(prepare_external=lambda d, tag: (d, tag)))
    ls = Launches(writer, direct.COPIES_TAG)
    calls = []
    real = copies.launch_at
    side = torch.cuda.Stream(dev)
    other = torch.cuda.Stream(dev)
    try:
        copies.launch_at = lambda *a: (calls.append(a[1]), real(*a))[1]
        for step in range(3):
            ls.start()
            src.add_(1)
            with torch.cuda.stream(side):
                assert ls.launch(ls.get(0, q)) == "native"
            with torch.cuda.stream(side if step < 2 else other):
                r = ls.get(0, q)
                assert ls.launch(r) == "native"
            torch.cuda.synchronize(dev)
            assert torch.equal(dst[:4096], src)
    finally:
        copies.launch_at = real
    # each push's first launch chooses the copier (copy_ranges); its second reuses the table on
    # the stream it was uploaded on; on another stream (the third push) copy_ranges uploads its own
    assert calls == [side.cuda_stream, side.cuda_stream] and r.at[0] == other.cuda_stream


def test_queue_run_queues_what_queue_copy_would_and_stops_where_queue_copy_must_decide(monkeypatch):
    """InPlaceWriter.queue_run (the step loop's run of copy tasks): nothing before the tasks are
    bound; then a whole run with queue_copy's queue, bytes and counters, a launch as a batch
    fills; it stops at a task whose memory moved (queue_copy binds it, the run goes on after
    it), and queues nothing in a push that does not copy (verify on)."""
    from wxfer import zerocopy

    monkeypatch.setattr(zerocopy, "COPY_BATCH", 4)  # a launch per 4 ranges
    regions = {b"g0": torch.zeros(256, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})
    srcs = [torch.full((16,), i + 1, dtype=torch.uint8) for i in range(6)]
    ops = _ops(srcs)
    s.start(1, False, lambda: None)
    assert s.queue_run(ops, 0) == 0  # not bound yet: queue_copy binds them
    for op in ops:
        assert s.queue_copy(op)
    s.flush_copies()
    assert [len(t[0]) for t in s.engine.tasks] == [4, 2]
    for src in srcs:
        src.add_(10)
    s.start(2, False, lambda: None)
    assert s.queue_run(ops, 0) == 6
    assert (s.n["copies"], s.copy_q_bytes, len(s.copy_q)) == (6, 32, 2)  # 4 launched as they filled
    s.flush_copies()
    assert [len(t[0]) for t in s.engine.tasks] == [4, 2, 4, 2] and s.stats()["last_push"]["launches"] == 2
    assert regions[b"g0"][:96].tolist() == [v for i in range(6) for v in [i + 11] * 16]
    ops[3].prep.whole = [("w", torch.full((16,), 50, dtype=torch.uint8))]  # task 3's memory moved
    s.start(3, False, lambda: None)
    assert s.queue_run(ops, 0) == 3 and s.queue_run(ops, 3) == 3
    assert s.queue_copy(ops[3])  # bound again
    assert s.queue_run(ops, 4) == 6 and s.n["copies"] == 6
    s.flush_copies()
    assert int(regions[b"g0"][48]) == 50 and s.stats()["last_push"]["bound"] == 1
    s.start(4, True, lambda: None)  # verify on: the engine's way
    assert s.queue_run(ops, 0) == 0 and s.copy_q == []
