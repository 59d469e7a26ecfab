"""SQL lives in the store package only: the rest of the scheduler calls its methods."""

from __future__ import annotations

import re
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
SQL = re.compile(r"execute(many|script)?\(|CREATE TABLE|SELECT ")


def test_no_sql_outside_the_store_package():
    found = []
    for path in sorted(SCHEDULER.rglob("*.py")):
        if SCHEDULER / "store" in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if SQL.search(line):
                found.append(f"{path.relative_to(SCHEDULER.parent)}:{n}: {line.strip()}")
    assert found == [], "SQL outside scheduler/store/:\n" + "\n".join(found)


def test_the_store_codec_is_a_leaf():
    text = (SCHEDULER / "store" / "codec.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+scheduler\b", text, re.M)
