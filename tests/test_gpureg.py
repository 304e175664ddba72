"""Issue 28, item 3 (CPU, CI): where GPU memory cannot be registered for RDMA, the transport
fails when it opens (the Receiver's and Sender's setup), naming the cause and its fix, before
anything is registered or written. Each cause is forced here:

- verbs: no dma-buf (each of its three conditions) and no nvidia-peermem, or only the one the
  option reg= excludes: the facts the backend reads are overridden with $WXFER_TEST_GPUREG
  (test builds only); with no override on this CPU machine, the real cause (no CUDA driver);
- memlock too low: a real RLIMIT_MEMLOCK lowered in the child, the emulation counting pinned
  host pages as the kernel does (WXEMU_VERBS_MEMLOCK=nocap: as for a process without
  CAP_IPC_LOCK);
- a libfabric provider without FI_HMEM: the real tcp provider of this libfabric, with
  hmem=on (what the Receiver and Sender ask for with CUDA memory).

The emulated verbs runs happen in child processes (see test_verbs.py)."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import wxfer
from wxfer import _wxfer
from wxfer.runtime.receiver import gpu_memory_options, registration_info
from wxfer.tools import gpuprobe
from helpers import needs_verbs_emulation as _verbs_emulation_mark  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

needs_verbs_emulation = _verbs_emulation_mark()
needs_testing_build = pytest.mark.skipif(
    not getattr(_wxfer, "TESTING", 0), reason="$WXFER_TEST_GPUREG is read by test builds only (WXFER_TESTING=1)"
)
needs_fabric = pytest.mark.skipif(
    not wxfer.backends()["fabric"]["available"], reason="fabric backend unavailable: %s" % wxfer.backends()["fabric"]
)


def _child(emu_lib, code, **env):
    e = dict(os.environ, WXFER_LIBIBVERBS=emu_lib)
    e.pop("WXFER_TEST_GPUREG", None)
    e.update({k: str(v) for k, v in env.items()})
    r = subprocess.run([PY, "-c", textwrap.dedent(code)], env=e, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "child failed:\n%s\n%s" % (r.stdout, r.stderr)
    return r.stdout


OPEN = """
from wxfer import _wxfer
try:
    t = _wxfer.Transport("verbs", {%s})
    print("OPENED", t.info())
    t.close()
except _wxfer.Error as e:
    print("ERROR", e)
"""


def _open(emu_lib, opts, facts=None):
    env = {"WXFER_TEST_GPUREG": facts} if facts is not None else {}
    out = _child(emu_lib, OPEN % opts, **env)
    return out.strip().splitlines()[-1]


@needs_verbs_emulation
@needs_testing_build
@pytest.mark.parametrize(
    "facts,words",
    [
        # the open kernel module missing (or Linux < 5.12): the driver says no dma-buf
        ("cuda=1,dmabuf=0,peermem=0", ["CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0", "open kernel module"]),
        # an rdma-core older than 34
        ("cuda=1,ibv_dmabuf=0,peermem=0", ["lacks ibv_reg_dmabuf_mr (rdma-core < 34)", "rdma-core >= 34"]),
        # a CUDA driver older than 11.7
        ("cuda=1,get_handle=0,peermem=0", ["lacks cuMemGetHandleForAddressRange", "driver >= 515"]),
    ],
)
def test_verbs_no_dmabuf_and_no_peermem_fails_at_open_naming_cause_and_fix(emu_lib, facts, words):
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes"', facts)
    assert line.startswith("ERROR"), line
    assert "GPU 0 memory cannot be registered with the NIC on this machine" in line, line
    for w in words + ["nvidia-peermem: not loaded", "fix: modprobe nvidia-peermem"]:
        assert w in line, (w, line)


@needs_verbs_emulation
@needs_testing_build
def test_verbs_route_is_chosen_at_open_and_reported(emu_lib):
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes"', "cuda=1")
    assert line.startswith("OPENED") and "gpu_route=dmabuf (GPU 0 exports dma-bufs" in line, line
    assert registration_info("verbs", line[7:]).startswith(
        "registration=none (nothing registered yet); gpu_route=dmabuf"
    )
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes"', "cuda=1,dmabuf=0,peermem=1")
    assert "gpu_route=peermem (nvidia-peermem loaded; dma-buf: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0" in line, line
    # reg= narrows the choice: each refused when only the other one would work
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes", "reg": "dmabuf"', "cuda=1,dmabuf=0,peermem=1")
    assert line.startswith("ERROR") and "by dma-buf (reg=dmabuf)" in line and "reg=auto" in line, line
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes", "reg": "peermem"', "cuda=1")
    assert line.startswith("ERROR") and "nvidia-peermem is not loaded (fix: modprobe" in line, line
    # the emulation's own "nvidia-peermem" switch is what the backend reads there
    out = _child(
        emu_lib,
        OPEN % '"gpu": "0", "gpu_memory": "yes", "reg": "peermem"',
        WXFER_TEST_GPUREG="cuda=1",
        WXEMU_VERBS_PEERMEM="1",
    )
    assert "gpu_route=peermem" in out, out
    # without gpu_memory=yes nothing is checked (host memory only)
    line = _open(emu_lib, '"gpu": "0"', "cuda=0")
    assert line.startswith("OPENED") and "gpu_route" not in line, line
    line = _open(emu_lib, '"gpu_memory": "maybe"')
    assert "gpu_memory=maybe (want yes or no)" in line, line


@needs_verbs_emulation
def test_verbs_gpu_memory_without_a_cuda_driver_names_it(emu_lib):
    """No override: the real facts of this machine. Where there is no GPU the CUDA driver is
    the cause (on a GPU machine this would open, so it is not asserted there)."""
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA GPU is present: the real facts allow a route here")
    except ImportError:
        pass
    line = _open(emu_lib, '"gpu": "0", "gpu_memory": "yes"')
    assert line.startswith("ERROR") and "the CUDA driver is not usable" in line and "fix:" in line, line


@needs_verbs_emulation
def test_memlock_too_low_fails_the_registration_naming_the_limit_and_the_fix(emu_lib):
    out = _child(
        emu_lib,
        """
        import resource
        import numpy as np
        from wxfer import _wxfer
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, hard))
        t = _wxfer.Transport("verbs", {})
        small = np.zeros(256 << 10, dtype=np.uint8)
        r = t.register(small)  # within the limit
        big = np.zeros(4 << 20, dtype=np.uint8)
        try:
            t.register(big)
            raise AssertionError("registered past RLIMIT_MEMLOCK")
        except _wxfer.Error as e:
            print("ERROR", e)
        r.close()
        r = t.register(np.zeros(512 << 10, dtype=np.uint8))  # the failed one pinned nothing
        r.close(); t.close()
        """,
        WXEMU_VERBS_MEMLOCK="nocap",
    )
    line = [l for l in out.splitlines() if l.startswith("ERROR")][0]
    for w in [
        "Cannot allocate memory",
        "RLIMIT_MEMLOCK, which is 1024 KiB",
        "ulimit -l unlimited",
        "--ulimit memlock=-1",
    ]:
        assert w in line, (w, line)


@needs_verbs_emulation
def test_memlock_is_not_enforced_by_default_nor_with_cap_ipc_lock(emu_lib):
    code = """
        import resource
        import numpy as np
        from wxfer import _wxfer
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, hard))
        t = _wxfer.Transport("verbs", {})
        r = t.register(np.zeros(4 << 20, dtype=np.uint8))
        r.close(); t.close()
        print("OK")
        """
    assert "OK" in _child(emu_lib, code)
    if os.geteuid() == 0:  # root has CAP_IPC_LOCK: the kernel does not count its pages
        assert "OK" in _child(emu_lib, code, WXEMU_VERBS_MEMLOCK="1")


@needs_fabric
def test_fabric_provider_without_hmem_fails_at_open_naming_the_ones_that_have_it():
    probe = gpuprobe.fabric_probe()
    hm = [p for p, _ in gpuprobe.fabric_hmem_providers(probe)]
    if "tcp;ofi_rxm" in hm:
        pytest.skip("this libfabric's tcp offers FI_HMEM: %s" % gpuprobe.fabric_finding(probe))
    with pytest.raises(_wxfer.Error) as ei:
        _wxfer.Transport("fabric", {"provider": "tcp", "hmem": "on"})
    m = str(ei.value)
    assert "provider tcp;ofi_rxm does not offer FI_HMEM" in m and "libfabric %s" % probe["version"] in m, m
    have = re.search(r"providers here that do: (.*?) \(fix:", m).group(1)
    assert sorted(x.split("/")[0] for x in have.split(", ")) == sorted(hm) if hm else have == "none", (have, hm)
    assert "fix: provider=" in m, m
    # hmem=auto still opens it (host memory)
    _wxfer.Transport("fabric", {"provider": "tcp", "hmem": "auto"}).close()


@needs_fabric
def test_fabric_probe_reports_the_loaded_libfabric():
    probe = gpuprobe.fabric_probe()
    assert probe["loaded"] is True
    fi_info = shutil.which("fi_info")
    if fi_info:
        out = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=30).stdout
        lib = re.search(r"libfabric: (\d+\.\d+)", out)
        if lib:
            assert probe["version"] == lib.group(1), (probe["version"], out)
    names = {e["provider"] for e in probe["rma"]}
    assert "tcp;ofi_rxm" in names, names
    for e in probe["rma_hmem"]:
        assert e["hmem"] is True and e["provider"] in names, e
    # what `fi_info -c FI_HMEM` lists, for the same kind of endpoint
    if fi_info:
        out = subprocess.run(
            [fi_info, "-c", "FI_HMEM", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=30
        ).stdout
        listed = set(re.findall(r"provider: (\S+)", out))
        assert {p for p, _ in gpuprobe.fabric_hmem_providers(probe)} <= listed | {"none"}, (listed, probe["rma_hmem"])
    assert "FI_HMEM offered by:" in gpuprobe.fabric_finding(probe)


def test_receiver_and_sender_ask_for_the_gpu_check_with_cuda_memory():
    import torch

    cuda1 = torch.device("cuda", 1)
    assert gpu_memory_options("verbs", cuda1, {}) == {"gpu": "1", "gpu_memory": "yes"}
    assert gpu_memory_options("verbs", cuda1, {"gpu_memory": "no"}) == {"gpu": "1", "gpu_memory": "no"}
    assert gpu_memory_options("fabric", torch.device("cuda"), {"provider": "shm"}) == {"provider": "shm", "hmem": "on"}
    assert gpu_memory_options("fabric", torch.device("cpu"), {"provider": "tcp"}) == {"provider": "tcp"}
    assert gpu_memory_options("cuda_ipc", cuda1, {}) == {}
