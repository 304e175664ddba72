"""bench_baselines' predicted_s (issue 24): the calibration made before the run, by
placement, and the prediction of a Sender's push from it alone (bb_fsdp calls `predicted`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def placement_of(layout: str, dry_run: bool) -> str:
    """The calibrate placement (wxfer.tools.calibrate_host) of a layout: colocated rows have the
    receiver on the trainer's GPU (same), disagg rows on another GPU (gpu); the dry run's
    receivers are behind fabric tcp (host)."""
    if dry_run:
        return "host"
    return "same" if layout == "colocated" else "gpu"


def calibrations(args, layouts, out) -> dict:
    """{placement: calibration dict (what calibrate --json writes)} for predicted_s: the file
    --calibration names (for its placement), else (auto) one ``python -m wxfer calibrate`` per
    placement the layouts need, each in its own process before any configuration runs; none:
    {}.  A calibrate that fails is reported in the dict as {"error": ...}."""
    how = getattr(args, "calibration", "auto") or "auto"
    if how == "none":
        return {}
    if how != "auto":
        try:
            with open(how) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:  # the run goes on (fitted_s); each row says why it has no prediction
            why = f"--calibration {how}: {type(e).__name__}: {e}"
            return {placement_of(l, args.dry_run): dict(error=why) for l in layouts}
        return {(d.get("measured") or {}).get("placement") or "unknown": dict(d, file=os.path.abspath(how))}
    got = {}
    for pl in sorted({placement_of(l, args.dry_run) for l in layouts}):
        path = os.path.join(out or ".", "calibration-%s.json" % pl)
        cmd = [sys.executable, "-m", "wxfer", "calibrate", "--json", "--out", path, "--placement", pl]
        cmd += ["--device", "cpu", "--quick"] if args.dry_run else []
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(f"calibrate --placement {pl}: rc {p.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
        if p.returncode != 0 or not os.path.exists(path):
            got[pl] = dict(error="calibrate failed (rc %d): %s" % (p.returncode, p.stderr.strip()[-500:]))
            continue
        with open(path) as f:
            got[pl] = dict(json.load(f), file=os.path.abspath(path))
    return got


def predicted(sender, dev, a: dict) -> dict:
    """The simulator's prediction of this push from a calibration made before the run
    (``a["calibrations"]``: bench_baselines --calibration FILE, or one calibrate process per
    placement at the start) alone: the trainers' own plan, each task's kind as this Sender
    runs it (structure, not timing), the cluster the calibration describes (its measured
    write, copy, quantizer, H2D rates and host costs); nothing from this run's traces or
    timings.  Returns predicted_s (or predicted_error) and what it used."""
    from bb_fsdp import _offloaded

    cals = a.get("calibrations") or {}
    if not cals:
        return {}
    cfg = a.get("_cfg") or {}
    want = placement_of(cfg.get("layout", ""), a.get("dry_run", False))
    try:
        from collections import Counter

        from wxfer.plan.calibrate import assume, fits_at_zero, from_dict, run

        d = cals.get(want)
        if d is None:
            raise ValueError(f"no calibration for placement {want!r} (have {sorted(cals)})")
        if "error" in d:
            raise RuntimeError(d["error"])
        cal = from_dict(d)
        # a term whose fit came out <= 0 is unmeasured in the file: taken at 0 here, listed as assumed
        cal = assume(cal, why="its fit came out <= 0", **dict.fromkeys(fits_at_zero(cal), 0.0))
        kinds = sender.task_kinds()
        offload = dev.type == "cuda" and _offloaded(sender, dev)
        r = run(sender.plan, cal, kinds=kinds, cpu_offload=offload, watermark_bytes=sender.watermark or (1 << 50))
        return dict(
            predicted_s=r.simulated_s,
            predicted_bound_by=r.bound_by,
            predicted_terms=r.terms,
            predicted_assumptions=r.assumptions,
            predicted_kinds=dict(Counter(kinds.values())),
            predicted_calibration=dict(name=cal.name, source=cal.source, file=d.get("file"), placement=want),
        )
    except Exception as e:  # noqa: BLE001 -- the measurement stands without it
        return dict(predicted_error=f"{type(e).__name__}: {e}")
