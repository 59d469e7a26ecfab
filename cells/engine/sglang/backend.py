"""The SGLang side of the adapter: loading the package, and translating to and from it.

Everything here is a pure function of its arguments except `load_sglang`, which imports
SGLang lazily: cellflip installs and tests without it (the `gpu` extra brings it), and
`nccl_environment`, which sets the NCCL error mode SGLang's processes will inherit.
Outputs are read as SGLang's streaming generator yields them with `skip_tokenizer_init`:
`{"output_ids": [...], "meta_info": {"output_token_logprobs": [(logprob, id, None), ...],
"completion_tokens": n, "finish_reason": {"type": ...} | None, ...}}`, where the lists are
cumulative (the default) or only the new part (`incremental_streaming_output`).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from cells.engine.records import EngineError, FinishReason, SamplingParams

log = logging.getLogger(__name__)

PINNED_SGLANG_VERSION = "0.5.23"
"""The SGLang release whose source the contract test checks the adapter against."""

GPU_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""Tags SGLang's release/resume_memory_occupation accept."""

_REQUIRED_ENGINE_METHODS = (
    "async_generate", "init_weights_update_group", "destroy_weights_update_group",
    "begin_weight_update", "end_weight_update", "update_weights_from_distributed",
    "update_weights_from_tensor", "release_memory_occupation", "resume_memory_occupation",
    "shutdown",
)


class SGLangUnavailable(EngineError, ImportError):
    """`engine.type: sglang` was selected but SGLang cannot be used here."""


@dataclass(frozen=True)
class SGLangModules:
    """The SGLang entry points the adapter uses (the real package, or a test double)."""

    Engine: Any
    """`sglang.srt.entrypoints.engine.Engine`."""
    io_struct: Any
    """`sglang.srt.managers.io_struct`: request objects for the tokenizer manager."""
    version: str
    tensor_bucket: Any = None
    """`sglang.srt.weight_sync.tensor_bucket`: `FlattenedTensorMetadata` for `flattened_bucket`
    payloads of `update_weights_from_tensor` (tensor_update.py)."""
    serialize: Any = None
    """`MultiprocessingSerializer.serialize`: SGLang's own encoding of a payload handed to its
    scheduler on this node (CUDA tensors travel as IPC handles); cellflip never decodes it."""


def load_sglang() -> SGLangModules:
    """Import SGLang, or raise `SGLangUnavailable` saying how to get it."""
    try:
        import sglang
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync import tensor_bucket
    except ImportError as e:
        raise SGLangUnavailable(
            f"cells.engine.type is 'sglang' but SGLang is not importable ({e}). Install the GPU "
            f"extra on the GPU nodes: pip install 'cellflip[gpu]' (tested with sglang=="
            f"{PINNED_SGLANG_VERSION}); or use engine type 'embedded'.") from e
    missing = [m for m in _REQUIRED_ENGINE_METHODS if not hasattr(Engine, m)]
    version = getattr(sglang, "__version__", "unknown")
    if missing:
        raise SGLangUnavailable(
            f"installed sglang {version} lacks Engine methods {missing}; "
            f"install sglang=={PINNED_SGLANG_VERSION}")

    def serialize(payload: Any) -> str:
        monkey_patch_torch_reductions()  # CUDA tensors by device UUID, as SGLang's receiver expects
        return MultiprocessingSerializer.serialize(payload, output_str=True)

    return SGLangModules(Engine=Engine, io_struct=io_struct, version=version, tensor_bucket=tensor_bucket,
                         serialize=serialize)


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse settings that change what the returned log-probs mean."""
    if environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        raise EngineError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs "
                          "before temperature scaling; unset it on SGLang cells")


def nccl_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Choose how NCCL failures end, before SGLang starts its scheduler processes (they
    inherit this process's environment). The default (3) tears a process down when a
    communicator fails or times out, and SGLang's launcher then takes the cell process with
    it; 2 (CleanUpOnly) aborts the communicator and raises in the waiting call, so a failed
    version update reaches the adapter, which restarts the engine (control.py)."""
    mode = environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if mode in ("1", "3"):
        log.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s: a failed version update kills SGLang's scheduler "
                    "and the cell process with it; cellflip expects 2", mode)


def server_kwargs(model_path: str, tp: int, mem_fraction_static: float,
                  overrides: Mapping[str, Any] | None = None, *, deterministic: bool = False) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for a cell. Token-in/token-out (`skip_tokenizer_init`),
    memory handover (`enable_memory_saver`), batch-invariant kernels where `deterministic`
    (`enable_deterministic_inference`: without it SGLang ignores `sampling_seed` and a token's
    numbers depend on its batch). `overrides` (e.g. HiCache settings) win, except that they
    cannot switch deterministic inference off where the config promises it."""
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tp,
        "mem_fraction_static": mem_fraction_static,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "log_level": "error",
    }
    if deterministic:
        kwargs["enable_deterministic_inference"] = True
    kwargs.update(overrides or {})
    if deterministic and not kwargs.get("enable_deterministic_inference"):
        raise EngineError("server_args switch enable_deterministic_inference off, but the engine config asks "
                          "for deterministic inference (set cells.engine.deterministic: false instead)")
    return kwargs


def submission_rid(request_id: str, n: int) -> str:
    """SGLang's id of submission `n` of `request_id`: `{request_id}#{n};`. SGLang aborts every
    request whose id *starts with* the one given (`X#1` would also stop `X#10`), so ids are
    prefix-free: `;` ends the number, and `%`, `#` and `;` inside the request id are escaped,
    so the first `#` always ends the id. No submission id is then a prefix of another."""
    escaped = request_id.replace("%", "%25").replace("#", "%23").replace(";", "%3B")
    return f"{escaped}#{n};"


def cached_tokens(meta_info: Mapping) -> int | None:
    """Prompt tokens SGLang found cached (device radix tree, host tier or HiCache store) for
    this submission, as its first chunk reports them; None where absent."""
    n = meta_info.get("cached_tokens")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else None


def sampling_seed(seed: int, request_id: str) -> int:
    """SGLang's per-request seed (used with deterministic inference, where the noise of a
    token is a function of seed and position): derived from (seed, request id) so that a
    re-prefill of the same request on another cell draws the same noise."""
    return zlib.crc32(f"{seed}:{request_id}".encode()) & 0x7FFFFFFF


def to_sglang_sampling(params: SamplingParams, request_id: str, max_new_tokens: int) -> dict[str, Any]:
    """SGLang `sampling_params` for a request with `max_new_tokens` left to generate."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop_token_ids": list(params.stop_token_ids),
        "sampling_seed": sampling_seed(params.seed, request_id),
    }


def is_truncated(params: SamplingParams) -> bool:
    """Whether top-p/top-k truncation is active for sampled (non-greedy) tokens."""
    return not params.greedy and (params.top_p < 1.0 or params.top_k > 0)


def cache_salt(version: int) -> str:
    """Prefix-cache salt for a weight version: KV computed under another version (in the
    radix cache or in a HiCache store, which survives flushes) never matches."""
    return f"cellflip-v{version}"


def finish_reason(meta_info: Mapping) -> FinishReason | None:
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    return kind if kind in ("stop", "length") else "abort"


def _new_part(seq: list, num_seen: int, total: int) -> list:
    if len(seq) >= total:  # cumulative (SGLang's default; also its abort echoes)
        return seq[num_seen:total]
    return seq[len(seq) - (total - num_seen):] if total > num_seen else []  # incremental


def new_tokens(chunk: Mapping, num_seen: int) -> list[tuple[int, float]]:
    """(token id, log-prob) pairs in `chunk` beyond the first `num_seen` output tokens.
    `completion_tokens` (the running total) decides what is new, so cumulative lists,
    incremental deltas, coalesced deltas and abort echoes all read the same way."""
    meta = chunk["meta_info"]
    total = int(meta["completion_tokens"])
    ids = list(chunk.get("output_ids") or [])
    lps = list(meta.get("output_token_logprobs") or [])
    if total < num_seen or len(ids) < total - num_seen:
        raise EngineError(f"SGLang output out of step: {num_seen} seen, {total} in all, {len(ids)} ids sent")
    ids, lps = _new_part(ids, num_seen, total), _new_part(lps, num_seen, total)
    if len(lps) != len(ids):
        raise EngineError(f"SGLang returned {len(ids)} new tokens but {len(lps)} log-probs")
    out = []
    for tok, lp in zip(ids, lps, strict=True):
        if int(lp[1]) != int(tok):
            raise EngineError(f"SGLang log-prob entry for token {lp[1]} where the output has {tok}")
        out.append((int(tok), float(lp[0])))
    return out


def span_versions(meta_info: Mapping) -> list[tuple[int, int, int]] | None:
    """SGLang's per-token weight-version spans (sent when a request finishes) as
    (start, end, version), or None where absent or not cellflip's integer labels."""
    spans = meta_info.get("weight_versions")
    if not spans:
        return None
    try:
        return [(int(s["start"]), int(s["end"]), int(s["version"])) for s in spans]
    except (KeyError, TypeError, ValueError):
        return None


def call_ok(result: Any) -> tuple[bool, str]:
    """SGLang control calls answer `(success, message)`; others answer None or an object."""
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        return result[0], str(result[1])
    success = getattr(result, "success", True)
    return bool(success), str(getattr(result, "message", ""))
