"""vLLM's own load of the tiny DeepSeek-V3 (tests/on_vllm/trace_proc.tiny_config("deepseek_v3"), the
trainer's weights of seed 1: trainer_proc.seeded) against transformers' greedy decode of the same
weights; no wxfer involved.

    .venv-vllm/bin/python benchmarks/runs/cpu-2026-12-07-vllm/deepseek_probe.py

Run 2026-12-07 00:28 UTC on the 2-core VM:
    hf [373, 141, 38, 494, 121, 132, 153, 41]
    vllm own load [346, 98, 228, 98, 202, 470, 58, 21]
(test_reach_deepseek.py's engine after wxfer's push of the same weights: [346, 98, 228, 98, 202, 470, 58, 21])
"""

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "on_vllm")]
    import torch
    from trace_proc import tiny_config
    from trainer_proc import NEW, PROMPT, greedy, seeded
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"), dtype=torch.bfloat16).eval()
    seeded(m, 1)
    ck = tempfile.mkdtemp(prefix="wxfer-ds-probe-")
    m.save_pretrained(ck)
    p = os.path.join(ck, "config.json")
    d = json.load(open(p))
    d.update(architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid")
    json.dump(d, open(p, "w"))
    print("hf", [h[0] for h in greedy(m)])

    import wxfer.integrations.vllm as wv

    wv.register()
    wv.keep_cpu_weights()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=ck, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True
    )
    sp = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, detokenize=False, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids
    print("vllm own load", list(out))


if __name__ == "__main__":
    main()
