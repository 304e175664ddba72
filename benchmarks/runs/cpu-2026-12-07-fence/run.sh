#!/bin/sh
# The begin / end stamps' fences on CPU, before and after the ready-stage skip (issue 37):
# BASE is a copy of main 54110f4 with its extension built in place (git archive 54110f4 | tar -x
# -C BASE; WXFER_TESTING=1 python setup.py -q build_ext --inplace), this checkout the branch
# `fence`; 200 pushes 5 ms apart each, alternated, three runs each. Usage: run.sh BASE
base=${1:?BASE}
here=$(cd "$(dirname "$0")/../../.." && pwd)
cp "$here/benchmarks/bench_host_fixed.py" "$base/benchmarks/"  # (the fence columns)
for i in 1 2 3; do
  for r in "$base" "$here"; do timeout 300 nice "$here/.venv/bin/python" "$here/benchmarks/runs/cpu-2026-12-07-fence/ab.py" "$r" 200 | tail -1; done
  uptime
done
