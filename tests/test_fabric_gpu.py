"""Issue 28, item 1: the fabric backend with GPU memory, through every provider of the
installed libfabric that offers FI_HMEM (without a NIC: shm with CUDA IPC / device copies,
tcp where it has HMEM).

Two processes, as tests/test_fabric.py on the CPU: a target that registers its buffers on
the GPU (fi_mr_regattr with FI_HMEM_CUDA and the device id, hmem=on: FI_HMEM in the hints),
and this process writing through the Engine from GPU or host memory: GPU -> GPU,
GPU -> host, host -> GPU, every byte checked. Which providers are tried comes from the probe
(wxfer.tools.gpuprobe, `python -m wxfer.tools.gpuprobe`); where none offers FI_HMEM, or one
offers it but this libfabric cannot register CUDA memory (built without CUDA), the test skips
with that finding as its reason."""

import pytest

import wxfer
from wxfer import _wxfer
from wxfer.testing import TargetProcess
from wxfer.tools import gpuprobe

FABRIC = wxfer.backends()["fabric"]
PROBE = gpuprobe.fabric_probe() if FABRIC["available"] else {"loaded": False, "why": FABRIC["reason"]}
FINDING = gpuprobe.fabric_finding(PROBE)
HMEM = gpuprobe.fabric_hmem_providers(PROBE) if PROBE.get("loaded") else []
PROVIDERS = [pytest.param(p, d, id=p) for p, d in HMEM] or [
    pytest.param(None, None, id="none", marks=pytest.mark.skip(reason="no provider offers FI_HMEM: " + FINDING))
]
CASES = [("cuda:0", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cuda:0")]
N = 9 << 20

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def _opts(provider, domain):
    return {"provider": provider, "iface": domain, "hmem": "on"}


@pytest.mark.parametrize("provider,domain", PROVIDERS)
@pytest.mark.parametrize("src_dev,dst_dev", CASES, ids=["gpu-gpu", "gpu-host", "host-gpu"])
def test_fabric_writes_with_gpu_memory(provider, domain, src_dev, dst_dev):
    import torch

    opts = _opts(provider, domain)
    try:
        tp = TargetProcess("fabric", opts, [N], device=dst_dev)
    except RuntimeError as e:
        if dst_dev != "cpu" and "fi_mr_regattr" in str(e) and "FI_HMEM_CUDA" in str(e):
            pytest.skip("%s; %s offers FI_HMEM but cannot register CUDA memory here: %s" % (FINDING, provider, e))
        raise
    with tp:
        t = _wxfer.Transport("fabric", opts)
        try:
            tp.connect(t)
            g = torch.Generator().manual_seed(len(src_dev) * 7 + len(dst_dev))
            host = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)
            src = host.to(src_dev)
            torch.cuda.synchronize()
            try:
                r = t.register(src, export=False)
            except _wxfer.Error as e:
                if src_dev != "cpu" and "FI_HMEM_CUDA" in str(e):
                    pytest.skip("%s; %s cannot register a CUDA write source here: %s" % (FINDING, provider, e))
                raise
            eng = _wxfer.Engine(t, chunk=1 << 20, timeout=30.0)
            # one large write in chunks and one at an odd offset and length
            eng.submit(r, [(tp.descriptors[0], 0, 0, N - 4099), (tp.descriptors[0], N - 4099, N - 4099, 4099)], tag=1)
            eng.wait(timeout=30.0)
            got = torch.frombuffer(bytearray(tp.read(0)), dtype=torch.uint8)
            assert torch.equal(got, host), (got != host).nonzero()[:5].tolist()
            assert "hmem=yes" in t.info() and "hmem=yes" in tp.info, (t.info(), tp.info)
            if dst_dev != "cpu":
                assert "reg_cuda=1" in tp.info, tp.info
            print("%s %s -> %s: %d bytes checked; target %s" % (provider, src_dev, dst_dev, N, tp.info))
            eng.close()
            r.close()
        finally:
            t.close()


def test_probe_finding_is_stated():
    """The probe's finding, printed for the run's log (-rA / -s) and checked for its form."""
    print("fabric HMEM probe:", FINDING)
    assert FINDING.startswith(("libfabric ", "libfabric not loaded"))
