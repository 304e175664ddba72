"""Tests on the real vLLM (`make vllm-test` runs them with .venv-vllm/bin/python). Without vLLM
every test here skips, with the reason make vllm-setup wrote when the install failed."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _why_not():
    if importlib.util.find_spec("vllm") is not None:
        return None
    failed = os.path.join(ROOT, ".venv-vllm", "FAILED")
    if os.path.exists(failed):
        with open(failed) as f:
            return "vLLM is not installed: " + f.read().strip().replace("\n", " | ")
    return "vLLM is not importable in this Python (make vllm-test runs these in .venv-vllm)"


def pytest_collection_modifyitems(config, items):
    why = _why_not()
    for item in items:
        if "on_vllm" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
