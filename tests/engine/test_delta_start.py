"""A sticky turn's delta start on a real cell agent's command handler and the embedded engine:
the cell rebuilds the context from what it holds, checked by length and digest; a cell that
does not hold the prefix (or holds another one) starts nothing and asks for the whole context,
which then decodes exactly as a delta start does."""

from types import SimpleNamespace

from cells.agent.commands import Commands
from cells.agent.held import HeldContexts
from cells.engine.records import SamplingParams
from scheduler.contract.prefixhash import prefix_digest
from scheduler.contract.protocol import PrefixMissingEvent, StartCmd

from .enginekit import make_engine, prompts, run_all


class _Agent(SimpleNamespace):
    """What `Commands.start` uses of a cell agent; `run` is the engine loop's `_collect`."""

    def events_append(self, e):
        self.events.append(e)

    def run(self) -> dict[str, list[int]]:
        out = {rid: [e.record.token_id for e in evs] for rid, evs in run_all(self.engine).items()}
        for rid, toks in out.items():
            for t in toks:
                self.held.sampled(rid, t)
        return out


def _agent():
    a = _Agent(engine=make_engine(True), held=HeldContexts(), owned={}, events=[], moves=SimpleNamespace(
        migrate_out=None, migrate_in=None, cancel=None))
    return a, Commands(a)


def _start(rid, ids, prompt_len, prefix=None):
    n, digest = (0, None) if prefix is None else (len(prefix), prefix_digest(prefix))
    return StartCmd(1, rid, 1, "sess", ids, prompt_len, 0, SamplingParams(max_tokens=8, seed=5), None, n, digest)


def _first_turn(a, cmds):
    p = prompts(1, seed=70, lo=40, hi=41)[0]
    cmds.start(_start("t0", p, len(p)))
    return p + a.run()["t0"]


def test_delta_start_decodes_as_the_full_context_and_a_lost_prefix_is_asked_for():
    new = prompts(1, seed=71, lo=9, hi=10)[0]
    a, cmds = _agent()
    ctx = _first_turn(a, cmds)
    assert a.held.length("sess") == len(ctx)
    cmds.start(_start("t1", new, len(ctx) + len(new), prefix=ctx))
    assert not a.events and a.engine.requests["t1"].token_ids == ctx + new  # rebuilt exactly
    delta_out = a.run()["t1"]

    b, bcmds = _agent()  # a cell that never saw the session: the delta is refused, nothing starts
    _first_turn(b, bcmds)
    b.held = HeldContexts()
    bcmds.start(_start("t1", new, len(ctx) + len(new), prefix=ctx))
    assert b.events == [PrefixMissingEvent("t1", 1, 0)] and "t1" not in b.engine.requests and "t1" not in b.owned
    bcmds.start(_start("t1", ctx + new, len(ctx) + len(new)))  # the scheduler's full start
    assert b.run()["t1"] == delta_out  # token-exact


def test_a_prefix_with_one_other_token_or_length_is_refused():
    a, cmds = _agent()
    ctx = _first_turn(a, cmds)
    wrong = list(ctx)
    wrong[len(wrong) // 2] = (wrong[len(wrong) // 2] + 1) % 100
    for prefix in (wrong, ctx[:-1]):
        cmds.start(_start("t1", [5], len(ctx) + 1, prefix=prefix))
        assert a.events[-1] == PrefixMissingEvent("t1", 1, len(ctx)) and "t1" not in a.engine.requests
    cmds.start(_start("t1", [5], len(ctx) + 1, prefix=ctx))  # control: the true prefix starts
    assert a.engine.requests["t1"].token_ids == ctx + [5]


def test_held_contexts_are_bounded_and_dropped_with_their_request():
    h = HeldContexts(max_tokens=100)
    h.began(_start("a", list(range(60)), 60), list(range(60)))
    h.began(SimpleNamespace(**{**vars(_start("b", list(range(60)), 60)), "session_id": "other"}), list(range(60)))
    assert h.length("sess") == 0 and h.length("other") == 60 and h.num_tokens == 60  # oldest dropped
    h.sampled("b", 7)
    assert h.length("other") == 61
    h.ended("b")
    assert h.length("other") == 0 and h.num_tokens == 0


def test_ids_after_a_checked_prefix_are_still_checked():
    import pytest

    from cells.engine.records import EngineError

    eng = make_engine(True)
    ctx = prompts(1, seed=72, lo=30, hi=31)[0]
    with pytest.raises(EngineError, match="outside"):
        eng.add_request("bad", ctx + [10**9], SamplingParams(max_tokens=4), checked=len(ctx))
    eng.add_request("ok", ctx + [3], SamplingParams(max_tokens=4), checked=len(ctx))
    assert eng.requests["ok"].token_ids == ctx + [3]
