"""A tiny Qwen3-style causal LM with Hugging Face parameter names (the trainer side).

Dense (``Qwen3ForCausalLM``): embedding, per layer RMSNorm -> attention with q/k RMSNorm,
rotary embeddings and grouped KV heads -> RMSNorm -> SwiGLU MLP, final norm, lm_head.
MoE (``Qwen3MoeForCausalLM``): the MLP is a router (``mlp.gate``) over routed experts
``mlp.experts.{E}``; a rank may hold only some experts (expert parallelism across
sub-meshes); tokens are routed among the experts this rank holds.

The names match ``wxfer.mapping``'s qwen3 / qwen3_moe presets, so the same mapping that
serves Qwen3-8B serves these.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# head_dim 128 and 128-row TP shards so that FP8 block quantization applies with TP=2
TINY = dict(architectures=["Qwen3ForCausalLM"], hidden_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
            vocab_size=512, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
SMALL = dict(TINY, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, intermediate_size=1536, vocab_size=4096)
MEDIUM = dict(TINY, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              head_dim=128, intermediate_size=3072, vocab_size=8192)
TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512, vocab_size=512,
                tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
CONFIGS = {"tiny": TINY, "small": SMALL, "medium": MEDIUM, "tiny-moe": TINY_MOE}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _rope(x, theta: float):
    # x: [B, heads, T, hd]
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or H // self.nh
        self.theta = c.get("rope_theta", 10000.0)
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, c.get("rms_norm_eps", 1e-6))
        self.k_norm = RMSNorm(self.hd, c.get("rms_norm_eps", 1e-6))

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, self.theta), _rope(k, self.theta)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, H: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Router over all experts; only `local` experts are held (and routed to) here."""

    def __init__(self, c, local):
        super().__init__()
        H, E = c["hidden_size"], c["num_experts"]
        self.top_k = c.get("num_experts_per_tok", 2)
        self.local = sorted(local)
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(H, c["moe_intermediate_size"]) for e in self.local})

    def forward(self, x):
        logits = self.gate(x)[..., self.local]
        k = min(self.top_k, len(self.local))
        w = torch.softmax(logits.float(), -1)
        top, idx = w.topk(k, -1)
        mask = torch.zeros_like(w).scatter(-1, idx, top / top.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for j, e in enumerate(self.local):
            out = out + self.experts[str(e)](x) * mask[..., j:j + 1]
        return out


class Layer(nn.Module):
    def __init__(self, c, local_experts=None):
        super().__init__()
        H, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SparseMoe(c, local_experts) if local_experts is not None else MLP(H, c["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, c, local_experts=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, local_experts) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-6))


class Qwen3ForCausalLM(nn.Module):
    """Dense (local_experts=None) or MoE (`local_experts`: the expert ids this rank holds)."""

    def __init__(self, config: dict, local_experts=None):
        super().__init__()
        self.config = dict(config)
        if local_experts is None and "num_experts" in config:
            local_experts = range(config["num_experts"])
        self.model = _Body(self.config, local_experts)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0):
        import zlib
        for n, p in self.named_parameters():
            # seeded per name: the same value whichever experts this rank holds
            g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(n.encode()))
            with torch.no_grad():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def Qwen3MoeForCausalLM(config: dict, local_experts=None):
    return Qwen3ForCausalLM(config, local_experts if local_experts is not None else range(config["num_experts"]))


def shard_fsdp2(model, mesh, expert_mesh=None, offload: bool = False):
    """FSDP2 ``fully_shard`` per layer and at the root; routed experts on `expert_mesh`
    (a sub-mesh) when given.  offload: CPUOffloadPolicy (pinned when CUDA is present)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    for layer in model.model.layers:
        if expert_mesh is not None and isinstance(layer.mlp, SparseMoe):
            for e in layer.mlp.experts.values():
                fully_shard(e, mesh=expert_mesh, **kw)
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model
