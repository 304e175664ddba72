"""benchmarks/sim_check.py: the engine records read back from a Chrome trace as the runtime
writes it (wxfer.runtime.trace), and a benchmark row's plan rebuilt from its configuration."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

STAMP = 1 << 62


def test_records_come_back_from_the_chrome_trace(tmp_path):
    import sim_check
    from wxfer.runtime.trace import write_chrome

    t = 5_000_000
    keys = ("t_submit", "t_admit", "t_ready", "t_post_first", "t_post_last", "t_done", "bytes", "held")
    rows = [  # tag, then the times after t (ns), bytes, held
        (STAMP, 0, 1000, 2000, 3000, 3500, 9000, 8, 8),
        (0, 4000, 4100, 5000, 9100, 9800, 20000, 4096, 0),
        (1, 8000, 6000, 9000, 9900, 9950, 21000, 64, 64),  # reserved before it was prepared: admitted first
        (STAMP, 21000, 21100, 30000, 30100, 30200, 31000, 8, 8),
    ]
    recs = [dict(zip(keys, [t + x for x in ts] + [nb, held]), tag=tag, status=0) for tag, *ts, nb, held in rows]
    p = tmp_path / "trace.json"
    write_chrome(recs, str(p))
    got = sim_check.chrome_records(str(p), {0: 3})
    assert [r["tag"] for r in got] == [STAMP, 0, 1, STAMP]  # the end stamps a record of their own
    for a, b in zip(recs, got):
        assert {k: b[k] - (sim_check.BASE_NS - t if k.startswith("t_") else 0) for k in keys} == {k: a[k] for k in keys}
    assert got[1]["nwrites"] == 3 and got[2]["nwrites"] == 1


def test_a_rows_plan_is_the_senders():
    import sim_check

    # the counts the H200 Senders reported for these rows (2026-12-01): tasks and zero copy
    plan, train = sim_check.row_plan(dict(model="qwen3-8b", quant="fp8", layout="colocated", trainer="plain"), 2 << 30)
    assert len(plan.tasks) == 183
    plan, _ = sim_check.row_plan(dict(model="qwen3-8b", quant="fp8", layout="colocated", trainer="plain"), 256 << 20)
    assert len(plan.tasks) == 255


def test_a_row_whose_simulation_failed_takes_its_link_rate_and_the_kernels_given():
    import sim_check
    from wxfer.plan.calibrate import get

    # as the 11:58 UTC H200 run recorded its 8B FP8 row (hostfit raised on the copy tasks)
    w = dict(tasks=183, zero_copy_tasks=147, direct=dict(tasks=36, copies=145, enabled=True), simulated_error="x")
    assert sim_check._reported(w) == {"zero_copy": 2, "copy": 145, "direct": 36}
    res = dict(config=dict(layout="colocated", trainer="fsdp2"), methods=dict(link=dict(gbps=2091.0)))
    rec, src = sim_check._rates(res, w, get("h200-kernels"))
    assert rec["write_GBps"] == 2091.0 and rec["device_shared"] and rec["quant_GBps"] == get("h200-kernels").quant_GBps
    assert "not recorded" in src
    assert sim_check._rates(res, w, None) == (None, None)  # no kernels: the row is left out
    # the kernels the run measured before its simulation failed are preferred
    w["simulated_rates"] = dict(quant_GBps=3000.0, copy_GBps=3500.0, pack_launch_s=5e-6, quantizer="x (native)")
    rec, src = sim_check._rates(res, w, get("h200-kernels"))
    assert rec["quant_GBps"] == 3000.0 and rec["launch_per_piece"] is False and src == "kernels: recorded"


def test_calibration_file_alone_predicts_a_row_and_names_what_it_lacks(tmp_path, capsys):
    """--calibration FILE: the row's plan and kinds from its configuration, the figures from the
    file only (the row's recorded fit and timings are not read: changing them changes nothing)."""
    import json

    import sim_check
    from wxfer.meta import Calibration
    from wxfer.plan.calibrate import save

    cal = Calibration(
        name="given",
        host_zc_task_s=50e-6,
        host_task_s=100e-6,
        write_GBps=1.0,
        copy_GBps=10.0,
        quant_GBps=1.0,
        host_sync=True,
        cpu_shared=True,
    )
    path = tmp_path / "cal.json"
    save(cal, str(path), extra=dict(measured=dict(placement="host")))
    row = dict(seconds=0.5, direct=dict(enabled=False), simulated_calibration=dict(host_zc_task_s=1.0))
    res = [
        dict(config=dict(model="tiny", quant=q, layout="disagg", trainer="plain"), wxfer_by_watermark={"1024": row})
        for q in ("bf16", "fp8")
    ]
    rj = tmp_path / "results.json"
    rj.write_text(json.dumps(dict(results=res, dry_run=True)))
    sim_check.main(["--json", "--calibration", str(path), str(rj)])
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["config"] for r in rows] == ["tiny-bf16-disagg", "tiny-fp8-disagg"]
    bf16 = rows[0]
    assert bf16["kinds"] == {"zero_copy": bf16["terms"]["zero_copy_tasks"]}  # BF16 TP1: every task zero copy
    # the host: every zero-copy task at the file's 50 us, one after the other
    assert bf16["simulated_s"] >= bf16["terms"]["zero_copy_tasks"] * 50e-6
    assert bf16["ratio"] == bf16["simulated_s"] / 0.5
    # a file that marks a term this row needs unmeasured: that row is an error naming it
    save(Calibration(**dict(cal.__dict__, unmeasured={"quant_GBps": "no quantizer here"})), str(path))
    assert sim_check.main(["--json", "--calibration", str(path), str(rj)]) == 1
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert "error" not in rows[0] and "quant_GBps" in rows[1]["error"] and "no quantizer here" in rows[1]["error"]
    # --assume gives it a value by name: the row is predicted, the assumption listed with it
    sim_check.main(["--json", "--calibration", str(path), "--assume", "quant_GBps=1.0", str(rj)])
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert rows[1]["assumptions"]["quant_GBps"] == "quant_GBps = 1.0 assumed: given by --assume"
