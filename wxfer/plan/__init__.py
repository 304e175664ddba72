"""The static plan: who sends what to whom, in which order; its checks and its notebook views.

Entry points::

    from wxfer.meta import Cluster, synthesize
    from wxfer.plan import build_plan, plan_for
    plan = plan_for("kimi-k2", Cluster(train_gpus=256, infer_gpus=128, infer_tp=16, infer_ep=True, quant="fp8"))
    plan.check(); plan.simulate(cluster); plan.to_bytes(); Plan.from_bytes(b)
"""

from .core import Plan, PlanError, Task, build_plan
from .check import check_coverage, check_deadlock_free
from .reference import expected_destination, packed_buffer


def plan_for(preset, cluster, **kw) -> Plan:
    """Synthesize both sides from a preset (name, Preset or HF config dict) and build the plan."""
    import time
    from ..meta import synthesize

    t0 = time.perf_counter()
    s = synthesize(preset, cluster)
    kw.setdefault("gpus_per_node", cluster.gpus_per_node)
    plan = build_plan(s.train, s.workers, s.preset, quant=cluster.quant, expanded=s.expanded, **kw)
    plan.build_s = time.perf_counter() - t0
    return plan


__all__ = [
    "Plan",
    "PlanError",
    "Task",
    "build_plan",
    "plan_for",
    "check_coverage",
    "check_deadlock_free",
    "expected_destination",
    "packed_buffer",
]
