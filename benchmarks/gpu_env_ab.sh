#!/usr/bin/env bash
# Settings of one tree on one GPU in one device call, alternated (issue 37's opt-in knobs):
#
#   SETTINGS="off:WXFER_DIRECT_COPY_FIRST=0 ramp:WXFER_DIRECT_COPY_FIRST=32MiB" OUT=/some/dir \
#     bash benchmarks/gpu_env_ab.sh
#
# Each setting is NAME:VAR=VALUE[,VAR=VALUE...]; the colocated rows (ROWS: bench_baselines'
# selection, default the 1.7B and 8B BF16 FSDP2 rows) run once per setting per round (ROUNDS,
# default 2: off ramp off ramp ...), each in its own bench_baselines.py call of at most ROW_S
# seconds (default 80) with one more push profiled (WXFER_BB_PROFILE=1); TESTS (GPU test files,
# bounded by TESTS_S, default 120 s) run first. Printed: one table (benchmarks/common/phase_table.py)
# of every run. Back in $OUT: tests.log, table.md, logs.tgz (each run's results.json and log).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; W=$(mktemp -d)
save() {
  cp "$W/tests.log" "$W/table.md" "$OUT/" 2>/dev/null
  (cd "$W" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 150 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$W/build.log" 2>&1 || tail -20 "$W/build.log"
echo "=== built at ${SECONDS}s"
if [ -n "${TESTS:-}" ]; then
  timeout -k 5 ${TESTS_S:-120} python3 -u -m pytest -q -ra -p no:cacheprovider -o faulthandler_timeout=45 -m gpu $TESTS \
    >"$W/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|Timeout|passed|failed" "$W/tests.log" | tail -8; save
fi
ROWS=${ROWS:---models qwen3-1.7b,qwen3-8b --quant bf16 --trainers fsdp2}
runs=""
for r in $(seq 1 "${ROUNDS:-2}"); do
  for s in ${SETTINGS:?SETTINGS=\"name:VAR=value ...\"}; do
    name=${s%%:*}; vars=${s#*:}
    (export ${vars//,/ } WXFER_BB_PROFILE=1; timeout -k 5 ${ROW_S:-80} python3 benchmarks/bench_baselines.py \
      --layouts colocated $ROWS --methods link,wxfer --calibration none --max-s $((${ROW_S:-80} - 10)) \
      --out "$W/$name-$r" --json >"$W/$name-$r.log" 2>&1) || echo "$name round $r: rc=$?"
    grep -E "^\[|Error" "$W/$name-$r.log" | head -6
    runs="$runs $name-$r=$W/$name-$r"; save
  done
done
timeout 30 python3 benchmarks/common/phase_table.py --label setting \
  --columns ${COLUMNS:-groups,submit,per_task,launches,launch_parts,profile} $runs | tee "$W/table.md"
echo "=== end at ${SECONDS}s"; save
