"""cuda_ipc transport: one-sided writes between processes of one node, through CUDA IPC.

Every test here needs a GPU (marker `gpu`; the cross-GPU case `gpu2`) and skips cleanly
without one. The receiving process is a separate process (multiprocessing, spawn) that
registers its memory, sends its export blob, and then runs nothing until the writer asks it
to read its memory back for the byte comparison.
"""

import multiprocessing as mp
import os
import re
import struct

import pytest

torch = pytest.importorskip("torch")
from wxfer import _wxfer  # noqa: E402


from helpers import gpu_count  # noqa: E402 -- tests/helpers.py

NGPU = gpu_count()
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
needs_gpu2 = pytest.mark.skipif(NGPU < 2, reason="needs two CUDA GPUs")
HAS_FP8 = hasattr(torch, "float8_e4m3fn")
TIMEOUT = 120

# Tensors the receiver packs into ONE allocation (many tensors in one cudaMalloc), plus one
# tensor in an allocation of its own. (name, dtype name, shape)
ARENA = [
    ("q_proj.weight", "bfloat16", (1024, 1024)),
    ("experts.w13", "float8_e4m3fn", (2048, 2048)),
    ("experts.w13.scale", "float32", (16, 16)),
    ("embed", "bfloat16", (4096, 4096)),  # 32 MiB: several engine chunks
]
SEPARATE = ("lm_head", "float8_e4m3fn", (4096, 2048))  # 8 MiB, its own allocation


def _dtype(name):
    if name == "float8_e4m3fn" and not HAS_FP8:
        return torch.uint8
    return getattr(torch, name)


def _nbytes(dt, shape):
    n = torch.empty((), dtype=_dtype(dt)).element_size()
    for s in shape:
        n *= s
    return n


def _receiver(conn, device, env):
    """Target process: register, export, then idle until asked to read back or exit."""
    os.environ.update(env)
    import torch
    from wxfer import _wxfer

    try:
        torch.cuda.set_device(device)
        t = _wxfer.Transport("cuda_ipc", {})
        sizes = [(n, (_nbytes(dt, shp) + 255) // 256 * 256) for n, dt, shp in ARENA]
        arena = torch.zeros(sum(s for _, s in sizes), dtype=torch.uint8, device=device)
        views, regions, off = {}, {}, 0
        for (name, dt, shp), (_, padded) in zip(ARENA, sizes):
            nb = _nbytes(dt, shp)
            views[name] = arena[off : off + nb].view(_dtype(dt)).view(shp)
            off += padded
        name, dt, shp = SEPARATE
        views[name] = torch.zeros(shp, dtype=_dtype(dt), device=device)
        for name, v in views.items():
            regions[name] = t.register(v, export=True)
        conn.send(
            ("ok", t.export(), {n: r.descriptor for n, r in regions.items()}, {n: r.nbytes for n, r in regions.items()})
        )
    except Exception as e:  # reported to the test, which asserts on it
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return
    while True:
        if not conn.poll(TIMEOUT):
            return
        msg = conn.recv()
        if msg[0] == "read":
            torch.cuda.synchronize(device)
            conn.send({n: v.view(torch.uint8).cpu().numpy().tobytes() for n, v in views.items()})
        else:
            t.close()
            conn.send("bye")
            return


class Receiver:
    def __init__(self, device, env=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(child, device, env or {}), daemon=True)
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})  # the child starts with it (and sets it again itself)
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        assert self.conn.poll(TIMEOUT), "receiver did not start"
        msg = self.conn.recv()
        self.status = msg[0]
        if msg[0] == "ok":
            _, self.blob, self.desc, self.nbytes = msg
        else:
            self.error = msg[1]

    def read(self):
        self.conn.send(("read",))
        assert self.conn.poll(TIMEOUT), "receiver did not answer"
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                self.conn.poll(TIMEOUT) and self.conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        self.proc.join(TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _writer_transport(device):
    ok, why = _wxfer.backends().get("cuda_ipc", (False, "not compiled into this build"))
    assert ok, "a GPU is present but the cuda_ipc backend is unavailable: %s" % why
    torch.cuda.set_device(device)
    return _wxfer.Transport("cuda_ipc", {"device": str(device)})


def _connect(t, blob):
    peer, req = t.connect_request(blob)
    assert req == b"", "cuda_ipc needs no handshake"
    t.connect_finish(peer, b"")
    return peer


def _payload(dt, shape, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * 3
    if dt == "float8_e4m3fn" and HAS_FP8:
        x = x.to(torch.float8_e4m3fn)
    elif dt == "float8_e4m3fn":
        x = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    else:
        x = x.to(_dtype(dt))
    return x.to(device) if device is not None else x


def _as_bytes(x):
    return x.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _roundtrip(wdev, rdev):
    rx = Receiver(rdev)
    try:
        assert rx.status == "ok", rx.error
        t = _writer_transport(wdev)
        _connect(t, rx.blob)
        # Opened at connect time, once per allocation: the arena's four regions share one.
        assert re.search(r"maps=2\b", t.info()), t.info()
        expect = {n: bytes(rx.nbytes[n]) for n in rx.nbytes}
        srcs = {}
        for i, (name, dt, shp) in enumerate(ARENA + [SEPARATE]):
            dev = None if name == "experts.w13.scale" else "cuda:%d" % wdev  # one host source
            srcs[name] = _payload(dt, shp, dev, seed=i + 1)
        regs = {n: t.register(x, export=False) for n, x in srcs.items()}

        # 1) blocking writes: BF16 tensor, and a host (CPU) float32 source -> H2D
        for name in ("q_proj.weight", "experts.w13.scale"):
            t.write(regs[name], 0, rx.desc[name], 0, rx.nbytes[name], timeout=30)
            expect[name] = _as_bytes(srcs[name])
        # 2) the engine, in 1 MiB chunks: FP8 and a 32 MiB BF16 tensor, one task each
        eng = _wxfer.Engine(t, chunk=1 << 20, depth=16, timeout=60)
        for name in ("experts.w13", "embed"):
            eng.submit(regs[name], [(rx.desc[name], 0, 0, rx.nbytes[name])])
            expect[name] = _as_bytes(srcs[name])
        # 3) partial write with offsets on both sides (FP8, separate allocation)
        name = "lm_head"
        loff, roff, n = 1 << 20, (5 << 20) + 4096, 2 << 20
        eng.submit(regs[name], [(rx.desc[name], roff, loff, n)])
        e = bytearray(rx.nbytes[name])
        e[roff : roff + n] = _as_bytes(srcs[name])[loff : loff + n]
        expect[name] = bytes(e)
        eng.wait(timeout=60)
        eng.close()

        got = rx.read()
        for name in expect:
            assert len(got[name]) == len(expect[name]), name
            assert got[name] == expect[name], "bytes differ in %s" % name
        # a write past the region's end is refused before it reaches the backend
        with pytest.raises(_wxfer.Error):
            t.write(regs["lm_head"], 0, rx.desc["lm_head"], rx.nbytes["lm_head"] - 16, 4096)
        assert re.search(r"maps=2\b", t.info()), t.info()
        t.close()
    finally:
        rx.stop()


@pytest.mark.gpu
@needs_gpu
def test_same_gpu_bf16_fp8_many_tensors_one_allocation():
    _roundtrip(0, 0)


@pytest.mark.gpu
@pytest.mark.gpu2
@needs_gpu2
def test_across_gpus_bf16_fp8():
    _roundtrip(0, 1)


@pytest.mark.gpu
@pytest.mark.gpu2
@needs_gpu2
def test_across_gpus_reverse_direction():
    _roundtrip(1, 0)


@pytest.mark.gpu
@needs_gpu
def test_loopback_same_process():
    t_rx = _writer_transport(0)
    dst = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda:0")
    r = t_rx.register(dst, export=True)
    t = _writer_transport(0)
    _connect(t, t_rx.export())
    src = _payload("bfloat16", (1 << 20,), "cuda:0", seed=7)
    t.write(t.register(src, export=False), 0, r.descriptor, 0, r.nbytes)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    t.close()
    t_rx.close()


@pytest.mark.gpu
@needs_gpu
def test_stale_handle_owner_exited():
    rx = Receiver(0)
    assert rx.status == "ok", rx.error
    pid = rx.proc.pid
    rx.stop()  # the owner exits: its allocations and their IPC handles die with it
    t = _writer_transport(0)
    with pytest.raises(_wxfer.Error) as ei:
        _connect(t, rx.blob)
    msg = str(ei.value)
    assert "cuIpcOpenMemHandle" in msg and ("pid %d" % pid) in msg, msg
    assert "no longer exists" in msg and "stale" in msg, msg
    t.close()


@pytest.mark.gpu
@needs_gpu
def test_foreign_blob_from_another_boot():
    rx = Receiver(0)
    try:
        assert rx.status == "ok", rx.error
        blob = bytearray(rx.blob)
        assert blob[:3] == b"WXE"
        (alen,) = struct.unpack_from("<I", blob, 8)
        assert alen == 48 and blob[12:16] == b"WXCA"
        blob[12 + 16] ^= 0xFF  # one byte of the boot id in the address
        t = _writer_transport(0)
        with pytest.raises(_wxfer.Error) as ei:
            _connect(t, bytes(blob))
        assert "another machine or boot" in str(ei.value), str(ei.value)
        # the genuine blob still connects and writes
        _connect(t, rx.blob)
        name = "q_proj.weight"
        src = _payload("bfloat16", (1024, 1024), "cuda:0", seed=3)
        t.write(t.register(src, export=False), 0, rx.desc[name], 0, rx.nbytes[name])
        assert rx.read()[name] == _as_bytes(src)
        t.close()
    finally:
        rx.stop()


@pytest.mark.gpu
@needs_gpu
def test_expandable_segments_refused_with_advice():
    rx = Receiver(0, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        assert rx.status == "error", "registering expandable_segments memory should fail"
        assert "expandable_segments" in rx.error and "PYTORCH_CUDA_ALLOC_CONF" in rx.error, rx.error
    finally:
        rx.stop()


def test_cuda_ipc_options_are_checked():
    ok, why = _wxfer.backends().get("cuda_ipc", (False, "not compiled into this build"))
    if not ok:
        pytest.skip("cuda_ipc unavailable here: %s" % why)
    with pytest.raises(_wxfer.Error, match="unknown option"):
        _wxfer.Transport("cuda_ipc", {"bogus": "1"})
    with pytest.raises(_wxfer.Error, match="streams"):
        _wxfer.Transport("cuda_ipc", {"streams": "99"})


@pytest.mark.gpu
@needs_gpu
def test_fence_waits_for_the_copies_still_queued_to_a_peer():
    """Issue 17: cuda_ipc fences a peer by waiting (bounded) for the copies to it still on the
    writer's streams (CUDA cannot cancel a queued copy): once fence() says fenced, nothing
    of them changes the target's memory any more. 16 GiB of copies (512 writes of 16
    different sources into one 32 MiB region), fenced once every write is posted, the
    region read twice 0.5 s apart."""
    import time

    rx = Receiver(0)
    try:
        assert rx.status == "ok", rx.error
        torch.cuda.set_device(0)
        t = _wxfer.Transport("cuda_ipc", {"device": "0", "max_inflight": "1024"})
        peer = _connect(t, rx.blob)
        n, k = rx.nbytes["embed"], 512
        srcs = [torch.full((n,), i + 1, dtype=torch.uint8, device="cuda:0") for i in range(16)]
        regs = [t.register(x, export=False) for x in srcs]
        eng = _wxfer.Engine(t, chunk=n, depth=1024, timeout=60)
        for i in range(k):
            eng.submit(regs[i % 16], [(rx.desc["embed"], 0, 0, n)])
        deadline = time.monotonic() + 30
        while True:  # every write posted (in flight or done): nothing more will be
            st = eng.stats()
            if st["inflight"] * n + st["bytes_written"] >= k * n:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.0005)
        time.sleep(0.002)  # (inflight counts the last write just before its post call returns)
        fenced, how = t.fence(peer, timeout=30.0)
        print(how)
        assert fenced, how
        assert how.startswith("cuda_ipc: waited") and "all completed" in how, how
        first = rx.read()["embed"]
        time.sleep(0.5)
        assert rx.read()["embed"] == first, "a copy landed after the fence"
        assert len(first) == n and 1 <= min(first) and max(first) <= 16
        eng.wait(timeout=60)
        assert eng.stats()["bytes_written"] == k * n
        eng.close()
        t.close()
    finally:
        rx.stop()
