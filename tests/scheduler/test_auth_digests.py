"""A token's digest is computed once per token that resolves (a cell's sync every second is not
hashed again), while revocation still applies from the next request on."""

from __future__ import annotations

import pytest

import scheduler.api.auth as auth
from scheduler.store import Store


@pytest.fixture
def registry(tmp_path, monkeypatch):
    calls: list[str] = []
    real = auth.token_hash

    def counted(token: str) -> str:
        calls.append(token)
        return real(token)
    monkeypatch.setattr(auth, "token_hash", counted)
    reg = auth.TokenRegistry({"cell": "cell-secret", "admin": "admin-secret"})
    store = Store(str(tmp_path / "s.sqlite"))
    reg.open(store)
    calls.clear()
    yield reg, calls
    store.close()


def test_a_token_that_resolved_is_not_hashed_again(registry):
    reg, calls = registry
    assert all(reg.resolve("cell-secret").scope == "cell" for _ in range(5))
    assert calls == ["cell-secret"]
    # negative control: a token that does not resolve is hashed each time and nothing is kept
    assert reg.resolve("guess") is None and reg.resolve("guess") is None
    assert calls == ["cell-secret", "guess", "guess"] and "guess" not in reg._digests


def test_a_revoked_token_is_refused_though_its_digest_was_kept(registry):
    reg, _ = registry
    row, token = reg.create("agent", "a")
    assert reg.resolve(token).id == row.id and token in reg._digests
    reg.revoke(row.id)
    assert reg.resolve(token) is None
    other, token2 = reg.create("agent", "b")
    assert reg.resolve(token2).id == other.id  # the control: a live token still resolves
