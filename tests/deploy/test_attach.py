"""The chart attached to a Gateway the cluster already runs (`envoyGateway.gateway.create: false`),
and the image it refuses to guess.

Attach mode renders the HTTPRoute with a parentRef to the given Gateway (name, namespace,
sectionName), the route-level policies (EnvoyExtensionPolicy, BackendTrafficPolicy) in the release
namespace, and the ClientTrafficPolicy that strips the picker's control headers in the Gateway's
namespace, targeting that Gateway (or its listener); no Gateway and no EnvoyProxy of its own.
tests/envoy_gateway/test_eg_attach.py runs the same against a real Envoy Gateway controller.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import yaml

from extproc.commands.envoy_config import CONTROL_HEADERS
from testkit.helm import REPO_ROOT, Helm
from testkit.k8s_objects import CHART, NAMESPACE, RELEASE, USER_GATEWAY, Obj, container, find, find_all, with_image
from testkit.netpol import Pod, admits
from testkit.versions import VERSIONS

Render = Callable[[str], list[Obj]]
ATTACH: Obj = {"envoyGateway": {"enabled": True, "gateway": USER_GATEWAY}}
ROUTE_TARGET = [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": RELEASE}]


def template(helm: Helm, values: Obj) -> list[Obj]:
    return helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values))


def template_error(helm: Helm, values: Obj) -> str:
    proc = helm.run(helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=values), check=False)
    assert proc.returncode != 0, f"helm template accepted {values}"
    return proc.stderr


def notes(helm: Helm, values: Obj) -> str:
    args = helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values))
    args[0] = "install"
    return helm.run([*args, "--dry-run=client"]).stdout.split("NOTES:", 1)[1]


def test_attach_renders_no_gateway_and_no_envoyproxy(render: Render) -> None:
    objs = render("eg-attach")
    assert not find_all(objs, "Gateway") and not find_all(objs, "EnvoyProxy")


def test_route_attaches_to_the_given_gateway_listener(render: Render) -> None:
    route = find(render("eg-attach"), "HTTPRoute")
    assert route["metadata"]["namespace"] == NAMESPACE
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "edge", "namespace": "gateways", "sectionName": "https"}]


def test_route_level_policies_target_the_route_in_the_release_namespace(render: Render) -> None:
    objs = render("eg-attach")
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy"):
        policy = find(objs, kind)
        assert policy["metadata"]["namespace"] == NAMESPACE, kind
        assert policy["spec"]["targetRefs"] == ROUTE_TARGET, kind
    assert find(objs, "BackendTrafficPolicy")["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"] == [
        {"header": "x-gateway-destination-endpoint"}]


def test_client_policy_strips_control_headers_at_the_users_gateway(render: Render) -> None:
    policy = find(render("eg-attach"), "ClientTrafficPolicy")
    # Envoy Gateway accepts a ClientTrafficPolicy only in its target Gateway's namespace.
    assert policy["metadata"]["namespace"] == "gateways"
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "edge", "sectionName": "https"}]
    assert policy["spec"]["headers"]["earlyRequestHeaders"]["remove"] == list(CONTROL_HEADERS)
    assert policy["spec"]["connection"]["bufferLimit"] == "16Mi"


def test_network_policy_admits_the_envoy_pods_of_the_users_gateway(render: Render) -> None:
    objs = render("eg-attach")
    deploy = find(objs, "Deployment")
    target = Pod(NAMESPACE, deploy["spec"]["template"]["metadata"]["labels"],
                 {p["name"]: p["containerPort"] for p in container(deploy)["ports"]})

    def envoy(gateway: str, gateway_ns: str) -> Pod:
        return Pod("envoy-gateway-system", {"gateway.envoyproxy.io/owning-gateway-name": gateway,
                                            "gateway.envoyproxy.io/owning-gateway-namespace": gateway_ns})

    policies = find_all(objs, "NetworkPolicy")
    assert admits(policies, target, envoy("edge", "gateways"), "grpc")
    assert not admits(policies, target, envoy("edge", NAMESPACE), "grpc")
    assert not admits(policies, target, envoy(f"{RELEASE}-gateway", NAMESPACE), "grpc")


def test_gateway_in_the_release_namespace_on_every_listener(helm: Helm) -> None:
    objs = template(helm, {"envoyGateway": {"enabled": True, "gateway": {"create": False, "name": "edge"}}})
    [parent] = find(objs, "HTTPRoute")["spec"]["parentRefs"]
    assert parent == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge", "namespace": NAMESPACE}
    policy = find(objs, "ClientTrafficPolicy")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge"}]


def test_users_own_client_policy_gets_the_settings_in_the_notes(helm: Helm) -> None:
    values = {"envoyGateway": {"enabled": True, "gateway": USER_GATEWAY, "clientTrafficPolicy": {"create": False}}}
    assert not find_all(template(helm, values), "ClientTrafficPolicy")
    text = notes(helm, values)
    assert "WARNING: envoyGateway.clientTrafficPolicy.create=false" in text
    assert "Gateway gateways/edge (or of its listener https)" in text
    block = text.split("earlyRequestHeaders:", 1)[1]
    assert [line.strip().removeprefix("- ") for line in block.splitlines()[2:2 + len(CONTROL_HEADERS)]] == list(
        CONTROL_HEADERS)
    assert "bufferLimit: 16Mi" in block


def test_attach_notes_say_where_the_route_went(helm: Helm) -> None:
    text = notes(helm, ATTACH)
    assert "attached to your Gateway gateways/edge, listener https" in text
    assert f"must admit routes from namespace {NAMESPACE}" in text
    assert "ClientTrafficPolicy gateways/prefix-epp targets listener https" in text


def test_attach_without_a_gateway_name_fails_clearly(helm: Helm) -> None:
    values = with_image({"envoyGateway": {"enabled": True, "gateway": {"create": False}}})
    assert "envoyGateway.gateway.name is required with envoyGateway.gateway.create=false" in template_error(
        helm, values)


def test_existing_gateway_values_without_attach_fail(helm: Helm) -> None:
    values = with_image({"envoyGateway": {"enabled": True, "gateway": {"namespace": "gateways"}}})
    assert "set envoyGateway.gateway.create=false" in template_error(helm, values)


def test_missing_image_fails_with_how_to_get_one(helm: Helm) -> None:
    for values in ({}, {"envoyGateway": {"enabled": True}}, ATTACH):
        err = template_error(helm, values)
        assert "image.repository is required: no prefix-epp image is published to a registry" in err, err
        assert "make image" in err and "push it to your registry" in err


def test_given_image_and_tag(helm: Helm) -> None:
    deploy = find(template(helm, {"image": {"tag": "v7"}}), "Deployment")
    assert container(deploy)["image"] == "registry.example/team/prefix-epp:v7"
    default = find(template(helm, {}), "Deployment")
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container(default)["image"] == f"registry.example/team/prefix-epp:{app_version}"


def test_install_docs_name_the_image_the_chart_and_envoy_gateway_expect() -> None:
    """The README's and docs/kubernetes.md's install lines build the tag the chart defaults to and
    name the image the chart requires; the Envoy Gateway version they give is the newest tested."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for doc in ("README.md", "docs/kubernetes.md"):
        text = (REPO_ROOT / doc).read_text()
        tags = re.findall(r"docker build -t \$REGISTRY/prefix-epp:(\S+) \.", text)
        assert tags and set(tags) == {app_version}, (doc, tags)
        assert "helm install prefix-epp charts/prefix-epp" in text and "image.repository=$REGISTRY/prefix-epp" in text
        assert set(re.findall(r"envoyGateway\.version=(v[\d.]+)", text)) <= {VERSIONS.eg}, doc
