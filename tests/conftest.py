import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# A command a script starts in the background (`make test > log &`, nohup) starts with SIGINT
# ignored, Python then leaves it so, and every process the tests spawn inherits it across exec:
# their Ctrl-C tests (test_signals, test_waits) then time out.  The tests' children get
# SIGINT as a terminal's Ctrl-C finds it (test_waits::test_the_suite_started_in_the_background_...).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n = None
    for item in items:
        if "gpu" in item.keywords or "gpu2" in item.keywords:
            if n is None:
                n = _cuda_count()
            need = 2 if "gpu2" in item.keywords else 1
            if n < need:
                item.add_marker(pytest.mark.skip(reason="needs %d CUDA GPU(s), this machine has %d" % (need, n)))
        if "rdma" in item.keywords:
            devs = os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else []
            if not devs:
                item.add_marker(pytest.mark.skip(reason="needs an RDMA device (/sys/class/infiniband is empty)"))


@pytest.fixture(scope="session")
def emu_lib():
    """The libibverbs emulation (csrc/testing, built once a session): its path, for
    $WXFER_LIBIBVERBS in the child processes that load it. Skips without rdma-core's headers,
    which it is built from. From the installed wheel, the checkout named by $WXFER_INSTALLED."""
    import subprocess

    from wxfer.testing import build_env

    if not os.path.exists("/usr/include/infiniband/verbs.h"):
        pytest.skip("the libibverbs emulation is built from infiniband/verbs.h (libibverbs-dev)")
    src = os.environ.get("WXFER_INSTALLED") or ROOT
    out = subprocess.run(
        ["sh", os.path.join(src, "csrc", "testing", "build.sh")],
        env=build_env(),
        check=True,
        capture_output=True,
        text=True,
    )
    path = out.stdout.strip().splitlines()[-1]
    assert os.path.exists(path), path
    return path


@pytest.fixture
def store(request):
    """(a TCPStore hosted by this test, "host:port"), its timeout the test module's T."""
    from datetime import timedelta
    import torch.distributed as dist
    from wxfer.runtime import control

    port = control.free_port()
    t = getattr(request.module, "T", 30.0)
    s = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=t), wait_for_workers=False)
    return s, "127.0.0.1:%d" % port
