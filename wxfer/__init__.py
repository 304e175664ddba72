"""wxfer: move freshly trained weights from training GPUs to inference GPUs with one-sided
writes driven by the trainers, replaying a static plan computed once.

The native core (``wxfer._wxfer``) is imported lazily, so the pure-Python parts (the plan,
the mapping, the simulator) work on a machine where the extension is not built.
"""

from __future__ import annotations

import logging

# the library-logging convention: a NullHandler on the package logger, no handlers or levels
# of our own (the application configures logging); children: wxfer.runtime.sender, ...
logging.getLogger("wxfer").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_NATIVE = ("Transport", "Region", "Engine", "Error", "decode_descriptor", "decode_export", "parse_size")
# the product, imported on first use (they need torch)
_PY = {
    "Sender": ("runtime.sender", "Sender"),
    "PushHandle": ("runtime.sender", "PushHandle"),
    "Receiver": ("runtime.receiver", "Receiver"),
    "SetupError": ("runtime.control", "SetupError"),
}


def _native():
    try:
        from . import _wxfer
    except ImportError as e:  # pragma: no cover - depends on the build
        raise ImportError(
            "wxfer's native extension is not built: run `make setup` (or "
            "`python setup.py build_ext --inplace`) first (%s)" % e
        ) from e
    return _wxfer


def backends() -> dict:
    """Which transports are usable here, and why the others are not.

    Returns ``{name: {"available": bool, "reason": str}}`` for every transport wxfer knows
    ("fabric", "verbs", "cuda_ipc"); ``reason`` is empty when available.
    """
    return {name: {"available": ok, "reason": why} for name, (ok, why) in _native().backends().items()}


def __getattr__(name):
    if name in _NATIVE:
        return getattr(_native(), name)
    if name in _PY:
        import importlib

        mod, attr = _PY[name]
        return getattr(importlib.import_module("." + mod, __name__), attr)
    raise AttributeError("module 'wxfer' has no attribute %r" % name)


__all__ = ["backends", "__version__", *_NATIVE, *_PY]
