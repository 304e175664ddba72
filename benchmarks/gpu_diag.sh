#!/usr/bin/env bash
# One device call (at most ~9.5 min; OUT=/some/dir bash benchmarks/gpu_diag.sh):
#   1. build;
#   2. the begin stamps' / in-place GPU tests one file at a time, verbose and unbuffered, each
#      bounded, with pytest's faulthandler dumping every thread's stack for a test past 45 s
#      (the 2026-12-07 H100 call's log of these came back empty: which test, if any, blocks?);
#   3. the rest of `make gpu-test` (every gpu-marked test but those three files), bounded;
#   4. bench_delta --parts scatter: the cuda_ipc scatter kernel against a dense copy of the same
#      range at 0.1-50% changed, and (--scatter-push 1) forced scatter pushes against dense ones.
# Every step's result is printed to stdout (only 8 files come back from $OUT).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 240 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
echo "=== built at ${SECONDS}s"
PYT="python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=45 -m gpu"
for f in test_stream_wait_gpu test_external_gpu test_direct_gpu; do
  echo "=== $f at ${SECONDS}s"
  timeout -k 5 100 $PYT tests/$f.py >"$OUT/$f.log" 2>&1; echo "rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Timeout|File \"/|^E " "$OUT/$f.log" | head -60
done
echo "=== other gpu tests at ${SECONDS}s"
timeout -k 5 $((420 - SECONDS)) python3 -u -m pytest -q -ra -p no:cacheprovider -o faulthandler_timeout=60 \
  -m "gpu or gpu2" tests --ignore=tests/test_stream_wait_gpu.py --ignore=tests/test_external_gpu.py \
  --ignore=tests/test_direct_gpu.py --ignore=tests/on_vllm >"$OUT/gpu_rest.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|ERROR|Timeout" "$OUT/gpu_rest.log" | tail -25
echo "=== scatter at ${SECONDS}s"
if [ $SECONDS -lt 470 ]; then
  timeout -k 5 $((560 - SECONDS)) python3 benchmarks/bench_delta.py --parts scatter --scatter-push 1 \
    --push-model medium --push-fp8 1 --out "$OUT/scatter.json" >"$OUT/scatter.log" 2>&1; echo "rc=$?"
  tail -30 "$OUT/scatter.log"
fi
echo "=== end at ${SECONDS}s"
