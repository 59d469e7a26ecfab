"""A page of exported trajectories as rows on disk: the flat row (the scheduler's row with its
training outcome spread into `train_*` columns), its JSON line, and its parquet table.

The columns and their types are `SCHEMA` (docs/EXPORT.md says what each holds). Per-token
columns are lists aligned with `token_ids`; log-probs are float32 (what the engines compute;
`float32_inexact` in the manifest counts any value that was not, none on the embedded engine).
"""

from __future__ import annotations

import json
from typing import Any

TRAIN_KEYS = ("status", "update_version", "rl_step", "start_version", "advantage", "staleness", "drop_reason",
              "correction")
"""What the trainer writes back per session (cells/trainer/outcomes.py), as `train_<key>`."""

TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprob", "version", "old_logprob", "old_provenance", "cell_idx",
                 "truncated")


_DTYPES = {"token_ids": "<i4", "loss_mask": "i1", "logprob": "<f4", "version": "<i4", "old_logprob": "<f4",
           "old_provenance": "i1", "cell_idx": "<i2", "truncated": "i1"}
"""The packed wire types (scheduler/store/exportread.py `PACKED`)."""


def token_arrays(row: dict[str, Any]) -> dict[str, Any]:
    """A row's per-token columns as numpy arrays (from the packed wire form or from lists;
    nulls as NaN in the float columns and -1 in `version`)."""
    import base64

    import numpy as np

    if "packed" in row:
        return {k: np.frombuffer(base64.b64decode(row["packed"][k]), dtype=dt) for k, dt in _DTYPES.items()}
    out = {}
    for k, dt in _DTYPES.items():
        vals = row[k]
        if dt == "<f4":
            vals = [np.nan if x is None else x for x in vals]
        elif k == "version":
            vals = [-1 if x is None else x for x in vals]
        out[k] = np.asarray(vals, dtype=dt)
    return out


def num_tokens(row: dict[str, Any]) -> int:
    return len(row["token_ids"]) if "token_ids" in row else len(row["packed"]["token_ids"]) * 3 // 4 // 4


def row_versions(row: dict[str, Any]) -> set[int]:
    v = token_arrays(row)["version"] if "packed" in row else [x for x in row["version"] if x is not None]
    return {int(x) for x in set(v) if x >= 0}


def flat_row(row: dict[str, Any], lists: bool = True) -> dict[str, Any]:
    """The scheduler's export row with `training` spread into `train_*` columns; with `lists`
    the per-token columns as lists (nulls as None), else as numpy arrays."""
    out = {k: v for k, v in row.items() if k not in ("training", "packed", "f32_inexact")}
    if "packed" in row or not lists:
        arrays = token_arrays(row)
        if not lists:
            out.update(arrays)
        else:
            for k, a in arrays.items():
                vals = a.tolist()
                if a.dtype.kind == "f":
                    vals = [None if x != x else x for x in vals]
                elif k == "version":
                    vals = [None if x < 0 else x for x in vals]
                out[k] = vals
    t = row.get("training") or {}
    for k in TRAIN_KEYS:
        v = t.get(k)
        out[f"train_{k}"] = json.dumps(v) if k == "correction" and v is not None else v
    w, out["train_weight_note"] = train_weight(t, token_arrays(row)["loss_mask"] if "packed" in row else row["loss_mask"])
    out["train_weight"] = w if w is None or not lists else [None if x != x else x for x in w.tolist()]
    return out


def train_weight(training: dict[str, Any], loss_mask: Any) -> tuple[Any, str | None]:
    """The per-token weights the update used (the outcome's `weights`: its loss-mask tokens')
    aligned with `token_ids` (NaN elsewhere), and a note when there are none to give: `omitted`
    (the session had more than the write-back carries), `missing` (no training rank sent them)
    or `mismatch` (they do not fit the row's loss mask: not shown, never misaligned)."""
    import base64

    import numpy as np

    if training.get("weights_omitted") is not None:
        return None, f"omitted: {training['weights_omitted']} loss-mask tokens"
    if training.get("weights_missing") is not None:
        return None, "missing: the training ranks sent none"
    if training.get("weights") is None:
        return None, None
    w = np.frombuffer(base64.b64decode(training["weights"]), dtype="<f4")
    mask = np.asarray(loss_mask, dtype=bool)
    if len(w) != int(mask.sum()):
        return None, f"mismatch: {len(w)} weights for {int(mask.sum())} loss-mask tokens"
    full = np.full(len(mask), np.nan, dtype=np.float32)
    full[mask] = w
    return full, None


def turn_messages(messages: dict[str, Any] | str | None) -> list[list[dict[str, Any]] | None]:
    """A row's `messages` column as each turn's whole message list as sent (turn k: the first
    `keep` of turn k-1's, then its own `messages`); None for a turn past the recording cap."""
    rec = json.loads(messages) if isinstance(messages, str) else messages
    out: list[list[dict[str, Any]] | None] = []
    prev: list[dict[str, Any]] | None = []
    for t in (rec or {}).get("turns", []):
        prev = None if t["messages"] is None or prev is None else prev[:t["keep"]] + t["messages"]
        out.append(prev)
    return out


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in rows).encode()


def schema():
    """The parquet schema of a flat row."""
    import pyarrow as pa

    turn = pa.struct([("request_id", pa.string()), ("prompt_start", pa.int32()), ("base", pa.int32()),
                      ("num_generated", pa.int32()), ("cell", pa.string()), ("epoch", pa.int64()),
                      ("state", pa.string()), ("reason", pa.string()), ("params", pa.string()),
                      ("created_at", pa.float64()), ("updated_at", pa.float64())])
    move = pa.struct([("request_id", pa.string()), ("src", pa.string()), ("dst", pa.string()), ("path", pa.string()),
                      ("epoch", pa.int64()), ("state", pa.string()), ("reason", pa.string()),
                      ("created_at", pa.float64()), ("finished_at", pa.float64()), ("commit_tokens", pa.int32()),
                      ("stall_s", pa.float64())])
    return pa.schema([
        ("session_id", pa.string()), ("finish_seq", pa.int64()), ("job", pa.string()), ("group_id", pa.string()),
        ("parent_id", pa.string()), ("branch", pa.int32()), ("reward", pa.float64()),
        ("finish_reason", pa.string()), ("created_at", pa.float64()), ("finished_at", pa.float64()),
        ("tainted", pa.bool_()), ("segment_starts", pa.list_(pa.int32())),
        ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("logprob", pa.list_(pa.float32())),
        ("version", pa.list_(pa.int32())), ("old_logprob", pa.list_(pa.float32())),
        ("old_provenance", pa.list_(pa.int8())), ("cell_idx", pa.list_(pa.int16())),
        ("truncated", pa.list_(pa.int8())), ("cells", pa.list_(pa.string())),
        ("turns", pa.list_(turn)), ("migrations", pa.list_(move)), ("messages", pa.string()),
        ("train_status", pa.string()), ("train_update_version", pa.int64()), ("train_rl_step", pa.int64()),
        ("train_start_version", pa.int64()), ("train_advantage", pa.float64()), ("train_staleness", pa.int64()),
        ("train_drop_reason", pa.string()), ("train_correction", pa.string()),
        ("train_weight", pa.list_(pa.float32())), ("train_weight_note", pa.string()),
    ])


def _list_column(rows: list[dict[str, Any]], key: str, typ):
    """One per-token column as a list array over one flat array and its offsets (numpy rows)."""
    import numpy as np
    import pyarrow as pa

    parts = [r[key] for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=_DTYPES[key])
    if flat.dtype.kind == "f":
        values = pa.array(flat, type=typ, mask=np.isnan(flat))
    elif key == "version":
        values = pa.array(flat, type=typ, mask=flat < 0)
    else:
        values = pa.array(flat, type=typ)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def _nullable_list(rows: list[dict[str, Any]], key: str):
    """A float32 list column whose rows may be null (numpy arrays or None)."""
    import numpy as np
    import pyarrow as pa

    parts = [r[key] for r in rows]
    sizes = [0 if p is None else len(p) for p in parts]
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.concatenate([p for p in parts if p is not None] or [np.zeros(0, dtype=np.float32)])
    nulls = np.array([p is None for p in parts] + [False])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32(), mask=nulls),
                                    pa.array(flat, pa.float32(), mask=np.isnan(flat)))


def float32_inexact(rows: list[dict[str, Any]]) -> int:
    """Log-prob values that float32 does not hold exactly (counted in the manifest): the
    scheduler's count for packed rows, else counted here."""
    import numpy as np

    n = 0
    for r in rows:
        if "packed" in r:
            n += int(r.get("f32_inexact", 0))
            continue
        for key in ("logprob", "old_logprob"):
            a = np.array([x for x in r[key] if x is not None], dtype=np.float64)
            n += int(np.count_nonzero(a.astype(np.float32).astype(np.float64) != a))
    return n


def arrow_table(rows: list[dict[str, Any]]):
    """A page of flat rows (per-token columns as numpy arrays: `flat_row(lists=False)`) as a
    pyarrow Table of `schema()`."""
    import pyarrow as pa

    sch = schema()
    cols = []
    for f in sch:
        if f.name in TOKEN_COLUMNS:
            cols.append(_list_column(rows, f.name, f.type.value_type))
        elif f.name == "train_weight":
            cols.append(_nullable_list(rows, f.name))
        elif f.name == "turns":
            cols.append(pa.array([[{**t, "params": json.dumps(t["params"])} for t in r["turns"]] for r in rows],
                                 type=f.type))
        elif f.name == "messages":
            cols.append(pa.array([None if r["messages"] is None else json.dumps(r["messages"]) for r in rows],
                                 type=f.type))
        else:
            cols.append(pa.array([r[f.name] for r in rows], type=f.type))
    return pa.Table.from_arrays(cols, schema=sch)


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    """A parquet file of the rows: zstd, float columns byte-stream-split (log-probs compress to
    about half), dictionary-encoded strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    split = ["logprob.list.element", "old_logprob.list.element"]
    pq.write_table(arrow_table(rows), sink, compression="zstd", compression_level=1,
                   use_byte_stream_split=split, use_dictionary=[c for c in schema().names if c not in
                                                                ("logprob", "old_logprob", "token_ids")])
    return sink.getvalue().to_pybytes()
