"""Fixtures for end-to-end tests (the pieces they are built from: testkit.stack, testkit.picker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.stack import Stack, stack


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three echo backends, a plaintext picker with decision explanations, Envoy in full-duplex mode."""
    with stack(tmp_path_factory.mktemp("stack"), 3, "--explain-decisions", "--seed", "7") as s:
        yield s
