#!/usr/bin/env bash
# Issue 37's colocated rows with Python's cyclic garbage collector paused while push() submits
# (WXFER_GC_PAUSE=1, the default) and not (0), alternated in one call (1, 0, 1: about 3 min on an
# H100), then one table (benchmarks/common/phase_table.py). OUT=/some/dir bash benchmarks/gpu_gc.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 90 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
runs=""
for g in ${GCS:-1 0 1b}; do
  WXFER_GC_PAUSE=${g%b} timeout ${ROW_S:-80} python3 benchmarks/bench_baselines.py --layouts colocated \
    --curated ${MODELS:-qwen3-8b,qwen3-1.7b} --methods link,wxfer --calibration none --max-s 70 \
    --out "$OUT/gc$g" --json >"$OUT/gc$g.log" 2>&1 || echo "gc$g: rc=$?"
  grep -E "^\[|Error" "$OUT/gc$g.log" | head -8
  runs="$runs gc$g=$OUT/gc$g"
done
timeout 30 python3 benchmarks/common/phase_table.py --label gc \
  --columns rejoin_check,begin_stamps,streams,groups,submit,per_task $runs
