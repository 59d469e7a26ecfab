"""Agent harnesses for the toy task: episodes in flight against the scheduler's gateway.

Each worker thread plays episodes back to back through `/v1/chat/completions` (the gateway
records the tokens; nothing here tokenizes) and closes every session into a trajectory with
its reward and group id. Episodes come in groups of `group_size` (the same task instance with
different sampling seeds: a GRPO/RLOO group); a share of them fork into sub-agent branches
(rollout trees). A 429 (no rollout cell has room, e.g. while cells train) is retried after
its Retry-After; any other failure abandons the episode and is counted as lost.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field

from cells.trainer.toy_task import ChatError, HttpChat, TaskSpec, make_episode, run_episode
from scheduler.contract.config.trainer import TrainerConfig

log = logging.getLogger("cellflip.agents")

RETRY_S = 0.5


@dataclass
class AgentStats:
    episodes: int = 0
    sessions: int = 0
    lost: int = 0
    retries: int = 0
    long_rollouts: int = 0
    rewards: list[float] = field(default_factory=list)
    last_error: str = ""


class AgentPool:
    def __init__(self, url: str, cfg: TrainerConfig, *, token: str | None = None, finish_token: str | None = None,
                 run_tag: str = "run") -> None:
        """`token`: the agents' (the gateway, their own sessions); `finish_token`: the trainer's,
        which closes each session with the reward the harness computed (an agent cannot set its
        own reward). None: read as every client reads its scope's token."""
        from scheduler.contract.tokens import client_token

        self.url, self.cfg, self.tag = url, cfg, run_tag
        self.token = token if token is not None else client_token(scope="agent")
        self.finish_token = finish_token if finish_token is not None else client_token(scope="trainer")
        self.stats = AgentStats()
        self.task = TaskSpec.variant(cfg.seed, cfg.task)
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.paused = threading.Event()
        """Set: workers start no new episode (running ones finish)."""

    def start(self) -> None:
        for i in range(self.cfg.agents):
            t = threading.Thread(target=self._worker, args=(i,), name=f"agent-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> tuple[int, int]:
        """(episode index, sample within its group)."""
        with self._lock:
            n = next(self._next)
        return n // self.cfg.group_size, n % self.cfg.group_size

    def _worker(self, i: int) -> None:
        chat = _RetryingChat(HttpChat(self.url, self.token, timeout=600.0, finish_token=self.finish_token), self)
        try:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.1)
                    continue
                index, sample = self._take()
                self._play(chat, index, sample)
        finally:
            chat.inner.close()

    def _play(self, chat: _RetryingChat, index: int, sample: int) -> None:
        cfg = self.cfg
        episode = make_episode(self.task, index)
        rng = random.Random(hash((cfg.seed, index, sample)) & 0xFFFFFFFF)
        branches = rng.choice((2, 3)) if rng.random() < cfg.branch_fraction else 1
        sid = f"{self.tag}-e{index}-s{sample}"
        sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens_per_turn,
                    "seed": rng.randrange(1 << 30)}
        try:
            reward, stats = run_episode(chat, episode, session_id=sid, max_turns=cfg.max_turns, sampling=sampling,
                                        branches=branches, group_id=f"{self.tag}-g{index}", finish=chat.finish)
        except Exception as e:  # the episode is lost: counted, shown, never silent
            with self._lock:
                self.stats.lost += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("episode %s lost: %s", sid, e)
            return
        with self._lock:
            self.stats.episodes += 1
            self.stats.sessions += len(stats["branches"])
            self.stats.rewards.append(reward)
        if rng.random() < cfg.long_fraction:
            self._long(chat.inner, sid, rng)

    def _long(self, chat: HttpChat, sid: str, rng: random.Random) -> None:
        """A long continuation of a finished episode's tokens (token-in, never re-encoded) on
        a session of its own, left unfinished: its tokens are sampled, recorded and scored
        like any others, but it is no trajectory and never trained on."""
        n = min(self.cfg.long_max_tokens, int(256 * rng.paretovariate(1.5)))
        try:
            ids = chat.client.get(f"/v1/sessions/{sid}", headers=chat.headers).json()["token_ids"]
            r = chat.client.post("/v1/generate", headers={**chat.headers, "X-Session-Id": f"{sid}.long"},
                                 json={"prompt_ids": ids, "max_tokens": n, "temperature": self.cfg.temperature,
                                       "seed": rng.randrange(1 << 30)})
            if r.status_code == 429:
                return  # no room now: skip it, it is no trajectory
            r.raise_for_status()
            with self._lock:
                self.stats.long_rollouts += 1
        except Exception as e:
            with self._lock:
                self.stats.lost += 1
                self.stats.last_error = f"long rollout: {type(e).__name__}: {e}"[:300]


class _RetryingChat:
    """Retries 429s (no rollout room) until the pool stops; other errors propagate."""

    def __init__(self, inner: HttpChat, pool: AgentPool) -> None:
        self.inner, self.pool = inner, pool

    def _retry(self, fn, *args, **kw):
        while True:
            try:
                return fn(*args, **kw)
            except ChatError as e:
                if e.status != 429 or self.pool.stop.is_set():
                    raise
                with self.pool._lock:
                    self.pool.stats.retries += 1
                time.sleep(RETRY_S)

    def __call__(self, messages, tools, session_id, **sampling):
        return self._retry(self.inner, messages, tools, session_id, **sampling)

    def finish(self, session_id: str, reward: float, group_id: str | None = None):
        return self._retry(self.inner.finish, session_id, reward, group_id)
