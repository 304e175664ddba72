"""benchmarks/bench_copies.py runs where there is no GPU (small shapes, the torch copier),
checks the bytes it copied and prints its figures with the bound measured in the same run."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_copies_runs_on_the_cpu_and_checks_its_bytes():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_copies.py"), "--reps", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    cases = {r["case"]: r for r in out["results"]}
    assert set(cases) == {"uniform-128", "qwen3-8b", "qwen3-1.7b", "norms"}
    assert cases["qwen3-8b"]["ranges"] == 399 and cases["qwen3-1.7b"]["ranges"] == 311
    for r in cases.values():
        assert r["torch"]["bytes_ok"] and r["bound_GBps"] > 0 and r["torch"]["GBps"] > 0
        assert "native" not in r  # no CUDA here: only the fallback ran
