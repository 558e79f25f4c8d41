"""The import layers of docs/architecture.md, checked on the whole source tree.

The ```layers block of docs/architecture.md names every part of the tree (a
package folder such as ``radixrt/server/``, a top-level module such as
``radixrt/cli.py``, and ``**/__main__.py`` for the ``python -m`` programs),
one layer per line, top to bottom. A module may import the modules of its own
part and those of parts on lower lines: nothing on its own line (parts side
by side are independent) and nothing above. Inside a part, modules import
each other without cycles.

The graph is built from the source with ``ast``: an edge ``a -> b`` for every
import in module ``a`` of a module ``b`` of the tree, wherever the import
statement sits: at module level, inside a function (a cycle hidden behind a
function-level import still counts) and under ``if TYPE_CHECKING:`` (a
type-only import is still a dependency of the code that names the type).
Importing ``pkg.mod`` runs ``pkg/__init__.py`` too; those implicit edges are
not counted.

There is no exceptions list and no known violation: a new import that breaks
the order, or closes a cycle, fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# folders of the tree and the package each is imported as
TOP_FOLDERS = {"radixrt": "radixrt", "frontend": "radixrt.frontend", "kernels": "radixrt.kernels"}
MAIN = "**/__main__.py"


# ----------------------------------------------------------------------------- the declaration
def declared_layers(text: str) -> list[list[str]]:
    """The parts of each line of the first ```layers block of ``text``, top
    line first (``#`` starts a comment)."""
    match = re.search(r"^```layers\n(.*?)^```", text, re.M | re.S)
    assert match, "docs/architecture.md has no ```layers block"
    layers = [line.split("#", 1)[0].split() for line in match.group(1).splitlines()]
    return [parts for parts in layers if parts]


def part_of(rel_path: str, parts: list[str]) -> str | None:
    """The declared part a file (path relative to the root) belongs to: the
    programs' part for a ``__main__.py``, else the exact file, else the
    deepest folder holding it."""
    if rel_path.endswith("/__main__.py") and MAIN in parts:
        return MAIN
    if rel_path in parts:
        return rel_path
    folders = [p for p in parts if p.endswith("/") and rel_path.startswith(p)]
    return max(folders, key=len) if folders else None


# ----------------------------------------------------------------------------- the graph
def module_files(root: Path, top_folders: dict[str, str]) -> dict[str, Path]:
    """``{module name: file}`` for every ``*.py`` under the top folders."""
    files: dict[str, Path] = {}
    for folder, package in top_folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            files[".".join((package, *rel))] = path
    return files


def _imported_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` statement in ``package`` reads from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known_prefix(name: str, modules: set[str]) -> str | None:
    """The module ``name`` lies in: itself, or the longest module it starts with."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``module`` (the file ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _imported_base(node, package)
            for alias in node.names:
                # from pkg import module, or from pkg.module import name
                target = _known_prefix(f"{base}.{alias.name}", modules)
                if target:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(t for alias in node.names if (t := _known_prefix(alias.name, modules)))
    return out - {module}


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the modules of ``files`` it imports}``."""
    names = set(files)
    return {m: imports_of(p, m, names) for m, p in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each a
    cycle or a knot of cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ----------------------------------------------------------------------------- the checks
class Tree:
    """The tree's modules, their parts and layers, and the import graph."""

    def __init__(self, root: Path, top_folders: dict[str, str], declaration: str) -> None:
        self.layers = declared_layers(declaration)
        parts = [p for layer in self.layers for p in layer]
        self.level = {p: i for i, layer in enumerate(self.layers) for p in layer}
        self.files = module_files(root, top_folders)
        self.rel = {m: p.relative_to(root).as_posix() for m, p in self.files.items()}
        self.part = {m: part_of(rel, parts) for m, rel in self.rel.items()}
        self.graph = import_graph(self.files)
        self.duplicates = sorted({p for p in parts if parts.count(p) > 1})
        self.missing_parts = sorted(p for p in parts if p != MAIN and not (root / p).exists())

    def undeclared(self) -> list[str]:
        return sorted(rel for m, rel in self.rel.items() if self.part[m] is None)

    def layer_violations(self) -> set[tuple[str, str, str]]:
        """``(importer, imported, part of the importer)`` for each import of a
        module on the importer's own line or above."""
        out = set()
        for a, targets in self.graph.items():
            for b in targets:
                pa, pb = self.part[a], self.part[b]
                if pa is None or pb is None or pa == pb:
                    continue
                if self.level[pb] <= self.level[pa]:
                    out.add((a, b, pa))
        return out

    def part_graph(self, part: str) -> dict[str, set[str]]:
        """The import graph between the modules of one part."""
        members = {m for m, p in self.part.items() if p == part}
        return {m: self.graph[m] & members for m in members}


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(ROOT, TOP_FOLDERS, ARCHITECTURE.read_text())


def test_every_module_is_in_a_declared_part_and_every_part_exists(tree):
    assert tree.undeclared() == [], "add these to the ```layers block of docs/architecture.md"
    assert tree.missing_parts == [], "the ```layers block names parts that are not in the tree"
    assert tree.duplicates == [], "a part is declared twice"
    declared = {p for layer in tree.layers for p in layer}
    assert declared == set(tree.part.values()), "a declared part holds no module"
    assert len(tree.files) > 100


def test_every_import_points_to_a_lower_layer(tree):
    unexpected = sorted(f"{a} -> {b}" for a, b, _ in tree.layer_violations())
    assert unexpected == [], (
        f"imports of a part on the same line or above (docs/architecture.md, ```layers): {unexpected}"
    )


@pytest.mark.parametrize("part", sorted(p for layer in declared_layers(ARCHITECTURE.read_text()) for p in layer))
def test_no_import_cycle_inside_a_part(tree, part):
    assert find_cycles(tree.part_graph(part)) == []


# ----------------------------------------------------------------------------- the checker itself
def test_checker_sees_cycles_hidden_in_functions_and_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\n\nclass A:\n    pass\n")
    (pkg / "b.py").write_text("class B:\n    def f(self):\n        from .a import A\n        return A\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\nfrom pkg.e import x\n")
    (pkg / "e.py").write_text("x = 1\n")
    graph = import_graph(module_files(tmp_path, {"pkg": "pkg"}))
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg.d"},
        "pkg.d": {"pkg.c", "pkg.e"},
        "pkg.e": set(),
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_checker_refuses_imports_upwards_and_sideways_and_undeclared_modules(tmp_path):
    for rel, text in {
        "app/__init__.py": "",
        "app/__main__.py": "from app.cli import main\n",
        "app/cli.py": "from app.low import util\n",  # down: fine
        "app/mid/__init__.py": "",
        "app/mid/x.py": "from app.side import y\n",  # sideways
        "app/side/__init__.py": "",
        "app/side/y.py": "def f():\n    import app.cli\n",  # upwards
        "app/low/__init__.py": "",
        "app/low/util.py": "from ..mid import x\n",  # upwards, relative
        "app/stray.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    declaration = (
        "```layers\n" + MAIN + "\napp/cli.py  # the command\napp/mid/ app/side/\napp/low/ app/__init__.py\n```\n"
    )
    t = Tree(tmp_path, {"app": "app"}, declaration)
    assert t.undeclared() == ["app/stray.py"]
    assert {(a, b) for a, b, _ in t.layer_violations()} == {
        ("app.mid.x", "app.side.y"),
        ("app.side.y", "app.cli"),
        ("app.low.util", "app.mid.x"),
    }


def test_every_package_is_listed_for_installation():
    """pyproject.toml names its packages one by one: a new subpackage left out
    would be missing from a wheel (an editable install hides it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "radixrt").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
