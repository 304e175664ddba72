"""What the fault runs (gpu_faults.py, store_faults.py) share: the trainer's weights per step
(``next_weights``), the parent's reading of the children's logs back (``read_logs``,
``events``, ``after``, ``keep_logs``), and the inference worker once its Receiver is set up
(``watch``): what it saw, one JSON line per event on stdout, until POLL_AFTER_S after the
parent wrote ``<out>/done``.

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


# ------------------------------------------------------------------ the trainer's side
def next_weights(model, step: int, gap_s: float) -> None:
    """The weights of `step` (each parameter +0.01); step 4 starts `gap_s` later (past a lease's bound)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    if step == 4:
        time.sleep(gap_s)


# ------------------------------------------------------------------ the parent's side
def read_logs(logs: dict) -> dict:
    """{name: text} of the children's log files (opened "w+"), each closed."""
    text = {}
    for n, f in logs.items():
        f.seek(0)
        text[n] = f.read()
        f.close()
    return text


def events(log: str, t_fault: float | None) -> list:
    """A worker's events (its JSON lines), each with ``dt``, seconds after the fault, when there was one."""
    evs = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
    for e in evs:
        if t_fault is not None:
            e["dt"] = round(e["t"] - t_fault, 2)
    return evs


def after(evs: list, most: int = 8) -> str:
    """A worker's first `most` version and state changes after the fault, in one line."""
    seen = [e for e in evs if e["ev"] in ("state", "version") and e.get("dt", -1) >= 0]
    return " -> ".join((f"v{e['v']}" if e["ev"] == "version" else e["state"]) + f"(+{e['dt']}s)" for e in seen[:most])


def keep_logs(keep: str | None, name: str, text: dict) -> None:
    """Every child's log of one run, in ``<keep>/<name>.log`` (nothing when keep is None)."""
    if keep:
        with open(os.path.join(keep, f"{name}.log"), "w") as f:
            for n, t in text.items():
                f.write(f"===== {n}\n{t}\n")
