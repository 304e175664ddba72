"""Tables and the chart of bench_baselines.py."""

from __future__ import annotations

METHODS = ("link", "h2d", "wxfer", "rank0", "per-tensor")


def _gb(x):
    return "" if x is None else f"{x / 1e9:.3f}"


def wxfer_table(results: list, cfg_name) -> str:
    """Per configuration and watermark: wxfer's median push against the bound measured in
    the same run, peak extra GPU memory of a push against watermark + largest task, tasks
    (zero copy), host time per step, per task and per parameter (engine trace, last step)."""
    lines = [
        "| configuration | trainer (step) | watermark | push s | x bound | peak extra GB | "
        "watermark + largest task GB | holds | tasks (zero copy) | host ms / step | host us / task | "
        "host us / param |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        byw = r.get("wxfer_by_watermark")
        if not byw:
            continue
        ms = r["methods"]
        bound = ms.get("h2d", ms.get("link", {})).get("seconds")
        for wm, w in byw.items():
            x = f"{bound / w['seconds']:.2f}" if bound else ""
            lim = int(wm) + w["largest_task"]
            held = "" if w["within_watermark"] is None else ("yes" if w["within_watermark"] else "NO")
            h = w["host"]
            lines.append(
                f"| {cfg_name(r['config'])} | {r.get('trainer_used', '')} ({r.get('train_step', '')}) | "
                f"{int(wm) / 2**20:.0f} MiB | {w['seconds']:.4f} | {x} | {_gb(w['peak_extra'])} | "
                f"{_gb(lim)} | {held} | {w['tasks']} ({w['zero_copy_tasks']}) | {h['host_s'] * 1e3:.2f} | "
                f"{h['per_task_us']:.0f} | {h['per_param_us']:.1f} |"
            )
    notes = [r["note"] for r in results if r.get("note")]
    return "\n".join(lines + [""] + [f"Note: {n}" for n in notes])


def sim_table(results: list, cfg_name) -> str:
    """Per configuration: the simulator beside wxfer's measured median push (the first
    watermark): predicted_s (from a calibration made before the run, nothing from it) and
    fitted_s (the in-run fit of this Sender's own trace), with the fit's terms on the busiest
    rank and what it was calibrated with."""
    lines = [
        "| configuration | push s | predicted s | pred / push | fitted s | fit / push | bound by (pred / fit) | "
        "host ms | kernel ms | write ms | stamps ms | H2D ms | tasks (kinds) | us / write | quantizer GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        byw = r.get("wxfer_by_watermark")
        if not byw:
            continue
        w = next(iter(byw.values()))
        if "predicted_s" in w:
            pred = f"{w['predicted_s']:.4f} | {w['predicted_s'] / w['seconds']:.2f}"
        else:
            pred = "error: %s | " % (w.get("predicted_error") or "not predicted")[:80]
        pb = w.get("predicted_bound_by", "-")
        if "simulated_s" not in w:
            err = (w.get("simulated_error") or "not fitted")[:80]
            lines.append(f"| {cfg_name(r['config'])} | {w['seconds']:.4f} | {pred} | error: {err} | | {pb} / - |")
            continue
        t, c = w["simulated_terms"], w["simulated_calibration"]
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(w.get("simulated_kinds", {}).items()))
        ms = [t[k] * 1e3 for k in ("host_s", "kernel_s", "write_s", "stamps_s", "h2d_s")]
        lines.append(
            f"| {cfg_name(r['config'])} | {w['seconds']:.4f} | {pred} | {w['simulated_s']:.4f} | "
            f"{w['simulated_s'] / w['seconds']:.2f} | {pb} / {w['simulated_bound_by']} | "
            + " | ".join(f"{x:.2f}" for x in ms)
            + f" | {kinds} | {c['write_call_s'] * 1e6:.1f} | {c['quant_GBps']:.0f} |"
        )
    return "\n".join(lines)


def copy_max_table(results: list, cfg_name) -> str:
    """The copy_max sweep (bench_baselines --copy-max), "" without one: per configuration and
    Sender(copy_max=...) value, the median push against the bound and against the headline
    (the first watermark, the default copy_max), the zero-copy tasks copied."""
    lines = [
        "copy_max sweep (a fresh Sender per value at the first watermark, as many steps as the headline):",
        "",
        "| configuration | copy_max | push s | x bound | headline push s | x headline | copies / zero-copy tasks |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in results if r.get("wxfer_by_copy_max")]
    for r in rows:
        ms = r["methods"]
        bound = ms.get("h2d", ms.get("link", {})).get("seconds")
        head = ms.get("wxfer", {}).get("seconds")
        for v, w in r["wxfer_by_copy_max"].items():
            x = f"{bound / w['seconds']:.2f}" if bound else ""
            xh = f"{head / w['seconds']:.2f}" if head else ""
            hs = f"{head:.4f}" if head else ""
            d = w.get("direct") or {}
            lines.append(
                f"| {cfg_name(r['config'])} | {v} | {w['seconds']:.4f} | {x} | {hs} | {xh} | "
                f"{d.get('copies', 0)} / {w['zero_copy_tasks']} |"
            )
    return "\n".join(lines) if rows else ""


def table(results: list, cfg_name) -> str:
    """The methods table, then wxfer's per-watermark table, the simulator's, the copy_max sweep."""
    lines = [
        "| configuration | method | seconds | GB/s | x bound | x best baseline | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = cfg_name(r["config"])
        if r.get("error") and not r.get("methods"):
            lines.append(f"| {name} | - | error: {r['error'].strip().splitlines()[-1][:120]} | | | | |")
            continue
        ms = r["methods"]
        bound = "h2d" if "h2d" in ms else "link"  # a CPU-offloaded trainer: pinned H2D
        link = ms.get(bound, {}).get("seconds")
        basel = [ms[m]["seconds"] for m in ("rank0", "per-tensor") if m in ms]
        best = min(basel) if basel else None
        for m in METHODS:
            if m not in ms:
                if m in r.get("errors", {}):
                    lines.append(f"| {name} | {m} | error: {r['errors'][m][:120]} | | | | |")
                continue
            s = ms[m]["seconds"]
            xl = f"{link / s:.2f}" if link and m != bound else ("1.00" if m == bound else "")
            xb = f"{best / s:.2f}" if best and m not in ("link", "h2d") else ""
            chk = r.get("checks", {}).get(m, "")
            chk = "" if chk == "" else ("same bytes as wxfer" if chk else "DIFFERS from wxfer")
            if m == "wxfer" and "reference" in r.get("checks", {}):
                chk = "reference bytes" if r["checks"]["reference"] else "DIFFERS from the reference"
            lines.append(f"| {name} | {m} | {s:.4f} | {ms[m]['gbps']:.2f} | {xl} | {xb} | {chk} |")
    out = "\n".join(lines) + "\n\n" + wxfer_table(results, cfg_name) + "\n\n" + sim_table(results, cfg_name)
    sweep = copy_max_table(results, cfg_name)
    return out + ("\n\n" + sweep if sweep else "")


def chart(results: list, path: str, cfg_name) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    rows = [r for r in results if r.get("methods")]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4.5))
    w = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        xs = [i + (j - (len(METHODS) - 1) / 2) * w for i in range(len(rows))]
        ys = [r["methods"].get(m, {}).get("gbps", 0.0) for r in rows]
        ax.bar(xs, ys, w, label=m)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([cfg_name(r["config"]).replace("-", "\n", 2) for r in rows], fontsize=8)
    ax.set_ylabel("GB/s (bytes the inference GPU receives / step time)")
    ax.set_title("wxfer vs baselines" + (" (CPU dry run: not GPU figures)" if rows and rows[0].get("dry_run") else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
