"""Small HTTP backends for end-to-end tests: `python -m testkit.echo_backends PORT [PORT ...]`.

Each answers every request with JSON naming itself (`served_by`), the method, path, body length,
body sha256 and the request headers it received, plus the `x-served-by` header. GET /health is 200.
A JSON body with `"stream": true` gets a server-sent-events answer instead: five `data:` chunks
50 ms apart, then `data: [DONE]`, so tests can see chunks arrive before the stream ends. A
`/v1/responses` answer names itself as vLLM's does: the JSON opens with `"id": "resp_<uuid>"`, a
stream's first event is `response.created` with that id (its `previous_response_id` is echoed).
An optional `--delay S` holds each response, so concurrent requests overlap; `--trivial` answers
a fixed tiny JSON without reading headers or hashing (for overhead benchmarks); a `--trivial`
backend streams when the body's first or last 256 bytes say `"stream": true`: `max_tokens` (from the same
bytes, default 1) SSE chunks, `"interval_ms"` apart (back to back without it, which lets Envoy
coalesce them), then `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import signal
import uuid

from aiohttp import web

_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
_INTERVAL_MS = re.compile(rb'"interval_ms":\s*(\d+(?:\.\d+)?)')


async def _trivial_stream(request: web.Request, head: bytes, name: str) -> web.StreamResponse:
    m = _MAX_TOKENS.search(head)
    tokens = int(m.group(1)) if m else 1
    m = _INTERVAL_MS.search(head)
    interval = float(m.group(1)) / 1000 if m else 0.0
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-served-by": name})
    await resp.prepare(request)
    chunk = b'data: {"choices": [{"index": 0, "text": " tok"}]}\n\n'
    for i in range(tokens):
        if interval and i:
            await asyncio.sleep(interval)
        await resp.write(chunk)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def make_app(name: str, delay: float, trivial: bool = False) -> web.Application:
    tiny = b'{"served_by": "' + name.encode() + b'"}'

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if trivial:
            # The request's first 256 bytes, and its last 256: a picker that re-serialises the body
            # (the Go endpoint picker sorts the keys) moves "stream" behind the prompt.
            head = body[:256] + body[-256:]
            if b'"stream": true' in head or b'"stream":true' in head:
                return await _trivial_stream(request, head, name)
            return web.Response(body=tiny, content_type="application/json", headers={"x-served-by": name})
        if delay:
            await asyncio.sleep(delay)
        if request.path == "/health":
            return web.Response(text="ok", headers={"x-served-by": name})
        response_id = f"resp_{uuid.uuid4().hex}" if request.path.endswith("/responses") else ""
        if b'"stream":true' in body.replace(b" ", b""):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-served-by": name})
            await resp.prepare(request)
            if response_id:
                created = {"type": "response.created", "sequence_number": 0, "response": {"id": response_id}}
                await resp.write(f"event: response.created\ndata: {json.dumps(created)}\n\n".encode())
            for i in range(5):
                await resp.write(f'data: {{"chunk": {i}, "served_by": "{name}"}}\n\n'.encode())
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        payload: dict[str, object] = {"id": response_id} if response_id else {}
        payload |= {
            "served_by": name,
            "method": request.method,
            "path": request.path_qs,
            "body_len": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
        return web.json_response(payload, headers={"x-served-by": name})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def main(ports: list[int], host: str, delay: float, trivial: bool = False) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(make_app(f"{host}:{port}", delay, trivial), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ports", type=int, nargs="+")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--trivial", action="store_true", help="answer a fixed tiny JSON (benchmarks)")
    a = parser.parse_args()
    asyncio.run(main(a.ports, a.host, a.delay, a.trivial))
