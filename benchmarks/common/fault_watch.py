"""The inference worker of the fault runs (gpu_faults.py, store_faults.py) once its Receiver
is set up: what it saw, one JSON line per event on stdout, until POLL_AFTER_S after the parent
wrote ``<out>/done``.

- ``version``: each change of ``recv.version()``, polled in its own thread (a ``state()`` blocked
  in the store does not hide it); at versions 3 and 4 a host copy of its parameters, saved as
  ``<out>/at<v><suffix>.pt`` (``copied``) only when the version is still complete after the copy
  (the copy is then that step's bytes);
- ``state``: each change of ``recv.state()`` (state, message), or what it raised; ``slow``: a
  ``state()`` call over a second; a call past `cap_s` dumps the process's stacks (faulthandler);
- ``end``: the slowest ``version()`` and ``state()`` calls."""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time


def say(ev: str, **kw) -> None:
    print(json.dumps(dict(t=time.time(), ev=ev, **kw)), flush=True)


def watch(recv, params: dict, out: str, suffix: str, cap_s: float, poll_after_s: float) -> None:
    import torch

    stop_at = [None]  # poll_after_s after the parent said "done"
    slowest = {"version": 0.0, "state": 0.0}

    def more() -> bool:
        if stop_at[0] is None and os.path.exists(os.path.join(out, "done")):
            stop_at[0] = time.monotonic() + poll_after_s
        return stop_at[0] is None or time.monotonic() < stop_at[0]

    def versions():
        saved, last = set(), None
        while more():
            t0 = time.monotonic()
            v = recv.version()
            slowest["version"] = max(slowest["version"], time.monotonic() - t0)
            if v != last:
                say("version", v=v)
                last = v
            if v in (3, 4) and v not in saved:
                copy = {k: t.detach().to("cpu", copy=True) for k, t in params.items()}
                if recv.version() == v:  # still complete after the copy: the copy is that step's
                    torch.save(copy, os.path.join(out, f"at{v}{suffix}.pt"))
                    saved.add(v)
                    say("copied", v=v)
            time.sleep(0.001)

    th = threading.Thread(target=versions, daemon=True)
    th.start()
    last = None
    while more():
        faulthandler.dump_traceback_later(cap_s, exit=False)  # a state() past cap_s: its stack
        t0 = time.monotonic()
        try:
            s = recv.state()
            st = (s["state"], s["message"][:300])
        except Exception as e:  # noqa: BLE001 -- recorded
            st = ("raised", f"{type(e).__name__}: {e}"[:300])
        ds = time.monotonic() - t0
        faulthandler.cancel_dump_traceback_later()
        slowest["state"] = max(slowest["state"], ds)
        if ds > 1.0:
            say("slow", call="state", s=round(ds, 2))
        if st != last:
            say("state", state=st[0], msg=st[1])
            last = st
        time.sleep(0.05)
    th.join(5)
    say("end", slowest={k: round(v, 3) for k, v in slowest.items()})
