#!/bin/sh
# The architectures x (vLLM's CPU GEMM as shipped / keep_cpu_weights()) table of docs/vllm.md:
# one bench_vllm_update.py run each (the tests' tiny configs, TP1, traced map, 3 pushes), raw
# output and JSON here.  Run from the repository root:
#   sh benchmarks/runs/cpu-2026-12-07-vllm/run_table.sh
D=benchmarks/runs/cpu-2026-12-07-vllm
for arch in ${ARCHS:-qwen3 llama mistral qwen2 gemma2 phi3 olmo2 qwen3_moe deepseek_v3}; do
  for mode in shipped keep; do
    flag=""; [ $mode = keep ] && flag="--keep"
    cmd=".venv-vllm/bin/python benchmarks/bench_vllm_update.py --arch $arch --pushes 3 $flag --out $D/$arch-$mode.json"
    { echo "\$ $cmd"; date -u; uptime; { timeout 900 $cmd 2>&1; echo "exit $?"; } | grep -vE '^\(|^\s*$|^frame|TCPStore|Exception raised from|omitting python|warn'; } > $D/$arch-$mode.txt
  done
done
