"""StepLoop._groups per task on bench_push_host.py's FSDP2 copy setup (311 copy tasks, DTensor
sources) with the batched launches stubbed (flush_copies clears the queue), the group's barrier
and end left out: the step loop's per-task Python alone.  200 loops after bench_push's own pushes.

    WXFER_BENCH_ROOT=/path/to/checkout python3 benchmarks/runs/cpu-2026-12-07-hostpath/loop_only.py
"""

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # benchmarks/ (bench_push_host puts the checkout first)
import bench_push_host as b  # noqa: E402
import wxfer.runtime.sender as S  # noqa: E402
from wxfer.runtime import control  # noqa: E402

real_close = S.Sender.close


def close(self):
    ip, loop = self.inplace, self.steps
    n = sum(len(g) for g in self.program.groups)
    ip.start(999, False, lambda: None)
    ip.flush_copies = lambda: (ip.copy_q.clear(), setattr(ip, "copy_q_bytes", 0))
    ip.end_group = lambda: None
    barrier, control.Barrier = control.Barrier, lambda *a, **k: None
    per = []
    for _ in range(200):
        t = time.perf_counter()
        loop._groups(1, None, None, {"barrier": None, "at": (0, -1)})
        per.append((time.perf_counter() - t) / n * 1e6)
        ip.copy_q.clear()
        ip.copy_q_bytes = 0
    control.Barrier = barrier
    print(
        "%s: _groups us/task median %.3f min %.3f (%d tasks)"
        % (os.environ.get("WXFER_BENCH_ROOT"), statistics.median(per), min(per), n)
    )
    return real_close(self)


S.Sender.close = close
b.bench_push("shm", 28, 3, copy=True, fsdp2=True)
