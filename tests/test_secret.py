"""Issue 17.8: with a job secret (Sender/Receiver(secret=...) or $WXFER_SECRET) every store
record is authenticated (HMAC-SHA256 over key and value): a store writer without the secret
who swaps two same-size descriptors (lm_head <-> embed_tokens) or injects a record is refused
at setup, on the trainer and on the receiver; with the record intact the push is exact.
Real receiver processes over fabric tcp."""

import json
import os
import sys
import time

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import control
from wxfer.runtime.control import SetupError
from wxfer.models import TINY, preset_for

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
T = 30.0
SECRET = "0123456789abcdef-job-secret"
sys.path.insert(0, HERE)
import fault_worker  # noqa: E402
from test_faults import _expected, _reap, _spawn as _spawn_worker  # noqa: E402


def _spawn(*args):
    """A fault_worker.py process (test_faults') with the job secret set."""
    return _spawn_worker(*args, WXFER_SECRET=SECRET)


def _wait_registered(s, name, procs):
    ctl = control.Control(s, name, T)
    deadline = time.monotonic() + 60
    while not ctl.check("infer/0"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), procs[0].communicate()[0]
        time.sleep(0.05)


@pytest.mark.timeout(150)
def test_a_swapped_descriptor_is_refused_and_an_intact_store_works(store, tmp_path, monkeypatch):
    from wxfer.runtime.sender import Sender

    monkeypatch.delenv("WXFER_SECRET", raising=False)
    s, addr = store
    # 1. tampered: lm_head's and embed_tokens' descriptors (same size) swapped in the record
    procs = [_spawn("receiver", addr, "sec1", 0, 1, tmp_path)]
    try:
        _wait_registered(s, "sec1", procs)
        key = "wxfer/sec1/infer/0"
        raw = bytes(s.get(key))
        assert raw[:4] == b"WXH1"
        meta = json.loads(raw[36:])
        d = meta["desc"]
        d["lm_head.weight"], d["model.embed_tokens.weight"] = d["model.embed_tokens.weight"], d["lm_head.weight"]
        s.set(key, raw[:36] + json.dumps(meta, separators=(",", ":")).encode())
        with pytest.raises(SetupError, match="infer/0' fails authentication"):
            Sender(fault_worker.model(), mapping=preset_for(TINY), store=addr, name="sec1", timeout=T, secret=SECRET)
        out = procs[0].communicate(timeout=T)[0]
        assert procs[0].returncode != 0 and "fails authentication" in out, out[-2000:]
    finally:
        _reap(procs)
    # 2. intact, same secret: every byte lands where it belongs
    procs = [_spawn("receiver", addr, "sec2", 0, 1, tmp_path)]
    try:
        m = fault_worker.model()
        sender = Sender(m, mapping=preset_for(TINY), store=addr, name="sec2", timeout=T, secret=SECRET)
        sender.push()
        ctl = control.Control(s, "sec2", T, secret=SECRET.encode())
        ctl.set("test/dump/0", b"1")
        ctl.get("test/dumped/0", "worker 0's dump", T)
        got = torch.load(tmp_path / "0.pt")
        assert got["version"] == 1
        for dst, off, b in _expected(m):
            assert torch.equal(got["params"][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
        sender.close()
    finally:
        _reap(procs)


def test_records_without_the_secret_are_refused(store):
    s, _ = store
    plain = control.Control(s, "sec3", 5)
    keyed = control.Control(s, "sec3", 5, secret=control.job_secret(SECRET))
    plain.set("plan", b"OKforged")  # injected without the secret
    with pytest.raises(SetupError, match="fails authentication"):
        keyed.get("plan", "the plan")
    keyed.set("infer/0", b"{}")
    assert keyed.get("infer/0", "x") == b"{}"
    with pytest.raises(SetupError, match="lacks"):
        plain.get("infer/0", "x")  # a process without the secret is told so
    other = control.Control(s, "sec3", 5, secret=control.job_secret("another-secret-of-16+"))
    with pytest.raises(SetupError, match="fails authentication"):
        other.get("infer/0", "x")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        control.job_secret("short")
