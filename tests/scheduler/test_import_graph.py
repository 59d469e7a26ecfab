"""No runtime import cycle in scheduler/: every module of the package is parsed, its imports
(top-level, function-local and relative alike; only `if TYPE_CHECKING:` blocks are left out,
since they never run) become edges, and the graph must have no cycle.

An edge goes to the module imported (`from scheduler.x import y` goes to `scheduler.x.y` when
that is a module, else to `scheduler.x`); a package's `__init__` is not counted as imported
by its submodules' imports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module → modules of `package` it imports at run time."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            graph[mod].update(t for t in targets if t in files and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_no_runtime_import_cycle_in_the_scheduler():
    graph = import_graph(ROOT, "scheduler")
    assert "scheduler.control.controller" in graph and graph["scheduler.control.controller"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == set()
    assert find_cycle(graph) is None
    (pkg / "c.py").write_text("import pkg.a\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]


def _first_import_failures(root: Path, package: str) -> list[str]:
    """Import each module of `package` first, in a fresh interpreter state each, in one
    subprocess: a circle through a package's `__init__` (which the graph above does not count)
    shows as a module that cannot be imported first."""
    mods = sorted(_module_name(p, root) for p in (root / package).rglob("*.py") if p.name != "__main__.py")
    top = package.split("/")[0]
    code = ("import importlib, json, sys\nbad = []\n"
            f"for m in {mods!r}:\n"
            f"    for k in [k for k in sys.modules if k == {top!r} or k.startswith({top + '.'!r})]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad.append(f'{m}: {e!r}')\n"
            "print(json.dumps(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_contract_module_imports_first():
    """The contract's config package re-exports its sections from `__init__`, so a contract
    module the sections import must not import the config package back."""
    assert _first_import_failures(ROOT, "scheduler/contract") == []


def test_the_first_import_check_sees_a_circle_through_an_init(tmp_path):
    pkg = tmp_path / "pkgx"
    (pkg / "conf").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "conf" / "__init__.py").write_text("from pkgx.conf.sect import Sect\n")
    (pkg / "conf" / "base.py").write_text("BASE = 1\n")
    (pkg / "conf" / "sect.py").write_text("from pkgx.shared import VALUE\nSect = VALUE\n")
    (pkg / "shared.py").write_text("VALUE = 2\n")
    assert _first_import_failures(tmp_path, "pkgx") == []
    (pkg / "shared.py").write_text("from pkgx.conf.base import BASE\nVALUE = BASE\n")
    assert [f.split(":")[0] for f in _first_import_failures(tmp_path, "pkgx")] == ["pkgx.shared"]
