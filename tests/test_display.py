"""The live view and the summary count moves the same way, from the same counter."""

from cells.display import _phase, _samples, moves_line

EXPOSITION = """# TYPE cellflip_migrations_total counter
cellflip_migrations_total{outcome="committed",path="kv"} 7.0
cellflip_migrations_total{outcome="committed",path="reprefill"} 2.0
cellflip_migrations_total{outcome="aborted",path="kv"} 3.0
cellflip_migrations_total{outcome="aborted",path="reprefill"} 1.0
cellflip_migrations_created 1.7e9
"""


def test_moves_by_path_with_aborted_apart():
    assert moves_line(_samples(EXPOSITION, "cellflip_migrations_total")) == "kv 7 · kv_store 0 · reprefill 2 (aborted 4)"
    assert moves_line({}) == "kv 0 · kv_store 0 · reprefill 0 (aborted 0)"


def test_phase_names_and_warmup_progress():
    assert _phase([]) == "starting the trainer"
    p = _phase([{"event": "warmup_progress", "step": 50, "steps": 200, "eta_s": 31.2}])
    assert p.startswith("warm-up") and "50/200" in p and "about 31 s left" in p and "█████░" in p
    assert _phase([{"event": "step"}]).startswith("RL step done")
    assert _phase([{"event": "something_new"}]) == "something_new"
