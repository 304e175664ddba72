"""The size rule of the product code: no file over 800 lines, no function over 80.

`python .ci/sizes.py` (run by `make lint`) walks the product code, wxfer/ and csrc/ but
csrc/testing/ (the tests' libibverbs emulation, built by the tests and never shipped), Python
by its syntax tree, C, CUDA and headers by their top-level braces (as clang-format lays them
out: a definition's `{` and `}` alone at column 0), and prints every file or function over
its limit. It fails on any that ALLOWED does not name, and on an ALLOWED entry that is no
longer over (so the list shrinks as the splits land).
"""

from __future__ import annotations

import ast
import os
import re
import sys

ROOTS = ("wxfer", "csrc")
NOT_PRODUCT = ("csrc/testing",)
MAX_FILE = 800
MAX_FUNC = 80

# Over the limit today and being split elsewhere: name -> who.
ALLOWED: dict = {}

_C_DEF = re.compile(r"^(?:[A-Za-z_][^(;=]*[\s*])?([A-Za-z_]\w*)\s*\(")


def py_functions(path: str, text: str):
    """[(qualified name, lines)] of every def in a Python file (methods as Class.name)."""
    out = []

    def walk(node, prefix):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + n.name, n.end_lineno - n.lineno + 1))
                walk(n, prefix + n.name + ".")
            elif isinstance(n, ast.ClassDef):
                walk(n, prefix + n.name + ".")

    walk(ast.parse(text, path), "")
    return out


def c_functions(lines: list[str]):
    """[(name, lines)] of every C function definition: from the line naming it to its `}` at
    column 0 (the signature is the last line before the `{` that starts at column 0 with a
    name and a parenthesis)."""
    out, name, start = [], None, None
    for i, line in enumerate(lines):
        if line.startswith("{") and name is None:
            for j in range(i - 1, max(i - 8, -1), -1):
                m = _C_DEF.match(lines[j])
                if m and not lines[j].startswith(("typedef", "struct", "enum", "union")):
                    name, start = m.group(1), j
                    break
            else:
                name, start = "?", i  # a brace block that is not a function (an initializer)
        elif line.startswith("}") and name is not None:
            if name != "?":
                out.append((name, i - start + 1))
            name = None
    return out


def over(root_dir: str = "."):
    """[(name, lines, limit)] of every file and function over its limit under ROOTS."""
    found = []
    for root in ROOTS:
        for dp, dns, fns in os.walk(os.path.join(root_dir, root)):
            dns[:] = sorted(
                d
                for d in dns
                if d != "__pycache__" and os.path.relpath(os.path.join(dp, d), root_dir) not in NOT_PRODUCT
            )
            for f in sorted(fns):
                if not f.endswith((".py", ".c", ".h", ".cu")):
                    continue
                path = os.path.join(dp, f)
                rel = os.path.relpath(path, root_dir)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                lines = text.splitlines()
                if len(lines) > MAX_FILE:
                    found.append((rel, len(lines), MAX_FILE))
                funcs = py_functions(path, text) if f.endswith(".py") else c_functions(lines)
                found += [(f"{rel}:{n}", k, MAX_FUNC) for n, k in funcs if k > MAX_FUNC]
    return found


def main(argv=None) -> int:
    root_dir = (argv or sys.argv[1:] or ["."])[0]
    found = over(root_dir)
    bad = [(n, k, lim) for n, k, lim in found if n not in ALLOWED]
    for n, k, lim in found:
        note = f"  (allowed: {ALLOWED[n]})" if n in ALLOWED else ""
        print(f"sizes: {n}: {k} lines, over {lim}{note}")
    names = {n for n, _, _ in found}
    stale = sorted(set(ALLOWED) - names)
    for n in stale:
        print(f"sizes: {n} is in .ci/sizes.py's ALLOWED but no longer over its limit: take it out")
    if bad or stale:
        print(f"sizes: {len(bad)} over the limits (files {MAX_FILE} lines, functions {MAX_FUNC})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
