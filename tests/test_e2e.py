"""The demo's checks, small: real processes (FSDP2 trainers over gloo, inference workers),
real sockets (fabric tcp).  Each run: every inference parameter equals, bit for bit, the
mapping's reference packing of the trainers' weights, and the inference replicas' logits
match the trainer's.  GPU variants carry the gpu / gpu2 markers."""

import json
import os

import pytest

from wxfer import _wxfer

from helpers import run_json  # tests/helpers.py

FABRIC = _wxfer.backends()["fabric"][0]
needs_fabric = pytest.mark.skipif(not FABRIC, reason="fabric transport not built: %s" % _wxfer.backends()["fabric"][1])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(monkeypatch=None, **kw):
    """run_demo(**kw) (tiny, 150 s, quiet unless `kw` says otherwise), on the CPU where a
    monkeypatch is given: its result, checked (_check) for its `steps` steps."""
    from wxfer.tools.demo import run_demo

    if monkeypatch is not None:
        monkeypatch.setenv("WXFER_DEMO_CPU", "1")
    kw.setdefault("size", "tiny")
    kw.setdefault("timeout", 150)
    kw.setdefault("log", lambda *a: None)
    res = run_demo(**kw)
    _check(res, kw["steps"])
    return res


def _check(res, steps):
    assert res["steps"] == steps and res["verified"], res
    assert res["bitexact"] and not res["mismatches"]
    assert len(res["step_s"]) == steps and all(t > 0 for t in res["step_s"])
    assert res["bytes_per_step"] > 0 and res["gbps"] > 0


@needs_fabric
@pytest.mark.timeout(200)
def test_demo_cli_bf16_json_and_unchanged_step():
    argv = ["demo", "--size", "tiny", "--steps", "2", "--unchanged-step", "--json", "--timeout", "150"]
    res, log = run_json("-m", "wxfer", *argv, timeout=190, env=dict(WXFER_DEMO_CPU="1"))
    for k in ("steps", "verified", "transport", "bytes_per_step", "step_s", "gbps", "simulated_s"):
        assert k in res
    _check(res, 3)
    assert res["simulated_s"] > 0 and res["calibration"]["name"] == "measured-cpu-host"  # issue 15, 24
    assert res["transport"] == "fabric" and res["replicas"] == 2 and res["tp"] == 2
    assert res["logits_ok"] and max(res["logits_rel_err"]) < 0.02
    # the step with nothing changed moved the same bytes and left the receivers identical
    assert res["unchanged_ok"] is True
    assert len(set(res["moved_bytes"])) == 1
    assert "step 3 (nothing changed)" in log


@needs_fabric
@pytest.mark.timeout(200)
def test_demo_fp8_with_cpu_offload(monkeypatch):
    res = _demo(monkeypatch, fp8=True, cpu_offload=True, replicas=1, steps=2)
    assert res["fp8"] and res["cpu_offload"] and res["logits_ok"]
    assert 0 < max(res["logits_rel_err"]) < 0.25


@needs_fabric
@pytest.mark.timeout(200)
def test_demo_mesh_groups_with_an_expert_sub_mesh(monkeypatch):
    # 4 trainers as 2 x 2 training transformers' Qwen3MoeForCausalLM (experts fused 3-D, as
    # transformers 5 stores them): dense layers HSDP sharded over the rows {0,1},{2,3}; the
    # routed experts HSDP sharded (along the experts) over the columns {0,2},{1,3} -> 2 mesh
    # groups; inference side: expert parallel (each TP rank holds whole experts); logits
    # through transformers' forward
    res = _demo(monkeypatch, moe=True, ep=True, trainers=4, replicas=1, steps=2)
    assert res["mesh_groups"] == 2 and res["ep"] and res["logits_ok"]
    assert res["logits_rel_err"] == [0.0]  # BF16: the inference bytes are the trainers' weights in BF16


@needs_fabric
@pytest.mark.timeout(200)
def test_demo_moe_fp8_experts_tp_sliced(monkeypatch):
    # without expert parallelism every inference rank holds every expert's half of the
    # intermediate dimension, FP8 on each expert's own 128x128 grid, from the fused 3-D params
    res = _demo(monkeypatch, moe=True, fp8=True, trainers=2, replicas=1, steps=1)
    assert res["fp8"] and not res["ep"] and res["logits_ok"] and 0 < max(res["logits_rel_err"]) < 0.25


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_demo_gpu_bf16_and_fp8_cpu_offload():
    for fp8, off in ((False, False), (True, True)):
        res = _demo(fp8=fp8, cpu_offload=off, replicas=1, trainers=1, steps=2, timeout=240)
        assert res["device"] == "cuda" and res["logits_ok"] and res["transport"] == "cuda_ipc"
        # weight memory registered per caching-allocator segment: fewer regions than parameters
        assert all(mode == "segments" and 0 < regions < params for params, regions, mode in res["receiver_regions"])
        print("gpu demo:", json.dumps(res))


@pytest.mark.gpu2
@pytest.mark.timeout(300)
def test_demo_two_gpus_trainers_and_receivers_spread():
    res = _demo(trainers=2, replicas=1, tp=2, steps=3, size="small", timeout=240)
    assert res["device"] == "cuda" and res["logits_ok"] and res["transport"] == "cuda_ipc"
    assert all(mode == "segments" for _, _, mode in res["receiver_regions"])
    print("gpu2 demo:", json.dumps(res))
