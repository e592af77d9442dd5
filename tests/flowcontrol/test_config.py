"""The flowControl section of an EndpointPickerConfig, as llm-d's router reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.config.flow_control import CONCURRENCY, FCFS, GLOBAL_STRICT, ROUND_ROBIN, BandConfig, parse_quantity
from extproc.config.settings import EppConfig
from extproc.config.values import ConfigError
from extproc.scheduling.config_loader import load_text

# llm-d's flow-control guide, as its router chart takes it (guides/flow-control/router/
# flow-control.values.yaml in llm-d/llm-d), unchanged.
LLMD_GUIDE = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates:
- flowControl
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: round-robin-fairness-policy
- type: fcfs-ordering-policy
- type: concurrency-detector
  parameters:
    maxConcurrency: 132
    concurrencyMode: requests
    headroom: 0.0

schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3

flowControl:
  maxBytes: "10Gi"
  maxRequests: "1k"
  defaultRequestTTL: "60s"
  saturationDetector:
    pluginRef: concurrency-detector
  priorityBands:
  - priority: 100
    maxRequests: "500"
    fairnessPolicyRef: round-robin-fairness-policy
    orderingPolicyRef: fcfs-ordering-policy
  - priority: 0
    maxRequests: "200"
    fairnessPolicyRef: round-robin-fairness-policy
    orderingPolicyRef: fcfs-ordering-policy
  - priority: -10
    maxRequests: "50"
    fairnessPolicyRef: round-robin-fairness-policy
    orderingPolicyRef: fcfs-ordering-policy
"""
HEAD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"


def test_llm_d_s_flow_control_guide_loads_unchanged() -> None:
    cfg, profile = load_text(LLMD_GUIDE, EppConfig())
    fc = cfg.flow_control
    assert fc.enabled and fc.max_bytes == 10 * 2**30 and fc.max_requests == 1000
    assert fc.default_request_ttl_s == 60.0 and fc.no_endpoint_ttl_s == 60.0
    assert fc.detector == CONCURRENCY and fc.concurrency.max_concurrency == 132
    assert [(b.priority, b.max_requests, b.max_bytes, b.fairness, b.ordering) for b in fc.bands] == [
        (100, 500, 10**9, ROUND_ROBIN, FCFS), (0, 200, 10**9, ROUND_ROBIN, FCFS), (-10, 50, 10**9, ROUND_ROBIN, FCFS)]
    assert fc.band(-10).max_requests == 50 and fc.band(7) == BandConfig(priority=7)  # unlisted: the template
    assert profile is not None and [t for t, _ in profile.scorers] == [
        "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"]


def test_the_chart_s_default_picker_config_leaves_it_off() -> None:
    assert not EppConfig().flow_control.enabled
    cfg, _ = load_text(HEAD + "flowControl: {maxRequests: 10}\n", EppConfig())
    assert not cfg.flow_control.enabled and cfg.flow_control.max_requests == 10  # validated, unused


def test_defaults_and_templates() -> None:
    text = HEAD + """featureGates: [flowControl]
plugins:
- {type: round-robin-fairness-policy, name: rr}
flowControl:
  noEndpointRequestTTL: 5s
  defaultPriorityBand: {maxRequests: 0, maxBytes: 1Mi, fairnessPolicyRef: rr}
  defaultNegativePriorityBand: {maxRequests: 3, defaultRequestTTL: 0s}
  priorityBands:
  - {priority: 5, defaultRequestTTL: 2s}
"""
    fc = load_text(text, EppConfig())[0].flow_control
    assert fc.detector == "utilization-detector" and fc.max_requests == 0 and fc.no_endpoint_ttl_s == 5.0
    assert fc.band(1) == BandConfig(priority=1, max_bytes=2**20, fairness=ROUND_ROBIN)  # maxRequests 0: default
    assert fc.band(-3) == BandConfig(priority=-3, max_requests=3, request_ttl_s=0.0)
    assert fc.ttl_s(fc.band(-3)) == 0.0 and fc.ttl_s(fc.band(5)) == 2.0 and fc.ttl_s(fc.band(1)) == 60.0
    assert fc.band(5).fairness == GLOBAL_STRICT  # a listed band does not take the template


@pytest.mark.parametrize(("section", "needle"), [
    ("{maxRequest: 1}", "flowControl: unknown field 'maxRequest' (known: maxRequests, maxBytes"),
    ("{maxBytes: 1.5}", "flowControl.maxBytes: expected a quantity such as 500, '1k' or '10Gi', got 1.5"),
    ("{maxRequests: '-1'}", "flowControl.maxRequests: expected a quantity"),
    ("{defaultRequestTTL: soon}", "flowControl.defaultRequestTTL: expected a duration such as '60s'"),
    ("{priorityBands: [{priority: 1, maxRequest: 2}]}",
     "flowControl.priorityBands[0]: unknown field 'maxRequest' (known: priority, maxRequests"),
    ("{priorityBands: [{maxRequests: 2}]}", "flowControl.priorityBands[0].priority: expected an integer, got None"),
    ("{priorityBands: [{priority: 1}, {priority: 1}]}", "flowControl.priorityBands[1].priority: 1 is listed twice"),
    ("{priorityBands: [{priority: 1, fairnessPolicyRef: fair}]}",
     "flowControl.priorityBands[0].fairnessPolicyRef: no plugin named 'fair'"),
    ("{priorityBands: [{priority: 1, fairnessPolicyRef: fcfs-ordering-policy}]}",
     "no plugin named 'fcfs-ordering-policy' (declare it under plugins, or name one of: "
     "global-strict-fairness-policy, round-robin-fairness-policy)"),
    ("{defaultPriorityBand: {priority: 3}}", "flowControl.defaultPriorityBand: unknown field 'priority'"),
    ("{saturationDetector: {pluginRef: queue-scorer}}",
     "flowControl.saturationDetector.pluginRef: 'queue-scorer' is a queue-scorer, expected utilization-detector"),
    ("{enableEviction: true}", "flowControl.enableEviction: only false is supported"),
    ("{usageLimitPolicyPluginRef: static}", "flowControl.usageLimitPolicyPluginRef: not supported by prefix-epp"),
    ("[1]", "flowControl: expected a mapping, got list"),
])
def test_errors_name_the_field(section: str, needle: str) -> None:
    text = HEAD + "plugins:\n- type: queue-scorer\nflowControl: " + section + "\n"
    with pytest.raises(ConfigError) as err:
        load_text(text, EppConfig())
    assert needle in str(err.value)


@pytest.mark.parametrize(("params", "needle"), [
    ("{maxConcurrency: 0}", "maxConcurrency: expected an integer >= 1"),
    ("{concurrencyMode: tokens}", "concurrencyMode: expected one of ['requests']"),
    ("{maxConcurency: 2}", "unknown parameter 'maxConcurency' for concurrency-detector"),
])
def test_concurrency_detector_parameters(params: str, needle: str) -> None:
    text = HEAD + f"plugins:\n- type: concurrency-detector\n  parameters: {params}\n"
    with pytest.raises(ConfigError) as err:
        load_text(text, EppConfig())
    assert needle in str(err.value)


@pytest.mark.parametrize(("value", "expected"), [
    (5000, 5000), ("500", 500), ("1k", 1000), ("10Gi", 10 * 2**30), ("1G", 10**9), ("0", 0), ("1.5k", 1500)])
def test_quantities(value: object, expected: int) -> None:
    assert parse_quantity(value, "x") == expected


def test_the_docs_example_loads(tmp_path: Path) -> None:
    """docs/flow-control.md's example is a working EndpointPickerConfig."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "flow-control.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg, _ = load_text(block, EppConfig())
    assert cfg.flow_control.enabled
