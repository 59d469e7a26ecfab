"""Play toy-task episodes against a chat endpoint.

    python -m cells.trainer.toy_task --url http://127.0.0.1:8000 [--token T] [--episodes 8]
"""

from __future__ import annotations

import argparse
import json

from cells.trainer.toy_task.clients import HttpChat
from cells.trainer.toy_task.harness import run_episode
from cells.trainer.toy_task.task import TaskSpec, make_episodes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Play toy-task episodes against a chat endpoint.")
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", default=None, help="an agent token (the chat turns)")
    p.add_argument("--finish-token", default=None,
                   help="a trainer token, which closes each session with its reward (default: --token)")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--branches", type=int, default=1)
    args = p.parse_args(argv)
    spec = TaskSpec(seed=args.seed)
    chat = HttpChat(args.url, args.token, finish_token=args.finish_token)
    rewards = []
    for ep in make_episodes(spec, args.episodes):
        r, stats = run_episode(chat, ep, session_id=ep.episode_id, branches=args.branches,
                               group_id=ep.episode_id, finish=chat.finish)
        rewards.append(r)
        print(json.dumps({k: v for k, v in stats.items() if k != "branches"}))
    print(json.dumps({"mean_reward": sum(rewards) / len(rewards)}))


if __name__ == "__main__":
    main()
