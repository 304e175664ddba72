"""The ``vllm.general_plugins`` entry point, in vLLM's own multiprocess engine: a fresh Python
outside the checkout (so the wxfer imported is the one installed in .venv-vllm, by make
vllm-setup) builds a vllm.LLM with WeightTransferConfig(backend="wxfer") without importing wxfer
itself; vLLM's engine-core process loads the plugin, its worker builds wxfer's engine from the
factory, and with $WXFER_VLLM_CPU_KEEP_WEIGHTS=1 the plugin kept vLLM's CPU GEMM dispatch on the
parameters there (else init_transfer_engine with proof=False would refuse the packed layers'
shape-[0] parameters first)."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import sys
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
              enforce_eager=True, weight_transfer_config=WeightTransferConfig(backend="wxfer"))
    for info in ({"bogus": 1}, {"store": "127.0.0.1:9", "timeout": 2.0, "proof": False}):
        try:
            llm.init_weight_transfer_engine({"init_info": info})
            print("RESULT ok")
        except Exception as e:
            print("RESULT", type(e).__name__, str(e).replace(chr(10), " ")[:600])
    import wxfer

    print("WXFER_FROM", wxfer.__file__)
    """
)


def test_the_entry_point_registers_the_backend_in_vllms_processes(tmp_path):
    sys.path.insert(0, HERE)
    from vhelp import save_checkpoint

    ck = str(tmp_path / "ckpt")
    save_checkpoint(ck)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(WXFER_VLLM_CPU_KEEP_WEIGHTS="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, ck], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300
    )
    res = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
    assert p.returncode == 0 and len(res) == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Invalid init_info for WxferWeightTransferEngine" in res[0], res
    # the packed layers' shapes would be refused first without the plugin's keep_cpu_weights in the
    # worker: what fails is reaching the (absent) trainers' store
    assert "CPU GEMM dispatch" not in res[1] and "127.0.0.1:9" in res[1], res
    assert "site-packages/wxfer/__init__.py" in p.stdout  # the installed wxfer (vLLM loaded its plugin)
