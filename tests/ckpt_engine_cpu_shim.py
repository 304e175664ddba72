"""Tests only: let checkpoint-engine 0.4.2's own code (ParameterServer.register_checkpoint /
gather_metas / update, worker.update_weights_from_ipc, its ZeroMQ protocol and bucket loop)
run on a machine without CUDA, so that benchmarks/bench_ckpt_engine.py's use of its API is
exercised in a CPU dry run.  bench_ckpt_engine loads this file in both of its processes
when $BCE_CPU_SHIM names it (``install()`` before checkpoint-engine is used).

What it replaces (nothing else): the device manager (CUDA-only there) by a CPU one; pinned
host allocations by plain ones; the CUDA IPC handle of the shared bucket buffer by a
shared-memory (file_system) handle that the worker rebuilds.  The copies, the buckets,
the messages and the worker's state machine are checkpoint-engine's.
"""

from __future__ import annotations

import types


class _CpuModule:
    """The subset of torch.cuda that checkpoint-engine calls, on CPU."""

    @staticmethod
    def set_device(i):
        return None

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def synchronize(*_):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def ipc_collect():
        return None

    @staticmethod
    def mem_get_info(*_):
        return (8 << 30, 16 << 30)

    @staticmethod
    def memory_allocated(*_):
        return 0

    @staticmethod
    def memory_reserved(*_):
        return 0

    @staticmethod
    def get_device_properties(i):
        return types.SimpleNamespace(uuid="cpu-shim-%d" % (i or 0))


class CpuDeviceManager:
    def __init__(self):
        self.device_type = "cpu"
        self.device_module = _CpuModule

    @property
    def backend(self):
        return "gloo"


def rebuild(manager: bytes, handle: bytes, size: int, numel: int):
    """The worker side of share(): the same shared-memory storage as a uint8 tensor."""
    import torch

    st = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (numel,), (1,))


def share(t):
    """In place of torch's reduce_tensor (CUDA IPC): a (function, args) pair pickled by
    value that rebuilds the same memory in another process."""
    t.share_memory_()
    manager, handle, size = t.untyped_storage()._share_filename_cpu_()
    return rebuild, (manager, handle, size, t.numel())


def install():
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    import checkpoint_engine.device_utils as du
    import checkpoint_engine.pin_memory as pm
    import checkpoint_engine.ps as ps
    import checkpoint_engine.worker as wk

    du.DeviceManager = ps.DeviceManager = wk.DeviceManager = CpuDeviceManager
    ps.reduce_tensor = share

    class _Torch(types.ModuleType):
        def __getattr__(self, k):
            return getattr(torch, k)

        @staticmethod
        def empty(*a, pin_memory=False, **k):
            return torch.empty(*a, **k)

    pm.torch = _Torch("torch")
