"""The inference side of the tiny Qwen3 / Qwen3-MoE: vLLM's layout (fused ``qkv_proj`` and
``gate_up_proj``, vocabulary-parallel embedding and lm_head, TP shards, FP8 block weights
with ``weight_scale_inv``), and the way back to Hugging Face names (de-fuse, gather the
TP shards, dequantize) to compare the inference model's logits with the trainer's.
"""

from __future__ import annotations

import torch

from ..mapping import BLOCK, Layout, dequantize_fp8_block, expand, from_config, scale_name


def preset_for(config: dict):
    return from_config("tiny-" + config["architectures"][0], config)


def inference_layout(config: dict, tp: int, quant: str | None = None, ep: bool = False):
    """rank -> {name: DestParam} of one replica (what the mapping writes)."""
    preset = preset_for(config)
    shapes = {n: s for n, (s, _, _) in preset.hf_params(config).items()}
    return expand(preset.rules, shapes, Layout(tp, ep, quant), config).dest


def inference_params(
    config: dict, tp: int, rank: int, quant: str | None = None, ep: bool = False, device="cpu"
) -> dict:
    """Freshly allocated (NaN-filled where floating point, so an unwritten byte shows)
    parameters of inference rank `rank`, in the inference layout."""
    out = {}
    for n, d in inference_layout(config, tp, quant, ep)[rank].items():
        dt = getattr(torch, d.dtype)
        t = torch.empty(d.shape, dtype=dt, device=device)
        t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(float("nan"))
        out[n] = t
    return out


def _deq(sd: dict, name: str):
    w = sd[name]
    if w.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_block(w, sd[scale_name(name)], BLOCK)
    return w.float()


def _split_rows(w, sizes):
    out, o = [], 0
    for s in sizes:
        out.append(w[o : o + s])
        o += s
    return out


def _heads_of(heads: int, tp: int):
    """For each rank, the first KV head it holds, and which ranks hold a new head."""
    if tp <= heads:
        return list(range(tp))
    firsts, seen = [], set()
    for r in range(tp):
        h = r * heads // tp
        if h not in seen:
            seen.add(h)
            firsts.append(r)
    return firsts


def _experts_hf(config: dict, shards: list[dict], p: str, ep: bool) -> dict:
    """transformers 5's fused expert tensors of layer prefix `p` from the vLLM w13 / w2."""

    def deq3(sd, name):
        w = sd[name]
        if w.dtype != torch.float8_e4m3fn:
            return w.float()
        s = sd[scale_name(name)]
        return torch.stack([dequantize_fp8_block(w[e], s[e], BLOCK) for e in range(w.shape[0])])

    w13 = [deq3(s, p + "mlp.experts.w13_weight") for s in shards]
    w2 = [deq3(s, p + "mlp.experts.w2_weight") for s in shards]
    if ep:  # rank r holds experts [r*E/tp, (r+1)*E/tp) whole
        return {p + "mlp.experts.gate_up_proj": torch.cat(w13), p + "mlp.experts.down_proj": torch.cat(w2)}
    ir = w13[0].shape[1] // 2  # every rank: all experts, intermediate rows sliced
    gate = torch.cat([w[:, :ir] for w in w13], 1)
    up = torch.cat([w[:, ir:] for w in w13], 1)
    return {p + "mlp.experts.gate_up_proj": torch.cat([gate, up], 1), p + "mlp.experts.down_proj": torch.cat(w2, 2)}


def reconstruct_hf(config: dict, shards: list[dict], ep: bool = False) -> dict:
    """Hugging Face (transformers 5) state dict (float32) of a Qwen3 / Qwen3-MoE from one
    replica's TP shards (``shards[r]``: rank r's inference-layout tensors, FP8 or BF16)."""
    tp = len(shards)
    H, nh, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or H // nh
    q_r = nh * hd // tp
    kv_r = (nkv * hd // tp) if tp <= nkv else hd
    kv_ranks = _heads_of(nkv, tp)
    moe = "num_experts" in config
    sd = {
        "model.embed_tokens.weight": torch.cat([_deq(s, "model.embed_tokens.weight") for s in shards]),
        "model.norm.weight": _deq(shards[0], "model.norm.weight"),
    }
    if not config.get("tie_word_embeddings", False):
        sd["lm_head.weight"] = torch.cat([_deq(s, "lm_head.weight") for s in shards])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in (
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            a + "q_norm.weight",
            a + "k_norm.weight",
        ) + ((p + "mlp.gate.weight",) if moe else ()):
            sd[n] = _deq(shards[0], n)
        qkv = [_split_rows(_deq(s, a + "qkv_proj.weight"), (q_r, kv_r, kv_r)) for s in shards]
        sd[a + "q_proj.weight"] = torch.cat([x[0] for x in qkv])
        sd[a + "k_proj.weight"] = torch.cat([qkv[r][1] for r in kv_ranks])
        sd[a + "v_proj.weight"] = torch.cat([qkv[r][2] for r in kv_ranks])
        sd[a + "o_proj.weight"] = torch.cat([_deq(s, a + "o_proj.weight") for s in shards], 1)
        if moe:
            sd.update(_experts_hf(config, shards, p, ep))
            continue
        inter_r = config["intermediate_size"] // tp
        gu = [_split_rows(_deq(s, p + "mlp.gate_up_proj.weight"), (inter_r, inter_r)) for s in shards]
        sd[p + "mlp.gate_proj.weight"] = torch.cat([x[0] for x in gu])
        sd[p + "mlp.up_proj.weight"] = torch.cat([x[1] for x in gu])
        sd[p + "mlp.down_proj.weight"] = torch.cat([_deq(s, p + "mlp.down_proj.weight") for s in shards], 1)
    return sd


def logits_from_shards(config: dict, shards: list[dict], ids, ep: bool = False):
    """Logits of the inference replica's weights (de-fused, dequantized), through the
    transformers model's own forward, on token ids."""
    from .train import logits, train_model

    m = train_model(config)
    sd = reconstruct_hf(config, [{k: v.cpu() for k, v in s.items()} for s in shards], ep)
    names = set(dict(m.named_parameters()))
    if names != set(sd):
        raise KeyError(f"reconstruction lacks {sorted(names - set(sd))}, has unknown {sorted(set(sd) - names)}")
    m.load_state_dict(sd, strict=False)  # strict=False: the rotary buffers are not weights
    with torch.no_grad():
        return logits(m, ids).float()


def logits_of_weights(config: dict, weights: dict, ids, dtype=None):
    """Logits, through the transformers model's own forward, of full training weights
    (name -> tensor), first rounded to `dtype` (e.g. torch.bfloat16) when given."""
    from .train import logits, train_model

    m = train_model(config)
    names = set(dict(m.named_parameters()))
    if names != set(weights):
        raise KeyError(f"weights lack {sorted(names - set(weights))}, have unknown {sorted(set(weights) - names)}")
    sd = {n: (w.to(dtype) if dtype is not None else w).float().cpu() for n, w in weights.items()}
    m.load_state_dict(sd, strict=False)  # strict=False: the rotary buffers are not weights
    with torch.no_grad():
        return logits(m, ids).float()


def logits_close(ref, got, quant: str | None) -> tuple[bool, float]:
    """(within tolerance, relative max error): BF16 2e-2, FP8 2.5e-1 of the logits' range."""
    ref, got = ref.detach().float(), got.detach().float()
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))
    tol = 0.25 if quant == "fp8" else 0.02
    return err <= tol, err
