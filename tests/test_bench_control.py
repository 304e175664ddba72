"""benchmarks/bench_control.py (issue 24): its growth laws recover known exponents, and one
small run counts the control plane's store traffic as the runtime makes it: the controller
reads the receivers' whole records, every other trainer only their connection records."""

import os
import sys

import pytest

from wxfer import _wxfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_growth_laws_recover_what_made_the_figures():
    import bench_control as bc

    rows = [dict(trainers=n, receivers=n, y=5.0 + 2.0 * (2 * n) ** 2, z=7.0) for n in (1, 2, 4, 8, 16)]
    g = bc.growth(rows, "y")
    assert g["k"] == pytest.approx(2.0, abs=0.05) and g["faster_than_linear"]
    assert g["predicted"] == pytest.approx(5.0 + 2.0 * 384**2, rel=0.05)
    lin = bc.growth([dict(r, y=3.0 * (r["trainers"] + r["receivers"])) for r in rows], "y")
    assert (
        lin["k"] == pytest.approx(1.0) and not lin["faster_than_linear"] and lin["predicted"] == pytest.approx(3 * 384)
    )
    assert bc.growth(rows, "z")["law"] == "constant"
    pts = [
        dict(trainers=t, receivers=r, w=3 + 2 * t + 5 * r + 0.5 * t * r)
        for t, r in ((1, 1), (2, 2), (4, 4), (8, 2), (2, 8))
    ]
    b = bc.bilinear(pts, "w")
    assert b["coef"]["per_pair"] == pytest.approx(0.5) and b["predicted"] == pytest.approx(
        3 + 512 + 640 + 0.5 * 256 * 128
    )


@pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
@pytest.mark.timeout(240)
def test_a_small_run_counts_the_store_traffic():
    import bench_control as bc

    r = bc.run_one(2, 2, 1)
    assert not r["errors"] and r["transfers"] > 0, r
    assert r["push_ops_per_rank"] <= 2  # a push makes no control-plane traffic beyond its restart check
    # the controller reads the receivers' whole records (parameters, descriptors); the other trainer
    # only their connection records (the descriptors it needs come in the plan)
    assert r["trainer_setup_bytes"] < r["rank0_setup_bytes"] - r["plan_bytes"]
