"""The committed bench baselines, held to the code and to the README; no bench runs here.

- Every baseline records its provenance: the commit, the SHA-256 of its bench's source file,
  the command. One whose bench source is not the tree's is stale: it must be listed in
  bench/stale.yaml with a reason, and a listed one that is fresh fails as well.
- Its `targets` and `all_met` are what bench/judge.py gives now from its own figures: a goal
  changed in bench/targets.yaml fails here until `python bench/judge.py --write`.
- The judge on made-up results: a met target, a missed one (exit 1 through `finish`), a missing
  field, a check that cannot compare, `--no-targets`; and the expression language under it.
- README's figures table is what bench/render_readme.py renders from the baselines.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import judge  # noqa: E402
import render_readme  # noqa: E402
from expr import ExprError, Many, Missing, evaluate, lookup  # noqa: E402

BASELINES = judge.baselines()
NOT_BENCHES = {"common.py", "expr.py", "judge.py", "render_readme.py", "train_checks.py"}


def bench_scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if p.name not in NOT_BENCHES and "__main__" in p.read_text())


def stale_baselines() -> dict[str, str]:
    """Baseline name -> why it is stale, for every one whose bench source is not the tree's."""
    out = {}
    for path in BASELINES:
        prov = json.loads(path.read_text())["provenance"]
        now = judge.source_sha256(judge.bench_of(path))
        if prov["bench_sha256"] != now:
            out[path.name] = f"measured on bench source {prov['bench_sha256'][:12]} (commit {prov['commit'][:8]}), tree has {now[:12]}"
        elif "companions_sha256" in prov and prov["companions_sha256"] != judge.companions_sha256(judge.bench_of(path)):
            # recorded since the companions' hash exists; older baselines are judged on bench/NAME.py alone
            out[path.name] = f"a bench-local module it imports changed since commit {prov['commit'][:8]}"
    return out


# ------------------------------------------------------------------ targets.yaml and the benches

def test_every_bench_has_a_section_and_every_section_a_bench():
    spec = judge.load_targets()  # every field, op, goal and expression checked
    sections = {s.split(".")[0] for s in spec}
    scripts = {p.stem for p in bench_scripts()}
    assert scripts - sections == set(), "benches without a section in bench/targets.yaml"
    assert sections - scripts == set(), "sections of bench/targets.yaml without a bench"


@pytest.mark.parametrize("script", bench_scripts(), ids=lambda p: p.stem)
def test_every_bench_ends_in_finish_with_its_own_name(script):
    calls = [n for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "finish"]
    assert calls, f"{script.name} never calls common.finish"
    names = {a.value for c in calls for a in c.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    assert names == {script.stem}, f"{script.name} calls finish with {names}"


# ------------------------------------------------------------------ the committed baselines

@pytest.mark.parametrize("path", BASELINES, ids=lambda p: p.name)
def test_every_baseline_records_its_provenance(path):
    prov = json.loads(path.read_text()).get("provenance")
    assert prov, f"{path.name}: no provenance"
    assert re.fullmatch(r"[0-9a-f]{40}", prov.get("commit") or ""), prov
    assert re.fullmatch(r"[0-9a-f]{64}", prov.get("bench_sha256") or ""), prov
    assert prov.get("command", "").startswith(f"python bench/{judge.bench_of(path)}.py"), prov


def test_stale_baselines_are_the_listed_ones():
    listed = yaml.safe_load((BENCH / "stale.yaml").read_text()) or {}
    stale = stale_baselines()
    assert all(isinstance(v, str) and v.strip() for v in listed.values()), "every listed baseline needs a reason"
    unlisted = {k: v for k, v in stale.items() if k not in listed}
    assert not unlisted, ("stale baselines (run the bench again, or list it with a reason in bench/stale.yaml):\n"
                          + "\n".join(f"  {k}: {v}" for k, v in unlisted.items()))
    fresh = sorted(set(listed) - set(stale))
    assert not fresh, f"listed in bench/stale.yaml but fresh or gone (remove them): {fresh}"


@pytest.mark.parametrize("path", BASELINES, ids=lambda p: p.name)
def test_each_baselines_targets_are_the_judges_verdict_now(path):
    stored = json.loads(path.read_text())
    assert judge.rejudge(path) == stored, f"{path.name}: run python bench/judge.py --write"


def test_a_changed_goal_changes_the_verdict(tmp_path):
    spec = judge.load_targets()
    spec["flip"]["ratio"] = {**spec["flip"]["ratio"], "goal": 0.01}
    path = BENCH / "flip.baseline.json"
    assert judge.rejudge(path, spec) != json.loads(path.read_text())


def test_a_baseline_whose_source_changed_is_stale(tmp_path, monkeypatch):
    data = json.loads((BENCH / "p2p.baseline.json").read_text())
    data["provenance"]["bench_sha256"] = judge.source_sha256("p2p")
    fresh = tmp_path / "p2p.baseline.json"
    fresh.write_text(json.dumps(data))
    data["provenance"]["bench_sha256"] = "0" * 64
    (tmp_path / "p2p.old.baseline.json").write_text(json.dumps(data))
    monkeypatch.setattr(sys.modules[__name__], "BASELINES", sorted(tmp_path.glob("*.baseline.json")))
    assert set(stale_baselines()) == {"p2p.old.baseline.json"}


def test_a_baseline_whose_companion_module_changed_is_stale(tmp_path, monkeypatch):
    """The negative control of the companions' hash: e2e's figures come from bench/e2e_jobs.py
    too, so a baseline that recorded another hash of it is stale though bench/e2e.py is not."""
    assert {p.name for p in judge.companions("e2e")} >= {"e2e_jobs.py"}
    assert "bound.py" in {p.name for p in judge.companions("cluster_sim")}
    assert not {p.stem for p in judge.companions("cluster_sim")} & judge.JUDGING
    data = json.loads((BENCH / "e2e.baseline.json").read_text())
    data["provenance"]["bench_sha256"] = judge.source_sha256("e2e")
    data["provenance"]["companions_sha256"] = judge.companions_sha256("e2e")
    (tmp_path / "e2e.baseline.json").write_text(json.dumps(data))
    data["provenance"]["companions_sha256"] = "0" * 64
    (tmp_path / "e2e.old.baseline.json").write_text(json.dumps(data))
    monkeypatch.setattr(sys.modules[__name__], "BASELINES", sorted(tmp_path.glob("*.baseline.json")))
    assert set(stale_baselines()) == {"e2e.old.baseline.json"}


# ------------------------------------------------------------------ the judge on made-up results

SPEC = {
    "demo": {
        "worst_ms": {"value": "max(points.*.ms)", "op": "<=", "goal": 50, "about": "worst"},
        "exact": {"value": "exact", "op": "==", "goal": True, "about": "exact"},
        "gain": {"value": "min(seeds.*.last - seeds.*.control)", "op": ">=", "goal": 0.1, "about": "gain"},
    },
    "demo.quick": {"gain": None},
}


def demo(ms=(10, 40), exact=True, gains=((0.5, 0.1), (0.9, 0.2))) -> dict:
    return {"points": [{"ms": m} for m in ms], "exact": exact,
            "seeds": [{"last": a, "control": b} for a, b in gains]}


def test_met_targets():
    targets, ok = judge.judge(demo(), "demo", False, SPEC)
    assert ok and all(t["met"] for t in targets.values())
    assert targets["worst_ms"] == {"value": 40, "op": "<=", "goal": 50, "met": True, "at": "points.1"}
    assert targets["gain"]["value"] == pytest.approx(0.4) and targets["gain"]["at"] == "seeds.0"


def test_a_missed_target():
    targets, ok = judge.judge(demo(ms=(10, 60)), "demo", False, SPEC)
    assert not ok and not targets["worst_ms"]["met"] and targets["exact"]["met"]
    assert judge.missed(targets) == ["worst_ms: 60 at points.1; goal <= 50"]


def test_a_missing_field_or_a_null_misses():
    result = demo()
    del result["exact"]
    targets, ok = judge.judge(result, "demo", False, SPEC)
    assert not ok and not targets["exact"]["met"] and "not in the result" in targets["exact"]["error"]
    targets, ok = judge.judge({**demo(), "points": [{"ms": None}]}, "demo", False, SPEC)
    assert not ok and "null" in targets["worst_ms"]["error"]


def test_a_value_of_the_wrong_kind_misses():
    # 1 is not true, a list is not a number, "yes" is not a bool: never a silent pass
    for result in ({**demo(), "exact": 1}, {**demo(), "exact": "yes"}):
        targets, ok = judge.judge(result, "demo", False, SPEC)
        assert not ok and "error" in targets["exact"]
    spec = {"demo": {"all_ms": {"value": "points.*.ms", "op": "<=", "goal": 50, "about": "a list"}}}
    targets, ok = judge.judge(demo(), "demo", False, spec)
    assert not ok and "not a number" in targets["all_ms"]["error"]


def test_quick_mode_drops_and_overrides_targets():
    targets, _ = judge.judge(demo(gains=((0.1, 0.1),)), "demo", True, SPEC)
    assert set(targets) == {"worst_ms", "exact"}
    with pytest.raises(KeyError):
        judge.targets_for("nobench", False, SPEC)


@pytest.mark.parametrize("bad", [
    {"value": "max(", "op": "<=", "goal": 1, "about": ""},
    {"value": "x", "op": "=<", "goal": 1, "about": ""},
    {"value": "x", "op": ">=", "goal": True, "about": ""},
    {"value": "x", "op": ">=", "goal": 1},
    {"value": "frobnicate(x)", "op": ">=", "goal": 1, "about": ""},
])
def test_a_wrong_target_is_refused(tmp_path, bad):
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump({"demo": {"t": bad}}))
    with pytest.raises(judge.TargetsError):
        judge.load_targets(path)


def run_finish(result: dict, no_targets: bool) -> tuple[int, dict]:
    args = argparse.Namespace(quick=False, json=True, no_targets=no_targets)
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        common.finish(dict(result), args, "flip", argv=["--json"])
    return exit_.value.code, json.loads(out.getvalue().strip().splitlines()[-1])


def test_finish_exits_by_the_targets_of_bench_targets_yaml():
    code, printed = run_finish({"ratio": 0.05, "lost": 0}, no_targets=False)
    assert code == 0 and printed["all_met"] is True
    assert printed["provenance"]["bench_sha256"] == judge.source_sha256("flip")
    assert printed["provenance"]["command"] == "python bench/flip.py --json"
    code, printed = run_finish({"ratio": 0.2, "lost": 0}, no_targets=False)
    assert code == 1 and printed["targets"]["ratio"]["met"] is False
    code, printed = run_finish({"lost": 0}, no_targets=False)  # no ratio at all: missed
    assert code == 1 and printed["all_met"] is False


def test_no_targets_exits_0_and_still_reports_the_misses():
    code, printed = run_finish({"ratio": 0.2, "lost": 3}, no_targets=True)
    assert code == 0 and printed["all_met"] is False


# ------------------------------------------------------------------ the expression language

def test_paths_wildcards_and_items():
    r = {"a": {"x": 1, "y": 3}, "l": [{"v": 2}, {"v": 5}], "s": {"1": 7}}
    assert lookup(r, "s.1") == 7 and lookup(r, "l.1.v") == 5
    assert lookup(r, "a.*") == Many([("a.x", 1), ("a.y", 3)])
    assert evaluate(r, "max(l.*.v) - min(a.*)") == (4, "a.x")  # the last min/max names its item
    assert evaluate(r, "l.*.v * 2 + 1")[0].values() == [5, 11]
    assert evaluate(r, "len(a.*)")[0] == 2 and evaluate(r, "median(l.*.v)")[0] == 3.5
    assert evaluate(r, "1e9 / 1000")[0] == 1e6 and evaluate(r, "(1 + 2) * 3")[0] == 9


@pytest.mark.parametrize("text", ["a.w", "a.z + 1", "l.2.v", "l.*.v - a.*", "min(nothing.*)", "a.x / 0"])
def test_what_is_not_there_is_missing(text):
    with pytest.raises(Missing):
        evaluate({"a": {"x": 1, "y": 3, "z": None}, "l": [{"v": 2}], "nothing": []}, text)


@pytest.mark.parametrize("text", ["a +", "(a", "a b", "a ; b", "nope(a)"])
def test_what_does_not_parse_is_refused(text):
    with pytest.raises(ExprError):
        evaluate({"a": 1, "b": 2}, text)


# ------------------------------------------------------------------ README

def test_the_readme_table_is_rendered_from_the_baselines():
    readme = render_readme.readme_table(render_readme.README.read_text())
    rendered = render_readme.render_table()
    assert readme == rendered, "README.md's figures table differs: python bench/render_readme.py --write"


def test_the_readme_check_sees_a_changed_figure():
    text = render_readme.README.read_text()
    table = render_readme.readme_table(text)
    changed = table.replace("| `bench/p2p.py` |", "| `bench/p2p.py` | 9.9 vs", 1)
    assert changed != table
    assert render_readme.readme_table(render_readme.write(text, changed)) != render_readme.render_table()
    assert render_readme.readme_table(render_readme.write(text, table)) == table


def test_templates_cite_only_what_a_baseline_holds():
    with pytest.raises(render_readme.RenderError, match="not in the result"):
        render_readme.fill("{no_such_field:.2f}", {"main": {"a": 1}}, "demo")
    with pytest.raises(render_readme.RenderError, match="no target"):
        render_readme.fill("{?no_such_target}", {"main": {"targets": {}}}, "demo")
    baseline = {"a": [1.234, 5.678], "targets": {"t": {"value": 1, "op": ">=", "goal": 0.8, "met": False}}}
    assert render_readme.fill("{a.*:.1f} ms, {?t}, {!t}, {{id}}", {"main": baseline}, "demo") == \
        "1.2 / 5.7 ms, target ≥ 0.8: missed, missed, {id}"
