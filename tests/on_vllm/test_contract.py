"""The parameter contract on vLLM's own model classes (Qwen3 and Qwen3-MoE, BF16 and FP8 block,
TP1 and TP2 in real processes), each built from a tiny HF checkpoint with vLLM's CPU GEMM
dispatch kept on the parameters (wxfer.integrations.vllm.keep_cpu_weights: vLLM's CPU
platform otherwise repacks linear weights and leaves shape-[0] parameters): every parameter
the mapping writes is there under the mapping's name or vLLM's renamed one, with its shape and
dtype; the bytes vLLM's own load_weights lays for seeded checkpoint tensors equal the mapping's
reference packing (the layout proof); a deliberately wrong mapping is caught by it; vLLM's
factory builds the wxfer engine."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CASES = {}


def _run(tmp, moe, fp8, tp, post=True, ep=False, keep=True, **kw):
    from wxfer.runtime.control import free_port
    from vhelp import save_checkpoint

    ck = os.path.join(tmp, "ckpt")
    save_checkpoint(ck, moe=moe, fp8=fp8, **kw)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "vhelp.py"),
                "contract",
                ck,
                str(tp),
                str(r),
                str(port),
                os.path.join(tmp, "r%d.json" % r),
                "1" if post else "0",
                "1" if ep else "0",
                "1" if keep else "0",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(tp)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n" + outs[r][-4000:]
    return [json.load(open(os.path.join(tmp, "r%d.json" % r))) for r in range(tp)]


# FP8 runs without process_weights_after_loading: on vLLM's CPU platform the FP8 linear
# post-processing re-lays some weights (the router comes out float32 and transposed), which the
# contract tests separately (test_cpu_fp8_post_processing_is_refused)
CASES = {  # id: (moe, fp8, tp, ep)
    "qwen3-bf16-tp1": (False, False, 1, False),
    "qwen3-fp8-tp1": (False, True, 1, False),
    "moe-bf16-tp1": (True, False, 1, False),
    "moe-fp8-tp1": (True, True, 1, False),
    "qwen3-bf16-tp2": (False, False, 2, False),
    "qwen3-fp8-tp2": (False, True, 2, False),
    "moe-bf16-tp2": (True, False, 2, False),
    "moe-fp8-tp2": (True, True, 2, False),
    "moe-bf16-tp2-ep": (True, False, 2, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_contract_and_layout_proof(tmp_path, case):
    moe, fp8, tp, ep = CASES[case]
    # FP8 at TP2: head_dim 128 and moe_intermediate 256 so that every rank's rows are whole 128-row
    # blocks (the mapping refuses a block split across ranks, by name)
    big = fp8 and tp > 1
    # post-processing only for dense BF16: vLLM's CPU platform re-lays FP8 weights and prepacks MoE
    # experts (refused, see the tests below); without it the model holds the loader's own layout
    post = not fp8 and not moe
    reps = _run(
        str(tmp_path), moe, fp8, tp, post=post, ep=ep, head_dim=128 if big else 64, moe_inter=256 if big else 128
    )
    for r, rep in enumerate(reps):
        assert not rep["missing"], rep["missing"]
        assert rep["shape_error"] is None, rep["shape_error"]
        # what the mapping does not write: the attention's activation / KV-cache scales
        weights = [n for n in rep["params"] if not n.endswith(("q_scale", "k_scale", "v_scale", "prob_scale"))]
        assert sorted(rep["left"]) == sorted(set(rep["params"]) - set(weights)), rep["left"]
        assert len(rep["selected"]) == len(rep["expected"]) == len(weights)
        for n, (shape, dt) in rep["expected"].items():
            vn = n if n in rep["params"] else n.replace(".experts.", ".experts.routed_experts.", 1)
            assert rep["params"][vn] == [shape, dt], (n, rep["params"][vn], shape, dt)
        if moe:
            assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in rep["params"]
            assert rep["gate_fp8"] == [fp8]  # the router follows the checkpoint's quantization config
            assert rep["params"]["model.layers.0.mlp.gate.weight"][1] == ("float8_e4m3fn" if fp8 else "bfloat16")
        if fp8:
            assert rep["params"]["model.layers.0.self_attn.qkv_proj.weight_scale_inv"][1] == "float32"
        # bit equality of what vLLM's load_weights lays with what the mapping packs
        assert rep["proof_errors"] == [], rep["proof_errors"]
        assert (
            "lm_head.weight" in rep["proof_params"]
            and "model.layers.1.mlp.down_proj.weight" in rep["proof_params"]
            or moe
        )
        assert len(rep["proof_params"]) >= 10
        # the deliberately wrong mapping (gate/up swapped in gate_up_proj) is caught, by name
        if not moe:
            assert rep["wrong_errors"] and all("gate_up_proj" in e for e in rep["wrong_errors"]), rep["wrong_errors"]
        if moe and tp > 1:  # the layout of the other expert placement (EP on / off) is caught too
            assert any("experts.w13_weight" in e for e in rep["ep_errors"]), rep["ep_errors"]
        assert rep["engine"] == "wxfer.integrations.vllm.engine.WxferWeightTransferEngine"
        if fp8:  # this loader layout is what a GPU FP8 block kernel serves; vLLM's CPU FP8 kernel re-lays it
            assert rep["refusals"] and all("CPUFp8BlockScaledMMKernel" in r for r in rep["refusals"]), rep["refusals"]
        else:  # (MoE: vLLM's CPU experts, which would prepack it, are chosen by post-processing, not run here)
            assert rep["refusals"] == []


def test_vllm_cpu_gemm_dispatch_is_refused_by_name(tmp_path):
    """Without keep_cpu_weights, vLLM's CPU platform repacks: the setup checks name every layer."""
    (rep,) = _run(str(tmp_path), False, False, 1, keep=False)
    assert "model.layers.0.self_attn.qkv_proj.weight: vLLM holds (0,)" in rep["shape_error"], rep["shape_error"]
    refused = [r.split(":")[0] for r in rep["refusals"]]
    assert "model.embed_tokens" in refused and "lm_head" in refused and "model.layers.1.mlp.down_proj" in refused
    assert all("keep_cpu_weights" in r for r in rep["refusals"])


def test_cpu_moe_prepacking_is_refused(tmp_path):
    """vLLM's CPU MoE prepacks the experts after loading (new tensors, its own layout): refused by name."""
    (rep,) = _run(str(tmp_path), True, False, 1, post=True)
    moe = [r for r in rep["refusals"] if "mlp.experts" in r]
    assert moe and all("prepacks w13_weight / w2_weight" in r for r in moe), rep["refusals"]


def test_cpu_fp8_post_processing_is_refused(tmp_path):
    """vLLM's CPU FP8 post-processing re-lays the MoE router: the setup check names it."""
    (rep,) = _run(str(tmp_path), True, True, 1, post=True)
    assert rep["shape_error"] and "model.layers.0.mlp.gate.weight" in rep["shape_error"], rep["shape_error"]
