"""The adapter against the real SGLang source (the pinned release), with no GPU.

The test fetches the pinned sglang wheel without dependencies into a cache directory
(`CELLFLIP_SGLANG_CACHE`, default ~/.cache/cellflip/sglang), reads its Python source with
`ast`, and checks every SGLang method, attribute, request field, sampling/server argument,
enumerated value and response key the adapter uses. What the adapter uses is not listed
here: it is recorded by driving the adapter through every path against the recording fake,
and an AST pass over the adapter makes sure no SGLang-facing call escaped the recording.
With CI=true a failed download fails the test instead of skipping it. The tests that read the
source are marked `network` (`-m "not network"` leaves them out on a machine with no registry).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import fake_sglang
import pytest
import torch

from cells.engine.records import EngineError, SamplingParams
from cells.engine.sglang import backend as sb
from cells.engine.sglang.engine import SGLangEngine
from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    UpdateGroup,
    flatten_bucket,
    plan_buckets,
)
from scheduler.contract.config.engine import SGLangEngineConfig

WHEEL = f"sglang-{sb.PINNED_SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
ADAPTER_GLOB = "*.py"
"""Every module of the adapter (cells/engine/sglang/*.py): a new one is read without a list to update."""

# Where each recorded owner lives in SGLang's source.
ANCHORS = {
    "Engine": ("sglang/srt/entrypoints/engine.py", "Engine"),
    "TokenizerManager": ("sglang/srt/managers/tokenizer_manager.py", "TokenizerManager"),
    "SamplingParams": ("sglang/srt/sampling/sampling_params.py", "SamplingParams"),
}
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SERVER_ARGS = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/fields")
RESPONSE_FILES = ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/utils/weight_versions.py",
                  "sglang/srt/managers/schedule_batch.py")
# Enumerated values the adapter passes, and the file that must define each.
VALUE_FILES = {
    "PauseGenerationReqInput.mode": IO_STRUCT,
    "load_format": "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    "tags": "sglang/srt/constants.py",
}


# -- fetching the source ----------------------------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("CELLFLIP_SGLANG_CACHE", Path.home() / ".cache" / "cellflip" / "sglang"))


def fetch_sglang_source() -> Path:
    """Extracted Python source of the pinned wheel (downloaded once, checked by hash)."""
    root = cache_dir()
    src = root / f"src-{sb.PINNED_SGLANG_VERSION}"
    if (src / ".complete").exists():
        return src
    wheel = root / WHEEL
    if not wheel.exists():
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
               "--platform", "manylinux_2_34_x86_64", f"sglang=={sb.PINNED_SGLANG_VERSION}",
               "-d", str(root), "--quiet"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"pip download failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}")
    tmp = Path(tempfile.mkdtemp(prefix="src-partial-", dir=root))  # concurrent runs never share it
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    (tmp / ".complete").write_text(digest)
    try:
        tmp.rename(src)
    except OSError:  # another run finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return src


@pytest.fixture(scope="module")
def sglang_src() -> Path:
    try:
        return fetch_sglang_source()
    except Exception as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"cannot fetch the pinned SGLang source in CI: {e}")
        pytest.skip(f"cannot fetch the pinned SGLang source: {e}")


# -- reading it -------------------------------------------------------------------------

class SourceIndex:
    """Classes, methods and fields of SGLang's source, resolved through its imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._mods: dict[str, ast.Module | None] = {}

    def module(self, rel: str) -> ast.Module | None:
        if rel not in self._mods:
            p = self.root / rel
            self._mods[rel] = ast.parse(p.read_text(), str(p)) if p.exists() else None
        return self._mods[rel]

    def find_class(self, rel: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        mod = self.module(rel)
        if mod is None or depth > 5:
            return None
        for node in mod.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return rel, node
        for node in mod.body:  # `from sglang.x import Name` or a re-export
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang"):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = node.module.replace(".", "/")
                        for cand in (f"{base}.py", f"{base}/__init__.py"):
                            hit = self.find_class(cand, alias.name, depth + 1)
                            if hit:
                                return hit
        return None

    def mro(self, rel: str, name: str) -> list[ast.ClassDef]:
        hit = self.find_class(rel, name)
        if hit is None:
            return []
        crel, cls = hit
        out = [cls]
        for base in cls.bases:
            bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if bname:
                out += self.mro(crel, bname)
        return out

    def method(self, rel: str, cls: str, name: str):
        for c in self.mro(rel, cls):
            for node in c.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
        return None

    def fields(self, rel: str, cls: str) -> set[str]:
        return {n.target.id for c in self.mro(rel, cls) for n in c.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    def attributes(self, rel: str, cls: str) -> set[str]:
        out = self.fields(rel, cls)
        for c in self.mro(rel, cls):
            for node in ast.walk(c):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    out.add(node.attr)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(node.name)
        return out

    def server_args(self) -> set[str]:
        main, fields_dir = SERVER_ARGS
        out = self.fields(main, "ServerArgs")
        for p in sorted((self.root / fields_dir).glob("*.py")):
            mod = self.module(str(p.relative_to(self.root)))
            for c in (n for n in mod.body if isinstance(n, ast.ClassDef)):
                if any(isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_NS_PATH" or
                       isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_NS_PATH" for t in n.targets)
                       for n in c.body):
                    out |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign)
                            and isinstance(n.target, ast.Name) and not n.target.id.startswith("_")}
        return out

    def strings(self, rels) -> set[str]:
        out: set[str] = set()
        for rel in rels:
            mod = self.module(rel)
            for node in ast.walk(mod) if mod else ():
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.add(node.value)
        return out

    def response_keys(self) -> set[str]:
        out: set[str] = set()
        for rel in RESPONSE_FILES:
            for node in ast.walk(self.module(rel) or ast.Module(body=[], type_ignores=[])):
                if isinstance(node, ast.Dict):
                    out |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.slice, ast.Constant):
                    out.add(node.slice.value)
        return out


def _params(fn) -> tuple[set[str], int, bool, bool]:
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args][1:]  # drop self
    return set(pos) | {x.arg for x in a.kwonlyargs}, len(pos), a.vararg is not None, a.kwarg is not None


def check_contract(index: SourceIndex, calls) -> list[str]:
    """Problems with `calls` (a Recorder's set) against the source in `index`; [] = all good."""
    problems: list[str] = []
    server_args = index.server_args()
    response_keys = index.response_keys()
    for kind, owner, name, keys in sorted(calls):
        if kind == "method":
            rel, cls = ANCHORS[owner]
            fn = index.method(rel, cls, name)
            if fn is None:
                problems.append(f"{owner}.{name}: no such method")
                continue
            names, npos, varargs, varkw = _params(fn)
            for k in keys:
                if k.startswith("#"):
                    if int(k[1:]) > npos and not varargs:
                        problems.append(f"{owner}.{name}: takes {npos} positional arguments, adapter passes {k[1:]}")
                elif k not in names and not varkw:
                    problems.append(f"{owner}.{name}: no parameter {k!r} (has {sorted(names)})")
        elif kind == "attr":
            rel, cls = ANCHORS[owner]
            if name not in index.attributes(rel, cls):
                problems.append(f"{owner}.{name}: no such attribute")
        elif kind == "struct":
            if index.find_class(IO_STRUCT, name) is None:
                problems.append(f"io_struct.{name}: no such class")
                continue
            missing = set(keys) - index.fields(IO_STRUCT, name)
            problems += [f"io_struct.{name}: no field {k!r}" for k in sorted(missing)]
        elif kind == "fields":
            have = server_args if owner == "ServerArgs" else index.fields(*ANCHORS[owner])
            problems += [f"{owner}: no field {k!r}" for k in sorted(set(keys) - have)]
        elif kind == "value":
            if name not in index.strings([VALUE_FILES[owner]]):
                problems.append(f"{owner}: value {name!r} unknown to {VALUE_FILES[owner]}")
        elif kind == "response":
            if name not in response_keys:
                problems.append(f"response {owner}[{name!r}]: SGLang never sets this key")
        else:
            problems.append(f"unknown record kind {kind}")
    return problems


# -- what the adapter uses ----------------------------------------------------------------

def _drain(engine: SGLangEngine, limit: int = 400) -> list:
    events = []
    for _ in range(limit):
        events += engine.step()
        if not engine.has_work():
            break
    return events


def record_adapter_usage() -> fake_sglang.Recorder:
    """Drive the adapter through every path that touches SGLang; return what it used."""
    rec = fake_sglang.Recorder()
    store = fake_sglang.SharedStore()
    hicache = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
               "enable_deterministic_inference": True}
    for incremental in (False, True):
        mods, _ = fake_sglang.fake_modules(rec, store)
        cfg = SGLangEngineConfig(model_path="m", scoring="publisher_copy")
        a = SGLangEngine(cfg, modules=mods, server_args={**hicache, "incremental_streaming_output": incremental})
        b = SGLangEngine(cfg, modules=mods, server_args=hicache)
        a.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=40, top_p=0.9, seed=3))
        a.add_request("r2", [5, 6], SamplingParams(max_tokens=3, stop_token_ids=(1,)))
        a.add_request("r3", [8], SamplingParams(max_tokens=50))
        for _ in range(3):
            a.step()
        a.abort("r3")
        a.pause_all()
        a.resume_all()
        a.receive_version(1, UpdateGroup("127.0.0.1", 1, 1, 2, "g1"),
                          [BucketSpec(("w",), ("bfloat16",), ((2, 2),))])
        a.load_weights(2, {"w": torch.zeros(2, 2, dtype=torch.bfloat16)})
        a.runtime.sglang.fail["update_weights_from_distributed"] = "injected"
        with pytest.raises(EngineError):
            a.receive_version(3, UpdateGroup("127.0.0.1", 1, 1, 2, "g2"),
                              [BucketSpec(("w",), ("bfloat16",), ((2, 2),))])
        a.runtime.sglang.fail.clear()
        a.receive_version(3, UpdateGroup("127.0.0.1", 1, 1, 2, "g3"),
                          [BucketSpec(("w",), ("bfloat16",), ((2, 2),))])
        b.receive_version(3, UpdateGroup("127.0.0.1", 1, 1, 2, "g4"),
                          [BucketSpec(("w",), ("bfloat16",), ((2, 2),))])
        a.abort("r1")  # moved by the scheduler through the shared store
        b.add_request("r1", [5, 6, 7, 8], SamplingParams(max_tokens=40, top_p=0.9, seed=3), prompt_len=3,
                      path="kv_store")
        _drain(a)
        _drain(b)
        a.release_memory(["weights", "kv_cache"])
        a.resume_memory(["weights", "kv_cache"])
        a.close()
        b.close()
    return rec


def adapter_sglang_names() -> dict[str, set[str]]:
    """SGLang names the adapter's source uses, by AST: methods called on the engine or the
    tokenizer manager (directly or through `control("name", ...)`), attributes read from
    the engine, and io_struct classes."""
    out: dict[str, set[str]] = {"Engine": set(), "TokenizerManager": set(), "io_struct": set(), "attr": set()}
    root = Path(sb.__file__).parent
    for path in sorted(root.glob(ADAPTER_GLOB)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target, attr = node.func.value, node.func.attr
                holder = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if holder == "_engine":
                    out["Engine"].add(attr)
                elif holder == "_tm":
                    out["TokenizerManager"].add(attr)
                elif holder == "io_struct":
                    out["io_struct"].add(attr)
                elif attr == "control" and node.args and isinstance(node.args[0], ast.Constant):
                    out["Engine"].add(node.args[0].value)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "_engine" and isinstance(node.ctx, ast.Load):
                out["attr"].add(node.attr)
    return out


@pytest.fixture(scope="module")
def recorded() -> fake_sglang.Recorder:
    return record_adapter_usage()


# -- the tests ---------------------------------------------------------------------------

def test_recording_covers_every_sglang_call_in_the_adapter(recorded):
    names = adapter_sglang_names()
    methods = {(o, n) for k, o, n, _ in recorded.calls if k == "method"}
    structs = {n for k, _, n, _ in recorded.calls if k == "struct"}
    attrs = {n for k, o, n, _ in recorded.calls if k in ("attr", "method") and o == "Engine"}
    assert {("Engine", n) for n in names["Engine"]} <= methods
    assert {("TokenizerManager", n) for n in names["TokenizerManager"]} <= methods
    assert names["io_struct"] <= structs
    assert names["attr"] <= attrs
    assert len(names["Engine"]) >= 10  # the AST pass does see the adapter's calls


@pytest.mark.network
def test_adapter_matches_pinned_sglang_source(sglang_src, recorded):
    problems = check_contract(SourceIndex(sglang_src), recorded.calls)
    assert problems == [], "\n".join(problems)
    kinds = {c[0] for c in recorded.calls}
    assert kinds == {"method", "attr", "struct", "fields", "value", "response"}


@pytest.mark.network
def test_fake_signatures_are_sglang_signatures(sglang_src):
    """The fake accepts only parameter names the real methods have."""
    import inspect
    index = SourceIndex(sglang_src)
    fakes = {"Engine": fake_sglang.FakeEngine, "TokenizerManager": fake_sglang.FakeTokenizerManager}
    checked = 0
    for owner, cls in fakes.items():
        for name, fn in vars(cls).items():
            if not hasattr(fn, "__wrapped__"):
                continue
            real = index.method(*ANCHORS[owner], name)
            assert real is not None, f"{owner}.{name} missing in SGLang"
            names, _, _, varkw = _params(real)
            fake_names = [p for p in inspect.signature(fn.__wrapped__).parameters if p != "self"]
            assert varkw or set(fake_names) <= names, (owner, name, fake_names, names)
            checked += 1
    assert checked >= 13


@pytest.mark.network
@pytest.mark.parametrize("mutation", ["rename_method", "rename_field", "rename_kwarg"])
def test_contract_check_catches_a_changed_source(sglang_src, recorded, tmp_path, mutation):
    files = {"rename_method": ("sglang/srt/entrypoints/engine.py", "def update_weights_from_distributed(",
                               "def update_weights_from_distributed_v2(", "Engine.update_weights_from_distributed"),
             "rename_field": (IO_STRUCT, 'mode: Literal["abort", "retract", "in_place"]',
                              'pause_mode: Literal["abort", "retract", "in_place"]',
                              "io_struct.PauseGenerationReqInput: no field 'mode'"),
             "rename_kwarg": ("sglang/srt/entrypoints/engine.py", "cache_salt: Optional[Union[List[str], str]] = None,",
                              "prefix_salt: Optional[Union[List[str], str]] = None,",
                              "Engine.async_generate: no parameter 'cache_salt'")}
    rel, old, new, expected = files[mutation]
    copy = tmp_path / "src"
    for sub in ("sglang/srt/entrypoints", "sglang/srt/managers", "sglang/srt/sampling", "sglang/srt/arg_groups",
                "sglang/srt/utils", "sglang/srt/model_executor/model_runner_components"):
        shutil.copytree(sglang_src / sub, copy / sub)
    for f in ("sglang/srt/server_args.py", "sglang/srt/constants.py"):
        shutil.copy(sglang_src / f, copy / f)
    text = (copy / rel).read_text()
    assert old in text
    (copy / rel).write_text(text.replace(old, new))
    assert check_contract(SourceIndex(copy), recorded.calls) != []
    problems = check_contract(SourceIndex(copy), recorded.calls)
    assert any(expected in p for p in problems), problems


@pytest.mark.network
def test_flattened_layout_is_sglangs(sglang_src):
    """Our flattened bucket is byte for byte SGLang's `FlattenedTensorBucket`, and a planned
    bucket passes its receive-side allocation (alignment) checks."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket",
                                                  sglang_src / "sglang/srt/weight_sync/tensor_bucket.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)), ("b", torch.randn(7, generator=g)),
             ("c", torch.randint(0, 9, (3,), dtype=torch.int8)), ("d", torch.randn(2, 2, generator=g))]
    theirs = mod.FlattenedTensorBucket(named_tensors=named).get_flattened_tensor()
    ours = flatten_bucket([t for _, t in named])
    assert torch.equal(theirs, ours)
    for b in plan_buckets([TensorMeta.of(n, t) for n, t in named], bucket_bytes=64):
        recv = mod.FlattenedTensorBucket.empty(list(b.names), list(b.dtypes), [list(s) for s in b.shapes], "cpu")
        assert recv.get_flattened_tensor().numel() == b.nbytes
        recv.flattened_tensor.copy_(flatten_bucket([dict(named)[n] for n in b.names]))
        for name, t in recv.reconstruct_tensors():
            assert torch.equal(t, dict(named)[name])


@pytest.mark.network
def test_tensor_update_payload_is_read_by_sglangs_bucket(sglang_src):
    """The metadata the adapter sends with a `flattened_bucket` payload of
    `update_weights_from_tensor` rebuilds every tensor through SGLang's own
    `FlattenedTensorBucket`, as its weight updater does."""
    import importlib.util

    from cells.engine.sglang.tensor_update import flattened_metadata

    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket2",
                                                  sglang_src / "sglang/srt/weight_sync/tensor_bucket.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(1)
    named = {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
             "c": torch.randint(0, 9, (3,), dtype=torch.int8), "d": torch.randn(2, 2, generator=g).to(torch.float16)}
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in named.items()], bucket_bytes=48)
    assert len(buckets) >= 2
    for b in buckets:
        flat = flatten_bucket([named[n] for n in b.names])
        bucket = mod.FlattenedTensorBucket(flattened_tensor=flat, metadata=flattened_metadata(b, mod))
        got = dict(bucket.reconstruct_tensors())
        assert list(got) == list(b.names)
        assert all(got[n].dtype == named[n].dtype and torch.equal(got[n], named[n]) for n in b.names)
