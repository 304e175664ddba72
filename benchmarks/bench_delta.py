"""Delta pushes (issue 36): measured change rates, bytes and push times.  One JSON object.

Parts (``--parts``, default all but ``kernels``):

* ``rates``: real AdamW steps (lr 1e-6, 3e-6, 1e-5; FP32 master weights, random tokens) on a
  Qwen3-shaped model with random weights (``--model tiny|small|medium`` on CPU; ``qwen3-0.6b``
  or ``qwen3-1.7b`` shapes on a GPU).  Per step: the fraction of BF16 elements, FP8 e4m3 bytes
  and FP8 128x128 block scales (float32) of the 2-D weights that changed since the last step.
* ``push``: ``python -m wxfer demo`` (CPU, fabric tcp, two trainer ranks -> two receivers, real
  processes) with ``Sender(delta=True)``, real AdamW steps at ``--push-lr`` (FP8 and BF16
  destinations, ``--push-model``): per step the bytes sent, the changed fraction, the push time;
  step 2 is forced dense (shadow kept) to give the dense push time of the same run; every
  receiver's bytes are checked each step against the reference packing (a dense push's).
* ``synthetic``: the same with ``--change-rate`` 0.1, 1, 3, 10, 50% of the elements changed.
* ``kernels`` (GPU; on CPU too, small): on one 2-D weight, the dense quantize alone against
  quantize + compare with the shadow + encode; the receiver's apply per MB of records.
* ``colocated`` (GPU only): one trainer rank and one receiver on the same GPU (cuda_ipc),
  ``delta=True`` at ``--colocated-rates`` against a ``delta=False`` run (median push of steps
  2-5): the chooser should send dense by itself, within 5% of the dense push, no slower at 50%.
* ``scatter`` (GPU only): the trainer-side scatter on cuda_ipc (delta_scatter.py) at
  ``--scatter-rates`` of the bytes changed: the scatter kernel over ``--scatter-mib`` MiB against
  a dense copy of the same range (what a dense in-place write of those bytes moves), bit-exact
  checked; with ``--scatter-push 1`` also one trainer and one receiver on this GPU, forced
  scatter (``Sender(delta={"scatter": "force"})``) at each rate against a ``delta=False`` run
  (dense, in place; the median push of steps 2-5 of each).
* ``apply`` (GPU; on CPU the host apply against torch, small): the receiver's apply of one
  slot's records (``--apply-mib`` MiB of destination in ranges of ``--apply-range-kib`` KiB, odd,
  at ``--apply-rates`` of its bytes changed): the native kernel (``delta_gpu.apply``,
  wx_delta_apply) against the torch apply (``delta.apply_records(how="torch")``) and a device copy
  of the same destination bytes, per MB of records and in GB/s, the L2 flushed before each run;
  every row checked bit-exact against the new bytes. ``--cal-in FILE --cal-out FILE`` writes a
  copy of a calibration with ``delta_apply_GBps``, the native rate at the row nearest
  ``--apply-cal-rate``, which ``python -m wxfer plan --delta-rate`` takes for its apply term.
* ``fused`` (GPU only): the delta kernels (wxfer.runtime.delta_gpu) on one 2-D BF16 weight at
  ``--fused-rates``: the fused quantize + compare kernel, and with the count and the records,
  against the dense quantize alone and the torch path (quantize, compare, encode) they replace.

    python benchmarks/bench_delta.py                      # CPU: this VM's table
    python benchmarks/bench_delta.py --parts rates,kernels --model qwen3-0.6b   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
SHAPES = {
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, vocab_size=151936),
    "qwen3-1.7b": dict(QWEN3, hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, vocab_size=151936),
}


def _config(name: str) -> dict:
    from wxfer.models import CONFIGS

    return dict(SHAPES[name]) if name in SHAPES else dict(CONFIGS[name])


def _snapshot(model) -> dict:
    """{name: (bf16 bytes, fp8 bytes or None, scales or None)} of the model's weights as a push
    would write them (BF16 cast; FP8 block quantization of the 2-D ones, from the FP32 master)."""
    import torch
    from wxfer.mapping.reference import quantize_fp8_block

    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            b = p.detach().to(torch.bfloat16).view(torch.int16).clone()
            q = s = None
            if p.dim() == 2:
                q, s = quantize_fp8_block(p.detach())
                q = q.view(torch.uint8).clone()
            out[n] = (b, q, s)
    return out


def _fractions(a: dict, b: dict) -> dict:
    tot = dict(bf16=[0, 0], fp8=[0, 0], scale=[0, 0])
    for n, (b0, q0, s0) in a.items():
        b1, q1, s1 = b[n]
        tot["bf16"][0] += int((b0 != b1).sum())
        tot["bf16"][1] += b0.numel()
        if q0 is not None:
            tot["fp8"][0] += int((q0 != q1).sum())
            tot["fp8"][1] += q0.numel()
            tot["scale"][0] += int((s0 != s1).sum())
            tot["scale"][1] += s0.numel()
    return {k: v[0] / max(v[1], 1) for k, v in tot.items()}


def bench_rates(model_name: str, lrs, steps: int, device, batch: int, seq: int) -> list:
    """Per lr, per step: the changed fractions after one real AdamW step."""
    import torch
    from wxfer.models import train_model
    from wxfer.models import logits as model_logits

    cfg = _config(model_name)
    rows = []
    for lr in lrs:
        model = train_model(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        prev = _snapshot(model)
        for step in range(1, steps + 1):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=gen).to(device)
            out = model_logits(model, ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cur = _snapshot(model)
            rows.append(dict(lr=lr, step=step, **_fractions(prev, cur)))
            prev = cur
        del model, opt
    return rows


def bench_push(model: str, fp8: bool, lr, rate, steps: int, watermark: str, link_gbps=None, dense=(2,)) -> dict:
    """One demo run with delta on (real AdamW at `lr`, or `rate` of the elements changed);
    the steps in `dense` pushed dense (the shadow kept), to compare with in the same run."""
    from wxfer.tools.demo import run_demo

    os.environ.setdefault("WXFER_DEMO_CPU", "1")
    kw = dict(lr=lr) if lr is not None else {}
    res = run_demo(
        trainers=2,
        replicas=1,
        tp=2,
        steps=steps,
        fp8=fp8,
        size=model,
        watermark=watermark,
        transport="fabric",
        delta=link_gbps or True,
        change_rate=rate,
        dense_steps=tuple(dense),
        log=lambda *a: None,
        **kw,
    )
    keep = (
        "verified", "bitexact", "delta_bytes", "dense_bytes", "change_rate", "delta_vs_dense_bytes",
        "first_push_s", "dense_push_s", "delta_push_s", "delta_vs_dense_s", "apply_s", "delta_steps",
        "bytes_per_step", "load_average",
    )  # fmt: skip
    out = {k: res.get(k) for k in keep}
    for s in out["delta_steps"] or []:
        s["records_vs_sent"] = s["record_bytes"] / max(s["sent_bytes"], 1)
    pairs = _paired(out["delta_steps"] or [], set(dense))
    if pairs:  # each delta push against the dense push just before it (the load moves in minutes)
        out["paired_delta_vs_dense_s"] = pairs
    return dict(model=model, fp8=fp8, lr=lr, change_rate_requested=rate, link_gbps=link_gbps, **out)


def _colocated_run(model: str, fp8: bool, rate: float, steps: int, watermark: str, delta: bool) -> dict:
    """One ``python -m wxfer demo`` on this GPU: one trainer rank, one receiver (transport auto:
    cuda_ipc), `rate` of the elements changed per step."""
    from wxfer.tools.demo import run_demo

    prev = os.environ.get("WXFER_DEMO_CPU")
    os.environ["WXFER_DEMO_CPU"] = "0"
    try:
        return run_demo(
            trainers=1, replicas=1, tp=1, steps=steps, fp8=fp8, size=model, watermark=watermark,
            transport="auto", delta=delta, change_rate=rate, log=lambda *a: None,
        )  # fmt: skip
    finally:
        if prev is None:
            os.environ.pop("WXFER_DEMO_CPU", None)
        else:
            os.environ["WXFER_DEMO_CPU"] = prev


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _against_dense(model: str, fp8: bool, rates, steps: int, watermark: str, delta, row) -> list:
    """A ``delta=False`` run of `model` on this GPU, then one run per rate of `rates` with
    ``Sender(delta=delta)``: ``row(rate, run, dense_run, dense_s, s)`` for each, `s` and
    `dense_s` the median push of steps 2.. of the run and of the dense run."""
    dense = _colocated_run(model, fp8, rates[0], steps, watermark, False)
    d_s = _median(dense["step_s"][1:])
    rows = []
    for rate in rates:
        res = _colocated_run(model, fp8, rate, steps, watermark, delta)
        rows.append(row(rate, res, dense, d_s, _median(res["step_s"][1:])))
    return rows


def bench_colocated(model: str, fp8: bool, rates, steps: int, watermark: str) -> list:
    """Colocated on one GPU (GPU only): ``Sender(delta=True)`` (link measured) at each of
    `rates` against a ``delta=False`` run of the same model: the median push of steps 2.. of
    each. The chooser should send dense by itself (there is no link to save): its tasks bypass
    the delta writer (``tasks_bypassed``), delta_vs_dense_s near 1 (target within 5%), at 50%
    changed no slower. Each row is also printed (``colocated_line``)."""

    def row(rate, res, dense, d_s, s):
        r = dict(
            model=model, fp8=fp8, change_rate_requested=rate, transport=res.get("transport"),
            dense_push_s=d_s, delta_push_s=s, delta_vs_dense_s=s / d_s,
            verified=res.get("verified"), dense_verified=dense.get("verified"),
            bitexact=res.get("bitexact"), delta_steps=res.get("delta_steps"),
        )  # fmt: skip
        print(colocated_line(r), flush=True)
        return r

    return _against_dense(model, fp8, rates, steps, watermark, True, row)


def colocated_line(x: dict) -> str:
    """One colocated row as the GPU scripts print it (gpu_fused.sh, gpu_checks.sh grep it)."""
    why = [(s.get("tasks_delta"), s.get("tasks_dense"), s.get("tasks_bypassed")) for s in x["delta_steps"] or []]
    return (
        "colocated fp8=%s rate %g (%s): dense %.4f s, delta %.4f s, delta/dense %.3f, verified %s/%s; "
        "tasks (delta, dense, bypassed) per step %s"
        % (x["fp8"], x["change_rate_requested"], x["transport"], x["dense_push_s"], x["delta_push_s"],
           x["delta_vs_dense_s"], x["verified"], x["dense_verified"], why)
    )  # fmt: skip


def bench_scatter_kernel(device, nbytes: int, rate: float, reps: int) -> dict:
    """The scatter kernel (delta_gpu.scatter) over a range of `nbytes` with `rate` of its bytes
    changed, into a buffer of this GPU, against a dense copy of the same range."""
    import torch
    from wxfer.runtime import delta_gpu

    g = torch.Generator(device=device).manual_seed(int(rate * 1e4))
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
    m = torch.rand(nbytes, generator=g, device=device) < rate
    new = old ^ m.to(torch.uint8)
    expected = int(m.sum())
    del m
    shadow = old.clone()
    cs, st = delta_gpu.compare_count(shadow, new, [(0, nbytes, 0)])
    dst = old.clone()
    t_sc = _best(device, reps, lambda: delta_gpu.scatter(shadow, st["bits"], [(dst.data_ptr(), 0, nbytes)]))
    bitexact = torch.equal(dst, new)
    t_copy = _best(device, reps, lambda: dst.copy_(new))
    return dict(
        device=str(device), name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        nbytes=nbytes, rate=rate, changed=cs[0],
        scatter_s=t_sc, dense_copy_s=t_copy, scatter_vs_dense=t_sc / t_copy,
        expected_changed=expected, changed_Bps=cs[0] / t_sc, bitexact=bool(bitexact),
    )  # fmt: skip


def bench_scatter_push(model: str, fp8: bool, rates, steps: int, watermark: str) -> list:
    """One trainer and one receiver on this GPU (cuda_ipc): forced scatter at each of `rates`
    against a ``delta=False`` run (dense, in place): the median push of steps 2.. of each."""

    def row(rate, res, dense, d_s, s):
        later = (res.get("delta_steps") or [])[1:]
        return dict(
            model=model, fp8=fp8, change_rate_requested=rate, transport=res.get("transport"),
            dense_push_s=d_s, scatter_push_s=s, scatter_vs_dense_s=s / d_s,
            change_rate=res.get("change_rate"), verified=res.get("verified"),
            dense_verified=dense.get("verified"), bitexact=res.get("bitexact"),
            tasks_scatter=[x.get("tasks_scatter") for x in later],
            scatter_bytes=[x.get("scatter_bytes") for x in later],
        )  # fmt: skip

    return _against_dense(model, fp8, rates, steps, watermark, {"scatter": "force"}, row)


def _paired(steps: list, dense: set) -> list:
    """delta push time / the dense push's of the step before, for each delta step after a dense one."""
    by = {s["step"]: s for s in steps}
    return [
        by[k]["push_s"] / by[k - 1]["push_s"]
        for k in sorted(by)
        if k not in dense and k - 1 in dense and k - 1 > 1 and by[k]["tasks_delta"]
    ]


def _best(device, reps: int, fn, setup=None) -> float:
    """The fastest of `reps` runs of `fn` (each after `setup`, when given), the device synchronized
    around each."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t = float("inf")
    for _ in range(reps):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        t = min(t, time.perf_counter() - t0)
    return t


def _apply_records(device, nbytes: int, range_bytes: int, rate: float):
    """(old, new, the records of new against old in ranges of range_bytes, their count): about
    `rate` of the bytes changed (a byte-level rate, as the simulator's)."""
    import torch
    from wxfer.runtime import delta, delta_gpu

    g = torch.Generator(device=device).manual_seed(int(rate * 1e5) + 1)
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
    new = old.clone()
    for o in range(0, nbytes, 1 << 26):  # the mask in 64 MiB pieces (its floats)
        m = torch.rand(min(1 << 26, nbytes - o), generator=g, device=device) < rate
        new[o : o + m.numel()] ^= m.to(torch.uint8)
    ranges = [(o, min(range_bytes, nbytes - o)) for o in range(0, nbytes, range_bytes)]
    if device.type == "cuda" and delta_gpu.why(device) is None:  # the kernels: fast at any size
        shadow = old.clone()
        cs, st = delta_gpu.compare_count(shadow, new, [(o, n, o) for o, n in ranges])
        recs = delta_gpu.emit(shadow, st, [(i, 0, ranges[i][0]) for i, c in enumerate(cs) if c])
    else:
        recs = []
        for o, n in ranges:
            d, c = delta.changed(new[o : o + n], old[o : o + n])
            if c:
                recs.append(delta.encode(new[o : o + n], d, c, 0, o))
    buf = torch.cat(recs) if recs else torch.zeros(8, dtype=torch.uint8, device=device)
    return old, new, buf, len(recs)


def bench_apply(device, nbytes: int, range_bytes: int, rate: float, reps: int) -> dict:
    """One slot's records applied by the native path (the kernel on a GPU, wx_delta_host.c on
    the CPU) against the torch apply and a copy of the destination bytes."""
    import torch
    from wxfer.runtime import delta

    old, new, buf, nrec = _apply_records(device, nbytes, range_bytes, rate)
    dst = old.clone()
    flush = torch.empty(256 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)
    how, why = delta.applier(buf, [dst])
    ok = {}

    def run(h):
        def fn():
            delta.apply_records(buf, nrec, [dst], how=h)

        dst.copy_(old)
        fn()
        ok[h] = bool(torch.equal(dst, new))
        return _best(device, reps, fn, flush.zero_)  # absolute values: the same bytes each run

    t_native = run(how)
    t_torch = run("torch") if how != "torch" else t_native
    t_copy = _best(device, reps, lambda: dst.copy_(new), flush.zero_)
    rb, changed = buf.numel(), int((new != old).sum())
    return dict(
        device=str(device), name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        nbytes=nbytes, range_bytes=range_bytes, rate=rate, changed=changed, records=nrec, record_bytes=rb,
        applier=how, applier_why=why,
        native_s=t_native, torch_s=t_torch, dense_copy_s=t_copy,
        native_s_per_MB=t_native / (rb / 1e6), torch_s_per_MB=t_torch / (rb / 1e6),
        native_GBps=rb / t_native / 1e9, torch_GBps=rb / t_torch / 1e9,
        native_vs_torch=t_native / t_torch, native_vs_copy=t_native / t_copy,
        bitexact=ok.get(how, False) and ok.get("torch", True),
    )  # fmt: skip


def apply_line(x: dict) -> str:
    """One row of the apply part, for the log."""
    return "apply %s: %.2f%% changed, %d records %.2f MB: %s %.3f ms (%.1f GB/s of records), torch %.3f ms " \
        "(%.1f GB/s), copy of the %d MiB %.3f ms; native/torch %.3f, native/copy %.2f, bit-exact %s" % (
            x["name"], 100 * x["rate"], x["records"], x["record_bytes"] / 1e6, x["applier"], 1e3 * x["native_s"],
            x["native_GBps"], 1e3 * x["torch_s"], x["torch_GBps"], x["nbytes"] >> 20, 1e3 * x["dense_copy_s"],
            x["native_vs_torch"], x["native_vs_copy"], x["bitexact"],
        )  # fmt: skip


def apply_calibration(rows: list, rate: float, cal_in: str, cal_out: str, machine: str) -> dict:
    """A copy of calibration `cal_in` with delta_apply_GBps, the native apply's rate at the row
    nearest `rate`, written to `cal_out`: what ``plan --delta-rate`` takes for its apply term."""
    from wxfer.plan.calibrate import load, save

    row = min(rows, key=lambda x: abs(x["rate"] - rate))
    cal = load(cal_in)
    cal.delta_apply_GBps = row["native_GBps"]
    cal.source += "; delta_apply_GBps: bench_delta.py --parts apply (%s, %s) at %.2f%% changed on %s" % (
        row["applier"], row["name"], 100 * row["rate"], machine,
    )  # fmt: skip
    save(cal, cal_out)
    return dict(cal_in=cal_in, cal_out=cal_out, delta_apply_GBps=row["native_GBps"], rate=row["rate"])


def bench_kernels(device, rows: int, cols: int, rate: float, reps: int) -> dict:
    """Dense quantize alone vs quantize + compare + encode, and apply per MB of records."""
    import torch
    from wxfer.runtime import delta, delta_cpu, fp8

    def best(fn):
        return _best(device, reps, fn)

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    nq = rows * cols
    ns = -(-rows // 128) * -(-cols // 128) * 4
    out = torch.empty(nq + ns, dtype=torch.uint8, device=device)
    fp8.quantize_into(out, [(w, 0, nq)])
    shadow = out.clone()
    w2 = w.clone()
    m = torch.rand(rows, cols, generator=g).to(device) < rate
    w2[m] = w2[m] * 1.07
    t_q = best(lambda: fp8.quantize_into(out, [(w2, 0, nq)]))
    box = {}

    def full():
        fp8.quantize_into(out, [(w2, 0, nq)])
        d, c = delta.changed(out, shadow)
        box["rec"] = delta.encode(out, d, c, 0, 0)

    t_full = best(full)
    rec = box["rec"]
    native = {}
    if delta_cpu.available(device):  # what a CPU push runs: one scan, the record from its offsets
        sh2 = shadow.clone()

        def cpu():
            fp8.quantize_into(out, [(w2, 0, nq)])
            c, idx = delta_cpu.scan(out, sh2)
            box["nrec"] = delta_cpu.record(out, sh2, c, idx, 0, 0)

        def torch_only():  # compare + encode alone, the torch ops and the native ones
            d, c = delta.changed(out, shadow)
            delta.encode(out, d, c, 0, 0)

        def native_only():
            c, idx = delta_cpu.scan(out, sh2)
            delta_cpu.record(out, sh2, c, idx, 0, 0)

        t_n = best(cpu)
        native = dict(
            quantize_compare_encode_native_s=t_n,
            ratio_native=t_n / t_q,
            compare_encode_torch_s=best(torch_only),
            compare_encode_native_s=best(native_only),
        )
        assert torch.equal(box["nrec"], rec)
    changed_bytes = int(delta.changed(out, shadow)[1])
    dst = shadow.clone()
    t_apply = best(lambda: delta.apply_records(rec, 1, [dst]))
    assert torch.equal(dst, out)
    return dict(
        device=str(device),
        quantizer=fp8.last(),
        shape=[rows, cols],
        rate=rate,
        quantize_s=t_q,
        quantize_compare_encode_s=t_full,
        ratio=t_full / t_q,
        record_bytes=int(rec.numel()),
        changed_bytes=changed_bytes,
        expected_record_bytes=delta.record_size(int(out.numel()), changed_bytes),
        dense_bytes=int(out.numel()),
        apply_s=t_apply,
        apply_s_per_MB=t_apply / (rec.numel() / 1e6),
        **native,
    )


def bench_fused(device, rows: int, cols: int, rate: float, reps: int) -> dict:
    """The delta kernels (wxfer.runtime.delta_gpu) on one 2-D BF16 weight against the dense
    quantize alone and the torch path they replace (quantize, then delta.changed + encode):
    fused_s the fused quantize + compare kernel (the bitmask zeroed, the shadow updated in the
    same pass), fused_encode_s that plus the count (one read back) and the records; bitexact:
    the shadow equals the dense push's bytes and the records delta.encode's."""
    import torch
    from wxfer.runtime import delta, delta_gpu, fp8

    def best(fn, setup=None):
        return _best(device, reps, fn, setup)

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    nq = rows * cols
    n = nq + -(-rows // 128) * -(-cols // 128) * 4
    old = torch.empty(n, dtype=torch.uint8, device=device)
    fp8.quantize_into(old, [(w, 0, nq)])
    w2 = w.clone()
    m = torch.rand(rows, cols, generator=g).to(device) < rate
    w2[m] = w2[m] * 1.07
    jobs = [(w2, 0, nq)]
    out = torch.empty_like(old)
    t_q = best(lambda: fp8.quantize_into(out, jobs))
    box: dict = {}

    def torch_path():
        fp8.quantize_into(out, jobs)
        d, c = delta.changed(out, old)
        box["rec"] = delta.encode(out, d, c, 0, 0)

    t_torch = best(torch_path)
    shadow = old.clone()

    def reset():
        shadow.copy_(old)

    def fused():
        box["bits"] = delta_gpu.bits_for(n, device)
        delta_gpu.quantize_compare(shadow, box["bits"], jobs)

    t_fused = best(fused, reset)

    def fused_encode():
        fused()
        cs, st = delta_gpu.count(box["bits"], [(0, n)])
        box["recs"] = delta_gpu.emit(shadow, st, [(0, 0, 0)]) if cs[0] else []

    t_all = best(fused_encode, reset)
    rec = box["recs"][0] if box["recs"] else None
    changed_bytes = int(delta.changed(out, old)[1])
    bitexact = torch.equal(shadow, out) and (rec is None or torch.equal(rec, box["rec"]))
    return dict(
        device=str(device),
        name=torch.cuda.get_device_name(device),
        shape=[rows, cols],
        rate=rate,
        quantize_s=t_q,
        fused_s=t_fused,
        fused_vs_quantize=t_fused / t_q,
        fused_encode_s=t_all,
        fused_encode_vs_quantize=t_all / t_q,
        torch_path_s=t_torch,
        torch_path_vs_quantize=t_torch / t_q,
        record_bytes=0 if rec is None else int(rec.numel()),
        changed_bytes=changed_bytes,
        expected_record_bytes=delta.record_size(n, changed_bytes),
        dense_bytes=n,
        bitexact=bool(bitexact),
    )


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="rates,push,synthetic")
    ap.add_argument("--model", default="small", help="rates: tiny|small|medium|qwen3-0.6b|qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--push-model", default="medium")
    ap.add_argument("--push-lr", type=float, default=1e-6)
    ap.add_argument("--push-steps", type=int, default=5)
    ap.add_argument("--dense-steps", default="2", help="push part: steps pushed dense (e.g. 2,4,6: interleaved)")
    ap.add_argument("--synthetic-model", default="small")
    ap.add_argument("--synthetic-rates", default="0.001,0.01,0.03,0.1,0.5")
    ap.add_argument("--watermark", default="2GiB")
    ap.add_argument("--link-gbps", type=float, default=None, help="the chooser's link pinned (default: measured)")
    ap.add_argument("--push-fp8", default="1,0", help="push part: FP8 (1) and/or BF16 (0) destinations")
    ap.add_argument("--kernel-shape", default="4096x4096")
    ap.add_argument("--kernel-rate", type=float, default=0.004)
    ap.add_argument("--colocated-rates", default="0.004,0.5", help="colocated part: fractions of elements changed")
    ap.add_argument("--fused-rates", default="0,0.004,0.03,0.5", help="fused part: fractions of elements changed")
    ap.add_argument("--scatter-rates", default="0.001,0.01,0.03,0.1,0.5", help="scatter part: fractions changed")
    ap.add_argument("--scatter-mib", type=int, default=256, help="scatter part: the kernel rows' range, MiB")
    ap.add_argument("--scatter-push", type=int, default=0, help="scatter part: 1 also runs the push rows (demo)")
    ap.add_argument("--apply-rates", default="0.001,0.0031,0.01,0.03,0.1,0.5", help="apply part: bytes changed")
    ap.add_argument("--apply-mib", type=int, default=512, help="apply part: MiB of destination (GPU; CPU: 16)")
    ap.add_argument("--apply-range-kib", type=int, default=4099, help="apply part: KiB per range (one record each)")
    ap.add_argument("--apply-cal-rate", type=float, default=0.0031, help="apply part: the row --cal-out takes")
    ap.add_argument("--cal-in", default=None, help="apply part: a calibration to copy with delta_apply_GBps")
    ap.add_argument("--cal-out", default=None, help="apply part: where that copy goes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    res = dict(
        machine="%s, %s, %d CPUs%s"
        % (
            platform.node(),
            platform.machine(),
            os.cpu_count() or 0,
            ", " + torch.cuda.get_device_name() if torch.cuda.is_available() else "",
        ),
        load_average=os.getloadavg(),
    )
    if "rates" in parts:
        lrs = [float(x) for x in a.lrs.split(",")]
        res["rates"] = dict(model=a.model, rows=bench_rates(a.model, lrs, a.steps, device, a.batch, a.seq))
    if "push" in parts:
        res["push"] = [
            bench_push(
                a.push_model,
                f == "1",
                a.push_lr,
                None,
                a.push_steps,
                a.watermark,
                a.link_gbps,
                [int(x) for x in a.dense_steps.split(",")],
            )  # fmt: skip
            for f in a.push_fp8.split(",")
        ]
    if "synthetic" in parts:
        res["synthetic"] = [
            bench_push(a.synthetic_model, True, None, float(r), 4, a.watermark, a.link_gbps)
            for r in a.synthetic_rates.split(",")
        ]
    if "kernels" in parts:
        r, c = (int(x) for x in a.kernel_shape.split("x"))
        res["kernels"] = bench_kernels(device, r, c, a.kernel_rate, 5)
    if "colocated" in parts:  # GPU only: one trainer and one receiver on the same GPU
        rates = [float(r) for r in a.colocated_rates.split(",")]
        res["colocated"] = [
            row for f in a.push_fp8.split(",") for row in bench_colocated(a.push_model, f == "1", rates, 5, a.watermark)
        ]
    if "scatter" in parts:  # GPU only: the trainer-side scatter (cuda_ipc)
        rates = [float(r) for r in a.scatter_rates.split(",")]
        res["scatter"] = [bench_scatter_kernel(device, a.scatter_mib << 20, r, 10) for r in rates]
        if a.scatter_push:
            res["scatter_push"] = [
                row
                for f in a.push_fp8.split(",")
                for row in bench_scatter_push(a.push_model, f == "1", rates, 5, a.watermark)
            ]
    if "apply" in parts:  # the receiver's apply: native against torch and a copy
        mib = a.apply_mib if device.type == "cuda" else min(a.apply_mib, 16)
        res["apply"] = []
        for r in a.apply_rates.split(","):
            res["apply"].append(bench_apply(device, mib << 20, a.apply_range_kib << 10, float(r), 5))
            print(apply_line(res["apply"][-1]), file=sys.stderr, flush=True)
        if a.cal_in and a.cal_out:
            res["apply_calibration"] = apply_calibration(
                res["apply"], a.apply_cal_rate, a.cal_in, a.cal_out, res["machine"]
            )
    if "fused" in parts:  # GPU only: the delta kernels
        r, c = (int(x) for x in a.kernel_shape.split("x"))
        res["fused"] = [bench_fused(device, r, c, float(x), 10) for x in a.fused_rates.split(",")]
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
