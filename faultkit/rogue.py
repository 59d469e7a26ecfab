"""A rogue cell for the fault campaign: a thread that holds the cell token and speaks the cell
protocol over HTTP like a cell, but lies.

Modes:
- `bad_probe`: registers with a probe answer no model gives (the scheduler must refuse it);
- `oov`: registers with the right probe (it holds the model), takes requests, and reports a
  token id outside the model's vocabulary;
- `neg_inf`: likewise, reporting a log-prob of -inf;
- `wrong_logprobs`: samples the right tokens (the real engine, batch-invariant) but reports
  log-probs that are not theirs; a verified cell's exact scoring must catch it.
Every request it is given is recorded (`given`); it stops when it is told it is fenced.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx

from scheduler.contract.probe import PROBE_LEN

MODES = ("bad_probe", "oov", "neg_inf", "wrong_logprobs")
WRONG_LOGPROB = -0.6931  # a plausible value (log 1/2), not the token's


class RogueCell(threading.Thread):
    def __init__(self, url: str, token: str, cell_id: str, mode: str, engine: Any, probe: list[float],
                 boot_version: int, serve_version: int, vocab_size: int) -> None:
        super().__init__(daemon=True, name=f"rogue-{cell_id}")
        assert mode in MODES, mode
        self.url, self.cell_id, self.mode = url, cell_id, mode
        self.http = httpx.Client(base_url=url, timeout=20.0, headers={"Authorization": f"Bearer {token}"})
        self.engine, self.probe = engine, probe
        self.boot_version, self.serve_version, self.vocab_size = boot_version, serve_version, vocab_size
        self.incarnation = uuid.uuid4().hex
        self.register_answer: tuple[int, dict] | None = None
        self.given: list[str] = []
        """Requests the scheduler placed on it."""
        self.fenced = threading.Event()
        self.stop = threading.Event()
        self.held: dict[str, dict] = {}
        self.outbox: list[dict] = []
        self.events: list[dict] = []
        """Events for the next sync: it holds no session's context, so a sticky turn's delta
        start is answered with prefix_missing (the scheduler then sends the whole context)."""

    def _register(self) -> bool:
        probe = [-0.5] * (PROBE_LEN - 1) if self.mode == "bad_probe" else self.probe
        caps = self.engine.capabilities
        r = self.http.post("/internal/v1/cells/register", json={
            "cell_id": self.cell_id, "incarnation": self.incarnation, "address": "127.0.0.1:1", "store_port": 1,
            "capabilities": {"kv_export": False, "scoring": True, "weight_update": "staged",
                             "batch_invariant": True, "block_size": caps.block_size, "vocab_size": caps.vocab_size,
                             "max_context": caps.max_context,
                             "output_ranges": [list(x) for x in caps.output_ranges] if caps.output_ranges else None},
            "kv_blocks_total": 256, "max_running": 4, "version": self.boot_version, "probe": probe})
        self.register_answer = (r.status_code, r.json())
        return r.status_code == 200

    def run(self) -> None:
        try:
            if not self._register():
                return
            while not self.stop.is_set() and not self.fenced.is_set():
                self._sync()
                time.sleep(0.05)
        except httpx.HTTPError:
            pass
        finally:
            self.http.close()

    def _sync(self) -> None:
        tokens, self.outbox = self.outbox, []
        events, self.events = self.events, []
        body = {"incarnation": self.incarnation, "tokens": tokens, "events": events, "wait_s": 0.0,
                "summary": {"inflight": len(self.held), "kv_blocks_used": len(self.held), "kv_blocks_total": 256,
                            "version": self.serve_version, "request_ids": sorted(self.held), "role": "rollout",
                            "versions_held": [self.serve_version]}}
        # json.dumps writes -Infinity (and Python's JSON reader on the other side takes it)
        r = self.http.post(f"/internal/v1/cells/{self.cell_id}/sync", content=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        if r.status_code == 409 or r.status_code == 404:
            self.fenced.set()
            return
        body = r.json()
        for rid in body.get("rejected", []):
            self.held.pop(rid, None)
        for cmd in body.get("commands", []):
            if cmd["type"] == "start" and cmd.get("prefix_hash") is not None:
                self.events.append({"type": "prefix_missing", "request_id": cmd["request_id"], "epoch": cmd["epoch"]})
            elif cmd["type"] == "start":
                self.given.append(cmd["request_id"])
                self.held[cmd["request_id"]] = cmd
                self.outbox.append(self._lie(cmd))
            elif cmd["type"] in ("abort", "suspend"):
                self.held.pop(cmd["request_id"], None)

    def _lie(self, cmd: dict) -> dict:
        """The whole completion in one batch, with this mode's lie in it."""
        from cells.engine.records import SamplingParams

        n0 = cmd["num_generated"]
        params = cmd["params"]
        if self.mode == "wrong_logprobs":
            self.engine.add_request(cmd["request_id"], cmd["token_ids"], SamplingParams(
                max_tokens=params["max_tokens"], seed=params.get("seed", 0),
                temperature=params.get("temperature", 1.0)), prompt_len=cmd["prompt_len"])
            records = []
            while self.engine.has_work():
                records += [[e.record.token_id, WRONG_LOGPROB, self.serve_version, False] for e in self.engine.step()]
            return {"request_id": cmd["request_id"], "epoch": cmd["epoch"], "start": n0, "records": records,
                    "finish_reason": "length"}
        bad = ([self.vocab_size + 7, -0.5, self.serve_version, False] if self.mode == "oov"
               else [3, float("-inf"), self.serve_version, False])
        return {"request_id": cmd["request_id"], "epoch": cmd["epoch"], "start": n0, "records": [bad],
                "finish_reason": None}
