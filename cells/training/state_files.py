"""Training state on disk without pickle: below a checkpoint root, a directory of
`state.safetensors` (every tensor) and `manifest.json` (the structure around them, its numbers
and strings, and the tensor file's SHA-256), named by the root's `LATEST` file.

A nested state (dicts, lists, tuples, tensors, numbers, strings, None) is written as it is:
a tensor becomes `{"__tensor__": "its/path"}` in the manifest and one entry of the safetensors
file, a dict whose keys are not all strings (an optimizer's per-parameter state) becomes
`{"__items__": [[key, value], ...]}`, a tuple `{"__tuple__": [...]}`, a non-finite float
`{"__float__": "nan" | "inf" | "-inf"}`: `load_state` gives back an equal structure, tensors
bitwise. Each save writes a new directory and only then points `LATEST` at it (an atomic
rename), so a crash at any moment leaves the previous state whole; a tensor file that does not
match the manifest's hash is refused.

Sizes at Qwen3-32B (32.8e9 parameters, fp32 params + 2 Adam moments + EWMA + reference): 5 x 4 B
x 32.8e9 = 656 GB per full state — one file per training rank's shard once state is sharded
(the sharded-training work), here one file per checkpoint, written by a cell holding the state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "cellflip-state/1"
TENSORS = "state.safetensors"
MANIFEST = "manifest.json"


class StateFileError(ValueError):
    """A state directory that cannot be read back as written."""


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()  # not copied: nothing writes it meanwhile
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"{path}: a {type(obj).__name__} cannot go in a state file")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        name = obj["__tensor__"]
        if name not in tensors:
            raise StateFileError(f"the manifest names tensor {name!r}, which the tensor file lacks")
        return tensors[name]
    if "__items__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__float__" in obj:
        return float(obj["__float__"])
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


LATEST = "LATEST"
"""The file naming the newest complete state directory below a checkpoint root."""


def save_state(path: str | Path, state: dict[str, Any], keep: tuple[str, ...] = ()) -> Path:
    """Write `state` below the checkpoint root `path`: a new directory, then `LATEST` naming it
    (replaced atomically), then the older directories removed (but those named in `keep`: the
    shard files the new state names, cells/training/shard_files.py). A crash at any point
    leaves the previous state whole and named. Returns the new directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    name = f"state-{time.time_ns():x}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / TENSORS))
    manifest = {"format": FORMAT, "tensors_sha256": _sha256(tmp / TENSORS), "num_tensors": len(tensors),
                "state": tree}
    (tmp / MANIFEST).write_text(json.dumps(manifest, allow_nan=False))
    os.replace(tmp, root / name)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    for old in root.iterdir():
        if old.name not in (name, LATEST, *keep):
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return root / name


def load_state(path: str | Path) -> dict[str, Any]:
    """Read back the newest state `save_state` wrote below `path`; a missing, foreign or
    altered file is a StateFileError."""
    root = Path(path)
    try:
        d = root / (root / LATEST).read_text().strip()
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StateFileError(f"cannot read the state below {root}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StateFileError(f"{d / MANIFEST} is not a {FORMAT} manifest")
    if not (d / TENSORS).is_file():
        raise StateFileError(f"{d / TENSORS} is missing")
    if _sha256(d / TENSORS) != manifest.get("tensors_sha256"):
        raise StateFileError(f"{d / TENSORS} does not match its manifest's SHA-256 (altered or truncated)")
    with safe_open(str(d / TENSORS), framework="pt", device="cpu") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(manifest["state"], tensors)


def exists(path: str | Path) -> bool:
    return (Path(path) / LATEST).is_file()


__all__ = ["StateFileError", "exists", "load_commit", "load_packed", "load_state", "save_state"]


def load_packed(path: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """The packed training state a cell's checkpoint holds (cells/training/holder.py):
    (manifest with the generator and cursor, values, rows)."""
    state = load_state(path)["state"]
    if "values" not in state:
        raise StateFileError(f"the state below {path} is sharded over {state['meta'].get('sharded')} training "
                             "ranks per cell: a cell of one rank cannot read it (set cells.train_ranks > 1)")
    return dict(state["meta"]), state["values"], state["rows"]


def load_commit(path: str | Path) -> dict[str, Any] | None:
    """The commit record a cell's checkpoint was written for, read from its manifest alone
    (None: no checkpoint there)."""
    if not exists(path):
        return None
    root = Path(path)
    try:
        manifest = json.loads((root / (root / LATEST).read_text().strip() / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StateFileError(f"cannot read the state below {root}: {e}") from None
    commit = manifest.get("state", {}).get("commit")
    return _decode(commit, {}) if commit is not None else None
