"""`python -m wxfer calibrate --quick --json --out FILE` on this machine (CPU): a valid file
that the plan CLI and wxfer.plan.calibrate.load take."""

import json

import pytest

from wxfer import _wxfer
from helpers import run_wxfer  # tests/helpers.py

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")


@pytest.mark.timeout(180)
def test_calibrate_quick_writes_a_calibration_the_plan_cli_takes(tmp_path, capsys):
    out = tmp_path / "cal.json"
    p = run_wxfer("calibrate", "--quick", "--json", "--device", "cpu", "--out", str(out), timeout=170)
    d = json.loads(p.stdout.strip().splitlines()[-1])
    from wxfer.plan.calibrate import load

    cal = load(str(out))
    assert cal.name == "measured-cpu-host" and cal.host_sync and cal.serial
    assert cal.quant_GBps > 0 and cal.copy_GBps > 0 and cal.write_GBps > 0 and cal.allgather_GBps > 0
    # a real packed task has host work (split by the fit between per task, parameter and piece)
    assert cal.host_s(7, 7) > 0 and (cal.host_zc_task_s or 0) + (cal.host_zc_batch_s or 0) > 0
    assert (cal.write_call_s or 0) < 0.1 and (cal.coll_call_s or 0) < 0.5
    m = d["measured"]
    assert m["transport"] == "fabric" and m["allgather_backend"] == "gloo" and m["placement"] == "host"
    assert "quantize" in m["quantizer"] and m["calibrate_s"] < 60
    # the probes ran the runtime's own kinds in the receivers' dtype (BF16: zero copy; FP8, TP2: packed)
    probes = m["host_probes"]
    assert probes["bf16"]["kinds"].get("zero_copy", 0) > 0 and probes["fp8"]["kinds"].get("packed", 0) > 0
    assert probes["fp8-tp2-fine"]["pieces_per_task"] > probes["fp8"]["pieces_per_task"]
    # the columns separate: the probes' samples are far from collinear
    assert m["host_conditioning"]["condition"] < 100
    # every term is measured or named unmeasured with its reason; on the CPU nothing is offloaded
    from wxfer.plan.calibrate import TERMS

    from wxfer.plan.calibrate import FIT_AT_ZERO, fits_at_zero, problems

    # each term of the file: a value > 0 (measured), or None named unmeasured with why; no 0.0
    raw = json.loads(out.read_text())
    for k in TERMS:
        v, why = raw[k], raw["unmeasured"].get(k)
        assert (v is not None and v > 0 and why is None) or (v is None and why), (k, v, why)
    assert raw["assumptions"] == {} and problems(cal) == []
    measured = {k for k in TERMS if getattr(cal, k) is not None}
    assert "h2d_GBps" in cal.unmeasured and "no GPU" in cal.unmeasured["h2d_GBps"]
    assert "h2d_call_s" in cal.unmeasured and "push_fixed_s" in cal.unmeasured  # named, not 0.0
    assert {"quant_GBps", "copy_GBps", "push_begin_s", "write_GBps"} <= measured
    assert not measured & set(cal.unmeasured)
    # a fit that came out <= 0 is named so, with its samples (the host fit's: "over N samples")
    for k in fits_at_zero(cal):
        why = cal.unmeasured[k]
        assert why.startswith(FIT_AT_ZERO) and ("samples" in why or "pushes" in why), (k, why)
    assume = [a for k in fits_at_zero(cal) for a in ("--assume", k + "=0")]
    from wxfer.plan.cli import main

    assert (
        main(
            [
                "--preset",
                "qwen3-tiny",
                "--train-gpus",
                "2",
                "--infer-gpus",
                "2",
                "--infer-tp",
                "2",
                "--calibration",
                str(out),
                "--json",
                "--steps",
                "200",
            ]
            + assume
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["calibration"] == "measured-cpu-host" and r["simulated_s"] >= r["lower_bound_s"]
    assert set(r["assumptions"]) <= set(fits_at_zero(cal))  # the assumptions it took, by name


def test_simulate_measured_on_a_plan_with_a_given_calibration():
    from wxfer.meta import Calibration, Cluster
    from wxfer.plan import plan_for
    from wxfer.tools.calibrate import simulate_measured

    c = Cluster(train_gpus=2, infer_gpus=4, infer_tp=2, gpus_per_node=2, dense_shard=2)
    plan = plan_for("qwen3-tiny", c)
    cal = Calibration(name="given", host_param_s=1e-3, write_GBps=1.0, allgather_GBps=1.0, host_sync=True)
    r = simulate_measured(plan.to_bytes(), cal)
    nsrc = max(sum(len(plan.tasks[t].sources) for t in plan.mesh_tasks[m]) for m in plan.mesh_tasks)
    assert r["simulated_s"] >= nsrc * 1e-3 and r["calibration"]["name"] == "given"
    assert r["simulated_bound_by"] in r["simulated_stage_busy_s"]


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_calibrate_on_a_gpu(tmp_path):
    """On the H200: the quantizer and the copy on the GPU, writes over cuda_ipc between two
    processes (the same GPU twice when there is one), NCCL all-gather on two GPUs."""
    out = tmp_path / "gpu.json"
    p = run_wxfer("calibrate", "--quick", "--json", "--out", str(out), timeout=230)
    d = json.loads(p.stdout.strip().splitlines()[-1])
    from wxfer.plan.calibrate import load

    cal = load(str(out))
    assert cal.name.startswith("measured-cuda-") and not cal.host_sync and cal.serial
    m = d["measured"]
    # on one GPU the receivers are colocated: packed tasks run in place, small zero-copy tasks are copied
    if m["placement"] == "same":
        kinds = {k for p in m["host_probes"].values() for k in p["kinds"]}
        assert {"direct", "copy", "zero_copy", "staged"} <= kinds, m["host_probes"]
        assert cal.device_shared and cal.host_direct_task_s is not None and cal.host_copy_task_s is not None
        # the engine's writes in flight on one GPU move at about the on-device copy's rate (copy_GBps
        # counts read + write), as the colocated pushes' do (H200 run 1: one write at a time read half)
        assert cal.write_GBps > 0.6 * cal.copy_GBps / 2, (cal.write_GBps, cal.copy_GBps, m.get("write_single_GBps"))
        assert cal.host_copy_launch_s is not None and cal.host_copy_range_s is not None
    assert cal.quant_GBps > 50 and cal.copy_GBps > 500  # H200: reference ~170 GB/s, copy ~2 TB/s
    assert d["measured"]["transport"] == "cuda_ipc" and cal.write_GBps > 50
    assert d["measured"]["calibrate_s"] < 60


@pytest.mark.gpu
def test_kernel_launch_cost_is_the_streams_not_the_hosts():
    import torch
    from wxfer.tools.calibrate import measure_kernels

    k = measure_kernels(torch.device("cuda", torch.cuda.current_device()), quick=True)
    assert k["quant_GBps"] > 0 and k["copy_GBps"] > 0
    # queued behind a spinning kernel, a small quantization costs the stream less than a call
    # from Python timed to its synchronize
    assert k["device_launch_s"] is not None and 0 < k["device_launch_s"] < k["pack_call_s"] + k["quant_small_s"]
    assert k["pack_launch_s"] <= k["device_launch_s"]
