"""The inference side of the tiny Qwen3: vLLM's layout (fused ``qkv_proj`` and
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


def inference_params(config: dict, tp: int, rank: int, quant: str | None = None, ep: bool = False,
                     device="cpu") -> dict:
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
        out.append(w[o:o + s])
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


def reconstruct_hf(config: dict, shards: list[dict]) -> dict:
    """Hugging Face state dict (float32) of a dense Qwen3 from one replica's TP shards
    (``shards[r]``: rank r's inference-layout tensors, FP8 or BF16)."""
    tp = len(shards)
    H, nh, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or H // nh
    q_r = nh * hd // tp
    kv_r = (nkv * hd // tp) if tp <= nkv else hd
    inter_r = config["intermediate_size"] // tp
    kv_ranks = _heads_of(nkv, tp)
    sd = {"model.embed_tokens.weight": torch.cat([_deq(s, "model.embed_tokens.weight") for s in shards]),
          "lm_head.weight": torch.cat([_deq(s, "lm_head.weight") for s in shards]),
          "model.norm.weight": _deq(shards[0], "model.norm.weight")}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight", a + "q_norm.weight",
                  a + "k_norm.weight"):
            sd[n] = _deq(shards[0], n)
        qkv = [_split_rows(_deq(s, a + "qkv_proj.weight"), (q_r, kv_r, kv_r)) for s in shards]
        sd[a + "q_proj.weight"] = torch.cat([x[0] for x in qkv])
        sd[a + "k_proj.weight"] = torch.cat([qkv[r][1] for r in kv_ranks])
        sd[a + "v_proj.weight"] = torch.cat([qkv[r][2] for r in kv_ranks])
        sd[a + "o_proj.weight"] = torch.cat([_deq(s, a + "o_proj.weight") for s in shards], 1)
        gu = [_split_rows(_deq(s, p + "mlp.gate_up_proj.weight"), (inter_r, inter_r)) for s in shards]
        sd[p + "mlp.gate_proj.weight"] = torch.cat([x[0] for x in gu])
        sd[p + "mlp.up_proj.weight"] = torch.cat([x[1] for x in gu])
        sd[p + "mlp.down_proj.weight"] = torch.cat([_deq(s, p + "mlp.down_proj.weight") for s in shards], 1)
    return sd


def logits_from_shards(config: dict, shards: list[dict], ids):
    """Logits of the inference replica's weights (de-fused, dequantized) on token ids."""
    from .qwen3 import Qwen3ForCausalLM
    m = Qwen3ForCausalLM(config)
    sd = reconstruct_hf(config, [{k: v.cpu() for k, v in s.items()} for s in shards])
    missing = set(dict(m.named_parameters())) - set(sd)
    if missing:
        raise KeyError(f"reconstruction lacks {sorted(missing)}")
    m.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return m(ids).float()


def logits_close(ref, got, quant: str | None) -> tuple[bool, float]:
    """(within tolerance, relative max error): BF16 2e-2, FP8 2.5e-1 of the logits' range."""
    ref, got = ref.detach().float(), got.detach().float()
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))
    tol = 0.25 if quant == "fp8" else 0.02
    return err <= tol, err
