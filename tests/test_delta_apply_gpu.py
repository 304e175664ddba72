"""The receiver's native apply of delta records on a GPU (issue 36; wx_delta_apply through
wxfer.runtime.delta_gpu.apply): the kernel loads; BF16 and FP8 destination bytes (the product
FP8 kernel's) at 0.1-50% changed, in records at odd offsets and lengths (1, 7, 33, 8193 bytes,
ranges over several 8 KiB segments and a PAIRS record over two segments of 8192 pairs, two
regions) are applied bit-identically to the torch apply and to a dense write of the new bytes,
the bytes between the ranges untouched; a malformed record is refused with nothing written; the
staging area (delta.Staging) applies a slot through the kernel, keeps its header checks (a
missed step's records refused, the resync asked) and reports its applier; the bench part runs.
The same logic on CPU, through an emulation of the kernel: tests/test_delta_apply.py."""

import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = [0.001, 0.004, 0.03, 0.1, 0.5]
# (region, destination offset, source offset, n): odd sizes, ranges over several 8 KiB segments
LAYOUT = [(0, 3, 0, 20_011), (0, 20_100, 20_011, 7), (1, 1, 20_018, 1), (1, 9, 20_019, 400_003),
          (0, 20_200, 420_022, 33), (1, 400_100, 420_055, 8193), (0, 20_300, 428_248, 3 * 8192 + 5)]  # fmt: skip
SIZES = [50_000, 410_000]
NSRC = 428_248 + 3 * 8192 + 5


def _kernel(dev):
    from wxfer.runtime import delta_gpu

    why = delta_gpu.apply_why(dev)
    assert why is None, f"the apply kernel does not run on {dev}: {why}"
    return delta_gpu


def _src_bytes(quant, rate, g, dev):
    """(old, new) source bytes of NSRC: BF16 weights, or the product FP8 kernel's bytes and
    scales of them, with about `rate` of the elements moved."""
    from wxfer.runtime import fp8

    rows, cols = 257, 1031
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(dev, torch.bfloat16)
    m = (torch.rand(w.shape, generator=g) < rate).to(dev)
    w2 = w.clone()
    w2[m] = (w2[m].float() * 1.07 + 0.003).to(torch.bfloat16)
    if quant == "bf16":
        old, new = w.view(-1).view(torch.uint8), w2.view(-1).view(torch.uint8)
    else:
        nq, ns = w.numel(), -(-rows // 128) * -(-cols // 128) * 4
        old = torch.empty(nq + ns, dtype=torch.uint8, device=dev)
        new = torch.empty_like(old)
        fp8.quantize_into(old, [(w, 0, nq)])
        fp8.quantize_into(new, [(w2, 0, nq)])
    reps = -(-NSRC // old.numel())  # tiled to the layout's length
    return old.repeat(reps)[:NSRC].contiguous(), new.repeat(reps)[:NSRC].contiguous()


def _records(old_src, new_src, regions):
    """The records (delta.encode on the GPU, one buffer) of LAYOUT, and the regions after a dense
    write of the new bytes."""
    from wxfer.runtime import delta

    dense = [r.clone() for r in regions]
    recs = []
    for region, doff, so, n in LAYOUT:
        old, new = old_src[so : so + n], new_src[so : so + n]
        regions[region][doff : doff + n] = old
        dense[region][doff : doff + n] = new
        d, c = delta.changed(new, old)
        if c:
            recs.append(delta.encode(new, d, c, region, doff))
    return (torch.cat(recs) if recs else None), len(recs), dense


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_native_apply_is_bit_identical_to_the_torch_apply_and_a_dense_write(quant, rate):
    from wxfer.runtime import delta

    dev = torch.device("cuda")
    delta_gpu = _kernel(dev)
    g = torch.Generator().manual_seed(int(rate * 1e4) + (7 if quant == "fp8" else 0))
    old_src, new_src = _src_bytes(quant, rate, g, dev)
    regions = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev) for n in SIZES]
    buf, nrec, dense = _records(old_src, new_src, regions)
    assert nrec > 0
    assert delta.applier(buf, regions) == ("kernel", None)
    native = [r.clone() for r in regions]
    torch_ = [r.clone() for r in regions]
    c_native = delta_gpu.apply(buf, nrec, native)
    c_torch = delta.apply_records(buf, nrec, torch_, how="torch")
    assert c_native == c_torch == sum(int((a != b).sum()) for a, b in zip(dense, regions))
    for a, b, d in zip(native, torch_, dense):
        assert torch.equal(a, d) and torch.equal(b, d)  # the bytes between the ranges too
    assert delta_gpu.apply(buf, nrec, native) == c_native and all(torch.equal(a, d) for a, d in zip(native, dense))


def test_every_byte_changed_and_a_mask_at_a_segment_s_edge():
    from wxfer.runtime import delta

    dev = torch.device("cuda")
    delta_gpu = _kernel(dev)
    g = torch.Generator().manual_seed(5)
    region = torch.randint(0, 256, (60_000,), dtype=torch.uint8, generator=g).to(dev)
    dense = region.clone()
    recs = []
    for doff, n in [(8, 8192), (8200, 16384), (24_600, 8193), (40_000, 1)]:
        new = region[doff : doff + n] ^ 0x5A  # every byte changed: MASK words all ones
        dense[doff : doff + n] = new
        recs.append(delta.encode(new, torch.ones(n, dtype=torch.bool, device=dev), n, 0, doff))
    got = region.clone()
    delta_gpu.apply(torch.cat(recs), len(recs), [got])
    assert torch.equal(got, dense)


def test_a_malformed_record_is_refused_with_nothing_written():
    from wxfer.runtime import delta

    dev = torch.device("cuda")
    delta_gpu = _kernel(dev)
    g = torch.Generator().manual_seed(9)
    old = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g).to(dev)
    recs = []
    for k, rate in enumerate((0.01, 0.01, 0.3)):
        new = old.clone()
        m = (torch.rand(1000, generator=g) < rate).to(dev)
        new[m] ^= 0xFF
        d, c = delta.changed(new, old)
        recs.append(delta.encode(new, d, c, 0, 1000 * k))
    good, pairs, mask = recs
    bad_off = pairs.clone()
    bad_off[32:36] = torch.tensor([0xE8, 0x03, 0, 0], dtype=torch.uint8, device=dev)  # offset 1000 = n
    bad_mask = mask.clone()
    bad_mask[32] ^= 1
    bad_region = pairs.clone()
    bad_region[0] = 9
    for rec, match in [(bad_off, "an offset outside"), (bad_mask, "the mask does not hold"), (bad_region, "outside")]:
        region = torch.zeros(4096, dtype=torch.uint8, device=dev)
        with pytest.raises(delta.DeltaError, match=match):
            delta_gpu.apply(torch.cat([good, rec]), 2, [region])
        assert int(region.count_nonzero()) == 0, match


class _Ctl:
    def __init__(self):
        self.calls = []

    def set(self, k, v):
        self.calls.append(("set", k, v))

    def add(self, k, v):
        self.calls.append(("add", k, v))


def _staging(dev, nbytes=1 << 20):
    """A delta.Staging on the GPU with a stand-in receiver (one sender, rank 0)."""
    from wxfer.runtime import delta

    st = delta.Staging.__new__(delta.Staging)
    st.r = types.SimpleNamespace(gpu=0, device=dev, senders=[0], ctl=_Ctl(), version=lambda: -1)
    st.nbytes = nbytes
    st.buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    st.applied, st.applied_rec = {}, {}
    st.applier = st.applier_why = None
    st.last = dict(applied_s=0.0, records=0, bytes=0, changed=0, version=-1)
    st.total = dict(applied_s=0.0, records=0, bytes=0, changed=0, applies=0)
    return st


def _slot(st, version, last_rec, buf, nrec):
    from wxfer.runtime import delta

    head = delta.HEAD.pack(delta.MAGIC, version, last_rec, nrec, buf.numel(), 0)
    st.buf[: delta.HEAD.size] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(st.buf.device)
    st.buf[delta.HEAD.size : delta.HEAD.size + buf.numel()] = buf


def test_the_staging_area_applies_a_slot_through_the_kernel_and_keeps_its_checks():
    from wxfer.runtime import delta

    dev = torch.device("cuda")
    _kernel(dev)
    g = torch.Generator().manual_seed(11)
    old_src, new_src = _src_bytes("fp8", 0.004, g, dev)
    regions = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev) for n in SIZES]
    buf, nrec, dense = _records(old_src, new_src, regions)
    st = _staging(dev)
    _slot(st, 1, -1, buf, nrec)
    out = st.apply(regions, version=1)
    assert out["records"] == nrec and out["changed"] > 0 and st.stats()["applier"] == "kernel"
    assert all(torch.equal(a, d) for a, d in zip(regions, dense))
    assert st.apply(regions, version=1)["records"] == 0  # applied once
    # step 3 builds on the records of step 2, which this worker never applied: refused, resync asked
    _slot(st, 3, 2, buf, nrec)
    before = [r.clone() for r in regions]
    with pytest.raises(delta.DeltaError, match="did not apply"):
        st.apply(regions, version=3)
    assert ("add", "delta/resync", 1) in st.r.ctl.calls
    assert all(torch.equal(a, b) for a, b in zip(regions, before))


def test_bench_apply_on_the_gpu():
    sys.path.insert(0, ROOT)
    from benchmarks.bench_delta import apply_line, bench_apply

    r = bench_apply(torch.device("cuda"), 32 << 20, 4099 << 10, 0.004, 3)
    print(apply_line(r))
    assert r["applier"] == "kernel" and r["bitexact"] and r["records"] == 8
    assert r["native_s"] > 0 and r["torch_s"] > 0 and r["dense_copy_s"] > 0
