"""Precise prefix routing through real Envoy and the picker process, against simulated engines.

Two replicas x (routed to) and y share nothing at first. Prompt A goes through Envoy to x; the
same prompt goes to y directly (traffic the picker never sees); then x is flooded directly until
A is evicted there. The approximate index still places A on x; the engines' KV events say y.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from prefix_epp_sim.server import Replica, run_replicas
from testkit.envoy import run_envoy
from testkit.http_client import post
from testkit.kvevents import PROMPTS, SIM, complete, sim_blocks, spec_for
from testkit.picker import Picker, picker_for, until, value

pytestmark = pytest.mark.e2e


@contextlib.asynccontextmanager
async def precise_stack(tmp: Path, scorer: str) -> AsyncIterator[tuple[list[Replica], Picker, str]]:
    async with run_replicas(SIM.replace(kv_events_replay_port_base=0), 2, base_port=0) as reps:
        endpoints = [f"127.0.0.1:{r.port}@{spec_for(r).kv_events_endpoint}" for r in reps]
        picker = picker_for(tmp, endpoints, "--prefix-scorer", scorer, "--kv-events", "--explain-decisions",
                            "--seed", "1", "--kv-events-speculative-ttl", "200ms", "--usage-sample-rate", "1",
                            name=f"picker-{scorer}")
        await asyncio.to_thread(picker.start)  # the simulated engines keep running in this loop meanwhile
        try:
            with contextlib.ExitStack() as stack:
                # Buffered request bodies: Envoy then honours the picker's request for response bodies.
                _, listen, _ = await asyncio.to_thread(stack.enter_context, run_envoy(
                    tmp, picker.grpc_port, name=f"envoy-{scorer}", request_body_mode="BUFFERED"))
                yield reps, picker, f"http://127.0.0.1:{listen}/v1/completions"
        finally:
            await asyncio.to_thread(picker.stop)


@pytest.mark.parametrize("scorer", ["precise", "approximate"])
async def test_routing_and_closed_loop_after_eviction(tmp_path: Path, scorer: str) -> None:
    prompt = PROMPTS[0]
    async with precise_stack(tmp_path, scorer) as (reps, picker, url), aiohttp.ClientSession() as s:
        first = await post(s, url, {"model": "sim-model", "prompt": prompt, "max_tokens": 4})
        assert first.status == 200 and first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        x = next(r for r in reps if r.address == first.served_by)
        y = next(r for r in reps if r is not x)
        await complete(y, prompt)  # not through the picker
        for p in PROMPTS[1:5]:  # flood x directly until the prompt is evicted there
            await complete(x, p)
        assert sim_blocks(x, prompt) == 0 and sim_blocks(y, prompt) >= 10
        published = sum(r.publisher.next_sequence for r in reps if r.publisher is not None)
        await until(picker, lambda m: value(m, "prefix_epp_kv_events_messages_total") == published)
        await asyncio.sleep(0.3)  # past the speculative TTL of the first decision

        second = await post(s, url, {"model": "sim-model", "prompt": prompt + "and more", "max_tokens": 4})
        assert second.status == 200
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        explain = second.headers["x-prefix-epp-decision"]
        if scorer == "precise":  # the engines' events: y holds the prefix, x lost it
            assert second.served_by == y.address and cached == 16 * sim_blocks(y, prompt), explain
            assert f"precise={sim_blocks(y, prompt)}/" in explain and "fallback" not in explain
        else:  # the approximate index still believes x holds it: a miss
            assert second.served_by == x.address and cached == 0, explain

        m = await until(picker, lambda m: value(m, "prefix_epp_cached_tokens_predictions_total",
                                                scorer="precise") == 2)
        assert value(m, "prefix_epp_cached_tokens_predictions_total", scorer="approximate") == 2
        precise_err = value(m, "prefix_epp_cached_tokens_prediction_error_tokens_sum", scorer="precise")
        approx_err = value(m, "prefix_epp_cached_tokens_prediction_error_tokens_sum", scorer="approximate")
        assert precise_err == 0 < approx_err, (precise_err, approx_err)
        assert value(m, "prefix_epp_cached_tokens_predicted_within_one_block_total", scorer="precise") == 2
        assert value(m, "prefix_epp_cached_tokens_predicted_within_one_block_total", scorer="approximate") == 1
        assert value(m, "prefix_epp_kv_events_endpoint_usable", endpoint=f"127.0.0.1:{x.port}") == 1
        assert value(m, "prefix_epp_kv_events_gaps_total") == 0
