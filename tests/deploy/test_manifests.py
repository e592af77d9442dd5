"""manifests/ (kind rollout and EKS overlay) and kind-config.yaml: they build offline with the
pinned kubectl's kustomize, every object is schema-valid, the generated chart render is current,
and the model pods carry the labels and ports the InferencePool expects."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from prefix_epp_sim.cli import add_arguments as add_sim_arguments
from prefix_epp_sim.cli import config_from_args as sim_config_from_args
from testkit.helm import REPO_ROOT, Helm, load_documents
from testkit.k8s_objects import MANIFESTS, Obj, container, find, find_all, validate
from testkit.render_manifests import OUTPUT
from testkit.render_manifests import render as render_manifests

Kubectl = Callable[..., subprocess.CompletedProcess[str]]

KIND_VALUES: Obj = yaml.safe_load((MANIFESTS / "values-kind.yaml").read_text())
SCRIPT = (REPO_ROOT / "scripts" / "kind-up.sh").read_text()


GEN_SECRETS = REPO_ROOT / "scripts" / "gen-secrets.sh"
OVERLAYS = {"base": Path("."), "eks": Path("overlays") / "eks"}  # kustomization directory in manifests/


def build(kubectl: Kubectl, path: Path) -> list[Obj]:
    proc = kubectl("kustomize", str(path))
    assert proc.returncode == 0, proc.stderr
    return load_documents(proc.stdout)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of manifests/ (without any secrets of this checkout) in which scripts/gen-secrets.sh
    wrote each overlay's own secrets, as a user would before `kubectl apply -k`."""
    root = tmp_path_factory.mktemp("rollouts") / "manifests"
    shutil.copytree(MANIFESTS, root, ignore=shutil.ignore_patterns("secrets"))
    for overlay in OVERLAYS.values():
        proc = subprocess.run(["bash", str(GEN_SECRETS), str(root / overlay / "secrets")], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture(scope="module")
def base(kubectl: Kubectl, rollouts: Path) -> list[Obj]:
    return build(kubectl, rollouts / OVERLAYS["base"])


@pytest.fixture(scope="module")
def eks(kubectl: Kubectl, rollouts: Path) -> list[Obj]:
    return build(kubectl, rollouts / OVERLAYS["eks"])


def pod_labels(deployment: Obj) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def parse_sim(args: list[str]) -> argparse.Namespace:
    assert args[0] == "sim"
    parser = argparse.ArgumentParser(prog="prefix-epp sim", exit_on_error=False)
    add_sim_arguments(parser)
    try:
        return parser.parse_args(args[1:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"`prefix-epp sim` rejects {args}: {exc}") from exc


def test_generated_chart_render_is_current(helm: Helm) -> None:
    assert OUTPUT.read_text() == render_manifests(helm), (
        f"{OUTPUT.relative_to(REPO_ROOT)} is out of date: .venv/bin/python -m testkit.render_manifests")


def test_base_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    files = {p.name for p in (MANIFESTS / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert "namespace" not in kustomization, "kustomize would stamp a namespace onto the cluster-scoped GatewayClass"


@pytest.mark.parametrize("which", ["base", "eks"])
def test_every_object_is_valid(request: pytest.FixtureRequest, which: str) -> None:
    objs: list[Obj] = request.getfixturevalue(which)
    assert len(objs) >= 15
    for obj in objs:
        validate(obj)
        if obj["kind"] not in ("Namespace", "GatewayClass"):
            assert obj["metadata"]["namespace"] == "prefix-epp", obj["metadata"]["name"]


def test_simulator_is_the_pool(base: list[Obj]) -> None:
    sim = find(base, "Deployment", "vllm-sim")
    pool = find(base, "InferencePool", "vllm")
    models = find(base, "Service", "vllm-models")
    labels = pod_labels(sim)
    assert sim["spec"]["replicas"] == 3
    assert selects(pool["spec"]["selector"]["matchLabels"], labels)
    assert selects(models["spec"]["selector"], labels)
    assert selects(sim["spec"]["selector"]["matchLabels"], labels)
    assert labels.get("inference.networking.k8s.io/engine-type") == "vllm"
    # The simulator runs from the picker's image.
    picker = container(find(base, "Deployment", "prefix-epp"))
    c = container(sim)
    assert c["image"] == picker["image"]
    config = sim_config_from_args(parse_sim(c["args"]))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    [target] = pool["spec"]["targetPorts"]
    assert config.host == "0.0.0.0"
    assert config.port == ports["http"] == target["number"]
    assert config.kv_events and config.kv_events_port_base == ports["kv-events"]
    assert config.model == re.search(r'^MODEL="\$\{MODEL:-(.+)\}"$', SCRIPT, re.M).group(1)  # type: ignore[union-attr]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_no_other_pods_match_the_pool(base: list[Obj], eks: list[Obj]) -> None:
    for objs in (base, eks):
        selector = find(objs, "InferencePool")["spec"]["selector"]["matchLabels"]
        matching = [d["metadata"]["name"] for d in find_all(objs, "Deployment") if selects(selector, pod_labels(d))]
        assert len(matching) == 1, matching


def test_kind_values_drive_the_rendered_objects(base: list[Obj]) -> None:
    pool = find(base, "InferencePool")
    assert pool["metadata"]["name"] == KIND_VALUES["inferencePool"]["name"]
    picker = container(find(base, "Deployment", "prefix-epp"))
    assert picker["imagePullPolicy"] == "Never"
    assert picker["image"] == "prefix-epp:dev"
    assert "--pool-name=vllm" in picker["args"]


def test_kind_config_maps_the_gateway_nodeport() -> None:
    cluster = yaml.safe_load((REPO_ROOT / "kind-config.yaml").read_text())
    assert cluster["kind"] == "Cluster" and cluster["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    [node] = cluster["nodes"]
    [mapping] = node["extraPortMappings"]
    assert mapping["containerPort"] == KIND_VALUES["envoyGateway"]["envoyProxy"]["nodePort"]
    assert KIND_VALUES["envoyGateway"]["envoyProxy"]["serviceType"] == "NodePort"
    default_port = re.search(r'^GATEWAY_PORT="\$\{GATEWAY_PORT:-(\d+)\}"$', SCRIPT, re.M)
    assert default_port and mapping["hostPort"] == int(default_port.group(1))
    assert re.search(rf'^CLUSTER_NAME="\$\{{CLUSTER_NAME:-{cluster["name"]}\}}"$', SCRIPT, re.M)


def test_eks_runs_vllm_on_gpus(eks: list[Obj]) -> None:
    assert not [d for d in find_all(eks, "Deployment") if d["metadata"]["name"] == "vllm-sim"]
    vllm = find(eks, "Deployment", "vllm")
    pool = find(eks, "InferencePool")
    pod = vllm["spec"]["template"]["spec"]
    c = container(vllm)
    args: list[str] = c["args"]
    assert "--enable-prefix-caching" in args
    [target] = pool["spec"]["targetPorts"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert f"--port={target['number']}" in args and ports["http"] == target["number"]
    model = next(a.split("=", 1)[1] for a in args if a.startswith("--model="))
    [events_arg] = [a for a in args if a.startswith("--kv-events-config=")]
    events = json.loads(events_arg.split("=", 1)[1])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    # The same topic shape as the simulator's: kv@<pod IP>:<port>@<model>.
    assert events["topic"] == f"kv@$(POD_IP):{target['number']}@{model}"
    assert any(e["name"] == "POD_IP" for e in c["env"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels(vllm))
    # The same request works on kind and on EKS.
    assert model == re.search(r'^MODEL="\$\{MODEL:-(.+)\}"$', SCRIPT, re.M).group(1)  # type: ignore[union-attr]


def test_eks_pulls_the_picker_and_uses_a_load_balancer(eks: list[Obj]) -> None:
    picker = container(find(eks, "Deployment", "prefix-epp"))
    assert picker["imagePullPolicy"] == "IfNotPresent"
    assert picker["image"].endswith("/prefix-epp:0.1.0") and "/" in picker["image"]
    service = find(eks, "EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyService"]
    assert service["type"] == "LoadBalancer" and "patch" not in service
    assert service["annotations"]["service.beta.kubernetes.io/aws-load-balancer-type"] == "external"


def test_image_reaches_every_workload_of_the_quickstart(kubectl: Kubectl, helm: Helm) -> None:
    """kind-up.sh's IMAGE goes to the simulator (kubectl set image --local, run here offline with the
    pinned kubectl) and to the picker (the chart's image values)."""
    image = "registry.example:5000/team/prefix-epp:v9"
    assert ('kubectl set image --local --filename "$ROOT/manifests/base/simulator.yaml" "*=${IMAGE}" --output yaml'
            in SCRIPT)
    proc = kubectl("set", "image", "--local", "--filename", str(MANIFESTS / "base" / "simulator.yaml"),
                   f"*={image}", "--output", "yaml")
    assert proc.returncode == 0, proc.stderr
    sims = [o for o in load_documents(proc.stdout) if o["kind"] == "Deployment"]
    assert sims and all(c["image"] == image for d in sims for c in d["spec"]["template"]["spec"]["containers"])
    assert '--set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}"' in SCRIPT
    repository, _, tag = image.rpartition(":")
    objs = helm.template(REPO_ROOT / "charts" / "prefix-epp", release="prefix-epp", namespace="prefix-epp",
                         values={"image": {"repository": repository, "tag": tag}},
                         values_files=[MANIFESTS / "values-kind.yaml"])
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert deployments and all(container(d)["image"] == image for d in deployments)


# --- secrets: each rollout its own, none in git ------------------------------------------------

OLD_PUBLIC_SECRET = "kind-only-prefix-epp-peer-sync-secret-change-me"  # shipped by earlier releases


@pytest.mark.parametrize("which", sorted(OVERLAYS))
def test_no_overlay_builds_without_its_own_secrets(kubectl: Kubectl, tmp_path: Path, which: str) -> None:
    root = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, root, ignore=shutil.ignore_patterns("secrets"))
    proc = kubectl("kustomize", str(root / OVERLAYS[which]))
    assert proc.returncode != 0
    assert "secrets/" in proc.stderr, proc.stderr


def test_overlays_have_their_own_secrets(base: list[Obj], eks: list[Obj]) -> None:
    names = {"prefix-epp-sync", "prefix-epp-tls"}
    for objs in (base, eks):
        assert {s["metadata"]["name"] for s in find_all(objs, "Secret")} == names
    for name in names:
        assert find(base, "Secret", name)["data"] != find(eks, "Secret", name)["data"], name
    assert find(base, "ConfigMap", "prefix-epp-ca")["data"] != find(eks, "ConfigMap", "prefix-epp-ca")["data"]
    # No Secret is in git: not in base/, and the public one of earlier releases nowhere.
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    files = [REPO_ROOT / f for f in tracked.decode().split("\0") if f.startswith(("manifests/", "charts/"))]
    for path in files:
        text = path.read_text()
        assert OLD_PUBLIC_SECRET not in text, path
        if path.suffix == ".yaml" and "templates" not in path.parts:
            assert not [d for d in load_documents(text) if d.get("kind") == "Secret"], path


@pytest.mark.parametrize("which", sorted(OVERLAYS))
def test_manifests_verify_the_picker_with_their_own_ca(request: pytest.FixtureRequest, which: str) -> None:
    objs: list[Obj] = request.getfixturevalue(which)
    deploy = find(objs, "Deployment", "prefix-epp")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "prefix-epp-tls"
    assert volumes["sync-secret"]["secret"]["secretName"] == "prefix-epp-sync"
    tls = find(objs, "Secret", "prefix-epp-tls")
    assert tls["type"] == "kubernetes.io/tls"
    sync = find(objs, "Secret", "prefix-epp-sync")
    assert len(base64.b64decode(sync["data"]["secret"])) >= 32
    policy = find(objs, "BackendTLSPolicy")
    [ref] = policy["spec"]["validation"]["caCertificateRefs"]
    ca = x509.load_pem_x509_certificate(find(objs, "ConfigMap", ref["name"])["data"]["ca.crt"].encode())
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert policy["spec"]["validation"]["hostname"] in sans
    assert not find_all(objs, "Backend"), "no insecureSkipVerify Backend"
    assert find(objs, "NetworkPolicy", "prefix-epp")


def test_gen_secrets_passes_shellcheck_and_keeps_existing_files(shellcheck: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(shellcheck), "--shell=bash", "--severity=style", str(GEN_SECRETS)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [subprocess.run(["bash", str(GEN_SECRETS), str(tmp_path)], capture_output=True, text=True, check=False)]
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    runs.append(subprocess.run(["bash", str(GEN_SECRETS), str(tmp_path)], capture_output=True, text=True, check=False))
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert "wrote" not in runs[1].stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first
    assert set(first) == {"sync-secret", "ca.crt", "tls.crt", "tls.key"}  # the CA key is not kept
    assert all((tmp_path / name).stat().st_mode & 0o077 == 0 for name in first)
