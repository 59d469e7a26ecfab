import random

import torch

from cells.engine.embedded.kv_cache import BlockPool
from cells.engine.embedded.model_spec import ModelSpec

SPEC = ModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                 intermediate_size=64, vocab_size=64)


def test_allocate_free_verb_pairs_keep_integrity():
    pool = BlockPool(SPEC, num_blocks=10, block_size=4)
    assert pool.can_allocate(10) and not pool.can_allocate(11)
    a = pool.allocate("a", 3)
    assert len(set(a)) == 3 and pool.num_free == 7
    assert pool.can_append("a", 12) and not pool.can_append("a", 13 + 7 * 4)
    pool.append_slots("a", 13)
    assert len(pool.tables["a"]) == 4
    assert pool.free("a") == 4 and pool.num_free == 10
    assert pool.free("a") == 0  # a second free is a no-op, never a double free
    pool.check_integrity()


def test_random_ops_never_leak_or_share_blocks():
    rng = random.Random(0)
    pool = BlockPool(SPEC, num_blocks=32, block_size=4)
    owners = [f"r{i}" for i in range(6)]
    for _ in range(500):
        o = rng.choice(owners)
        if rng.random() < 0.3:
            pool.free(o)
        else:
            n = rng.randint(1, 40)
            if pool.can_append(o, n):
                pool.append_slots(o, n)
        pool.check_integrity()


def test_export_import_round_trip_is_bitwise():
    src = BlockPool(SPEC, num_blocks=8, block_size=4)
    dst = BlockPool(SPEC, num_blocks=8, block_size=4)
    src.append_slots("x", 10)
    src.k.normal_()
    src.v.normal_()
    data = src.export_blocks("x", 0, 3)
    dst.allocate("filler", 2)
    dst.allocate("x", 3)
    dst.import_blocks("x", 0, data)
    for layer in range(SPEC.num_layers):
        ks, vs = src.read(layer, "x", 10)
        kd, vd = dst.read(layer, "x", 10)
        assert torch.equal(ks, kd) and torch.equal(vs, vd)
