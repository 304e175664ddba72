"""The vLLM backend's plain-Python parts, without vLLM (tests/on_vllm runs them on the real one):
vLLM's routed-experts names, the FP8 router following the quantization config, the worker engine's
RPCs over a stand-in Receiver (bounded wait, fail-stop finish, no accelerator call on CPU, payload
checks), data_parallel_index, and the trainer side's layout check."""

import sys
import types

import pytest
import torch

from helpers import StoreCtl, module_with  # tests/helpers.py
from wxfer.integrations.vllm import engine as E
from wxfer.integrations.vllm.layout import expected_destinations, proof_digests, select_parameters
from wxfer.mapping import Fuse, Preset, from_config, router_quantized
from wxfer.models import TINY, TINY_MOE, inference_params, preset_for

T = 30.0


def test_routed_experts_names_are_selected_under_the_mapping_names():
    exp = expected_destinations(preset_for(TINY_MOE), TINY_MOE, 1, 0)
    assert "model.layers.0.mlp.experts.w13_weight" in exp
    params = inference_params(TINY_MOE, 1, 0)
    named = [(n.replace(".experts.", ".experts.routed_experts.", 1), t) for n, t in params.items()]
    sel, left, missing = select_parameters(named, exp)
    assert not missing and not left and len(sel) == len(exp)
    got = dict(sel)
    assert got["model.layers.0.mlp.experts.w13_weight"] is params["model.layers.0.mlp.experts.w13_weight"]


def test_the_router_follows_the_quantization_config():
    def gate(cfg):
        (r,) = [r for r in from_config("m", cfg).rules if getattr(r, "dst", "").endswith("mlp.gate.weight")]
        return r.fp8

    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert not router_quantized(TINY_MOE) and gate(TINY_MOE) is False
    assert router_quantized(dict(TINY_MOE, quantization_config=fp8)) and gate(dict(TINY_MOE, quantization_config=fp8))
    excl = dict(fp8, modules_to_not_convert=["model.layers.0.mlp.gate"])
    assert gate(dict(TINY_MOE, quantization_config=excl)) is False
    exp = expected_destinations(from_config("m", dict(TINY_MOE, quantization_config=fp8)), None, 1, 0, "fp8")
    assert exp["model.layers.0.mlp.gate.weight"][1] == "float8_e4m3fn"
    assert "model.layers.0.mlp.gate.weight_scale_inv" in exp


class FakeReceiver:
    made = []

    def __init__(self, named, **kw):
        self.params, self.kw = dict(named), kw
        self.v, self.st, self.closed = -1, None, False
        FakeReceiver.made.append(self)

    def wait_version(self, v, timeout):
        self.waited = (v, timeout)
        if self.v < v:
            raise TimeoutError(f"version {self.v} after {timeout:.0f} s, waiting for {v}")
        return self.v

    def state(self):
        if self.st:
            return self.st
        return dict(state="complete", version=self.v, ranks=[], message=f"step {self.v} complete")

    def close(self):
        self.closed = True


def _model(cfg, tp, rank):
    return module_with(inference_params(cfg, tp, rank))


class Worker(E.WorkerSide):
    def __init__(self, model, cfg):
        self.model, self.cfg, self.device = model, cfg, torch.device("cpu")

    def _parallel(self):
        return dict(tp=2, rank=1, dp_rank=3, dp=4, ep=False)

    def _hf_config(self):
        return dict(self.cfg)

    def parse_update_info(self, d):  # what vLLM's base does
        try:
            return self.update_info_cls(**d)
        except TypeError as e:
            raise ValueError(f"Invalid update_info: {e}") from e


def cpu_worker_runtime(monkeypatch, receiver) -> None:
    """A worker engine's runtime on this CPU: `receiver` for wxfer's Receiver, no store, and
    torch.accelerator.synchronize() refused (a CPU worker must not call it)."""
    import wxfer.runtime.receiver
    from wxfer.runtime import control

    monkeypatch.setattr(wxfer.runtime.receiver, "Receiver", receiver)
    monkeypatch.setattr(control, "resolve_store", lambda *a, **k: "store")

    def no_accelerator():
        raise AssertionError("torch.accelerator.synchronize() called on a CPU worker")

    monkeypatch.setattr(torch.accelerator, "synchronize", no_accelerator, raising=False)


@pytest.fixture
def worker(monkeypatch):
    cpu_worker_runtime(monkeypatch, FakeReceiver)
    w = Worker(_model(TINY, 2, 1), dict(TINY, name_or_path="tiny"))
    w.init_transfer_engine(E.WxferInitInfo(store="h:1", mapping="tiny-name", proof=False, timeout=T))
    return w


def test_finish_runs_the_finalizers_once_complete_and_reports_them(worker):
    from wxfer.integrations.vllm import Finalizer

    order = []
    kept = torch.zeros(4, 8, dtype=torch.bfloat16)
    worker.finalizers = [
        Finalizer("model.layers.0.mlp.experts", {"w13_weight": kept}, lambda: order.append("experts")),
        Finalizer("model.layers.0.self_attn.attn", {}, lambda: order.append("attn"), late=True),
    ]
    worker.finalizers.sort(key=lambda f: f.late)
    worker.finalize_report.update(kept_bytes=sum(f.kept_bytes for f in worker.finalizers))
    r = worker.receiver
    r.v = 1
    worker.start_weight_update()
    worker.update_weights({"version": 1, "timeout": 5})
    worker.finish_weight_update()
    assert order == ["experts", "attn"]
    rep = worker.finalize_report
    assert sorted(rep["modules"]) == ["model.layers.0.mlp.experts", "model.layers.0.self_attn.attn"]
    assert rep["updates"] == 1 and rep["kept_bytes"] == 64 and rep["seconds"] >= 0
    worker.start_weight_update()  # an incomplete update runs no finalizer
    r.v = 2
    worker.update_weights({"version": 2})
    r.st = dict(state="torn", version=-1, ranks=[1], message="torn")
    with pytest.raises(RuntimeError, match="not complete"):
        worker.finish_weight_update()
    assert order == ["experts", "attn"] and worker.finalize_report["updates"] == 1


def test_finish_reports_the_whole_update_timed(worker):
    """update_report: start -> writes -> finish on the worker, each part measured (a finalizer
    that sleeps 50 ms shows in finalize_s and finish_s; an update that failed reports nothing)."""
    import time

    from wxfer.integrations.vllm import Finalizer

    worker.finalizers = [Finalizer("model.layers.0.mlp.experts", {}, lambda: time.sleep(0.05))]
    worker.receiver.v = 1
    worker.start_weight_update()
    time.sleep(0.02)
    worker.update_weights({"version": 1, "timeout": 5})
    worker.finish_weight_update()
    rep = worker.update_report
    assert rep["version"] == 1 and rep["start_s"] >= 0.02 and rep["write_s"] >= 0, rep
    assert rep["apply_s"] is None and "apply" not in rep, rep  # no staging area: no apply, none reported
    assert rep["finalize_s"] >= 0.05 and rep["finish_s"] >= rep["finalize_s"], rep
    assert rep["total_s"] >= rep["start_s"] + rep["write_s"] + rep["finish_s"] - 1e-6, rep
    worker.start_weight_update()
    worker.receiver.v = 2
    worker.update_weights({"version": 2})
    worker.receiver.st = dict(state="torn", version=-1, ranks=[1], message="torn")
    with pytest.raises(RuntimeError, match="not complete"):
        worker.finish_weight_update()
    assert worker.update_report is rep  # the failed update replaced nothing


def test_delta_fields_are_checked_naming_the_field():
    from wxfer.integrations.vllm import WxferTrainerInitInfo

    assert E.WxferInitInfo(delta_staging="1MiB").delta_staging == 2**20 and E.WxferInitInfo().delta_staging == 0
    for bad in ("lots", -1, True, 1.5):
        with pytest.raises(ValueError, match="init_info: delta_staging must be bytes >= 0"):
            E.WxferInitInfo(delta_staging=bad)
    assert WxferTrainerInitInfo(delta={}).delta is True
    assert WxferTrainerInitInfo(delta={"link_Bps": 1e8}).delta == {"link_Bps": 1e8}
    with pytest.raises(TypeError, match=r"WxferTrainerInitInfo.delta: delta must be True, False or a dict"):
        WxferTrainerInitInfo(delta="yes")
    with pytest.raises(ValueError, match=r"WxferTrainerInitInfo.delta: delta options \['bogus'\] unknown"):
        WxferTrainerInitInfo(delta={"bogus": 1})
    with pytest.raises(ValueError, match=r"WxferTrainerInitInfo.delta_staging must be > 0 bytes with delta on"):
        WxferTrainerInitInfo(delta=True, delta_staging=0)
    with pytest.raises(ValueError, match=r"WxferTrainerInitInfo.delta_staging must be bytes >= 0"):
        WxferTrainerInitInfo(delta=True, delta_staging="lots")
    assert WxferTrainerInitInfo(delta=False, delta_staging=0).delta is False  # dense: no staging needed


def _with_staging(r, heads):
    """The FakeReceiver `r` with a real delta.Staging (its buffer on the host, no transport): one
    slot per trainer rank of `heads`, each holding a record-free header of that step; r.apply
    applies it as Receiver.apply does (`calls`: the versions asked for)."""
    from wxfer.runtime import delta

    region = types.SimpleNamespace(descriptor=b"", close=lambda: None)
    r.transport = types.SimpleNamespace(register=lambda buf, export: region)
    r.device, r.gpu, r.ctl, r.senders = torch.device("cpu"), 1, StoreCtl(), list(range(len(heads)))
    r.version = lambda: r.v
    r.staging = delta.Staging(r, 64 * len(heads))
    for i, hv in enumerate(heads):
        off, _ = r.staging.slot(i, len(heads))
        head = delta.HEAD.pack(delta.MAGIC, hv, -1, 0, 0, 0)
        r.staging.buf[off : off + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    calls = []

    def apply(version=None, sender=None):
        calls.append(version)
        return r.staging.apply([], version, sender)

    r.apply = apply
    return calls


def test_finish_applies_the_records_before_the_finalizers_timed(worker):
    from wxfer.integrations.vllm import Finalizer

    order, r = [], worker.receiver
    calls = _with_staging(r, [1, 1])
    real = r.apply

    def apply(version=None):
        order.append("apply")
        real(version)
        return dict(records=3, bytes=120, changed=7, applied_s=0.01, version=version)

    r.apply = apply
    worker.finalizers = [Finalizer("model.layers.0.mlp.experts", {}, lambda: order.append("finalize"))]
    r.v = 1
    worker.start_weight_update()
    worker.update_weights({"version": 1, "timeout": 5})
    worker.finish_weight_update()
    rep = worker.update_report
    assert order == ["apply", "finalize"] and rep["apply"] == dict(records=3, bytes=120, changed=7), rep
    assert rep["apply_s"] > 0 and rep["finish_s"] >= rep["apply_s"] + rep["finalize_s"], rep
    assert calls == [1] and r.staging.applied == {0: 1, 1: 1}  # step 1's slots, asked by version


def test_a_missed_apply_fails_the_update_naming_the_mix_and_the_resync(worker):
    from wxfer.runtime.delta import DeltaError

    r = worker.receiver
    _with_staging(r, [2])

    def apply(version=None):
        raise DeltaError("the delta of step 2 from trainer rank 0 builds on the records of step 1")

    from wxfer.integrations.vllm import Finalizer

    r.apply, r.v, ran = apply, 2, []
    worker.finalizers = [Finalizer("model.layers.0.mlp.experts", {}, lambda: ran.append(1))]
    worker.start_weight_update()
    worker.update_weights({"version": 2, "timeout": 5})
    with pytest.raises(RuntimeError, match=r"version 2 failed.*records of step 1.*mix of versions.*send it dense") as e:
        worker.finish_weight_update()
    assert "previous weight version" not in str(e.value)  # the dense and scattered tasks of 2 landed
    assert isinstance(e.value.__cause__, DeltaError) and worker.update_report is None
    assert ran == []  # nothing finalized over bytes the records did not bring in step


@pytest.mark.parametrize("case", ["later push began", "a slot of another step"])
def test_finish_applies_its_own_version_and_fails_where_a_slot_of_it_was_not_applied(worker, case):
    """finish_weight_update(v) applies step v's records by version: a later push that began
    after the completeness check (version() -1) or a slot whose header is of another step
    leaves records of v unapplied: the update fails saying so and asks for a resync."""
    from wxfer.integrations.vllm import Finalizer

    r, ran = worker.receiver, []
    calls = _with_staging(r, [2, 2] if case == "later push began" else [2, 3])
    worker.finalizers = [Finalizer("model.layers.0.mlp.experts", {}, lambda: ran.append(1))]
    r.v = 2
    worker.start_weight_update()
    worker.update_weights({"version": 2, "timeout": 5})
    if case == "later push began":  # the stamps said complete; then the next push's begin stamps
        r.st, r.v = dict(state="complete", version=2, ranks=[], message="step 2 complete"), -1
    if case == "later push began":
        want = r"version 2 failed.*records were applied while a later push was being written; version now -1"
    else:
        want = r"version 2 failed.*records of trainer rank\(s\) \[1\] were not applied.*version now 2"
    with pytest.raises(RuntimeError, match=want + ".*mix of versions.*send it dense"):
        worker.finish_weight_update()
    assert calls == [2] and ran == [] and r.ctl.kv.get("delta/resync") == 1 and "delta/resync/1" in r.ctl.kv
    if case == "later push began":
        assert r.staging.applied == {0: 2, 1: 2}  # applied by version, though version() is -1


def test_delta_is_refused_where_a_finalizer_rewrites_its_kept_memory(worker):
    from wxfer.integrations.vllm import Finalizer

    f = Finalizer("model.layers.0.mlp.experts", {}, lambda: None, rewrites_kept=True)
    worker.finalizers = [f]
    worker._refuse_delta_over_rewrites(E.WxferInitInfo(), "w")  # dense: fine
    with pytest.raises(RuntimeError, match=r"delta pushes .*model.layers.0.mlp.experts rewrites its kept memory"):
        worker._refuse_delta_over_rewrites(E.WxferInitInfo(delta_staging="1MiB"), "w")
    # the cuda_ipc scatter writes the changed bytes with no staging area: delta on is enough
    with pytest.raises(RuntimeError, match=r"delta pushes .*model.layers.0.mlp.experts rewrites its kept memory"):
        worker._refuse_delta_over_rewrites(E.WxferInitInfo(extra=dict(delta=True)), "w")


class _Lin(torch.nn.Module):
    """A layer whose post-processing keeps its weight transposed (as a GEMM packing would)."""

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)


@pytest.mark.parametrize("rewrites", [False, True])
def test_the_proof_sees_a_finalizer_that_rewrites_its_kept_memory(monkeypatch, rewrites):
    """postproc.classify (its real passes) with vLLM's reference load replaced by the same layer
    built from the checkpoint's bytes: a hook's finalizer that transposes from its kept memory is
    proven either way, and the one whose run rewrites that memory in place (here: transposes it
    there first) is marked rewrites_kept, which the worker's delta refusal reads."""
    from wxfer.integrations.vllm import Finalizer, postproc

    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    live = torch.nn.Sequential()
    live.add_module("lin", _Lin(torch.zeros(4, 4)))  # the worker's model: other weights loaded
    ref = torch.nn.Sequential()
    ref.add_module("lin", _Lin(w))  # vLLM's first load of `w`, post-processed

    def reference(vllm_config, device, checkpoint):
        names = dict(ref.named_modules())
        return postproc._state(names, {}), postproc._fold({m: {} for m in names}), {}

    monkeypatch.setattr(postproc, "_reference", reference)
    kept = torch.zeros(4, 4)

    def hook(model, name, module, ctx):
        if name != "lin":
            return None

        def run():
            if rewrites:
                kept.copy_(kept.t().contiguous())  # post-processing in place, over the kept memory
                module.weight.copy_(kept)
            else:
                module.weight.copy_(kept.t())

        return Finalizer(name, {"weight": kept}, run)

    dests = {"d": ("lin.weight", (4, 4), "float32")}
    packed = {"d": w.view(-1).view(torch.uint8).clone()}
    c = postproc.classify(live, types.SimpleNamespace(model_config=None), "cpu", dests, packed, [], hooks=[hook])
    assert c.refused == [] and [f.module_name for f in c.finalize] == ["lin"], c.summary()
    assert c.finalize[0].rewrites_kept is rewrites
    assert torch.equal(live.lin.weight, torch.zeros(4, 4))  # the live model put back


def test_the_worker_engine_builds_one_receiver_and_fails_stop(worker):
    r = worker.receiver
    assert (r.kw["replica"], r.kw["rank"], r.kw["tp"], r.kw["replicas"], r.kw["mapping"].name) == (
        3,
        1,
        2,
        4,
        "tiny-name",
    )
    assert sorted(r.params) == sorted(inference_params(TINY, 2, 1))
    worker.start_weight_update()
    with pytest.raises(TimeoutError, match="waiting for 1"):  # nothing pushed: the bounded wait ends
        worker.update_weights({"version": 1, "timeout": 0.5})
    assert r.waited == (1, 0.5)
    r.v = 1
    worker.start_weight_update()
    worker.update_weights({"version": 1, "timeout": 5})
    worker.finish_weight_update()
    worker.start_weight_update()
    r.v = 2
    worker.update_weights({"version": 2})
    r.st = dict(state="torn", version=-1, ranks=[1], message="torn since step 2: trainer rank 1 died")
    with pytest.raises(RuntimeError, match=r"version 2 is not complete: torn since step 2.*trainer rank\(s\) \[1\]"):
        worker.finish_weight_update()
    worker.start_weight_update()
    with pytest.raises(RuntimeError, match="without update_weights announcing a version"):
        worker.finish_weight_update()
    for bad, what in (
        ({"bogus": 1}, "Invalid update_info"),
        ({"version": "2"}, "int"),
        ({"version": 1, "timeout": 0}, "timeout"),
    ):
        with pytest.raises(ValueError, match=what):
            worker.update_weights(bad)
    worker.shutdown()
    assert r.closed and worker.receiver is None
    with pytest.raises(RuntimeError, match="before init_weight_transfer_engine"):
        worker.start_weight_update()


def test_the_worker_engine_refuses_a_model_without_a_destination(monkeypatch, worker):
    model = _model(TINY, 2, 1)
    del model.lm_head
    w = Worker(model, dict(TINY))
    with pytest.raises(RuntimeError, match=r"lacks 1 parameter\(s\) .*lm_head.weight"):
        w.init_transfer_engine(E.WxferInitInfo(store="h:1", proof=False))
    model = _model(TINY, 2, 1)
    model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(ValueError, match=r"lm_head.weight: vLLM holds \(0,\) bfloat16"):
        Worker(model, dict(TINY)).init_transfer_engine(E.WxferInitInfo(store="h:1", proof=False))


def test_parallel_info_takes_the_data_parallel_index(monkeypatch):
    from wxfer.integrations.vllm import parallel_info

    ps = types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2, get_tensor_model_parallel_rank=lambda: 1)
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = ps
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    pc = types.SimpleNamespace(data_parallel_rank=0, data_parallel_index=2, data_parallel_size=4)
    info = parallel_info(types.SimpleNamespace(parallel_config=pc))
    assert info == dict(tp=2, rank=1, dp_rank=2, dp=4, ep=False)


def test_the_trainers_check_names_what_their_mapping_lays_differently(store):
    from wxfer.integrations.vllm.proof import LayoutProofError, trainer_check
    from wxfer.runtime import control

    s, _ = store
    ctl = control.Control(s, "proof", T)
    good = preset_for(TINY)
    for rank in (0, 1):
        d = proof_digests(good, None, 2, rank, None, False, [0, 1])
        ctl.set_json(
            "vllm/proof/%d" % rank,
            dict(
                gpu=rank,
                tp=2,
                rank=rank,
                replica=0,
                replicas=1,
                quant=None,
                ep=False,
                layers=[0, 1],
                seed=20261201,
                digests=d,
                errors=[],
            ),
        )
    assert trainer_check(ctl, good, T) == {0: len(d), 1: len(d)}
    wrong = Preset(
        good.name,
        good.arch,
        [
            Fuse(r.dst, tuple(reversed(r.srcs))) if getattr(r, "dst", "").endswith("gate_up_proj.weight") else r
            for r in good.rules
        ],
        good.config,
    )
    with pytest.raises(LayoutProofError, match=r"gpu 1 .*model.layers.0.mlp.gate_up_proj.weight") as e:
        trainer_check(ctl, wrong, T)
    assert e.value.workers == 2 and "qkv_proj" not in str(e.value)
    with pytest.raises(RuntimeError, match="failed before the layout proof: boom"):
        trainer_check(control.Control(s, "none", T), good, T, alive=lambda: "boom")


def test_the_trainer_side_bounds_its_rpc_thread():
    from wxfer.integrations.vllm.trainer import LLMClient, _Call, _worker_mapping

    c = _Call(lambda: (_ for _ in ()).throw(ValueError("nope")))
    assert c.result(5, "x") == "x raised ValueError: nope"
    import threading

    ev = threading.Event()
    c = _Call(ev.wait, 10)
    assert c.result(0.1, "update_weights") == "update_weights did not return within 0 s"
    ev.set()
    calls = []
    llm = types.SimpleNamespace(
        init_weight_transfer_engine=lambda r: calls.append(("init", r)),
        update_weights=lambda r: calls.append(("update", r)),
        start_weight_update=lambda: calls.append(("start",)),
        finish_weight_update=lambda weight_version=None: calls.append(("finish", weight_version)),
    )
    cl = LLMClient(llm)
    cl.init_weight_transfer_engine({"a": 1})
    cl.start_weight_update()
    cl.update_weights({"version": 3})
    cl.finish_weight_update(weight_version="3")
    assert calls == [
        ("init", {"init_info": {"a": 1}}),
        ("start",),
        ("update", {"update_info": {"version": 3}}),
        ("finish", "3"),
    ]
    assert _worker_mapping("qwen3-8b") == {"mapping": "qwen3-8b"}
    assert _worker_mapping(preset_for(TINY)) == {"mapping": None, "mapping_name": preset_for(TINY).name}


def test_register_is_a_no_op_without_vllm_and_the_entry_point_names_it():
    import tomllib

    import wxfer.integrations.vllm as wv

    with open(wv.__file__.rsplit("/wxfer/", 1)[0] + "/pyproject.toml", "rb") as f:
        ep = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert ep == {"wxfer": "wxfer.integrations.vllm:register"}
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert wv.register() is False
        with pytest.raises(ImportError):
            E.WxferWeightTransferEngine  # noqa: B018 -- built on first access, needs vLLM


def test_without_the_proof_a_refusing_worker_fails_the_setup_at_once(store):
    import time

    from wxfer.integrations.vllm.trainer import _wait_first_receiver
    from wxfer.runtime import control

    s, _ = store
    ctl = control.Control(s, "first", T)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine failed: RuntimeError: refused"):
        _wait_first_receiver(ctl, lambda: "RuntimeError: refused", T)
    with pytest.raises(TimeoutError, match="no vLLM worker registered within 0 s"):
        _wait_first_receiver(ctl, lambda: None, 0.2)
    ctl.set_json("infer/0", {})
    _wait_first_receiver(ctl, lambda: None, T)
    assert time.monotonic() - t0 < 5


def test_the_trainer_pushes_persistent_buffers_over_their_own_storage():
    """with_persistent_buffers: a persistent buffer (in the state dict, so in the checkpoint:
    transformers 5's DeepseekV3 e_score_correction_bias) appears as a parameter over the same
    storage under its name; a non-persistent one does not; a model without any is returned as is."""
    from wxfer.integrations.vllm.trainer import with_persistent_buffers

    m = torch.nn.Module()
    m.add_module("gate", torch.nn.Linear(4, 2, bias=False))
    m.gate.register_buffer("e_score_correction_bias", torch.zeros(2))
    m.gate.register_buffer("inv_freq", torch.ones(3), persistent=False)
    w = with_persistent_buffers(m)
    got = dict(w.named_parameters())
    assert sorted(got) == ["gate.e_score_correction_bias", "gate.weight"] and w.wxfer_buffers == [
        "gate.e_score_correction_bias"
    ]
    assert got["gate.weight"] is m.gate.weight
    m.gate.e_score_correction_bias.add_(5.0)  # written in place by the training code: seen
    assert got["gate.e_score_correction_bias"].data_ptr() == m.gate.e_score_correction_bias.data_ptr()
    assert torch.equal(got["gate.e_score_correction_bias"], torch.full((2,), 5.0))
    plain = torch.nn.Linear(4, 2)
    assert with_persistent_buffers(plain) is plain


def test_the_traced_maps_wait_names_a_worker_that_failed_or_published_nothing(store):
    """trainer_maps waits (bounded) for each worker's traced map: a failed init is raised as a
    TraceError at once, a worker that publishes nothing as a TimeoutError naming its gpu."""
    import time

    from wxfer.integrations.vllm.traced import TraceError, trainer_maps
    from wxfer.runtime import control

    s, _ = store
    ctl = control.Control(s, "traced_wait", T)
    t0 = time.monotonic()
    with pytest.raises(TraceError, match="failed before gpu 0 published its trace: RuntimeError: boom"):
        trainer_maps(ctl, T, alive=lambda: "RuntimeError: boom")
    with pytest.raises(TimeoutError, match="vLLM worker gpu 0 published no traced map within 0 s"):
        trainer_maps(ctl, 0.2)
    assert time.monotonic() - t0 < 5
