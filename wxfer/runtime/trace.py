"""Per-task stage timestamps from the engine as Chrome / Perfetto trace JSON.

``Engine.trace()`` returns one record per finished task with monotonic nanosecond stamps:
t_submit (caller asked), t_admit (under the watermark), t_ready (its CUDA event done),
t_post_first / t_post_last (first / last write posted), t_done (last write landed).  A task
the Sender reserved before preparing it (``Engine.reserve``) was admitted first: its
t_admit .. t_submit is the host time of its stages 1-2 (``prepare``).
Open the file at ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json

STAGES = (
    ("prepare", "t_admit", "t_submit"),  # reserved tasks only: admitted, then prepared
    ("admit", "t_submit", "t_admit"),
    ("ready", "t_admit", "t_ready"),
    ("post", "t_ready", "t_post_last"),
    ("write", "t_post_first", "t_done"),
)


def _span(r, stage, a, b):
    lo, hi = r[a], r[b]
    if stage == "ready":
        lo = max(r["t_admit"], r["t_submit"])
    return lo, hi


def to_chrome(records, pid: int = 0, name: str = "wxfer") -> dict:
    """Turn engine trace records into a Chrome trace dict (``traceEvents``)."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    for tid, (stage, _, _) in enumerate(STAGES):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stage}})
    t0 = min((min(r["t_submit"], r["t_admit"] or r["t_submit"]) for r in records), default=0)
    for r in records:
        for tid, (stage, a, b) in enumerate(STAGES):
            lo, hi = _span(r, stage, a, b)
            if lo and hi and hi >= lo and not (stage == "prepare" and hi == lo):
                events.append(
                    {
                        "ph": "X",
                        "name": "task %d" % r["tag"],
                        "cat": stage,
                        "pid": pid,
                        "tid": tid,
                        "ts": (lo - t0) / 1e3,
                        "dur": (hi - lo) / 1e3,
                        "args": {"bytes": r["bytes"], "held": r["held"], "status": r["status"]},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def host_times(records, params_of: dict | None = None, skip_tags=()) -> dict:
    """Host time of the push loop from a trace: per task, the host time of its stages 1-2
    (t_admit .. t_submit of a task the Sender reserved before preparing it; the
    Engine.submit call itself is not in it; 0 for a task submitted by
    Engine.submit_prepared, which has no stages 1-2; the in-place writes, external tasks, left
    out).  params_of: tag -> number of training
    parameters of the task.  Returns tasks, params, host_s (sum), per_task_us and
    per_param_us (means), median_task_us."""
    hs = []
    nparams = 0
    for r in records:
        if r["tag"] in skip_tags or r.get("kind") == "external":  # an in-place write: no stages 1-2 here
            continue
        hs.append(max(0, r["t_submit"] - r["t_admit"]) if r["t_admit"] and r["t_admit"] <= r["t_submit"] else 0)
        nparams += (params_of or {}).get(r["tag"], 1)
    if not hs:
        return dict(tasks=0, params=0, host_s=0.0, per_task_us=0.0, per_param_us=0.0, median_task_us=0.0)
    tot = sum(hs) / 1e9
    srt = sorted(hs)
    return dict(
        tasks=len(hs),
        params=nparams,
        host_s=tot,
        per_task_us=tot / len(hs) * 1e6,
        per_param_us=tot / max(1, nparams) * 1e6,
        median_task_us=srt[len(srt) // 2] / 1e3,
    )


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
