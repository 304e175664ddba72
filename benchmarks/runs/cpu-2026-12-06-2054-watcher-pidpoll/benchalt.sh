#!/bin/bash
PY=/work/wt/faults/.venv/bin/python
for i in 4 5 6; do
  for t in base new; do
    d=/tmp/fbase; [ $t = new ] && d=/work/wt/faults
    (cd $d && $PY benchmarks/bench_host_fixed.py --json > /tmp/bench_${t}_$i.json 2>/tmp/bench_${t}_$i.err)
    echo "$t $i rc=$? $(uptime | sed 's/.*load/load/')"
  done
done
