"""Receiver: registration (deduplicated, contiguous only), descriptors, version stamps, setup
errors raised on both sides; the whole Sender -> Receiver path in one process (threads,
fabric tcp); and the vLLM worker extension's pure-Python parts."""

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import control
from wxfer.runtime.control import SetupError
from wxfer.models import TINY, train_model, inference_params, preset_for
from wxfer.runtime.receiver import Receiver, decode_param_descriptor, encode_param_descriptor

FABRIC = _wxfer.backends()["fabric"][0]
pytestmark = pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
T = 30.0


from helpers import expected_shards, joined, module_with, receivers_in_threads  # noqa: E402 -- tests/helpers.py
from wxfer.testing import in_thread as _in_thread  # noqa: E402


def test_descriptor_round_trip():
    d = encode_param_descriptor(b"\x01\x02region", 12345)
    assert decode_param_descriptor(d) == (b"\x01\x02region", 12345)
    with pytest.raises(ValueError):
        decode_param_descriptor(b"abc")


def test_registration_is_per_storage_and_refuses_non_contiguous(store):
    s, addr = store
    flat = torch.zeros(1000, dtype=torch.bfloat16)
    params = {"a": flat[:400].view(20, 20), "b": flat[400:], "c": torch.zeros(7)}
    th, box = _in_thread(Receiver, params, store=addr, replica=0, rank=0, tp=1, replicas=1, name="reg", timeout=T)
    ctl = control.Control(s, "reg", T)
    meta = ctl.get_json("infer/0", "receiver metadata")
    assert meta["params"]["a"] == [[20, 20], "bfloat16"] and meta["tp"] == 1 and meta["transport"] == "fabric"
    import base64

    da = decode_param_descriptor(base64.b64decode(meta["desc"]["a"]))
    db = decode_param_descriptor(base64.b64decode(meta["desc"]["b"]))
    dc = decode_param_descriptor(base64.b64decode(meta["desc"]["c"]))
    assert da[0] == db[0] != dc[0]  # a and b share one registered storage
    assert (da[1], db[1], dc[1]) == (0, 800, 0)
    # the controller refuses: the receivers learn it and raise it too
    ctl.set("status", control.encode_result(None, "PlanError: model.x is missing"))
    th.join(T)
    assert isinstance(box.get("error"), SetupError) and "model.x is missing" in str(box["error"])
    with pytest.raises(ValueError, match="not contiguous"):
        Receiver({"t": torch.zeros(4, 4).t()}, store=addr, name="nc", timeout=1)


def _tiny_model():
    m = train_model(TINY)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _expected(model, tp, quant):
    out = [dict() for _ in range(tp)]
    for rank, dst, off, b in expected_shards(model, TINY, tp, quant):
        out[rank].setdefault(dst, []).append((off, b))
    return out


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_sender_to_receivers_in_one_process(store, quant):
    from wxfer.runtime.sender import Sender

    s, addr = store
    name = "one" + str(quant)
    tp = 2
    params, ths = receivers_in_threads(TINY, addr, name, tp, quant, timeout=T)
    model = _tiny_model()
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, watermark="1MiB")
    recvs = joined(ths, T)
    assert [r.version() for r in recvs] == [-1, -1]
    sender.push()
    assert [r.version() for r in recvs] == [1, 1]
    exp = _expected(model, tp, quant)
    for r in range(tp):
        for n, lst in exp[r].items():
            got = params[r][n].view(-1).view(torch.uint8)
            for off, b in lst:
                assert torch.equal(got[off : off + b.numel()], b), f"{n} on rank {r} differs at {off}"
    # the watermark (1 MiB) bounded what was in flight
    st = sender.stats()
    assert 0 < st["held_peak"] <= (1 << 20) + max(op.nbytes for g in sender.program.groups for op in g)
    # change the weights, push asynchronously
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    before = [{n: t.clone() for n, t in p.items()} for p in params]
    h = sender.push(async_op=True)
    h.wait()
    assert [r.version() for r in recvs] == [2, 2] and h.version == 2
    assert any(not torch.equal(before[0][n].view(torch.uint8), params[0][n].view(torch.uint8)) for n in params[0])
    # nothing changed: same bytes, receivers bit-identical
    moved = sender.engine.stats()["bytes_written"]
    snap = [{n: t.clone() for n, t in p.items()} for p in params]
    sender.push()
    assert sender.engine.stats()["bytes_written"] - moved == sender.bytes_per_step + 2 * 8 * tp  # begin + end stamps
    assert all(
        torch.equal(snap[r][n].view(torch.uint8), params[r][n].view(torch.uint8)) for r in range(tp) for n in params[r]
    )
    assert recvs[0].wait_version(3, 5) == 3
    with pytest.raises(TimeoutError, match="trainer ranks not done: \\[0\\]"):
        recvs[0].wait_version(4, 0.05)
    sender.close()
    for r in recvs:
        r.close()


def test_a_parameter_over_the_watermark_is_named_at_setup(store):
    import warnings
    from wxfer.runtime.sender import Sender

    s, addr = store
    [params], [(th, box)] = receivers_in_threads(TINY, addr, "wmw", timeout=T)
    model = _tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sender = Sender(model, mapping=preset_for(TINY), store=addr, name="wmw", timeout=T, watermark="200KiB")
    th.join(T)
    assert "error" not in box, box.get("error")
    msgs = " ".join(str(w.message) for w in caught)
    # float32 training weights cast to BF16: packed, so they count; 512x256 x 4 bytes > 200 KiB
    assert "model.embed_tokens.weight (524288 bytes) is larger than the watermark (204800 bytes)" in msgs
    assert "model.norm.weight" not in msgs
    sender.push()
    assert box["value"].version() == 1
    exp = _expected(model, 1, None)[0]
    for n, lst in exp.items():
        got = params[n].view(-1).view(torch.uint8)
        assert all(torch.equal(got[off : off + b.numel()], b) for off, b in lst), n
    sender.close()
    box["value"].close()


def test_a_mismatch_is_raised_on_the_trainer_and_on_every_receiver(store):
    from wxfer.runtime.sender import Sender

    s, addr = store
    tp = 2
    params = [inference_params(TINY, tp, r) for r in range(tp)]
    del params[1]["model.layers.1.mlp.down_proj.weight"]
    params[0]["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    ths = [
        _in_thread(Receiver, params[r], store=addr, replica=0, rank=r, tp=tp, replicas=1, name="bad", timeout=T)
        for r in range(tp)
    ]
    with pytest.raises(SetupError) as ei:
        Sender(_tiny_model(), mapping=preset_for(TINY), store=addr, name="bad", timeout=T)
    msg = str(ei.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "replica 0 rank 1" in msg
    assert "model.layers.0.self_attn.o_proj.weight" in msg
    for th, box in ths:
        th.join(T)
        assert isinstance(box.get("error"), SetupError)
        assert "model.layers.1.mlp.down_proj.weight" in str(box["error"])


def test_receivers_that_disagree_on_the_mapping_are_refused(store):
    from wxfer.runtime.sender import Sender

    s, addr = store
    ths = [_in_thread(Receiver, inference_params(TINY, 1, 0), mapping="llama3-8b", store=addr, name="map", timeout=T)]
    with pytest.raises(SetupError, match="uses mapping 'llama3-8b'"):
        Sender(_tiny_model(), mapping=preset_for(TINY), store=addr, name="map", timeout=T)
    ths[0][0].join(T)
    assert isinstance(ths[0][1].get("error"), SetupError)


# --------------------------------------------------------------------------- vLLM adapter


def test_vllm_adapter_selects_what_the_mapping_writes():
    from wxfer.integrations.vllm import expected_destinations, quant_of, select_parameters

    exp = expected_destinations(preset_for(TINY), TINY, 2, 1, "fp8")
    assert exp["model.layers.0.self_attn.qkv_proj.weight"] == ((256 + 128 + 128, 256), "float8_e4m3fn")
    assert exp["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ((4, 2), "float32")
    named = list(inference_params(TINY, 2, 1, "fp8").items())
    named.append(("model.layers.0.self_attn.attn.k_scale", torch.ones(1)))
    assert quant_of(named) == "fp8"
    sel, left, missing = select_parameters(named, exp)
    assert left == ["model.layers.0.self_attn.attn.k_scale"] and not missing and len(sel) == len(exp)
    sel, left, missing = select_parameters(named[1:], exp, skip=r"lm_head")
    assert "lm_head.weight" in left and missing == sorted({named[0][0], "lm_head.weight"})


def test_vllm_worker_extension_builds_the_receiver(monkeypatch):
    import wxfer.runtime.receiver
    from wxfer.integrations.vllm import WxferWorkerExtension

    seen = {}

    class FakeReceiver:
        def __init__(self, named, **kw):
            seen.update(kw, names=[n for n, _ in named])

        def stats(self):
            return {"gpu": 3}

        def version(self):
            return 7

        def wait_version(self, v, t):
            return max(v, 7)

        def close(self):
            seen["closed"] = True

    monkeypatch.setattr(wxfer.runtime.receiver, "Receiver", FakeReceiver)
    holder = inference_params(TINY, 2, 1)
    model = module_with(holder)  # nested modules named like vLLM's

    class Worker(WxferWorkerExtension):
        def _vllm_parallel_info(self):
            return dict(tp=2, rank=1, dp_rank=1, dp=4, ep=False)

        def _vllm_model(self):
            return model

        def _vllm_hf_config(self):
            return dict(TINY)

    w = Worker()
    assert w.wxfer_version() == -1
    out = w.wxfer_setup(store="h:1", mapping=preset_for(TINY), name="x")
    assert out["gpu"] == 3 and out["left_out"] == [] and out["quant"] is None
    assert (seen["replica"], seen["rank"], seen["tp"], seen["replicas"]) == (1, 1, 2, 4)
    assert sorted(seen["names"]) == sorted(holder)
    assert w.wxfer_version() == 7 and w.wxfer_wait(3) == 7
    w.wxfer_close()
    assert seen["closed"]


def test_a_receiver_gone_mid_run_fails_the_push_in_bounded_time(store, monkeypatch):
    import time
    from wxfer.runtime.sender import Sender

    # its lease bound (3 x 3 s) past write_timeout (5 s): the failed write is what the trainer
    # sees (with the default 1 s lease both bounds are 5 s, and a loaded machine saw the lease)
    monkeypatch.setenv("WXFER_LEASE_S", "3")
    s, addr = store
    params = inference_params(TINY, 1, 0)
    th, box = _in_thread(Receiver, params, mapping=preset_for(TINY).name, store=addr, name="gone", timeout=T)
    sender = Sender(_tiny_model(), mapping=preset_for(TINY), store=addr, name="gone", timeout=T, write_timeout=5)
    th.join(T)
    recv = box["value"]
    sender.push()
    assert recv.version() == 1
    recv.close()  # the inference worker's memory and transport are gone
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        sender.push()
    assert time.monotonic() - t0 < 20
    # the error names the rank, the step, the peer and what failed: the step's first write to
    # it, its begin version stamp (written before any data write of the step)
    msg = str(ei.value)
    assert "trainer rank 0, step 2" in msg and "peer" in msg and "[the version stamps]" in msg, msg
    sender.close()
