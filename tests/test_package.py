"""The package as shipped: every module imports (a subpackage missing from the wheel shows
here), and the version is defined once.  Run from the installed wheel (`make test` runs it
so, see .ci/installed.sh), WXFER_INSTALLED=<checkout> also asserts that the wxfer imported
is the installed one, not the checkout."""

import importlib
import os
import pkgutil
import sys

import wxfer

# every module of the source tree; the installed package must hold the same
MODULES = sorted(
    [
        "wxfer",
        "wxfer.__main__",
        "wxfer.envs",
        "wxfer.meta",
        "wxfer.testing",
        *("wxfer.integrations." + m for m in ("vllm",)),
        *("wxfer.integrations.vllm." + m for m in ("cpu", "engine", "extension", "layout", "proof", "trainer")),
        *("wxfer.mapping." + m for m in ("presets", "reference", "rules")),
        *("wxfer.models." + m for m in ("infer", "train")),
        *("wxfer.plan." + m for m in ("check", "cli", "core", "notebook", "reference", "serialize", "simulate")),
        *("wxfer.runtime." + m for m in ("control", "prepare", "program", "receiver", "sender", "trace", "verify")),
        *("wxfer.tools." + m for m in ("demo", "demo_ranks", "doctor", "gpuprobe", "selftest", "selftest_verbs")),
        "wxfer.integrations",
        "wxfer.mapping",
        "wxfer.models",
        "wxfer.plan",
        "wxfer.runtime",
        "wxfer.tools",
    ]
)


def _found():
    out = {"wxfer"}
    for m in pkgutil.walk_packages(wxfer.__path__, "wxfer."):
        if m.name != "wxfer._wxfer":
            out.add(m.name)
    return out


def test_every_module_is_there_and_imports():
    found = _found()
    missing = sorted(set(MODULES) - found)
    assert not missing, f"modules missing from {os.path.dirname(wxfer.__file__)}: {missing}"
    for name in sorted(found):
        importlib.import_module(name)
    from wxfer import _wxfer, Receiver, Sender  # noqa: F401  -- the extension and the entry points

    assert callable(Sender) and callable(Receiver)


def test_version_defined_once():
    from importlib import metadata

    v = wxfer.__version__
    assert v and v[0].isdigit()
    try:
        assert metadata.version("wxfer") == v  # installed: the wheel's metadata is the same string
    except metadata.PackageNotFoundError:
        pass  # the checkout, not installed


def test_installed_package_not_the_checkout():
    checkout = os.environ.get("WXFER_INSTALLED")
    if not checkout:
        import pytest

        pytest.skip("runs from the installed wheel only (WXFER_INSTALLED=<checkout>, see .ci/installed.sh)")
    here = os.path.realpath(wxfer.__file__)
    assert os.sep + "site-packages" + os.sep in here, here
    co = os.path.realpath(checkout)
    assert not here.startswith(co + os.sep), (here, co)
    on_path = [p for p in sys.path if p and os.path.realpath(p) == co]
    assert not on_path, f"the checkout {co} is on sys.path"
    assert os.path.realpath(os.getcwd()) != co and not os.path.realpath(os.getcwd()).startswith(co + os.sep)


def test_the_type_information_ships():
    """PEP 561: py.typed and the extension's stub lie next to the package (in the wheel too)."""
    here = os.path.dirname(wxfer.__file__)
    for f in ("py.typed", "_wxfer.pyi"):
        assert os.path.isfile(os.path.join(here, f)), f"{f} missing from {here}"
