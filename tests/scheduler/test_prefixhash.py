"""The running prefix hash: a function of the token ids alone, cheap to extend, and it tells
a changed token apart."""

import random

import pytest

from scheduler.contract.prefixhash import BLOCK, PrefixHash, prefix_digest


def test_digest_depends_on_the_ids_not_on_how_they_were_appended():
    rng = random.Random(3)
    ids = [rng.randrange(150_000) for _ in range(3 * BLOCK + 17)]
    whole = prefix_digest(ids)
    h = PrefixHash()
    k = 0
    for step in (1, BLOCK - 1, 2, 5 * BLOCK, 0):
        h.extend(ids[k:k + step])
        k += step
        assert h.digest() == prefix_digest(ids[:k])
    assert h.length == len(ids) and h.digest() == whole
    assert PrefixHash.from_json(h.to_json()).extend([9]).digest() == prefix_digest(ids + [9])


@pytest.mark.parametrize("at", [0, BLOCK - 1, BLOCK, 2 * BLOCK + 5, -1])
def test_one_changed_token_or_another_length_changes_the_digest(at):
    ids = list(range(1000, 1000 + 3 * BLOCK + 17))
    changed = list(ids)
    changed[at] += 1  # negative control: the same length, one id different
    assert prefix_digest(changed) != prefix_digest(ids)
    assert prefix_digest(ids[:-1]) != prefix_digest(ids) and prefix_digest([0]) != prefix_digest([0, 0])
    assert prefix_digest([]) != prefix_digest([0])


def test_bad_ids_and_states_are_refused():
    with pytest.raises(ValueError):
        prefix_digest([1, -2])
    with pytest.raises(ValueError):
        PrefixHash.from_json({"n": 3, "chain": "00" * 16, "tail": [1, 2]})
