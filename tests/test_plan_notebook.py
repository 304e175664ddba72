"""The example notebook runs from top to bottom (so it cannot rot)."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # make test-slow (CI runs it after make test)
@pytest.mark.timeout(300)
def test_kimi_k2_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    # a kernelspec pointing at this interpreter, so the kernel sees the same venv
    kdir = tmp_path / "kernels" / "wxfer-test"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "wxfer test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(ROOT / "examples" / "kimi_k2_plan.ipynb", as_version=4)
    NotebookClient(nb, kernel_name="wxfer-test", timeout=240, resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outs)
    assert "simulated" in text and "lower bound" in text
    html = "".join(o.get("data", {}).get("text/html", "") for o in outs)
    assert "wxfer plan" in html  # plan._repr_html_ rendered
    assert sum("image/png" in o.get("data", {}) for o in outs) >= 4  # bytes, utilisation, timeline, busy
