"""Issue 28, item 2: the verbs backend's GPU path against the libibverbs EMULATION.

The backend registers CUDA memory as it would with a real NIC: a dma-buf fd from the real
CUDA driver (cuMemGetHandleForAddressRange, the range aligned to the host page size) given to
ibv_reg_dmabuf_mr, or ibv_reg_mr on the device pointer (nvidia-peermem) as the fallback. The
emulation checks what a real provider checks (the fd is a dma-buf, offset and length inside
it, the page offsets of offset and iova, the access flags) and its HCA moves the bytes with
CUDA copies (csrc/testing/wxemu_verbs_cuda.c); what it cannot check is listed in
docs/verbs.md. The checks that need no GPU run everywhere (CI); the writes carry `gpu`.

Every emulated run happens in a child process (see test_verbs.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import needs_verbs_emulation  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

pytestmark = needs_verbs_emulation()


def _child(emu_lib, code, timeout=90, **env):
    e = dict(os.environ, WXFER_LIBIBVERBS=emu_lib, WXEMU_VERBS_RETRY_CAP_MS="1000")
    for k in ("WXFER_TEST_GPUREG", "WXFER_IB_DEVICES", "WXEMU_VERBS_PEERMEM", "WXEMU_VERBS_DMABUF"):
        e.pop(k, None)
    e.update({k: str(v) for k, v in env.items()})
    r = subprocess.run(
        [PY, "-c", textwrap.dedent(code)], env=e, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, "child failed:\n%s\n%s" % (r.stdout, r.stderr)
    return r.stdout


def _code(*parts):
    return "\n".join(textwrap.dedent(p) for p in parts)


# The emulation's own entry points, called directly (ctypes), as a provider library is.
VERBS = """
import ctypes, errno, os
lib = ctypes.CDLL(os.environ["WXFER_LIBIBVERBS"], use_errno=True)
lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
lib.ibv_open_device.restype = ctypes.c_void_p
lib.ibv_open_device.argtypes = [ctypes.c_void_p]
lib.ibv_alloc_pd.restype = ctypes.c_void_p
lib.ibv_alloc_pd.argtypes = [ctypes.c_void_p]
lib.ibv_reg_dmabuf_mr.restype = ctypes.c_void_p
u64, i32 = ctypes.c_uint64, ctypes.c_int
lib.ibv_reg_dmabuf_mr.argtypes = [ctypes.c_void_p, u64, ctypes.c_size_t, u64, i32, i32]
lib.ibv_dereg_mr.argtypes = [ctypes.c_void_p]
lib.ibv_dealloc_pd.argtypes = [ctypes.c_void_p]
lib.ibv_close_device.argtypes = [ctypes.c_void_p]
lib.ibv_free_device_list.argtypes = [ctypes.c_void_p]
devs = lib.ibv_get_device_list(None)
ctx = lib.ibv_open_device(devs[0])
lib.ibv_free_device_list(devs)
pd = lib.ibv_alloc_pd(ctx)
LW, RW = 1, 2
def reg(off, n, iova, fd, acc=LW | RW):
    ctypes.set_errno(0)
    mr = lib.ibv_reg_dmabuf_mr(pd, off, n, iova, fd, acc)
    return mr, ctypes.get_errno()
def refused(off, n, iova, fd, acc=LW | RW):
    mr, e = reg(off, n, iova, fd, acc)
    assert not mr, "registered"
    return errno.errorcode.get(e, e)
"""


def test_emulated_dmabuf_mr_checks_that_need_no_gpu(emu_lib):
    """What the kernel checks before it looks at the memory: access flags, offset and iova
    in the same place of a page, a valid fd that is a dma-buf. And WXEMU_VERBS_DMABUF=0 is a
    device without dma-buf MRs (EOPNOTSUPP)."""
    out = _child(
        emu_lib,
        _code(
            VERBS,
            """
        fd = os.memfd_create("not-a-dmabuf")
        os.ftruncate(fd, 1 << 20)
        print("access", refused(0, 4096, 0x10000, fd, RW))       # REMOTE_WRITE without LOCAL_WRITE
        print("pageoff", refused(0, 4096, 0x10010, fd))          # offset 0, iova 16 bytes into a page
        print("notdmabuf", refused(0, 4096, 0x10000, fd))        # a memfd is no dma-buf
        os.close(fd)
        print("badfd", refused(0, 4096, 0x10000, fd))
        print("zero", refused(0, 0, 0x10000, 0))
        lib.ibv_dealloc_pd(pd); lib.ibv_close_device(ctx)
        """,
        ),
    )
    got = dict(l.split() for l in out.strip().splitlines())
    assert got == {
        "access": "EINVAL",
        "pageoff": "EINVAL",
        "notdmabuf": "EINVAL",
        "badfd": "EBADF",
        "zero": "EINVAL",
    }, got
    out = _child(
        emu_lib,
        _code(VERBS, "print('off', refused(0, 4096, 0x10000, 0)); lib.ibv_dealloc_pd(pd); lib.ibv_close_device(ctx)"),
        WXEMU_VERBS_DMABUF="0",
    )
    assert out.split() in (["off", "EOPNOTSUPP"], ["off", "ENOTSUP"]), out  # one value on Linux


# ---- with a GPU -------------------------------------------------------------------------

DMABUF = """
import torch
cu = ctypes.CDLL("libcuda.so.1")
x = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")   # one allocator segment, 2 MiB aligned
torch.cuda.synchronize()
fd = ctypes.c_int(-1)
rc = cu.cuMemGetHandleForAddressRange(
    ctypes.byref(fd), ctypes.c_uint64(x.data_ptr()), ctypes.c_size_t(4 << 20), 1, ctypes.c_ulonglong(0)
)
assert rc == 0, "cuMemGetHandleForAddressRange: CUresult %d" % rc
print("link", os.readlink("/proc/self/fd/%d" % fd.value))
"""


@pytest.mark.gpu
def test_emulated_dmabuf_mr_checks_a_real_dmabuf(emu_lib):
    """A real dma-buf of GPU memory from the CUDA driver: registered whole, and refused past
    its end, or with an iova that is no GPU memory of this process (the emulation's own
    requirement: iova - offset is the address the dma-buf was exported from)."""
    out = _child(
        emu_lib,
        _code(
            VERBS,
            DMABUF,
            """
        base = x.data_ptr()
        print("end", refused(4096, 4 << 20, base + 4096, fd.value))          # past the dma-buf's end
        print("notgpu", refused(0, 4096, 16 * 4096, fd.value))               # iova not GPU memory here
        mr, e = reg(0, 4 << 20, base, fd.value)
        assert mr, "refused a good dma-buf: errno %d" % e
        os.close(fd.value)                                                # the MR keeps its own reference
        mr2, e = reg(1 << 20, 1 << 20, base + (1 << 20), os.open("/dev/null", os.O_RDONLY))
        print("devnull", "registered" if mr2 else errno.errorcode.get(e, e))
        assert lib.ibv_dereg_mr(mr) == 0
        lib.ibv_dealloc_pd(pd); lib.ibv_close_device(ctx)
        """,
        ),
    )
    print(out)
    got = dict(l.split(None, 1) for l in out.strip().splitlines())
    assert got["link"].startswith(("/dmabuf:", "anon_inode:dmabuf")), got
    assert got["end"] == "EINVAL" and got["notgpu"] == "EFAULT" and got["devnull"] == "EINVAL", got


PUSH = """
import time
import torch
from wxfer import _wxfer
from wxfer.testing import TargetProcess
N = 9 << 20
opts = {%(opts)s}
cases = [("cuda:0", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cuda:0")]
for src_dev, dst_dev in cases:
    with TargetProcess("verbs", dict(opts, gpu_memory="yes" if dst_dev != "cpu" else "no"), [N], device=dst_dev) as tp:
        t = _wxfer.Transport("verbs", dict(opts, gpu_memory="yes" if src_dev != "cpu" else "no"))
        tp.connect(t)
        g = torch.Generator().manual_seed(len(src_dev) * 7 + len(dst_dev))
        host = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)
        src = host.to(src_dev)
        torch.cuda.synchronize()
        r = t.register(src, export=False)
        eng = _wxfer.Engine(t, chunk=1 << 20, timeout=30.0)
        t0 = time.perf_counter()
        eng.submit(r, [(tp.descriptors[0], 0, 0, N - 4096), (tp.descriptors[0], N - 4096, N - 4096, 4096)], tag=1)
        eng.wait(timeout=30.0)
        dt = time.perf_counter() - t0
        got = torch.frombuffer(bytearray(tp.read(0)), dtype=torch.uint8)
        bad = (got != host).nonzero()[:5].tolist()
        assert torch.equal(got, host), "bytes differ %%s -> %%s at %%s" %% (src_dev, dst_dev, bad)
        print("PUSH %%s -> %%s %%d bytes ok %%.3f s writer: %%s | target: %%s"
              %% (src_dev, dst_dev, N, dt, t.info(), tp.info))
        eng.close(); r.close(); t.close()
print("OK")
"""


def _dmabuf_supported() -> bool:
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuInit(0)
        dev, attr = ctypes.c_int(), ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), 0)
        return cu.cuDeviceGetAttribute(ctypes.byref(attr), 124, dev) == 0 and attr.value == 1
    except OSError:
        return False


@pytest.mark.gpu
def test_push_gpu_memory_through_verbs_dmabuf_on_the_emulation(emu_lib):
    """GPU -> GPU, GPU -> host, host -> GPU between two processes through the verbs backend,
    its GPU memory registered by dma-buf (the real driver's fd), bytes checked."""
    if not _dmabuf_supported():
        pytest.skip("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on this GPU (proprietary kernel module?)")
    out = _child(emu_lib, PUSH % {"opts": '"gpu": "0", "reg": "dmabuf"'})
    print(out)
    assert out.strip().endswith("OK")
    lines = [l for l in out.splitlines() if l.startswith("PUSH")]
    assert len(lines) == 3
    for l in lines:
        w, tgt = l.split(" writer: ")[1].split(" | target: ")
        src_gpu, dst_gpu = l.split()[1] != "cpu", l.split()[3] != "cpu"
        assert ("registration=dmabuf" in w) == src_gpu and ("registration=dmabuf" in tgt) == dst_gpu, l
        if dst_gpu:
            assert "gpu_route=dmabuf" in tgt, tgt


@pytest.mark.gpu
def test_push_gpu_memory_through_verbs_peermem_on_the_emulation(emu_lib):
    """The fallback: ibv_reg_mr on the device pointer, with the emulation's "nvidia-peermem"
    loaded (WXEMU_VERBS_PEERMEM=1) and dma-buf excluded (reg=peermem)."""
    out = _child(emu_lib, PUSH % {"opts": '"gpu": "0", "reg": "peermem"'}, WXEMU_VERBS_PEERMEM="1")
    print(out)
    assert out.strip().endswith("OK")
    for l in (l for l in out.splitlines() if l.startswith("PUSH")):
        if l.split()[3] != "cpu":
            assert "registration=peermem" in l.split(" | target: ")[1] and "gpu_route=peermem" in l, l


@pytest.mark.gpu
def test_gpu_memory_where_neither_route_works_fails_at_setup_naming_both(emu_lib):
    """The emulation without dma-buf MRs (WXEMU_VERBS_DMABUF=0) and without nvidia-peermem:
    with gpu_memory=yes the open already fails when the facts say so; registering anyway
    (gpu_memory=no) fails naming why each path failed."""
    out = _child(
        emu_lib,
        """
        import torch
        from wxfer import _wxfer
        x = torch.zeros(1 << 21, dtype=torch.uint8, device="cuda:0")
        t = _wxfer.Transport("verbs", {"gpu": "0"})
        try:
            t.register(x)
            raise AssertionError("registered GPU memory with neither route")
        except _wxfer.Error as e:
            m = str(e)
            assert ("dma-buf: ibv_reg_dmabuf_mr" in m and "Operation not supported" in m) or (
                "DMA_BUF_SUPPORTED is 0" in m
            ), m
            assert "nvidia-peermem not loaded" in m and "fix: modprobe nvidia-peermem" in m, m
            print(m)
        t.close()
        print("OK")
        """,
        WXEMU_VERBS_DMABUF="0",
    )
    assert "OK" in out


# ---- Sender -> Receiver over verbs (one process, the emulation) -------------------------

SENDER_RECEIVER = """
import torch
from datetime import timedelta
import torch.distributed as dist
from wxfer.runtime import control
from wxfer.models import TINY, train_model, inference_params, preset_for
from wxfer.runtime.receiver import Receiver
from wxfer.runtime.sender import Sender
import sys
sys.path.insert(0, "tests")  # run from the checkout: tests/helpers.py
from helpers import joined, expected_shards
from wxfer.testing import in_thread
dev = %(dev)r
port = control.free_port()
store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
addr = "127.0.0.1:%%d" %% port
params = {n: t.to(dev) for n, t in inference_params(TINY, 1, 0).items()}  # NaN-filled: unwritten bytes show
th = in_thread(Receiver, params, store=addr, replica=0, rank=0, tp=1, replicas=1, name="vg", timeout=60,
               mapping=preset_for(TINY).name, transport="verbs")
with torch.device(dev):
    model = train_model(TINY)
for p in model.parameters():
    p.requires_grad_(False)
sender = Sender(model, mapping=preset_for(TINY), store=addr, name="vg", timeout=60, transport="verbs", device=dev)
[rx] = joined([th], 60)
for step in (1, 2):
    if step == 2:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
    sender.push()
    assert rx.version() == step, rx.version()
    n = 0
    for rank, dst, off, b in expected_shards(model, TINY, 1, None):
        got = params[dst].view(-1).view(torch.uint8)[off : off + b.numel()].cpu()
        assert torch.equal(got, b.cpu()), "%%s differs at %%d (step %%d)" %% (dst, off, step)
        n += b.numel()
    print("STEP", step, "bytes checked", n)
print("RECEIVER", rx.stats()["registration"])
print("SENDER", sender.transport.info())
sender.close()
rx.close()
print("OK")
"""


def _sender_receiver(emu_lib, dev):
    out = _child(emu_lib, SENDER_RECEIVER % {"dev": dev}, timeout=120)
    print(out)
    assert out.strip().endswith("OK") and "STEP 2 bytes checked" in out, out
    return out


def test_sender_receiver_push_over_verbs_on_the_emulation_host_memory(emu_lib):
    """The whole Sender.push() -> Receiver path over verbs (host memory; CI)."""
    out = _sender_receiver(emu_lib, "cpu")
    assert "RECEIVER registration=host" in out and "gpu_route" not in out, out


@pytest.mark.gpu
def test_sender_receiver_push_gpu_to_gpu_over_verbs_dmabuf_on_the_emulation(emu_lib):
    """The whole Sender.push() -> Receiver path over verbs with GPU memory on both ends: the
    Receiver and Sender open with gpu_memory=yes, the route decided at open is in
    Receiver.stats()["registration"], every byte of two steps checked."""
    if not _dmabuf_supported():
        pytest.skip("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on this GPU (proprietary kernel module?)")
    out = _sender_receiver(emu_lib, "cuda:0")
    rec = [l for l in out.splitlines() if l.startswith("RECEIVER")][0]
    assert "registration=dmabuf" in rec and "gpu_route=dmabuf" in rec, rec
    assert "gpu_route=dmabuf" in [l for l in out.splitlines() if l.startswith("SENDER")][0], out
