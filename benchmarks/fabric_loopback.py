"""Loopback GB/s of the fabric backend (tcp;ofi_rxm and shm) for 1-64 MiB writes.

    python benchmarks/fabric_loopback.py [--providers tcp,shm] [--sizes 1,4,16,64] [--reps 10]

Two processes on this host: a target (wxfer.testing.TargetProcess) that registers one
64 MiB buffer and runs no code per write, and this process, which writes a registered
source into it through one wxfer Engine (split into the backend's chunks, up to its depth
in flight), timing submit -> wait for each write. The last write of every size is checked byte for byte. Prints one line
per (provider, size) and a JSON list last, with the machine description.
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from wxfer import _wxfer
    from wxfer.testing import TargetProcess

    ap = argparse.ArgumentParser()
    ap.add_argument("--providers", default="tcp,shm")
    ap.add_argument("--sizes", default="1,4,16,64", help="MiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", default=None, help="backend chunk option, e.g. 4MiB")
    args = ap.parse_args()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    cap = max(sizes)
    machine = "%s, %s, %d CPUs, %s" % (platform.node(), platform.machine(), os.cpu_count() or 0, platform.platform())
    rows = []
    src = np.random.default_rng(0).integers(0, 256, cap, dtype=np.uint8)
    for prov in args.providers.split(","):
        opts = {"provider": prov}
        if args.chunk:
            opts["chunk"] = args.chunk
        with TargetProcess("fabric", opts, [cap]) as tgt:
            t = _wxfer.Transport("fabric", opts)
            tgt.connect(t)
            rs = t.register(src, export=False)
            eng = _wxfer.Engine(t, timeout=60)
            eng.submit(rs, [(tgt.descriptors[0], 0, 0, cap)])  # warm-up
            eng.wait(timeout=60)
            for n in sizes:
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    eng.submit(rs, [(tgt.descriptors[0], 0, 0, n)])
                    eng.wait(timeout=60)
                    times.append(time.perf_counter() - t0)
                ok = tgt.read(0)[:n] == src[:n].tobytes()
                row = {
                    "provider": prov,
                    "bytes": n,
                    "best_gbps": n / min(times) / 1e9,
                    "median_gbps": n / float(np.median(times)) / 1e9,
                    "reps": args.reps,
                    "verified": ok,
                    "info": t.info(),
                }
                rows.append(row)
                print(
                    "%-4s %3d MiB: median %5.2f GB/s, best %5.2f GB/s, verified=%s"
                    % (prov, n >> 20, row["median_gbps"], row["best_gbps"], ok),
                    flush=True,
                )
            eng.close()
            rs.close()
            t.close()
    print(json.dumps({"machine": machine, "results": rows}))


if __name__ == "__main__":
    main()
