"""Before/after runs of a host benchmark in fresh processes (the benches' ``--compare``):
wxfer imported from another checkout ("base") and from this one ("this"), alternated, and the
machine they ran on.  A script that uses it puts ``$WXFER_BENCH_ROOT`` (else this checkout)
first on sys.path before it imports wxfer."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys


def add_compare(ap) -> None:
    """The benches' --compare CHECKOUT and --rounds N (``alternated``) on argparse parser `ap`."""
    ap.add_argument("--compare", default=None, help="another checkout (its extension built): before/after")
    ap.add_argument("--rounds", type=int, default=3)


def machine() -> dict:
    """The machine a run's figures come from, and its load when it starts."""
    return dict(
        machine=platform.node(),
        cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        load_average=os.getloadavg(),
    )


def wxfer_from() -> str:
    """The checkout whose wxfer this process imported."""
    return os.path.dirname(os.path.dirname(__import__("wxfer").__file__))


def alternated(script: str, base: str, here: str, rounds: int, argvs: dict) -> dict:
    """{"base": [(label, its JSON)], "this": [...]}: `script` run with each of `argvs` ({label:
    [arguments]}), wxfer from checkout `base` then from `here`, `rounds` times, each in a fresh
    process whose last line of output is its JSON; a failed run raises with its stderr's tail."""
    runs: dict = {"base": [], "this": []}
    for _ in range(rounds):
        for who, root in (("base", os.path.abspath(base)), ("this", here)):
            for label, args in argvs.items():
                got = subprocess.run(
                    [sys.executable, os.path.abspath(script), *args],
                    env=dict(os.environ, WXFER_BENCH_ROOT=root),
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if got.returncode:
                    raise RuntimeError(f"{who} {label}".strip() + f": {got.stderr[-2000:]}")
                runs[who].append((label, json.loads(got.stdout)))
    return runs
