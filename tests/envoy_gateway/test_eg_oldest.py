"""The chart beside the oldest Envoy Gateway it supports (EG_MIN_VERSION of versions.env, v1.5.0):
a smaller set than test_eg_newest.py, with the values a user of that release gives.

Envoy Gateway v1.5 has no BackendTLSPolicy v1, so the picker is reached through an Envoy Gateway
Backend with tls.insecureSkipVerify (its Backend API on, as the rig's controller config has it);
that Backend names the picker Service's host name, which resolves to one address, so the rig runs
one picker replica. The pool is fail-open (`inferencePool.failureMode: FailOpen`, which the chart
maps to the EnvoyExtensionPolicy's failOpen).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.eg_client import client, metric, settled
from testkit.envoy_gateway import EnvoyGatewayRig, running_rig
from testkit.k8s_objects import IMAGE
from testkit.versions import Versions

pytestmark = [pytest.mark.envoy_gateway, pytest.mark.timeout(900)]

VERSION = Versions.load().eg_min
VALUES: dict[str, Any] = {
    **IMAGE,
    "replicas": 1,
    "picker": {"explainDecisions": True},
    "inferencePool": {"failureMode": "FailOpen"},
    "envoyGateway": {"enabled": True, "version": VERSION, "envoyProxy": {"serviceType": "ClusterIP",
                                                                           "gracefulExtProcClose": True},
                     "pickerTLS": {"insecureSkipVerify": True}},
}
SIM = ("--inter-token-latency", "2", "--max-model-len", "4000000", "--kv-cache-blocks", "300000",
       "--prefill-time-per-token", "0.0005")
GRACEFUL = "envoy.reloadable_features.ext_proc_graceful_grpc_close"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyGatewayRig]:
    with running_rig(tmp_path_factory.mktemp("eg-min"), VERSION, VALUES, sim_args=SIM) as r:
        yield r


def test_envoy_gateway_accepted_every_object_of_the_chart(rig: EnvoyGatewayRig) -> None:
    c = rig.cluster
    assert c is not None
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy"):
        assert c.conditions(kind, c.fullname).get("Accepted") == "True", (kind, c.conditions(kind, c.fullname))
    assert c.conditions("Gateway", f"{c.fullname}-gateway").get("Accepted") == "True"


def test_graceful_close_flag_is_in_the_bootstrap(rig: EnvoyGatewayRig) -> None:
    assert rig.bootstrap["layered_runtime"]["layers"][0]["static_layer"][GRACEFUL] is True
    assert json.loads(rig.envoy_admin("/runtime"))["entries"][GRACEFUL]["final_value"] == "true"


def test_shared_prefix_lands_on_one_pod_and_streams_arrive_with_usage(rig: EnvoyGatewayRig) -> None:
    oa = client(rig)
    served = set()
    for i in range(5):
        prompt = "You are a careful assistant. " * 120 + f"Question {i}?"
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4)
        served.add(raw.headers["x-served-by"])
        assert raw.headers["x-prefix-epp-decision"].startswith("endpoint=")
    assert len(served) == 1, served
    stream = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_a_prompt_of_several_mib(rig: EnvoyGatewayRig) -> None:
    size = 3 * 1024 * 1024
    prompt = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    body = client(rig, timeout=120).completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert body.usage is not None and body.usage.prompt_tokens > size // 8


def test_generation_longer_than_ten_seconds_ends_closed(rig: EnvoyGatewayRig) -> None:
    [before] = settled(rig)
    t0 = time.monotonic()
    stream = client(rig, timeout=120).completions.create(model="tiny", prompt="a long story", max_tokens=6000,
                                                         stream=True)
    assert sum(1 for c in stream if c.choices and c.choices[0].text) == 6000
    assert time.monotonic() - t0 > 10.5
    [after] = settled(rig)
    name = "prefix_epp_extproc_streams_total"
    # The graceful close: the picker closed the call after Envoy's half-close, Envoy did not reset it.
    for end, by, more in (("complete", "picker", 1), ("complete", "proxy", 0), ("reset", "proxy", 0)):
        assert metric(after, name, end=end, closed_by=by) - metric(before, name, end=end, closed_by=by) == more


def test_typo_in_values_fails_at_helm_install_naming_it(rig: EnvoyGatewayRig) -> None:
    assert rig.cluster is not None
    proc = rig.cluster.helm_install({"envoyGateway": {"enabled": True, "verison": VERSION}}, release="typo")
    assert proc.returncode != 0 and "verison" in proc.stderr, proc.stderr


def test_picker_down_fails_open_unsteered(rig: EnvoyGatewayRig) -> None:
    """The picker crashes: requests go on without a decision (no decision header) to a model pod,
    before and after its EndpointSlice empties (the Backend path resolves the Service's name; Envoy
    Gateway reads no EndpointSlice for it)."""
    [pod] = rig.picker_pods
    rig.crash_picker(pod)
    try:
        for i in range(6):
            if i == 3:
                rig.publish_pickers(wait=False)  # the endpoints controller catches up: no picker
            raw = client(rig).completions.with_raw_response.create(model="tiny", prompt=f"unsteered {i}",
                                                                    max_tokens=1)
            assert raw.http_response.status_code == 200
            assert "x-prefix-epp-decision" not in raw.headers
            assert raw.headers["x-served-by"] in {f"{p.ip}:8000" for p in rig.model_pods}
    finally:
        rig.start_pickers()
    assert client(rig).completions.create(model="tiny", prompt="back", max_tokens=1).choices

