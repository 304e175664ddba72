"""Every backend is in every build, whatever headers the build machine had: the extension
carries its own declarations (csrc/core/wx_*_abi.h) and decides availability at run time.
.ci/installed.sh runs this against the manylinux wheel built with the -dev headers hidden
(.ci/wheel.sh), with WXFER_WHEEL_GLIBC=2.28 (the most recent glibc symbol version allowed)."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

import wxfer
from helpers import loads as _loads  # tests/helpers.py

PY = sys.executable
ROOT = os.environ.get("WXFER_INSTALLED") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ext():
    from wxfer import _wxfer

    return _wxfer.__file__


def test_no_backend_is_compiled_out():
    b = wxfer.backends()
    assert set(b) == {"fabric", "verbs", "cuda_ipc"}
    for name, v in b.items():
        assert "not part of this build" not in v["reason"], (name, v)


def test_fabric_available_where_libfabric_is():
    b = wxfer.backends()["fabric"]
    if _loads("libfabric.so.1"):
        assert b["available"], b
    else:
        assert not b["available"] and "libfabric" in b["reason"], b


def test_cuda_ipc_reason_names_the_library():
    b = wxfer.backends()["cuda_ipc"]
    if not _loads("libcuda.so.1"):
        assert not b["available"] and "libcuda.so.1" in b["reason"], b


def test_verbs_available_over_the_emulation(emu_lib):
    emu = emu_lib
    code = "import wxfer, json; print(json.dumps(wxfer.backends()['verbs']))"
    r = subprocess.run(
        [PY, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ, WXFER_LIBIBVERBS=emu)
    )
    assert r.returncode == 0, r.stderr
    assert '"available": true' in r.stdout, r.stdout


def test_extension_links_no_foreign_library():
    """libfabric, libibverbs, libcuda and NVRTC are dlopened, never linked."""
    if not shutil.which("objdump"):
        pytest.skip("objdump missing")
    out = subprocess.run(["objdump", "-p", _ext()], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"NEEDED\s+(\S+)", out)
    assert not [n for n in needed if re.match(r"lib(fabric|ibverbs|cuda|nvrtc)", n)], needed
    syms = subprocess.run(["objdump", "-T", _ext()], capture_output=True, text=True, check=True).stdout
    und = [ln for ln in syms.splitlines() if "*UND*" in ln and re.search(r"\b(ibv_|fi_|cu[A-Z]|nvrtc)", ln)]
    assert not und, und


def test_glibc_floor():
    floor = os.environ.get("WXFER_WHEEL_GLIBC")
    if not floor:
        pytest.skip("not the manylinux wheel (WXFER_WHEEL_GLIBC unset)")
    if not shutil.which("objdump"):
        pytest.skip("objdump missing")
    syms = subprocess.run(["objdump", "-T", _ext()], capture_output=True, text=True, check=True).stdout
    vers = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", syms)}
    assert vers and max(vers) <= tuple(int(x) for x in floor.split(".")), sorted(vers)[-3:]
    assert glob.glob(os.path.join(os.path.dirname(wxfer.__file__), "..", "wxfer-*.dist-info"))
