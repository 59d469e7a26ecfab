"""Where a weight export may be written: a path relative to the cell's `cells.export_root`.

The scheduler checks the syntax before it sends anything (422); the cell resolves the path
under its root and refuses one that leaves it (a symlink included), so a trainer token can
make a cell write only below the directory its operator set aside. Exports never overwrite.
"""

from __future__ import annotations

import re
from pathlib import Path

EXPORT_PATH_PATTERN = r"^[A-Za-z0-9_.][A-Za-z0-9_.\-/]{0,199}$"
EXPORT_PATH_RULE = ("a relative path of up to 200 characters (letters, digits, `_ . - /`) below the cells' "
                    "`cells.export_root`, with no `..` part")
DTYPES = ("float32", "bfloat16")


def check_export_path(path: str) -> str | None:
    """Why `path` cannot name an export directory (None: it can)."""
    if not re.match(EXPORT_PATH_PATTERN, path):
        return f"export path {path!r} is not {EXPORT_PATH_RULE}"
    if any(p in ("", ".", "..") for p in path.split("/")):
        return f"export path {path!r} has an empty, `.` or `..` part"
    return None


def resolve_export_path(root: str | Path, path: str) -> Path:
    """`path` under `root`, resolved; ValueError when it is not one or leaves the root."""
    why = check_export_path(path)
    if why is not None:
        raise ValueError(why)
    base = Path(root).resolve()
    target = (base / path).resolve()
    if target != base and base not in target.parents:
        raise ValueError(f"export path {path!r} leaves the export root {base}")
    return target
