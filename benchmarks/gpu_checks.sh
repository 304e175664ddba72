#!/usr/bin/env bash
# One device call's checks of a session's GPU work, at most ~9.5 minutes, each step bounded and
# printed to stdout (only 8 files come back from $OUT). OUT=/some/dir bash benchmarks/gpu_checks.sh
#   1. one build with the kernel sweep compiled in (WXFER_KERNEL_SWEEP=1: without a kernel_sweep
#      call it is the product, so every later step runs the product's kernels);
#   2. the GPU tests of the begin stamps' orders and the in-place writes (test_stream_wait_gpu,
#      test_external_gpu, test_direct_gpu), the copies beside the quantizer (test_overlap_gpu) and
#      delta (test_delta_apply_gpu: the receiver's native apply; test_delta_gpu,
#      test_delta_scatter_gpu), verbose, pytest's faulthandler dumping stacks past 60 s;
#   3. bench_delta --parts apply (native apply against the torch apply and a device copy, per MB
#      of records) writing a copy of the H100 calibration with the measured native rate, then the
#      8B FP8 one-GPU -> one-GPU restatement and Kimi-K2's (benchmarks/restate.py) with it;
#   4. the 8B FP8 FSDP2 colocated row with the large BF16 copies beside the quantizer
#      (WXFER_DIRECT_OVERLAP=engines, the default) and without (0), each push profiled
#      (gpu_perf.sh fp8);
#   5. the fused delta kernel's variants against the quantize alone (gpu_fused_sweep.sh's bench,
#      VARIANTS below; the build of step 1 serves it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; W=$(mktemp -d); mkdir -p "$W/r"  # at most 8 files come back: chosen at the end
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 150 env WXFER_TESTING=1 WXFER_KERNEL_SWEEP=1 python3 setup.py -q build_ext --inplace --force -j 16 \
  >"$W/r/build.log" 2>&1 || tail -20 "$W/r/build.log"
echo "=== built at ${SECONDS}s"
timeout -k 5 270 python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=60 -m gpu \
  tests/test_stream_wait_gpu.py tests/test_external_gpu.py tests/test_direct_gpu.py tests/test_overlap_gpu.py \
  tests/test_delta_apply_gpu.py tests/test_delta_gpu.py tests/test_delta_scatter_gpu.py >"$W/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|Timeout|^E |passed|failed" "$W/gpu_tests.log" | head -40
echo "=== apply at ${SECONDS}s"
timeout -k 5 100 python3 benchmarks/bench_delta.py --parts apply --out "$W/r/apply.json" \
  --cal-in benchmarks/runs/h100-2026-12-07-b/cal-8b-fp8.json --cal-out "$W/cal-8b-fp8-apply.json" \
  >"$W/r/apply.log" 2>&1; echo "rc=$?"; grep -E "^apply|machine|Error" "$W/r/apply.log" | head -12
if [ -f "$W/cal-8b-fp8-apply.json" ]; then
  timeout 60 python3 -m wxfer plan --preset qwen3-8b --train-gpus 1 --infer-gpus 1 --infer-tp 1 --quant fp8 \
    --nic-gbps 400 --delta-rate 0.0031 --calibration "$W/cal-8b-fp8-apply.json" \
    --assume host_task_s=5.5e-6 --assume host_param_s=0 --assume host_piece_s=0 --json >"$W/r/plan-8b.json" 2>&1
  python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print('8B FP8 1->1 400G:', {k: d.get(k) for k in ('simulated_s','delta_s','delta_apply_s','delta_terms')})" "$W/r/plan-8b.json"
  timeout 90 python3 benchmarks/restate.py --calibration "$W/cal-8b-fp8-apply.json" --jobs kimi-k2 --delta-rate 0.0031 \
    >"$W/r/restate-kimi.log" 2>&1; tail -12 "$W/r/restate-kimi.log"
fi
echo "=== fp8 overlap at ${SECONDS}s"
(OUT=$W/fp8 OVERLAPS="engines 0" bash benchmarks/gpu_perf.sh fp8 2>&1 | grep -v "^+" | tail -30)
echo "=== fused sweep at ${SECONDS}s"
if [ $SECONDS -lt 480 ]; then
  timeout -k 5 $((560 - SECONDS)) python3 benchmarks/bench_fused_variants.py --variants "${VARIANTS:-p,d1:2,d2:2,d3:2,d4:2,d0:1}" \
    --json >"$W/r/fused-sweep.log" 2>"$W/r/fused-sweep.err"; echo "rc=$?"
  grep -v '^{' "$W/r/fused-sweep.log" | tail -30; tail -5 "$W/r/fused-sweep.err"
fi
echo "=== end at ${SECONDS}s"
cp "$W/gpu_tests.log" "$W/cal-8b-fp8-apply.json" "$W/r/apply.json" "$W/r/restate-kimi.log" "$W/r/fused-sweep.log" "$OUT/" 2>/dev/null
for o in engines 0; do cp "$W/fp8/fp8-overlap$o/results.json" "$OUT/fp8-overlap$o.json" 2>/dev/null; done
(cd "$W" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null  # every log under 2 MB, in one file
