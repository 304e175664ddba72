"""The training side of the demo and the tests: transformers' own model classes
(``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) built from a small config with random
weights, and FSDP2 sharding of them.

The configs are plain dicts in Hugging Face's keys (with ``architectures``), so that the
same dict is the mapping's config (``wxfer.mapping.from_config``).  transformers 5 stores
the routed experts of a MoE layer as two fused 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2 x inter, hidden], ``mlp.experts.down_proj``
[E, hidden, inter]); FSDP2 shards them along dim 0, the experts.
"""

from __future__ import annotations

from ..mapping.presets import decoder

_NORMS = dict(rms_norm_eps=1e-6, rope_theta=10000.0)
# architecture, hidden, layers, heads, kv heads, intermediate, vocabulary (mapping.presets.decoder);
# TINY: head_dim 128 and 128-row TP shards so that FP8 block quantization applies with TP=2
TINY = decoder("Qwen3ForCausalLM", 256, 2, 4, 2, 512, 512, head_dim=128, **_NORMS)
SMALL = decoder("Qwen3ForCausalLM", 512, 4, 8, 4, 1536, 4096, head_dim=64, **_NORMS)
MEDIUM = decoder("Qwen3ForCausalLM", 1024, 8, 8, 4, 3072, 8192, head_dim=128, **_NORMS)
TINY_MOE = dict(
    TINY,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
)
CONFIGS = {"tiny": TINY, "small": SMALL, "medium": MEDIUM, "tiny-moe": TINY_MOE}

_CLASSES = {
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def _classes(config: dict):
    import transformers

    arch = (config.get("architectures") or [None])[0]
    if arch not in _CLASSES:
        raise ValueError(
            f"wxfer.models: no transformers class for architectures={config.get('architectures')!r}; "
            f"known: {sorted(_CLASSES)}"
        )
    c, m = _CLASSES[arch]
    return getattr(transformers, c), getattr(transformers, m)


def hf_config(config: dict):
    """The transformers config object of a config dict (no KV cache: training forwards)."""
    cfg_cls, _ = _classes(config)
    c = cfg_cls(**{k: v for k, v in config.items() if k != "architectures"})
    c.architectures = list(config["architectures"])
    c.use_cache = False
    return c


def train_model(config: dict, seed: int = 0, dtype=None):
    """transformers' model class of `config` with random weights (its own initialization,
    seeded: every rank builds the same weights), float32 unless `dtype`.  Builds on the
    current default device (``with torch.device("meta"):`` gives a meta model)."""
    import torch

    _, model_cls = _classes(config)
    c = hf_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = model_cls(c)
    if dtype is not None:
        m = m.to(dtype)
    return m


def logits(model, ids):
    """The model's logits (float) on token ids, through transformers' own forward."""
    return model(input_ids=ids, use_cache=False).logits


def shard_fsdp2(model, mesh, expert_mesh=None, offload: bool = False):
    """FSDP2 ``fully_shard`` per decoder layer and at the root; a MoE layer's routed experts
    (``mlp.experts``) on `expert_mesh` when given (their own FSDP unit, sharded along dim 0,
    the experts).  offload: CPUOffloadPolicy (pinned when CUDA is present)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if expert_mesh is not None and experts is not None:
            fully_shard(experts, mesh=expert_mesh, **kw)
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model
