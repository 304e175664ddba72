"""Helpers of the tests on the real vLLM (not a test module): tiny Qwen3 / Qwen3-MoE checkpoints
saved as HF directories, and vLLM's own model classes built from them without an engine
(``python tests/on_vllm/vhelp.py contract ...`` runs one TP rank in its own process)."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# The tiny checkpoints' common config (hf_config's, trace_proc's), as helpers.small_moe groups
# it: 2 layers of 4 heads (2 KV), hidden 256, a 512-token vocabulary, untied, random weights
# at initializer_range 0.2.
_HEADS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_WIDTHS = dict(vocab_size=512, hidden_size=256, max_position_embeddings=256)
TINY = dict(**_HEADS, **_WIDTHS, tie_word_embeddings=False, initializer_range=0.2)


def hf_config(moe=False, fp8=False, layers=2, vocab=512, head_dim=64, moe_inter=128):
    from transformers import Qwen3Config, Qwen3MoeConfig

    kw = dict(TINY, vocab_size=vocab, num_hidden_layers=layers, head_dim=head_dim)
    if moe:
        c = Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=moe_inter,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            **kw,
        )
    else:
        c = Qwen3Config(intermediate_size=256, **kw)
    if fp8:
        c.quantization_config = dict(FP8)
    return c


def hf_model(cfg, seed=0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    c = cfg.__class__.from_dict(cfg.to_dict())
    c.quantization_config = None
    if hasattr(c, "quantization_config"):
        del c.quantization_config
    return AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16).eval()


def save_checkpoint(path, moe=False, fp8=False, seed=0, **kw):
    """An HF directory: the BF16 weights of a seeded model, and its config (with an FP8
    quantization_config when `fp8`)."""
    cfg = hf_config(moe, fp8, **kw)
    hf_model(cfg, seed).save_pretrained(path)
    if fp8:  # the config an FP8 checkpoint has (the weights stay BF16: the contract tests load none)
        d = json.load(open(os.path.join(path, "config.json")))
        d["quantization_config"] = dict(FP8)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f)
    return cfg


def wxfer_llm(path, **engine_kw):
    """The offline ``vllm.LLM`` every test here serves from the checkpoint at `path` with
    ``WeightTransferConfig(backend="wxfer")`` (token ids in, no tokenizer, eager; `engine_kw`
    added: TP), with the checkpoint and its start seconds on it (``wxfer_ckpt``, ``wxfer_start_s``)."""
    import time

    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    t0 = time.monotonic()
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        weight_transfer_config=WeightTransferConfig(backend="wxfer"),
        **engine_kw,
    )
    llm.wxfer_ckpt = path
    llm.wxfer_start_s = time.monotonic() - t0
    return llm


def release(llm):
    """Closes the wxfer Receivers of a test's engine (``shutdown_weight_transfer_engine``) at its
    teardown; an error there (nothing to release, an engine a failed test left half set up) is
    not the test's result."""
    try:
        llm.shutdown_weight_transfer_engine()
    except Exception:  # noqa: BLE001 -- nothing to release
        pass


def plant(kind):
    """Plant a post-processing of our own into vLLM's classes in this process (both the model
    built here and the proof's fresh reference instance get it): "transpose" re-lays
    layers.0's o_proj weight (square) into a new tensor, transposed; "random" adds a buffer to
    that o_proj which its post-processing fills with fresh random numbers (no re-run can
    reproduce it); "init-buffer" a buffer on every Qwen3 decoder layer, random at build time,
    that no post-processing touches (neither written by wxfer nor constant); several: "a,b"."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.models import qwen3

    kinds = (kind or "").split(",")
    if "transpose" in kinds or "random" in kinds:
        real = UnquantizedLinearMethod.process_weights_after_loading

        def planted(self, layer):
            real(self, layer)
            if getattr(layer, "prefix", "").endswith("layers.0.self_attn.o_proj"):
                if "transpose" in kinds:
                    layer.weight = torch.nn.Parameter(layer.weight.t().contiguous(), requires_grad=False)
                else:
                    layer.register_buffer("planted_noise", torch.randn(8))

        UnquantizedLinearMethod.process_weights_after_loading = planted
    if "init-buffer" in kinds:
        real_init = qwen3.Qwen3DecoderLayer.__init__

        def init(self, *a, **kw):
            real_init(self, *a, **kw)
            self.register_buffer("planted_state", torch.randn(8))

        qwen3.Qwen3DecoderLayer.__init__ = init
    if set(kinds) - {"", "transpose", "random", "init-buffer"}:
        raise ValueError(kind)


def engine_config(path, tp=1, ep=False, **extra):
    """vLLM's engine config of the checkpoint at `path` as the model builds here (this file's,
    trace_proc.py's and mla_proc.py's) make it: BF16, eager, 128 tokens, no tokenizer, `tp` ranks,
    `ep` expert parallel, `extra` more EngineArgs (mla_proc.py's MTP draft)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        enforce_eager=True,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        distributed_executor_backend="mp" if tp > 1 else None,
        **extra,
    ).create_engine_config()


def build(path, tp=1, rank=0, port=29611, post=True, ep=False, keep=True):
    """(vllm_config, model): vLLM's own model class for the checkpoint at `path`, TP rank `rank`
    of `tp` (gloo), with vLLM's CPU GEMM dispatch kept on the parameters (keep_cpu_weights).
    post: run vLLM's process_weights_after_loading too; ep: expert parallelism; keep: False
    leaves vLLM's CPU GEMM dispatch as it is."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from wxfer.integrations.vllm import keep_cpu_weights

    if keep:
        keep_cpu_weights()
    os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets before its gloo groups
    vc = engine_config(path, tp, ep)
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tp)
        with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config)
        if post:
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return vc, model


def moe_of(cfg):
    return "num_experts" in cfg or "num_local_experts" in cfg


def contract(path, tp, rank, port, out, post, ep=False, keep=True):
    """One TP rank: the parameter contract, the layout proof (bit equality of vLLM's load_weights
    with the mapping), a deliberately wrong mapping, and the engine from vLLM's factory."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from wxfer.integrations.vllm import expected_destinations, quant_of, select_parameters
    from wxfer.integrations.vllm.engine import WxferInitInfo, worker_preset
    from wxfer.integrations.vllm.layout import check_shapes, compare_digests, proof_digests, proof_layers
    from wxfer.integrations.vllm.proof import classify_worker, load_and_digest

    plant(os.environ.get("WXFER_TEST_PLANT"))
    vc, model = build(path, tp, rank, port, post, ep, keep)
    cfg = vc.model_config.hf_config.to_dict()
    preset = worker_preset(WxferInitInfo(mapping_name="tiny"), cfg)
    named = list(model.named_parameters())
    quant = quant_of(named)
    exp = expected_destinations(preset, cfg, tp, rank, quant, ep)
    sel, left, missing = select_parameters(named, exp)
    classes = None
    if post:  # the post-processing proof (postproc.py), every layer; each finalizer run twice more
        with set_current_vllm_config(vc):
            par = dict(tp=tp, rank=rank, ep=ep)
            c, _ = classify_worker(model, vc, "cpu", preset, cfg, named, par, quant, None, 7, "rank %d" % rank)
            for f in c.finalize:
                f()
                f()
        classes = dict(
            c.summary(),
            direct_names=c.direct,
            finalize_dests=sorted(c.finalize_dests),
            finalize_s={f.module_name: f.seconds for f in c.finalize},
        )
    shape_error = None
    try:
        check_shapes(sel, exp, "rank %d" % rank)
    except ValueError as e:
        shape_error = str(e)
    layers = proof_layers(cfg["num_hidden_layers"])
    if shape_error or (classes and (classes["finalize"] or classes["refused"])):
        # post-processing re-laid parameters: the loader alone cannot run on them (the proof did)
        with open(out, "w") as f:
            params = {n: [list(t.shape), str(t.dtype)] for n, t in named}
            json.dump(dict(shape_error=shape_error, classes=classes, params=params), f)
        return
    with set_current_vllm_config(vc):
        got, errors, secs = load_and_digest(model, preset, cfg, sel, tp, rank, quant, ep, layers, 7, "rank %d" % rank)
        # a deliberately wrong mapping: gate and up swapped in the fused gate_up_proj (same shapes)
        from wxfer.mapping import Fuse, Preset

        def swap(r):
            if getattr(r, "dst", "").endswith("gate_up_proj.weight"):
                return Fuse(r.dst, tuple(reversed(r.srcs)))
            return r

        wrong = Preset(preset.name, preset.arch, [swap(r) for r in preset.rules], preset.config)
        wrong_errors = compare_digests(
            proof_digests(wrong, None, tp, rank, quant, ep, layers, 7), got, "rank %d" % rank
        )
        # and the layout without expert parallelism on an engine with it (or the other way round)
        other = proof_digests(preset, None, tp, rank, quant, not ep, layers, 7) if moe_of(cfg) and tp > 1 else {}
        ep_errors = compare_digests(other, got, "rank %d" % rank) if other else []
        eng = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="wxfer"), vc, torch.device("cpu"), model
        )
    rep = dict(
        params={n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in named},
        expected={n: [list(s), d] for n, (s, d) in exp.items()},
        selected=[n for n, _ in sel],
        left=left,
        missing=missing,
        shape_error=shape_error,
        proof_errors=errors,
        proof_params=sorted(got),
        proof_s=secs,
        wrong_errors=wrong_errors,
        ep_errors=ep_errors,
        classes=classes,
        engine=type(eng).__module__ + "." + type(eng).__name__,
        gate_fp8=[getattr(r, "fp8", None) for r in preset.rules if getattr(r, "dst", "").endswith("mlp.gate.weight")],
    )
    with open(out, "w") as f:
        json.dump(rep, f)


if __name__ == "__main__":
    if sys.argv[1] == "contract":
        a = sys.argv[2:]
        contract(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], a[5] == "1", a[6] == "1", a[7] == "1")
