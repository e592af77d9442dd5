"""The Grafana dashboard and the chart's alert rules, evaluated by a real Prometheus that scraped a
picker under traffic.

The rig: a fake Kubernetes API (testkit.kube) with an InferencePool of three model-server stubs
(testkit.vllm_stubs: they answer requests, or keep them open while told to hold, and serve a vLLM
/metrics page whose load the test sets) and two InferenceObjectives (`chat`, priority 5; `batch`,
-1: sheddable), the picker discovering them with flow control on (CONFIG: a concurrency detector of
one request per endpoint, a band of one request for priority -1), real Envoy in front of it, and
Debian's Prometheus (testkit.prometheus) scraping the picker every second with the `namespace` and
`pod` labels a Kubernetes scrape attaches.

The traffic makes every panel's metric move: shared-prefix completions (hit ratio), chat requests,
a malformed JSON body (400, the error panels), a request pinned to an endpoint outside the pool
(503), and flow control at work: three requests the stubs keep open saturate the pool, a sheddable
request is held, the next finds its band full (429 rejected-saturated), then the stubs answer and
the held one is dispatched (the queue, outcome, time-held and saturation panels). It starts after
Prometheus's first scrape of the picker and runs twice with a scrape between, because a labelled
series is born with its first request: only the second round makes every rate rise. Once
Prometheus has scraped twice after the last request (every series has samples on both sides of
it), every panel target of charts/prefix-epp/dashboards/prefix-epp.json is evaluated through /api/v1/query
with Grafana's variables substituted: `$namespace` and `$pod` by what their own `label_values`
queries return, `$__rate_interval` by a window covering the whole run. A query that Prometheus
refuses, or whose answer has no series with a finite value (a panel that would draw nothing),
fails. Panels are read from the JSON, so panels added later are checked as they come.

Alert rules: every PrometheusRule that the chart renders under any value set of
testkit/k8s_objects.py is loaded into the same Prometheus as a rule file; each rule must be
evaluated with health "ok".
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import urllib3
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit.envoy import run_envoy
from testkit.k8s_objects import CHART, VALUE_SETS, Obj
from testkit.kube import OBJECTIVES, PODS, POOL_V1, KubeApi, objective, pod, pool_v1
from testkit.procs import free_ports, prefix_epp, python_module, running, wait_for_port
from testkit.prometheus import Prometheus, Target, running_prometheus

pytestmark = pytest.mark.e2e

DASHBOARD = json.loads((CHART / "dashboards" / "prefix-epp.json").read_text())
SCRAPE_S = 1.0
# $__rate_interval (Grafana: at least four scrape intervals) stands for a window covering the whole
# run, so every rate sees the traffic whenever it was sent.
WINDOW = "2m"
GRAFANA_BUILTINS = {"$__rate_interval": WINDOW, "$__interval": f"{int(SCRAPE_S)}s", "$__range": WINDOW}
NAMESPACE, POD = "prefix-epp", "prefix-epp-5d8f9c7b6-x2x4q"  # the labels the scrape attaches
# Panel targets whose data needs a picker feature this rig does not turn on: (panel title, refId)
# -> why. Such a target must still be a query Prometheus accepts. Keep it empty where possible.
NEEDS_FEATURE: dict[tuple[str, str], str] = {}
# Flow control on, so its panels draw: the pool (3 endpoints) is saturated by 3 requests in flight,
# and the sheddable objective's band holds one request.
CONFIG = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
flowControl:
  noEndpointRequestTTL: 0s
  saturationDetector: {pluginRef: concurrency-detector}
  priorityBands:
  - {priority: -1, maxRequests: 1}
"""

HTTP = urllib3.PoolManager(maxsize=4)


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str


def panel_queries() -> list[PanelQuery]:
    out = []
    for panel in DASHBOARD["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            out.append(PanelQuery(panel["title"], target.get("refId", str(i)), target["expr"]))
    return out


QUERIES = panel_queries()


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's `$name` and `${name}` replaced from `variables` (names without `$`)."""
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # $__range before $__r...
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def label_values_query(var: dict[str, Any]) -> tuple[str, str]:
    """(series selector, label) of a `label_values(selector, label)` template variable."""
    query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query)
    assert m, f"template variable {var['name']}: only label_values(...) queries are evaluated here: {query!r}"
    return m.group(1), m.group(2)


def template_variables(prom: Prometheus) -> dict[str, str]:
    """Grafana's built-ins and each query variable's values (in the dashboard's order, so a later
    variable's query sees the earlier ones), as a regex alternation as Grafana writes a multi-value."""
    variables = {k.removeprefix("$"): v for k, v in GRAFANA_BUILTINS.items()}
    for var in DASHBOARD["templating"]["list"]:
        if var.get("type") != "query":
            continue
        selector, label = label_values_query(var)
        values = prom.label_values(label, substitute(selector, variables))
        assert values, f"template variable {var['name']} has no values: {selector}"
        variables[var["name"]] = "|".join(values)
    return variables


# -- the rig ------------------------------------------------------------------------------------

@dataclass
class Rig:
    ports: list[int]
    metrics_port: int
    envoy_port: int
    counter: int = 0

    def send(self, body: bytes, headers: dict[str, str] | None = None) -> int:
        r = HTTP.request("POST", f"http://127.0.0.1:{self.envoy_port}/v1/completions", body=body, timeout=10.0,
                         retries=False, headers={"content-type": "application/json", **(headers or {})})
        return int(r.status)

    def ask(self, objective: str, prompt: str = "") -> int:
        self.counter += 1
        prompt = prompt or f"request {self.counter} " * 20
        return self.send(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode(),
                         {"x-gateway-inference-objective": objective})

    def chat(self, text: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        r = HTTP.request("POST", f"http://127.0.0.1:{self.envoy_port}/v1/chat/completions",
                         body=json.dumps(body).encode(), timeout=10.0, retries=False,
                         headers={"content-type": "application/json"})
        return int(r.status)

    def set_load(self, waiting: float, kv: float) -> None:
        for port in self.ports:
            HTTP.request("POST", f"http://127.0.0.1:{port}/control",
                         body=json.dumps({"waiting": waiting, "running": 1, "kv": kv}).encode())

    def hold(self, on: bool) -> None:
        """The stubs keep requests open (`on`) or answer them, the ones kept open included."""
        for port in self.ports:
            HTTP.request("POST", f"http://127.0.0.1:{port}/hold", body=json.dumps({"hold": on}).encode())

    def metric(self, name: str) -> float:
        """The sum of `name`'s samples as the picker's own /metrics says now."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not in {timeout}s")
        time.sleep(0.02)


def drive(rig: Rig) -> None:
    """Traffic that moves every metric the dashboard draws (bounded: about 60 requests)."""
    rig.set_load(0, 0.1)
    until(lambda: rig.ask("batch") == 200, "the picker routes once it has scraped the pool")
    shared = "You are a careful assistant. Answer in one line. " * 12
    for group in range(3):
        for turn in range(8):  # a shared prefix per group: hit ratio above zero
            assert rig.ask("chat", f"{group} {shared} question {turn}") == 200
    for i in range(6):
        assert rig.chat(f"chat request {i} " * 10) == 200
    assert rig.send(b'{"model": "m", "prompt": ') == 400  # malformed JSON: the error panels
    assert rig.send(b'{"model": "m", "prompt": "x"}', {"test-epp-endpoint-selection": "10.255.0.1:8000"}) == 503
    # Flow control: three requests kept open fill the pool (one per endpoint), a sheddable request is
    # held, the next finds its band (one request) full.
    rig.hold(True)
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(rig.ask, "chat") for _ in range(3)]
        try:
            until(lambda: rig.metric("prefix_epp_inflight_requests") == 3, "three requests in flight")
            busy.append(pool.submit(rig.ask, "batch"))
            until(lambda: rig.metric("prefix_epp_flow_control_queue_size") == 1, "a sheddable request held")
            assert rig.ask("batch") == 429  # rejected-saturated
        finally:
            rig.hold(False)
        assert [f.result() for f in busy] == [200] * 4  # the held one dispatched once a slot freed
    assert rig.ask("chat") == 200


def scraped_after(prom: Prometheus, job: str, t: float) -> float:
    """Wait until Prometheus has scraped `job` after time `t`; that scrape's time."""
    def last_scrape() -> float:
        result = prom.query(f'timestamp(up{{job="{job}"}})')
        return float(result[0]["value"][1]) if result else 0.0

    until(lambda: last_scrape() > t, "a scrape after the traffic")
    return last_scrape()


def chart_rule_groups(render: Callable[[str], list[Obj]]) -> list[dict[str, Any]]:
    """Rule groups of every PrometheusRule the chart renders under any value set, once each."""
    groups: dict[str, dict[str, Any]] = {}
    for name in VALUE_SETS:
        for obj in render(name):
            if obj.get("kind") == "PrometheusRule":
                for group in obj["spec"]["groups"]:
                    groups[f"{obj['metadata']['name']}/{group['name']}"] = group
    return list(groups.values())


@pytest.fixture(scope="module")
def rule_groups(render: Callable[[str], list[Obj]]) -> list[dict[str, Any]]:
    return chart_rule_groups(render)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, rule_groups: list[dict[str, Any]]) -> Iterator[Prometheus]:
    """The rig under traffic, and the Prometheus that scraped it (twice since the last request)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    rules = tmp / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups}))
    ports = free_ports(3)
    grpc_port, health_port, metrics_port = free_ports(3)
    with KubeApi().start() as api:
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, ports))
        for i, port in enumerate(ports):
            api.create(PODS, pod(f"vllm-{i}", {"app": "vllm"}, active_ports=[port]))
        api.create(OBJECTIVES, objective("chat", "pool", 5))
        api.create(OBJECTIVES, objective("batch", "pool", -1))
        picker_args = prefix_epp(
            "serve", "--pool-name", "pool", "--pool-namespace", "default", "--kubeconfig", str(kubeconfig),
            "--secure-serving=false", "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
            "--enable-test-endpoint-selection",  # the 503: a request pinned outside the pool
            "--usage-sample-rate", "1",  # every response's usage: the served hit rate panel
            "--config-text", CONFIG)
        target = Target("prefix-epp", f"127.0.0.1:{metrics_port}", {"namespace": NAMESPACE, "pod": POD})
        with running(python_module("testkit.vllm_stubs", *map(str, ports)), tmp / "stubs.log", wait_port=ports[-1]), \
                running(picker_args, tmp / "picker.log", wait_port=metrics_port) as picker, \
                run_envoy(tmp, grpc_port) as (_, envoy_port, _admin), \
                running_prometheus(tmp / "prometheus", [target], [rules], interval=SCRAPE_S) as prom:
            for port in ports:
                wait_for_port(port)
            rig = Rig(ports, metrics_port, envoy_port)
            try:
                # Traffic only after Prometheus's first sample of the picker: every counter that
                # exists before it (routed requests, the histograms) then rises inside the window.
                until(lambda: prom.query(f'up{{job="{target.job}"}} == 1') != [], "the picker scraped once")
                # Two rounds with a scrape between: a labelled series is born with its first
                # request, so only the second round's requests make its rate rise.
                drive(rig)
                scraped_after(prom, target.job, time.time())
                drive(rig)
                total = rig.metric("prefix_epp_requests_total")
                scraped_after(prom, target.job, scraped_after(prom, target.job, time.time()))
            except Exception as exc:
                raise AssertionError(f"{exc}\npicker log:\n{picker.log_text()[-3000:]}\n"
                                     f"prometheus log:\n{prom.proc.log_text()[-2000:]}") from exc
            # Prometheus read what the picker counted.
            assert float(prom.query("sum(prefix_epp_requests_total)")[0]["value"][1]) == total
            yield prom


# -- the checks ---------------------------------------------------------------------------------

def finite(sample: dict[str, Any]) -> bool:
    return math.isfinite(float(sample["value"][1]))


def test_template_variables_resolve(prometheus: Prometheus) -> None:
    variables = template_variables(prometheus)
    assert variables["namespace"] == NAMESPACE and variables["pod"] == POD


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.panel}:{q.ref}" for q in QUERIES])
def test_panel_query_has_data(prometheus: Prometheus, query: PanelQuery) -> None:
    expr = substitute(query.expr, template_variables(prometheus))
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    result = prometheus.query(expr)  # PromQLError when Prometheus refuses it
    if (query.panel, query.ref) in NEEDS_FEATURE:
        return
    assert result, f"panel {query.panel!r} {query.ref}: no series for {expr}"
    assert any(finite(s) for s in result), f"panel {query.panel!r} {query.ref}: only NaN/Inf for {expr}: {result}"


def test_every_panel_has_a_query() -> None:
    """A panel without targets would be skipped silently by the check above (rows excepted)."""
    assert QUERIES
    for panel in DASHBOARD["panels"]:
        assert panel["type"] == "row" or panel.get("targets"), panel["title"]


def test_chart_alert_rules_evaluate(prometheus: Prometheus, rule_groups: list[dict[str, Any]]) -> None:
    shipped = {(g["name"], r.get("alert") or r.get("record")) for g in rule_groups for r in g["rules"]}
    mentions = [p for p in CHART.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".tpl", ".json")
                and "PrometheusRule" in p.read_text()]
    assert shipped or not mentions, f"{mentions} mention PrometheusRule but no value set renders one"

    # A rule's health is "unknown" until its group's first evaluation.
    until(lambda: all(r["health"] != "unknown" for g in prometheus.rules() for r in g["rules"]),
          "every rule evaluated once")
    loaded = {(g["name"], r["name"]) for g in prometheus.rules() for r in g["rules"]}
    assert loaded == shipped
    for group in prometheus.rules():
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"{group['name']}/{rule['name']}: {rule.get('lastError')}"
