"""HTTP surface of simulated vLLM replicas, and `run_replicas` to host many in one process.

Each `Replica` owns a KV cache, an engine, a metrics registry, an optional KV-events publisher
and one aiohttp site; replicas share only the event loop and the ZeroMQ context.

Routes (vLLM's):
  POST /v1/completions, /v1/chat/completions   streaming (SSE, `data: [DONE]`) or not
  POST /v1/messages                              Anthropic Messages (`anthropic_api`), streaming or not
  POST /v1/responses                             OpenAI Responses (`responses_api`), streaming or not,
                                                 `previous_response_id` from the replica's store
                                                 (Messages and Responses prompts: the chat request
                                                 vLLM converts them into, `shapes`)
  POST /v1/embeddings                            hashed vectors (`embeddings`), costed on the engine
  POST /v1/completions/render, /v1/chat/completions/render
                                                 the prompt's token ids, not generated
                                                 (`prefix_epp_sim.render`, vLLM 0.32's shapes)
  POST /tokenize                                 {"count", "max_model_len", "tokens", "token_strs"}
  POST /reset_prefix_cache                       forget cached blocks, publish AllBlocksCleared
  GET  /v1/models, /health, /metrics           (/metrics: `vllm_metrics`, with
                                                 process_start_time_seconds = the replica's start)
Every response carries `x-served-by: <host:port>` (with a wildcard bind address, the `POD_IP`
environment variable names the host), and `x-echo-prefiller-host-port` with the value of the
request's `x-prefiller-host-port` when it had one (the picker's prefill endpoint for a
disaggregated request), so tests see what reached the engine. Until `startup_delay` seconds have passed, /health and
the inference routes answer 503. With `failure_rate` f, a fraction f of well-formed inference
requests is answered 500 before it is queued (the draw uses `random.Random(f"{seed}:{index}")`).

Addresses (`replica_address`): replica i listens on host:(port + i), or with `spread_hosts` on
(host + i):port; port 0 picks a free port per replica. KV events, when enabled, go to
tcp://<replica host>:(kv_events_port_base + i) (+0 with `spread_hosts`; base 0 picks a free
port), replay to kv_events_replay_port_base + i likewise; an explicit `kv_events_endpoint` /
`kv_events_replay_endpoint` applies to a single replica. Topic: kv@<host:port>@<model>.

With a KV connector (`kv_connector`), a generation's `kv_transfer_params` are honoured and its
answer carries vLLM's `kv_transfer_params` field (`prefix_epp_sim.kv_transfer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import zmq.asyncio
from aiohttp import web

from prefix_epp_sim.anthropic_api import MessageAnswer, error_body
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.embeddings import embeddings_body, parse_embeddings
from prefix_epp_sim.engine import Engine, SimRequest
from prefix_epp_sim.kv_publisher import KVEventPublisher
from prefix_epp_sim.kv_transfer import KVTransfer
from prefix_epp_sim.kvcache import KVCache, KVEvent
from prefix_epp_sim.openai_api import (
    Answer,
    ApiError,
    ChatAnswer,
    Generation,
    Kind,
    models_body,
    parse_generation,
    parse_json,
    tokenize_body,
)
from prefix_epp_sim.render import render_chat, render_completions
from prefix_epp_sim.responses_api import ResponseAnswer, ResponseStore
from prefix_epp_sim.shapes import as_chat
from prefix_epp_sim.vllm_metrics import CONTENT_TYPE, build_registry, render

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's P/D header (extproc/transport/responses.py)
ECHOED_PREFILLER_HEADER = "x-echo-prefiller-host-port"
log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
SHUTDOWN_GRACE_S = 2.0  # wall seconds in-flight requests get to finish on stop


def replica_address(config: SimConfig, index: int, base_port: int) -> tuple[str, int]:
    if config.spread_hosts:
        return str(ipaddress.ip_address(config.host) + index), base_port
    return config.host, base_port + index if base_port else 0


async def start_site(runner: web.AppRunner, host: str, port: int) -> int:
    """Serve `runner` on host:port and return the port (the kernel's choice when `port` is 0)."""
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    if port == 0:
        server = site._server
        assert server is not None and getattr(server, "sockets", None)
        port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    return port


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@web.middleware
async def _http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes and methods answer like vLLM's FastAPI app, through the normal response path."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json({"detail": exc.reason}, exc.status)


def _api(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _json(exc.body(), exc.status)

    return wrapped


class Replica:
    def __init__(self, config: SimConfig, index: int, host: str, port: int,
                 zmq_ctx: zmq.asyncio.Context | None = None) -> None:
        config = config.for_replica(index)
        self.config = config
        self.index = index
        self.host = host
        self.port = port
        self.publisher: KVEventPublisher | None = None
        lora_ids = {name: i + 1 for i, name in enumerate(config.lora_names)}
        self.cache = KVCache(config.kv_cache_blocks, config.block_size, sink=self._on_kv_event)
        self.engine = Engine(config, self.cache, after_step=self._flush_events, lora_ids=lora_ids)
        self.started_at = time.time()  # process_start_time_seconds: set again at each start
        self.registry = build_registry(self.engine, config.model_names[0], config.metrics_surface,
                                       started_at=lambda: self.started_at)
        self.responses = ResponseStore()
        self.kv_transfer = KVTransfer(config, lambda: self.address)
        self.failures = 0
        self._zmq_ctx = zmq_ctx
        self._rng = random.Random(f"{config.seed}:{index}")
        self._ready_at = 0.0
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        """host:port as clients reach it (and as `x-served-by` reports it)."""
        host = self.host
        if host in _WILDCARD_HOSTS:
            host = os.environ.get("POD_IP", host)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self._ready_at

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        log.info("sim_replica_started", extra={
            "replica": self.index, "address": self.address,
            "kv_events": self.publisher.endpoint if self.publisher else None,
            "kv_events_replay": self.publisher.replay_endpoint if self.publisher else None})

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_http_errors])
        app.on_response_prepare.append(self._stamp)
        app.router.add_post("/v1/completions", _api(self._completions))
        app.router.add_post("/v1/chat/completions", _api(self._chat))
        app.router.add_post("/v1/messages", _api(self._messages))
        app.router.add_post("/v1/responses", _api(self._responses))
        app.router.add_post("/v1/embeddings", _api(self._embeddings))
        app.router.add_post("/v1/completions/render", _api(self._render_completions))
        app.router.add_post("/v1/chat/completions/render", _api(self._render_chat))
        app.router.add_post("/tokenize", _api(self._tokenize))
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        self.port = await start_site(self._runner, self.host, self.port)
        self.started_at = time.time()
        self._ready_at = time.monotonic() + self.config.startup_delay
        self._start_publisher()
        self.engine.start()

    def _start_publisher(self) -> None:
        cfg = self.config
        if not cfg.kv_events:
            return
        assert self._zmq_ctx is not None, "KV events need a ZeroMQ context"
        offset = 0 if cfg.spread_hosts else self.index
        endpoint = cfg.kv_events_endpoint or self._tcp(cfg.kv_events_port_base, offset)
        replay = cfg.kv_events_replay_endpoint
        if replay is None and cfg.kv_events_replay_port_base is not None:
            replay = self._tcp(cfg.kv_events_replay_port_base, offset)
        topic = cfg.kv_events_topic or f"kv@{self.address}@{cfg.model_names[0]}"
        publisher = KVEventPublisher(self._zmq_ctx, endpoint, topic, encoding=cfg.kv_events_encoding,
                                     replay_endpoint=replay, buffer_steps=cfg.kv_events_buffer_steps,
                                     hwm=cfg.kv_events_hwm, connect=cfg.kv_events_connect)
        publisher.start()
        self.publisher = publisher

    def _tcp(self, port_base: int, offset: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host or "*"
        return f"tcp://{host}:{port_base + offset if port_base else '*'}"

    async def stop(self) -> None:
        # The engine outlives the site so in-flight requests can finish within the grace period.
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()
        if self.publisher is not None:
            await self.publisher.close()

    # --- plumbing ---------------------------------------------------------------------------

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-served-by"] = self.address
        prefiller = request.headers.get(PREFILLER_HEADER)
        if prefiller is not None:
            response.headers[ECHOED_PREFILLER_HEADER] = prefiller

    def _on_kv_event(self, event: KVEvent) -> None:
        if self.publisher is not None:
            self.publisher.add(event)

    def _flush_events(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()

    def _check_ready(self) -> None:
        if not self.ready:
            raise ApiError("unavailable", "The server is starting up.")

    # --- handlers ---------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return _json(models_body(self.config, self._created))

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def _reset(self, request: web.Request) -> web.Response:
        self.cache.reset()
        self._flush_events()
        log.info("sim_prefix_cache_reset", extra={"address": self.address})
        return web.Response(status=200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        return _json(tokenize_body(parse_json(await request.read()), self.config))

    async def _render_completions(self, request: web.Request) -> web.Response:
        self._check_ready()
        return _json(render_completions(parse_json(await request.read()), self.config))

    async def _render_chat(self, request: web.Request) -> web.Response:
        self._check_ready()
        return _json(render_chat(parse_json(await request.read()), self.config))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        body = as_chat(parse_json(await request.read()), "messages")  # malformed: vLLM's OpenAI-shaped 400
        try:
            gen = parse_generation(body, "chat", self.config)
            return await self.generate(request, gen, MessageAnswer(gen))
        except ApiError as exc:
            return _json(error_body(exc), exc.status)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        created = int(time.time())
        body = parse_json(await request.read())
        chat = as_chat(body, "responses", self.responses.history(body))
        gen = parse_generation(chat, "chat", self.config)
        return await self.generate(request, gen, ResponseAnswer(gen, body, chat["messages"], self.responses,
                                                                created))

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self._check_ready()
        gen = parse_generation(parse_json(await request.read()), kind, self.config)
        return await self.generate(request, gen)

    def _maybe_fail(self) -> None:
        if self.config.failure_rate and self._rng.random() < self.config.failure_rate:
            self.failures += 1
            raise ApiError("internal", "Injected failure (--failure-rate).")

    async def _embeddings(self, request: web.Request) -> web.Response:
        """Each input costs one prefill on the engine (a one-token request), as the module
        `prefix_epp_sim.embeddings` says; the vectors do not depend on it."""
        self._check_ready()
        emb = parse_embeddings(parse_json(await request.read()), self.config)
        self._maybe_fail()
        reqs = [SimRequest(tokens, 1, False, emb.lora) for tokens in emb.inputs]
        for req in reqs:
            self.engine.submit(req)
        try:
            await asyncio.gather(*(req.done.wait() for req in reqs))
        finally:
            for req in reqs:
                self.engine.abort(req)
        return _json(embeddings_body(emb))

    async def generate(self, request: web.Request, gen: Generation, answer: Answer | None = None) -> web.StreamResponse:
        """Serve a parsed request, written by `answer` (default: the completions/chat one): queued
        on the engine before the first await (the clairvoyant front, `prefix_epp_sim.clairvoyant`,
        relies on that; a shared-storage KV connector looks its blocks up first), then answered on
        `request`."""
        self._check_ready()
        self._maybe_fail()
        answer = answer or ChatAnswer(gen)
        req = SimRequest(gen.prompt_tokens, gen.max_tokens, gen.stream, gen.lora)
        remote_decode = False
        if self.config.kv_connector:  # what a KV connector loads for it (prefix_epp_sim.kv_transfer)
            self.engine.hash_prompt(req)
            remote_decode = await self.kv_transfer.prepare(req, gen.kv_transfer_params)
        self.engine.submit(req)
        try:
            if gen.stream:
                return await self._stream(request, req, answer)
            await req.done.wait()
            text = self.engine.filler.text(0, req.generated)
            body = answer.body(text, req.generated, req.cached_tokens)
            if self.config.kv_connector:
                await self.kv_transfer.finish(req)
                body["kv_transfer_params"] = (self.kv_transfer.answer_params(req, str(body.get("id", "")))
                                              if remote_decode else None)
            return _json(body)
        finally:
            self.engine.abort(req)  # no-op once finished; frees the blocks of a vanished client

    async def _stream(self, request: web.Request, req: SimRequest, answer: Answer) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        opening = answer.opening()
        if opening:
            await response.write(opening)
        sent = 0
        while True:
            await req.progress.wait()
            req.progress.clear()
            generated = req.generated
            if generated > sent:
                text = self.engine.filler.text(sent, generated)
                await response.write(answer.chunk(text, first=sent == 0, last=req.finished))
                sent = generated
            if req.finished:
                break
        await self.kv_transfer.finish(req)
        await response.write(answer.closing(sent, req.cached_tokens))
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def run_replicas(config: SimConfig, n: int | None = None,
                       base_port: int | None = None) -> AsyncIterator[list[Replica]]:
    """Start `n` (default `config.replicas`) replicas in this event loop; stop them on exit.

    `base_port` defaults to `config.port`; 0 gives every replica a free port (see `.port`/`.url`).
    """
    count = config.replicas if n is None else n
    base = config.port if base_port is None else base_port
    zmq_ctx = zmq.asyncio.Context() if config.kv_events else None
    replicas: list[Replica] = []
    try:
        for index in range(count):
            host, port = replica_address(config, index, base)
            replica = Replica(config, index, host, port, zmq_ctx)
            await replica.start()
            replicas.append(replica)
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()
        if zmq_ctx is not None:
            zmq_ctx.destroy(linger=0)
