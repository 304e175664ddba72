"""Delta pushes on the CPU (issue 36): the native compare / encode / shadow update / apply
(csrc/prepare/wx_delta_host.c through wxfer.runtime.delta_cpu) give byte for byte the records of
the torch path (delta.encode, the format the GPU path and the receivers share), leave the
shadow equal to the new bytes, and the native apply equals the torch apply; a malformed record
is refused with nothing written."""

import errno

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import delta, delta_cpu

CPU = torch.device("cpu")


def _pair(n: int, k: int, seed: int = 0, burst: bool = False):
    """(old, new) uint8 host tensors of n bytes, k of them changed (at random, or in one run)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    new = old.clone()
    if k:
        idx = torch.arange(k) + (n - k) // 2 if burst else torch.randperm(n, generator=g)[:k]
        new[idx] ^= torch.randint(1, 256, (k,), dtype=torch.uint8, generator=g)
    return old, new


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 65_537])
@pytest.mark.parametrize("rate", [0.0, 0.001, 0.03, 0.04, 0.2, 1.0])
def test_native_records_equal_the_torch_encoding(n, rate):
    assert delta_cpu.available(CPU)
    old, new = _pair(n, int(n * rate), seed=n)
    d, c = delta.changed(new, old)
    c2, idx = delta_cpu.scan(new, old)
    assert c2 == c
    if c == 0:
        return
    ref = delta.encode(new, d, c, 7, 4096)
    for offsets in (idx, None):  # from the scan's offsets, and scanning again
        if offsets is None and idx is None:
            continue
        rec = delta_cpu.record(new, old, c, offsets, 7, 4096)
        assert rec.numel() == delta.record_size(n, c)
        assert torch.equal(rec, ref)
    rec = delta_cpu.record(new, old, c, None, 7, 4096)
    assert torch.equal(rec, ref)


def test_a_burst_past_the_offset_table_takes_the_mask():
    n = 100_000
    old, new = _pair(n, n // 10, burst=True)  # more than the offsets kept (n / 32)
    c, idx = delta_cpu.scan(new, old)
    assert c == n // 10 and idx is None
    rec = delta_cpu.record(new, old, c, None, 0, 0)
    assert delta.REC.unpack(rec[:32].numpy().tobytes())[1] == delta.MASK
    assert torch.equal(rec, delta.encode(new, *delta.changed(new, old), 0, 0))


@pytest.mark.parametrize("k", [0, 50, 5000])
def test_sync_leaves_the_shadow_equal_to_the_new_bytes(k):
    old, new = _pair(20_000, k, seed=3)
    c, idx = delta_cpu.scan(new, old)
    ip = 0 if idx is None else idx.data_ptr()
    _wxfer.delta_sync(new.data_ptr(), old.data_ptr(), new.numel(), c, ip)
    assert torch.equal(old, new)


@pytest.mark.parametrize("rate", [0.002, 0.3])
def test_native_apply_equals_the_torch_apply(rate, monkeypatch):
    n = 50_003
    old, new = _pair(n, int(n * rate), seed=5)
    d, c = delta.changed(new, old)
    recs = torch.cat([delta.encode(new[:20_000], d[:20_000], int(d[:20_000].sum()), 1, 0),
                      delta.encode(new[20_000:], d[20_000:], int(d[20_000:].sum()), 1, 20_000)])  # fmt: skip
    native = [torch.zeros(3, dtype=torch.uint8), old.clone()]
    assert delta.apply_records(recs, 2, native) == c
    assert torch.equal(native[1], new)
    monkeypatch.setattr(delta, "_native_apply", lambda buf, regions: None)
    ref = [torch.zeros(3, dtype=torch.uint8), old.clone()]
    assert delta.apply_records(recs, 2, ref) == c
    assert torch.equal(ref[1], native[1])


def test_a_malformed_record_is_refused_and_nothing_written():
    old, new = _pair(4096, 40, seed=9)
    d, c = delta.changed(new, old)
    rec = delta.encode(new, d, c, 0, 0)
    bad = rec.clone()
    bad[32:36] = torch.tensor([0xFF, 0xFF, 0, 0], dtype=torch.uint8)  # offset 65535 of a 4096-byte range
    dst = old.clone()
    with pytest.raises(delta.DeltaError, match="offset 65535 outside"):
        delta.apply_records(bad, 1, [dst])
    assert torch.equal(dst, old)
    with pytest.raises(delta.DeltaError, match="overruns"):
        delta.apply_records(rec[:-8], 1, [dst])
    assert torch.equal(dst, old)
    with pytest.raises(_wxfer.Error, match="output of 10 bytes"):
        _wxfer.delta_encode(new.data_ptr(), old.data_ptr(), 4096, c, 0, 0, 0, dst.data_ptr(), 10)
    with pytest.raises(_wxfer.Error, match="changed"):  # the bytes no longer match the scan's count
        out = torch.empty(delta.record_size(4096, c + 1), dtype=torch.uint8)
        _wxfer.delta_encode(new.data_ptr(), old.data_ptr(), 4096, c + 1, 0, 0, 0, out.data_ptr(), out.numel())


def test_a_native_failure_of_the_encode_names_the_task(monkeypatch):
    """The source changes between the scan and the record (a writer racing the push): the
    native encode fails (ESTALE) and the error names the task, not only the C call."""
    from types import SimpleNamespace

    old, new = _pair(4096, 3, seed=4)
    real_scan = delta_cpu.scan

    def scan_then_write(cur, shadow):
        c, idx = real_scan(cur, shadow)
        cur[int(idx[0])] = shadow[int(idx[0])]  # the racing writer puts one changed byte back
        return c, idx

    monkeypatch.setattr(delta_cpu, "scan", scan_then_write)
    step = dict(compared_bytes=0, changed_bytes=0, compare_s=0.0)
    w = SimpleNamespace(step=step, costs=dict(apply_Bps=1e12, encode_Bps=1e12), link_Bps=1e9, room={0: 1 << 20})
    w._region_index = lambda g: {b"region": 0}
    op = SimpleNamespace(task=5, name="layers.0.mlp.w")
    with pytest.raises(_wxfer.Error, match=r"task 5 \(layers.0.mlp.w\): delta_encode: .*no longer changed") as e:
        delta_cpu.encode(w, op, new, [(b"region", 0, 0, 4096)], ([(0, 4096, 0)], old.clone()), [0])
    assert e.value.errno == errno.ESTALE  # kept
