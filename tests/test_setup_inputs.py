"""Issue 25.9: what a receiver or a peer hands to setup, refused clearly or served: malformed
export blobs and handshake requests raise ValueError (as the README promises), a parameter
of no elements is left out instead of failing the model, stamp_slots=0 is named."""

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, inference_params, preset_for
from wxfer.runtime.receiver import Receiver
from wxfer.testing import in_thread
from helpers import expected_shards, frozen_model, joined  # tests/helpers.py

FABRIC = _wxfer.backends()["fabric"][0]
T = 30.0


def _malformed(blob: bytes) -> dict:
    """Export blobs broken in each part of their layout (header, address, regions, length)."""
    out = {
        "empty": b"",
        "truncated": blob[: len(blob) // 2],
        "garbage": bytes(range(200)),
        "padded": blob + b"\0",
        "bad magic": b"ZZ" + blob[2:],
    }
    for pos, what in ((3, "version"), (4, "kind"), (5, "reserved header byte"), (9, "address length")):
        b = bytearray(blob)
        b[pos] ^= 0xFF
        out[what] = bytes(b)
    b = bytearray(blob)
    b[12] ^= 0xFF  # the first byte of the address: a sockaddr family no provider knows
    out["address"] = bytes(b)
    return out


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
def test_malformed_export_blobs_and_requests_raise_value_error():
    t = _wxfer.Transport("fabric", {"provider": "tcp"})
    t.register(torch.zeros(4096, dtype=torch.uint8), export=True)
    blob = t.export()
    for what, bad in _malformed(blob).items():
        w = _wxfer.Transport("fabric", {"provider": "tcp"})
        with pytest.raises(ValueError, match="Transport.connect_request: ") as ei:
            w.connect_request(bad)
        assert isinstance(ei.value, _wxfer.Error), what  # still the module's error (errno kept)
        w.close()
    w = _wxfer.Transport("fabric", {"provider": "tcp"})
    assert w.connect_request(blob)[1] == b""  # the well-formed blob still connects
    with pytest.raises(ValueError, match="Transport.accept: .*unexpected 50-byte connection request"):
        t.accept(bytes(range(50)))
    w.close()
    t.close()


def test_stamp_slots_zero_is_refused_naming_the_option():
    params = inference_params(TINY, 1, 0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"stamp_slots must be an int >= 1 \\(the version stamps.*got {bad!r}"):
            Receiver(params, store="127.0.0.1:1", timeout=1, stamp_slots=bad)


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
def test_a_parameter_of_no_elements_is_left_out_and_the_model_served(store):
    """A 0-element parameter on the receiver (and one on the trainer) is not registered, not
    planned, and named in Receiver.stats()["empty"]; every other byte arrives under version 1
    (setup had failed: the transport refuses an empty buffer)."""
    from wxfer.runtime.sender import Sender

    _, addr = store
    torch.manual_seed(0)
    model = frozen_model(TINY)
    expected = expected_shards(model, TINY)
    zero = torch.nn.Parameter(torch.zeros(0, 4, dtype=torch.bfloat16), requires_grad=False)
    model.model.layers[0].mlp.register_parameter("empty_bias", zero)
    params = inference_params(TINY, 1, 0)
    params["model.layers.0.mlp.empty_bias"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    th = in_thread(Receiver, params, mapping=preset_for(TINY).name, store=addr, name="zero", timeout=T)
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name="zero", timeout=T)
    (recv,) = joined([th], T)
    assert recv.stats()["empty"] == ["model.layers.0.mlp.empty_bias"]
    assert "model.layers.0.mlp.empty_bias" in sender.plan.ignored
    sender.push()
    assert recv.version() == 1
    for _, dst, off, b in expected:
        got = params[dst].view(-1).view(torch.uint8)
        assert torch.equal(got[off : off + b.numel()], b), dst
    sender.close()
    recv.close()
