"""Attacks on the sync port from inside the cluster, over real gRPC against the real sync service.

Each test plays one attacker: a process without the secret (forger), one that captured frames off
the wire (replayer), one that sits at a peer's address (reflector), or a peer that holds the
secret but sends records for endpoints that do not exist.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from extproc.pb import health_pb2, health_pb2_grpc
from extproc.prefix.index import PrefixIndex
from extproc.sync.link import HELLO_METHOD, PUSH_METHOD, SERVICE, PeerCredentials
from extproc.sync.manager import PeerSync
from extproc.sync.wire import RECORD, REMOVE, UPDATES, Codec, Frame
from extproc.transport.health import HealthServicer
from extproc.transport.tls import peer_tls, self_signed
from testkit.procs import free_ports
from testkit.sync import FAST, POOL, SECRET, pool, replica, until

FORGED = b"m" * 32


def raw(address: str) -> grpc.aio.Channel:
    """A client that sends whatever bytes it is given (no size limit of its own)."""
    return grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                       ("grpc.max_receive_message_length", 64 << 20)])


async def push(channel: grpc.aio.Channel, *frames: bytes) -> grpc.StatusCode:
    async def gen() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame
    try:
        await channel.stream_unary(PUSH_METHOD)(gen(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def forged(records: list[Any]) -> bytes:
    return Codec(FORGED, max_frame_bytes=FAST.max_frame_bytes, max_clock_skew_s=60).encode(UPDATES, 7, records)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_oversized_frame_is_refused_before_any_work() -> None:
    (pa,) = free_ports(1)
    a = replica(pa, [])
    await a.start()
    try:
        async with raw(f"127.0.0.1:{pa}") as ch:
            code = await push(ch, os.urandom(a.cfg.max_frame_bytes + 1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's receive limit, before the handler
        assert a.admission.checked == 0 and a.index.entries == 0
        with pytest.raises(Exception, match="more than"):  # the explicit check, for every path
            await a.admission.open(b"x" * (a.cfg.max_frame_bytes + 1), "ipv4:10.9.9.9")
        assert a.admission.checked == 0 and a.stats.rejected["too_large"] == 1
    finally:
        await a.stop()


async def test_forged_frame_is_checked_off_the_event_loop() -> None:
    """While a forged frame is being checked, calls served by the same loop still complete."""
    pa, ph = free_ports(2)
    a = replica(pa, [])
    entered, release, checked = threading.Event(), threading.Event(), threading.Event()
    decode = a.codec.decode

    def slow_decode(data: bytes, now: float | None = None) -> Frame:
        entered.set()
        release.wait(5)  # where the check runs on the loop, the loop stops here
        try:
            return decode(data, now)
        finally:
            checked.set()

    a.codec.decode = slow_decode  # type: ignore[method-assign,assignment]
    health = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(lambda: True, max_watches=4), health)
    health.add_insecure_port(f"127.0.0.1:{ph}")
    await health.start()
    await a.start()
    try:
        async with raw(f"127.0.0.1:{pa}") as ch, grpc.aio.insecure_channel(f"127.0.0.1:{ph}") as hc:
            attack = asyncio.create_task(push(ch, forged([(RECORD, POOL[0], [1, 2, 3])])))
            await asyncio.to_thread(entered.wait, 5)
            reply = await health_pb2_grpc.HealthStub(hc).Check(health_pb2.HealthCheckRequest(service="readiness"))
            a.index.match([1, 2, 3], POOL)  # and the index reads the request path does
            served_during_check = not checked.is_set()
            release.set()
            assert await attack == grpc.StatusCode.UNAUTHENTICATED
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert served_during_check, "the loop waited for the forged frame's check"
        assert a.index.entries == 0 and a.stats.rejected["unauthenticated"] == 1
    finally:
        release.set()
        await a.stop()
        await health.stop(None)


@pytest.mark.skipif(not ipv6_loopback(), reason="needs ::1 beside 127.0.0.1: two sending addresses")
async def test_a_forger_gets_a_bounded_share_and_peers_keep_syncing() -> None:
    pa, pb = free_ports(2)
    # No refill during the test: the forger's checks are exactly the burst, however fast it sends.
    a = replica(pa, [], bind="::", failure_burst=3, failure_rate_per_s=1e-9)
    b = replica(pb, [pa])
    await a.start()
    try:
        frame = forged([(RECORD, POOL[0], list(range(1000)))])
        async with raw(f"[::1]:{pa}") as ch:  # the forger speaks from ::1, the peer from 127.0.0.1
            codes = await asyncio.gather(*(push(ch, frame, frame) for _ in range(40)))
            codes += [await push(ch, frame) for _ in range(20)]
        assert a.admission.checked == 3, "every forged frame past the burst was checked"
        assert a.stats.rejected["unauthenticated"] == 3 and a.stats.rejected["throttled"] >= 57
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 57
        await b.start()  # a real peer, while the forger is throttled
        await until(lambda: b.connected_peers() == 1)
        b.index.record(POOL[1], [5, 6])
        await until(lambda: a.index.held_by(POOL[1]) == 2)
        assert a.index.held_by(POOL[0]) == 0
    finally:
        await b.stop()
        await a.stop()


async def test_a_captured_frame_replayed_is_refused() -> None:
    pa, pb, dead = free_ports(3)
    a = replica(pa, [dead])  # its frames wait in the queue of a link that never connects
    b = replica(pb, [])
    await a.start()
    await b.start()
    try:
        a.index.record(POOL[2], [7, 8, 9])
        a.outbox.removed(POOL[3])
        a.flush()
        link = next(iter(a.links.values()))
        captured, _ = link._queue.get_nowait()  # the bytes a peer would see on the wire
        async with raw(f"127.0.0.1:{pb}") as ch:
            assert await push(ch, captured) == grpc.StatusCode.OK
            assert b.index.held_by(POOL[2]) == 3 and b.stats.records_applied == 2
            b.index.remove_endpoint(POOL[2])
            b.index.record(POOL[3], [1])
            assert await push(ch, captured) == grpc.StatusCode.UNAUTHENTICATED  # later, same bytes
        assert b.index.held_by(POOL[2]) == 0 and b.index.held_by(POOL[3]) == 1  # nothing re-applied
        assert b.stats.records_applied == 2 and b.stats.rejected["replayed"] == 1
    finally:
        await b.stop()
        await a.stop()


async def test_a_reflected_hello_does_not_close_the_link() -> None:
    """A process at the peer's address sends our own Hello back, then relays to the real peer."""
    pa, pb, pm = free_ports(3)
    b = replica(pb, [])
    await b.start()
    reflected = 0
    upstream = raw(f"127.0.0.1:{pb}")

    async def hello(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal reflected
        if reflected < 2:
            reflected += 1
            return request  # our own Hello: our origin, a valid MAC
        return bytes(await upstream.unary_unary(HELLO_METHOD)(request))

    async def relay(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        return bytes(await upstream.stream_unary(PUSH_METHOD)(requests))

    mitm = grpc.aio.server()
    mitm.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Hello": grpc.unary_unary_rpc_method_handler(hello),
        "Push": grpc.stream_unary_rpc_method_handler(relay)}),))
    mitm.add_insecure_port(f"127.0.0.1:{pm}")
    await mitm.start()
    a = replica(pa, [pm])
    await a.start()
    try:
        await until(lambda: a.connected_peers() == 1)
        a.index.record(POOL[4], [3, 4])
        await until(lambda: b.index.held_by(POOL[4]) == 2)
        assert reflected == 2 and a.stats.rejected["bad_reply"] == 2
        assert not next(iter(a.links.values())).is_self
    finally:
        await a.stop()
        await mitm.stop(None)
        await upstream.close()
        await b.stop()


async def test_records_for_invented_endpoints_make_no_index_slots() -> None:
    """Even a peer holding the secret cannot grow our index past the pool discovery knows."""
    pa, pb = free_ports(2)
    a = replica(pa, [])
    insider = replica(pb, [pa])
    await a.start()
    await insider.start()
    try:
        await until(lambda: insider.connected_peers() == 1)
        for i in range(500):
            insider.outbox.record(f"10.66.{i // 250}.{i % 250}:8000", list(range(i * 100, i * 100 + 100)))
        insider.outbox.record(POOL[5], [1, 2])
        await until(lambda: a.index.held_by(POOL[5]) == 2)
        assert a.index.endpoints() == [POOL[5]] and a.index.entries == 2
        assert a.stats.dropped["unknown_endpoint"] == 500
    finally:
        await insider.stop()
        await a.stop()


async def test_forged_removals_and_records_change_nothing() -> None:
    (pa,) = free_ports(1)
    a = replica(pa, [])
    a.index.record(POOL[6], [1, 2, 3])
    await a.start()
    try:
        async with raw(f"127.0.0.1:{pa}") as ch:
            assert await push(ch, forged([(REMOVE, POOL[6], ())])) == grpc.StatusCode.UNAUTHENTICATED
            assert await push(ch, forged([(RECORD, POOL[7], [1, 2, 3])])) == grpc.StatusCode.UNAUTHENTICATED
        assert a.index.held_by(POOL[6]) == 3 and a.index.held_by(POOL[7]) == 0
        assert a.stats.records_applied == 0 and a.stats.rejected["unauthenticated"] == 2
    finally:
        await a.stop()


def tls_dir(tmp: Path, name: str) -> str:
    key, cert = self_signed("prefix-epp")
    d = tmp / name
    d.mkdir()
    (d / "tls.key").write_bytes(key)
    (d / "tls.crt").write_bytes(cert)
    return str(d)


def tls_replica(port: int, peers: list[int], cert_path: str) -> PeerSync:
    server, channel, name = peer_tls(cert_path)
    cfg = replace(FAST, port=port, peers=tuple(f"127.0.0.1:{p}" for p in peers), tls=True)
    index = PrefixIndex(1000)
    sync = PeerSync(cfg, SECRET, index, None, datastore=pool(), bind="127.0.0.1", server_credentials=server,
                    peer_credentials=PeerCredentials(channel, name))
    index.on_record(sync.outbox.record)
    return sync


async def test_tls_sync_between_replicas_sharing_a_certificate(tmp_path: Path) -> None:
    pa, pb, pc = free_ports(3)
    shared = tls_dir(tmp_path, "shared")
    a, b = tls_replica(pa, [pb], shared), tls_replica(pb, [pa], shared)
    stranger = tls_replica(pc, [pa], tls_dir(tmp_path, "other"))  # the secret, not the certificate
    for s in (a, b, stranger):
        await s.start()
    try:
        await until(lambda: a.connected_peers() == 1 and b.connected_peers() == 1)
        a.index.record(POOL[8], [1, 2])
        await until(lambda: b.index.held_by(POOL[8]) == 2)
        async with raw(f"127.0.0.1:{pa}") as ch:  # plaintext to the TLS port
            assert await push(ch, forged([])) == grpc.StatusCode.UNAVAILABLE
        await until(lambda: stranger.stats.connect_failures >= 2)
        assert stranger.connected_peers() == 0
    finally:
        for s in (stranger, b, a):
            await s.stop()


async def test_a_record_too_large_for_a_frame_is_dropped_by_the_sender() -> None:
    pa, pb = free_ports(2)
    a = replica(pa, [pb], max_frame_bytes=64 * 1024)
    b = replica(pb, [], max_frame_bytes=64 * 1024)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.connected_peers() == 1)
        a.index.record(POOL[0], [int.from_bytes(os.urandom(8), "little") for _ in range(10_000)])  # 80 KB
        a.flush()
        a.index.record(POOL[1], [1])
        await until(lambda: b.index.held_by(POOL[1]) == 1)
        assert a.stats.dropped["frame_too_large"] == 1 and b.index.held_by(POOL[0]) == 0
        assert sum(b.stats.rejected.values()) == 0
    finally:
        await b.stop()
        await a.stop()
