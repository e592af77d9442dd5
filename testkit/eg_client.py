"""Clients of the Envoy Gateway rig (testkit/envoy_gateway.py): OpenAI requests and picker metrics.

- `client(rig)`: an `openai.OpenAI` for the Gateway's listener, without retries, so every failure
  of the path shows;
- `scrape(rig, pod)`: every sample of one picker replica's /metrics as {(name, labels): value};
  `metric(samples, name, **labels)` reads one (0 when absent), `total(samples, name)` sums a
  metric over its label values;
- `settled(rig)`: every picker replica's samples once none has an ext_proc stream open, so a
  counter of stream ends read before and after a request counts that request's stream alone
  (the previous test's stream may end after its client has read the whole response).
"""

from __future__ import annotations

import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from testkit.envoy_gateway import EnvoyGatewayRig, Pod

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def client(rig: EnvoyGatewayRig, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def scrape(rig: EnvoyGatewayRig, pod: Pod) -> Samples:
    with urllib.request.urlopen(rig.picker_metrics_url(pod), timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def settled(rig: EnvoyGatewayRig, timeout: float = 15.0) -> list[Samples]:
    """Every picker pod's samples, once no pod reports an open ext_proc stream (AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = [scrape(rig, p) for p in rig.picker_pods]
        if all(total(s, "prefix_epp_open_streams") == 0 for s in samples):
            return samples
        assert time.monotonic() < deadline, [total(s, "prefix_epp_open_streams") for s in samples]
        time.sleep(0.05)
