"""How much of each lib module a student reads is validation, and how long each module is.

    python tools/measure_lib.py                 # every module of lib outside lib.course
    python tools/measure_lib.py attention scan  # some of them

Code lines are the module's lines that are neither blank, nor comments, nor docstrings.
Validation lines are the code lines of functions named `_check*`, `check_*` or `require_*`, of
`if checking():` blocks, of declared contracts (`door(...)`, `.plus(...)`, as decorators or
assigned, and the module constants they read, such as a long message) and of `raise` statements
elsewhere (their whole statement). A maintainer's
measure, not a test: it prints a table.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "lib"


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _span(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))


def _is_checking_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Call)
        and getattr(test.func, "id", getattr(test.func, "attr", None)) == "checking"
    )


def _is_declaration(node: ast.AST) -> bool:
    """A declared contract: `door(...)` or `<contract>.plus(...)`, as a decorator or assigned."""
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("door", "plus")


def measure(path: Path) -> dict:
    source = path.read_text()
    tree = ast.parse(source)
    text = source.splitlines()
    docs = _docstring_lines(tree)
    code = {i for i, line in enumerate(text, 1) if line.strip() and not line.strip().startswith("#") and i not in docs}
    validation: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            node.name.startswith(("_check", "check_", "require_"))
        ):
            validation |= _span(node)
        elif _is_checking_guard(node) or isinstance(node, ast.Raise) or _is_declaration(node):
            validation |= _span(node)
    # the module's constants that only a declaration reads (a long message, a shared rule's text)
    declared = {
        n.id for node in ast.walk(tree) if _is_declaration(node) for n in ast.walk(node) if isinstance(n, ast.Name)
    }
    for node in tree.body:
        if isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} <= declared:
            if not _is_declaration(node.value):
                validation |= _span(node)
    validation &= code
    return {"lines": len(text), "code": len(code), "validation": len(validation)}


def main(argv: list[str]) -> None:
    names = argv or sorted(
        str(p.relative_to(LIB).with_suffix("")).replace("/", ".")
        for p in LIB.rglob("*.py")
        if "course" not in p.relative_to(LIB).parts and p.name != "__init__.py"
    )
    print("| module | lines | code lines | validation | share |\n|---|---:|---:|---:|---:|")
    for name in names:
        m = measure(LIB / (name.replace(".", "/") + ".py"))
        share = m["validation"] / m["code"] if m["code"] else 0.0
        print(f"| {name} | {m['lines']} | {m['code']} | {m['validation']} | {share:.0%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
