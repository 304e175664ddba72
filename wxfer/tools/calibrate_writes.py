"""calibrate's write probes (wxfer.tools.calibrate.measure_links): the engine's writes of a
registered region into a helper process's memory through the placement's transport, timed
as a push makes them (a GPU: many in flight), or one at a time (the CPU)."""

from __future__ import annotations


def _timed(fn, dev, iters: int) -> float:
    from .calibrate import _timed as timed  # (calibrate imports this module)

    return timed(fn, dev, iters)


_TIMEOUT = 60.0  # = wxfer.tools.calibrate._TIMEOUT


def write_rates(eng, region, desc, size: int, dev, quick: bool) -> dict:
    """The engine's writes of `region` to `desc` the way a push makes them: many writes in
    flight at once (one submit, one wait; the transport spreads them over its streams), as a
    push's zero-copy tasks are handed over batch after batch.

    - rate: the slope between `nb` and 2 writes of the whole region in flight (a submit + wait's
      own round trip, which a push pays once, cancels);
    - the write path's own time per write beyond its bytes (``write_dev_s``): the same bytes as
      `nb` writes cut into 8x as many writes of 1/8 the size, the difference per extra write
      (on a GPU each of those is still longer on the device than its posting, so this is the
      device's, not the host's);
    - one write alone, submit to completion (``write_single_GBps``, for comparison), and 256
      writes of 4 KiB in one submit (the cost per write where posting, not the bytes, sets the pace).

    A GPU's figures (the CPU's: _write_rates_serial).  One write at a time (submit, wait, then
    the next) measures each write's round trip (the engine's hand-offs, the progress thread's
    polling) more than the link: on an H200 with the
    receiver on the same GPU, single writes of 64 and 16 MiB gave a slope of 1141 GB/s (one write
    537 GB/s) while the same session's pushes, several copies in flight, wrote at the on-device
    copy rate (2.1 TB/s; benchmarks/README.md, issue 24)."""
    if dev.type != "cuda":
        return _write_rates_serial(eng, region, desc, size, dev, quick)
    iters = 3 if quick else 5
    nb = 8

    def write(dests):
        eng.submit(region, dests, tag=0)
        eng.wait(timeout=_TIMEOUT)

    whole = [(desc, 0, 0, size)]
    t_many = _timed(lambda: write(whole * nb), dev, iters)
    t_two = _timed(lambda: write(whole * 2), dev, iters)
    slope = t_many - t_two
    rate = (nb - 2) * size / slope if slope > 0.05 * t_many else nb * size / t_many
    k, part = 8, size // 8
    cut = [(desc, i * part, i * part, part) for i in range(k)] * nb
    t_cut = _timed(lambda: write(cut), dev, iters)
    per_write = max(0.0, (t_cut - t_many) / (len(cut) - nb))
    t_single = _timed(lambda: write(whole), dev, iters)
    nsmall = 256
    small = [(desc, i * 4096, i * 4096, 4096) for i in range(nsmall)]
    t_small = _timed(lambda: write(small), dev, iters)
    return dict(
        write_GBps=rate / 1e9,
        write_single_GBps=size / t_single / 1e9,
        # (a submit + wait's round trip: t_two less its bytes at the rate)
        write_call_s=max(0.0, (t_small - (t_two - 2 * size / rate) - nsmall * 4096 / rate) / nsmall),
        write_dev_link_s=per_write,
        write_inflight=nb,
        write_s=t_many,
        write_two_s=t_two,
        write_cut_s=t_cut,
        write_cut_n=len(cut),
        write_single_s=t_single,
        write_small_s=t_small,
        write_small_n=nsmall,
    )


def _write_rates_serial(eng, region, desc, size: int, dev, quick: bool) -> dict:
    """The CPU's figures (fabric tcp): one write at a time, the rate from the slope between a
    write of `size` and one of a quarter of it, per write from 256 writes of 4 KiB.  The CPU
    model charges all of a push's bytes at this rate on cores the trainers share (cpu_shared);
    with it tests/test_predict_cpu.py predicted 0.75-1.33 of the measured pushes (2-core VM,
    2026-12-01 20:37 and 21:30 UTC), with the in-flight rate (write_rates on a GPU) 0.54 / 0.50
    (one run, 21:28 UTC, load average about 4)."""
    iters = 3 if quick else 5

    def write(dests):
        eng.submit(region, dests, tag=0)
        eng.wait(timeout=_TIMEOUT)

    t_big = _timed(lambda: write([(desc, 0, 0, size)]), dev, iters)
    t_quarter = _timed(lambda: write([(desc, 0, 0, size // 4)]), dev, iters)
    nsmall = 256
    small = [(desc, i * 4096, i * 4096, 4096) for i in range(nsmall)]
    t_small = _timed(lambda: write(small), dev, iters)
    slope = t_big - t_quarter
    rate = (size - size // 4) / slope if slope > 0.05 * t_big else size / t_big
    return dict(
        write_GBps=rate / 1e9,
        write_single_GBps=size / t_big / 1e9,
        write_call_s=max(0.0, (t_small - (t_big - size / rate) - nsmall * 4096 / rate) / nsmall),
        write_inflight=1,
        write_s=t_big,
        write_quarter_s=t_quarter,
        write_small_s=t_small,
        write_small_n=nsmall,
    )
