"""Qwen3-MoE in a real offline vllm.LLM on CPU through finalize: vLLM's CPU MoE prepacks the
experts after loading, so the proof at setup classifies each layer's experts finalize (their
loader layout kept and registered, the prepack re-run in finish_weight_update); two pushes from
transformers' Qwen3MoeForCausalLM (trainer_proc.py), and after each vLLM's greedy tokens equal
transformers' (up to BF16 near ties, test_llm.same_greedy); the backend reports the finalize
seconds per module and the bytes kept.  vLLM's CPU GEMM dispatch is left as vLLM ships it (not
keep_cpu_weights): every linear layer computes from a packed copy made after loading, so the
proof makes it finalize too (its loader-layout weight kept, the dispatch re-run); the norms are
direct."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# (test_llm sets vLLM's in-process CPU environment on import, before anything imports vLLM)
from test_llm import served, tokens, ulp_bf16, worker_engine  # noqa: E402
from trainer_proc import PROMPT  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vhelp import save_checkpoint

    import wxfer.integrations.vllm as wv

    import vllm.model_executor.layers.utils as U

    assert wv.register()
    # vLLM's CPU GEMM dispatch as vLLM ships it (test_llm.py's keep_cpu_weights() undone for this
    # module): every linear layer computes from a packed copy, so it is finalize too
    patched = U.dispatch_cpu_unquantized_gemm
    U.dispatch_cpu_unquantized_gemm = getattr(patched, "_wxfer_original", patched)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # an engine of an earlier module in this process (test_llm.py) left vLLM's process groups
    # without the expert-parallel one a MoE model needs: vLLM's own cleanup, then a fresh start
    cleanup_dist_env_and_memory()

    ck = str(tmp_path_factory.mktemp("ckpt_moe"))
    save_checkpoint(ck, moe=True, seed=0)
    from vhelp import release, wxfer_llm

    engine = wxfer_llm(ck)
    yield engine
    release(engine)
    U.dispatch_cpu_unquantized_gemm = patched


def leading_equal(got, hf) -> int:
    """How many leading greedy tokens equal transformers' [(token, runner-up, margin, top)]; a step
    where vLLM took the runner-up of a near tie (within 2 BF16 ulps) counts as equal and ends it."""
    n = 0
    for g, (tok, second, margin, top) in zip(got, hf):
        if g == tok:
            n += 1
            continue
        if g == second and margin <= 2 * ulp_bf16(top):
            n += 1
        break
    return n


def all_equal(got, hf, min_ulps=4.0):
    """All of vLLM's greedy tokens equal transformers' (hf: [(token, runner-up, margin, top logit)]).
    vLLM's CPU kernels and transformers' round differently (measured on this model: log-probs of
    the same token 0.00-0.14 apart, at most 2.3 BF16 ulps), so a step whose two best logits are
    closer may go either way; the seeds are chosen so that none is (asserted here first)."""
    margins = [m / ulp_bf16(top) for _, _, m, top in hf]
    assert min(margins) >= min_ulps, (
        f"transformers' greedy decode has a near tie (margins in BF16 ulps {margins}): choose other trainer seeds"
    )
    assert list(got) == [h[0] for h in hf], f"vLLM {list(got)} != transformers {[h[0] for h in hf]}"


def router_margin_ulps(ckpt, seed, prompt_and_tokens):
    """The smallest gap, in BF16 ulps, between the k-th and (k+1)-th router logit over every MoE
    layer and position of transformers' forward of the sequence: where it is ~0 (a tie in the top-k
    choice) vLLM's rounding may pick the other expert, and its logits then part by far more than a
    rounding (seeds 11 and 12: a router tie at the last step, vLLM's log-prob of transformers'
    token 0.38 lower, its runner-up taken)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trainer_proc import seeded

    cfg = AutoConfig.from_pretrained(ckpt)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    seeded(hf, seed)
    with torch.no_grad():
        out = hf(torch.tensor([prompt_and_tokens]), output_router_logits=True)
    k, worst = cfg.num_experts_per_tok, float("inf")
    for r in out.router_logits:
        top = r.float().sort(-1, descending=True).values
        for a, b in zip(top[:, k - 1].tolist(), top[:, k].tolist()):
            worst = min(worst, (a - b) / ulp_bf16(a))
    return worst


def plant_swapped_experts(eng, layer=0):
    """Swap experts 0 and 1 of `layer` in the kept loader-layout memory the Receiver registered
    (what a mapping that permutes experts would write) and finalize; again restores them."""
    import torch

    fin = {f.module_name: f for f in eng.finalizers}[f"model.layers.{layer}.mlp.experts.routed_experts"]
    with torch.no_grad():
        for name in ("w13_weight", "w2_weight"):
            w = fin.params[name]
            w[[0, 1]] = w[[1, 0]].clone()
    eng.run_finalizers()


def assert_every_tensor_equals_vllms_first_load(llm, seed):
    """Every parameter, buffer and derived tensor of the engine's model after the push (the
    finalized experts included) equals what vLLM's own first load makes of the trainer's weights:
    a fresh model, its load_weights, vLLM's process_weights_after_loading."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trainer_proc import seeded

    from wxfer.integrations.vllm.postproc import _reference, _state

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llm.wxfer_ckpt), dtype=torch.bfloat16)
    seeded(hf, seed)
    eng = worker_engine(llm)
    ref, _, derived = _reference(eng.vllm_config, "cpu", [(n, p.detach()) for n, p in hf.named_parameters()])
    live = _state(dict(eng.model.named_modules()), derived)
    differ = [(m, n) for m in ref for n in ref[m] if live.get(m, {}).get(n) != ref[m][n]]
    assert not differ, differ[:8]
    assert any("routed_experts" in m and "w13_weight" in ref[m] for m in ref)


SEED0 = 56  # trainer weights of seeds 57 and 58: no near tie (logits >= 6 ulps, router >= 11 ulps)


def test_moe_two_pushes_through_finalize(llm, monkeypatch):
    monkeypatch.setenv("WXFER_TEST_SEED0", str(SEED0))
    first = tokens(llm)
    seen = []

    def on_pushed(v, hf_tokens):
        seen.append((v, tokens(llm), hf_tokens, dict(worker_engine(llm).finalize_report)))
        seq = PROMPT + [h[0] for h in hf_tokens]
        assert router_margin_ulps(llm.wxfer_ckpt, SEED0 + v, seq) >= 4, "a router near tie: choose other seeds"
        if v == 1:
            assert_every_tensor_equals_vllms_first_load(llm, seed=SEED0 + 1)
        if v == 2:  # the check can fail: two experts swapped in what wxfer wrote, then put back
            eng = worker_engine(llm)
            plant_swapped_experts(eng)
            wrong = tokens(llm)
            plant_swapped_experts(eng)
            with pytest.raises(AssertionError, match="!= transformers"):
                all_equal(wrong, hf_tokens)
            assert tokens(llm) == seen[-1][1]

    served(llm, "ok", on_pushed)
    assert [s[0] for s in seen] == [1, 2]
    for v, got, hf, _ in seen:
        all_equal(got, hf)  # all 8 (the bytes are vLLM's own first load's, checked above)
        print(f"\nversion {v}: vLLM {got}, transformers {[h[0] for h in hf]}")
    assert seen[0][1] != first and seen[1][1] != seen[0][1]
    eng = worker_engine(llm)
    classes = eng.proof_result["classes"]
    experts = [f"model.layers.{i}.mlp.experts.routed_experts" for i in (0, 1)]
    linear = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate")
    ]
    assert sorted(classes["finalize"]) == sorted(experts + linear) and classes["refused"] == [], classes
    assert eng.proof_result["classes"]["direct"] == 9  # the norms (q, k, input, post-attention; final)
    for _, _, _, rep in seen:  # reported by the backend after each update
        assert sorted(rep["modules"]) == sorted(experts + linear) and rep["seconds"] > 0, rep
    # experts w13 (4, 256, 256) + w2 (4, 256, 128); qkv 512x256, o 256x256, router 4x256; head, embeddings 512x256
    kept = 2 * (2 * 4 * 256 * 384 + 2 * 256 * (512 + 256 + 4) + 2 * 512 * 256)
    assert seen[1][3]["updates"] == 2 and seen[1][3]["kept_bytes"] == kept, seen[1][3]
    up = eng.update_report  # the whole update timed by the backend (the planted finalizes are no update)
    assert up["version"] == 2 and up["finalize_s"] > 0 and up["total_s"] >= up["write_s"] + up["finish_s"], up
    # the finalize memory is what the Receiver registered for the experts
    w13 = eng.receiver.params["model.layers.0.mlp.experts.w13_weight"]
    fin = {f.module_name: f for f in eng.finalizers}
    assert w13.data_ptr() == fin[experts[0]].params["w13_weight"].data_ptr()
    print(
        "\nMoE setup %.1f s, proof %.2f s, finalize per update %s"
        % (llm.wxfer_start_s, eng.proof_result["seconds"], [round(s[3]["seconds"], 4) for s in seen])
    )
