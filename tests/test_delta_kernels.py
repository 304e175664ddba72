"""The delta kernels' tables and algorithm on CPU (issue 36; the kernels themselves run in
tests/test_delta_gpu.py on a GPU): wxfer.runtime.delta_gpu drives an emulation of
csrc/prepare/wx_delta_ops_kernel.cu that follows its code thread by thread (32-byte compare
chunks, bitmask words read at any bit offset, the block scan per 8 KiB segment) on host memory,
after the extension's own validation of every table (delta_check); the shadow, the counts and
the records must equal delta.changed / delta.encode of the same bytes, over ranges at odd
offsets and lengths and change rates from none to all. The validation's refusals are checked
too."""

import array
import ctypes

import numpy as np
import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import delta, delta_gpu

THREADS, SEG = 256, delta_gpu.SEG


def _mem(addr: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)


def _entries(table, k: int) -> list:
    a = np.frombuffer(table, dtype=np.uint64)
    return [tuple(int(x) for x in a[i : i + k]) for i in range(0, len(a), k)]


def _find(ents, seg, s) -> int:
    i = 0
    while i + 1 < len(ents) and ents[i + 1][seg] <= s:
        i += 1
    return i


def _set_bits(words, pos: int, m: int) -> None:
    x = m << (pos & 31)
    w = pos >> 5
    words[w] |= np.uint32(x & 0xFFFFFFFF)
    if x >> 32:
        words[w + 1] |= np.uint32(x >> 32)


def _word(words, bit0: int, k: int, n: int) -> int:
    if 32 * k >= n:
        return 0
    b = bit0 + 32 * k
    sh = b & 31
    lo = int(words[b >> 5])
    w = ((lo | (int(words[(b >> 5) + 1]) << 32)) >> sh) & 0xFFFFFFFF if sh else lo
    rem = n - 32 * k
    return w & ((1 << rem) - 1) if rem < 32 else w


def _emulate(kind, device, stream, table, dev, bits, bits_nb, a=0, an=0, b=0, bn=0, o=0, on=0):
    """_wxfer.delta_launch on host memory: the extension validates, this runs the kernel."""
    if kind == 2:
        nsegs = _wxfer.delta_check(kind, table, bits_nb, an, on, bn)
    elif kind == 3:
        nsegs = _wxfer.delta_check(kind, table, bits_nb, an)
    else:
        nsegs = _wxfer.delta_check(kind, table, bits_nb)
    words = np.frombuffer((ctypes.c_uint8 * bits_nb).from_address(bits), dtype=np.uint32)
    if kind == 0:  # wx_delta_cmp: 32 bytes a thread
        for dst, src, n, seg0, bit0 in _entries(table, 5):
            for off in range(0, n, 32):
                nb = min(32, n - off)
                d, s = _mem(dst + off, nb), _mem(src + off, nb)
                m = sum(1 << k for k in range(nb) if d[k] != s[k])
                if m:
                    d[:] = s
                _set_bits(words, bit0 + off, m)
        return
    if kind == 3:  # wx_delta_scatter: one bitmask word a thread, a byte store per set bit
        for dst, bit0, n, seg0 in _entries(table, 4):
            for k in range((n + 31) // 32):
                w = _word(words, bit0, k, n)
                while w:
                    b = (w & -w).bit_length() - 1
                    w &= w - 1
                    _mem(dst + 32 * k + b, 1)[0] = _mem(a + bit0 + 32 * k + b, 1)[0]
        return
    ents = _entries(table, 3 if kind == 1 else 8)
    for sg in range(nsegs):
        i = _find(ents, 2 if kind == 1 else 3, sg)
        e = ents[i]
        if kind == 1:  # wx_delta_count
            bit0, n, seg0 = e
            ws = [_word(words, bit0, (sg - seg0) * THREADS + t, n) for t in range(THREADS)]
            np.frombuffer((ctypes.c_uint8 * (4 * an)).from_address(a), dtype=np.uint32)[sg] = sum(
                bin(w).count("1") for w in ws
            )
            continue
        out_off, bit0, n, seg0, rseg0, c, head0, doff = e  # wx_delta_emit
        s = sg - seg0
        rec = o + out_off
        if s == 0:
            _mem(rec, 32)[:] = np.frombuffer(np.array([head0, doff, n, c], dtype=np.uint64).tobytes(), np.uint8)
        segx = np.frombuffer((ctypes.c_uint8 * (8 * bn)).from_address(b), dtype=np.int64)
        ws = [_word(words, bit0, s * THREADS + t, n) for t in range(THREADS)]
        pre = np.concatenate([[0], np.cumsum([bin(w).count("1") for w in ws])])
        mask = head0 >> 32 == 1
        pay = rec + 32
        vals = pay + (delta.pad8((n + 7) // 8) if mask else delta.pad8(4 * c))
        for t, w in enumerate(ws):
            k = s * THREADS + t
            if mask and 32 * k < n:
                _mem(pay + 4 * k, 4)[:] = np.frombuffer(np.uint32(w).tobytes(), np.uint8)
            q = int(segx[rseg0 + s] - segx[rseg0]) + int(pre[t])
            while w:
                bit = (w & -w).bit_length() - 1
                w &= w - 1
                _mem(vals + q, 1)[0] = _mem(a + bit0 + 32 * k + bit, 1)[0]
                if not mask:
                    _mem(pay + 4 * q, 4)[:] = np.frombuffer(np.uint32(32 * k + bit).tobytes(), np.uint8)
                q += 1


def _quantize_compare(shadow, bits, jobs):
    """delta_gpu.quantize_compare's contract on CPU: the reference quantizer's bytes in the
    shadow, the changed ones marked (the kernel itself: tests/test_delta_gpu.py)."""
    from wxfer.runtime import fp8

    new = shadow.clone()
    fp8.quantize_into(new, jobs)
    d = np.packbits((new != shadow).numpy(), bitorder="little")
    d = np.concatenate([d, np.zeros(4 * bits.numel() - d.size, np.uint8)]).view(np.int32)
    bits |= torch.from_numpy(d)
    shadow.copy_(new)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(_wxfer, "delta_launch", _emulate, raising=False)
    monkeypatch.setattr(delta_gpu, "quantize_compare", _quantize_compare)
    monkeypatch.setattr(delta_gpu, "_dev", lambda table, device: torch.frombuffer(table, dtype=torch.int64))
    monkeypatch.setattr(delta_gpu, "_stream", lambda device: 0)


def _changed(old, rate: float, g) -> torch.Tensor:
    new = old.clone()
    m = torch.rand(old.numel(), generator=g) < rate
    new[m] = new[m] ^ torch.randint(1, 256, (int(m.sum()),), dtype=torch.uint8, generator=g)
    return new


@pytest.mark.parametrize("rate", [0.0, 0.004, 0.03, 0.5, 1.0])
def test_emulated_kernels_make_the_cpu_encoders_records(emulated, rate):
    g = torch.Generator().manual_seed(int(rate * 1000) + 7)
    # ranges at odd buffer and shadow offsets, one over two segments, one below a word
    layout = [(3, 9000, 5), (9003, 17000, 9011), (26003, 21, 26020), (26100, 7, 26045)]
    nbuf, nsh = 26107, 26052
    old_buf = torch.randint(0, 256, (nbuf,), dtype=torch.uint8, generator=g)
    shadow = torch.randint(0, 256, (nsh,), dtype=torch.uint8, generator=g)
    for soff, n, so in layout:
        shadow[so : so + n] = old_buf[soff : soff + n]
    old_shadow = shadow.clone()
    buf = _changed(old_buf, rate, g)
    cs, st = delta_gpu.compare_count(shadow, buf, layout)
    for (soff, n, so), c in zip(layout, cs):
        d, c_ref = delta.changed(buf[soff : soff + n], old_shadow[so : so + n])
        assert c == c_ref
        assert torch.equal(shadow[so : so + n], buf[soff : soff + n])
    gaps = torch.ones(nsh, dtype=torch.bool)
    for _, n, so in layout:
        gaps[so : so + n] = False
    assert torch.equal(shadow[gaps], old_shadow[gaps])  # bytes outside the ranges untouched
    recs = [(i, 3 + i, 1000 * i + 1) for i, c in enumerate(cs) if c]
    got = delta_gpu.emit(shadow, st, recs)
    assert len(got) == len(recs)
    for (i, region, doff), r in zip(recs, got):
        soff, n, so = layout[i]
        d, c = delta.changed(buf[soff : soff + n], old_shadow[so : so + n])
        ref = delta.encode(buf[soff : soff + n], d, c, region, doff)
        assert torch.equal(r, ref), (i, rate)


def test_the_checks_name_the_bad_entry():
    t = array.array("Q", (0x1000, 0x2000, 100, 0, 0))
    assert _wxfer.delta_check(0, t, 4 * 5) == 1
    with pytest.raises(_wxfer.Error, match="compare range 0.*bitmask"):
        _wxfer.delta_check(0, t, 8)
    with pytest.raises(_wxfer.Error, match="compare range 1: seg0 5, expected 1"):
        _wxfer.delta_check(0, array.array("Q", tuple(t) + (0x1000, 0x2000, 100, 5, 0)), 64)
    with pytest.raises(_wxfer.Error, match="null shadow"):
        _wxfer.delta_check(0, array.array("Q", (0, 0x2000, 100, 0, 0)), 64)
    assert _wxfer.delta_check(1, array.array("Q", (7, 20000, 0)), 4 * 700) == 3
    rec = (0, 7, 100, 0, 0, 5, 2 | (delta.PAIRS << 32), 9)
    size = delta.pairs_size(5)
    assert _wxfer.delta_check(2, array.array("Q", rec), 64, 107, size, 2) == 1
    with pytest.raises(_wxfer.Error, match="record 0.*not 8-aligned inside"):
        _wxfer.delta_check(2, array.array("Q", rec), 64, 107, size - 8, 2)
    with pytest.raises(_wxfer.Error, match="record 0.*inside the 106-byte shadow"):
        _wxfer.delta_check(2, array.array("Q", rec), 64, 106, size, 2)
    bad = rec[:6] + (2 | (7 << 32),) + rec[7:]
    with pytest.raises(_wxfer.Error, match="record 0.*encoding 7"):
        _wxfer.delta_check(2, array.array("Q", bad), 64, 107, size, 2)
    with pytest.raises(_wxfer.Error, match="prefix sum has 1 entries"):
        _wxfer.delta_check(2, array.array("Q", rec), 64, 107, size, 1)
    with pytest.raises(ValueError, match="delta table kind 4"):
        _wxfer.delta_check(4, array.array("Q", rec), 64)


def test_without_a_gpu_the_kernels_say_why():
    why = delta_gpu.why(torch.device("cuda", 0))
    if torch.cuda.is_available():
        assert why is None, why
    else:
        assert why and ("libcuda" in why or "cuda.h" in why), why
    assert "CUDA devices only" in delta_gpu.why(torch.device("cpu"))


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_sender_on_the_kernel_path_is_bit_identical_to_dense(store, emulated, monkeypatch, quant):
    """Sender(delta=True) with the DeltaWriter's kernel path (compare_count, emit) forced on, the
    ops kernels emulated: every push leaves the receivers' bytes of a dense push, and the
    records went through the kernels' path."""
    import test_delta as td

    from wxfer.runtime import delta_send

    if not td.FABRIC:
        pytest.skip("fabric transport not built")
    monkeypatch.setattr(delta_send, "_kernels", lambda device: (True, None))
    used = []
    real = delta_gpu.emit
    monkeypatch.setattr(delta_gpu, "emit", lambda *a: (used.append(1), real(*a))[1])

    _, addr = store
    name, tp = "deltak" + str(quant), 2
    model, params, sender, recvs = td._delta_run(addr, name, tp, quant)
    gen = torch.Generator().manual_seed(5)
    try:
        for step in range(1, 4):
            if step > 1:
                td._touch(model, 0.01, gen)
            td._push_equal(model, params, sender, recvs, tp, quant, f"step {step}")
        st = sender.stats()["delta"]
        assert st["encoder"] == "kernels" and st["last"]["tasks_delta"] > 0 and used
        # FP8: the tasks with FP8 pieces made in the shadow (the fused path), none for BF16
        assert (st["last"]["fused_tasks"] > 0) == (quant == "fp8"), st["last"]
    finally:
        sender.close()
        for r in recvs:
            r.close()


def test_bypassed_pushes_drop_the_shadow_and_the_next_delta_starts_dense(store, emulated, monkeypatch):
    """The kernel path with the link faster than the compare (colocated): the tasks take a plain
    push's way (DeltaWriter.bypass), no shadow is kept; when the link is slow again the next push
    is dense ('first') and only the one after sends records; every push bit-identical to dense."""
    import test_delta as td

    from wxfer.runtime import delta_send

    if not td.FABRIC:
        pytest.skip("fabric transport not built")
    monkeypatch.setattr(delta_send, "_kernels", lambda device: (True, None))
    fast = {"on": False}
    monkeypatch.setattr(delta_send.DeltaWriter, "link_fast", lambda self: fast["on"])

    _, addr = store
    name, tp, quant = "deltabypass", 1, "fp8"
    model, params, sender, recvs = td._delta_run(addr, name, tp, quant)
    gen = torch.Generator().manual_seed(9)
    lasts = []
    try:
        for step, on in enumerate([False, True, True, False, False], 1):
            fast["on"] = on
            if step > 1:
                td._touch(model, 0.01, gen)
            td._push_equal(model, params, sender, recvs, tp, quant, f"step {step}")
            st = sender.stats()["delta"]
            lasts.append((st["last"], st["shadow_bytes"]))
        (l1, s1), (l2, s2), (l3, s3), (l4, s4), (l5, s5) = lasts
        assert l1["tasks_dense"] > 0 and l1["tasks_bypassed"] == 0 and s1 > 0
        assert l2["tasks_bypassed"] > 0 and l2["tasks_delta"] == l2["tasks_dense"] == 0 and s2 == 0
        assert l3["tasks_bypassed"] > 0 and s3 == 0
        assert l4["tasks_delta"] == 0 and l4["dense_why"].get("first", 0) > 0 and s4 > 0
        assert l5["tasks_delta"] > 0
    finally:
        sender.close()
        for r in recvs:
            r.close()
