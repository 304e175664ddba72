#!/usr/bin/env bash
# Issue 36, item 2's GPU parts, on one H100/H200: the delta kernels (csrc/prepare/wx_delta*.cu).
#
#   OUT=/some/dir bash benchmarks/gpu_fused.sh   # at most 6 minutes: build 50 s, probe 30 s
#   (NVRTC compiles the kernels), tests 70 s, kernel bench 25 s, colocated rows 65 s (three demo
#   runs), scatter tests 100 s (three receiver spawns), scatter kernel rows 40 s (the bounds;
#   the steps before the scatter's took about 4 minutes)
#
# 1. builds the extension in place (the kernels compile with NVRTC at first use);
# 2. an NVRTC probe of the delta kernels on this GPU (the reason, if they cannot load);
# 3. the GPU tests: tests/test_delta_gpu.py (the fused quantize + compare kernel and the
#    compare / count / emit kernels bit for bit against the product FP8 kernel, the CPU
#    reference quantizer and delta.encode, shapes with partial tiles, 0 / 0.4% / 50% / 100%);
# 4. the kernel bench at 8192x8192 BF16: fused quantize + compare (and + count + records)
#    against the dense quantize alone and the torch path it replaces (target: fused <= 1.2x);
# 5. the colocated rows: one trainer and one receiver on this GPU (cuda_ipc), delta=True
#    against a delta=False run, 0.4% and 50% changed (targets: within 5%; no slower);
# 6. the scatter (delta_scatter.py): tests/test_delta_scatter_gpu.py (a trainer and receiver
#    processes on this GPU, Sender(delta={"scatter": "force"}), BF16 and FP8 bit-identical to a
#    dense push each step, a dropped receiver not written, the end stamps after a late scatter,
#    the kernel bit-exact), then the scatter kernel over 256 MiB at 0.1/1/3/10/50% changed
#    against a dense copy of the range. The push rows (forced scatter against dense in place,
#    demo runs) are longer; run them apart:
#      python3 benchmarks/bench_delta.py --parts scatter --scatter-push 1 --push-model medium \
#        --push-fp8 1,0 --out scatter.json
# Every step runs even when an earlier one failed; logs and JSON under $OUT.
set -x
OUT=${OUT:-.out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc=0

timeout 50 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$OUT/build.log" 2>&1 || { rc=1; tail -20 "$OUT/build.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

timeout 30 python3 -c "
import torch
from wxfer import _wxfer
from wxfer.runtime.nvrtc import nvrtc_dirs
print('delta_probe', _wxfer.delta_probe(torch.cuda.current_device(), nvrtc_dirs()))
print('fp8_probe', _wxfer.fp8_probe(torch.cuda.current_device(), nvrtc_dirs()))
" 2>&1 | tee "$OUT/probe.txt" || rc=1

timeout 70 python3 -m pytest -q -m gpu tests/test_delta_gpu.py --maxfail=10 -rs >"$OUT/pytest.log" 2>&1 || rc=1
tail -30 "$OUT/pytest.log"

timeout 25 python3 benchmarks/bench_delta.py --parts fused --kernel-shape 8192x8192 \
  --fused-rates 0,0.004,0.03,0.5 --out "$OUT/fused.json" >"$OUT/fused.log" 2>&1 || rc=1
python3 - "$OUT/fused.json" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
print(r["machine"])
print("%-6s %10s %10s %7s %12s %7s %10s %7s %8s" % ("rate", "quant ms", "fused ms", "x", "fused+rec ms", "x", "torch ms", "x", "exact"))
for x in r["fused"]:
    print("%-6g %10.3f %10.3f %7.2f %12.3f %7.2f %10.3f %7.2f %8s" % (
        x["rate"], 1e3 * x["quantize_s"], 1e3 * x["fused_s"], x["fused_vs_quantize"],
        1e3 * x["fused_encode_s"], x["fused_encode_vs_quantize"], 1e3 * x["torch_path_s"],
        x["torch_path_vs_quantize"], x["bitexact"]))
PY

timeout 65 python3 benchmarks/bench_delta.py --parts colocated --push-model medium --push-fp8 1 \
  --colocated-rates 0.004,0.5 --out "$OUT/colocated.json" >"$OUT/colocated.log" 2>&1 || { rc=1; tail -20 "$OUT/colocated.log"; }
grep '^colocated ' "$OUT/colocated.log" || rc=1  # bench_delta prints each row (colocated_line)
timeout 100 python3 -m pytest -q -m gpu tests/test_delta_scatter_gpu.py --maxfail=10 -rs >"$OUT/pytest_scatter.log" 2>&1 || rc=1
tail -30 "$OUT/pytest_scatter.log"

timeout 40 python3 benchmarks/bench_delta.py --parts scatter --out "$OUT/scatter.json" >"$OUT/scatter.log" 2>&1 || { rc=1; tail -20 "$OUT/scatter.log"; }
python3 - "$OUT/scatter.json" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
print("%-6s %10s %12s %12s %8s %14s %6s" % ("rate", "MiB", "scatter ms", "copy ms", "x", "changed GB/s", "exact"))
for x in r["scatter"]:
    print("%-6g %10d %12.3f %12.3f %8.2f %14.1f %6s" % (
        x["rate"], x["nbytes"] >> 20, 1e3 * x["scatter_s"], 1e3 * x["dense_copy_s"], x["scatter_vs_dense"],
        x["changed_Bps"] / 1e9, x["bitexact"]))
PY
echo "gpu_fused: rc=$rc (see $OUT)"
exit $rc
