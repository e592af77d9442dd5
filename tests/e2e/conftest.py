"""Fixtures for end-to-end tests (the pieces they are built from: testkit.stack, testkit.picker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.stack import Stack, stack


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three echo backends, a plaintext picker with decision explanations (and the conformance
    tests' test-epp-endpoint-selection header honoured), Envoy in front of it."""
    with stack(tmp_path_factory.mktemp("stack"), 3, "--explain-decisions", "--seed", "7",
               "--enable-test-endpoint-selection") as s:
        yield s
