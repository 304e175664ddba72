"""A plan of one trainer rank writing to one TP1 inference GPU, with its tasks' kinds as the
runtime decides them: the shared setup of the simulator's kind tests (test_copy_kind,
test_plan_sim_direct, test_plan_sim_kinds)."""

from wxfer.meta import Calibration, Cluster, synthesize
from wxfer.plan import build_plan
from wxfer.plan.kinds import task_kinds


def one_trainer_plan(preset: str, quant, cal: dict, kinds: dict | None = None, **cluster):
    """(Cluster, Plan, {task: kind}) of `preset` from 1 trainer rank to 1 x TP1, every parameter
    whole on that rank; `cal` the Calibration's fields, `kinds` task_kinds' options, `cluster`
    the other Cluster fields (bandwidths)."""
    c = Cluster(
        train_gpus=1,
        infer_gpus=1,
        infer_tp=1,
        quant=quant,
        gpus_per_node=1,
        dense_shard=1,
        expert_shard=1,
        calibration=Calibration(**cal),
        **cluster,
    )
    s = synthesize(preset, c)
    plan = build_plan(s.train, s.workers, s.preset, quant=quant, expanded=s.expanded)
    return c, plan, task_kinds(plan, s.train, cpu_offload=c.cpu_offload, **(kinds or {}))
