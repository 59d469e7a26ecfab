"""Chat clients of the harness: the scheduler's gateway over HTTP, or in-process.

`HttpChat` posts to `/v1/chat/completions` and `/v1/sessions/{id}/finish`; `LocalGateway`
runs the real gateway logic over an in-memory session store on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cells.trainer.toy_task import gateway_link
from cells.trainer.toy_task.task import TOY_RENDERER


class ChatError(RuntimeError):
    """The chat endpoint refused a request."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"chat endpoint answered {status}: {body}")
        self.status = status
        self.body = body


class HttpChat:
    """`ChatFn` over the scheduler's OpenAI-compatible gateway (`/v1/chat/completions`, the
    session in `X-Session-Id`), plus `finish` (`/v1/sessions/{id}/finish`). `token` is the
    agent's; `finish_token` the trainer's (finishing sets the reward: no agent token may),
    `token` when not given."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 120.0,
                 client: Any = None, finish_token: str | None = None) -> None:
        import httpx

        self.client = client if client is not None else httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        finish_token = finish_token or token
        self.finish_headers = {"Authorization": f"Bearer {finish_token}"} if finish_token else {}

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 session_id: str, **sampling: Any) -> dict[str, Any]:
        body = {"messages": messages, **({"tools": tools} if tools else {}), **sampling}
        r = self.client.post("/v1/chat/completions", json=body,
                             headers={**self.headers, "X-Session-Id": session_id})
        if r.status_code != 200:
            raise ChatError(r.status_code, r.text)
        return r.json()["choices"][0]["message"]

    def finish(self, session_id: str, reward: float, group_id: str | None = None) -> dict[str, Any]:
        r = self.client.post(f"/v1/sessions/{session_id}/finish",
                             json={"reward": reward, "group_id": group_id}, headers=self.finish_headers)
        if r.status_code != 200:
            raise ChatError(r.status_code, r.text)
        return r.json()

    def close(self) -> None:
        self.client.close()


class LocalGateway:
    """The real TitoGateway over an in-memory session store, on a private event-loop thread.

    A `ChatFn` usable from any number of threads (the turns of concurrent episodes then meet
    in the same engine steps). `engine` is anything with the ReplayEngine's async `generate`
    (a ReplayEngine for scripted demos, an `EngineDriver` around an EmbeddedEngine to sample).
    """

    def __init__(self, engine: Any, renderer: str = TOY_RENDERER) -> None:
        self.backend, self.renderer, self.gateway = gateway_link.local_gateway(engine, renderer)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="toy-gateway")
        self._thread.start()

    def __enter__(self) -> LocalGateway:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the gateway's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 session_id: str, **sampling: Any) -> dict[str, Any]:
        body = {"messages": messages, **({"tools": tools} if tools else {}), **sampling}
        try:
            return self.run(gateway_link.chat_turn(self.gateway, session_id, body))
        except gateway_link.GatewayError as e:
            raise ChatError(e.status, e.message) from None

    def finish(self, session_id: str, reward: float, group_id: str | None = None) -> dict[str, Any]:
        return self.run(self.backend.finish_session(session_id, reward, group_id))

    def trajectory(self, session_id: str) -> dict[str, Any]:
        """The session in the store's `to_api` format (old log-probs not yet scored)."""
        sess = self.backend.sessions[session_id]
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float | None] = []
        versions: list[int | None] = []
        starts: list[int] = []
        for seg in sess.segments:
            starts.append(len(ids))
            ids += seg.token_ids
            mask += seg.loss_mask
            lps += seg.logprobs
            versions += seg.versions
        n = len(ids)
        return {
            "id": session_id, "state": "finished" if sess.finished else "open",
            "reward": sess.reward, "group_id": sess.group_id, "segment_starts": starts,
            "token_ids": ids, "loss_mask": mask, "logprobs": lps, "versions": versions,
            "old_logprobs": [None] * n, "provenance": [None] * n,
        }

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()
