"""Migration path choice and cost for SGLang cells."""

from __future__ import annotations

import pytest

from cells.engine.sglang.migration import (
    MigrationEndpoint,
    choose_migration_path,
    kv_store_identity,
)

EMB = MigrationEndpoint(kv_export=True, kv_store=None, model="m", version=3)
SGL = MigrationEndpoint(kv_export=False, kv_store=None, model="m", version=3)
HIC = MigrationEndpoint(kv_export=False, kv_store="file:abc", model="m", version=3)


@pytest.mark.parametrize("src,dst,path", [
    (EMB, EMB, "kv"),
    (EMB, SGL, "reprefill"),
    (SGL, EMB, "reprefill"),
    (HIC, HIC, "kv_store"),
    (HIC, SGL, "reprefill"),
    (HIC, MigrationEndpoint(False, "file:other", "m", 3), "reprefill"),
    (HIC, MigrationEndpoint(False, "file:abc", "m", 4), "reprefill"),  # KV of another version: never reused
    (HIC, MigrationEndpoint(False, "file:abc", "m2", 3), "reprefill"),
    (EMB, MigrationEndpoint(True, None, "m", None), "reprefill"),
    (MigrationEndpoint(True, "s", "m", 3), MigrationEndpoint(True, "s", "m", 3), "kv"),
])
def test_path_choice(src, dst, path):
    assert choose_migration_path(src, dst) == path


def test_endpoint_json_roundtrip():
    assert MigrationEndpoint.from_dict(HIC.to_dict()) == HIC
    with pytest.raises(ValueError):
        MigrationEndpoint.from_dict({"kv_export": True})


def test_planner_cost_orders_paths_for_long_contexts():
    from scheduler.planner import move_seconds

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
