"""docs/metrics.md names every metric the picker exports, and none it does not.

Exported: the families of a real picker's registry with every optional part wired (KV events,
peer sync, Kubernetes discovery, the predicted-TTFT model, flow control) and the pod-level family of a
multi-worker pod, as `/metrics` names them (counters with `_total`; the `_created` series that
prometheus_client adds beside counters and histograms are left out). Documented: the names in the
first column of the table, `{a,b}` after an underscore expanding to each alternative and `{...}`
after a name being its labels. The doc's PromQL queries name only exported metrics and labels
(testkit/promql.py reads them as it reads the dashboard's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.config.flow_control import FlowControlConfig
from extproc.config.settings import EppConfig, KVEventsConfig, SyncConfig
from extproc.core.datastore import EndpointSpec
from extproc.runtime.app import App
from extproc.telemetry.pod import PodMetrics
from testkit.helm import REPO_ROOT
from testkit.promql import EXPORTED, grouping_labels, selectors

DOC = REPO_ROOT / "docs" / "metrics.md"


def exported(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("PREFIX_EPP_SYNC_SECRET", "s" * 32)
    app = App(EppConfig(seed=1, pool_name="pool", kv_events=KVEventsConfig(enabled=True), sync=SyncConfig(port=1),
                        flow_control=FlowControlConfig(enabled=True)))
    app.datastore.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    text = PodMetrics([]).render(generate_latest(app.metrics.registry).decode()).decode()
    families = list(text_string_to_metric_families(text))
    created = {f.name + "_created" for f in families if f.type in ("counter", "histogram")}  # their creation time
    return {f.name + "_total" if f.type == "counter" else f.name for f in families if f.name not in created}


def expand(name: str) -> Iterator[str]:
    """`a_{b,c}_d{labels}` -> a_b_d, a_c_d."""
    m = re.search(r"_\{([^}]*)\}", name)
    if m is None:
        yield name.split("{", 1)[0]
        return
    for alt in m.group(1).split(","):
        yield from expand(name[:m.start()] + "_" + alt.strip() + name[m.end():])


def documented() -> set[str]:
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        for token in re.findall(r"`([^`]+)`", first):
            names.update(expand(token))
    return names


def test_expand_reads_the_doc_shorthands() -> None:
    assert list(expand("a_{b,c}_total{x,y}")) == ["a_b_total", "a_c_total"]
    assert list(expand("a_{b,c}_{d,e}")) == ["a_b_d", "a_b_e", "a_c_d", "a_c_e"]
    assert list(expand("inference_objective_request_error_total{...,error_code}")) == [
        "inference_objective_request_error_total"]


def test_every_exported_metric_is_documented_and_every_documented_one_exported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names = exported(monkeypatch)
    assert "prefix_epp_extproc_streams_total" in names and "prefix_epp_sync_warm" in names  # all parts wired
    assert "prefix_epp_discovery_refused_annotations_total" in names
    doc = documented()
    assert sorted(names - doc) == [], "exported but not in docs/metrics.md"
    assert sorted(doc - names) == [], "in docs/metrics.md but not exported"


def promql() -> list[str]:
    """The doc's PromQL queries: each line of its ```promql blocks, continuation lines joined."""
    queries: list[str] = []
    for block in re.findall(r"```promql\n(.*?)```", DOC.read_text(), re.S):
        for line in block.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line.startswith(" ") and queries:
                queries[-1] += " " + line.strip()
            else:
                queries.append(line)
    return queries


def test_the_docs_queries_use_exported_metrics_and_labels() -> None:
    queries = promql()
    assert len(queries) >= 12
    for query in queries:
        found = selectors(query)
        assert found, query
        found = [(n, labels) for n, labels in found if not n.startswith("vllm:")]  # the engines' own
        for name, labels in found:
            assert name in EXPORTED, f"{name} (in {query!r}) is not exported"
            assert labels <= EXPORTED[name].labels, f"{name} has no label(s) {labels - EXPORTED[name].labels}"
        grouped = set().union(*(EXPORTED[n].labels for n, _ in found)) | {"le"}
        assert grouping_labels(query) <= grouped, query
