"""The supervisor of the benchmarks' two-process runs (bench_baselines.py, bench_ckpt_engine.py):
the parent's one retry loop (run_attempts): it starts the children on a list of work items
(spawn), collects each item's result from the store in order and stops at the first item that
fails -- a child reported an error, exited, or the caller's time limit passed (watch) -- then
stops the children (stop), lets the caller decide what is left, and starts fresh ones on it;
the children's body (child), their Python stacks on demand (faulthandler: stack_file,
arm_stack_dump, dump_stacks), the SIGTERM handler that kills them."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import traceback
from typing import NamedTuple


def child(main, rank: int, q, *args) -> None:
    """A benchmark child process's body: main(rank, *args), then (rank, None) on `q`; on any
    failure (rank, traceback) on `q`, and the process dies at once (native threads may linger).
    bench_baselines.py's and bench_ckpt_engine.py's children."""
    try:
        main(rank, *args)
        q.put((rank, None))
    except BaseException:  # noqa: BLE001 -- report, then die at once
        traceback.print_exc()
        q.put((rank, traceback.format_exc()[-3000:]))
        q.close()
        q.join_thread()
        os._exit(1)


_CHILDREN: list = []  # this run's child processes (spawn): killed on SIGTERM


def _kill_children(*_):
    for p in _CHILDREN:
        if p.is_alive():
            p.kill()
    raise SystemExit(1)


def spawn(ctx, target, a: dict, work: list, n: int = 2):
    """n daemon children target(rank, a, work, q) (q: what child() reports); (processes, q)."""
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, a, work, q), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    _CHILDREN[:] = procs
    return procs, q


def drain(q) -> dict:
    """{rank: traceback} of the failures the children have reported so far (not blocking)."""
    errs = {}
    try:
        while True:
            r, e = q.get_nowait()
            if e:
                errs[r] = e
    except Exception:  # noqa: BLE001 -- queue empty
        pass
    return errs


class Failure(NamedTuple):
    index: int  # the work item waited for
    errs: dict  # {rank: traceback} the children reported
    reported: bool  # the errors came first (before any child was seen exited or late)
    dead: list  # the children that had exited
    over: bool  # the caller's time limit passed


def watch(procs, q, ctl, todo: list, key: str, on_result, over, settle: float = 0.0, poll: float = 0.1):
    """Collect the results of the work items `todo` (indices, in order; the store key `key % i`
    says item i's is in): on_result(i) for each, popped from `todo`.  None once all are in;
    else the Failure of the first item still waited for when a child reported an error (the
    other child's too after `settle` seconds), a child failed (exited with a non-zero code, or
    every child exited with items still waited for), or over() became true.  A child that
    exited with 0 has finished its part of every item (the inference rank finishes the last
    configuration while the trainer still checks its bytes): that is not a failure."""
    while todo:
        i = todo[0]
        if ctl.check(key % i):
            todo.pop(0)
            on_result(i)
            continue
        errs = drain(q)
        if errs:
            if settle:
                time.sleep(settle)
                errs.update(drain(q))
            return Failure(i, errs, True, [p for p in procs if not p.is_alive()], False)
        gone = [p for p in procs if not p.is_alive()]
        dead = [p for p in gone if p.exitcode != 0] or (gone if len(gone) == len(procs) else [])
        late = over()
        if dead or late:
            return Failure(i, drain(q), False, dead, late)
        time.sleep(poll)
    return None


def stop(procs, failed: bool, wait_s: float, kill: bool) -> None:
    """Join the children (wait_s each after a clean end, 0.1 s after a failure), then
    terminate (or kill) the ones still alive."""
    for p in procs:
        if p.is_alive():
            p.join(0.1 if failed else wait_s)
        if p.is_alive():
            if kill:
                p.kill()
            else:
                p.terminate()
            p.join(5)


def stack_file(path: str):
    """In a child: where its Python stacks go, on SIGUSR1 (dump_stacks, sent by the parent
    before it stops a failed item) and when an armed timer fires (arm_stack_dump)."""
    f = open(path, "w")  # noqa: SIM115 -- open for faulthandler until the process exits
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    return f


def arm_stack_dump(f, label: str, seconds: float) -> None:
    """In a child, at the start of a work item: a header, and the stacks in `seconds` unless
    faulthandler.cancel_dump_traceback_later() is called first."""
    f.write("--- %s (%s)\n" % (label, time.strftime("%H:%M:%S")))
    f.flush()
    faulthandler.dump_traceback_later(max(1.0, seconds), file=f)


def disarm_stack_dump() -> None:
    """In a child, at the end of a work item: the armed timer cancelled."""
    faulthandler.cancel_dump_traceback_later()


def read_stacks(paths: dict, limit: int = 6000) -> dict:
    """{rank: the stacks dumped since the last header} of each file in `paths` {rank: path}
    that holds some."""
    out = {}
    for r, path in paths.items():
        try:
            with open(path) as f:
                txt = f.read()
        except OSError:
            continue
        last = txt.rfind("--- ")
        body = txt[last:] if last >= 0 else txt
        if "File " in body:
            out[str(r)] = body[-limit:]
    return out


def dump_stacks(procs, paths: dict) -> dict:
    """The children's Python stacks now (SIGUSR1 to each alive one; stack_file in each),
    before they are stopped: read_stacks(paths)."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    if alive:
        time.sleep(2.0)
    return read_stacks(paths)


def run_attempts(
    ctx,
    target,
    a: dict,
    store,
    prefix: str,
    timeout: float,
    todo: list,
    work_of,
    on_result,
    over,
    why,
    on_failure,
    *,
    more=None,
    settle: float = 0.0,
    poll: float = 0.1,
    stop_wait: float = 5.0,
    kill: bool = False,
    stack_paths=None,
) -> None:
    """The parent's loop: while items of `todo` (indices, in order) are left and more() (when
    given) holds, fresh children target(rank, a, work_of(todo), q) (spawn) under their own
    store namespace a["name"] = "<prefix>_<attempt>"; each item's result, as its key "res/<i>"
    appears, handed to on_result(ctl, i) (the item popped from `todo`); at the first failure
    (watch; over(item_s) says the caller's limits passed, item_s the seconds since the last
    result or the attempt's start) why(ctl, failure, procs, item_s) says why while the
    children are still as they failed, their stacks are read (stack_paths(a): {rank: file},
    dump_stacks), they are stopped (stop: stop_wait, kill), and on_failure(ctl, index, why,
    procs, stacks) decides what is left: it removes the item from `todo` (given up) or leaves
    it there (retried with fresh children)."""
    from wxfer.runtime import control

    attempt = 0
    while todo and (more is None or more()):
        attempt += 1
        a["name"] = "%s_%d" % (prefix, attempt)
        ctl = control.Control(store, a["name"], timeout)
        procs, q = spawn(ctx, target, a, work_of(todo))
        t_item = [time.monotonic()]

        def got(i, ctl=ctl, t_item=t_item):
            on_result(ctl, i)
            t_item[0] = time.monotonic()

        def late(t_item=t_item):
            return over(time.monotonic() - t_item[0])

        f = watch(procs, q, ctl, todo, "res/%d", got, late, settle=settle, poll=poll)
        reason = None if f is None else why(ctl, f, procs, time.monotonic() - t_item[0])
        stacks = dump_stacks(procs, stack_paths(a)) if f is not None and stack_paths else {}
        stop(procs, f is not None, stop_wait, kill)
        if f is not None:
            on_failure(ctl, f.index, reason, procs, stacks)
