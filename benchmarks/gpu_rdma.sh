#!/bin/sh
# Issue 28 on a GPU machine, in one command (under 4 minutes; each step has its own bound):
#   1. build the extension in place (test build: WXFER_TESTING=1) and the libibverbs emulation
#   2. the probe: libfabric version, providers, FI_HMEM, CUDA registration per HMEM provider;
#      CUDA (dma-buf support, kernel module), verbs facts (python -m wxfer.tools.gpuprobe)
#   3. the `gpu` tests of issue 28 with -rA: fabric with GPU memory per HMEM provider
#      (tests/test_fabric_gpu.py), the verbs GPU path on the emulation (tests/test_verbs_gpu.py);
#      the setup errors' CPU tests (tests/test_gpureg.py) run in CI, not here
#   4. python -m wxfer selftest --transport verbs --emulated --gpu (two processes, dma-buf)
#   5. the benchmark line: fabric HMEM / verbs-emulated / cuda_ipc / device copy, one run
# Logs go to $OUT (default ./gpu_rdma_out). Usage, from the checkout:
#   sh benchmarks/gpu_rdma.sh            # PYTHON=python3 by default
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/gpu_rdma_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
step() { echo "== [$(elapsed) s] $*" | tee -a "$OUT/summary.log"; }

step "machine"
{
    date -u
    uname -a
    nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv 2>&1
    head -n1 /proc/driver/nvidia/version 2>&1
    echo "ulimit -l: $(ulimit -l)"
    echo "/sys/class/infiniband: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
    echo "nvidia_peermem loaded: $([ -e /sys/module/nvidia_peermem ] && echo yes || echo no)"
    ls -l /usr/lib/x86_64-linux-gnu/libfabric.so* /usr/lib64/libfabric.so* /opt/amazon/efa/lib*/libfabric.so* 2>/dev/null
    fi_info --version 2>&1 | head -n2
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} >"$OUT/machine.log" 2>&1
cat "$OUT/machine.log"

step "build (WXFER_TESTING=1, in place)"
if ! WXFER_TESTING=1 timeout 150 $PY setup.py -q build_ext --inplace -j 8 >"$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"
    step "BUILD FAILED (see $OUT/build.log)"
    exit 1
fi
timeout 60 sh csrc/testing/build.sh >"$OUT/emu_build.log" 2>&1 || step "emulation build failed (see $OUT/emu_build.log)"
$PY -c 'import wxfer, json; print(json.dumps(wxfer.backends()))' 2>&1 | tee "$OUT/backends.log"

step "probe (python -m wxfer.tools.gpuprobe)"
timeout 60 $PY -m wxfer.tools.gpuprobe --json >"$OUT/probe.json" 2>"$OUT/probe.err"
timeout 60 $PY -m wxfer.tools.gpuprobe 2>&1 | tee "$OUT/probe.txt"

step "gpu tests (-rA)"
timeout -s INT -k 15 160 $PY -m pytest -rA -q -p no:cacheprovider \
    tests/test_fabric_gpu.py tests/test_verbs_gpu.py >"$OUT/pytest.log" 2>&1
rc=$?
echo "pytest exit status $rc" >>"$OUT/pytest.log"
sed -n '/short test summary info/,$p' "$OUT/pytest.log" | tee -a "$OUT/summary.log"
grep -E "^(PUSH|STEP|RECEIVER|link|shm|tcp|fabric HMEM probe)" "$OUT/pytest.log" | cut -c1-400 | head -n 30

step "verbs self-test with GPU memory on the emulation (dma-buf)"
timeout 60 $PY -m wxfer selftest --transport verbs --emulated --gpu --size 64MiB --json 2>&1 | tail -n 1 |
    cut -c1-600 | tee "$OUT/selftest_verbs_gpu.log"

left=$((225 - $(elapsed)))
if [ "$left" -gt 30 ]; then
    step "benchmark (benchmarks/bench_fabric_gpu.py, bound ${left} s)"
    timeout "$left" $PY benchmarks/bench_fabric_gpu.py --size 256MiB --iters 8 --json 2>&1 | tee "$OUT/bench.log"
else
    step "benchmark skipped: only ${left} s left of the 4-minute budget"
fi
step "done; logs in $OUT (pytest exit status $rc)"
exit "$rc"
