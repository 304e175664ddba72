"""The per-push fit (wxfer.runtime.hostfit) on a trace as today's runtime makes it: the begin
stamps an engine fence (the host goes on at once, no data write posted before they landed),
direct tasks as external records (the push's first waits for the begin stamps; each is ready at
its kernel's CUDA event, the end stamps a plain fence after them), the engine's posting stamps
per task.  The fit leaves the external records out of the write path and takes the end of the
side stream's work from their last event."""

import pytest

from wxfer.runtime.hostfit import STAMP_TAG, fit, post_cost, write_extra

US = 1000  # ns


def _rec(tag, sub, post, done, nbytes=1 << 20, nwrites=1, ready=None):
    return dict(
        tag=tag,
        t_submit=sub,
        t_admit=sub,
        t_ready=sub if ready is None else ready,
        t_post_first=post,
        t_post_last=post + 2 * US,
        t_done=done,
        bytes=nbytes,
        nwrites=nwrites,
        held=0,
    )


def _ext(tag, sub, ready, nbytes=1 << 20):
    """An in-place write's record (Engine.submit_external): nothing posted, ready at its event."""
    return dict(_rec(tag, sub, ready, ready, nbytes, ready=ready), kind="external")


def test_the_posting_gap_per_write_and_the_write_paths_time_beyond_the_link():
    # four tasks ready at once, posted 10 us per write (the second has 3 writes), completing in order
    recs = [
        _rec(0, US, 100 * US, 300 * US),
        _rec(1, US, 110 * US, 400 * US, nwrites=3),
        _rec(2, US, 140 * US, 500 * US),
        _rec(3, US, 150 * US, 600 * US),
        _rec(4, 900 * US, 2000 * US, 2100 * US),  # ready after an idle gap: not a posting gap; its own period
    ]
    per, n = post_cost(recs)
    assert n == 3 and per == pytest.approx(50e-6 / 5)  # 50 us over the 5 writes of tasks 0-2
    # periods: [100, 600] us with 4 tasks in 6 writes, [2000, 2100] with 1; 10 us each at 0.1 GB/s
    for r in recs:
        r["bytes"] = 1000
    got, w = write_extra(recs, 0.1)
    assert w == 7 and got == pytest.approx(((500e-6 - 40e-6) + (100e-6 - 10e-6)) / 7)
    got, w = write_extra(recs, 0.1, outside=(1500 * US, 3000 * US))  # the second overlaps it: left out
    assert w == 6 and got == pytest.approx(460e-6 / 6)
    assert write_extra(recs, 1e-6)[0] == 0.0  # a slower link explains it all


def test_fence_stamps_direct_tasks_and_their_wait_are_fitted_back():
    zc, dh, t0 = 5 * US, 40 * US, 10**9
    order = [list(range(10))]
    kinds = {t: ("direct" if 3 <= t < 7 else "zero_copy") for t in range(10)}
    info = {t: (1, 1) for t in range(10)}
    begin = _rec(STAMP_TAG, t0 + 300 * US, t0 + 350 * US, t0 + 800 * US, 8)
    # zero copy 0-2 submitted from t0 + 300 us (one batch), written by t0 + 2 ms
    recs = [begin]
    h = t0 + 300 * US
    for t in range(3):
        h += zc
        recs.append(_rec(t, h, t0 + 800 * US + t * 10 * US, t0 + 1000 * US + t * 500 * US))
    # the first direct task waits until the begin stamps landed (t0 + 800 us; not for the zero-copy
    # writes submitted since: Engine.wait(fence=...)), then 4 direct tasks' host work
    h = t0 + 800 * US + 4 * dh
    for t in range(7, 10):
        h += zc
        recs.append(_rec(t, h, h + 20 * US, h + 100 * US))
    # the in-place writes: ready at their kernels' events, the last at t0 + 8.9 ms
    recs += [_ext(t, t0 + 800 * US + (t - 2) * dh, t0 + (8900 - 100 * (6 - t)) * US) for t in range(3, 7)]
    end = _rec(STAMP_TAG, h + 10 * US, t0 + 9000 * US, t0 + 9100 * US, 8)
    recs.append(end)
    t1 = t0 + 9200 * US
    f = fit([(t0, t1, recs)], order, kinds, info, batch=2, write_GBps=1000.0)  # batches of 2: 4 samples
    assert f["push_begin_s"] == pytest.approx(300e-6) and f["begin_fence_s"] == pytest.approx(500e-6)
    assert f["host_zc_task_s"] == pytest.approx(5e-6, rel=1e-3)
    assert f["host_direct_task_s"] == pytest.approx(40e-6, rel=1e-3)  # the wait is not host work
    assert f["push_end_s"] == pytest.approx(300e-6)  # from the last in-place write's event on
    assert post_cost(recs) == post_cost([r for r in recs if r.get("kind") != "external"])  # not engine writes
    # without direct tasks the column is not fitted and the end is from the last write
    kz = {t: "zero_copy" for t in range(10)}
    g = fit([(t0, t1, [r for r in recs if r["tag"] not in range(3, 7)])], order, kz, info)
    assert "host_direct_task_s" not in g and g["push_end_s"] > 300e-6


def test_direct_tasks_after_the_last_record_are_fitted_from_the_end_stamps_submission():
    """A push whose direct tasks all come after its last zero-copy batch (an FP8 model whose
    only zero-copy tasks are the embeddings, first): their host time is the gap from that
    batch's submission to the end stamps' (no other sample holds a direct task); a push
    where other samples hold every column does not use that gap (the push's own end work)."""
    dh, t0 = 90 * US, 10**9
    order = [list(range(8))]
    kinds = {t: ("zero_copy" if t < 2 else "direct") for t in range(8)}
    info = {t: (1, 1) for t in range(8)}
    begin = _rec(STAMP_TAG, t0 + 300 * US, t0 + 350 * US, t0 + 500 * US, 8)
    recs = [
        begin,
        _rec(0, t0 + 305 * US, t0 + 500 * US, t0 + 900 * US),
        _rec(1, t0 + 310 * US, t0 + 510 * US, t0 + 1000 * US),
    ]
    h = t0 + 500 * US + 6 * dh  # the first direct task waited for the begin stamps (t0 + 500 us)
    ext = [_ext(t, t0 + 500 * US + (t - 1) * dh, t0 + 8900 * US) for t in range(2, 8)]
    end = _rec(STAMP_TAG, h, t0 + 9000 * US, t0 + 9100 * US, 8)
    f = fit([(t0, t0 + 9200 * US, recs + ext + [end])], order, kinds, info, batch=2, write_GBps=1000.0)
    assert f["host_direct_task_s"] == pytest.approx(90e-6, rel=1e-3)
    # zero copy only: the tail holds no task, nothing is added
    kz = {t: "zero_copy" for t in range(2)}
    g = fit([(t0, t0 + 9200 * US, recs + [end])], [[0, 1]], kz, info, batch=2)
    assert g["host_samples"] == 1


def test_a_push_of_direct_tasks_only_is_fitted_from_its_stamps():
    """Every task direct (or copied): the engine wrote only the stamps; the host time of the
    tasks is the gap from the begin stamps' landing (the first direct task waited for it) to
    the end stamps' submission, the end from the last in-place write's event."""
    t0, dh = 10**9, 50 * US
    order = [list(range(5))]
    kinds = {t: "direct" for t in range(5)}
    info = {t: (1, 1) for t in range(5)}
    begin = _rec(STAMP_TAG, t0 + 200 * US, t0 + 250 * US, t0 + 400 * US, 8)
    ext = [_ext(t, t0 + 400 * US + (t + 1) * dh, t0 + (1500 + 100 * t) * US) for t in range(5)]
    end = _rec(STAMP_TAG, t0 + 400 * US + 5 * dh, t0 + 2000 * US, t0 + 2100 * US, 8)
    f = fit([(t0, t0 + 2200 * US, [begin, *ext, end])], order, kinds, info)
    assert f["host_direct_task_s"] == pytest.approx(50e-6, rel=1e-3)
    assert f["push_begin_s"] == pytest.approx(200e-6) and f["begin_fence_s"] == pytest.approx(200e-6)
    assert f["push_end_s"] == pytest.approx(300e-6)  # from the last in-place write's event (t0 + 1.9 ms)
