"""What the README says about the benchmark's prefix-epp setup is what bench/routers.py runs."""

from __future__ import annotations

import re

from bench.routers import picker_flags
from tests.support.procs import REPO_ROOT


def _setup_paragraph() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("**Setup.**")
    return text[start:text.index("\n\n", start)]


def test_readme_names_every_flag_the_benchmark_adds_to_the_picker() -> None:
    setup = " ".join(_setup_paragraph().split())
    # The benchmark's replicas publish KV events for the prefix-epp setups (bench/run.py).
    for flag in picker_flags("prefix-epp", replicas_publish_events=True):
        assert f"`{flag}`" in setup, flag
    assert "default configuration)" not in setup  # it is not the default configuration
    assert re.search(r"`prefix-epp` \(Envoy \+ `python -m extproc serve`, default scheduling plus `--kv-events`",
                     setup)
    assert picker_flags("prefix-epp", replicas_publish_events=False) == ()
