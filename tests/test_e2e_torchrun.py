"""Under torchrun, with no store given: trainer rank 0 hosts the TCPStore at
$MASTER_ADDR:$WXFER_STORE_PORT, the inference workers (separate processes, not in the
trainers' process group) find it through $WXFER_STORE."""
import os
import subprocess
import sys
import textwrap

import pytest

from wxfer import _wxfer
from wxfer.control import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")

TRAINER = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import TINY, Qwen3ForCausalLM, preset_for, shard_fsdp2
    from wxfer.sender import Sender
    dist.init_process_group("gloo")
    model = shard_fsdp2(Qwen3ForCausalLM(TINY), init_device_mesh("cpu", (dist.get_world_size(),)))
    sender = Sender(model, mapping=preset_for(TINY), timeout=60)      # store=None: rank 0 hosts it
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sender.push()
    # one write per line: both ranks share torchrun's stdout (unbuffered)
    print(f"rank {dist.get_rank()} pushed {sender.bytes_per_step}", flush=True)
    dist.barrier()
    sender.close()
    dist.destroy_process_group()
""")

WORKER = textwrap.dedent("""
    import sys, torch
    from wxfer.models import TINY, inference_params, preset_for
    from wxfer.receiver import Receiver
    rank, broken = int(sys.argv[1]), sys.argv[2] == "broken"
    params = inference_params(TINY, 2, rank)
    if broken and rank == 1:
        del params["model.layers.1.mlp.down_proj.weight"]
    recv = Receiver(params, mapping=preset_for(TINY).name, replica=0, rank=rank, tp=2, replicas=1, timeout=60)
    print("worker", rank, "version", recv.wait_version(2, 60), flush=True)
    nan = sum(int(torch.isnan(t.float()).sum()) for t in params.values())
    print("worker", rank, "nan", nan, flush=True)
    recv.close()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["ok", "broken"])
def test_sender_under_torchrun_hosts_the_store(tmp_path, case):
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "worker.py").write_text(WORKER)
    sport = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, WXFER_STORE_PORT=str(sport), WXFER_STORE="127.0.0.1:%d" % sport,
               OMP_NUM_THREADS="1")
    tr = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           str(tmp_path / "trainer.py")], env=dict(env, WXFER_STORE=""), cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ws = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r), case], env=env, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    try:
        for p in [tr] + ws:
            out, _ = p.communicate(timeout=150)
            outs.append(out)
    finally:
        for p in [tr] + ws:
            if p.poll() is None:
                p.kill()
    if case == "broken":
        # the controller's error is raised on both trainer ranks and in both workers, by name
        bad = "model.layers.1.mlp.down_proj.weight: expected on replica 0 rank 1 but the worker lacks it"
        assert tr.returncode != 0 and ws[0].returncode != 0 and ws[1].returncode != 0
        for r in (0, 1):     # torchrun prefixes each rank's traceback lines with [rankN]
            assert any(ln.startswith(f"[rank{r}]") and "SetupError" in ln for ln in outs[0].splitlines()), \
                outs[0][-3000:]
        assert bad in outs[0]
        for out in outs[1:]:
            assert "SetupError" in out and bad in out, out[-3000:]
        return
    assert tr.returncode == 0, outs[0][-3000:]
    assert "rank 0 pushed" in outs[0] and "rank 1 pushed" in outs[0]
    for r, (p, out) in enumerate(zip(ws, outs[1:])):
        assert p.returncode == 0, out[-3000:]
        assert f"worker {r} version 2" in out and f"worker {r} nan 0" in out
