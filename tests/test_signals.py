"""Issue 17.1: wxfer leaves the process's signal dispositions as it found them.  Debian's
libfabric pulls in libinfinipath, which installs its own SIGINT/SIGTERM/SIGSEGV/... handlers
when loaded; a training script's SIGTERM handler must still run and Ctrl-C must still be a
KeyboardInterrupt (with `finally`), also during push().  A real process over fabric tcp."""

import os
import signal
import subprocess
import sys
import time

import pytest

from wxfer import _wxfer

pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _wait_line(p, want, timeout):
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        ln = p.stdout.readline()
        if not ln:
            break
        lines.append(ln)
        if ln.strip() == want:
            return lines
    raise AssertionError(f"no {want!r} within {timeout} s: {''.join(lines)}")


@pytest.mark.timeout(120)
def test_sigterm_and_sigint_reach_the_script_after_a_fabric_transport_opened(store):
    _, addr = store
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), WXFER_FABRIC_PROVIDER="tcp")
    env.pop("IPATH_NO_BACKTRACE", None)
    env.pop("HFI_NO_BACKTRACE", None)
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "signal_worker.py"), addr],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_line(p, "ready", 90)
        p.send_signal(signal.SIGTERM)  # the script's own handler, not the library's
        _wait_line(p, "term handler", 10)
        assert p.poll() is None
        time.sleep(0.1)
        p.send_signal(signal.SIGINT)  # while it pushes: KeyboardInterrupt, finally
        rest = p.communicate(timeout=20)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert "KeyboardInterrupt\nfinally\n" in rest, rest
    assert "Fatal Python error" not in rest, rest
    assert p.returncode == 0, (p.returncode, rest)
