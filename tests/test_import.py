"""The package imports, and says which backends are unusable and why, on a machine that
lacks libcuda / libibverbs (simulated by pointing the loaders at files that do not exist)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _backends(env_extra):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = ROOT
    out = subprocess.run(
        [sys.executable, "-c", "import json, wxfer; print(json.dumps(wxfer.backends()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_without_libcuda_and_libibverbs_says_why():
    b = _backends({"WXFER_LIBCUDA": "/nonexistent/libcuda.so.1", "WXFER_LIBIBVERBS": "/nonexistent/libibverbs.so.1"})
    assert set(b) == {"fabric", "verbs", "cuda_ipc"}
    for name in ("cuda_ipc", "verbs"):
        assert b[name]["available"] is False
        assert b[name]["reason"], name
    # when the backend is built, the reason names the library it could not load
    if "not part of this build" not in b["cuda_ipc"]["reason"] and "missing at build" not in b["cuda_ipc"]["reason"]:
        assert "libcuda" in b["cuda_ipc"]["reason"]
    if "not part of this build" not in b["verbs"]["reason"] and "missing at build" not in b["verbs"]["reason"]:
        assert "libibverbs" in b["verbs"]["reason"]


def test_missing_libfabric_is_reported():
    b = _backends({"WXFER_LIBFABRIC": "/nonexistent/libfabric.so.1"})
    assert b["fabric"]["available"] is False
    assert "libfabric" in b["fabric"]["reason"]


def test_cli_backends_lists_every_transport():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "wxfer", "backends"], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for name in ("fabric", "verbs", "cuda_ipc"):
        assert name in out
