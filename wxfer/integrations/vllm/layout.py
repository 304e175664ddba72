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
- what vLLM's post-processing does to that memory is decided by proof (postproc.py), not here.
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

    preset = _preset(mapping, hf_config)
    cfg = dict(preset.config, **(hf_config or {}))
    return {
        n: seeded_tensor(n, shape, dtype, seed)
        for n, (shape, dtype, _) in preset.hf_params(cfg).items()
        if _in_proof(n, layers)
    }


def seeded_tensor(name: str, shape, dtype: str, seed: int = PROOF_SEED):
    """One seeded random checkpoint tensor, a function of (seed, name, shape, dtype) alone (norm
    weights around 1)."""
    import torch

    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFF)
    t = torch.randn(tuple(shape), generator=g) * 0.05
    if name.endswith("norm.weight") or "layernorm" in name:
        t = t + 1.0
    return t.to(getattr(torch, dtype))


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
