#!/usr/bin/env bash
# One device call (about 7-9 min on an H100) deciding issue 37's opt-in defaults from an A/B on one
# machine, and the fused delta kernel's variants (issue 36). OUT=/some/dir bash benchmarks/gpu_ab.sh
#   1. one build with the kernel sweep compiled in (without a kernel_sweep call it is the product);
#   2. tests/test_overlap_gpu.py (the copies beside the quantizer, both modes, and a late copy);
#   3. the fused delta kernel's variants against the quantize alone (bench_fused_variants.py,
#      VARIANTS; kernel-only, CUDA events, every variant checked byte for byte);
#   4. the colocated rows (MODELS, default the 8B and 1.7B rows) with the begin stamps in each
#      order of WAITS (default "stream host"), the FP8 row's large copies beside the quantizer
#      (WXFER_DIRECT_OVERLAP=$OVERLAP, default engines) -- gpu_perf.sh bench;
#   5. the 8B FP8 FSDP2 row with each overlap of OVERLAPS (default "engines 0"), profiled, the
#      begin order BEGIN_WAIT (default stream) -- gpu_perf.sh fp8 without its tests; FP8=0 skips it.
# TESTS: more test files for step 2 (bounded by TESTS_S seconds, default 120).
# 6. the stamps' fences from the rows' engine traces (benchmarks/common/fence_parts.py).
# Only 8 files come back from $OUT: the logs are saved after each step into logs.tgz.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; W=$(mktemp -d); mkdir -p "$W/r"
save() {
  cp "$W/r/tests.log" "$W/r/fused-sweep.log" "$OUT/" 2>/dev/null
  cp "$W/ab/bb-stream/results.json" "$OUT/rows-stream.json" 2>/dev/null
  cp "$W/ab/bb-host/results.json" "$OUT/rows-host.json" 2>/dev/null
  (cd "$W" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git log --oneline -1
timeout 150 env WXFER_TESTING=1 WXFER_KERNEL_SWEEP=1 python3 setup.py -q build_ext --inplace --force -j 16 \
  >"$W/r/build.log" 2>&1 || tail -20 "$W/r/build.log"
echo "=== built at ${SECONDS}s"
timeout -k 5 ${TESTS_S:-120} python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=45 -m gpu \
  tests/test_overlap_gpu.py ${TESTS:-} >"$W/r/tests.log" 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|Timeout|^E |passed|failed" "$W/r/tests.log" | head -20
save; echo "=== fused sweep at ${SECONDS}s"
timeout -k 5 ${FUSED_S:-150} python3 benchmarks/bench_fused_variants.py --variants "${VARIANTS:-p,d1:2,d3:2,d4:2}" \
  --json >"$W/r/fused-sweep.log" 2>"$W/r/fused-sweep.err"; echo "rc=$?"
grep -v '^{' "$W/r/fused-sweep.log" | tail -30; tail -5 "$W/r/fused-sweep.err"
save; echo "=== rows at ${SECONDS}s"
(OUT=$W/ab WAITS=${WAITS:-stream host} MODELS=${MODELS:-qwen3-8b,qwen3-1.7b} WXFER_DIRECT_OVERLAP=${OVERLAP:-engines} \
  bash benchmarks/gpu_perf.sh bench 2>&1 | grep -v "^+" | tail -40)
save; echo "=== fp8 overlaps at ${SECONDS}s"
[ "${FP8:-1}" = 0 ] || (OUT=$W/fp8 OVERLAPS=${OVERLAPS:-engines 0} BEGIN_WAIT=${BEGIN_WAIT:-stream} NO_TESTS=1 bash benchmarks/gpu_perf.sh fp8 \
  2>&1 | grep -v "^+" | tail -12)
timeout 30 python3 benchmarks/common/fence_parts.py $W/ab/bb-* 2>&1 | tail -12 | tee "$W/r/fence_parts.txt"
echo "=== end at ${SECONDS}s"; save
