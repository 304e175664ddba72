"""The simulator's per-push figures fitted on the engine trace of a Sender's own pushes.

What the push loop does on the host (wxfer.runtime.sender / tasks), and so what a trace of
it shows: the restart check and the begin stamps' submission (an engine fence task: the host
goes on at once, the engine posts no data write before they landed), then for each mesh
group, the rank's tasks in order:

- zero-copy tasks are collected (a check of each parameter's memory) and handed to the
  engine by one ``Engine.submit_prepared`` call per batch (``ZERO_COPY_BATCH`` tasks, or fewer
  where a task of another kind or the group's end comes first): in the trace the batch's
  tasks carry submission stamps microseconds apart, and the host time of the whole batch is
  the gap from the previous submission to its last task's;
- a packed (or staged) task is admitted under the watermark (``Engine.reserve``: ``t_admit``,
  after any wait for buffers to be released: then just after a held buffer's last write
  landed, and only its preparation is sampled), prepared (gathers, H2D, packing issued:
  ``t_admit`` .. ``t_submit``) and submitted;
- a direct task (wxfer.runtime.inplace) has no record: its kernel writes the receivers; at the
  push's first one the host waited until the begin stamps landed (that fence task alone;
  batched copies wait at their first launch, after 128 ranges or 256 MiB: by then the stamps
  have mostly landed, and what is left of that wait is booked as host work);
- a copy task (a small zero-copy task copied into the receivers' mapped memory by batched
  copy kernels, wxfer.runtime.inplace.InPlaceWriter.queue_copy) has no record either: its host time falls
  into the next record's gap (with what is left of the wait at the first launch, above), and
  it does not cut the zero-copy batch it lies in (the Sender queues it and goes on);
- a task this rank only joins the collective of has no record: its host time falls into the
  next record's gap;
then the end stamps (a fence after the side stream's event: after the last direct kernel),
the engine wait, the group barrier.

``fit(pushes, order, kinds, info)`` fits, by non-negative least squares over one sample
per batch and per packed task: host seconds per packed task, per parameter, per piece, per
zero-copy task and per batch, per direct task, per copy task (and per mesh group after the
first); the
per-push costs before the first task, until the begin stamps landed and after the last data
landed; and, given the link's rate, the engine's posting gap per write and the write path's
time per write beyond the link (``post_cost``, ``write_extra``).  Pure Python + numpy: tests
feed it synthetic traces with known costs.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..zerocopy import ZERO_COPY_BATCH, batch_ends

STAMP_TAG = 1 << 62  # = wxfer.runtime.tasks.STAMP_TAG (no import: that module needs the extension)
COLUMNS = (
    "host_task_s",
    "host_param_s",
    "host_piece_s",
    "host_zc_task_s",
    "host_zc_batch_s",
    "barrier_s",
    "host_direct_task_s",
    "host_copy_task_s",
)
# the host costs per task, parameter, piece and zero-copy batch (the fit's columns but the barrier)
HOST_COSTS = tuple(c for c in COLUMNS if c != "barrier_s")
_OWN = {"direct": 6, "copy": 7}  # tasks without a record, written by the rank's kernels: their column


def nnls(rows, ys) -> np.ndarray:
    """Non-negative least squares by elimination: columns with a negative coefficient are
    dropped and the rest refitted.  Returns one coefficient per column."""
    A = np.asarray(rows, float)
    y = np.asarray(ys, float)
    keep = [i for i in range(A.shape[1]) if A[:, i].any()]
    while keep:
        coef, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(A.shape[1])
            out[keep] = coef
            return out
        keep.pop(int(np.argmin(coef)))
    return np.zeros(A.shape[1])


WAKE_NS = 100_000  # an admission this soon after a buffer's release was waiting for it


def _waited(r, prev: int, releases) -> bool:
    """Whether the packed task of record r waited in Engine.reserve for the watermark: it was
    admitted just after a held buffer was released (a task's last write landed), a release that
    came after the host had finished the previous task."""
    i = bisect.bisect_right(releases, r["t_admit"])
    return i > 0 and releases[i - 1] >= max(prev, r["t_admit"] - WAKE_NS)


def _samples(
    recs: dict, prev: int, order, kinds, info, batch: int, work: dict, begin_done: int = 0, sizes=None, end=None
) -> tuple:
    """(host samples [(features, seconds)] of one push, when the wait at its first direct or
    copy task ended (ns; None: it has none)); prev: when the host started its first task (ns).
    A packed task that waited for the watermark is sampled from its admission on (t_admit ..
    t_submit: its preparation), without what came before it.  Direct and copy tasks have no
    record: their host time is in the next record's gap, from the end of the wait at the push's
    first one (the begin stamps, `begin_done`, landed: the Sender waits for that fence alone).
    sizes: tag -> bytes (the zero-copy batches are also cut by their bytes, as the Sender cuts
    them; None: by count only).  end: when the end stamps were submitted (ns): the host time of
    the tasks after the last record (direct and copy tasks at the push's end) is in that gap."""
    releases = sorted(r["t_done"] for r in recs.values() if r.get("held"))
    out = []
    ncol = len(COLUMNS)
    carry = np.zeros(ncol)  # collective-only, direct and copy tasks: their host time is in the next gap
    waited = None
    seen = hidden = 0  # zero-copy tasks of the open batch so far; of those, done before the wait ended
    for g, tags in enumerate(order):
        if g:
            carry[5] += 1
        ks = [kinds.get(t, "packed") for t in tags]
        ends = batch_ends(ks, batch, None if sizes is None else [sizes.get(t, 0) for t in tags])
        for i, t in enumerate(tags):
            r = recs.get(t)
            if ks[i] in _OWN:  # no record: written by the rank's kernels (wxfer.runtime.inplace)
                if waited is None and ks[i] == "direct":  # the push's first: the host waited for the begin stamps
                    waited = max(prev, begin_done)  # the begin stamps alone (Engine.wait(fence=...))
                    # the open batch's zero-copy tasks so far were done during the wait, when it waited
                    hidden = seen if waited > prev else 0
                    prev = waited
                carry[_OWN[ks[i]]] += 1
            elif ks[i] == "zero_copy":
                seen += 1
            else:
                nparams, pieces = info[t]
                one = np.zeros(ncol)
                one[:3] = (1.0, nparams, pieces)
                if r is None:  # collective only
                    carry[:2] += (1.0, nparams)
                    continue
                f = carry + one
                y = (r["t_submit"] - prev) / 1e9 - work.get(t, 0.0)
                if r["t_admit"] and prev <= r["t_admit"] <= r["t_submit"] and _waited(r, prev, releases):
                    f = one
                    y = (r["t_submit"] - r["t_admit"]) / 1e9 - work.get(t, 0.0)
                out.append((f, y))
                prev, carry = r["t_submit"], np.zeros(ncol)
            if i in ends:  # a zero-copy batch handed to the engine here (after any copy tasks in it)
                n, last = ends[i]
                rz = recs.get(tags[last])
                if rz is None:
                    raise ValueError(
                        f"hostfit: zero-copy task {tags[last]} (the last of its batch) has no trace record"
                    )
                f = carry.copy()
                f[3] += n - hidden
                f[4] += 1
                seen = hidden = 0
                out.append((f, (rz["t_submit"] - prev) / 1e9))
                prev, carry = rz["t_submit"], np.zeros(ncol)
    if end is not None and carry[[0, 6, 7]].any() and end > prev:  # tasks after the last record
        out.append((carry, (end - prev) / 1e9, "tail"))
    return out, waited


def _writes(records) -> list:
    """The records of the engine's own writes: not the in-place writes (kind "external", a
    kernel's or a batched copy's CUDA event: no write posted), which the fit counts as the
    side stream's work between the stamps (``_design``'s windows)."""
    return [r for r in records if r.get("kind", "write") != "external"]


def _queued(records) -> list:
    """[(gap s, bytes, writes)] of the tasks whose writes queued behind the previous task's
    (ready before it completed): the time from the previous completion to theirs."""
    recs = [r for r in _writes(records) if r["tag"] != STAMP_TAG and r.get("nwrites")]
    recs.sort(key=lambda r: r["t_done"])
    return [
        ((b["t_done"] - a["t_done"]) / 1e9, float(b["bytes"]), float(b["nwrites"]))
        for a, b in zip(recs, recs[1:])
        if b["t_ready"] and b["t_ready"] <= a["t_done"]
    ]


def _post_cost(q, rate: float) -> tuple:
    """(seconds per write, samples) from the queued tasks that took longer than their bytes at
    `rate` (posting, not the link, set their pace): their time per write.  The simulator posts
    a rank's writes one after the other at that cost while the link moves earlier ones."""
    slow = [(g, w) for g, b, w in q if g > 1.1 * b / rate]
    if not slow:
        return 0.0, 0
    return sum(g for g, _ in slow) / sum(w for _, w in slow), len(slow)


def write_cost(records, write_GBps: float) -> tuple:
    """(seconds per write, samples) of the write path at the rate `write_GBps`, from the
    completions of tasks whose writes queued behind the previous task's (see _post_cost)."""
    return _post_cost(_queued(records), write_GBps * 1e9)


def write_path(records) -> tuple:
    """(bytes/s, seconds per write, samples) of the write path from the queued completions:
    the rate over the largest quarter of them (by bytes), then the cost per write as write_cost
    (rate None when nothing queued)."""
    q = _queued(records)
    if not q:
        return None, 0.0, 0
    big = sorted(q, key=lambda x: x[1])[(3 * len(q)) // 4 :]
    t = sum(g for g, _, _ in big)
    if t <= 0:
        return None, 0.0, len(q)
    rate = sum(b for _, b, _ in big) / t
    per, _ = _post_cost(q, rate)
    return rate, per, len(q)


def _posted(records) -> list:
    """The data records with their posting stamps, in the order the engine posted them."""
    recs = [r for r in _writes(records) if r["tag"] != STAMP_TAG and r.get("t_post_first") and r.get("t_done")]
    return sorted(recs, key=lambda r: r["t_post_first"])


def post_cost(records) -> tuple:
    """(seconds per write, samples) of the engine's posting: the gap from a task's first write
    posted to the next task's, per write of the first, where the next one was ready before the
    first's last write was posted (the engine went from one to the other without waiting).  The
    mean over those gaps: a stall of the poster (the transport's in-flight cap) counts in it."""
    recs = _posted(records)
    gaps = [
        ((b["t_post_first"] - a["t_post_first"]) / 1e9, float(a.get("nwrites") or 1))
        for a, b in zip(recs, recs[1:])
        if b.get("t_ready") and b["t_ready"] <= a.get("t_post_last", a["t_post_first"])
    ]
    if not gaps:
        return 0.0, 0
    return sum(g for g, _ in gaps) / sum(w for _, w in gaps), len(gaps)


def _periods(records, outside=None) -> list:
    """[(seconds, bytes, writes)] of the write path's busy periods: from a task's first write
    posted to the last completion, while each next task was posted before the latest
    completion so far (the writes complete in the order they were posted).  outside: (lo, hi)
    ns, leave out the periods that overlap it."""
    spans, cur = [], None
    for r in _posted(records):
        w = float(r.get("nwrites") or 1)
        if cur is not None and r["t_post_first"] <= cur[1]:
            cur = [cur[0], max(cur[1], r["t_done"]), cur[2] + r["bytes"], cur[3] + w]
            continue
        if cur is not None:
            spans.append(cur)
        cur = [r["t_post_first"], r["t_done"], r["bytes"], w]
    if cur is not None:
        spans.append(cur)
    if outside is not None:
        spans = [c for c in spans if c[1] <= outside[0] or c[0] >= outside[1]]
    return [((b - a) / 1e9, float(nb), w) for a, b, nb, w in spans]


def write_extra(records, write_GBps: float, outside=None) -> tuple:
    """(seconds per write, writes) the write path takes beyond its bytes at `write_GBps` (the
    link's rate, measured apart): over its busy periods (outside the span `outside`, ns, where
    the push's direct kernels share the GPU: that sharing is a term of its own), their time
    less their bytes at that rate, per write (0 when the link's rate explains it all)."""
    ps = _periods(records, outside) or _periods(records)
    n = sum(w for _, _, w in ps)
    if not n:
        return 0.0, 0
    extra = sum(t for t, _, _ in ps) - sum(b for _, b, _ in ps) / (write_GBps * 1e9)
    return max(0.0, extra) / n, int(n)


def _begin(stamps, first: int, t0: int, fence: bool = False) -> tuple:
    """(when the host started the tasks, when the begin stamps landed) of one push: the begin
    stamps are a fence task (the host goes on at once; no data write is posted before they
    landed), or, older runtimes, waited for (landed before the first task was submitted);
    fence: known to be a fence (a runtime with copy tasks), however late the first submission."""
    if not stamps:
        return t0, t0
    b = stamps[0]
    if not fence and b.get("t_done") and b["t_done"] <= first:
        return b["t_done"], b["t_done"]
    return b["t_submit"], b.get("t_done") or b["t_submit"]


def _without_needless_tails(samples) -> list:
    """[(features, seconds)]: the samples, each push's tail (its tasks after the last record,
    up to the end stamps' submission, which also holds the push's own end work) kept only
    where it holds tasks of a column no other sample has (else it would bias the fit by that
    end work): e.g. a push whose direct tasks all come after its last zero-copy batch."""
    body = [s[:2] for s in samples if len(s) == 2]
    seen = np.zeros(len(COLUMNS), bool)
    for f, _ in body:
        seen |= np.asarray(f) > 0
    return body + [s[:2] for s in samples if len(s) == 3 and ((np.asarray(s[0]) > 0) & ~seen).any()]


def fit(
    pushes, order, kinds: dict, info: dict, batch: int = ZERO_COPY_BATCH, work=None, write_GBps=None, sizes=None
) -> dict:
    """Fit the push's host and fixed costs on traced pushes of one Sender (fit_designs with
    one design).

    pushes: [(t0 ns, t1 ns, records)]: when push() was called and returned, and the engine's
    trace of it (stamp records included); order: this rank's task tags per mesh group, in
    program order; kinds: tag -> kind (Sender.task_kinds()); info: tag -> (parameters,
    pieces); work: tag -> seconds of work done on the host itself (CPU packing) to take out;
    write_GBps: the write rate, to fit the costs per write (None: not fitted); sizes: tag ->
    the task's bytes (the zero-copy batches are cut by bytes too, as the Sender cuts them).

    push_begin_s: t0 to the host's first task (after the begin stamps' submission);
    begin_fence_s: from then until the begin stamps landed (no data write is posted before);
    push_end_s: from the last data landed (the last write's completion, or, with direct tasks,
    the last in-place write's CUDA event: the side stream's last kernel) to t1."""
    d = dict(pushes=pushes, order=order, kinds=kinds, info=info, work=work, sizes=sizes)
    return fit_designs([d], batch, write_GBps)


def _design(d: dict, batch: int) -> tuple:
    """(samples, begin, fence, end, windows, per-push records) of one design's pushes."""
    pushes, order, kinds, info = d["pushes"], d["order"], d["kinds"], d["info"]
    work, sizes = d.get("work") or {}, d.get("sizes")
    samples, begin, fence, end, recs = [], [], [], [], []
    windows: dict = {}  # push index -> (lo, hi) ns: where its direct kernels and copies ran
    direct = any(k in _OWN for k in kinds.values())  # kernels on the side stream write the receivers
    copies = any(k == "copy" for k in kinds.values())  # (a runtime whose begin stamps are a fence)
    for i, (t0, t1, records) in enumerate(pushes):
        recs.append(records)
        inplace = [r["t_ready"] for r in records if r.get("kind") == "external" and r.get("t_ready")]
        records = _writes(records)
        data = {r["tag"]: r for r in records if r["tag"] != STAMP_TAG}
        stamps = sorted((r for r in records if r["tag"] == STAMP_TAG), key=lambda r: r["t_submit"])
        if not data and not (direct and len(stamps) > 1):
            continue  # (every task direct or copied: only the stamps were traced, and the tail says it all)
        first = min(r["t_submit"] for r in data.values()) if data else stamps[-1]["t_submit"]
        start, landed = _begin(stamps, first, t0, copies or not data)
        begin.append((start - t0) / 1e9)
        fence.append((landed - start) / 1e9)
        last = max([r["t_done"] for r in data.values()] + [landed])
        tail = stamps[-1]["t_submit"] if len(stamps) > 1 else None  # the end stamps' submission
        got, waited = _samples(data, start, order, kinds, info, batch, work, landed, sizes, tail)
        samples += got
        if direct and inplace:
            last = max(last, max(inplace))
            # the kernels ran from the wait for the begin stamps to the last in-place write's event
            windows[len(recs) - 1] = (waited if waited is not None else landed, max(inplace))
        end.append((t1 - last) / 1e9)
    return samples, begin, fence, end, windows, recs


def conditioning(rows) -> dict:
    """How well the samples separate the columns they use: the condition number of the
    design matrix with each used column scaled to unit norm (1: orthogonal columns; ~1e3 and
    up: some columns are nearly collinear, their split is not determined by the samples), and
    the samples per column."""
    A = np.asarray(rows, float)
    used = [i for i in range(A.shape[1]) if A[:, i].any()]
    if not used:
        return dict(condition=None, samples={})
    B = A[:, used] / np.linalg.norm(A[:, used], axis=0)
    sv = np.linalg.svd(B, compute_uv=False)
    cond = float(sv[0] / sv[-1]) if len(sv) == len(used) and sv[-1] > 0 else float("inf")
    return dict(condition=cond, samples={COLUMNS[i]: int((A[:, i] > 0).sum()) for i in used})


def fit_designs(designs: list, batch: int = ZERO_COPY_BATCH, write_GBps=None) -> dict:
    """Fit the host and per-push costs on the traced pushes of several Senders at once (a
    probe design each: different task kinds, parameters per task, pieces per task, so that
    the columns separate), one non-negative least squares over all their samples.  designs:
    [dict(pushes, order, kinds, info, work=None, sizes=None)] as fit()'s arguments.

    A column that no sample holds is not measured: it is left out of the result (not 0) and
    named in ``host_unmeasured`` with the reason; ``host_conditioning`` says how well the
    samples separate the columns they hold (wxfer.runtime.hostfit.conditioning)."""
    samples, begin, fence, end, recs, wins = [], [], [], [], [], {}
    kinds_all: set = set()
    for d in designs:
        s, b, f, e, w, rs = _design(d, batch)
        samples += s
        begin += b
        fence += f
        end += e
        wins.update({len(recs) + k: v for k, v in w.items()})
        recs += rs
        kinds_all |= set(d["kinds"].values())
    samples = _without_needless_tails(samples)
    if not samples:
        raise RuntimeError("hostfit: the pushes traced no task of this rank")
    ys = np.array([y for _, y in samples])
    rows = [f for f, _ in samples]
    coef = nnls(rows, np.maximum(ys, 0.0))
    held = np.asarray(rows, float).any(axis=0)
    out: dict = {k: float(v) for k, v, h in zip(COLUMNS, coef, held) if h}
    unmeasured = {}
    for i, k in enumerate(COLUMNS):
        if held[i]:
            continue
        kind = {3: "zero_copy", 4: "zero_copy", 6: "direct", 7: "copy"}.get(i, "packed")
        if i == 5:
            unmeasured[k] = "every traced push had one mesh group (no barrier between groups)"
        elif kind not in kinds_all and not (kind == "packed" and kinds_all & {"staged", "collective_only"}):
            unmeasured[k] = f"no {kind} task in the traced pushes"
        else:
            unmeasured[k] = f"no sample holds it (the {kind} tasks traced left no record of their own)"
    for k, col in _OWN.items():  # fitted only where the Sender had such tasks
        if k not in kinds_all:
            out.pop(COLUMNS[col], None)
    out.update(
        push_begin_s=float(np.median(begin)),
        begin_fence_s=float(np.median(fence)),
        push_end_s=float(np.median(end)),
        host_samples=len(samples),
        host_pushes=len(begin),
        host_batches=int(sum(1 for f, _ in samples if f[4])),
        host_unmeasured=unmeasured,
        host_conditioning=conditioning(rows),
    )
    flat = [r for rs in recs for r in rs]
    rate, per, n = write_path(flat)
    out.update(trace_write_GBps=None if rate is None else rate / 1e9, trace_write_call_s=per)
    ps = _periods(flat)
    if ps:  # the rate the writes moved at over their busy periods (a check beside the link's bound)
        out["trace_busy_GBps"] = sum(b for _, b, _ in ps) / max(sum(t for t, _, _ in ps), 1e-12) / 1e9
    if write_GBps:
        if _posted(flat):  # the engine's posting stamps: the posting gap, and the time beyond the link's
            out["write_call_s"], out["write_samples"] = post_cost(flat)
            extra, writes = 0.0, 0
            for i, rs in enumerate(recs):
                p, k = write_extra(rs, write_GBps, wins.get(i))
                extra += p * k
                writes += k
            out["write_dev_s"] = extra / max(writes, 1)
        else:
            out["write_call_s"], out["write_samples"] = write_cost(flat, write_GBps)
    return out


def device_times(pushes, tags: set, moved: dict, fp8: dict) -> dict:
    """The device time of the tasks `tags` (packed or staged: they wait for their own CUDA
    event) from the traces: each task's stream work ends at its t_ready and starts at the later
    of its admission (before the host issued any of it) and the previous such task's t_ready
    (one stream).  Returns per class (fp8: a task with FP8 shards, raw: the others) tasks,
    seconds and GB/s of `moved` bytes (sources read + buffer written, as the simulator counts
    them): the device's rate where the stream was busy, lower where the host issued late or
    the engine saw the event late."""
    acc = {"fp8": [0, 0.0, 0.0], "raw": [0, 0.0, 0.0]}
    for _, _, records in pushes:
        prev = 0
        for r in sorted((r for r in _writes(records) if r["tag"] in tags), key=lambda r: r["t_submit"]):
            if not r.get("t_ready"):
                continue
            d = max(0, r["t_ready"] - max(r["t_admit"] or r["t_submit"], prev)) / 1e9
            a = acc["fp8" if fp8.get(r["tag"]) else "raw"]
            a[0] += 1
            a[1] += d
            a[2] += moved.get(r["tag"], 0)
            prev = r["t_ready"]
    return {k: dict(tasks=n, seconds=s, GBps=(b / s / 1e9) if s > 0 else None) for k, (n, s, b) in acc.items() if n}
