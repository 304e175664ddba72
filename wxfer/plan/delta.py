"""The simulator's delta term (issue 36): what a delta push costs against the dense one.

A delta push (``Sender(delta=True)``, docs/delta.md) still makes every destination byte on the
trainer (gather, fusion, FP8), then compares it with the shadow, and sends only the changed bytes
as records, which the receiver applies after the step.  Given a dense simulation of a plan
(``lower_bound_s``: the busiest link's bytes over its bandwidth; ``simulated_s``: the whole
push), the delta push is estimated as

    stages  = the busiest non-link stage of the dense simulation (stage_busy_s: host, all-gather,
              pack, H2D; these stay: a delta push still makes every byte), or, without it,
              simulated_s - lower_bound_s
    link    = lower_bound_s * records_fraction(rate)
    compare = 2 * distinct bytes per trainer GPU / compare bandwidth   (its share and the shadow)
    apply   = max bytes per inference GPU * records_fraction(rate) / apply bandwidth
    delta_s = max(stages + compare, link, simulated_s - lower_bound_s + link) + apply

and the chooser falls back to dense (``delta_pays`` False, ``chosen_s`` = simulated_s) where
that is not shorter.  ``rate`` is the fraction of destination *bytes* that changed (the FP8
bytes rate for an FP8 destination, as benchmarks/bench_delta.py measures it).  The bandwidths
are inputs with their source said (defaults: assumptions for an H100-class GPU, to be replaced
by bench_delta.py --parts kernels measured on the device).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

REC_HEAD = 32  # bytes of a record's head (wxfer.runtime.delta.REC)


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
    compare_GBps: float = 1500.0
    apply_GBps: float = 50.0
    source: str = "assumed (H100-class GPU); measure with benchmarks/bench_delta.py --parts kernels"


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
