"""Eviction the picker did not cause: the approximate index goes wrong, the precise one stays right."""

from __future__ import annotations

import asyncio

import orjson

from extproc.config.settings import EppConfig, KVEventsConfig
from extproc.control.director import RequestContext
from extproc.prefix.hashing import block_hashes
from extproc.request.openai import Api, parse_request
from extproc.runtime.app import App
from testkit.kvevents import (
    PROMPTS,
    agrees,
    complete,
    events_stack,
    precise_blocks,
    sim_blocks,
    spec_for,
    subscribed,
)


def body(prompt: str) -> bytes:
    return orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 4})


async def test_flooded_replica_loses_the_prefix_and_only_the_precise_index_knows() -> None:
    cfg = EppConfig(seed=1, refresh_metrics_interval_s=0, kv_events=KVEventsConfig(
        prefix_scorer="precise", speculative_ttl_s=0.2, maintenance_interval_s=0.05))
    async with events_stack(2, subscribe=False) as ev:
        app = App(cfg)
        assert app.kv_events is not None
        m = app.kv_events
        app.datastore.set_endpoints([spec_for(r) for r in ev.replicas])
        task = asyncio.create_task(m.run())
        try:
            await subscribed(ev.replicas)
            prompt = PROMPTS[0]
            first = app.director.route(RequestContext(path="/v1/completions"), body(prompt))
            x, y = sorted(ev.replicas, key=lambda r: f"127.0.0.1:{r.port}" != first.primary.key)
            await complete(x, prompt)  # forwarded as routed
            app.director.complete(first.primary)
            await complete(y, prompt)  # traffic the picker never saw
            for p in PROMPTS[1:5]:  # flood x directly: the prefix is evicted there
                await complete(x, p)
            await agrees(m, x)
            await agrees(m, y)
            await asyncio.sleep(0.25)  # the decision-time (speculative) entries have expired
            assert sim_blocks(x, prompt) == 0 and sim_blocks(y, prompt) >= 10
            xk, yk = f"127.0.0.1:{x.port}", f"127.0.0.1:{y.port}"
            hashes = block_hashes(parse_request(Api.COMPLETIONS, body(prompt)).segments, "sim-model",
                                  block_size=cfg.prefix.block_size_bytes, max_blocks=cfg.prefix.max_prefix_blocks)
            assert app.index.match(hashes, [xk, yk]) == {xk: len(hashes)}  # approximate: still on x
            assert precise_blocks(m, x, prompt) == 0 and precise_blocks(m, y, prompt) == sim_blocks(y, prompt)
            again = app.director.route(RequestContext(path="/v1/completions"), body(prompt + " and more"))
            assert again.primary.key == yk and again.precise_usable
            assert again.precise_matched == sim_blocks(y, prompt) and again.matched_blocks == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
