#!/bin/sh
# base (f18a33f, main before this branch, with this branch's extension) against this branch,
# alternated, three runs each; the 2-core CPU VM; bench_host_fixed.py's phases and parts.
# usage: sh run.sh BASE_CHECKOUT OUTDIR   (run from this branch's checkout)
base=$1; out=$(cd "$2" && pwd); py=$(pwd)/.venv/bin/python
for i in 1 2 3; do
  for t in base new; do
    d=$(pwd); [ $t = base ] && d=$base
    echo "== $t $i load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "$d" && nice "$py" benchmarks/bench_host_fixed.py --workers 1 --pushes 200 --gap-ms 5 --json > "$out/$t-$i.json" 2>"$out/$t-$i.err")
  done
done
