"""The user's model in and out of the trainer: a run started from a Hugging Face directory
trains from those weights (no random initialisation, no warm-up unless asked), and every
`export_every`-th published version is written as a Hugging Face directory that serves
bitwise like the weights it was published from."""

from __future__ import annotations

import json

import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.trainer.trainer import Trainer
from cells.training.wire import weights_checksum
from cells.transport.broadcast import BroadcastResult
from scheduler.contract.config import EmbeddedEngineConfig, ModelConfig, parse_config
from tests.trainer.test_trainer_resume import FakeClient, _demo

torch.set_num_threads(1)


def _trainer(tmp_path, model: dict, **trainer) -> Trainer:
    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": model}},
                        "trainer": {"enabled": True, "checkpoint_dir": None, "seed": 3, **trainer}})
    t = Trainer(cfg, "http://127.0.0.1:9", run_dir=tmp_path / "run")
    t.client = FakeClient([])
    t.host.broadcast = lambda version, receivers, ranks=None: BroadcastResult(version)
    return t


def test_a_run_from_a_hugging_face_directory_starts_from_its_weights_without_a_warmup(tmp_path):
    spec = PRESETS["toy"]
    theirs = init_weights(spec, seed=11, std=0.05)
    src = save_checkpoint(tmp_path / "their-model", spec, theirs)
    t = _trainer(tmp_path, {"preset": None, "path": str(src)})
    try:
        assert t.warmup_steps == 0 and t.start_checksum == weights_checksum(theirs)
        assert all(torch.equal(t.learner.params[k].detach(), theirs[k]) for k in theirs)
        random = _trainer(tmp_path / "r", {"preset": "toy"})
        assert random.warmup_steps == 300 and random.start_checksum != t.start_checksum  # negative control
        random.host.close()
        asked = _trainer(tmp_path / "a", {"preset": None, "path": str(src)}, warmup_steps=7)
        assert asked.warmup_steps == 7
        asked.host.close()
    finally:
        t.host.close()


def test_every_nth_published_version_is_exported_and_serves_like_its_weights(tmp_path):
    spec = PRESETS["toy"]
    src = save_checkpoint(tmp_path / "their-model", spec, init_weights(spec, seed=11, std=0.05))
    (src / "generation_config.json").write_text('{"temperature": 0.7}')
    t = _trainer(tmp_path, {"preset": None, "path": str(src)}, export_every=2,
                 export_dir=str(tmp_path / "exports"))
    try:
        published = {}
        for _ in range(4):
            t.learner.sft_step(_demo(t))  # the weights move between versions
            t._publish()
            published[t.learner.version] = {k: v.detach().clone() for k, v in t.learner.weights().items()}
        t.flush()
    finally:
        t.host.close()
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == [f"v{v}" for v in sorted(published) if v % 2 == 0]
    ids = list(spec.output_ids()[:6])
    for v in (v for v in published if v % 2 == 0):
        out = tmp_path / "exports" / f"v{v}"
        assert json.loads((out / "config.json").read_text())["cellflip"]["version"] == v
        assert json.loads((out / "generation_config.json").read_text()) == {"temperature": 0.7}
        served = EmbeddedEngine(spec=spec, weights=published[v]).score(ids)
        exported = EmbeddedEngine(EmbeddedEngineConfig(model=ModelConfig(preset=None, path=str(out)))).score(ids)
        assert torch.equal(served, exported)
        before = EmbeddedEngine(spec=spec, weights=published[v - 1]).score(ids)
        assert not torch.equal(before, exported)  # negative control: the version before it
    events = [json.loads(x) for x in (tmp_path / "run" / "trainer.jsonl").read_text().splitlines()]
    assert sorted(e["version"] for e in events if e["event"] == "exported") == [v for v in sorted(published) if v % 2 == 0]
