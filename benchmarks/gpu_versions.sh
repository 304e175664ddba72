#!/usr/bin/env bash
# Two versions of wxfer on one GPU in one device call, alternated (issue 37's host-time changes):
# the working tree ("this") against the tree unpacked under ab-base/ ("base"), each built in place,
# then the colocated rows run from each in turn, base / this / base / this ... (ROUNDS, default 2),
# so the machine's drift falls on both. Make the base tree first, on the CPU machine:
#
#   rm -rf ab-base && mkdir ab-base && git archive BASE_COMMIT wxfer csrc setup.py pyproject.toml \
#     benchmarks/*.py benchmarks/common | tar -x -C ab-base       # (ab-base/ travels untracked)
#   OUT=/some/dir bash benchmarks/gpu_versions.sh                   # then on the GPU
#
# ROWS: bench_baselines' selection (default the 8B and 1.7B BF16 FSDP2 rows).
# Printed: one line per run and row (wxfer ms at each watermark, wxfer / link, the push's
# phases), then the medians per version. Logs (and each run's results.json) in $OUT/logs.tgz.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"; W=$(mktemp -d)
[ -d ab-base/wxfer ] || { echo "no ab-base/ tree: see the header"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
for d in . ab-base; do
  (cd $d && timeout 200 env WXFER_TESTING=1 python3 setup.py -q build_ext --inplace -j 16 >"$W/build-${d//[.\/]/_}.log" 2>&1) \
    || { echo "build of $d failed"; tail -20 "$W/build-${d//[.\/]/_}.log"; }
done
echo "=== built at ${SECONDS}s"
ROWS=${ROWS:---models qwen3-8b,qwen3-1.7b --quant bf16 --trainers fsdp2}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for who in base this; do
    root=$PWD; [ $who = base ] && root=$PWD/ab-base
    (cd "$root" && timeout -k 5 ${ROW_S:-130} python3 benchmarks/bench_baselines.py --layouts colocated $ROWS \
      --methods link,wxfer --calibration none --max-s $((${ROW_S:-130} - 10)) --out "$W/$who-$r" --json \
      >"$W/$who-$r.log" 2>&1) || echo "$who round $r: rc=$?"
    echo "=== $who round $r at ${SECONDS}s"
  done
done
python3 - "$W" <<'PY'
import json, os, statistics, sys
w = sys.argv[1]
rows = {}
for d in sorted(os.listdir(w)):
    p = os.path.join(w, d, "results.json")
    if not os.path.exists(p):
        continue
    who = d.split("-")[0]
    for r in json.load(open(p))["results"]:
        c = r["config"]
        name = "%s %s %s" % (c["model"], c["quant"], c["trainer"])
        link = (r.get("methods", {}).get("link") or {}).get("seconds")
        for k, x in sorted((r.get("wxfer_by_watermark") or {}).items(), key=lambda x: -int(x[0])):
            ph = x.get("phases") or {}
            print(d, name, k, "wxfer %.3f ms" % (x["seconds"] * 1e3), "link %.3f ms" % (link * 1e3) if link else "",
                  "ratio %.3f" % (x["seconds"] / link) if link else "",
                  "phases us", json.dumps({p: round(v * 1e6) for p, v in ph.items() if p != "done"}))
            if link:
                rows.setdefault((name, k), {}).setdefault(who, []).append(x["seconds"] / link)
print("| row | watermark | base wxfer/link (runs) | this wxfer/link (runs) | median this/base |")
print("|---|---|---|---|---|")
for (name, k), v in sorted(rows.items()):
    b, t = v.get("base", []), v.get("this", [])
    m = statistics.median(t) / statistics.median(b) if b and t else float("nan")
    print("| %s | %s | %s | %s | %.3f |" % (name, k, " ".join("%.3f" % x for x in b), " ".join("%.3f" % x for x in t), m))
PY
(cd "$W" && find . -type f -size -2M | tar czf "$OUT/logs.tgz" -T -) 2>/dev/null
