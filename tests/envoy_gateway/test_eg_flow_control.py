"""Flow control behind a real Envoy Gateway (EG_VERSION of versions.env): a request the picker holds
for seconds is dispatched when a slot frees, not cut by Envoy.

A held request waits inside the picker's answer to one ext_proc message, so Envoy's per-message
timeout must outlast it (Envoy's own default is 200 ms). The chart sets the EnvoyExtensionPolicy's
`messageTimeout` (`envoyGateway.extProc.messageTimeout`, 1000 s); this module checks that the Envoy
Envoy Gateway configured carries it and that a request held for seconds comes back 200.

Its own rig (testkit/envoy_gateway.py, ~30 s to come up): one picker replica whose
EndpointPickerConfig (the chart's `config.text`) turns flow control on with a concurrency detector
of one request per endpoint, and one simulated vLLM pod streaming a token every 2 ms, so one long
generation saturates the pool for seconds.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testkit.eg_client import client, metric, scrape, total
from testkit.envoy_gateway import EnvoyGatewayRig, running_rig
from testkit.k8s_objects import IMAGE
from testkit.versions import Versions

pytestmark = [pytest.mark.envoy_gateway, pytest.mark.timeout(300)]

VERSION = Versions.load().eg
CONFIG = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
"""
VALUES: dict[str, Any] = {
    **IMAGE,
    "replicas": 1,
    "config": {"text": CONFIG},
    "envoyGateway": {"enabled": True, "version": VERSION, "envoyProxy": {"serviceType": "ClusterIP"}},
}
SIM = ("--inter-token-latency", "2", "--max-model-len", "100000", "--kv-cache-blocks", "20000")
LONG_TOKENS = 2500  # ~5 s at 2 ms a token: the pool stays saturated that long


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyGatewayRig]:
    with running_rig(tmp_path_factory.mktemp("eg-flow"), VERSION, VALUES, models=1, sim_args=SIM) as r:
        yield r


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def message_timeouts(node: Any) -> list[str]:
    """Every `message_timeout` in a config dump (the ext_proc filters')."""
    if isinstance(node, dict):
        found = [str(v) for k, v in node.items() if k == "message_timeout"]
        return found + [t for v in node.values() for t in message_timeouts(v)]
    if isinstance(node, list):
        return [t for v in node for t in message_timeouts(v)]
    return []


def test_envoy_waits_for_the_picker_as_long_as_the_chart_says(rig: EnvoyGatewayRig) -> None:
    timeouts = message_timeouts(rig.config_dump())
    assert timeouts and set(timeouts) == {"1000s"}, timeouts


def test_a_request_held_for_seconds_is_dispatched_not_cut_by_envoy(rig: EnvoyGatewayRig) -> None:
    picker = rig.picker_pods[0]
    oa = client(rig)

    def ask(tokens: int) -> tuple[int, dict[str, str]]:
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=f"tell me {tokens} things",
                                                      max_tokens=tokens)
        return raw.http_response.status_code, dict(raw.headers)

    dispatched = metric(scrape(rig, picker), "prefix_epp_flow_control_requests_total",
                        outcome="Dispatched", priority="0")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(ask, LONG_TOKENS)  # takes the pool's one slot for ~5 s
        wait_for(lambda: total(scrape(rig, picker), "prefix_epp_inflight_requests") == 1, "the long request routed")
        held = pool.submit(ask, 4)
        wait_for(lambda: total(scrape(rig, picker), "prefix_epp_flow_control_queue_size") == 1,
                 "the second request held by the picker")
        (status, headers), (long_status, long_headers) = held.result(timeout=60), long.result(timeout=60)
    # Cut by Envoy it would be a 504, or, failing open, served without the picker's header.
    assert status == 200 and "x-llm-d-flow-queue-duration-ms" in headers, (status, headers)
    assert int(headers["x-llm-d-flow-queue-duration-ms"]) >= 3000, headers  # held for seconds, then served
    assert (long_status, long_headers.get("x-llm-d-flow-queue-duration-ms")) == (200, "0")
    m = scrape(rig, picker)
    assert metric(m, "prefix_epp_flow_control_requests_total", outcome="Dispatched", priority="0") == dispatched + 2
    assert total(m, "prefix_epp_flow_control_queue_size") == 0
    assert "x-llm-d-request-dropped-reason" not in headers
