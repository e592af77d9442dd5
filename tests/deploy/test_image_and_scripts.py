"""Dockerfile, .dockerignore and scripts/kind-up.sh, checked without a Docker engine: the image
is pinned, multi-stage, non-root and its default command parses with the real flag parser; the
build context contains what `pip wheel .` needs and nothing else; the script is valid bash,
passes shellcheck and installs the pinned versions."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import yaml

from extproc.commands.serve import add_arguments, config_from_args
from extproc.config.settings import EppConfig
from testkit.helm import REPO_ROOT
from testkit.k8s_objects import CHART

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
SCRIPT_PATH = REPO_ROOT / "scripts" / "kind-up.sh"
SCRIPT = SCRIPT_PATH.read_text()


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_base_image_is_pinned_and_multi_stage() -> None:
    steps = instructions(DOCKERFILE)
    [arg] = [rest for word, rest in steps if word == "ARG" and rest.startswith("PYTHON_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", image), image
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "python3 -m venv /opt/prefix-epp" in runs
    assert "/opt/prefix-epp/bin/pip install --no-cache-dir ." in runs
    # The final stage copies the environment (content-keyed), never a bind mount of the build stage.
    assert ("COPY", "--from=build /opt/prefix-epp /opt/prefix-epp") in steps
    assert "--mount" not in runs


def test_runs_as_the_chart_user() -> None:
    steps = instructions(DOCKERFILE)
    users = [rest for word, rest in steps if word == "USER"]
    assert users == ["65532:65532"]
    # USER comes after every RUN of the final stage.
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    last_run = max(i for i, (w, _) in enumerate(final) if w == "RUN")
    assert last_run < next(i for i, (w, _) in enumerate(final) if w == "USER")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 65532
    assert values["podSecurityContext"]["runAsGroup"] == 65532


def test_entrypoint_and_default_command() -> None:
    steps = dict(instructions(DOCKERFILE))
    assert json.loads(steps["ENTRYPOINT"]) == ["prefix-epp"]
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "prefix-epp" in project["scripts"]
    cmd = json.loads(steps["CMD"])
    assert cmd[0] == "serve"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    config = config_from_args(parser.parse_args(cmd[1:]))
    defaults = EppConfig()
    assert (config.grpc_port, config.grpc_health_port, config.metrics_port) == (
        defaults.grpc_port, defaults.grpc_health_port, defaults.metrics_port)
    assert config.secure_serving is True and config.pool_name == "vllm"
    exposed = {int(p) for p in steps["EXPOSE"].split()}
    assert {config.grpc_port, config.grpc_health_port, config.metrics_port, 8000, 5557} <= exposed


def _context(root: Path, patterns: list[str]) -> set[str]:
    """Files Docker sends for these .dockerignore patterns (last matching pattern wins)."""
    sent = set()
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            parts = rel.split("/")
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            matches = any(fnmatch.fnmatchcase(p, pat) for p in prefixes)
            if pat.startswith("**/"):
                matches = matches or any(fnmatch.fnmatchcase(part, pat[3:]) for part in parts)
            if matches:
                included = negate
        if included:
            sent.add(rel)
    return sent


def test_build_context_is_the_package_only() -> None:
    patterns = [ln.strip() for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert patterns[0] == "*", "the .dockerignore is an allow-list"
    sent = _context(REPO_ROOT, patterns)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "pyproject.toml" in sent and project["readme"] in sent
    sources = {p.relative_to(REPO_ROOT).as_posix() for pkg in ("extproc", "prefix_epp_sim")
               for p in (REPO_ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    assert sources and sources <= sent
    for excluded in (".venv/", ".cache/", ".git/", "tests/", "testkit/", "charts/", "bench/"):
        assert not any(s.startswith(excluded) for s in sent), excluded
    assert not any("__pycache__" in s for s in sent)


def test_kind_up_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT_PATH)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert SCRIPT.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in SCRIPT
    assert SCRIPT_PATH.stat().st_mode & 0o111, "not executable"


def test_kind_up_passes_shellcheck(shellcheck: Path) -> None:
    proc = subprocess.run([str(shellcheck), "--shell=bash", "--severity=style", "-x", str(SCRIPT_PATH)],
                          capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_catches_problems(shellcheck: Path, tmp_path: Path) -> None:
    """The shellcheck binary really checks (an unquoted expansion is reported)."""
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/tmp\n")
    proc = subprocess.run([str(shellcheck), str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "SC2086" in proc.stdout


def test_kind_up_installs_the_pinned_pieces() -> None:
    # The versions themselves come from versions.env (tests/deploy/test_versions.py).
    assert ("https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
            "${GIE_VERSION}/manifests.yaml") in SCRIPT
    assert "helm upgrade --install eg oci://docker.io/envoyproxy/gateway-helm" in SCRIPT
    # Envoy Gateway's Backend API: the chart's unverified-TLS fallback (pickerTLS.insecureSkipVerify) uses it.
    assert "config.envoyGateway.extensionApis.enableBackend=true" in SCRIPT
    for path in ("kind-config.yaml", "manifests/values-kind.yaml", "charts/prefix-epp",
                 "manifests/base/simulator.yaml", "manifests/base/gatewayclass.yaml"):
        assert f"$ROOT/{path}" in SCRIPT, path
        assert (REPO_ROOT / path).exists(), path
    assert "docker build" in SCRIPT
    # An image archive works with Docker's containerd image store; `kind load docker-image` does not.
    assert 'docker save --output "$archive" "$IMAGE"' in SCRIPT
    assert 'kind load image-archive "$archive" --name "$CLUSTER_NAME"' in SCRIPT
    assert not re.search(r"^\s*kind load docker-image", SCRIPT, re.M)
    assert "Docker engine" in SCRIPT.split("set -euo pipefail")[0], "the header says a Docker engine is needed"


def test_docs_name_existing_files_and_the_pinned_versions() -> None:
    for doc in (REPO_ROOT / "docs" / "kubernetes.md", REPO_ROOT / "manifests" / "README.md"):
        text = doc.read_text()
        paths = set(re.findall(r"`((?:charts|manifests|scripts|extproc|tests|docs)/[\w./-]+|kind-config\.yaml)", text))
        assert paths, doc
        missing = sorted(p for p in paths if not (REPO_ROOT / p.rstrip("/")).exists())
        assert not missing, f"{doc.name} names files that do not exist: {missing}"
        # The versions they install: tests/deploy/test_versions.py.


BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-image.sh"


def test_build_image_script_passes_shellcheck(shellcheck: Path) -> None:
    proc = subprocess.run([str(shellcheck), "--shell=bash", "--severity=style", "-x", str(BUILD_SCRIPT)],
                          capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "\nimage:\n\tbash scripts/build-image.sh\n" in makefile
    assert re.search(r"^test: .*\bimage\b", makefile, re.M), "make test builds the image first"
    text = BUILD_SCRIPT.read_text()
    assert "podman build --isolation chroot" in text and "-v /etc/ssl/certs:/etc/ssl/certs:ro" in text
    assert "debootstrap --variant=minbase" in text and '"$ROOT/.cache/image"' in text


def test_build_image_fails_loudly_without_tools_or_apt(tmp_path: Path) -> None:
    """Without podman, debootstrap and apt-get the build stops with an error; it never passes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "sha256sum", "cut", "dirname", "printf", "mktemp"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False,
                          env={"PATH": str(bin_dir)}, timeout=60)
    assert proc.returncode != 0
    assert "podman debootstrap missing and no apt-get" in proc.stderr, proc.stderr
