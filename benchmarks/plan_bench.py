"""Plan build time, plan size and simulated update time for the reference configurations.

    .venv/bin/python benchmarks/plan_bench.py            # Kimi-K2 and Qwen3-235B
    .venv/bin/python benchmarks/plan_bench.py --all      # plus variants (TP-sliced experts, offload, ...)
    .venv/bin/python benchmarks/plan_bench.py --calibration free-stage2   # the model before issue 15

Prints one line per configuration and the machine it ran on.  Targets (issue 3):
Kimi-K2 simulated within 3% of the lower bound, plan built in <= 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from wxfer.meta import Cluster  # noqa: E402
from wxfer.plan import plan_for  # noqa: E402
from wxfer.plan.cli import sizes  # noqa: E402
from wxfer.plan.simulate import simulate  # noqa: E402


def _cfg(preset: str, train: int, infer: int, tp: int, quant="fp8", **kw):
    """(preset, Cluster fields) of `train` trainer GPUs writing `infer` inference GPUs at TP `tp`."""
    return preset, dict(train_gpus=train, infer_gpus=infer, infer_tp=tp, quant=quant, **kw)


CONFIGS = {
    "kimi-k2 256->8x16 EP fp8": _cfg("kimi-k2", 256, 128, 16, infer_ep=True),
    "qwen3-235b 128->4x8 EP fp8": _cfg("qwen3-235b", 128, 32, 8, infer_ep=True),
}
EXTRA = {
    "kimi-k2 256->8x16 TP-experts fp8": _cfg("kimi-k2", 256, 128, 16, infer_ep=False),
    "kimi-k2 256->8x16 EP fp8 cpu-offload": _cfg("kimi-k2", 256, 128, 16, infer_ep=True, cpu_offload=True),
    "qwen3-235b 128->4x8 EP bf16": _cfg("qwen3-235b", 128, 32, 8, quant=None, infer_ep=True),
    "qwen3-8b 16->4x2 fp8": _cfg("qwen3-8b", 16, 8, 2),
}


def run(name, preset, kw, steps, calibration=None):
    from wxfer.plan.calibrate import get

    c = Cluster(nic_gbps=400, calibration=get(calibration), **kw)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_for(preset, c)
    build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    data = plan.to_bytes()
    enc = time.perf_counter() - t1
    t2 = time.perf_counter()
    r = simulate(plan, c, steps=steps, record=False, kinds="auto")
    sim = time.perf_counter() - t2
    return dict(
        config=name,
        **sizes(plan),
        plan_bytes=len(data),
        build_s=round(build, 2),
        build_cpu_s=round(build_cpu, 2),
        encode_s=round(enc, 2),
        sim_wall_s=round(sim, 2),
        lower_bound_s=round(r.lower_bound_s, 4),
        simulated_s=round(r.simulated_s, 4),
        ratio=round(r.simulated_s / r.lower_bound_s, 4),
        bottleneck=r.bottleneck,
        bound_by=r.bound_by,
        calibration=c.cal.name,
        stage_busy_s={k: round(v, 4) for k, v in r.stage_busy_s.items()},
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--calibration",
        default=None,
        help="a name (h200 = default, h200-native, free-stage2) or a file from `python -m wxfer calibrate --out FILE`",
    )
    a = ap.parse_args(argv)
    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}"
    )
    cfgs = dict(CONFIGS, **(EXTRA if a.all else {}))
    for name, (preset, kw) in cfgs.items():
        d = run(name, preset, kw, a.steps, a.calibration)
        if a.json:
            print(json.dumps(d))
        else:
            print(
                f"{name:40s} build {d['build_s']:5.2f} s (cpu {d['build_cpu_s']:5.2f} s)  sim {d['sim_wall_s']:5.2f} s  "  # noqa: E501
                f"transfers {d['transfers']:>9,}  plan {d['plan_bytes'] / 1e6:6.2f} MB  "
                f"max/GPU {d['max_bytes_per_infer_gpu'] / 1e9:6.2f} GB  lower bound {d['lower_bound_s']:.3f} s  "
                f"simulated {d['simulated_s']:.3f} s  ratio {d['ratio']:.4f}  ({d['bottleneck']}; {d['calibration']}: "
                f"bound by {d['bound_by']})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
