"""A recording stand-in for SGLang's offline Engine, for tests on machines without a GPU.

It implements the SGLang surface the adapter uses, with SGLang's parameter names (a test
checks them against the real source), keyword-only so that every call is checkable by name
(the tokenizer manager's request-object argument is positional, as in SGLang), and records
every call, attribute, request object, dict key and enumerated value it is given and every
response key read from it. The contract test
checks the recording against the pinned SGLang source; the unit tests check the adapter's
logic against the behaviour modelled here:

- generation: one token per request per loop turn (or per `token_delay_s`, to give tests
  time to act mid-decode) while not paused; the "model" is a pure
  function of (weights fingerprint, context, sampling seed, position), so a re-prefill on
  another fake with the same weights continues token for token;
- streaming chunks as SGLang yields them with `skip_tokenizer_init` (cumulative lists by
  default, deltas with `incremental_streaming_output`), finish reasons as dicts, per-token
  weight-version spans on the last chunk;
- pause `in_place` / `retract`, continue, abort; the weight-update session (update calls
  outside begin/end fail, a cache flush fails while requests run); `flattened_bucket`
  receives over a real gloo group when the sender is there;
- a radix cache keyed by (cache salt, tokens), optionally backed by a shared store, and the
  `cached_tokens` SGLang reports for each submission.

Strict where real SGLang fails at run time rather than at the call:
- the tokenizer manager's `abort_request` sends on a `zmq.asyncio` socket: called with the
  engine's loop not running in this thread it raises SGLang's "There is no current event
  loop in thread ..."; the Engine's synchronous methods run that loop themselves, so called
  from inside it they raise "This event loop is already running";
- `abort_request(rid=X)` stops every request whose id starts with X, as SGLang's scheduler does;
- `update_weights_from_tensor` takes only `flattened_bucket` payloads (one per TP rank, each
  decoded once, each at most `max_tensor_payload_bytes`): a whole version in one call would
  cost every GPU the full model once more;
- `release_memory_occupation` on a busy engine fails SGLang's idleness assertion, which kills
  its scheduler: every later call fails.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from cells.engine.sglang.backend import SGLangModules
from cells.engine.sglang.weights import (
    BucketSpec,
    broadcast_bucket,
    flatten_bucket,
    join_update_group,
    unflatten_bucket,
)

VOCAB = 1000
EOS = 2
MAX_TENSOR_PAYLOAD_BYTES = 512 << 20
"""The most bytes one `update_weights_from_tensor` call may carry (the adapter's bucket size)."""

_PAYLOADS: dict[str, dict] = {}
"""Payloads made by `fake_serialize`, by key, until a rank decodes them (once)."""
_PAYLOAD_IDS = itertools.count()


def fake_serialize(payload: dict) -> str:
    """`SGLangModules.serialize` for the fake: a key to the payload (nothing is encoded)."""
    key = f"payload-{next(_PAYLOAD_IDS)}"
    _PAYLOADS[key] = payload
    return key


@dataclass
class FlattenedTensorMetadata:
    """`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`."""

    name: str
    shape: object
    dtype: object
    start_idx: int
    end_idx: int
    numel: int


def _off_loop_error() -> RuntimeError:
    return RuntimeError(f"There is no current event loop in thread {threading.current_thread().name!r}.")


class Recorder:
    """Every use of the SGLang surface: (kind, owner, name, keys)."""

    def __init__(self) -> None:
        self.calls: set[tuple[str, str, str, tuple[str, ...]]] = set()

    def add(self, kind: str, owner: str, name: str, keys=()) -> None:
        self.calls.add((kind, owner, name, tuple(sorted(keys))))

    def merge(self, other: Recorder) -> None:
        self.calls |= other.calls


def recorded(owner: str):
    """Record each call by the names it passed: keyword names, and `#i` for the i-th positional."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            rec = self.rec if hasattr(self, "rec") else self._e.rec
            rec.add("method", owner, fn.__name__, [f"#{i + 1}" for i in range(len(args))] + list(kwargs))
            return fn(self, *args, **kwargs)

        return wrapper

    return deco


class RecDict(dict):
    """A response dict that records which keys the adapter reads."""

    def __init__(self, rec: Recorder, owner: str, data: dict) -> None:
        super().__init__(data)
        self._rec, self._owner = rec, owner

    def __getitem__(self, key):
        self._rec.add("response", self._owner, key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._rec.add("response", self._owner, key)
        return super().get(key, default)


class FakeIoStruct:
    """`sglang.srt.managers.io_struct`: any request class, recorded with its field names."""

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec

    def __getattr__(self, name: str):
        rec = self._rec

        def make(**fields):
            rec.add("struct", "io_struct", name, fields)
            return SimpleNamespace(_type=name, **fields)

        return make


class SharedStore:
    """A HiCache storage backend shared by several fakes: (salt, token prefix) entries."""

    def __init__(self) -> None:
        self.entries: set[tuple[str | None, tuple[int, ...]]] = set()


@dataclass
class _Gen:
    rid: str
    input_ids: list[int]
    sp: dict
    salt: str | None
    out: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    aborted: bool = False
    retractions: int = 0
    cached: int = 0
    """Prompt tokens found cached at submission (`cached_tokens`)."""


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine) -> None:
        self._e = engine

    @recorded("TokenizerManager")
    async def pause_generation(self, obj, /):
        self._e.rec.add("value", "PauseGenerationReqInput.mode", obj.mode)
        self._e.log.append(("pause", obj.mode))
        self._e.paused = True
        if obj.mode == "retract":
            for g in self._e.gens.values():
                g.retractions += 1
        elif obj.mode == "abort":
            for g in self._e.gens.values():
                g.aborted = True

    @recorded("TokenizerManager")
    async def continue_generation(self, obj, /):
        self._e.log.append(("continue",))
        self._e.paused = False

    @recorded("TokenizerManager")
    async def update_weight_version(self, obj, /):
        assert obj.abort_all_requests is False, "the adapter must not let SGLang abort everything"
        self._e.log.append(("label", obj.new_version))
        self._e.label = obj.new_version

    @recorded("TokenizerManager")
    def abort_request(self, *, rid: str = "", abort_all: bool = False):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._e._loop:  # the zmq.asyncio send needs this thread's running loop
            raise _off_loop_error()
        self._e.log.append(("abort", rid))
        for g in self._e.gens.values():
            if rid and g.rid.startswith(rid):  # SGLang's scheduler matches by prefix
                g.aborted = True


class FakeEngine:
    """`sglang.Engine` with the methods the adapter calls (see the module docstring)."""

    def __init__(self, *, rec: Recorder | None = None, store: SharedStore | None = None,
                 token_delay_s: float = 0.0, eos: int = EOS, **server_args):
        """`token_delay_s`: seconds between two tokens of a request (0: one per loop turn).
        `eos`: the model's end-of-sequence id (always a stop token; -1: none)."""
        self.rec = rec if rec is not None else Recorder()
        self.token_delay_s, self.eos = token_delay_s, eos
        self.rec.add("fields", "ServerArgs", "", server_args)
        self.server_args = server_args
        self._loop = asyncio.new_event_loop()
        self._tm = FakeTokenizerManager(self)
        self.incremental = bool(server_args.get("incremental_streaming_output"))
        self.store = store
        self.gens: dict[str, _Gen] = {}
        self.cache: set[tuple[str | None, tuple[int, ...]]] = set()
        self.cache_hits: list[tuple[str, str | None, int, str]] = []
        self.log: list[tuple] = []
        self.produced: list[tuple[str, int, str]] = []
        """(SGLang rid, token, version label) of every token generated, in order."""
        self.paused = False
        self.label = "default"
        self.fingerprint = 0
        self.weights: dict = {}
        self.groups: dict[str, object] = {}
        self.session_open = False
        self.fail: dict[str, str] = {}
        self.raise_on: dict[str, Exception] = {}
        self.released: set[str] = set()
        self.shut_down = False
        self.crashed = False
        """SGLang's scheduler died (an assertion failed in it): every later call fails."""
        self.max_tensor_payload_bytes = MAX_TENSOR_PAYLOAD_BYTES
        self.tensor_payloads: list[tuple[int, str, bool]] = []
        """(bytes, device, flush_cache) of every `update_weights_from_tensor` payload."""

    @property
    def loop(self):
        self.rec.add("attr", "Engine", "loop")
        return self._loop

    @property
    def tokenizer_manager(self):
        self.rec.add("attr", "Engine", "tokenizer_manager")
        return self._tm

    def _called(self, name: str):
        if self._loop.is_running():  # SGLang's synchronous methods run this loop themselves
            raise RuntimeError("This event loop is already running")
        if self.crashed:
            raise RuntimeError("SGLang's scheduler process died")
        self._loop.run_until_complete(asyncio.sleep(0))
        self.log.append((name,))
        if name in self.raise_on:
            raise self.raise_on[name]
        if name in self.fail:
            return False, self.fail[name]
        return None

    # -- generation --------------------------------------------------------------------

    @recorded("Engine")
    async def async_generate(self, *, input_ids=None, sampling_params=None, return_logprob=False,
                             stream=False, rid=None, cache_salt=None):
        self.rec.add("fields", "SamplingParams", "", sampling_params)
        assert stream is True and return_logprob is True
        assert all(isinstance(t, int) for t in input_ids) and rid not in self.gens
        g = _Gen(rid, list(input_ids), dict(sampling_params), cache_salt)
        self.gens[rid] = g
        g.cached = self._lookup_cache(g)
        return self._stream(g)

    def _lookup_cache(self, g: _Gen) -> int:
        ids = tuple(g.input_ids)
        best, where = 0, "none"
        for source, entries in (("device", self.cache), ("store", self.store.entries if self.store else set())):
            for salt, toks in entries:
                n = 0
                while salt == g.salt and n < min(len(ids), len(toks)) and ids[n] == toks[n]:
                    n += 1
                if n > best:
                    best, where = n, source
        self.cache_hits.append((g.rid, g.salt, best, where))
        return best

    def _insert_cache(self, g: _Gen) -> None:
        entry = (g.salt, tuple(g.input_ids + g.out))
        self.cache.add(entry)
        if self.store is not None:
            self.store.entries.add(entry)

    def next_token(self, context: list[int], seed: int) -> tuple[int, float]:
        h = zlib.crc32(repr((self.fingerprint, context[-4:], seed, len(context))).encode())
        return h % VOCAB, -((h >> 10) % 1000) / 250.0

    async def _stream(self, g: _Gen):
        sp = g.sp
        lps: list = []
        stops = set(sp.get("stop_token_ids") or []) | {self.eos}
        while True:
            await asyncio.sleep(self.token_delay_s)
            while self.paused and not g.aborted:
                await asyncio.sleep(0.001)
            reason = None
            new: list[int] = []
            if g.aborted:
                reason = {"type": "abort", "message": "Abort in waiting queue"}
            else:
                tok, lp = self.next_token(g.input_ids + g.out, sp["sampling_seed"])
                g.out.append(tok)
                g.labels.append(self.label)
                self.produced.append((g.rid, tok, self.label))
                lps.append((lp, tok, None))
                new = [tok]
                if tok in stops:
                    reason = {"type": "stop", "matched": tok}
                elif len(g.out) >= sp["max_new_tokens"]:
                    reason = {"type": "length", "length": len(g.out)}
            meta = {"id": g.rid, "finish_reason": None if reason is None else RecDict(self.rec, "finish_reason", reason),
                    "completion_tokens": len(g.out), "num_retractions": g.retractions, "cached_tokens": g.cached,
                    "output_token_logprobs": list(lps[-len(new):]) if self.incremental and new else
                    ([] if self.incremental else list(lps))}
            if reason is not None:
                meta["weight_versions"] = _spans(g.labels)
            out_ids = new if self.incremental else list(g.out)
            yield RecDict(self.rec, "chunk", {"output_ids": out_ids, "meta_info": RecDict(self.rec, "meta_info", meta)})
            if reason is not None:
                self._insert_cache(g)
                del self.gens[g.rid]
                return

    # -- weights -----------------------------------------------------------------------

    @recorded("Engine")
    def init_weights_update_group(self, *, master_address, master_port, rank_offset, world_size,
                                  group_name, backend="nccl"):
        r = self._called("init_weights_update_group")
        if r:
            return r
        if group_name in self.groups:
            return False, "group exists"
        self.groups[group_name] = (join_update_group(SimpleNamespace(
            master_address=master_address, master_port=master_port, world_size=world_size,
            group_name=group_name, backend=backend), rank_offset, 30.0) if backend == "gloo" else None)
        return True, "Succeeded to initialize custom process group."

    @recorded("Engine")
    def destroy_weights_update_group(self, *, group_name):
        r = self._called("destroy_weights_update_group")
        if self.groups.pop(group_name, "missing") == "missing":
            return False, "The group to be destroyed does not exist."
        return r or (True, "destroyed")

    @recorded("Engine")
    def begin_weight_update(self, *, selector="all"):
        r = self._called("begin_weight_update")
        if r:
            return r
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    @recorded("Engine")
    def end_weight_update(self):
        r = self._called("end_weight_update")
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return r or (True, "Success")

    @recorded("Engine")
    def update_weights_from_distributed(self, *, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        r = self._called("update_weights_from_distributed")
        if r:
            return r
        if not self.session_open:
            return False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
        self.rec.add("value", "load_format", load_format)
        assert load_format == "flattened_bucket" and group_name in self.groups
        spec = BucketSpec(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes))
        pg = self.groups[group_name]
        if pg is not None:  # receive as SGLang does: one uint8 buffer, one broadcast from rank 0
            import torch
            flat = torch.empty(spec.nbytes, dtype=torch.uint8)
            broadcast_bucket(pg, flat, 30.0)
            self.weights.update({k: v.clone() for k, v in unflatten_bucket(flat, spec).items()})
            self.fingerprint = zlib.crc32(flat.numpy().tobytes(), self.fingerprint)
        else:
            self.fingerprint = zlib.crc32(repr(names).encode(), self.fingerprint)
        return self._flush_after_update(flush_cache, "Succeeded to update parameter online.")

    @recorded("Engine")
    def update_weights_from_tensor(self, *, named_tensors, load_format=None, flush_cache=True):
        r = self._called("update_weights_from_tensor")
        if r:
            return r
        if not self.session_open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        self.rec.add("value", "load_format", load_format)
        assert load_format == "flattened_bucket", "whole tensors: every TP rank would hold each one unsharded"
        tp = int(self.server_args.get("tp_size") or 1)
        assert len(named_tensors) == tp and all(isinstance(p, str) for p in named_tensors), \
            f"one serialized payload per TP rank ({tp}), got {len(named_tensors)}"
        payloads = [_PAYLOADS.pop(key) for key in named_tensors]  # each rank decodes its own, once
        flat, metadata = payloads[0]["flattened_tensor"], payloads[0]["metadata"]
        assert all(p["flattened_tensor"] is flat for p in payloads)
        assert flat.numel() <= self.max_tensor_payload_bytes, \
            f"a {flat.numel()}-byte payload: over {self.max_tensor_payload_bytes} bytes per call"
        self.tensor_payloads.append((flat.numel(), str(flat.device), bool(flush_cache)))
        for m in metadata:
            t = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
            self.weights[m.name] = t.clone()
            self.fingerprint = zlib.crc32(flatten_bucket([t]).numpy().tobytes(), self.fingerprint)
        return self._flush_after_update(flush_cache, "Success")

    def _flush_after_update(self, flush_cache: bool, message: str):
        if flush_cache:
            running = [g for g in self.gens.values() if not g.aborted]
            if running and not self._retracted():
                return False, "Weights were updated, but the cache was not flushed because requests are still running"
            self.cache.clear()
        return True, message

    def _retracted(self) -> bool:
        return self.paused and any(e == ("pause", "retract") for e in self.log[-50:])

    # -- memory, lifecycle -------------------------------------------------------------

    @recorded("Engine")
    def release_memory_occupation(self, *, tags=None):
        self._called("release_memory_occupation")
        for t in tags:
            self.rec.add("value", "tags", t)
        if self.gens:  # an assertion inside SGLang's scheduler: the process dies
            self.crashed = True
            raise AssertionError("release_memory_occupation should be called only when server is idle.")
        self.released |= set(tags)
        if "kv_cache" in tags:
            self.cache.clear()

    @recorded("Engine")
    def resume_memory_occupation(self, *, tags=None):
        self._called("resume_memory_occupation")
        for t in tags:
            self.rec.add("value", "tags", t)
        self.released -= set(tags)

    @recorded("Engine")
    def shutdown(self):
        self.crashed = False  # shutting a dead engine down works
        self._called("shutdown")
        self.shut_down = True


def _spans(labels: list[str]) -> list[dict]:
    spans: list[dict] = []
    for i, v in enumerate(labels):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def fake_modules(rec: Recorder | None = None, store: SharedStore | None = None, *, token_delay_s: float = 0.0,
                 eos: int = EOS) -> tuple[SGLangModules, Recorder]:
    """SGLang entry points backed by the fake; every engine built from them records into `rec`
    (`token_delay_s`, `eos`: see `FakeEngine`)."""
    rec = rec if rec is not None else Recorder()

    class Engine(FakeEngine):
        def __init__(self, **server_args):
            super().__init__(rec=rec, store=store, token_delay_s=token_delay_s, eos=eos, **server_args)

    return SGLangModules(Engine=Engine, io_struct=FakeIoStruct(rec), version="fake",
                         tensor_bucket=SimpleNamespace(FlattenedTensorMetadata=FlattenedTensorMetadata),
                         serialize=fake_serialize), rec
