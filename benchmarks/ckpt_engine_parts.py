"""The pieces of benchmarks/bench_ckpt_engine.py that do not depend on its processes:
deterministic training weights (plain tensors and an FSDP2 CPU-offloaded model holding the
same bytes), per-parameter fingerprints and the reference packing's fingerprints, the
inference-side load_fn checkpoint-engine calls (``Loader``) and a reader of
checkpoint-engine's own log lines (``LogTap``)."""

from __future__ import annotations

import re
import sys
import time
import zlib

from common import baselines as bb  # noqa: E402  -- _sync_dev

CH = 1 << 24  # fingerprint chunk (bytes)


# --------------------------------------------------------------------------- steps


def step_name(s) -> str:
    return "%s-%s-%s:%s" % (s["model"], s["quant"], s["job"], s["method"])


def wait_any(ctl, keys, what: str, timeout: float):
    """The first of `keys` present in the store (polled, bounded)."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        for k in keys:
            if ctl.check(k):
                return k
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what} (store keys {keys})")
        time.sleep(delay)
        delay = min(2 * delay, 0.02)


def _med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _summ(times, nbytes):
    med = _med(times)
    return dict(seconds=med, best=min(times), times=times, gbps=nbytes / med / 1e9)


# --------------------------------------------------------------------------- weights and checks


def weight(name: str, shape, dtype, dev):
    """Training tensor `name`: deterministic per name, the same wherever it is made."""
    import torch

    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(tuple(shape), generator=g, device=dev, dtype=torch.float32)
    t = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(0.02)
    return t.to(dtype)


def train_weights(preset, conf, dev) -> dict:
    import torch

    return {n: weight(n, s, getattr(torch, dt), dev) for n, (s, dt, _) in preset.hf_params(conf).items()}


def fused_or_plain(name: str, shape, dtype, dev):
    """The training tensor `name`, where transformers 5's fused experts hold the same bytes as
    the per-expert tensors of train_weights: gate_up_proj[e] = [gate_e | up_e] (rows), down_proj[e]
    = down_e. So both jobs' trainers (plain tensors with per-expert names, transformers' class
    with fused ones) give the receivers the same bytes."""
    import torch

    pre, _, last = name.rpartition(".")
    if pre.endswith("mlp.experts") and last in ("gate_up_proj", "down_proj"):
        E = shape[0]
        if last == "down_proj":
            parts = [weight(f"{pre}.{e}.down_proj.weight", shape[1:], dtype, dev) for e in range(E)]
        else:
            half = (shape[1] // 2, shape[2])
            parts = [
                torch.cat(
                    [
                        weight(f"{pre}.{e}.gate_proj.weight", half, dtype, dev),
                        weight(f"{pre}.{e}.up_proj.weight", half, dtype, dev),
                    ]
                )
                for e in range(E)
            ]
        return torch.stack(parts)
    return weight(name, shape, dtype, dev)


SLAB = 2 << 30  # pinned slab (a power of two: torch's pinned allocator rounds each allocation up to one)


def fsdp_model(preset, conf, dev, phases: dict | None = None, log=None):
    """An FSDP2 model (world 1) under CPUOffloadPolicy holding the same bytes as train_weights,
    built with one host copy of the weights: transformers' class on the meta device,
    fully_shard (offload) there, then every sharded parameter placed in pinned host slabs
    (place_shards) and filled one parameter at a time (made on `dev`, as the reference's, and
    copied into its shard).  `phases` gets the seconds of each step and the bytes; log(phase,
    seconds) is called as each ends."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import shard_fsdp2, train_model

    ph = phases if phases is not None else {}
    t = [time.perf_counter()]

    def done(key):
        ph[key] = time.perf_counter() - t[0]
        if log is not None:
            log(key[:-2], ph[key])
        t[0] = time.perf_counter()

    with torch.device("meta"):
        model = train_model(conf).to(torch.bfloat16)  # transformers' own class (experts fused)
    done("meta_build_s")
    shard_fsdp2(model, init_device_mesh(dev.type, (1,)), offload=True)
    done("fully_shard_s")
    ph.update(place_shards(model, pin=dev.type == "cuda"))
    done("pinned_slabs_s" if dev.type == "cuda" else "host_slabs_s")
    want = preset.hf_params(conf, fused_experts=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n not in want or tuple(want[n][0]) != tuple(p.shape):
                raise RuntimeError(f"model parameter {n} {tuple(p.shape)} is not in the preset's shapes")
            p._local_tensor.copy_(fused_or_plain(n, p.shape, p.dtype, dev))
    bb.sync_dev(dev)
    done("fill_s")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model


def slab_layout(sizes: list, slab: int = SLAB, align: int = 4096) -> tuple:
    """First-fit decreasing of byte sizes into slabs of `slab` bytes (a larger item gets a
    slab of its own size): ([slab sizes], [(slab, offset)] per item)."""
    order = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    used: list = []
    cap: list = []
    where: list = [None] * len(sizes)
    for k in order:
        n = -(-sizes[k] // align) * align
        for j, u in enumerate(used):
            if u + n <= cap[j]:
                where[k] = (j, u)
                used[j] += n
                break
        else:
            where[k] = (len(used), 0)
            used.append(n)
            cap.append(max(slab, n))
    return used, where


def place_shards(model, pin: bool) -> dict:
    """The meta sharded parameters of an FSDP2 model under CPUOffloadPolicy given host memory:
    views into a few pinned slabs (slab_layout), through nn.Module._apply as to_empty does
    (FSDP2 then keeps them: already pinned, nothing copied).  FSDP2's own to_empty(cpu) path
    pins each parameter by itself, rounded up to a power of two (qwen3-30b-a3b: 81 GB pinned
    for 61 GB of weights)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for _, p in model.named_parameters()]
    locs = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
    sizes = [t.numel() * t.element_size() for t in locs]
    used, where = slab_layout(sizes)
    slabs = [torch.empty(u, dtype=torch.uint8, pin_memory=pin) for u in used]
    view = {}
    for p, t, n, (j, off) in zip(params, locs, sizes, where):
        v = slabs[j][off : off + n].view(t.dtype).view(t.shape)
        # DTensor(...) as FSDP2 makes its sharded parameters: from_local would move `v` to the mesh's device
        view[id(p)] = DTensor(v, p._spec, requires_grad=False) if isinstance(p, DTensor) else v

    def fn(t):
        got = view.get(id(t))
        return got if got is not None else torch.empty_like(t, device="cpu")  # buffers

    model._apply(fn)
    bases = {s.data_ptr() for s in slabs}
    moved = [
        n
        for n, p in model.named_parameters()
        if (p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr() not in bases
    ]
    if moved:
        raise RuntimeError(f"FSDP2 did not keep the placed shards of {moved[:3]}")
    return dict(param_bytes=sum(sizes), host_bytes=sum(pinned_size(u) if pin else u for u in used), slabs=len(used))


def pinned_size(n: int) -> int:
    """What torch's pinned (caching host) allocator takes for an n-byte request: the next power of two."""
    return 1 << max(0, (n - 1).bit_length())


def host_avail_gb():
    """MemAvailable of /proc/meminfo in GB (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def rss_peak_gb() -> float:
    """This process's peak resident set (getrusage: kilobytes on Linux) in GB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class _Plain:
    """What wxfer.Sender needs of a model: named_parameters() (plain tensors, one rank)."""

    def __init__(self, params: dict):
        self._p = params

    def named_parameters(self):
        return list(self._p.items())


def _u8(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


_AR: dict = {}


def _range_sums(b, p0: int):
    """(sum of bytes, sum of (position + 1) * byte) of the uint8 tensor `b` lying at byte `p0`
    of its parameter, as device int64 scalars (wrapping: compared modulo 2**64)."""
    import torch

    ar = _AR.get(b.device)
    if ar is None:
        ar = _AR[b.device] = torch.arange(1, CH + 1, dtype=torch.int64, device=b.device)
    s0 = torch.zeros((), dtype=torch.int64, device=b.device)
    s1 = torch.zeros((), dtype=torch.int64, device=b.device)
    for k in range(0, b.numel(), CH):
        c = b[k : k + CH].to(torch.int64)
        cs = c.sum()
        s0 += cs
        s1 += cs * (p0 + k) + (c * ar[: c.numel()]).sum()
    return s0, s1


def _fold(pairs) -> list:
    import torch

    if not pairs:
        return []
    return torch.stack([torch.stack(p) for p in pairs]).cpu().tolist()


def fingerprints(params: dict) -> list:
    """Per parameter (sorted by name): [byte sum, position-weighted byte sum]."""
    import torch

    with torch.no_grad():
        return _fold([_range_sums(_u8(t), 0) for _, t in sorted(params.items())])


def components(ex):
    return [c for c in ex.components if c.shards]


def reference(ex, fulls: dict) -> list:
    """The fingerprints the worker must hold: the mapping's reference packing of `fulls`."""
    import torch
    from wxfer.runtime import prepare

    dest = ex.dest[0]
    acc = {}
    with torch.no_grad():
        for c in components(ex):
            for sh in c.shards:
                if sh.rank != 0:
                    continue
                dev = fulls[sh.pieces[0].src].device
                buf = torch.empty(sh.nbytes, dtype=torch.uint8, device=dev)
                prepare.pack_shard_into(sh, fulls, buf, 0)
                s0, s1 = _range_sums(buf, sh.offset)
                a = acc.get(sh.dst)
                acc[sh.dst] = (s0, s1) if a is None else (a[0] + s0, a[1] + s1)
    missing = [n for n in dest if n not in acc]
    if missing:
        raise RuntimeError(f"the mapping writes no shard of {missing[:3]}")
    return _fold([acc[n] for n in sorted(dest)])


def compare(got, want, ex) -> dict:
    names = sorted(ex.dest[0])
    bad = [
        names[k] for k, (g, w) in enumerate(zip(got, want)) if [x % (1 << 64) for x in g] != [x % (1 << 64) for x in w]
    ]
    if len(got) != len(want):
        bad.append(f"{len(got)} parameters fingerprinted, {len(want)} expected")
    return dict(ok=not bad, differ=len(bad), first=bad[:3])


class Loader:
    """checkpoint-engine's ``run=`` callback on the inference side: the HF-named tensors of
    one bucket (views into its IPC buffer) -> the vLLM layout, fused / sliced / FP8 with the
    mapping's reference packing.  A component whose sources straddle buckets keeps copies
    of the ones it has (the buffer is reused two buckets later)."""

    def __init__(self, ex, params: dict):
        self.ex, self.params = ex, params
        self.comps = components(ex)
        self.of = {}
        for k, c in enumerate(self.comps):
            for s in c.sources:
                self.of[s] = k
        self.nsrc = [len(set(c.sources)) for c in self.comps]
        self.begin()

    def begin(self) -> None:
        self.pending: dict = {}
        self.done = 0
        self.calls = 0
        self.clones = 0
        self.clone_bytes = 0
        self.seconds = 0.0
        self.ignored: set = set()

    def __call__(self, weights) -> None:
        import torch

        t0 = time.perf_counter()
        kept = []
        with torch.no_grad():
            for name, t in weights:
                k = self.of.get(name)
                if k is None:
                    self.ignored.add(name)
                    continue
                have = self.pending.setdefault(k, {})
                have[name] = t
                if len(have) == self.nsrc[k]:
                    self._write(self.comps[k], have)
                    del self.pending[k]
                    self.done += 1
                else:
                    kept.append((k, name))
            for k, name in kept:
                if k in self.pending:
                    t = self.pending[k][name]
                    self.pending[k][name] = t.clone()
                    self.clones += 1
                    self.clone_bytes += t.numel() * t.element_size()
            if weights:
                bb.sync_dev(weights[0][1].device)
        self.calls += 1
        self.seconds += time.perf_counter() - t0

    def _write(self, c, fulls) -> None:
        from wxfer.runtime import prepare

        for sh in c.shards:
            if sh.rank == 0:
                prepare.pack_shard_into(sh, fulls, _u8(self.params[sh.dst]), sh.offset)

    def stats(self) -> dict:
        left = sorted(s for d in self.pending.values() for s in d)
        return dict(
            components=self.done,
            of=len(self.comps),
            calls=self.calls,
            clones=self.clones,
            clone_bytes=self.clone_bytes,
            load_fn_s=self.seconds,
            missing_sources=len(left),
            ignored=sorted(self.ignored)[:5],
            complete=self.done == len(self.comps) and not left,
        )


def feed_in_buckets(loader: Loader, fulls: dict, bucket_bytes: int) -> None:
    """The loader-only check (no checkpoint-engine): the tensors in name order, packed into
    uint8 buckets of about `bucket_bytes` (256-byte aligned), each handed over as views."""
    import torch

    names = sorted(fulls)
    al = [-(-fulls[n].numel() * fulls[n].element_size() // 256) * 256 for n in names]
    dev = fulls[names[0]].device
    buf = torch.empty(2 * max(bucket_bytes, max(al)), dtype=torch.uint8, device=dev)
    half = buf.numel() // 2
    i, slot = 0, 0
    while i < len(names):
        base, used, batch = slot * half, 0, []
        while i < len(names) and (not batch or used + al[i] <= bucket_bytes):
            t = fulls[names[i]]
            n = t.numel() * t.element_size()
            buf[base + used : base + used + n].copy_(_u8(t))
            batch.append((names[i], buf[base + used : base + used + n].view(t.dtype).view(t.shape)))
            used += al[i]
            i += 1
        loader(batch)
        slot ^= 1


# --------------------------------------------------------------------------- ckpt-engine log


class LogTap:
    """checkpoint-engine's loguru lines (time, message), kept and parsed per update."""

    PAT = dict(
        bucket=re.compile(r"begin to update bucket (\d+)/(\d+)"),
        size=re.compile(r"auto detect bucket size ([\d.]+) GiB"),
        done=re.compile(r"weights broadcast done"),
        reg=re.compile(r"register pin_memory for bucket (\d+)/(\d+)"),
        begin=re.compile(r"\[rank\d+\] update checkpoint \S+$"),
        end=re.compile(r"\[rank\d+\] update checkpoint \S+ with ranks \S+ done\."),
    )

    def __init__(self, path: str | None):
        from loguru import logger

        self.lines: list = []
        logger.remove()
        logger.add(sys.stderr, level="WARNING")
        if path:
            logger.add(path, level="INFO")
        logger.add(self._sink, level="INFO", format="{message}")

    def _sink(self, msg) -> None:
        r = msg.record
        self.lines.append((r["time"].timestamp(), r["message"]))

    def mark(self) -> int:
        return len(self.lines)

    def parse(self, since: int) -> dict:
        out: dict = {}
        starts, done, begin, end = [], None, None, None
        for t, m in self.lines[since:]:
            if self.PAT["begin"].match(m):
                begin = t
            elif self.PAT["end"].match(m):
                end = t
            elif g := self.PAT["bucket"].search(m):
                starts.append(t)
                out["buckets"] = int(g.group(2))
            elif g := self.PAT["size"].search(m):
                out["bucket_GiB"] = float(g.group(1))
            elif "use h2d buffer" in m:
                out["h2d_buffer"] = True
            elif "disable h2d buffer" in m:
                out["h2d_buffer"] = False
            elif self.PAT["done"].search(m):
                done = t
            elif g := self.PAT["reg"].search(m):
                out["pool_buckets"] = int(g.group(2))
        if starts:
            gaps = [b - a for a, b in zip(starts, starts[1:] + ([done] if done else []))]
            if gaps:
                out["bucket_s_mean"] = sum(gaps) / len(gaps)
                out["bucket_s_max"] = max(gaps)
            if done:
                out["broadcast_s"] = done - starts[0]
            if begin:
                out["setup_s"] = starts[0] - begin
        if done and end:
            out["release_s"] = end - done
        return out
