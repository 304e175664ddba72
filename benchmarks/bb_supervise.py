"""The parent side of the benchmarks' two-process runs (bench_baselines.py, bench_ckpt_engine.py):
the child processes' body and the SIGTERM handler that kills them."""

from __future__ import annotations

import os
import traceback


def child(main, rank: int, q, *args) -> None:
    """A benchmark child process's body: main(rank, *args), then (rank, None) on `q`; on any
    failure (rank, traceback) on `q`, and the process dies at once (native threads may linger).
    bench_ckpt_engine.py's children use it too."""
    try:
        main(rank, *args)
        q.put((rank, None))
    except BaseException:  # noqa: BLE001 -- report, then die at once
        traceback.print_exc()
        q.put((rank, traceback.format_exc()[-3000:]))
        q.close()
        q.join_thread()
        os._exit(1)


_CHILDREN: list = []  # this run's child processes (bench_ckpt_engine.py's too): killed on SIGTERM


def _kill_children(*_):
    for p in _CHILDREN:
        if p.is_alive():
            p.kill()
    raise SystemExit(1)
