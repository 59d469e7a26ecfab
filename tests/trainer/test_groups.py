"""Groups are taken whole: the finishing-order split, the deadline, the leftover, trees,
stale members, dynamic sampling; and the trainer's call site."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from cells.rl.objectives.advantages import grpo_advantages
from cells.trainer.groups import GroupGate
from cells.trainer.trainer import Trainer

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def traj(sid: str, reward: float, group: str | None = "g", **kw) -> dict:
    return {"id": sid, "reward": reward, "group_id": group, **kw}


def _advantages(ts: list[dict]) -> list[float]:
    rewards = torch.tensor([t["reward"] for t in ts], dtype=torch.float64)
    return grpo_advantages(rewards, torch.zeros(len(ts), dtype=torch.long)).tolist()


def _fake_trainer(group_size=4, deadline_s=60.0, drop_uniform=False, clock=None):
    """What `Trainer._complete_groups` and `_step`'s batching loop touch."""
    reports, events = [], []
    fake = SimpleNamespace(
        batch=[], groups=GroupGate(group_size, deadline_s=deadline_s, drop_uniform=drop_uniform,
                                   clock=clock or Clock()),
        client=SimpleNamespace(report_dropped=lambda *a: reports.append(a)),
        _emit=events.append, reports=reports, events=events)
    return fake


def test_finishing_order_does_not_split_a_group():
    # rewards {0, 0, 1, 1}: the two skips are short and finish first
    fake = _fake_trainer()
    fake.batch = [traj("s0", 0.0), traj("s1", 0.0)]
    assert Trainer._complete_groups(fake, 16) == []  # half a group waits
    fake.batch += [traj("s2", 1.0), traj("s3", 1.0)]
    batch = Trainer._complete_groups(fake, 16)
    assert [t["id"] for t in batch] == ["s0", "s1", "s2", "s3"] and fake.batch == []
    adv = _advantages(batch)
    assert adv == pytest.approx([-0.866, -0.866, 0.866, 0.866], abs=1e-3)  # not [0, 0] and [0, 0]


def test_deadline_drops_the_group_whole_and_counts_it():
    clock = Clock()
    fake = _fake_trainer(deadline_s=60.0, clock=clock)
    fake.batch = [traj("s0", 0.0), traj("s1", 1.0), traj("s2", 1.0)]
    assert Trainer._complete_groups(fake, 16) == []
    clock.t += 59.0
    assert Trainer._complete_groups(fake, 16) == [] and len(fake.batch) == 3
    clock.t += 2.0
    assert Trainer._complete_groups(fake, 16) == []
    assert fake.batch == []  # nothing stays in the batch forever
    assert fake.groups.groups_dropped["deadline"] == 1
    assert fake.reports == [("deadline", 1, 3)]
    # the straggler arrives later: dropped with its group, not the start of a new one
    fake.batch = [traj("s3", 0.0)]
    assert Trainer._complete_groups(fake, 16) == [] and fake.batch == []
    assert fake.groups.groups_dropped["deadline"] == 1
    assert fake.groups.trajectories_dropped["deadline"] == 4


def test_a_lone_leftover_is_never_trained_and_leaves_the_batch():
    clock = Clock()
    fake = _fake_trainer(group_size=2, deadline_s=30.0, clock=clock)
    fake.batch = [traj("a0", 1.0, "ga"), traj("a1", 0.0, "ga"), traj("b0", 1.0, "gb")]
    assert [t["id"] for t in Trainer._complete_groups(fake, 16)] == ["a0", "a1"]
    assert [t["id"] for t in fake.batch] == ["b0"]
    clock.t += 31.0
    assert Trainer._complete_groups(fake, 16) == [] and fake.batch == []
    assert fake.groups.groups_dropped["deadline"] == 1


def test_the_batch_loop_takes_whole_groups_oldest_first():
    clock = Clock()
    gate = GroupGate(2, deadline_s=60.0, clock=clock)
    pending = [traj("x0", 1.0, "gx"), traj("x1", 0.0, "gx")]
    assert gate.select(pending[:1], 10).ready == []
    clock.t += 1.0
    pending += [traj("y0", 1.0, "gy"), traj("y1", 0.0, "gy"), traj("z0", 1.0, "gz"), traj("z1", 0.0, "gz")]
    sel = gate.select(pending, 3)  # two whole groups pass 3; never a split one
    assert [t["id"] for t in sel.ready] == ["x0", "x1", "y0", "y1"]


def test_a_tree_is_one_member_complete_when_its_trunk_finished():
    gate = GroupGate(2, deadline_s=60.0, clock=Clock())
    # member e0 forked into three branches: e0.b1 and e0.b2 finish before the trunk e0
    pending = [traj("e0.b1", 1.0), traj("e0.b2", 0.0), traj("e1", 1.0)]
    assert gate.select(pending, 10).ready == []  # e0 not finished: one member of two
    pending.append(traj("e0", 0.5))
    assert {t["id"] for t in gate.select(pending, 10).ready} == {"e0", "e0.b1", "e0.b2", "e1"}


def test_a_member_dropped_as_stale_drops_its_group_at_once():
    fake = _fake_trainer(group_size=3)
    fake.batch = [traj("s0", 1.0), traj("s1", 0.0, dropped="stale", staleness=9)]
    assert Trainer._complete_groups(fake, 16) == [] and fake.batch == []
    assert fake.groups.groups_dropped["stale"] == 1 and fake.reports == [("stale", 1, 2)]


def test_dynamic_sampling_drops_equal_reward_groups_when_on():
    on = GroupGate(2, deadline_s=60.0, drop_uniform=True, clock=Clock())
    sel = on.select([traj("a", 1.0, "g1"), traj("b", 1.0, "g1"), traj("c", 1.0, "g2"), traj("d", 0.0, "g2")], 10)
    assert [t["id"] for t in sel.ready] == ["c", "d"] and sel.groups_dropped["uniform_reward"] == 1
    off = GroupGate(2, deadline_s=60.0, clock=Clock())
    assert len(off.select([traj("a", 1.0), traj("b", 1.0)], 10).ready) == 2


def test_no_group_id_is_dropped_and_counted():
    gate = GroupGate(2, deadline_s=60.0, clock=Clock())
    sel = gate.select([traj("a", 1.0, None)], 10)
    assert sel.ready == [] and gate.groups_dropped["no_group"] == 1
    with pytest.raises(ValueError, match="group_size"):
        GroupGate(1, deadline_s=1.0)


def test_step_collects_a_batch_of_whole_groups():
    # `_step`'s loop: fetch, take whole groups until batch_episodes, sleep otherwise
    arrivals = [[traj("s0", 0.0), traj("s1", 0.0)], [traj("s2", 1.0), traj("s3", 1.0)]]
    fake = _fake_trainer()
    fake.tc = SimpleNamespace(batch_episodes=4)
    fake.client.trajectories = lambda limit: arrivals.pop(0) if arrivals else []
    taken = []

    def stop_after_batch(batch):
        taken.append(batch)
        raise StopIteration

    fake._complete_groups = lambda limit: Trainer._complete_groups(fake, limit)
    fake.cells = SimpleNamespace(acquire=lambda untrained=0: stop_after_batch(untrained))
    with pytest.raises(StopIteration):
        Trainer._step(fake, threading.Event())
    assert fake.batch == [] and taken == [4]  # the step declares its 4 fetched, untrained sessions


def test_the_harness_finishes_a_tree_trunk_last():
    from cells.trainer.toy_task import TaskSpec, make_episode, run_episode

    order = []

    def chat(messages, tools, session_id, **sampling):  # calls the tool once, then answers
        calls = sum(1 for m in messages if m["role"] == "assistant")
        if calls == 0:
            return {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"item": 1}'}}]}
        return {"role": "assistant", "content": "unknown"}

    run_episode(chat, make_episode(TaskSpec(), 0), session_id="e", branches=3, group_id="g",
                finish=lambda sid, reward, gid: order.append(sid))
    assert order[-1] == "e" and sorted(order) == ["e", "e.b1", "e.b2"]
