"""``python -m wxfer demo``: the whole product on one machine.

Spawns trainer processes (FSDP2 ``fully_shard``; gloo on CPU, NCCL on GPUs) training
transformers' own ``Qwen3ForCausalLM`` (``--moe``: ``Qwen3MoeForCausalLM``, experts fused
3-D as transformers 5 stores them) built from a small config with random weights, and
inference worker processes holding the same model in vLLM's layout (fused qkv / gate_up /
w13, TP or EP shards, FP8 block weights with ``--fp8``).  Trainers train a few steps on
random data and ``push()`` after each; then

  (a) every inference worker checks that each of its parameters equals, bit for bit,
      what the mapping's reference packing makes of the trainers' current weights;
  (b) this process rebuilds each replica's model from its shards (de-fuse, gather TP,
      dequantize), runs it through the transformers model's own forward and compares its
      logits with the trainer's, within FP8 tolerance.

Prints per-step push time and GB/s; ``--json`` prints one JSON object last, with
``simulated_s``: the simulator on the trainers' own plan, calibrated on this machine right
after the run (``python -m wxfer calibrate --quick``; ``--no-simulate`` skips it), or
predicted from a calibration made before, in its own process (``--calibration FILE``:
``python -m wxfer calibrate --json --out FILE``); ``load_average`` says how busy the
machine was (before the run, after it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from .. import envs
from .demo_ranks import TIMEOUT, trainer_main, worker_main


# --------------------------------------------------------------------------- helpers


def _cfg(size: str, moe: bool) -> dict:
    from ..models import CONFIGS

    return dict(CONFIGS["tiny-moe" if moe else size])


# --------------------------------------------------------------------------- the parent


def _spawn(a: dict, procs: list) -> None:
    """The inference workers and the trainer ranks started (spawn), into `procs` as
    [(who, process)]."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for g in range(a["replicas"] * a["tp"]):
        procs.append(("inference worker gpu %d" % g, ctx.Process(target=worker_main, args=(g, a), daemon=True)))
    for r in range(a["trainers"]):
        procs.append(("trainer rank %d" % r, ctx.Process(target=trainer_main, args=(r, a["trainers"], a), daemon=True)))
    for _, p in procs:
        p.start()


def _step_line(n: int, s: dict) -> str:
    ok = all(r["ok"] for r in s["reports"])
    return "step %d%s: push %.3f s, %d bytes, %.3f GB/s, receivers bit-exact: %s" % (
        n,
        "" if s["trained"] else " (nothing changed)",
        s["step_s"],
        s["moved"],
        s["moved"] / max(s["step_s"], 1e-9) / 1e9,
        ok,
    )


def _watch(ctl, procs, timeout: float, log):
    """Log each step as rank 0 reports it until every process has exited: None, or
    [(who, exit code or why)] once one failed or `timeout` passed."""
    deadline = time.monotonic() + timeout
    shown = 0
    while True:
        while ctl.check("demo/step/%d" % (shown + 1)):
            shown += 1
            log(_step_line(shown, ctl.get_json("demo/step/%d" % shown, "step report")))
        alive = [p for _, p in procs if p.is_alive()]
        bad = [(w, p.exitcode) for w, p in procs if not p.is_alive() and p.exitcode not in (0, None)]
        if bad:
            return bad
        if not alive:
            return None
        if time.monotonic() > deadline:
            return [("timeout", f"the demo did not finish within {timeout:.0f} s")]
        time.sleep(0.05)


def _raise_failed(ctl, procs, failed, a: dict, log):
    """Let the others fail too (setup errors reach every process), log what each reported,
    raise naming who exited how."""
    end = time.monotonic() + 15
    while any(p.is_alive() for _, p in procs) and time.monotonic() < end:
        time.sleep(0.1)
    errs = {}
    for k in ["trainer%d" % r for r in range(a["trainers"])] + ["worker%d" % g for g in range(a["replicas"] * a["tp"])]:
        if ctl.check("demo/error/" + k):
            errs[k] = ctl.get("demo/error/" + k, "error").decode(errors="replace")
    msg = "; ".join("%s exited with %s" % (w, c) for w, c in failed)
    for k, e in errs.items():
        log("---- %s failed:\n%s" % (k, e.rstrip()))
    raise RuntimeError("wxfer demo failed: " + msg)


def _check_logits(a: dict):
    """(b): every replica's logits, its model rebuilt from its shards, against transformers'
    forward of the trainers' weights at the inference side's BF16 precision (and against the
    trainers' own FSDP2 forward in float32, reported beside it): the result's keys logits_ok
    (all close), logits_rel_err and logits_rel_err_fp32 (per replica)."""
    import torch
    from ..models import logits_close, logits_from_shards, logits_of_weights

    cfg, tp, steps, tmp = a["cfg"], a["tp"], a["steps"], a["dir"]
    ref = torch.load(os.path.join(tmp, "step%d_train.pt" % steps))
    ref_logits = logits_of_weights(cfg, ref["weights"], ref["ids"], torch.bfloat16)
    logits_ok, logit_err, train_err = True, [], []
    for rep in range(a["replicas"]):
        shards = [torch.load(os.path.join(tmp, "step%d_gpu%d.pt" % (steps, rep * tp + r))) for r in range(tp)]
        got = logits_from_shards(cfg, shards, ref["ids"], a["ep"])
        ok, err = logits_close(ref_logits, got, "fp8" if a["fp8"] else None)
        logits_ok &= ok
        logit_err.append(round(err, 5))
        train_err.append(round(logits_close(ref["logits"], got, None)[1], 5))
    return dict(logits_ok=logits_ok, logits_rel_err=logit_err, logits_rel_err_fp32=train_err)


# The run's settings its result repeats, as given.
_SETTINGS = ("trainers", "replicas", "tp", "fp8", "cpu_offload", "moe", "ep")


def _result(a: dict, res: dict, per_step: list, total_s: float, load0) -> dict:
    """The demo's result (what --json prints) from the trainers' result and the step reports."""
    bitexact = all(r["ok"] for s in per_step for r in s["reports"])
    logits = _check_logits(a)
    unchanged_ok = None
    if a["unchanged_step"]:
        last, prev = per_step[-1], per_step[-2]
        unchanged_ok = last["moved"] == prev["moved"] and all(r["same_as_previous"] for r in last["reports"])
    bps = sum(r["bytes_per_step"] for r in res["ranks"])
    step_s = res["step_s"]
    return dict(
        steps=len(step_s),
        verified=bool(bitexact and logits["logits_ok"] and unchanged_ok is not False),
        bitexact=bitexact,
        **logits,
        unchanged_ok=unchanged_ok,
        transport=res["transport"],
        bytes_per_step=bps,
        moved_bytes=res["moved"],
        step_s=step_s,
        gbps=bps / min(step_s) / 1e9,
        gbps_mean=bps * len(step_s) / sum(step_s) / 1e9,
        **{k: a[k] for k in _SETTINGS},
        model=a["size"] if not a["moe"] else "tiny-moe",
        tasks=res["tasks"],
        mesh_groups=res["groups"],
        transfers=res["transfers"],
        setup_s=max(r["setup_s"] for r in res["ranks"]),
        held_peak=max(r["held_peak"] for r in res["ranks"]),
        total_s=total_s,
        load_average=dict(before=load0, after=os.getloadavg() if hasattr(os, "getloadavg") else None),
        device="cuda" if a["gpu"] else "cpu",
        machine="%s, %s, %d CPUs" % (platform.node(), platform.machine(), os.cpu_count() or 0),
        mismatches=[m for s in per_step for r in s["reports"] for m in r["mismatches"]][:20],
        receiver_regions=[
            (r["registration"]["params"], r["registration"]["regions"], r["registration"]["register_mode"])
            for r in per_step[0]["reports"]
        ],
    )


def _host_store(port: int):
    """The demo's TCPStore, hosted in this process."""
    from datetime import timedelta
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=TIMEOUT), wait_for_workers=False)


def _delta_args(delta, change_rate, dense_steps) -> dict:
    """The processes' delta arguments: Sender(delta=...), the receivers' staging area, the
    synthetic change rate (None: train), the steps pushed dense on purpose (bench_delta.py)."""
    if change_rate is not None and not 0.0 <= float(change_rate) <= 1.0:
        raise ValueError(f"--change-rate must be a fraction in [0, 1], got {change_rate}")
    if isinstance(delta, (int, float)) and not isinstance(delta, bool):  # a link pinned at `delta` Gb/s
        delta = dict(link_Bps=float(delta) * 1e9 / 8, measure_link=False)
    return dict(delta=delta, change_rate=change_rate, delta_staging="64MiB", dense_steps=list(dense_steps))


def _delta_result(a: dict, res: dict, per_step: list) -> dict:
    """The delta fields of the result (--delta): per step what was sent against a dense push
    (``dense_bytes``: every rank's bytes per step), the changed fraction of the destination
    bytes compared, the receivers' apply, and ``verified`` (every receiver's bytes after its
    apply() equal the reference packing of the trainers' weights, i.e. a dense push's, every
    step).  Step 1 is dense by rule; the totals are over the later steps."""
    dense = sum(r["bytes_per_step"] for r in res["ranks"])
    steps = []
    for i, s in enumerate(per_step):
        d = s["delta"]
        steps.append(
            dict(
                step=i + 1,
                sent_bytes=s["moved"],
                record_bytes=d["record_bytes"],
                tasks_delta=d["tasks_delta"],
                tasks_dense=d["tasks_dense"],
                tasks_dense_cost=d.get("tasks_dense_cost", 0),
                tasks_bypassed=d.get("tasks_bypassed", 0),
                tasks_scatter=d.get("tasks_scatter", 0),  # stored in the receivers' memory (cuda_ipc)
                scatter_bytes=d.get("scatter_bytes", 0),
                change_rate=d["changed_bytes"] / max(d["compared_bytes"], 1),
                apply_s=max(r["apply"]["applied_s"] for r in s["reports"]),
                push_s=s["step_s"],
                submit_s=d.get("submit_s"),
                writes_s=d.get("writes_s"),
                # seconds summed over the trainer ranks: making the bytes (of which the
                # all-gathers), the compare with the shadow, compare + encode, the shadow copy
                **{k: d.get(k) for k in ("make_s", "gather_s", "compare_s", "encode_s", "keep_s")},
                bitexact=all(r["ok"] for r in s["reports"]),
            )
        )
    forced = set(a.get("dense_steps", ()))
    later = [x for x in steps[1:] if x["step"] not in forced] or steps
    dense_s = [x["push_s"] for x in steps if x["step"] in forced and x["step"] > 1]
    extra = {}
    if dense_s:  # dense pushes of the same run (forced; the shadow kept): the time to compare with
        extra["dense_push_s"] = sorted(dense_s)[len(dense_s) // 2]
        extra["delta_vs_dense_s"] = sorted(x["push_s"] for x in later)[len(later) // 2] / extra["dense_push_s"]
    return dict(
        extra,
        delta=True,
        delta_link="measured" if a["delta"] is True else a["delta"],
        change_rate_requested=a["change_rate"],
        delta_bytes=sum(x["sent_bytes"] for x in later) // len(later),
        dense_bytes=dense,
        change_rate=sum(x["change_rate"] for x in later) / len(later),
        delta_vs_dense_bytes=sum(x["sent_bytes"] for x in later) / len(later) / max(dense, 1),
        first_push_s=steps[0]["push_s"],
        delta_push_s=sorted(x["push_s"] for x in later)[len(later) // 2],
        apply_s=max(x["apply_s"] for x in later),
        delta_steps=steps,
    )


def _add_simulated(out: dict, ctl, calibration, log) -> None:
    """The simulator on the trainers' own plan, calibrated here after the run (issue 15), or
    from `calibration`, into `out`."""
    from ..runtime import control
    from .calibrate import simulate_measured

    step_s = out["step_s"]
    plan = control.decode_result(ctl.get("plan", "the trainers' plan"), "trainer rank 0 (controller)")
    out.update(simulate_measured(plan, calibration, log=log))
    out["simulated_from"] = calibration or "calibrate --quick in this process, after the run"
    if "simulated_s" in out:
        out["simulated_vs_median"] = out["simulated_s"] / sorted(step_s)[len(step_s) // 2]
        log(
            "simulated %.3f s (bound by %s) against a median push of %.3f s"
            % (out["simulated_s"], out["simulated_bound_by"], sorted(step_s)[len(step_s) // 2])
        )
        for why in (out.get("simulated_assumptions") or {}).values():
            log("  assumed: " + why)
    else:
        log("not simulated: " + out["simulated_error"])


def _summary(out: dict) -> str:
    """The demo's last line."""
    err = out["logits_rel_err"]
    return (
        "wxfer demo: %d trainers -> %d replicas x TP%d (%s%s%s), %s: %d bytes/step, best %.3f s "
        "(%.3f GB/s), bit-exact %s, logits %s%s, verified=%s"
        % (
            out["trainers"],
            out["replicas"],
            out["tp"],
            "FP8" if out["fp8"] else "BF16",
            ", CPU offload" if out["cpu_offload"] else "",
            ", MoE expert sub-mesh" + (", EP inference" if out["ep"] else "") if out["moe"] else "",
            out["transport"],
            out["bytes_per_step"],
            min(out["step_s"]),
            out["gbps"],
            out["bitexact"],
            "ok (max rel err %.3g)" % max(err) if out["logits_ok"] else "MISMATCH %s" % err,
            "" if out["unchanged_ok"] is None else ", unchanged step identical %s" % out["unchanged_ok"],
            out["verified"],
        )
    )


def _demo_trainers(trainers: int | None, gpu: bool) -> int:
    """The number of trainer ranks: `trainers`, by default 2 (on GPUs: min(2, GPUs))."""
    import torch

    if trainers is None:
        trainers = min(2, torch.cuda.device_count()) if gpu else 2
    if gpu and trainers > torch.cuda.device_count():
        raise ValueError(
            f"--trainers {trainers} needs {trainers} GPUs (NCCL: one rank per GPU), this machine "
            f"has {torch.cuda.device_count()}; use fewer trainers or WXFER_DEMO_CPU=1"
        )
    return trainers


def _stop(procs) -> None:
    for _, p in procs:
        if p.is_alive():
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_demo(
    trainers: int | None = None,
    replicas: int = 2,
    tp: int = 2,
    steps: int = 3,
    fp8: bool = False,
    cpu_offload: bool = False,
    moe: bool = False,
    size: str = "small",
    unchanged_step: bool = False,
    ep: bool = False,
    batch: int = 4,
    seq: int = 64,
    lr: float = 1e-3,
    watermark: str = "256MiB",
    transport: str = "auto",
    trace_dir: str | None = None,
    timeout: float = 600.0,
    log=print,
    simulate: bool = False,
    calibration: str | None = None,
    delta: bool = False,
    change_rate: float | None = None,
    dense_steps: tuple = (),
) -> dict:
    """Run the demo (the module's docstring says what) and return its result."""
    import torch
    from ..runtime import control

    gpu = torch.cuda.is_available() and envs.get("WXFER_DEMO_CPU") != "1"
    trainers = _demo_trainers(trainers, gpu)
    port, name = control.free_port(), "demo%d" % os.getpid()
    ctl = control.Control(_host_store(port), name, TIMEOUT)
    tmp = tempfile.mkdtemp(prefix="wxfer-demo-")
    a = dict(
        store="127.0.0.1:%d" % port,
        name=name,
        master_port=control.free_port(),
        cfg=_cfg(size, moe),
        size=size,
        tp=tp,
        replicas=replicas,
        trainers=trainers,
        steps=steps,
        fp8=fp8,
        cpu_offload=cpu_offload,
        moe=moe,
        ep=ep,
        unchanged_step=unchanged_step,
        batch=batch,
        seq=seq,
        lr=lr,
        watermark=watermark,
        gpu=gpu,
        transport=transport,
        dir=tmp,
        trace_dir=trace_dir,
        **_delta_args(delta, change_rate, dense_steps),
    )
    procs = []
    t_start = time.perf_counter()
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        _spawn(a, procs)
        failed = _watch(ctl, procs, timeout, log)
        if failed:
            _raise_failed(ctl, procs, failed, a, log)
        res = ctl.get_json("demo/result", "the trainers' result")
        total_s = time.perf_counter() - t_start
        per_step = [ctl.get_json("demo/step/%d" % s, "step report") for s in range(1, len(res["step_s"]) + 1)]
        out = _result(a, res, per_step, total_s, load0)
        if delta:
            out.update(_delta_result(a, res, per_step))
        if simulate:
            _add_simulated(out, ctl, calibration, log)
        log(_summary(out))
        return out
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _delta_arg(args):
    """run_demo's `delta` from the flags: False, True, a pinned link's Gb/s, or a dict of options."""
    if not args.delta:
        return False
    if args.delta_scatter is None:
        return args.delta_link_gbps or True
    opts = dict(scatter=args.delta_scatter)
    if args.delta_link_gbps:
        opts.update(link_Bps=args.delta_link_gbps * 1e9 / 8, measure_link=False)
    return opts


def _delta_flags(ap) -> None:
    """--delta, --delta-link-gbps, --delta-scatter, --change-rate (docs/delta.md)."""
    ap.add_argument(
        "--delta",
        action="store_true",
        help="Sender(delta=True): after the first (dense) push send only the changed bytes; receivers apply() them",
    )
    ap.add_argument(
        "--delta-link-gbps",
        type=float,
        default=None,
        help="with --delta: the chooser's link throughput pinned at this many Gb/s (default: measured from the "
        "first, dense push; on one host that is loopback, where records rarely pay)",
    )
    ap.add_argument(
        "--delta-scatter",
        choices=("auto", "force", "off"),
        default=None,
        help="with --delta on cuda_ipc: Sender(delta={'scatter': ...}): the changed bytes stored straight into the "
        "receivers' memory by a trainer kernel where cheapest (auto, the default), for every mapped task (force: "
        "one GPU), or never (off)",
    )
    ap.add_argument(
        "--change-rate",
        type=float,
        default=None,
        help="instead of training, change this fraction of every parameter's elements each step (e.g. 0.01)",
    )


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m wxfer demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", type=int, default=None, help="default 2 (on GPUs: min(2, GPUs))")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 block weights on the inference side")
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy on the trainers")
    ap.add_argument(
        "--moe",
        action="store_true",
        help="tiny Qwen3-MoE (transformers 5 fused experts), experts on their own mesh of a 2 x N trainer mesh",
    )
    ap.add_argument("--ep", action="store_true", help="with --moe: expert-parallel inference layout")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument(
        "--unchanged-step",
        action="store_true",
        help="push once more without training: same bytes, receivers bit-identical",
    )
    ap.add_argument("--watermark", default="256MiB")
    _delta_flags(ap)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--trace-dir", default=None, help="write a Chrome trace per trainer rank here")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument(
        "--no-simulate", action="store_true", help="skip calibrating this machine and simulating the plan (simulated_s)"
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="simulate from this calibration (a file of python -m wxfer calibrate --json --out FILE, made "
        "before, in its own process) instead of calibrating in this process after the run",
    )
    args = ap.parse_args(argv)
    try:
        res = run_demo(
            args.trainers,
            args.replicas,
            args.tp,
            args.steps,
            args.fp8,
            args.cpu_offload,
            args.moe,
            args.size,
            args.unchanged_step,
            ep=args.ep,
            watermark=args.watermark,
            transport=args.transport,
            trace_dir=args.trace_dir,
            timeout=args.timeout,
            simulate=not args.no_simulate,
            calibration=args.calibration,
            delta=_delta_arg(args),
            change_rate=args.change_rate,
        )
    except Exception as e:  # noqa: BLE001
        print("wxfer demo: %s" % e, file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    dict(steps=0, verified=False, error=str(e), transport="", bytes_per_step=0, step_s=[], gbps=0.0)
                )
            )
        return 1
    if args.json:
        print(json.dumps(res))
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
