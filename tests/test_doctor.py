"""`python -m wxfer doctor`: what it reports is checked against what is there, found another
way (ctypes loads of the libraries, `fi_info --version`, sysfs, getrlimit, torch on a GPU).
Runs from the checkout and from the installed wheel (.ci/installed.sh)."""

import json
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest

from wxfer.testing import build_env
from helpers import loads as _loads  # tests/helpers.py

PY = sys.executable
ROOT = os.environ.get("WXFER_INSTALLED") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doctor(**env):
    e = dict(os.environ)
    e.update(env)
    r = subprocess.run([PY, "-m", "wxfer", "doctor", "--json"], capture_output=True, text=True, timeout=120, env=e)
    assert r.returncode == 0, r.stderr
    checks = json.loads(r.stdout)["checks"]
    for c in checks:
        assert c["status"] in ("ok", "missing", "wrong"), c
        assert c["status"] == "ok" or c["fix"], c  # every problem comes with its fix
    return {c["name"]: c for c in checks}


@pytest.fixture(scope="module")
def plain():
    return _doctor()


def test_text_output_names_every_check():
    r = subprocess.run([PY, "-m", "wxfer", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in (
        "libfabric",
        "libibverbs",
        "libcuda",
        "nvrtc",
        "rdma devices",
        "gpu registration",
        "locked memory",
        "gpu topology",
        "cuda peer access",
        "transport for cuda",
        "store",
        "environment",
    ):
        assert re.search(r"^\[(ok|missing|wrong) *\] %s: " % re.escape(name), r.stdout, re.M), (name, r.stdout)


def test_libfabric_as_found(plain):
    c = plain["libfabric"]
    if not _loads("libfabric.so.1"):
        assert c["status"] == "missing" and "libfabric" in c["detail"]
        return
    assert c["status"] == "ok", c
    provs = plain["fabric providers"]["data"]["providers"]
    fi = shutil.which("fi_info")
    if fi:  # libfabric-bin: the library's own answers
        v = re.search(
            r"libfabric: (\d+)\.(\d+)", subprocess.run([fi, "--version"], capture_output=True, text=True).stdout
        )
        assert v and c["data"]["version"] == "%s.%s" % v.groups(), (c, v)
        rdm = subprocess.run([fi, "-c", "FI_RMA", "-t", "FI_EP_RDM"], capture_output=True, text=True).stdout
        assert sorted(set(re.findall(r"provider: (\S+)", rdm))) == provs, (rdm, provs)
    assert plain["transport for cpu"]["data"]["transport"] == ("fabric" if provs else None)


def test_rdma_devices_as_in_sysfs(plain):
    base = "/sys/class/infiniband"
    devs = sorted(os.listdir(base)) if os.path.isdir(base) else []
    c = plain["rdma devices"]
    if not devs:
        assert c["status"] == "missing" and c["data"]["ports"] == [], c
    else:
        assert sorted({p["device"] for p in c["data"]["ports"]}) == devs


def test_libcuda_as_found(plain):
    c = plain["libcuda"]
    if _loads("libcuda.so.1"):
        assert c["status"] in ("ok", "missing")  # missing: a driver without a GPU (cuInit fails)
    else:
        assert c["status"] == "missing" and "libcuda.so.1" in c["detail"], c
        for name in ("gpu registration", "gpu topology", "cuda peer access"):
            assert plain[name]["status"] == "missing", plain[name]
        assert plain["transport for cuda"]["data"]["transport"] != "cuda_ipc"


def test_memlock_as_getrlimit(plain):
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    c = plain["locked memory"]
    assert (c["data"]["soft"], c["data"]["hard"]) == (soft, hard)


def test_store_address_and_interface():
    c = _doctor(WXFER_STORE="127.0.0.1:29777")["store"]
    assert c["status"] == "ok", c
    assert (c["data"]["host"], c["data"]["port"], c["data"]["local"]) == ("127.0.0.1", 29777, "127.0.0.1")
    assert c["data"]["iface"] == "lo"
    bad = _doctor(WXFER_STORE="no-such-host.invalid:1")["store"]
    assert bad["status"] == "wrong" and "no-such-host.invalid" in bad["detail"], bad


def test_verbs_emulation_is_named_and_picked(emu_lib):
    d = _doctor(WXFER_LIBIBVERBS=emu_lib)
    v = d["libibverbs"]
    assert v["status"] == "ok" and v["data"]["emulated"] and v["data"]["devices"], v
    assert "EMULATED" in v["detail"]
    if d["libcuda"]["status"] != "ok":  # no cuda_ipc: GPU memory would go over verbs
        assert d["transport for cuda"]["data"]["transport"] == "verbs", d["transport for cuda"]


def test_efa_check_against_ports():
    from wxfer.tools.doctor import check_efa

    fab = {"loaded": True, "providers": [{"name": "tcp;ofi_rxm"}, {"name": "shm"}]}
    port = {"device": "rdmap0s6", "driver": "efa"}
    assert check_efa([], fab)[0]["status"] == "ok"
    bad = check_efa([port], fab)[0]
    assert bad["status"] == "wrong" and "rdmap0s6" in bad["detail"] and bad["fix"], bad
    assert check_efa([port], {"loaded": True, "providers": [{"name": "efa"}]})[0]["status"] == "ok"


def test_pci_hops_and_topo_words():
    from wxfer.tools.doctor import _topo_word, pci_hops

    gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0"
    nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0"
    far = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"
    assert pci_hops(gpu, nic) == 2 and _topo_word(2, True) == "PIX"
    assert pci_hops(gpu, far) == 7 and _topo_word(7, False) == "SYS" and _topo_word(7, True) == "NODE"


@pytest.mark.gpu
def test_doctor_on_a_gpu_node():
    import torch

    d = _doctor()
    c = d["libcuda"]
    n = torch.cuda.device_count()
    assert c["status"] == "ok" and c["data"]["gpus"] == n, c
    assert d["nvrtc"]["status"] == "ok", d["nvrtc"]
    assert d["transport for cuda"]["data"]["transport"] == "cuda_ipc", d["transport for cuda"]
    m = d["cuda peer access"]["data"]["matrix"]
    for i in range(n):
        for j in range(n):
            assert m[i][j] == (i == j or torch.cuda.can_device_access_peer(i, j)), (i, j, m)
    assert d["libfabric"]["status"] == ("ok" if _loads("libfabric.so.1") else "missing"), d["libfabric"]
    assert d["gpu topology"]["status"] in ("ok", "wrong") and len(d["gpu topology"]["data"]["gpus"]) == n


FAKE_NVRTC = r"""
/* a stand-in libnvrtc: the entry points wxfer resolves, each refusing, but a version */
int nvrtcVersion(int *major, int *minor) { *major = 12; *minor = 9; return 0; }
const char *nvrtcGetErrorString(int r) { (void)r; return "fake nvrtc"; }
int nvrtcCreateProgram(void) { return 1; }
int nvrtcDestroyProgram(void) { return 1; }
int nvrtcCompileProgram(void) { return 1; }
int nvrtcGetProgramLogSize(void) { return 1; }
int nvrtcGetProgramLog(void) { return 1; }
int nvrtcGetCUBINSize(void) { return 1; }
int nvrtcGetCUBIN(void) { return 1; }
"""


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler to build the stand-in libnvrtc")
def test_doctor_reports_a_loaded_nvrtc(tmp_path):
    """The NVRTC entry where the library loads (on the H200 its dict was built with one
    format item too many: doctor died with 'SystemError: Bad dict format'); here a stand-in
    library named by $WXFER_LIBNVRTC takes the loaded branch."""
    src = tmp_path / "fake_nvrtc.c"
    src.write_text(FAKE_NVRTC)
    lib = tmp_path / "libnvrtc.so.12"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, env=build_env())
    code = "import json; from wxfer import _wxfer; print(json.dumps(_wxfer.libraries([])['nvrtc']))"
    e = dict(os.environ, WXFER_LIBNVRTC=str(lib))
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=e)
    assert r.returncode == 0, r.stderr
    nv = json.loads(r.stdout)
    assert nv["loaded"] is True and nv["version"] == "12.9" and nv["path"] == str(lib), nv
    checks = _doctor(WXFER_LIBNVRTC=str(lib))
    assert any("12.9" in json.dumps(c) for c in checks.values()), checks


def test_environment_lists_the_variables_set_and_the_unknown_ones():
    """The C code's variables as its table (csrc/core/wx_param.h) reads them, the Python ones,
    and a WXFER_* name nothing reads (a typo) named as such."""
    d = _doctor(WXFER_IFACE="eth9", WXFER_VERIFY="1", WXFER_IFACEE="typo0")
    env = d["environment"]
    assert env["status"] == "ok", env
    assert env["data"]["set"]["WXFER_IFACE"] == "eth9" and env["data"]["set"]["WXFER_VERIFY"] == "1", env
    assert "WXFER_IFACEE" in env["data"]["unknown"] and "WXFER_IFACEE" not in env["data"]["set"], env
    assert "WXFER_IFACE=eth9" in env["detail"] and "typo" in env["detail"], env
