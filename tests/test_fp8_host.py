"""The host FP8 quantizer (csrc/prepare/wx_fp8_host.c through wxfer.runtime.fp8 on CPU tensors)
gives the reference's bytes (wxfer.mapping.reference.quantize_fp8_block): every e4m3 code and
every midpoint between two codes (ties to even), random floats, BF16 / F16 / F32 pieces of odd
shapes and column slices, tiny values (e4m3 subnormals) and signed zeros; WXFER_FP8=reference
keeps torch."""

import pytest
import torch

from wxfer.mapping.reference import quantize_fp8_block
from wxfer.runtime import fp8


def _host(w, monkeypatch=None):
    rows, cols = w.shape
    nq, ns = rows * cols, -(-rows // 128) * -(-cols // 128) * 4
    out = torch.zeros(nq + ns + 3, dtype=torch.uint8)
    assert fp8._host(out, [(w, 1, 1 + nq)])
    return out[1 : 1 + nq], out[1 + nq : 1 + nq + ns]


def test_the_conversion_rounds_as_torch_at_every_code_and_midpoint():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = codes[torch.isfinite(codes)].unique().double()
    mids = (v[:-1] + v[1:]) / 2  # exact in float32: ties, to even
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0x30000000, 0x43E00001, (200_000,), dtype=torch.int64, generator=g).to(torch.int32)
    x = torch.cat([v.float(), mids.float(), rnd.view(torch.float32), torch.tensor([0.0, -0.0, 1e-30])])
    x = torch.cat([x, -x]).clamp(-448, 448)
    n = x.numel() // 127 * 127
    # each row's first element 448: every block's amax is 448, its scale exactly 1
    piece = torch.cat([torch.full((n // 127, 1), 448.0), x[:n].view(-1, 127)], 1).contiguous()
    q, s = _host(piece)
    rq, rs = quantize_fp8_block(piece)
    assert torch.equal(rs, torch.ones_like(rs))
    assert torch.equal(q, rq.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (128, 128), (130, 257)])
def test_pieces_equal_the_reference(dt, shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = (torch.randn(shape[0], shape[1] + 5, generator=g) * 0.02).to(dt)
    if shape[0] > 2:
        w[1] *= 1e-6  # e4m3 subnormals after scaling
        w[2, :3] = -0.0
    w = w[:, 2 : 2 + shape[1]]  # a column slice: row pitch > cols
    q, s = _host(w)
    rq, rs = quantize_fp8_block(w)
    assert torch.equal(q, rq.reshape(-1).view(torch.uint8))
    assert torch.equal(s, rs.reshape(-1).view(torch.uint8))


def test_quantize_into_uses_it_unless_the_reference_is_asked_for(monkeypatch):
    w = torch.randn(130, 140).to(torch.bfloat16)
    out = torch.empty(130 * 140 + 4 * 4, dtype=torch.uint8)
    fp8.quantize_into(out, [(w, 0, 130 * 140)])
    assert "host quantizer" in fp8.last()["reason"]
    ref = out.clone()
    monkeypatch.setenv("WXFER_FP8", "reference")
    out.zero_()
    fp8.quantize_into(out, [(w, 0, 130 * 140)])
    assert "host quantizer" not in fp8.last()["reason"]
    assert torch.equal(out, ref)


def test_a_source_whose_rows_overlap_or_an_out_not_contiguous_is_left_to_the_reference():
    """The host quantizer reads rows `ld` apart: an expanded view (row stride 0) or a
    non-contiguous out is not its to take (fp8._host declines; the reference quantizes it)."""
    row = torch.randn(1, 300, dtype=torch.bfloat16)
    w = row.expand(4, 300)  # stride(0) == 0: every row the same memory
    out = torch.zeros(4 * 300 + 3 * 4 + 8, dtype=torch.uint8)
    assert not fp8._host(out, [(w, 0, 4 * 300)])
    q, _ = _host(w.contiguous())  # what the reference of the same values gives
    rq, _ = quantize_fp8_block(w.contiguous())
    assert torch.equal(q, rq.reshape(-1).view(torch.uint8))
    strided = torch.zeros(2 * (300 + 8), dtype=torch.uint8)[::2]
    assert not fp8._host(strided, [(row, 0, 300)])
