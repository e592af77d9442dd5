"""The sidecar's request handling: forward to the decode engine, or prefill elsewhere first.

Every request, whatever its method and path, goes through `Proxy.handle`:

- Without `x-prefiller-host-port`: forwarded to the decode engine as it is, streamed both ways
  (the body is not read whole; one larger than `max_request_body_bytes` is refused, 413). This is
  also how the engine's own /metrics, /health and /v1/models stay reachable on the pod's target
  port, where the picker scrapes them.
- With it, on POST /v1/completions or /v1/chat/completions (`protocol.DISAGGREGATED`): the body is
  read whole (bounded), the prefill request goes to the named endpoint and its answer is read
  whole (one token; bounded by `max_prefill_response_bytes`); then the decode request goes to the
  decode engine and its answer is streamed to the client as it comes (SSE chunk by chunk; never
  the whole answer in memory). A prefill answering 4xx/5xx is the client's answer (its status,
  content type and body) and no decode runs; a prefill endpoint that cannot be reached is 502, one
  that does not answer within `prefill_timeout_s` 504, each an OpenAI-style JSON error. On any
  other path the header is removed and the request forwarded.
- A malformed header value (not one IP:PORT), a repeated header or a body that is not a JSON
  object is 400.

TLS to an engine (`enable_tls`, or an https `decode_url`) verifies its certificate against `ca_file`
(else the system's CAs) unless `tls_insecure_skip_verify` names its stage.

Both legs carry the client's `x-request-id`, or one the sidecar makes, so the two engines' logs of
one request can be matched. The decode engine unreachable is 503 (connection refused: it is not
serving yet) or 502. An engine failing after its answer started cannot change the status any more:
the client's connection is closed, so the answer reads as cut short, never as complete. A client
leaving mid-answer closes the engine's connection, which makes vLLM abort the request.

Logs are structured and never contain prompt text nor bodies: the prefill endpoint, statuses,
durations, the request id.
"""

from __future__ import annotations

import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from extproc.config.sidecar import SidecarConfig
from extproc.sidecar import protocol
from extproc.sidecar.metrics import SidecarMetrics

log = logging.getLogger("prefix_epp.sidecar")
JSON = "application/json"


class BodyTooLarge(Exception):
    """A streamed request body passed `max_request_body_bytes`."""


class Proxy:
    """The handler (module docstring); `session` is the one outbound pool, shared by both legs."""

    def __init__(self, config: SidecarConfig, session: aiohttp.ClientSession, metrics: SidecarMetrics) -> None:
        self.config = config
        self.session = session
        self.metrics = metrics
        decode = URL(config.decode_url)
        if "decoder" in config.enable_tls and decode.scheme == "http":
            decode = decode.with_scheme("https")
        self.decode_base = str(decode).rstrip("/")
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=config.ca_file) if config.ca_file else True
        self.decode_ssl = False if "decoder" in config.tls_insecure_skip_verify else verify
        self.prefill_scheme = "https" if "prefiller" in config.enable_tls else "http"
        self.prefill_ssl = False if "prefiller" in config.tls_insecure_skip_verify else verify
        self.prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout_s,
                                                     sock_connect=config.connect_timeout_s)
        self.decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)

    # --- entry --------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        values = request.headers.getall(protocol.PREFILLER_HEADER, [])
        if not values:
            return await self.forward(request, "forwarded")
        if len(values) > 1:
            return self.refuse(400, f"{protocol.PREFILLER_HEADER} given {len(values)} times", "disaggregated")
        try:
            target = protocol.host_port(values[0])
        except ValueError as exc:
            return self.refuse(400, str(exc), "disaggregated")
        kind = protocol.DISAGGREGATED.get(request.path) if request.method == "POST" else None
        if kind is None:  # nothing to prefill: the engine serves it alone
            return await self.forward(request, "forwarded")
        return await self.disaggregate(request, kind, target)

    def refuse(self, status: int, message: str, mode: str, outcome: str = "refused") -> web.Response:
        self.metrics.requests.labels(mode, outcome).inc()
        return error(status, message)

    # --- without a prefill ----------------------------------------------------------------------

    async def forward(self, request: web.Request, mode: str) -> web.StreamResponse:
        """The request to the decode engine as it came, the answer back as it comes."""
        limit = self.config.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return self.refuse(413, f"request body larger than {limit} bytes", mode)
        body = BoundedBody(request.content, limit)
        headers = protocol.forwarded(request.headers.items(), keep_length=True)
        url = URL(self.decode_base + request.raw_path, encoded=True)  # path and query as sent
        try:
            async with self.session.request(request.method, url, headers=headers,
                                            data=body.chunks() if request.body_exists else None,
                                            ssl=self.decode_ssl, timeout=self.decode_timeout,
                                            allow_redirects=False) as upstream:
                return await self.relay(request, upstream, mode)
        except (TimeoutError, aiohttp.ClientError, BodyTooLarge) as exc:
            if body.too_large:  # however aiohttp reported the body's end
                return self.refuse(413, f"request body larger than {limit} bytes", mode)
            return self.decode_failed(exc, mode)

    # --- with a prefill ---------------------------------------------------------------------------

    async def disaggregate(self, request: web.Request, kind: protocol.Kind, target: str) -> web.StreamResponse:
        mode = "disaggregated"
        raw = await request.read()  # bounded by the app's client_max_size (413)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self.refuse(400, f"malformed JSON body: {exc}", mode)
        if not isinstance(body, dict):
            return self.refuse(400, "the request body must be a JSON object", mode)
        request_id = request.headers.get(protocol.REQUEST_ID_HEADER) or uuid.uuid4().hex
        headers = [(k, v) for k, v in protocol.forwarded(request.headers.items())
                   if k.lower() not in ("content-type", "content-encoding", protocol.REQUEST_ID_HEADER)]
        headers += [("Content-Type", JSON), (protocol.REQUEST_ID_HEADER, request_id)]
        connector = self.config.kv_connector

        prefill = await self.prefill(request, target, orjson.dumps(protocol.prefill_body(body, kind, connector)),
                                     headers, request_id)
        if isinstance(prefill, web.Response):
            return prefill
        decode = raw
        if connector == "nixlv2":
            params = protocol.decode_params(prefill)
            if params is None:  # vLLM without a NIXL connector answers none: the decode computes the prompt
                log.warning("sidecar_prefill_without_kv_transfer_params",
                            extra={"prefiller": target, "request_id": request_id})
            else:
                decode = orjson.dumps(protocol.decode_body(body, params))
        url = URL(self.decode_base + request.raw_path, encoded=True)
        try:
            async with self.session.post(url, headers=headers, data=decode, ssl=self.decode_ssl,
                                         timeout=self.decode_timeout, allow_redirects=False) as upstream:
                return await self.relay(request, upstream, mode)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self.decode_failed(exc, mode)

    async def prefill(self, request: web.Request, target: str, body: bytes, headers: list[tuple[str, str]],
                      request_id: str) -> Any:
        """Run the prefill on `target`: its answer (parsed JSON, or None when not JSON) on 2xx, else
        the client's error response (module docstring)."""
        url = URL(f"{self.prefill_scheme}://{target}{request.raw_path}", encoded=True)
        started = time.monotonic()
        outcome, status = "ok", 0
        try:
            sent = [(k, v) for k, v in headers if k.lower() != "accept-encoding"]  # its answer is read here
            async with self.session.post(url, headers=[*sent, ("Accept-Encoding", "identity")], data=body,
                                         ssl=self.prefill_ssl, timeout=self.prefill_timeout,
                                         allow_redirects=False) as answer:
                status = answer.status
                raw = await _read_bounded(answer, self.config.max_prefill_response_bytes)
                if raw is None:
                    outcome = "invalid"
                    return self.refuse(502, f"prefill endpoint {target}: answer larger than "
                                            f"{self.config.max_prefill_response_bytes} bytes", "disaggregated",
                                       "prefill_invalid")
                if not 200 <= status < 300:  # the client's error, as the prefill engine wrote it
                    outcome = "error"
                    self.metrics.requests.labels("disaggregated", "prefill_error").inc()
                    return web.Response(status=status, body=raw,
                                        content_type=answer.content_type or JSON)
                try:
                    return orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return None
        except aiohttp.ConnectionTimeoutError:
            outcome = "unreachable"
            return self.refuse(502, f"prefill endpoint {target} unreachable: connect timed out", "disaggregated",
                               "prefill_unreachable")
        except TimeoutError:
            outcome = "timeout"
            return self.refuse(504, f"prefill endpoint {target} did not answer within "
                                    f"{self.config.prefill_timeout_s:g} s", "disaggregated", "prefill_timeout")
        except aiohttp.ClientError as exc:
            outcome = "unreachable"
            return self.refuse(502, f"prefill endpoint {target} unreachable: {type(exc).__name__}", "disaggregated",
                               "prefill_unreachable")
        finally:
            seconds = time.monotonic() - started
            self.metrics.prefill_seconds.labels(outcome).observe(seconds)
            level = logging.INFO if outcome == "ok" else logging.WARNING
            log.log(level, "sidecar_prefill", extra={"prefiller": target, "outcome": outcome, "status": status,
                                                     "prefill_ms": round(seconds * 1000, 1),
                                                     "request_id": request_id})

    # --- the answer ---------------------------------------------------------------------------------

    async def relay(self, request: web.Request, upstream: aiohttp.ClientResponse, mode: str) -> web.StreamResponse:
        """The engine's answer to the client as it arrives: status, end-to-end headers, then each
        chunk of the body as read (aiohttp's reader pauses the engine when the client is slow)."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in protocol.forwarded(upstream.headers.items(), keep_length=True):
            response.headers.add(name, value)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except ConnectionResetError:  # the client left (aiohttp's own reset error is a ClientError too)
            self.metrics.requests.labels(mode, "client_gone").inc()
            return response  # leaving the engine's answer unread closes its connection: vLLM aborts
        except (TimeoutError, aiohttp.ClientError) as exc:
            # Too late for a status: closing the client's connection without the answer's end is
            # what tells it the answer is cut (aiohttp's own end of it then fails quietly).
            self.metrics.requests.labels(mode, "decode_cut").inc()
            log.warning("sidecar_answer_cut", extra={"mode": mode, "error": type(exc).__name__})
            if request.transport is not None:
                request.transport.close()
            return response
        self.metrics.requests.labels(mode, "ok" if upstream.status < 400 else "engine_error").inc()
        await response.write_eof()
        return response

    def decode_failed(self, exc: BaseException, mode: str) -> web.Response:
        refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)
        status = 503 if refused else 502
        log.warning("sidecar_decode_unreachable", extra={"mode": mode, "error": type(exc).__name__,
                                                         "status": status})
        self.metrics.requests.labels(mode, "decode_unreachable").inc()
        return error(status, f"decode engine {self.config.decode_url} unreachable: {type(exc).__name__}")


def error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(protocol.error_body(status, message)), content_type=JSON)


class BoundedBody:
    """A request body passed on as it arrives, stopped (`BodyTooLarge`, `too_large`) past `limit` bytes."""

    def __init__(self, content: aiohttp.StreamReader, limit: int) -> None:
        self.content = content
        self.limit = limit
        self.too_large = False

    async def chunks(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self.content.iter_any():
            size += len(chunk)
            if size > self.limit:
                self.too_large = True
                raise BodyTooLarge
            yield chunk


async def _read_bounded(answer: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body of a (small) answer; None past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in answer.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
