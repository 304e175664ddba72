"""The large zero-copy tasks of a quantizing push copied beside the FP8 kernel on one GPU
(wxfer.runtime.overlap; the CPU's decisions and order: tests/test_overlap.py).  Trainer (this
process) and a receiver (a spawned process) share GPU 0 over cuda_ipc; a BF16 model into FP8,
copy_max cut low so that its embeddings and lm_head are "large".  From the second push on they
are copied on a second stream (WXFER_DIRECT_OVERLAP: by the driver's batched copy on the copy
engines, or by the copy kernel with a small grid): every inference byte is the
reference's, the engine writes only the version stamps, the end stamps are posted after the
copies landed even when they are late, and the quantizer on the side stream does not wait for
them (the two streams really run side by side)."""

import time

import pytest

torch = pytest.importorskip("torch")
from wxfer.models import TINY  # noqa: E402
from wxfer.models.infer import preset_for  # noqa: E402
from test_direct import _check_trace  # noqa: E402 -- tests/test_direct.py
from test_direct_gpu import T, _Receivers, _check_bytes, _model, needs_gpu  # noqa: E402

CUT = 4096


def _sender(addr, name):
    from wxfer.runtime.sender import Sender

    model = _model(TINY).to(torch.bfloat16)  # BF16: the norms, embeddings, lm_head stay zero copy
    s = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, direct=True)
    ops = [op for g in s.program.groups for op in g if op.sends]
    big = [op for op in ops if op.prep.zero_copy and op.nbytes >= CUT]
    assert big and any(not op.prep.zero_copy for op in ops) and s.transport_name == "cuda_ipc"
    return model, s, ops, big


def _step(model, k):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.75 if k % 2 else 1.25)


def _stamps(s):
    from wxfer.runtime.tasks import STAMP_TAG

    recs = sorted(s.engine.trace(), key=lambda r: r["id"])
    return recs, [r for r in recs if r["tag"] == STAMP_TAG]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["engines", "kernel"])
def test_large_copies_beside_the_quantizer_give_the_reference_bytes_before_the_end_stamps(store, monkeypatch, mode):
    from wxfer.runtime import copies
    from wxfer.runtime.inplace import COPIES_TAG
    from wxfer.runtime.overlap import OVERLAP_TAG

    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", str(CUT))
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", mode)
    _, addr = store
    name = "ovl_" + mode
    rx = _Receivers(addr, name, TINY, "fp8")
    try:
        model, s, ops, big = _sender(addr, name)
        driver = copies.driver_why(torch.device("cuda", 0)) is None
        for step in (1, 2, 3):
            if step > 1:
                _step(model, step)
            moved = s.engine.stats()["bytes_written"]
            s.engine.trace(clear=True)
            s.push()
            got, version = rx.read(0)
            assert version == step
            _check_bytes(model, TINY, "fp8", got)
            d = s.stats()["direct"]
            engine = s.engine.stats()["bytes_written"] - moved
            if step == 1:  # no quantizing push before it: the engine writes them
                assert "overlap" not in d and engine == sum(op.nbytes for op in big) + 2 * 8, (d, engine)
                continue
            assert engine == 2 * 8, engine  # the stamps only
            o = d["overlap"]
            assert o["tasks"] == len(big) and o["bytes"] == sum(op.nbytes for op in big) and o["launches"] >= 1, o
            assert o["mode"] == mode and o["copier"] == ("driver" if mode == "engines" and driver else "native"), o
            _check_trace(s, {op.task for op in ops} | {COPIES_TAG, OVERLAP_TAG})
            recs, (begin, end) = _stamps(s)
            ovl = [r for r in recs if r["tag"] == OVERLAP_TAG]
            assert ovl and all(begin["t_done"] <= r["t_done"] <= end["t_post_first"] for r in ovl), (ovl, end)
        assert s.stats()["quantizer"]["quantizer"] == "native"
        s.close()
    finally:
        rx.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
def test_a_late_overlap_copy_holds_the_end_stamps_and_not_the_quantizer(store, monkeypatch):
    """The second stream held up (torch.cuda._sleep, ~0.3 s, queued before its copy): the
    side stream's quantizer kernels finish while it sleeps (they do not wait for it); push()
    returns only after the copy landed (the engine waited for its CUDA event, no synchronize),
    the end stamps after it; the bytes are the reference's."""
    from wxfer.runtime import copies, overlap
    from wxfer.runtime.overlap import OVERLAP_TAG

    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", str(CUT))
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "engines")  # opt-in; the driver's copy, else the kernel's
    _, addr = store
    rx = _Receivers(addr, "ovl_late", TINY, "fp8")
    try:
        model, s, ops, big = _sender(addr, "ovl_late")
        s.push()  # warm-up: kernels compiled, regions mapped; the next push defers
        real_copy, real_launch = copies.copy_ranges, overlap.Overlap.launch
        seen = {}

        def slow(device, items, **kw):
            if (kw.get("ctas") or kw.get("beside")) and "slept" not in seen:  # the overlap's launch (its stream)
                seen["slept"] = True
                torch.cuda._sleep(int(0.3 * 2e9))
            return real_copy(device, items, **kw)

        def launch(self, gate, skip):
            real_launch(self, gate, skip)
            # the side stream's work so far (the quantizer launches before the copies' launch;
            # the tiny model's both, its layers running first: steps._ordered) against the late
            # copy: done within 0.2 s while the copy still sleeps (before the group's end joins them)
            side = self.w.stream.record_event()
            late = self.unjoined[-1] if self.unjoined else None
            t = time.monotonic() + 0.2
            while not side.query() and time.monotonic() < t:
                time.sleep(0.001)
            seen["side_first"] = side.query() and late is not None and not late.query()

        monkeypatch.setattr(copies, "copy_ranges", slow)
        monkeypatch.setattr(overlap.Overlap, "launch", launch)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: pytest.fail("a stream synchronize"))
        _step(model, 2)
        s.engine.trace(clear=True)
        t0 = time.monotonic_ns()
        s.push()
        took = (time.monotonic_ns() - t0) / 1e9
        got, version = rx.read(0)
        assert seen.get("slept") and version == 2
        assert seen["side_first"], "the quantizer's stream waited for the late copy's stream"
        _check_bytes(model, TINY, "fp8", got)
        recs, (_, end) = _stamps(s)
        ovl = [r for r in recs if r["tag"] == OVERLAP_TAG]
        assert ovl and all(r["status"] == 0 and r["t_done"] <= end["t_post_first"] for r in ovl)
        assert ovl[0]["t_done"] - t0 > 0.1e9 and took > 0.1, (ovl[0]["t_done"] - t0, took)
        s.close()
    finally:
        rx.close()
