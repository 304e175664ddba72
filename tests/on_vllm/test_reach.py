"""Reach (issue 34.4): a real offline vllm.LLM per architecture, tiny random checkpoints, written by
trainers that pass no mapping (``WxferTrainerInitInfo(mapping=None)``): the plan comes from the map
each worker traces from vLLM's own load_weights.  After each of two pushes vLLM's greedy tokens
equal transformers' greedy decode of the trainer's weights.  OLMo2 is an architecture no line of
wxfer names; Phi-3's checkpoint holds fused qkv_proj / gate_up_proj; Gemma 2 ties its embeddings.
TP1 (vLLM's CPU platform runs TP>1 only with its multiprocess executor, which this in-process
harness does not start; the TP2 layout is covered by test_trace.py)."""

import os
import sys
import time

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_llm import NEW, Trainers, same_greedy, tokens, worker_engine  # noqa: E402

ARCHS = ["qwen3", "llama", "mistral", "qwen2", "gemma2", "phi3", "olmo2"]
TIMES = {}


def engine(path):
    import wxfer.integrations.vllm as wv

    assert wv.register() and wv.keep_cpu_weights()
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    t0 = time.monotonic()
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        weight_transfer_config=WeightTransferConfig(backend="wxfer"),
    )
    llm.wxfer_ckpt = path
    llm.wxfer_start_s = time.monotonic() - t0
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_two_pushes_by_the_traced_map_give_transformers_tokens(tmp_path, arch):
    from trace_proc import save_tiny

    t0 = time.monotonic()
    ck = str(tmp_path / arch)
    save_tiny(ck, arch)
    llm = engine(ck)
    try:
        first = tokens(llm)
        seen = []
        tr = Trainers(llm, "traced")
        kind, msg = tr.serve(lambda v, hf: seen.append((v, tokens(llm), hf, llm.get_weight_version())))
        tr.close()
        assert kind == "done", (kind, msg)
        assert [s[0] for s in seen] == [1, 2]
        for v, got, hf, version in seen:
            exact = got == [h[0] for h in hf]  # else equal up to a near tie (same_greedy)
            assert exact or same_greedy(got, hf) >= NEW // 2, f"{arch} version {v}: vLLM {got} != transformers {hf}"
            assert version == str(v)
        assert seen[0][1] != first or seen[1][1] != first
        eng = worker_engine(llm)
        assert eng.traced_map is not None and not eng.traced_map.problems
        assert eng.receiver.version() == 2 and eng.proof_result is None
        TIMES[arch] = (llm.wxfer_start_s, eng.traced_map.seconds, time.monotonic() - t0)
        print(f"{arch}: engine start {llm.wxfer_start_s:.1f} s, trace {eng.traced_map.seconds:.3f} s, "
              f"test {time.monotonic() - t0:.1f} s")
    finally:
        try:
            llm.shutdown_weight_transfer_engine()
        except Exception:  # noqa: BLE001
            pass
        del llm
