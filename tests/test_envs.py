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


def test_get_reads_declared_names_only(monkeypatch):
    monkeypatch.setenv("WXFER_TRANSPORT", "fabric")
    assert envs.get("WXFER_TRANSPORT", "auto") == "fabric"
    monkeypatch.delenv("WXFER_TRANSPORT")
    assert envs.get("WXFER_TRANSPORT", "auto") == "auto"
    assert envs.get("WXFER_SECRET") is None or "WXFER_SECRET" in os.environ
    with pytest.raises(KeyError, match="WXFER_NOT_A_VARIABLE"):
        envs.get("WXFER_NOT_A_VARIABLE")
