"""``python -m wxfer plan``: build (and simulate) a plan for a preset on a modelled cluster.

Example::

    python -m wxfer plan --preset kimi-k2 --train-gpus 256 --infer-gpus 128 --infer-tp 16 \\
        --nic-gbps 400 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _parser() -> argparse.ArgumentParser:
    from ..mapping import PRESETS

    p = argparse.ArgumentParser(prog="python -m wxfer plan", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-tiny")
    src.add_argument("--config", help="path to a Hugging Face config.json instead of a preset")
    p.add_argument("--train-gpus", type=int, default=8)
    p.add_argument("--infer-gpus", type=int, default=None, help="default: one replica")
    p.add_argument("--infer-tp", type=int, default=None, help="default: the preset's")
    ep = p.add_mutually_exclusive_group()
    ep.add_argument(
        "--infer-ep",
        dest="infer_ep",
        action="store_true",
        default=None,
        help="experts expert-parallel over the TP ranks (preset default for MoE)",
    )
    ep.add_argument("--no-infer-ep", dest="infer_ep", action="store_false")
    p.add_argument("--quant", choices=["fp8", "bf16"], default=None, help="default: the preset's")
    p.add_argument("--nic-gbps", type=float, default=400.0)
    p.add_argument("--nvlink-gbytes", type=float, default=370.0, help="per GPU, GB/s")
    p.add_argument("--pcie-gbytes", type=float, default=55.0, help="per GPU, GB/s")
    p.add_argument(
        "--write-gbytes",
        type=float,
        default=None,
        help="trainer -> inference write path per GPU, GB/s (default: the NIC); e.g. the measured "
        "cuda_ipc rate when trainers and receivers share a node",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--dense-shard", type=int, default=8, help="FSDP size of dense params (inside a node)")
    p.add_argument("--expert-shard", type=int, default=2, help="FSDP size of routed experts (across nodes)")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--watermark-gb", type=float, default=8.0)
    p.add_argument(
        "--calibration",
        default=None,
        help="per-task costs: a file from `python -m wxfer calibrate --out FILE` or a name "
        "(h200 = default, h200-native, free-stage2 = the model before issue 15); the links "
        "stay the ones given here",
    )
    p.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="TERM=VALUE",
        help="give a calibration term the calibration lacks (unmeasured) this value, as a named assumption "
        "(listed in the output); repeatable",
    )
    p.add_argument("--steps", type=int, default=1500, help="simulation steps per lower bound")
    p.add_argument(
        "--delta-rate",
        type=float,
        default=None,
        help="also estimate a delta push (docs/delta.md) at this fraction of destination bytes changed, e.g. 0.004",
    )
    p.add_argument(
        "--delta-compare-gbytes",
        type=float,
        default=None,
        help="trainer compare + count + records beyond the quantize, GB/s of bytes read (fresh + shadow); default: "
        "the fused kernel's, measured on one H100 (785; the torch ops' path: 167.3)",
    )
    p.add_argument(
        "--delta-apply-gbytes",
        type=float,
        default=None,
        help="receiver apply, GB/s of records; default: the calibration's delta_apply_GBps where it has one "
        "(bench_delta.py --parts apply --cal-out), else 29.27 (the native apply kernel measured on one H100 "
        "at 0.31%% changed)",
    )
    p.add_argument("--no-sim", action="store_true")
    p.add_argument("--out", help="write the serialized plan to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def _preset_and_cluster(args):
    """The preset (--preset, or --config's HF config.json) and the Cluster the flags describe,
    with the calibration loaded."""
    from ..mapping import from_config, get_preset
    from ..meta import Cluster
    from .calibrate import get as get_calibration

    if args.config:
        with open(args.config) as f:
            preset = from_config(os.path.basename(args.config), json.load(f))
    else:
        preset = get_preset(args.preset)
    tp = args.infer_tp or preset.infer_tp
    cluster = Cluster(
        train_gpus=args.train_gpus,
        infer_gpus=args.infer_gpus or tp,
        infer_tp=tp,
        infer_ep=preset.infer_ep if args.infer_ep is None else args.infer_ep,
        quant=(preset.quant if args.quant is None else (None if args.quant == "bf16" else args.quant)),
        gpus_per_node=args.gpus_per_node,
        nic_gbps=args.nic_gbps,
        nvlink_GBps=args.nvlink_gbytes,
        pcie_GBps=args.pcie_gbytes,
        dense_shard=args.dense_shard,
        expert_shard=args.expert_shard,
        cpu_offload=args.cpu_offload,
        watermark_bytes=int(args.watermark_gb * (1 << 30)),
        write_GBps=args.write_gbytes,
    )
    cluster.calibration = get_calibration(args.calibration)
    if args.assume:
        from .calibrate import assume

        terms = {}
        for a in args.assume:
            k, sep, v = a.partition("=")
            try:
                terms[k.strip()] = float(v)
            except ValueError:
                raise ValueError(f"--assume {a!r}: expected TERM=VALUE (a number)") from None
        cluster.calibration = assume(cluster.calibration, why="given by --assume", **terms)
    return preset, cluster


# what a plan's report says of its size (keys of Plan.summary())
SIZES = (
    "params",
    "bytes_per_replica",
    "max_bytes_per_infer_gpu",
    "max_bytes_per_train_gpu",
    "min_bytes_per_train_gpu",
    "tasks",
    "mesh_groups",
    "transfers",
)


def sizes(plan) -> dict:
    """{key: value} of `plan`'s summary for the keys of SIZES."""
    s = plan.summary()
    return {k: s[k] for k in SIZES}


def run(args) -> dict:
    from . import plan_for
    from .simulate import simulate

    preset, cluster = _preset_and_cluster(args)
    tp = cluster.infer_tp
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_for(preset, cluster)
    build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    out = dict(
        preset=preset.name,
        train_gpus=cluster.train_gpus,
        infer_gpus=cluster.infer_gpus,
        infer_tp=tp,
        infer_ep=cluster.infer_ep,
        quant=cluster.quant or "bf16",
        nic_gbps=cluster.nic_gbps,
        **sizes(plan),
        build_s=round(build_s, 3),
        build_cpu_s=round(build_cpu_s, 3),
    )
    if args.out:
        data = plan.to_bytes()
        with open(args.out, "wb") as f:
            f.write(data)
        out["plan_bytes"] = len(data)
    if not args.no_sim:
        t1 = time.perf_counter()
        r = simulate(plan, cluster, steps=args.steps, record=False, kinds="auto")
        out.update(
            lower_bound_s=round(r.lower_bound_s, 4),
            simulated_s=round(r.simulated_s, 4),
            ratio=round(r.simulated_s / r.lower_bound_s, 4),
            bottleneck=r.bottleneck,
            bound_by=r.bound_by,
            stage_busy_s={k: round(v, 4) for k, v in r.stage_busy_s.items()},
            calibration=cluster.cal.name,
            calibration_source=cluster.cal.source,  # its measured terms' source (the default: issue 13's runtime)
            assumptions=r.assumptions,
            sim_s=round(time.perf_counter() - t1, 3),
        )
    else:
        from .simulate import lower_bound

        lb, bn = lower_bound(plan, cluster)
        out.update(lower_bound_s=round(lb, 4), simulated_s=None, bottleneck=bn)
    if getattr(args, "delta_rate", None) is not None:
        from .delta import estimate, simulate_delta

        terms = _delta_terms(args, cluster.cal)
        if out.get("simulated_s") is not None:  # the delta push simulated (its all-gathers without the dense writes)
            out.update(simulate_delta(plan, cluster, terms, out["simulated_s"], out["lower_bound_s"], args.steps))
        else:
            out.update(estimate(plan, out["lower_bound_s"], None, terms, None))
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs"
    if hasattr(os, "getloadavg"):
        machine += f", load average {os.getloadavg()[0]:.1f}"
    out["machine"] = machine
    return out


def _delta_terms(args, cal):
    """The delta term's inputs: the flags, else the calibration's measured apply rate
    (Calibration.delta_apply_GBps), else wxfer.plan.delta's measured defaults; `source` says
    where each figure comes from."""
    from .delta import delta_terms

    apply = args.delta_apply_gbytes
    terms = delta_terms(args.delta_rate, args.delta_compare_gbytes, apply)
    if apply is None and getattr(cal, "delta_apply_GBps", None):
        terms.apply_GBps = cal.delta_apply_GBps
        cmp_src = terms.source.split("; apply: ")[0]
        terms.source = (
            f"{cmp_src}; apply: {cal.delta_apply_GBps:.4g} GB/s of records from the calibration {cal.name} "
            f"(delta_apply_GBps: {cal.source})"
        )
    return terms


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        out = run(args)
    except ValueError as e:  # mapping / plan errors name the parameter
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.json:
        for k, v in out.items():
            if isinstance(v, int) and k.startswith(("bytes", "max_bytes", "min_bytes")):
                v = f"{v / 1e9:,.2f} GB"
            print(f"{k:>24}: {v}")
    else:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
