"""`make abi-check` (csrc/abi/abi_check.py): our declarations of libibverbs and libfabric
match the system headers here, and a changed declaration (a field's type, a constant) is
caught and named."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "csrc", "abi", "abi_check.py")


def _run(*args):
    return subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True, timeout=120)


def _have(path):
    return os.path.exists(path)


@pytest.mark.skipif(
    not _have("/usr/include/infiniband/verbs.h") or not _have("/usr/include/rdma/fabric.h"),
    reason="needs libibverbs-dev and libfabric-dev",
)
def test_ours_match_the_system_headers():
    r = _run("--require", "verbs,fabric")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verbs: " in r.stdout and "fabric: " in r.stdout and " match " in r.stdout, r.stdout


@pytest.mark.skipif(not _have("/usr/include/infiniband/verbs.h"), reason="needs libibverbs-dev")
def test_a_changed_declaration_is_caught(tmp_path):
    core = tmp_path / "core"
    shutil.copytree(os.path.join(ROOT, "csrc", "core"), core)
    h = core / "wx_ibv_abi.h"
    s = h.read_text()
    for old, new in (
        ("    IBV_QPS_RTS = 3,", "    IBV_QPS_RTS = 4,"),
        ("    uint8_t active_speed;", "    uint16_t active_speed;"),
    ):
        assert old in s
        s = s.replace(old, new)
    h.write_text(s)
    r = _run("--only", "verbs", "--core", str(core))
    assert r.returncode == 1, r.stdout
    assert "IBV_QPS_RTS" in r.stdout and "offsetof(struct ibv_port_attr, link_layer)" in r.stdout, r.stdout


@pytest.mark.skipif(_have("/usr/include/cuda.h"), reason="cuda.h is on the default include path here")
def test_a_missing_required_header_fails(tmp_path):
    r = _run("--require", "cuda", "--only", "cuda", "--cuda-home", str(tmp_path))
    assert r.returncode == 1 and "cuda.h not found" in r.stdout and "required" in r.stdout, r.stdout
