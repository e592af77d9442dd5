"""Worker roles from the supervisor's environment (extproc/runtime/workers.py) and the HA flags of serve."""

from __future__ import annotations

import argparse

import pytest

from extproc.commands.serve import add_arguments, config_from_args, validate
from extproc.runtime.workers import WORKER_ENV, WorkerRole, worker_role


def test_worker_role_parsing() -> None:
    assert worker_role({}) is None
    role = worker_role({WORKER_ENV: "1/3/7001,7002,7003/8001,8002,8003"})
    assert role == WorkerRole(1, 3, 7002, ("127.0.0.1:7001", "127.0.0.1:7003"), 8002, ())
    first = worker_role({WORKER_ENV: "0/2/7001,7002/8001,8002"})
    assert first is not None and first.metrics_port == 0
    assert first.sibling_metrics == ((1, "http://127.0.0.1:8002/metrics"),)
    for bad in ("3/3/7001,7002,7003/8001,8002,8003", "0/2/7001,7002/8001", "0/2/x"):
        with pytest.raises(ValueError):
            worker_role({WORKER_ENV: bad})


def parse(*args: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--endpoints", "127.0.0.1:8000", *args])


def test_ha_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_EPP_SYNC_SECRET", "s" * 32)
    config = config_from_args(parse("--sync-port", "9005", "--peers", "10.0.0.1:9005, 10.0.0.2:9005",
                                    "--sync-warm-timeout", "2s", "--drain-timeout", "45s", "--workers", "2"))
    assert config.sync.port == 9005 and config.sync.peers == ("10.0.0.1:9005", "10.0.0.2:9005")
    assert config.sync.warm_timeout_s == 2.0 and config.drain.timeout_s == 45.0 and config.workers == 2
    validate(config)


@pytest.mark.parametrize(("args", "message"), [
    (("--workers", "0"), "--workers"),
    (("--peers", "10.0.0.1:9005"), "need --sync-port"),
    (("--sync-port", "9005", "--peers", "nonsense"), "--peers"),
    (("--sync-port", "9005"), "shared secret"),
    (("--sync-port", "9005", "--peer-selector", "app=x"), "--pool-name"),
    (("--drain-timeout", "-1"), "--drain-timeout"),
])
def test_bad_ha_flags_are_refused(args: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIX_EPP_SYNC_SECRET", raising=False)
    if "--peer-selector" in args or "nonsense" in args:
        monkeypatch.setenv("PREFIX_EPP_SYNC_SECRET", "s" * 32)
    with pytest.raises(SystemExit, match=message):
        validate(config_from_args(parse(*args)))
