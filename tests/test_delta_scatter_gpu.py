"""The delta writer's scatter on cuda_ipc (issue 36, item 2; wxfer.runtime.delta_scatter) on ONE
GPU: the trainer (this process) and the receivers (spawned processes, as in test_direct_gpu.py)
share GPU 0, cuda_ipc opens the receivers' allocations here (cuIpcOpenMemHandle) and
``Sender(delta={"scatter": "force"})`` makes every push after the first store the changed bytes
straight into them with the scatter kernel (the receivers have no staging area and run
nothing).  Every push leaves each receiver a dense push's bytes (the mapping's reference
packing), BF16 and FP8; the scatter path was taken (stats); a dropped receiver is not written;
the end stamps wait for a late scatter kernel (its external task), without a host synchronize.
The CPU side of the same logic: tests/test_delta_scatter.py."""

import pytest

torch = pytest.importorskip("torch")
from wxfer.models import TINY  # noqa: E402
from wxfer.models.infer import preset_for  # noqa: E402
from test_direct_gpu import NGPU, T, _check_bytes, _model, _Receivers, _timed_push  # noqa: E402 -- tests/test_direct_gpu.py
from helpers import externals_before_the_end_stamp, hold_up_first_call  # noqa: E402 -- tests/helpers.py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]
FORCE = {"scatter": "force"}


def _touch(model, rate: float, seed: int) -> None:
    """About `rate` of every parameter's elements moved by a few percent (on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            m = torch.rand(p.shape, generator=g, device=p.device) < rate
            p[m] = p[m] * 1.07 + 0.01


def _sender(model, addr, name, delta=FORCE):
    from wxfer.runtime.sender import Sender

    s = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, delta=delta)
    assert s.transport_name == "cuda_ipc"
    return s


@pytest.mark.parametrize("quant", [None, "fp8"], ids=["bf16", "fp8"])
def test_forced_scatter_pushes_leave_a_dense_push_s_bytes_every_step(store, quant):
    _, addr = store
    model = _model(TINY)
    name = f"dscat_{quant}"
    rx = _Receivers(addr, name, TINY, quant)
    try:
        s = _sender(model, addr, name)
        st = s.stats()["delta"]
        assert st["encoder"] == "kernels", st  # the delta kernels (the scatter among them) load
        assert st["costs"]["scatter_Bps"] > 0 and "why_not" not in st["scatter"], st
        for step in range(1, 5):
            if step > 1:
                _touch(model, 0.01, step)
            s.push()
            got, version = rx.read(0)
            assert version == step
            _check_bytes(model, TINY, quant, got)  # the reference packing: a dense push's bytes
            last = s.stats()["delta"]["last"]
            if step == 1:
                assert last["tasks_scatter"] == 0 and last["dense_why"].get("first", 0) > 0, last
            else:
                # every task scattered (none bypassed, none sent as records: no staging area)
                assert last["tasks_scatter"] > 0 and last["tasks_dense"] == last["tasks_delta"] == 0, last
                assert last["tasks_bypassed"] == 0 and last["scatter_skipped"] == 0, last
                assert 0 < last["scatter_bytes"] < 0.5 * last["delta_bytes"], last
        if quant == "fp8":
            assert last["fused_tasks"] > 0, last  # the FP8 tasks quantized and compared in the shadow
        tot = s.stats()["delta"]["scatter"]["total"]
        assert tot["tasks"] >= 3 * last["tasks_scatter"] and tot["bytes"] > 0, tot
        s.close()
    finally:
        rx.close()


def test_a_dropped_receiver_is_not_scattered_into(store):
    """Two replicas on the GPU, the scatter "auto" with the link pinned at 1 Gb/s (so the chooser
    takes it by cost: the receivers have no staging area, and the colocated bypass needs a
    measured link); after two pushes the trainer gives up on the second (as when its writes
    failed): the next push scatters into the first only; the second keeps the bytes of the push
    before."""
    from wxfer.runtime.peerstate import Event

    _, addr = store
    quant = "fp8"
    model = _model(TINY)
    name = "dscat_drop"
    rx = _Receivers(addr, name, TINY, quant, replicas=2)
    try:
        s = _sender(model, addr, name, dict(scatter="auto", link_Bps=1e9 / 8, measure_link=False))
        for step in (1, 2):
            if step > 1:
                _touch(model, 0.01, step)
            s.push()
        last = s.stats()["delta"]["last"]
        assert last["tasks_scatter"] > 0 and last["tasks_dense"] == 0, last  # chosen by cost
        _check_bytes(model, TINY, quant, rx.read(0)[0])
        kept, v1 = rx.read(1)
        _check_bytes(model, TINY, quant, kept)
        assert v1 == 2
        s.links.states.apply(1, Event.WRITE_FAILED, "a test's failed write")  # as StepLoop._take_failed
        assert s.links.drop({1}) == {1}
        _touch(model, 0.01, 3)
        try:
            s.push()
        except RuntimeError:
            pass  # a push may name the worker it skips; the bytes are what is checked
        last = s.stats()["delta"]["last"]
        assert last["tasks_scatter"] > 0 and last["scatter_skipped"] > 0, last
        got0, _ = rx.read(0)
        _check_bytes(model, TINY, quant, got0)
        got1, _ = rx.read(1)
        assert got1 == kept, "the dropped receiver was written"
        s.close()
    finally:
        rx.close()


def test_the_end_stamps_wait_for_a_late_scatter_kernel(store, monkeypatch):
    """The side stream held up (torch.cuda._sleep, about 0.3 s) just before the first scatter
    launch of a push: push() returns only after the scatter landed (the engine waited for the
    external tasks' CUDA events, no stream synchronize), the end stamps were posted after them,
    and the bytes are the reference's."""

    from wxfer.runtime import delta_gpu

    _, addr = store
    quant = "fp8"
    model = _model(TINY)
    name = "dscat_slow"
    rx = _Receivers(addr, name, TINY, quant)
    try:
        s = _sender(model, addr, name)
        s.push()
        _touch(model, 0.01, 2)
        s.push()  # warm: the scatter ran once
        s.engine.trace(clear=True)
        slept = hold_up_first_call(monkeypatch, delta_gpu, "scatter")  # (on the current: the side stream)
        _touch(model, 0.01, 3)
        t0, took, got, version = _timed_push(s, rx)
        assert slept and version == 3
        _check_bytes(model, TINY, quant, got)
        ext = externals_before_the_end_stamp(s.engine)
        assert max(r["t_done"] for r in ext) - t0 > 0.1e9, took  # the events waited for the sleep
        assert took > 0.1, took
        s.close()
    finally:
        rx.close()


@pytest.mark.parametrize("rate", [0.001, 0.03, 0.5, 1.0])
def test_the_scatter_kernel_rows_are_bit_exact(rate):
    """benchmarks/bench_delta.py --parts scatter's kernel row on 16 MiB: the scatter kernel leaves
    the destination equal to the new bytes (the old ones where nothing changed), and times it."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench_delta import bench_scatter_kernel

    r = bench_scatter_kernel(torch.device("cuda"), 16 << 20, rate, 3)
    assert r["bitexact"] and r["changed"] == r["expected_changed"] > 0, r
    assert r["scatter_s"] > 0 and r["dense_copy_s"] > 0, r
    print(r)
