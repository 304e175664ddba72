"""The receiver's native apply of delta records (issue 36; wx_delta_apply in
csrc/prepare/wx_delta_ops_kernel.cu, through wxfer.runtime.delta_gpu.apply) on CPU: an emulation
that follows the kernel's four phases thread by thread on host memory (the walk over the heads,
the count of each MASK record's bits per 8 KiB segment and the check of each PAIRS offset, the
launcher's prefix sum, the check of the counts, the apply: a block scan per MASK segment, 8192
pairs a PAIRS segment), after the extension's own check of the launch (delta_apply_check). Its
bytes must equal the torch apply's, the host apply's and the new bytes (a dense write), over
records at odd offsets and lengths, straddling segments, from none to every byte changed; a
malformed record is refused naming it with nothing written, not even the good records before it;
the applier and its fallback reason; a Sender -> Receivers run whose records the receivers apply
through the emulated kernel. The kernel itself on a GPU: tests/test_delta_apply_gpu.py."""

import ctypes
import types

import numpy as np
import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import delta, delta_gpu

THREADS, SEG = 256, delta_gpu.SEG


def _mem(addr: int, n: int, dtype=np.uint8) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * (n * np.dtype(dtype).itemsize)).from_address(addr), dtype=dtype)


def _pad8(x: int) -> int:
    return (x + 7) & ~7


def _walk(rec, rec_nbytes, nrec, reg, work, st, cap):
    """Phase 0 (one thread): wx_dap_walk."""
    p = segs = changed = err = 0
    i = 0
    while i < nrec:
        if rec_nbytes < 32 or p > rec_nbytes - 32:
            err = delta_gpu.AP_OVER
            break
        h0, doff, n, c = (int(x) for x in _mem(rec + p, 4, np.uint64))
        region, enc = h0 & 0xFFFFFFFF, h0 >> 32
        if region >= len(reg) or enc > 1 or n > reg[region][1] or doff > reg[region][1] - n:
            err = delta_gpu.AP_HEAD
            break
        if c > n or (enc == 0 and n > 1 << 32):
            err = delta_gpu.AP_BAD
            break
        size = (_pad8(4 * c) if enc == 0 else _pad8((n + 7) // 8)) + _pad8(c)
        if size > rec_nbytes - 32 - p:
            err = delta_gpu.AP_OVER
            break
        nseg = ((c if enc == 0 else n) + SEG - 1) // SEG
        work[i] = (segs, p + 32, reg[region][0] + doff, n, c, enc, p, nseg)
        segs += nseg
        changed += c
        p += 32 + size
        i += 1
    if not err and segs > cap:
        err = delta_gpu.AP_SEGS
    st[1] = i if err else (1 << 64) - 1
    st[2] = 0 if err else segs
    st[3], st[4], st[5], st[0] = p, changed, 1 if err else 0, err


def _find(work, nrec, sg):
    i = 0
    while i + 1 < nrec and work[i + 1][0] <= sg:
        i += 1
    return i


def _mask_words(rec, r, s):
    """The 256 threads' words of segment s of MASK record r (wx_dap_word)."""
    seg0, pay, dst, n, c, enc, head, nseg = r
    ws = []
    for t in range(THREADS):
        k = s * THREADS + t
        if 32 * k >= n:
            ws.append(0)
            continue
        w = int(_mem(rec + pay + 4 * k, 1, np.uint32)[0])
        rem = n - 32 * k
        ws.append(w & ((1 << rem) - 1) if rem < 32 else w)
    return ws


def _flag(st, i, err):
    st[0] |= err
    st[1] = min(int(st[1]), i)


def _segments(rec, nrec, work, st, counts, segx, phase):
    """Phases 1 (count) and 3 (apply): each segment as a CTA runs it."""
    for sg in range(int(st[2])):
        i = _find(work, nrec, sg)
        seg0, pay, dst, n, c, enc, head, nseg = work[i]
        s = sg - seg0
        if enc == 1:
            ws = _mask_words(rec, work[i], s)
            pops = [bin(w).count("1") for w in ws]
            if phase == 1:
                counts[sg] = sum(pops)
                continue
            pre = np.concatenate([[0], np.cumsum(pops)])  # the block scan: exclusive
            vals = rec + pay + _pad8((n + 7) // 8)
            for t, w in enumerate(ws):
                k = s * THREADS + t
                q = int(segx[sg] - segx[seg0]) + int(pre[t])
                while w:
                    b = (w & -w).bit_length() - 1
                    w &= w - 1
                    _mem(dst + 32 * k + b, 1)[0] = _mem(vals + q, 1)[0]
                    q += 1
            continue
        offs = _mem(rec + pay, c, np.uint32) if c else np.zeros(0, np.uint32)
        vals = rec + pay + _pad8(4 * c)
        end = min(c, (s + 1) * SEG)
        js = range(s * SEG, end)  # thread t takes j = s * SEG + t + 256 * m
        if phase == 1:
            if any(int(offs[j]) >= n for j in js):
                _flag(st, i, delta_gpu.AP_BAD)
            counts[sg] = 0
            continue
        for t in range(THREADS):
            for j in range(s * SEG + t, end, THREADS):
                _mem(dst + int(offs[j]), 1)[0] = _mem(vals + j, 1)[0]


def _emulate(device, stream, phase, rec, rec_nbytes, nrec, regions, nregions, work, state, counts, segx, cap):
    """_wxfer.delta_apply_launch on host memory: the extension checks the launch, this runs it."""
    _wxfer.delta_apply_check(rec, rec_nbytes, nrec, regions, nregions, work, state, counts, segx, cap)
    st = _mem(state, 8, np.uint64)
    reg = [tuple(int(x) for x in _mem(regions + 16 * r, 2, np.uint64)) for r in range(nregions)]
    wk = _mem(work, 8 * nrec, np.uint64).reshape(nrec, 8)
    cn, sx = _mem(counts, cap, np.uint32), _mem(segx, cap + 1, np.int64)
    if phase == 0:
        _walk(rec, rec_nbytes, nrec, reg, wk, st, cap)
        if not st[0]:
            _segments(rec, nrec, [tuple(int(x) for x in e) for e in wk], st, cn, sx, 1)
        return
    if st[0]:  # every CTA of the later phases reads the error first
        return
    ents = [tuple(int(x) for x in e) for e in wk]
    for i, (seg0, pay, dst, n, c, enc, head, nseg) in enumerate(ents):  # phase 2
        if enc == 1 and int(sx[seg0 + nseg] - sx[seg0]) != c:
            _flag(st, i, delta_gpu.AP_BAD)
    if not st[0]:
        _segments(rec, nrec, ents, st, cn, sx, 3)


@pytest.fixture
def emulated_apply(monkeypatch):
    monkeypatch.setattr(_wxfer, "delta_apply_launch", _emulate, raising=False)
    monkeypatch.setattr(delta_gpu, "_dev", lambda table, device: torch.frombuffer(table, dtype=torch.int64).clone())
    monkeypatch.setattr(delta_gpu, "_stream", lambda device: 0)


def _changed(old, rate: float, g) -> torch.Tensor:
    new = old.clone()
    m = torch.rand(old.numel(), generator=g) < rate
    new[m] = new[m] ^ torch.randint(1, 256, (int(m.sum()),), dtype=torch.uint8, generator=g)
    return new


def _records(layout, old_regions, rate, g, force=None):
    """Records (delta.encode, one buffer) of `layout` [(region, doff, n)] at change `rate`, and the
    regions' new bytes. force: ranges whose every byte changes (index -> True)."""
    new_regions = [r.clone() for r in old_regions]
    recs = []
    for k, (region, doff, n) in enumerate(layout):
        old = old_regions[region][doff : doff + n]
        new = _changed(old, 1.0 if force and k in force else rate, g)
        new_regions[region][doff : doff + n] = new
        d, c = delta.changed(new, old)
        if c:
            recs.append(delta.encode(new, d, c, region, doff))
    buf = torch.cat(recs) if recs else torch.zeros(0, dtype=torch.uint8)
    return buf, len(recs), new_regions


# odd offsets and lengths; one PAIRS record over two 8192-pair segments at 3% (12k pairs), MASK
# records over several 8 KiB segments, ranges of 1 and 7 bytes, two regions
LAYOUT = [(0, 3, 20_011), (0, 20_100, 7), (1, 0, 1), (1, 5, 400_003), (0, 20_200, 33), (1, 400_100, 8193)]
SIZES = [40_000, 410_000]


def _heads(buf, nrec):
    """(encoding, n, c) of each record."""
    p, out = 0, []
    for _ in range(nrec):
        region, enc, doff, n, c = delta.REC.unpack(buf[p : p + 32].numpy().tobytes())
        out.append((enc, n, c))
        p += delta.pairs_size(c) if enc == delta.PAIRS else delta.mask_size(n, c)
    return out


@pytest.mark.parametrize("rate", [0.0, 0.001, 0.004, 0.03, 0.5, 1.0])
def test_the_emulated_kernel_writes_the_torch_and_host_applies_bytes(emulated_apply, rate):
    g = torch.Generator().manual_seed(int(rate * 1e4) + 3)
    old = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]
    buf, nrec, new = _records(LAYOUT, old, rate, g)
    heads = _heads(buf, nrec)
    if rate == 0.03:  # a PAIRS record over two segments of 8192 pairs
        assert any(enc == delta.PAIRS and c > SEG for enc, n, c in heads), heads
    if rate == 0.5:  # MASK records over several 8 KiB segments, one of 8193 bytes
        assert any(enc == delta.MASK and n > 2 * SEG for enc, n, c in heads), heads
        assert (delta.MASK, SEG + 1) in [(enc, n) for enc, n, c in heads], heads
    got = [r.clone() for r in old]
    assert delta_gpu.apply(buf, nrec, got) == sum(int((a != b).sum()) for a, b in zip(new, old))
    torch_ = [r.clone() for r in old]
    host = [r.clone() for r in old]
    if nrec:
        delta.apply_records(buf, nrec, torch_, how="torch")
        delta.apply_records(buf, nrec, host, how="host")
    for a, b, c, d in zip(got, torch_, host, new):
        assert torch.equal(a, d) and torch.equal(b, d) and torch.equal(c, d)


def test_a_whole_range_changed_and_a_mask_at_a_segment_s_edge(emulated_apply):
    """Ranges of exactly one and two 8 KiB segments, every byte changed (MASK words all ones),
    and one of 8192 + 1 bytes: the last segment holds one bit."""
    g = torch.Generator().manual_seed(17)
    layout = [(0, 8, 8192), (0, 8200, 16384), (0, 24_600, 8193)]
    old = [torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)]
    buf, nrec, new = _records(layout, old, 0.2, g, force={0, 1})
    got = [old[0].clone()]
    delta_gpu.apply(buf, nrec, got)
    assert torch.equal(got[0], new[0])


def _one(region=0, doff=5, n=1000, rate=0.01, seed=1):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    new = _changed(old, rate, g)
    d, c = delta.changed(new, old)
    return delta.encode(new, d, c, region, doff), c


def _bad(rec, field, value):
    """rec with its head's field (0 region|enc, 1 doff, 2 n, 3 c; u64) set."""
    out = rec.clone()
    out[8 * field : 8 * field + 8] = torch.frombuffer(bytearray(int(value).to_bytes(8, "little")), dtype=torch.uint8)
    return out


def test_a_malformed_record_is_refused_naming_it_and_nothing_is_written(emulated_apply):
    good, _ = _one(doff=5, seed=2)
    pairs, c = _one(doff=2000, n=1000, rate=0.01, seed=3)
    mask, cm = _one(doff=3000, n=1000, rate=0.3, seed=4)
    assert delta.REC.unpack(pairs[:32].numpy().tobytes())[1] == delta.PAIRS
    assert delta.REC.unpack(mask[:32].numpy().tobytes())[1] == delta.MASK
    bad_off = pairs.clone()
    bad_off[32:36] = torch.frombuffer(bytearray((1000).to_bytes(4, "little")), dtype=torch.uint8)  # offset = n
    bad_mask = mask.clone()
    bad_mask[32] ^= 0x01  # one bit more or less than the count
    cases = [
        (_bad(pairs, 0, 7), "record 7/0 .* outside the registered memory"),  # region 7 of 1
        (_bad(pairs, 0, 2 << 32), "record 0/2 .* outside"),  # encoding 2
        (_bad(pairs, 1, 4000), r"record 0/0 \[4000, 5000\) outside"),  # past the region's end
        (pairs[:-8], "record 0/0 \\[2000, 3000\\): its payload overruns"),
        (_bad(pairs, 3, 1001), "1001 changed bytes of a range of 1000"),
        (bad_off, "record 0/0 \\[2000, 3000\\): delta apply: an offset outside the range"),
        (bad_mask, f"record 0/1 \\[3000, 4000\\): delta apply: the mask does not hold {cm} bits"),
    ]
    for rec, match in cases:
        region = torch.zeros(4096, dtype=torch.uint8)
        buf = torch.cat([good, rec])
        with pytest.raises(delta.DeltaError, match=match):
            delta_gpu.apply(buf, 2, [region])
        assert int(region.count_nonzero()) == 0, match  # not even the good record before it
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(delta.DeltaError, match="record 1: its head at byte"):
        delta_gpu.apply(good, 2, [region])  # a second head past the records' end
    assert int(region.count_nonzero()) == 0


def test_the_launch_check_names_the_bad_argument():
    ok = dict(rec=8, rec_nbytes=100, nrec=1, regions=16, nregions=1, work=24, state=32, counts=40, segx=48, cap=2)
    _wxfer.delta_apply_check(*ok.values())
    for k, v, match in [
        ("rec", 12, "not 8-aligned"),
        ("nrec", 0, "0 records"),
        ("rec_nbytes", 16, "16 bytes of records"),
        ("nregions", 0, "0 regions"),
        ("state", 0, "null state"),
        ("cap", 1, "counts for 1 segments"),
    ]:
        with pytest.raises(_wxfer.Error, match=match):
            _wxfer.delta_apply_check(*dict(ok, **{k: v}).values())
    assert delta_gpu.apply_cap(100, 1) == 2


def test_the_applier_and_why_the_kernel_does_not_run(monkeypatch):
    cpu = torch.zeros(8, dtype=torch.uint8)
    assert delta.applier(cpu, [cpu]) == ("host", None)
    assert delta.applier(cpu, [cpu[::2]])[0] == "torch"
    fake = types.SimpleNamespace(device=torch.device("cuda", 0), is_contiguous=lambda: True, dtype=torch.uint8)
    how, why = delta.applier(fake, [fake])
    if torch.cuda.is_available():
        assert (how, why) == ("kernel", None)
    else:  # the probe's own reason (this VM: no libcuda)
        assert how == "torch" and ("libcuda" in why or "cuda" in why), why
    if torch.cuda.is_available():  # a region of another dtype: the torch ops, saying why
        bf16 = types.SimpleNamespace(device=fake.device, is_contiguous=lambda: True, dtype=torch.bfloat16)
        assert delta.applier(fake, [fake, bf16]) == ("torch", "region 1 is not contiguous uint8 memory on cuda:0")
    monkeypatch.setenv("WXFER_DELTA_APPLY", "torch")
    delta_gpu._APPLY_PROBE._probed.clear()
    assert delta.applier(fake, [fake]) == ("torch", "WXFER_DELTA_APPLY=torch")


def test_the_staging_area_reports_its_applier(monkeypatch, caplog):
    st = delta.Staging.__new__(delta.Staging)
    st.r = types.SimpleNamespace(gpu=3)
    st.nbytes, st.last, st.total = 64, {}, {}
    st.applier = st.applier_why = None
    monkeypatch.setattr(delta, "applier", lambda buf, regions: ("torch", "WXFER_DELTA_APPLY=torch"))
    with caplog.at_level("WARNING", logger="wxfer.runtime.delta"):
        st._choose(torch.zeros(8, dtype=torch.uint8), [])
    s = st.stats()
    assert s["applier"] == "torch" and s["applier_why"] == "WXFER_DELTA_APPLY=torch"
    assert "gpu 3" in caplog.text and "WXFER_DELTA_APPLY=torch" in caplog.text


def test_a_delta_push_applied_by_the_kernel_path_is_bit_identical_to_dense(store, emulated_apply, monkeypatch):
    """Sender(delta=True) -> two receivers whose Receiver.apply() goes the kernel's way (applier
    forced to "kernel", the kernel emulated on their host memory): every push leaves a dense push's
    bytes, and a receiver that missed an apply() is still refused (the header checks run first)."""
    import test_delta as td

    if not td.FABRIC:
        pytest.skip("fabric transport not built")
    used = []
    real = delta_gpu.apply
    monkeypatch.setattr(delta, "applier", lambda buf, regions: ("kernel", None))
    monkeypatch.setattr(delta_gpu, "apply", lambda *a: (used.append(a[1]), real(*a))[1])
    _, addr = store
    model, params, sender, recvs = td._delta_run(addr, "dapplyk", 2, "fp8")
    gen = torch.Generator().manual_seed(6)
    try:
        for step in range(1, 4):
            if step > 1:
                td._touch(model, 0.01, gen)
            applied = td._push_equal(model, params, sender, recvs, 2, "fp8", f"step {step}")
            if step > 1:
                assert sum(a["records"] for a in applied) > 0, applied
        assert used and sum(used) > 0
        assert all(r.stats()["delta"]["applier"] == "kernel" for r in recvs)
        # receiver 0 skips the apply of step 4: step 5's apply refuses it
        td._touch(model, 0.01, gen)
        sender.push()
        recvs[1].apply()
        td._touch(model, 0.01, gen)
        sender.push()
        with pytest.raises(delta.DeltaError, match="did not apply"):
            recvs[0].apply()
    finally:
        sender.close()
        for r in recvs:
            r.close()


# what NVRTC declares by itself, for clang's CUDA front end without a CUDA installation
_CLANG_PRELUDE = """
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline)) inline
#define __launch_bounds__(x) __attribute__((launch_bounds(x)))
#include <__clang_cuda_builtin_vars.h>
struct uint4 { unsigned x, y, z, w; };
__device__ unsigned atomicOr(unsigned *, unsigned);
__device__ unsigned long long atomicOr(unsigned long long *, unsigned long long);
__device__ unsigned long long atomicMin(unsigned long long *, unsigned long long);
__device__ int __popc(unsigned);
__device__ int __ffs(int);
__device__ unsigned __shfl_up_sync(unsigned, unsigned, int);
__device__ void __syncthreads();
__device__ uint4 __ldg(const uint4 *);
__device__ unsigned __ldg(const unsigned *);
__device__ unsigned char __ldg(const unsigned char *);
__device__ unsigned __funnelshift_r(unsigned, unsigned, int);
"""


def test_the_ops_kernel_source_compiles_for_a_gpu_with_clang(tmp_path):
    """No nvcc here: clang's CUDA front end compiles csrc/prepare/wx_delta_ops_kernel.cu (the apply
    kernel with the others) to PTX for sm_80, warnings as errors, with NVRTC's builtins declared;
    the entry points the launchers name are in it."""
    import os
    import shutil
    import subprocess

    clang = shutil.which("clang++")
    if clang is None:
        pytest.skip("no clang++")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "prepare")
    pre = tmp_path / "prelude.h"
    pre.write_text(_CLANG_PRELUDE)
    out = tmp_path / "ops.ptx"
    cmd = [clang, "-x", "cuda", "-nocudainc", "-nocudalib", "--cuda-gpu-arch=sm_80", "--cuda-device-only", "-S",
           "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-cuda-version", "-include", str(pre),
           os.path.join(src, "wx_delta_ops_kernel.cu"), "-o", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode and "unsupported" in r.stderr and "arch" in r.stderr:
        pytest.skip(f"this clang cannot target sm_80: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    ptx = out.read_text()
    for fn in ("wx_delta_cmp", "wx_delta_count", "wx_delta_emit", "wx_delta_scatter", "wx_delta_apply"):
        assert f".entry {fn}(" in ptx, fn
