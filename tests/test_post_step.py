"""Issue 37.4: the engine's post stage moves each write task along a pure table
(csrc/engine/wx_post_step.c: its state enum and next move on what the post thread saw);
tests/c/post_step_check.c checks every (state, event) pair, the looks and walks through it,
with no engine, thread or lock.  The engine's own runs (tests/test_engine.py, `make
tsan-test`) drive the same table from the post thread."""

import os

import pytest

from helpers import run_c_check  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_every_post_stage_pair_moves_as_the_grid_says(tmp_path):
    flags = ["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"]
    flags += ["-I" + os.path.join(ROOT, "csrc", "engine"), "-I" + os.path.join(ROOT, "tests", "c")]
    p = run_c_check(tmp_path, "post_step_check", flags, [os.path.join(ROOT, "csrc", "engine", "wx_post_step.c")])
    assert p.returncode == 0 and p.stdout.strip() == "post_step_check: ok 48", p.stdout + p.stderr
