"""No pickle on any network wire or in any store (faults issue, "hostile input").

A pickle from the network is code execution for whoever can reach the port, so every wire
(cell protocol over HTTP, torch.distributed transfers and their TCPStore rendezvous) and
every store (the scheduler's SQLite file) carries JSON, safetensors or raw tensors only.

Static: an AST scan of cells/, scheduler/, bench/, faultkit/ and tests/ (this file aside) for
pickle-family imports, torch.load without weights_only=True, torch.distributed's *_object
collectives, torch.distributed.rpc, multiprocessing in any form (a spawned Process's
arguments, a Queue, a Pipe's send/recv and a Pool's tasks and results are pickled between
processes; ours are subprocesses exchanging JSON lines), concurrent.futures'
ProcessPoolExecutor (the same), numpy allow_pickle=True, pickle_module=, pandas pickles and
yaml.load without a safe loader. The scanner is tested on a sample of each pattern.

Runtime: with pickle (and torch.load without weights_only) made to raise, every cell
protocol message round-trips through JSON text; a short session runs through the HTTP API
and the SQLite store; JSON goes through a TCPStore; and the local cluster starts its
processes with a config file path and plain string arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import pickle
import types
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCAN = ("cells", "scheduler", "bench", "faultkit", "tests")
SELF = Path(__file__).resolve()
"""This file imports pickle to make it raise."""

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "pickletools", "dill", "cloudpickle", "shelve", "marshal",
                  "joblib", "copyreg", "torch.distributed.rpc", "multiprocessing", "torch.multiprocessing",
                  "concurrent.futures.process", "concurrent.futures.ProcessPoolExecutor"}
"""Importing these (or anything under them) is a finding."""
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}
"""torch.distributed collectives that pickle their payload."""
PICKLING_ATTRS = {"read_pickle", "to_pickle"} | OBJECT_COLLECTIVES
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


# ----------------------------------------------------------------------------- static scan


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.findings: list[tuple[int, str]] = []

    def flag(self, node: ast.AST, what: str) -> None:
        self.findings.append((getattr(node, "lineno", 0), what))

    def dotted(self, node: ast.AST) -> str | None:
        """`a.b.c` with `a` resolved through the file's imports (None: not a plain name chain)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    @staticmethod
    def forbidden_module(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in PICKLE_MODULES)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            top = a.name.split(".")[0]
            self.aliases[a.asname or top] = a.name if a.asname else top
            if self.forbidden_module(a.name):
                self.flag(node, f"import {a.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        for a in node.names:
            full = f"{mod}.{a.name}"
            self.aliases[a.asname or a.name] = full
            if self.forbidden_module(mod) or self.forbidden_module(full) or a.name in PICKLING_ATTRS:
                self.flag(node, f"from {mod} import {a.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.dotted(node)
        if node.attr in PICKLING_ATTRS or (name and self.forbidden_module(name)):
            self.flag(node, f"uses {name or node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func) or ""
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        const = lambda key: isinstance(kw.get(key), ast.Constant) and kw[key].value  # noqa: E731
        if name in ("torch.load", "torch.serialization.load") and const("weights_only") is not True:
            self.flag(node, f"{name}() without weights_only=True")
        if "pickle_module" in kw:
            self.flag(node, f"{name}(pickle_module=...)")
        if "allow_pickle" in kw and const("allow_pickle") is not False:
            self.flag(node, f"{name}(allow_pickle=...)")
        if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
            self.flag(node, f"{name}()")
        if name in ("yaml.load", "yaml.load_all"):
            loader = kw.get("Loader") or (node.args[1] if len(node.args) > 1 else None)
            lname = (self.dotted(loader) or "") if loader is not None else ""
            if lname.rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                self.flag(node, f"{name}() without a safe Loader")
        self.generic_visit(node)


def scan_source(text: str, filename: str = "<src>") -> list[tuple[int, str]]:
    s = _Scanner()
    s.visit(ast.parse(text, filename))
    return s.findings


def _sources() -> list[Path]:
    return sorted(p for d in SCAN for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts and p != SELF)


def test_scanner_catches_every_pattern():
    bad = {
        "import pickle": "import pickle",
        "import cloudpickle as cp": "import cloudpickle",
        "from pickle import loads": "from pickle import loads",
        "import dill": "import dill",
        "import torch\ntorch.load(f)": "torch.load",
        "import torch\ntorch.load(f, weights_only=False)": "torch.load",
        "from torch import load\nload(f)": "torch.load",
        "import torch as T\nT.load(f, map_location='cpu')": "torch.load",
        "import torch.distributed as dist\ndist.broadcast_object_list(x, src=0)": "broadcast_object_list",
        "from torch.distributed import all_gather_object": "all_gather_object",
        "import torch.distributed as dist\ndist.send_object_list(x, dst=1)": "send_object_list",
        "import torch.distributed as dist\ndist.recv_object_list(x)": "recv_object_list",
        "import torch.distributed as dist\ndist.gather_object(x)": "gather_object",
        "import torch.distributed as dist\ndist.scatter_object_list(x, y)": "scatter_object_list",
        "import torch.distributed.rpc as rpc": "torch.distributed.rpc",
        "from multiprocessing.connection import Listener": "multiprocessing.connection",
        "import multiprocessing as mp\nmp.connection.Client(('10.0.0.1', 1))": "multiprocessing.connection",
        "from multiprocessing.managers import BaseManager": "multiprocessing.managers",
        "import multiprocessing as mp\nq = mp.Queue()": "multiprocessing",
        "from multiprocessing import Pool": "multiprocessing",
        "import torch.multiprocessing as mp": "torch.multiprocessing",
        "from concurrent.futures import ProcessPoolExecutor": "ProcessPoolExecutor",
        "import concurrent.futures as cf\ncf.ProcessPoolExecutor(2)": "ProcessPoolExecutor",
        "import numpy as np\nnp.load(f, allow_pickle=True)": "allow_pickle",
        "import torch\ntorch.save(x, f, pickle_module=m)": "pickle_module",
        "import pandas as pd\npd.read_pickle(f)": "read_pickle",
        "import yaml\nyaml.load(text)": "yaml.load",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)": "yaml.load",
        "import yaml\nyaml.unsafe_load(text)": "yaml.unsafe_load",
    }
    for src, expect in bad.items():
        found = scan_source(src)
        assert any(expect in what for _, what in found), (src, found)
    good = '''"""Nothing here pickles: JSON on the wire (a docstring may say pickle)."""
import json, yaml, torch, numpy as np
import subprocess, queue, threading
from concurrent.futures import ThreadPoolExecutor
import torch.distributed as dist
# pickle.loads(x) in a comment is not code
p = subprocess.Popen(["python", "w.py"], stdin=subprocess.PIPE); q = queue.Queue()
torch.load(f, weights_only=True, map_location="cpu")
yaml.safe_load(text); yaml.load(text, Loader=yaml.SafeLoader)
np.load(f, allow_pickle=False)
dist.broadcast(t, src=0); dist.send(t, dst=1)
msg = "pickle"
'''
    assert scan_source(good) == []


def test_no_pickle_in_the_source_tree():
    files = _sources()
    assert len(files) > 50 and ROOT / "scheduler" / "contract" / "protocol.py" in files and ROOT / "cells" / "transport" / "p2p.py" in files
    findings = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in scan_source(p.read_text(), str(p))]
    assert findings == [], "\n".join(findings)


def test_local_cli_payloads_are_json_or_file_paths():
    """`cellflip cell --p2p-probe` is JSON; every other start-up input is a config file path."""
    cli = (ROOT / "cells" / "cli.py").read_text()
    assert "json.loads(args.p2p_probe)" in cli
    tree = ast.parse(cli)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("loads", "load")]
    assert all(isinstance(n.func.value, ast.Name) and n.func.value.id in ("json", "yaml") and
               (n.func.value.id == "json" or n.func.attr != "load") for n in loads)


# ----------------------------------------------------------------------------- runtime


def _refuse(what: str):
    def refuse(*a, **k):
        raise AssertionError(f"{what} called: pickle on a wire or in a store")
    return refuse


@pytest.fixture
def no_pickle(monkeypatch):
    """pickle (and torch's unrestricted load) raise for the rest of the test."""
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse(f"pickle.{name}"))
    try:
        import torch
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return
    real_load = torch.load

    def load(*a, weights_only=None, **k):
        if weights_only is not True:
            raise AssertionError("torch.load without weights_only=True")
        return real_load(*a, weights_only=True, **k)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(torch, "save", _refuse("torch.save"))
    for helper in ("_object_to_tensor", "_tensor_to_object"):  # what the *_object collectives pickle with
        if hasattr(c10d, helper):
            monkeypatch.setattr(c10d, helper, _refuse(f"torch.distributed {helper}"))


def test_refusal_is_in_force(no_pickle):
    with pytest.raises(AssertionError):
        pickle.dumps(1)
    import torch
    with pytest.raises(AssertionError):
        torch.load(io.BytesIO(b""))


def _messages() -> list[type]:
    from scheduler.contract import protocol, protocol_commands
    from scheduler.contract.protocol_base import Message
    out = {c for m in (protocol, protocol_commands) for c in vars(m).values()
           if isinstance(c, type) and issubclass(c, Message) and dataclasses.is_dataclass(c)}
    return sorted(out, key=lambda c: c.__name__)


def _sample(tp, depth: int = 0):
    import pydantic

    from scheduler.contract.records import Columns

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return {"k": [1, "x", None]}
    if tp is type(None):
        return None
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), depth)
    if origin is typing.Literal:
        return args[0]
    if origin is list:
        return [_sample(args[0], depth + 1)] if args else [1]
    if origin is tuple:
        return tuple(_sample(a, depth + 1) for a in args if a is not Ellipsis)
    if origin is dict or tp is dict:
        return {"k": _sample(args[1], depth + 1) if args else 1}
    if dataclasses.is_dataclass(tp):
        return _build(tp)
    if isinstance(tp, type) and issubclass(tp, Columns):  # columns of named rows
        return tp.of([_sample(tp.ROW, depth + 1)])
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):  # sampling params (their rules hold)
        return tp()
    if isinstance(tp, type) and issubclass(tp, tuple):  # a NamedTuple
        hints = typing.get_type_hints(tp)
        return tp(*(_sample(hints[f], depth + 1) for f in tp._fields))
    return {str: "s-1", int: 7, float: -0.25, bool: True}[tp]


def _build(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls) if f.init})


def test_every_protocol_message_round_trips_through_json_text(no_pickle):
    from scheduler.contract.protocol import COMMANDS, EVENTS, decode_command, decode_event

    classes = _messages()
    assert len(classes) >= 20 and set(COMMANDS.values()) | set(EVENTS.values()) <= set(classes)
    for cls in classes:
        msg = _build(cls)
        wire = json.dumps(msg.to_dict(), allow_nan=False)  # plain JSON text, nothing else
        data = json.loads(wire)
        if cls in COMMANDS.values():
            back = decode_command(data)
        elif cls in EVENTS.values():
            back = decode_event(data)
        else:
            back = cls.from_dict(data)
        assert type(back) is cls and back == msg, cls.__name__


def test_every_migration_message_round_trips_through_json_text(no_pickle):
    """The handshake of a live migration (cells/migration/messages.py): JSON text both ways."""
    from cells.migration import messages

    classes = [c for c in vars(messages).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == messages.__name__]
    assert {c.__name__ for c in classes} == {"Hello", "Reservation", "KVRound", "Final", "Abort", "Ready", "Verdict"}
    for cls in classes:
        msg = _build(cls)
        back = cls.from_dict(json.loads(json.dumps(msg.to_dict(), allow_nan=False)))
        assert type(back) is cls and back == msg, cls.__name__
    final = _build(messages.Final)
    assert type(messages._ROUND.validate_python(json.loads(json.dumps(final.to_dict())))) is messages.Final


def test_a_session_through_the_api_and_the_store_without_pickle(tmp_path, no_pickle):
    from tests.scheduler.sched_fakes import FakeCell, Harness, pump

    h = Harness(str(tmp_path / "store.sqlite"))
    try:
        cells = [FakeCell(h.client, "a"), FakeCell(h.client, "b")]
        for cell in cells:
            cell.register(), cell.sync()
        assert h.client.post("/v1/versions", json={"version": 0}).status_code == 201
        fut = h.complete({"prompt_ids": [1, 2, 3], "max_tokens": 4}, session="np")
        pump(cells, until=fut, harness=h)
        assert len(fut.result(timeout=60).json()["token_ids"]) == 4
        assert h.client.post("/v1/sessions/np/finish", json={"reward": 1.0}).status_code == 200
        traj = h.client.get("/v1/trajectories").json()["trajectories"]
        assert [t["id"] for t in traj] == ["np"]
        r = h.client.post("/v1/flips", json={"cell": "a", "to": "training"}, headers={"Idempotency-Key": "k"})
        assert r.status_code == 202  # the answer is kept under its key, as JSON
        pump(cells, rounds=5, harness=h)
    finally:
        h.close()
    # the store holds text and numbers, its structured text is JSON, and its only BLOBs are the
    # token chunks' packed arrays: exactly n fixed-size numbers each (scheduler/store/tokenpack.py)
    import sqlite3
    conn = sqlite3.connect(str(tmp_path / "store.sqlite"))
    try:
        tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        assert {"cells", "flips", "versions", "idempotency", "sessions", "token_chunks"} <= set(tables)
        width = {"token_ids": 4, "logprobs": 8, "truncated": 1, "old_logprobs": 8, "provenance": 1}
        blobs = 0
        for table in tables:
            cur = conn.execute(f"SELECT * FROM {table}")
            names = [d[0] for d in cur.description]
            for row in cur:
                for name, v in zip(names, row):
                    if isinstance(v, bytes):
                        assert table == "token_chunks" and len(v) == width[name] * row[names.index("n")], (table, name)
                        blobs += 1
                    if isinstance(v, str) and v[:1] in ("{", "["):
                        json.loads(v)
        assert conn.execute("SELECT count(*) FROM idempotency").fetchone()[0] == 1
        assert blobs > 0  # the check above saw the packed columns
    finally:
        conn.close()


def test_tcpstore_rendezvous_values_are_json(no_pickle):
    pytest.importorskip("torch.distributed")
    from cells.transport.store import StoreHost, connect, get_json, set_json

    host = StoreHost("127.0.0.1", 0, timeout_s=10)
    client = connect(host.address, timeout_s=10)
    obj = {"address": host.address.to_dict(), "sizes": [1, 2, 3], "ok": True}
    set_json(client, "k", obj)
    assert get_json(host.store, "k") == obj
    assert json.loads(host.store.get("k")) == obj  # the raw value is JSON text
    host.close()


def test_local_cluster_starts_processes_with_a_config_path(tmp_path, monkeypatch, no_pickle):
    import cells.localcluster as lc

    started = []

    class FakeProc:
        def __init__(self, argv, **kw):
            started.append((argv, kw))

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

        def send_signal(self, sig):
            pass

        terminate = kill = lambda self: None

    monkeypatch.setattr(lc.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(lc.Cluster, "wait", staticmethod(lambda *a, **k: True))
    cluster = lc.Cluster(tmp_path, num_cells=2)
    try:
        assert len(started) == 3
        for argv, kw in started:
            assert all(isinstance(a, str) for a in argv), argv
            assert argv[1:3] == ["-m", "cells.cli"]
            i = argv.index("--config")
            assert yaml.safe_load(Path(argv[i + 1]).read_text()) == cluster.cfg
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in kw["env"].items())
            assert "stdin" not in kw  # nothing is piped into the child
    finally:
        cluster.stop()
