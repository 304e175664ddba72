"""python -m wxfer doctor [--json]: what a user runs first on a new cluster.

Each check is ok / missing / wrong, with what was found and, unless ok, the fix in one line:
the libraries wxfer dlopens and their versions (libfabric and its providers, libibverbs,
libcuda and the driver, NVRTC); the RDMA devices and their ports (sysfs /sys/class/infiniband);
the GPU memory registration paths (dma-buf, nvidia_peermem); the locked-memory limit; each
GPU's NUMA node and nearest RDMA NIC (sysfs, as `nvidia-smi topo -m` shows it); CUDA peer
access between the GPUs; the transport Sender/Receiver would pick here and why; the store
address and the interface it would use; the WXFER_* variables set (wxfer/envs.py). Nothing
is changed and no connection is made.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket

from .. import envs

OK, MISSING, WRONG = "ok", "missing", "wrong"
SYS = "/sys"
MEMLOCK_MIN = 1 << 30  # host memory registered for RDMA counts against `ulimit -l`


def _check(name, status, detail, fix="", **data):
    return {"name": name, "status": status, "detail": detail, "fix": "" if status == OK else fix, "data": data}


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def rdma_ports(sysfs=SYS):
    """[{device, port, state, phys_state, link_layer, rate, pci}] from sysfs."""
    base = os.path.join(sysfs, "class", "infiniband")
    out = []
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        pci = os.path.realpath(os.path.join(base, dev, "device"))
        ports = os.path.join(base, dev, "ports")
        for p in sorted(os.listdir(ports), key=lambda s: int(s) if s.isdigit() else 0) if os.path.isdir(ports) else []:
            d = os.path.join(ports, p)
            out.append(
                {
                    "device": dev,
                    "port": int(p) if p.isdigit() else p,
                    "state": _read(os.path.join(d, "state")).split(":")[-1].strip(),
                    "phys_state": _read(os.path.join(d, "phys_state")).split(":")[-1].strip(),
                    "link_layer": _read(os.path.join(d, "link_layer")),
                    "rate": _read(os.path.join(d, "rate")),
                    "pci": pci,
                    "numa": _numa(pci),
                    "driver": os.path.basename(os.path.realpath(os.path.join(pci, "driver"))),
                }
            )
    return out


def _numa(pci_path):
    v = _read(os.path.join(pci_path, "numa_node"), "-1")
    return int(v) if v.lstrip("-").isdigit() else -1


def pci_hops(a, b):
    """PCI hops between two sysfs device paths (up to the common bridge and down)."""
    pa, pb = a.strip("/").split("/"), b.strip("/").split("/")
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    return (len(pa) - common) + (len(pb) - common)


def _topo_word(hops, same_numa):
    """nvidia-smi topo -m's words, from the hop count and NUMA nodes."""
    if hops <= 2:
        return "PIX"
    if hops <= 4:
        return "PXB"
    return "NODE" if same_numa else "SYS"


def _library(name: str, info: dict, fix: str, found, why: str | None = None) -> dict:
    """The check of library `name` from its entry `info` of ``_wxfer.libraries()``: OK with
    ``found(info)`` -> (detail, data) when it loaded, else MISSING with `why` (default: the
    loader's reason) and `fix`."""
    if not info["loaded"]:
        return _check(name, MISSING, info["why"] if why is None else why, fix)
    detail, data = found(info)
    return _check(name, OK, detail, **data)


def _check_fabric(lib):
    fab = lib["libfabric"]
    out = [
        _library(
            "libfabric",
            fab,
            "install libfabric 1.9+ (apt install libfabric1; EFA images ship it) "
            "or set WXFER_LIBFABRIC=/path/libfabric.so.1",
            lambda f: ("libfabric %s (ABI of %s)" % (f["version"], lib["abi_libfabric"]), dict(version=f["version"])),
        )
    ]
    if fab["loaded"]:
        provs = sorted({p["name"] for p in fab.get("providers", []) if p["rma"] and p["ep_type"] == "rdm"})
        hmem = sorted({p["name"] for p in fab.get("providers", []) if p["hmem"]})
        if provs:
            det = "RDM providers with RMA: %s" % ", ".join(provs)
            det += "; with FI_HMEM (GPU memory): %s" % (", ".join(hmem) if hmem else "none")
            out.append(_check("fabric providers", OK, det, providers=provs, hmem=hmem))
        else:
            out.append(
                _check(
                    "fabric providers",
                    MISSING,
                    "fi_getinfo found no RDM provider with RMA (%s)" % (fab["why"] or "none listed"),
                    "install the provider libraries (Debian: libfabric1 has tcp and shm; EFA: the aws-efa-installer)",
                    providers=[],
                )
            )
    return out


def _check_verbs(lib):
    def found(v):
        what = "EMULATED libibverbs (test build of csrc/testing)" if v["emulated"] else "libibverbs"
        detail = "%s from %s, %d device(s): %s (ABI of %s)" % (
            what,
            v["path"],
            len(v["devices"]),
            ", ".join(v["devices"]) or "none",
            lib["abi_ibverbs"],
        )
        return detail, dict(path=v["path"], emulated=v["emulated"], devices=v["devices"])

    fix = "install rdma-core's libibverbs1 and the NIC's provider (apt install libibverbs1 ibverbs-providers)"
    return [_library("libibverbs", lib["libibverbs"], fix, found)]


def _check_cuda(lib):
    def found(c):
        dv = c["driver_version"]
        gpus = ", ".join("%d %s (%s)" % (g["index"], g["name"], g["pci"]) for g in c["devices"])
        detail = "driver API %d.%d, %d GPU(s): %s" % (dv // 1000, dv % 1000 // 10, len(c["devices"]), gpus)
        return detail, dict(driver_version=dv, gpus=len(c["devices"]))

    fix = "install the NVIDIA driver; in a container run with --gpus all (or the NVIDIA container runtime)"
    return [_library("libcuda", lib["libcuda"], fix, found)]


def _check_nvrtc(lib):
    def found(n):
        return "NVRTC %s from %s" % (n["version"], n["path"]), dict(version=n["version"], path=n["path"])

    n = lib["nvrtc"]
    fix = "pip install nvidia-cuda-nvrtc-cu12 (or have torch's CUDA wheels), or set WXFER_LIBNVRTC=/path/libnvrtc.so"
    return [_library("nvrtc", n, fix, found, why=n["why"].split("; ")[0][:300] if not n["loaded"] else None)]


def check_libraries(lib):
    """One check per library (and libfabric's providers) from `_wxfer.libraries()`."""
    return _check_fabric(lib) + _check_verbs(lib) + _check_cuda(lib) + _check_nvrtc(lib)


def check_rdma(ports, verbs):
    if not ports:
        emu = verbs["loaded"] and verbs["emulated"]
        det = "no RDMA device (/sys/class/infiniband is empty)"
        if emu:
            det += "; the EMULATED libibverbs shows %d test device(s)" % len(verbs["devices"])
        return [
            _check(
                "rdma devices",
                MISSING,
                det,
                "none needed within a node (cuda_ipc) or over fabric tcp; for RDMA load the NIC's "
                "driver (mlx5_ib, efa) and check `ibv_devices`",
                ports=[],
            )
        ]
    bad = [p for p in ports if p["state"] != "ACTIVE"]
    det = "; ".join("%s:%s %s %s %s" % (p["device"], p["port"], p["state"], p["link_layer"], p["rate"]) for p in ports)
    if bad:
        return [
            _check(
                "rdma devices",
                WRONG,
                det,
                "a port is not ACTIVE: check the cable / switch and `ibstat`; wxfer skips ports that are down",
                ports=ports,
            )
        ]
    return [_check("rdma devices", OK, det, ports=ports)]


def check_efa(ports, fab):
    """An EFA NIC wants libfabric's efa provider (Debian's libfabric1 has none; AWS's has)."""
    efa = sorted({p["device"] for p in ports if p["driver"] == "efa"})
    provs = {p["name"].split(";")[0] for p in fab.get("providers", [])} if fab["loaded"] else set()
    if not efa:
        return [
            _check(
                "efa provider",
                OK,
                "no EFA device here" + ("; efa provider present" if "efa" in provs else ""),
                devices=[],
            )
        ]
    if "efa" in provs:
        return [
            _check("efa provider", OK, "EFA device(s) %s and libfabric's efa provider" % ", ".join(efa), devices=efa)
        ]
    return [
        _check(
            "efa provider",
            WRONG,
            "EFA device(s) %s but the loaded libfabric has no efa provider" % ", ".join(efa),
            "use the aws-efa-installer's libfabric: "
            "WXFER_LIBFABRIC=/opt/amazon/efa/lib64/libfabric.so.1 (lib/ on Ubuntu)",
            devices=efa,
        )
    ]


def nvidia_peermem(sysfs=SYS) -> bool:
    """Whether the nvidia_peermem module is loaded (GPU Direct RDMA without dma-buf)."""
    return os.path.isdir(os.path.join(sysfs, "module", "nvidia_peermem"))


def memlock() -> tuple:
    """(soft, hard) RLIMIT_MEMLOCK: host memory registered for RDMA counts against it."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def check_gpu_reg(cuda, ports):
    peermem = nvidia_peermem()
    if not cuda["loaded"] or not cuda["devices"]:
        return [
            _check(
                "gpu registration",
                MISSING,
                "no GPU here (libcuda: %s)" % (cuda["why"] or "no devices"),
                "only GPU memory needs it: run on a GPU node",
                peermem=peermem,
                dmabuf=[],
            )
        ]
    dmabuf = [g["index"] for g in cuda["devices"] if g["dmabuf"]]
    det = "dma-buf supported on GPU(s) %s; nvidia_peermem %s" % (
        dmabuf or "none",
        "loaded" if peermem else "not loaded",
    )
    if dmabuf or peermem:
        return [_check("gpu registration", OK, det, peermem=peermem, dmabuf=dmabuf)]
    status = WRONG if ports else MISSING
    return [
        _check(
            "gpu registration",
            status,
            det + (" (no RDMA device, so nothing needs it yet)" if not ports else ""),
            "GPU Direct RDMA needs dma-buf (driver 515+, kernel 5.12+, open kernel modules) "
            "or `modprobe nvidia_peermem`",
            peermem=peermem,
            dmabuf=dmabuf,
        )
    ]


def check_memlock(ports):
    soft, hard = memlock()
    inf = resource.RLIM_INFINITY

    def fmt(v):
        return "unlimited" if v == inf else "%d KiB" % (v // 1024)

    det = "ulimit -l: %s (hard %s)" % (fmt(soft), fmt(hard))
    low = soft != inf and soft < MEMLOCK_MIN
    if low and ports:
        return [
            _check(
                "locked memory",
                WRONG,
                det + ": too low to register host memory for RDMA",
                "ulimit -l unlimited (docker: --ulimit memlock=-1; slurm: PropagateResourceLimits)",
                soft=soft,
                hard=hard,
            )
        ]
    if low:
        det += " (low, but only RDMA registration of host memory needs more; no RDMA device here)"
    return [_check("locked memory", OK, det, soft=soft, hard=hard)]


def check_topology(cuda, ports):
    if not cuda["loaded"] or not cuda["devices"]:
        return [_check("gpu topology", MISSING, "no GPU here", "run on a GPU node", gpus=[])]
    gpus, wrong = [], False
    for g in cuda["devices"]:
        pci = os.path.realpath(os.path.join(SYS, "bus", "pci", "devices", g["pci"].lower()))
        numa = _numa(pci)
        near = None
        for p in ports:
            h = pci_hops(pci, p["pci"])
            if near is None or h < near["hops"]:
                near = {"nic": p["device"], "hops": h, "numa": p["numa"], "topo": _topo_word(h, p["numa"] == numa)}
        if near and near["topo"] == "SYS":
            wrong = True
        gpus.append({"gpu": g["index"], "pci": g["pci"], "numa": numa, "nearest_nic": near})
    det = "; ".join(
        "GPU %d (%s) NUMA %d, nearest NIC %s"
        % (
            x["gpu"],
            x["pci"],
            x["numa"],
            "%s %s (%d hops, NUMA %d)"
            % (x["nearest_nic"]["nic"], x["nearest_nic"]["topo"], x["nearest_nic"]["hops"], x["nearest_nic"]["numa"])
            if x["nearest_nic"]
            else "none",
        )
        for x in gpus
    )
    if wrong:
        return [
            _check(
                "gpu topology",
                WRONG,
                det,
                "a GPU's nearest NIC is on another NUMA node (SYS): run the process on the GPU's "
                "NUMA node and give verbs a NIC near it (its device option)",
                gpus=gpus,
            )
        ]
    return [_check("gpu topology", OK, det, gpus=gpus)]


def check_peer(cuda):
    if not cuda["loaded"] or not cuda["devices"]:
        return [_check("cuda peer access", MISSING, "no GPU here", "run on a GPU node", matrix=[])]
    m = cuda["peer"]
    n = len(m)
    if n < 2:
        return [_check("cuda peer access", OK, "one GPU: nothing to check", matrix=m)]
    no = [(i, j) for i in range(n) for j in range(n) if not m[i][j]]
    if no:
        return [
            _check(
                "cuda peer access",
                WRONG,
                "no peer access between GPU pairs %s" % no,
                "check `nvidia-smi topo -p2p r`; in VMs enable GPU P2P (PCI ACS off, IOMMU passthrough)",
                matrix=m,
            )
        ]
    return [_check("cuda peer access", OK, "every pair of the %d GPUs can access each other" % n, matrix=m)]


def check_transport():
    from ..runtime.receiver import transport_choice
    from .. import _wxfer

    avail = _wxfer.backends()
    out = []
    for mem in ("cuda", "cpu"):
        order = ("cuda_ipc", "verbs", "fabric") if mem == "cuda" else ("fabric",)
        why = "; ".join("%s: %s" % (n, "usable" if avail[n][0] else avail[n][1]) for n in order)
        try:
            name, opts = transport_choice("auto", mem)
            det = "%s memory -> %s%s (order %s; %s)" % (
                mem,
                name,
                " provider %s" % opts["provider"] if "provider" in opts else "",
                ", ".join(order),
                why,
            )
            out.append(_check("transport for %s" % mem, OK, det, transport=name, options=opts))
        except Exception as e:  # SetupError names every backend and why
            out.append(
                _check(
                    "transport for %s" % mem,
                    MISSING,
                    str(e),
                    "make one backend usable (see the library checks above) or set WXFER_TRANSPORT",
                    transport=None,
                )
            )
    return out


def _local_iface(addr):
    for _, name in socket.if_nameindex():
        try:
            from ..runtime.control import iface_address

            if iface_address(name) == addr:
                return name
        except Exception:
            continue
    return None


def check_store():
    from ..runtime import control

    store = envs.get("WXFER_STORE") or "%s:%s" % (
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        envs.get("WXFER_STORE_PORT", control.DEFAULT_PORT),
    )
    try:
        host, port = control.parse_addr(store)
        bind = control.bind_address(host)
        ip = socket.getaddrinfo(host.strip("[]"), port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a route lookup; nothing is sent
            s.connect((ip, port))
            local = s.getsockname()[0]
    except Exception as e:
        return [
            _check(
                "store",
                WRONG,
                "store %s: %s" % (store, e),
                "set WXFER_STORE=host:port (or MASTER_ADDR) to an address every process can reach",
            )
        ]
    iface = _local_iface(local)
    det = "store %s:%d (%s); reached from %s via %s; hosted store listens on %s" % (
        host,
        port,
        ip,
        local,
        iface or "?",
        bind or "every interface",
    )
    return [_check("store", OK, det, host=host, port=port, ip=ip, local=local, iface=iface, bind=bind)]


def check_environment():
    """The WXFER_* variables set here (wxfer/envs.py; the C code's from its table), and any
    WXFER_* name wxfer does not read (a typo reads as unset)."""
    now = envs.values()
    unknown = sorted(n for n in os.environ if n.startswith("WXFER_") and n not in envs.VARS)
    det = ", ".join("%s=%s" % kv for kv in sorted(now.items())) or "no WXFER_* variable set"
    if unknown:
        det += "; not read by wxfer (tests/benchmarks only, or a typo): %s" % ", ".join(unknown)
    return [_check("environment", OK, det, set=now, unknown=unknown)]


def run() -> list:
    from .. import _wxfer
    from ..runtime.nvrtc import nvrtc_dirs

    lib = _wxfer.libraries(nvrtc_dirs())
    ports = rdma_ports()
    checks = check_libraries(lib)
    checks += check_rdma(ports, lib["libibverbs"])
    checks += check_efa(ports, lib["libfabric"])
    checks += check_gpu_reg(lib["libcuda"], ports)
    checks += check_memlock(ports)
    checks += check_topology(lib["libcuda"], ports)
    checks += check_peer(lib["libcuda"])
    checks += check_transport()
    checks += check_store()
    checks += check_environment()
    return checks


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m wxfer doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    a = ap.parse_args(argv)
    checks = run()
    if a.json:
        print(json.dumps({"checks": checks}, indent=1, default=str))
        return 0
    for c in checks:
        print("[%-7s] %s: %s" % (c["status"], c["name"], c["detail"]))
        if c["fix"]:
            print("%10s fix: %s" % ("", c["fix"]))
    return 0
