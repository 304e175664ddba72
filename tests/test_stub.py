"""wxfer/_wxfer.pyi names exactly the public attributes of the extension wxfer._wxfer, and
of each of its types the public methods and properties (a function added in C without its
stub, or a stub left after a removal, fails here)."""

import ast
import pathlib

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
