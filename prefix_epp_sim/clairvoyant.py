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

Prediction on one replica (model milliseconds; `SimConfig` supplies every constant): a dry run
of the replica's own scheduler (prefix_epp_sim/engine.py) from its state now, with the request
appended to the waiting queue. Step by step, the step's token budget (max_num_batched_tokens
less one token per decoding request) goes to the prefill still owed by admitted requests in
order, then admits waiting ones while budget remains; a request's cached tokens are fixed at its
admission: the leading blocks held by the KV cache now or covered by a chunk scheduled before it
in the dry run (chained hashes: the longest of those runs), at most (prompt_tokens - 1) //
block_size blocks, as vLLM and the engine count them: blocks are hits once their chunk is
scheduled. Each step costs what the engine charges::

    step = inter_token_latency + decode_time_per_seq x (sequences in the step - 1)
           + prefill_overhead + prefill_time_per_token x prefill tokens

and TTFT is the end of the step in which the request's prefill completes. It leaves out what it
cannot know without running the requests: decodes ending (fewer sequences per step), evictions
and admission stalls on a full KV cache.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.engine import Engine
from prefix_epp_sim.kvcache import hash_blocks
from prefix_epp_sim.openai_api import Generation, Kind, parse_generation, parse_json
from prefix_epp_sim.server import Replica, _api, _http_errors, start_site

log = logging.getLogger(__name__)

_SERVED_BY_KEY = web.RequestKey("clairvoyant_served_by", str)  # the chosen replica's address


def _run(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chained-hash lists share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cached_tokens(engine: Engine, hashes: Sequence[int], prompt_len: int,
                   scheduled: Sequence[Sequence[int]] = ()) -> int:
    bs = engine.cache.block_size
    blocks = max([engine.cache.match_prefix(hashes), *(_run(hashes, c) for c in scheduled)])
    return min(blocks, (prompt_len - 1) // bs) * bs


def queued_prefill_tokens(engine: Engine) -> int:
    """Prompt tokens the replica must still compute for the requests it already holds (cache as now)."""
    ahead = sum(r.prefill_left for r in engine.running if not r.aborted)
    for r in engine.waiting:
        ahead += len(r.prompt_tokens) - _cached_tokens(engine, r.prompt_hashes, len(r.prompt_tokens))
    return ahead


@dataclass(slots=True)
class _Job:
    left: int  # prompt tokens still to prefill
    hashes: Sequence[int]
    prompt_len: int
    ours: bool = False

    def schedule(self, chunk: int, block_size: int) -> Sequence[int]:
        """Schedule `chunk` tokens of its prefill; the block hashes it has scheduled so far."""
        self.left -= chunk
        return self.hashes[:(self.prompt_len - self.left) // block_size]


def predict_ttft_ms(engine: Engine, hashes: Sequence[int], prompt_len: int) -> float:
    """Predicted TTFT (model ms) of a prompt with these block hashes if queued on `engine` now."""
    cfg: SimConfig = engine.config
    bs = engine.cache.block_size
    live = [r for r in engine.running if not r.aborted]
    decodes = sum(1 for r in live if r.prefill_left == 0)
    admitted = [_Job(r.prefill_left, r.prompt_hashes, len(r.prompt_tokens))
                for r in live if r.prefill_left > 0]
    waiting: list[tuple[Sequence[int], int, bool]] = [
        (r.prompt_hashes, len(r.prompt_tokens), False) for r in engine.waiting]
    waiting.append((hashes, prompt_len, True))
    scheduled: list[Sequence[int]] = []  # blocks of chunks scheduled in the dry run: hits from then on
    elapsed = 0.0
    while True:
        budget = max(1, cfg.max_num_batched_tokens - decodes)
        tokens = seqs = 0
        done: list[_Job] = []
        for job in admitted:
            if budget <= 0:
                break
            if job.left > 0:
                chunk = min(job.left, budget)
                scheduled.append(job.schedule(chunk, bs))
                budget, tokens, seqs = budget - chunk, tokens + chunk, seqs + 1
                if job.left == 0:
                    done.append(job)
        while budget > 0 and waiting:
            w_hashes, w_len, ours = waiting.pop(0)
            job = _Job(w_len - _cached_tokens(engine, w_hashes, w_len, scheduled), w_hashes, w_len, ours)
            chunk = min(job.left, budget)
            scheduled.append(job.schedule(chunk, bs))
            budget, tokens, seqs = budget - chunk, tokens + chunk, seqs + 1
            admitted.append(job)
            if job.left == 0:
                done.append(job)
        elapsed += (cfg.inter_token_latency + cfg.decode_time_per_seq * max(0, decodes + seqs - 1)
                    + cfg.prefill_overhead + cfg.prefill_time_per_token * tokens)
        if any(job.ours for job in done):
            return elapsed
        admitted = [job for job in admitted if job.left > 0]


class Clairvoyant:
    """Picks, for each request, the replica with the least predicted TTFT."""

    def __init__(self, replicas: Sequence[Replica], seed: int) -> None:
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
        self.port = await start_site(self._runner, self.host, self.port)
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
