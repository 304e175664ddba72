"""``python -m wxfer demo``: until the end-to-end pipeline lands, the demo runs the
self-test over each libfabric provider this machine offers (tcp, then shm)."""
from __future__ import annotations

import json
import sys


def main(argv) -> int:
    from .selftest import run_selftest
    want_json = "--json" in argv
    results = []
    for provider in ("tcp", "shm"):
        results.append(run_selftest("fabric", {"provider": provider}, size=64 << 20, iters=3))
    ok = all(r["verified"] for r in results)
    if want_json:
        print(json.dumps({"verified": ok, "runs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
