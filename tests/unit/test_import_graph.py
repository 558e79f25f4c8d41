"""No import cycles inside the frontend package or the HTTP server package.

The graph is built from the source with ``ast``: an edge ``a -> b`` for every
import in module ``a`` of a module ``b`` of the same package, wherever the
import statement sits (module level or inside a function, so a cycle hidden
behind a function-level import counts). Imports under ``if TYPE_CHECKING:``
are left out: they never run.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (folder, the package it is imported as)
PACKAGES = [
    (ROOT / "frontend", "radixrt.frontend"),
    (ROOT / "radixrt" / "server", "radixrt.server"),
]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imported_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` statement in ``package`` reads from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports_of(path: Path, package: str, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = _imported_base(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    out.add(sub)  # from pkg import module
                elif base in modules:
                    out.add(base)  # from pkg.module import name
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
    return out


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for the ``*.py``
    files directly in ``folder`` (``__init__.py`` is ``package`` itself)."""
    files = {(package if p.stem == "__init__" else f"{package}.{p.stem}"): p for p in folder.glob("*.py")}
    names = set(files)
    return {m: _imports_of(p, package, names) - {m} for m, p in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each a
    cycle or a knot of cycles), plus modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("folder,package", PACKAGES, ids=[p for _, p in PACKAGES])
def test_package_has_no_import_cycle(folder, package):
    graph = import_graph(folder, package)
    assert len(graph) > 3, f"no modules found in {folder}"
    assert find_cycles(graph) == []


def test_checker_sees_cycles_hidden_in_functions_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\n\nclass A:\n    pass\n")
    (pkg / "b.py").write_text("class B:\n    def f(self):\n        from .a import A\n        return A\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "d.py").write_text("import pkg.c\nfrom pkg import c as _c\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": set(),
                     "pkg.d": {"pkg.c"}}
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_every_package_is_listed_for_installation():
    """pyproject.toml names its packages one by one: a new subpackage left out
    would be missing from a wheel (an editable install hides it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "radixrt").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
