"""What docs/benchmarks.md says about the benchmark's prefix-epp setup is what bench/lib/routers.py runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.lib.routers import KV_EVENT_ROUTERS, ROUTERS, picker_flags, picker_setup, start
from bench.lib.runner import RouterSpec
from testkit.procs import REPO_ROOT


def _setup_paragraph() -> str:
    text = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index("**Setup.**")
    return text[start:text.index("\n\n", start)]


def test_docs_name_every_flag_the_benchmark_adds_to_the_picker() -> None:
    setup = " ".join(_setup_paragraph().split())
    # The benchmark's replicas publish KV events for the prefix-epp setups (bench/run.py).
    for flag in picker_flags("prefix-epp", replicas_publish_events=True):
        assert f"`{flag}`" in setup, flag
    assert "default configuration)" not in setup  # it is not the default configuration
    assert re.search(r"`prefix-epp` \(Envoy \+ `python -m extproc serve`, default scheduling plus `--kv-events`",
                     setup)
    assert picker_flags("prefix-epp", replicas_publish_events=False) == ()


def test_weighted_setup_passes_the_scheduler_flag_to_the_picker() -> None:
    backends = ["127.0.0.1:1", "127.0.0.1:2"]
    events = ["tcp://127.0.0.1:3@tcp://127.0.0.1:5", "tcp://127.0.0.1:4@tcp://127.0.0.1:6"]
    endpoints, flags = picker_setup("prefix-epp-weighted", backends, ("--spill-absolute", "2"), events)
    assert flags == ("--scheduler", "weighted", "--kv-events", "--spill-absolute", "2")
    assert endpoints == [f"{b}@{e}" for b, e in zip(backends, events, strict=True)]
    _, default = picker_setup("prefix-epp", backends, (), events)
    assert default == ("--kv-events",)  # the default scheduler: no --scheduler flag
    assert picker_setup("prefix-epp-weighted", backends)[1] == ("--scheduler", "weighted")
    assert {"prefix-epp-weighted", "clairvoyant"} <= set(ROUTERS)
    assert "prefix-epp-weighted" in KV_EVENT_ROUTERS  # the same KV events as prefix-epp, for comparability


def test_clairvoyant_setup_is_the_simulators_front() -> None:
    with start("clairvoyant", Path("/nonexistent"), ["127.0.0.1:1"], front="127.0.0.1:7") as router:
        assert router.url == "http://127.0.0.1:7" and router.procs == ()
    with pytest.raises(ValueError, match="front"):
        start("clairvoyant", Path("/nonexistent"), ["127.0.0.1:1"])


def test_closed_loop_samples_every_response_without_renaming_the_router() -> None:
    closed = RouterSpec("prefix-epp-precise", ("--spill-absolute", "2"), closed_loop=True)
    assert closed.all_picker_args == ("--usage-sample-rate", "1", "--spill-absolute", "2")
    assert closed.label == "prefix-epp-precise --spill-absolute 2"  # rows and targets keep their names
    assert RouterSpec("prefix-epp").all_picker_args == ()
    _, flags = picker_setup("prefix-epp", ["127.0.0.1:1"], closed.all_picker_args)
    assert flags[:2] == ("--usage-sample-rate", "1")
