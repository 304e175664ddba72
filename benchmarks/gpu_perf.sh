#!/usr/bin/env bash
# Issue 37's colocated rows on one GPU, this branch's changes (about 4-5 min on an H100):
#
#   OUT=/some/dir bash benchmarks/gpu_perf.sh          # the rows (below)
#   OUT=/some/dir bash benchmarks/gpu_perf.sh sweep    # the FP8 kernel's launch shapes on this GPU
#                                                      # (a WXFER_KERNEL_SWEEP build; about 3 min)
#   OUT=/some/dir bash benchmarks/gpu_perf.sh bench    # the rows without the tests (about 6 min)
#   OUT=/some/dir bash benchmarks/gpu_perf.sh big      # the Qwen3-30B-A3B rows only (BF16 and FP8
#                                                      # FSDP2; they need an H200's memory; about 9 min;
#                                                      # DEPTH=24: its first 24 layers, on an H100)
#   OUT=/some/dir bash benchmarks/gpu_perf.sh fp8      # the 8B FP8 FSDP2 row alone, with the large BF16
#                                                      # copies beside the quantizer and without
#                                                      # (WXFER_DIRECT_OVERLAP=engines / kernel / 0, or
#                                                      # OVERLAPS="..."), each row's pushes profiled, after
#                                                      # tests/test_overlap_gpu.py (about 3 min;
#                                                      # NO_TESTS=1: without the tests)
#
# sweep: the product kernel (v6, 2 CTAs per SM) was chosen on an H200; on an H100 the 8B FP8
# row's kernel term is its largest (its quantizer ran at about 2.65 TB/s of traffic against
# the copy's 3.0), so bench_quant.py --variants compares v6 at 1-4 CTAs per SM and v7 / v8 on
# this GPU, each checked byte for byte; a winner becomes WX__CTAS_PER_SM / the product's
# variant in csrc/prepare/wx_fp8.c. The build is put back to the product's at the end.
#
# 1. build; 2. the gpu tests touching the begin stamps' device wait and the in-place writes;
# 3. bench_baselines --layouts colocated --curated qwen3-8b,qwen3-1.7b (the 8B BF16 plain and
#    FSDP2 rows, the 8B FP8 FSDP2 row -- the curated list's fp8 entry -- and the 1.7B FSDP2
#    and FSDP2-offload rows) for each begin-stamp order in WAITS (default "stream host": the
#    stamps written on the side stream, WXFER_BEGIN_WAIT=stream, opt-in; then the host
#    wait, the default, for the A/B on the same machine; "device" also runs the cuStreamWaitValue32 wait;
#    MODELS=qwen3-8b: the 8B rows only); 4. one table of both: link, wxfer, ratio, and the fixed cost before the first
#    write (the push's phases: rejoin_check, begin_stamps) per row, the submit phase per task and
#    the batched copy launches' host time (stats()["direct"]["last_push"]; issue 37).
# Every step is bounded and runs even when an earlier one failed; the exit status says whether
# all passed. Logs under $OUT.
set -x
OUT=${OUT:-.out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
git log --oneline -1 >>"$OUT/gpu.txt" 2>/dev/null
timeout 240 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { rc=1; tail -20 "$OUT/build.log"; }
if [ "${1:-rows}" = sweep ]; then
  timeout 240 env WXFER_TESTING=1 WXFER_KERNEL_SWEEP=1 python3 setup.py -q build_ext --inplace --force \
    >"$OUT/build-sweep.log" 2>&1 || { rc=1; tail -20 "$OUT/build-sweep.log"; }
  timeout 300 python3 benchmarks/bench_quant.py --native-only --variants v6:1,v6:2,v6:3,v6:4,v7:2,v8:2 \
    >"$OUT/quant-sweep.log" 2>&1 || rc=1
  tail -30 "$OUT/quant-sweep.log"
  timeout 240 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace --force >>"$OUT/build.log" 2>&1 || rc=1
  exit $rc
fi
if [ "${1:-rows}" = fp8 ]; then  # issue 37's FP8 row: the overlap (wxfer/runtime/overlap.py) on and off
  if [ -z "${NO_TESTS:-}" ]; then  # NO_TESTS=1: the tests ran elsewhere in the same call
    timeout -k 5 150 python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=45 -m gpu \
      tests/test_overlap_gpu.py >"$OUT/overlap_tests.log" 2>&1 || rc=1
    tail -8 "$OUT/overlap_tests.log"
  fi
  for ovl in ${OVERLAPS:-engines kernel 0}; do
    WXFER_DIRECT_OVERLAP=$ovl WXFER_BB_PROFILE=1 WXFER_BEGIN_WAIT=${BEGIN_WAIT:-stream} timeout -k 5 110 python3 \
      benchmarks/bench_baselines.py --layouts colocated --models qwen3-8b --quant fp8 --trainers fsdp2 \
      --methods link,wxfer --calibration none --max-s 90 --out "$OUT/fp8-overlap$ovl" --json \
      >"$OUT/fp8-overlap$ovl.log" 2>&1 || rc=1
    grep -E "^\[|skipped|failed|Error" "$OUT/fp8-overlap$ovl.log" | head -20
  done
  timeout 30 python3 - "$OUT" <<'PY' || rc=1
import json, os, sys
out = sys.argv[1]
print("| overlap | link ms | wxfer ms (2 GiB / 256 MiB) | wxfer / FP8 copy | overlap stats | profiled: busy, quant, copies beside / alone ms |")
print("|---|---|---|---|---|---|")
for ovl in sorted((d[len("fp8-overlap"):] for d in os.listdir(out) if d.startswith("fp8-overlap") and "." not in d), reverse=True):
    p = os.path.join(out, "fp8-overlap" + ovl, "results.json")
    if not os.path.exists(p):
        print("| %s | (no results.json) |" % ovl)
        continue
    for r in json.load(open(p))["results"]:
        link = r.get("methods", {}).get("link", {}).get("seconds")
        byw = r.get("wxfer_by_watermark") or {}
        ks = sorted(byw, key=int, reverse=True)
        if not ks or not link:
            print("| %s | error: %s |" % (ovl, r.get("error") or r.get("errors")))
            continue
        ws = [byw[k]["seconds"] for k in ks]
        o = (byw[ks[0]].get("direct") or {}).get("overlap")
        pr = [byw[k].get("profile") or {} for k in ks]
        prof = " / ".join("%.2f, %.2f, %.2f / %.2f" % (x.get("gpu_busy_ms", 0), (x.get("overlap") or {}).get("quant_ms", 0),
                          (x.get("overlap") or {}).get("beside_ms", 0), (x.get("overlap") or {}).get("copy_alone_ms", 0)) for x in pr)
        print("| %s | %.2f | %s | %s | %s | %s |" % (ovl, link * 1e3, " / ".join("%.2f" % (w * 1e3) for w in ws),
              " / ".join("%.2fx" % (w / link) for w in ws), json.dumps(o), prof))
PY
  exit $rc
fi
MODELS=${MODELS:-qwen3-8b,qwen3-1.7b}; MAXS=150; SEL=""
if [ "${1:-rows}" = big ]; then  # no tests: the 30B rows take the call's time
  MODELS=qwen3-30b-a3b; MAXS=230
  # DEPTH=24: the 30B-A3B's BF16 and FP8 FSDP2 rows cut to its first 24 of 48 layers (the same
  # shapes per layer; about 64 GB colocated: they fit an 80 GB H100), named qwen3-30b-a3b-l24
  [ -n "${DEPTH:-}" ] && SEL="--models qwen3-30b-a3b-l$DEPTH --quant bf16,fp8 --trainers fsdp2" && MAXS=200
elif [ "${1:-rows}" != bench ]; then  # bench: the rows only (the tests run elsewhere in the same call)
timeout 200 python3 -m pytest -q -ra --durations=8 -m gpu tests/test_stream_wait_gpu.py tests/test_external_gpu.py \
  tests/test_direct_gpu.py >"$OUT/gpu_tests.log" 2>&1 || rc=1
tail -25 "$OUT/gpu_tests.log"
fi
WAITS=${WAITS:-stream host}
for wait in $WAITS; do  # WAITS=stream: the default order's rows only
  # the first wait's run also profiles one more push per row (bb_profile.py: where its time goes)
  prof=0; [ $wait = "${WAITS%% *}" ] && prof=1
  WXFER_BB_PROFILE=$prof WXFER_BEGIN_WAIT=$wait timeout $((MAXS + 20)) python3 benchmarks/bench_baselines.py --layouts colocated \
    ${SEL:---curated $MODELS} --methods link,wxfer --calibration none --max-s $MAXS \
    --out "$OUT/bb-$wait" --json >"$OUT/bb-$wait.log" 2>&1 || rc=1
  grep -E "^\[|skipped|failed|Error" "$OUT/bb-$wait.log" | head -40
done
runs=""; for wait in $WAITS; do runs="$runs $wait=$OUT/bb-$wait"; done
timeout 30 python3 benchmarks/common/phase_table.py --label wait \
  --columns rejoin_check,begin_stamps,streams,groups,submit,per_task,launches,fit,order $runs || rc=1
exit $rc
