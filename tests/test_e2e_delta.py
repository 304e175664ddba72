"""`python -m wxfer demo --delta --change-rate 0.01 --fp8 --json` (issue 36): real processes
(two FSDP2 trainer ranks over gloo, four inference workers), fabric tcp; after every push each
worker's apply(), then every byte checked against the reference packing (a dense push's)."""

import os

import pytest

from wxfer import _wxfer

from helpers import run_json  # tests/helpers.py

pytestmark = pytest.mark.slow  # make test-slow (CI runs it after make test)

FABRIC = _wxfer.backends()["fabric"][0]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
@pytest.mark.timeout(240)
def test_demo_delta_fp8_reports_bytes_and_stays_bit_identical():
    argv = ["demo", "--size", "tiny", "--steps", "3", "--delta", "--change-rate", "0.01", "--fp8"]
    argv += ["--delta-link-gbps", "1"]  # a 1 Gb/s link: on one host the measured one is loopback
    argv += ["--json", "--no-simulate", "--timeout", "180"]
    res, _ = run_json("-m", "wxfer", *argv, timeout=230, env=dict(WXFER_DEMO_CPU="1"))
    assert res["verified"] and res["bitexact"] and res["delta"] and res["fp8"]
    assert res["delta_link"]["link_Bps"] == 1e9 / 8 and not res["delta_link"]["measure_link"]
    steps = res["delta_steps"]
    assert [s["bitexact"] for s in steps] == [True] * 3
    assert steps[0]["tasks_delta"] == 0 and steps[0]["sent_bytes"] >= res["dense_bytes"]  # the first push: dense
    assert all(s["tasks_delta"] > 0 for s in steps[1:])
    assert 0 < res["change_rate"] < 0.1 and res["change_rate_requested"] == 0.01
    assert 0 < res["delta_bytes"] < 0.2 * res["dense_bytes"]
    # what was sent is the records (and the version stamps), not more
    assert all(s["sent_bytes"] - s["record_bytes"] <= 1024 for s in steps[1:])
    assert res["apply_s"] >= 0
