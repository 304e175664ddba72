"""One markdown table of bench_baselines.py's colocated rows from several runs of it (an A/B on
one machine: gpu_perf.sh's begin-stamp waits, gpu_submit.sh's event polling), one line per run
and row: link ms, wxfer ms per watermark (largest first), wxfer / link, then the columns asked
for, read from each watermark's push phases and the engine's last push:

    python3 benchmarks/common/phase_table.py --label wait --columns rejoin_check,begin_stamps \
        device=$OUT/bb-device host=$OUT/bb-host

Each NAME=DIR is a bench_baselines --out folder (its results.json); a missing one, or a row
without both a link and a wxfer time, gets a line that says so."""

from __future__ import annotations

import argparse
import json
import os


def _each(fmt, xs):
    return " / ".join(fmt(x) for x in xs)


def _per_task(rs, ph, lp, fit):
    per = _each(lambda pw: "%.2f" % (pw[0].get("submit", 0) * 1e6 / max(1, pw[1].get("tasks") or 1)), zip(ph, rs))
    return "%s (%s)" % (per, rs[0].get("tasks"))


def _launches(rs, ph, lp, fit):
    if not any(lp):
        return "-"
    return _each(
        lambda x: (
            "%d, %.2f (%.2f), %s"
            % (x.get("launches", 0), x.get("launch_s", 0) * 1e3, x.get("begin_wait_s", 0) * 1e3, x.get("bound", "-"))
        ),
        lp,
    )


def _launch_parts(rs, ph, lp, fit):
    """Per batched copy launch, host us: all of it, the copier's call, the event and engine
    submission (copy_s / submit_s: runs from before they were recorded show '-')."""
    if not any(x.get("launches") for x in lp):
        return "-"

    def one(x):
        n = max(1, x.get("launches", 0))
        parts = [x.get(k) for k in ("launch_s", "copy_s", "submit_s")]
        return ", ".join("-" if v is None else "%.0f" % (v * 1e6 / n) for v in parts)

    return _each(one, lp)


def _fit(rs, ph, lp, fit):
    return "%.0f / %.0f" % (fit.get("push_begin_s", 0) * 1e6, fit.get("begin_fence_s", 0) * 1e6) if fit else "-"


def _phase(key, scale, fmt):
    return lambda rs, ph, lp, fit: _each(lambda p: "-" if p.get(key) is None else fmt % (p[key] * scale), ph)


# name -> (header, cell(rs, phases, last pushes, the largest watermark's fitted calibration))
def _profile(rs, ph, lp, fit):
    pr = [r.get("profile") or {} for r in rs]
    if not any(pr):
        return "-"
    keys = ("gpu_busy_ms", "lead_ms", "idle_ms", "tail_ms")
    return _each(lambda x: ", ".join("%.2f" % (x.get(k) or 0) for k in keys) if x else "-", pr)


COLUMNS = {
    "rejoin_check": ("rejoin_check us", _phase("rejoin_check", 1e6, "%.0f")),
    "begin_stamps": ("begin_stamps us", _phase("begin_stamps", 1e6, "%.0f")),
    "streams": ("streams ordered us", _phase("streams", 1e6, "%.0f")),
    "groups": ("task loop begins us", _phase("groups", 1e6, "%.0f")),
    "submit": ("submit ms", _phase("submit", 1e3, "%.2f")),
    "per_task": ("submit us/task (tasks)", _per_task),
    "launches": ("copy launches: n, host ms (begin wait ms), bindings made", _launches),
    "launch_parts": ("per copy launch: host us, copier us, event + engine us", _launch_parts),
    "fit": ("fit: push_begin / begin_fence us", _fit),
    "profile": ("profiled push: busy, lead, idle, tail ms", _profile),
    "order": ("begin order (stats)", lambda rs, ph, lp, fit: str((rs[0].get("direct") or {}).get("begin", "-"))),
}


def row_line(label: str, r: dict, columns) -> str:
    """The table line of one bench_baselines result `r` of run `label`."""
    c = r["config"]
    name = "%s-%s-%s" % (c["model"], c["quant"], c.get("trainer", "plain"))
    link = r.get("methods", {}).get("link", {}).get("seconds")
    byw = r.get("wxfer_by_watermark") or {}
    order = sorted(byw, key=int, reverse=True)
    rs = [byw[k] for k in order]
    if not rs or not link:
        return "| %s | %s | error: %s |" % (label, name, r.get("error") or r.get("errors"))
    ph = [w.get("phases", {}) for w in rs]
    lp = [(w.get("direct") or {}).get("last_push") or {} for w in rs]
    fit = rs[0].get("simulated_calibration") or {}
    cells = [label, name, "%.2f" % (link * 1e3), _each(lambda w: "%.2f" % (w["seconds"] * 1e3), rs)]
    cells.append(_each(lambda w: "%.2fx" % (w["seconds"] / link), rs))
    cells += [COLUMNS[col][1](rs, ph, lp, fit) for col in columns]
    return "| " + " | ".join(cells) + " |"


def table(runs, label: str, columns) -> str:
    """The table of `runs` [(name, bench_baselines --out folder)] with `columns` (COLUMNS' names)."""
    heads = [label, "row", "link ms", "wxfer ms (per watermark, largest first)", "wxfer / link"]
    heads += [COLUMNS[col][0] for col in columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name, folder in runs:
        p = os.path.join(folder, "results.json")
        if not os.path.exists(p):
            lines.append("| %s | (no results.json in %s) |" % (name, folder))
            continue
        with open(p) as f:
            lines += [row_line(name, r, columns) for r in json.load(f)["results"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="run", help="the first column's header (what the runs differ in)")
    ap.add_argument("--columns", default="", help="comma-separated, of: " + ", ".join(COLUMNS))
    ap.add_argument("runs", nargs="+", metavar="NAME=DIR", help="a bench_baselines --out folder and its name")
    a = ap.parse_args(argv)
    columns = [c for c in a.columns.split(",") if c]
    bad = [c for c in columns if c not in COLUMNS]
    if bad:
        ap.error("--columns: unknown %s (known: %s)" % (", ".join(bad), ", ".join(COLUMNS)))
    runs = [tuple(x.split("=", 1)) if "=" in x else ap.error("run %r is not NAME=DIR" % x) for x in a.runs]
    print(table(runs, a.label, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
