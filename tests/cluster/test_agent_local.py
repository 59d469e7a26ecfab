"""The cell agent on its own (no scheduler): the copy-round quiesce of the engine loop and the
stall report. The agent is built but never registered; its engine loop runs on a thread."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

import pytest
import torch

from cells.agent import STALL_LOG_S, CellAgent
from cells.engine.embedded import EmbeddedEngine
from cells.engine.records import SamplingParams
from scheduler.contract.config import parse_config

torch.set_num_threads(1)


def _agent(quiesce: str = "auto", keep_training_memory: str = "auto") -> CellAgent:
    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 64,
                                             "block_size": 16, "batch_invariant": True},
                                  "keep_training_memory": keep_training_memory},
                        "migration": {"copy_quiesce": quiesce, "copy_quiesce_max_ms": 5000}})
    return CellAgent(cfg, cell_id="c-test", scheduler_url="http://127.0.0.1:9", engine=EmbeddedEngine(cfg.cells.engine))


@pytest.fixture
def agent():
    a = _agent()
    yield a
    a.client.close()
    a.versions.close()
    a.store_host.close()


def _wait(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@contextlib.contextmanager
def _decoding(agent, max_tokens: int):
    """The agent's engine loop on a thread, decoding one request in the rollout role."""
    agent.role.set("rollout")
    agent.engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, seed=1))
    stop = threading.Event()
    loop = threading.Thread(target=agent._engine_loop, args=(stop,), daemon=True)
    loop.start()
    try:
        _wait(lambda: agent.engine.num_steps >= 2)
        yield
    finally:
        stop.set()
        agent.wake()
        loop.join(10)


def test_quiesce_pauses_the_engine_loop_and_lets_it_go(agent):
    with _decoding(agent, 200):
        with agent.quiesce():
            assert agent._quieted()
            time.sleep(0.05)  # let a step in flight finish
            steps = agent.engine.num_steps
            time.sleep(0.2)
            assert agent.engine.num_steps == steps  # no step while a copy is on the wire
        assert not agent._quieted()
        _wait(lambda: agent.engine.num_steps > steps)  # woken at once, not after a timeout


def test_back_to_back_pauses_let_one_step_run_between(agent):
    """A copy round of several messages pauses decoding one message at a time: the engine
    runs a step between two pauses, so the stream is never held for the whole round."""
    with _decoding(agent, 500):
        between = []
        for _ in range(4):
            with agent.quiesce():
                start = agent.engine.num_steps
                time.sleep(0.03)
                assert agent.engine.num_steps == start  # paused while the message is on the wire
            between.append(start)
        assert all(b > a for a, b in zip(between, between[1:])), between


def test_a_pause_does_not_wait_for_an_idle_engine():
    a = _agent()  # rollout, nothing to decode: nothing to wait for
    a.role.set("rollout")
    t0 = time.monotonic()
    for _ in range(3):
        with a.quiesce():
            pass
    assert time.monotonic() - t0 < 0.4
    a.client.close(), a.versions.close(), a.store_host.close()


def test_quiesce_is_bounded_and_can_be_off():
    a = _agent()
    a._quiesce_s = 0.05
    with a.quiesce():
        assert a._quieted()
        time.sleep(0.1)
        assert not a._quieted()  # past copy_quiesce_max_ms decoding goes on regardless
    off = _agent("off")
    with off.quiesce():
        assert not off._quieted()
    for x in (a, off):
        x.client.close(), x.versions.close(), x.store_host.close()


def test_stall_report_names_the_request_and_why(agent, caplog):
    agent.role.set("rollout")
    agent.role.set("training", "a role the store no longer gives it")
    agent.engine.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=8, seed=2))
    agent._check_progress()
    assert "no token" not in caplog.text  # fresh: not yet a stall
    agent._progress_at -= STALL_LOG_S + 1
    with caplog.at_level(logging.WARNING, logger="cellflip.cell"):
        agent._check_progress()
        agent._check_progress()  # once a minute, not per sync
    lines = [r.getMessage() for r in caplog.records if "no token" in r.getMessage()]
    assert len(lines) == 1
    state = json.loads(lines[0].split(": ", 1)[1].split(" with work in the engine: ", 1)[1])
    assert state["role"] == "training"
    assert state["engine"]["requests"]["stuck"]["status"] == "waiting" and state["engine"]["waiting"] == ["stuck"]
    agent.engine.abort("stuck")
    agent._check_progress()  # no work: progress resets
    assert time.monotonic() - agent._progress_at < 1.0


def test_staging_buffers_are_reused_by_size_and_bounded():
    from cells.migration import StagingBuffers

    st = StagingBuffers(prealloc_numel=1000, keep=2)
    a, a_buf = st.take([2, 10, 5])  # fits the preallocated one
    assert a.shape == (2, 10, 5) and a_buf.numel() == 1000 and st.sizes() == []
    b, b_buf = st.take([3, 7])  # none kept: a fresh one of just that size
    assert b_buf.numel() == 21
    c, c_buf = st.take([50])
    st.give(a_buf), st.give(b_buf), st.give(c_buf)
    assert st.sizes() == [50, 1000]  # at most `keep`, the smallest dropped
    d, d_buf = st.take([40])
    assert d_buf is c_buf  # the smallest that fits
    d.fill_(7.0)
    assert float(c_buf[:40].sum()) == 280.0  # a view of the kept buffer, not a copy
    e, e_buf = st.take([2000])
    assert e_buf.numel() == 2000 and st.sizes() == [1000]
    zero, _ = st.take([0, 4])
    assert zero.numel() == 0


# -- cancel_migration ------------------------------------------------------------------------

class _Client:
    """The scheduler's migration endpoints as a cell sees them (nothing refused)."""

    def __init__(self) -> None:
        self.aborts: list[tuple[str, str]] = []
        self.commits: list[str] = []

    def abort_migration(self, mid, req) -> None:
        self.aborts.append((mid, req.reason))

    def commit(self, mid, req) -> int:
        self.commits.append(mid)
        return req.epoch + 1


def _pair(cancel: str):
    """A source and a destination engine, one migration between them on two threads; the side
    named by `cancel` is cancelled right after its first copy round. Returns (outcomes, engines,
    client)."""
    from cells.engine.base import kv_handover
    from cells.migration import MigrationReceiver, MigrationSender
    from cells.transport.store import StoreHost
    from scheduler.contract.protocol import MigrateInCmd, MigrateOutCmd

    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 64,
                                             "block_size": 16}},
                        "migration": {"stop_copy_blocks": 1, "max_copy_rounds": 4, "transfer_timeout_s": 20}})
    src, dst = EmbeddedEngine(cfg.cells.engine), EmbeddedEngine(cfg.cells.engine)
    src.add_request("r", list(range(1, 100)), SamplingParams(max_tokens=40, seed=3))
    src.step()  # the prompt's KV: six complete blocks to copy
    locks = {"src": threading.Lock(), "dst": threading.Lock()}

    def on(engine, name):
        def run(fn):
            with locks[name]:
                return fn(kv_handover(engine))
        return run

    host, client, box = StoreHost("127.0.0.1", 0), _Client(), {}
    out_cmd = MigrateOutCmd(1, "r", 0, "m1", "dst", "127.0.0.1:0", 0)
    in_cmd = MigrateInCmd(1, "r", "m1", "src", "127.0.0.1:0", host.address.port, 200, 0)
    sides = {}

    @contextlib.contextmanager
    def quiesce(name):
        yield
        if name == cancel:
            sides[name].cancel()  # the scheduler's cancel_migration, between two rounds

    sides["src"] = MigrationSender(out_cmd, cell_id="src", incarnation="i", store=host.store, client=client,
                                   cfg=cfg.migration, on_engine=on(src, "src"), flushed=lambda: 0,
                                   quiesce=lambda: quiesce("src"))
    sides["dst"] = MigrationReceiver(in_cmd, cell_id="dst", incarnation="j", client=client, cfg=cfg.migration,
                                     on_engine=on(dst, "dst"), on_commit=lambda *a: None,
                                     quiesce=lambda: quiesce("dst"))
    threads = [threading.Thread(target=lambda n=n: box.__setitem__(n, sides[n].run())) for n in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    host.close()
    return box, src, dst, client


@pytest.mark.parametrize("cancel", ["src", "dst"])
def test_cancel_migration_stops_the_transfer_and_keeps_the_request_on_the_source(cancel):
    outcomes, src, dst, client = _pair(cancel)
    assert outcomes["src"].result == "aborted" and outcomes[cancel].reason == "cancelled by the scheduler"
    assert outcomes["dst"].result in ("aborted", "failed") and client.commits == []
    assert client.aborts and client.aborts[0][0] == "m1"  # the source settles it at the scheduler
    assert "r" not in dst.requests and dst.pool.num_free == dst.pool.num_blocks  # the reservation is freed
    assert not src.handover.is_paused("r")
    steps = 0
    while src.has_work() and steps < 200:  # the source still decodes it to its end
        src.step()
        steps += 1
    assert not src.has_work() and "r" not in src.requests


def test_cancel_migration_without_a_thread_resumes_the_source_and_frees_the_destination(agent):
    from cells.agent import Owned
    from scheduler.contract.protocol import CancelMigrationCmd

    eng = agent.engine
    eng.add_request("s", [1, 2, 3, 4], SamplingParams(max_tokens=20, seed=1))
    eng.step()
    eng.handover.pause_request("s")  # its abort never reached the scheduler: it stayed paused
    agent.owned["s"] = Owned(0, 0)
    assert eng.handover.reserve("d", 40)  # a destination's reservation, its thread gone
    free = eng.pool.num_free
    with agent.access():
        agent.commands.handle(CancelMigrationCmd(7, "s", "m-s"))
        agent.commands.handle(CancelMigrationCmd(8, "d", "m-d"))
    assert not eng.handover.is_paused("s") and "s" in agent.owned
    assert eng.pool.num_free > free and "d" not in eng.pool.tables


@pytest.mark.parametrize("setting, kept", [("auto", True), ("off", False)])
def test_an_embedded_cell_keeps_its_training_memory_unless_told_not_to(setting, kept):
    a = _agent(keep_training_memory=setting)
    try:
        assert a.training.keep_memory is kept  # host memory: the engine never takes it back
    finally:
        a.client.close()
        a.versions.close()
        a.store_host.close()
