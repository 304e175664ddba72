"""Whether a colocated configuration fits one GPU, said before it runs (issue 37): the
Qwen3-30B-A3B rows need about 122 GB colocated (the trainer's 61 GB and the inference copy's
61 GB) and ran out of memory at setup on an 80 GB H100, printing an OOM trace. Now the bench
prints one line naming the row, the bytes it needs and the bytes free, and skips it.

The estimate (``need``), per configuration on GPU 0:

* the trainer's model: its BF16 training tensors (none on the GPU for fsdp2-offload);
* its gradients where the training step is SGD (``bb_fsdp.train_kind``: dense FSDP2 rows);
* the inference copy (the mapping's destination bytes, BF16 or FP8 with scales);
* the link bound's two buffers (1 GiB pieces, or the whole copy when smaller);
* the Sender's larger watermark (what a push may hold beyond the two models);
* ``CONTEXTS``: the two processes' CUDA contexts and allocator slack.

Free memory: ``nvidia-smi --query-gpu=memory.free`` of GPU 0 (no CUDA context made in the
parent, which would take ~0.5 GB from its children), or ``--gpu-free`` (a fake figure: tests,
or a planned machine)."""

from __future__ import annotations

import subprocess

GiB = 1 << 30
CONTEXTS = 2 * GiB  # two processes' CUDA contexts (~0.5 GiB each) and the caching allocator's slack


def _dtype_bytes(dt: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dt)).element_size()


def need(cfg: dict, watermarks: list) -> dict:
    """The bytes configuration `cfg` needs on GPU 0 colocated, by part (``total`` their sum)."""
    import bb_fsdp
    from common.baselines import expanded, model_spec

    conf, preset = model_spec(cfg["model"])
    ex = expanded(preset, conf, "fp8" if cfg["quant"] == "fp8" else None)
    model = sum(_numel(s) * _dtype_bytes(dt) for s, dt, _ in preset.hf_params(conf).values())
    kind = cfg.get("trainer", "plain")
    on_gpu = 0 if kind == "fsdp2-offload" else model
    sgd = kind != "plain" and bb_fsdp.train_kind(cfg, conf["architectures"][0], False) == "sgd"
    dest = ex.dest_bytes(0)
    parts = dict(
        model=on_gpu,
        grads=on_gpu if sgd else 0,
        inference=dest,
        link=2 * min(GiB, dest),
        watermark=max(watermarks) if watermarks else 0,
        contexts=CONTEXTS,
    )
    parts["total"] = sum(parts.values())
    return parts


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def gpu_free(device: int = 0) -> int | None:
    """Free bytes of GPU `device` by nvidia-smi, or None where it cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", str(device)],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        return int(float(out.splitlines()[0])) << 20  # MiB
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def refusal(name: str, parts: dict, free: int | None) -> str | None:
    """One line saying row `name` does not fit (None: it fits, or the free memory is unknown)."""
    if free is None or parts["total"] <= free:
        return None
    shown = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items() if k != "total" and v)
    return (
        f"{name}: skipped, does not fit one GPU colocated: needs about {parts['total'] / 1e9:.1f} GB "
        f"({shown}) against {free / 1e9:.1f} GB free on GPU 0 (run it on a larger GPU, e.g. an H200)"
    )
