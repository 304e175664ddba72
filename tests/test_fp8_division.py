"""The FP8 kernel's fast division (wx_div_fast in csrc/prepare/wx_fp8_kernel.cu:
q0 = a*rcp(s), t = fma(q0, s, -a), q = fma(-t, rcp(s), q0)) equals IEEE float32 division for
every bfloat16 / float16 significand of a against every scale significand the kernel can
produce from that format (and the 1e-12 floor), and keeps signed zeros and the sign of
subnormal sources: tests/c/fp8_div_check.c, compiled and run on the CPU. Its --all mode (every
float32 significand of the scale, 9.7e9 pairs, about a minute) is run by hand."""

import os

import pytest

from helpers import run_c_check  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREP = os.path.join(ROOT, "csrc", "prepare")  # wx_fp8_host.h: the bit casts


@pytest.mark.timeout(120)
def test_fast_division_is_correctly_rounded_for_16_bit_sources(tmp_path):
    p = run_c_check(tmp_path, "fp8_div_check", ["-O2", "-ffp-contract=off", "-I" + PREP], ["-lm"])
    assert p.returncode == 0 and p.stdout.startswith("ok "), p.stdout[-2000:]
    assert int(p.stdout.split()[1]) > 3_000_000
