"""The large zero-copy tasks of a quantizing push copied beside the FP8 kernel
(wxfer.runtime.overlap; the GPU's two streams: tests/test_overlap_gpu.py).  On the CPU the
writer has no stream: every write runs on the host in the order it is issued, so what is
checked here is the decision (which push, which task), the order of the launches against the
quantizer's and the begin stamps, the receivers skipped, the engine tasks and their place
between the version stamps, and the bytes."""

import pytest

torch = pytest.importorskip("torch")
from wxfer import _wxfer  # noqa: E402
from wxfer.runtime import inplace as direct  # noqa: E402
from wxfer.runtime import overlap, steps  # noqa: E402
from wxfer.runtime.overlap import OVERLAP_TAG  # noqa: E402
from test_direct import _CopySender, _COPY, _direct_sender, _check, _check_trace, _closed  # noqa: E402

FABRIC = _wxfer.backends()["fabric"][0]
needs_fabric = pytest.mark.skipif(not FABRIC, reason="fabric transport not built")


@pytest.fixture(autouse=True)
def _overlap_on(monkeypatch):
    """These tests are of the overlap: on (engines), as WXFER_DIRECT_OVERLAP=engines turns it on
    (off by default until it has run on a GPU); a test that wants it off sets it again."""
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "engines")


def _big_task(src, dests, task=0):
    from types import SimpleNamespace

    prep = SimpleNamespace(zero_copy=True, direct=None, whole=[("w", src)], dests=dests, best=_COPY)
    return SimpleNamespace(prep=prep, sends=True, nbytes=src.numel(), task=task)


def test_a_large_copy_is_deferred_only_after_a_quantizing_push_and_launched_after_the_begin_stamps(monkeypatch):
    """First push: a task of copy_max bytes or more is the engine's.  A push after one that
    launched the quantizer queues it (nothing written, nothing waited for) and launches it at
    the group's end after the begin stamps, skipping a receiver failed by then; one external
    task tagged OVERLAP_TAG; stats say it.  WXFER_DIRECT_OVERLAP=0: the engine's again."""
    from types import SimpleNamespace

    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "64")
    regions = {b"g0": torch.zeros(256, dtype=torch.uint8), b"g1": torch.zeros(256, dtype=torch.uint8)}
    waits = []
    s = _CopySender(regions, {b"g0": 0, b"g1": 1}, lambda: waits.append(1))
    src = torch.arange(128, dtype=torch.uint8)
    op = _big_task(src, [(b"g0", 8, 0, 128), (b"g1", 0, 0, 128)])
    assert s.copy_max == 64 and not s.overlap.live
    assert not s.queue_copy(op)  # the first push: the engine writes it
    s.overlap.quant = 1  # (this push launched the quantizer)
    s.start(2, False, lambda: waits.append(2))
    assert s.overlap.live and s.queue_copy(op)
    assert waits == [] and int(regions[b"g0"].count_nonzero()) == 0  # queued only
    s.links.failed = [SimpleNamespace(peer=11)]  # receiver gpu 1 failed meanwhile
    s.end_group()
    assert waits == [2]  # the begin stamps, before the launch
    assert torch.equal(regions[b"g0"][8:136], src) and int(regions[b"g1"].count_nonzero()) == 0
    assert s.engine.tasks == [([(b"g0", 8, 0, 128)], OVERLAP_TAG)] and s.engine.signalled == [1]
    d = s.stats()
    assert d["overlap"]["tasks"] == 1 and d["overlap"]["bytes"] == 128 and d["overlap"]["launches"] == 1, d
    assert d["skipped_writes"] == 1 and d["copies"] == 0, d
    # that push launched no quantizer: the next one leaves it to the engine
    s.start(3, False, lambda: None)
    assert not s.overlap.live and not s.queue_copy(op)
    # off
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "0")
    s2 = _CopySender(regions, {b"g0": 0, b"g1": 1})
    s2.overlap.quant = 1
    s2.start(2, False, lambda: None)
    assert not s2.overlap.live and not s2.queue_copy(op)
    # verify on: nothing is copied at all
    s.overlap.quant = 1
    s.start(4, True, lambda: None)
    assert not s.overlap.live and not s.queue_copy(op)


def test_the_mode_and_ctas_variables_are_checked(monkeypatch):
    assert overlap.mode() == "engines" and overlap.ctas() == overlap.CTAS  # (the fixture's)
    monkeypatch.delenv("WXFER_DIRECT_OVERLAP")
    assert overlap.mode() == "engines"  # the default (measured on one H100: overlap.mode's docstring)
    # ... where the driver has the batched copy; without it, unset is off (set, the kernel's copy)
    from types import SimpleNamespace

    from wxfer.runtime import copies

    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert copies.driver_why(cpu.device) and overlap.Overlap(cpu).mode is None and not overlap.Overlap(cpu).on
    monkeypatch.setattr(copies, "driver_why", lambda device: None)
    assert overlap.Overlap(cpu).mode == "engines" and overlap.Overlap(cpu).on
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "engines")
    monkeypatch.setattr(copies, "driver_why", lambda device: "no batched copy")
    assert overlap.Overlap(cpu).mode == "engines"  # asked for: the launch falls back to the kernel
    for v, want in (("1", "engines"), ("kernel", "kernel"), ("ENGINES", "engines"), ("off", None), ("0", None)):
        monkeypatch.setenv("WXFER_DIRECT_OVERLAP", v)
        assert overlap.mode() == want and overlap.enabled() == (want is not None)
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "dma")
    with pytest.raises(ValueError, match="WXFER_DIRECT_OVERLAP must be engines, kernel or 0"):
        overlap.mode()
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP_CTAS", "3")
    assert overlap.ctas() == 3
    for bad in ("0", "65", "two"):
        monkeypatch.setenv("WXFER_DIRECT_OVERLAP_CTAS", bad)
        with pytest.raises(ValueError, match="WXFER_DIRECT_OVERLAP_CTAS"):
            overlap.ctas()
    assert overlap.after() == overlap.AFTER == 4
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP_AFTER", "1")
    assert overlap.after() == 1
    for bad in ("0", "1001", "x"):
        monkeypatch.setenv("WXFER_DIRECT_OVERLAP_AFTER", bad)
        with pytest.raises(ValueError, match="WXFER_DIRECT_OVERLAP_AFTER"):
            overlap.after()


def test_the_copies_wait_for_a_gate_before_the_first_quantizer_and_go_after_a_few_launches(monkeypatch):
    """Without a mark the gate is recorded once, before the first quantizer launch that found
    copies queued, and kept (not recorded again) until they are launched ``after`` quantizer
    launches later, on the second stream after that gate; copies queued meanwhile go in the same
    launch; the group's end launches what is still queued after the gate it has (a new one when
    none).  With the push's mark (right after its begin stamps) that is the gate."""
    from types import SimpleNamespace

    class Ev:
        n = 0

        def __init__(self):
            Ev.n += 1
            self.records = 0

        def record(self, stream):
            self.records += 1

    class Stream:
        def __init__(self, *a):
            self.waited = []

        def wait_event(self, ev):
            self.waited.append(ev)

    launched = []
    fake_cuda = SimpleNamespace(Event=Ev, Stream=Stream, stream=lambda st: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    ext = []
    w = SimpleNamespace(device=SimpleNamespace(index=0), stream=Stream(), n={"skipped_writes": 0}, launched=False)
    w.engine = SimpleNamespace(submit_external=lambda dests, **kw: ext.append((dests, kw["tag"])))
    o = overlap.Overlap(w)
    assert o.after == 4
    o._copy = lambda copies, items: launched.append(len(items))
    o.start(True)
    assert o.gate() is None  # nothing queued: no gate
    o.quantized(frozenset())
    hit = (None, 0, 0, [(0, ("d0", 0, 0, 8), ("dst", "src", 0, 0, 8))], None, 8)
    o.live = True
    assert o.take(hit)
    g = o.gate()
    assert isinstance(g, Ev) and g.records == 1
    o.quantized(frozenset())
    assert o.take(hit)  # queued after the gate: the same launch
    for i in range(2, 5):
        assert o.gate() is g and g.records == 1  # kept, not recorded again
        assert launched == [], i
        o.quantized(frozenset())
    assert launched == [2] and o.stream.waited == [g] and o.q == [] and o.gated is None
    assert [t for _, t in ext] == [OVERLAP_TAG] and o.quant == 5
    # the group's end: what is queued goes after the gate recorded for it (a new record)
    assert o.take(hit)
    o.end_group(lambda: frozenset())
    assert launched == [2, 1] and g.records == 2 and o.stream.waited == [g, g] and Ev.n == 3
    # the next push: its begin stamps mark the gate (InPlaceWriter._begin), before any quantizer
    # launch; the copies wait for that one, however late they are queued (none recorded later)
    o.start(True)
    o.live = True
    o.mark()
    early = o.early
    assert isinstance(early, Ev) and early is not g and early.records == 1 and Ev.n == 4
    o.mark()  # once a push
    assert early.records == 1
    o.quantized(frozenset())
    assert o.take(hit) and o.gate() is early and g.records == 2
    o.end_group(lambda: frozenset())
    assert launched == [2, 1, 1] and o.stream.waited[-1] is early and early.records == 1
    o.start(False)  # a push that defers nothing marks nothing
    o.mark()
    assert o.early is None and early.records == 1


def test_the_engines_batch_cuts_each_range_into_pieces():
    items = [("d", "s", 1000, 5000, 10), ("d2", "s2", 9000, 20000, 4)]
    got = overlap.pieces(items, piece=4)
    assert got == [
        (None, None, 1000, 5000, 4),
        (None, None, 1004, 5004, 4),
        (None, None, 1008, 5008, 2),
        (None, None, 9000, 20000, 4),
    ]
    assert overlap.pieces(items) == [(None, None, 1000, 5000, 10), (None, None, 9000, 20000, 4)]


def test_a_driver_refusing_the_engines_batch_sends_the_copies_to_the_kernel_for_good():
    """The driver's batch raising (a hint or memory it does not take): the same items copied by
    the kernel with the small grid, and every later launch of that Sender too."""
    from types import SimpleNamespace

    calls = []

    def copy_ranges(device, items, copier=None, ctas=0, beside=False):
        calls.append((copier, ctas, beside, len(items)))
        if copier == "driver":
            raise RuntimeError("cuMemcpyBatchAsync: invalid value")
        return "native"

    fake = SimpleNamespace(driver_why=lambda d: None, copy_ranges=copy_ranges)
    o = overlap.Overlap(SimpleNamespace(device="cuda:0"))
    items = [(None, None, 1 << 20, 1 << 30, 3 * overlap.PIECE)]
    o._copy(fake, items)
    assert calls == [("driver", 0, True, 3), (None, o.ctas, False, 1)] and o.mode == "kernel" and o.ran == "native"
    o._copy(fake, items)
    assert calls[2:] == [(None, o.ctas, False, 1)]


def test_a_failing_push_drops_the_queued_copies():
    regions = {b"g0": torch.zeros(256, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})
    s.copy_max = 64
    s.overlap.quant = 1
    s.start(2, False, lambda: None)
    assert s.queue_copy(_big_task(torch.ones(100, dtype=torch.uint8), [(b"g0", 0, 0, 100)]))
    assert s.abandon(bound=0.1)
    s.end_group()
    assert int(regions[b"g0"].count_nonzero()) == 0 and s.engine.tasks == []


def _order_spy(monkeypatch, s):
    """[("quant", task) | ("overlap", n items)] as the writer launches them."""
    log = []
    real_q, real_l = direct.InPlaceWriter._quantize, overlap.Overlap.launch

    def quant(self, plan, fulls, skip):
        log.append(("quant", plan.uid))
        return real_q(self, plan, fulls, skip)

    def launch(self, gate, skip):
        log.append(("overlap", len(self.q)))
        return real_l(self, gate, skip)

    monkeypatch.setattr(direct.InPlaceWriter, "_quantize", quant)
    monkeypatch.setattr(overlap.Overlap, "launch", launch)
    return log


@needs_fabric
@pytest.mark.timeout(120)
def test_a_quantizing_push_copies_the_large_bf16_tasks_beside_the_quantizer(store, monkeypatch):
    """A BF16 model into FP8 at TP1: the FP8 weights quantized in place, the rest zero copy;
    with copy_max cut low some of those are large.  Push 1: the engine writes them.  Push 2
    (after a quantizing push): the in-place writer copies them -- launched right after a
    quantizer launch (the first: the model's large tasks come before its layers); the engine
    writes only the stamps; one external task tagged OVERLAP_TAG between the begin and the end
    stamps; the reference bytes every push."""
    _, addr = store
    from test_direct import _model

    model = _model().to(torch.bfloat16)
    cut = 4096
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", str(cut))
    s, params, recvs = _direct_sender(monkeypatch, addr, "ovl", model, 1, "fp8")
    ops = [op for g in s.program.groups for op in g if op.sends]
    big = [op for op in ops if op.prep.zero_copy and op.nbytes >= cut]
    quant = [op for op in ops if not op.prep.zero_copy]
    assert big and quant and s.inplace.overlap.after == overlap.AFTER
    log = _order_spy(monkeypatch, s.inplace)
    tags = {op.task for op in ops} | {direct.COPIES_TAG, OVERLAP_TAG}
    for step in (1, 2, 3):
        if step > 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
        moved = s.engine.stats()["bytes_written"]
        s.engine.trace(clear=True)
        log.clear()
        s.inplace.overlap.after = overlap.AFTER if step < 3 else 1
        s.push()
        assert recvs[0].version() == step
        _check(model, params, 1, "fp8")
        engine = s.engine.stats()["bytes_written"] - moved
        d = s.stats()["direct"]
        if step == 1:
            assert engine == sum(op.nbytes for op in big) + 2 * 8 and "overlap" not in d, d
            assert not any(e[0] == "overlap" for e in log)
            continue
        assert engine == 2 * 8, engine  # the stamps only
        assert d["overlap"]["tasks"] == len(big) and d["overlap"]["bytes"] == sum(op.nbytes for op in big), d
        # (the tiny model's plan, as Qwen3's: the large tasks first, then the norms, then the
        # layers): launched after `after` quantizer launches (push 3: 1), or at the group's end
        # after all of them when there are fewer
        nq = sum(1 for e in log if e[0] == "quant")
        # (the first layers run first, before the large tasks are queued: steps._ordered; the
        # gate is recorded before the first quantizer launch after that)
        run = s.steps.task_order()[0]
        ahead = run.index(big[0].task)
        assert ahead == min(steps.LEAD, len(quant)) and set(run[:ahead]) <= {op.task for op in quant}, run
        k = min(ahead + s.inplace.overlap.after, nq)
        assert nq == len(quant) and log[k] == ("overlap", len(big)), log
        assert [e[0] for e in log[:k] + log[k + 1 :]] == ["quant"] * nq, log  # the others not held back
        _check_trace(s, tags)
        assert any(r["tag"] == OVERLAP_TAG for r in s.engine.trace())
        kinds = s.task_kinds()  # (as the next push runs them: the simulator's and the host fit's kinds)
        assert {t for t, k in kinds.items() if k == "copy"} >= {op.task for op in big}, kinds
    # the in-run host fit (bench_baselines' fitted_s) takes those tasks as copies: no record each
    from wxfer.tools.calibrate_host import host_costs

    fit = host_costs(s, 2)
    assert fit["host_kinds"].get("copy", 0) >= len(big) and fit["host_push_s"] > 0, fit
    # off: the engine's writes again
    monkeypatch.setenv("WXFER_DIRECT_OVERLAP", "0")
    s.inplace.overlap.on = overlap.enabled()
    moved = s.engine.stats()["bytes_written"]
    s.push()
    _check(model, params, 1, "fp8")
    assert s.engine.stats()["bytes_written"] - moved == sum(op.nbytes for op in big) + 2 * 8
    assert "overlap" not in s.stats()["direct"]
    assert all(s.task_kinds()[op.task] == "zero_copy" for op in big)
    _closed(s, recvs)


def test_the_profile_says_how_much_of_the_copies_ran_beside_the_quantizer():
    """benchmarks/bb_profile.py's ``overlap``: unions of the data copies (device-to-device
    memcpys, the copy kernel; not the stamps' host-to-device copies) and of the quantizer, the
    part of the copies beside it and alone, which began first, and the begin stamp's lead."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bb_profile

    def ev(cat, name, ts, dur, tid, **args):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)

    events = [
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 5, 7),
        ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 150, 1000, 8),
        ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 160, 900, 9),
        ev("kernel", "wx_fp8_quant", 500, 2000, 10, grid=[264, 1, 1], **{"registers per thread": 72}),
        ev("kernel", "wx_copy_ranges", 2600, 100, 10),
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2900, 5, 7),
    ]
    o = bb_profile.summarize(events, 0, 3000)["overlap"]
    assert o["quant_ms"] == 2.0 and o["copy_ms"] == 1.1  # [150, 1150) and [2600, 2700)
    assert o["beside_ms"] == 0.65 and abs(o["copy_alone_ms"] - 0.45) < 1e-9
    assert o["first"] == "copy" and o["begin_to_data_ms"] == 0.045
    assert o["copy_streams"] == ["10", "8", "9"] and o["quant_streams"] == ["10"]
    assert o["shapes"]["wx_fp8_quant"] == {"grid": [264, 1, 1], "registers per thread": 72}
    assert "0.65 ms of them beside it" in bb_profile.line("row", bb_profile.summarize(events, 0, 3000))
