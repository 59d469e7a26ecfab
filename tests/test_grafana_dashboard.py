"""The Grafana dashboard queries only metrics, and labels, that the scheduler exports.

Every `cellflip_*` identifier in a panel's PromQL (and in the templating queries) must be a
sample name the scheduler's registry exposes (`_total` for counters, `_bucket/_sum/_count`
for histograms), so renaming a metric in scheduler/control/metrics.py fails here. Labels named in
`by (...)`, `without (...)`, selectors, `label_values(...)` and `{{legend}}` templates must be
declared on the metric they apply to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from scheduler.control.metrics import FLEET_FAMILIES, Metrics

DASHBOARD = (
    Path(__file__).resolve().parent.parent / "configs" / "grafana" / "cellflip-dashboard.json"
)

# Families a dashboard for operators must show; stripping any of these panels fails the test.
REQUIRED = {
    "cellflip_cells",
    "cellflip_cells_by_role",
    "cellflip_cell_role_seconds",
    "cellflip_inflight_requests",
    "cellflip_waiting_requests",
    "cellflip_kv_blocks_used",
    "cellflip_migrations",
    "cellflip_migration_bytes",
    "cellflip_migration_downtime_seconds",
    "cellflip_flips",
    "cellflip_flip_duration_seconds",
    "cellflip_weight_broadcast_seconds",
    "cellflip_versions_live",
    "cellflip_logprob_backlog_tokens",
    "cellflip_logprob_scored_tokens",
    "cellflip_logprob_missing_tokens",
    "cellflip_logprob_final_pass_seconds",
    "cellflip_tokens_generated",
    "cellflip_admission_rejected",
    "cellflip_tokens_rejected",
    "cellflip_retokenization_drift",
    "cellflip_cells_fenced",
}

# Sample names each metric type exposes in the text exposition, as suffixes of the family name.
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "untyped": ("",),
    "unknown": ("",),
}

_METRIC = re.compile(r"(?<![\w:])cellflip_[A-Za-z0-9_:]*")
_STRING = r'"(?:[^"\\]|\\.)*"'
_SELECTOR = re.compile(r"(?<![\w:])(cellflip_[A-Za-z0-9_:]*)\s*\{((?:[^{}\"]|" + _STRING + r")*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*" + _STRING)
_GROUPING = re.compile(r"\b(by|without)\s*\(([^()]*)\)")
_MATCHING = re.compile(r"\b(on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_LABEL_VALUES = re.compile(
    r"label_values\(\s*(cellflip_[A-Za-z0-9_:]*)\s*(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)"
)
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# ------------------------------------------------------------------------------ the registry


class Exported:
    """What the scheduler's registry exposes: sample name -> family, family -> label names."""

    def __init__(self, metrics: Metrics) -> None:
        self.family_of: dict[str, str] = {}
        for family in metrics.registry.collect():
            for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)):
                self.family_of[family.name + suffix] = family.name
            for sample in family.samples:  # whatever else the client actually emits
                self.family_of.setdefault(sample.name, family.name)
        # Declared label names. A labelled metric with no child yet has no samples to read its
        # labels from, so they come from the metric objects the Metrics instance holds.
        self.labels: dict[str, set[str]] = {}
        for obj in vars(metrics).values():
            if isinstance(obj, MetricWrapperBase):
                self.labels[obj._name] = set(obj._labelnames)
        for name, (_, _, labels) in FLEET_FAMILIES.items():  # built at scrape time
            self.labels["cellflip_" + name] = set(labels)
        assert set(self.labels) == set(self.family_of.values()), (
            "Metrics attributes and registry families disagree"
        )

    def labels_of(self, sample: str) -> set[str]:
        labels = set(self.labels[self.family_of[sample]])
        if sample.endswith("_bucket"):
            labels.add("le")
        return labels


@pytest.fixture(scope="module")
def exported() -> Exported:
    return Exported(Metrics())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# ------------------------------------------------------------------------------ the dashboard


def iter_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))  # collapsed rows hold their panels


def queries(dash: dict) -> Iterator[tuple[str, str, str]]:
    """(where, PromQL, legendFormat) for every panel target and every query variable."""
    for panel in iter_panels(dash["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield (
                    f"panel {panel['title']!r} {target.get('refId', '?')}",
                    target["expr"],
                    target.get("legendFormat", ""),
                )
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q or ""
            if q:
                yield f"variable ${var['name']}", q, ""


def _matching_paren(text: str, start: int, step: int) -> int:
    """Index of the paren matching the one at `start`, scanning forward (+1) or back (-1)."""
    open_, close = ("(", ")") if step > 0 else (")", "(")
    depth, i = 0, start
    while 0 <= i < len(text):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
        i += step
    raise ValueError(f"unbalanced parentheses in {text!r}")


def _grouping_scope(expr: str, m: re.Match) -> str:
    """The aggregation argument a `by`/`without` clause applies to (prefix or postfix form)."""
    after = m.end()
    while after < len(expr) and expr[after].isspace():
        after += 1
    if after < len(expr) and expr[after] == "(":  # sum by (x) (...)
        return expr[after : _matching_paren(expr, after, 1) + 1]
    before = m.start() - 1
    while before >= 0 and expr[before].isspace():
        before -= 1
    if before >= 0 and expr[before] == ")":  # sum(...) by (x)
        return expr[_matching_paren(expr, before, -1) : before + 1]
    raise ValueError(f"cannot find what {m.group(0)!r} groups in {expr!r}")


def _label_list(text: str) -> list[str]:
    return [label.strip() for label in text.split(",") if label.strip()]


def check(dash: dict, exported: Exported) -> list[str]:
    """Every problem with the dashboard's queries against the exported metrics."""
    problems: list[str] = []
    for where, expr, legend in queries(dash):
        names = _METRIC.findall(expr)
        unknown = sorted({n for n in names if n not in exported.family_of})
        for name in unknown:
            problems.append(f"{where}: {name} is not exported by the scheduler ({expr})")
        known = [n for n in names if n in exported.family_of]
        if not known:
            continue

        for m in _SELECTOR.finditer(expr):
            if m.group(1) not in exported.family_of:
                continue
            for label in _MATCHER.findall(m.group(2)):
                if label != "__name__" and label not in exported.labels_of(m.group(1)):
                    problems.append(f"{where}: {m.group(1)} has no label {label!r}")

        for m in _GROUPING.finditer(expr):
            scoped = [
                n for n in _METRIC.findall(_grouping_scope(expr, m)) if n in exported.family_of
            ]
            if not scoped:
                problems.append(f"{where}: {m.group(0)!r} applies to no cellflip metric")
            for label in _label_list(m.group(2)):
                for name in scoped:
                    if label not in exported.labels_of(name):
                        problems.append(
                            f"{where}: {m.group(1)} ({label}) but {name} has no label {label!r}"
                        )

        everywhere = set().union(*(exported.labels_of(n) for n in known))
        for m in _MATCHING.finditer(expr):
            for label in _label_list(m.group(2)):
                if label not in everywhere:
                    problems.append(
                        f"{where}: {m.group(1)} ({label}) matches no label of {sorted(set(known))}"
                    )

        for name, label in _LABEL_VALUES.findall(expr):
            if name in exported.family_of and label not in exported.labels_of(name):
                problems.append(
                    f"{where}: label_values({name}, {label}) but it has no label {label!r}"
                )

        for label in _LEGEND.findall(legend):
            if label not in everywhere:
                problems.append(
                    f"{where}: legend {{{{{label}}}}} is not a label of {sorted(set(known))}"
                )
    return problems


def referenced_families(dash: dict, exported: Exported) -> set[str]:
    return {
        exported.family_of[n]
        for _, expr, _ in queries(dash)
        for n in _METRIC.findall(expr)
        if n in exported.family_of
    }


# ------------------------------------------------------------------------------ tests


def test_dashboard_is_grafana_json(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(iter_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']}: no queries"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit in fieldConfig"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']}: duplicate refId"


def test_every_query_uses_only_exported_metrics_and_labels(dashboard, exported):
    assert list(queries(dashboard)), "the dashboard has no queries"
    assert check(dashboard, exported) == []


def test_dashboard_shows_the_key_metrics(dashboard, exported):
    assert REQUIRED <= set(exported.labels), (
        f"REQUIRED names unexported: {REQUIRED - set(exported.labels)}"
    )
    missing = REQUIRED - referenced_families(dashboard, exported)
    assert not missing, f"no panel queries {sorted(missing)}"


def test_histograms_are_read_as_quantiles(dashboard):
    exprs = [expr for _, expr, _ in queries(dashboard)]
    for family in ("cellflip_migration_downtime_seconds", "cellflip_flip_duration_seconds"):
        for q in ("0.5", "0.99"):
            assert any(
                f"histogram_quantile({q}," in e and f"{family}_bucket" in e for e in exprs
            ), f"no p{q} of {family}"


# The checks above must actually catch what they guard against.


def _with_expr(dash: dict, expr: str, legend: str = "") -> dict:
    copy = json.loads(json.dumps(dash))
    copy["panels"].append(
        {
            "id": 10_000,
            "type": "timeseries",
            "title": "probe",
            "targets": [{"refId": "A", "expr": expr, "legendFormat": legend}],
        }
    )
    return copy


def test_a_renamed_metric_is_caught(dashboard, exported):
    renamed = Exported(Metrics())
    for sample, family in list(renamed.family_of.items()):
        if family == "cellflip_flips":  # as if metrics.py renamed cellflip_flips
            del renamed.family_of[sample]
    problems = check(dashboard, renamed)
    assert any("cellflip_flips_total is not exported" in p for p in problems), problems


@pytest.mark.parametrize(
    "expr, legend, needle",
    [
        ("sum(rate(cellflip_flip_total[5m]))", "", "cellflip_flip_total is not exported"),
        (
            "sum(rate(cellflip_flips[5m]))",
            "",
            "cellflip_flips is not exported",
        ),  # counter without _total
        (
            "histogram_quantile(0.5, rate(cellflip_flip_duration_seconds[5m]))",
            "",
            "is not exported",
        ),
        ("sum by (outcom) (rate(cellflip_flips_total[5m]))", "", "no label 'outcom'"),
        ("sum(rate(cellflip_flips_total[5m])) by (path)", "", "no label 'path'"),
        ("sum without (state) (cellflip_cells_by_role)", "", "no label 'state'"),
        ('sum(cellflip_inflight_requests{celll="a"})', "", "no label 'celll'"),
        ("sum by (cell) (cellflip_waiting_requests)", "", "no label 'cell'"),
        ("sum by (reason) (rate(cellflip_tokens_rejected_total[5m]))", "{{reasons}}", "legend"),
    ],
)
def test_a_bad_query_is_caught(dashboard, exported, expr, legend, needle):
    problems = check(_with_expr(dashboard, expr, legend), exported)
    assert any(needle in p for p in problems), problems


def test_a_stripped_dashboard_misses_key_metrics(dashboard, exported):
    def keeps(panel: dict) -> bool:
        text = json.dumps(panel.get("targets", []))
        return not any(
            k in text
            for k in (
                "cellflip_retokenization_drift",
                "cellflip_migrations_total",
                "cellflip_flips_total",
                "cellflip_logprob_backlog",
            )
        )

    stripped = dict(dashboard, panels=[p for p in dashboard["panels"] if keeps(p)])
    missing = REQUIRED - referenced_families(stripped, exported)
    assert {
        "cellflip_retokenization_drift",
        "cellflip_migrations",
        "cellflip_flips",
        "cellflip_logprob_backlog_tokens",
    } <= missing
