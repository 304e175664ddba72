"""TRL's GRPO loop with its colocated vLLM syncing through wxfer: the process of
tests/on_vllm/test_trl.py (not a test module; its own process because TRL's colocate mode
initializes torch.distributed and vLLM's parallel state in the process it runs in).

python trl_proc.py OUT_JSON [MODE]

MODE "wxfer" (default): ``WxferGRPOTrainer`` below, the lines docs/vllm.md ("TRL GRPO") shows:
TRL builds its ``vllm.LLM`` with ``WeightTransferConfig(backend="wxfer")`` and every weight sync
is wxfer's ``send_weights()``, never TRL's ``load_weights`` (vLLM's CPU GEMM kept on the
parameters: ``keep_cpu_weights()``, so that the bytes can be compared with vLLM's loader).
"wxfer-shipped": the same with vLLM's CPU GEMMs as shipped (packed copies: wxfer's finalize path;
greedy tokens compared, not bytes).  MODE "trl": TRL's own GRPOTrainer and its own sync, on vLLM's
CPU platform as shipped; "trl-keep":
the same with ``keep_cpu_weights()`` (what TRL's own sync does there: docs/vllm.md).  Writes what
the test checks to OUT_JSON.
"""

import functools
import json
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# ---- the integration (docs/vllm.md, "TRL GRPO") ----------------------------------------------
import trl.generation.vllm_generation as trl_vllm  # noqa: E402
from trl import GRPOTrainer  # noqa: E402


class WxferGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer (colocate mode) whose vLLM has the wxfer backend and whose weight
    sync is one ``send_weights()``.  TRL 1.16 has no setting for vLLM's weight-transfer backend:
    it builds ``LLM(...)`` with its own arguments and syncs by calling the model's
    ``load_weights`` per tensor, so the LLM it builds gets the config here, and the sync is
    replaced."""

    def __init__(self, *a, wxfer_store, **kw):
        from vllm import LLM
        from vllm.config.weight_transfer import WeightTransferConfig

        real = trl_vllm.LLM
        trl_vllm.LLM = functools.partial(LLM, weight_transfer_config=WeightTransferConfig(backend="wxfer"))
        try:
            super().__init__(*a, **kw)
        finally:
            trl_vllm.LLM = real
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from wxfer.integrations.vllm import LLMClient, WxferTrainerInitInfo

        gen = self.vllm_generation
        model = self.accelerator.unwrap_model(self.model)
        info = WxferTrainerInitInfo(
            store=wxfer_store, mapping=model.config.to_dict(), rank=self.accelerator.process_index
        )
        self.wxfer = WeightTransferTrainerFactory.trainer_init(
            info, client=LLMClient(gen.llm), source=ModuleSource(model)
        )
        self.wxfer_sync_s = []

        def sync_weights():
            t0 = time.monotonic()
            self.wxfer.send_weights()  # push, then vLLM's finish_weight_update
            gen.llm.reset_prefix_cache()
            self.wxfer_sync_s.append(time.monotonic() - t0)

        gen.sync_weights = sync_weights


# ---- the run -----------------------------------------------------------------------------------
PROMPT = [3, 17, 101, 45, 9, 250]


def tokenizer_for(ckpt):
    """A word-level tokenizer of the checkpoint's 512 ids ("t2" ... "t511", pad 0, eos 1),
    saved beside it: TRL's trainer and vLLM both load one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(ckpt)


def reward(completions, **kw):
    """A toy reward: the completion's token numbers mod 97 (completions differ, so the group
    advantages are not all zero and the weights move)."""
    return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) for c in completions]


def engine_of(llm):
    return llm.collective_rpc(lambda self: self.weight_transfer_engine)[0]


def bytes_differ(eng, model):
    """The registered parameters whose bytes differ from what vLLM's own load_weights lays for
    the trainer's current weights (test_llm.py's check)."""
    import torch
    from vllm.config import set_current_vllm_config

    pushed = {n: t.detach().clone() for n, t in eng.receiver.params.items()}
    with set_current_vllm_config(eng.vllm_config), torch.no_grad():
        for t in eng.receiver.params.values():
            t.zero_()
        eng.model.load_weights((n, p.detach()) for n, p in model.named_parameters())
    return [
        n for n, t in eng.receiver.params.items() if not torch.equal(t.view(torch.uint8), pushed[n].view(torch.uint8))
    ]


def greedy_pair(llm, model):
    """vLLM's greedy tokens for trainer_proc.PROMPT, and transformers' of `model`."""
    import torch
    from trainer_proc import NEW, PROMPT, greedy
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = list(llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids)
    was = model.training
    model.eval()
    with torch.no_grad():
        ref = greedy(model)
    model.train(was)
    return got, ref


def main(out, mode="wxfer"):
    t_start = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from vhelp import save_checkpoint
    from wxfer.integrations.vllm import keep_cpu_weights
    from wxfer.runtime.control import free_port

    if mode in ("wxfer", "trl-keep"):
        keep_cpu_weights()  # the engine runs in this process (TRL's external_launcher)
    ck = os.path.join(os.path.dirname(out), "ckpt")
    save_checkpoint(ck, seed=0)
    tokenizer_for(ck)
    tok = AutoTokenizer.from_pretrained(ck)
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = Dataset.from_list([{"prompt": " ".join(f"t{(7 * i + j) % 500 + 2}" for j in range(5))} for i in range(16)])
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "grpo"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=3,
        learning_rate=1e-2,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    res = dict(mode=mode)
    kw = dict(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    try:
        t0 = time.monotonic()
        if mode.startswith("wxfer"):
            tr = WxferGRPOTrainer(**kw, wxfer_store="127.0.0.1:%d" % free_port())
        else:
            tr = GRPOTrainer(**kw)
        res["build_s"] = time.monotonic() - t0
        llm = tr.vllm_generation.llm
        vmodel = llm.llm_engine.model_executor.driver_worker.model_runner.model
        calls = []  # TRL's own sync calls the vLLM model's load_weights: count them
        real_lw = vmodel.load_weights
        vmodel.load_weights = lambda w, _r=real_lw: calls.append(1) or _r(w)
        if not mode.startswith("wxfer"):  # TRL's own sync, timed
            trl_sync, res["trl_sync_s"] = tr.vllm_generation.sync_weights, []

            def timed():
                t = time.monotonic()
                trl_sync()
                res["trl_sync_s"].append(time.monotonic() - t)

            tr.vllm_generation.sync_weights = timed
        t0 = time.monotonic()
        tr.train()
        res["train_s"] = time.monotonic() - t0
        res["global_step"] = tr.state.global_step
        res["load_weights_calls"] = len(calls)
        if mode.startswith("wxfer"):
            res["sync_s"] = list(tr.wxfer_sync_s)
            tr.vllm_generation.sync_weights()  # what the next step's generation would sync first
            res["final_sync_s"] = tr.wxfer_sync_s[-1]
            eng = engine_of(llm)
            res["engine"] = type(eng).__name__
            res["receiver_version"] = eng.receiver.version()
            res["weight_version"] = llm.get_weight_version()
            res["proof"] = {k: len(v) for k, v in (eng.proof_result or {}).items() if isinstance(v, (list, dict))}
            res["moved"] = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])]
            res["registered"] = len(eng.receiver.params)
            fin = eng.finalize_report
            res["finalize"] = dict(modules=len(fin["modules"]), last_s=fin["seconds"], kept=fin["kept_bytes"])
            res["vllm_greedy"], res["hf_greedy"] = greedy_pair(llm, model)
            vmodel.load_weights = real_lw
            if mode == "wxfer":  # the live parameters are what vLLM computes from (keep_cpu_weights)
                res["differ"] = bytes_differ(eng, model)
            tr.wxfer.shutdown()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    res["total_s"] = time.monotonic() - t_start
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
