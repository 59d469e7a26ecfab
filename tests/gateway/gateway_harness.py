"""Helpers shared by the gateway tests: corpus sessions, a harness, a live server."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from scheduler.gateway.tito.memory import echo_assistant

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "bench" / "data"
RENDERER_NAMES = ("qwen3", "deepseek-v3")


def load_corpus(name: str, ids: list[int] | None = None) -> list[dict]:
    rows = [
        json.loads(line)
        for line in open(CORPUS / f"tito_corpus_{name}.jsonl", encoding="utf-8")
        if line.strip()
    ]
    return rows if ids is None else [rows[i] for i in ids]


def next_messages(messages: list[dict], message: dict, turn: dict, mode: str) -> list[dict]:
    out = messages + [echo_assistant(message, mode)]
    for tc, result in zip(message.get("tool_calls") or [], turn["tool_results"], strict=False):
        out.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    if turn.get("user_followup"):
        out.append({"role": "user", "content": turn["user_followup"]})
    return out


def renderer_view(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class LiveServer:
    """A uvicorn server in a thread, serving one FastAPI app on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
