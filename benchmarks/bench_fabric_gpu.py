#!/usr/bin/env python3
"""GPU -> GPU one-sided writes between two processes on one GPU (cuda:0 -> cuda:0), in one run:

  bound           dst.copy_(src) on cuda:0 inside one process (the device's own copy rate)
  cuda_ipc        wxfer's cuda_ipc transport through the Engine
  fabric:<prov>   wxfer's fabric transport, GPU memory registered with FI_HMEM_CUDA, for every
                  provider of the installed libfabric that offers FI_HMEM (the probe,
                  wxfer.tools.gpuprobe); "not measured" with the reason where it cannot run
  verbs-emulated  wxfer's verbs transport on the libibverbs EMULATION, GPU memory registered by
                  dma-buf; the emulated HCA moves the bytes with CUDA IPC copies, so this is
                  the emulation's rate, NOT a NIC's (needs csrc/testing/build.sh to build)

Each line: `iters` writes of `size` bytes submitted, then waited for; wall clock from the first
submit to the last completion; the target's bytes checked after the run. Each line runs in a
process of its own. Needs torch with CUDA.

  python3 benchmarks/bench_fabric_gpu.py [--size 256MiB] [--iters 8] [--json]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _measure(kind: str, size: int, iters: int, dev: str = "cuda:0") -> dict:
    import torch

    def sync():
        if dev != "cpu":
            torch.cuda.synchronize()

    if kind == "bound":
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        return {"kind": kind, "gbps": size * iters / dt / 1e9, "verified": bool(torch.equal(dst, src))}

    from wxfer import _wxfer
    from wxfer.testing import TargetProcess

    if kind == "cuda_ipc":
        name, opts = "cuda_ipc", {}
    elif kind.startswith("fabric:"):
        prov, dom = kind[7:].rsplit("@", 1)
        name, opts = "fabric", {"provider": prov, "iface": dom, "hmem": "on"}
    elif kind == "verbs-emulated":
        name, opts = "verbs", {"gpu": "0", "gpu_memory": "yes" if dev != "cpu" else "no"}
    else:
        raise SystemExit("unknown line %r" % kind)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    sync()
    with TargetProcess(name, opts, [size], device=dev) as tp:
        t = _wxfer.Transport(name, opts)
        try:
            tp.connect(t)
            r = t.register(src, export=False)
            eng = _wxfer.Engine(t, timeout=45.0)
            d = tp.descriptors[0]
            eng.submit(r, [(d, 0, 0, size)], tag=0)  # warm-up: connections, mappings
            eng.wait(timeout=45.0)
            tp.fill(0, 0)
            t0 = time.perf_counter()
            for i in range(iters):
                eng.submit(r, [(d, 0, 0, size)], tag=i + 1)
            eng.wait(timeout=45.0)
            dt = time.perf_counter() - t0
            ok = tp.read(0) == src.cpu().numpy().tobytes()
            info = t.info()
            eng.close()
            r.close()
        finally:
            t.close()
    return {"kind": kind, "gbps": size * iters / dt / 1e9, "verified": ok, "writer": info, "target": tp.info}


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _lines() -> tuple:
    from wxfer import _wxfer
    from wxfer.tools import gpuprobe

    lines = ["bound"]
    if _wxfer.backends().get("cuda_ipc", (False,))[0] and torch_cuda():
        lines.append("cuda_ipc")
    probe = gpuprobe.fabric_probe()
    lines += ["fabric:%s@%s" % pd for pd in gpuprobe.fabric_hmem_providers(probe)] if probe.get("loaded") else []
    lines.append("verbs-emulated")
    return lines, gpuprobe.fabric_finding(probe) if probe.get("loaded") else "libfabric not loaded"


def _run_line(kind: str, size: int, iters: int, dev: str) -> dict:
    env = dict(os.environ)
    if kind == "verbs-emulated":
        b = subprocess.run(["sh", os.path.join(ROOT, "csrc", "testing", "build.sh")], capture_output=True, text=True)
        if b.returncode:
            return {"kind": kind, "gbps": None, "why": "emulation not built: " + b.stderr.strip()}
        env["WXFER_LIBIBVERBS"] = b.stdout.strip().splitlines()[-1]
    try:
        r = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--line",
                kind,
                "--size",
                str(size),
                "--iters",
                str(iters),
                "--device",
                dev,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=75,
        )
    except subprocess.TimeoutExpired:
        return {"kind": kind, "gbps": None, "why": "did not finish within 75 s"}
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode or not last.startswith("{"):
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"kind": kind, "gbps": None, "why": tail[-400:]}
    return json.loads(last)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--line", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)  # cpu: a smoke test of the wiring
    a = ap.parse_args()
    from wxfer import _wxfer

    size = int(a.size) if a.size.isdigit() else _wxfer.parse_size(a.size)
    if a.line:
        print(json.dumps(_measure(a.line, size, a.iters, a.device)))
        return 0
    import torch

    if a.device != "cpu" and not torch.cuda.is_available():
        print("bench_fabric_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    lines, finding = _lines()
    print(
        "machine: %s, %s, torch %s, %s; %s"
        % (
            platform.node(),
            torch.cuda.get_device_name(0) if a.device != "cpu" else "CPU ONLY (smoke test)",
            torch.__version__,
            platform.release(),
            finding,
        )
    )
    res = [_run_line(k, size, a.iters, a.device) for k in lines]
    bound = res[0]["gbps"] if res and res[0]["kind"] == "bound" else None
    print("%-28s %10s %9s  %s" % ("GPU->GPU, %d MiB x %d" % (size >> 20, a.iters), "GB/s", "of bound", "note"))
    for x in res:
        if x.get("gbps") is None:
            print("%-28s %10s %9s  not measured: %s" % (x["kind"], "-", "-", x.get("why")))
            continue
        note = "bytes checked" if x.get("verified") else "BYTES DIFFER"
        if x["kind"] == "verbs-emulated":
            note += "; EMULATION (CUDA IPC copies), not a NIC"
        print(
            "%-28s %10.1f %8.0f%%  %s"
            % (x["kind"], x["gbps"], 100 * x["gbps"] / bound if bound else float("nan"), note)
        )
    if a.json:
        print(json.dumps({"size": size, "iters": a.iters, "finding": finding, "lines": res}))
    return 0 if all(x.get("verified", True) for x in res if x.get("gbps") is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
