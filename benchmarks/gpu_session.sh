#!/usr/bin/env bash
# One device call's worth of GPU checks for this session's work (each step bounded; logs under $OUT):
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh tests     # build + every gpu test + calibrate (about 6-8 min on an H100)
#   OUT=/some/dir bash benchmarks/gpu_session.sh bench     # build + delta kernels/rates, MLA finalize
#                                                          # kernels, the colocated dense rows (about 8 min)
#
# Every step runs even when an earlier one failed; the exit status says whether all passed.
set -x
OUT=${OUT:-.out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
git log --oneline -1 >>"$OUT/gpu.txt" 2>/dev/null
WXFER_TESTING=1 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { rc=1; tail -20 "$OUT/build.log"; }
case "${1:-tests}" in
tests)
  timeout 420 python3 -m pytest -q -ra -m "gpu or gpu2" tests >"$OUT/gpu_tests.log" 2>&1 || rc=1
  tail -40 "$OUT/gpu_tests.log"
  # issue 35.7: every calibration term measured > 0 or None with its reason, on the GPU too
  timeout 170 python3 -m wxfer calibrate --json --placement same --out "$OUT/cal-gpu.json" \
    >"$OUT/calibrate.json" 2>"$OUT/calibrate.log" || rc=1
  tail -25 "$OUT/calibrate.log"
  ;;
bench)
  timeout 150 python3 benchmarks/bench_delta.py --parts rates,kernels --model qwen3-0.6b --steps 3 \
    --kernel-shape 8192x8192 --kernel-rate 0.004 --out "$OUT/delta_gpu.json" >"$OUT/bench_delta.log" 2>&1 || rc=1
  tail -30 "$OUT/bench_delta.log"
  timeout 60 python3 benchmarks/bench_mla_derive.py --device cuda >"$OUT/bench_mla_derive.log" 2>&1 || rc=1
  tail -20 "$OUT/bench_mla_derive.log"
  timeout 250 python3 benchmarks/bench_baselines.py --layouts colocated --curated qwen3-8b,qwen3-1.7b \
    --methods link,wxfer --max-s 225 --out "$OUT/bb-dense" --json >"$OUT/bb-dense.log" 2>&1 || rc=1
  tail -30 "$OUT/bb-dense.log"
  ;;
esac
exit $rc
