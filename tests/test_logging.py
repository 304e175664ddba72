"""The `wxfer` logger follows the library-logging convention (a NullHandler, nothing else) and
tells, for a small CPU push in one process: each side's setup at INFO, each push at DEBUG, a
worker that fails at WARNING."""

import logging

import pytest
import torch

from wxfer import _wxfer
from wxfer.models import TINY, preset_for, train_model
from helpers import frozen_model, joined, receivers_in_threads  # tests/helpers.py

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
T = 30.0


def _connected(addr, name: str, model, **kw):
    """A Sender of `model` (TINY's) and the one Receiver it writes (constructed in a thread),
    both set up: (sender, [receiver]). `kw`: more Sender arguments."""
    from wxfer.runtime.sender import Sender

    _, ths = receivers_in_threads(TINY, addr, name, 1, None, timeout=T)
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name=name, timeout=T, **kw)
    return sender, joined(ths, T)


def test_the_library_installs_only_a_null_handler():
    import wxfer  # noqa: F401

    lg = logging.getLogger("wxfer")
    assert [type(h) for h in lg.handlers] == [logging.NullHandler]
    assert lg.level == logging.NOTSET and lg.propagate
    for name in ("wxfer.runtime.sender", "wxfer.runtime.receiver", "wxfer.runtime.finish"):
        assert logging.getLogger(name).handlers == []


def test_setup_at_info_and_each_push_at_debug(store, caplog):
    _, addr = store
    caplog.set_level(logging.DEBUG, logger="wxfer")
    sender, recvs = _connected(addr, "log", frozen_model(TINY))
    try:
        sender.push()
        sender.push()
    finally:
        sender.close()
        for r in recvs:
            r.close()
    recs = [r for r in caplog.records if r.name.startswith("wxfer.")]
    ready = [r for r in recs if r.levelno == logging.INFO and r.getMessage().startswith("Sender ready")]
    assert len(ready) == 1 and ready[0].name == "wxfer.runtime.sender", [r.getMessage() for r in recs]
    msg = ready[0].getMessage()
    assert "trainer rank 0 of 1" in msg and "writes 1 of 1 inference workers" in msg and "transport fabric" in msg
    assert f"({sender.bytes_per_step} bytes per step" in msg and " setup " in msg
    n_tasks = sum(len(ops) for ops in sender.program.groups)
    assert f"plan {n_tasks} tasks" in msg and n_tasks > 0
    got = [r for r in recs if r.levelno == logging.INFO and r.getMessage().startswith("Receiver ready")]
    assert len(got) == 1 and "written by 1 trainer rank(s)" in got[0].getMessage()
    pushes = [r.getMessage() for r in recs if r.levelno == logging.DEBUG and r.getMessage().startswith("push:")]
    assert len(pushes) == 2 and "step 1," in pushes[0] and "step 2," in pushes[1], pushes
    assert f"{sender.bytes_per_step} bytes in" in pushes[0]
    assert not [r for r in recs if r.levelno >= logging.WARNING]


def test_nothing_at_info_reaches_a_logger_left_at_warning(store, caplog):
    """The library sets no level: an application at WARNING sees no setup line."""
    _, addr = store
    caplog.set_level(logging.WARNING, logger="wxfer")
    sender, recvs = _connected(addr, "logw", train_model(TINY))
    with torch.no_grad():
        sender.push()
    sender.close()
    for r in recvs:
        r.close()
    assert not [r for r in caplog.records if r.name.startswith("wxfer.")]


def test_a_failed_worker_at_warning_and_the_failed_step_at_error(store, caplog):
    _, addr = store
    caplog.set_level(logging.INFO, logger="wxfer")
    sender, (recv,) = _connected(addr, "logf", frozen_model(TINY), write_timeout=5)
    sender.push()
    recv.close()  # the worker's memory and transport are gone
    with pytest.raises(RuntimeError, match="step 2"):
        sender.push()
    sender.close()
    recs = [r for r in caplog.records if r.name.startswith("wxfer.")]
    warn = [r.getMessage() for r in recs if r.levelno == logging.WARNING]
    assert any("step 2: inference worker gpu 0 failed and is skipped" in m for m in warn), warn
    err = [r.getMessage() for r in recs if r.levelno == logging.ERROR]
    assert any("trainer rank 0, step 2" in m for m in err), err
