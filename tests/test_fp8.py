"""wxfer.runtime.fp8 without a GPU: the fallback writes the reference bytes (quantize_fp8_block)
at any offsets, info() names why the native kernel is not used, the native piece table is
validated (wx_fp8_check) with errors naming the piece, and Sender.stats() reports the
quantizer. The kernel itself: tests/test_fp8_kernel.py (gpu)."""

import array

import pytest
import torch

from wxfer.mapping.reference import quantize_fp8_block
from wxfer.runtime import fp8

_wx = pytest.importorskip("wxfer._wxfer")


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def test_fallback_writes_the_reference_bytes_at_unaligned_offsets():
    g = torch.Generator().manual_seed(3)
    full = torch.randn(300, 520, generator=g).to(torch.bfloat16)
    experts = torch.randn(4, 130, 260, generator=g, dtype=torch.float32)
    jobs_t = [
        full[64:320, 3:200],
        full[:, 128:256],
        experts[2],
        experts[1, :, 5:6],
        torch.randn(1, 77, generator=g).to(torch.float16),
        torch.randn(9, 9, generator=g).double(),
    ]
    out = torch.full((400_000,), 0xA5, dtype=torch.uint8)
    want = out.clone()
    jobs, off = [], 1
    for i, t in enumerate(jobs_t):
        q, s = quantize_fp8_block(t)
        qo = off if i != 4 else None  # one job writes only its scales
        if qo is not None:
            want[qo : qo + q.numel()] = _bytes(q)
            off += q.numel() + 3
        so = off
        want[so : so + s.numel() * 4] = _bytes(s)
        off += s.numel() * 4 + 1
        jobs.append((t, qo, so))
    assert fp8.quantize_into(out, jobs) == "reference"
    assert torch.equal(out, want)
    assert fp8.last()["quantizer"] == "reference" and "cpu" in fp8.last()["reason"]


def test_fallback_checks_offsets_and_shapes():
    out = torch.zeros(1000, dtype=torch.uint8)
    t = torch.randn(20, 30)
    with pytest.raises(ValueError, match=r"job 0 \(20x30\): its fp8 bytes \[500, 1100\)"):
        fp8.quantize_into(out, [(t, 500, None)])
    with pytest.raises(ValueError, match=r"its scale bytes \[998, 1002\)"):
        fp8.quantize_into(out, [(t, 0, 998)])
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_into(out, [(torch.randn(4), 0, None)])
    with pytest.raises(ValueError, match="uint8"):
        fp8.quantize_into(out.view(torch.int8), [(t, 0, None)])
    assert fp8.quantize_into(out, [(torch.empty(0, 30), 0, 4)]) == "reference"  # nothing to do


def test_info_names_why_the_native_kernel_is_not_used(monkeypatch):
    inf = fp8.info()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the reason is tested by tests/test_fp8_kernel.py")
    assert inf["quantizer"] == "reference"
    assert "no CUDA device" in inf["reason"]
    assert fp8.info("cpu")["reason"].startswith("tensors on cpu")
    monkeypatch.setenv("WXFER_FP8", "reference")
    assert fp8.info("cpu")["reason"] == "WXFER_FP8=reference"
    monkeypatch.setenv("WXFER_FP8", "fast")
    assert "expected native or reference" in fp8.info("cpu")["reason"]
    assert {"native_calls", "reference_calls"} <= set(inf)


def test_probe_says_why_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ok, why = _wx.fp8_probe(0, ["/nonexistent"])
    assert ok is False
    assert "libcuda" in why or "cuda.h" in why or "cuInit" in why, why


def _piece(src=0x10000, dtype=0, ld=260, rows=300, cols=260, q=0, s=-1, tile0=0):
    return [src, dtype, ld, rows, cols, q, s, tile0]


def test_piece_table_is_validated_naming_the_piece():
    ok = array.array("q", _piece(q=0, s=78000) + _piece(dtype=2, rows=1, cols=1, q=78036, s=-1, tile0=9))
    assert _wx.fp8_check(ok, 78037) == 10
    cases = [
        (_piece(dtype=3), "piece 0: dtype code 3"),
        (_piece(rows=0), "piece 0: rows 0"),
        (_piece(src=0x10001), "piece 0: source address 0x10001 is not bfloat16-aligned"),
        (_piece(q=-1, s=-1), "neither fp8 bytes nor scales"),
        (_piece(q=1), "its fp8 bytes \\[1, 1 \\+ 78000\\) are not inside the 78000-byte output"),
        (_piece(q=-1, s=77990), "its scale bytes"),
        (_piece(q=-5), "its fp8 bytes \\[-5"),
        (_piece(tile0=1), "tile0 1, expected 0"),
    ]
    for p, msg in cases:
        with pytest.raises(_wx.Error, match=msg):
            _wx.fp8_check(array.array("q", p), 78000)
    with pytest.raises(_wx.Error, match="piece 1: tile0 0, expected 9"):
        _wx.fp8_check(array.array("q", _piece() + _piece()), 10**6)
    with pytest.raises(ValueError, match="pieces of 64 bytes"):
        _wx.fp8_check(array.array("q", [1, 2, 3]), 100)
    with pytest.raises(_wx.Error, match="tiles in one launch"):
        _wx.fp8_check(array.array("q", _piece(rows=1 << 36, cols=1 << 36, q=-1, s=0)), 1 << 62)


def test_pack_into_quantizes_each_piece_once_for_its_fp8_and_scale_shards(monkeypatch):
    from wxfer.mapping.reference import pack_task
    from wxfer.mapping.rules import Piece, Shard
    from wxfer.runtime import prepare

    g = torch.Generator().manual_seed(5)
    fulls = {
        "w": torch.randn(300, 260, generator=g).to(torch.bfloat16),
        "e": torch.randn(256, 384, generator=g).to(torch.bfloat16),
    }
    pw, pe1, pe2 = Piece("w", 0, 300, 0, 260), Piece("e", 0, 128, 0, 384), Piece("e", 128, 256, 128, 384)

    def nb(kind, pcs):
        return sum(p.rows * p.cols if kind == "fp8" else -(-p.rows // 128) * -(-p.cols // 128) * 4 for p in pcs)

    shards = [
        Shard(0, "a", 0, nb("fp8", [pw, pe1]), "fp8", "float8_e4m3fn", (pw, pe1)),
        Shard(0, "r", 0, 300 * 260 * 2, "raw", "bfloat16", (pw,)),
        Shard(0, "b", 0, nb("fp8", [pe2]), "fp8", "float8_e4m3fn", (pe2,)),
        Shard(0, "a_s", 0, nb("scale", [pw, pe1]), "scale", "float32", (pw, pe1)),
        Shard(1, "b_s", 0, nb("scale", [pe2]), "scale", "float32", (pe2,)),
    ]
    calls = []
    real, real_cached = fp8.quantize_into, fp8.quantize_cached
    monkeypatch.setattr(fp8, "quantize_into", lambda out, jobs: calls.append(list(jobs)) or real(out, jobs))
    monkeypatch.setattr(
        fp8,
        "quantize_cached",  # pack_into's call: its jobs, once
        lambda out, key, build: calls.append(list(build())) or real_cached(out, key, build),
    )
    total = sum(s.nbytes for s in shards)
    got = prepare.pack_into(shards, fulls, total, torch.device("cpu"))
    assert torch.equal(got, pack_task(shards, fulls))
    assert len(calls) == 1 and len(calls[0]) == 3  # one call, one job per piece
    assert all(qo is not None and so is not None for _, qo, so in calls[0])
    calls.clear()
    out = torch.zeros(shards[3].nbytes, dtype=torch.uint8)
    assert prepare.pack_shard_into(shards[3], fulls, out, 0) == shards[3].nbytes
    assert torch.equal(out, pack_task([shards[3]], fulls))
    assert len(calls) == 1 and all(qo is None for _, qo, _ in calls[0])


def test_sender_stats_report_the_quantizer():
    from wxfer.runtime.sender import _quantizer_stats

    d = _quantizer_stats(torch.device("cpu"))
    assert d["quantizer"] in ("native", "reference") and d["reason"]
    fp8.quantize_into(torch.zeros(64, dtype=torch.uint8), [(torch.ones(4, 4), 0, 16)])
    d = _quantizer_stats(torch.device("cpu"))
    assert d["quantizer"] == "reference" and d["reference_calls"] >= 1


def test_launch_without_a_device_table_takes_at_most_8_pieces():
    # up to 8 pieces travel in the launch's parameters (device table address 0); more need a
    # device table: refused before any CUDA call, naming the count
    tab, tiles = [], 0
    for i in range(9):
        tab += _piece(rows=128, cols=128, q=i * 16384, s=-1, tile0=tiles)
        tiles += 1
    with pytest.raises(_wx.Error, match="null piece table address with 9 pieces \\(at most 8"):
        _wx.fp8_launch(0, 0, 0x20000, 9 * 16384, array.array("q", tab), 0)
    with pytest.raises(_wx.Error, match="null output address"):
        _wx.fp8_launch(0, 0, 0, 9 * 16384, array.array("q", tab), 0)
