"""A real cluster on one machine: the scheduler and cell processes on 127.0.0.1.

Used by `cellflip up`, the multi-process tests and the benches. Every process is started
and stopped here (no broad kills); every wait is bounded. Each process gets the token of its
scope and no other (scheduler/contract/tokens.py): cells the cell token, the trainer the trainer
and agent tokens; the `http` client here (the operator's) holds the admin token.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import yaml

from cells.client import all_cells
from scheduler.contract.tokens import SCOPE_ENV, SCOPES, TOKEN_ENV, auth_headers, scoped_env

ROOT = Path(__file__).resolve().parents[1]


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMALL_MODEL = {"preset": "tiny", "vocab_size": 1024, "hidden_size": 128, "num_layers": 2, "head_dim": 32,
               "intermediate_size": 256, "output_id_ranges": [[0, 1024]]}


def cluster_config(tmp: Path, **over) -> dict:
    cfg = {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 2.0, "heartbeat_s": 0.2,
                      "min_rollout_cells": 1, "drain_deadline_s": 20.0},
        "cells": {"count": 3, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 512,
                                         "block_size": 8, "batch_invariant": True}},
        "migration": {"transfer_timeout_s": 5.0},
    }
    for key, val in over.items():
        section, _, field = key.partition("__")
        cfg.setdefault(section, {})[field] = val
    return cfg


class Cluster:
    """`cfg` is a full config dict (default: the small test model with `over` applied as
    `section__field=value`)."""

    def __init__(self, tmp: Path, num_cells: int = 3, cell_env: dict[int, dict] | None = None,
                 cfg: dict | None = None, port: int | None = None, cell_args: dict[int, list[str]] | None = None,
                 ready_timeout_s: float = 120, progress=None, **over):
        self.tmp = Path(tmp).resolve()
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg if cfg is not None else cluster_config(self.tmp, **over)
        self.cfg_path = self.tmp / "cluster.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.cfg))
        self.port = port or find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tokens = self._tokens()
        self.token = self.tokens["admin"] if self.tokens else None
        self.env = {k: v for k, v in os.environ.items() if k not in SCOPE_ENV.values()}
        self.env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        self.env.pop("CELLFLIP_FAILPOINTS", None)
        self.headers = auth_headers(self.token)
        self.progress = progress or (lambda msg: None)
        self._reported: int | None = None
        self.cell_env = cell_env or {}
        self.cell_args = cell_args or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.http = httpx.Client(base_url=self.url, timeout=30.0, headers=self.headers)
        try:
            self.progress(f"starting the scheduler on {self.url}")
            self.start_scheduler()
            self.progress(f"starting {num_cells} cells (each loads its model, then registers)")
            for i in range(num_cells):
                self.start_cell(i)
            self.wait(lambda: self._rollout_cells(num_cells) >= num_cells, ready_timeout_s, "cells up")
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise

    def _tokens(self) -> dict[str, str] | None:
        """Every scope's bootstrap token, as the scheduler will read them (the config's files,
        the scopes' variables, else the files generated beside the store now); None where the
        config turns auth off."""
        from scheduler.contract.config import parse_config
        from scheduler.contract.tokens import server_tokens

        return server_tokens(parse_config(self.cfg).scheduler)

    @property
    def agent_token(self) -> str | None:
        """The agents' token (what a client of the gateway or `/v1/generate` holds)."""
        return self.tokens["agent"] if self.tokens else None

    @property
    def trainer_token(self) -> str | None:
        return self.tokens["trainer"] if self.tokens else None

    def scoped_env(self, *scopes: str) -> dict[str, str | None]:
        """Environment updates giving a process the tokens of `scopes` and no other."""
        return scoped_env(self.tokens, *scopes)

    def _rollout_cells(self, want: int) -> int:
        n = len([c for c in self.cells() if c["state"] == "rollout"])
        if n != self._reported:
            self._reported = n
            self.progress(f"cells in rollout: {n}/{want}")
        return n

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> None:
        """Start `cellflip <args>`; `env` updates the cluster's environment (a None value removes
        the variable)."""
        log = open(self.tmp / f"{name}.log", "a")
        full = {**self.env, **(env or {})}
        full = {k: v for k, v in full.items() if v is not None}
        # cwd: the caller's, so relative paths in the config mean what they meant to the caller
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "cells.cli", *args], cwd=os.getcwd(),
                                            env=full, stdout=log, stderr=subprocess.STDOUT)

    def start_scheduler(self, env: dict | None = None) -> None:
        self._spawn("scheduler", ["scheduler", "--config", str(self.cfg_path), "--port", str(self.port)],
                    {**self.scoped_env(*SCOPES), **(env or {})})
        self.wait(self._healthy, 30, "scheduler healthy")

    def start_cell(self, i: int) -> None:
        self._spawn(f"cell-{i}", ["cell", "--config", str(self.cfg_path), "--scheduler", self.url,
                                  "--cell-id", f"cell-{i}", *self.cell_args.get(i, [])],
                    {**self.scoped_env("cell"), **self.cell_env.get(i, {})})

    def start_trainer(self, args: list[str], env: dict | None = None, name: str = "trainer") -> None:
        """A trainer process (`cellflip trainer …`): the trainer's and the agents' tokens only
        (`env` may give it others of those scopes: an RL job's own)."""
        self._spawn(name, ["trainer", *args], {**self.scoped_env("trainer", "agent"), **(env or {})})

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=10)

    def _healthy(self) -> bool:
        try:
            return self.http.get("/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = 10.0) -> list[str]:
        """SIGTERM every process, then SIGKILL what is still there after `grace_s`; returns the
        names of the processes that had to be killed (none, when shutdown is clean)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.terminate()
        killed = []
        deadline = time.monotonic() + grace_s
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
                killed.append(name)
        self.http.close()
        return killed

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log")))

    # -- API --------------------------------------------------------------------------------
    @staticmethod
    def wait(pred, timeout_s: float, what: str, every: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                v = pred()
            except httpx.HTTPError:
                v = None
            if v:
                return v
            time.sleep(every)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")

    def cells(self) -> list[dict]:
        return all_cells(self.http, "")

    def cell(self, cell_id: str) -> dict:
        return self.http.get(f"/v1/cells/{cell_id}").json()

    def flip(self, cell: str, to: str, **kw) -> dict:
        r = self.http.post("/v1/flips", json={"cell": cell, "to": to, **kw})
        assert r.status_code == 202, r.text
        return r.json()

    def session(self, session_id: str) -> dict:
        return self.http.get(f"/v1/sessions/{session_id}").json()

    def sampled_tokens(self, session_id: str) -> list[int]:
        """The session's sampled tokens (loss mask 1) as the durable store holds them."""
        s = self.session(session_id)
        return [t for t, m in zip(s["token_ids"], s["loss_mask"]) if m == 1]

    def flip_state(self, flip_id: str) -> dict:
        return self.http.get(f"/v1/flips/{flip_id}").json()

    def wait_flip(self, flip_id: str, timeout_s: float = 60) -> dict:
        return self.wait(lambda: (f := self.flip_state(flip_id))["state"] in ("done", "failed", "rolled_back") and f,
                         timeout_s, f"flip {flip_id}")


class Streamer(threading.Thread):
    """A client of one streamed completion; records each token's arrival time.

    `reconnect`: a client as a real one is written: the request carries an Idempotency-Key,
    and a stream that breaks (the scheduler restarted, the connection dropped) is followed
    again under the same key until `timeout_s` — the replay starts at the request's first token,
    so the tokens already received are skipped, and a replay that disagrees with them is a
    `replay_mismatch` (what a client would see as its text changing under it). `reconnects`
    counts the follows after the first; `error` is set only when no follow completed."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, seed: int, timeout_s: float = 180,
                 token: str | None = None, reconnect: bool = False):
        super().__init__(daemon=True)
        self.headers = auth_headers(token or os.environ.get(SCOPE_ENV["agent"]) or os.environ.get(TOKEN_ENV))
        self.url, self.prompt, self.max_tokens, self.seed, self.timeout_s = url, prompt, max_tokens, seed, timeout_s
        self.reconnect = reconnect
        self.key = f"stream-{uuid.uuid4().hex}"
        self.request_id: str | None = None
        self.session_id: str | None = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.times: list[float] = []
        self.wall_times: list[float] = []
        """Arrival instants on the wall clock, comparable with the cells' migration marks."""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.finished_at: float | None = None
        """When the finish arrived (monotonic clock)."""
        self.reconnects = 0
        self.replay_mismatch: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    self._follow(max(1.0, deadline - time.monotonic()))
                    return
                except (httpx.TransportError, httpx.RemoteProtocolError) as e:
                    if not self.reconnect or time.monotonic() >= deadline:
                        self.error = repr(e)
                        return
                    self.reconnects += 1
                    time.sleep(0.2)
        except Exception as e:  # reported by the test
            self.error = repr(e)
        finally:
            self.started.set()

    def _follow(self, timeout_s: float) -> None:
        body = {"prompt_ids": self.prompt, "max_tokens": self.max_tokens, "seed": self.seed, "stream": True}
        headers = {**self.headers, "Idempotency-Key": self.key} if self.reconnect else self.headers
        skip = len(self.tokens)  # a replay starts at the first token
        with httpx.stream("POST", f"{self.url}/v1/generate", json=body, headers=headers, timeout=timeout_s) as r:
            if r.status_code != 200:
                if self.reconnect and r.status_code in (502, 503) and self.request_id is not None:
                    raise httpx.RemoteProtocolError(f"{r.status_code} while the scheduler restarts")
                self.error = f"{r.status_code}: {r.read()[:300]!r}"
                return
            self.request_id = r.headers.get("X-Request-Id")
            self.session_id = r.headers.get("X-Session-Id")
            seen = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                now, wall = time.monotonic(), time.time()
                for t, lp in zip(msg.get("token_ids", []), msg.get("logprobs", [])):
                    if seen < skip:
                        if t != self.tokens[seen] and self.replay_mismatch is None:
                            self.replay_mismatch = f"token {seen}: {self.tokens[seen]} first, {t} on the replay"
                        seen += 1
                        continue
                    seen += 1
                    self.tokens.append(t)
                    self.logprobs.append(lp)
                    self.times.append(now)
                    self.wall_times.append(wall)
                self.started.set()
                if msg.get("finish_reason"):
                    self.finish_reason = msg["finish_reason"]
                    self.finished_at = now
            if self.finish_reason is None and self.reconnect:  # the stream ended early: a drop
                raise httpx.RemoteProtocolError("the stream ended without a finish")


def reference_tokens(cfg: dict, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    """The same request on one in-process engine, never moved (batch-invariant mode)."""
    from cells.engine.embedded import EmbeddedEngine
    from cells.engine.records import SamplingParams
    from scheduler.contract.config import parse_config

    eng = EmbeddedEngine(parse_config(cfg).cells.engine)
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
    out = []
    while eng.has_work():
        out += [e.record.token_id for e in eng.step()]
    return out
