"""A narrow HTTP/1.1 GET client for /metrics: one kept-alive connection per endpoint, nothing else.

Why not aiohttp's client: a GET of the ~1.5 KB filtered page costs ~160 us of CPU through
aiohttp's session, request and response objects, ~75 us here (bench/results/scale.md); the
scraper does hundreds a second at 256 endpoints.

What it does, and refuses (the model server is not trusted):
- `GET <target> HTTP/1.1` with `Host`, `Accept-Encoding: identity`, on a connection kept per
  endpoint and reused while the server keeps it open; any error closes it, the next scrape opens
  a new one. TLS when the scheme is https (certificate checks off with `insecure_skip_verify`).
- The whole exchange (connecting included) runs under `timeout_s`.
- The status must be 200: anything else (a redirect included: it is never followed) is a
  `ScrapeError` and the connection is closed unread.
- Header block at most `MAX_HEADER_BYTES` (64 KiB); the body at most `max_body_bytes`, declared
  (Content-Length) or counted (chunked, or read to the end of a closing connection): beyond, a
  `ScrapeError` before buffering more. A compressed body (Content-Encoding other than identity)
  is refused: the picker asked for none.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

MAX_HEADER_BYTES = 64 * 1024


class ScrapeError(Exception):
    pass


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


def _tls_context(insecure_skip_verify: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class MetricsHttp:
    def __init__(self, scheme: str, insecure_skip_verify: bool, timeout_s: float, max_body_bytes: int) -> None:
        self._tls = _tls_context(insecure_skip_verify) if scheme == "https" else None
        self._timeout_s = timeout_s
        self._max_body = max_body_bytes
        self._idle: dict[str, _Conn] = {}  # endpoint key -> its idle kept-alive connection
        self.connects = 0  # connections opened (tests, benchmarks)

    async def get(self, key: str, host: str, port: int, host_header: str, target: str) -> bytes:
        """The body of a 200 answer to `GET target`; ScrapeError (or OSError, TimeoutError) otherwise."""
        conn = self._idle.pop(key, None)
        reusable = False
        try:
            async with asyncio.timeout(self._timeout_s):
                if conn is None:
                    reader, writer = await asyncio.open_connection(host, port, ssl=self._tls, limit=MAX_HEADER_BYTES)
                    conn = _Conn(reader, writer)
                    self.connects += 1
                conn.writer.write(f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nAccept: text/plain\r\n"
                                  "Accept-Encoding: identity\r\nUser-Agent: prefix-epp\r\n\r\n".encode("latin-1"))
                body, reusable = await self._response(conn.reader)
        finally:
            if conn is not None:
                if reusable:
                    self._idle[key] = conn
                else:
                    conn.writer.close()
        return body

    async def _response(self, reader: asyncio.StreamReader) -> tuple[bytes, bool]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise ScrapeError(f"response header block over {MAX_HEADER_BYTES} bytes") from exc
        except asyncio.IncompleteReadError as exc:
            raise ScrapeError("connection closed before a response") from exc
        lines = head[:-4].split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
            raise ScrapeError("not an HTTP/1.x response")
        if status[1] != b"200":
            raise ScrapeError(f"HTTP {status[1].decode('latin-1', 'replace')[:3]}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"content-encoding", b"identity") != b"identity":
            raise ScrapeError("compressed body (identity was asked for)")
        keep = status[0] == b"HTTP/1.1" and headers.get(b"connection") != b"close"
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            return await self._chunked(reader), keep
        if b"content-length" in headers:
            try:
                size = int(headers[b"content-length"])
            except ValueError as exc:
                raise ScrapeError("bad Content-Length") from exc
            if size < 0 or size > self._max_body:
                raise ScrapeError(f"body of {size} bytes, over {self._max_body}")
            try:
                return await reader.readexactly(size), keep
            except asyncio.IncompleteReadError as exc:
                raise ScrapeError("body shorter than its Content-Length") from exc
        body = await reader.read(self._max_body + 1)  # no length: the body ends with the connection
        while body and len(body) <= self._max_body:
            more = await reader.read(self._max_body + 1 - len(body))
            if not more:
                break
            body += more
        if len(body) > self._max_body:
            raise ScrapeError(f"body over {self._max_body} bytes")
        return body, False

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        try:
            while True:
                line = await reader.readuntil(b"\r\n")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise ScrapeError("bad chunk size") from exc
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                        pass
                    return b"".join(parts)
                total += size
                if size < 0 or total > self._max_body:
                    raise ScrapeError(f"body over {self._max_body} bytes")
                chunk = await reader.readexactly(size + 2)
                parts.append(chunk[:-2])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise ScrapeError("malformed chunked body") from exc

    async def close(self) -> None:
        conns, self._idle = list(self._idle.values()), {}
        for conn in conns:
            conn.writer.close()
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()
