"""The baselines' common ground, imported by bench_baselines.py and the benchmarks built on
it (bench_ckpt_engine, bench_scale, bench_copies, bench_offload_build, ckpt_engine_*,
sim_check): the benchmark models (model_spec), their training parameters with random
weights of the real shapes, the mapping expanded and the inference parameters it fills,
their byte checksums, a timing summary, a configuration's name, the machine description
written beside every result, and sizes as the extension parses them."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
GPU_MODELS = ("qwen3-8b", "qwen3-30b-a3b")
CPU_MODELS = ("tiny", "tiny-moe")


def as_bytes(t):
    """The bytes of tensor `t` (a uint8 view, flat)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def sync_dev(dev) -> None:
    """Wait for the work queued on `dev` (a CUDA device; nothing on the CPU)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def step_options(ap, reps: int, per: str = "") -> None:
    """The runs' step counts on argparse parser `ap`: --warmup (1) and --reps (`reps`: the timed
    steps `per` after --warmup, their median reported)."""
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=reps, help=f"timed steps{per} after --warmup (median reported)")


def run_store(args):
    """The parent's TCPStore server on a free local port (args.timeout its bound; it serves as
    long as the returned store is referenced) and what every child process of the run is told
    from the command line: (store, dict(store=its address, dry_run, timeout, warmup, reps))."""
    import torch.distributed as dist

    from wxfer.runtime import control

    port = control.free_port()
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout, wait_for_workers=False)
    run = dict(store="127.0.0.1:%d" % port, dry_run=args.dry_run, timeout=args.timeout)
    return store, dict(run, warmup=args.warmup, reps=args.reps)


# --------------------------------------------------------------------------- models


def model_spec(name: str):
    """(config dict, mapping preset) of a benchmark model."""
    from wxfer.mapping import get_preset
    from wxfer.models import TINY, TINY_MOE, preset_for

    if name == "tiny":
        return dict(TINY), preset_for(TINY)
    if name == "tiny-moe":
        return dict(TINY_MOE), preset_for(TINY_MOE)
    if name == "qwen3-1.7b":
        from wxfer.mapping import from_config

        return dict(QWEN3_1_7B), from_config(name, QWEN3_1_7B, infer_tp=1)
    base, sep, depth = name.rpartition("-l")
    if sep and depth.isdigit() and base:  # e.g. qwen3-30b-a3b-l24: the model cut to its first 24 layers
        return _cut(base, int(depth), name)
    p = get_preset(name)
    return dict(p.config), p


def _cut(base: str, layers: int, name: str):
    """(config, preset) of benchmark model `base` with `layers` decoder layers instead of its
    own (the same shapes per layer): the rows of a model one GPU cannot hold colocated, at a
    depth it can (qwen3-30b-a3b-l24 on an 80 GB H100), named so wherever it is printed."""
    from wxfer.mapping import from_config

    conf, p = model_spec(base)
    full = conf.get("num_hidden_layers")
    if not isinstance(full, int) or not 1 <= layers <= full:
        raise ValueError(f"benchmark model {name!r}: {base} has {full} layers; -l<N> must be 1..{full}, got {layers}")
    conf = dict(conf, num_hidden_layers=layers)
    return conf, from_config(name, conf, infer_tp=p.infer_tp, infer_ep=p.infer_ep, quant=p.quant)


# a 1.7B-class dense model: 28 layers, hidden 2048, untied lm_head: 311 tensors, 4.06 GB BF16
QWEN3_1_7B = dict(
    architectures=["Qwen3ForCausalLM"],
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    tie_word_embeddings=False,
)


def train_params(preset, cfg, device, seed: int = 0) -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for n, (shape, dt, _) in preset.hf_params(cfg).items():
        t = torch.empty(shape, dtype=getattr(torch, dt), device=device)
        if t.dim() == 1:
            t.normal_(1.0, 0.1, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        out[n] = t
    return out


def expanded(preset, cfg, quant, tp: int = 1):
    from wxfer.mapping import Layout, expand

    shapes = {n: s for n, (s, _, _) in preset.hf_params(cfg).items()}
    ex = expand(preset.rules, shapes, Layout(tp, False, quant), cfg)
    if ex.errors:
        raise RuntimeError("mapping errors: " + "; ".join(ex.errors[:5]))
    return ex


def infer_params(ex, device, rank: int = 0) -> dict:
    import torch

    return {n: torch.empty(d.shape, dtype=getattr(torch, d.dtype), device=device) for n, d in ex.dest[rank].items()}


def reset(params: dict) -> None:
    for t in params.values():
        as_bytes(t).fill_(0xFF)


def checksums(params: dict) -> list:
    import torch

    return [int(as_bytes(t).sum(dtype=torch.int64)) for _, t in sorted(params.items())]


def copy_through(dst, src, nbytes: int) -> None:
    """Copy `nbytes` from `src` into `dst` (byte tensors of one piece each), that piece again and
    again: the time of `nbytes` over that link without holding them all at once."""
    piece, left = dst.numel(), nbytes
    while left > 0:
        k = min(piece, left)
        dst[:k].copy_(src[:k], non_blocking=True)
        left -= k


def summary(times, nbytes):
    ts = sorted(times)
    med = ts[len(ts) // 2]
    return dict(seconds=med, best=ts[0], times=times, gbps=nbytes / med / 1e9)


def cfg_name(c) -> str:
    t = c.get("trainer", "plain")
    return "%s-%s-%s" % (c["model"], c["quant"], c["layout"]) + ("" if t == "plain" else "-" + t)


def machine(dry_run: bool) -> dict:
    import torch
    import wxfer

    m = dict(
        host=socket.gethostname(),
        platform=platform.platform(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        env={k: os.environ.get(k) for k in (*NO_MULTICAST, "WXFER_DIRECT")},
        dry_run=dry_run,
        backends={k: v for k, v in wxfer.backends().items()},
    )
    try:
        m["load"] = os.getloadavg()
    except OSError:
        pass
    m["commit"] = commit()
    if not dry_run and torch.cuda.is_available():
        m["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        for args in (
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            ["nvidia-smi", "topo", "-m"],
        ):
            try:
                m[" ".join(args[:2])] = subprocess.run(args, capture_output=True, text=True, timeout=20).stdout
            except Exception:  # noqa: BLE001
                pass
    return m


def commit() -> str:
    """The checkout's commit, only where it is known: $WXFER_COMMIT when set (a copied tree's
    .git can be older than its files: the H200's copy read 07234f1-dirty for e4d7d45), else
    git's, when ROOT is the top of a git work tree (not a copy inside another repository's
    tree), else "unknown"."""
    if os.environ.get("WXFER_COMMIT"):
        return os.environ["WXFER_COMMIT"]
    try:
        top = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        lines = top.stdout.split()
        if top.returncode == 0 and len(lines) == 2 and os.path.realpath(lines[0]) == os.path.realpath(ROOT):
            dirty = subprocess.run(
                ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return lines[1] + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 -- no git here
        pass
    return "unknown"


def parse_size(v: str) -> int:
    from wxfer import _wxfer

    return int(_wxfer.parse_size(v))
