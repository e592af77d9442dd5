"""Cross-references between the rendered objects, the picker's real flag parser and EppConfig:
ports agree everywhere, selectors select the model pods, RBAC grants only what the picker reads,
and the Envoy Gateway wiring points at the picker and at the pool's pods."""

from __future__ import annotations

import argparse
import base64
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from extproc.commands.serve import add_arguments, config_from_args, validate
from extproc.config.settings import EppConfig, ProxyTrafficConfig
from extproc.discovery.objectives import OBJECTIVE_GROUPS
from extproc.scheduling.build import default_profile
from extproc.scheduling.config_loader import load_text
from testkit.k8s_objects import CHART, NAMESPACE, RELEASE, VALUE_SETS, Obj, container, find, find_all

Render = Callable[[str], list[Obj]]

DEFAULTS = EppConfig()
VALUES: Obj = yaml.safe_load((CHART / "values.yaml").read_text())


def serve_args(objs: list[Obj]) -> list[str]:
    args: list[str] = container(find(objs, "Deployment"))["args"]
    assert args[0] == "serve", "the image's ENTRYPOINT is prefix-epp; the first argument must be the command"
    return args[1:]


def parse(args: list[str]) -> argparse.Namespace:
    """Parse with the real `prefix-epp serve` parser; an unknown flag fails the test."""
    parser = argparse.ArgumentParser(prog="prefix-epp serve", exit_on_error=False)
    add_arguments(parser)
    try:
        return parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"`prefix-epp serve` rejects {args}: {exc}") from exc


def service_port(service: Obj, name: str) -> Obj:
    return next(p for p in service["spec"]["ports"] if p["name"] == name)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_args_parse_and_match_the_chart(render: Render, name: str) -> None:
    objs = render(name)
    ns = parse(serve_args(objs))
    config = config_from_args(ns)
    deploy = find(objs, "Deployment")
    c = container(deploy)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    service = find(objs, "Service", RELEASE)
    values = VALUE_SETS[name]
    tls_enabled = values.get("tls", {}).get("enabled", True)
    pool_name = values.get("inferencePool", {}).get("name") or RELEASE

    assert (config.grpc_port, config.grpc_health_port, config.metrics_port) == (
        ports["grpc"], ports["grpc-health"], ports["metrics"])
    for port_name in ("grpc", "grpc-health", "metrics"):
        port = service_port(service, port_name)
        assert port["targetPort"] == port_name and port["port"] == ports[port_name]
    assert config.pool_name == pool_name
    assert config.pool_namespace == NAMESPACE
    assert config.pool_group == "inference.networking.k8s.io"
    assert config.secure_serving is tls_enabled
    assert config.max_endpoints == values.get("picker", {}).get("maxEndpoints", ProxyTrafficConfig().fallback_endpoints)
    assert config.max_buffered_bytes == values.get("picker", {}).get("maxBufferedBytes", DEFAULTS.max_buffered_bytes)
    assert config.affinity.enabled is values.get("picker", {}).get("affinityHints", DEFAULTS.affinity.enabled)
    assert config.affinity.session_header == values.get("picker", {}).get("sessionHeader",
                                                                            DEFAULTS.affinity.session_header)
    assert ns.config_file == c["volumeMounts"][0]["mountPath"] + "/config.yaml"
    tls = values.get("tls", {})
    if tls_enabled and (tls.get("existingSecret") or tls.get("generate", True)):
        assert config.cert_path == next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
    else:
        assert config.cert_path == ""
    # The Service selects exactly the picker's pods.
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())


def test_chart_defaults_equal_eppconfig() -> None:
    picker = VALUES["picker"]
    assert picker["grpcPort"] == DEFAULTS.grpc_port
    assert picker["grpcHealthPort"] == DEFAULTS.grpc_health_port
    assert picker["metricsPort"] == DEFAULTS.metrics_port
    assert picker["maxEndpoints"] == ProxyTrafficConfig().fallback_endpoints  # the gateway takes a list
    assert picker["explainDecisions"] == DEFAULTS.explain_decisions
    assert picker["affinityHints"] == DEFAULTS.affinity.enabled
    assert picker["sessionHeader"] == DEFAULTS.affinity.session_header
    assert picker["maxBufferedBytes"] == DEFAULTS.max_buffered_bytes
    assert VALUES["tls"]["enabled"] == DEFAULTS.secure_serving
    assert VALUES["inferencePool"]["apiGroup"] == DEFAULTS.pool_group


def test_default_render_parses_to_eppconfig_defaults(render: Render) -> None:
    """Apart from what the chart must set (pool, namespace, config file; peer sync on, a drain
    that fits the grace period with the preStop sleep, and a fallback endpoint, which the gateway
    takes as a list), the default chart's flags leave every
    EppConfig field at its default; the certificate (generated by the chart, so that Envoy can
    verify it) and the sync secret are mounted files."""
    config = config_from_args(parse(serve_args(render("default"))))
    differing = {f.name for f in fields(EppConfig) if getattr(config, f.name) != getattr(DEFAULTS, f.name)}
    assert differing == {"pool_name", "pool_namespace", "config_file", "sync", "drain", "cert_path", "max_endpoints"}
    assert config.max_endpoints == ProxyTrafficConfig().fallback_endpoints
    assert replace(config.sync, port=0, peer_selector="", secret_file="") == DEFAULTS.sync
    assert replace(config.drain, timeout_s=DEFAULTS.drain.timeout_s) == DEFAULTS.drain


def test_default_config_is_the_builtin_profile() -> None:
    """The chart's default EndpointPickerConfig, read by the picker's own loader, changes no
    EppConfig default and yields exactly the profile the picker uses without a config."""
    config, profile = load_text(VALUES["config"]["text"], DEFAULTS, "values.yaml config.text")
    assert config == DEFAULTS
    assert profile == default_profile(DEFAULTS)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_config_loads_and_agrees_with_flags(render: Render, name: str) -> None:
    objs = render(name)
    ns = parse(serve_args(objs))
    cm = find(objs, "ConfigMap", f"{RELEASE}-config")
    assert ns.config_file.rsplit("/", 1)[1] in cm["data"]
    flags = config_from_args(ns)
    config, profile = load_text(cm["data"]["config.yaml"], flags, "rendered ConfigMap")
    assert profile is not None
    # The file may not contradict the flags the chart sets (e.g. maxNumOfEndpoints vs --max-endpoints).
    assert config.max_endpoints == flags.max_endpoints



@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_args_pass_start_up_validation(render: Render, name: str, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The chart's own flags, config file and environment start the picker: no error, no overridden flag."""
    objs = render(name)
    flags = config_from_args(parse(serve_args(objs)))
    cm = find(objs, "ConfigMap", f"{RELEASE}-config")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    flags = replace(flags, config_file=str(path))
    # The chart's Secrets as the kubelet mounts them (the peer-sync secret file, the certificate).
    pod = find(objs, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert not [e for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], "secrets as files"
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("secret")
        rendered = [s for s in find_all(objs, "Secret") if source and s["metadata"]["name"] == source["secretName"]]
        if not rendered:
            continue
        local = tmp_path / mount["name"]
        local.mkdir()
        items = source.get("items") or [{"key": k, "path": k} for k in rendered[0]["data"]]
        for item in items:
            (local / item["path"]).write_bytes(base64.b64decode(rendered[0]["data"][item["key"]]))
        if flags.sync.secret_file.startswith(mount["mountPath"] + "/"):
            flags = replace(flags, sync=replace(flags.sync, secret_file=str(local / Path(flags.sync.secret_file).name)))
    with caplog.at_level("WARNING", logger="prefix_epp"):
        validate(flags)
    assert not caplog.records


@pytest.mark.parametrize("name", sorted(n for n in VALUE_SETS if n != "inference-pool-disabled"))
def test_pool_points_at_the_picker_service(render: Render, name: str) -> None:
    objs = render(name)
    pool = find(objs, "InferencePool")
    service = find(objs, "Service", RELEASE)
    ref = pool["spec"]["endpointPickerRef"]
    picker = service["metadata"]["name"]
    assert (ref.get("group", ""), ref.get("kind", "Service"), ref["name"]) == ("", "Service", picker)
    assert ref["port"]["number"] == service_port(service, "grpc")["port"]
    assert ref["port"]["number"] == parse(serve_args(objs)).grpc_port
    assert pool["metadata"]["name"] == parse(serve_args(objs)).pool_name
    assert pool["spec"]["selector"]["matchLabels"] == VALUES["inferencePool"]["modelServers"]["matchLabels"]


def test_rbac_is_least_privilege(render: Render) -> None:
    objs = render("default")
    role = find(objs, "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    read = ("get", "list", "watch")
    expected = {("", "pods", v) for v in read}
    expected |= {("inference.networking.k8s.io", "inferencepools", v) for v in read}
    expected |= {(g, "inferenceobjectives", v) for g in OBJECTIVE_GROUPS for v in read}
    assert granted == expected
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"]), "no resourceNames/URLs"
    assert not find_all(objs, "ClusterRole") and not find_all(objs, "ClusterRoleBinding")
    binding = find(objs, "RoleBinding")
    account = find(objs, "ServiceAccount")
    role_name, account_name = role["metadata"]["name"], account["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account_name, "namespace": NAMESPACE}]
    assert find(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


# --- Envoy Gateway wiring -----------------------------------------------------------------------

def _route_target(policy: Obj, route: Obj) -> None:
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}]


@pytest.mark.parametrize("name", ["envoy-gateway", "eg-verified-tls", "eg-plaintext", "eg-nodeport"])
def test_envoy_gateway_calls_the_picker_off_the_token_stream(render: Render, name: str) -> None:
    objs = render(name)
    route = find(objs, "HTTPRoute")
    policy = find(objs, "EnvoyExtensionPolicy")
    _route_target(policy, route)
    [ext] = policy["spec"]["extProc"]
    # Buffered request bodies, nothing of the response; the picker's mode_override (honoured only
    # without FullDuplexStreamed bodies) asks for trailers and the sampled response bodies.
    assert ext["processingMode"] == {"request": {"body": "Buffered"}, "allowModeOverride": True}
    assert ext["failOpen"] is True  # inferencePool.failureMode FailOpen: a picker crash cuts no routed request
    client = find(objs, "ClientTrafficPolicy")
    gateway = find(objs, "Gateway")
    assert client["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": gateway["metadata"]["name"]}]
    assert client["spec"]["connection"]["bufferLimit"] == "16Mi"  # Envoy Gateway's 32Ki default would 413
    assert "envoy.lb" in ext["metadata"]["writableNamespaces"]
    service = find(objs, "Service", RELEASE)
    grpc = service_port(service, "grpc")["port"]
    [ref] = ext["backendRefs"]
    tls = VALUE_SETS[name].get("tls", {})
    if ref["kind"] == "Backend":
        assert tls.get("enabled", True) and not VALUE_SETS[name]["envoyGateway"].get("pickerTLS")
        backend = find(objs, "Backend", ref["name"])
        assert ref["group"] == "gateway.envoyproxy.io"
        [endpoint] = backend["spec"]["endpoints"]
        assert endpoint["fqdn"] == {"hostname": f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local",
                                    "port": grpc}
        assert backend["spec"]["tls"] == {"insecureSkipVerify": True}
    else:
        picker = service["metadata"]["name"]
        assert (ref["group"], ref["kind"], ref["name"], ref["port"]) == ("", "Service", picker, grpc)
        if tls.get("enabled", True):
            btp = find(objs, "BackendTLSPolicy")
            assert btp["spec"]["targetRefs"] == [
                {"group": "", "kind": "Service", "name": service["metadata"]["name"], "sectionName": "grpc"}]
            assert btp["spec"]["validation"]["caCertificateRefs"][0]["name"] == "prefix-epp-ca"
        else:
            assert service_port(service, "grpc")["appProtocol"] == "kubernetes.io/h2c"
            assert parse(serve_args(objs)).secure_serving is False
            assert not find_all(objs, "Backend") and not find_all(objs, "BackendTLSPolicy")


@pytest.mark.parametrize("name", ["envoy-gateway", "eg-verified-tls", "eg-plaintext", "eg-nodeport"])
def test_envoy_gateway_sends_to_the_picked_pod(render: Render, name: str) -> None:
    objs = render(name)
    route = find(objs, "HTTPRoute")
    gateway = find(objs, "Gateway")
    pool = find(objs, "InferencePool")
    traffic = find(objs, "BackendTrafficPolicy")
    _route_target(traffic, route)
    assert traffic["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"] == [
        {"header": "x-gateway-destination-endpoint"}]
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    assert route["spec"]["parentRefs"][0]["sectionName"] in {ln["name"] for ln in gateway["spec"]["listeners"]}
    [rule] = route["spec"]["rules"]
    [ref] = rule["backendRefs"]
    models = find(objs, "Service", ref["name"])
    # Every address the picker can return (pod IP of a pool pod : target port) is an endpoint of
    # the cluster Envoy Gateway builds from this Service.
    assert models["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    [port] = models["spec"]["ports"]
    [target] = pool["spec"]["targetPorts"]
    assert port["port"] == ref["port"] == port["targetPort"] == target["number"]


@pytest.mark.parametrize("name", ["envoy-gateway", "eg-ai-gateway", "eg-nodeport"])
def test_gateway_uses_the_envoyproxy(render: Render, name: str) -> None:
    objs = render(name)
    gateway = find(objs, "Gateway")
    proxy = find(objs, "EnvoyProxy")
    assert gateway["spec"]["gatewayClassName"] == VALUES["envoyGateway"]["gatewayClassName"]
    assert gateway["spec"]["infrastructure"]["parametersRef"] == {
        "group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "name": proxy["metadata"]["name"]}
    assert proxy["spec"]["backendTLS"]["alpnProtocols"] == ["h2"]


def test_nodeport_patch_targets_the_listener(render: Render) -> None:
    objs = render("eg-nodeport")
    service = find(objs, "EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyService"]
    listener_port = find(objs, "Gateway")["spec"]["listeners"][0]["port"]
    assert service["type"] == "NodePort"
    assert service["patch"]["value"]["spec"]["ports"] == [{"port": listener_port, "nodePort": 30080}]
    default = find(render("envoy-gateway"), "EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyService"]
    assert default == {"type": "LoadBalancer"}
