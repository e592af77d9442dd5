"""The chart's protections: who may reach the picker (NetworkPolicy), Envoy verifying the picker
(a generated CA and a BackendTLSPolicy, no insecureSkipVerify by default), optional mutual TLS,
and the client-set control headers the Gateway strips before ext_proc sees them."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from extproc.commands.envoy_config import CONTROL_HEADERS
from testkit.helm import Helm
from testkit.k8s_objects import CHART, NAMESPACE, RELEASE, VALUE_SETS, Obj, container, find, find_all, with_image
from testkit.netpol import Pod, admits

Render = Callable[[str], list[Obj]]

GATEWAY = f"{RELEASE}-gateway"
EG_NAMESPACE = "envoy-gateway-system"


def picker_pod(objs: list[Obj]) -> Pod:
    deploy = find(objs, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in container(deploy)["ports"]}
    return Pod(NAMESPACE, deploy["spec"]["template"]["metadata"]["labels"], ports)


def envoy_pod(gateway: str = GATEWAY, gateway_ns: str = NAMESPACE, namespace: str = EG_NAMESPACE) -> Pod:
    """An Envoy pod as Envoy Gateway labels it (gateway.envoyproxy.io/owning-gateway-*)."""
    return Pod(namespace, {"app.kubernetes.io/name": "envoy", "app.kubernetes.io/component": "proxy",
                           "gateway.envoyproxy.io/owning-gateway-name": gateway,
                           "gateway.envoyproxy.io/owning-gateway-namespace": gateway_ns})


# --- NetworkPolicy ---------------------------------------------------------------------------------

def test_network_policy_admits_only_the_gateway_peers_and_monitoring(render: Render) -> None:
    objs = render("envoy-gateway")
    policies = find_all(objs, "NetworkPolicy")
    target = picker_pod(objs)
    peer = Pod(NAMESPACE, target.labels)
    neighbour = Pod(NAMESPACE, {"app": "vllm"})  # any other pod, e.g. a compromised model server
    outsider = Pod("default", {"app": "curl"})
    prometheus = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    other_gateway = envoy_pod(gateway="someone-elses-gateway")
    for port in ("grpc", "sync", "metrics", "grpc-health"):
        assert admits([], target, outsider, port), "without the policy every pod reaches every port"
    assert admits(policies, target, envoy_pod(), "grpc")
    assert not any(admits(policies, target, src, "grpc") for src in (neighbour, outsider, other_gateway, peer))
    assert admits(policies, target, peer, "sync")
    assert not any(admits(policies, target, src, "sync") for src in (neighbour, outsider, envoy_pod()))
    assert admits(policies, target, prometheus, "metrics")
    assert not admits(policies, target, neighbour, "metrics")
    assert not any(admits(policies, target, src, "grpc-health") for src in (peer, envoy_pod(), prometheus))
    # The rules name ports the container declares (a typo would silently admit nothing).
    for rule in policies[0]["spec"]["ingress"]:
        assert all(p["port"] in target.ports for p in rule["ports"])


def test_network_policy_follows_the_gateway_values(helm: Helm) -> None:
    values = {"envoyGateway": {"enabled": True, "gateway": {"name": "edge"}},
              "networkPolicy": {"extProc": {"envoyNamespace": "gateways"}}}
    objs = helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values))
    target = picker_pod(objs)
    assert find(objs, "Gateway")["metadata"]["name"] == "edge"
    assert admits(find_all(objs, "NetworkPolicy"), target, envoy_pod("edge", namespace="gateways"), "grpc")
    assert not admits(find_all(objs, "NetworkPolicy"), target, envoy_pod(GATEWAY, namespace="gateways"), "grpc")
    assert not admits(find_all(objs, "NetworkPolicy"), target, envoy_pod("edge"), "grpc")


def test_network_policy_custom_peers_and_off(render: Render) -> None:
    objs = render("network-policy-custom")
    policies, target = find_all(objs, "NetworkPolicy"), picker_pod(objs)
    istio = Pod("istio-system", {"istio": "ingressgateway"})
    assert admits(policies, target, istio, "grpc") and not admits(policies, target, envoy_pod(), "grpc")
    assert not admits(policies, target, Pod("monitoring", {}), "metrics")  # metrics.from: [] admits no one
    assert admits(policies, target, Pod(NAMESPACE, {"app": "prober"}), "grpc-health")  # extraIngress
    assert not find_all(render("network-policy-off"), "NetworkPolicy")


# --- TLS: Envoy verifies the picker ----------------------------------------------------------------

def certificate(data: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(data))


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def test_default_envoy_gateway_wiring_verifies_a_generated_certificate(render: Render) -> None:
    objs = render("envoy-gateway")
    secret = find(objs, "Secret", f"{RELEASE}-tls")
    ca_map = find(objs, "ConfigMap", f"{RELEASE}-ca")
    policy = find(objs, "BackendTLSPolicy")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    ca = x509.load_pem_x509_certificate(ca_map["data"]["ca.crt"].encode())
    assert ca == certificate(secret["data"]["ca.crt"]), "one CA across templates"
    cert = certificate(secret["data"]["tls.crt"])
    assert signed_by(cert, ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    validation = policy["spec"]["validation"]
    assert validation["caCertificateRefs"] == [{"group": "", "kind": "ConfigMap", "name": f"{RELEASE}-ca"}]
    assert validation["hostname"] == f"{RELEASE}.{NAMESPACE}.svc.cluster.local" and validation["hostname"] in sans
    assert policy["spec"]["targetRefs"] == [{"group": "", "kind": "Service", "name": RELEASE, "sectionName": "grpc"}]
    [ref] = find(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]["backendRefs"]
    assert ref["kind"] == "Service" and ref["name"] == RELEASE
    assert not find_all(objs, "Backend")
    assert "insecureSkipVerify" not in str(objs)
    # The pod serves that certificate and rolls when it changes.
    deploy = find(objs, "Deployment")
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    checksum = deploy["spec"]["template"]["metadata"]["annotations"]["checksum/tls"]
    assert checksum == hashlib.sha256(secret["data"]["tls.crt"].encode()).hexdigest()


def test_given_certificate_is_verified_with_the_given_ca(render: Render) -> None:
    objs = render("eg-verified-tls")
    policy = find(objs, "BackendTLSPolicy")
    assert policy["spec"]["validation"]["caCertificateRefs"][0]["name"] == "prefix-epp-ca"
    assert not [s for s in find_all(objs, "Secret") if s["type"] == "kubernetes.io/tls"]


def test_insecure_skip_verify_only_when_asked(render: Render) -> None:
    for name in sorted(VALUE_SETS):
        backends = find_all(render(name), "Backend")
        asked = VALUE_SETS[name].get("envoyGateway", {}).get("pickerTLS", {}).get("insecureSkipVerify", False)
        assert bool(backends) is asked, name
        assert all(b["spec"]["tls"] == {"insecureSkipVerify": True} for b in backends)


@pytest.mark.parametrize(("values", "message"), [
    ({"tls": {"existingSecret": "mine"}, "envoyGateway": {"enabled": True}}, "caConfigMap"),
    ({"tls": {"generate": False}, "envoyGateway": {"enabled": True}}, "insecureSkipVerify"),
    ({"tls": {"enabled": False, "clientCA": {"name": "ca"}}}, "tls.clientCA needs tls.enabled"),
], ids=["existing-secret-without-ca", "self-signed", "client-ca-without-tls"])
def test_unverifiable_setups_refuse_to_render(helm: Helm, values: Obj, message: str) -> None:
    proc = helm.run(helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values)),
                    check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_generated_certificate_differs_per_install(helm: Helm) -> None:
    """Each install (no cluster to look the Secret up in) gets its own CA: a certificate of one
    install is not accepted by another's CA."""
    values = with_image({"networkPolicy": {"enabled": False}})
    one, two = (find(helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=values), "Secret",
                     f"{RELEASE}-tls")["data"] for _ in range(2))
    assert signed_by(certificate(one["tls.crt"]), certificate(one["ca.crt"]))
    assert not signed_by(certificate(one["tls.crt"]), certificate(two["ca.crt"]))


def test_mutual_tls_wiring(render: Render) -> None:
    objs = render("eg-mutual-tls")
    c = container(find(objs, "Deployment"))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "client-ca")
    assert f"--client-ca-file={mount['mountPath']}/ca.crt" in c["args"] and mount["readOnly"] is True
    volumes = find(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == "client-ca")
    assert volume["secret"] == {"secretName": "envoy-client-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    ref = find(objs, "EnvoyProxy")["spec"]["backendTLS"]["clientCertificateRef"]
    assert ref == {"group": "", "kind": "Secret", "name": "envoy-client"}
    assert not any(a.startswith("--client-ca-file") for a in container(find(render("default"), "Deployment"))["args"])


# --- client-set control headers --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["envoy-gateway", "eg-ai-gateway"])
def test_gateway_strips_client_set_control_headers_before_ext_proc(render: Render, name: str) -> None:
    policy = find(render(name), "ClientTrafficPolicy")
    assert policy["spec"]["targetRefs"][0]["name"] == find(render(name), "Gateway")["metadata"]["name"]
    removed = policy["spec"]["headers"]["earlyRequestHeaders"]["remove"]
    # The same list `prefix-epp envoy-config` strips.
    assert removed == list(CONTROL_HEADERS)
    # Not on the route: Envoy applies route header changes in the router, after ext_proc.
    for rule in find(render(name), "HTTPRoute")["spec"]["rules"]:
        assert not [f for f in rule.get("filters", []) if f["type"] == "RequestHeaderModifier"]
