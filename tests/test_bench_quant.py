"""benchmarks/bench_quant.py cannot rot: its CPU dry run measures the reference quantizer on
the three cases (dense, experts in one call, one call per expert) against an on-device copy
and prints the table and one JSON line."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_dry_run_prints_the_table_and_json():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant.py"), "--dry-run", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["bench"] == "quant" and res["dry_run"] is True and res["gpu"].startswith("none")
    assert res["native"]["quantizer"] in ("native", "reference") and res["native"]["reason"]
    cases = [r["case"] for r in res["results"]]
    assert cases == ["dense 384x520", "experts 4x256x384, one call", "experts 4x256x384, call per expert"]
    for r in res["results"]:
        assert r["ran"] == r["quantizer"] == "reference"
        n = 384 * 520 if r["case"].startswith("dense") else 4 * 256 * 384
        scales = 3 * 5 * 4 if r["case"].startswith("dense") else 4 * 2 * 3 * 4
        assert r["bytes_moved"] == 2 * n + n + scales        # bf16 read + fp8 and scales written
        assert r["ms"] > 0 and r["copy_ms"] > 0 and r["GBps"] > 0
    assert sum(1 for ln in lines if ln.startswith("| ")) == 1 + 3
