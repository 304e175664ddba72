"""MLA finalize on a vLLM worker: re-deriving W_UV / W_UK_T in ``finish_weight_update`` against
writing them from the trainers.

    .venv-vllm/bin/python benchmarks/bench_mla_finalize.py [--repeat 20] [--shapes 4x64,4x128,16x128,128x128]

For each shape (heads x head dim; 4x128 is Kimi-K2 at TP16, 128x128 DeepSeek-V3 at TP1),
vLLM 0.32's own DeepSeek-V3 model (2 layers, CPU_MLA backend, built as
tests/on_vllm/mla_proc.py builds it; FP8 block kv_b_proj, the AMX check of vLLM's CPU FP8 kernel
patched, its GEMM never run) is loaded with seeded weights, new kv_b_proj bytes are written raw,
and the finalizers (vLLM's ``MLAAttention.process_weights_after_loading`` re-run) are timed
(median and best of --repeat), and so is wxfer's ``mla.derive`` on the same bytes.  Measured:
the finalize seconds per layer and per MB of kv_b_proj (FP8 weight + scales), and this machine's
copy rate for the derived bytes (one ``copy_`` into W_UV and one into W_UK_T, what a
one-sided write of them would at least cost on the receiving side).  Estimated, not measured:
the one-sided alternative as derived bytes / that copy rate, and its wire time at 50 GB/s.  BF16
kv_b_proj needs no finalize (W_UV / W_UK_T are views of it): printed as such.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests", "on_vllm")]

LINK_GBPS = 50.0  # one 400 Gb/s NIC per GPU (DESIGN.md), for the estimate only


def _times(fn, repeat):
    """(median, min) seconds of `repeat` calls."""
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)


def one(tmp, heads, dim, fp8, repeat):
    import mla_proc as P
    import torch

    from wxfer.integrations.vllm.mla import derive, mla_finalizers

    nope = v = dim
    cfg = P.tiny_config(fp8, heads=heads, nope=nope, v=v)
    path = P.save_config(os.path.join(tmp, f"h{heads}x{dim}{'fp8' if fp8 else 'bf16'}"), cfg)
    vc = P.engine_config(path)
    model, mc = P.build(vc)
    P.load(vc, model, mc, P.checkpoint(cfg))
    fins = mla_finalizers(model)
    P.write_like_wxfer(model, [n for f in fins for n in f.reads], P.checkpoint(cfg, kv_seed=P.SEED + 1))
    params = dict(model.named_parameters())
    kv_bytes = sum(params[n].numel() * params[n].element_size() for n in fins[0].reads)
    row = dict(
        heads=heads,
        head_dim=dim,
        dtype="fp8" if fp8 else "bf16",
        layers=len(fins),
        kv_b_proj_MB_per_layer=kv_bytes / 1e6,
    )
    if fins[0].aliased:
        row.update(finalize_s_per_layer=0.0, note="W_UV / W_UK_T are views of kv_b_proj: nothing to run")
        return row
    f = fins[0]
    fin, fin_min = _times(f.run, repeat)
    m = f.module
    src = [t.detach().clone() for t in (m.W_UV, m.W_UK_T)]

    def copy():
        m.W_UV.data.copy_(src[0])
        m.W_UK_T.data.copy_(src[1])

    cp, cp_min = _times(copy, repeat)
    kv = m.kv_b_proj
    blk = (128, 128)

    def own():  # wxfer's mla.derive on the same bytes (the kernels bench_mla_derive.py times)
        derive(kv.weight, kv.weight_scale_inv, blk, m.num_heads, m.qk_nope_head_dim, m.v_head_dim)

    dv, dv_min = _times(own, repeat)
    d = f.derived_bytes
    row.update(
        finalize_s_per_layer=fin,
        finalize_s_per_layer_min=fin_min,
        derive_s_per_layer=dv,
        derive_s_per_layer_min=dv_min,
        finalize_s_per_MB_kv_b_proj=fin / (kv_bytes / 1e6),
        derived_MB_per_layer=d / 1e6,
        copy_GBps=d / cp / 1e9,
        copy_GBps_best=d / cp_min / 1e9,
        onesided_receiver_copy_s_per_layer_est=cp,
        onesided_wire_s_per_layer_est=d / (LINK_GBPS * 1e9),
        torch_threads=torch.get_num_threads(),
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--shapes", default="4x64,4x128,16x128,128x128", help="heads x (qk_nope = v head dim), ...")
    a = ap.parse_args()
    import mla_proc as P

    P.fp8_kernel_patch()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(a.shapes.split(",")):
            h, dim = (int(x) for x in shape.split("x"))
            for fp8 in (True, False) if i == 0 else (True,):
                rows.append(one(tmp, h, dim, fp8, a.repeat))
                print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
