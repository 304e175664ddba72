"""The native block-FP8 kernel (csrc/prepare/wx_fp8_kernel.cu, through wxfer.runtime.fp8)
writes exactly the bytes of wxfer.mapping.reference.quantize_fp8_block: every fp8 byte and
every scale byte, over partial blocks, all-zero blocks, 1-row / 1-column tensors, 3-D
experts, fused and TP-sliced pieces (one straddling the full tensor's block grid),
bfloat16 / float16 / float32 sources, unaligned offsets and many pieces in one launch.
Bytes outside the pieces' outputs stay untouched. Needs a CUDA GPU of compute capability
>= 8.9 and libnvrtc (the test fails, with the reason, when the native kernel is not used)."""

import random

import pytest
import torch

from wxfer.mapping.reference import quantize_fp8_block
from wxfer.runtime import fp8
from helpers import native_gpu  # tests/helpers.py

pytestmark = pytest.mark.gpu
FILL = 0xA5
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def dev():
    return native_gpu(fp8.info, "quantizer", "the native FP8 kernel")


def _data(shape, dtype, dev, seed=0):
    """Normal values with a different magnitude per 64x64 patch (so block scales differ), a
    few huge outliers (the rest of their block lands in e4m3 subnormals) and some zeros."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float32)
    if w.dim() >= 2 and w.numel():
        r, c = w.shape[-2:]
        lo, hi, big = (-12, 3, 100.0) if dtype == torch.float16 else (-20, 12, 3000.0)  # no fp16 inf
        mag = torch.exp2(torch.randint(lo, hi, (-(-r // 64), -(-c // 64)), generator=g).float())
        w = w * mag.repeat_interleave(64, 0)[:r].repeat_interleave(64, 1)[:, :c]
        flat = w.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 5000),), generator=g)
        flat[idx] *= big
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)] = 0.0
    return w.to(dtype).to(dev)


def _expected(out_cpu, jobs):
    """out_cpu (filled with FILL) with the reference bytes of each job written in."""
    for t, qo, so in jobs:
        q, s = quantize_fp8_block(t)
        if qo is not None:
            out_cpu[qo : qo + q.numel()] = q.view(-1).view(torch.uint8).cpu()
        if so is not None:
            out_cpu[so : so + s.numel() * 4] = s.view(-1).view(torch.uint8).cpu()
    return out_cpu


def _run(dev, nbytes, jobs):
    out = torch.full((nbytes,), FILL, dtype=torch.uint8, device=dev)
    kind = fp8.quantize_into(out, jobs)
    assert kind == "native"
    want = _expected(torch.full((nbytes,), FILL, dtype=torch.uint8), jobs)
    got = out.cpu()
    bad = (got != want).nonzero().view(-1)
    assert bad.numel() == 0, (
        f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}: "
        f"got {got[bad[:8]].tolist()} want {want[bad[:8]].tolist()}"
    )


def _layout(ts, q_align=1, s_align=1, gap=0):
    """Jobs placing each tensor's fp8 bytes then scales one after the other (offsets rounded up
    to q_align / s_align, then moved by `gap` bytes so they are unaligned when gap is odd)."""
    jobs, off = [], 0
    for t in ts:
        r, c = t.shape
        off = -(-off // q_align) * q_align + gap
        qo = off
        off += r * c
        off = -(-off // s_align) * s_align + gap
        so = off
        off += -(-r // 128) * -(-c // 128) * 4
        jobs.append((t, qo, so))
    return jobs, off + 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(128, 128), (300, 260), (1, 4096), (4096, 1), (1, 1), (129, 127), (5, 3), (768, 2048), (256, 136), (2, 7)]
)
def test_one_piece_every_byte(dev, dtype, shape):
    t = _data(shape, dtype, dev, seed=hash(shape) % 1000)
    for q_align, s_align, gap in ((16, 16, 0), (1, 1, 3), (8, 4, 1)):
        jobs, n = _layout([t], q_align, s_align, gap)
        _run(dev, n, jobs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_blocks_and_negative_zero(dev, dtype):
    t = _data((384, 300), dtype, dev, seed=3)
    t[:128, :128] = 0
    t[128:256, 256:] = -0.0
    t[256:, :] = 0
    t[300, 5] = 1e-3
    jobs, n = _layout([t], 1, 1, 1)
    _run(dev, n, jobs)
    _, s = quantize_fp8_block(t)  # the zero blocks took the 1e-12 floor
    floor = (torch.tensor(1e-12, dtype=torch.float32) / 448).item()
    assert s[0, 0].item() == floor and s[1, 2].item() == floor and s[2, 1].item() == floor and s[2, 0].item() > floor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_3d_experts_in_one_launch(dev, dtype):
    w = _data((16, 300, 260), dtype, dev, seed=5)
    jobs, n = _layout([w[e] for e in range(16)], 1, 1, 0)
    _run(dev, n, jobs)
    jobs, n = _layout([w[e, :, 128:] for e in range(16)], 4, 1, 1)  # column halves of experts
    _run(dev, n, jobs)


def test_fused_qkv_pieces_in_one_shard(dev):
    q = _data((512, 384), torch.bfloat16, dev, seed=7)
    k = _data((128, 384), torch.bfloat16, dev, seed=8)
    v = _data((100, 384), torch.bfloat16, dev, seed=9)
    # fp8 shard: q, k, v bytes back to back; scale shard: their scale rows back to back
    jobs, off = [], 0
    for t in (q, k, v):
        jobs.append([t, off, None])
        off += t.numel()
    for j in jobs:
        r, c = j[0].shape
        j[2] = off
        off += -(-r // 128) * -(-c // 128) * 4
    _run(dev, off + 5, [tuple(j) for j in jobs])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tp_slices_and_a_scale_block_straddling_the_boundary(dev, dtype):
    full = _data((640, 520), dtype, dev, seed=11)
    pieces = [
        full[0:256],
        full[256:512],
        full[512:640],  # row slices (TP rank rows)
        full[:, 128:256],
        full[:, 384:520],  # column slices: strided rows
        full[64:320],  # its 128-row blocks straddle
        full[64:192, 200:330],  # the full tensor's grid
        full[:, 3:200],
        full[7:9, 1:2],
        full[639:640, :],
    ]  # unaligned source starts
    jobs, n = _layout(pieces, 1, 1, 1)
    _run(dev, n, jobs)
    gate_up = full[:320], full[320:]  # halves of a fused tensor
    jobs, n = _layout(gate_up, 16, 4, 0)
    _run(dev, n, jobs)


def test_fp8_only_and_scale_only_outputs(dev):
    a = _data((300, 260), torch.bfloat16, dev, seed=13)
    b = _data((130, 140), torch.float16, dev, seed=14)
    jobs = [(a, 0, None), (b, None, 78003), (a, None, 78021), (b, 78101, None)]
    _run(dev, 78101 + b.numel() + 7, jobs)


def test_many_pieces_one_launch_mixed_dtypes_and_untouched_gaps(dev):
    rnd = random.Random(17)
    ts = []
    for i in range(300):
        r = rnd.choice([1, 2, 63, 128, 129, 200, 256, 300])
        c = rnd.choice([1, 3, 64, 128, 130, 256, 384])
        ts.append(_data((r, c), rnd.choice(DTYPES), dev, seed=i))
    jobs, n = _layout(ts, 1, 1, rnd.choice([1, 2, 3]))
    rnd.shuffle(jobs)
    _run(dev, n, jobs)


def test_runs_on_the_current_stream(dev):
    t = _data((1024, 1024), torch.bfloat16, dev, seed=19)
    jobs, n = _layout([t], 16, 16, 0)
    s = torch.cuda.Stream(dev)
    out = torch.full((n,), FILL, dtype=torch.uint8, device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        t2 = t * 1  # produced on s: the kernel must run after it on s
        jobs2 = [(t2, jobs[0][1], jobs[0][2])]
        assert fp8.quantize_into(out, jobs2) == "native"
    s.synchronize()
    want = _expected(torch.full((n,), FILL, dtype=torch.uint8), jobs)
    assert torch.equal(out.cpu(), want)


def test_cuda_bytes_equal_the_cpu_reference(dev):
    t = _data((300, 260), torch.bfloat16, dev, seed=23)
    jobs, n = _layout([t], 1, 1, 1)
    out = torch.zeros(n, dtype=torch.uint8, device=dev)
    fp8.quantize_into(out, jobs)
    cpu = torch.zeros(n, dtype=torch.uint8)
    fp8.quantize_into(cpu, [(t.cpu(), jobs[0][1], jobs[0][2])])
    assert torch.equal(out.cpu(), cpu)


def test_nan_propagates_to_the_block(dev):
    t = _data((256, 256), torch.float32, dev, seed=29)
    t[3, 4] = float("nan")
    jobs, n = _layout([t], 16, 16, 0)
    out = torch.zeros(n, dtype=torch.uint8, device=dev)
    fp8.quantize_into(out, jobs)
    qo, so = jobs[0][1], jobs[0][2]
    q = out[qo : qo + t.numel()].view(torch.float8_e4m3fn).view(256, 256).float()
    s = out[so : so + 16].view(torch.float32).view(2, 2)
    assert torch.isnan(s[0, 0]) and not torch.isnan(s[1:, :]).any() and not torch.isnan(s[0, 1])
    assert torch.isnan(q[:128, :128]).all() and not torch.isnan(q[128:]).any()
    rq, rs = quantize_fp8_block(t)
    assert torch.equal(out[qo : qo + t.numel()].view(256, 256)[128:].cpu(), rq.view(torch.uint8)[128:].cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_itself_is_the_same_on_cuda_and_cpu(dev, dtype):
    # torch on CUDA multiplies by the reciprocal of a Python-scalar divisor; the reference
    # divides by a tensor so that its CUDA and CPU scales (and bytes) agree
    t = _data((1000, 700), dtype, dev, seed=31)
    qg, sg = quantize_fp8_block(t)
    qc, sc = quantize_fp8_block(t.cpu())
    assert torch.equal(sg.cpu().view(torch.int32), sc.view(torch.int32))
    assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8))


def test_forced_reference_on_cuda_gives_the_native_bytes(dev, monkeypatch):
    ts = [_data((300, 260), torch.bfloat16, dev, seed=37), _data((128, 384), torch.float32, dev, seed=38)]
    jobs, n = _layout(ts, 1, 1, 1)
    nat = torch.zeros(n, dtype=torch.uint8, device=dev)
    assert fp8.quantize_into(nat, jobs) == "native"
    monkeypatch.setenv("WXFER_FP8", "reference")
    assert fp8.info(dev) == dict(fp8.info(dev), quantizer="reference", reason="WXFER_FP8=reference")
    ref = torch.zeros(n, dtype=torch.uint8, device=dev)
    assert fp8.quantize_into(ref, jobs) == "reference"
    assert torch.equal(nat, ref)


def test_pack_into_on_cuda_one_launch_per_task_equals_the_cpu_packing(dev, monkeypatch):
    from wxfer.mapping.reference import pack_task
    from wxfer.mapping.rules import Piece, Shard
    from wxfer.runtime import prepare

    fulls = {
        "qkv.q": _data((512, 384), torch.bfloat16, dev, seed=41),
        "qkv.k": _data((128, 384), torch.bfloat16, dev, seed=42),
        "up": _data((300, 384), torch.float32, dev, seed=43),
    }
    pcs = [Piece("qkv.q", 0, 256, 0, 384), Piece("qkv.k", 0, 128, 0, 384), Piece("up", 64, 300, 128, 384)]

    def nb(kind, ps):
        return sum(p.rows * p.cols if kind == "fp8" else -(-p.rows // 128) * -(-p.cols // 128) * 4 for p in ps)

    shards = [
        Shard(0, "w", 0, nb("fp8", pcs), "fp8", "float8_e4m3fn", tuple(pcs)),
        Shard(0, "raw", 0, 10 * 384 * 2, "raw", "bfloat16", (Piece("up", 0, 10, 0, 384),)),
        Shard(0, "w_s", 0, nb("scale", pcs), "scale", "float32", tuple(pcs)),
    ]
    launches = []
    real = fp8._native
    monkeypatch.setattr(fp8, "_native", lambda out, jobs: launches.append(len(jobs)) or real(out, jobs))
    total = sum(s.nbytes for s in shards)
    got = prepare.pack_into(shards, fulls, total, dev)
    assert launches == [3]
    want = pack_task(shards, {k: v.cpu() for k, v in fulls.items()})
    assert torch.equal(got.cpu(), want)


def _edge_tiles(dtype, seed):
    """A 384x512 tensor whose 128x128 tiles stress the division (the kernel divides 16-bit
    sources by multiplying with rcp.rn(scale) and one fma correction): random bit patterns of
    every finite magnitude (subnormals included), exact e4m3 ties and their float neighbours
    under power-of-two scales, tiles below the 1e-12 amax floor, subnormal-only tiles, signed
    zeros inside non-zero tiles, amax at the format's largest finite value."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.empty(384, 512, dtype=torch.float32)
    ib = {
        torch.bfloat16: (torch.int16, 0x7F80),
        torch.float16: (torch.int16, 0x7C00),
        torch.float32: (torch.int32, 0x7F800000),
    }[dtype]
    nbits = 16 if dtype != torch.float32 else 32

    def rand_bits(n):
        hi = 1 << (nbits - 1)
        b = torch.randint(-hi, hi, (n,), generator=g, dtype=torch.int64)
        b = torch.where((b & ib[1]) == ib[1], b & ~(1 << (nbits - 2)), b)  # no inf / NaN
        return b.to(ib[0]).view(dtype).float()

    # tiles (row block, col block): 0,* random bits; 1,0 ties; 1,1 below the floor; 1,2 subnormals; ...
    for c in range(4):
        w[:128, c * 128 : (c + 1) * 128] = rand_bits(128 * 128).view(128, 128)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # +0 .. 448
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact ties
    k = 2.0**-3 if dtype == torch.float16 else 2.0**20
    vals = torch.cat([mids, e4m3, torch.tensor([448.0])]) * k  # amax 448 k: the scale is k
    tie = vals[torch.randint(0, vals.numel(), (128 * 128,), generator=g)]
    tie = tie * torch.where(torch.rand(128 * 128, generator=g) < 0.5, -1.0, 1.0)
    tie[:3] = torch.tensor([448.0 * k, -448.0 * k, 0.0])
    w[128:256, 0:128] = tie.view(128, 128)
    tiny = 1e-13 if dtype != torch.float16 else 0.0
    w[128:256, 128:256] = torch.randn(128, 128, generator=g) * tiny
    sub = {torch.bfloat16: 1e-39, torch.float16: 3e-6, torch.float32: 1e-40}[dtype]
    w[128:256, 256:384] = torch.randn(128, 128, generator=g) * sub
    mixed = torch.randn(128, 128, generator=g)
    mixed[::3, ::2] = -0.0
    mixed[1::5] *= sub
    w[128:256, 384:512] = mixed
    fmax = torch.finfo(dtype).max
    big = torch.randn(128, 512, generator=g).clamp(-4, 4) * (fmax / 4)
    big[0, ::128] = fmax
    big[1, 1::128] = -fmax
    w[256:384] = big
    t = w.to(dtype)
    if dtype != torch.float32:
        t[128:256, 0:128] = tie.view(128, 128).to(dtype)  # exact in 16 bits: 5 significant bits
    return t


@pytest.mark.parametrize("dtype", DTYPES)
def test_division_edge_cases_every_byte(dev, dtype):
    for seed in range(3):
        t = _edge_tiles(dtype, seed)
        assert torch.isfinite(t.float()).all()
        t = t.to(dev)
        for q_align, s_align, gap in ((16, 16, 0), (1, 1, 3)):
            jobs, n = _layout([t], q_align, s_align, gap)
            _run(dev, n, jobs)
        jobs, n = _layout([t[1:, 3:], t[:, 129:300]], 1, 1, 1)  # unaligned rows: other tiles
        _run(dev, n, jobs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_against_many_scales(dev, dtype):
    # every finite bf16 / fp16 value x once per tile, in tiles whose amax is one of many
    # magnitudes (the first element of each tile): all significand pairs the kernel meets
    allb = torch.arange(-32768, 32768, dtype=torch.int64).to(torch.int16).view(dtype).float()
    allb = allb[torch.isfinite(allb)]
    g = torch.Generator(device="cpu").manual_seed(43)
    tiles = []
    for i in range(24):
        amax = float(allb.abs().max()) * 2.0 ** -float(torch.randint(0, 30, (1,), generator=g))
        x = allb[allb.abs() <= amax]
        x = x[torch.randperm(x.numel(), generator=g)]
        x = torch.cat([torch.tensor([amax]), x])[: 128 * 128]
        tiles.append(torch.nn.functional.pad(x, (0, 128 * 128 - x.numel())).view(128, 128))
    t = torch.cat(tiles, 1).to(dtype).to(dev)
    jobs, n = _layout([t], 16, 16, 0)
    _run(dev, n, jobs)


@pytest.mark.parametrize("npieces", [1, 8, 9])
def test_table_in_the_launch_parameters_or_in_device_memory(dev, monkeypatch, npieces):
    # <= 8 pieces travel in the launch's parameters, more in a device table; both give the
    # reference bytes, and forcing the device table for a small launch does too
    ts = [_data((130 + 7 * i, 260 - 5 * i), DTYPES[i % 3], dev, seed=60 + i) for i in range(npieces)]
    jobs, n = _layout(ts, 1, 1, 1)
    _run(dev, n, jobs)
    monkeypatch.setattr(fp8, "_INLINE", 0)
    _run(dev, n, jobs)


def test_pack_into_reuses_the_piece_table_while_the_sources_stay(dev):
    """A task's second and later packings launch with the piece table of the first (the
    Sender's shards are the same objects every push): the bytes follow the sources' new
    contents in place, and a source at a new address builds a new table."""
    from wxfer.mapping.reference import pack_task
    from wxfer.mapping.rules import Piece, Shard
    from wxfer.runtime import prepare

    E, inter, hidden = 12, 128, 256
    gu = _data((E, 2 * inter, hidden), torch.bfloat16, dev, seed=51)
    pcs = [Piece("gu", r, r + inter, 0, hidden) for r in range(0, E * 2 * inter, inter)]  # 24 pieces
    q = sum(p.rows * p.cols for p in pcs)
    s = sum(-(-p.rows // 128) * -(-p.cols // 128) * 4 for p in pcs)
    shards = [
        Shard(0, "w13", 0, q, "fp8", "float8_e4m3fn", tuple(pcs)),
        Shard(0, "w13_s", 0, s, "scale", "float32", tuple(pcs)),
    ]
    before = len(fp8._TABLES)
    for step in range(3):
        got = prepare.pack_into(shards, {"gu": gu}, q + s, dev)
        assert torch.equal(got.cpu(), pack_task(shards, {"gu": gu.cpu()})), step
        gu.mul_(-1.5)  # new contents, same memory
    assert len(fp8._TABLES) == before + 1  # one table, reused twice
    moved = gu.clone()
    got = prepare.pack_into(shards, {"gu": moved}, q + s, dev)
    assert torch.equal(got.cpu(), pack_task(shards, {"gu": moved.cpu()}))
    assert len(fp8._TABLES) == before + 2
