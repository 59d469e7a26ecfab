"""The README's table of latest figures, rendered from the committed baselines.

    python bench/render_readme.py            print the table
    python bench/render_readme.py --check    exit 1 when README.md's table differs from it
    python bench/render_readme.py --write    rewrite README.md's table

Each row's prose is a template in bench/readme_rows.yaml whose numbers are placeholders filled
from the baselines' JSON (bench/expr.py's language); the met / missed words come from each
baseline's `targets` (bench/judge.py): `{?name}` in the prose, and the last column.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import yaml  # noqa: E402
from expr import Many, evaluate  # noqa: E402

README = HERE.parent / "README.md"
ROWS = HERE / "readme_rows.yaml"
HEADER = "| bench | question | latest figures | targets |\n|---|---|---|---|"
FIRST = "| bench | question | latest figures"
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]+)\}")
SIGN = {"<=": "≤", ">=": "≥", "==": "=", "<": "<", ">": ">"}


class RenderError(ValueError):
    """A template cites what its baseline does not hold, or renders what a table cell cannot."""


def load_baseline(stem: str) -> dict:
    return json.loads((HERE / f"{stem}.baseline.json").read_text())


def show(value, fmt: str = "") -> str:
    """One value as the README prints it: a list's items joined by " / "."""
    if isinstance(value, Many):
        return " / ".join(show(v, fmt) for v in value.values())
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if fmt:
        return format(value, fmt)
    return str(value)


def goal_text(t: dict) -> str:
    g = t["goal"]
    g = json.dumps(g) if isinstance(g, bool) else f"{g:g}" if isinstance(g, (int, float)) else str(g)
    return f"{SIGN[t['op']]} {g}"


def target_phrase(baseline: dict, name: str, where: str, word_only: bool = False) -> str:
    """"target ≥ 0.8: missed", or with `word_only` "missed"."""
    targets = baseline.get("targets") or {}
    if name not in targets:
        raise RenderError(f"{where}: no target {name!r} in the baseline (has {sorted(targets)})")
    t = targets[name]
    word = "met" if t["met"] else "missed"
    return word if word_only else f"target {goal_text(t)}: {word}"


def fill(template: str, baselines: dict[str, dict], where: str) -> str:
    """The template with every placeholder replaced; RenderError for one it cannot fill."""
    default = next(iter(baselines))

    def one(m: re.Match) -> str:
        if m.group(0) in ("{{", "}}"):
            return m.group(0)[0]
        body = m.group(1).strip()
        if (q := re.match(r"^(\w*)([?!])(\w+)$", body)) is not None:
            return target_phrase(baselines[q.group(1) or default], q.group(3), where, q.group(2) == "!")
        name, _, rest = body.rpartition("@") if "@" in body else ("", "", body)
        expr, _, fmt = rest.partition(":")
        if (name or default) not in baselines:
            raise RenderError(f"{where}: no baseline called {name!r}")
        try:
            value, _ = evaluate(baselines[name or default], expr.strip())
            return show(value, fmt)
        except Exception as e:
            raise RenderError(f"{where}: {{{body}}}: {e}") from e

    return PLACEHOLDER.sub(one, template)


def targets_cell(baselines: dict[str, str], data: dict[str, dict]) -> str:
    """N/M met per baseline, and each missed target with its value (or why none) and goal."""
    parts = []
    for alias, stem in baselines.items():
        targets = data[alias].get("targets") or {}
        met = sum(t["met"] for t in targets.values())
        text = f"{met}/{len(targets)} met" if targets else "no targets"
        misses = []
        for name, t in targets.items():
            if not t["met"]:
                got = "no value" if t.get("error") else show(t["value"])
                at = f" at {t['at']}" if t.get("at") else ""
                misses.append(f"`{name}` {got}{at} ({goal_text(t)})")
        if misses:
            text += "; missed: " + ", ".join(misses)
        parts.append(f"`{stem}`: {text}" if len(baselines) > 1 else text)
    return "; ".join(parts)


def render_row(row: dict) -> str:
    stems = row["baselines"]
    data = {alias: load_baseline(stem) for alias, stem in stems.items()}
    where = f"bench/{row['bench']}.py"
    cells = [f"`{where}`", fill(row["question"], data, where), fill(row["figures"], data, where),
             targets_cell(stems, data)]
    for c in cells:
        if "|" in c or "\n" in c:
            raise RenderError(f"{where}: a cell holds '|' or a line break: {c[:80]!r}")
    return "| " + " | ".join(cells) + " |"


def render_table(rows_path: Path = ROWS) -> str:
    rows = yaml.safe_load(rows_path.read_text())["rows"]
    return "\n".join([HEADER, *(render_row(r) for r in rows)])


def table_span(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the figures table in README's lines."""
    start = next((i for i, line in enumerate(lines) if line.startswith(FIRST)), None)
    if start is None:
        raise RenderError(f"README.md has no line starting {FIRST!r}")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def readme_table(text: str) -> str:
    lines = text.split("\n")
    start, end = table_span(lines)
    return "\n".join(lines[start:end])


def write(text: str, table: str) -> str:
    lines = text.split("\n")
    start, end = table_span(lines)
    return "\n".join(lines[:start] + table.split("\n") + lines[end:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md differs")
    mode.add_argument("--write", action="store_true", help="rewrite README.md's table")
    args = ap.parse_args(argv)
    table = render_table()
    text = README.read_text()
    if args.write:
        README.write_text(write(text, table))
        return 0
    if args.check:
        current = readme_table(text)
        if current != table:
            old, new = current.split("\n"), table.split("\n")
            for i, (a, b) in enumerate(zip(old, new)):
                if a != b:
                    print(f"README.md table line {i + 1} differs:\n  README:   {a[:200]}\n  rendered: {b[:200]}",
                          file=sys.stderr)
            if len(old) != len(new):
                print(f"README.md table has {len(old)} lines, rendered {len(new)}", file=sys.stderr)
            print("run: python bench/render_readme.py --write", file=sys.stderr)
            return 1
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
