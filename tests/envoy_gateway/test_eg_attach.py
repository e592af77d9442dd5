"""The chart attached to a Gateway the user already runs, beside a real Envoy Gateway (EG_VERSION of
versions.env): the user's Gateway comes first, in a namespace of its own whose listener admits
routes from the release namespace; then `helm install` with `envoyGateway.gateway.create: false`
and its name, namespace and listener. The chart adds no Gateway or EnvoyProxy, Envoy Gateway
accepts the route on that Gateway and every policy, and requests through the user's Envoy reach
the endpoint the picker chose, with the client-set control headers removed before the picker sees
them (the chart's ClientTrafficPolicy in the Gateway's namespace). Same rig as test_eg_newest.py
(testkit/envoy_gateway.py); one picker replica, verified TLS to it (the default), which needs
nothing of the user's EnvoyProxy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.eg_client import client, scrape, total
from testkit.eg_cluster import Cluster
from testkit.envoy_gateway import GATEWAY_CLASS, NAMESPACE, EnvoyGatewayRig, running_rig
from testkit.k8s_objects import IMAGE
from testkit.versions import Versions

pytestmark = [pytest.mark.envoy_gateway, pytest.mark.timeout(900)]

VERSION = Versions.load().eg
GATEWAY_NS, GATEWAY, LISTENER = "gateways", "edge", "web"
VALUES: dict[str, Any] = {
    **IMAGE,
    "replicas": 1,
    "picker": {"explainDecisions": True},
    "envoyGateway": {"enabled": True, "version": VERSION,
                     "gateway": {"create": False, "name": GATEWAY, "namespace": GATEWAY_NS, "sectionName": LISTENER}},
}
IGNORED = "prefix_epp_ignored_headers_total"
GATEWAY_API = "gateway.networking.k8s.io/v1"
EG_API = "gateway.envoyproxy.io/v1alpha1"


def users_gateway(cluster: Cluster) -> None:
    """What the user has before installing the chart: a Gateway in its own namespace whose listener
    admits routes from the release namespace (by the namespace's name label)."""
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": GATEWAY_NS}})
    cluster.create({
        "apiVersion": GATEWAY_API, "kind": "Gateway", "metadata": {"name": GATEWAY, "namespace": GATEWAY_NS},
        "spec": {"gatewayClassName": GATEWAY_CLASS, "listeners": [{
            "name": LISTENER, "protocol": "HTTP", "port": 80,
            "allowedRoutes": {"namespaces": {"from": "Selector", "selector": {
                "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}}}}]}})


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyGatewayRig]:
    with running_rig(tmp_path_factory.mktemp("eg-attach"), VERSION, VALUES, before_chart=users_gateway) as r:
        yield r


def decided(raw: Any) -> str:
    """The endpoint the picker chose (its decision header's first field)."""
    return str(raw.headers["x-prefix-epp-decision"]).split(";")[0].removeprefix("endpoint=")


def ignored(rig: EnvoyGatewayRig) -> float:
    """Requests whose test-epp-endpoint-selection header reached the picker (and was ignored)."""
    return sum(total(scrape(rig, p), IGNORED) for p in rig.picker_pods)


def test_the_chart_made_no_gateway_and_envoy_gateway_accepted_everything(rig: EnvoyGatewayRig) -> None:
    c = rig.cluster
    assert c is not None
    gateways = [(g["metadata"]["namespace"], g["metadata"]["name"]) for g in c.items(GATEWAY_API, "Gateway", None)]
    assert gateways == [(GATEWAY_NS, GATEWAY)]
    assert c.items(EG_API, "EnvoyProxy", None) == []
    assert c.conditions("Gateway", GATEWAY, GATEWAY_NS).get("Accepted") == "True"
    route = c.get(GATEWAY_API, "HTTPRoute", NAMESPACE, c.fullname)
    assert route is not None
    [parent] = route["status"]["parents"]
    assert parent["parentRef"]["namespace"] == GATEWAY_NS and parent["parentRef"]["sectionName"] == LISTENER
    conds = {x["type"]: x["status"] for x in parent["conditions"]}
    assert conds.get("Accepted") == "True" and conds.get("ResolvedRefs") == "True", conds
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy", "BackendTLSPolicy"):
        assert c.conditions(kind, c.fullname).get("Accepted") == "True", (kind, c.conditions(kind, c.fullname))
    assert c.conditions("ClientTrafficPolicy", c.fullname, GATEWAY_NS).get("Accepted") == "True"


def test_requests_through_the_users_gateway_reach_the_picked_endpoint(rig: EnvoyGatewayRig) -> None:
    oa = client(rig)
    pods = {f"{p.ip}:8000" for p in rig.model_pods}
    for i in range(6):
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=f"attached {i}: " + "ctx " * 200,
                                                      max_tokens=2)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-served-by"] == decided(raw) and decided(raw) in pods


def test_verified_tls_to_the_picker_needs_nothing_from_the_users_envoyproxy(rig: EnvoyGatewayRig) -> None:
    """The user's Gateway has no EnvoyProxy of the chart (no backendTLS ALPN): Envoy Gateway still
    verifies the picker (the chart's BackendTLSPolicy) and offers no ALPN, which the picker's TLS
    gRPC server accepts (the requests above went through it)."""
    c = rig.cluster
    assert c is not None
    [cluster] = [d["cluster"] for cfg in rig.config_dump()["configs"] for d in cfg.get("dynamic_active_clusters", [])
                 if d["cluster"]["name"].startswith("envoyextensionpolicy/")]
    [match] = cluster["transport_socket_matches"]
    tls = match["transport_socket"]["typed_config"]
    host = f"{c.fullname}.{NAMESPACE}.svc.cluster.local"
    assert tls["sni"] == host
    validation = tls["common_tls_context"]["combined_validation_context"]
    assert validation["default_validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": host}}]
    assert "alpn_protocols" not in tls["common_tls_context"]


def test_client_set_control_headers_are_removed_before_the_picker(rig: EnvoyGatewayRig) -> None:
    oa = client(rig)
    prompt = "pin me somewhere else: " + "same prefix " * 200
    chosen = decided(oa.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1))
    other = next(f"{p.ip}:8000" for p in rig.model_pods if f"{p.ip}:8000" != chosen)
    before = ignored(rig)
    forged = {"test-epp-endpoint-selection": other, "x-gateway-destination-endpoint": other}
    for _ in range(5):
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1, extra_headers=forged)
        assert raw.headers["x-served-by"] == decided(raw) == chosen
    assert ignored(rig) == before  # the picker never saw the client's header


def test_without_the_client_policy_the_header_reaches_the_picker(rig: EnvoyGatewayRig) -> None:
    """The control: the same request once the chart's ClientTrafficPolicy is gone (a user's own
    policy without the removals) hands the picker the client's header. Runs last: it changes the
    Gateway."""
    c = rig.cluster
    assert c is not None
    status, _ = c.kube.request("DELETE", f"/apis/{EG_API}/namespaces/{GATEWAY_NS}/clienttrafficpolicies/{c.fullname}")
    assert status == 200
    oa = client(rig)
    before = ignored(rig)
    deadline = time.monotonic() + 60  # until Envoy Gateway has pushed the listener without the removal
    while ignored(rig) == before:
        assert time.monotonic() < deadline, "the header never reached the picker"
        raw = oa.completions.with_raw_response.create(model="tiny", prompt="unprotected", max_tokens=1,
                                                      extra_headers={"test-epp-endpoint-selection": "10.0.0.1"})
        assert raw.http_response.status_code == 200
        time.sleep(0.1)  # polling interval while Envoy Gateway pushes the change
