"""The API tokens, read the same way by the scheduler and every client (the middleware that
checks them is scheduler/api/auth.py).

Where the token comes from, in this order (the scheduler and every client agree):
1. `scheduler.auth_token_file`, when the config names one (it must exist and be non-empty);
2. the `CELLFLIP_API_TOKEN` environment variable;
3. `api.token` beside the store (`scheduler.db_path`), generated on first start, mode 0600.
`scheduler.auth: none` turns auth off, and is refused on any address but loopback.

`/metrics` also takes a scrape token (`metrics_token_file`, default `metrics.token` beside the
store, generated likewise): Prometheus then reads metrics and can change nothing.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from scheduler.contract.config import ConfigError, SchedulerConfig

TOKEN_ENV = "CELLFLIP_API_TOKEN"
"""Environment variable holding the API token (clients and, when no file is configured, the scheduler)."""


def load_token(path: str | None) -> str | None:
    """The token in `path` (stripped), None for no path; an unreadable or empty file stops
    start-up with a ConfigError."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def ensure_token(path: Path) -> str:
    """The token in `path`, generating it (mode 0600, created atomically) when absent."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)  # never overwrites a token another process just wrote
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return load_token(str(path))  # type: ignore[return-value]


def default_token_path(sched: SchedulerConfig, name: str = "api.token") -> Path:
    return Path(os.path.dirname(os.path.abspath(sched.db_path))) / name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_token(sched: SchedulerConfig) -> str | None:
    """The token the scheduler requires (None: auth off, loopback only). Generates the
    default token file on first start."""
    if sched.auth == "none":
        if not is_loopback(sched.host):
            raise ConfigError(f"scheduler.auth: none is refused on a non-loopback address ({sched.host}); "
                              "use a token (the default)")
        return None
    if sched.auth_token_file:
        return load_token(sched.auth_token_file)
    return os.environ.get(TOKEN_ENV) or ensure_token(default_token_path(sched))


def scrape_token(sched: SchedulerConfig) -> str | None:
    """The read-only /metrics token (None when auth is off)."""
    if sched.auth == "none":
        return None
    path = Path(sched.metrics_token_file) if sched.metrics_token_file else default_token_path(sched, "metrics.token")
    return ensure_token(path)


def client_token(sched: SchedulerConfig | None = None, token_file: str | None = None) -> str | None:
    """The token a client sends: an explicit file, the config's file, the environment
    variable, or the scheduler's generated file when it is there (None: send none)."""
    if token_file:
        return load_token(token_file)
    if sched is not None and sched.auth == "none":
        return None
    if sched is not None and sched.auth_token_file:
        return load_token(sched.auth_token_file)
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = default_token_path(sched or SchedulerConfig())
    return load_token(str(path)) if path.exists() else None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
