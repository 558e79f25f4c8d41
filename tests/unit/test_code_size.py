"""Size limits of the runtime's source: no function over 80 lines, no module
over 450, in ``radixrt/``, ``kernels/`` and ``frontend/``.

A function's length runs from its ``def`` line to its last line (decorators
excluded; a nested function counts inside its enclosing one and again on its
own). A module's length is its number of lines. There is no exceptions list:
the test lists every offender with its length.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("radixrt", "kernels", "frontend")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450


def _modules() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return out


def test_the_walk_sees_the_tree() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"radixrt/scheduler/scheduler.py", "kernels/base.py", "frontend/api.py"} <= names


def test_no_function_over_80_lines() -> None:
    offenders = [o for path in _modules() for o in _long_functions(path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_no_module_over_450_lines() -> None:
    offenders = []
    for path in _modules():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)
