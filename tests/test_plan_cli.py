"""`python -m wxfer plan` / wxfer.plan.cli.main."""

import json
import subprocess
import sys

from wxfer.plan import Plan
from wxfer.plan.cli import main

KEYS = {
    "params",
    "bytes_per_replica",
    "max_bytes_per_infer_gpu",
    "max_bytes_per_train_gpu",
    "lower_bound_s",
    "simulated_s",
    "build_s",
    "transfers",
}


def test_json_last_line(capsys, tmp_path):
    out = tmp_path / "plan.bin"
    rc = main(
        [
            "--preset",
            "qwen3-30b-a3b",
            "--train-gpus",
            "16",
            "--infer-gpus",
            "8",
            "--infer-tp",
            "4",
            "--nic-gbps",
            "400",
            "--json",
            "--out",
            str(out),
            "--steps",
            "300",
        ]
    )
    assert rc == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(d)
    assert d["infer_ep"] is True and d["quant"] == "fp8"
    assert d["simulated_s"] >= d["lower_bound_s"] > 0
    assert d["max_bytes_per_infer_gpu"] * 4 >= d["bytes_per_replica"]
    plan = Plan.from_bytes(out.read_bytes())
    assert plan.n_transfers == d["transfers"] and plan.check() == []


def test_refusal_names_the_parameter(capsys):
    rc = main(["--preset", "qwen3-235b", "--train-gpus", "8", "--infer-tp", "8", "--no-infer-ep", "--no-sim"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "mlp.experts.0.gate_proj.weight" in err and "128" in err


def test_python_dash_m_entry_point():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "wxfer.plan.cli",
            "--preset",
            "qwen3-tiny",
            "--train-gpus",
            "2",
            "--infer-gpus",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout.strip().splitlines()[-1])
    assert d["infer_gpus"] == 4 and d["transfers"] > 0 and KEYS <= set(d)


def test_plan_modules_import_light():
    """No torch, pandas, matplotlib or native extension just to build a plan."""
    code = (
        "import sys, wxfer.plan, wxfer.plan.simulate, wxfer.meta, wxfer.mapping, wxfer.plan.cli\n"
        "from wxfer.meta import Cluster\n"
        "from wxfer.plan import plan_for\n"
        "p = plan_for('qwen3-8b', Cluster(train_gpus=8, infer_gpus=4, infer_tp=2))\n"
        "p.simulate(Cluster(train_gpus=8, infer_gpus=4, infer_tp=2)); p.summary(); p._repr_html_()\n"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'wxfer._wxfer') if m in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_hf_config_file_instead_of_a_preset(tmp_path, capsys):
    from wxfer.mapping.presets import QWEN3_TINY

    cfg = dict(QWEN3_TINY, num_hidden_layers=3, model_type="qwen3")
    del cfg["architectures"]  # found through model_type
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert (
        main(
            [
                "--config",
                str(path),
                "--train-gpus",
                "4",
                "--infer-tp",
                "2",
                "--infer-gpus",
                "2",
                "--json",
                "--steps",
                "200",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["preset"] == "config.json" and d["tasks"] == 1 + 3  # the root unit (embed, norm); one task per layer


def test_calibration_by_name_and_file(capsys, tmp_path):
    from wxfer.meta import Calibration
    from wxfer.plan.calibrate import save

    args = [
        "--preset",
        "qwen3-8b",
        "--train-gpus",
        "8",
        "--infer-gpus",
        "4",
        "--infer-tp",
        "2",
        "--json",
        "--steps",
        "300",
    ]
    out = {}
    for name in ("free-stage2", "h200"):
        assert main(args + ["--calibration", name]) == 0
        out[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["free-stage2"]["calibration"] == "free-stage2" and out["h200"]["calibration"] == "h200"
    assert out["h200"]["simulated_s"] > out["free-stage2"]["simulated_s"]
    f = tmp_path / "slow.json"
    save(Calibration(name="slowhost", host_param_s=0.1), str(f))
    assert main(args + ["--calibration", str(f)]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["calibration"] == "slowhost" and d["bound_by"] == "host" and d["simulated_s"] > 1.0
    assert main(args + ["--calibration", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_a_term_the_calibration_lacks_is_refused_by_name_or_assumed(capsys, tmp_path):
    """--calibration FILE with a term named unmeasured: exit 2 naming it; --assume TERM=VALUE
    gives it a value, listed under "assumptions" in the output."""
    from wxfer.meta import Calibration
    from wxfer.plan.calibrate import save

    cal = Calibration(name="given", host_param_s=None, unmeasured={"host_param_s": "no packed task here"})
    path = tmp_path / "cal.json"
    save(cal, str(path))
    args = ["--preset", "qwen3-tiny", "--train-gpus", "2", "--infer-gpus", "2", "--infer-tp", "2"]
    args += ["--dense-shard", "2", "--gpus-per-node", "2", "--quant", "bf16", "--calibration", str(path), "--json"]
    assert main(args + ["--steps", "200"]) == 2
    err = capsys.readouterr().err
    assert "host_param_s (charged by packed task" in err and "no packed task here" in err and "--assume" in err
    assert main(args + ["--steps", "200", "--assume", "host_param_s=1e-4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["assumptions"]["host_param_s"] == "host_param_s = 0.0001 assumed: given by --assume"
    assert main(args + ["--assume", "host_param_s=fast"]) == 2
    assert "--assume 'host_param_s=fast'" in capsys.readouterr().err
