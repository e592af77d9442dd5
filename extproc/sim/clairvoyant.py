"""A clairvoyant front for the simulated replicas: the routing reference no real router can reach.

A benchmark reference, not a router for production: it lives in the simulator process
(`prefix-epp sim --clairvoyant-port P`), next to the replicas it routes to, and reads their
true state. For each POST /v1/completions or /v1/chat/completions it parses the request as a
replica would (`openai_api.parse_generation`), predicts the request's TTFT on every replica
with the simulator's own cost model (`predict_ttft_ms`), picks the least (ties broken by
`random.Random(f"clairvoyant:{seed}")`), and hands the request to that replica's
`Replica.generate`, the code path of its own HTTP handler. Choosing and queuing happen on the
event loop without an await in between, so a request sees every earlier one already queued.
Responses are the replica's (same streaming), with `x-served-by: <chosen replica address>`.
GET /health answers 200 once every replica is ready.

Prediction on one replica (model milliseconds; `SimConfig` supplies every constant)::

    cached  = leading prompt blocks in its KV cache now (`KVCache.match_prefix`, which leaves the
              LRU order alone), at most (prompt_tokens - 1) // block_size, times block_size
    ahead   = prefill_left of running requests + uncached tokens of waiting requests (each
              matched against the cache as it is now)
    work    = ahead + prompt_tokens - cached                     (FIFO: ahead is prefilled first)
    decodes = running requests past their prefill
    steps   = ceil(work / (max_num_batched_tokens - decodes))    (chunked prefill budget)
    ttft    = steps * (inter_token_latency + prefill_overhead + decode_time_per_seq * decodes)
              + prefill_time_per_token * work

It ignores what it cannot know exactly without simulating ahead: requests finishing (and their
blocks being stored) before this one is scheduled, and admission stalls on a full KV cache.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine
from extproc.sim.kvcache import hash_blocks
from extproc.sim.openai_api import Generation, Kind, parse_generation, parse_json
from extproc.sim.server import Replica, _api, _http_errors

log = logging.getLogger(__name__)

_SERVED_BY_KEY = web.RequestKey("clairvoyant_served_by", str)  # the chosen replica's address


def _cached_tokens(engine: Engine, hashes: Sequence[int], prompt_len: int) -> int:
    bs = engine.cache.block_size
    return min(engine.cache.match_prefix(hashes), (prompt_len - 1) // bs) * bs


def queued_prefill_tokens(engine: Engine) -> int:
    """Prompt tokens the replica must still compute for the requests it already holds."""
    ahead = sum(r.prefill_left for r in engine.running if not r.aborted)
    for r in engine.waiting:
        ahead += len(r.prompt_tokens) - _cached_tokens(engine, r.prompt_hashes, len(r.prompt_tokens))
    return ahead


def predict_ttft_ms(engine: Engine, hashes: Sequence[int], prompt_len: int) -> float:
    """Predicted TTFT (model ms) of a prompt with these block hashes if queued on `engine` now."""
    cfg: SimConfig = engine.config
    work = queued_prefill_tokens(engine) + prompt_len - _cached_tokens(engine, hashes, prompt_len)
    decodes = sum(1 for r in engine.running if r.prefill_left == 0 and not r.aborted)
    budget = max(1, cfg.max_num_batched_tokens - decodes)
    steps = max(1, math.ceil(work / budget))
    per_step = cfg.inter_token_latency + cfg.prefill_overhead + cfg.decode_time_per_seq * decodes
    return steps * per_step + cfg.prefill_time_per_token * work


class Clairvoyant:
    """Picks, for each request, the replica with the least predicted TTFT."""

    def __init__(self, replicas: Sequence[Replica], seed: int = 0) -> None:
        if not replicas:
            raise ValueError("the clairvoyant front needs at least one replica")
        self.replicas = list(replicas)
        self._rng = random.Random(f"clairvoyant:{seed}")

    def choose(self, gen: Generation) -> Replica:
        engine0 = self.replicas[0].engine
        hashes = hash_blocks(gen.prompt_tokens, engine0.cache.block_size, engine0.seed_for(gen.lora))
        n = len(gen.prompt_tokens)
        predictions = [predict_ttft_ms(r.engine, hashes, n) for r in self.replicas]
        best = min(predictions)
        ties = [r for r, p in zip(self.replicas, predictions, strict=True) if p <= best + 1e-9]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


class ClairvoyantFront:
    """The HTTP side: one aiohttp site on `host:port` (0 picks a free port, see `.port`)."""

    def __init__(self, replicas: Sequence[Replica], config: SimConfig, port: int) -> None:
        self.config = config
        self.host = config.host
        self.port = port
        self.picker = Clairvoyant(replicas, config.seed)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_http_errors])
        app.on_response_prepare.append(self._stamp)
        app.router.add_post("/v1/completions", _api(self._completions))
        app.router.add_post("/v1/chat/completions", _api(self._chat))
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None and getattr(server, "sockets", None)
            self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        log.info("sim_clairvoyant_started", extra={"address": f"{self.host}:{self.port}"})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        served_by = request.get(_SERVED_BY_KEY)
        if served_by:
            response.headers["x-served-by"] = served_by

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if all(r.ready for r in self.picker.replicas) else 503)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "chat")

    async def _route(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        gen = parse_generation(parse_json(await request.read()), kind, self.config)
        replica = self.picker.choose(gen)  # no await between choosing and queuing (generate)
        request[_SERVED_BY_KEY] = replica.address
        return await replica.generate(request, gen)


@contextlib.asynccontextmanager
async def clairvoyant_front(replicas: Sequence[Replica], config: SimConfig,
                            port: int) -> AsyncIterator[ClairvoyantFront]:
    front = ClairvoyantFront(replicas, config, port)
    try:
        await front.start()
        yield front
    finally:
        await front.stop()
