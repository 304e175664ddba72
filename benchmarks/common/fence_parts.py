"""What the version stamps' fences of a traced push consist of (issue 37), from the engine
traces a bench_baselines run writes (trace-<row>.json, Chrome format): per row, in us from
the begin stamps' submission, where the begin fence's task was when (admit: the submit call;
ready: on the post queue, the ready thread's wake-up unless it skipped it; posted: the post
thread's first write; done: the stamps landed, the fence finished) and when the push's first
data task was submitted and first posted (the fence orders the writes only where that comes
after it finished); then the end stamps the same way from their submission, and from the
last data write's completion.

    python benchmarks/common/fence_parts.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import glob
import json
import os
import sys

STAMP = "task %d" % (1 << 62)  # wxfer.runtime.tasks.STAMP_TAG's trace name


def records(path: str) -> list:
    """[(name, {stage: (start us, end us)})] of a trace, one per task, in submission order."""
    recs: list = []
    cur = None
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if cur is None or cur[0] != e["name"] or e["cat"] in cur[1]:
            cur = (e["name"], {})
            recs.append(cur)
        cur[1][e["cat"]] = (e["ts"], e["ts"] + e["dur"])
    return sorted(recs, key=lambda r: min(a for a, _ in r[1].values()))


def _parts(st: dict, t0: float) -> str:
    """admit / ready / posted / done of one stamps' record, in us after t0."""
    sub = min(a for a, _ in st.values())
    out = [st.get("admit", (sub, sub))[1], st.get("ready", (0, float("nan")))[1]]
    w = st.get("write", (float("nan"), float("nan")))
    return " / ".join("%.0f" % (x - t0) for x in out + [w[0], w[1]])


def row(path: str) -> str | None:
    recs = records(path)
    stamps = [r for r in recs if r[0] == STAMP]
    data = [r for r in recs if r[0] != STAMP]
    if len(stamps) < 2 or not data:
        return None
    b, e = stamps[0][1], stamps[-1][1]
    t0 = min(a for a, _ in b.values())
    first_sub = min(min(a for a, _ in r[1].values()) for r in data)
    first_post = min((r[1]["write"][0] for r in data if "write" in r[1]), default=float("nan"))
    last_done = max((r[1]["write"][1] for r in data if "write" in r[1]), default=float("nan"))
    e0 = min(a for a, _ in e.values())
    name = os.path.basename(path)[len("trace-") : -len(".json")]
    return "| %s | %s | %.0f / %.0f | %s | %.0f |" % (
        name,
        _parts(b, t0),
        first_sub - t0,
        first_post - t0,
        _parts(e, e0),
        e["write"][1] - last_done if "write" in e else float("nan"),
    )


def main(argv: list) -> None:
    print(
        "| run | row | begin fence us: admit / ready / posted / done | first data task: submitted / "
        "posted | end fence us: admit / ready / posted / done | end stamps landed after the last data us |"
    )
    print("|---|---|---|---|---|---|")
    for run in argv:
        for path in sorted(glob.glob(os.path.join(run, "trace-*.json"))):
            r = row(path)
            if r is not None:
                print("| %s " % os.path.basename(os.path.normpath(run)) + r)


if __name__ == "__main__":
    main(sys.argv[1:])
