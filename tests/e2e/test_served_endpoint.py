"""x-gateway-destination-endpoint-served through real Envoy: with a dead first choice, Envoy's
retry walks the picker's fallback list, reports the endpoint that served the request, and the
picker moves its prefix-index record (and in-flight count) there, so the next request with the
same prefix goes straight to the live endpoint instead of the dead one."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from testkit.http_client import completion, post
from testkit.stack import stack

pytestmark = pytest.mark.e2e

DEAD = "127.0.0.1:1"  # nothing listens on port 1


def first_choice(headers: dict[str, str]) -> str:
    return headers["x-prefix-epp-decision"].split(";")[0].removeprefix("endpoint=")


async def test_dead_first_choice_moves_the_record_to_the_endpoint_that_served(tmp_path: Path) -> None:
    with stack(tmp_path, 1, "--max-endpoints", "2", "--explain-decisions", "--seed", "11",
               envoy_endpoints=True, dead_endpoints=(DEAD,)) as st:
        live = st.backends[0]
        firsts: dict[int, list[str]] = {}
        async with aiohttp.ClientSession() as s:
            for p in range(10):
                prompt = f"conversation {p}: " + f"the same long prefix {p} " * 60
                for _ in range(3):
                    r = await post(s, f"{st.url}/v1/completions", completion(prompt))
                    assert r.status == 200, r.body[:300]
                    assert r.served_by == live
                    # Envoy reports the address that really answered (envoy-config's route).
                    assert r.headers["x-gateway-destination-endpoint-served"] == live
                    firsts.setdefault(p, []).append(first_choice(r.headers))
    assert any(choices[0] == DEAD for choices in firsts.values()), f"the dead endpoint was never first: {firsts}"
    for p, choices in firsts.items():
        # After the first request the prefix is recorded on the endpoint that served it.
        assert choices[1:] == [live, live], (p, choices)
