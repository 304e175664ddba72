"""What the mapping writes into a vLLM worker, and the setup-time proof that vLLM's own loader
lays the same bytes there.  Plain Python and torch: no vLLM import, tested without it.

- ``expected_destinations``: name -> (shape, dtype) the mapping writes on one inference rank.
- ``vllm_names``: the mapping's destination names as the vLLM model names them (vLLM 0.32
  keeps the routed experts of a fused MoE layer under ``mlp.experts.routed_experts.``).
- ``select_parameters``: the model's parameters the mapping writes, the ones it leaves out and
  the destinations the model lacks.
- ``seeded_checkpoint`` / ``proof_digests``: the layout proof.  The same seeded random
  checkpoint tensors (a few layers plus embeddings, final norm and head) are loaded by vLLM's
  own ``load_weights`` on the worker and packed by the mapping's reference packing on the
  trainer; the SHA-256 of every destination's bytes must agree.
- ``refusals``: the post-processing paths that move or re-lay the memory wxfer writes, found
  on the model's modules by name, each with what to configure instead.
"""

from __future__ import annotations

import hashlib
import re
import zlib

PROOF_SEED = 20261201
ROUTED = ".experts.routed_experts."


def _preset(mapping, hf_config: dict | None = None):
    from ...runtime.program import get_preset

    return get_preset(mapping if mapping is not None else dict(hf_config or {}))


def expected_destinations(
    mapping, hf_config: dict, tp: int, rank: int, quant: str | None = None, ep: bool = False
) -> dict:
    """name -> (shape, dtype) the mapping writes on inference rank `rank`."""
    from ...mapping import Layout, expand

    preset = _preset(mapping, hf_config)
    cfg = dict(preset.config, **(hf_config or {}))
    shapes = {n: s for n, (s, _, _) in preset.hf_params(cfg).items()}
    dest = expand(preset.rules, shapes, Layout(tp, ep, quant), cfg).dest[rank]
    return {n: (tuple(d.shape), d.dtype) for n, d in dest.items()}


def vllm_names(expected, model_names) -> dict:
    """destination name -> the model's name for it: the same name, or for a MoE layer whose
    experts vLLM keeps in a RoutedExperts module, ``...mlp.experts.routed_experts.w13_weight``
    for the mapping's ``...mlp.experts.w13_weight``."""
    have = set(model_names)
    out = {}
    for n in expected:
        if n not in have and ".experts." in n:
            alt = n.replace(".experts.", ROUTED, 1)
            if alt in have:
                out[n] = alt
                continue
        out[n] = n
    return out


def select_parameters(named_parameters, expected: dict, skip: str | None = None):
    """(selected [(destination name, tensor)], left out [model names], missing [destination names]).

    Parameters the mapping writes are selected (under the mapping's name, which is what the
    plan and the trainers use); others are left out; destinations the model lacks are
    reported as missing (the plan would refuse them anyway, by name)."""
    named = list(named_parameters)
    pat = re.compile(skip) if skip else None
    rename = vllm_names(expected, [n for n, _ in named])
    back = {v: k for k, v in rename.items()}
    sel, left = [], []
    seen = set()
    for n, t in named:
        d = back.get(n)
        if d is None or (pat and pat.search(n)):
            left.append(n)
            continue
        sel.append((d, t))
        seen.add(d)
    missing = sorted(set(expected) - seen)
    return sel, left, missing


def quant_of(named_parameters) -> str | None:
    return "fp8" if any(str(t.dtype).endswith("float8_e4m3fn") for _, t in named_parameters) else None


def check_shapes(selected, expected: dict, where: str) -> None:
    """Every selected tensor has the shape and dtype the mapping writes, else a ValueError
    naming each parameter (e.g. a weight post-processing replaced by an empty tensor)."""
    bad = []
    for n, t in selected:
        shape, dt = expected[n]
        have = str(t.dtype).replace("torch.", "")
        if tuple(t.shape) != tuple(shape) or have != dt:
            bad.append(f"{n}: vLLM holds {tuple(t.shape)} {have}, the mapping writes {tuple(shape)} {dt}")
    if bad:
        raise ValueError(
            f"wxfer: {where}: {len(bad)} parameter(s) not in the layout the mapping writes: " + "; ".join(bad[:8])
        )


def writable_parameters(named, mapping, hf_config: dict, par: dict, quant, skip, where: str, mapping_name=None):
    """(selected, left out): the parameters of `named` the mapping writes on the worker `par`
    describes (its "tp", "rank", "ep"), and the others.  RuntimeError naming what the model
    lacks; ValueError (check_shapes) for a shape or dtype the mapping does not write."""
    expected = expected_destinations(mapping, hf_config, par["tp"], par["rank"], quant, par["ep"])
    sel, left, missing = select_parameters(named, expected, skip)
    if missing:
        what = f"the mapping {mapping_name!r}" if mapping_name else "the mapping"
        raise RuntimeError(f"wxfer: {where} lacks {len(missing)} parameter(s) {what} writes: {missing[:10]}")
    check_shapes(sel, expected, where)
    return sel, left


# --------------------------------------------------------------------------- the layout proof


def proof_layers(n_layers: int, count: int = 2) -> list[int]:
    """The decoder layers the proof loads: the first and the last (``count`` in all)."""
    if n_layers <= count:
        return list(range(n_layers))
    return sorted({*range(count - 1), n_layers - 1})


def _in_proof(name: str, layers) -> bool:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return m is None or int(m.group(1)) in layers


def seeded_checkpoint(mapping, hf_config: dict | None, layers, seed: int = PROOF_SEED) -> dict:
    """name -> tensor: random checkpoint tensors in the training (HF) layout, for the
    parameters outside decoder layers and those of `layers`; each one a function of (seed,
    name) alone, so both sides make the same bytes."""
    import torch

    preset = _preset(mapping, hf_config)
    cfg = dict(preset.config, **(hf_config or {}))
    out = {}
    for n, (shape, dtype, _) in preset.hf_params(cfg).items():
        if not _in_proof(n, layers):
            continue
        g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(n.encode())) & 0x7FFFFFFFFFFF)
        t = torch.randn(tuple(shape), generator=g) * 0.05
        if n.endswith("norm.weight") or "layernorm" in n:
            t = t + 1.0
        out[n] = t.to(getattr(torch, dtype))
    return out


def fp8_checkpoint(tensors: dict, quantized) -> list:
    """[(name, tensor)]: `tensors` as an FP8 block-quantized checkpoint stores them (what
    vLLM's loader of such a checkpoint reads): the weights `quantized(name)` says are
    quantized as float8_e4m3fn with ``<name>_scale_inv``, the others as they are."""
    from ...mapping.reference import quantize_fp8_block

    out = []
    for n, t in tensors.items():
        if quantized(n):
            q, s = quantize_fp8_block(t)
            out += [(n, q), (n + "_scale_inv", s)]
        else:
            out.append((n, t))
    return out


def digest(t) -> str:
    import torch

    b = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest()


def proof_digests(mapping, hf_config, tp: int, rank: int, quant, ep: bool, layers, seed: int = PROOF_SEED) -> dict:
    """destination name -> SHA-256 of the bytes the mapping writes there on `rank` for the
    seeded checkpoint: the trainer's side of the proof (the reference packing, which every
    fast path equals bit for bit).  Only destinations whose every byte comes from the seeded
    tensors are listed."""
    buf = proof_bytes(mapping, hf_config, tp, rank, quant, ep, layers, seed)
    return {n: hashlib.sha256(b.numpy().tobytes()).hexdigest() for n, b in buf.items()}


def proof_bytes(mapping, hf_config, tp: int, rank: int, quant, ep: bool, layers, seed: int = PROOF_SEED) -> dict:
    """destination name -> the bytes (uint8) the mapping's reference packing writes there on
    `rank` for the seeded checkpoint (see proof_digests)."""
    import torch
    from ...mapping import Layout, expand, pack_shard

    preset = _preset(mapping, hf_config)
    cfg = dict(preset.config, **(hf_config or {}))
    full = seeded_checkpoint(preset, cfg, layers, seed)
    ex = expand(preset.rules, {n: tuple(t.shape) for n, t in full.items()}, Layout(tp, ep, quant), cfg)
    dest = ex.dest[rank]
    buf = {}
    for c in ex.components:
        for sh in c.shards:
            if sh.rank != rank:
                continue
            d = dest[sh.dst]
            if sh.dst not in buf:
                buf[sh.dst] = torch.zeros(d.nbytes, dtype=torch.uint8)
            b = pack_shard(sh, full)
            buf[sh.dst][sh.offset : sh.offset + b.numel()] = b
    return buf


def compare_digests(expected: dict, got: dict, where: str) -> list[str]:
    """The differences, one line per parameter."""
    out = []
    for n in sorted(expected):
        if n not in got:
            out.append(f"{where}: {n}: vLLM's loader did not fill it from the seeded checkpoint")
        elif got[n] != expected[n]:
            out.append(
                f"{where}: {n}: the bytes vLLM's load_weights wrote differ from what the mapping packs "
                f"(sha256 {got[n][:12]} != {expected[n][:12]})"
            )
    return out


# --------------------------------------------------------------------------- refusals

# What vLLM's post-processing does to the memory wxfer writes, by the names vLLM 0.32 gives its
# choices (Fp8MoeBackend / UnquantizedMoeBackend members, kernel classes).
MOE_FIX = 'moe_backend="triton" (vLLM: --moe-backend triton)'
REFUSED_MOE_BACKENDS = {
    "FLASHINFER_TRTLLM": "FlashInfer TRT-LLM MoE re-lays w13 (as w31, shuffled) in new tensors",
    "FLASHINFER_CUTLASS": "FlashInfer CUTLASS MoE swaps w13 into w31 in new tensors",
    "MARLIN": "Marlin repacks the expert weights",
    "AITER": "ROCm AITER shuffles the expert weights",
}
REFUSED_LINEAR_KERNELS = [  # (part of the class name, why, what to configure instead)
    (
        "Marlin",
        "Marlin repacks the weights into its tiles",
        "a GPU with native FP8 (the CUTLASS / Triton block kernels)",
    ),
    ("FlashInfer", "its weight layout after loading is not proven here", "the CUTLASS or Triton block FP8 kernel"),
    (
        "CPUFp8",
        "vLLM's CPU FP8 kernel re-lays weights after loading (the MoE router comes out float32, transposed)",
        "BF16 on vLLM's CPU platform",
    ),
]


def _linear_kernel_refusal(name: str, qm, device_major: int | None) -> str | None:
    k = getattr(qm, "fp8_linear", None)
    if k is None:
        return None
    cls = type(k).__name__
    for pat, why, instead in REFUSED_LINEAR_KERNELS:
        if pat in cls:
            return f"{name}: FP8 kernel {cls}: {why}; configure {instead}"
    if "DeepGemm" in cls and device_major is not None and device_major >= 10:
        return (
            f"{name}: FP8 kernel {cls} on SM{device_major}x: DeepGEMM repacks the scales as int32 UE8M0 in a new "
            "tensor; configure VLLM_USE_DEEP_GEMM=0 (the CUTLASS block kernel)"
        )
    return None


def _moe_refusal(name: str, qm) -> str | None:
    backend = getattr(qm, "fp8_backend", None) or getattr(qm, "unquantized_backend", None)
    b = getattr(backend, "name", None)
    if b in REFUSED_MOE_BACKENDS:
        return f"{name}: MoE backend {b}: {REFUSED_MOE_BACKENDS[b]}; configure {MOE_FIX}"
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if experts is not None and "CPU" in type(experts).__name__:
        return (
            f"{name}: MoE experts {type(experts).__name__}: vLLM's CPU MoE prepacks w13_weight / w2_weight into its "
            "grouped-GEMM layout in new tensors after loading; MoE on vLLM's CPU platform cannot be written"
        )
    return None


def refusals(model, arch: str | None = None, device_major: int | None = None) -> list[str]:
    """Why wxfer must not write this model's memory, one line each (empty: it may): MLA (derived
    ``W_UV`` / ``W_UK_T`` the writes would leave stale), a kernel or MoE backend whose
    post-processing re-lays the weights, ROCm's FP8 fnuz, and vLLM's CPU GEMM dispatch that
    computes from a packed copy (``cpu_linear`` other than torch's linear).  device_major: the
    CUDA compute capability's major of the worker's GPU (None: not a CUDA worker)."""
    import torch

    out = []
    if arch == "deepseek_v3":
        out.append(
            "MLA (DeepSeek-V3 / Kimi-K2): vLLM derives W_UV / W_UK_T from kv_b_proj after loading and wxfer's "
            "writes would leave them stale; not supported (use the nccl or ipc backend for this model)"
        )
    for name, mod in model.named_modules():
        if hasattr(mod, "W_UV") or hasattr(mod, "W_UK_T"):
            out.append(f"{name}: MLA absorbed weights (W_UV / W_UK_T) derived after loading; not supported")
            break
    fp8 = any(str(p.dtype).endswith("float8_e4m3fn") for p in model.parameters())
    if fp8 and getattr(torch.version, "hip", None):
        out.append("FP8 on ROCm: vLLM re-encodes e4m3fn weights as e4m3fnuz and doubles the scales; not supported")
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            if "Marlin" in type(qm).__name__:
                out.append(f"{name}: quant method {type(qm).__name__}: Marlin repacks the weights; not supported")
            for why in (_linear_kernel_refusal(name, qm, device_major), _moe_refusal(name, qm)):
                if why:
                    out.append(why)
        lin = getattr(mod, "cpu_linear", None)
        if lin is not None and lin is not torch.nn.functional.linear:
            out.append(
                f"{name}: vLLM's CPU GEMM dispatch computes from a packed copy of the weight (cpu_linear "
                f"{getattr(lin, '__name__', type(lin).__name__)}); writes to the parameter would not be used: "
                "call wxfer.integrations.vllm.keep_cpu_weights() in the worker before the model loads "
                "(WXFER_VLLM_CPU_KEEP_WEIGHTS=1 with the vllm.general_plugins entry point)"
            )
    return out
