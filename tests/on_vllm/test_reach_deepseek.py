"""DeepSeek-V3 (tiny: MLA, one dense and one MoE layer, ``noaux_tc`` routing; mla_proc.tiny_config,
BF16, no MTP weights) end to end in a real offline vllm.LLM on CPU with ``keep_cpu_weights()``:
two jobs on one engine, the trainer with the hand-written rules (the HF config dict: the
deepseek_v3 preset) and with ``mapping=None`` (the traced map), two pushes each.

What it took (issue 34.4): vLLM's ``RoutedExperts`` registers its gate's
``e_score_correction_bias`` Parameter as its own as well, and the experts are finalize (vLLM's CPU
MoE).  The proof put the experts' saved state back before trying their finalizer, and with it the
shared bias the direct pass had written through the gate: it refused
``...experts.routed_experts.e_score_correction_bias ... (after finalize)``; it now writes the
in-place destinations again after that.  transformers 5 holds the bias as a persistent buffer,
which the Sender did not push (``the training model lacks checkpoint tensor``): the trainer engine
now pushes the model's persistent buffers too (``trainer.with_persistent_buffers``).

After each push every tensor of the engine's model equals vLLM's own first load of the trainer's
weights (a fresh model, load_weights, process_weights_after_loading), and the greedy tokens change
with the weights.  They are not compared with transformers': vLLM 0.32's CPU DeepSeek-V3 and
transformers 5's differ on this config from the first token with no wxfer involved (vLLM loading
the trainer's weights of seed 1 as a checkpoint: [346, 98, 228, ...], transformers: [373, 141,
38, ...]; benchmarks/runs/cpu-2026-12-07-vllm/deepseek_probe.py), and wxfer's pushed engine gave
vLLM's own tokens."""

import gc
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# (test_llm sets vLLM's in-process CPU environment on import, before anything imports vLLM)
from test_llm import served, tokens, worker_engine  # noqa: E402
from test_traced_proof import every_tensor_equals_vllms_first_load  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from trace_proc import save_tiny

    import wxfer.integrations.vllm as wv

    assert wv.register() and wv.keep_cpu_weights()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # an earlier module's engine left process groups without EP
    ck = str(tmp_path_factory.mktemp("ds") / "deepseek_v3")
    save_tiny(ck, "deepseek_v3")
    from vhelp import release, wxfer_llm

    engine = wxfer_llm(ck)
    yield engine
    release(engine)
    gc.collect()


@pytest.mark.parametrize("mode", ["ok", "traced"])
def test_deepseek_v3_two_pushes(llm, mode, monkeypatch):
    seed0 = {"ok": 0, "traced": 10}[mode]
    monkeypatch.setenv("WXFER_TEST_SEED0", str(seed0))
    seen, first = [], tokens(llm)

    def pushed(v, hf):
        eng = worker_engine(llm)
        seen.append((v, tokens(llm), hf, dict(eng.update_report or {}), sorted(eng.receiver.params)))
        every_tensor_equals_vllms_first_load(llm, llm.wxfer_ckpt, seed=seed0 + v)

    served(llm, mode, pushed, shutdown=True)
    assert [s[0] for s in seen] == [1, 2]
    for v, got, hf, up, _ in seen:
        assert up["version"] == v and up["total_s"] >= up["write_s"] + up["finish_s"], up
    assert seen[0][1] != first and seen[1][1] != seen[0][1]
    eng = worker_engine(llm)
    cls = eng.proof_result["classes"]
    assert cls["refused"] == [] and list(cls["finalize"]) == ["model.layers.1.mlp.experts.routed_experts"], cls
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in seen[0][4]
    print(f"\n{mode}: vLLM {[s[1] for s in seen]}, transformers {[[h[0] for h in s[2]] for s in seen]}")
