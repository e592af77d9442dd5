"""Each listener binds the address it is given: /metrics, health and sync apart from ext_proc, and
--bind-address for those without their own. A listener on 127.0.0.1 is not reachable on 127.0.0.2
(both are this machine's loopback addresses, so only the bind tells them apart)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from extproc.config.settings import EppConfig, SyncConfig
from extproc.config.validate import check
from extproc.runtime.app import App
from testkit.procs import free_ports


async def reachable(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


@contextlib.asynccontextmanager
async def started(tmp: Path, **fields: object) -> AsyncIterator[dict[str, int]]:
    grpc, health, metrics, sync = free_ports(4)
    secret = tmp / "secret"
    secret.write_text("s" * 32)
    cfg = replace(EppConfig(), grpc_port=grpc, grpc_health_port=health, metrics_port=metrics, secure_serving=False,
                  refresh_metrics_interval_s=0, endpoints=("127.0.0.1:9",),
                  sync=replace(SyncConfig(), port=sync, secret_file=str(secret), warm_timeout_s=0.0),
                  **fields)  # type: ignore[arg-type]
    assert check(cfg) == []
    app = App(cfg)
    await app.start()
    try:
        yield {"ext_proc": grpc, "health": health, "metrics": metrics, "sync": sync}
    finally:
        await app.stop(grace=0)


async def test_each_listener_binds_its_own_address(tmp_path: Path) -> None:
    async with started(tmp_path, bind_address="127.0.0.2", metrics_bind_address="127.0.0.1",
                       health_bind_address="127.0.0.1", sync_bind_address="127.0.0.1") as ports:
        for name in ("metrics", "health", "sync"):
            assert await reachable("127.0.0.1", ports[name]), name
            assert not await reachable("127.0.0.2", ports[name]), name
        assert await reachable("127.0.0.2", ports["ext_proc"])
        assert not await reachable("127.0.0.1", ports["ext_proc"])


async def test_listeners_without_an_address_of_their_own_bind_the_bind_address(tmp_path: Path) -> None:
    async with started(tmp_path, bind_address="127.0.0.1") as ports:
        for name, port in ports.items():
            assert await reachable("127.0.0.1", port), name
            assert not await reachable("127.0.0.2", port), name


def test_a_listen_address_must_be_an_ip_address() -> None:
    problems = check(replace(EppConfig(), bind_address="localhost", metrics_bind_address="0.0.0.0 ",
                             sync_bind_address="::"))
    assert problems == [
        "--bind-address must be an IP address such as 0.0.0.0, :: or 127.0.0.1, got 'localhost'",
        "--metrics-bind-address must be an IP address such as 0.0.0.0, :: or 127.0.0.1 (or empty), got '0.0.0.0 '",
    ]
    assert EppConfig().listen_address("metrics") == EppConfig().bind_address == "0.0.0.0"
