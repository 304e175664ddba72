"""The two baselines of bench_baselines.py (issue 7), one step each: the rank-0 pattern (buckets
of whole components broadcast from the trainer, double-buffered; colocated: a shared CUDA IPC
bucket pair) and the per-tensor pattern (one call and one transfer per training tensor); the
messages between the trainer (rank 0) and the inference rank (1) they use."""

from __future__ import annotations

import pickle

from common.baselines import as_bytes, sync_dev


def buckets(ex, sizes: dict, bucket_bytes: int):
    """Components grouped into buckets of about bucket_bytes (a component never split; a
    bucket grows to hold the largest one): (capacity, [(used bytes, [(component, {src: offset})])])."""
    comps = [c for c in ex.components if c.shards]
    biggest = max(sum(_align(sizes[s]) for s in c.sources) for c in comps)
    cap = max(bucket_bytes, biggest)
    out, cur, used = [], [], 0
    for c in comps:
        need = sum(_align(sizes[s]) for s in c.sources)
        if cur and used + need > cap:
            out.append((used, cur))
            cur, used = [], 0
        offs = {}
        for s in c.sources:
            offs[s] = used
            used += _align(sizes[s])
        cur.append((c, offs))
    if cur:
        out.append((used, cur))
    return cap, out


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


class _Link:
    """Synchronization and messages between the trainer (0) and the inference rank (1)."""

    def __init__(self, rank):
        import torch
        import torch.distributed as dist

        self.dist, self.torch, self.rank = dist, torch, rank
        self.pending = []  # signals sent, not yet known to be received

    def barrier(self):
        t = self.torch.zeros(1)
        self.dist.all_reduce(t)  # CPU tensor: gloo

    def obj(self, o=None, src=0):
        lst = [o]
        self.dist.broadcast_object_list(lst, src=src, device=self.torch.device("cpu"))  # gloo
        return lst[0]

    def bcast(self, t, async_op=True):
        return self.dist.broadcast(t, src=0, async_op=async_op)


def _fulls_in(bucket_t, offs, sizes, meta):

    out = {}
    for s, o in offs.items():
        shape, dt = meta[s]
        out[s] = bucket_t[o : o + sizes[s]].view(dt).view(shape)
    return out


def _write_component(c, fulls, params):
    from wxfer.runtime import prepare

    for sh in c.shards:
        if sh.rank == 0:
            prepare.pack_shard_into(sh, fulls, as_bytes(params[sh.dst]), sh.offset)


def _rank0(link, ex, params, sizes, meta, dev, a, ipc, step):
    """The rank-0 pattern, one step."""
    from wxfer.runtime import prepare

    cap, plan = _rank0_plan(ex, sizes, a)
    st = _state(link, "rank0", lambda: _rank0_buffers(link, cap, dev, ipc))
    bufs = st["bufs"]
    works = [None] * len(plan)
    for k, (used, bucket) in enumerate(plan):
        b = bufs[k % 2][:used]  # only the filled part moves
        if link.rank == 0:
            if k >= 2:  # double buffering: slot k % 2 free again
                if ipc:
                    _flag(link, 1, ACK + k - 2)  # the inference rank copied bucket k - 2 out
                else:
                    works[k - 2].wait()
            for c, offs in bucket:
                for s, o in offs.items():
                    full = prepare.full_tensor(params[s], params[s])  # one trainer rank: itself
                    b[o : o + sizes[s]].view(full.dtype).view(full.shape).copy_(full)
            if ipc:
                sync_dev(dev)
                _flag(link, 0, READY + k)
            else:
                works[k] = link.bcast(b)
        else:
            if ipc:
                _flag(link, 0, READY + k)
            else:
                link.bcast(b).wait()
            for c, offs in bucket:
                _write_component(c, _fulls_in(b, offs, sizes, meta), params)
            if ipc:
                sync_dev(dev)
                _flag(link, 1, ACK + k)
    if link.rank == 0:
        for w in works:
            if w is not None:
                w.wait()
        if ipc:  # the last two slots' acknowledgements
            for k in range(max(0, len(plan) - 2), len(plan)):
                _flag(link, 1, ACK + k)
    _drain(link)


def _flag(link, src, tag):
    """A point-to-point signal from rank `src` to the other rank (gloo, matched by tag)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(1)
    if link.rank == src:  # not blocking: gloo matches a send with its receive
        link.pending.append((dist.isend(t, dst=1 - src, tag=tag), t))
    else:
        dist.recv(t, src=src, tag=tag)


def _drain(link):
    for w, _ in link.pending:
        w.wait()
    link.pending.clear()


def _share(obj) -> bytes:
    """Tensors pickled as shared-memory handles (CUDA IPC; CPU: file_system shared memory)."""
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401 -- registers the tensor reductions

    return bytes(ForkingPickler.dumps(obj))


_STATE: dict = {}


READY, ACK = 1 << 20, 1 << 21  # p2p tags of the shared-bucket handshake


def _state(link, key, make):
    """Per-configuration state made on the first step (buffers, IPC handles opened once)."""
    if key not in _STATE:
        _STATE[key] = make()
    return _STATE[key]


def _rank0_plan(ex, sizes, a):
    k = ("plan", id(ex))
    if k not in _STATE:
        _STATE[k] = buckets(ex, sizes, a["bucket"])
    return _STATE[k]


def _rank0_buffers(link, cap, dev, ipc):
    import torch

    if not ipc:
        return dict(bufs=[torch.empty(cap, dtype=torch.uint8, device=dev) for _ in range(2)])
    if link.rank == 0:
        bufs = [torch.empty(cap, dtype=torch.uint8, device=dev) for _ in range(2)]
        link.obj(_share(bufs))
    else:
        bufs = pickle.loads(link.obj(None))
    return dict(bufs=bufs)


def _per_tensor(link, ex, params, sizes, meta, dev, a, ipc, step):
    """The per-tensor pattern, one step: per training tensor one call (a pickled message)
    and one transfer; the inference rank writes a fused parameter once its sources are in."""
    import torch

    comps = _STATE.setdefault(("comps", id(ex)), [c for c in ex.components if c.shards])
    if link.rank == 0:
        for c in comps:
            for s in c.sources:
                t = params[s]
                if ipc:
                    link.obj((s, _share(t)))
                else:
                    link.obj(s)
                    link.bcast(t, async_op=False)
        if ipc:
            _flag(link, 1, ACK)
        return
    for c in comps:
        fulls = {}
        for _ in c.sources:
            if ipc:
                s, blob = link.obj(None)
                fulls[s] = pickle.loads(blob)
            else:
                s = link.obj(None)
                shape, dt = meta[s]
                t = torch.empty(shape, dtype=dt, device=dev)
                link.bcast(t, async_op=False)
                fulls[s] = t
        _write_component(c, fulls, params)
    if ipc:
        sync_dev(dev)
        _flag(link, 1, ACK)
        _drain(link)
