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

With ``--delta-rate R`` (issue 36) every row also simulates the delta push at that fraction of
destination bytes changed (wxfer.plan.delta.simulate_delta: the records instead of the bytes,
the pack stage with the fused kernel's compare, each host waiting for each task's count, then
the receivers' apply), and the output lists every input term with its source: the
calibration's terms the plan charges (measured in the file, or a named assumption), the delta
terms (measured, or given), the links (assumed: this job's NICs at line rate, NVLink at the
2 x H200 broadcast rate) and what is not measured and not charged.

    python benchmarks/restate.py --calibration cal-h200.json --jobs kimi-k2 --delta-rate 0.0031
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


def simulate_job(spec: dict, cal, nic_eff: float = 1.0, delta=None) -> dict:
    """One job simulated; `delta` (wxfer.plan.delta.DeltaTerms): its delta push too."""
    from wxfer.meta import Cluster
    from wxfer.plan import plan_for
    from wxfer.plan.simulate import simulate

    spec = dict(spec)
    preset = spec.pop("preset")
    c = Cluster(nic_gbps=400.0 * nic_eff, calibration=cal, **spec)
    t0 = time.perf_counter()
    plan = plan_for(preset, c)
    r = simulate(plan, c, steps=400, record=False, kinds="auto")
    out = dict(
        simulated_s=r.simulated_s,
        lower_bound_s=r.lower_bound_s,
        bound_by=r.bound_by,
        busy=dict(
            host=r.stage_busy_s.get("host"), allgather=r.stage_busy_s.get("allgather"), pack=r.stage_busy_s.get("pack")
        ),
        assumptions=r.assumptions,
    )
    if delta is not None:
        from wxfer.plan.delta import simulate_delta

        out["delta"] = simulate_delta(plan, c, delta, r.simulated_s, r.lower_bound_s, steps=400)
        out["sources"] = term_sources(plan, c)
    out["wall_s"] = time.perf_counter() - t0
    return out


def term_sources(plan, cluster) -> dict:
    """{input term: "source: value (why)"} of a simulation of `plan` on `cluster`: each
    calibration term the plan charges (wxfer.plan.simulate.needed_terms: measured in the file,
    or a named assumption), the rates whose None means another figure, and the links."""
    from wxfer.plan.kinds import task_kinds
    from wxfer.plan.simulate import needed_terms

    cal = cluster.cal
    need = needed_terms(plan, cluster, task_kinds(plan, plan.train_params or None, cluster.cpu_offload))
    out = {}
    for k in sorted(set(need) | {"quant_GBps", "quant_small_GBps", "copy_GBps"}):
        src, why = cal.source_of(k)
        v = getattr(cal, k)
        out[k] = "%s: %r (%s)" % (src, v, why if src != "measured" else "the file's: " + why)
    gpn = cluster.gpus_per_node
    cross = sum(len({r // gpn for r in plan.meshes[t.mesh]}) > 1 for t in plan.tasks)
    out["nic_GBps"] = (
        "assumed: %g GB/s per GPU and direction (%g Gb/s line rate x efficiency %g; not measured): the writes "
        "and the %d tasks' all-gathers across nodes (a ring over the NICs)"
        % (cluster.nic_GBps, cluster.nic_gbps, cluster.nic_efficiency, cross)
    )
    out["nvlink_GBps"] = (
        "assumed: %g GB/s, the all-gathers inside a node (measured: NCCL broadcast on 2 x H200, DESIGN.md; not an "
        "all-gather over 8 GPUs)" % cluster.nvlink_GBps
    )
    out["barrier_s"] = "assumed: %g s, the gloo barrier between mesh groups (not measured)" % cluster.barrier_s
    return out


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


def delta_lines(name: str, rows: list, terms) -> list:
    """The delta table of one job's rows, and every input term's source (the base row's)."""
    from wxfer.plan.delta import NOT_MEASURED

    out = [
        "",
        "%s, delta push at %.4g of destination bytes changed" % (name, terms.rate),
        "",
        "| variant | dense | delta: simulated push + apply = total | x dense | busiest rank: all-gather / pack |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["delta"]
        b = d["delta_stage_busy_s"]
        out.append(
            "| %s | %.3f s | %.3f + %.3f = **%.3f s** | %.3f | %.3f / %.3f s |"
            % (
                r["variant"],
                d["dense_s"],
                d["delta_simulated_s"],
                d["delta_apply_s"],
                d["delta_s"],
                d["delta_vs_dense"],
                b["allgather"],
                b["pack"],
            )
        )
    out += ["", "Every input term of the base row, with its source:", ""]
    out += ["- rate %g: given (--delta-rate)" % terms.rate]
    out += ["- compare %g GB/s, apply %g GB/s: %s" % (terms.compare_GBps, terms.apply_GBps, terms.source)]
    out += ["- %s: %s" % kv for kv in sorted(rows[0]["sources"].items())]
    out += ["- not measured, not charged: %s" % v for v in NOT_MEASURED.values()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", required=True, help="a python -m wxfer calibrate --json --out FILE")
    ap.add_argument("--jobs", default="all", help="comma list of kimi-k2, qwen3-235b (default all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--delta-rate", type=float, default=None, help="also the delta push at this byte change rate")
    ap.add_argument("--delta-compare-gbytes", type=float, default=None, help="default: the fused kernel's (H100)")
    ap.add_argument(
        "--delta-apply-gbytes",
        type=float,
        default=None,
        help="default: the native apply kernel's (H100, 29.3 GB/s at 0.31%% changed)",
    )
    ap.add_argument("--base-only", action="store_true", help="the base row only (no sensitivity rows)")
    ap.add_argument(
        "--expert-shard",
        type=int,
        default=None,
        help="the routed experts' FSDP size (default 2, across nodes; 1: every expert rank holds its experts whole, "
        "no all-gather: what a rank quantizing its own block-aligned rows would send)",
    )
    a = ap.parse_args(argv)
    cal = job_calibration(a.calibration)
    want = None if a.jobs == "all" else set(a.jobs.split(","))
    res: dict = dict(calibration=a.calibration, source=cal.source, assumptions=cal.assumptions, jobs={})
    terms = None
    if a.delta_rate is not None:
        from wxfer.plan.delta import NOT_MEASURED, delta_terms

        terms = delta_terms(a.delta_rate, a.delta_compare_gbytes, a.delta_apply_gbytes)
        if a.delta_apply_gbytes is None and getattr(cal, "delta_apply_GBps", None):  # bench_delta --parts apply
            terms.apply_GBps = cal.delta_apply_GBps
            terms.source = "%s; apply: %.4g GB/s of records from the calibration (delta_apply_GBps)" % (
                terms.source.split("; apply: ")[0],
                cal.delta_apply_GBps,
            )
        res.update(delta_terms=terms.__dict__, delta_not_measured=NOT_MEASURED)
    lines = []
    for name, spec in JOBS.items():
        if want and spec["preset"] not in want:
            continue
        if a.expert_shard is not None:
            spec = dict(spec, expert_shard=a.expert_shard)
            name += ", expert FSDP %d" % a.expert_shard
        rows = []
        for label, c, e in variants(cal)[: 1 if a.base_only else None]:
            r = simulate_job(spec, c, e, terms)
            if rows:  # (a variant changes one figure: its sources are the base row's but that one)
                r.pop("sources", None)
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
        if terms is not None:
            lines += delta_lines(name, rows, terms)
    if cal.assumptions:
        lines += ["", "Assumed (the file did not measure them):"] + ["- " + v for v in cal.assumptions.values()]
    print("\n".join(lines))
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
