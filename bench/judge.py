"""Every bench judges itself: its goals from bench/targets.yaml, checked against its own result.

`judge(result, bench, quick)` gives `targets` ({name: {value, op, goal, met}}, with `at` where
a min or max took one item, `error` where the value could not be had) and `all_met`. A target
whose value is missing, null, of the wrong kind or whose check raised is missed.
`provenance(bench, argv)` says what code a result was measured on: the commit, the SHA-256 of
the bench's own source file, the command, and `dirty` when the working tree differs from the
commit in bench/, cells/ or scheduler/. `mode_of(provenance)` reads back whether a committed
result ran with --quick. Baselines recorded before provenance existed carry `from_history`:
their commit is the last one that changed the baseline file, their hash the bench's source then.

    python bench/judge.py [--write]    every committed baseline judged from its own figures;
                                       --write records the verdicts (after a goal changed)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import operator
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from expr import ExprError, Many, Missing, evaluate, parse

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = HERE / "targets.yaml"
COMPARE = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}
FIELDS = {"value", "op", "goal", "about"}
SOURCES = ("bench", "cells", "scheduler")
"""Where a difference from the commit makes a run `dirty`."""


class TargetsError(ValueError):
    """bench/targets.yaml itself is wrong (a bad field, op, goal or expression)."""


def load_targets(path: Path = TARGETS) -> dict[str, dict[str, dict | None]]:
    spec = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(spec, dict):
        raise TargetsError(f"{path}: a mapping of benches")
    for section, targets in spec.items():
        if not isinstance(targets, dict):
            raise TargetsError(f"{section}: a mapping of targets ({{}} for none)")
        for name, t in targets.items():
            if t is None and section.endswith(".quick"):
                continue
            _check_target(f"{section}.{name}", t)
    return spec


def _check_target(where: str, t) -> None:
    if not isinstance(t, dict) or set(t) != FIELDS:
        raise TargetsError(f"{where}: needs exactly {sorted(FIELDS)}, has {sorted(t) if isinstance(t, dict) else t!r}")
    if t["op"] not in COMPARE:
        raise TargetsError(f"{where}: op {t['op']!r} is not one of {list(COMPARE)}")
    goal = t["goal"]
    if not isinstance(goal, (bool, int, float, str)):
        raise TargetsError(f"{where}: goal {goal!r} is not a number, bool or string")
    if t["op"] != "==" and isinstance(goal, (bool, str)):
        raise TargetsError(f"{where}: {t['op']} needs a number, not {goal!r}")
    try:
        parse(t["value"])
    except ExprError as e:
        raise TargetsError(f"{where}: {e}") from e


def targets_for(bench: str, quick: bool, spec: dict | None = None, variant: str | None = None) -> dict[str, dict]:
    """The bench's targets in that mode; KeyError for a bench the file does not list. A
    `variant` (`variant_of`) judges by its own section `NAME.VARIANT` instead of NAME's."""
    spec = load_targets() if spec is None else spec
    if variant is not None:
        bench = f"{bench}.{variant}"
    if bench not in spec:
        raise KeyError(f"{bench}: no section in {TARGETS.name} (an empty one, {{}}, for a bench without goals)")
    out = dict(spec[bench])
    if quick:
        out.update(spec.get(f"{bench}.quick") or {})
    return {k: v for k, v in out.items() if v is not None}


def variant_of(bench: str, argv: list[str], spec: dict | None = None) -> str | None:
    """The variant a run's arguments select: section `NAME.VARIANT` of bench/targets.yaml (not
    `quick`) whose flag `--VARIANT` (underscores as dashes) the arguments carry; None for none."""
    spec = load_targets() if spec is None else spec
    for section in spec:
        head, _, variant = section.partition(".")
        if head == bench and variant and "." not in variant and variant != "quick" \
                and f"--{variant.replace('_', '-')}" in argv:
            return variant
    return None


def check(result: dict, target: dict) -> dict:
    """One target against one result: {value, op, goal, met} (+ at, error)."""
    goal, op = target["goal"], target["op"]
    rec = {"value": None, "op": op, "goal": goal, "met": False}
    try:
        value, at = evaluate(result, target["value"])
        if at:
            rec["at"] = at
        rec["value"] = _plain(value)
        rec["met"] = bool(_compare(value, op, goal))
    except Missing as e:
        rec["error"] = str(e)
    except Exception as e:  # a check that crashes misses its target, and says why
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def _compare(value, op: str, goal) -> bool:
    if isinstance(goal, (bool, str)):
        if type(value) is not type(goal):
            raise Missing(f"{value!r} is not a {type(goal).__name__}")
        return value == goal
    if value is None:
        raise Missing("null")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Missing(f"{_plain(value)!r} is not a number (a list needs min, max, all, ...)")
    return COMPARE[op](value, goal)


def _plain(value):
    """The value as the JSON records it: lists of items as lists, floats to 6 significant digits."""
    if isinstance(value, Many):
        return [_plain(v) for v in value.values()]
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def judge(result: dict, bench: str, quick: bool, spec: dict | None = None,
          variant: str | None = None) -> tuple[dict, bool]:
    """(targets, all_met) of one result. The result's own `targets`, `all_met` and
    `provenance` are never judged."""
    data = {k: v for k, v in result.items() if k not in ("targets", "all_met", "provenance")}
    targets = {name: check(data, t) for name, t in targets_for(bench, quick, spec, variant).items()}
    return targets, all(t["met"] for t in targets.values())


def missed(targets: dict) -> list[str]:
    """One line per missed target: name, value (or why none), goal."""
    out = []
    for name, t in targets.items():
        if not t["met"]:
            got = t.get("error") or f"{t['value']}" + (f" at {t['at']}" if t.get("at") else "")
            out.append(f"{name}: {got}; goal {t['op']} {json.dumps(t['goal'])}")
    return out


def source_sha256(bench: str, commit: str | None = None) -> str:
    """SHA-256 of bench/NAME.py: the file as it is now, or as it was at `commit`."""
    if commit is None:
        data = (HERE / f"{bench}.py").read_bytes()
    else:
        data = _git("show", f"{commit}:bench/{bench}.py", text=False)
    return hashlib.sha256(data).hexdigest()


JUDGING = {"common", "expr", "judge", "render_readme"}
"""Bench-local modules that judge and print figures, not measure them: a change there stales no baseline."""


def _local_imports(path: Path) -> set[Path]:
    """The bench-local modules (bench/*.py, bench/sim/...) `path` imports, function-local imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, up level - 1
                pkg = path.parent.relative_to(HERE).parts
                pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join([*pkg, *([node.module] if node.module else [])])
            if base:
                names |= {base} | {f"{base}.{a.name}" for a in node.names}
            else:
                names |= {a.name for a in node.names}
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] in JUDGING:
            continue
        for candidate in (HERE.joinpath(*parts).with_suffix(".py"), HERE.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                out.add(candidate)
    return out


def companions(bench: str) -> list[Path]:
    """Every bench-local module bench/NAME.py reaches by import (transitively), itself aside."""
    main = HERE / f"{bench}.py"
    seen: set[Path] = set()
    todo = [main]
    while todo:
        for dep in _local_imports(todo.pop()) - seen - {main}:
            seen.add(dep)
            todo.append(dep)
    return sorted(seen)


def companions_sha256(bench: str) -> str:
    """SHA-256 over the companions' paths and sources as they are now: a baseline measured
    before one of them changed is stale too, though bench/NAME.py itself did not move."""
    h = hashlib.sha256()
    for dep in companions(bench):
        h.update(dep.relative_to(HERE).as_posix().encode() + b"\0" + dep.read_bytes() + b"\0")
    return h.hexdigest()


def provenance(bench: str, argv: list[str]) -> dict:
    """What a run was measured on. The commit is null outside a git checkout."""
    try:
        commit = _git("rev-parse", "HEAD").strip()
        dirty = bool(_git("status", "--porcelain", "--", *SOURCES).strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, True
    return {"commit": commit, "bench_sha256": source_sha256(bench), "companions_sha256": companions_sha256(bench),
            "dirty": dirty,
            "command": shlex.join(["python", f"bench/{bench}.py", *argv])}


def mode_of(prov: dict) -> bool:
    """Whether a recorded run was a --quick one."""
    return "--quick" in shlex.split(prov["command"])


def _git(*args: str, text: bool = True):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True, text=text).stdout


def baselines() -> list[Path]:
    """The committed baselines: bench/NAME[.VARIANT].baseline.json."""
    return sorted(HERE.glob("*.baseline.json"))


def bench_of(path: Path) -> str:
    return path.name.split(".")[0]


def write_baseline(path: Path, data: dict) -> None:
    """Rewrites a baseline in its own layout: one line, or indented as it was."""
    old = path.read_text() if path.exists() else ""
    indent = 2 if old.startswith("{\n") else None
    text = json.dumps(data, indent=indent, ensure_ascii=old.isascii())
    path.write_text(text + ("\n" if old.endswith("\n") or not old else ""))


def rejudge(path: Path, spec: dict | None = None) -> dict:
    """The baseline with `targets` and `all_met` judged again from its own figures, in the
    mode its provenance records."""
    data = json.loads(path.read_text())
    if "provenance" not in data:
        raise ValueError(f"{path.name}: no provenance (which code, which command)")
    out = {k: v for k, v in data.items() if k not in ("targets", "all_met", "provenance")}
    variant = variant_of(bench_of(path), shlex.split(data["provenance"]["command"]), spec)
    out["targets"], out["all_met"] = judge(out, bench_of(path), mode_of(data["provenance"]), spec, variant)
    out["provenance"] = data["provenance"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Every committed baseline judged from its own figures; --write records the verdicts
    (after a goal changed in bench/targets.yaml)."""
    ap = argparse.ArgumentParser(description="judge the committed baselines against bench/targets.yaml")
    ap.add_argument("--write", action="store_true", help="rewrite each baseline's targets and all_met")
    args = ap.parse_args(argv)
    spec = load_targets()
    for path in baselines():
        judged = rejudge(path, spec)
        met = sum(t["met"] for t in judged["targets"].values())
        print(f"{path.name}: {met}/{len(judged['targets'])} met")
        for line in missed(judged["targets"]):
            print(f"  missed {line}")
        if args.write and judged != json.loads(path.read_text()):
            write_baseline(path, judged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
