"""Helper process for tests/test_rejoin.py (not a test module): restarts of inference worker
gpu 1 landing before, during and right after a push, and pushes far apart, in one process
(trainer world 1, two Receivers in threads, the transport from the environment).

python tests/rejoin_scenario.py STORE [far]

Prints one line per check ("ok <what>" or a traceback) and "done" at the end.  `far`: also a
restart whose constructor has rejoin_timeout unset and a store timeout of 2 s, taken by a push
6 s later, and one that learns the trainer job is gone."""

import sys
import threading
import time

import torch

from wxfer.models import TINY, inference_params, preset_for
from wxfer.runtime import links
from wxfer.runtime.control import SetupError
from wxfer.runtime.receiver import Receiver
from wxfer.runtime.sender import Sender
from wxfer.testing import in_thread, joined

from helpers import frozen_model  # tests/helpers.py: this script's folder is on sys.path

T = 30.0
NAME = "rejoin"


def _scaled(m):
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.25)


def _expected(model):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from helpers import expected_shards  # tests/helpers.py

    return [(dst, off, b) for rank, dst, off, b in expected_shards(model, TINY) if rank == 0]


def _receiver(addr, replica, params, **kw):
    kw.setdefault("timeout", T)
    return in_thread(
        Receiver, params, mapping=preset_for(TINY), store=addr, name=NAME, replica=replica, replicas=2, **kw
    )


def _exact(recv, params, model, version, what):
    assert recv.version() == version, (what, recv.version(), version)
    for dst, off, b in _expected(model):
        got = params[dst].view(-1).view(torch.uint8)[off : off + b.numel()]
        assert torch.equal(got, b), (what, dst)


def _complete(ctl, epoch):
    """Wait (bounded) until restart `epoch` of worker gpu 1 has its whole record in the store."""
    deadline = time.monotonic() + T
    while not ctl.check("infer/1/e%d" % epoch):
        assert time.monotonic() < deadline, f"restart {epoch} never registered"
        time.sleep(0.01)


def main(addr, far):
    model = frozen_model(TINY, seed=0)
    p0, p1 = inference_params(TINY, 1, 0), inference_params(TINY, 1, 0)
    ths = [_receiver(addr, 0, p0), _receiver(addr, 1, p1)]
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name=NAME, timeout=T, write_timeout=5.0)
    r0, r1 = joined(ths, T)
    ctl = r0.ctl  # the job generation's records
    version = 1
    sender.push()
    _exact(r1, p1, model, 1, "first")
    old, old_params = r1, p1
    for epoch, when in enumerate(("before", "during", "right after"), start=1):
        params = inference_params(TINY, 1, 0)
        if when == "during":  # registers (record complete, seen by the watcher) inside the push
            real = sender.runner.write_begin
            started = {}

            def begin(*a, _real=real, _params=params, _epoch=epoch, **kw):
                out = _real(*a, **kw)
                started["th"] = _receiver(addr, 1, _params)
                _complete(ctl, _epoch)
                assert sender.links.sync(5.0)
                return out

            sender.runner.write_begin = begin
            _scaled(model)
            version += 1
            sender.push()
            del sender.runner.write_begin
            assert sender.stats()["rejoined"] == epoch - 1, "a push in flight took the restart"
            _exact(old, old_params, model, version, "in flight")
            th = started["th"]
        else:
            th = _receiver(addr, 1, params)
            _complete(ctl, epoch)
            if when == "before":
                assert sender.links.sync(5.0)
            else:
                time.sleep(links.WATCH_S * 2.5)  # right after the push before: its next push
        _scaled(model)
        version += 1
        t0 = time.monotonic()
        sender.push()
        (new,) = joined([th], T)
        assert sender.stats()["rejoined"] == epoch, (when, sender.stats()["rejoined"])
        _exact(new, params, model, version, when)
        _exact(r0, p0, model, version, when + " (worker 0)")
        print(f"ok restart {when} a push: taken by the next one ({time.monotonic() - t0:.2f} s)", flush=True)
        old.close()
        old, old_params = new, params
    if far:
        # its store waits are 2 s; the push comes 6 s after it registered: it waits for it (job alive)
        params = inference_params(TINY, 1, 0)
        th = _receiver(addr, 1, params, timeout=2.0)
        _complete(ctl, 4)
        time.sleep(6.0)
        _scaled(model)
        version += 1
        sender.push()
        (new,) = joined([th], T)
        _exact(new, params, model, version, "far")
        print("ok restart 6 s before the next push, store timeout 2 s: taken", flush=True)
        old.close()
        old = new
        # the trainer job ends while a restart waits: told, within the job lease's bound
        th = _receiver(addr, 1, inference_params(TINY, 1, 0), timeout=2.0)
        _complete(ctl, 5)
        time.sleep(0.5)
        t0 = time.monotonic()
        sender.close()
        th[0].join(T)
        err = th[1].get("error")
        took = time.monotonic() - t0
        assert isinstance(err, SetupError) and "the trainer job is gone" in str(err), err
        print(f"ok trainer job gone: the waiting restart told in {took:.2f} s: {err}", flush=True)
        old.close()
    else:
        sender.close()
        old.close()
    r0.close()
    print("done", flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda a: print("thread error", a.exc_value, flush=True)
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "far")
