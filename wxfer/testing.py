"""A write target in another process, for tests, notebooks and the self-test.

``TargetProcess(transport, options, sizes)`` starts a process (spawn) that registers one
zeroed buffer per size with the transport, exports them, and then only answers requests
from this process: the connection handshake, and reading its buffers back to check what
landed. It runs no code per write.

The tools' helper processes (``python -m wxfer selftest``, its verbs form, ``calibrate``) speak
one pipe protocol, written here once: the child sends ("ready", ...) once set up, or
("error", text); then it answers each request (op, *args) -- ("accept", request) with
("reply", its transport's answer), the others with its own handlers -- until ("exit",).
``spawn_helper``, ``expect`` and ``connect_helper`` are the parent's side, ``serve`` the child's.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp

TIMEOUT = 60.0


# Receiver's placement keywords for a job's only inference worker (replica 0 of 1, rank 0, tp 1)
ONE_WORKER = dict(replica=0, rank=0, tp=1, replicas=1)


def pattern(size: int, seed: int):
    """`size` reproducible random bytes (a numpy uint8 array) for write checks."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def build_env() -> dict:
    """The environment for the C compiler run by tests: without the sanitizer runtime that
    `make asan-test` preloads (the compiler is not what is under test)."""
    import os

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def in_thread(fn, *a, **kw):
    """Run fn(*a, **kw) in a daemon thread; returns (thread, box) where box gets "value" or
    "error" (the exception) once it finished. For tests that drive two sides in one process."""
    import threading

    box = {}

    def run():
        try:
            box["value"] = fn(*a, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def joined(threads, timeout: float = 30.0) -> list:
    """The values of in_thread's [(thread, box)], each joined; a thread's error is raised here."""
    out = []
    for th, box in threads:
        th.join(timeout)
        if "error" in box:
            raise box["error"]
        if "value" not in box:
            raise TimeoutError(f"wxfer.testing.joined: a thread did not finish in {timeout} s")
        out.append(box["value"])
    return out


def stop_process(conn, proc) -> None:
    """Ask a helper process to exit over its pipe, then make sure it is gone (bounded)."""
    try:
        conn.send(("exit",))
    except OSError:
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def spawn_helper(target, *args):
    """(the parent's pipe end, the started process) of target(the child's end, *args), spawned."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return parent, proc


def expect(conn, what: str, who: str, timeout: float = TIMEOUT):
    """The helper's next message, which must be `what`: its ("error", text) is raised as a
    RuntimeError, silence past `timeout` seconds as a TimeoutError; `who` names the tool."""
    if not conn.poll(timeout):
        raise TimeoutError("%s: the helper process did not answer %r within %.0f s" % (who, what, timeout))
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("%s: the helper process failed: %s" % (who, msg[1]))
    if msg[0] != what:
        raise RuntimeError("%s: expected %r from the helper process, got %r" % (who, what, msg[0]))
    return msg


def connect_helper(t, conn, export_blob: bytes, who: str) -> int:
    """Connect transport ``t`` to the helper process that exported ``export_blob``, the
    handshake over its pipe; the peer id."""
    peer, req = t.connect_request(export_blob)
    if req:
        conn.send(("accept", req))
        rep = expect(conn, "reply", who)[1]
    else:
        rep = b""
    t.connect_finish(peer, rep)
    return peer


def serve(conn, t, handlers: dict, timeout: float = TIMEOUT) -> None:
    """The helper's loop once it sent ("ready", ...): ("accept", request) is answered with
    ("reply", t.accept(request)), each other (op, *args) with handlers[op](*args), a failure
    with ("error", text), until ("exit",) or `timeout` seconds without a request."""
    while conn.poll(timeout):
        op, *args = conn.recv()
        if op == "exit":
            break
        try:
            conn.send(("reply", t.accept(args[0])) if op == "accept" else handlers[op](*args))
        except Exception as e:  # noqa: BLE001 -- reported to the parent
            conn.send(("error", "%s: %s" % (type(e).__name__, e)))


def _serve(conn, transport, options, sizes, device="cpu"):
    import numpy as np
    from wxfer import _wxfer

    try:
        if device == "cpu":
            bufs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        else:  # GPU memory (torch), allocated (and the device current) before the transport opens
            import torch

            torch.cuda.set_device(device)
            bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
            torch.cuda.synchronize(device)
        t = _wxfer.Transport(transport, options)
        regions = [t.register(b) for b in bufs]
        conn.send(("ready", t.export(), [r.descriptor for r in regions], t.info()))
    except Exception as e:
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return
    while conn.poll(TIMEOUT):
        msg = conn.recv()
        op = msg[0]
        if op == "accept":
            conn.send(("ok", t.accept(msg[1])))
        elif op == "read":
            b = bufs[msg[1]]
            conn.send(("ok", b.tobytes() if device == "cpu" else b.cpu().numpy().tobytes()))
        elif op == "fill":
            bufs[msg[1]][:] = msg[2]
            if device != "cpu":
                torch.cuda.synchronize(device)
            conn.send(("ok", None))
        elif op == "exit":
            break
    for r in regions:
        r.close()
    t.close()
    conn.send(("bye", None))


class TargetProcess:
    """A process that registers zeroed buffers of `sizes` on `device` ("cpu", or "cuda:N":
    torch GPU memory) with a transport and serves accept / read / fill over a pipe."""

    def __init__(self, transport: str, options: dict | None, sizes, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, transport, dict(options or {}), list(sizes), device), daemon=True
        )
        self.proc.start()
        msg = self._recv()
        self.export, self.descriptors, self.info = msg[1], msg[2], msg[3]

    def _recv(self, timeout=TIMEOUT):
        if not self._conn.poll(timeout):
            raise TimeoutError("target process did not answer within %.0f s" % timeout)
        msg = self._conn.recv()
        if msg[0] == "error":
            raise RuntimeError("target process failed: %s" % msg[1])
        return msg

    def call(self, *msg):
        self._conn.send(msg)
        return self._recv()[1]

    def accept(self, req: bytes) -> bytes:
        return self.call("accept", req)

    def read(self, i: int = 0) -> bytes:
        return self.call("read", i)

    def fill(self, i: int, value: int) -> None:
        self.call("fill", i, value)

    def connect(self, t) -> int:
        """Connect transport ``t`` (in this process) to the target."""
        peer, req = t.connect_request(self.export)
        t.connect_finish(peer, self.accept(req) if req else b"")
        return peer

    def kill(self) -> None:
        import glob
        import os

        self.proc.kill()
        self.proc.join(10)
        for f in glob.glob("/dev/shm/%d:*" % self.proc.pid):  # what a killed shm endpoint leaves
            try:
                os.unlink(f)
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("exit",))
                self._recv(15)
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def connected_fabric(provider: str, sizes):
    """(writer Transport, TargetProcess with buffers of `sizes`), connected over libfabric
    `provider`; both closed on exit."""
    from . import _wxfer

    opts = {"provider": provider}
    with TargetProcess("fabric", opts, sizes) as tgt:
        t = _wxfer.Transport("fabric", opts)
        try:
            tgt.connect(t)
            yield t, tgt
        finally:
            t.close()
