"""A cell serves the version the scheduler last asked for, even an older number: a cell moved to
another RL job serves that job's lineage, whose ids may be below the one it served (each job
has its own range). A version older than the served one that was not the last asked for (a late
load of the same lineage) is still only held, never served."""

from __future__ import annotations

import time

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.versions import CellVersions
from scheduler.contract.config.engine import EmbeddedEngineConfig
from scheduler.contract.protocol import LoadVersionCmd

MODEL = {"preset": "tiny", "vocab_size": 128, "hidden_size": 32, "num_layers": 1, "head_dim": 16,
         "intermediate_size": 64, "output_id_ranges": [[0, 128]]}


def _setup():
    cfg = EmbeddedEngineConfig(model=MODEL, batch_invariant=True, num_blocks=32)
    spec = resolve_spec(cfg.model)
    weights = {v: init_weights(spec, v, 0.5) for v in (2, 5, 1_000_007)}
    engine = EmbeddedEngine(cfg, spec=spec, weights=weights[1_000_007], version=1_000_007)
    events: list = []
    versions = CellVersions("c0", events.append, lambda: None, engine=engine, local=lambda v: weights.get(v))
    return engine, versions


def _load(versions: CellVersions, engine, v: int, activate: bool = True) -> None:
    versions.load(LoadVersionCmd(1, v, None, "fetch", activate, "keep_kv"), [], engine.version)
    deadline = time.monotonic() + 10
    while not versions._staged and time.monotonic() < deadline:  # the loader thread stages it
        time.sleep(0.01)
    versions.activate_staged(engine)


def test_the_version_last_asked_for_is_served_even_when_older():
    engine, versions = _setup()
    _load(versions, engine, 2)  # moved to a job whose lineage is at version 2
    assert engine.version == 2
    _load(versions, engine, 5)
    assert engine.version == 5


def test_an_older_version_not_last_asked_for_is_not_served():
    engine, versions = _setup()
    versions.load(LoadVersionCmd(1, 5, None, "fetch", True, "keep_kv"), [], engine.version)
    versions.wanted = 1_000_007  # a newer ask arrived meanwhile: the late load of 5 must not win
    deadline = time.monotonic() + 10
    while not versions._staged and time.monotonic() < deadline:
        time.sleep(0.01)
    versions.activate_staged(engine)
    assert engine.version == 1_000_007
