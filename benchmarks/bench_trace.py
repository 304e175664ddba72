"""Setup-trace seconds against parameter count (issue 34.6): vLLM's own Qwen3 / Qwen3-MoE model
classes (TP1, vLLM's CPU platform, no weights loaded), their ``load_weights`` traced over the HF
checkpoint's names and shapes (taken from transformers' model on the meta device: nothing
allocated for it), then the map turned into the plan's shards.

    .venv-vllm/bin/python benchmarks/bench_trace.py            # sizes: tiny, small, medium
    .venv-vllm/bin/python benchmarks/bench_trace.py --sizes tiny,small --json

Prints the machine, then per size: parameters, checkpoint tensors, parameters written, runs in
the map, map bytes (to_bytes), trace seconds, shard-conversion seconds.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests", "on_vllm")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SIZES = {  # name: (arch, hidden, layers, intermediate, heads, kv heads, vocab)
    "tiny": ("qwen3", 256, 2, 256, 4, 2, 512),
    "small": ("qwen3", 1024, 8, 3072, 16, 8, 32768),
    "medium": ("qwen3", 2048, 16, 6144, 16, 8, 65536),
    "moe": ("qwen3_moe", 1024, 8, 3072, 16, 8, 32768),
}


def machine() -> str:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}"


def one(name, tmp):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config

    from trace_proc import build, tiny_config
    from wxfer.integrations.vllm.trace import trace_model
    from wxfer.mapping.traced import rank_shards

    arch, h, layers, inter, nh, kv, vocab = SIZES[name]
    over = dict(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=nh)
    over.update(num_key_value_heads=kv, vocab_size=vocab, head_dim=h // nh)
    if arch == "qwen3_moe":
        over.update(moe_intermediate_size=inter // 4)
    cfg = tiny_config(arch, **over)
    if arch == "qwen3_moe":
        cfg.num_experts = 32
    # named, else vLLM adapts the config as a pooling model (no lm_head)
    cfg.architectures = ["Qwen3MoeForCausalLM" if arch == "qwen3_moe" else "Qwen3ForCausalLM"]
    path = os.path.join(tmp, name)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ckpt = [(n, tuple(p.shape), "bfloat16") for n, p in hf.named_parameters()]
    vc, model = build(path, 1)
    with set_current_vllm_config(vc):
        m = trace_model(model, ckpt)
    t0 = time.perf_counter()
    params, shards, problems = rank_shards(m)
    conv = time.perf_counter() - t0
    assert not problems and not m.problems, (problems, m.problems)
    used = m.sources_into(m.written())
    return dict(
        unused=sorted(n for n in m.sources if n not in used)[:4],
        size=name,
        arch=arch,
        params=sum(p.numel() for p in model.parameters()),
        ckpt_tensors=len(ckpt),
        written=len(m.written()),
        runs=int(sum(len(r[0]) for r in m.runs.values())),
        map_bytes=len(m.to_bytes()),
        trace_s=round(m.seconds, 4),
        shards_s=round(conv, 4),
        shards=len(shards),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,small,medium,moe")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from trace_proc import init_dist
    from wxfer.runtime.control import free_port

    init_dist(1, 0, free_port())
    print("machine:", machine())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.sizes.split(","):
            r = one(s, tmp)
            rows.append(r)
            if not a.json:
                print(
                    f"{r['size']:>7} {r['arch']:>9}: {r['params'] / 1e6:8.1f} M params, "
                    f"{r['ckpt_tensors']:5d} checkpoint "
                    f"tensors, {r['written']:5d} written, {r['runs']:6d} runs, map {r['map_bytes'] / 1e3:7.1f} kB, "
                    f"trace {r['trace_s']:.3f} s, shards {r['shards_s']:.3f} s, not loaded: {r['unused']}",
                    flush=True,
                )
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
