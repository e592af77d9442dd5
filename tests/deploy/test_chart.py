"""The Helm chart: lint, render for every value set, schema-valid objects, the right objects per
option, and values.yaml / values.schema.json that document and guard every value."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from testkit.helm import HELM_VERSION, REPO_ROOT, Helm
from testkit.k8s_objects import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Obj,
    container,
    find,
    find_all,
    kinds,
    validate,
    with_image,
)

Render = Callable[[str], list[Obj]]

BASE_KINDS = {"ServiceAccount", "ConfigMap", "Role", "RoleBinding", "Service", "Deployment", "InferencePool",
              "PodDisruptionBudget", "Secret", "NetworkPolicy"}
PLAIN_EG_KINDS = {"Gateway", "HTTPRoute", "EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy",
                  "EnvoyProxy"}
VERIFIED = PLAIN_EG_KINDS | {"BackendTLSPolicy"}  # the default: Envoy Gateway verifies the picker

EXPECTED_KINDS: dict[str, set[str]] = {
    "default": BASE_KINDS,
    "envoy-gateway": BASE_KINDS | VERIFIED,
    "inference-pool-disabled": BASE_KINDS - {"InferencePool"},
    "tls-secret": BASE_KINDS,
    "grafana": BASE_KINDS,
    "custom-config": BASE_KINDS,
    "eg-verified-tls": BASE_KINDS | VERIFIED,
    "eg-plaintext": BASE_KINDS | PLAIN_EG_KINDS,
    "eg-ai-gateway": BASE_KINDS | {"Gateway", "HTTPRoute", "EnvoyProxy", "ClientTrafficPolicy"},
    "eg-nodeport": BASE_KINDS | VERIFIED,
    "eg-fallbacks": BASE_KINDS | VERIFIED,
    "eg-single-endpoint": BASE_KINDS | VERIFIED,
    "eg-oldest-supported": BASE_KINDS | PLAIN_EG_KINDS | {"Backend"},
    "eg-insecure-tls": BASE_KINDS | PLAIN_EG_KINDS | {"Backend"},
    "eg-mutual-tls": BASE_KINDS | VERIFIED,
    "network-policy-off": BASE_KINDS - {"NetworkPolicy"},
    "network-policy-custom": BASE_KINDS,
    # An existing Gateway: the route and its policies, no Gateway or EnvoyProxy of the chart's own.
    "eg-attach": BASE_KINDS | VERIFIED - {"Gateway", "EnvoyProxy"},
}


def test_pinned_helm_version(helm: Helm) -> None:
    assert helm.version() == HELM_VERSION


def test_every_value_set_has_expected_kinds() -> None:
    assert set(EXPECTED_KINDS) == set(VALUE_SETS)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(helm: Helm, name: str) -> None:
    proc = helm.lint(CHART, values=VALUE_SETS[name])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_render_kinds_and_schemas(render: Render, name: str) -> None:
    objs = render(name)
    assert kinds(objs) == EXPECTED_KINDS[name]
    seen: set[tuple[str, str]] = set()
    for obj in objs:
        validate(obj)
        ident = (obj["kind"], obj["metadata"]["name"])
        assert ident not in seen, f"duplicate {ident}"
        seen.add(ident)
        # Envoy Gateway policies live beside their target: the ClientTrafficPolicy in the Gateway's.
        gateway = VALUE_SETS[name].get("envoyGateway", {}).get("gateway", {})
        expected = gateway.get("namespace") or NAMESPACE if obj["kind"] == "ClientTrafficPolicy" else NAMESPACE
        assert obj["metadata"]["namespace"] == expected, ident


def test_grafana_dashboard_configmap(render: Render) -> None:
    cm = find(render("grafana"), "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "prefix-epp.json").read_text())
    assert json.loads(cm["data"]["prefix-epp.json"]) == shipped
    assert not [c for c in find_all(render("default"), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]


def test_custom_config_reaches_the_configmap(render: Render) -> None:
    text = find(render("custom-config"), "ConfigMap", f"{RELEASE}-config")["data"]["config.yaml"]
    assert yaml.safe_load(text) == yaml.safe_load(VALUE_SETS["custom-config"]["config"]["text"])
    default = find(render("default"), "ConfigMap", f"{RELEASE}-config")["data"]["config.yaml"]
    assert default != text


def test_config_change_rolls_the_pods(render: Render) -> None:
    def checksum(name: str) -> str:
        deploy = find(render(name), "Deployment")
        value: str = deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return value

    assert re.fullmatch(r"[0-9a-f]{64}", checksum("default"))
    assert checksum("default") != checksum("custom-config")


def test_tls_secret_is_mounted_at_cert_path(render: Render) -> None:
    for name, secret in (("tls-secret", "prefix-epp-tls"), ("default", f"{RELEASE}-tls")):
        deploy = find(render(name), "Deployment")
        c = container(deploy)
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == secret
        assert mount["readOnly"] is True
        assert f"--cert-path={mount['mountPath']}" in c["args"]
        assert "--secure-serving=true" in c["args"]
    # A given Secret is used, not made.
    assert not [s for s in find_all(render("tls-secret"), "Secret") if s["type"] == "kubernetes.io/tls"]
    assert not [c for c in find_all(render("tls-secret"), "ConfigMap") if c["metadata"]["name"].endswith("-ca")]
    plaintext = container(find(render("eg-plaintext"), "Deployment"))
    assert not any(a.startswith("--cert-path") for a in plaintext["args"])
    assert all(m["name"] != "tls" for m in plaintext["volumeMounts"])


def test_security_context_and_probes(render: Render) -> None:
    deploy = find(render("default"), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = container(deploy)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["runAsNonRoot"] is True
    health = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc-health")
    assert c["livenessProbe"]["grpc"] == {"port": health, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": health, "service": "readiness"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # A read-only root needs a writable /tmp.
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_ai_gateway_routes_to_the_pool(render: Render) -> None:
    objs = render("eg-ai-gateway")
    refs = find(objs, "HTTPRoute")["spec"]["rules"][0]["backendRefs"]
    pool = find(objs, "InferencePool")
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]


def test_several_target_ports_are_refused_with_plain_envoy_gateway(helm: Helm) -> None:
    values = {"envoyGateway": {"enabled": True},
              "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]}}
    args = helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values))
    proc = helm.run(args, check=False)
    assert proc.returncode != 0
    assert "exactly one entry" in proc.stderr


# --- values.yaml and values.schema.json ---------------------------------------------------------

BAD_VALUES: list[tuple[str, Obj]] = [
    ("port as string", {"picker": {"grpcPort": "9002"}}),
    ("port out of range", {"picker": {"grpcPort": 70000}}),
    ("tls.enabled as string", {"tls": {"enabled": "yes"}}),
    ("unknown top-level key", {"replica": 2}),
    ("unknown nested key", {"envoyGateway": {"enable": True}}),
    ("failureMode enum", {"inferencePool": {"failureMode": "Open"}}),
    ("matchLabels removed", {"inferencePool": {"modelServers": {"matchLabels": None}}}),
    ("label value too long", {"inferencePool": {"modelServers": {"matchLabels": {"app": "x" * 64}}}}),
    ("too many targetPorts", {"inferencePool": {"targetPorts": [{"number": 8000 + i} for i in range(9)]}}),
    ("maxEndpoints zero", {"picker": {"maxEndpoints": 0}}),
    ("nodePort outside the range", {"envoyGateway": {"envoyProxy": {"nodePort": 8080}}}),
    ("duration format", {"envoyGateway": {"route": {"requestTimeout": "5 minutes"}}}),
    ("extra arg without dashes", {"picker": {"extraArgs": ["serve"]}}),
    ("session header not a header name", {"picker": {"sessionHeader": "X-Session Id"}}),
]


@pytest.mark.parametrize(("label", "values"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_schema_rejects_bad_values(helm: Helm, label: str, values: Obj) -> None:
    args = helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=values)
    proc = helm.run(args, check=False)
    assert proc.returncode != 0, f"{label}: helm template accepted {values}"
    assert "schema" in proc.stderr.lower(), proc.stderr


def test_schema_rejects_bad_set_flag(helm: Helm) -> None:
    """A wrong type given on the command line (--set-string) is refused too."""
    args = ["template", RELEASE, str(CHART), "--set-string", "picker.metricsPort=9090"]
    proc = helm.run(args, check=False)
    assert proc.returncode != 0 and "metricsPort" in proc.stderr


def _walk(values: Any, schema: Obj, path: str, problems: list[str]) -> None:
    if not isinstance(values, dict):
        return
    props: Obj = schema.get("properties", {})
    closed = schema.get("additionalProperties") is False
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key in props:
            _walk(value, props[key], where, problems)
        elif closed or schema.get("type") != "object":
            # Only free-form maps typed as objects (labels, annotations, securityContext) may hold
            # keys the schema does not name.
            problems.append(f"{where} is not in values.schema.json")


def test_schema_covers_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    problems: list[str] = []
    _walk(values, schema, "", problems)
    assert not problems
    assert set(schema["properties"]) == set(values), "top-level keys of values.yaml and the schema differ"


def test_every_value_is_documented() -> None:
    """Each key line of values.yaml carries a comment on the same line or right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented: list[str] = []
    block_indent: int | None = None
    list_indent: int | None = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:
            if not stripped or indent > block_indent:
                continue
            block_indent = None
        if not stripped or stripped.startswith("#"):
            continue
        if list_indent is not None and (indent > list_indent or (indent == list_indent and stripped.startswith("- "))):
            continue
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent
            continue
        match = re.match(r"^([A-Za-z0-9_.\-/\"]+):(.*)$", stripped)
        if not match:
            continue
        rest = match.group(2).strip()
        if rest.startswith(("|", ">")):
            block_indent = indent
        above = lines[i - 1].strip() if i else ""
        if "#" not in rest and not above.startswith("#"):
            undocumented.append(f"line {i + 1}: {stripped}")
    assert not undocumented, "undocumented values:\n" + "\n".join(undocumented)


def test_chart_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert chart["apiVersion"] == "v2"
