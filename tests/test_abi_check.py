"""`make abi-check` (csrc/abi/abi_check.py): our declarations of libibverbs and libfabric
match the system headers here, and a changed declaration (a field's type, a constant) is
caught and named."""

import os
import shutil
import subprocess
import sys

import pytest

from wxfer.testing import build_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "csrc", "abi", "abi_check.py")


def _run(*args):
    return subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True, timeout=120, env=build_env())


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


@pytest.mark.skipif(not _have("/usr/include/infiniband/verbs.h"), reason="needs libibverbs-dev")
def test_contexts_built_by_verbs_h_work_through_our_declarations(tmp_path):
    """tests/c/verbs_ctx_check.c: extended (mlx5-style), newer, older and plain contexts made
    with the system verbs.h, queried and posted to through wx_ibv_abi.h's inlines."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    c = os.path.join(ROOT, "csrc")
    exe = str(tmp_path / "verbs_ctx_check")
    flags = ["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    inc = ["-I" + os.path.join(c, d) for d in ("core", "transport", "backends/verbs")]
    obj = str(tmp_path / "ours.o")
    subprocess.run(
        [cc, *flags, *inc, "-c", "-o", obj, os.path.join(ROOT, "tests", "c", "verbs_ctx_ours.c")],
        check=True,
        env=build_env(),
    )
    srcs = [
        os.path.join(c, p)
        for p in ("backends/verbs/wx_verbs_dl.c", "core/wx_dl.c", "core/wx_common.c", "core/wx_param.c")
    ]
    subprocess.run(
        [
            cc,
            *flags,
            "-I" + os.path.join(ROOT, "tests", "c"),
            *inc,
            "-o",
            exe,
            os.path.join(ROOT, "tests", "c", "verbs_ctx_check.c"),
            obj,
            *srcs,
            "-ldl",
            "-lpthread",
        ],
        check=True,
        env=build_env(),
    )
    r = subprocess.run([exe], capture_output=True, text=True, timeout=30, env=build_env())
    assert r.returncode == 0 and "verbs_ctx_check: ok" in r.stdout, r.stdout + r.stderr


def test_a_struct_the_library_grows_may_be_larger_there_only():
    """ibv_port_attr: newer rdma-core (the H200 image's) appends a field (56 bytes against
    Debian 12's 52); ours, passed with its own size, is a prefix. Smaller there is a mismatch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("abi_check", os.path.join(ROOT, "csrc", "abi", "abi_check.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m._grown("sizeof(struct ibv_port_attr)", "56", "52")
    assert not m._grown("sizeof(struct ibv_port_attr)", "48", "52")
    assert not m._grown("sizeof(struct ibv_wc)", "56", "48")
