"""Kubernetes objects of the chart and of manifests/: the value sets the tests render, lookups,
and schema validation.

Validation (`validate`): built-in kinds against the Kubernetes OpenAPI schemas bundled with
kubernetes-validate (strict: unknown fields are errors), for every version in `K8S_VERSIONS`;
custom resources (InferencePool, Gateway API and Envoy Gateway kinds) against the upstream CRDs
vendored under testkit/crds/schemas/ (testkit/crd_validation.py), including their offline-
evaluable CEL rules, for the oldest and newest supported release of each project
(versions.env). An object of any other kind fails: a new kind needs a CRD before it ships.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

from testkit import crd_validation
from testkit.helm import REPO_ROOT
from testkit.versions import VERSIONS, semver

Obj = dict[str, Any]

CHART = REPO_ROOT / "charts" / "prefix-epp"
MANIFESTS = REPO_ROOT / "manifests"
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

# The image every render names: the chart has no default (nothing is published to a registry).
IMAGE: Obj = {"image": {"repository": "registry.example/team/prefix-epp"}}
# An existing Gateway the attach-mode renders join: its name, namespace and listener.
USER_GATEWAY: Obj = {"create": False, "name": "edge", "namespace": "gateways", "sectionName": "https"}

# Value sets rendered by the tests: name -> values given on top of values.yaml (and IMAGE).
_VALUE_SETS: dict[str, Obj] = {
    "default": {},
    "envoy-gateway": {"envoyGateway": {"enabled": True}},
    "inference-pool-disabled": {"inferencePool": {"enabled": False}},
    "tls-secret": {"tls": {"existingSecret": "prefix-epp-tls"}},
    "grafana": {"grafana": {"dashboard": {"enabled": True}}},
    "custom-config": {"config": {"text": CUSTOM_CONFIG}, "picker": {"maxEndpoints": 2, "affinityHints": False,
                                                                   "sessionHeader": "x-conversation-id"}},
    "eg-verified-tls": {"tls": {"existingSecret": "prefix-epp-tls"},
                        "envoyGateway": {"enabled": True, "pickerTLS": {"caConfigMap": "prefix-epp-ca"}}},
    "eg-plaintext": {"tls": {"enabled": False}, "envoyGateway": {"enabled": True}},
    "eg-ai-gateway": {"envoyGateway": {"enabled": True, "inferencePoolBackend": True}},
    "eg-nodeport": {"envoyGateway": {"enabled": True,
                                     "envoyProxy": {"serviceType": "NodePort", "nodePort": 30080}}},
    "eg-fallbacks": {"envoyGateway": {"enabled": True}, "picker": {"maxEndpoints": 3}},
    "eg-single-endpoint": {"envoyGateway": {"enabled": True}, "picker": {"maxEndpoints": 1}},
    "eg-oldest-supported": {"envoyGateway": {"enabled": True, "version": "v1.5.0",
                                             "pickerTLS": {"insecureSkipVerify": True}}},
    "eg-insecure-tls": {"envoyGateway": {"enabled": True, "pickerTLS": {"insecureSkipVerify": True}}},
    "eg-mutual-tls": {"tls": {"clientCA": {"name": "envoy-client-ca"}},
                      "envoyGateway": {"enabled": True, "envoyProxy": {"backendClientCertificate": "envoy-client"}}},
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    "network-policy-custom": {"networkPolicy": {
        "extProc": {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}},
                              "podSelector": {"matchLabels": {"istio": "ingressgateway"}}}]},
        "metrics": {"from": []},
        "extraIngress": [{"ports": [{"port": "grpc-health", "protocol": "TCP"}],
                          "from": [{"podSelector": {"matchLabels": {"app": "prober"}}}]}]}},
    "eg-attach": {"envoyGateway": {"enabled": True, "gateway": USER_GATEWAY}},
}

# Custom resources are validated against the vendored upstream CRDs (testkit/crds/schemas/) of the
# project that defines their API group, for every vendored release from the oldest that supports
# the object (versions.env) to the newest tested.
CRD_PROJECTS: dict[str, str] = {
    "inference.networking.k8s.io": "inference-extension",
    "gateway.networking.k8s.io": "envoy-gateway",  # Envoy Gateway's Helm chart installs these CRDs
    "gateway.envoyproxy.io": "envoy-gateway",
}



def deep_merge(base: Obj, override: Obj) -> Obj:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def with_image(values: Obj) -> Obj:
    """`values` naming the test image too (the chart renders nothing without one)."""
    return deep_merge(IMAGE, values)


VALUE_SETS: dict[str, Obj] = {name: with_image(values) for name, values in _VALUE_SETS.items()}


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


def crd_releases(obj: Obj) -> list[tuple[str, str]]:
    """(project, version) of every vendored release `obj` must be valid against."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    project = CRD_PROJECTS[group]
    if project == "inference-extension":
        return [(project, v) for v in (VERSIONS.gie_min, VERSIONS.gie)]
    oldest = VERSIONS.eg_verified_tls_min if obj.get("kind") == "BackendTLSPolicy" else VERSIONS.eg_min
    vendored = sorted({r["file"].split("/")[1] for r in crd_validation.sources()
                       if r["file"].startswith("envoy-gateway/")}, key=semver)
    return [(project, v) for v in vendored if semver(oldest) <= semver(v) <= semver(VERSIONS.eg)]


def validate(obj: Obj, cel: crd_validation.CelReport | None = None) -> None:
    """Raise AssertionError with every problem of `obj` against its schemas (and their CEL rules)."""
    ident = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key[0].rpartition("/")[0] in CRD_PROJECTS:
        for project, version in crd_releases(obj):
            try:
                errors = crd_validation.errors(obj, project, version, cel)
            except crd_validation.CrdUnknown as exc:
                raise AssertionError(f"{ident}: {exc}") from exc
            assert not errors, f"{ident} against {project} {version}: " + "; ".join(errors)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:
            raise AssertionError(f"{ident}: no schema for {key} (vendor its CRD under testkit/crds/schemas/)") from exc
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{ident} against Kubernetes {version}: {path}: {exc.message}") from exc
