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
