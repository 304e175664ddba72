"""``python -m wxfer selftest``: two local processes, one registers a buffer, the other
writes into it with one-sided writes through wxfer's own engine and transport, then the
target checks every byte. Prints GB/s; with ``--json`` one JSON object as the last line.

The target process runs no code per write: it registers, answers the connection
handshake, and after the writer says it is done, compares its buffer with the expected
pattern.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from ..testing import connect_helper, expect, pattern, serve, spawn_helper, stop_process

_TIMEOUT = 60.0  # seconds any wait on the other process may take


def _target_main(conn, transport: str, opts: dict, size: int) -> None:
    """The target: registers a zeroed buffer, then answers the handshake and ("verify", seed)
    (the helper protocol of wxfer.testing)."""
    import numpy as np
    from wxfer import _wxfer

    try:
        t = _wxfer.Transport(transport, opts)
        buf = np.zeros(size, dtype=np.uint8)
        region = t.register(buf)
        conn.send(("ready", t.export(), region.descriptor, t.info()))
    except Exception as e:  # report setup errors to the writer instead of dying silently
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return
    serve(conn, t, {"verify": lambda seed: verified(buf, pattern(size, seed))}, _TIMEOUT)
    region.close()
    t.close()


def verified(got, expected) -> tuple:
    """("verified", all equal, first differing offset or -1, how many differ)."""
    import numpy as np

    bad = np.flatnonzero(got != expected)
    return ("verified", bad.size == 0, int(bad[0]) if bad.size else -1, int(bad.size))


def run_selftest(
    transport: str = "fabric", opts: dict | None = None, size: int = 64 << 20, iters: int = 5, chunk: int = 0, log=print
) -> dict:
    """Run the two-process self-test and return the figures (see module doc)."""
    from wxfer import _wxfer

    opts = dict(opts or {})
    parent, proc = spawn_helper(_target_main, transport, opts, size)
    result = {
        "transport": transport,
        "provider": opts.get("provider", ""),
        "bytes": size,
        "verified": False,
        "gbps": 0.0,
    }
    try:
        _, blob, desc, target_info = expect(parent, "ready", "selftest", _TIMEOUT)
        t = _wxfer.Transport(transport, opts)
        connect_helper(t, parent, blob, "selftest")
        eng = _wxfer.Engine(t, chunk=chunk, timeout=_TIMEOUT)
        times = []
        seed = 0
        for i in range(iters):
            seed = 1000 + i
            src = pattern(size, seed)
            region = t.register(src, export=False)
            t0 = time.perf_counter()
            eng.submit(region, [(desc, 0, 0, size)], tag=i)
            eng.wait(timeout=_TIMEOUT)
            times.append(time.perf_counter() - t0)
            region.close()
        parent.send(("verify", seed))
        _, ok, first_bad, nbad = expect(parent, "verified", "selftest", _TIMEOUT)
        best = min(times)
        result.update(
            verified=bool(ok),
            gbps=size / best / 1e9,
            best_s=best,
            mean_s=sum(times) / len(times),
            iters=iters,
            first_mismatch=first_bad,
            mismatches=nbad,
            writer_info=t.info(),
            target_info=target_info,
            machine="%s, %s, %d CPUs, Python %s"
            % (platform.node(), platform.machine(), os.cpu_count() or 0, platform.python_version()),
        )
        log(
            "wxfer selftest: %s %s, %d bytes x %d, best %.3f ms, %.2f GB/s, verified=%s"
            % (transport, opts.get("provider", ""), size, iters, best * 1e3, result["gbps"], ok)
        )
        if not ok:
            log("  %d bytes differ, first at offset %d" % (nbad, first_bad))
        eng.close()
        t.close()
    finally:
        stop_process(parent, proc)
    return result


def backends_main(argv) -> int:
    import wxfer

    for name, b in wxfer.backends().items():
        print("%-9s %s" % (name, "available" if b["available"] else "unavailable: " + b["reason"]))
    return 0


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m wxfer selftest")
    ap.add_argument("--transport", default="fabric", choices=["fabric", "verbs", "cuda_ipc"])
    ap.add_argument("--provider", default="tcp", help="fabric provider: tcp, shm, efa")
    ap.add_argument("--iface", default=None, help="fabric network interface (tcp)")
    ap.add_argument("--size", default="64MiB", help="bytes per write, e.g. 4KiB, 64MiB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--chunk", default="0", help="largest single write (0: the transport's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--device", default=None, help="verbs: RDMA device[:port]")
    ap.add_argument("--gpu", action="store_true", help="verbs: use GPU memory")
    ap.add_argument("--emulated", action="store_true", help="verbs: use the test emulation")
    ap.add_argument("--connect", default=None, help="verbs: the other host (HOST[:PORT])")
    ap.add_argument(
        "--serve",
        nargs="?",
        const=18515,
        type=int,
        default=None,
        help="verbs: be the target for a --connect writer on this port",
    )
    args = ap.parse_args(argv)
    from wxfer import _wxfer

    size = _wxfer.parse_size(args.size)
    if args.transport == "verbs":
        from .selftest_verbs import run_verbs_selftest

        res = run_verbs_selftest(args)
    else:
        opts = {}
        if args.transport == "fabric":
            opts["provider"] = args.provider
            if args.iface:
                opts["iface"] = args.iface
        res = run_selftest(args.transport, opts, size=size, iters=args.iters, chunk=_wxfer.parse_size(args.chunk))
    if args.json:
        print(json.dumps(res))
    return 0 if res.get("verified") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
