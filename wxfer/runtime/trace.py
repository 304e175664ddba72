"""Per-task stage timestamps from the engine as Chrome / Perfetto trace JSON.

``Engine.trace()`` returns one record per finished task with monotonic nanosecond stamps:
t_submit (caller asked), t_admit (under the watermark), t_ready (its CUDA event done),
t_post_first / t_post_last (first / last write posted), t_done (last write landed).
Open the file at ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import json

STAGES = (
    ("admit", "t_submit", "t_admit"),
    ("ready", "t_admit", "t_ready"),
    ("post", "t_ready", "t_post_last"),
    ("write", "t_post_first", "t_done"),
)


def to_chrome(records, pid: int = 0, name: str = "wxfer") -> dict:
    """Turn engine trace records into a Chrome trace dict (``traceEvents``)."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    for tid, (stage, _, _) in enumerate(STAGES):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": stage}})
    t0 = min((r["t_submit"] for r in records), default=0)
    for r in records:
        for tid, (stage, a, b) in enumerate(STAGES):
            if r[a] and r[b] and r[b] >= r[a]:
                events.append({
                    "ph": "X", "name": "task %d" % r["tag"], "cat": stage, "pid": pid,
                    "tid": tid, "ts": (r[a] - t0) / 1e3, "dur": (r[b] - r[a]) / 1e3,
                    "args": {"bytes": r["bytes"], "held": r["held"], "status": r["status"]},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(records, path: str, **kw) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome(records, **kw), f)


def held_over_time(records):
    """[(t_ns, bytes held)] at every admission and completion: what the watermark bounds."""
    ev = []
    for r in records:
        ev.append((r["t_admit"], r["held"]))
        ev.append((r["t_done"], -r["held"]))
    ev.sort(key=lambda x: (x[0], x[1]))  # releases before admissions at equal stamps
    out, cur = [], 0
    for t, d in ev:
        cur += d
        out.append((t, cur))
    return out
