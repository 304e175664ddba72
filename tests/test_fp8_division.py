"""The FP8 kernel's fast division (wx_div_fast in csrc/prepare/wx_fp8_kernel.cu:
q0 = a*rcp(s), t = fma(q0, s, -a), q = fma(-t, rcp(s), q0)) equals IEEE float32 division for
every bfloat16 / float16 significand of a against every scale significand the kernel can
produce from that format (and the 1e-12 floor), and keeps signed zeros and the sign of
subnormal sources: tests/c/fp8_div_check.c, compiled and run on the CPU. Its --all mode (every
float32 significand of the scale, 9.7e9 pairs, about a minute) is run by hand."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_fast_division_is_correctly_rounded_for_16_bit_sources(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = str(tmp_path / "fp8_div_check")
    subprocess.run(
        [cc, "-O2", "-ffp-contract=off", "-o", exe, os.path.join(ROOT, "tests", "c", "fp8_div_check.c"), "-lm"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    p = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("ok "), p.stdout[-2000:]
    assert int(p.stdout.split()[1]) > 3_000_000
