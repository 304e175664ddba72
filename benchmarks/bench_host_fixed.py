"""The fixed host cost of a push before its first write (issue 26), on CPU (no GPU needed).

One trainer (this process, world 1) and `--workers` inference workers (Receivers in threads
of this process: same host, same pid namespace, so their pid checks run, and their leases
are real store counters) over fabric (tcp by default), a TINY BF16 model (every task zero
copy).  Two passes of `--pushes` pushes each, `--gap-ms` apart (a training step's stand-in,
so that nothing rests on pushes following each other at once):

* ``phases``: ``Sender.last_phases`` as push() records it, unwrapped: ``rejoin_check`` (the
  restart check, the liveness checks, fail_dead), ``begin_stamps`` (then the begin stamps'
  fence submitted), both from the start of the push.
* ``parts``: the same pushes with each part of the check wrapped and timed: the store round
  trip of the counters, the pid checks at the start and at the end of a push, the lease
  check, fail_dead, the begin stamps' submission, and ``first_submit`` (the push's start to
  the first data task handed to the engine).  The wrappers add about 1 us each.

Beside them, in the same run, the bounds: one bare store round trip (``Control.add(k, 0)``),
``Control.counters`` of one key, one /proc/<pid>/stat read (``liveness.proc_start``) and one poll(2) of a pidfd, back
to back and each after a gap.  Median and p90 of each, in microseconds.

    python benchmarks/bench_host_fixed.py [--workers 2] [--pushes 300] [--gap-ms 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (collaborator, method) timed in the `parts` pass when the code has it; the names before and
# after issue 26's cut, so that one command measures both trees
PARTS = [
    ("links", "_check_pids"),
    ("links", "_check_leases"),
    ("links", "fail_dead"),
    ("links", "_poll_pids"),
    ("runner", "write_begin"),
]
TWICE = {"store_counters", "_check_pids", "_poll_pids"}  # called at a push's start and end: timed apart


def _stats(xs: list) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return dict(
        n=len(s),
        median_us=round(statistics.median(s) * 1e6, 2),
        p90_us=round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e6, 2),
    )


def _setup(workers: int, provider: str, timeout: float):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from wxfer.models import TINY, inference_params, preset_for, train_model
    from wxfer.runtime import control
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender
    from wxfer.testing import in_thread, joined

    port = control.free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    addr = "127.0.0.1:%d" % port
    opts = {"provider": provider}
    ths = [
        in_thread(
            Receiver,
            inference_params(TINY, 1, 0, None),
            mapping=preset_for(TINY).name,
            store=addr,
            replica=q,
            rank=0,
            tp=1,
            replicas=workers,
            name="fixed",
            timeout=timeout,
            transport="fabric",
            transport_options=opts,
        )
        for q in range(workers)
    ]
    model = train_model(TINY).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name="fixed", timeout=timeout)
    return store, sender, joined(ths, timeout)


def _pushes(sender, n: int, gap: float, on_push=None, fence=None) -> dict:
    """n pushes, `gap` seconds apart; last_phases' rejoin_check and begin_stamps of each
    (and into `fence`, a dict, _fence_times of each push's engine trace)."""
    out = {"rejoin_check": [], "begin_stamps": []}
    sender.trace(clear=True)
    for _ in range(n):
        time.sleep(gap)
        sender.push()
        for k in out:
            out[k].append(sender.last_phases[k])
        if fence is not None:
            for k, v in _fence_times(sender.trace(clear=True)).items():
                fence.setdefault(k, []).append(v)
        if on_push is not None:
            on_push()
    return out


def _fence_times(recs) -> dict:
    """The begin and end stamps' fence tasks of one push's engine trace (the first and last
    records of the stamps' tag), in seconds from their submission: to the ready stage's end
    (``ready``: the task on the post queue), to its first write posted (``posted``), to its
    last write's completion (``done``: the fence finished, the next tasks may post)."""
    from wxfer.runtime.tasks import STAMP_TAG

    st = sorted((r for r in recs if r["tag"] == STAMP_TAG), key=lambda r: r["t_submit"])
    out = {}
    for which, r in (("begin", st[0]), ("end", st[-1])) if len(st) > 1 else ():
        for k, f in (("ready", "t_ready"), ("posted", "t_post_first"), ("done", "t_done")):
            out[f"{which}_fence_{k}"] = (r[f] - r["t_submit"]) / 1e9
    return out


class _Timed:
    """Wraps `obj.name` (an instance attribute over its method): each call's seconds into
    `into[label]`; `mark` (a dict) says which phase of a push the call fell in."""

    def __init__(self, obj, name, into, label, first=None):
        self.obj, self.name, self.real = obj, name, getattr(obj, name)
        self.into, self.label, self.first = into, label, first
        setattr(obj, name, self)

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        if self.first is not None and self.first.get("t") is None:
            self.first["t"] = t
        try:
            return self.real(*a, **kw)
        finally:
            self.into.setdefault(self.label(), []).append(time.perf_counter() - t)

    def undo(self):
        delattr(self.obj, self.name)


def _parts(sender, n: int, gap: float) -> dict:
    """n pushes with each part of the pre-write phase timed (see the module's docstring)."""
    links, runner = sender.links, sender.runner
    times: dict = {}
    where = {"in": "end"}  # a call made inside adopt_rejoins is the push's start, else its end
    first = {}
    wraps = []

    def phase(base):
        if base not in TWICE:
            return lambda: base
        return lambda: f"{base}@{where['in']}"

    real_adopt = links.adopt_rejoins

    def adopt():
        where["in"] = "start"
        first["t0"], first["t"] = time.perf_counter(), None
        t = time.perf_counter()
        try:
            return real_adopt()
        finally:
            times.setdefault("adopt_rejoins", []).append(time.perf_counter() - t)
            where["in"] = "end"

    links.adopt_rejoins = adopt
    wraps.append(_Timed(links.ctl, "counters", times, phase("store_counters")))
    keys: dict = {}  # how many keys each push's restart check read (1: the count alone, no lease)
    counted = links.ctl.counters

    def counters(k):
        keys[len(k)] = keys.get(len(k), 0) + 1
        return counted(k)

    links.ctl.counters = counters  # over the _Timed one (its undo removes this attribute)
    for who, name in PARTS:
        obj = {"links": links, "runner": runner}[who]
        if hasattr(obj, name):
            wraps.append(_Timed(obj, name, times, phase(name)))
    # the first data task handed to the engine: a zero-copy batch, or one task's run
    wraps.append(_Timed(runner, "submit_fast", {}, lambda: "x", first))
    wraps.append(_Timed(sender, "_run_task", {}, lambda: "x", first))
    firsts = []

    def on_push():
        if first.get("t") is not None:
            firsts.append(first["t"] - first["t0"])

    ph = _pushes(sender, n, gap, on_push)
    for w in wraps:
        w.undo()
    del links.adopt_rejoins
    out = {k: _stats(v) for k, v in sorted(times.items())}
    out["first_submit"] = _stats(firsts)
    out["restart_checks_by_keys_read"] = {str(k): v for k, v in sorted(keys.items())}
    out["wrapped_rejoin_check"] = _stats(ph["rejoin_check"])
    out["wrapped_begin_stamps"] = _stats(ph["begin_stamps"])
    return out


def _bounds(sender, n: int, gap: float) -> dict:
    """One bare store round trip (Control.add of 0), Control.counters of one key, one /proc/<pid>/stat read and
    one poll(2) of a pidfd with no wait: `n` of each back to back ("hot"), and `n // 4` each
    after a `gap` sleep, as a push meets them ("after_gap")."""
    import select

    from wxfer.runtime import liveness

    ctl, pid = sender.links.ctl, os.getpid()
    poll = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
            poll = select.poll()
            poll.register(fd, select.POLLIN)
        except OSError:
            poll = None
    what = {
        "store_add_1_key": lambda: ctl.add("infer/rejoins", 0),  # one round trip
        "counters_1_key": lambda: ctl.counters(["infer/rejoins"]),
        "proc_stat_read": lambda: liveness.proc_start(pid),
    }
    if poll is not None:
        what["pidfd_poll"] = lambda: poll.poll(0)
    out = {}
    for label, reps, pause in (("hot", n, 0.0), ("after_gap", n // 4, gap)):
        xs = {k: [] for k in what}
        for _ in range(reps):
            for k, f in what.items():
                if pause:
                    time.sleep(pause)
                t = time.perf_counter()
                f()
                xs[k].append(time.perf_counter() - t)
        out.update({f"{k} ({label})": _stats(v) for k, v in xs.items()})
    if poll is not None:
        os.close(fd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="inference workers (replicas of TP 1)")
    ap.add_argument("--pushes", type=int, default=300, help="timed pushes per pass")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="sleep before each push")
    ap.add_argument("--provider", default="tcp", help="libfabric provider (tcp, shm)")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    store, sender, recvs = _setup(a.workers, a.provider, 60.0)
    try:
        gap = a.gap_ms / 1e3
        _pushes(sender, 10, gap)  # warm-up
        fence: dict = {}
        ph = _pushes(sender, a.pushes, gap, fence=fence)
        res = dict(
            machine=platform.node(),
            cpu=_cpu(),
            cores=os.cpu_count(),
            workers=a.workers,
            provider=a.provider,
            pushes=a.pushes,
            gap_ms=a.gap_ms,
            tasks=sum(len(g) for g in sender.program.groups),
            phases={k: _stats(v) for k, v in ph.items()},
            fence={k: _stats(v) for k, v in fence.items()},
            parts=_parts(sender, a.pushes, gap),
            bounds=_bounds(sender, 1000, gap),
            version=[r.version() for r in recvs],
        )
    finally:
        sender.close()
        for r in recvs:
            r.close()
        del store
    if a.json:
        print(json.dumps(res, indent=1))
        return
    _print(res)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _print(res: dict) -> None:
    print(
        f"{res['machine']}: {res['cpu']}, {res['cores']} cores; {res['workers']} workers over fabric "
        f"{res['provider']}, {res['tasks']} tasks, {res['pushes']} pushes {res['gap_ms']} ms apart"
    )
    print(f"{'what':<40} {'median us':>10} {'p90 us':>10}")
    rows = [("phases: " + k, v) for k, v in res["phases"].items()]
    rows += [("engine: " + k, v) for k, v in res.get("fence", {}).items()]
    rows += [("  part: " + k, v) for k, v in res["parts"].items()]
    rows += [("bound: " + k, v) for k, v in res["bounds"].items()]
    for k, v in rows:
        if v and "median_us" in v:
            print(f"{k:<40} {v['median_us']:>10.1f} {v['p90_us']:>10.1f}")
    print(f"restart checks by keys read (1: the count alone): {res['parts']['restart_checks_by_keys_read']}")
    print(f"receivers' versions at the end: {res['version']}")


if __name__ == "__main__":
    main()
