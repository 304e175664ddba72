"""``python -m wxfer selftest --transport verbs``: the ibverbs RDMA WRITE self-test.

Like ``ib_write_bw`` but through wxfer's own engine and verbs transport: a target process
registers a buffer (host memory, or GPU memory with ``--gpu``), a writer posts one-sided
RDMA WRITEs into it, then the target checks every byte. Two local processes by default;
``--connect HOST[:PORT]`` writes to a target started on HOST with ``serve_verbs_selftest``
(``--serve [PORT]`` once the CLI passes it through).

``--emulated`` builds and loads the libibverbs EMULATION from a source checkout
(csrc/testing/libwxemu_verbs.so via WXFER_LIBIBVERBS): the real backend code runs, against
an emulated HCA. That proves the code path, not the hardware; the result says
``"emulated": true``. See docs/verbs.md.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import platform
import re
import subprocess
import time

from .. import envs
from .selftest import verified
from ..testing import connect_helper, expect, pattern, serve, spawn_helper, stop_process

_TIMEOUT = 60.0
_PORT = 18515
_AUTH_ENV = "WXFER_SELFTEST_KEY"


def emulation_library() -> str:
    """Build (if needed) and return the path of the libibverbs emulation. Only a source
    checkout has it: it is a test tool and never shipped."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "csrc", "testing", "build.sh")
    if not os.path.exists(script):
        raise RuntimeError(
            "--emulated needs a source checkout of wxfer (csrc/testing/build.sh "
            "is not next to this package); the emulation is never shipped"
        )
    out = subprocess.run(["sh", script], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _alloc(size: int, gpu: int, fill=None):
    """A uint8 buffer on the host (numpy) or on CUDA device `gpu` (torch)."""
    import numpy as np

    if gpu < 0:
        return np.zeros(size, dtype=np.uint8) if fill is None else fill.copy()
    import torch

    if fill is None:
        return torch.zeros(size, dtype=torch.uint8, device="cuda:%d" % gpu)
    return torch.from_numpy(fill).to("cuda:%d" % gpu)


def _to_numpy(buf):
    return buf if not hasattr(buf, "cpu") else buf.cpu().numpy()


def _target_loop(conn, opts: dict, size: int, gpu: int) -> None:
    from wxfer import _wxfer

    try:
        o = dict(opts)
        if gpu >= 0:
            o["gpu"] = str(gpu)
        t = _wxfer.Transport("verbs", o)
        buf = _alloc(size, gpu)
        region = t.register(buf)
        conn.send(("ready", t.export(), region.descriptor, t.info()))
    except Exception as e:
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return
    serve(conn, t, {"verify": lambda seed: verified(_to_numpy(buf), pattern(size, seed))}, _TIMEOUT)
    region.close()
    t.close()


def _spawned_target(conn, opts, size, gpu, env):
    os.environ.update(env)
    _target_loop(conn, opts, size, gpu)


def _expect(conn, what: str):
    return expect(conn, what, "verbs selftest", _TIMEOUT)


def registration_of(info: str) -> str:
    m = re.search(r"registration=(\w+)", info or "")
    return m.group(1) if m else "unknown"


def _writer(conn, opts: dict, size: int, iters: int, chunk: int, gpu: int, log) -> dict:
    from wxfer import _wxfer

    _, blob, desc, target_info = _expect(conn, "ready")
    o = dict(opts)
    if gpu >= 0:
        o["gpu"] = str(gpu)
    t = _wxfer.Transport("verbs", o)
    connect_helper(t, conn, blob, "verbs selftest")
    eng = _wxfer.Engine(t, chunk=chunk, timeout=_TIMEOUT)
    times, seed = [], 0
    # Register every source once, outside the timed loop (never register per step).
    srcs = []
    for i in range(iters):
        buf = _alloc(size, gpu, pattern(size, 1000 + i))
        srcs.append((1000 + i, buf, t.register(buf, export=False)))
    if gpu >= 0:
        import torch

        torch.cuda.synchronize(gpu)
    for i, (seed, _, region) in enumerate(srcs):
        t0 = time.perf_counter()
        eng.submit(region, [(desc, 0, 0, size)], tag=i)
        eng.wait(timeout=_TIMEOUT)
        times.append(time.perf_counter() - t0)
    conn.send(("verify", seed))
    _, ok, first_bad, nbad = _expect(conn, "verified")
    info = t.info()
    best = min(times)
    res = {
        "transport": "verbs",
        "bytes": size,
        "verified": bool(ok),
        "gbps": size / best / 1e9,
        "registration": registration_of(info),
        "target_registration": registration_of(target_info),
        "emulated": "EMULATED" in info,
        "best_s": best,
        "mean_s": sum(times) / len(times),
        "iters": iters,
        "first_mismatch": first_bad,
        "mismatches": nbad,
        "writer_info": info,
        "target_info": target_info,
        "machine": "%s, %s, %d CPUs, Python %s"
        % (platform.node(), platform.machine(), os.cpu_count() or 0, platform.python_version()),
    }
    log(
        "wxfer selftest: verbs%s, %d bytes x %d, best %.3f ms, %.2f GB/s, registration=%s, "
        "verified=%s"
        % (" (EMULATED)" if res["emulated"] else "", size, iters, best * 1e3, res["gbps"], res["registration"], ok)
    )
    if not ok:
        log("  %d bytes differ, first at offset %d" % (nbad, first_bad))
    for _, _, region in srcs:
        region.close()
    eng.close()
    t.close()
    return res


def _authkey() -> bytes:
    return envs.get(_AUTH_ENV, "wxfer-selftest").encode()


def serve_verbs_selftest(args, port: int = _PORT, log=print) -> dict:
    """The target side for ``--connect``: accept one writer on ``port`` and serve it."""
    opts = _opts(args)
    with mpc.Listener(("0.0.0.0", port), authkey=_authkey()) as ls:
        log("wxfer selftest: verbs target waiting on port %d" % port)
        conn = ls.accept()
        _, size, gpu = conn.recv()
        _target_loop(conn, opts, size, gpu)
    return {"transport": "verbs", "served": True, "bytes": size, "verified": True, "gbps": 0.0, "registration": "n/a"}


def _opts(args) -> dict:
    opts = {}
    if getattr(args, "device", None):
        opts["device"] = args.device
    if getattr(args, "emulated", False):
        os.environ["WXFER_LIBIBVERBS"] = emulation_library()
    return opts


def run_verbs_selftest(args, log=print) -> dict:
    """Entry point called by ``python -m wxfer selftest --transport verbs``. ``args`` has
    device, gpu (bool), emulated, connect, size, iters, chunk (as the CLI parses them).
    Returns at least transport, bytes, verified, gbps, registration; on failure verified is
    False and ``error`` says why (no traceback for the expected failures: no device,
    registration refused, a write failing with its completion status)."""
    try:
        return _run(args, log)
    except (OSError, RuntimeError, TimeoutError, ValueError, subprocess.CalledProcessError) as e:
        msg = "%s: %s" % (type(e).__name__, e)
        log("wxfer selftest: verbs FAILED: %s" % msg)
        return {"transport": "verbs", "bytes": 0, "verified": False, "gbps": 0.0, "registration": "none", "error": msg}


def _run(args, log) -> dict:
    from wxfer import _wxfer

    opts = _opts(args)
    size = _wxfer.parse_size(str(getattr(args, "size", "64MiB")))
    chunk = _wxfer.parse_size(str(getattr(args, "chunk", "0")))
    iters = int(getattr(args, "iters", 5))
    gpu = 0 if getattr(args, "gpu", False) else -1
    if getattr(args, "serve", None) is not None:
        return serve_verbs_selftest(args, int(args.serve or _PORT), log)
    if getattr(args, "connect", None):
        host, _, port = args.connect.partition(":")
        deadline = time.monotonic() + 30.0  # the target may still be starting
        while True:
            try:
                conn = mpc.Client((host, int(port or _PORT)), authkey=_authkey())
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        conn.send(("hello", size, gpu))
        try:
            return _writer(conn, opts, size, iters, chunk, gpu, log)
        finally:
            try:
                conn.send(("exit",))
            except OSError:
                pass
    tgpu = gpu
    if gpu >= 0:
        import torch

        tgpu = 1 if torch.cuda.device_count() > 1 else 0
    env = {k: v for k, v in os.environ.items() if k.startswith(("WXFER_", "WXEMU_"))}
    parent, proc = spawn_helper(_spawned_target, opts, size, tgpu, env)
    try:
        return _writer(parent, opts, size, iters, chunk, gpu, log)
    finally:
        stop_process(parent, proc)
