"""The API tokens and their scopes, read the same way by the scheduler and every client (the
middleware that checks them is scheduler/api/auth.py; which route takes which scope is
scheduler/api/scopes.py).

Scopes, least privilege first:
- `scrape`: `GET /metrics` only (Prometheus);
- `agent`: the OpenAI-compatible gateway and `/v1/generate`, and reading its own sessions;
- `reader`: the trajectory export's reads (`/v1/export/...`: finished trajectories with their
  provenance, the versions that made them) and its acknowledgements; it changes no state any
  other reader or the trainer sees (`cellflip export`);
- `cell`: the cell protocol (`/internal/v1/...`) only;
- `trainer`: flips, versions, trajectories, trainer reports, finishing sessions, cells;
- `admin`: everything, and the only scope that creates or revokes tokens.

Each scope has a bootstrap token, found in this order (the scheduler and every client agree):
1. the config's file for the scope (`scheduler.auth_token_file` for admin,
   `scheduler.metrics_token_file` for scrape, `scheduler.<scope>_token_file` for the others but
   reader, which has no config file);
   it must exist and be non-empty;
2. the scope's environment variable (`CELLFLIP_API_TOKEN` for admin, `CELLFLIP_<SCOPE>_TOKEN`
   for the others);
3. `<file>` beside the store (`scheduler.db_path`): `api.token` (admin), `trainer.token`,
   `cell.token`, `agent.token`, `metrics.token`, `reader.token`, generated on first start (mode 0600,
   created atomically, never overwritten, so stable across restarts).
A client of a scope other than admin that finds none of these uses `CELLFLIP_API_TOKEN` when
set (a user who exported the admin token). More tokens of any scope are created and revoked
at run time through `POST /v1/tokens` (`cellflip token create|revoke|list`), stored hashed.
`scheduler.auth: none` turns auth off, and is refused on any address but loopback.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from pathlib import Path

from scheduler.contract.config import ConfigError
from scheduler.contract.config.scheduler import SchedulerConfig

SCOPES = ("admin", "trainer", "cell", "agent", "scrape", "reader")
"""Every scope a token can have."""

TOKEN_ENV = "CELLFLIP_API_TOKEN"
"""Environment variable holding the admin token (clients and, when no file is configured, the scheduler)."""

SCOPE_ENV = {"admin": TOKEN_ENV, "trainer": "CELLFLIP_TRAINER_TOKEN", "cell": "CELLFLIP_CELL_TOKEN",
             "agent": "CELLFLIP_AGENT_TOKEN", "scrape": "CELLFLIP_SCRAPE_TOKEN",
             "reader": "CELLFLIP_READER_TOKEN"}
"""Each scope's environment variable."""

SCOPE_FILE = {"admin": "api.token", "trainer": "trainer.token", "cell": "cell.token", "agent": "agent.token",
              "scrape": "metrics.token", "reader": "reader.token"}
"""Each scope's bootstrap token file beside the store."""


def token_hash(token: str) -> str:
    """What the scheduler keeps of a token (SHA-256: tokens are 256-bit random strings, so a
    fast hash is enough; the store never holds a usable token)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


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
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_token() + "\n")
        try:
            os.link(tmp, path)  # never overwrites a token another process just wrote
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return load_token(str(path))  # type: ignore[return-value]


def default_token_path(sched: SchedulerConfig, name: str = "api.token") -> Path:
    return Path(os.path.dirname(os.path.abspath(sched.db_path))) / name


def scope_token_path(sched: SchedulerConfig, scope: str) -> Path:
    """Where the scope's bootstrap token lives: the config's file, else the default beside the store."""
    configured = _configured_file(sched, scope)
    return Path(configured) if configured else default_token_path(sched, SCOPE_FILE[scope])


def _configured_file(sched: SchedulerConfig, scope: str) -> str | None:
    if scope not in SCOPES:
        raise ValueError(f"unknown token scope {scope!r} (one of {', '.join(SCOPES)})")
    if scope == "admin":
        return sched.auth_token_file
    if scope == "scrape":
        return sched.metrics_token_file
    return getattr(sched, f"{scope}_token_file", None)  # reader: its variable or its file beside the store


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_auth_off(sched: SchedulerConfig) -> None:
    if not is_loopback(sched.host):
        raise ConfigError(f"scheduler.auth: none is refused on a non-loopback address ({sched.host}); "
                          "use tokens (the default)")


def server_tokens(sched: SchedulerConfig) -> dict[str, str] | None:
    """Every scope's bootstrap token (None: auth off, loopback only), generating the default
    files beside the store on first start. Two scopes sharing one token is a ConfigError
    (it would give one of them the other's rights)."""
    if sched.auth == "none":
        _check_auth_off(sched)
        return None
    out: dict[str, str] = {}
    for scope in SCOPES:
        configured = _configured_file(sched, scope)
        if configured:
            out[scope] = load_token(configured)  # type: ignore[assignment]
        else:
            out[scope] = os.environ.get(SCOPE_ENV[scope]) or ensure_token(default_token_path(sched, SCOPE_FILE[scope]))
    seen: dict[str, str] = {}
    for scope, tok in out.items():
        if tok in seen:
            raise ConfigError(f"the {seen[tok]} and {scope} scopes have the same token: each scope needs its own")
        seen[tok] = scope
    return out


def server_token(sched: SchedulerConfig) -> str | None:
    """The admin token (None: auth off); generates every scope's default file on first start."""
    tokens = server_tokens(sched)
    return None if tokens is None else tokens["admin"]


def scrape_token(sched: SchedulerConfig) -> str | None:
    """The read-only /metrics token (None when auth is off)."""
    tokens = server_tokens(sched)
    return None if tokens is None else tokens["scrape"]


def client_token(sched: SchedulerConfig | None = None, token_file: str | None = None,
                 scope: str = "admin") -> str | None:
    """The token a client of `scope` sends: an explicit file, the config's file for the
    scope, the scope's environment variable, the scope's generated file beside the store when
    it is there, else (for a scope other than admin) `CELLFLIP_API_TOKEN`. None: send none."""
    if token_file:
        return load_token(token_file)
    sched = sched or SchedulerConfig()
    if sched.auth == "none":
        return None
    configured = _configured_file(sched, scope)
    if configured:
        return load_token(configured)
    if os.environ.get(SCOPE_ENV[scope]):
        return os.environ[SCOPE_ENV[scope]]
    path = default_token_path(sched, SCOPE_FILE[scope])
    if path.exists():
        return load_token(str(path))
    return os.environ.get(TOKEN_ENV) or None


def scoped_env(tokens: dict[str, str] | None, *scopes: str) -> dict[str, str | None]:
    """Environment updates giving a process exactly the tokens of `scopes` (the others' variables
    set to None: the caller removes them), so no process holds a token it does not need."""
    if tokens is None:
        return {}
    return {SCOPE_ENV[s]: (tokens[s] if s in scopes else None) for s in SCOPES}


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
