"""The MLA finalize's kernels without vLLM, for a GPU prediction: wxfer's ``mla.derive`` (the same
arithmetic as vLLM 0.32's FP8 block ``split_kv_b_proj``, checked bit-equal to it in
tests/on_vllm/test_mla.py) plus the in-place copies into W_UV / W_UK_T, per layer and per update,
for DeepSeek-V3 / Kimi-K2 shapes at a TP degree; against the one-sided alternative (the derived
BF16 bytes written from the trainers: a device copy of them, and their wire time at 50 GB/s,
estimated).

    python benchmarks/bench_mla_derive.py --device cuda     # on the H100 / H200 (no vLLM needed)
    python benchmarks/bench_mla_derive.py --device cpu --models tiny,k2 --tp 16

What it leaves out: vLLM's own Python around the kernels (``process_weights_after_loading``
per module; measured on CPU by benchmarks/bench_mla_finalize.py, which runs vLLM's code).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {  # heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, layers (MTP layer included)
    "tiny": (4, 64, 64, 512, 3),
    "k2": (64, 128, 128, 512, 61),  # Kimi-K2: 61 layers, no MTP layer in its checkpoint
    "v3": (128, 128, 128, 512, 62),  # DeepSeek-V3: 61 layers + 1 MTP
}
LINK_GBPS = 50.0


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _times(fn, dev, repeat):
    ts = []
    for _ in range(repeat):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)


def one(model, tp, dev, repeat):
    import torch

    from wxfer.integrations.vllm.mla import derive

    heads, nope, v, L, layers = MODELS[model]
    n = max(heads // tp, 1)
    rows = n * (nope + v)
    g = torch.Generator(device=dev).manual_seed(1)
    # drawn as tests/on_vllm/mla_proc.py draws its FP8 kv_b_proj (the CPU's FP8 -> float32 cast is
    # data-dependent: about 3x slower on N(0, 100) draws than on these)
    w = ((torch.randn(rows, L, device=dev, generator=g) * 0.05).to(torch.bfloat16).float() * 4000).to(
        torch.float8_e4m3fn
    )
    s = torch.rand(-(-rows // 128), -(-L // 128), device=dev, generator=g) * 1e-4 + 1e-5
    uv0, ukt0 = derive(w, s, (128, 128), n, nope, v)
    # the module's parameters as vLLM registers them: views of one dequantized [N * (P + V), L] buffer
    W_UV, W_UK_T = uv0, ukt0

    def finalize():
        uv, ukt = derive(w, s, (128, 128), n, nope, v)
        W_UV.copy_(uv)
        W_UK_T.copy_(ukt)

    src = [W_UV.clone(), W_UK_T.clone()]

    def copy():
        W_UV.copy_(src[0])
        W_UK_T.copy_(src[1])

    finalize()  # warm-up (allocator, kernels)
    fin, fin_min = _times(finalize, dev, repeat)
    cp, cp_min = _times(copy, dev, repeat)
    kv = w.numel() + s.numel() * 4
    d = (W_UV.numel() + W_UK_T.numel()) * 2
    return dict(
        model=model,
        tp=tp,
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        heads_per_rank=n,
        layers=layers,
        kv_b_proj_MB_per_layer=kv / 1e6,
        derived_MB_per_layer=d / 1e6,
        finalize_s_per_layer=fin,
        finalize_s_per_layer_min=fin_min,
        finalize_s_per_update=fin * layers,
        copy_GBps=d / cp / 1e9,
        onesided_copy_s_per_update_est=cp * layers,
        onesided_wire_s_per_update_est=d * layers / (LINK_GBPS * 1e9),
    )


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="tiny,k2,v3")
    ap.add_argument("--tp", default="1,8,16")
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device(a.device)
    for m in a.models.split(","):
        for tp in [int(x) for x in a.tp.split(",")]:
            print(json.dumps(one(m, tp, dev, a.repeat)), flush=True)


if __name__ == "__main__":
    main()
