"""Issue 35.8, what the survivors are told (in one process; the multi-process cases are in
test_setup_waits.py and test_torn.py):

- right after a setup (a re-setup over memory an earlier job may have left half written),
  state() reads ``unwritten`` at version -1, not ``complete`` at -1; after a push, complete;
- a forged inference record claiming replicas=1e9 is refused at once, naming the record,
  where the controller had waited its whole setup timeout for a billion workers."""

import time

import pytest

from wxfer import _wxfer
from wxfer.models import TINY, preset_for, train_model
from wxfer.runtime import program
from wxfer.runtime.control import Control, SetupError
from wxfer.runtime.controller import build_plan, mapping_digest

from helpers import joined, receivers_in_threads  # tests/helpers.py

T = 30.0
FABRIC = _wxfer.backends()["fabric"][0]


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
def test_right_after_setup_state_is_unwritten_not_complete_at_minus_1(store):
    from wxfer.runtime.sender import Sender

    _, addr = store
    params, ths = receivers_in_threads(TINY, addr, "fresh", 2, timeout=T)  # (as test_receiver: TP 2)
    model = train_model(TINY)
    for p in model.parameters():
        p.requires_grad_(False)
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name="fresh", timeout=T)
    recvs = joined(ths, T)
    for r in recvs:
        st = r.state()
        assert st["state"] == "unwritten" and st["version"] == -1, st
        assert "no step written since this Receiver's setup" in st["message"], st
    sender.push()
    for r in recvs:
        st = r.state()
        assert st["state"] == "complete" and st["version"] == 1, st
    sender.close()
    for r in recvs:
        r.close()


@pytest.mark.parametrize("replicas, tp", [(10**9, 1), (2, 0), ("4", 1)])
def test_a_forged_layout_record_is_refused_at_once(store, replicas, tp):
    s, _ = store
    ctl = Control(s, "forged%s%s" % (replicas, tp), T)
    ctl.set_json("train/0", program.train_metadata(train_model(TINY)))
    ctl.set_json("train/0/mapping", mapping_digest(preset_for(TINY)))
    ctl.set_json("infer/0", dict(replicas=replicas, tp=tp, gpu=0))
    ctl.add("infer/count", 1)
    t0 = time.monotonic()
    with pytest.raises(SetupError, match=r"inference worker gpu 0's record \(store key infer/0\) says replicas="):
        build_plan(ctl, 1, preset_for(TINY), 20.0, 1 << 20)
    assert time.monotonic() - t0 < 2.0  # at once: not the 20 s wait for the workers
