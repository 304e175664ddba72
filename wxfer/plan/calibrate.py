"""Calibrations of the simulator: named sets, JSON files, and ``predict()``.

A `wxfer.meta.Calibration` holds the per-task costs the simulator charges on top of the
links (host work per task / parameter / piece, the quantizer and copy rates, per-call
costs of the collective and of a write, a fixed cost per push) and, when measured on a
machine, that machine's link rates.  ``python -m wxfer calibrate --json --out FILE``
(wxfer.tools.calibrate) measures one; ``python -m wxfer plan --calibration FILE|NAME``
and `Calibration` objects passed to `Cluster(calibration=...)` use it.

    from wxfer.plan.calibrate import load, predict
    cal = load("calib.json")                 # or a name of CALIBRATIONS
    seconds = predict(plan, cal)             # the trainers' own plan, this machine's figures
    seconds = predict(plan, cal, assume=dict(write_GBps=50.0))  # a term it lacks, as a named assumption

Every term of a calibration is a measured value > 0, a named assumption, or None named in
`unmeasured` with why (`problems()` lists what breaks this; ``calibrate`` writes a fit that
came out <= 0 as unmeasured, with its samples).  A file of an older ``calibrate`` still loads:
its 0.0 terms are read as unmeasured, with that reason.

Pure Python (no torch, no native extension).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from typing import Any

from ..meta import NONE_MEANS, Calibration, Cluster

# Stage 2 free: no host time, quantize and pack at memory speed (None: Cluster.mem_GBps).
_STAGE2_FREE: dict[str, Any] = dict.fromkeys(
    ("host_task_s", "host_param_s", "host_piece_s", "host_zc_task_s", "pack_launch_s"), 0.0
)
_STAGE2_FREE.update(quant_GBps=None, copy_GBps=None)

# Named calibrations.  "h200" is the default (Calibration()); see its field comments.
CALIBRATIONS: dict[str, Calibration] = {
    "h200": Calibration(),
    # the model before issue 15: stage 2 at memory speed (Cluster.mem_GBps), no host time, gathers
    # and packs pipelined on separate streams; reproduces Kimi-K2 1.315 s / Qwen3-235B 0.594 s
    "free-stage2": Calibration(
        name="free-stage2",
        **_STAGE2_FREE,
        serial=False,
        source="the pre-issue-15 model: stage 2 free (memory speed, no host time)",
    ),
    # the one-pass block-FP8 kernel measured on one H200 (issue 13): 3.3 TB/s on 12288x4096,
    # 3.6 TB/s on 128 grouped experts of 768x2048; 128 experts one launch each: 2.7 ms -> ~21 us per
    # launch; host work still the per-parameter 0.25 ms of today's runtime
    "h200-native": Calibration(
        name="h200-native",
        quant_GBps=3450.0,
        pack_launch_s=21e-6,
        launch_per_piece=False,
        source="one H200, issue 13: native one-pass FP8 kernel, today's host costs",
    ),
    # the kernels as bench_baselines measured them in-process (wxfer.tools.calibrate.measure_kernels) on one
    # H200, 2026-12-01 11:44 UTC (the FSDP2 rows' process): v6 FP8 kernel 3145 GB/s dense, 3305 GB/s on
    # small pieces, 4.59 us per launch, on-device copy 3713 GB/s (read + write).  For a run of that machine
    # whose own figures were not recorded (benchmarks/sim_check.py --kernels); host costs: fit them
    "h200-kernels": Calibration(
        name="h200-kernels",
        quant_GBps=3145.4,
        quant_small_GBps=3304.6,
        copy_GBps=3713.0,
        pack_launch_s=4.59e-6,
        launch_per_piece=False,
        source="one H200, bench_baselines 2026-12-01 11:44 UTC: the kernels measured in-process",
    ),
}


# the fields that are measured figures (what `unmeasured` / `assumptions` may name)
TERMS = frozenset(
    f.name
    for f in fields(Calibration)
    if f.name not in ("name", "source", "unmeasured", "assumptions", "serial", "host_sync", "cpu_shared")
    and f.name not in ("launch_per_piece", "device_shared", "zc_batch", "small_piece_elems")
    and f.name != "delta_apply_GBps"  # the delta term's input (wxfer.plan.delta), None: its default
)


def assume(cal, why: str = "", **terms) -> Calibration:
    """`cal` with `terms` (name=value) put in its fields as named assumptions: each leaves
    `unmeasured` for `assumptions` (with `why`, or the reason it was unmeasured), and a
    simulation that uses it reports it (SimResult.assumptions).  A name that is not a term is
    refused."""
    cal = get(cal)
    bad = sorted(set(terms) - TERMS)
    if bad:
        raise ValueError(f"assume: {bad} are not calibration terms (see wxfer.plan.calibrate.TERMS)")
    un, got = dict(cal.unmeasured), dict(cal.assumptions)
    for k in terms:
        v = terms[k]
        if v is None and k not in NONE_MEANS or isinstance(v, bool) or not isinstance(v, (int, float, type(None))):
            raise ValueError(f"assume: {k} must be a number >= 0 (None only where it means another figure), got {v!r}")
        if v is not None and v < 0:
            raise ValueError(f"assume: {k} must be a number >= 0, got {v!r}")
        got[k] = "%s = %r assumed%s" % (k, terms[k], ": " + why if why else " (unmeasured: %s)" % un.get(k, "-"))
        un.pop(k, None)
    return replace(cal, unmeasured=un, assumptions=got, **terms)


_assume = assume  # for the functions whose argument `assume` hides it


def get(cal) -> Calibration:
    """A Calibration from a Calibration, a name of CALIBRATIONS, a dict or a JSON file path."""
    if isinstance(cal, Calibration):
        return cal
    if cal is None:
        return Calibration()
    if isinstance(cal, dict):
        return from_dict(cal)
    if isinstance(cal, str):
        if cal in CALIBRATIONS:
            return CALIBRATIONS[cal]
        return load(cal)
    raise TypeError(
        f"calibration must be a Calibration, a name ({sorted(CALIBRATIONS)}), a dict or a path, "
        f"got {type(cal).__name__}"
    )


# the pre-issue-15 model's zeros are that model's own assumptions
CALIBRATIONS["free-stage2"] = assume(
    CALIBRATIONS["free-stage2"],
    why="the pre-issue-15 model: stage 2 free",
    host_param_s=0.0,
    host_zc_task_s=0.0,
    pack_launch_s=0.0,
)


def from_dict(d: dict) -> Calibration:
    """The Calibration in a dict (what `to_dict` / ``calibrate --json`` write; unknown keys
    such as the measurements' details are ignored, a wrong type is refused by name)."""
    d = d.get("calibration", d)
    kw: dict[str, Any] = {}
    for f in fields(Calibration):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name in ("name", "source"):
            kw[f.name] = str(v)
        elif f.name in ("unmeasured", "assumptions"):  # term -> why
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in list(v) + list(v.values())):
                raise ValueError(f"calibration field {f.name} must map term names to reasons, got {v!r}")
            bad = sorted(set(v) - TERMS)
            if bad:
                raise ValueError(f"calibration field {f.name}: {bad} are not calibration terms")
            kw[f.name] = dict(v)
        elif f.type in ("bool", bool):  # serial, host_sync, cpu_shared, launch_per_piece, device_shared
            if not isinstance(v, bool):
                raise ValueError(f"calibration field {f.name} must be true or false, got {v!r}")
            kw[f.name] = v
        elif v is None:
            kw[f.name] = None
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"calibration field {f.name} must be a number >= 0, got {v!r}")
            kw[f.name] = float(v)
    if str(d.get("name", "")).startswith("measured-"):  # a file of `python -m wxfer calibrate`
        _older_zeros(kw)
    return Calibration(**kw)


# what an older `calibrate` wrote as 0.0: a term it did not measure, or a fit clamped at 0
OLDER_ZERO = (
    "0.0 in a file of an older `python -m wxfer calibrate`, which wrote unmeasured terms and fits that came "
    "out <= 0 as 0.0: read as unmeasured"
)


def _older_zeros(kw: dict) -> None:
    """In the fields of a calibrate file (`kw`), a term that is 0.0 (or absent: the default
    0.0) and not an assumption: None, named unmeasured (OLDER_ZERO, or the file's own reason)."""
    un, got = dict(kw.get("unmeasured", {})), kw.get("assumptions") or {}
    defaults = {f.name: f.default for f in fields(Calibration)}
    for k in sorted(TERMS):
        v = kw.get(k, defaults[k])
        if v == 0.0 and k not in got:
            kw[k] = None
            un[k] = un[k] + " (stored as 0.0)" if k in un else OLDER_ZERO
    kw["unmeasured"] = un
    kw.setdefault("assumptions", {})


def problems(cal) -> list:
    """What keeps `cal` from having every term a value > 0 (measured or assumed, with its
    reason) or None named in `unmeasured` with why: [(term, what)], empty when none."""
    cal = get(cal)
    out = []
    for k in sorted(TERMS):
        v = getattr(cal, k)
        src, why = cal.source_of(k)
        if src == "unmeasured":
            if v is not None:
                out.append((k, "named unmeasured but holds %r" % v))
            elif not why:
                out.append((k, "unmeasured with no reason"))
        elif v is None:
            if src != "instead":
                out.append((k, "None with no reason"))
        elif v <= 0 and src != "assumed":
            out.append((k, "%r, measured as such? (not marked unmeasured or assumed)" % v))
    return out


def strict(cal: Calibration, why: dict | None = None) -> Calibration:
    """`cal` (a measured one) with every term that came out <= 0 made None and named in
    `unmeasured`: why[term] (e.g. the fit and its samples), else "came out <= 0"."""
    un = dict(cal.unmeasured)
    put: dict[str, Any] = {}
    for k in sorted(TERMS):
        v = getattr(cal, k)
        if v is not None and v <= 0 and k not in cal.assumptions:
            put[k] = None
            un[k] = FIT_AT_ZERO + ((why or {}).get(k) or "measured %r" % v)
    return replace(cal, unmeasured=un, **put)


FIT_AT_ZERO = "came out <= 0: "  # how strict() names a term whose measurement came out <= 0


def fits_at_zero(cal) -> list:
    """The terms of `cal` whose measurement came out <= 0 (strict), or that an older
    calibrate file stored as 0.0: those a caller may choose to assume at 0, by name
    (``assume(cal, why=..., **dict.fromkeys(fits_at_zero(cal), 0.0))``)."""
    cal = get(cal)
    return sorted(k for k, v in cal.unmeasured.items() if v.startswith((FIT_AT_ZERO, OLDER_ZERO)))


def to_dict(cal: Calibration) -> dict:
    return asdict(cal)


def load(path: str) -> Calibration:
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"calibration {path!r}: no such file, and not a name of {sorted(CALIBRATIONS)}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path}: not JSON ({e})") from None
    return from_dict(d)


def save(cal: Calibration, path: str, extra: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump(dict(to_dict(cal), **(extra or {})), f, indent=1)


def cluster_for(plan, cal, assume: dict | None = None, **kw) -> Cluster:
    """A Cluster describing the machine a calibration was measured on, sized for `plan`:
    the plan's trainers and receivers on one host (all-gathers at the measured all-gather
    rate, writes at the measured write rate), `cal`'s costs.  `kw` overrides any field;
    `assume`: {term: value} given as named assumptions (`assume()`).  A calibration with no
    write rate (unmeasured, or a named set that has none) is refused by name unless `kw` or
    `assume` gives one."""
    cal = get(cal)
    if assume:
        cal = _assume(cal, why="given by the caller (assume=)", **assume)
    if cal.write_GBps is None and kw.get("write_GBps") is None:
        src, why = cal.source_of("write_GBps")
        raise ValueError(
            "calibration %r has no write_GBps (%s), which a prediction on the machine it describes needs; "
            "pass assume={'write_GBps': ...} or a Cluster with its links"
            % (cal.name, why if src == "unmeasured" else "None")
        )
    world = plan.train_world
    ngpu = int(plan.gpu_of.max()) + 1
    base = dict(
        train_gpus=world,
        infer_gpus=ngpu,
        infer_tp=plan.tp,
        infer_ep=plan.ep,
        quant=plan.quant,
        gpus_per_node=max(world, ngpu, 1),
        dense_shard=world,
        expert_shard=1,
        write_GBps=cal.write_GBps,
    )
    base.update(kw)
    return cal.apply(Cluster(**base))


def run(
    plan,
    calibration,
    cluster: Cluster | None = None,
    steps: int = 400,
    record: bool = False,
    kinds: dict | None = None,
    assume: dict | None = None,
    **cluster_kw,
):
    """The SimResult of one push of `plan` with `calibration` (a Calibration, a name or a JSON
    path) on the machine it describes (`cluster_for`), or on `cluster` (its link rates, this
    calibration's costs); kinds: task -> kind (wxfer.plan.kinds; a Sender's task_kinds());
    assume: {term: value} for terms it lacks, as named assumptions (SimResult.assumptions)."""
    from .simulate import simulate

    cal = get(calibration)
    if assume:
        cal = _assume(cal, why="given by the caller (assume=)", **assume)
    c = cluster_for(plan, cal, **cluster_kw) if cluster is None else replace(cluster, calibration=cal)
    return simulate(plan, c, steps=steps, record=record, kinds=kinds)


def predict(
    plan,
    calibration,
    rank: int | None = None,
    cluster: Cluster | None = None,
    steps: int = 400,
    kinds: dict | None = None,
    assume: dict | None = None,
    **cluster_kw,
) -> float:
    """Seconds one push of `plan` takes (see run()).  rank: None for the whole push (the
    slowest trainer), else when that trainer rank's last write lands (plus the per-push
    costs after it)."""
    cal = get(calibration)
    r = run(plan, cal, cluster, steps, rank is not None, kinds, assume, **cluster_kw)
    if rank is None:
        return float(r.simulated_s)
    ends = [e for st, rk, _, _, e in r.timeline if rk == rank and st in ("write", "quant", "allgather")]
    return float(max(ends, default=0.0)) + (cal.push_end_s or 0.0) + (cal.push_fixed_s or 0.0)
