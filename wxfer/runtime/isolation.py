"""Whether a transport keeps a dead or stopped inference worker's fault to that worker
(issue 35.4): where it was measured not to, setup says so on both sides, with the reason and
the transport to use instead (a warning: the user may accept it, e.g. one host, no faults)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def fault_isolation(transport: str, options: dict) -> str | None:
    """Why `transport` with `options` does not keep a dead or stopped worker's fault to that
    worker (None: it does, as far as was measured): libfabric's shm (1.17, README
    reliability, tests/test_faults.py SHM_FAULTS)."""
    if transport == "fabric" and str((options or {}).get("provider", "")).split(";")[0] == "shm":
        return (
            "wxfer: transport fabric with provider shm does not isolate a fault: an inference worker "
            "killed in the middle of a step took the other workers' writes down with it (refused "
            "until write_timeout), and one that was stopped (SIGSTOP) hung a trainer's writes inside "
            "libfabric (libfabric 1.17's shm). Where a worker may die, use provider tcp "
            "(transport_options={'provider': 'tcp'} on every side, or $WXFER_FABRIC_PROVIDER=tcp) or "
            "a NIC provider (verbs, efa)"
        )
    return None


def warn_fault_isolation(transport: str, options: dict, who: str) -> str | None:
    """Warn (RuntimeWarning, and the log) when `transport` does not isolate a fault
    (``fault_isolation``); returns the reason."""
    why = fault_isolation(transport, options)
    if why is not None:
        import warnings

        log.warning("%s: %s", who, why)
        warnings.warn(f"{who}: {why}", RuntimeWarning, stacklevel=3)
    return why
