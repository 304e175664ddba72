#!/usr/bin/env bash
# Issue 37's host path of the colocated rows (branch hostpath: each batched copy launch kept from
# one push to the next with its engine destinations validated once, a run of copy tasks queued in
# one call, the push's stream order on events made once), A/B against a base tree in one call
# (about 8 min on an H100). OUT=/some/dir bash benchmarks/gpu_hostpath.sh
#   1. this tree built; its GPU tests of the changed code (TESTS, bounded by TESTS_S, default 150 s);
#   2. the base tree: BASE_DIR (a copy of the base checkout) or BASE_REV (git archive of that
#      revision, default main's fee52e2), built there; none of them: this tree's rows only;
#   3. the colocated rows (ROWS: bench_baselines' selection, default the 1.7B and 8B BF16 FSDP2 rows) from each tree in the order of RUNS
#      (default "this base this2"), one bench_baselines.py call each (ROW_S, default 80 s);
#   4. one table (benchmarks/common/phase_table.py): the phases to the first submission, the
#      submit per task, the copy launches and their host us per launch in parts (copy_s / submit_s,
#      '-' for the base, which does not record them).
# Back in $OUT (few files): tests.log, table.md, rows-<run>.json per run, logs.tgz (the rest).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); HERE=$(pwd); W=$(mktemp -d); R=$W/r; mkdir -p "$R"
save() {
  cp "$R/tests.log" "$R/table.md" "$OUT/" 2>/dev/null
  for d in "$R"/*/; do [ -f "$d/results.json" ] && cp "$d/results.json" "$OUT/rows-$(basename "$d").json"; done
  (cd "$R" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 120 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$R/build.log" 2>&1 || tail -20 "$R/build.log"
echo "=== built at ${SECONDS}s"
timeout -k 5 ${TESTS_S:-150} python3 -u -m pytest -v -ra -p no:cacheprovider -o faulthandler_timeout=45 -m gpu \
  ${TESTS:-tests/test_copy_launch.py tests/test_steps_gpu.py tests/test_copies.py tests/test_external_gpu.py tests/test_direct_gpu.py} \
  >"$R/tests.log" 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|Timeout|^E |passed|failed" "$R/tests.log" | head -20; save
BASE=${BASE_DIR:-}
if [ -z "$BASE" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  BASE=$W/base; mkdir -p "$BASE"
  git archive "${BASE_REV:-fee52e2}" | tar -x -C "$BASE" || BASE=""
fi
if [ -n "$BASE" ]; then
  (cd "$BASE" && timeout 120 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$R/build-base.log" 2>&1) \
    || { tail -20 "$R/build-base.log"; BASE=""; }
fi
[ -n "$BASE" ] || echo "no base tree (BASE_DIR, or BASE_REV with git here): this tree's rows only"
echo "=== rows at ${SECONDS}s"
runs=""
for r in ${RUNS:-this base this2}; do
  case $r in base*) [ -n "$BASE" ] || continue; tree=$BASE ;; *) tree=$HERE ;; esac
  (cd "$tree" && timeout ${ROW_S:-80} python3 benchmarks/bench_baselines.py --layouts colocated \
    ${ROWS:---models qwen3-1.7b,qwen3-8b --quant bf16 --trainers fsdp2} --methods link,wxfer --calibration none --max-s 70 \
    --out "$R/$r" --json >"$R/$r.log" 2>&1) || echo "$r: rc=$?"
  grep -E "^\[|Error" "$R/$r.log" | head -8
  runs="$runs $r=$R/$r"; save
done
timeout 30 python3 benchmarks/common/phase_table.py --label tree \
  --columns rejoin_check,begin_stamps,streams,groups,submit,per_task,launches,launch_parts $runs | tee "$R/table.md"
echo "=== end at ${SECONDS}s"; save
