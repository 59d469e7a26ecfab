"""The actor boundary carries JSON scalars only (no cellflip data through Ray's object store),
the launcher is a discriminated union, and the embedded default needs no Ray. No Ray cluster."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import yaml

from cells.launch.actors import ACTOR_CLASSES, check_plain, json_boundary
from cells.launch.ray_launcher import absolute_paths, cell_bundle, check_reachable
from cells.localcluster import ROOT, find_free_port
from scheduler.contract.config import ConfigError, parse_config
from scheduler.contract.config.launch import LocalLauncherConfig, RayLauncherConfig


def _public_methods(cls):
    return [(name, fn) for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")]


def test_every_actor_method_is_guarded_and_annotated_with_json_scalars():
    for cls in ACTOR_CLASSES:
        methods = _public_methods(cls)
        assert methods, cls
        for name, fn in methods:
            assert getattr(fn, "json_boundary", False), f"{cls.__name__}.{name} is not a json_boundary"
            hints = inspect.signature(fn).parameters
            for p in list(hints.values())[1:]:
                assert p.annotation in ("str", "int", "float", "bool", "str | None"), (cls.__name__, name, p)
            assert inspect.signature(fn).return_annotation in ("str", "int", "bool", "str | None"), (cls.__name__, name)
        init = inspect.signature(cls.__init__).parameters
        assert all(p.annotation == "str" for p in list(init.values())[1:]), f"{cls.__name__}.__init__ takes strings only"


class _Probe:
    @json_boundary
    def echo(self, value):
        return value


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2], b"raw", bytearray(b"x"), object()])
def test_boundary_refuses_anything_but_json_scalars(value):
    with pytest.raises(TypeError, match="actor boundary"):
        _Probe().echo(value)
    with pytest.raises(TypeError, match="actor boundary"):
        check_plain(value, "result")


def test_boundary_refuses_tensors_and_passes_json_text():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="Tensor"):
        _Probe().echo(torch.zeros(2))
    text = json.dumps({"cell": "cell-0", "tokens": [1, 2]})
    assert _Probe().echo(text) == text and _Probe().echo(None) is None and _Probe().echo(3) == 3


def test_launcher_is_a_discriminated_union():
    assert isinstance(parse_config({}).launcher, LocalLauncherConfig)
    ray_cfg = parse_config({"launcher": {"type": "ray", "address": "10.0.0.1:6379", "scheduler_node": "10.0.0.1"}})
    assert isinstance(ray_cfg.launcher, RayLauncherConfig) and ray_cfg.launcher.placement == "SPREAD"
    with pytest.raises(ConfigError, match="'local', 'ray'"):
        parse_config({"launcher": {"type": "k8s"}})
    with pytest.raises(ConfigError, match="launcher.ray.max_restarts"):
        parse_config({"launcher": {"type": "ray", "max_restarts": -1}})


def test_cli_ray_flag_keeps_the_configs_ray_settings():
    from cells.entry import launcher_for as _launcher

    cfg = parse_config({"launcher": {"type": "ray", "namespace": "team-a", "max_restarts": 1}})
    got = _launcher(cfg, "auto")
    assert (got.type, got.address, got.namespace, got.max_restarts) == ("ray", "auto", "team-a", 1)
    assert _launcher(parse_config({}), None).type == "local"
    assert _launcher(parse_config({}), "10.0.0.1:6379").address == "10.0.0.1:6379"


def test_paths_reach_the_actors_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = absolute_paths({"scheduler": {"auth_token_file": "tok"}, "trainer": {"enabled": True}})
    assert out["scheduler"]["db_path"] == str(tmp_path / "runs/cellflip.sqlite")
    assert out["scheduler"]["auth_token_file"] == str(tmp_path / "tok")
    assert out["trainer"]["checkpoint_dir"] == str(tmp_path / "runs/trainer")


def test_the_embedded_default_never_imports_ray():
    code = ("import sys, cells.cli, cells.localcluster, scheduler.api.app, scheduler.contract.config; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_a_cell_bundle_holds_one_replica():
    cpu = parse_config({"launcher": {"type": "ray", "cpus_per_cell": 2}})
    assert cell_bundle(cpu, cpu.launcher) == {"CPU": 2}
    gpu = parse_config({"cells": {"engine": {"type": "sglang", "model_path": "/m", "tp": 8}}, "launcher": {"type": "ray"}})
    assert cell_bundle(gpu, gpu.launcher) == {"CPU": 1, "GPU": 8}
    pinned = parse_config({"launcher": {"type": "ray", "gpus_per_cell": 1}})
    assert cell_bundle(pinned, pinned.launcher) == {"CPU": 1, "GPU": 1}


def test_the_yaml_in_docs_ray_is_a_valid_config():
    text = (ROOT / "docs" / "RAY.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = parse_config(yaml.safe_load(block), "docs/RAY.md")
    assert isinstance(cfg.launcher, RayLauncherConfig) and cfg.launcher.scheduler_node == "10.0.0.5"


def test_the_live_view_and_status_say_where_each_cell_runs():
    from rich.console import Console

    from cells.display import node_of, render

    ray_cell = {"id": "cell-0", "state": "rollout", "address": "10.0.0.7:0",
                "capabilities": {"node": "10.0.0.7/4f2a9c01d3e5"}}
    local_cell = {"id": "cell-1", "state": "training", "address": "127.0.0.1:0", "capabilities": {}}
    assert node_of(ray_cell) == "10.0.0.7/4f2a9c01d3e5" and node_of(local_cell) == "127.0.0.1"

    class Snap:
        cells, versions, events, steps = [ray_cell, local_cell], [], [], []
        drift = flips = missing = 0.0
        migrations: dict = {}

    console = Console(width=200, record=True)
    console.print(render(Snap(), "http://127.0.0.1:8700", 3))
    shown = console.export_text()
    assert "node" in shown and "10.0.0.7/4f2a9c01d3e5" in shown and "127.0.0.1" in shown


def test_an_absent_head_fails_at_once_with_the_address():
    with pytest.raises(SystemExit, match=r"no Ray head answers at 127\.0\.0\.1:\d+"):
        check_reachable(f"127.0.0.1:{find_free_port()}")
    check_reachable("auto")  # Ray's to resolve


def test_user_code_reaches_every_actor_through_py_modules(tmp_path, monkeypatch):
    """A custom loss's module ships with each actor's runtime environment (Ray's py_modules),
    as an absolute path; without it the runtime environment carries the environment only."""
    from cells.launch.ray_launcher import RayCluster

    monkeypatch.chdir(tmp_path)
    (tmp_path / "myloss").mkdir()
    rc = object.__new__(RayCluster)
    rc.launcher = parse_config({"launcher": {"type": "ray", "py_modules": ["myloss"]}}).launcher
    rc.namespace = "ns"
    rc.scoped_env = lambda *scopes: {"CELLFLIP_TOKEN": "t"}
    env = rc._options("cellflip-cell-0", ("cell",))["runtime_env"]
    assert env["py_modules"] == [str(tmp_path / "myloss")] and env["env_vars"]["CELLFLIP_TOKEN"] == "t"
    rc.launcher = parse_config({"launcher": {"type": "ray"}}).launcher
    assert "py_modules" not in rc._options("cellflip-cell-0", ("cell",))["runtime_env"]
