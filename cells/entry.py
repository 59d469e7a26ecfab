"""What the entry points share (the CLI, `cellflip up`, the Ray actors): the configuration
loaded, a client's token, signal handling, a cell's configuration and engine, the launcher,
the toy task's defaults."""

from __future__ import annotations

import signal


def load(path: str | None):
    from scheduler.contract.config import CellflipConfig, load_config

    return load_config(path) if path else CellflipConfig()


def client_token_for(cfg, token_file: str | None = None, scope: str = "admin") -> str | None:
    """The token a client of `scope` sends (scheduler/contract/tokens.py: an explicit file, the
    config's file for the scope, its environment variable, or the file the scheduler generated);
    a bad file exits with one line."""
    from scheduler.contract.config import ConfigError
    from scheduler.contract.tokens import client_token

    try:
        return client_token(cfg.scheduler, token_file, scope=scope)
    except ConfigError as e:
        raise SystemExit(f"cellflip: {e}") from None


def stop_on_signals(handler) -> None:
    """SIGINT and SIGTERM call `handler` whatever disposition this process inherited (a shell
    that starts a job in the background sets SIGINT to ignored)."""
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def interrupt(*_):
    raise KeyboardInterrupt


def cell_config(args, cfg):
    """`cfg` with the cell's engine overridden by `--engine`, `--model-path` and `--tp`.
    `--engine sglang` keeps the config's SGLang settings (scoring, server args…) where the
    config already selects SGLang; `--model-path` is the embedded model's checkpoint path
    or SGLang's model path. Raises SystemExit naming the flag on a bad combination."""
    from pydantic import ValidationError

    from scheduler.contract.config.engine import EmbeddedEngineConfig, SGLangEngineConfig

    base = cfg.cells.engine
    kind = args.engine or base.type
    if kind == "sglang":
        fields = base.model_dump() if isinstance(base, SGLangEngineConfig) else {}
        if args.model_path is not None:
            fields["model_path"] = args.model_path
        if args.tp is not None:
            fields["tp"] = args.tp
        if "model_path" not in fields:
            raise SystemExit("cellflip cell: --engine sglang needs --model-path (or cells.engine.model_path "
                             "in the config)")
        make = lambda: SGLangEngineConfig(**fields)  # noqa: E731
    else:
        if args.tp is not None:
            raise SystemExit("cellflip cell: --tp applies to --engine sglang only")
        fields = base.model_dump() if isinstance(base, EmbeddedEngineConfig) else {}
        if args.model_path is not None:
            fields["model"] = {**fields.get("model", {}), "path": args.model_path}
        make = lambda: EmbeddedEngineConfig(**fields)  # noqa: E731
    try:
        eng_cfg = make()
    except ValidationError as e:
        raise SystemExit(f"cellflip cell: bad engine settings: {e}") from None
    return cfg.model_copy(update={"cells": cfg.cells.model_copy(update={"engine": eng_cfg})})


def build_engine(eng_cfg):
    """The cell's engine. SGLang that cannot run here (not installed, a wrong version, a
    setting that changes what log-probs mean) exits with the adapter's message."""
    from scheduler.contract.config.engine import EmbeddedEngineConfig

    if isinstance(eng_cfg, EmbeddedEngineConfig):
        import torch

        from cells.engine.embedded import EmbeddedEngine

        torch.set_num_threads(eng_cfg.threads)
        return EmbeddedEngine(eng_cfg)
    from cells.engine.records import EngineError
    from cells.engine.sglang.engine import SGLangEngine  # SGLang itself is imported lazily

    try:
        return SGLangEngine(eng_cfg)
    except EngineError as e:
        raise SystemExit(f"cellflip cell: {e}") from None


def launcher_for(cfg, ray_address: str | None):
    """The config's launcher; `--ray [ADDRESS]` selects Ray (keeping the config's Ray settings)."""
    from scheduler.contract.config.launch import RayLauncherConfig

    if ray_address is None:
        return cfg.launcher
    base = cfg.launcher.model_dump() if isinstance(cfg.launcher, RayLauncherConfig) else {}
    return RayLauncherConfig(**{**base, "address": ray_address})


def prepare_toy(raw: dict) -> None:
    """The toy task's chat format and output vocabulary, unless the config sets them: the
    cells sample, and the trainer trains, over exactly the ids the task can use."""
    from cells.trainer.toy_task import TOY_RENDERER, output_token_ids

    model = raw.setdefault("cells", {}).setdefault("engine", {}).setdefault("model", {})
    if model.get("output_id_ranges") is None:
        ids = sorted(set(output_token_ids()))
        ranges, start = [], ids[0]
        for a, b in zip(ids, ids[1:] + [None]):
            if b != a + 1:
                ranges.append([start, a + 1])
                start = b
        model["output_id_ranges"] = ranges
    raw.setdefault("gateway", {}).setdefault("renderer", TOY_RENDERER)
