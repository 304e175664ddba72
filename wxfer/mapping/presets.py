"""Presets: Hugging Face configs, their training parameter shapes, and HF -> vLLM rules.

Config values are copied from the models' published config.json files:

- Kimi-K2 (moonshotai/Kimi-K2-Instruct): hidden 7168, 61 layers, first_k_dense_replace 1,
  384 routed experts + 1 shared, moe_intermediate 2048, intermediate 18432, vocab 163840,
  q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
  v_head_dim 128, 64 heads, untied embeddings.
- DeepSeek-V3: as Kimi-K2 but 128 heads, 256 routed experts, first_k_dense_replace 3,
  vocab 129280.
- Qwen3-235B-A22B: hidden 4096, 94 layers, 64 heads, 4 KV heads, head_dim 128,
  128 experts, moe_intermediate 1536, vocab 151936, untied.
- Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts,
  moe_intermediate 768, vocab 151936.
- Qwen3-8B: hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
  12288, vocab 151936, untied.
- Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256.
- Qwen2-7B: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944,
  vocab 152064, q/k/v biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from .rules import Experts, Fuse, FusedExperts, Ignore, Row, Rule

L = "model.layers.{L}."


@dataclass
class Preset:
    """A model family: how to list its HF parameters, and its HF -> vLLM rules."""

    name: str
    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "deepseek_v3"
    rules: list[Rule]
    config: dict = field(default_factory=dict)
    infer_tp: int = 1  # a sensible default inference layout for the CLI
    infer_ep: bool = False
    quant: str | None = None

    def hf_params(
        self, config: Mapping | None = None, fused_experts: bool = False
    ) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
        """name -> (global shape, dtype, expert index or None) of the training model.

        Routed experts as transformers 4 names them (one parameter per expert and
        projection, with its expert index), or with fused_experts=True as transformers 5
        does (``mlp.experts.gate_up_proj`` [E, 2 x inter, hidden] and
        ``mlp.experts.down_proj`` [E, hidden, inter] per layer, expert index None)."""
        return HF_PARAMS[self.arch](_as_dict(config or self.config, self.arch), fused_experts)


# --------------------------------------------------------------------------- shapes


def _attn_gqa(c, i, out, bias=False, qk_norm=False):
    H, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim") or H // nh
    p = L.replace("{L}", str(i)) + "self_attn."
    out[p + "q_proj.weight"] = ((nh * hd, H), "bfloat16", None)
    out[p + "k_proj.weight"] = ((nkv * hd, H), "bfloat16", None)
    out[p + "v_proj.weight"] = ((nkv * hd, H), "bfloat16", None)
    if bias:
        out[p + "q_proj.bias"] = ((nh * hd,), "bfloat16", None)
        out[p + "k_proj.bias"] = ((nkv * hd,), "bfloat16", None)
        out[p + "v_proj.bias"] = ((nkv * hd,), "bfloat16", None)
    out[p + "o_proj.weight"] = ((H, nh * hd), "bfloat16", None)
    if qk_norm:
        out[p + "q_norm.weight"] = ((hd,), "bfloat16", None)
        out[p + "k_norm.weight"] = ((hd,), "bfloat16", None)


def _mlp(prefix, H, inter, out, expert=None):
    out[prefix + "gate_proj.weight"] = ((inter, H), "bfloat16", expert)
    out[prefix + "up_proj.weight"] = ((inter, H), "bfloat16", expert)
    out[prefix + "down_proj.weight"] = ((H, inter), "bfloat16", expert)


def _ends(c, out):
    H, V = c["hidden_size"], c["vocab_size"]
    out["model.norm.weight"] = ((H,), "bfloat16", None)
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = ((V, H), "bfloat16", None)


def _decoder_params(c, attn, mlp):
    """Every parameter of a decoder, in its order: the embedding; per layer i (prefix p) its input
    norm, attn(i, p, out), its post-attention norm, mlp(i, p, out); the final norm and the head."""
    H = c["hidden_size"]
    out = {"model.embed_tokens.weight": ((c["vocab_size"], H), "bfloat16", None)}
    for i in range(c["num_hidden_layers"]):
        p = L.replace("{L}", str(i))
        out[p + "input_layernorm.weight"] = ((H,), "bfloat16", None)
        attn(i, p, out)
        out[p + "post_attention_layernorm.weight"] = ((H,), "bfloat16", None)
        mlp(i, p, out)
    _ends(c, out)
    return out


def _dense_params(c, bias=False, qk_norm=False):
    return _decoder_params(
        c,
        lambda i, p, out: _attn_gqa(c, i, out, bias, qk_norm),
        lambda i, p, out: _mlp(p + "mlp.", c["hidden_size"], c["intermediate_size"], out),
    )


def _experts(prefix, H, E, I, out, fused):
    if fused:
        out[prefix + "gate_up_proj"] = ((E, 2 * I, H), "bfloat16", None)
        out[prefix + "down_proj"] = ((E, H, I), "bfloat16", None)
        return
    for e in range(E):
        _mlp(f"{prefix}{e}.", H, I, out, e)


def _qwen3_moe_params(c, fused=False):
    H = c["hidden_size"]
    E, I = c["num_experts"], c["moe_intermediate_size"]

    def mlp(i, p, out):
        out[p + "mlp.gate.weight"] = ((E, H), "bfloat16", None)
        _experts(p + "mlp.experts.", H, E, I, out, fused)

    return _decoder_params(c, lambda i, p, out: _attn_gqa(c, i, out, False, True), mlp)


def _deepseek_params(c, fused=False):
    H, nh = c["hidden_size"], c["num_attention_heads"]
    qr, kr = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, I, Im = c["n_routed_experts"], c["intermediate_size"], c["moe_intermediate_size"]
    ns = c.get("n_shared_experts", 1)

    def attn(i, p, out):  # multi-head latent attention: low-rank q and kv
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = ((qr, H), "bfloat16", None)
        out[a + "q_a_layernorm.weight"] = ((qr,), "bfloat16", None)
        out[a + "q_b_proj.weight"] = ((nh * (nope + rope), qr), "bfloat16", None)
        out[a + "kv_a_proj_with_mqa.weight"] = ((kr + rope, H), "bfloat16", None)
        out[a + "kv_a_layernorm.weight"] = ((kr,), "bfloat16", None)
        out[a + "kv_b_proj.weight"] = ((nh * (nope + vd), kr), "bfloat16", None)
        out[a + "o_proj.weight"] = ((H, nh * vd), "bfloat16", None)

    def mlp(i, p, out):
        if i < c.get("first_k_dense_replace", 0):
            _mlp(p + "mlp.", H, I, out)
            return
        out[p + "mlp.gate.weight"] = ((E, H), "bfloat16", None)
        if not fused:  # transformers 5 keeps it as a buffer, not a parameter
            out[p + "mlp.gate.e_score_correction_bias"] = ((E,), "float32", None)
        _experts(p + "mlp.experts.", H, E, Im, out, fused)
        _mlp(p + "mlp.shared_experts.", H, Im * ns, out)

    return _decoder_params(c, attn, mlp)


HF_PARAMS: dict[str, Callable] = {
    "llama": lambda c, fused=False: _dense_params(c),
    "qwen2": lambda c, fused=False: _dense_params(c, bias=True),
    "qwen3": lambda c, fused=False: _dense_params(c, qk_norm=True),
    "qwen3_moe": _qwen3_moe_params,
    "deepseek_v3": _deepseek_params,
}

# --------------------------------------------------------------------------- rules


def _common_rules() -> list[Rule]:
    return [
        Fuse("model.embed_tokens.weight", ("model.embed_tokens.weight",), fp8=False),  # vocab parallel
        Fuse("lm_head.weight", ("lm_head.weight",), fp8=False),  # vocab parallel
        Fuse("model.norm.weight", ("model.norm.weight",), tp=False),
        Fuse(L + "input_layernorm.weight", (L + "input_layernorm.weight",), tp=False),
        Fuse(L + "post_attention_layernorm.weight", (L + "post_attention_layernorm.weight",), tp=False),
    ]


def _gqa_rules(bias=False, qk_norm=False) -> list[Rule]:
    a = L + "self_attn."
    heads = ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")
    rules: list[Rule] = [
        Fuse(a + "qkv_proj.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), heads=heads),
        Row(a + "o_proj.weight", (a + "o_proj.weight",)),
    ]
    if bias:
        rules.append(Fuse(a + "qkv_proj.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), heads=heads))
    if qk_norm:
        rules += [
            Fuse(a + "q_norm.weight", (a + "q_norm.weight",), tp=False),
            Fuse(a + "k_norm.weight", (a + "k_norm.weight",), tp=False),
        ]
    return rules


def _mlp_rules(prefix: str) -> list[Rule]:
    return [
        Fuse(prefix + "gate_up_proj.weight", (prefix + "gate_proj.weight", prefix + "up_proj.weight")),
        Row(prefix + "down_proj.weight", (prefix + "down_proj.weight",)),
    ]


def _experts_rules(n_key: str) -> list[Rule]:
    """Routed experts as transformers 4 names them (per expert) and as transformers 5 does
    (fused 3-D); a model has one or the other, the rule that finds its names applies."""
    e = L + "mlp.experts.{E}."
    return [
        Experts(
            L + "mlp.experts",
            (e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"),
            n_experts_key=n_key,
        ),
        FusedExperts(
            L + "mlp.experts", (L + "mlp.experts.gate_up_proj", L + "mlp.experts.down_proj"), n_experts_key=n_key
        ),
    ]


def dense_rules(bias=False, qk_norm=False) -> list[Rule]:
    return _common_rules() + _gqa_rules(bias, qk_norm) + _mlp_rules(L + "mlp.")


def qwen3_moe_rules(gate_fp8: bool = False) -> list[Rule]:
    """gate_fp8: the router ``mlp.gate`` is FP8 in an FP8 layout too (vLLM quantizes it unless
    the checkpoint's quantization config excludes it, see ``router_quantized``)."""
    return (
        _common_rules()
        + _gqa_rules(False, True)
        + [
            Fuse(L + "mlp.gate.weight", (L + "mlp.gate.weight",), tp=False, fp8=gate_fp8),
            *_experts_rules("num_experts"),
        ]
    )


def router_quantized(config: Mapping) -> bool:
    """Whether vLLM builds the MoE router ``mlp.gate`` as an FP8 linear for this config: its
    quantization_config is FP8 and does not exclude the gate (``modules_to_not_convert`` /
    ``ignored_layers`` naming ``mlp.gate``).  Without a quantization config (BF16 checkpoint,
    FP8 chosen at serving time) vLLM's own rule is not known here: the gate stays BF16."""
    q = dict(config).get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() != "fp8":
        return False
    skip = list(q.get("modules_to_not_convert") or []) + list(q.get("ignored_layers") or [])
    return not any(s.endswith("mlp.gate") or s == "gate" or ".mlp.gate" in s for s in skip)


def deepseek_rules() -> list[Rule]:
    a = L + "self_attn."
    return _common_rules() + [
        # MLA: q_a_proj and kv_a_proj_with_mqa fused and replicated (vLLM disable_tp=True)
        Fuse(a + "fused_qkv_a_proj.weight", (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"), tp=False),
        Fuse(a + "q_a_layernorm.weight", (a + "q_a_layernorm.weight",), tp=False),
        Fuse(a + "kv_a_layernorm.weight", (a + "kv_a_layernorm.weight",), tp=False),
        Fuse(a + "q_b_proj.weight", (a + "q_b_proj.weight",), heads=("num_attention_heads",)),
        Fuse(a + "kv_b_proj.weight", (a + "kv_b_proj.weight",), heads=("num_attention_heads",)),
        Row(a + "o_proj.weight", (a + "o_proj.weight",)),
        *_mlp_rules(L + "mlp."),  # the first_k_dense_replace dense layers
        *_mlp_rules(L + "mlp.shared_experts."),
        Fuse(L + "mlp.gate.weight", (L + "mlp.gate.weight",), tp=False, fp8=False),  # router: BF16
        Fuse(
            L + "mlp.gate.e_score_correction_bias",
            (L + "mlp.gate.e_score_correction_bias",),
            tp=False,
            fp8=False,
            dtype="float32",
        ),
        *_experts_rules("n_routed_experts"),
    ]


ARCH_RULES: dict[str, Callable[[], list[Rule]]] = {
    "llama": dense_rules,
    "qwen2": lambda: dense_rules(bias=True),
    "qwen3": lambda: dense_rules(qk_norm=True),
    "qwen3_moe": qwen3_moe_rules,
    "deepseek_v3": deepseek_rules,
}

# --------------------------------------------------------------------------- configs


def decoder(
    arch: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    head_dim: int | None = None,
    tie: bool = False,
    **more,
) -> dict:
    """A decoder's Hugging Face config in the keys the presets read: its architecture, sizes,
    vocabulary, head_dim only where given (Llama and Qwen2 take hidden / heads) and tied
    embeddings, then any further keys (`more`: the experts of a MoE, norms)."""
    cfg = dict(architectures=[arch], hidden_size=hidden, num_hidden_layers=layers)
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads)
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    cfg.update(intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tie, **more)
    return cfg


# architecture, hidden, layers, heads, kv heads, intermediate, vocabulary
KIMI_K2 = decoder("DeepseekV3ForCausalLM", 7168, 61, 64, 64, 18432, 163840, first_k_dense_replace=1)
# (then the low-rank attention's dimensions, the routed and shared experts)
KIMI_K2.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
KIMI_K2.update(n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048)
DEEPSEEK_V3 = dict(KIMI_K2, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280)
DEEPSEEK_V3.update(n_routed_experts=256, first_k_dense_replace=3)
QWEN3_235B = decoder("Qwen3MoeForCausalLM", 4096, 94, 64, 4, 12288, 151936, head_dim=128)
QWEN3_235B.update(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536)
QWEN3_30B = decoder("Qwen3MoeForCausalLM", 2048, 48, 32, 4, 6144, 151936, head_dim=128)
QWEN3_30B.update(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QWEN3_8B = decoder("Qwen3ForCausalLM", 4096, 36, 32, 8, 12288, 151936, head_dim=128)
QWEN3_TINY = decoder("Qwen3ForCausalLM", 256, 2, 4, 2, 512, 1024, head_dim=64, tie=True)
LLAMA3_8B = decoder("LlamaForCausalLM", 4096, 32, 32, 8, 14336, 128256)
QWEN2_7B = decoder("Qwen2ForCausalLM", 3584, 28, 28, 4, 18944, 152064)

ARCH_OF = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "qwen3": "qwen3",
    "qwen2": "qwen2",
    "llama": "llama",
}


# transformers 5 writes some keys under a canonical name (its configs' attribute_map):
# Qwen3-MoE's num_experts and DeepSeek-V3's n_routed_experts are num_local_experts in to_dict()
ALIASES: dict[str | None, dict[str, str]] = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts"},
}


def _as_dict(config, arch: str | None = None) -> dict:
    """A config dict from a dict or a transformers PretrainedConfig (its to_dict()), with
    the keys the presets read under their transformers 4 names too."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    config = dict(config)
    for ours, theirs in ALIASES.get(arch, {}).items():
        if ours not in config and theirs in config:
            config[ours] = config[theirs]
    return config


def arch_of(config: Mapping) -> str:
    """The preset architecture of a Hugging Face config: from `architectures`, else from
    `model_type` (a config built in code has architectures=None)."""
    config = _as_dict(config)
    archs = config.get("architectures") or []
    for a in archs:
        if a in ARCH_OF:
            return ARCH_OF[a]
    mt = config.get("model_type") or ""
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ValueError(
        f"no mapping preset for a config with architectures={config.get('architectures')!r} and "
        f"model_type={mt!r}: pass a config whose architectures lists one of {sorted(ARCH_OF)} or whose "
        f"model_type is one of {sorted(MODEL_TYPES)}, or pass mapping=wxfer.mapping.Preset(name, arch, rules, "
        f"config) with your own rules (docs/mapping.md)"
    )


def from_config(name: str, config: Mapping, **kw) -> Preset:
    """The preset of a Hugging Face config (a dict, e.g. ``model.config.to_dict()``, or a
    transformers config object) for its architecture's rules."""
    arch = arch_of(config)
    rules = qwen3_moe_rules(gate_fp8=True) if arch == "qwen3_moe" and router_quantized(config) else ARCH_RULES[arch]()
    return Preset(name, arch, rules, _as_dict(config, arch), **kw)


PRESETS: dict[str, Callable[[], Preset]] = {
    "kimi-k2": lambda: from_config("kimi-k2", KIMI_K2, infer_tp=16, infer_ep=True, quant="fp8"),
    "deepseek-v3": lambda: from_config("deepseek-v3", DEEPSEEK_V3, infer_tp=16, infer_ep=True, quant="fp8"),
    "qwen3-235b": lambda: from_config("qwen3-235b", QWEN3_235B, infer_tp=8, infer_ep=True, quant="fp8"),
    "qwen3-30b-a3b": lambda: from_config("qwen3-30b-a3b", QWEN3_30B, infer_tp=4, infer_ep=True, quant="fp8"),
    "qwen3-8b": lambda: from_config("qwen3-8b", QWEN3_8B, infer_tp=2),
    "qwen3-tiny": lambda: from_config("qwen3-tiny", QWEN3_TINY, infer_tp=2),
    "llama3-8b": lambda: from_config("llama3-8b", LLAMA3_8B, infer_tp=2),
    "qwen2-7b": lambda: from_config("qwen2-7b", QWEN2_7B, infer_tp=2),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


__all__ = [
    "Preset",
    "PRESETS",
    "get_preset",
    "from_config",
    "arch_of",
    "HF_PARAMS",
    "ARCH_RULES",
    "dense_rules",
    "qwen3_moe_rules",
    "router_quantized",
    "deepseek_rules",
    "Ignore",
]
