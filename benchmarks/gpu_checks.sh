#!/usr/bin/env bash
# One device call's checks of the 2026-12-07 session's GPU work, at most ~9.5 minutes, each step
# bounded (OUT=/some/dir bash benchmarks/gpu_checks.sh):
#   1. benchmarks/gpu_perf.sh: build, the begin stamps' / in-place GPU tests (test_stream_wait_gpu:
#      the fence word held for a late receiver; test_external_gpu, test_direct_gpu), the colocated
#      rows (8B BF16 / FP8 FSDP2, 1.7B) with the stream order (the default; one more push per row
#      profiled: bb_profile.py) and the host wait;
#   2. the delta GPU tests: test_delta_scatter_gpu.py (the cuda_ipc scatter), test_delta_gpu.py;
#   3. bench_delta --parts colocated (delta=True against delta=False on one GPU, 0.4% and 50%).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null; date -u
echo "=== gpu_perf (build, stream-wait/external/direct gpu tests, stream then host-wait rows, the stream ones profiled)"
(OUT=$OUT/perf WAITS="stream host" bash benchmarks/gpu_perf.sh 2>&1 | grep -v "^+" | tail -45)
echo "=== delta gpu tests at ${SECONDS}s"
timeout 150 python3 -m pytest -q -ra -m gpu tests/test_delta_scatter_gpu.py tests/test_delta_gpu.py --maxfail=5 2>&1 | tail -15
echo "=== colocated delta at ${SECONDS}s"
if [ $SECONDS -lt 420 ]; then
timeout $((570 - SECONDS)) python3 benchmarks/bench_delta.py --parts colocated --push-model medium --push-fp8 1 \
  --colocated-rates 0.004,0.5 --out "$OUT/colocated.json" >"$OUT/colocated.log" 2>&1 || tail -5 "$OUT/colocated.log"
grep '^colocated ' "$OUT/colocated.log"  # bench_delta prints each row (colocated_line)
fi
echo "=== end at ${SECONDS}s"; cp $OUT/perf/bb-device.log $OUT/perf/gpu_tests.log $OUT/ 2>/dev/null
