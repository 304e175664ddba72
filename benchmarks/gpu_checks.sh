#!/usr/bin/env bash
# One device call's checks of a session's GPU work, at most ~9.8 minutes, each step bounded and
# printed to stdout (only 8 files come back from $OUT). OUT=/some/dir bash benchmarks/gpu_checks.sh
#   1. one build with the kernel sweep compiled in (WXFER_KERNEL_SWEEP=1: without a kernel_sweep
#      call it is the product, so every later step runs the product's kernels);
#   2. the GPU tests of the begin stamps' orders and the in-place writes (test_stream_wait_gpu,
#      test_external_gpu, test_direct_gpu's reference-bytes and failed-receiver tests), the copies
#      beside the quantizer (test_overlap_gpu) and delta (test_delta_apply_gpu: the receiver's
#      native apply; test_delta_gpu: the fused kernel), verbose, faulthandler stacks past 60 s;
#   3. (after 4) the Qwen3-8B colocated rows (BF16 plain / FSDP2, FP8 FSDP2) with this session's opt-in
#      orders on (the begin stamps in stream order, the FP8 row's large copies beside the
#      quantizer: WXFER_DIRECT_OVERLAP=engines), one more
#      push per row profiled (gpu_perf.sh bench; the FP8 row's overlap figures printed);
#   4. (before 3) bench_delta --parts apply (native apply against the torch apply and a device copy, per MB
#      of records) writing a copy of the H100 calibration with the measured native rate (the
#      8B FP8 and Kimi-K2 restatements with it run on any CPU: benchmarks/README.md);
#   5. (when END, default 575 s, leaves 75 s) the fused delta kernel's variants against the quantize alone (bench_fused_variants.py,
#      VARIANTS below; the build of step 1 serves it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; W=$(mktemp -d); mkdir -p "$W/r"  # at most 8 files come back: saved after each step
save() {
  cp "$W/gpu_tests.log" "$W/cal-8b-fp8-apply.json" "$W/r/apply.json" "$W/r/fused-sweep.log" "$OUT/" 2>/dev/null
  cp "$W/perf/bb-stream/results.json" "$OUT/rows-8b.json" 2>/dev/null
  (cd "$W" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null  # every log under 2 MB
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 150 env WXFER_TESTING=1 WXFER_KERNEL_SWEEP=1 python3 setup.py -q build_ext --inplace --force -j 16 \
  >"$W/r/build.log" 2>&1 || tail -20 "$W/r/build.log"
echo "=== built at ${SECONDS}s"
timeout -k 5 150 python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=60 -m gpu \
  tests/test_stream_wait_gpu.py tests/test_external_gpu.py tests/test_overlap_gpu.py tests/test_delta_apply_gpu.py \
  tests/test_delta_gpu.py tests/test_direct_gpu.py -k "not test_direct_gpu or failed_is_not_written or reference_bytes" \
  >"$W/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|Timeout|^E |passed|failed" "$W/gpu_tests.log" | head -40
save; echo "=== apply at ${SECONDS}s"
timeout -k 5 100 python3 benchmarks/bench_delta.py --parts apply --out "$W/r/apply.json" \
  --cal-in benchmarks/runs/h100-2026-12-07-b/cal-8b-fp8.json --cal-out "$W/cal-8b-fp8-apply.json" \
  >"$W/r/apply.log" 2>&1; echo "rc=$?"; grep -E "^apply|machine|Error" "$W/r/apply.log" | head -12
save; echo "=== 8B rows at ${SECONDS}s"
(OUT=$W/perf WAITS=stream MODELS=qwen3-8b WXFER_DIRECT_OVERLAP=engines bash benchmarks/gpu_perf.sh bench 2>&1 | grep -v "^+" | tail -12)
python3 - "$W/perf/bb-stream/results.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    for k, w in sorted((r.get("wxfer_by_watermark") or {}).items(), key=lambda x: -int(x[0])):
        pr = w.get("profile") or {}
        print(r["config"].get("quant"), r["config"].get("trainer"), k, "overlap:", json.dumps(w.get("direct", {}).get("overlap")),
              "profile:", json.dumps({x: pr.get(x) for x in ("gpu_busy_ms", "lead_ms", "tail_ms", "overlap")}))
PY
save; echo "=== fused sweep at ${SECONDS}s"
END=${END:-575}  # the call's own bound, seconds
if [ $SECONDS -lt $((END - 75)) ]; then
  timeout -k 5 $((END - SECONDS)) python3 benchmarks/bench_fused_variants.py --variants "${VARIANTS:-p,d1:2,d3:2,d4:2}" \
    --json >"$W/r/fused-sweep.log" 2>"$W/r/fused-sweep.err"; echo "rc=$?"
  grep -v '^{' "$W/r/fused-sweep.log" | tail -30; tail -5 "$W/r/fused-sweep.err"
fi
echo "=== end at ${SECONDS}s"; save
