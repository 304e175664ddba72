"""Glue for inference engines (vLLM worker extension)."""
