"""What one turn of a long sticky agentic session costs the control plane, decode excluded.

Measured by `python bench/tito.py [--quick] [--json]` (its `turn_*` fields; this module has
no entry of its own).

One session per context size (1k, 8k, 32k, 128k tokens): a first turn whose user message
brings the context to the size, then sticky turns each adding 200 new tokens (a user message
of ~150 tokens with its template, and a 50-token answer the cell "samples"). Each turn runs the
real parts in process, in the order a turn runs them, and times them:

- gateway: the chat body parsed (`scheduler/gateway/intake.py`), the turn planned from the
  session's kept render state (`TitoGateway.plan`), its prompt recorded, and after the answer
  the commit (drift count, parse, gateway state);
- scheduler: the completion admitted, compared by length and hash, recorded and placed, its
  `start` built (`ControlPlaneBackend.submit`), and delivered in the cell's sync response
  through the real internal route (a TestClient call: ASGI in process, no socket);
- cell: the `start` decoded and handled by the real `Commands.start` (cells/agent/held.py
  rebuilds the context from the held prefix; `EmbeddedEngine.add_request`).

Beside it, `turn_full_start_ms`: the same turn's start with the whole context (a cell that
lost the prefix, or every sticky turn before delta starts): built from the store, JSON both
ways, handled by the cell.

Not timed (decode and its streaming): the engine's steps are not run — the bench aborts the
request after its start is timed and syncs a 50-token answer for it through the real route,
as the engine loop would have. So the engine's own prefix-cache match (one C-speed list
compare over the context, ~0.3 ms at 128k) and every forward pass are outside the figure.

Bench model: the embedded engine with a tiny Qwen3 shape (hidden 32, one layer, 2 heads of
16, one KV head, Qwen3's vocabulary) and `max_position` 139,264; KV pool 2,176 blocks of 64
tokens = 139,264 tokens (one 128k context plus headroom), 17.8 MB. At Qwen3-32B on an 8-GPU
cell the control-plane parts are the same code on the same ids (the context's size in ids is
what they touch, not the model's); only the excluded prefill and decode grow with the model.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONTEXTS = (1024, 8192, 32768, 131072)
PROMPT_TOKENS, ANSWER_TOKENS = 150, 50
"""New tokens a turn adds: the user message (with its template tokens) and the answer."""
BLOCK, POOL_TOKENS = 64, 139264
MODEL = dict(preset="tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
             intermediate_size=64, max_position=POOL_TOKENS, seed=0)
WORDS = ("alpha", "beta", "gamma", "delta", "table", "index", "query", "value", "row", "file", "path", "line")
BENCH_MODEL = (f"embedded tiny Qwen3 shape (hidden 32, 1 layer, 2x16 heads, 1 KV head, vocab 151936), "
               f"max_position {POOL_TOKENS}; KV pool {POOL_TOKENS // BLOCK} blocks x {BLOCK} = {POOL_TOKENS} tokens")


def _text(tok, n: int, rng: random.Random) -> str:
    """Text of about n tokens."""
    words = [rng.choice(WORDS) for _ in range(n)]
    text = " ".join(words)
    k = len(tok.encode(text))
    return " ".join(words[:max(1, n * n // max(k, 1))])


class BenchCell:
    """One cell: the real command handler, held contexts and embedded engine, synced through
    the real internal route."""

    def __init__(self, client, cell_id: str = "bench-cell") -> None:
        from cells.agent.commands import Commands
        from cells.agent.held import HeldContexts
        from cells.engine.embedded import EmbeddedEngine
        from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

        cfg = EmbeddedEngineConfig(model=ModelConfig(**MODEL), batch_invariant=False, num_blocks=POOL_TOKENS // BLOCK,
                                   block_size=BLOCK)
        self.engine = EmbeddedEngine(cfg)
        self.client, self.cell_id, self.incarnation = client, cell_id, "bench"
        self.agent = SimpleNamespace(engine=self.engine, held=HeldContexts(), owned={}, events=[],
                                     moves=SimpleNamespace(migrate_out=None, migrate_in=None, cancel=None))
        self.agent.events_append = self.agent.events.append
        self.commands = Commands(self.agent)
        self.pending: list[dict] = []

    def register(self) -> None:
        from scheduler.contract.probe import PROBE_LEN

        r = self.client.post("/internal/v1/cells/register", json={
            "cell_id": self.cell_id, "incarnation": self.incarnation, "address": "127.0.0.1:9999",
            "store_port": 29500, "capabilities": {"kv_export": False, "scoring": True, "weight_update": "staged",
                                                  "batch_invariant": False, "block_size": BLOCK},
            "kv_blocks_total": POOL_TOKENS // BLOCK, "max_running": 4, "version": 0,
            "probe": [-1.0 - 0.01 * i for i in range(PROBE_LEN - 1)]})
        assert r.status_code == 200, r.text
        self.sync()

    def sync(self) -> list[dict]:
        """One sync: ship pending token batches and events, return the commands."""
        events = [e.to_dict() for e in self.agent.events]
        self.agent.events.clear()
        tokens, self.pending = self.pending, []
        summary = {"inflight": 0, "kv_blocks_used": 0, "kv_blocks_total": POOL_TOKENS // BLOCK, "version": 0,
                   "request_ids": [], "role": "rollout", "versions_held": [0]}
        r = self.client.post(f"/internal/v1/cells/{self.cell_id}/sync", json={
            "incarnation": self.incarnation, "summary": summary, "tokens": tokens, "events": events, "wait_s": 0.0})
        assert r.status_code == 200, r.text
        return r.json()["commands"]

    def start(self, cmd: dict) -> str:
        from scheduler.contract.protocol import decode_command

        c = decode_command(cmd)
        self.commands.handle(c)
        assert not self.agent.events, self.agent.events
        return c.request_id

    def answer(self, request_id: str, epoch: int, ids: list[int]) -> None:
        """What the engine loop would have sampled and shipped (not timed)."""
        self.engine.abort(request_id)
        for t in ids:
            self.agent.held.sampled(request_id, t)
        self.pending.append({"request_id": request_id, "epoch": epoch, "start": 0,
                             "records": [[t, -0.5, 0, False] for t in ids], "finish_reason": "stop"})


class Bench:
    """The real app (no background loop: nothing else runs between a turn's parts), a chat
    gateway over its control-plane backend, and one bench cell."""

    def __init__(self, tmp: Path) -> None:
        from fastapi.testclient import TestClient

        from scheduler.api.app import create_app
        from scheduler.contract.config import CellflipConfig
        from scheduler.contract.config.scheduler import SchedulerConfig
        from scheduler.gateway.control_backend import ControlPlaneBackend
        from scheduler.gateway.tito.backend import SimpleCounters
        from scheduler.gateway.tito.render import load_renderer
        from scheduler.gateway.tito.tito import TitoGateway

        db = str(tmp / "turns.sqlite")
        cfg = CellflipConfig(scheduler=SchedulerConfig(db_path=db, auth="none", lease_s=3600.0, min_rollout_cells=1))
        self.app = create_app(cfg, db_path=db, tick_interval_s=None, manage_gc=False)
        self.client = TestClient(self.app)
        self.client.__enter__()
        self.portal = self.client.portal
        self.renderer = load_renderer("qwen3")
        self.backend = ControlPlaneBackend(self.app)
        self.gw = TitoGateway(self.backend, self.renderer, SimpleCounters())
        self.cell = BenchCell(self.client)
        self.cell.register()

    def close(self) -> None:
        self.client.__exit__(None, None, None)

    def turn(self, sid: str, messages: list[dict], answer: list[int]) -> tuple[dict, dict, dict]:
        """One turn; (ms per part, the assistant message, the start command)."""
        from scheduler.gateway.intake import parse_chat_request
        from scheduler.gateway.tito.backend import TokenOut

        body = json.dumps({"messages": messages, "max_tokens": 64}).encode()
        t0 = time.perf_counter()
        req = parse_chat_request(body, {})
        tp = time.perf_counter()
        plan = self.portal.call(self.gw.plan, sid, req)
        run = self.gw.start(plan)
        self.portal.call(run._write_prompt)
        t1 = time.perf_counter()
        row = self.portal.call(self.backend.submit, sid, plan.prompt_ids, plan.params)
        start = next(c for c in self.cell.sync() if c["type"] == "start")
        t2 = time.perf_counter()
        self.cell.start(start)
        t3 = time.perf_counter()
        self.cell.answer(row.id, start["epoch"], answer)  # decode: not timed
        self.cell.sync()
        rows = self.app.state.controller.store.sessions.read(sid, row.base, row.base + len(answer))
        sampled = [TokenOut(t, lp, v) for t, lp, v in zip(rows.token_ids, rows.logprobs, rows.versions)]
        assert [t.token_id for t in sampled] == answer
        t4 = time.perf_counter()
        self.portal.call(run._commit, sampled, "stop", None)
        t5 = time.perf_counter()
        ms = {"gateway": 1e3 * (t1 - t0 + t5 - t4), "scheduler": 1e3 * (t2 - t1), "cell": 1e3 * (t3 - t2),
              "of which body parse": 1e3 * (tp - t0), "of which commit": 1e3 * (t5 - t4)}
        return ms, run.result.message, start


class Conversation:
    """One sticky session around `size` tokens, driven turn by turn."""

    def __init__(self, b: Bench, size: int, grow: int, rng: random.Random) -> None:
        self.b, self.size, self.rng = b, size, rng
        self.tok = b.renderer.tokenizer
        self.sid = f"turns-{size}"
        self.messages = [{"role": "user", "content": _text(self.tok, max(64, size - grow // 2), rng)}]
        self.parts: list[dict] = []
        self.start_ids: list[int] = []
        self.contexts: list[int] = []
        self.last_request = ""

    def turn(self, timed: bool) -> None:
        import gc

        answer = self.tok.encode(_text(self.tok, ANSWER_TOKENS, self.rng))[:ANSWER_TOKENS - 1]
        answer.append(self.b.renderer.close_token_id)
        gc.collect()
        ms, msg, start = self.b.turn(self.sid, self.messages, answer)
        self.last_request = start["request_id"]
        if timed:
            self.parts.append(ms)
            self.start_ids.append(len(start["token_ids"]))
            self.contexts.append(start["prompt_len"])
        user = {"role": "user", "content": _text(self.tok, PROMPT_TOKENS - 8, self.rng)}
        self.messages = self.messages + [msg, user]

    def full_start_ms(self) -> float:
        """What the last turn's start costs with the whole context (no prefix held, or before
        delta starts): built from the store, JSON both ways, handled by the cell."""
        from scheduler.contract.protocol import decode_command
        from scheduler.control.turns import start_command

        store = self.b.app.state.controller.store
        req = store.owners.get_request(self.last_request)
        req.num_generated = 0  # as it was started
        t0 = time.perf_counter()
        make, _ = self.b.portal.call(start_command, store, req, "bench-cell", None, True)
        cmd = decode_command(json.loads(json.dumps(make(0).to_dict())))
        cmd.request_id, cmd.session_id = "full-" + req.id, "full-" + self.sid  # beside the held one
        self.b.cell.commands.handle(cmd)
        ms = 1e3 * (time.perf_counter() - t0)
        self.b.cell.engine.abort(cmd.request_id)
        self.b.cell.agent.held.ended(cmd.request_id)
        return ms

    def summary(self) -> dict:
        med = {p: round(statistics.median(m[p] for m in self.parts), 2) for p in self.parts[0]}
        total = statistics.median(m["gateway"] + m["scheduler"] + m["cell"] for m in self.parts)
        return {"ms": total, "parts": med, "start_ids": max(self.start_ids),
                "context": int(statistics.median(self.contexts))}


def measure(quick: bool = False) -> dict:
    """The turn-overhead fields bench/tito.py reports."""
    rng = random.Random(45)
    warm, measured = (2, 5) if quick else (2, 10)
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(Path(tmp))
        try:
            grow = (PROMPT_TOKENS + ANSWER_TOKENS) * (warm + measured)
            convs = [Conversation(b, size, grow, rng) for size in CONTEXTS]
            for k in range(warm + measured):  # sizes in turn: the machine's noise falls on all alike
                for c in convs:
                    c.turn(timed=k >= warm)
            runs = {c.size: c.summary() for c in convs}
            full = {c.size: statistics.median(c.full_start_ms() for _ in range(3)) for c in convs}
            drift = b.gw.counters.retokenization_drift_total
            kept = dict(b.gw.planner.kept.stats)
        finally:
            b.close()
    ms = {str(s): round(r["ms"], 2) for s, r in runs.items()}
    return {
        "turn_overhead_ms": ms,
        "turn_overhead_ratio_128k_over_1k": round(runs[CONTEXTS[-1]]["ms"] / runs[CONTEXTS[0]]["ms"], 2),
        "turn_overhead_parts_ms": {str(s): r["parts"] for s, r in runs.items()},
        "turn_full_start_ms": {str(s): round(v, 2) for s, v in full.items()},
        "turn_context_tokens": {str(s): r["context"] for s, r in runs.items()},
        "turn_start_token_ids": {str(s): r["start_ids"] for s, r in runs.items()},
        "turn_new_tokens": PROMPT_TOKENS + ANSWER_TOKENS,
        "turn_gateway_drift": drift,
        "turn_kept_reads": kept,
        "turn_bench_model": BENCH_MODEL,
        "turn_measured_turns": measured,
    }

