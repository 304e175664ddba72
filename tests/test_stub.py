"""wxfer/_wxfer.pyi names exactly the public attributes of the extension wxfer._wxfer, and
of each of its types the public methods and properties (a function added in C without its
stub, or a stub left after a removal, fails here), and each one's parameters as its C
docstring's signature line names them (the extension's functions carry no
__text_signature__: their docstrings start with "name(params)", or they take none)."""

import ast
import pathlib
import re

from wxfer import _wxfer

STUB = pathlib.Path(__file__).resolve().parent.parent / "wxfer" / "_wxfer.pyi"
# members every exception has (from BaseException/OSError), not the extension's own
_INHERITED = set(dir(OSError))
# in builds made with WXFER_KERNEL_SWEEP=1 only (_wxfer.KERNEL_SWEEP; csrc/prepare/wx_sweep.h)
_SWEEP_ONLY = {"kernel_sweep"}


def _public(names) -> set:
    return {n for n in names if not n.startswith("_")}


def _stub():
    tree = ast.parse(STUB.read_text())
    top, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, ast.Assign):
            top.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            members = set()
            for b in node.body:
                if isinstance(b, ast.FunctionDef):
                    members.add(b.name)
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    members.add(b.target.id)
            classes[node.name] = _public(members)
    return _public(top), classes


def test_the_stub_names_exactly_the_public_module_attributes():
    top, _ = _stub()
    real = _public(dir(_wxfer))
    assert (real & _SWEEP_ONLY == _SWEEP_ONLY) == bool(_wxfer.KERNEL_SWEEP)
    real |= _SWEEP_ONLY
    assert top == real, f"in the extension only: {sorted(real - top)}; in the stub only: {sorted(top - real)}"


def test_the_stub_names_each_types_members():
    _, classes = _stub()
    for name, members in classes.items():
        cls = getattr(_wxfer, name)
        assert isinstance(cls, type), name
        # an exception: the fields set on the class itself (task, tag, ...), not what OSError has
        real = _public(vars(cls)) - _INHERITED if issubclass(cls, BaseException) else _public(dir(cls))
        assert members == real, f"{name}: in C only: {sorted(real - members)}; stub only: {sorted(members - real)}"


def test_the_stub_parses_as_python_and_marks_the_package_typed():
    compile(STUB.read_text(), str(STUB), "exec")
    assert (STUB.parent / "py.typed").is_file()


_SIG = re.compile(r"^\s*(\w+)\(([^)]*)\)")


def _params_of_doc(doc, name):
    """The parameter names of a docstring's leading "name(a, b=1, *, c=2)", or None."""
    m = _SIG.match(doc or "")
    if not m or m.group(1) != name:
        return None
    parts = [p.strip() for p in m.group(2).split(",")]
    return [re.split(r"[=:\s]", p.lstrip("*"))[0] for p in parts if p and p not in ("/", "*")]


def _params_of_stub(fn):
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg != "self"]


def _stub_functions():
    """(qualified name, the stub's def, the extension's object, the name its doc gives)."""
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            if hasattr(_wxfer, node.name):  # kernel_sweep: sweep builds only
                yield node.name, node, getattr(_wxfer, node.name), node.name
        elif isinstance(node, ast.ClassDef):
            cls = getattr(_wxfer, node.name)
            for b in node.body:
                if isinstance(b, ast.FunctionDef) and not b.decorator_list and not b.name.startswith("__"):
                    yield f"{node.name}.{b.name}", b, getattr(cls, b.name), b.name
                elif isinstance(b, ast.FunctionDef) and b.name == "__init__":
                    yield f"{node.name}()", b, cls, node.name


def test_the_stub_signatures_match_the_docstrings():
    checked, wrong = 0, []
    for qual, fn, obj, name in _stub_functions():
        doc = _params_of_doc(obj.__doc__, name)
        stub = _params_of_stub(fn)
        if doc is None:  # no signature line: a METH_NOARGS function
            if stub:
                wrong.append(f"{qual}: the stub takes {stub}; its docstring gives no signature")
            continue
        checked += 1
        if doc != stub:
            wrong.append(f"{qual}: docstring {doc}, stub {stub}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 30, checked  # the scan sees the module's functions and the types' methods
