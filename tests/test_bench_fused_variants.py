"""benchmarks/bench_fused_variants.py on CPU (its GPU rows run in benchmarks/gpu_fused_sweep.sh):
the byte-for-byte check passes the reference stand-in of the fused kernel and catches one that
drops a changed byte or a bit, and a child's dry run times both kernels and leaves the shadow
where the toggling should."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_fused_variants as bfv  # noqa: E402

CPU = torch.device("cpu")


def test_the_check_passes_the_reference_and_catches_a_lost_byte_or_bit():
    n, bad = bfv.check(CPU, bfv.fused_standin, [(129, 200)], True)
    assert n == 24 and bad == []

    def lost_byte(shadow, bits, jobs):
        old = shadow.clone()
        bfv.fused_standin(shadow, bits, jobs)
        ch = (shadow != old).nonzero()
        if ch.numel():
            shadow[ch[-1]] = old[ch[-1]]

    def lost_bit(shadow, bits, jobs):
        bfv.fused_standin(shadow, bits, jobs)
        nz = bits.nonzero()
        if nz.numel():
            bits[nz[0]] = 0

    for broken in (lost_byte, lost_bit):
        n, bad = bfv.check(CPU, broken, [(129, 200)], True)
        # 0% changed: nothing to lose; 0.4%, 50%, 100%: every dtype and offset caught
        assert len(bad) == 18, (broken.__name__, bad)


def test_a_dry_child_times_both_and_toggles_the_shadow(capsys, monkeypatch):
    monkeypatch.setattr(bfv, "DRY_SHAPES", [(77, 130)])
    assert bfv.main(["--dry-run", "--kernel", "p", "--iters", "2", "--reps", "1", "--rates", "0,0.5"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["variant"] == "p" and r["mismatches"] == [] and r["cases"] == 24
    assert [x["rate"] for x in r["rows"]] == [0.0, 0.5]
    assert r["rows"][0]["changed_bytes"] == 0 < r["rows"][1]["changed_bytes"]
    assert all(x["shadow_toggled"] and x["fused_ms"] > 0 and x["quantize_ms"] > 0 for x in r["rows"])


def test_odd_iters_and_bad_variants_are_refused():
    for argv in (["--iters", "3"], ["--variants", "d30:2"], ["--variants", "d1:3"]):
        try:
            bfv.main(argv)
        except SystemExit as e:
            assert "bench_fused_variants" in str(e)
        else:
            raise AssertionError(argv)
