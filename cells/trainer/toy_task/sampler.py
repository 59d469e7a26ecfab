"""Rollouts in-process: an EmbeddedEngine (batch-invariant) behind the in-process gateway.

`ToySampler` serves the engine through `LocalGateway`, with exact old log-probs scored by the
engine; `heldout_eval` scores weights greedily on the held-out episodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from cells.trainer.toy_task.clients import LocalGateway
from cells.trainer.toy_task.gateway_link import TokenOut
from cells.trainer.toy_task.harness import run_episode
from cells.trainer.toy_task.task import TOY_RENDERER, Episode, TaskSpec, heldout_episodes


class EngineDriver:
    """Async `generate` (the ReplayEngine interface) over an EmbeddedEngine, stepped on the
    gateway's loop: every request in flight shares each engine step (continuous batching).

    Call the engine's own methods (`load_weights`, `score`) only while no request is in flight.
    """

    def __init__(self, engine: Any, *, max_tokens: int = 64) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        """Cap on a completion's length (the request's own limit applies when smaller)."""
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self._turns: dict[str, int] = {}
        self.sampled_tokens = 0

    def sampling_params(self, params: Any) -> Any:
        """The gateway's `SamplingParams`, capped at this driver's `max_tokens` (its limit
        where the request set none)."""
        limit = params.max_tokens if "max_tokens" in params.model_fields_set else self.max_tokens
        return params.model_copy(update={"max_tokens": min(self.max_tokens, limit)})

    async def generate(self, session_id: str, prompt_ids: list[int], params: Any,
                       request_id: str):
        # The engine's request id (and so the sampling noise) is the session's n-th turn,
        # not the backend's global counter, which depends on how sessions interleave.
        turn = self._turns.get(session_id, 0)
        self._turns[session_id] = turn + 1
        request_id = f"{session_id}#{turn}"
        self.engine.add_request(request_id, list(prompt_ids), self.sampling_params(params),
                                cache_key=session_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, BaseException):
                    raise RuntimeError("the engine step failed") from ev
                self.sampled_tokens += 1
                rec = ev.record
                yield TokenOut(rec.token_id, rec.logprob, rec.version, ev.finish_reason)
                if ev.finish_reason is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            while self.engine.has_work():
                for ev in self.engine.step():
                    q = self._queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
                await asyncio.sleep(0)  # let finished turns and new requests in
        except Exception as e:  # fail the waiting turns rather than leave them hanging
            for q in self._queues.values():
                q.put_nowait(e)

    def forget(self, session_id: str) -> None:
        """Drop the turn counter of a finished session."""
        self._turns.pop(session_id, None)


class ToySampler:
    """Toy-task rollouts from a batch-invariant EmbeddedEngine through the in-process gateway,
    with exact old log-probs scored by the engine (the log-prob service's job in the fleet).

    Sampling noise depends on (seed, session id, turn, token index) only, and the engine is
    batch-invariant, so the same weights, session ids and seed give the same rollouts however
    the concurrent episodes interleave.
    """

    def __init__(self, model_spec: Any, weights: dict[str, Any], *, version: int = 0,
                 row_tile: int = 4, renderer: str = TOY_RENDERER, max_tokens: int = 64,
                 threads: int = 32, max_running: int = 64) -> None:
        from cells.engine.embedded import EmbeddedEngine
        from scheduler.contract.config.engine import EmbeddedEngineConfig

        cfg = EmbeddedEngineConfig(batch_invariant=True, row_tile=row_tile, num_blocks=8192,
                                   max_running=max_running, prefill_chunk=8192)
        self.engine = EmbeddedEngine(cfg, spec=model_spec, weights=weights, version=version)
        self.driver = EngineDriver(self.engine, max_tokens=max_tokens)
        self.gateway = LocalGateway(self.driver, renderer)
        self.threads = threads

    def close(self) -> None:
        self.gateway.close()

    def load(self, version: int, weights: dict[str, Any]) -> None:
        """Serve `version` (between rollout batches)."""
        self.engine.load_weights(version, weights)  # cached prefixes of old versions are
        # never reused (the engine checks the version) and are evicted when blocks run short

    def rollouts(self, episodes: Sequence[Episode], *, samples: int = 1, tag: str = "",
                 seed: int = 0, temperature: float = 1.0, max_turns: int = 6,
                 branches: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Play `samples` sessions per episode (group = the episode), concurrently; returns
        (finished trajectories with old log-probs, per-session episode stats)."""
        from concurrent.futures import ThreadPoolExecutor

        gw = self.gateway
        sampling = {"temperature": temperature, "seed": seed}
        jobs = [(ep, f"{tag}{ep.episode_id}-s{j}", f"{tag}{ep.episode_id}")
                for ep in episodes for j in range(samples)]

        def play(job: tuple[Episode, str, str]) -> dict[str, Any]:
            ep, sid, gid = job
            _, stats = run_episode(gw, ep, session_id=sid, max_turns=max_turns,
                                   sampling=sampling, branches=branches, group_id=gid,
                                   finish=gw.finish)
            return stats

        with ThreadPoolExecutor(self.threads) as pool:
            stats = list(pool.map(play, jobs))
        trajs = []
        for st in stats:
            for b in st["branches"]:
                t = gw.trajectory(b["session_id"])
                self.score_old_logprobs(t, temperature)
                trajs.append(t)
                del gw.backend.sessions[b["session_id"]]
                self.driver.forget(b["session_id"])
        gw.backend.turn_log.clear()
        return trajs, stats

    def score_old_logprobs(self, traj: dict[str, Any], temperature: float = 1.0) -> None:
        """Fill `old_logprobs` / `provenance` of the sampled tokens (exact where the engine
        holds their version, else missing)."""
        n = len(traj["token_ids"])
        starts = list(traj["segment_starts"]) + [n]
        held = set(self.engine.versions_held)
        for a, b in zip(starts, starts[1:]):
            sampled = [i for i in range(a, b) if traj["loss_mask"][i]]
            for v in sorted({traj["versions"][i] for i in sampled}):
                idx = [i for i in sampled if traj["versions"][i] == v]
                if v not in held:
                    for i in idx:
                        traj["provenance"][i] = "missing"
                    continue
                lp = self.engine.score(traj["token_ids"][a:b], temperature=temperature,
                                       version=v).tolist()
                for i in idx:
                    traj["old_logprobs"][i] = lp[i - a - 1]
                    traj["provenance"][i] = "exact"


def heldout_eval(model_spec: Any, weights: dict[str, Any], spec: TaskSpec, n: int, *,
                 row_tile: int = 4, max_turns: int = 6) -> dict[str, float]:
    """Greedy (temperature 0) score of `weights` on the first `n` held-out episodes, one
    session each, in-process: mean reward and solved rate. Deterministic for given weights."""
    sampler = ToySampler(model_spec, weights, row_tile=row_tile)
    try:
        _, stats = sampler.rollouts(heldout_episodes(spec, n), samples=1, tag="heldout-",
                                    temperature=0.0, max_turns=max_turns)
    finally:
        sampler.close()
    return {"reward": sum(s["reward"] for s in stats) / len(stats),
            "solved": sum(s["solved"] for s in stats) / len(stats)}
