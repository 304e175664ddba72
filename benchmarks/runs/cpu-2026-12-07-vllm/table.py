"""The markdown table of docs/vllm.md from the JSON files run_table.sh wrote here (python table.py)."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ["qwen3", "llama", "mistral", "qwen2", "gemma2", "phi3", "olmo2", "qwen3_moe", "deepseek_v3"]
print(
    "| architecture | CPU GEMM | direct | finalize modules (kept) | refused | trace s | proof s | "
    "trainer_init s | finalize per update s | whole update s (worker / trainer) | vLLM's reload s | file |"
)
print("|---" * 12 + "|")
for arch in ORDER:
    for mode in ("shipped", "keep"):
        f = os.path.join(HERE, f"{arch}-{mode}.json")
        if not os.path.exists(f):
            print(f"| {arch} | {mode} | | | no result: see {arch}-{mode}.txt | | | | | | | {arch}-{mode}.txt |")
            continue
        r = json.load(open(f))
        w, t = r["worker_median"], r["trainer_median"]
        fin = [p["worker"]["finalize_s"] for p in r["pushes"]]
        gemm = "`keep_cpu_weights()`" if r["keep"] else "as shipped"
        print(
            f"| {arch} | {gemm} | {r['direct']} | {r['finalize_modules']} ({r['kept_bytes'] / 2**20:.2f} MiB) | none | "
            f"{r['trace_s']:.3f} | {r['proof_s']:.2f} | {r['trainer_init_s']:.2f} | "
            f"{min(fin):.4f}-{max(fin):.4f} | {w['total_s']:.3f} / {t['total_s']:.3f} | "
            f"{sorted(r['reload_s'])[len(r['reload_s']) // 2]:.3f} | {arch}-{mode}.txt |"
        )
