"""`cellflip export --weights`: the weight versions the rows name, as Hugging Face directories
at `DIR/weights/v<N>` (what `cellflip replay` loads), or where they are when they cannot be put
there. For each version, in order:

1. already at `DIR/weights/v<N>`: kept;
2. found below a `--weights-from` directory as `v<N>` (the trainer's `trainer.export_every`
   exports, `cells.export_root/trainer/v<N>`, or an earlier export): copied;
3. with a trainer or admin token, a cell still holding it writes it (POST /v1/versions/{v}/exports,
   below its `cells.export_root`); copied when that path is on this machine, else named;
4. else named: the version's state and source as the scheduler lists them (retired versions
   no cell holds any longer need step 2).

The manifest's `weights` records each version's outcome (`present`, `copied`, `named`,
`unavailable`) and path.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from cells.export.source import ExportSource
from cells.export.writer import ExportDir


def _find(v: int, roots: list[Path]) -> Path | None:
    for root in roots:
        for cand in (root / f"v{v}", *root.glob(f"*/v{v}")):
            if (cand / "config.json").is_file():
                return cand
    return None


def _ask_cell(src: ExportSource, v: int, name: str, timeout_s: float) -> dict[str, Any]:
    """A cell holding `v` writes it below its export root; its answer (or why not)."""
    r = src.http.post(f"/v1/versions/{v}/exports", json={"path": f"replay/{name}/v{v}", "dtype": "float32"})
    if r.status_code != 202:
        return {"state": "refused", "status": r.status_code, "reason": (r.json() or {}).get("detail")}
    ex = r.json()
    deadline = time.monotonic() + timeout_s
    while ex.get("state") in ("pending", "writing") and time.monotonic() < deadline:
        time.sleep(0.25)
        ex = src.http.get(f"/v1/exports/{ex['id']}").json()
    return ex


def collect(src: ExportSource, out: ExportDir, roots: list[str], ask_cells: bool = True,
            timeout_s: float = 300.0) -> dict[str, Any]:
    """Bring every version the rows name to `DIR/weights/v<N>`, or name where it is."""
    listed = {int(v["version"]): v for v in src.versions()}
    dest = out.dir / "weights"
    found: dict[str, Any] = {}
    for v in out.manifest["versions"]:
        target = dest / f"v{v}"
        if (target / "config.json").is_file():
            found[str(v)] = {"state": "present", "path": str(target)}
            continue
        hit, ex = _find(v, [Path(r) for r in roots]), {}
        if hit is None and ask_cells:
            ex = _ask_cell(src, v, out.manifest["exporter"], timeout_s)
            written = ex.get("written_to")
            if ex.get("state") == "done" and written and (Path(written) / "config.json").is_file():
                hit = Path(written)
            elif ex.get("state") == "done":
                found[str(v)] = {"state": "named", "path": written, "where": "the exporting cell's machine"}
                continue
        if hit is not None:
            dest.mkdir(exist_ok=True)
            shutil.copytree(hit, target)
            found[str(v)] = {"state": "copied", "path": str(target), "from": str(hit)}
            continue
        info = listed.get(v) or {}
        found[str(v)] = {"state": "named" if info else "unavailable", "version_state": info.get("state"),
                         "source": info.get("source"), **({"asked": ex} if ex else {})}
    out.note("weights", found)
    return found
