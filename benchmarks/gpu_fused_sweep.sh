#!/usr/bin/env bash
# Issue 36: the fused FP8 quantize + compare kernel's variants (csrc/prepare/wx_delta_kernel.cu,
# its WX_DPF / WX_DPAIR / WX_DBITS switches and CTAs per SM, compiled from that one source) against the
# dense quantize kernel alone, on one H100/H200 (about 3 minutes: build 50 s, 10 variants of
# about 10-15 s each):
#
#   OUT=/some/dir bash benchmarks/gpu_fused_sweep.sh
#   VARIANTS=p,d1:2 OUT=/some/dir bash benchmarks/gpu_fused_sweep.sh   # fewer
#
# 1. a WXFER_KERNEL_SWEEP build in place (the product kernels plus _wxfer.kernel_sweep; no
#    kernel_sweep call gives the product's, so the build serves the other GPU scripts too);
# 2. benchmarks/bench_fused_variants.py: one child per variant, each checking the fused
#    kernel byte for byte (the shadow against the product FP8 kernel's dense bytes and the CPU
#    reference quantizer's, the bitmask against the bytes that differ; two pieces, one with an
#    unaligned row pitch, at offsets 0 and 5; BF16 / FP16 / FP32; 0-100% changed) and timing,
#    in the same process, the dense quantize alone and the fused kernel (and with the bitmask
#    cleared before each launch) on one 8192x8192 BF16 weight at 0, 0.4, 3 and 50% of its
#    elements changed: CUDA events over 20 launches queued behind a sleep kernel, median of 5.
# A variant whose fused / quantize is lowest at 0-0.4% and exact everywhere becomes the product:
# WX__DPF, WX__DPAIR, WX__DBITS, WX__CTAS_PER_SM and WX__STAGES in csrc/prepare/wx_delta.c (its comment maps
# d<v>:<c> to them). Logs under $OUT.
set -x
OUT=${OUT:-.out}
mkdir -p "$OUT"
rc=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
git log --oneline -1 >>"$OUT/gpu.txt" 2>/dev/null
cat "$OUT/gpu.txt"
timeout 120 env WXFER_TESTING=1 WXFER_KERNEL_SWEEP=1 python3 setup.py -q build_ext --inplace --force -j 16 \
  >"$OUT/build-sweep.log" 2>&1 || { rc=1; tail -20 "$OUT/build-sweep.log"; }
# d8/d16: the bitmask by plain stores (WX_DBITS 1/2); d11/d19: the same with d3's L2 prefetch;
# d24/d26/d28: the old bytes one tile ahead in shared memory (WX_DPF 4), with WX_DBITS 0/1/2;
# d2: a shared-memory shadow ring of 2 stages (WX_DPF 2), never timed before
VARIANTS=${VARIANTS:-p,d2:2,d3:2,d8:2,d11:2,d16:2,d19:2,d24:2,d26:2,d28:2}
timeout 280 python3 benchmarks/bench_fused_variants.py --variants "$VARIANTS" --json \
  >"$OUT/fused-sweep.log" 2>"$OUT/fused-sweep.err" || rc=1
grep -v '^{' "$OUT/fused-sweep.log"
grep '^{' "$OUT/fused-sweep.log" >"$OUT/fused-sweep.json"
tail -20 "$OUT/fused-sweep.err"
echo "gpu_fused_sweep: rc=$rc (see $OUT)"
exit $rc
