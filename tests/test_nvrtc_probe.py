"""wxfer.runtime.nvrtc.Probe, the per-device "can the native kernel run here" of the FP8
quantizer and the batched copy, on a machine without CUDA: the environment's choice, a CPU
device, a CUDA device whose probe the extension answers (here: no driver), the answer kept per
device, and the hook after a successful probe."""

import torch

from wxfer import _wxfer
from wxfer.runtime import copies, fp8
from wxfer.runtime.nvrtc import Probe, nvrtc_dirs


def test_the_environment_and_the_device_type_answer_first(monkeypatch):
    p = Probe("WXFER_TESTPROBE", "slow", "the slow path", "copy_probe")
    monkeypatch.setenv("WXFER_TESTPROBE", "slow")
    assert p.why(torch.device("cuda", 0)) == "WXFER_TESTPROBE=slow"
    monkeypatch.setenv("WXFER_TESTPROBE", "fast")
    assert p.why(torch.device("cuda", 0)) == "WXFER_TESTPROBE='fast' (expected native or slow): using the slow path"
    monkeypatch.delenv("WXFER_TESTPROBE")
    assert "CUDA devices only" in p.why(torch.device("cpu"))


def test_a_cuda_device_is_asked_of_the_extension_once_and_the_answer_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _wxfer, "test_probe", lambda idx, dirs: (calls.append((idx, dirs)), (idx == 1, "no kernel"))[1], raising=False
    )
    p = Probe("WXFER_TESTPROBE", "slow", "the slow path", "test_probe")
    assert p.why(torch.device("cuda", 3), probe=False) == ""  # not known yet, not asked
    assert p.why(torch.device("cuda", 3)) == "no kernel"
    assert p.why(torch.device("cuda", 3)) == "no kernel" and len(calls) == 1  # kept
    assert p.why(torch.device("cuda", 1)) is None and len(calls) == 2
    assert calls[0] == (3, nvrtc_dirs())


def test_the_kernels_probes_reach_the_extension():
    """Without libcuda both native kernels say so (the extension's own probe, not a guess); on
    a CUDA machine (NVRTC there) both are usable."""
    why_fp8 = fp8._PROBE.why(torch.device("cuda", 0))
    why_copy = copies._PROBE.why(torch.device("cuda", 0))
    if torch.cuda.is_available():
        assert why_fp8 is None and why_copy is None, (why_fp8, why_copy)
    else:
        for why in (why_fp8, why_copy):
            assert why and ("libcuda" in why or "cuda.h" in why), why
