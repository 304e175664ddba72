"""How long and how much host memory bench_ckpt_engine.py's CPU-offloaded trainer takes to build
(issue 16: its qwen3-30b-a3b host-memory row timed out): an FSDP2 model (world 1) under
CPUOffloadPolicy on transformers' class, each setup phase timed, one fresh process per build.

    python benchmarks/bench_offload_build.py --models tiny-moe,moe-1g --json       # CPU
    python3 benchmarks/bench_offload_build.py --models qwen3-30b-a3b --json         # one GPU, ~1 min

Two ways to build it:
  slabs    (bench_ckpt_engine's, ckpt_engine_parts.fsdp_model) meta-device model, fully_shard
           on meta, every shard a view into a few pinned 2 GiB slabs, filled parameter by
           parameter;
  to-empty (the one before) the whole model materialized on the device, filled, then
           fully_shard, which copies every parameter into its own pinned host block (torch's
           pinned allocator rounds each one up to a power of two).
Per build: the seconds of each phase, the peak resident set of the process over its start
(getrusage), the bytes of the parameters and the pinned host bytes the allocator takes for
them (the slabs, or each parameter rounded up: computed from the sizes); for models under
2 GB, whether every shard holds the bytes the reference weights have (same_bytes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(HERE), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# a CPU-sized MoE of about 0.9 GB BF16 (8 layers of 32 fused experts)
MOE_1G = dict(
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    intermediate_size=2048,
    vocab_size=8192,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def spec(name: str):
    if name == "moe-1g":
        from wxfer.models import preset_for

        return dict(MOE_1G), preset_for(MOE_1G)
    from common import baselines as bb

    return bb.model_spec(name)


def old_build(preset, conf, dev, ph: dict):
    """The build bench_ckpt_engine used before: materialize, fill, then fully_shard (offload)."""
    import torch
    import ckpt_engine_parts as cp
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import shard_fsdp2, train_model

    t = time.perf_counter()
    with torch.device("meta"):
        model = train_model(conf).to(torch.bfloat16)
    model.to_empty(device=dev)
    ph["materialize_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(cp.fused_or_plain(n, p.shape, p.dtype, dev))
    cp.bb.sync_dev(dev)
    ph["fill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    shard_fsdp2(model, init_device_mesh(dev.type, (1,)), offload=True)
    ph["fully_shard_s"] = time.perf_counter() - t
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    gpu = dev.type == "cuda"
    ph.update(param_bytes=sum(sizes), host_bytes=sum(cp.pinned_size(n) if gpu else n for n in sizes))
    return model


def _one(name: str, how: str, q) -> None:
    try:
        import datetime
        import torch
        import torch.distributed as dist
        import ckpt_engine_parts as cp
        from wxfer.runtime import control

        gpu = torch.cuda.is_available()
        dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if gpu else "gloo",
            rank=0,
            world_size=1,
            init_method="tcp://127.0.0.1:%d" % control.free_port(),
            timeout=datetime.timedelta(seconds=120),
        )
        conf, preset = spec(name)
        rss0 = cp.rss_peak_gb()
        ph: dict = dict(model=name, how=how, device=str(dev), rss_start_GB=rss0, host_avail_GB=cp.host_avail_gb())
        t = time.perf_counter()
        if how == "slabs":
            model = cp.fsdp_model(preset, conf, dev, ph)
        else:
            model = old_build(preset, conf, dev, ph)
        ph["total_s"] = time.perf_counter() - t
        ph["rss_peak_GB"] = cp.rss_peak_gb()
        ph["rss_peak_over_start_GB"] = ph["rss_peak_GB"] - rss0
        ph["param_GB"] = ph["param_bytes"] / 1e9
        ph["host_GB"] = ph["host_bytes"] / 1e9
        ph["host_avail_after_GB"] = cp.host_avail_gb()
        locs = [p._local_tensor for p in model.parameters()]
        ph["on_host"] = all(x.device.type == "cpu" for x in locs)
        ph["pinned"] = all(x.is_pinned() for x in locs) if gpu else None
        if ph["param_bytes"] < 2e9:  # small models: every shard holds the reference's bytes
            with torch.no_grad():
                ph["same_bytes"] = all(
                    torch.equal(p._local_tensor.to(dev), cp.fused_or_plain(n, p.shape, p.dtype, dev))
                    for n, p in model.named_parameters()
                )
        dist.destroy_process_group()
        q.put(ph)
    except BaseException as e:  # noqa: BLE001 -- reported by the parent
        import traceback

        traceback.print_exc()
        q.put(dict(model=name, how=how, error=f"{type(e).__name__}: {e}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-moe,moe-1g")
    ap.add_argument("--how", default="slabs,to-empty", help="comma list of slabs, to-empty")
    ap.add_argument("--timeout", type=float, default=500.0, help="one build")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for name in args.models.split(","):
        for how in args.how.split(","):
            q = ctx.Queue()
            p = ctx.Process(target=_one, args=(name, how, q))
            p.start()
            try:
                r = q.get(timeout=args.timeout)
            except Exception:  # noqa: BLE001 -- no answer in time
                r = dict(model=name, how=how, error=f"no result in {args.timeout:.0f} s (exit code {p.exitcode})")
            p.join(10)
            if p.is_alive():
                p.kill()
            rows.append(r)
            print(json.dumps(r) if args.json else r, flush=True)
    return 1 if any("error" in r or r.get("same_bytes") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
