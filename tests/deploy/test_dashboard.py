"""The Grafana dashboard queries only metrics (and labels) the picker exports, and covers the
signals an operator needs: predicted and served hit rates, decision latency, in-flight per
endpoint, 429/503, stream ends, index size.

Exported names come from the code: every metric constructor call in extproc/telemetry/*.py
(Counter, Histogram, Gauge, Summary, *MetricFamily) with a literal name, expanded the way
prometheus_client exposes them (counters get _total, histograms _bucket/_sum/_count).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.helm import REPO_ROOT
from testkit.k8s_objects import CHART

DASHBOARD = CHART / "dashboards" / "prefix-epp.json"
METRIC_SOURCES = sorted((REPO_ROOT / "extproc" / "telemetry").glob("*.py"))
# Labels Prometheus adds to every scraped series (kubernetes_sd / ServiceMonitor relabelling).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    labels: frozenset[str]


def _literal_strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def exported_metrics(paths: list[Path]) -> dict[str, Metric]:
    """Series name -> Metric for every metric the picker's code constructs."""
    kinds = {"Counter": "counter", "CounterMetricFamily": "counter", "Histogram": "histogram",
             "HistogramMetricFamily": "histogram", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
             "Summary": "summary", "SummaryMetricFamily": "summary", "Info": "info", "InfoMetricFamily": "info"}
    out: dict[str, Metric] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            cls = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if cls not in kinds or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            labels = _literal_strings(node.args[2] if len(node.args) > 2 else None)
            for kw in node.keywords:
                if kw.arg in ("labels", "labelnames"):
                    labels = _literal_strings(kw.value)
            kind = kinds[cls]
            metric = Metric(first.value, kind, frozenset(labels))
            base = first.value
            if kind == "counter":
                base = base.removesuffix("_total")
                names = [base + "_total"]
            elif kind == "histogram":
                names = [base + "_bucket", base + "_sum", base + "_count"]
            elif kind == "info":
                names = [base.removesuffix("_info") + "_info"]
            else:
                names = [base]
            for series in names:
                out[series] = metric
    return out


EXPORTED = exported_metrics(METRIC_SOURCES)


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its {...} matcher) for every series selector of a PromQL query."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    found: list[tuple[str, set[str]]] = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, matcher = m.group(1), m.group(2) or ""
        rest = expr[m.end():].lstrip()
        before = expr[:m.start()].rstrip()
        if name in PROMQL_WORDS or (not matcher and re.match(r"(\(|(by|without)\s*\()", rest)):
            continue  # keyword, function call or aggregation
        if re.search(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*$", before):
            continue  # a label name in a grouping clause
        if name.startswith("$") or re.fullmatch(r"[0-9.e+-]+", name):
            continue
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matcher))
        found.append((name, labels))
    return found


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels


def test_exported_metrics_are_found() -> None:
    """The scan sees the metrics the docstring of extproc/telemetry/epp.py lists."""
    for name in ("prefix_epp_requests_total", "inference_extension_scheduler_e2e_duration_seconds_bucket",
                 "prefix_epp_predicted_prefix_hit_ratio_count", "prefix_epp_inflight_requests",
                 "inference_extension_prefix_indexer_size"):
        assert name in EXPORTED, name
    assert EXPORTED["prefix_epp_requests_total"].labels == {"outcome", "status"}
    assert EXPORTED["prefix_epp_inflight_requests"].labels == {"endpoint"}
    assert EXPORTED["prefix_epp_extproc_streams_total"].labels == {"end", "closed_by"}


EXPRESSIONS = expressions()


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=[f"query{i}" for i in range(len(EXPRESSIONS))])
def test_queries_use_exported_metrics_and_labels(expr: str) -> None:
    found = selectors(expr)
    assert found, f"no metric in {expr!r}"
    for name, labels in found:
        assert name in EXPORTED, f"{name} (in {expr!r}) is not exported by extproc/telemetry/*.py"
        unknown = labels - EXPORTED[name].labels - TARGET_LABELS
        assert not unknown, f"{name} has no label(s) {unknown}"
    metric_labels = set().union(*(EXPORTED[n].labels for n, _ in found))
    unknown = grouping_labels(expr) - metric_labels - TARGET_LABELS
    assert not unknown, f"grouping by unknown label(s) {unknown} in {expr!r}"


def test_selector_parser_finds_bad_names() -> None:
    """The checker itself: a misspelt metric or label is reported, functions and keywords are not."""
    found = dict((n, ls) for n, ls in selectors(
        'sum by (endpoint) (rate(prefix_epp_request_total{status="429", bogus=~"x"}[5m])) / scalar(up)'))
    assert found == {"prefix_epp_request_total": {"status", "bogus"}, "up": set()}
    assert "prefix_epp_request_total" not in EXPORTED


def test_dashboard_covers_the_operator_signals() -> None:
    exprs = "\n".join(EXPRESSIONS)
    needed_all = ("prefix_epp_predicted_prefix_hit_ratio_", "prefix_epp_served_cached_prompt_tokens_total",
                  "prefix_epp_served_prompt_tokens_total", "prefix_epp_predicted_cached_prompt_tokens_total",
                  "prefix_epp_extproc_streams_total",
                  "inference_extension_scheduler_e2e_duration_seconds_bucket", "prefix_epp_inflight_requests",
                  'status="429"', 'status="503"', "inference_extension_prefix_indexer_size")
    for needed in needed_all:
        assert needed in exprs, needed


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "prefix-epp" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]
