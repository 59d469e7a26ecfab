"""The code's shape, checked: module and function sizes, the engine boundary, and what the cells
may import of the scheduler. Each check parses the source (ast), so comments and strings never
count as code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("cells", "scheduler")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# the planner's hot loop: one pass over lazy heaps, kept whole on purpose (its docstring says why)
LONG_FUNCTION_ALLOWED = {("scheduler/planner/destinations.py", "_place")}
CONTRACT = "scheduler.contract"


def _modules(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """Every absolute import in a module, function-local ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_no_product_module_is_over_400_lines():
    long = {_rel(p): n for p in _modules(*PRODUCT) if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_product_function_is_over_60_lines():
    long = {}
    for p in _modules(*PRODUCT):
        for node in ast.walk(_tree(p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and (_rel(p), node.name) not in LONG_FUNCTION_ALLOWED:
                    long[f"{_rel(p)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_allowed_long_function_says_why():
    for rel, name in LONG_FUNCTION_ALLOWED:
        fn = next(n for n in ast.walk(_tree(ROOT / rel)) if isinstance(n, ast.FunctionDef) and n.name == name)
        assert "hot loop" in (ast.get_docstring(fn) or ""), f"{rel}:{name} must say why it stays long"


def _probe_calls(tree: ast.Module):
    """getattr/hasattr/inspect.signature calls whose subject mentions an engine."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("getattr", "hasattr", "signature") and "engine" in ast.unparse(node.args[0]).lower():
            yield node.lineno, ast.unparse(node)


def test_nothing_outside_the_engine_package_probes_an_engine():
    engine_dir = ROOT / "cells" / "engine"
    found = [f"{_rel(p)}:{ln} {src}" for p in _modules("cells") if engine_dir not in p.parents
             for ln, src in _probe_calls(_tree(p))]
    assert not found, "branch on engine.capabilities instead:\n" + "\n".join(found)


def test_the_probe_check_can_fail():
    tree = ast.parse("def f(engine):\n    return hasattr(engine, 'export_kv')\n")
    assert list(_probe_calls(tree))


def test_the_rl_maths_imports_neither_the_trainer_nor_the_training_ranks_and_they_one_way():
    """cells/rl/ is imported by both the trainer process and the cells' training ranks and
    imports neither; the training ranks (cells/training/) never import the trainer process."""
    def importing(pkg: str, banned: tuple[str, ...]) -> list[str]:
        return [f"{_rel(p)}:{ln} {mod}" for p in _modules(pkg) for ln, mod in _imported_modules(_tree(p))
                if any(mod == b or mod.startswith(b + ".") for b in banned)]

    assert not importing("cells/rl", ("cells.trainer", "cells.training")), importing("cells/rl", ("cells.trainer", "cells.training"))
    assert not importing("cells/training", ("cells.trainer",)), importing("cells/training", ("cells.trainer",))


def test_cells_import_only_the_schedulers_contract():
    found = [f"{_rel(p)}:{ln} {mod}" for p in _modules("cells") for ln, mod in _imported_modules(_tree(p))
             if (mod == "scheduler" or mod.startswith("scheduler.")) and not mod.startswith(CONTRACT + ".")]
    assert not found, f"cells may import only {CONTRACT}:\n" + "\n".join(found)


def test_the_contract_imports_nothing_else_of_the_scheduler():
    found = [f"{_rel(p)}:{ln} {mod}" for p in _modules("scheduler/contract")
             for ln, mod in _imported_modules(_tree(p))
             if mod.startswith("scheduler.") and not mod.startswith(CONTRACT + ".")]
    assert not found, "\n".join(found)


def test_the_product_does_not_import_the_fault_machinery():
    found = [f"{_rel(p)}:{ln} {mod}" for p in _modules(*PRODUCT) for ln, mod in _imported_modules(_tree(p))
             if mod.split(".")[0] == "faultkit"]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("root", PRODUCT)
def test_every_product_package_is_listed_in_the_architecture_doc(root):
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    packages = sorted({_rel(p.parent) for p in _modules(root) if p.name == "__init__.py"})
    missing = [pkg for pkg in packages if f"`{pkg}/`" not in doc]
    assert not missing, f"docs/ARCHITECTURE.md does not cover: {missing}"
