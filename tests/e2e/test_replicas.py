"""Several pickers behind one real Envoy, against simulated engines: peer sync, warm start, drain.

Envoy's ext_proc cluster lists every picker (LEAST_REQUEST, gRPC health checks on the ext_proc
service), so it spreads streams over them as a Gateway would over the picker's Service. The hit
rate is what the engines report: `usage.prompt_tokens_details.cached_tokens / prompt_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from extproc.pb import health_pb2, health_pb2_grpc
from extproc.sync.manager import PeerSync
from extproc.sync.wire import RECORD, UPDATES, Codec
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.envoy import epp_hosts_healthy, run_envoy
from testkit.http_client import gather_limited, post
from testkit.picker import Picker, picker_for, scrape, value
from testkit.procs import free_ports

pytestmark = pytest.mark.e2e

SIM = SimConfig(time_scale=50.0, kv_events=False, max_model_len=4096)
SECRET = "peer-sync-secret-for-tests-0123456789"
GROUPS = 24


def prompt(group: int, turn: int) -> str:
    return f"Group {group} system prompt. " + f"Rules of desk {group}: be precise and kind. " * 30 + \
        f"Question {turn} of group {group}?"


def sync_pickers(tmp: Path, endpoints: list[str], n: int, *extra: str, sync: bool = True,
                 prefix: str = "picker") -> list[Picker]:
    secret = tmp / "sync-secret"
    secret.write_text(SECRET + "\n")
    ports = free_ports(n)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    out = []
    for i, port in enumerate(ports):
        args = ["--sync-port", str(port), "--peers", peers, "--sync-secret-file", str(secret)] if sync else []
        out.append(picker_for(tmp, endpoints, "--seed", str(i + 1), "--sync-warm-timeout", "1s", *args, *extra,
                              name=f"{prefix}-{i}"))
    return out


@contextlib.contextmanager
def envoy_for(tmp: Path, pickers: list[Picker], name: str) -> Iterator[tuple[str, int]]:
    with run_envoy(tmp, pickers[0].grpc_port, epp_ports=tuple(p.grpc_port for p in pickers[1:]),
                   health_interval="0.5s", name=name) as (_, listen, admin):
        yield f"http://127.0.0.1:{listen}/v1/completions", admin


async def wait_healthy(admin: int, wanted: dict[int, bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        seen = await asyncio.to_thread(epp_hosts_healthy, admin)
        if all(seen.get(port) == ok for port, ok in wanted.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy health {seen}, wanted {wanted}")
        await asyncio.sleep(0.1)


async def peers_connected(pickers: list[Picker], n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for p in pickers:
        while value(await asyncio.to_thread(scrape, p), "prefix_epp_sync_peers_connected") < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.log} has not connected its {n} peers")
            await asyncio.sleep(0.1)


async def ask(s: aiohttp.ClientSession, url: str, group: int, turn: int) -> tuple[int, int, int]:
    r = await post(s, url, {"model": "sim-model", "prompt": prompt(group, turn), "max_tokens": 2})
    if r.status != 200:
        return r.status, 0, 0
    usage = r.json()["usage"]
    return 200, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


async def rounds(url: str, first: int, last: int) -> list[tuple[int, int, int]]:
    """Every group asks once per round (groups interleaved, 4 at a time)."""
    out: list[tuple[int, int, int]] = []
    async with aiohttp.ClientSession() as s:
        for turn in range(first, last):
            out += await gather_limited([ask(s, url, g, turn) for g in range(GROUPS)], 4)
    return out


def hit_rate(replies: list[tuple[int, int, int]]) -> float:
    return sum(c for _, c, _ in replies) / max(1, sum(t for _, _, t in replies))


@contextlib.asynccontextmanager
async def started(pickers: list[Picker]) -> AsyncIterator[None]:
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in pickers))
        yield
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in pickers))


async def measure(tmp: Path, n: int, sync: bool) -> tuple[float, list[float], float]:
    """(hit rate, share of requests per picker, records applied from peers) on fresh engines."""
    async with run_replicas(SIM, 4, base_port=0) as reps:
        pickers = sync_pickers(tmp, [f"127.0.0.1:{r.port}" for r in reps], n, sync=sync, prefix=f"p{n}{sync}")
        async with started(pickers):
            with envoy_for(tmp, pickers, f"envoy-{n}-{sync}") as (url, admin):
                await wait_healthy(admin, {p.grpc_port: True for p in pickers})
                if sync:
                    await peers_connected(pickers, n - 1)
                replies = await rounds(url, 0, 4)
                assert all(status == 200 for status, _, _ in replies)
                deadline = time.monotonic() + 10
                while True:  # each response's end reaches its picker after the client has the reply
                    samples = [await asyncio.to_thread(scrape, p) for p in pickers]
                    if sum(value(x, "prefix_epp_requests_total", outcome="routed", status="200")
                           for x in samples) >= len(replies) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
    routed = [value(x, "prefix_epp_requests_total", outcome="routed", status="200") for x in samples]
    applied = sum(value(x, "prefix_epp_sync_records_applied_total") for x in samples)
    return hit_rate(replies), [r / sum(routed) for r in routed], applied


async def test_sync_makes_two_pickers_route_like_one(tmp_path: Path) -> None:
    one, _, _ = await measure(tmp_path, 1, sync=False)
    synced, shares_s, applied = await measure(tmp_path, 2, sync=True)
    unsynced, shares_u, applied_u = await measure(tmp_path, 2, sync=False)
    assert min(shares_s) > 0.2 and min(shares_u) > 0.2, (shares_s, shares_u)  # Envoy spread the streams
    assert applied > 0 and applied_u == 0
    assert synced >= one - 0.04, (one, synced, unsynced)
    assert unsynced <= synced - 0.08, (one, synced, unsynced)


async def test_fresh_picker_replaces_one_during_traffic_warm_and_without_failures(tmp_path: Path) -> None:
    async with run_replicas(SIM, 4, base_port=0) as reps:
        a, b, c = sync_pickers(tmp_path, [f"127.0.0.1:{r.port}" for r in reps], 3, "--sync-warm-timeout", "10s")
        async with started([a, b]):
            with envoy_for(tmp_path, [a, b, c], "envoy-replace") as (url, admin):
                await wait_healthy(admin, {a.grpc_port: True, b.grpc_port: True, c.grpc_port: False})
                warm = await rounds(url, 0, 1)  # every group once, through a and b
                try:
                    await asyncio.to_thread(c.start)  # ready only once a snapshot is loaded
                    await wait_healthy(admin, {c.grpc_port: True})
                    fresh = await rounds(url, 1, 2)  # each group's first request since c started
                    c_first = await asyncio.to_thread(scrape, c)
                    assert a.proc is not None
                    os.kill(a.proc.pid, signal.SIGTERM)  # a drains while the traffic goes on
                    during = await rounds(url, 2, 4)
                    await asyncio.to_thread(a.proc.popen.wait, 40)
                    assert a.proc.popen.returncode == 0
                finally:
                    await asyncio.to_thread(c.stop)
    assert all(s == 200 for s, _, _ in warm + fresh + during)
    assert value(c_first, "prefix_epp_sync_snapshot_entries_loaded_total") > 0
    seen = value(c_first, "prefix_epp_predicted_prefix_hit_ratio_count")
    cold = value(c_first, "prefix_epp_predicted_prefix_hit_ratio_bucket", le="0.5")
    assert seen >= 2 and cold == 0, (seen, cold)  # its first decisions already matched the warm prefixes
    assert hit_rate(fresh) > 0.8 and hit_rate(during) > 0.8


async def test_sigterm_lets_a_streamed_generation_finish_then_exits(tmp_path: Path) -> None:
    slow = SIM.replace(time_scale=1.0, inter_token_latency=40.0)  # 80 tokens: ~3.2 s
    async with run_replicas(slow, 1, base_port=0) as reps:
        (picker,) = sync_pickers(tmp_path, [f"127.0.0.1:{reps[0].port}"], 1, sync=False, prefix="drain")
        async with started([picker]):
            assert picker.proc is not None
            with envoy_for(tmp_path, [picker], "envoy-drain") as (url, admin):
                await wait_healthy(admin, {picker.grpc_port: True})
                body = {"model": "sim-model", "prompt": "tell a long story", "max_tokens": 80, "stream": True}
                async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
                    assert resp.status == 200
                    data = await resp.content.readuntil(b"\n\n")  # the generation is under way
                    os.kill(picker.proc.pid, signal.SIGTERM)
                    await asyncio.to_thread(wait_not_serving, picker.health_port)
                    during = await ask(s, url, 1, 1)  # a new stream during the drain is still served
                    data += await resp.read()
                    assert picker.proc.alive()  # still there when the generation ended
            await asyncio.to_thread(picker.proc.popen.wait, 20)
            assert picker.proc.popen.returncode == 0
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 80 // SIM.stream_interval
    assert during[0] == 200
    assert '"drained"' in picker.log.read_text()


def wait_not_serving(health_port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            req = health_pb2.HealthCheckRequest(service=service)
            while stub.Check(req, timeout=5).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                if time.monotonic() > deadline:
                    raise TimeoutError("still SERVING after SIGTERM")
                time.sleep(0.02)


async def test_a_non_peer_cannot_inject_entries(tmp_path: Path) -> None:
    (picker,) = sync_pickers(tmp_path, ["127.0.0.1:9"], 1, prefix="victim")
    sync_port = int(picker.args[picker.args.index("--sync-port") + 1])
    async with started([picker]):
        from dataclasses import replace

        from extproc.config.settings import SyncConfig
        from extproc.core.datastore import Datastore
        from extproc.prefix.index import PrefixIndex

        cfg = replace(SyncConfig(), port=free_ports(1)[0], peers=(f"127.0.0.1:{sync_port}",), backoff_max_s=0.2)
        rogue = PeerSync(cfg, b"not-the-secret-of-the-peers", PrefixIndex(100), None, datastore=Datastore(),
                         bind="127.0.0.1")
        await rogue.start()
        try:
            rogue.index.on_record(rogue.outbox.record)
            for i in range(20):
                rogue.index.record("127.0.0.1:9", [i, i + 1, i + 2])
            rogue.flush()
            # A raw Push of a frame signed with the wrong key is refused outright.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sync_port}") as ch:
                push = ch.stream_unary("/prefixepp.sync.v1.IndexSync/Push")
                frame = Codec(b"x" * 32, max_frame_bytes=1 << 20, max_clock_skew_s=60).encode(
                    UPDATES, 7, [(RECORD, "127.0.0.1:9", [1, 2, 3])])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await push(iter([frame]))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            deadline = time.monotonic() + 20
            while True:  # the rogue's own link keeps knocking (Hello), refused every time
                samples = await asyncio.to_thread(scrape, picker)
                if value(samples, "prefix_epp_sync_rejected_frames_total", reason="unauthenticated") >= 2:
                    break
                assert time.monotonic() < deadline, "the rogue's Hello never reached the picker"
                await asyncio.sleep(0.05)
        finally:
            await rogue.stop()
    assert value(samples, "prefix_epp_sync_rejected_frames_total", reason="unauthenticated") >= 2
    assert value(samples, "inference_extension_prefix_indexer_size") == 0
    assert value(samples, "prefix_epp_sync_records_applied_total") == 0
    assert rogue.connected_peers() == 0
