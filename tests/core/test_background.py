"""Supervised background tasks come back after a crash (extproc/core/background.py), and /metrics is
collected on the event loop."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config.settings import EppConfig
from extproc.core.background import supervise
from extproc.runtime.app import App
from testkit.procs import free_ports


async def _until(predicate: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (callable(predicate) and predicate()):
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_crashed_task_is_logged_with_traceback_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    running = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        running.set()
        await asyncio.Event().wait()

    with caplog.at_level("ERROR", logger="prefix_epp.supervise"):
        sup = supervise("flaky", flaky, initial_s=0.01, max_s=0.05)
        await asyncio.wait_for(running.wait(), 10)
    assert sup.restarts == 2 and len(runs) == 3
    crashes = [r for r in caplog.records if r.getMessage().startswith("background task crashed")]
    assert len(crashes) == 2 and crashes[0].exc_info is not None and "boom" in str(crashes[0].exc_info[1])
    sup.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sup.task


async def test_the_picker_restarts_its_killed_scraper(caplog: pytest.LogCaptureFixture) -> None:
    dead = free_ports(1)[0]  # nothing listens: scrapes fail, but they are attempted (and counted)
    grpc_port, health_port = free_ports(2)
    app = App(EppConfig(endpoints=(f"127.0.0.1:{dead}",), grpc_port=grpc_port, grpc_health_port=health_port,
                        metrics_port=0, secure_serving=False, bind_address="127.0.0.1",
                        refresh_metrics_interval_s=0.01))
    scraper = app.scraper
    assert scraper is not None
    original_run = scraper.run
    runs: list[int] = []

    async def killed_on_first_run() -> None:
        runs.append(1)
        if len(runs) == 1:
            await asyncio.sleep(0)
            raise RuntimeError("scraper killed")
        await original_run()

    scraper.run = killed_on_first_run  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="prefix_epp"):
        await app.start()
    try:
        sup = next(s for s in app.supervised if s.name == "metrics-scraper")
        await _until(lambda: scraper.scrapes > 3)  # it came back and scrapes
        assert sup.restarts == 1 and len(runs) == 2
        assert any("scraper killed" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
        # A fault inside one endpoint's poll loop is logged and the loop keeps polling.
        original = scraper.scrape_once
        state = {"faults": 0}

        async def poisoned(*args: object, **kw: object) -> object:
            if not state["faults"]:
                state["faults"] += 1
                raise ZeroDivisionError("simulated fault while handling a scrape")
            return await original(*args, **kw)  # type: ignore[arg-type]

        scraper.scrape_once = poisoned  # type: ignore[method-assign,assignment]
        await _until(lambda: state["faults"] == 1)
        before = scraper.scrapes
        await _until(lambda: scraper.scrapes > before + 3)
        assert sup.restarts == 1
    finally:
        await app.stop()


class _ThreadProbe(Collector):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.threads.append(threading.get_ident())
        yield GaugeMetricFamily("probe", "which thread collects", value=1)


async def test_metrics_are_collected_on_the_event_loop_thread() -> None:
    grpc_port, health_port, metrics_port = free_ports(3)
    app = App(EppConfig(endpoints=("127.0.0.1:1",), grpc_port=grpc_port, grpc_health_port=health_port,
                        metrics_port=metrics_port, secure_serving=False, bind_address="127.0.0.1",
                        refresh_metrics_interval_s=0))
    probe = _ThreadProbe()
    app.metrics.registry.register(probe)
    await app.start()
    try:
        def fetch() -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                return bytes(r.read())

        text = await asyncio.get_running_loop().run_in_executor(None, fetch)
        assert b"probe 1.0" in text and b"prefix_epp_inflight_requests" in text
        assert probe.threads and set(probe.threads) == {threading.get_ident()}
    finally:
        await app.stop()
