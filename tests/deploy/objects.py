"""Kubernetes objects of the chart and of manifests/: the value sets the tests render, lookups,
and schema validation.

Validation (`validate`): built-in kinds against the Kubernetes OpenAPI schemas bundled with
kubernetes-validate (strict: unknown fields are errors), for every version in `K8S_VERSIONS`;
custom resources (InferencePool, Gateway API and Envoy Gateway kinds) against the JSON schemas in
tests/deploy/schemas/, written from the upstream API types (each file's description names its
source). An object of any other kind fails: a new kind needs a schema before it ships.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]

from tests.deploy.helm import REPO_ROOT

Obj = dict[str, Any]

CHART = REPO_ROOT / "charts" / "prefix-epp"
MANIFESTS = REPO_ROOT / "manifests"
SCHEMAS = Path(__file__).parent / "schemas"
RELEASE = "prefix-epp"
NAMESPACE = "prefix-epp"

# The chart's kubeVersion floor and the newest release kubernetes-validate bundles that kind and
# EKS run today.
K8S_VERSIONS = ("1.29.0", "1.35.0")

CUSTOM_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: prefix-cache-scorer
  - type: max-score-picker
    parameters:
      maxNumOfEndpoints: 2
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: prefix-cache-scorer
        weight: 1
      - pluginRef: max-score-picker
"""

# Value sets rendered by the tests: name -> values given on top of values.yaml.
VALUE_SETS: dict[str, Obj] = {
    "default": {},
    "envoy-gateway": {"envoyGateway": {"enabled": True}},
    "inference-pool-disabled": {"inferencePool": {"enabled": False}},
    "tls-secret": {"tls": {"existingSecret": "prefix-epp-tls"}},
    "grafana": {"grafana": {"dashboard": {"enabled": True}}},
    "custom-config": {"config": {"text": CUSTOM_CONFIG}, "picker": {"maxEndpoints": 2}},
    "eg-verified-tls": {"tls": {"existingSecret": "prefix-epp-tls"},
                        "envoyGateway": {"enabled": True, "pickerTLS": {"caConfigMap": "prefix-epp-ca"}}},
    "eg-plaintext": {"tls": {"enabled": False}, "envoyGateway": {"enabled": True}},
    "eg-ai-gateway": {"envoyGateway": {"enabled": True, "inferencePoolBackend": True}},
    "eg-nodeport": {"envoyGateway": {"enabled": True,
                                     "envoyProxy": {"serviceType": "NodePort", "nodePort": 30080}}},
}

CRD_SCHEMAS: dict[tuple[str, str], str] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "GatewayClass"): "gatewayclass-v1.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
    ("gateway.networking.k8s.io/v1", "BackendTLSPolicy"): "backendtlspolicy-v1.json",
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"): "envoyextensionpolicy-v1alpha1.json",
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): "backendtrafficpolicy-v1alpha1.json",
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): "clienttrafficpolicy-v1alpha1.json",
    ("gateway.envoyproxy.io/v1alpha1", "Backend"): "backend-v1alpha1.json",
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"): "envoyproxy-v1alpha1.json",
}


def deep_merge(base: Obj, override: Obj) -> Obj:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def find_all(objs: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == kind]


def find(objs: Iterable[Obj], kind: str, name: str | None = None) -> Obj:
    """The single object of `kind` (and `name`); fails when there is none or more than one."""
    matches = [o for o in find_all(objs, kind) if name is None or o["metadata"]["name"] == name]
    if len(matches) != 1:
        names = [o["metadata"]["name"] for o in find_all(objs, kind)]
        raise AssertionError(f"expected one {kind}{' ' + name if name else ''}, found {len(matches)} among {names}")
    return matches[0]


def kinds(objs: Iterable[Obj]) -> set[str]:
    return {o["kind"] for o in objs}


def container(deployment: Obj, name: str | None = None) -> Obj:
    containers: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1, f"{deployment['metadata']['name']} has {len(containers)} containers"
        return containers[0]
    return next(c for c in containers if c["name"] == name)


@cache
def crd_schema(filename: str) -> Obj:
    schema: Obj = json.loads((SCHEMAS / filename).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def crd_errors(obj: Obj) -> list[str]:
    """Schema errors of a custom resource (KeyError when no schema is kept for its kind)."""
    schema = crd_schema(CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in validator.iter_errors(obj)]


def validate(obj: Obj) -> None:
    """Raise AssertionError with every problem of `obj` against its schema."""
    ident = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CRD_SCHEMAS:
        errors = crd_errors(obj)
        assert not errors, f"{ident}: " + "; ".join(errors)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:
            raise AssertionError(f"{ident}: no schema for {key} (add one to tests/deploy/schemas/)") from exc
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{ident} against Kubernetes {version}: {path}: {exc.message}") from exc
