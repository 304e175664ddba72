"""Kimi-K2 and Qwen3-235B restated with a measured calibration, and how sensitive the
prediction is to what was assumed (issue 24).

    python benchmarks/restate.py --calibration cal-h200.json            # markdown tables
    python benchmarks/restate.py --calibration cal-h200.json --json     # one JSON object last

The plans: Kimi-K2, 256 BF16 trainers (32 nodes x 8, FSDP over a node, HSDP across nodes,
routed experts on 128 meshes of 2 ranks) -> 8 replicas x TP16 (EP) in FP8; Qwen3-235B, 128
trainers -> 4 x TP8 (EP) in FP8; one 400 Gb/s NIC per GPU.  Each task simulated as the
runtime runs it (kinds "auto"; a disaggregated job: no task in place).

From the calibration file: its costs (host per task / parameter / piece, per zero-copy task
and batch, the quantizer and copy rates and launch cost, the per-push costs, the write
path's per-write costs).  Not from it: its link rates (the cluster's NICs and NVLink are
this job's) and its placement flags (a calibration of colocated receivers shares one GPU's
memory between kernels and writes; these jobs do not).  A term the file marks unmeasured
that the plan needs is used as a named assumption (listed with the result), never silently.

Sensitivity (one figure changed at a time from the base): NIC efficiency 0.8, 0.9, 1.0 (the
fraction of 400 Gb/s the writes and cross-node all-gathers get); every host cost x0.5 and
x2; the quantizer at half its measured rate and at the reference quantizer's 170 GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

JOBS = {
    "Kimi-K2, 256 -> 8 x TP16 (EP), FP8": dict(
        preset="kimi-k2", train_gpus=256, infer_gpus=128, infer_tp=16, infer_ep=True, quant="fp8"
    ),
    "Qwen3-235B, 128 -> 4 x TP8 (EP), FP8": dict(
        preset="qwen3-235b", train_gpus=128, infer_gpus=32, infer_tp=8, infer_ep=True, quant="fp8"
    ),
}
# what a term the file could not measure is taken as here, and why (reported with the result)
ASSUME = {
    "coll_call_s": (0.0, "the all-gather's per-call cost not measured (one GPU: no NCCL peer); taken as 0"),
    "allgather_GBps": (None, "the all-gather rate is the cluster's (NVLink 370 GB/s in a node, the NICs across)"),
    "h2d_GBps": (None, "no offload in these jobs"),
    "h2d_call_s": (0.0, "no offload in these jobs"),
    "write_dev_s": (0.0, "the write path's time per write beyond the link not measured; taken as 0"),
    "host_piece_s": (0.0, "the per-piece host cost not measured; taken as 0"),
    "host_param_s": (
        0.0,
        "the per-parameter host cost: the fit put it at 0 (stored as 0.0 by an older calibrate); taken as 0",
    ),
}


def job_calibration(path: str):
    """The file's costs for a disaggregated multi-node job: its links and placement flags
    dropped, unmeasured terms the jobs need given as named assumptions."""
    from wxfer.plan.calibrate import assume, get

    cal = get(path)
    cal = replace(
        cal,
        write_GBps=None,
        allgather_GBps=None,
        h2d_GBps=None,
        device_shared=False,
        cpu_shared=False,
        host_sync=False,
        serial=True,
    )
    for k in list(cal.unmeasured):
        if k in ASSUME:
            v, why = ASSUME[k]
            cal = assume(cal, why=why, **{k: v})
    return cal


def simulate_job(spec: dict, cal, nic_eff: float = 1.0) -> dict:
    from wxfer.meta import Cluster
    from wxfer.plan import plan_for
    from wxfer.plan.simulate import simulate

    spec = dict(spec)
    preset = spec.pop("preset")
    c = Cluster(nic_gbps=400.0 * nic_eff, calibration=cal, **spec)
    t0 = time.perf_counter()
    plan = plan_for(preset, c)
    r = simulate(plan, c, steps=400, record=False, kinds="auto")
    return dict(
        simulated_s=r.simulated_s,
        lower_bound_s=r.lower_bound_s,
        bound_by=r.bound_by,
        busy=dict(
            host=r.stage_busy_s.get("host"), allgather=r.stage_busy_s.get("allgather"), pack=r.stage_busy_s.get("pack")
        ),
        assumptions=r.assumptions,
        wall_s=time.perf_counter() - t0,
    )


def variants(cal) -> list:
    """(label, calibration, NIC efficiency) of the sensitivity table."""
    from wxfer.runtime.hostfit import HOST_COSTS

    out = [("base (the file's costs, NIC 100%)", cal, 1.0)]
    out += [("NIC efficiency %.0f%%" % (100 * e), cal, e) for e in (0.9, 0.8)]
    for f in (0.5, 2.0):
        kw = {k: getattr(cal, k) * f for k in HOST_COSTS if getattr(cal, k) is not None}
        out.append(("host costs x%g" % f, replace(cal, **kw), 1.0))
    if cal.quant_GBps:
        q = dict(quant_GBps=cal.quant_GBps / 2)
        if cal.quant_small_GBps:
            q["quant_small_GBps"] = cal.quant_small_GBps / 2
        out.append(("quantizer at half its rate (%.3g GB/s)" % (cal.quant_GBps / 2), replace(cal, **q), 1.0))
    out.append(
        (
            "reference quantizer (170 GB/s, a launch per piece)",
            replace(cal, quant_GBps=170.0, quant_small_GBps=None, launch_per_piece=True, pack_launch_s=90e-6),
            1.0,
        )
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", required=True, help="a python -m wxfer calibrate --json --out FILE")
    ap.add_argument("--jobs", default="all", help="comma list of kimi-k2, qwen3-235b (default all)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cal = job_calibration(a.calibration)
    want = None if a.jobs == "all" else set(a.jobs.split(","))
    res: dict = dict(calibration=a.calibration, source=cal.source, assumptions=cal.assumptions, jobs={})
    lines = []
    for name, spec in JOBS.items():
        if want and spec["preset"] not in want:
            continue
        rows = []
        for label, c, e in variants(cal):
            r = simulate_job(spec, c, e)
            rows.append(dict(r, variant=label))
            print(
                "%s / %s: %.3f s (bound %.3f s, %s)"
                % (name, label, r["simulated_s"], r["lower_bound_s"], r["bound_by"]),
                file=sys.stderr,
                flush=True,
            )
        res["jobs"][name] = rows
        lines += [
            "",
            "%s (calibration: %s)" % (name, os.path.basename(a.calibration)),
            "",
            "| variant | simulated | lower bound | x bound | bound by | busiest rank: host / all-gather / pack |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            b = r["busy"]
            lines.append(
                "| %s | %.3f s | %.3f s | %.3f | %s | %.3f / %.3f / %.3f s |"
                % (
                    r["variant"],
                    r["simulated_s"],
                    r["lower_bound_s"],
                    r["simulated_s"] / r["lower_bound_s"],
                    r["bound_by"],
                    b["host"] or 0.0,
                    b["allgather"] or 0.0,
                    b["pack"] or 0.0,
                )
            )
    if cal.assumptions:
        lines += ["", "Assumed (the file did not measure them):"] + ["- " + v for v in cal.assumptions.values()]
    print("\n".join(lines))
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
