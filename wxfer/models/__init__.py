"""Tiny Qwen3-style models for the demo and the tests: the trainer side with Hugging Face
names (`qwen3`), and the inference side in vLLM's layout (`infer`)."""
from .qwen3 import CONFIGS, TINY, TINY_MOE, SMALL, Qwen3ForCausalLM, Qwen3MoeForCausalLM, shard_fsdp2
from .infer import inference_layout, inference_params, logits_close, logits_from_shards, preset_for, reconstruct_hf

__all__ = ["CONFIGS", "TINY", "TINY_MOE", "SMALL", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "shard_fsdp2",
           "inference_layout", "inference_params", "logits_close", "logits_from_shards", "preset_for",
           "reconstruct_hf"]
