"""HF training names -> vLLM inference layout: fusion, TP/EP slicing, FP8 block quantization.

Quick start::

    from wxfer.mapping import get_preset, expand, Layout
    preset = get_preset("qwen3-8b")
    shapes = {n: s for n, (s, _, _) in preset.hf_params().items()}
    ex = expand(preset.rules, shapes, Layout(tp=2, quant="fp8"), preset.config)

Adding a rule for your own model (see docs/plan.md)::

    from wxfer.mapping import Fuse, Row, get_preset
    preset = get_preset("qwen3-8b")
    preset.rules.append(Fuse("model.layers.{L}.mlp.my_gate_up.weight",
                             ("model.layers.{L}.mlp.my_gate.weight", "model.layers.{L}.mlp.my_up.weight")))
"""

from .rules import (
    BLOCK,
    Component,
    DestParam,
    Expanded,
    Experts,
    Fuse,
    FusedExperts,
    Ignore,
    Layout,
    MappingError,
    Piece,
    Row,
    Rule,
    Shard,
    cdiv,
    dtype_size,
    expand,
    scale_name,
)
from .presets import (
    ARCH_RULES,
    HF_PARAMS,
    PRESETS,
    Preset,
    arch_of,
    deepseek_rules,
    dense_rules,
    from_config,
    get_preset,
    qwen3_moe_rules,
    router_quantized,
)
from .reference import dequantize_fp8_block, pack_shard, pack_task, quantize_fp8_block

__all__ = [
    "BLOCK",
    "Component",
    "DestParam",
    "Expanded",
    "Experts",
    "Fuse",
    "FusedExperts",
    "Ignore",
    "Layout",
    "MappingError",
    "Piece",
    "Row",
    "Rule",
    "Shard",
    "cdiv",
    "dtype_size",
    "expand",
    "scale_name",
    "ARCH_RULES",
    "HF_PARAMS",
    "PRESETS",
    "Preset",
    "arch_of",
    "deepseek_rules",
    "dense_rules",
    "from_config",
    "get_preset",
    "qwen3_moe_rules",
    "router_quantized",
    "dequantize_fp8_block",
    "pack_shard",
    "pack_task",
    "quantize_fp8_block",
]
