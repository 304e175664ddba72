"""The per-push figures fitted on a Sender's trace (wxfer.runtime.hostfit): a synthetic trace
made the way the push loop makes one (prepared zero-copy batches, packed tasks admitted
under the watermark, collective-only tasks without a record, the stamps, writes queued
behind each other) with known costs is fitted back."""

import numpy as np
import pytest

from wxfer.runtime.hostfit import STAMP_TAG, fit, nnls, write_cost

US = 1000  # ns
COST = dict(
    host_task_s=100e-6,
    host_param_s=30e-6,
    host_piece_s=7e-6,
    host_zc_task_s=5e-6,
    host_zc_batch_s=20e-6,
    barrier_s=250e-6,
)


def _program(seed=0, groups=2, n=150):
    """order (tags per group), kinds, info (parameters, pieces) of a rank's program."""
    rng = np.random.default_rng(seed)
    order, kinds, info, tag = [], {}, {}, 0
    for _ in range(groups):
        tags = []
        for _ in range(n):
            u = rng.random()
            kinds[tag] = "zero_copy" if u < 0.7 else ("packed" if u < 0.93 else "collective_only")
            info[tag] = (int(rng.integers(1, 12)), int(rng.integers(1, 40)))
            tags.append(tag)
            tag += 1
        order.append(tags)
    return order, kinds, info


class _Engine:
    """Writes in submission order, each after the previous one (bytes / rate + per write), and
    the watermark: a held buffer is admitted when nothing is held or it fits."""

    def __init__(self, watermark, write_GBps, call_s):
        self.wm, self.rate, self.call_s = watermark, write_GBps * 1e9, call_s
        self.done, self.held = 0, []  # [(t_done, bytes)]

    def admit(self, t, nbytes):
        for td, _ in sorted(self.held) + [(None, 0)]:
            live = sum(b for d, b in self.held if d > t)
            if live == 0 or live + nbytes <= self.wm:
                return t
            t = max(t, td + 2 * US)  # woken by that release
        return t

    def submit(self, r, nwrites):
        # the link and the posting overlap: a task takes its bytes at the rate or its writes' posting
        step = max(r["bytes"] / self.rate, nwrites * self.call_s)
        self.done = max(self.done, r["t_submit"]) + int(round(step * 1e9))
        r.update(t_ready=r["t_submit"], t_done=self.done, nwrites=nwrites)
        if r["held"]:
            self.held.append((self.done, r["held"]))


def _push(order, kinds, info, t0, c=COST, batch=32, watermark=12 << 20, write_GBps=10.0, call_s=3e-6):
    """(t0, t1, records) of one push as the runtime would trace it with costs `c`."""
    from wxfer.zerocopy import batches

    ns = lambda s: int(round(s * 1e9))  # noqa: E731
    eng = _Engine(watermark, write_GBps, call_s)
    recs = []
    begin = dict(tag=STAMP_TAG, t_submit=t0 + 300 * US, t_admit=t0 + 300 * US, bytes=8, held=0)
    eng.submit(begin, 1)
    begin["t_done"] = t0 + 500 * US
    recs.append(begin)
    now, carry = begin["t_done"], 0
    eng.done = now
    for g, tags in enumerate(order):
        if g:
            carry += ns(c["barrier_s"])
        ks = [kinds[t] for t in tags]
        ends = {a + n - 1: (a, n) for a, n in batches(ks, batch)}
        for i, t in enumerate(tags):
            p, q = info[t]
            if ks[i] == "zero_copy":
                if i in ends:
                    a, n = ends[i]
                    last = now + carry + ns(n * c["host_zc_task_s"] + c["host_zc_batch_s"])
                    for k in range(n):  # the native submissions, ~1 us apart
                        ts = last - (n - 1 - k) * US
                        recs.append(dict(tag=tags[a + k], t_submit=ts, t_admit=ts, bytes=4096, held=0))
                        eng.submit(recs[-1], 1 + tags[a + k] % 3)
                    now, carry = last, 0
                continue
            if ks[i] == "collective_only":
                carry += ns(c["host_task_s"] + p * c["host_param_s"])
                continue
            pre = 10 * US  # the loop's own work before Engine.reserve
            adm = eng.admit(now + carry + pre, 4 << 20)
            sub = adm + ns(c["host_task_s"] + p * c["host_param_s"] + q * c["host_piece_s"]) - pre
            recs.append(dict(tag=t, t_submit=sub, t_admit=adm, bytes=4 << 20, held=4 << 20))
            eng.submit(recs[-1], 1 + t % 3)
            now, carry = sub, 0
    done = eng.done
    end = dict(tag=STAMP_TAG, t_submit=done + 100 * US, t_admit=done + 100 * US, t_ready=done + 100 * US)
    end.update(t_done=done + 200 * US, bytes=8, nwrites=1, held=0)
    recs.append(end)
    return t0, done + 450 * US, recs


def test_a_synthetic_trace_is_fitted_back():
    order, kinds, info = _program()
    pushes = [_push(order, kinds, info, t0=k * 10**9) for k in range(3)]
    f = fit(pushes, order, kinds, info, write_GBps=10.0)
    for k, v in COST.items():
        # within 5%: a task that waited for the watermark is sampled from its admission (its own
        # few microseconds before Engine.reserve are lost there)
        assert f[k] == pytest.approx(v, rel=0.05, abs=0.3e-6), k
    assert f["push_begin_s"] == pytest.approx(500e-6) and f["push_end_s"] == pytest.approx(450e-6)
    assert f["write_call_s"] == pytest.approx(3e-6, rel=0.05)
    from wxfer.zerocopy import batches

    nb = sum(len(batches([kinds[t] for t in g])) for g in order)
    assert f["host_batches"] == 3 * nb


def test_the_watermark_wait_is_not_booked_as_host_work():
    order, kinds, info = _program(seed=1, groups=1)
    slow = [_push(order, kinds, info, 0, watermark=4 << 20, write_GBps=1.0)]  # one buffer at a time
    recs = sorted(slow[0][2][1:-1], key=lambda r: r["t_submit"])
    gaps = [(b["t_submit"] - a["t_submit"]) / 1e9 for a, b in zip(recs, recs[1:]) if b["held"]]
    assert np.mean(gaps) > 3 * (COST["host_task_s"] + 6 * COST["host_param_s"] + 20 * COST["host_piece_s"])
    f = fit(slow, order, kinds, info)
    # within 10%: every packed task waited, and is sampled from its admission (the loop's own
    # 10 us before Engine.reserve are lost)
    assert f["host_task_s"] == pytest.approx(COST["host_task_s"], rel=0.1)
    assert f["host_param_s"] == pytest.approx(COST["host_param_s"], rel=0.1)


def test_other_costs_fit_back_too_and_a_missing_record_is_named():
    order, kinds, info = _program(seed=2, groups=1)
    c = dict(COST, host_zc_task_s=1e-6, host_zc_batch_s=200e-6, host_piece_s=0.0)
    f = fit([_push(order, kinds, info, 0, c=c)], order, kinds, info)
    assert f["host_zc_batch_s"] == pytest.approx(200e-6, rel=0.02)
    assert f["host_zc_task_s"] == pytest.approx(1e-6, abs=0.3e-6)
    assert f["host_piece_s"] == pytest.approx(0.0, abs=0.3e-6)
    t0, t1, recs = _push(order, kinds, info, 0)
    zc = next(t for t in order[0] if kinds[t] == "zero_copy")
    with pytest.raises(ValueError, match="zero-copy task"):
        fit([(t0, t1, [r for r in recs if r["tag"] != zc])], order, kinds, info)
    with pytest.raises(RuntimeError, match="no task"):
        fit([(t0, t1, [r for r in recs if r["tag"] == STAMP_TAG])], order, kinds, info)


def test_write_cost_uses_only_writes_that_queued_and_were_paced_by_posting():
    recs = [
        dict(tag=1, t_ready=0, t_done=1000 * US, bytes=10**6, nwrites=1),
        # ready before 1 completed, 1 MB at 1 GB/s (1 ms): the link set its pace
        dict(tag=2, t_ready=10 * US, t_done=2000 * US, bytes=10**6, nwrites=2),
        # ready before 2 completed, 1 KB in 4 writes over 200 us: posting set its pace
        dict(tag=4, t_ready=20 * US, t_done=2200 * US, bytes=1000, nwrites=4),
        # ready long after: the gap is idle time, not write cost
        dict(tag=3, t_ready=9000 * US, t_done=10000 * US, bytes=1000, nwrites=1),
    ]
    c, n = write_cost(recs, 1.0)
    assert n == 1 and c == pytest.approx(50e-6)
    assert write_cost(recs[:2], 1.0) == (0.0, 0)


def test_nnls_drops_negative_columns():
    A = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nnls(A, [3.0, 2.0, 1.0]).tolist() == pytest.approx([2.0, 0.0])  # slope -1: dropped
    assert nnls(A, A @ [1.0, 2.0]).tolist() == pytest.approx([1.0, 2.0])


def test_device_times_of_packed_tasks_on_one_stream():
    from wxfer.runtime.hostfit import device_times

    # three packed tasks: 2 ms, queued behind it 3 ms, then after an idle gap 1 ms; 1 GB each
    recs = [
        dict(tag=1, t_admit=50 * US, t_submit=100 * US, t_ready=2050 * US),
        dict(tag=2, t_admit=200 * US, t_submit=300 * US, t_ready=5050 * US),
        dict(tag=3, t_admit=9000 * US, t_submit=9100 * US, t_ready=10000 * US),
        dict(tag=STAMP_TAG, t_admit=0, t_submit=0, t_ready=99 * US),
    ]
    d = device_times([(0, 0, recs)], {1, 2, 3}, {1: 10**9, 2: 10**9, 3: 10**9}, {1: True, 2: True, 3: False})
    assert d["fp8"]["tasks"] == 2 and d["fp8"]["seconds"] == pytest.approx(5e-3)
    assert d["fp8"]["GBps"] == pytest.approx(2e9 / 5e-3 / 1e9)
    assert d["raw"]["seconds"] == pytest.approx(1e-3)


def test_the_write_path_is_fitted_from_queued_completions():
    from wxfer.runtime.hostfit import write_path

    order, kinds, info = _program(seed=3, groups=1)
    _, _, recs = _push(order, kinds, info, 0, write_GBps=2.5, call_s=40e-6)
    rate, per, n = write_path(recs)
    assert n > 50 and rate == pytest.approx(2.5e9, rel=0.02) and per == pytest.approx(40e-6, rel=0.05)
    assert write_path(recs[:1]) == (None, 0.0, 0)
