"""Runs the decoder fuzz target for a bounded time (CI), seeded with real descriptors,
export blobs and a real plan."""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import wxfer
from wxfer import _wxfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECONDS = int(os.environ.get("WXFER_FUZZ_SECONDS", "20"))


def _seeds():
    from wxfer.meta import Cluster
    from wxfer.plan import plan_for

    seeds = []
    if wxfer.backends()["fabric"]["available"]:
        t = _wxfer.Transport("fabric", {"provider": "tcp"})
        bufs = [np.zeros(n, np.uint8) for n in (4096, 100)]
        regions = [t.register(b) for b in bufs]
        seeds += [b"\x00" + regions[0].descriptor, b"\x01" + t.export()]
        for r in regions:
            r.close()
        t.close()
    blob = plan_for("qwen3-tiny", Cluster(train_gpus=2, infer_gpus=2, infer_tp=2)).to_bytes()
    seeds.append(b"\x02" + blob)
    seeds.append(b"\x03" + zlib.decompress(blob[16:]))
    return seeds


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_decoders_survive_fuzzing(tmp_path):
    pytest.importorskip("atheris", reason="atheris is installed by `make setup`")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, s in enumerate(_seeds()):
        (corpus / ("seed%d" % i)).write_bytes(s)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "fuzz", "fuzz_decoders.py"),
            str(corpus),
            "-max_total_time=%d" % SECONDS,
            "-rss_limit_mb=4096",
            "-timeout=10",
            "-artifact_prefix=%s/" % tmp_path,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
    )
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    assert "Done" in tail, tail
    runs = int(tail.split("Done ")[1].split()[0])
    assert runs > 1000, tail
