"""The rows, the summary per model x quantization x job and the table of
benchmarks/bench_ckpt_engine.py."""

from __future__ import annotations


def _row_view(r) -> dict:
    keep = (
        "seconds",
        "gbps",
        "best",
        "times",
        "error",
        "skipped",
        "check",
        "parts",
        "ckpt_log",
        "version",
        "h2d_GBps",
        "what",
        "tasks",
        "transport",
        "setup_s",
        "dest_bytes",
        "train_bytes",
        "worker",
        "setup",
        "warmup_s",
        "exitcodes",
        "stacks",
        "traceback",
    )
    return {k: r[k] for k in keep if k in r}


def summarize(results) -> list:
    """Per model x quantization x job: the bound, wxfer and checkpoint-engine, with ratios."""
    cases: dict = {}
    for r in results:
        if r is None:
            continue
        s = r["step"]
        c = cases.setdefault(
            (s["model"], s["quant"], s["job"]), dict(model=s["model"], quant=s["quant"], job=s["job"], methods={})
        )
        c["methods"][s["method"]] = _row_view(r)
    out = []
    for c in cases.values():
        ms = c["methods"]
        b = ms.get("bound", {}).get("seconds")
        for k, v in ms.items():
            if v.get("seconds") and b and k != "bound":
                v["x_bound"] = b / v["seconds"]
        w, ck = ms.get("wxfer", {}).get("seconds"), ms.get("ckpt-engine", {}).get("seconds")
        if w and ck:
            c["ckpt_over_wxfer"] = ck / w
        out.append(c)
    return out


JOB_TEXT = dict(host="weights in host memory", gpu="weights on the GPU")


WHAT = {
    ("host", "wxfer"): "wxfer (FSDP2, CPUOffloadPolicy)",
    ("gpu", "wxfer"): "wxfer (GPU tensors)",
    ("host", "ckpt-engine"): "checkpoint-engine update()",
    ("gpu", "ckpt-engine"): "checkpoint-engine register + update()",
    ("gpu", "loader"): "load_fn only (no ckpt-engine)",
}


def table(cases, out) -> str:
    v = out.get("ckpt_engine") or "-"
    lines = [
        f"checkpoint-engine {v}; {out['command']}",
        "",
        "| model | quant | job | method | seconds | GB/s | x bound | ckpt-engine / wxfer | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        for m in ("bound", "wxfer", "ckpt-engine", "loader"):
            r = c["methods"].get(m)
            if r is None:
                continue
            name = "bound: " + r.get("what", "") if m == "bound" else WHAT.get((c["job"], m), m)
            head = f"| {c['model']} | {c['quant']} | {JOB_TEXT[c['job']]} | {name} |"
            if r.get("error") or r.get("skipped"):
                lines.append(
                    f"{head} {'error' if r.get('error') else 'skipped'}: "
                    f"{(r.get('error') or r.get('skipped'))[:160]} | | | | |"
                )
                continue
            ratio = f"{c['ckpt_over_wxfer']:.2f}" if m == "wxfer" and c.get("ckpt_over_wxfer") else ""
            chk = r.get("check")
            chk = (
                ""
                if chk is None
                else ("same bytes as the reference" if chk["ok"] else f"DIFFERS ({chk['differ']}: {chk['first']})")
            )
            xb = "1.00" if m == "bound" else (f"{r['x_bound']:.2f}" if r.get("x_bound") else "")
            extra = ""
            if m == "ckpt-engine" and r.get("parts"):
                extra = " (" + ", ".join(f"{k[:-2]} {x:.3f}" for k, x in r["parts"].items() if x is not None) + ")"
            lines.append(f"{head} {r['seconds']:.4f}{extra} | {r['gbps']:.1f} | {xb} | {ratio} | {chk} |")
    return "\n".join(lines)
