"""versions.env is the one place external versions are pinned: the quickstart script, kind
config, chart, docs and the vendored CRDs agree with it; the chart refuses an Envoy
Gateway version too old for its values; and validation against the vendored upstream CRDs (and
their CEL rules) really rejects what the oldest supported release does not know."""

from __future__ import annotations

import gzip
import hashlib
import re
import subprocess
from collections.abc import Callable

import pytest
import yaml

from testkit import crd_validation
from testkit.helm import REPO_ROOT, Helm
from testkit.k8s_objects import (
    CHART,
    CRD_PROJECTS,
    IMAGE,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Obj,
    crd_releases,
    find,
    validate,
    with_image,
)
from testkit.versions import VERSIONS, parse, semver

Render = Callable[[str], list[Obj]]

DOCS = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
MANIFESTS_README = (REPO_ROOT / "manifests" / "README.md").read_text()
SCRIPT = (REPO_ROOT / "scripts" / "kind-up.sh").read_text()
HELPERS = (CHART / "templates" / "_helpers.tpl").read_text()
GIE_CRDS_URL = "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/{}/manifests.yaml"


def vendored(project: str) -> list[str]:
    versions = {r["file"].split("/")[1] for r in crd_validation.sources() if r["file"].startswith(f"{project}/")}
    return sorted(versions, key=semver)


def helper(name: str) -> str:
    match = re.search(r'\{\{- define "prefix-epp\.' + name + r'" -\}\}(v[\d.]+)\{\{- end -\}\}', HELPERS)
    assert match, name
    return match.group(1)


# --- versions.env and where it is read ------------------------------------------------------------

def test_versions_file_is_complete_and_ordered() -> None:
    raw = parse()
    for key, value in raw.items():
        if key.endswith("VERSION"):
            semver(value)  # a release tag vX.Y.Z, never a range or "latest"
    assert semver(VERSIONS.eg_min) <= semver(VERSIONS.eg_verified_tls_min) <= semver(VERSIONS.eg)
    assert semver(VERSIONS.gie_min) <= semver(VERSIONS.gie)
    image = VERSIONS.kind_node_image
    assert re.fullmatch(r"kindest/node:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", image), image


def test_oldest_and_newest_releases_are_vendored() -> None:
    assert {VERSIONS.eg_min, VERSIONS.eg_verified_tls_min, VERSIONS.eg} == set(vendored("envoy-gateway"))
    assert {VERSIONS.gie_min, VERSIONS.gie} == set(vendored("inference-extension"))


def test_vendored_crds_match_their_recorded_source() -> None:
    records = crd_validation.sources()
    files = {p.relative_to(crd_validation.CRDS).as_posix() for p in crd_validation.CRDS.rglob("*.yaml.gz")}
    assert files == {r["file"] for r in records}
    for record in records:
        assert record["repository"] in ("envoyproxy/gateway", "kubernetes-sigs/gateway-api-inference-extension")
        # A tag read from a git clone records its commit; one read from the Go module zip (a tag newer
        # than the clone) records the module and its checksum-database h1 sum.
        assert (re.fullmatch(r"[0-9a-f]{40}", record.get("commit", ""))
                or (record.get("module") == f"github.com/{record['repository']}@{record['tag']}"
                    and re.fullmatch(r"h1:[A-Za-z0-9+/]{43}=", record.get("module_sum", "")))), record
        assert record["file"].split("/")[1] == record["tag"]
        text = gzip.decompress((crd_validation.CRDS / record["file"]).read_bytes())
        assert hashlib.sha256(text).hexdigest() == record["sha256"], record["file"]
        crd = yaml.safe_load(text)
        assert crd["kind"] == "CustomResourceDefinition"
        assert record["file"].endswith(f"/{crd['metadata']['name']}.yaml.gz")


def test_kind_config_pins_the_node_image() -> None:
    config = yaml.safe_load((REPO_ROOT / "kind-config.yaml").read_text())
    assert [n["image"] for n in config["nodes"]] == [VERSIONS.kind_node_image]


def test_kind_up_reads_the_versions_file() -> None:
    assert 'pinned() { sed -n "s/^$1=//p" "$ROOT/versions.env"; }' in SCRIPT
    assert 'EG_VERSION="${EG_VERSION:-$(pinned EG_VERSION)}"' in SCRIPT
    assert 'GIE_VERSION="${GIE_VERSION:-$(pinned GIE_VERSION)}"' in SCRIPT
    assert not re.search(r"v\d+\.\d+\.\d+", SCRIPT), "kind-up.sh hard-codes a version"
    assert '--set envoyGateway.version="$EG_VERSION"' in SCRIPT


def test_the_pinned_helper_reads_each_key() -> None:
    """The script's `pinned` function, run by bash on versions.env, yields the parsed values."""
    prog = 'ROOT="$1"; pinned() { sed -n "s/^$1=//p" "$ROOT/versions.env"; }; pinned EG_VERSION; pinned GIE_VERSION'
    proc = subprocess.run(["bash", "-c", prog, "x", str(REPO_ROOT)], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == [VERSIONS.eg, VERSIONS.gie]


@pytest.mark.parametrize("doc", ["docs/kubernetes.md", "manifests/README.md"])
def test_docs_install_the_pinned_versions(doc: str) -> None:
    text = (REPO_ROOT / doc).read_text()
    assert f"gateway-helm --version {VERSIONS.eg}" in text
    assert GIE_CRDS_URL.format(VERSIONS.gie) in text
    installs = set(re.findall(r"gateway-helm --version (v[\d.]+)", text))
    crds = set(re.findall(r"releases/download/(v[\d.]+)/manifests\.yaml", text))
    assert installs == {VERSIONS.eg} and crds == {VERSIONS.gie}, (installs, crds)


def test_supported_versions_table_matches_what_is_validated() -> None:
    rows = {m.group(1): m.group(2, 3, 4) for m in re.finditer(
        r"^\| (Envoy Gateway|Inference Extension CRDs|kind) \| (\S+) \| (\S+) \| ([^|]+?) \|", DOCS, re.M)}
    eg, gie, kind = rows["Envoy Gateway"], rows["Inference Extension CRDs"], rows["kind"]
    assert (eg[0], eg[1], eg[2]) == (VERSIONS.eg_min, VERSIONS.eg, VERSIONS.eg)
    assert (eg[0], eg[1]) == (vendored("envoy-gateway")[0], vendored("envoy-gateway")[-1])
    assert (gie[0], gie[1], gie[2]) == (VERSIONS.gie_min, VERSIONS.gie, VERSIONS.gie)
    assert (gie[0], gie[1]) == (vendored("inference-extension")[0], vendored("inference-extension")[-1])
    assert kind[0] == VERSIONS.kind_min and VERSIONS.kind_node_image.split("@")[0].split(":")[1] in kind[2]
    assert f"{VERSIONS.eg_verified_tls_min} to verify the picker, the default" in DOCS
    assert f"llm-d router {VERSIONS.llmd_router}" in DOCS
    assert f"/#installation) {VERSIONS.kind_min} or newer" in DOCS


def test_chart_knows_the_same_versions(render: Render) -> None:
    assert helper("egMinVersion") == VERSIONS.eg_min
    assert helper("egVerifiedTLSMinVersion") == VERSIONS.eg_verified_tls_min
    assert helper("egNewestTested") == VERSIONS.eg
    assert helper("gieMinVersion") == VERSIONS.gie_min
    assert helper("gieNewestTested") == VERSIONS.gie
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["envoyGateway"]["version"] == VERSIONS.eg


def test_chart_notes_state_the_supported_ranges(helm: Helm) -> None:
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
            "--set", "envoyGateway.enabled=true", "--set", f"image.repository={IMAGE['image']['repository']}"]
    notes = helm.run(args).stdout.split("NOTES:", 1)[1]
    assert f"Inference Extension CRDs {VERSIONS.gie_min} to {VERSIONS.gie}" in notes
    assert f"Envoy Gateway {VERSIONS.eg_min} to {VERSIONS.eg}" in notes
    assert f"{VERSIONS.eg_verified_tls_min}+ to verify the picker, the default" in notes


# --- the chart refuses an Envoy Gateway that is too old --------------------------------------------

def older(version: str) -> str:
    major, minor, _ = semver(version)
    return f"v{major}.{minor - 1}.9"


@pytest.mark.parametrize(("label", "values", "needle"), [
    ("below the minimum", {"envoyGateway": {"enabled": True, "version": older(VERSIONS.eg_min)}},
     f"needs {VERSIONS.eg_min} or newer"),
    ("verified TLS below its minimum",
     {"tls": {"existingSecret": "s"},
      "envoyGateway": {"enabled": True, "version": older(VERSIONS.eg_verified_tls_min),
                       "pickerTLS": {"caConfigMap": "ca"}}},
     f"needs Envoy Gateway {VERSIONS.eg_verified_tls_min} or newer"),
])
def test_chart_fails_to_render_for_a_too_old_gateway(helm: Helm, label: str, values: Obj, needle: str) -> None:
    proc = helm.run(helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values)),
                    check=False)
    assert proc.returncode != 0, label
    assert needle in proc.stderr and values["envoyGateway"]["version"] in proc.stderr, proc.stderr


def test_verification_is_not_silently_dropped_below_its_minimum(helm: Helm) -> None:
    """Envoy Gateway older than the BackendTLSPolicy v1 minimum: the default (verified) wiring
    refuses to render rather than falling back to unverified TLS."""
    values = with_image({"envoyGateway": {"enabled": True, "version": VERSIONS.eg_min}})
    proc = helm.run(helm.template_args(CHART, release=RELEASE, namespace=NAMESPACE, values=values), check=False)
    assert proc.returncode != 0
    assert "insecureSkipVerify" in proc.stderr and VERSIONS.eg_verified_tls_min in proc.stderr


def test_chart_renders_at_each_minimum(helm: Helm) -> None:
    for values in ({"envoyGateway": {"enabled": True, "version": VERSIONS.eg_min,
                                     "pickerTLS": {"insecureSkipVerify": True}}},
                   {"envoyGateway": {"enabled": True, "version": VERSIONS.eg_verified_tls_min}},
                   {"tls": {"existingSecret": "s"},
                    "envoyGateway": {"enabled": True, "version": VERSIONS.eg_verified_tls_min,
                                     "pickerTLS": {"caConfigMap": "ca"}}}):
        objs = helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image(values))
        for obj in objs:
            validate(obj)


# --- validation against the vendored CRDs really checks -------------------------------------------

def test_every_rendered_custom_resource_is_checked_against_oldest_and_newest(render: Render) -> None:
    checked: set[tuple[str, str, str]] = set()
    for name in VALUE_SETS:
        for obj in render(name):
            if obj["apiVersion"].rpartition("/")[0] in CRD_PROJECTS:
                checked.update((obj["kind"], project, version) for project, version in crd_releases(obj))
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy", "Backend", "EnvoyProxy", "Gateway", "HTTPRoute"):
        assert {(kind, "envoy-gateway", VERSIONS.eg_min), (kind, "envoy-gateway", VERSIONS.eg)} <= checked, kind
    assert ("BackendTLSPolicy", "envoy-gateway", VERSIONS.eg_verified_tls_min) in checked
    assert {("InferencePool", "inference-extension", v) for v in (VERSIONS.gie_min, VERSIONS.gie)} <= checked


def test_cel_rules_are_evaluated(render: Render) -> None:
    report = crd_validation.CelReport()
    for name in VALUE_SETS:
        for obj in render(name):
            if obj["apiVersion"].rpartition("/")[0] in CRD_PROJECTS:
                validate(obj, report)
    assert report.evaluated >= 100, report
    # The rule that makes Envoy Gateway refuse fail-open with full-duplex bodies is among them.
    assert any("FullDuplexStreamed" in rule and "failOpen" in rule for rule in report.evaluated_rules)


def test_cel_rule_rejects_fail_open_with_full_duplex(render: Render) -> None:
    policy = find(render("envoy-gateway"), "EnvoyExtensionPolicy")
    ext = policy["spec"]["extProc"][0]
    ext["failOpen"] = True
    for version in (VERSIONS.eg_min, VERSIONS.eg):
        assert crd_validation.errors(policy, "envoy-gateway", version) == []  # buffered bodies: allowed
    ext["processingMode"]["request"]["body"] = "FullDuplexStreamed"
    for version in (VERSIONS.eg_min, VERSIONS.eg):
        errors = crd_validation.errors(policy, "envoy-gateway", version)
        assert any("failOpen" in e for e in errors), errors


def test_oldest_gateway_rejects_what_it_does_not_know(render: Render) -> None:
    # A whole kind: BackendTLSPolicy v1 arrived with Envoy Gateway v1.6 (Gateway API v1.4).
    tls_policy = find(render("eg-verified-tls"), "BackendTLSPolicy")
    assert not crd_validation.errors(tls_policy, "envoy-gateway", VERSIONS.eg)
    with pytest.raises(crd_validation.CrdUnknown):
        crd_validation.errors(tls_policy, "envoy-gateway", VERSIONS.eg_min)
    # A field: BackendTrafficPolicy timeout.http.streamIdleTimeout is newer than v1.5.
    btp = find(render("envoy-gateway"), "BackendTrafficPolicy")
    btp["spec"]["timeout"] = {"http": {"streamIdleTimeout": "600s"}}
    assert not crd_validation.errors(btp, "envoy-gateway", VERSIONS.eg)
    assert any("streamIdleTimeout" in e for e in crd_validation.errors(btp, "envoy-gateway", VERSIONS.eg_min))
    # Unknown fields are errors (kubectl's strict field validation), also for the InferencePool.
    pool = find(render("default"), "InferencePool")
    pool["spec"]["unknownField"] = 1
    assert any("unknownField" in e for e in crd_validation.errors(pool, "inference-extension", VERSIONS.gie_min))


def test_structural_errors_are_reported(render: Render) -> None:
    btp = find(render("eg-fallbacks"), "BackendTrafficPolicy")
    btp["spec"]["retry"]["retryOn"]["triggers"] = ["on-a-whim"]
    btp["spec"]["circuitBreaker"]["maxConnections"] = -1
    errors = crd_validation.errors(btp, "envoy-gateway", VERSIONS.eg)
    assert any("on-a-whim" in e for e in errors) and any("maxConnections" in e for e in errors), errors
