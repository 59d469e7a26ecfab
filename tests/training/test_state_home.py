"""Where a step finds the committed state when no cell that held it answers any more (a cell
moved to another RL job follows that job's store): the checkpoint of it posted after its commit,
once the holder wrote it, even before the trainer registered it; with no such checkpoint, or one
of an older commit, the state is lost and the coordinator says so."""

from __future__ import annotations

import pytest

from cells.training import jobs
from cells.training.coordinator import StateLost
from cells.transport.store import StoreHost
from tests.training.cluster import coordinator, learner

COMMIT = {"tag": "run:1:1", "version": 1, "step": 2, "checksum": 7}


@pytest.fixture
def coord():
    host = StoreHost("127.0.0.1", 0, timeout_s=10)
    c = coordinator(learner(), host.address, timeout_s=1, ack_timeout_s=1)
    c.adopt(COMMIT, holders=["cell-9"])  # cell-9 computed it, then left: it answers nothing here
    yield c
    host.close()


def test_the_checkpoint_written_after_the_commit_is_the_states_home(coord, tmp_path):
    path = str(tmp_path / "ckpt")
    jid = coord.checkpoint(path)
    jobs.answer(coord.store, jid, {"ok": True})  # the holder wrote it before it moved
    assert coord.checkpoint_path is None  # the trainer registers it only at its next checkpoint
    assert coord._outside_source([], 1) == {"kind": "checkpoint", "path": path}


def test_no_written_checkpoint_or_one_of_an_older_commit_is_no_home(coord, tmp_path):
    coord.checkpoint(str(tmp_path / "unwritten"))  # posted, never answered: the holder left first
    with pytest.raises(StateLost):
        coord._outside_source([], 1)
    jid = coord.checkpoint(str(tmp_path / "old"))
    jobs.answer(coord.store, jid, {"ok": True})
    coord.adopt({**COMMIT, "tag": "run:2:2", "version": 2}, holders=["cell-9"])  # a newer commit since
    with pytest.raises(StateLost):
        coord._outside_source([], 1)
