"""The Grafana dashboard queries only metrics (and labels) the picker exports, and covers the
signals an operator needs: predicted and served hit rates, decision latency, in-flight per
endpoint, 429/503, stream ends, index size, flow control's queue, outcomes, time held and saturation.

Exported names come from the code (testkit/promql.py).
"""

from __future__ import annotations

import json
import re

import pytest

from testkit.k8s_objects import CHART
from testkit.promql import EXPORTED, TARGET_LABELS, grouping_labels, selectors

DASHBOARD = CHART / "dashboards" / "prefix-epp.json"


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


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
                  'status="429"', 'status="503"', "inference_extension_prefix_indexer_size",
                  "prefix_epp_flow_control_queue_size", "prefix_epp_flow_control_queue_bytes",
                  "prefix_epp_flow_control_requests_total",
                  "prefix_epp_flow_control_request_queue_duration_seconds_bucket",
                  "prefix_epp_flow_control_pool_saturation")
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
