"""Training state on disk without pickle: what `save_state` writes `load_state` gives back
(tensors bitwise, the structure equal), and an altered file is refused."""

from __future__ import annotations

import json

import pytest
import torch

from cells.training.state_files import StateFileError, load_state, save_state


def _state() -> dict:
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
    p.grad = torch.randn(4, 3)
    opt.step()
    g = torch.Generator().manual_seed(3)
    return {"params": {"w": p.detach().clone(), "b16": torch.randn(5).to(torch.bfloat16)},
            "optimizer": opt.state_dict(), "rng": g.get_state(), "meta": {"step": 7, "cursor": 12,
            "nan": float("nan"), "inf": float("-inf"), "none": None, "flag": True, "spec": "{}"}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def test_a_state_comes_back_bitwise_with_its_structure(tmp_path):
    state = _state()
    d = save_state(tmp_path / "s", state)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["LATEST", d.name]
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "state.safetensors"]
    back = load_state(tmp_path / "s")
    assert _equal(state, back)
    assert 0 in back["optimizer"]["state"] and isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    # the optimizer state loads into a fresh optimizer and steps exactly like the original
    p1 = torch.nn.Parameter(state["params"]["w"].clone())
    p2 = torch.nn.Parameter(state["params"]["w"].clone())
    o1, o2 = torch.optim.AdamW([p1], lr=1e-3), torch.optim.AdamW([p2], lr=1e-3)
    o1.load_state_dict(state["optimizer"])
    o2.load_state_dict(back["optimizer"])
    g = torch.randn(4, 3)
    p1.grad, p2.grad = g.clone(), g.clone()
    o1.step(), o2.step()
    assert torch.equal(p1, p2)
    other = _state()  # negative control: another state is not equal
    assert not _equal(other, back)


def test_a_second_save_replaces_the_first_whole_and_a_crash_between_keeps_the_first(tmp_path):
    first = save_state(tmp_path / "s", {"x": torch.zeros(2)})
    second = save_state(tmp_path / "s", {"x": torch.ones(2), "y": 1})
    back = load_state(tmp_path / "s")
    assert torch.equal(back["x"], torch.ones(2)) and back["y"] == 1
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["LATEST", second.name]  # nothing else left
    assert not first.exists()
    # a crash after the new directory was written but before LATEST named it: the previous state
    (tmp_path / "s" / "state-crashed").mkdir()
    (tmp_path / "s" / "state-crashed" / "manifest.json").write_text("{")
    assert load_state(tmp_path / "s")["y"] == 1


def test_an_altered_or_foreign_state_is_refused(tmp_path):
    f = save_state(tmp_path / "s", {"x": torch.arange(1000.0)}) / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(StateFileError, match="SHA-256"):
        load_state(tmp_path / "s")
    (f.parent / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(StateFileError, match="manifest"):
        load_state(tmp_path / "s")
    with pytest.raises(StateFileError, match="cannot read"):
        load_state(tmp_path / "missing")
    with pytest.raises(TypeError, match="cannot go in a state file"):
        save_state(tmp_path / "t", {"x": object()})
