"""benchmarks/bench_quant.py cannot rot: its CPU dry run measures the reference quantizer on
the four cases (dense, experts in one call, the same with the piece table reused, one call per
expert) against an on-device copy
and prints the table and one JSON line."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_quant(*args):
    """benchmarks/bench_quant.py --dry-run --json *args: (its output lines, the JSON of the last)."""
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant.py"), "--dry-run", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.timeout(120)
def test_dry_run_prints_the_table_and_json():
    lines, res = _bench_quant()
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
    lines, res = _bench_quant("--variants", "v0,v2:3")
    assert res["bench"] == "quant-variants" and res["dry_run"] is True and res["failed"] == []
    assert [r["variant"] for r in res["results"]] == ["v0"] * 4 + ["v2:3"] * 4
    assert len({r["case"] for r in res["results"]}) == 4
    for r in res["results"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["bytes_moved"] > 0
    assert sum(1 for ln in lines if ln.startswith("| ")) == 1 + 8
    assert any("| v2:3 |" in ln for ln in lines)


def test_variants_reject_a_malformed_name():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant.py"), "--dry-run", "--variants", "v0,fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "'fast'" in p.stderr


KERNEL = os.path.join(ROOT, "csrc", "prepare", "wx_fp8_kernel.cu")
SWEEP = os.path.join(ROOT, "benchmarks", "kernels", "sweep_fp8_kernel.cu")


def test_the_sweep_variants_are_built_from_the_product_kernel():
    """--variants compiles benchmarks/kernels/sweep_fp8_kernel.cu, which includes the product's
    csrc/prepare/wx_fp8_kernel.cu (its tile code, WX_FP8_TILES_ONLY) and defines none of it
    again; wx_sweep.c hands NVRTC the product source under the name the sweep includes."""
    sweep = open(SWEEP).read()
    assert '#define WX_FP8_TILES_ONLY 1' in sweep and '#include "wx_fp8_kernel.cu"' in sweep
    product = open(KERNEL).read()
    assert "#ifndef WX_FP8_TILES_ONLY" in product
    for fn in ("wx_load", "wx_quant", "wx_divisor_of", "wx_piece_of", "wx_job_of", "wx_tile16", "wx_tile32"):
        defined = re.compile(r"__device__ __forceinline__ [\w<>:, ]*\b%s\(" % fn)
        assert defined.search(product) and not defined.search(sweep), fn
    src = open(os.path.join(ROOT, "csrc", "prepare", "wx_sweep.c")).read()
    assert 'wx__hdr(s, "wx_fp8_kernel.cu", wx_fp8_kernel_src);' in src
    # variants 6-8: the product's loop and copies (wx_fp8_pipe.cu), with 7's and 8's own steps
    pipe = open(os.path.join(ROOT, "benchmarks", "kernels", "sweep_fp8_pipe.cu")).read()
    product_pipe = open(os.path.join(ROOT, "csrc", "prepare", "wx_fp8_pipe.cu")).read()
    assert '#include "wx_fp8_pipe.cu"' in pipe and "wx_fp8_quant" not in pipe
    for fn in ("wx_tile_at", "wx_saddr", "wx_ringed", "wx_ring_read", "wx_ring_fill", "wx_ring_put", "wx_ring_loop"):
        defined = re.compile(r"__device__ __forceinline__ [\w<>:, ]*\b%s\(" % fn)
        assert defined.search(product_pipe) and not defined.search(pipe), fn
    assert 'wx__hdr(s, "wx_fp8_pipe.cu", wx_fp8_pipe_src);' in src


def _ptx(tmp_path, name, *args):
    out = tmp_path / name
    r = subprocess.run(
        ["nvcc", "-arch=sm_90", "--ptx", "--fmad=false", "-o", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out.read_text()


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no nvcc to compile the kernels")
@pytest.mark.timeout(240)
def test_sweep_variant_6_compiles_to_the_product_kernel(tmp_path):
    """Variant 6 of the sweep is the product kernel, instruction for instruction (nvcc's PTX,
    the options and defines wx_fp8.c and wx_sweep.c give NVRTC)."""
    product = _ptx(tmp_path, "product.ptx", "-DWX_STAGES=3", KERNEL)
    v6 = _ptx(tmp_path, "v6.ptx", "-Icsrc/prepare", "-DWX_VARIANT=6", "-DWX_STAGES=3", SWEEP)
    assert "wx_fp8_quant" in product and v6 == product
