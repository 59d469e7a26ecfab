"""`cellflip cell --job`: the agent registers with its model and the chosen job, once; a
refused registration (an unknown or draining job, another model) ends the cell before it
serves. The scheduler is played by a fake client."""

from __future__ import annotations

import threading

import pytest
import torch

from cells.agent import CellAgent
from cells.client import Refused
from cells.engine.embedded import EmbeddedEngine
from scheduler.contract.config import parse_config
from scheduler.contract.protocol import RegisterResponse

torch.set_num_threads(1)


class _Client:
    def __init__(self, refuse: str | None) -> None:
        self.refuse, self.sent = refuse, []

    def register(self, req):
        self.sent.append(req)
        if self.refuse:
            raise Refused(self.refuse, f"job {req.job!r}")
        return RegisterResponse(1, 5.0, 0.5)

    def close(self) -> None:
        pass


def _agent(job: str | None) -> CellAgent:
    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 64,
                                             "block_size": 16}}})
    return CellAgent(cfg, cell_id="c-job", scheduler_url="http://127.0.0.1:9", engine=EmbeddedEngine(cfg.cells.engine),
                     job=job)


@pytest.mark.parametrize("reason", ["unknown_job", "job_draining", "model_mismatch"])
def test_a_refused_job_ends_the_cell_before_it_serves(reason):
    agent = _agent("nope")
    agent.client = _Client(reason)
    try:
        with pytest.raises(Refused, match=reason):
            agent.run(threading.Event())
        assert agent.engine.num_steps == 0 and agent.role.state == "joining"  # never served
        (req,) = agent.client.sent
        assert (req.job, req.model) == ("nope", "tiny")
    finally:
        agent.versions.close()
        agent.store_host.close()


def test_the_job_is_sent_with_the_first_registration_only():
    agent = _agent("gamma")
    agent.client = _Client(None)
    try:
        agent.register()
        agent.register()  # after a fence: the scheduler keeps the job it has the cell under
        assert [(r.job, r.model) for r in agent.client.sent] == [("gamma", "tiny"), (None, "tiny")]
        control = _agent(None)  # control: no --job, none sent
        control.client = _Client(None)
        control.register()
        assert control.client.sent[0].job is None
        control.store_host.close()
    finally:
        agent.versions.close()
        agent.store_host.close()
