"""Reference contents of destination shards, computed with plain torch ops.

This is the definition of "what the mapping says the receiver should hold": given the
full (unsharded) training tensors of a task, `pack_shard` returns the exact bytes a
shard must contain, and `pack_task` the packed buffer a trainer rank sends.  The
prepare stage may compute the same thing faster; it must match these bytes exactly.

FP8: each piece is quantized on its own 128x128 grid; per block
``scale_inv = max(amax(|w|), 1e-12) / 448`` in float32 (IEEE division, on every device) and
``fp8 = clamp(w / scale_inv, -448, 448).to(float8_e4m3fn)``, so that
``w ~= fp8.float() * scale_inv``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .rules import BLOCK, Piece, Shard

FP8_MAX = 448.0


def _torch():
    import torch

    return torch


def quantize_fp8_block(w, block: int = BLOCK):
    """(fp8 e4m3 tensor, float32 scale_inv [ceil(rows/128), ceil(cols/128)]) of a 2-D tensor."""
    torch = _torch()
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D tensor, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    wf = w.detach().to(torch.float32)
    pad = torch.zeros(rb * block, cb * block, dtype=torch.float32, device=w.device)
    pad[:rows, :cols] = wf
    blocks = pad.view(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # IEEE division by a tensor: torch on CUDA turns `x / python_scalar` into x * (1 / 448),
    # which can differ from x / 448 in the last bit; this way CPU, CUDA and the native kernel
    # (wxfer.runtime.fp8) give the same scales.
    scale = torch.clamp(amax, min=1e-12) / torch.full_like(amax, FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(rb * block, cb * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.to(torch.float32).contiguous()


def dequantize_fp8_block(q, scale, block: int = BLOCK):
    torch = _torch()
    rows, cols = q.shape
    s = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.to(torch.float32) * s


def _piece_tensor(p: Piece, tensors: Mapping):
    try:
        t = tensors[p.src]
    except KeyError:
        raise KeyError(f"full tensor for {p.src!r} not supplied") from None
    if t.dim() == 1:
        return t[p.r0 : p.r1]
    if t.dim() == 3:  # fused experts [E, rows, cols]: pieces address [E x rows, cols]
        t = t.reshape(-1, t.shape[-1])
    return t[p.r0 : p.r1, p.c0 : p.c1]


def _as_bytes(t):
    torch = _torch()
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def pack_shard(shard: Shard, tensors: Mapping):
    """The bytes (uint8 1-D tensor) shard `shard` must hold, from full training tensors."""
    torch = _torch()
    parts = []
    for p in shard.pieces:
        t = _piece_tensor(p, tensors)
        if shard.kind == "raw":
            parts.append(_as_bytes(t.to(getattr(torch, shard.dtype))))
        else:
            q, s = quantize_fp8_block(t)
            parts.append(_as_bytes(q if shard.kind == "fp8" else s))
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    if out.numel() != shard.nbytes:
        raise AssertionError(f"shard {shard.dst}@{shard.offset}: packed {out.numel()} bytes, expected {shard.nbytes}")
    return out


def pack_task(shards: Sequence[Shard], tensors: Mapping):
    """Packed buffer: the shards' bytes concatenated in the given order."""
    torch = _torch()
    bufs = [pack_shard(s, tensors) for s in shards]
    return torch.cat(bufs) if bufs else torch.empty(0, dtype=torch.uint8)
