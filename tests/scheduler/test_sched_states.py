"""State machines, protocol codecs and the pure token-acceptance rule."""

from __future__ import annotations

import pytest

from scheduler.contract.protocol import (
    COMMANDS,
    EVENTS,
    ProtocolError,
    StartCmd,
    SyncRequest,
    TokenBatch,
    decode_command,
    decode_event,
    dispatch,
)
from scheduler.contract.records import StoredTokens
from scheduler.contract.states import (
    CELL,
    FLIP,
    MIGRATION,
    REQUEST,
    VERSION,
    IllegalTransition,
    set_state,
)
from scheduler.control.ingest import judge
from scheduler.store.owners import RequestRow


class Rec:
    def __init__(self, state: str) -> None:
        self.state, self.history = state, []


def test_every_edge_has_a_reason_and_targets_a_state():
    for m in (CELL, FLIP, VERSION, MIGRATION, REQUEST):
        for src, edges in m.transitions.items():
            for dst, why in edges.items():
                assert dst in m.transitions, (m.name, src, dst)
                assert why.strip(), (m.name, src, dst)


def test_cell_cycle_and_illegal_edge():
    r = Rec("joining")
    for s in ("rollout", "draining", "training", "loading", "rollout", "down", "joining"):
        set_state(CELL, r, s, t=1.0)
    assert [h[0] for h in r.history] == ["rollout", "draining", "training", "loading", "rollout", "down", "joining"]
    with pytest.raises(IllegalTransition):
        set_state(CELL, r, "training")
    assert r.state == "joining" and len(r.history) == 7


def test_the_cell_machine_is_the_one_role_machine():
    """The planner's roles and the cell's own record of its role are the cell machine's states."""
    from typing import get_args

    from cells.roles import CellRole
    from scheduler.contract.states import ROLLOUT_SIDE, TRAINING_SIDE, CellState

    assert set(get_args(CellState)) == set(CELL.transitions) == ROLLOUT_SIDE | TRAINING_SIDE | {"down"}
    role = CellRole()
    for s, want in (("rollout", "rollout"), ("training", "training"), ("training", "training"),
                    ("loading", None), ("rollout", "rollout"), ("down", None), ("rollout", "rollout")):
        role.set(s, "why")
        assert role.ready_role() == want
    assert [h[0] for h in role.history] == ["joining", "rollout", "draining", "training", "loading", "rollout", "down",
                                            "joining", "rollout"]
    with pytest.raises(IllegalTransition):
        role.set("retired")  # not a state of the machine


def test_terminal_states():
    assert FLIP.terminal_states() == {"done", "failed", "rolled_back"}
    assert MIGRATION.terminal_states() == {"committed", "aborted"}
    assert VERSION.is_terminal("retired") and not VERSION.is_terminal("retiring")
    with pytest.raises(IllegalTransition):
        MIGRATION.check("committed", "aborted")


def test_protocol_roundtrip_and_tables():
    cmd = StartCmd(7, "r1", 2, "s1", [1, 2, 3], 2, 1, {"max_tokens": 4})
    d = cmd.to_dict()
    assert d["type"] == "start" and d["cmd_id"] == 7
    assert decode_command(d) == cmd
    assert set(COMMANDS) == {"start", "migrate_out", "migrate_in", "abort", "suspend", "set_role", "cancel_migration",
                             "load_version", "score", "drop_version", "export"}
    assert set(EVENTS) == {"migration", "scored", "broadcast", "role_failed", "exported", "prefix_missing"}
    seen = []
    dispatch({"start": seen.append}, cmd)
    assert seen == [cmd]
    s = SyncRequest.from_dict({"incarnation": "a", "tokens": [{"request_id": "r", "epoch": 1, "start": 0, "records": [[5, -0.1, 0, False]]}]})
    assert s.tokens[0].records == [(5, -0.1, 0, False)]
    with pytest.raises(ProtocolError):
        decode_command({"type": "nope"})
    with pytest.raises(ProtocolError):
        decode_event({"type": "scored", "session_id": "s"})
    with pytest.raises(ProtocolError):
        SyncRequest.from_dict({"incarnation": "a", "wait_s": "soon"})


def _req(n: int = 2, epoch: int = 3, state: str = "running") -> RequestRow:
    return RequestRow("r", "s", base=4, prompt_start=0, num_generated=n, params={}, cell_id="A", epoch=epoch, state=state)


def _batch(start: int, records: list, epoch: int = 3) -> TokenBatch:
    return TokenBatch("r", epoch, start, [tuple(x) for x in records])


STORED = StoredTokens.of([(10, 1, -0.5, 0, 0, None, None), (11, 1, -0.25, 0, 0, None, None)])


@pytest.mark.parametrize("batch,cell,req,expect", [
    (_batch(2, [[12, -0.1, 0, False]]), "A", _req(), ("accept", 1, "")),
    (_batch(2, [[12, -0.1, 0, False]], epoch=2), "A", _req(), ("reject", 0, "stale_epoch")),
    (_batch(2, [[12, -0.1, 0, False]]), "B", _req(), ("reject", 0, "not_owner")),
    (_batch(3, [[12, -0.1, 0, False]]), "A", _req(), ("reject", 0, "gap")),
    (_batch(0, [[10, -0.5, 0, False], [11, -0.25, 0, False]]), "A", _req(), ("accept", 0, "")),
    (_batch(1, [[11, -0.25, 0, False], [12, -0.1, 0, False]]), "A", _req(), ("accept", 1, "")),
    (_batch(1, [[99, -0.25, 0, False]]), "A", _req(), ("reject", 0, "mismatch")),
    (_batch(2, [[12, -0.1, 0, False]]), "A", None, ("reject", 0, "unknown_request")),
    (_batch(2, [[12, -0.1, 0, False]]), "A", _req(state="finished"), ("reject", 0, "not_running")),
])
def test_judge(batch, cell, req, expect):
    stored = STORED[batch.start: min(2, batch.start + len(batch.records))] if req else StoredTokens()
    v = judge(req, cell, batch, stored)
    kind, n_new, reason = expect
    assert v.accept == (kind == "accept")
    assert len(v.new) == n_new and v.reason == reason
    assert v.drift == (reason == "mismatch")
    assert v.revoke == (reason in ("gap", "mismatch"))
