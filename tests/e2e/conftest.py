"""Fixtures for end-to-end tests (the pieces they are built from: testkit.stack, testkit.picker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.stack import Stack, stack


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three echo backends, a plaintext picker with decision explanations (and the conformance
    tests' test-epp-endpoint-selection header honoured), Envoy in front of it. Slowdown calibration
    is off: echo backends answer in well under a millisecond, so response-end timings measure the
    host's scheduling noise, and a backend read 30% slower by it takes a sixth of the traffic instead
    of a third (the spread test's counts would then depend on the noise)."""
    with stack(tmp_path_factory.mktemp("stack"), 3, "--explain-decisions", "--seed", "7",
               "--enable-test-endpoint-selection", "--ttft-calibration", "false") as s:
        yield s
