"""wxfer/envs.py declares every WXFER_* variable the package reads, and README's table is its."""

import os
import pathlib
import re

import pytest

from wxfer import envs

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bWXFER_[A-Z0-9_]*[A-Z0-9]\b")


def _sources():
    yield ROOT / "setup.py"
    yield from (ROOT / "wxfer").rglob("*.py")
    for p in (ROOT / "csrc").rglob("*"):
        if (
            p.is_file()
            and "testing" not in p.relative_to(ROOT / "csrc").parts[:1]
            and p.suffix
            in (
                ".c",
                ".h",
                ".cu",
                ".def",
                ".py",
            )
        ):
            yield p


def _names() -> dict:
    out: dict = {}
    for p in _sources():
        for n in NAME.findall(p.read_text(errors="replace")):
            out.setdefault(n, str(p.relative_to(ROOT)))
    return out


def test_every_variable_in_the_source_is_declared():
    found = _names()
    assert "WXFER_FABRIC_IFACE" in found and "WXFER_IFACE" in found  # the scan sees C and Python
    missing = {n: where for n, where in found.items() if n not in envs.VARS}
    assert not missing, f"declare these in wxfer/envs.py (name: first file): {missing}"


def test_every_declared_variable_is_read_somewhere():
    found = _names()
    stale = sorted(n for n in envs.VARS if n not in found)
    assert not stale, f"declared in wxfer/envs.py but in no source: {stale}"


def test_declarations_are_complete():
    for v in envs.VARS.values():
        assert v.type in ("flag", "str", "int", "float", "size", "path", "choice", "list"), v
        assert v.default and v.doc and v.read_by, v
        assert v.when in ("run", "build", "run, build", "test build"), v


def test_readme_table_is_generated_from_envs():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- envs:begin -->\n(.*?)<!-- envs:end -->", text, re.S)
    assert m, "README.md lacks the <!-- envs:begin/end --> table"
    assert m.group(1) == envs.markdown_table(), "README's table differs: paste `python -m wxfer.envs`"
    listed = set(re.findall(r"^\| `(WXFER_[A-Z0-9_]+)`", m.group(1), re.M))
    assert listed == set(envs.VARS)


GETENV = re.compile(r"\b(?:secure_)?getenv\s*\(")


def test_csrc_reads_the_environment_through_its_table_only():
    """No getenv() in csrc/ but in csrc/core/wx_param.c (the verbs emulation, csrc/testing/, is
    a separate library with its own WXEMU_* knobs)."""
    calls = {
        str(p.relative_to(ROOT)): len(GETENV.findall(p.read_text(errors="replace")))
        for p in _sources()
        if p.suffix in (".c", ".h") and GETENV.search(p.read_text(errors="replace"))
    }
    assert calls == {"csrc/core/wx_param.c": 1}, f"read these through wx_param.h instead: {calls}"


def test_c_table_and_envs_agree():
    """Every WXFER_* variable of the C table is declared in envs.py as read by C, with the
    table's type, default and doc, and every variable envs.py says C reads is in the table."""
    from wxfer import _wxfer

    table = {p["name"]: p for p in _wxfer.params()}
    assert "WXFER_IFACE" in table and table["WXFER_FABRIC_PROVIDER"]["default"] == "tcp"
    ours = {n: p for n, p in table.items() if n.startswith("WXFER_")}
    for name, p in ours.items():
        v = envs.VARS.get(name)
        assert v is not None and v.read_by.split(", ")[0] == "C", (name, v)
        assert (v.type, v.default, v.doc) == (p["type"], p["default"], p["doc"]), (v, p)
    said_c = {n for n, v in envs.VARS.items() if "C" in v.read_by.split(", ")}
    assert said_c == set(ours), said_c ^ set(ours)
    for p in table.values():
        assert p["type"] in ("flag", "str", "path", "list") and p["doc"] and p["when"] in ("run", "test build"), p


def test_c_table_reads_the_environment_as_set(monkeypatch):
    """params() shows each variable's value now (None when unset): it is read where used, so a
    change in this process is seen (the fabric defaults are read at each open)."""
    from wxfer import _wxfer

    monkeypatch.setenv("WXFER_IFACE", "eth7")
    monkeypatch.delenv("WXFER_LIBNVRTC", raising=False)
    now = {p["name"]: p["value"] for p in _wxfer.params()}
    assert now["WXFER_IFACE"] == "eth7" and now["WXFER_LIBNVRTC"] is None
    assert envs.values()["WXFER_IFACE"] == "eth7"


def test_get_reads_declared_names_only(monkeypatch):
    monkeypatch.setenv("WXFER_TRANSPORT", "fabric")
    assert envs.get("WXFER_TRANSPORT", "auto") == "fabric"
    monkeypatch.delenv("WXFER_TRANSPORT")
    assert envs.get("WXFER_TRANSPORT", "auto") == "auto"
    assert envs.get("WXFER_SECRET") is None or "WXFER_SECRET" in os.environ
    with pytest.raises(KeyError, match="WXFER_NOT_A_VARIABLE"):
        envs.get("WXFER_NOT_A_VARIABLE")
