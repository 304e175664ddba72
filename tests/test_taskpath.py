"""The task path classifier (wxfer.taskpath): every path with every reason from its facts, the
layouts it reads from shards, and the runtime's and the simulator's choices on the same plans
(the runtime's TaskPrep facts from tensors of the plan's shapes, on the meta device: nothing
allocated)."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from helpers import shard  # tests/helpers.py

from wxfer import taskpath as tp
from wxfer.mapping.rules import Piece
from wxfer.meta import Cluster, synthesize
from wxfer.plan import build_plan
from wxfer.plan.kinds import packed_bytes, task_choices, task_kinds
from wxfer.plan.simulate import simulate
from wxfer.runtime import prepare, program
from wxfer.runtime.tasks import TaskRunner

ASK = tp.NOT_ASKED
# (facts, in_place, copy) -> (path, reason): every path, every reason
TABLE = [
    (tp.Facts(False, tp.ROWS), None, None, "collective_only", "sends_nothing"),
    (tp.Facts(False, tp.FP8, held=False), None, None, "collective_only", "sends_nothing"),
    (tp.Facts(True, tp.ROWS), ASK, ASK, "zero_copy", "own_bytes"),
    (tp.Facts(True, tp.WHOLE), None, "not fewer bytes than copy_max", "zero_copy", "own_bytes"),
    (tp.Facts(True, tp.ROWS), None, None, "copy", "small_copy"),
    (tp.Facts(True, tp.WHOLE), ASK, None, "copy", "small_copy"),
    (tp.Facts(True, tp.ROWS, on_device=False), None, None, "staged", "offloaded"),
    (tp.Facts(True, tp.WHOLE, held=False), ASK, ASK, "staged", "gathered_whole"),
    (tp.Facts(True, tp.WHOLE, held=False), None, None, "direct", "in_place"),
    (tp.Facts(True, tp.FP8), None, ASK, "direct", "in_place"),
    (tp.Facts(True, tp.ROWS, fits=False), None, None, "direct", "in_place"),
    (tp.Facts(True, tp.FUSED), ASK, ASK, "packed", "fused"),
    (tp.Facts(True, tp.FP8), "verify is on", ASK, "packed", "fp8"),
    (tp.Facts(True, tp.CAST), ASK, ASK, "packed", "cast"),
    (tp.Facts(True, tp.SLICED), ASK, ASK, "packed", "sliced"),
    (tp.Facts(True, tp.UNKNOWN), ASK, ASK, "packed", "unknown"),
    (tp.Facts(True, tp.ROWS, held=False), ASK, None, "packed", "gathered"),
    (tp.Facts(True, tp.WHOLE, fits=False), ASK, ASK, "packed", "unfit"),
]


@pytest.mark.parametrize("facts,in_place,copy,path,reason", TABLE)
def test_each_path_and_reason(facts, in_place, copy, path, reason):
    assert tp.classify(facts, in_place, copy) == (path, reason)
    assert path in tp.PATHS and reason in tp.REASONS


def test_the_table_covers_every_path_and_reason():
    assert {r[3] for r in TABLE} == set(tp.PATHS)
    assert {r[4] for r in TABLE} == set(tp.REASONS)
    # best: what the in-place writer can make of a task (its candidates)
    assert [tp.best(f).path for f, *_ in TABLE[:3]] == ["collective_only", "collective_only", "copy"]
    assert tp.best(tp.Facts(True, tp.CAST)).path == "direct"


def test_layouts_of_shards():
    w = ("w", (6, 4), "bfloat16")
    whole = shard("raw", "bfloat16", Piece("w", 0, 6, 0, 4), dst="w")
    top, bot = (shard("raw", "bfloat16", Piece("w", a, b, 0, 4)) for a, b in ((0, 3), (3, 6)))
    assert tp.layout([whole], [w]) == tp.WHOLE
    assert tp.layout([shard("raw", "bfloat16", Piece("w", 0, 3, 0, 4), Piece("w", 3, 6, 0, 4))], [w]) == tp.WHOLE
    assert tp.layout([top, bot], [w]) == tp.ROWS and tp.layout([top], [w]) == tp.ROWS
    assert tp.layout([shard("raw", "bfloat16", Piece("w", 0, 6, 0, 2))], [w]) == tp.SLICED  # columns
    assert tp.layout([shard("raw", "float32", Piece("w", 0, 6, 0, 4))], [w]) == tp.CAST
    assert tp.layout([shard("fp8", "float8_e4m3fn", Piece("w", 0, 6, 0, 4))], [w]) == tp.FP8
    assert tp.layout([whole], [w, ("v", (6, 4), "bfloat16")]) == tp.FUSED
    assert tp.layout([whole], [None]) == tp.UNKNOWN
    # a fused 3-D [E, 2I, H] source, all of it in per-expert pieces: whole
    e = [Piece("e", r, r + 4, 0, 8) for r in range(0, 12, 4)]
    assert tp.layout([shard("raw", "bfloat16", *e)], [("e", (3, 4, 8), "bfloat16")]) == tp.WHOLE


# ----------------------------------------------------------------------------- runtime == simulator


def _plan(preset, quant=None, fused=False, tp_=1, train=1, coarse=True):
    c = Cluster(
        train_gpus=train,
        infer_gpus=tp_,
        infer_tp=tp_,
        quant=quant,
        gpus_per_node=max(tp_, train),
        dense_shard=train,
        expert_shard=1,
    )
    s = synthesize(preset, c, fused_experts=fused)
    return c, build_plan(s.train, s.workers, s.preset, quant=quant, expanded=s.expanded, coarse=coarse), s.train


def _ops(plan, train):
    """{task: TaskOp} on its first sending rank, its sources meta tensors of the trainers' shapes
    and dtypes (one destination per packed shard)."""
    params = {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in train}
    out = {}
    for t in plan.tasks:
        for r in plan.meshes[t.mesh]:
            packed = plan.packed_shards(r, t.id)
            if packed:
                dests = [(b"r", 0, off, sh.nbytes) for off, sh in packed]
                shards = [sh for _, sh in packed]
                srcs = [(n, params[n]) for n in t.sources]
                out[t.id] = program.TaskOp(t.id, t.name, srcs, shards, dests, sum(sh.nbytes for sh in shards))
                break
    return out


class _InPlace:
    """What the TaskRunner asks of the in-place writer, for one that can write every task
    (cuda_ipc, everything mapped): zero-copy tasks of fewer bytes than copy_max are copied."""

    verify = False

    def __init__(self, copy_max):
        self.copy_max = copy_max

    def off(self):
        return None

    def plan_of(self, op):
        return object(), None

    def copy_why(self, op):
        return None if op.nbytes < self.copy_max else "not fewer bytes than copy_max"


def _runtime(ops, device, in_place=None, gathered=False, monkeypatch=None):
    """{task: Choice} as a Sender's TaskRunner reports them (prepared on `device`: "cpu" with
    meta sources is a CPU-offloaded rank), its in-place writer `in_place` (None: off)."""
    if gathered:  # every source sharded over the mesh: gathered (DTensor.full_tensor)
        monkeypatch.setattr(prepare, "_is_whole", lambda p: False)
        monkeypatch.setattr(prepare, "_gather_spec", lambda p: None)
    for op in ops.values():
        op.prep = prepare.task_prep(op, torch.device(device))
    ip = in_place or SimpleNamespace(verify=False, off=lambda: "off (Sender(direct=False))")
    prog = SimpleNamespace(groups=[list(ops.values())])
    return TaskRunner(None, None, torch.device(device), None, 0, prog, None, ip, 1.0).task_choices()


CASES = [  # (preset, quant, fused experts, inference TP, trainer ranks, coarse tasks)
    ("qwen3-tiny", None, False, 1, 1, True),
    ("qwen3-tiny", None, False, 1, 1, False),  # one task per parameter
    ("qwen3-tiny", None, False, 2, 1, False),  # row-parallel column slices
    ("qwen3-tiny", "fp8", False, 1, 1, False),
    ("qwen3-tiny", None, False, 1, 2, False),  # every mesh two ranks: gathered
    ("qwen3-tiny", None, False, 2, 2, False),  # gathered, then cut for TP2
    ("qwen3-tiny", "fp8", False, 1, 2, True),
    ("qwen3-30b-a3b", "fp8", True, 1, 1, True),  # fused 3-D experts, FP8
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_runtime_and_the_simulator_choose_alike(case, monkeypatch):
    preset, quant, fused, tp_, train, coarse = case
    c, plan, params = _plan(preset, quant, fused, tp_, train, coarse)
    ops = _ops(plan, params)
    gathered = train > 1
    nb = packed_bytes(plan)
    cut = sorted(nb)[len(nb) // 2] + 1  # about half the zero-copy tasks are small
    for device, offload in (("meta", False), ("cpu", True)):
        for direct in (False, True):
            ip = _InPlace(cut) if direct else None
            got = _runtime(ops, device, ip, gathered, monkeypatch)
            want = task_choices(plan, params, cpu_offload=offload, direct=direct, copy_max=cut)
            assert got == {t: want[t] for t in got}, (case, device, direct)
            # the simulator's stage kinds are the runtime's paths (its jobs: one per sending rank)
            kinds = {t: ch.path for t, ch in got.items()}
            n = Counter(kinds[int(t)] for r, t in set(zip(plan.sender.tolist(), plan.task.tolist())))
            r = simulate(plan, c, kinds=kinds, record=False)
            assert (r.terms["zero_copy_tasks"], r.terms["copy_tasks"], r.terms["direct_tasks"]) == (
                n["zero_copy"],
                n["copy"],
                n["direct"],
            )
    if not gathered:  # "auto": the simulator decides them itself from the plan's training parameters
        auto = simulate(plan, c, kinds="auto", record=False)
        own = task_kinds(plan, plan.train_params)
        assert auto.terms["zero_copy_tasks"] == Counter(own.values())["zero_copy"]


def test_every_reason_is_reached_on_real_plans(monkeypatch):
    seen = set()
    for case in CASES[:-1]:
        _, plan, params = _plan(*case)
        for offload in (False, True):
            for direct in (False, True):
                ch = task_choices(plan, params, offload, direct, copy_max=1 << 20)
                seen |= {c.reason for c in ch.values()}
    # not from a plan: a rank in a collective only, a source's memory that is not contiguous, unknown shapes
    assert set(tp.REASONS) - seen == {"sends_nothing", "unfit", "unknown", "cast"}
    _, plan, _ = _plan(*CASES[3])  # FP8, one task per parameter, no parameter metadata: packed
    assert set(task_choices(plan).values()) == {("packed", "fused"), ("packed", "fp8"), ("packed", "unknown")}


def test_a_source_that_is_not_contiguous_is_packed_unfit():
    w = torch.empty(4, 6, dtype=torch.bfloat16).t()  # [6, 4], not contiguous
    sh = shard("raw", "bfloat16", Piece("w", 0, 6, 0, 4))
    op = program.TaskOp(0, "t", [("w", w)], [sh], [(b"", 0, 0, sh.nbytes)], sh.nbytes)
    prep = prepare.task_prep(op, torch.device("cpu"))
    assert prep.path == ("packed", "unfit") and not prep.zero_copy and prep.direct is None
    with torch.no_grad():
        assert torch.equal(prepare.run(prep, op, torch.device("cpu")), w.contiguous().reshape(-1).view(torch.uint8))


def test_a_gathered_3d_source_whole_in_per_expert_pieces_is_sent_as_gathered(monkeypatch):
    """staged, "gathered_whole" (as the plan predicts, wxfer.zerocopy.all_of_it): the bytes the
    engine writes are the gathered tensor's own, equal to the reference packing."""
    from wxfer.mapping.reference import pack_task

    monkeypatch.setattr(prepare, "_is_whole", lambda p: False)  # sharded over its mesh: gathered
    monkeypatch.setattr(prepare, "_gather_spec", lambda p: None)  # (DTensor.full_tensor's way)
    w = torch.arange(3 * 4 * 8, dtype=torch.float32).reshape(3, 4, 8).to(torch.bfloat16)
    sh = shard("raw", "bfloat16", *(Piece("e", r, r + 4, 0, 8) for r in range(0, 12, 4)))
    op = program.TaskOp(0, "experts", [("e", w)], [sh], [(b"", 0, 0, sh.nbytes)], sh.nbytes)
    prep = prepare.task_prep(op, torch.device("cpu"))
    assert prep.path == ("staged", "gathered_whole") and prep.direct is None and prep.held == sh.nbytes
    with torch.no_grad():
        buf = prepare.run(prep, op, torch.device("cpu"))
    assert buf.data_ptr() == w.data_ptr()  # no copy: (here) full_tensor of a plain tensor is itself
    assert torch.equal(buf, pack_task([sh], {"e": w}))
