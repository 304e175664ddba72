"""The transports' capabilities as each backend declares them in C (`_wxfer.capabilities()`),
and the Python that asks them instead of naming backends: the options a trainer opens with
from the receivers' published ones (sender.writer_options), the GPU-memory check
(receiver.gpu_memory_options), the options a receiver publishes (receiver.transport_choice).
With $WXFER_IFACE set (a job's fabric NIC), the option sets of verbs (emulated), cuda_ipc and
fabric still set up: a Sender and a Receiver over verbs and over fabric, whole pushes."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from wxfer import _wxfer
from wxfer.runtime.receiver import gpu_memory_options, transport_choice
from wxfer.runtime.sender import writer_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
CAPS = _wxfer.capabilities()
FABRIC = _wxfer.backends()["fabric"][0]


def _accepted(name: str) -> list:
    """The options `name`'s open() accepts, as its refusal of an unknown one lists them."""
    with pytest.raises(_wxfer.Error, match="unknown option 'no_such_option'") as e:
        _wxfer.Transport(name, {"no_such_option": "1"})
    return re.search(r"\(known: (.*)\)", str(e.value)).group(1).split(", ")


def test_every_backend_declares_what_it_accepts():
    assert set(CAPS) == set(_wxfer.backends())
    for name, c in CAPS.items():
        assert c is not None, name
        # the declared list is the one open() checks (also where the backend cannot run here)
        assert c["options"] == _accepted(name), name
        for k in ("host_options", "shared_options", "defaults", "gpu_check"):
            assert set(c[k]) <= set(c["options"]), (name, k, c[k])
        assert c["host_memory"] or c["cuda_memory"], name
        for mem in ("host", "cuda"):
            place = c["auto"][mem]
            assert place is None or (place >= 1 and c[mem + "_memory"]), (name, mem, place)
    places = [c["auto"]["cuda"] for c in CAPS.values() if c["auto"]["cuda"]]
    assert len(places) == len(set(places))  # one order for "auto"


def test_fabric_defaults_are_read_by_the_backend(monkeypatch):
    monkeypatch.delenv("WXFER_FABRIC_IFACE", raising=False)
    monkeypatch.setenv("WXFER_IFACE", "eth7")
    monkeypatch.setenv("WXFER_FABRIC_PROVIDER", "shm")
    d = _wxfer.capabilities()["fabric"]["defaults"]
    assert d == {"provider": "shm", "iface": "eth7"}
    monkeypatch.delenv("WXFER_IFACE")
    monkeypatch.setenv("WXFER_FABRIC_IFACE", "eth8")  # the older name, when WXFER_IFACE is unset
    assert _wxfer.capabilities()["fabric"]["defaults"]["iface"] == "eth8"
    monkeypatch.delenv("WXFER_FABRIC_IFACE")
    monkeypatch.delenv("WXFER_FABRIC_PROVIDER")
    assert _wxfer.capabilities()["fabric"]["defaults"] == {"provider": "tcp", "iface": "lo"}


@pytest.mark.parametrize("name", sorted(CAPS))
def test_writer_options_keep_only_what_the_backend_accepts(name, monkeypatch):
    """The receivers' published options on GPU memory (their own GPU check and host options
    included) become a trainer's that the backend accepts, with no host option of theirs."""
    monkeypatch.setenv("WXFER_IFACE", "lo")
    c = CAPS[name]
    published = gpu_memory_options(name, "cuda", {k: "theirs" for k in c["host_options"]})
    published.update({k: c["defaults"][k] for k in c["shared_options"]})
    mine = gpu_memory_options(name, "cuda", writer_options(name, published))
    assert set(mine) <= set(c["options"]), (name, mine)
    assert "theirs" not in mine.values(), mine
    # this rank's own options win over the receivers' and are kept
    given = {k: "mine" for k in c["host_options"]}
    assert writer_options(name, dict(published, **given), given) == dict(
        {k: v for k, v in published.items() if k not in c["host_options"]}, **given
    )


@pytest.mark.skipif(not FABRIC, reason="fabric transport not usable here")
def test_receiver_publishes_the_shared_options_and_no_iface(monkeypatch):
    monkeypatch.setenv("WXFER_IFACE", "lo")
    monkeypatch.setenv("WXFER_FABRIC_PROVIDER", "tcp")
    name, opts = transport_choice("auto", "cpu")
    assert name == "fabric" and opts == {"provider": "tcp"}, (name, opts)
    assert transport_choice("fabric", "cpu", {"provider": "shm"})[1] == {"provider": "shm"}
    t = _wxfer.Transport(name, writer_options(name, dict(opts, iface="eth9")))
    try:
        assert "domain=lo " in t.info(), t.info()  # the trainer's own NIC: $WXFER_IFACE, in C
    finally:
        t.close()


PUSH = """
import torch
from datetime import timedelta
import torch.distributed as dist
from wxfer.models import TINY, train_model, inference_params, preset_for
from wxfer.runtime import control
from wxfer.runtime.receiver import Receiver
from wxfer.runtime.sender import Sender
from wxfer.testing import in_thread
port = control.free_port()
store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
addr = "127.0.0.1:%%d" %% port
params = inference_params(TINY, 1, 0)
th, box = in_thread(Receiver, params, store=addr, replica=0, rank=0, tp=1, replicas=1, name="caps",
                    timeout=60, mapping=preset_for(TINY).name, transport=%(transport)r)
model = train_model(TINY)
sender = Sender(model, mapping=preset_for(TINY), store=addr, name="caps", timeout=60, transport=%(transport)r)
th.join(60)
rx = box["value"]
sender.push()
assert rx.version() == 1, rx.version()
print("RESULT", json.dumps(dict(transport=sender.transport_name, receiver=rx.transport_options)))
sender.close()
rx.close()
"""


def _push_child(transport: str, **env) -> dict:
    e = dict(os.environ, WXFER_IFACE="lo", **env)
    code = "import json\n" + textwrap.dedent(PUSH % {"transport": transport})
    r = subprocess.run([PY, "-c", code], env=e, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.timeout(200)
def test_a_job_with_wxfer_iface_sets_up_on_verbs(emu_lib):
    """$WXFER_IFACE set for the job's fabric NIC: Sender and Receiver over (emulated) verbs
    set up and push (verbs refuses an unknown option, so a passed-on iface failed setup)."""
    res = _push_child("verbs", WXFER_LIBIBVERBS=emu_lib, WXEMU_VERBS_RETRY_CAP_MS="1000")
    assert res["transport"] == "verbs" and "iface" not in res["receiver"], res


@pytest.mark.timeout(200)
@pytest.mark.skipif(not FABRIC, reason="fabric transport not usable here")
def test_a_job_with_wxfer_iface_sets_up_on_fabric():
    res = _push_child("fabric", WXFER_FABRIC_PROVIDER="tcp")
    assert res["transport"] == "fabric" and res["receiver"] == {"provider": "tcp"}, res


@pytest.mark.gpu
@pytest.mark.timeout(200)
def test_a_job_with_wxfer_iface_sets_up_on_cuda_ipc():
    """On a GPU: Sender and Receiver on cuda_ipc with $WXFER_IFACE set (cuda_ipc has no iface)."""
    code = PUSH.replace("params = inference_params(TINY, 1, 0)", "params = inference_params(TINY, 1, 0, device='cuda')")
    code = code.replace("model = train_model(TINY)", "model = train_model(TINY).cuda()")
    e = dict(os.environ, WXFER_IFACE="lo")
    r = subprocess.run(
        [PY, "-c", "import json\n" + textwrap.dedent(code % {"transport": "cuda_ipc"})],
        env=e,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])
    assert res["transport"] == "cuda_ipc" and "iface" not in res["receiver"], res
