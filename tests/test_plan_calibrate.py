"""The simulator's calibrated terms (host per task / parameter / piece, quantizer and copy
rates, per-call costs, fixed cost per push), the named calibrations, their JSON files and
predict()."""

import json

import numpy as np
import pytest

from wxfer.meta import Calibration, Cluster
from wxfer.plan import plan_for
from wxfer.plan.calibrate import CALIBRATIONS, cluster_for, from_dict, get, load, predict, save
from wxfer.plan.simulate import simulate

FAST = dict(nic_gbps=8000.0, nvlink_GBps=1e4, mem_GBps=1e5)  # links that cost ~nothing


def _one(quant=None, **cal):
    c = Cluster(train_gpus=1, infer_gpus=1, infer_tp=1, quant=quant, calibration=Calibration(**cal), **FAST)
    return c, plan_for("qwen3-tiny", c)


def test_host_time_per_parameter_adds_up_on_one_rank():
    c, plan = _one(host_param_s=1e-3, pack_launch_s=0.0, quant_GBps=None)
    r = simulate(plan, c, record=False)
    nsrc = sum(len(t.sources) for t in plan.tasks)
    assert r.simulated_s == pytest.approx(nsrc * 1e-3, rel=0.02)  # the host issues one task after another
    assert r.bound_by == "host" and r.stage_busy_s["host"] == pytest.approx(nsrc * 1e-3)
    c2, _ = _one(host_param_s=2e-3, pack_launch_s=0.0, quant_GBps=None)
    assert simulate(plan, c2, record=False).simulated_s == pytest.approx(2 * r.simulated_s, rel=0.02)


def test_host_per_task_and_per_piece():
    c, plan = _one(host_param_s=0.0, host_task_s=1e-3, host_piece_s=1e-4, pack_launch_s=0.0, quant_GBps=None)
    r = simulate(plan, c, record=False)
    from wxfer.plan.simulate import _jobs

    pieces = _jobs(plan, 1).pieces.sum()
    assert r.simulated_s == pytest.approx(len(plan.tasks) * 1e-3 + pieces * 1e-4, rel=0.02)


def test_a_slow_quantizer_bounds_an_fp8_push_and_not_a_bf16_one():
    c, plan = _one("fp8", host_param_s=0.0, pack_launch_s=0.0, quant_GBps=0.1, copy_GBps=1e5)
    r = simulate(plan, c, record=False)
    from wxfer.plan.simulate import _jobs

    jb = _jobs(plan, 1)
    work = sum(
        (plan.tasks[int(t)].src_bytes + p) / (0.1e9 if q else 1e14) for t, p, q in zip(jb.task, jb.packed, jb.fp8)
    )
    assert jb.fp8.any() and not jb.fp8.all()  # norms and embeddings stay BF16
    assert r.simulated_s == pytest.approx(work, rel=0.02) and r.bound_by == "pack"
    cb, pb = _one(None, host_param_s=0.0, pack_launch_s=0.0, quant_GBps=0.1, copy_GBps=1e5)
    assert simulate(pb, cb, record=False).simulated_s < r.simulated_s / 50


def test_launch_cost_per_piece_and_write_cost_per_transfer():
    c, plan = _one(host_param_s=0.0, pack_launch_s=1e-3, quant_GBps=None)
    from wxfer.plan.simulate import _jobs

    jb = _jobs(plan, 1)
    assert simulate(plan, c, record=False).simulated_s == pytest.approx(jb.pieces.sum() * 1e-3, rel=0.02)
    c2, _ = _one(host_param_s=0.0, pack_launch_s=0.0, quant_GBps=None, write_call_s=1e-3)
    # writes are posted after their task is packed: the last job's writes end the push
    r2 = simulate(plan, c2, record=False)
    assert int(jb.nwrites[-1]) * 1e-3 <= r2.simulated_s <= int(jb.nwrites.sum()) * 1e-3 + 1e-3


def test_serial_stream_and_host_sync():
    base = dict(host_param_s=1e-3, pack_launch_s=0.0, quant_GBps=0.5, copy_GBps=0.5)
    c = Cluster(
        train_gpus=2, infer_gpus=2, infer_tp=2, gpus_per_node=2, dense_shard=2, nvlink_GBps=0.5, nic_gbps=8000.0
    )
    plan = plan_for("qwen3-tiny", c, coarse=False)  # many tasks per rank: something to overlap
    t = {}
    for name, kw in (
        ("pipelined", dict(serial=False)),
        ("serial", dict(serial=True)),
        ("sync", dict(serial=True, host_sync=True)),
    ):
        t[name] = simulate(plan, Calibration(**base, **kw).apply(c), record=False).simulated_s
    assert t["pipelined"] < t["serial"] < t["sync"]
    # host_sync: the host waits for each gather and packing: the sum of all of them on the busiest rank
    r = simulate(plan, Calibration(**base, serial=True, host_sync=True).apply(c), record=False)
    b = r.stage_busy_s
    assert r.simulated_s == pytest.approx(b["host"] + b["allgather"] + b["pack"], rel=0.05)


def test_push_fixed_cost_is_added_once():
    c, plan = _one(host_param_s=0.0, pack_launch_s=0.0, quant_GBps=None)
    a = simulate(plan, c, record=False).simulated_s
    c.calibration = Calibration(host_param_s=0.0, pack_launch_s=0.0, quant_GBps=None, push_fixed_s=0.25)
    assert simulate(plan, c, record=False).simulated_s == pytest.approx(a + 0.25)


def test_named_calibrations_and_the_default():
    assert Cluster().cal == CALIBRATIONS["h200"] == Calibration()
    assert Calibration().host_param_s == 0.25e-3 and Calibration().quant_GBps == 170.0
    free = CALIBRATIONS["free-stage2"]
    assert free.host_param_s == 0 and free.quant_GBps is None and not free.serial
    assert get("h200-native").quant_GBps > 3000
    with pytest.raises(ValueError, match="no such file"):
        get("no-such-calibration")


def test_json_round_trip_and_bad_values(tmp_path):
    cal = Calibration(name="x", host_task_s=1e-4, write_GBps=3.5, host_sync=True)
    p = tmp_path / "c.json"
    save(cal, str(p), extra=dict(measured={"anything": 1}))
    assert load(str(p)) == cal
    d = json.loads(p.read_text())
    d["quant_GBps"] = "fast"
    with pytest.raises(ValueError, match="quant_GBps"):
        from_dict(d)
    d["quant_GBps"] = -1
    with pytest.raises(ValueError, match="quant_GBps"):
        from_dict(d)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load(str(tmp_path / "bad.json"))


def test_predict_uses_the_measured_rates():
    c = Cluster(train_gpus=2, infer_gpus=4, infer_tp=2, gpus_per_node=2, dense_shard=2)
    plan = plan_for("qwen3-tiny", c)
    slow = Calibration(host_param_s=0.0, pack_launch_s=0.0, quant_GBps=None, write_GBps=0.01, allgather_GBps=100.0)
    fast = Calibration(host_param_s=0.0, pack_launch_s=0.0, quant_GBps=None, write_GBps=1.0, allgather_GBps=100.0)
    per_rank = np.bincount(plan.sender, plan.nbytes, 2).max()
    assert predict(plan, slow) == pytest.approx(per_rank / 0.01e9, rel=0.05)
    assert predict(plan, slow) > 50 * predict(plan, fast)
    cl = cluster_for(plan, slow)
    assert cl.write_GBps == 0.01 and cl.nvlink_GBps == 100.0 and cl.train_gpus == 2 and cl.infer_gpus == 4
    r0 = predict(plan, slow, rank=0)
    assert 0 < r0 <= predict(plan, slow) * 1.001


def test_an_unmeasured_term_is_refused_by_name_or_used_as_a_named_assumption(tmp_path):
    from dataclasses import replace

    from wxfer.plan.calibrate import assume

    c, plan = _one(quant="fp8", host_param_s=1e-4)
    why = "no packed task in the traced pushes"
    cal = replace(c.calibration, name="partial", unmeasured={"host_piece_s": why})
    path = tmp_path / "partial.json"
    save(cal, str(path))
    back = load(str(path))
    assert back.unmeasured == {"host_piece_s": why}
    with pytest.raises(ValueError, match=r"host_piece_s \(charged by packed task \d+ .*unmeasured: " + why):
        simulate(plan, replace(c, calibration=back), record=False)
    # the same plan with the term given a value on purpose: simulated, and the result says so
    ok = assume(back, why="the per-piece cost taken as 0: the issue-13 H200 figure", host_piece_s=0.0)
    assert not ok.unmeasured and "host_piece_s" in ok.assumptions
    r = simulate(plan, replace(c, calibration=ok), record=False)
    assert "host_piece_s" in r.assumptions and "issue-13" in r.assumptions["host_piece_s"]
    assert r.summary()["assumptions"] == r.assumptions
    # a term the plan does not charge (no offload here) stays unmeasured without a refusal
    r2 = simulate(plan, replace(c, calibration=replace(ok, unmeasured={"h2d_GBps": "no GPU"})), record=False)
    assert r2.simulated_s == pytest.approx(r.simulated_s)
    with pytest.raises(ValueError, match="not calibration terms"):
        from_dict(dict(unmeasured={"no_such_term": "x"}))
    with pytest.raises(ValueError, match="not calibration terms"):
        assume(ok, no_such_term=1.0)


def test_every_term_is_measured_assumed_or_unmeasured_with_its_reason():
    """Calibration.source_of / need: the default set's figures that no measurement backs are
    assumptions a simulation lists; a term given another value loses that mark."""
    from wxfer.meta import DEFAULT_ASSUMED
    from wxfer.plan.calibrate import TERMS, problems

    d = Calibration()
    assert d.source_of("host_param_s")[0] == "measured" and d.source_of("coll_call_s")[0] == "assumed"
    assert set(d.assumptions) == set(DEFAULT_ASSUMED) and problems(d) == []
    given = Calibration(coll_call_s=5e-6)
    assert "coll_call_s" not in given.assumptions and given.source_of("coll_call_s")[0] == "measured"
    c, plan = _one()
    r = simulate(plan, c, record=False)
    assert "push_begin_s" in r.assumptions and "not measured on the H200" in r.assumptions["push_begin_s"]
    for name in CALIBRATIONS:  # the named sets: no term without a source
        assert problems(name) == [], name
    # need(): an unmeasured term refuses by name and why; a None with no reason too
    un = Calibration(host_param_s=None, unmeasured={"host_param_s": "no packed task"}, assumptions={})
    with pytest.raises(ValueError, match=r"host_param_s \(charged by task 3\): unmeasured: no packed task"):
        un.need("host_param_s", "task 3")
    with pytest.raises(ValueError, match="write_call_s: None, and not named in unmeasured"):
        Calibration(write_call_s=None).need("write_call_s")
    assert Calibration(quant_GBps=None).need("quant_GBps") is None  # None: the Cluster's memory rate
    assert problems(Calibration(write_call_s=None)) == [("write_call_s", "None with no reason")]
    assert [k for k, _ in problems(Calibration(host_param_s=0.0))] == ["host_param_s"]  # 0.0 with no mark
    assert TERMS >= set(DEFAULT_ASSUMED)


def test_strict_names_a_fit_at_zero_and_a_simulation_takes_it_only_as_an_assumption():
    from wxfer.plan.calibrate import FIT_AT_ZERO, assume, fits_at_zero, strict

    c, plan = _one(quant="fp8", host_param_s=1e-4)
    cal = strict(replace_cal(c.calibration, host_piece_s=0.0, assumptions={}), {"host_piece_s": "nnls over 9 samples"})
    assert cal.host_piece_s is None and cal.unmeasured["host_piece_s"] == FIT_AT_ZERO + "nnls over 9 samples"
    assert fits_at_zero(cal) == sorted(k for k in cal.unmeasured if cal.unmeasured[k].startswith(FIT_AT_ZERO))
    with pytest.raises(ValueError, match=r"host_piece_s \(charged by packed task .*came out <= 0: nnls over 9 samples"):
        simulate(plan, Cluster(**{**c.__dict__, "calibration": cal}), record=False)
    ok = assume(cal, why="taken at 0", **dict.fromkeys(fits_at_zero(cal), 0.0))
    r = simulate(plan, Cluster(**{**c.__dict__, "calibration": ok}), record=False)
    assert r.assumptions["host_piece_s"] == "host_piece_s = 0.0 assumed: taken at 0"


def replace_cal(cal, **kw):
    from dataclasses import replace

    return replace(cal, **kw)


def test_an_older_calibrate_file_reads_its_zeros_as_unmeasured(tmp_path):
    """A file of an older `python -m wxfer calibrate` (fits clamped at 0 and unmeasured terms
    stored as 0.0): it loads, each 0.0 read as unmeasured with that reason; the stored H200
    file of run 2 holds no term without a source."""
    import os

    from wxfer.plan.calibrate import OLDER_ZERO, fits_at_zero, problems

    old = dict(
        name="measured-cpu-host",
        host_task_s=8e-5,
        host_param_s=0.0,
        host_piece_s=0.0,
        h2d_call_s=0.0,
        push_fixed_s=0.0,
        write_GBps=4.9,
        unmeasured={"h2d_call_s": "no GPU: nothing is offloaded to host memory here"},
        assumptions={},
        measured={"placement": "host"},
    )
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    cal = load(str(p))
    assert cal.host_param_s is None and cal.unmeasured["host_param_s"] == OLDER_ZERO
    assert (
        cal.h2d_call_s is None
        and cal.unmeasured["h2d_call_s"].startswith("no GPU")
        and "0.0" in cal.unmeasured["h2d_call_s"]
    )
    assert cal.push_begin_s is None and "push_begin_s" in cal.unmeasured  # absent: the default 0.0, not measured
    assert cal.host_task_s == 8e-5 and problems(cal) == [] and "host_param_s" in fits_at_zero(cal)
    c, plan = _one(quant="fp8")
    with pytest.raises(ValueError, match="host_param_s .*older `python -m wxfer calibrate`"):
        predict(plan, cal)
    # a hand-made dict (not a calibrate file) keeps its zeros
    assert from_dict(dict(name="mine", host_param_s=0.0)).host_param_s == 0.0
    stored = os.path.join(
        os.path.dirname(__file__), "..", "benchmarks", "runs", "h200-2026-12-01-2317-predict", "cal-h200.json"
    )
    h200 = load(stored)
    assert problems(h200) == [] and h200.host_param_s is None and h200.quant_GBps > 3000


def test_cluster_for_refuses_a_missing_write_rate_unless_assumed():
    """No silent 50 GB/s: a calibration without write_GBps cannot describe its machine's
    writes; an explicit assume= is used and listed."""
    c = Cluster(train_gpus=2, infer_gpus=4, infer_tp=2, gpus_per_node=2, dense_shard=2)
    plan = plan_for("qwen3-tiny", c)
    cal = Calibration(
        host_param_s=0.0,
        pack_launch_s=0.0,
        quant_GBps=None,
        allgather_GBps=100.0,
        unmeasured={"write_GBps": "links failed"},
    )
    with pytest.raises(ValueError, match=r"no write_GBps \(links failed\)"):
        cluster_for(plan, cal)
    with pytest.raises(ValueError, match="no write_GBps"):
        predict(plan, "h200")
    from wxfer.plan.calibrate import run

    r = run(plan, cal, assume={"write_GBps": 0.01})
    per_rank = np.bincount(plan.sender, plan.nbytes, 2).max()
    assert r.simulated_s == pytest.approx(per_rank / 0.01e9, rel=0.05)
    assert r.assumptions["write_GBps"] == "write_GBps = 0.01 assumed: given by the caller (assume=)"
    assert predict(plan, cal, write_GBps=0.01) == pytest.approx(r.simulated_s, rel=0.01)
