"""The flagship configuration: Kimi-K2, 256 training GPUs -> 8 replicas x TP16 (EP) in FP8."""

import numpy as np
import pytest

from wxfer.meta import Cluster
from wxfer.plan import plan_for


@pytest.fixture(scope="module")
def kimi():
    c = Cluster(train_gpus=256, infer_gpus=128, infer_tp=16, infer_ep=True, quant="fp8")
    return c, plan_for("kimi-k2", c)  # build_plan runs the coverage check itself


def test_kimi_plan_is_covered_balanced_and_deadlock_free(kimi):
    c, plan = kimi
    assert plan.check() == []
    plan.check_deadlock_free()
    per_train = plan.bytes_per_train_rank()
    per_gpu = plan.bytes_per_infer_gpu()
    assert (per_train > 0).all()  # every trainer NIC used
    assert per_train[0] <= np.median(per_train) * 1.05  # no funnel through rank 0
    assert per_train.max() / per_train.min() < 1.1
    assert per_gpu.max() / per_gpu.min() < 1.001
    assert 64e9 < per_gpu.max() < 66e9  # ~1.05 TB per FP8 replica over 16 GPUs
    assert len(plan.groups) == 2  # node meshes (dense) and cross-node experts
    for g in plan.groups:
        ranks = [r for m in g for r in plan.meshes[m]]
        assert len(ranks) == len(set(ranks)) == 256


def test_kimi_serialization_is_compact(kimi):
    _, plan = kimi
    data = plan.to_bytes()
    assert len(data) < 8 * plan.n_transfers  # a few bytes per transfer after zlib


def test_kimi_senders_start_on_different_receivers(kimi):
    _, plan = kimi
    first = np.r_[0, np.flatnonzero(np.diff(plan.sender)) + 1]  # each sender's first write
    hits = np.bincount(plan.gpu[first], minlength=plan.infer_gpus)
    assert (hits > 0).sum() > 100 and hits.max() <= 8  # 256 senders over 128 receivers
