"""The narrow /metrics GET client against real servers: kept-alive connections, chunked and
length-delimited bodies, and what it refuses (other statuses, oversized or compressed bodies,
header floods, truncated bodies)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from extproc.scraping.http import MAX_HEADER_BYTES, MetricsHttp, ScrapeError
from testkit.certs import Authority
from testkit.procs import free_port

PAGE = b"vllm:num_requests_waiting 3.0\n" * 200


@pytest.fixture
async def aiohttp_server() -> AsyncIterator[tuple[int, list[str]]]:
    """A real aiohttp server: /fixed (Content-Length), /chunked (streamed), /close, /gone (302)."""
    peers: list[str] = []

    async def fixed(request: web.Request) -> web.Response:
        peers.append(str(request.transport.get_extra_info("peername") if request.transport else None))
        return web.Response(body=PAGE, content_type="text/plain")

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(PAGE), 1000):
            await resp.write(PAGE[i:i + 1000])
        await resp.write_eof()
        return resp

    async def close(_: web.Request) -> web.Response:
        return web.Response(body=PAGE, headers={"Connection": "close"})

    async def gone(_: web.Request) -> web.Response:
        raise web.HTTPFound("http://198.51.100.1/metrics")

    app = web.Application()
    for path, handler in (("/fixed", fixed), ("/chunked", chunked), ("/close", close), ("/gone", gone)):
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, peers
    await runner.cleanup()


def client(max_body: int = 1 << 20) -> MetricsHttp:
    return MetricsHttp("http", True, 2.0, max_body)


async def test_a_kept_alive_connection_serves_every_scrape(aiohttp_server: tuple[int, list[str]]) -> None:
    port, peers = aiohttp_server
    http = client()
    try:
        for _ in range(5):
            assert await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/fixed?name%5B%5D=x") == PAGE
        assert http.connects == 1 and len(set(peers)) == 1
        assert await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/chunked") == PAGE
        assert http.connects == 1
    finally:
        await http.close()


async def test_a_closing_server_gets_a_new_connection_each_time(aiohttp_server: tuple[int, list[str]]) -> None:
    port, _ = aiohttp_server
    http = client()
    try:
        for _ in range(3):
            assert await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/close") == PAGE
        assert http.connects == 3
    finally:
        await http.close()


async def test_a_redirect_is_an_error_never_followed(aiohttp_server: tuple[int, list[str]]) -> None:
    port, _ = aiohttp_server
    http = client()
    try:
        with pytest.raises(ScrapeError, match="HTTP 302"):
            await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/gone")
        assert await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/fixed") == PAGE  # a fresh connection
        assert http.connects == 2
    finally:
        await http.close()


@pytest.mark.parametrize("path", ["/fixed", "/chunked"])
async def test_a_body_over_the_limit_is_refused(aiohttp_server: tuple[int, list[str]], path: str) -> None:
    port, _ = aiohttp_server
    http = client(max_body=len(PAGE) - 1)
    try:
        with pytest.raises(ScrapeError, match="over"):
            await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", path)
    finally:
        await http.close()


async def raw_server(answer: bytes | Callable[[asyncio.StreamWriter], Awaitable[None]]) -> tuple[asyncio.Server, int]:
    """A TCP server that answers every request with these bytes, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if isinstance(answer, bytes):
            writer.write(answer)
        else:
            await answer(writer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(("answer", "error"), [
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "compressed"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "shorter"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk"),
    (b"HTTP/1.1 200 OK\r\nX-Flood: " + b"a" * (MAX_HEADER_BYTES + 10) + b"\r\n\r\n", "header block"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP"),
    (b"", "closed before"),
])
async def test_malformed_answers_are_errors(answer: bytes, error: str) -> None:
    server, port = await raw_server(answer)
    http = client()
    try:
        with pytest.raises(ScrapeError, match=error):
            await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics")
        assert not http._idle  # nothing kept after an error
    finally:
        await http.close()
        server.close()
        await server.wait_closed()


async def test_a_body_without_length_is_read_to_the_end_and_bounded() -> None:
    server, port = await raw_server(b"HTTP/1.0 200 OK\r\n\r\n" + PAGE)
    try:
        http = client()
        assert await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics") == PAGE
        assert not http._idle  # HTTP/1.0 without keep-alive: not reused
        with pytest.raises(ScrapeError, match="over"):
            await client(max_body=100).get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics")
    finally:
        server.close()
        await server.wait_closed()


async def test_a_stalled_server_times_out() -> None:
    release = asyncio.Event()

    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
        await release.wait()

    server, port = await raw_server(stall)
    http = MetricsHttp("http", True, 0.2, 1000)
    try:
        with pytest.raises(TimeoutError):
            await http.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics")
        assert not http._idle
    finally:
        release.set()
        await http.close()
        server.close()
        await server.wait_closed()


async def test_https_with_and_without_certificate_checks(tmp_path: Path) -> None:
    ca = Authority.create(tmp_path)
    cert_dir = ca.issue(tmp_path, "server", ips=("127.0.0.1",))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert_dir / "tls.crt", cert_dir / "tls.key")

    async def fixed(_: web.Request) -> web.Response:
        return web.Response(body=PAGE)

    app = web.Application()
    app.router.add_get("/metrics", fixed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    try:
        insecure = MetricsHttp("https", True, 2.0, 1 << 20)
        assert await insecure.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics") == PAGE
        await insecure.close()
        checked = MetricsHttp("https", False, 2.0, 1 << 20)  # the test CA is not trusted: refused
        with pytest.raises(ssl.SSLError):
            await checked.get("ep", "127.0.0.1", port, f"127.0.0.1:{port}", "/metrics")
        await checked.close()
    finally:
        await runner.cleanup()
