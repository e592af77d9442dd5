"""Fixtures of the deployment tests: the helm/kubectl/shellcheck binaries and rendered objects.

A binary that cannot be downloaded makes the tests that need it fail (pytest.fail), never skip.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from testkit import helm as tools
from testkit.k8s_objects import CHART, NAMESPACE, RELEASE, VALUE_SETS, Obj


@pytest.fixture(scope="session")
def layer_tools() -> tuple[Path, Path]:
    try:
        return tools.ensure_layer_tools()
    except tools.ToolUnavailable as exc:
        pytest.fail(f"helm/kubectl unavailable: {exc}")


@pytest.fixture(scope="session")
def helm(layer_tools: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tools.Helm:
    return tools.Helm(binary=layer_tools[0], home=tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def kubectl(layer_tools: tuple[Path, Path]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the pinned kubectl offline (no kubeconfig)."""
    binary = layer_tools[1]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120, check=False,
                              env={"PATH": "/usr/bin:/bin", "KUBECONFIG": "/nonexistent", "HOME": "/nonexistent"})

    return run


@pytest.fixture(scope="session")
def shellcheck() -> Path:
    try:
        return tools.ensure_shellcheck()
    except tools.ToolUnavailable as exc:
        pytest.fail(f"shellcheck unavailable: {exc}")


@pytest.fixture(scope="session")
def render(helm: tools.Helm) -> Callable[[str], list[Obj]]:
    """Objects of the chart for a value set of VALUE_SETS, rendered once per session."""
    rendered: dict[str, list[Obj]] = {}

    def get(name: str) -> list[Obj]:
        if name not in rendered:
            rendered[name] = helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=VALUE_SETS[name])
        return rendered[name]

    return get
