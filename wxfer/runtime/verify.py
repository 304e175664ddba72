"""Verify mode: checksums of what was sent against what landed, per parameter.

Off by default (a step then runs no code on the receivers).  On with
``Sender.push(verify=True)`` or ``WXFER_VERIFY=1`` on the trainers, and
``Receiver(verify=True)`` or ``WXFER_VERIFY=1`` on the inference workers: the receiver then
runs one thread that answers checksum requests; nothing else changes.

Per push and per receiver it wrote to, a trainer rank publishes the list of its writes
(region, offset, length, CRC-32 of the source bytes, plan task) under
``verify/req/<rank>/<gpu>/<seq>`` and bumps ``verify/seq/<rank>/<gpu>``; the receiver
recomputes the CRC-32 of those bytes in its own memory and answers under
``verify/res/<rank>/<gpu>/<seq>`` with the mismatches, by parameter.  The trainer waits for
every answer (bounded) and raises VerifyError with the report.
"""

from __future__ import annotations

import json
import threading
import time
import zlib

from .. import envs


class VerifyError(RuntimeError):
    """What landed differs from what was sent (the message lists every mismatch)."""

    def __init__(self, msg, report):
        super().__init__(msg)
        self.report = report


def verify_enabled(flag=None) -> bool:
    if flag is not None:
        return bool(flag)
    return envs.get("WXFER_VERIFY", "") not in ("", "0")


def crc(t) -> int:
    """CRC-32 of a uint8 tensor's bytes (copied to the host if needed)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(memoryview(t.contiguous().numpy())) & 0xFFFFFFFF


def request(ctl, rank: int, version: int, sums: dict, workers: dict, timeout: float) -> dict:
    """Trainer side: ask every receiver in `sums` to check; returns {gpu: report}; raises
    VerifyError when any receiver reports a mismatch, TimeoutError when one does not answer."""
    seqs = {}
    for g, entries in sums.items():
        seq = ctl.add("verify/next/%d/%d" % (rank, g), 1)
        ctl.set_json("verify/req/%d/%d/%d" % (rank, g, seq), dict(version=version, writes=entries, sender=rank))
        ctl.add("verify/seq/%d/%d" % (rank, g), 1)
        seqs[g] = seq
    out, bad = {}, []
    for g, seq in seqs.items():
        w = workers.get(g, {})
        who = f"inference worker gpu {g} (replica {w.get('replica')} rank {w.get('rank')})"
        rep = ctl.get_json(
            "verify/res/%d/%d/%d" % (rank, g, seq),
            f"the verify answer of {who} (is it running with verify on: Receiver(verify=True) or WXFER_VERIFY=1?)",
            timeout,
        )
        out[g] = rep
        for m in rep["mismatch"]:
            bad.append(
                f"{who}: {m['param']} bytes [{m['start']}, {m['end']}) (plan task {m['task']}): "
                f"sent crc32 {m['sent']:08x}, landed {m['landed']:08x}"
            )
        for e in rep.get("errors", []):
            bad.append(f"{who}: {e}")
    if bad:
        raise VerifyError(
            f"wxfer: verify failed for trainer rank {rank}, step {version}: "
            f"{len(bad)} mismatch(es):\n  " + "\n  ".join(bad),
            out,
        )
    return out


class Checker:
    """Receiver side: recompute checksums of requested ranges in registered memory."""

    def __init__(self, receiver):
        self.r = receiver
        self.ctl = receiver.ctl
        self._stop = threading.Event()
        self._seen = {}
        self.reports = []
        self._thread = None

    # ranges -> parameter names
    def _locate(self, rdesc: bytes, off: int, n: int):
        out = []
        for name, (d, poff, pn) in self.r.param_range.items():
            if d == rdesc and poff < off + n and off < poff + pn:
                out.append((name, max(off, poff) - poff, min(off + n, poff + pn) - poff))
        return out

    def check(self, req: dict) -> dict:
        import base64

        mism, errors, checked = [], [], 0
        if getattr(self.r, "staging", None) is not None:  # delta: the step's records first (whole destination)
            try:
                self.r.apply(req["version"], req.get("sender"))
            except Exception as e:  # noqa: BLE001 -- reported with the check
                errors.append(f"applying the delta records of step {req['version']}: {e}")
        for rd64, off, n, sent, task in req["writes"]:
            rdesc = base64.b64decode(rd64)
            base = self.r.region_base.get(rdesc)
            if base is None or off < 0 or off + n > base.numel():
                errors.append(f"write [{off}, {off + n}) (plan task {task}) is not inside a region registered here")
                continue
            got = crc(base[off : off + n])
            checked += n
            if got != sent:
                for name, a, b in self._locate(rdesc, off, n) or [("<no parameter>", off, off + n)]:
                    mism.append(dict(param=name, start=a, end=b, task=task, sent=sent, landed=got))
        return dict(version=req["version"], mismatch=mism, errors=errors, bytes=checked)

    def poll_once(self) -> int:
        done = 0
        for s in self.r.senders:
            seq = self.ctl.add("verify/seq/%d/%d" % (s, self.r.gpu), 0)
            last = self._seen.get(s, 0)
            for q in range(last + 1, seq + 1):
                req = json.loads(self.ctl.get("verify/req/%d/%d/%d" % (s, self.r.gpu, q), "a verify request", 10))
                rep = self.check(req)
                self.reports.append(dict(rep, sender=s))
                self.ctl.set("verify/res/%d/%d/%d" % (s, self.r.gpu, q), json.dumps(rep))
                done += 1
            self._seen[s] = seq
        return done

    def start(self, period: float = 0.02) -> None:
        def run():
            while not self._stop.wait(period):
                try:
                    self.poll_once()
                except Exception:  # noqa: BLE001 -- the store went away: stop quietly
                    if self._stop.is_set():
                        return
                    time.sleep(0.5)

        self._thread = threading.Thread(target=run, name=f"wxfer-verify-gpu{self.r.gpu}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
