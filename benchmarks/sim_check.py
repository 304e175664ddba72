"""The simulator against a benchmark run, offline (issue 15): per row of bench_baselines'
results.json, the trainers' plan rebuilt from the configuration, each task's kind as the
runtime decides it, the calibration of that run, and the simulated push beside the
measured median.

    python benchmarks/sim_check.py benchmarks/runs/h200-2026-12-01-1144/*/results.json
    python benchmarks/sim_check.py --json DIR/results.json      # one JSON object per row
    python benchmarks/sim_check.py --calibration cal.json DIR/results.json   # predicted, not fitted

With ``--calibration FILE`` every row is predicted from that file alone (a ``python -m wxfer
calibrate`` made before the run): the plan and the kinds from the row's configuration, the
cluster the file describes; nothing from the row's trace, timings or in-run fit.  Without
it, as follows.

The calibration of a row: the one the benchmark measured in its own run (``simulated_
calibration``: the quantizer, copy and link rates measured in-process, the host and per-push
costs fitted on the Sender's own trace) when it was made by this fit (it has
``begin_fence_s``); for a run made before, the same fit (wxfer.runtime.hostfit.fit) is run
here on the row's trace file (``trace-<config>.json``, the engine trace of the last timed
step, one push), its push() call and return placed by the step's phases (begin_stamps: when
the begin stamps were submitted; done: when push() returned), and the run's measured rates
kept.  That is a fit, not a prediction: the refit reads the timed push's own trace and
phases (its host costs, stamps and write path come from the very push it is held against);
the measured median itself is printed beside it.

Needs torch and transformers (CPU) to rebuild the models' parameter shapes (meta device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

STAMP_TAG = 1 << 62
BASE_NS = 10**12  # the trace's origin (its first submission) on a made-up clock


def train_meta(cfg: dict, conf: dict, preset) -> list:
    """The trainer's parameter metadata as its Sender publishes it (one rank): the preset's
    Hugging Face names for the plain trainer, transformers' own class (meta device) for FSDP2."""
    from wxfer.meta import TrainParam

    if cfg.get("trainer", "plain") == "plain":
        return [TrainParam(n, tuple(s), dt, ((0,),), ()) for n, (s, dt, _) in preset.hf_params(conf).items()]
    import torch

    import bb_fsdp

    cls, hc = bb_fsdp.hf_class(conf)
    with torch.device("meta"):
        m = cls(hc)
    return [TrainParam(n, tuple(p.shape), "bfloat16", ((0,),), ("Shard(dim=0)",)) for n, p in m.named_parameters()]


def row_plan(cfg: dict, watermark: int):
    """(plan, training metadata) of a benchmark row: one trainer rank, one receiver."""
    from common import baselines as bb
    from wxfer.meta import from_inference_worker
    from wxfer.plan import build_plan
    from wxfer.runtime.sender import task_bound

    conf, preset = bb.model_spec(cfg["model"])
    quant = "fp8" if cfg["quant"] == "fp8" else None
    ex = bb.expanded(preset, conf, quant)
    train = train_meta(cfg, conf, preset)
    worker = from_inference_worker(list(ex.dest[0].items()), 0, 0, 1, False, None, 0)
    return build_plan(train, [worker], preset, quant=quant, max_task_bytes=task_bound(watermark)), train


def chrome_records(path: str, nwrites: dict) -> list:
    """Engine trace records (ns on BASE_NS's clock) from a Chrome trace (wxfer.runtime.trace):
    one record per task and stage spans, a tag seen again (the end stamps) a new record."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out, cur = [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        tag, stage = int(e["name"].split()[1]), e["cat"]
        r = cur.get(tag)
        if r is None or stage in r["_seen"] or (stage == "prepare" and r["_seen"]):
            r = dict(
                tag=tag, bytes=e["args"]["bytes"], held=e["args"]["held"], nwrites=nwrites.get(tag, 1), _seen=set()
            )
            r.update(t_submit=0, t_admit=0, t_ready=0, t_post_first=0, t_post_last=0, t_done=0)
            cur[tag] = r
            out.append(r)
        r["_seen"].add(stage)
        lo = BASE_NS + int(round(e["ts"] * 1e3))
        hi = lo + int(round(e["dur"] * 1e3))
        if stage == "admit":
            r["t_submit"], r["t_admit"] = lo, hi
        elif stage == "prepare":
            r["t_admit"], r["t_submit"] = lo, hi
        elif stage == "ready":
            r["t_ready"] = hi
        elif stage == "post":
            r["t_post_last"] = hi
        elif stage == "write":
            r["t_post_first"], r["t_done"] = lo, hi
    for r in out:
        del r["_seen"]
        if not r["t_ready"]:
            r["t_ready"] = max(r["t_admit"], r["t_submit"])
    return out


def refit(plan, kinds: dict, trace: str, phases: dict, write_GBps: float) -> dict:
    """hostfit.fit on the row's one traced push (see the module's docstring)."""
    import numpy as np
    from wxfer.runtime import hostfit

    sel = plan.sender == 0
    nw = {int(t): int(n) for t, n in enumerate(np.bincount(plan.task[sel], minlength=len(plan.tasks))) if n}
    recs = chrome_records(trace, nw)
    t0 = BASE_NS - int(round(phases["begin_stamps"] * 1e9))
    t1 = t0 + int(round(phases["done"] * 1e9))
    order = [[t for t, _ in g] for g in plan.rank_schedule(0)]
    info = {t.id: (len(t.sources), sum(len(sh.pieces) for sh in t.shards if sh.kind != "scale")) for t in plan.tasks}
    return hostfit.fit([(t0, t1, recs)], order, kinds, info, write_GBps=write_GBps)


def _reported(w: dict) -> dict:
    """The kinds the Sender reported (simulated_kinds), or, for a run whose simulation failed or
    predates Sender.task_kinds(), what its counters say (tasks, zero_copy_tasks, direct)."""
    d = w.get("direct") or {}
    want = dict(w.get("simulated_kinds") or {})
    if not want:  # counted: copies are zero-copy tasks, direct ones packed tasks
        zc, n = int(w.get("zero_copy_tasks") or 0), int(w.get("tasks") or 0)
        want = {"zero_copy": zc - d.get("copies", 0), "copy": d.get("copies", 0), "packed": n - zc}
    if "direct" not in want and d.get("tasks"):  # a run before Sender.task_kinds() said so
        want["packed"] = want.get("packed", 0) - d["tasks"]
        want["direct"] = d["tasks"]
    return {k: v for k, v in want.items() if v}


def _rates(res: dict, w: dict, kernels) -> tuple:
    """(the row's recorded calibration, where its figures come from): the one its run recorded,
    else (its simulation failed) the link rate its run measured (methods.link, what bb_fsdp
    gives the simulator) with the kernels' figures of `kernels` (a Calibration: the run's were
    not recorded), colocated rows sharing the GPU."""
    from dataclasses import asdict

    rec = w.get("simulated_calibration")
    if rec is not None:
        return rec, None
    got = w.get("simulated_rates")  # the kernels this run measured before its simulation failed
    if got and got.get("quant_GBps"):
        from wxfer.plan.calibrate import from_dict

        q = got.get("quantizer", "")
        kernels, name = from_dict(dict(got, launch_per_piece="native" not in q, name="recorded")), "recorded"
    elif kernels is None:
        return None, None
    else:
        name = kernels.name + " (not recorded)"
    cfg = res["config"]
    link = (res.get("methods") or {}).get("link") or {}
    if not link.get("gbps"):
        return None, None
    rec = dict(asdict(kernels), write_GBps=link["gbps"], serial=True, device_shared=cfg.get("layout") == "colocated")
    h2d = ((res.get("methods") or {}).get("h2d") or {}).get("gbps")
    if "offload" in cfg.get("trainer", "") and h2d:
        rec["h2d_GBps"] = h2d
    return rec, "kernels: " + name


def predict_row(res: dict, cal, placement: str | None = None) -> dict | None:
    """The prediction of one results row from the calibration `cal` alone (--calibration): the
    plan rebuilt from the row's configuration, each task's kind from its structure and the
    Sender's configuration (direct on or off, copy_max: what it was asked to do), the cluster
    the calibration describes; nothing read from the row's trace, timings or fit.  The row's
    measured median is printed beside it.  None: the row has no wxfer push."""
    from wxfer.plan.calibrate import run
    from wxfer.plan.kinds import task_kinds
    from wxfer.zerocopy import COPY_MAX

    from bb_predict import placement_of
    from common import baselines as bb

    cfg = res["config"]
    byw = res.get("wxfer_by_watermark") or {}
    if not byw:
        return None
    wm, w = next(iter(byw.items()))
    want = placement_of(cfg.get("layout", ""), bool(res.get("dry_run")))
    plan, train = row_plan(cfg, int(wm))
    offload = "offload" in cfg.get("trainer", "")
    d = w.get("direct") or {}
    direct = want == "same" and d.get("enabled", False)
    kinds = task_kinds(plan, train, offload, direct, d.get("copy_max", COPY_MAX if "copies" in d else 0))
    row = dict(
        config=bb.cfg_name(cfg),
        measured_s=w["seconds"],
        kinds=dict(Counter(kinds.values())),
        kinds_reported=_reported(w),
        calibration="%s (%s)" % (cal.name, placement or "?"),
    )
    row["kinds_agree"] = row["kinds"] == row["kinds_reported"]
    if placement and placement != want:
        return dict(row, error=f"the calibration was measured for placement {placement!r}, this row is {want!r}")
    try:
        r = run(plan, cal, kinds=kinds, cpu_offload=offload, watermark_bytes=int(wm))
    except ValueError as e:  # an unmeasured term this row needs, by name
        return dict(row, error=str(e))
    return dict(
        row,
        simulated_s=r.simulated_s,
        ratio=r.simulated_s / w["seconds"],
        recorded_simulated_s=w.get("predicted_s"),
        bound_by=r.bound_by,
        terms=r.terms,
        assumptions=r.assumptions,
        figures={},
    )


def check_row(res: dict, trace_dir: str, kernels=None) -> dict | None:
    """The simulation of the first watermark of one results row, or None (no simulation).
    kernels: the kernels' figures for a row whose run recorded no calibration (its simulation
    failed; see _rates)."""
    from dataclasses import fields

    from wxfer.meta import Calibration
    from wxfer.plan.calibrate import from_dict, run
    from wxfer.plan.kinds import task_kinds
    from wxfer.zerocopy import COPY_MAX

    from common import baselines as bb

    cfg = res["config"]
    byw = res.get("wxfer_by_watermark") or {}
    wm, w = next(
        ((k, v) for k, v in byw.items() if "simulated_calibration" in v or "simulated_error" in v), (None, None)
    )
    if w is None:
        return None
    rec, rates = _rates(res, w, kernels)
    if rec is None:
        return None
    plan, train = row_plan(cfg, int(wm))
    offload = "offload" in cfg.get("trainer", "")
    on_gpu = rec.get("device_shared", False)  # colocated on one GPU: cuda_ipc, direct when on
    d = w.get("direct") or {}
    direct = on_gpu and d.get("enabled", False)
    # the small copies: the bound the Sender reported (copy_max, -1: none); a runtime that counted
    # them ("copies") before it reported the bound had the default; before that, none
    kinds = task_kinds(plan, train, offload, direct, d.get("copy_max", COPY_MAX if "copies" in d else 0))
    got = dict(Counter(kinds.values()))
    want = _reported(w)
    if "begin_fence_s" in rec and rates is None:  # the fit of this model, made in the run
        cal, source = from_dict(rec), "recorded"
    else:
        trace = os.path.join(trace_dir, "trace-%s.json" % bb.cfg_name(cfg))
        fit = refit(plan, kinds, trace, w["phases"], rec["write_GBps"])
        keep = {f.name for f in fields(Calibration)}
        kw = {k: v for k, v in rec.items() if k in keep}
        kw.update({k: v for k, v in fit.items() if k in keep})
        cal, source = Calibration(**kw), "refit on the trace" + ("; " + rates if rates else "")
    r = run(plan, cal, kinds=kinds, cpu_offload=offload, watermark_bytes=int(wm))
    return dict(
        config=bb.cfg_name(cfg),
        measured_s=w["seconds"],
        simulated_s=r.simulated_s,
        ratio=r.simulated_s / w["seconds"],
        recorded_simulated_s=w.get("simulated_s"),
        bound_by=r.bound_by,
        terms=r.terms,
        kinds=got,
        kinds_reported=want,
        kinds_agree=got == want,
        calibration=source,
        figures={
            k: getattr(cal, k)
            for k in (
                "push_begin_s",
                "begin_fence_s",
                "push_end_s",
                "host_zc_task_s",
                "host_direct_task_s",
                "host_copy_task_s",
                "write_call_s",
                "write_dev_s",
                "quant_GBps",
                "write_GBps",
            )
        },
    )


def _table(rows: list) -> str:
    lines = [
        "| configuration | push ms | simulated ms | sim / push | recorded sim ms | bound by | host | kernel | "
        "write | post | stamps | H2D | kinds (as reported?) | calibration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append("| %s | %.2f | error: %s |" % (r["config"], r["measured_s"] * 1e3, r["error"][:300]))
            continue
        t = r["terms"]
        ms = lambda v: "%.2f" % (v * 1e3) if v is not None else ""  # noqa: E731
        kinds = ", ".join("%d %s" % (n, k) for k, n in sorted(r["kinds"].items()))
        lines.append(
            "| %s | %s | %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s | %s (%s) | %s |"
            % (
                r["config"],
                ms(r["measured_s"]),
                ms(r["simulated_s"]),
                r["ratio"],
                ms(r["recorded_simulated_s"]),
                r["bound_by"],
                ms(t["host_s"]),
                ms(t["kernel_s"]),
                ms(t["write_s"]),
                ms(t.get("post_s")),
                ms(t["stamps_s"]),
                ms(t["h2d_s"]),
                kinds,
                "yes" if r["kinds_agree"] else "no: %s" % r["kinds_reported"],
                r["calibration"],
            )
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench_baselines results.json files")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of the table")
    ap.add_argument("--within", type=float, default=0.15, help="exit 1 when a row is off by more (default 0.15)")
    ap.add_argument(
        "--kernels",
        default="h200-kernels",
        help="for a row whose run recorded no calibration (its simulation failed): the kernels' figures "
        "from this calibration (a name of wxfer.plan.calibrate.CALIBRATIONS or a JSON file; default "
        "h200-kernels, measured on one H200 by bench_baselines); 'none': skip such rows",
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="predict every row from this calibrate file alone (python -m wxfer calibrate --json --out FILE): "
        "no refit, nothing read from the rows' traces or timings; a row of another placement, or needing a term "
        "the file marks unmeasured, is reported as an error",
    )
    ap.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="TERM=VALUE",
        help="with --calibration: give a term the file marks unmeasured this value, as a named assumption "
        "(listed under the table); repeatable",
    )
    ap.add_argument(
        "--assume-zero-fits",
        action="store_true",
        help="with --calibration: take every term whose fit came out <= 0 (named unmeasured by calibrate) at 0, "
        "as named assumptions",
    )
    a = ap.parse_args(argv)
    from wxfer.plan.calibrate import assume, fits_at_zero, get

    kernels = None if a.kernels == "none" else get(a.kernels)
    given = placement = None
    if a.calibration:
        given = get(a.calibration)
        terms = {k: float(v) for k, _, v in (x.partition("=") for x in a.assume)}
        if terms:
            given = assume(given, why="given by --assume", **terms)
        if a.assume_zero_fits and fits_at_zero(given):
            zero = dict.fromkeys(fits_at_zero(given), 0.0)
            given = assume(given, why="its fit came out <= 0 (--assume-zero-fits)", **zero)
        with open(a.calibration) as f:
            placement = (json.load(f).get("measured") or {}).get("placement")
    rows = []
    for path in a.results:
        with open(path) as f:
            d = json.load(f)
        for res in d.get("results", []):
            if given is not None:
                r = predict_row(dict(res, dry_run=d.get("dry_run")), given, placement)
            else:
                r = check_row(res, os.path.dirname(os.path.abspath(path)), kernels)
            if r is not None:
                rows.append(r)
                if a.json:
                    print(json.dumps(r))
    if not a.json:
        print(_table(rows))
        took = sorted({v for r in rows for v in (r.get("assumptions") or {}).values()})
        if took:
            print("\nAssumed (the calibration did not measure them):\n" + "\n".join("- " + v for v in took))
    off = [r for r in rows if "error" in r or abs(r["ratio"] - 1) > a.within]
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
