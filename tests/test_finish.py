"""The end of a push (wxfer.runtime.failures.FailureExchange): a failure exchange that cannot complete (another
trainer rank died or hung) still says this rank's own failure."""

import pytest

torch = pytest.importorskip("torch")

from wxfer.runtime import control  # noqa: E402
from wxfer.runtime.failures import FailureExchange  # noqa: E402


class _Never:
    def is_completed(self):
        return False


class _Rank(FailureExchange):
    def __init__(self):
        super().__init__(None, object(), 0, 2, 0.2, 1.0, False, None, [])

    def mark_other_rank_gone(self, step, exc):
        return "trainer rank 1 (pid 1, host h) died or hung"


def test_a_failure_flag_exchange_that_never_completes_keeps_this_ranks_own_failure(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: _Never())
    with pytest.raises(control.CollectiveError) as e:
        _Rank().agree("the writes to 1 inference worker(s) failed", 7)
    msg = str(e.value)
    assert "trainer rank 1 (pid 1, host h) died or hung" in msg and "did not finish the step" in msg
    assert "(and this rank: the writes to 1 inference worker(s) failed)" in msg
    with pytest.raises(control.CollectiveError) as e:
        _Rank().agree(None, 7)  # nothing of its own to add
    assert "and this rank" not in str(e.value)
