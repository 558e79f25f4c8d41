"""docs/architecture.md names only what exists, where it says.

Every `backticked` reference of the page is checked against the source tree
(read as text, nothing imported):

* a path (``radixrt/memory/radix_cache.py``, ``kernels/``, ``*_routes.py``,
  ``scheduler/request.py`` inside its package, ``tests/...py::test_name``)
  exists; a bare file name (``planner.py``) exists somewhere in the code;
* a dotted module (``radixrt.kernels.base``) is a module of the tree, and
  ``radixrt.x.y.name`` is defined in module ``radixrt.x.y``;
* a class-like name (``TreeNode``) is defined in the code, and ``Class.attr``
  (``Scheduler.step``) is a method, field or ``self.`` attribute of it;
* ``module.name`` (``rids.new_request_id``) is defined at the top of that module;
* "``file.py`` (``Name``, ``Other``)" says where the names are: ``file.py`` defines them.

Names from outside the tree (``ValueError``, ``DecodeStream``) are listed in
``EXTERNAL``. The ```layers block is left to tests/unit/test_import_graph.py.
"""

from __future__ import annotations

import fnmatch
import os
import re
from functools import cache
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
CODE_DIRS = {"radixrt": "radixrt", "kernels": "radixrt.kernels", "frontend": "radixrt.frontend"}
OTHER_DIRS = ("tests", "scripts", "docs", "examples")
EXTERNAL = {"None", "True", "False", "ValueError", "DecodeStream"}  # class-like names not of radixrt
FILE_SUFFIXES = (".py", ".c", ".md", ".toml", ".sh", "/")

BACKTICKED = re.compile(r"`([^`\n]+)`")
CLASS_LIKE = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # CamelCase, not a CONSTANT
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# `file.py` (`Name`, `Other.attr`): a parenthesis holding nothing but backticked names
WHERE = re.compile(r"`([\w/]+\.py)` \((`[^`]+`(?:, `[^`]+`)*)\)")


@cache
def code() -> dict[str, Path]:
    """Module name -> file, for every module of radixrt/, kernels/ and frontend/."""
    out = {}
    for folder, package in CODE_DIRS.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = [package, *p.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


@cache
def tree_paths() -> frozenset[str]:
    """Every file and folder (``a/b/``) under the code and the other top folders, relative to the root."""
    out = {p.name for p in ROOT.iterdir() if p.is_file()}
    for top in [*CODE_DIRS, *OTHER_DIRS]:
        for folder, dirs, files in os.walk(ROOT / top):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            rel = Path(folder).relative_to(ROOT).as_posix()
            out.add(rel + "/")
            out.update(f"{rel}/{f}" for f in files)
    return frozenset(out)


@cache
def by_name() -> dict[str, list[str]]:
    """File or folder name -> its paths in `tree_paths`."""
    out: dict[str, list[str]] = {}
    for p in tree_paths():
        out.setdefault(p.rstrip("/").rsplit("/", 1)[-1], []).append(p)
    return out


@cache
def text_of(path: Path) -> str:
    return path.read_text()


TOP_LEVEL = re.compile(r"^(?:(?:async )?def|class) (\w+)|^(\w+)\s*[:=]|^(?:from \S+ )?import (\([^)]*\)|[^\n]*)", re.M)


@cache
def top_level(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The names ``path`` defines at its top level, and those it imports."""
    defined: set[str] = set()
    imported: set[str] = set()
    for name, assigned, imports in TOP_LEVEL.findall(text_of(path)):
        defined.update(filter(None, (name, assigned)))
        imported.update(re.findall(r"(\w+)\s*(?:,|\)|$)", imports.replace("\n", " ")))
    return frozenset(defined), frozenset(imported)


@cache
def definers() -> dict[str, list[Path]]:
    """Name -> the modules that define or import it at their top level."""
    out: dict[str, list[Path]] = {}
    for path in code().values():
        for name in set().union(*top_level(path)):
            out.setdefault(name, []).append(path)
    return out


def defines(path: Path, name: str, imports: bool = True) -> bool:
    """``path`` defines ``name`` at its top level (or, with ``imports``, imports it: a package's re-export)."""
    defined, imported = top_level(path)
    return name in defined or (imports and name in imported)


@cache
def classes_of(path: Path) -> dict[str, frozenset[str]]:
    """Per top-level class of ``path``: its methods, class-level and annotated
    fields and the ``self.x`` it assigns (read from the class's source)."""
    out = {}
    for name, body in re.findall(r"^class (\w+)(.*?)(?=^[^\s#)]|\Z)", text_of(path), re.M | re.S):
        attrs = re.findall(r"^\s+(?:async )?def (\w+)|^    (\w+)\s*[:=]|self\.(\w+)\s*(?::[^=\n]*)?=[^=]", body, re.M)
        out[name] = frozenset(a for triple in attrs for a in triple if a)
    return out


def has(path: Path, name: str, imports: bool = True) -> bool:
    """``path`` defines ``name``, or ``Class.attr``: a class of it has ``attr``."""
    head, _, attr = name.partition(".")
    if not attr:
        return defines(path, head, imports)
    return attr.split(".")[0] in classes_of(path).get(head, frozenset())


def files_named(name: str) -> list[Path]:
    return [p for p in code().values() if p.name == name]


def check_path(ref: str) -> Optional[str]:
    ref, _, test = ref.partition("::")
    if ":" in ref or "$" in ref:
        return None  # an ipc:// address, a folder under $RADIXRT_HOME
    if ref.split("/")[0] in CODE_DIRS or ref.split("/")[0] in OTHER_DIRS:
        pattern = ref  # from the root
    else:  # a bare file name (planner.py), a path inside its package (scheduler/request.py), a pattern
        pattern = "**/" + ref
    if "*" in ref or "?" in ref:
        found = [p for p in tree_paths() if fnmatch.fnmatchcase(p, pattern)]
    else:
        wanted = (ref.rstrip("/"), ref.rstrip("/") + "/")
        name = ref.rstrip("/").rsplit("/", 1)[-1]
        found = [
            p
            for p in by_name().get(name, ())
            if p in wanted or (pattern != ref and p.endswith(("/" + wanted[0], "/" + wanted[1])))
        ]
    if not found:
        return f"{ref}: no such path"
    if test and not any(defines(ROOT / p, test) for p in found):
        return f"{ref}::{test}: no such test"
    return None


def check_name(ref: str) -> Optional[str]:
    ref = ref.removesuffix("()")
    head, _, rest = ref.partition(".")
    if head in EXTERNAL:
        return None
    if CLASS_LIKE.match(head):
        homes = definers().get(head, [])
        if not homes:
            return f"{ref}: not defined"
        if rest and not any(has(p, ref) for p in homes):
            return f"{ref}: {head} has no {rest.split('.')[0]}"
        return None
    if not DOTTED.match(ref):
        return None
    if head == "radixrt":
        parts = ref.split(".")
        for i in range(len(parts), 1, -1):  # the longest module prefix defines the rest
            module = code().get(".".join(parts[:i]))
            if module is not None:
                return None if i == len(parts) or has(module, ".".join(parts[i:])) else f"{ref}: not defined"
        return f"{ref}: no such module"
    modules = files_named(f"{head}.py")
    if modules and "." not in rest and not any(has(p, rest) for p in modules):
        return f"{ref}: not in {head}.py"
    return None


def check_where(text: str) -> list[str]:
    problems = []
    for path_ref, inside in WHERE.findall(text):
        paths = [ROOT / path_ref] if path_ref.split("/")[0] in CODE_DIRS else files_named(path_ref.split("/")[-1])
        for name in BACKTICKED.findall(inside):
            name = name.removesuffix("()")
            if name.split(".")[0] in EXTERNAL or not (CLASS_LIKE.match(name.split(".")[0]) or DOTTED.match(name)):
                continue  # a flag, a field, a file
            if not any(p.exists() and has(p, name, imports=p.name == "__init__.py") for p in paths):
                problems.append(f"{name}: not in {path_ref}")
    return problems


def check(ref: str) -> Optional[str]:
    if " " in ref:  # a command line: its paths
        return next(filter(None, (check(word) for word in ref.split() if word.endswith(FILE_SUFFIXES[:-1]))), None)
    ref = ref.removeprefix("./")
    if ref.startswith("/"):
        return None  # a route
    if ref.endswith(FILE_SUFFIXES) or "::" in ref or "/" in ref:
        return check_path(ref)
    return check_name(re.split(r"[(\[]", ref, maxsplit=1)[0])  # Engine.generate(prompt), last_tokens[row]


def problems_of(text: str) -> list[str]:
    text = re.sub(r"^```layers\n.*?^```", "", text, flags=re.M | re.S)
    problems = [p for p in map(check, set(m.strip() for m in BACKTICKED.findall(text))) if p]
    return sorted(set(problems + check_where(text)))


def test_every_reference_of_the_architecture_page_exists():
    assert problems_of(DOC.read_text()) == []


def test_the_checker_catches_stale_references():
    stale = (
        "its nodes in `radix_cache.py` (`TreeNode`); `radixrt/memory/gone.py`, `scheduler/gone.py`, "
        "`Scheduler.no_such_method`, `radixrt.memory.gone`, `NoSuchClass`, `intake.new_request_id`, "
        "`tests/unit/test_architecture_doc.py::test_no_such_test`"
    )
    assert problems_of(stale) == [
        "NoSuchClass: not defined",
        "Scheduler.no_such_method: Scheduler has no no_such_method",
        "TreeNode: not in radix_cache.py",
        "intake.new_request_id: not in intake.py",
        "radixrt.memory.gone: not defined",
        "radixrt/memory/gone.py: no such path",
        "scheduler/gone.py: no such path",
        "tests/unit/test_architecture_doc.py::test_no_such_test: no such test",
    ]
    fresh = (
        "`radix_node.py` (`TreeNode`, `MatchResult`), `rids.new_request_id`, `Scheduler.step`, `scheduler/request.py`"
    )
    assert problems_of(fresh) == []
