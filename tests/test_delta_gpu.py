"""Delta records on a GPU (issue 36): the shadow compare, the encode and the receiver's apply
as torch ops on CUDA tensors, after the native FP8 quantizer, leave exactly the new bytes; the
kernels part of benchmarks/bench_delta.py runs and reports its times (for the lead's GPU run)."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("rate", [0.004, 0.03, 0.3])
def test_fp8_records_round_trip_on_the_gpu(rate):
    from wxfer.runtime import delta, fp8

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1024, 2048, generator=g) * 0.02).to(dev, torch.bfloat16)
    nq, ns = w.numel(), 8 * 16 * 4
    old = torch.empty(nq + ns, dtype=torch.uint8, device=dev)
    fp8.quantize_into(old, [(w, 0, nq)])
    m = (torch.rand(w.shape, generator=g) < rate).to(dev)
    w2 = w.clone()
    w2[m] = w2[m] * 1.07
    new = torch.empty_like(old)
    fp8.quantize_into(new, [(w2, 0, nq)])
    d, c = delta.changed(new, old)
    assert c > 0
    rec = delta.encode(new, d, c, 0, 64)
    assert rec.device.type == "cuda" and rec.numel() == delta.record_size(new.numel(), c)
    region = torch.zeros(64 + old.numel(), dtype=torch.uint8, device=dev)
    region[64:] = old
    assert delta.apply_records(rec, 1, [region]) == c
    assert torch.equal(region[64:], new) and int(region[:64].sum()) == 0


def test_bench_kernels_on_the_gpu():
    sys.path.insert(0, ROOT)
    from benchmarks.bench_delta import bench_kernels

    r = bench_kernels(torch.device("cuda"), 4096, 4096, 0.004, 3)
    # the records are exactly the encoding's size for the bytes that changed, and far smaller than
    # dense: 0.4% of elements x1.07 also moves the amax (so every byte) of ~0.4% of the 128x128
    # blocks; on an H100 (2026-12-06) the records were 5.2% of the dense bytes
    assert r["record_bytes"] == r["expected_record_bytes"] > 0
    assert r["record_bytes"] < 0.1 * r["dense_bytes"]
    assert r["quantize_s"] > 0 and r["quantize_compare_encode_s"] > 0 and r["apply_s"] > 0
    print(r)


# ----------------------------------------------------------------- the delta kernels (delta_gpu)
# The fused FP8 quantize + compare kernel and the compare / count / emit kernels against the CPU
# reference: the shadow after the kernel equals the dense push's bytes (the product FP8 kernel's,
# themselves equal to the reference quantizer on the CPU), the bitmask marks exactly the bytes
# that differ, the counts and every record equal delta.changed / delta.encode of the same range,
# and the records applied over the old bytes give the new ones.

# rows 16/8/8/4/1/1-aligned; (160, 416), (130, 352): rows 32-aligned, not 128 (the bitmask's word stores, WX_DBITS)
SHAPES = [(256, 512), (300, 200), (129, 1000), (64, 300), (77, 130), (1, 3), (160, 416), (130, 352)]
RATES = [0.0, 0.004, 0.5, 1.0]


def _kernels_or_fail(dev):
    from wxfer.runtime import delta_gpu

    why = delta_gpu.why(dev)
    assert why is None, f"the delta kernels do not run on {dev}: {why}"
    return delta_gpu


def _moved(w, rate, g):
    """w with about `rate` of its elements changed (x1.07 + a small offset)."""
    m = (torch.rand(w.shape, generator=g) < rate).to(w.device)
    w2 = w.clone()
    w2[m] = (w2[m].float() * 1.07 + 0.003).to(w.dtype)
    return w2


def _jobs(w, q_off):
    """Two pieces of w: all its rows at q_off, its scales after; and its right columns (a slice
    with a row pitch that is not 16-byte aligned in general) with its own scales."""
    rows, cols = w.shape
    sb = -(-rows // 128) * -(-cols // 128) * 4
    c0 = cols // 3
    w1 = w[:, c0:]
    sb1 = -(-rows // 128) * -(-(cols - c0) // 128) * 4
    o = q_off + rows * cols
    jobs = [(w, q_off, o + 1), (w1, o + 1 + sb + 2, o + 1 + sb + 2 + rows * (cols - c0) + 3)]
    end = jobs[1][2] + sb1 + 5
    return jobs, end


def _packed_bits(d):
    """The bitmask of bool tensor d (little-endian bit order), as int32 words, one past the end."""
    n = d.numel()
    words = (n + 31) // 32 + 1
    b = torch.zeros(words * 32, dtype=torch.uint8)
    b[:n] = d.cpu()
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (b.view(-1, 8) * w).sum(1, dtype=torch.uint8).view(torch.int32)


def _check_records(delta_gpu, shadow, bits, old, new, ranges):
    from wxfer.runtime import delta

    cs, st = delta_gpu.count(bits, ranges)
    recs = []
    for i, (so, n) in enumerate(ranges):
        d, c = delta.changed(new[so : so + n].cpu(), old[so : so + n].cpu())
        assert cs[i] == c, (i, cs[i], c)
        if c:
            recs.append((i, 7 + i, 64 * i, d, c))
    got = delta_gpu.emit(shadow, st, [r[:3] for r in recs])
    region = old.clone()
    for (i, reg, doff, d, c), r in zip(recs, got):
        so, n = ranges[i]
        ref = delta.encode(new[so : so + n].cpu(), d, c, reg, doff)
        assert torch.equal(r.cpu(), ref), (i, n, c)
        # applied at the range's own offset: the old bytes become the new ones
        hdr = delta.REC.pack(0, delta.REC.unpack(ref[:32].numpy().tobytes())[1], so, n, c)
        r2 = torch.cat([torch.frombuffer(bytearray(hdr), dtype=torch.uint8).to(r.device), r[32:]])
        delta.apply_records(r2, 1, [region])
    assert torch.equal(region, new)
    return cs


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fused_quantize_compare_is_the_dense_push_and_the_cpu_encoder(shape, rate, dtype):
    from wxfer.runtime import fp8

    dev = torch.device("cuda")
    delta_gpu = _kernels_or_fail(dev)
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1] + int(rate * 1000) + len(dtype))
    w = (torch.randn(shape, generator=g) * 0.02).to(dev, getattr(torch, dtype))
    w2 = _moved(w, rate, g)
    for q_off in (0, 5):
        jobs1, n = _jobs(w, q_off)
        jobs2, _ = _jobs(w2, q_off)
        old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev)  # the gaps stay
        fp8.quantize_into(old, jobs1)
        new = old.clone()
        assert fp8.quantize_into(new, jobs2) == "native"
        cpu = old.cpu()
        fp8.quantize_into(cpu, [(t.cpu(), a, b) for t, a, b in jobs2])  # the reference quantizer
        assert torch.equal(cpu, new.cpu())
        shadow = old.clone()
        bits = delta_gpu.bits_for(n, dev)
        delta_gpu.quantize_compare(shadow, bits, jobs2)
        torch.cuda.synchronize()
        assert torch.equal(shadow, new), (q_off, int((shadow != new).sum()))
        assert torch.equal(bits.cpu(), _packed_bits(new != old))
        # the whole shadow, and ranges at odd offsets over the pieces and the gaps
        ranges = [(0, n), (1, n // 3), (n // 3 + 1, n - n // 3 - 1)]
        cs = _check_records(delta_gpu, shadow, bits, old, new, ranges)
        if rate == 0.0:
            assert cs[0] == 0


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("nbytes", [7, 8192, 100_003, 1 << 20])
def test_compare_kernel_bf16_bytes_into_the_shadow(nbytes, rate):
    dev = torch.device("cuda")
    delta_gpu = _kernels_or_fail(dev)
    g = torch.Generator().manual_seed(nbytes + int(rate * 1000))
    old = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=g)
    new = old.clone()
    m = torch.rand(old.numel(), generator=g) < rate
    new[m] = new[m] ^ torch.randint(1, 256, (int(m.sum()),), dtype=torch.uint8, generator=g)
    old, new = old.to(dev), new.to(dev)
    # buf -> shadow layouts: aligned, and buf and shadow at different odd offsets
    for layout in ([(0, nbytes, 0)], [(3, nbytes // 2, 17), (3 + nbytes // 2, nbytes - nbytes // 2, 17 + nbytes // 2)]):
        shadow = old.clone()
        shadow_old = shadow.clone()
        buf = torch.zeros_like(new)
        want = shadow_old.clone()
        for soff, n, so in layout:
            if n:
                buf[soff : soff + n] = new[so : so + n]
                want[so : so + n] = new[so : so + n]
        layout = [x for x in layout if x[1]]
        bits = delta_gpu.bits_for(shadow.numel(), dev)
        delta_gpu.compare(shadow, bits, buf, layout)
        torch.cuda.synchronize()
        assert torch.equal(shadow, want)
        assert torch.equal(bits.cpu(), _packed_bits(want != shadow_old))
        _check_records(delta_gpu, shadow, bits, shadow_old, want, [(so, n) for _, n, so in layout])


def test_bench_fused_kernel_rows_on_the_gpu():
    sys.path.insert(0, ROOT)
    from benchmarks.bench_delta import bench_fused

    r = bench_fused(torch.device("cuda"), 2048, 2048, 0.004, 3)
    assert r["bitexact"] and r["record_bytes"] == r["expected_record_bytes"] > 0
    assert r["fused_s"] > 0 and r["quantize_s"] > 0 and r["torch_path_s"] > 0
    print(r)


def test_a_push_on_the_kernel_path_is_verified_every_step(monkeypatch):
    """python -m wxfer demo on this GPU (one trainer, one receiver, cuda_ipc), FP8, delta with the
    link pinned at 1 Gb/s (so records pay) and 1% of the elements changed per step: the trainer's
    DeltaWriter runs the delta kernels, and every receiver's bytes after apply() equal the
    reference packing (a dense push's) every step.  The scatter off: on one GPU with the link
    pinned, "auto" would store the changed bytes straight into the receiver (that path:
    tests/test_delta_scatter_gpu.py); this test is of the records."""
    from wxfer.runtime import delta_gpu
    from wxfer.tools.demo import run_demo

    assert delta_gpu.why(torch.device("cuda")) is None
    monkeypatch.setenv("WXFER_DEMO_CPU", "0")
    res = run_demo(
        trainers=1, replicas=1, tp=1, steps=4, fp8=True, size="small", transport="auto",
        delta=dict(link_Bps=1e9 / 8, measure_link=False, scatter="off"), change_rate=0.01, log=lambda *a: None,
    )  # fmt: skip
    assert res["verified"] and res["bitexact"], res
    steps = res["delta_steps"]
    assert all(s["tasks_delta"] > 0 and s["tasks_scatter"] == 0 for s in steps[1:]), steps
    assert res["delta_bytes"] < 0.5 * res["dense_bytes"], res
