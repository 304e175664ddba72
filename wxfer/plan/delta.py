"""The simulator's delta term (issue 36): what a delta push costs against the dense one.

A delta push (``Sender(delta=True)``, docs/delta.md) still makes every destination byte on the
trainer (stage 1, the all-gathers, fusion, FP8), compares it with the shadow in the same pass
(the fused kernel reads the shadow too), sends only the changed bytes as records, and the
receivers apply them after the step.  ``simulate_delta`` runs the simulator itself on that push:

  * the plan with every transfer's bytes scaled to its records (``records_fraction(rate)``), so
    that the all-gathers' cross-node rings share the NICs with the records only, not with the
    dense writes (in a dense simulation they do: its all-gather stage is stretched by the writes,
    which a delta push does not pay);
  * the pack stage slowed by the compare: each FP8 task reads its shadow (its packed bytes) and
    its fresh bytes again at ``compare_GBps``, added to the quantizer's time per byte;
  * the receivers' apply after the push: max bytes per inference GPU x records_fraction /
    ``apply_GBps``.

    delta_s = simulated (records plan, pack + compare) + apply

The runtime writes a receiver's records in one write after the task loop, the model per task
(the records are 1-2% of the bytes: the difference is the records' own link time, in
``delta_link_s``).  On a GPU the runtime reads back each task's count of changed bytes before it
chooses and goes on to the next task (wxfer.runtime.delta_send), so the delta simulation's hosts
wait for each packing (``simulate(host_waits_pack=True)``): a rank's next all-gather is issued
after its last task's fused kernel, count and records.  ``estimate`` is the closed form used
without a simulation (``--no-sim``): max(busiest non-link stage + compare, link, dense_s -
lower_bound_s + link) + apply.  The chooser falls back to dense (``delta_pays`` False,
``chosen_s`` = the dense push) where delta is not shorter.  ``rate`` is the fraction of
destination *bytes* that changed (the FP8 bytes rate for an FP8 destination, as
benchmarks/bench_delta.py measures it).

Where the default rates come from (``SOURCE``; each run on one H100):

  * compare 785 GB/s of bytes read (fresh + shadow): the fused kernel the GPU runtime runs
    (quantize + compare in one pass, then the count and the records), its time beyond the dense
    quantize alone, on one 8192 x 8192 BF16 weight at 0.4% changed: 0.2667 - 0.0958 ms for
    2 x 67.1 MB (benchmarks/runs/h100-2026-12-07-session/fused/fused.json).  Applied per byte
    to every task of a plan: that it scales from one 8192 x 8192 weight to the plan's tasks is
    an assumption.  The torch ops' path (no NVRTC, ``WXFER_DELTA_GPU=torch``) is
    ``TORCH_COMPARE_GBPS``: 167 GB/s (runs/h100-2026-12-06-session/delta_gpu.json);
  * apply 29.3 GB/s of records: the receiver's native apply kernel (the runtime's on a GPU:
    ``wx_delta_apply`` through wxfer.runtime.delta_gpu.apply), 128 records of 8.32 MB over a
    512 MiB destination at 0.31% of bytes changed in 0.284 ms, launch included, bit-exact
    (benchmarks/runs/h100-2026-12-07-d/apply.json, ``bench_delta.py --parts apply``).  At 1%
    and 3% the same kernel ran at 61 and 148 GB/s: its fixed cost (about 0.2 ms a launch) is
    most of the 0.31% row, so per byte this rate is conservative for larger records.  Its cost
    with thousands of records per receiver was not measured (``NOT_MEASURED``).  The torch
    apply (``WXFER_DELTA_APPLY=torch``) is ``TORCH_APPLY_GBPS``: 6.9 GB/s (delta_gpu.json).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

REC_HEAD = 32  # bytes of a record's head (wxfer.runtime.delta.REC)
# the fused kernel (quantize + compare, count, records) beyond the quantize alone, one H100, 2026-12-07
# 00:35 UTC: 2 x 67,125,248 bytes read in 0.000266656 - 0.000095755 s (fused.json, the 0.4% row)
COMPARE_GBPS = 785.5
# the torch ops' compare + encode (the path without the kernels), one H100, 2026-12-06: 2 x 67,125,248
# bytes in 0.000901057 - 0.000098486 s; the torch apply: 3,413,424 bytes of records in 0.000495156 s
TORCH_COMPARE_GBPS = 167.3
TORCH_APPLY_GBPS = 6.89
# the native apply kernel, one H100, 2026-12-07 09:09 UTC: 8,324,856 bytes of records (128 records,
# 0.31% of a 512 MiB destination) in 0.000284371 s (runs/h100-2026-12-07-d/apply.json)
APPLY_GBPS = 29.27
SOURCE = (
    "measured on one H100: compare 785 GB/s of bytes read, the fused kernel with the count and the records "
    "beyond the quantize alone (benchmarks/runs/h100-2026-12-07-session/fused/fused.json, 8192 x 8192 at 0.4%); "
    "apply 29.3 GB/s of records, the native apply kernel at 0.31% changed "
    "(benchmarks/runs/h100-2026-12-07-d/apply.json)"
)
# what the delta term does not charge because nobody measured it (reported with every restatement)
NOT_MEASURED = {
    "apply_per_record_s": "the receiver's apply with thousands of records per receiver: not measured (the "
    "native kernel's rate was measured with 128 records, its launch included; charged per record byte only)",
    "compare_scaling": "the compare rate was measured on one 8192 x 8192 weight; applied per byte to every task",
}


def records_fraction(rate: float, range_bytes: int = 1 << 20) -> float:
    """Record bytes per dense byte at byte change rate `rate` over ranges of `range_bytes`:
    the smaller of index/value pairs (5 bytes a changed byte) and bitmask + bytes (1/8 + rate),
    with the record heads; at most 1 (dense)."""
    rate = min(max(float(rate), 0.0), 1.0)
    head = REC_HEAD / range_bytes
    return min(1.0, head + min(5.0 * rate, 0.125 + rate))


@dataclass
class DeltaTerms:
    """The delta term's inputs. rate: changed fraction of destination bytes; compare_GBps:
    the trainer's compare (reads its bytes and the shadow); apply_GBps: the receiver's apply
    per record byte; source: where these numbers come from."""

    rate: float
    compare_GBps: float = COMPARE_GBPS
    apply_GBps: float = APPLY_GBPS
    source: str = SOURCE


COMPARE_SOURCE = (
    "measured on one H100: the fused kernel with the count and the records beyond the quantize alone "
    "(benchmarks/runs/h100-2026-12-07-session/fused/fused.json, 8192 x 8192 at 0.4%)"
)
APPLY_SOURCE = (
    "measured on one H100: the native apply kernel, 128 records at 0.31% changed, launch included "
    "(benchmarks/runs/h100-2026-12-07-d/apply.json)"
)


def delta_terms(rate: float, compare_GBps: float | None = None, apply_GBps: float | None = None) -> DeltaTerms:
    """DeltaTerms at change rate `rate`; a rate left None is the measured default, and `source`
    says for each term where its figure comes from (measured, or given)."""
    cmp_src = COMPARE_SOURCE if compare_GBps is None else "given (%g GB/s)" % compare_GBps
    app_src = APPLY_SOURCE if apply_GBps is None else "given (%g GB/s)" % apply_GBps
    return DeltaTerms(
        rate,
        COMPARE_GBPS if compare_GBps is None else float(compare_GBps),
        APPLY_GBPS if apply_GBps is None else float(apply_GBps),
        "compare: %s; apply: %s" % (cmp_src, app_src),
    )


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


def estimate(
    plan, lower_bound_s: float, simulated_s: float | None, terms: DeltaTerms, stage_busy_s: dict | None = None
) -> dict:
    """The delta push of `plan` against its dense simulation (see the module docstring)."""
    s = plan.summary()
    dense_s = simulated_s if simulated_s is not None else lower_bound_s
    frac = records_fraction(terms.rate)
    busy = {k: v for k, v in (stage_busy_s or {}).items() if k != "links"}
    other = max(busy.values()) if busy else max(0.0, dense_s - lower_bound_s)
    link = lower_bound_s * frac
    per_trainer = s["bytes_per_replica"] / max(plan.train_world, 1)
    compare = 2 * per_trainer / (terms.compare_GBps * 1e9)
    apply = s["max_bytes_per_infer_gpu"] * frac / (terms.apply_GBps * 1e9)
    delta_s = max(other + compare, link, dense_s - lower_bound_s + link) + apply
    pays = delta_s < dense_s
    return dict(
        delta_terms=asdict(terms),
        delta_not_measured=dict(NOT_MEASURED),
        delta_records_fraction=frac,
        delta_link_s=_sig(link),
        delta_compare_s=_sig(compare),
        delta_apply_s=_sig(apply),
        delta_stages_s=_sig(other),
        delta_s=_sig(delta_s),
        dense_s=_sig(dense_s),
        delta_vs_dense=_sig(delta_s / dense_s) if dense_s else None,
        delta_pays=pays,
        chosen_s=_sig(delta_s if pays else dense_s),
    )


def simulate_delta(plan, cluster, terms: DeltaTerms, dense_s: float, lower_bound_s: float, steps: int = 1500) -> dict:
    """The delta push of `plan` on `cluster` simulated (the module docstring), against the
    dense push's `dense_s` (its simulation) and `lower_bound_s`."""
    import copy
    from dataclasses import replace

    import numpy as np

    from .simulate import simulate

    s = plan.summary()
    frac = records_fraction(terms.rate)
    rp = copy.copy(plan)  # the same tasks, meshes and groups; each transfer its records' bytes
    rp.nbytes = np.maximum(np.ceil(plan.nbytes * frac), 1).astype(plan.nbytes.dtype)
    cal = cluster.cal
    # the pack stage per byte of (sources + packed): the quantizer's, plus the compare reading
    # the packed bytes and the shadow (2 x packed; BF16 sources are 2 x packed: 2 of 3 bytes); a
    # raw piece's copy likewise (its sources are its packed bytes: 1 of 2).  A rate that is None
    # stays None where None means the (slowed) quantizer's or copy's (quant_small_GBps), else it is
    # the cluster's memory rate, slowed
    mem = cluster.mem_GBps

    def slowed(q, share=2.0 / 3.0):
        q = mem if q is None else q
        return 1.0 / (1.0 / q + share / terms.compare_GBps)

    small = None if cal.quant_small_GBps is None else slowed(cal.quant_small_GBps)
    dc = copy.copy(cluster)
    dc.calibration = replace(
        cal, quant_GBps=slowed(cal.quant_GBps), quant_small_GBps=small, copy_GBps=slowed(cal.copy_GBps, 1.0)
    )
    r = simulate(rp, dc, steps=steps, record=False, kinds="auto", host_waits_pack=True)
    apply = s["max_bytes_per_infer_gpu"] * frac / (terms.apply_GBps * 1e9)
    per_trainer = s["bytes_per_replica"] / max(plan.train_world, 1)
    delta_s = r.simulated_s + apply
    pays = delta_s < dense_s
    busy = {k: _sig(v) for k, v in r.stage_busy_s.items()}
    return dict(
        delta_model="simulated",
        delta_terms=asdict(terms),
        delta_not_measured=dict(NOT_MEASURED),
        delta_records_fraction=frac,
        delta_link_s=_sig(lower_bound_s * frac),
        delta_compare_s=_sig(2 * per_trainer / (terms.compare_GBps * 1e9)),
        delta_apply_s=_sig(apply),
        delta_simulated_s=_sig(r.simulated_s),
        delta_lower_bound_s=_sig(r.lower_bound_s),
        delta_bound_by=r.bound_by,
        delta_stage_busy_s=busy,
        delta_stages_s=_sig(max(v for k, v in r.stage_busy_s.items() if k != "links")),
        delta_s=_sig(delta_s),
        dense_s=_sig(dense_s),
        delta_vs_dense=_sig(delta_s / dense_s) if dense_s else None,
        delta_pays=pays,
        chosen_s=_sig(delta_s if pays else dense_s),
    )
