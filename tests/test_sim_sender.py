"""The simulator beside a real Sender (CPU, fabric tcp): the kinds the Sender runs its tasks as
are the ones the plan's metadata gives, and the host-cost fit reconstructs the push loop's
batches from the Sender's own trace."""

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, inference_params, preset_for, train_model
from wxfer.runtime.receiver import Receiver
from wxfer.testing import in_thread

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
T = 20.0


@pytest.mark.timeout(120)
def test_sender_kinds_match_the_plan_and_its_trace_fits(store):
    from wxfer.plan.kinds import task_kinds
    from wxfer.zerocopy import batches
    from wxfer.plan.calibrate import predict
    from wxfer.meta import Calibration
    from wxfer.runtime import program
    from wxfer.runtime.sender import Sender
    from wxfer.tools.calibrate import host_costs, hostfit_keys

    s, addr = store
    name = "simkinds"
    kw = dict(mapping=preset_for(TINY).name, store=addr, replica=0, tp=2, replicas=1, name=name, timeout=T)
    params = [inference_params(TINY, 2, r) for r in range(2)]
    ths = [in_thread(Receiver, params[r], rank=r, **kw) for r in range(2)]
    torch.manual_seed(0)
    model = train_model(TINY).to(torch.bfloat16)  # the inference dtype: zero copy where the layout allows
    for p in model.parameters():
        p.requires_grad_(False)
    meta = {d["name"]: d for d in program.train_metadata(model)}
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, watermark="1MiB")
    recvs = []
    try:
        for th, box in ths:
            th.join(T)
            assert "error" not in box, box.get("error")
            recvs.append(box["value"])
        got = sender.task_kinds()
        want = task_kinds(sender.plan, meta)
        assert got == {t: want[t] for t in got}  # the runtime decides as the plan's rule says
        assert {"zero_copy", "packed"} <= set(got.values())
        h = host_costs(sender, 2, None, 1.0)
        nb = sum(len(batches([got[op.task] for op in g])) for g in sender.program.groups)
        assert h["host_batches"] == 2 * nb  # one sample per submit_prepared call of each push
        assert h["host_kinds"] == {k: list(got.values()).count(k) for k in set(got.values())}
        assert h["push_begin_s"] > 0 and h["push_end_s"] > 0  # the stamps' round trips
        assert all(h[k] >= 0 for k in hostfit_keys()) and h["write_call_s"] >= 0
        cal = Calibration(**{k: h[k] for k in hostfit_keys()}, serial=True, host_sync=True, cpu_shared=True)
        # the machine's write rate is not part of this fit: given by name (no silent default)
        with pytest.raises(ValueError, match="no write_GBps"):
            predict(sender.plan, cal, kinds=got)
        assert predict(sender.plan, cal, kinds=got, assume={"write_GBps": 1.0}) > h["push_begin_s"] + h["push_end_s"]
    finally:
        sender.close()
        for r in recvs:
            r.close()
