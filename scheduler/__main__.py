"""`python -m scheduler [--config FILE] [--db PATH] [--host H] [--port P]`: run the control plane."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from scheduler.api.app import create_app
    from scheduler.api.httpwire import Protocol
    from scheduler.contract.config import CellflipConfig, ConfigError, load_config

    p = argparse.ArgumentParser(prog="python -m scheduler", description="cellflip scheduler (control plane)")
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument("--db", help="SQLite file of the durable store (overrides scheduler.db_path)")
    p.add_argument("--host", help="bind address (overrides scheduler.host)")
    p.add_argument("--port", type=int, help="port (overrides scheduler.port)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config) if args.config else CellflipConfig()
        if args.host:  # the address it binds is the one the auth check sees (auth: none is loopback-only)
            cfg = cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"host": args.host})})
        app = create_app(cfg, db_path=args.db)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    uvicorn.run(app, host=cfg.scheduler.host, port=args.port if args.port is not None else cfg.scheduler.port,
                log_level="warning", http=Protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
