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


def _run(tmp, moe, fp8, tp, post=True, ep=False, keep=True, plant=None, **kw):
    from wxfer.runtime.control import free_port
    from vhelp import save_checkpoint

    ck = os.path.join(tmp, "ckpt")
    save_checkpoint(ck, moe=moe, fp8=fp8, **kw)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    env.pop("WXFER_TEST_PLANT", None)
    if plant:
        env["WXFER_TEST_PLANT"] = plant
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
    if fp8 and "amx_tile" not in open("/proc/cpuinfo").read():
        # ValueError "Failed to find a kernel that can implement the ScaledMM linear layer" from
        # Fp8LinearMethod.create_weights: the model cannot be built here (it could not before either)
        pytest.skip("vLLM 0.32's CPU FP8 block linear needs AMX (Sapphire Rapids or newer); this CPU has none")
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
        if post:  # BF16 Qwen3, vLLM's GEMM on the parameters: every parameter direct, all layers
            c = rep["classes"]
            assert c["refused"] == [] and c["finalize"] == {} and c["kept_bytes"] == 0, c
            assert sorted(c["direct_names"]) == sorted(rep["selected"]), c
        else:
            assert rep["classes"] is None


def test_vllm_cpu_gemm_dispatch_is_finalize(tmp_path):
    """Without keep_cpu_weights vLLM's CPU platform repacks every linear weight into a private copy
    and leaves a shape-[0] parameter: the proof makes each such layer finalize (the loader-layout
    weight kept, vLLM's dispatch re-run), the norms direct."""
    (rep,) = _run(str(tmp_path), False, False, 1, keep=False)
    c = rep["classes"]
    assert rep["params"]["model.layers.0.self_attn.qkv_proj.weight"][0] == [0]
    assert c["refused"] == [], c["refused"]
    for m in ("model.embed_tokens", "lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.qkv_proj"):
        assert c["finalize"][m] == ["weight"], c["finalize"]
    assert "model.layers.0.input_layernorm.weight" in c["direct_names"]
    assert not any(n.endswith("proj.weight") for n in c["direct_names"])
    assert c["kept_bytes"] == 2 * 256 * (512 + 512 + 2 * (512 + 256 + 512 + 256)), c["kept_bytes"]
    assert all(len(s) == 3 and max(s) < 5 for s in c["finalize_s"].values()), c["finalize_s"]


def test_cpu_moe_prepacking_is_finalize(tmp_path):
    """vLLM's CPU MoE prepacks the experts after loading (new tensors, its own layout): the experts
    are finalize (their loader layout kept, the prepack re-run), everything else direct."""
    (rep,) = _run(str(tmp_path), True, False, 1, post=True)
    c = rep["classes"]
    assert c["refused"] == [], c["refused"]
    assert c["finalize"] == {
        f"model.layers.{i}.mlp.experts.routed_experts": ["w13_weight", "w2_weight"] for i in (0, 1)
    }, c["finalize"]
    assert c["kept_bytes"] == 2 * 2 * 4 * 256 * 128 * 3, c["kept_bytes"]  # w13 (4, 256, 256) + w2 (4, 256, 128)
    assert "model.layers.1.mlp.gate.weight" in c["direct_names"] and len(c["direct_names"]) == 17


def test_a_planted_relayout_is_never_direct(tmp_path):
    """A post-processing of our own that re-lays o_proj (transposed, a new tensor) is finalize: the
    loader-layout bytes kept, the transpose re-run, the result equal to vLLM's; never direct."""
    (rep,) = _run(str(tmp_path), False, False, 1, plant="transpose")
    c = rep["classes"]
    assert c["finalize"] == {"model.layers.0.self_attn.o_proj": ["weight"]}, c
    assert "model.layers.0.self_attn.o_proj.weight" not in c["direct_names"]
    assert "model.layers.1.self_attn.o_proj.weight" in c["direct_names"] and c["refused"] == []


def test_a_irreproducible_post_processing_and_d_an_inconstant_buffer_are_refused_by_name(tmp_path):
    """(One model for both.) A post-processing that fills a buffer of o_proj with fresh random
    numbers (no re-run reproduces it): o_proj is neither direct nor finalize, its buffer refused by
    name. A buffer on every decoder layer, random at build, that nothing writes: refused by name as
    neither written nor constant."""
    (rep,) = _run(str(tmp_path), False, False, 1, plant="random,init-buffer")
    c = rep["classes"]
    assert c["finalize"] == {} and "model.layers.0.self_attn.o_proj.weight" not in c["direct_names"], c
    noise = [r for r in c["refused"] if r.startswith("model.layers.0.self_attn.o_proj.planted_noise:")]
    state = [r for r in c["refused"] if ".planted_state:" in r]
    assert noise and len(noise) + len(state) == len(c["refused"]), c["refused"]
    assert {r.split(":")[0] for r in state} == {f"model.layers.{i}.planted_state" for i in (0, 1)}, state
    assert all("neither written by wxfer nor constant" in r for r in state), state
