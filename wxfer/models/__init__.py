"""Tiny Qwen3 / Qwen3-MoE models for the demo and the tests: the trainer side is
transformers' own classes (`train`: configs, `train_model`, FSDP2 sharding), the inference
side is vLLM's layout (`infer`)."""

from .train import CONFIGS, MEDIUM, SMALL, TINY, TINY_MOE, hf_config, logits, shard_fsdp2, train_model
from .infer import (
    inference_layout,
    inference_params,
    logits_close,
    logits_from_shards,
    logits_of_weights,
    preset_for,
    reconstruct_hf,
)

__all__ = [
    "CONFIGS",
    "MEDIUM",
    "SMALL",
    "TINY",
    "TINY_MOE",
    "hf_config",
    "logits",
    "shard_fsdp2",
    "train_model",
    "inference_layout",
    "inference_params",
    "logits_close",
    "logits_from_shards",
    "logits_of_weights",
    "preset_for",
    "reconstruct_hf",
]
