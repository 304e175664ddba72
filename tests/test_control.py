"""Control plane: bounded store access, error broadcast, the handshake through the store, and
the whole setup (metadata -> plan -> connections) in one process with threads."""

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torch.distributed")
import torch.distributed as dist  # noqa: E402

from wxfer.runtime import control  # noqa: E402
from wxfer.runtime.control import Control, SetupError  # noqa: E402

from wxfer import _wxfer  # noqa: E402

FABRIC = _wxfer.backends()["fabric"][0]
needs_fabric = pytest.mark.skipif(not FABRIC, reason="fabric transport not built: %s" % _wxfer.backends()["fabric"][1])


@pytest.fixture
def store():
    port = control.free_port()
    s = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    return _Store(s, "127.0.0.1:%d" % port)


class _Store:
    """The store and its address."""

    def __init__(self, s, addr):
        self.s, self.addr = s, addr

    def __getattr__(self, k):
        return getattr(self.s, k)


def test_get_is_bounded_and_names_what_it_waited_for(store):
    ctl = Control(store.s, "t", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        ctl.get("nobody/writes/this", "the answer of worker 7")
    assert time.monotonic() - t0 < 5
    assert "the answer of worker 7" in str(ei.value) and "wxfer/t/nobody/writes/this" in str(ei.value)
    ctl.set("k", b"v")
    assert ctl.get("k", "k") == b"v"
    ctl.set_json("j", {"a": [1, 2]})
    assert ctl.get_json("j", "j") == {"a": [1, 2]}


def test_wait_count_counts_and_times_out(store):
    ctl = Control(store.s, "c", timeout=0.3)
    ctl.add("n", 2)
    assert ctl.wait_count("n", 2, "two things") == 2
    with pytest.raises(TimeoutError, match="2 of 3 arrived"):
        ctl.wait_count("n", 3, "three things")


def test_namespaces_do_not_mix(store):
    a, b = Control(store.s, "a"), Control(store.s, "b")
    a.set("x", b"1")
    assert not b.check("x") and a.check("x")


def test_result_encoding_carries_errors():
    assert control.decode_result(control.encode_result(b"abc", None), "x") == b"abc"
    with pytest.raises(SetupError, match="on trainer rank 0: boom"):
        control.decode_result(control.encode_result(None, "boom"), "trainer rank 0")
    with pytest.raises(SetupError, match="malformed"):
        control.decode_result(b"??", "x")


def test_agree_without_a_group_raises_the_local_error():
    control.agree(None, None, 0, "x")
    with pytest.raises(SetupError, match="rank 3: bad"):
        control.agree(None, "bad", 3, "connecting")


def test_resolve_store_address_forms(store, monkeypatch):
    assert control.resolve_store(store.s) is store.s
    s = control.resolve_store(store.addr, False, 5)
    s.set("wxfer/probe", b"1")
    assert store.get("wxfer/probe") == b"1"
    monkeypatch.setenv("WXFER_STORE", store.addr)
    assert control.resolve_store(None, False, 5).get("wxfer/probe") == b"1"
    with pytest.raises(ValueError):
        control.parse_addr("nohostport")
    with pytest.raises(SetupError, match="cannot reach the TCPStore"):
        control.resolve_store("127.0.0.1:%d" % control.free_port(), False, 0.5)


@needs_fabric
def test_handshake_through_the_store_then_a_write(store):
    import numpy as np

    tgt = _wxfer.Transport("fabric", {"provider": "tcp"})
    wr = _wxfer.Transport("fabric", {"provider": "tcp"})
    buf = np.zeros(4096, np.uint8)
    reg = tgt.register(buf)
    ctl_t, ctl_w = (
        Control(control.resolve_store(store.addr), "hs", 10),
        Control(control.resolve_store(store.addr), "hs", 10),
    )
    th = threading.Thread(target=control.target_accept, args=(ctl_t, tgt, 5, 9))
    th.start()
    control.writer_connect(ctl_w, wr, 5, 9, tgt.export())
    th.join(10)
    src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    sreg = wr.register(src, export=False)
    wr.write(sreg, 0, reg.descriptor, 0, 4096, timeout=10)
    assert (buf == src).all()
    sreg.close()
    reg.close()
    wr.close()
    tgt.close()


@needs_fabric
def test_a_refused_handshake_reaches_the_writer(store):
    wr = _wxfer.Transport("fabric", {"provider": "tcp"})
    ctl = Control(store.s, "hs2", 5)
    ctl.set("hs/rep/0/1", control.encode_result(None, "accept: bad request"))
    with pytest.raises(SetupError, match="inference worker gpu 1 answering trainer rank 0: accept: bad request"):
        tgt = _wxfer.Transport("fabric", {"provider": "tcp"})
        try:
            control.writer_connect(ctl, wr, 0, 1, tgt.export())
        finally:
            tgt.close()
    wr.close()
