"""Issue 24: the simulator predicts out of sample on the CPU.  `python -m wxfer calibrate`
(its own process, its probe models: a 4-layer tiny Qwen3 and a tiny MoE) measures this
machine; then pushes of a model it never saw (a different size and shape mix: hidden 512,
head_dim 64, 6 layers, vocabulary 4096; BF16 TP1, FP8 TP2) are timed here, and each is
predicted from the calibration file alone (the plan and the kinds the Sender ran, the
cluster the file describes; nothing from these pushes' traces or timings).  The bound, 2x
either way, is loose for a 2-core machine shared with other jobs, yet a model that lost a
term (the host per task, the quantizer, the write path) or a calibration of the wrong
dtype falls outside it."""

import json

import pytest

from wxfer import _wxfer
from helpers import run_wxfer  # tests/helpers.py

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")


def _push(d, addr):
    import torch

    from wxfer.tools.calibrate_host import probe

    dev = torch.device("cpu")
    _, summ = probe(d, dev, dev, "auto", addr, 5, {}, inspect=lambda s: (s.plan, s.task_kinds(), s.watermark))
    return summ


@pytest.mark.timeout(300)
def test_calibrated_on_one_model_predicts_a_push_of_another_within_2x(tmp_path):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from wxfer.models import SMALL
    from wxfer.plan.calibrate import assume, fits_at_zero, load, run
    from wxfer.runtime import control

    path = tmp_path / "cal.json"
    run_wxfer("calibrate", "--quick", "--json", "--device", "cpu", "--out", str(path), timeout=170)
    cal = load(str(path))
    # a fit that came out <= 0 here is unmeasured (named, with its samples): taken at 0, by name
    zero = fits_at_zero(cal)
    cal = assume(cal, why="its fit came out <= 0 on this machine", **dict.fromkeys(zero, 0.0))
    probes = json.loads(path.read_text())["measured"]["host_probes"]
    torch.set_num_threads(1)  # as calibrate measured (one rank per core)
    port = control.free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    addr = "127.0.0.1:%d" % port
    other = dict(SMALL, num_hidden_layers=6)
    rows = []
    for name, quant, tp in (("small-bf16", None, 1), ("small-fp8-tp2", "fp8", 2)):
        d = dict(name=name, cfg=other, quant=quant, tp=tp, max_task_bytes=None)
        summ = _push(d, addr)
        plan, kinds, wm = summ["inspect"]
        assert len(plan.tasks) != probes["bf16" if quant is None else "fp8"]["tasks"]  # not a model it probed
        r = run(plan, cal, kinds=kinds, watermark_bytes=wm or (1 << 50))
        assert set(r.assumptions) <= set(zero)  # the simulation lists what it took as assumed
        ms = (summ["push_s"] * 1e3, r.simulated_s * 1e3)
        rows.append((name, *ms, r.simulated_s / summ["push_s"], r.bound_by, summ["kinds"]))
    del store
    print("\n".join("%s: push %.2f ms, predicted %.2f ms, ratio %.2f (bound by %s; %s)" % row for row in rows))
    for name, push, pred, ratio, _, _ in rows:
        assert 0.5 <= ratio <= 2.0, rows
