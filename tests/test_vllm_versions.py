"""wxfer's vLLM engines against the weight-transfer API of vLLM 0.26, 0.32 and 0.33, without vLLM:
stand-ins for each version's ABCs, factories, worker session and LLM (tests/vllm_fakes.py says
which file of which version each mirrors).  Checked: the version detection and its refusal by
name; our worker and trainer classes built over each version's ABC instantiate (every abstract
method there), with vLLM's signatures; the checks that catch a class built for the wrong version;
each factory's calling convention reaching our trainer_init; and the RPC sequence a trainer round
makes through each version's LLM, with a real worker engine over a stand-in Receiver."""

import inspect
import time
import types

import pytest
import torch
import vllm_fakes as F
from test_vllm_backend import FakeReceiver, _model, cpu_worker_runtime

from wxfer.integrations.vllm import engine as E
from wxfer.integrations.vllm import trainer as TR
from wxfer.integrations.vllm.versions import UnsupportedVLLM, api_for, check_bases, compatible
from wxfer.models import TINY

SHAPES = ("0.26", "0.32", "0.33")
WORKER_RPCS = ("init_transfer_engine", "start_weight_update", "update_weights", "receive_weights")
WORKER_RPCS += ("finish_weight_update", "shutdown")


def test_the_version_is_detected_and_an_unread_one_refused_by_name():
    assert [api_for(v) for v in ("0.26.0", "0.32.0", "0.32.0+cpu", "0.33.0", "0.33.2", "0.34.0")] == [
        "0.26",
        "0.32",
        "0.32",
        "0.33",
        "0.33",
        "0.33",  # 0.34's weight-transfer ABCs and factories are 0.33's, byte for byte
    ]
    for v in ("0.25.1", "0.29.0", "0.35.0", "dev"):
        with pytest.raises(
            UnsupportedVLLM, match=rf"vLLM {v} is not supported .* 0\.26\.x, 0\.32\.x, 0\.33\.x, 0\.34\.x"
        ):
            api_for(v)
    assert api_for("0.29.0", override="0.32") == "0.32"
    with pytest.raises(UnsupportedVLLM, match="WXFER_VLLM_API='0.29'"):
        api_for("0.29.0", override="0.29")


@pytest.mark.parametrize("shape", SHAPES)
def test_the_worker_engine_fills_each_versions_abc(shape, monkeypatch):
    base = F.WORKER_BASES[shape]
    cls = E.build_engine_class(base, shape)
    assert not inspect.isabstract(cls), cls.__abstractmethods__
    for name in sorted(base.__abstractmethods__ | {"update_weights"}):
        assert compatible(getattr(cls, name), getattr(base, name)) is None, name
    assert (cls.init_info_cls, cls.update_info_cls) == (E.WxferInitInfo, E.WxferUpdateInfo)
    check_bases(shape, engine_base=base)
    cfg = types.SimpleNamespace(backend="wxfer")
    vcfg = types.SimpleNamespace(parallel_config=None, model_config=None)
    eng = cls(cfg, vcfg, torch.device("cpu"), torch.nn.Module())  # what create_engine does
    assert eng.model_config is None and eng.device.type == "cpu"
    if shape == "0.26":
        with pytest.raises(NotImplementedError, match="send_weights"):
            cls.trainer_send_weights(iter(()), {})


def test_a_worker_engine_built_for_the_wrong_version_is_caught():
    with pytest.raises(TypeError, match="trainer_send_weights"):  # 0.26's ABC wants it
        E.build_engine_class(F.WorkerBase026, "0.32")(
            None, types.SimpleNamespace(parallel_config=1, model_config=2), 0, 0
        )
    with pytest.raises(UnsupportedVLLM, match=r"vLLM 0\.26\.0 .*declares the abstract trainer_send_weights"):
        check_bases("0.32", engine_base=F.WorkerBase026, version="0.26.0")
    with pytest.raises(UnsupportedVLLM, match="lacks the abstract trainer_send_weights"):
        check_bases("0.26", engine_base=F.WorkerBase032, version="0.32.0")

    class Renamed(F.WorkerBase032):  # a parameter named differently than vLLM's is named
        def init_transfer_engine(self, info): ...

    assert "vLLM's is init_info" in compatible(Renamed.init_transfer_engine, F.WorkerBase032.init_transfer_engine)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_trainer_engine_has_each_versions_signatures(shape):
    base = F.TRAINER_BASES[shape]
    cls = TR.build_trainer_class(base, shape)
    assert not inspect.isabstract(cls), cls.__abstractmethods__
    assert compatible(cls.__init__, base.__init__) is None
    assert compatible(cls.trainer_init, base.trainer_init) is None
    assert cls.init_info_cls is TR.WxferTrainerInitInfo and cls.wxfer_vllm_api == shape
    check_bases(shape, trainer_base=base)
    for other in SHAPES:
        if F.TRAINER_BASES[other] is not base and other != shape:
            with pytest.raises(
                UnsupportedVLLM, match=rf"vLLM 9\.9 \(taken as the {other} .*TrainerWeightTransferEngine"
            ):
                check_bases(other, trainer_base=base, version="9.9")
    if shape == "0.26":  # 0.32's engine over 0.26's ABC: trainer_init would take the config as init_info
        wrong = TR.build_trainer_class(base, "0.32")
        assert "vLLM's is config" in compatible(wrong.trainer_init, base.trainer_init)
    if shape == "0.33":
        wrong = TR.build_trainer_class(base, "0.32")
        assert "rank" in compatible(wrong.__init__, base.__init__)


class WaitingReceiver(FakeReceiver):
    """The stand-in Receiver whose wait_version waits (bounded) for the push on another thread."""

    def wait_version(self, v, timeout):
        deadline = time.monotonic() + timeout
        while self.v < v and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().wait_version(v, timeout)


class FakeSender:
    def __init__(self, receivers):
        self.version, self.receivers, self.pushed = 0, receivers, []

    def push(self, version):
        self.pushed.append(version)
        for r in self.receivers:
            r.v = version
        self.version = version

    def close(self):
        pass


@pytest.fixture
def fake_runtime(monkeypatch):
    cpu_worker_runtime(monkeypatch, WaitingReceiver)


def _worker_engine(shape):
    """Our worker engine over `shape`'s ABC, built as create_engine builds it, on a tiny model."""

    class Engine(E.build_engine_class(F.WORKER_BASES[shape], shape)):
        def _parallel(self):
            return dict(tp=1, rank=0, dp_rank=0, dp=1, ep=False)

        def _hf_config(self):
            return dict(TINY, name_or_path="tiny")

    fac = F.Factories(shape)
    fac.register_worker("wxfer", Engine)
    vcfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(), model_config=None)
    return fac.create_engine(types.SimpleNamespace(backend="wxfer"), vcfg, torch.device("cpu"), _model(TINY, 1, 0))


@pytest.mark.parametrize("shape", SHAPES)
def test_each_versions_factory_and_llm_drive_a_trainer_round(shape, fake_runtime, monkeypatch):
    """The trainer engine reached through `shape`'s factory (by module path, as register() does),
    then one send_weights through that version's LLM into our worker engine: the RPCs in order,
    the weight version where the LLM has one."""
    eng = _worker_engine(shape)
    log = []
    llm = F.LLMS[shape](F.Worker(shape, eng), log)
    client = TR.LLMClient(llm)
    cls = TR.build_trainer_class(F.TRAINER_BASES[shape], shape)
    monkeypatch.setitem(TR._CLASSES, "trainer", cls)  # what _trainer_class() builds over the real vLLM
    seen = {}

    def setup(klass, init_info, client, source, config=None):  # the rendezvous itself is tested on vLLM
        seen.update(klass=klass, config=config, source=source)
        self = klass._new(init_info, client, source, config)
        client.init_weight_transfer_engine(dict(store="h:1", mapping="tiny-name", proof=False, timeout=30.0))
        self.sender = FakeSender([eng.receiver])
        return self

    monkeypatch.setattr(TR.TrainerSide, "_setup", classmethod(setup))
    fac = F.Factories(shape)
    fac.register_trainer("wxfer", TR.__name__, "WxferTrainerWeightTransferEngine")
    info = TR.WxferTrainerInitInfo(store="h:1", mapping="tiny-name", proof=False, update_timeout=5.0, rank=0)
    src = object()
    if shape == "0.26":
        cfg = types.SimpleNamespace(backend="wxfer")
        t = fac.trainer_init_026("wxfer", cfg, info, client=client, source=src)
        assert t.config is cfg
        with pytest.raises(ValueError, match="config.backend is 'nccl'"):
            fac.trainer_init_026("wxfer", types.SimpleNamespace(backend="nccl"), info, client=client, source=src)
    else:
        t = fac.trainer_init_032(info, client=client, source=src)
    assert type(t) is cls and seen["klass"] is cls and seen["source"] is src
    assert t.is_sender and t.client is client and t.source is src and t.rank == 0
    assert t.send_weights() == 1
    assert eng.receiver.waited == (1, 5.0)
    upd = ("update", {"version": 1, "timeout": 5.0})
    if shape == "0.26":
        assert log == [("init",), ("start",), upd, ("finish",)]
    else:
        assert log == [("init",), ("start",), upd, ("finish", "1")] and llm.get_weight_version() == "1"
    # the next round after a finish that failed on the worker: vLLM keeps that session open
    eng.receiver.st = dict(state="torn", version=-1, ranks=[0], message="torn since step 2")
    with pytest.raises(RuntimeError, match="finish_weight_update raised RuntimeError: .*version 2 is not complete"):
        t.send_weights()
    eng.receiver.st = None
    assert t.send_weights() == 3 and log[-1][0] == "finish" and log[-3] == ("start",)


def test_a_026_client_without_weight_version_is_called_without_it(fake_runtime):
    eng = _worker_engine("0.26")
    log = []
    client = F.HTTPClient026(F.LLM026(F.Worker("0.26", eng), log))
    t = TR.build_trainer_class(F.TrainerBase026, "0.26")._new(
        TR.WxferTrainerInitInfo(update_timeout=5.0, rank=0), client, None, None
    )
    client.init_weight_transfer_engine(dict(store="h:1", mapping="tiny-name", proof=False))
    t.sender = FakeSender([eng.receiver])
    assert t.send_weights() == 1 and log[-1] == ("finish",)
    assert TR.takes_weight_version(client.finish_weight_update) is False
    assert TR.takes_weight_version(F.LLM033.finish_weight_update) is True


def test_a_033_list_payload_reaches_the_engine_as_this_workers_dict(fake_runtime):
    eng = _worker_engine("0.33")
    w = F.Worker("0.33", eng, rank=1, dp_index=1, world_size=2)
    w.init_weight_transfer_engine(dict(store="h:1", mapping="tiny-name", proof=False))
    w.start_weight_update()
    eng.receiver.v = 4
    w.update_weights([{"version": 9}] * 3 + [{"version": 4, "timeout": 2.0}])  # index 1 * 2 + 1
    assert eng.receiver.waited == (4, 2.0)
    w.finish_weight_update()
