"""A short soak through real Envoy (bench/soak.py; `make soak` runs the 30-minute one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import soak

pytestmark = pytest.mark.e2e


async def test_short_soak_stays_flat(tmp_path: Path) -> None:
    report = await soak(seconds=15, concurrency=4, interval=1.5, out=tmp_path / "soak")
    assert report.flat, (report.checks, report.picker_errors)
    assert {"valid", "stream", "invalid", "random_model", "cancelled"} <= set(report.by_kind)
    assert report.statuses.get("400", 0) > 0 and report.statuses.get("413", 0) > 0
    assert len(report.samples) >= 5
    assert (tmp_path / "soak.md").read_text().count("\n| ") > 5
