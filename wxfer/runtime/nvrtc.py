"""What the NVRTC-compiled kernels of the extension (the FP8 quantizer, the batched copy) share
on the Python side: where pip wheels put libnvrtc, and the per-device answer to "can the
native kernel run here, and if not, why" (an environment variable can force the fallback)."""

from __future__ import annotations

import os
import sys
import threading


def nvrtc_dirs() -> list:
    """Directories where pip wheels put libnvrtc (nvidia-cuda-nvrtc-cu12, nvidia-cu13, torch)."""
    subs = (("nvidia", "cuda_nvrtc", "lib"), ("nvidia", "cu13", "lib"), ("nvidia", "cu12", "lib"), ("torch", "lib"))
    out = []
    for base in sys.path:
        for sub in subs:
            d = os.path.join(base or ".", *sub)
            if d not in out and os.path.isdir(d):
                out.append(d)
    return out


class Probe:
    """Whether a native kernel can run on a CUDA device, asked of the extension once per device
    (`probe_name`: its function, (device, dirs) -> (usable, why not); it compiles the kernel).
    `env` = `fallback` forces the fallback (`fallback_desc` names it); unset, native or auto:
    the kernel where it can run."""

    def __init__(self, env: str, fallback: str, fallback_desc: str, probe_name: str):
        self.env, self.fallback, self.desc, self.probe_name = env, fallback, fallback_desc, probe_name
        self._lock = threading.Lock()
        self._probed: dict = {}  # CUDA ordinal -> None (usable) or why not

    def allowed(self) -> bool:
        """Does `env` let a native path run (unset, native or auto; not the fallback or a typo)?"""
        return os.environ.get(self.env, "").strip().lower() in ("", "native", "auto")

    def why(self, device, probe: bool = True) -> str | None:
        """None when the kernel can run on `device`, else why not; probe=False: "" when that is
        not known yet (the kernel has not been compiled for that device)."""
        mode = os.environ.get(self.env, "").strip().lower()
        if mode == self.fallback:
            return f"{self.env}={self.fallback}"
        if mode not in ("", "native", "auto"):
            return f"{self.env}={mode!r} (expected native or {self.fallback}): using {self.desc}"
        if device.type != "cuda":
            return f"tensors on {device.type}: the native kernel runs on CUDA devices only"
        import torch

        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if idx in self._probed:
                return self._probed[idx]
            if not probe:
                return ""
            try:
                from .. import _wxfer
            except ImportError as e:
                why = f"the native extension wxfer._wxfer is not built ({e})"
            else:
                ok, why = getattr(_wxfer, self.probe_name)(idx, nvrtc_dirs())
                why = None if ok else why
            self._probed[idx] = why
            return why
