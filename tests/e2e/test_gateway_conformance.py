"""A conformance-style suite per known gateway behaviour (testkit/gateways.py), on real Envoy
configurations: Envoy Gateway, Envoy AI Gateway with BUFFERED and with full-duplex bodies, and
Istio-style served metadata. For each: every request shape routes by prefix and keeps its
endpoint across turns; bodies arrive intact; errors reach the client as JSON; bodiless requests
route; in-flight counts are released when responses end; the destination list names only the
pool's endpoints, as many as the gateway can walk; and a dead first choice is survived, with the
accounting moved to the endpoint that served where (and only where) the gateway reports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.gateways import GATEWAYS, Gateway
from testkit.http_client import chat, completion, get, post
from testkit.picker import until, value
from testkit.stack import Stack, stack

pytestmark = pytest.mark.e2e

DEAD = "127.0.0.1:1"  # nothing listens on port 1


@pytest.fixture(scope="module", params=GATEWAYS, ids=lambda g: g.name)
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Stack]]:
    gateway: Gateway = request.param
    with stack(tmp_path_factory.mktemp(gateway.name), 3, *_args(gateway), gateway=gateway) as st:
        yield gateway, st


def _args(gateway: Gateway) -> tuple[str, ...]:
    return ("--max-endpoints", str(gateway.max_endpoints), "--seed", "5")


def _system(group: int) -> str:
    rng = random.Random(group)
    return " ".join("".join(rng.choice("klmnopqrst") for _ in range(7)) for _ in range(250))


def _turn(shape: str, group: int, turn: int) -> tuple[str, dict[str, Any]]:
    history: list[dict[str, Any]] = []
    for t in range(turn + 1):
        history.append({"role": "user", "content": f"question {t}"})
        if t < turn:
            history.append({"role": "assistant", "content": f"answer {t}"})
    if shape == "chat":
        return "/v1/chat/completions", chat([{"role": "system", "content": _system(group)}, *history])
    if shape == "messages":
        return "/v1/messages", {"model": "m", "max_tokens": 4, "system": _system(group), "messages": history}
    return "/v1/responses", {"model": "m", "instructions": _system(group), "input": history}


async def _destinations(st: Stack) -> set[str]:
    """The endpoints the picker named in x-gateway-destination-endpoint over a few requests."""
    seen: set[str] = set()
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            r = await post(s, f"{st.url}/v1/completions", completion(f"list {i} " * 40))
            assert r.status == 200, r.body[:300]
            seen.update(r.json()["headers"]["x-gateway-destination-endpoint"].split(","))
            assert len(r.json()["headers"]["x-gateway-destination-endpoint"].split(",")) <= 2
    return seen


@pytest.mark.parametrize("shape", ["chat", "messages", "responses"])
async def test_every_shape_sticks_to_its_endpoint(gw: tuple[Gateway, Stack], shape: str) -> None:
    _, st = gw
    homes = set()
    async with aiohttp.ClientSession() as s:
        for group in range(4):
            served = set()
            for turn in range(3):
                path, body = _turn(shape, group, turn)
                r = await post(s, f"{st.url}{path}", body)
                assert r.status == 200, r.body[:300]
                served.add(r.served_by)
            assert len(served) == 1, (shape, group, served)
            homes |= served
    assert homes <= set(st.backends)


async def test_bodies_arrive_intact_errors_are_json_and_bodiless_requests_route(gw: tuple[Gateway, Stack]) -> None:
    _, st = gw
    rng = random.Random(3)
    prompt = "".join(rng.choice("abcdefgh \n") for _ in range(300_000))
    sent = completion(prompt)
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"{st.url}/v1/completions", sent)
        assert r.status == 200
        raw = json.dumps(sent).encode()  # what testkit.http_client.post sends
        assert r.json()["body_sha256"] == hashlib.sha256(raw).hexdigest()
        bad = await post(s, f"{st.url}/v1/chat/completions", raw=b'{"model": "m", "messages": ')
        assert bad.status == 400 and bad.json()["error"]["type"] == "BadRequestError"
        models = await get(s, f"{st.url}/v1/models")
        assert models.status == 200 and models.served_by in st.backends


async def test_in_flight_counts_are_released_when_responses_end(gw: tuple[Gateway, Stack]) -> None:
    _, st = gw
    async with aiohttp.ClientSession() as s:
        replies = await asyncio.gather(*(post(s, f"{st.url}/v1/chat/completions",
                                              {**chat([{"role": "user", "content": f"stream {i}"}]), "stream": True})
                                         for i in range(6)))
    assert all(r.status == 200 and b"[DONE]" in r.body for r in replies)

    def released(samples: dict[Any, float]) -> bool:
        return all(value(samples, "prefix_epp_inflight_requests", endpoint=ep) == 0 for ep in st.backends)
    await until(st.picker, released)


async def test_fallbacks_name_only_the_pool_and_as_many_as_the_gateway_walks(gw: tuple[Gateway, Stack]) -> None:
    gateway, st = gw
    named = await _destinations(st)
    assert named <= set(st.backends)
    if not gateway.fallbacks:  # ORIGINAL_DST takes one endpoint: the picker must name one
        async with aiohttp.ClientSession() as s:
            r = await post(s, f"{st.url}/v1/completions", completion("one"))
        assert "," not in r.json()["headers"]["x-gateway-destination-endpoint"]


@pytest.mark.parametrize("gateway", [g for g in GATEWAYS if g.fallbacks], ids=lambda g: g.name)
async def test_a_dead_first_choice_is_survived_and_accounted_where_it_is_reported(
        gateway: Gateway, tmp_path: Path) -> None:
    """A pool with a dead endpoint (nothing listens): the gateway walks past it. Where the gateway
    reports the served endpoint, the picker moves the prefix record there and later turns go to
    the live endpoint first; without the report the record stays on the dead one (it keeps being
    chosen first, and each turn is served by whichever fallback comes second)."""
    with stack(tmp_path, 2, *_args(gateway), gateway=gateway, dead_endpoints=(DEAD,)) as st:
        await _survive_dead_first(gateway, st)


async def _survive_dead_first(gateway: Gateway, st: Stack) -> None:
    firsts: list[list[str]] = []
    async with aiohttp.ClientSession() as s:
        for p in range(12):
            prompt = f"conversation {p}: " + f"a long shared prefix {p} " * 50
            choices = []
            for _ in range(3):
                r = await post(s, f"{st.url}/v1/completions", completion(prompt))
                assert r.status == 200 and r.served_by in st.backends, r.body[:300]
                choices.append(r.json()["headers"]["x-gateway-destination-endpoint"].split(",")[0])
            firsts.append(choices)
    dead_first = [c for c in firsts if c[0] == DEAD]
    assert dead_first, firsts  # the dead endpoint was chosen first at least once
    if gateway.served_metadata:
        # The served report moved the prefix record to the live endpoint: later turns go there first.
        assert all(DEAD not in c[1:] for c in dead_first), dead_first
    else:  # nobody told the picker: the record stays where it was put, and so does the first choice
        assert any(DEAD in c[1:] for c in dead_first), dead_first
    await until(st.picker, lambda samples: value(samples, "prefix_epp_inflight_requests", endpoint=DEAD) == 0)
