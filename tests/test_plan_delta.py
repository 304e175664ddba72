"""The simulator's delta term (wxfer.plan.delta, `plan --delta-rate R`)."""

import json

import pytest

from wxfer.plan.cli import main
from wxfer.plan.delta import records_fraction


def test_records_fraction_is_the_smaller_encoding_and_at_most_dense():
    assert records_fraction(0.0) == pytest.approx(32 / (1 << 20))
    assert records_fraction(0.004) == pytest.approx(0.02 + 32 / (1 << 20))  # index/value pairs: 5 bytes each
    assert records_fraction(0.1) == pytest.approx(0.225 + 32 / (1 << 20))  # bitmask + bytes
    assert records_fraction(0.9) == 1.0  # dense


def _plan(rate: float, capsys) -> dict:
    argv = ["--preset", "qwen3-tiny", "--train-gpus", "2", "--infer-gpus", "2", "--infer-tp", "1"]
    assert main(argv + ["--steps", "200", "--json", "--delta-rate", str(rate)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_delta_rate_restates_the_push_and_falls_back_when_it_does_not_pay(capsys):
    lo = _plan(0.004, capsys)
    assert lo["delta_link_s"] == pytest.approx(lo["lower_bound_s"] * lo["delta_records_fraction"], rel=1e-3)
    assert lo["delta_s"] >= lo["delta_apply_s"] and lo["dense_s"] == lo["simulated_s"]
    assert lo["chosen_s"] == min(lo["delta_s"], lo["dense_s"])
    hi = _plan(0.95, capsys)  # every byte changed: the records cost more than the bytes
    assert hi["delta_records_fraction"] == 1.0
    assert not hi["delta_pays"] and hi["chosen_s"] == hi["dense_s"]
    assert lo["delta_s"] < hi["delta_s"]


def test_the_simulated_delta_push_is_no_shorter_than_dense_when_every_byte_is_sent(capsys):
    # rate 0.9: the records are the bytes (records_fraction 1); a compare that costs nothing: the
    # delta simulation is the dense one with each host waiting for its packings (it reads back each
    # task's count; tests/test_plan_sim_hosts.py holds it to that), plus the apply
    argv = ["--preset", "qwen3-tiny", "--train-gpus", "2", "--infer-gpus", "2", "--infer-tp", "1", "--steps", "200"]
    assert main(argv + ["--json", "--delta-rate", "0.9", "--delta-compare-gbytes", "1e9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["delta_model"] == "simulated" and out["delta_records_fraction"] == 1.0
    assert out["delta_simulated_s"] >= out["simulated_s"] - 1e-4  # simulated_s: 4 digits
    assert out["delta_s"] == pytest.approx(out["delta_simulated_s"] + out["delta_apply_s"], rel=1e-4)
    assert out["delta_terms"]["source"].startswith("compare: given")
    assert "issue 13" in out["calibration_source"]  # the default calibration says whose figures it holds


def test_cross_node_all_gathers_no_longer_share_the_nics_with_dense_writes(capsys):
    # two trainer nodes: the FSDP all-gathers' rings cross the NICs that also carry the dense
    # writes; with 0.1% changed the delta push's all-gather stage is shorter than the dense one's
    argv = ["--preset", "qwen3-8b", "--train-gpus", "16", "--infer-gpus", "8", "--infer-tp", "8", "--steps", "200"]
    assert main(argv + ["--json", "--nic-gbps", "100", "--delta-rate", "0.001"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["delta_stage_busy_s"]["allgather"] < out["stage_busy_s"]["allgather"]
    assert out["delta_s"] < out["dense_s"] and out["delta_pays"]


def test_the_apply_rate_comes_from_the_calibration_unless_given(capsys, tmp_path):
    """A calibration with delta_apply_GBps (bench_delta.py --parts apply --cal-out writes it: the
    native apply's measured rate) sets the delta term's apply; --delta-apply-gbytes overrides it;
    without either, the default (29.27 GB/s, the native apply kernel on one H100)."""
    from wxfer.plan.calibrate import CALIBRATIONS, load, save
    from wxfer.plan.delta import APPLY_GBPS

    cal = tmp_path / "cal.json"
    save(CALIBRATIONS["h200-kernels"], str(cal), {"delta_apply_GBps": 55.5})
    assert load(str(cal)).delta_apply_GBps == 55.5
    argv = ["--preset", "qwen3-tiny", "--train-gpus", "2", "--infer-gpus", "2", "--infer-tp", "1", "--steps", "200"]

    def run(*extra):
        assert main(argv + ["--json", "--delta-rate", "0.004", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    base = run("--calibration", "h200-kernels")
    from_cal = run("--calibration", str(cal))
    given = run("--calibration", str(cal), "--delta-apply-gbytes", "5.55")
    assert base["delta_terms"]["apply_GBps"] == APPLY_GBPS
    assert from_cal["delta_terms"]["apply_GBps"] == 55.5 and "delta_apply_GBps" in from_cal["delta_terms"]["source"]
    assert given["delta_terms"]["apply_GBps"] == 5.55 and "apply: given (5.55" in given["delta_terms"]["source"]
    # the apply term scales with the rate: 10x faster, a tenth of the time
    assert from_cal["delta_apply_s"] == pytest.approx(given["delta_apply_s"] / 10, rel=1e-3)
    assert base["delta_apply_s"] == pytest.approx(from_cal["delta_apply_s"] * 55.5 / APPLY_GBPS, rel=1e-3)
