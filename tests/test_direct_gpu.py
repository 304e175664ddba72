"""Stage 2 straight into the receivers' memory (wxfer.runtime.inplace) on one GPU: trainer (this
process) and receivers (spawned processes) share GPU 0, as colocated RL does; cuda_ipc maps
the receivers' weights here.  With direct on and off, BF16 and FP8, dense and a tiny MoE
(fused 3-D experts), every inference byte equals the mapping's reference packing; the direct
push holds nothing under the watermark where the staging one holds its buffers; a receiver
that failed earlier in the push is not written.  Transport.map itself: the address of a
region range, validated; memory on another GPU refused."""

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
from wxfer import _wxfer  # noqa: E402
from wxfer.models import TINY, TINY_MOE, train_model  # noqa: E402
from wxfer.models.infer import inference_params, preset_for  # noqa: E402
from helpers import expected_shards  # noqa: E402 -- tests/helpers.py
from test_watermark_gpu import CONFIG as WATERMARK_MODEL  # noqa: E402 -- tests/test_watermark_gpu.py
from test_direct import _check_trace  # noqa: E402 -- tests/test_direct.py

T = 120.0
MiB = 1 << 20
CONFIGS = {"dense": TINY, "moe": TINY_MOE}
# the watermark test's model: 8 layers of ~97 MB packed (float32 weights cast to BF16)
BIG = WATERMARK_MODEL


from helpers import gpu_count  # noqa: E402 -- tests/helpers.py

NGPU = gpu_count()
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")


def _bytes(params) -> dict:
    torch.cuda.synchronize()
    return {n: t.detach().view(-1).view(torch.uint8).cpu().numpy().tobytes() for n, t in params.items()}


def _receiver(addr, name, cfg, quant, replica, replicas, q_in, q_out, read):
    from wxfer.runtime.receiver import Receiver

    r = None
    try:
        torch.cuda.set_device(0)
        params = inference_params(cfg, 1, 0, quant, device="cuda:0")
        q_out.put(("before", _bytes(params) if read else None))
        r = Receiver(
            params,
            mapping=preset_for(cfg).name,
            store=addr,
            replica=replica,
            rank=0,
            tp=1,
            replicas=replicas,
            name=name,
            timeout=T,
        )
        while True:
            msg = q_in.get(timeout=T)
            if msg == "read":
                q_out.put(("after", _bytes(params) if read else None, r.version()))
            else:
                break
        r.close()
        q_out.put(("bye",))
    except BaseException as e:  # noqa: BLE001
        q_out.put(("error", repr(e)))
        if r is not None:
            r.close()


class _Receivers:
    """`replicas` receiver processes on GPU 0 for one Sender name."""

    def __init__(self, addr, name, cfg, quant, replicas=1, read=True):
        ctx = mp.get_context("spawn")
        self.q = [(ctx.Queue(), ctx.Queue()) for _ in range(replicas)]
        self.procs = [
            ctx.Process(target=_receiver, args=(addr, name, cfg, quant, k, replicas, qi, qo, read), daemon=True)
            for k, (qi, qo) in enumerate(self.q)
        ]
        for p in self.procs:
            p.start()
        self.before = [self._get(k, "before")[1] for k in range(replicas)]

    def _get(self, k, what):
        msg = self.q[k][1].get(timeout=T)
        assert msg[0] == what, msg
        return msg

    def read(self, k):
        """(bytes of each parameter of receiver k, its version)."""
        self.q[k][0].put("read")
        _, data, version = self._get(k, "after")
        return data, version

    def close(self):
        for k, (qi, _) in enumerate(self.q):
            if self.procs[k].is_alive():
                qi.put("exit")
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _model(cfg):
    torch.cuda.set_device(0)
    with torch.device("cuda", 0):
        model = train_model(cfg)  # float32: every task casts to BF16 or quantizes, so it is packed
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _check_bytes(model, cfg, quant, got):
    """Every byte of every inference parameter is the reference packing's."""
    seen = {n: 0 for n in got}
    for _, dst, off, ref in expected_shards(model, cfg, 1, quant):
        b = ref.cpu().numpy().tobytes()
        assert got[dst][off : off + len(b)] == b, f"{dst} bytes [{off}, {off + len(b)}) differ"
        seen[dst] += len(b)
    assert seen == {n: len(b) for n, b in got.items()}


def _packed(s) -> int:
    return sum(1 for g in s.program.groups for op in g if op.sends and not op.prep.zero_copy and op.prep.direct is None)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("quant", [None, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_push_gives_the_reference_bytes(store, kind, quant, direct):
    from wxfer.runtime.sender import Sender

    _, addr = store
    cfg = CONFIGS[kind]
    model = _model(cfg)
    name = f"d_{kind}_{quant}_{int(direct)}"
    rx = _Receivers(addr, name, cfg, quant)
    try:
        s = Sender(model, mapping=preset_for(cfg), store=addr, name=name, timeout=T, direct=direct)
        n = _packed(s)
        assert n > 0 and s.transport_name == "cuda_ipc"
        for step in (1, 2):
            if step == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-0.75)  # new weights: the second push must write them all again
            s.engine.trace(clear=True)
            s.push()
            got, version = rx.read(0)
            assert version == step
            _check_bytes(model, cfg, quant, got)
            d = s.stats()["direct"]
            if direct:
                assert d["enabled"] and d["tasks"] == n and d["staged"] == 0 and d["total"] == n * step, d
                # every in-place write an external engine task (its CUDA event), between the stamps
                _check_trace(s, {op.task for g in s.program.groups for op in g if op.sends})
                assert s.engine.stats()["bytes_external"] == step * s.bytes_per_step
            else:
                assert not d["enabled"] and d["tasks"] == 0 and d["total"] == 0, d
                assert d["staged"] == n and "off" in d["why_not"], d
        if quant == "fp8":
            q = s.stats()["quantizer"]
            assert q["quantizer"] == "native", q  # the H200: the NVRTC kernel, not the reference
        s.close()
    finally:
        rx.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("quant", [None, "fp8"], ids=["bf16", "fp8"])
def test_the_end_stamps_wait_for_slow_inplace_kernels_without_a_host_synchronize(store, monkeypatch, quant):
    """The side stream held up (torch.cuda._sleep, about 0.3 s, queued at the first task's
    gathers): the in-place kernels run late; push() returns only after they landed (the
    engine waited for their CUDA events: no stream synchronize), the end stamps were posted
    after them, the bytes are the reference's and the version is the step's."""
    import time

    from wxfer.runtime import prepare
    from wxfer.runtime.sender import Sender
    from wxfer.runtime.tasks import STAMP_TAG

    _, addr = store
    cfg = TINY
    model = _model(cfg)
    name = f"dslow_{quant}"
    rx = _Receivers(addr, name, cfg, quant)
    try:
        s = Sender(model, mapping=preset_for(cfg), store=addr, name=name, timeout=T, direct=True)
        s.push()  # warm-up (kernels compiled, regions mapped)
        s.engine.trace(clear=True)
        real, slept = prepare.gather, []

        def slow(prep, op, device):
            if not slept:
                slept.append(1)
                torch.cuda._sleep(int(0.3 * 2e9))  # ~0.3 s at up to 2 GHz, on the side stream
            return real(prep, op, device)

        monkeypatch.setattr(prepare, "gather", slow)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: pytest.fail("a stream synchronize"))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5)
        t0 = time.monotonic_ns()
        s.push()
        took = (time.monotonic_ns() - t0) / 1e9
        got, version = rx.read(0)
        assert slept and version == 2
        _check_bytes(model, cfg, quant, got)
        recs = s.engine.trace()
        ext = [r for r in recs if r["kind"] == "external"]
        end = max((r for r in recs if r["tag"] == STAMP_TAG), key=lambda r: r["id"])
        assert ext and all(r["status"] == 0 for r in ext)
        first_ready = min(r["t_ready"] for r in ext)
        assert first_ready - t0 > 0.1e9, (first_ready - t0, took)  # the events waited for the sleep
        assert all(r["t_done"] <= end["t_post_first"] for r in ext)
        assert took > 0.1, took
        s.close()
    finally:
        rx.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("quant", [None, "fp8"], ids=["bf16", "fp8"])
def test_direct_push_holds_nothing_under_the_watermark(store, quant):
    """Peak extra GPU memory of a push (max_memory_allocated during it minus what was
    allocated before): staged, at least one packed buffer (and within watermark + the largest
    task); direct, no packed buffer at all."""
    from wxfer.runtime.sender import Sender

    _, addr = store
    model = _model(BIG)
    wm = 256 * MiB
    peaks = {}
    for direct in (False, True):
        name = f"dwm_{quant}_{int(direct)}"
        rx = _Receivers(addr, name, BIG, quant, read=False)
        try:
            s = Sender(model, mapping=preset_for(BIG), store=addr, name=name, watermark=wm, timeout=T, direct=direct)
            largest = max(op.prep.held for g in s.program.groups for op in g if op.sends)
            s.push()  # warm-up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            s.push()
            torch.cuda.synchronize()
            peaks[direct] = (torch.cuda.max_memory_allocated() - base, largest)
            assert rx.read(0)[1] == 2
            assert s.stats()["direct"]["tasks"] == (_packed(s) if direct else 0)
            s.close()
        finally:
            rx.close()
    print("peak extra memory (bytes, largest task) staged / direct:", peaks[False], peaks[True])
    (staged, largest), (dpeak, _) = peaks[False], peaks[True]
    assert largest > 32 * MiB
    assert largest // 2 <= staged <= wm + largest + MiB, peaks
    assert dpeak < 8 * MiB, peaks


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _wxfer.TESTING, reason="needs a test build (WXFER_TESTING=1) for _test_refuse_peer")
@pytest.mark.parametrize(
    "direct,wait", [(True, "host"), (True, "stream"), (False, "stream")], ids=["direct-host", "direct-stream", "staged"]
)
def test_a_receiver_that_failed_is_not_written(store, monkeypatch, direct, wait):
    """Two replicas on the GPU; every write to the second (peer 1) is refused (TEST-ONLY
    cuda_ipc option), so it fails at its begin stamp's deadline: the push raises naming it
    within its bound, the first replica holds the reference bytes.  The staged push and the
    direct one with the host wait (WXFER_BEGIN_WAIT=host): the second keeps its bytes from
    before the push (neither the direct kernels nor the engine wrote it).  The direct push in
    stream order (the default): its kernels launched without waiting, after the begin stamps
    written on the same stream, so the second replica reads torn (version -1), never the old
    step over new bytes; and the training stream is not held up (it finishes its work at once
    after the failed push)."""
    import time

    from wxfer.runtime.sender import Sender

    monkeypatch.setenv("WXFER_BEGIN_WAIT", wait)
    _, addr = store
    cfg, quant = TINY, "fp8"
    model = _model(cfg)
    name = f"dfail_{int(direct)}_{wait}"
    rx = _Receivers(addr, name, cfg, quant, replicas=2)
    try:
        s = Sender(
            model,
            mapping=preset_for(cfg),
            store=addr,
            name=name,
            timeout=T,
            write_timeout=2.0,
            transport_options={"_test_refuse_peer": 1},
            direct=direct,
        )
        assert s.peers == {0: 0, 1: 1}
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="failed") as e:
            s.push()
        assert time.monotonic() - t0 < 30 and "gpu 1" in str(e.value), e.value
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())  # the training stream, after the failed push
        end = time.monotonic() + 10
        while not ev.query() and time.monotonic() < end:
            time.sleep(0.001)
        assert ev.query(), "the training stream is held up after the failed push"
        d = s.stats()["direct"]
        got0, v0 = rx.read(0)
        got1, v1 = rx.read(1)
        _check_bytes(model, cfg, quant, got0)
        assert v0 == 1
        if direct and wait == "stream":
            # written or not (the launches do not wait to see its failure: its refused stamp fails
            # at the write deadline, 2 s, long after them), it never reads a step complete
            assert d["tasks"] == _packed(s) > 0 and d["begin"] == "stream", d
            assert v1 == -1, v1
            print("the refused receiver was", "written (torn)" if got1 != rx.before[1] else "not written")
        else:
            if direct:
                assert d["tasks"] == _packed(s) > 0 and d["skipped_writes"] > 0, d
            assert got1 == rx.before[1], "the failed receiver was written"
        s.close()
    finally:
        rx.close()


# ---------------------------------------------------------------------------- Transport.map


def _transport(device):
    ok, why = _wxfer.backends().get("cuda_ipc", (False, "not compiled into this build"))
    assert ok, "a GPU is present but the cuda_ipc backend is unavailable: %s" % why
    return _wxfer.Transport("cuda_ipc", {"device": str(device)})


def _connect(t, blob):
    peer, req = t.connect_request(blob)
    t.connect_finish(peer, b"")
    return peer


@pytest.mark.gpu
@needs_gpu
def test_map_gives_the_address_of_a_region_range_and_checks_it():
    from wxfer.runtime.inplace import _Mapped, region_nbytes

    torch.cuda.set_device(0)
    t_rx = _transport(0)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    r = t_rx.register(dst[4096:], export=True)
    t = _transport(0)
    try:
        _connect(t, t_rx.export())
        assert region_nbytes(r.descriptor) == r.nbytes == (1 << 20) - 4096
        addr, dev = t.map(r.descriptor, 100, 1000)
        assert (addr, dev) == (dst.data_ptr() + 4096 + 100, 0)
        with pytest.raises(_wxfer.Error, match="outside"):
            t.map(r.descriptor, r.nbytes - 10, 11)
        base, _ = t.map(r.descriptor, 0, r.nbytes)
        view = torch.as_tensor(_Mapped(base, r.nbytes))
        assert view.device == torch.device("cuda", 0) and view.data_ptr() == base
        view[100:1100].fill_(7)
        torch.cuda.synchronize()
        assert int(dst[4196:5196].min()) == int(dst[4196:5196].max()) == 7 and int(dst.sum()) == 7000
    finally:
        t.close()
        t_rx.close()


@pytest.mark.gpu
@pytest.mark.gpu2
@pytest.mark.skipif(NGPU < 2, reason="needs two CUDA GPUs")
def test_map_refuses_memory_on_another_gpu_than_the_writers():
    t_rx = _transport(1)
    dst = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:1")
    r = t_rx.register(dst, export=True)
    torch.cuda.set_device(0)
    t = _transport(0)
    try:
        _connect(t, t_rx.export())
        with pytest.raises(_wxfer.Error, match="writer GPU cuda:0") as e:
            t.map(r.descriptor, 0, 16)
        assert "peer 0" in str(e.value) and "key 0x" in str(e.value)
    finally:
        t.close()
        t_rx.close()
