"""What this machine offers for GPU memory registered for RDMA (issue 28).

``python -m wxfer.tools.gpuprobe [--json]`` prints, for the lead's GPU runs and for users:

- libfabric: the version loaded, its providers for one-sided writes (FI_EP_RDM, FI_RMA) and
  which of them offer FI_HMEM; for each of those, whether a transport opens with hmem=on
  and, where a CUDA GPU is present, whether 2 MiB of CUDA memory registers
  (``fi_mr_regattr`` with FI_HMEM_CUDA) -- the step that needs a libfabric built with CUDA;
- CUDA: the GPU, the driver, whether it is the open kernel module, and
  CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (dma-buf export of GPU memory);
- verbs: the real libibverbs (ibv_reg_dmabuf_mr exported?), RDMA devices, nvidia-peermem,
  RLIMIT_MEMLOCK.

Nothing here writes anything; each finding says what it read. The CUDA, verbs, sysfs and
rlimit facts are those ``python -m wxfer doctor`` reads (``_wxfer.libraries()``, the same
dlopen tables the backends use, and doctor's sysfs readers); what only this tool does is
libfabric's providers as the backend asks for them (with and without FI_HMEM) and the try
of a CUDA registration through each. The `gpu` tests
(tests/test_fabric_gpu.py) take the HMEM providers from :func:`fabric_hmem_providers` and skip
with :func:`fabric_finding` as the reason where there are none.
"""

from __future__ import annotations

import json
import platform
import resource
import sys

from . import doctor


def fabric_probe() -> dict:
    """The C probe's answer: {"loaded", "version", "rma": [...], "rma_hmem": [...]}."""
    from .. import _wxfer

    return json.loads(_wxfer.fabric_probe())


def fabric_hmem_providers(probe: dict | None = None) -> list[tuple[str, str]]:
    """(provider, domain) of every provider that offers FI_HMEM, first domain each."""
    probe = fabric_probe() if probe is None else probe
    seen, out = set(), []
    for e in probe.get("rma_hmem", []):
        if e["provider"] not in seen:
            seen.add(e["provider"])
            out.append((e["provider"], e["domain"]))
    return out


def fabric_finding(probe: dict | None = None) -> str:
    """One line: the libfabric version and which providers offer FI_HMEM."""
    probe = fabric_probe() if probe is None else probe
    if not probe.get("loaded"):
        return "libfabric not loaded: %s" % probe.get("why")
    provs = sorted({e["provider"] for e in probe["rma"]})
    hm = [p for p, _ in fabric_hmem_providers(probe)]
    return "libfabric %s: RMA providers %s; FI_HMEM offered by: %s" % (
        probe["version"],
        ", ".join(provs) or "none",
        ", ".join(hm) or "none",
    )


def _try_fabric_cuda(provider: str, domain: str) -> dict:
    from .. import _wxfer

    res = {"provider": provider, "domain": domain}
    opts = {"provider": provider, "hmem": "on"}
    if provider.startswith(("tcp", "net", "udp", "sockets")):
        opts["iface"] = domain
    try:
        t = _wxfer.Transport("fabric", opts)
    except _wxfer.Error as e:
        res.update(opened=False, error=str(e))
        return res
    res.update(opened=True, info=t.info())
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.zeros(2 << 20, dtype=torch.uint8, device="cuda:0")
            try:
                r = t.register(x)
                res.update(cuda_registered=True)
                r.close()
            except _wxfer.Error as e:
                res.update(cuda_registered=False, error=str(e))
        else:
            res.update(cuda_registered=None, error="no CUDA GPU here: registration not tried")
    finally:
        t.close()
    return res


def _cuda_facts(lib: dict) -> dict:
    """torch's view, and the driver's as the extension's libcuda table reads it (doctor's)."""
    out: dict = {}
    try:
        import torch

        out["torch"] = torch.__version__
        if not torch.cuda.is_available():
            out["gpu"] = None
            return out
        out["gpu"] = torch.cuda.get_device_name(0)
        out["torch_cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001 -- reported, not raised
        out["torch_error"] = repr(e)
        return out
    cu = lib["libcuda"]
    if cu["loaded"] and cu["devices"]:
        out["driver_api"] = cu["driver_version"]
        out["dma_buf_supported"] = int(cu["devices"][0]["dmabuf"])
        out["cuMemGetHandleForAddressRange"] = cu["get_handle"]
    else:
        out["libcuda"] = cu["why"] or "no devices"
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline().strip()
        out["kernel_module"] = first
        out["open_kernel_module"] = "Open Kernel Module" in first
    except OSError:
        out["kernel_module"] = None
    return out


def _verbs_facts(lib: dict) -> dict:
    """libibverbs as the extension loads it, and sysfs / rlimit facts, all as doctor reads them."""
    v = lib["libibverbs"]
    soft, _ = doctor.memlock()
    return {
        "libibverbs": True if v["loaded"] else v["why"],
        "ibv_reg_dmabuf_mr": v.get("reg_dmabuf_mr", False),
        "emulated": v.get("emulated", False),
        "rdma_devices": sorted({p["device"] for p in doctor.rdma_ports()}),
        "nvidia_peermem": doctor.nvidia_peermem(),
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "kernel": platform.release(),
    }


def probe_all(try_cuda: bool = True) -> dict:
    from .. import _wxfer

    fp = fabric_probe()
    lib = _wxfer.libraries([])
    res = {"fabric": {"finding": fabric_finding(fp), "probe": fp}, "cuda": _cuda_facts(lib), "verbs": _verbs_facts(lib)}
    if try_cuda and fp.get("loaded"):
        res["fabric"]["hmem_tries"] = [_try_fabric_cuda(p, d) for p, d in fabric_hmem_providers(fp)]
    return res


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    res = probe_all()
    if "--json" in argv:
        print(json.dumps(res, indent=1, sort_keys=True))
        return 0
    print("fabric:", res["fabric"]["finding"])
    for t in res["fabric"].get("hmem_tries", []):
        print(
            "  %s (%s): opened=%s cuda_registered=%s %s"
            % (t["provider"], t["domain"], t.get("opened"), t.get("cuda_registered"), t.get("error", ""))
        )
    print("cuda:", json.dumps(res["cuda"], sort_keys=True))
    print("verbs:", json.dumps(res["verbs"], sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
