"""Reference bytes for a plan: what a sender's packed buffer holds and what every
inference GPU must hold after an update, from the full training tensors (torch on CPU).

The end-to-end test compares the receivers' memory with `expected_destination`, and a
prepare stage can be checked against `packed_buffer`.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..mapping import pack_shard


def packed_buffer(plan, rank: int, task: int, tensors: Mapping):
    """uint8 tensor: the packed buffer `rank` sends for `task` (offsets = src_offset)."""
    import torch

    parts = []
    pos = 0
    for off, sh in plan.packed_shards(rank, task):
        if off != pos:
            raise AssertionError(f"packed buffer of rank {rank} task {task} has a hole at {pos}")
        b = pack_shard(sh, tensors)
        parts.append(b)
        pos += b.numel()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def expected_destination(plan, gpu: int, tensors: Mapping) -> dict:
    """name -> uint8 tensor: every destination parameter of inference GPU `gpu`, built by
    replaying the plan's transfers from the reference packed buffers."""
    import torch

    rep, rank = (int(x[0]) for x in np.nonzero(plan.gpu_of == gpu))
    out = {}
    for d in np.flatnonzero(plan.dest_nbytes[rank] >= 0):
        out[plan.names[d]] = torch.zeros(int(plan.dest_nbytes[rank, d]), dtype=torch.uint8)
    sel = np.flatnonzero((plan.replica == rep) & (plan.infer_rank == rank))
    cache = {}
    for i in sel:
        key = (int(plan.sender[i]), int(plan.task[i]))
        if key not in cache:
            cache[key] = packed_buffer(plan, key[0], key[1], tensors)
        src, n = int(plan.src_offset[i]), int(plan.nbytes[i])
        o = int(plan.dst_offset[i])
        out[plan.names[plan.dst[i]]][o : o + n] = cache[key][src : src + n]
    return out
