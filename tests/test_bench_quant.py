"""benchmarks/bench_quant.py cannot rot: its CPU dry run measures the reference quantizer on
the four cases (dense, experts in one call, the same with the piece table reused, one call per
expert) against an on-device copy
and prints the table and one JSON line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_dry_run_prints_the_table_and_json():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant.py"), "--dry-run", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["bench"] == "quant" and res["dry_run"] is True and res["gpu"].startswith("none")
    assert res["native"]["quantizer"] in ("native", "reference") and res["native"]["reason"]
    cases = [r["case"] for r in res["results"]]
    assert cases == [
        "dense 384x520",
        "experts 4x256x384, one call",
        "experts 4x256x384, one call, table reused",
        "experts 4x256x384, call per expert",
    ]
    for r in res["results"]:
        assert r["ran"] == r["quantizer"] == "reference"
        n = 384 * 520 if r["case"].startswith("dense") else 4 * 256 * 384
        scales = 3 * 5 * 4 if r["case"].startswith("dense") else 4 * 2 * 3 * 4
        assert r["bytes_moved"] == 2 * n + n + scales  # bf16 read + fp8 and scales written
        assert r["ms"] > 0 and r["copy_ms"] > 0 and r["GBps"] > 0
    assert sum(1 for ln in lines if ln.startswith("| ")) == 1 + 4


@pytest.mark.timeout(120)
def test_variants_run_one_child_each_and_print_one_table():
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_quant.py"),
            "--dry-run",
            "--json",
            "--variants",
            "v0,v2:3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["bench"] == "quant-variants" and res["dry_run"] is True and res["failed"] == []
    assert [r["variant"] for r in res["results"]] == ["v0"] * 4 + ["v2:3"] * 4
    assert len({r["case"] for r in res["results"]}) == 4
    for r in res["results"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["bytes_moved"] > 0
    assert sum(1 for ln in lines if ln.startswith("| ")) == 1 + 8
    assert "| v2:3 |" in p.stdout


def test_variants_reject_a_malformed_name():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant.py"), "--dry-run", "--variants", "v0,fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "'fast'" in p.stderr
