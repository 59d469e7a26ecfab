"""Migration endpoints, path costs and shared-store identities for SGLang cells (the planner
chooses the path: tests/scheduler)."""

from __future__ import annotations

import pytest

from cells.engine.sglang.migration import MigrationEndpoint, kv_store_identity

HIC = MigrationEndpoint(kv_export=False, kv_store="file:abc", model="m", version=3)


def test_endpoint_json_roundtrip():
    assert MigrationEndpoint.from_dict(HIC.to_dict()) == HIC
    with pytest.raises(ValueError):
        MigrationEndpoint.from_dict({"kv_export": True})


def test_planner_cost_orders_paths_for_long_contexts():
    from scheduler.planner.paths import move_seconds

    kv, store, re = (move_seconds(100_000, False, p) for p in ("kv", "kv_store", "reprefill"))
    assert kv < store < re
    assert move_seconds(0, False, "reprefill") == 0


def test_store_identity_needs_hicache_with_a_backend():
    assert kv_store_identity({}) is None
    assert kv_store_identity({"enable_hierarchical_cache": True}) is None
    a = kv_store_identity({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"})
    b = kv_store_identity({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake",
                           "hicache_storage_backend_extra_config": '{"master": "x"}'})
    assert a.startswith("mooncake:") and a != b
