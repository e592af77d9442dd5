"""`--scheduler cache-aware` through real Envoy and the picker as a real process."""

from __future__ import annotations

import random
from collections import Counter

import aiohttp
import pytest

from testkit.http_client import completion, gather_limited, post
from testkit.stack import stack

pytestmark = pytest.mark.e2e

SYSTEM = "You are a meticulous assistant for the ACME support desk. " * 30  # ~1.7 KB shared prefix


async def test_a_shared_prefix_stays_on_one_replica_and_unrelated_prompts_spread(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with stack(tmp_path_factory.mktemp("cache-aware"), 3, "--scheduler", "cache-aware", "--explain-decisions",
               "--seed", "7") as s:
        url = f"{s.url}/v1/completions"
        async with aiohttp.ClientSession() as session:
            sticky = [await post(session, url, completion(SYSTEM + f"Question {i}?")) for i in range(12)]
            assert all(r.status == 200 for r in sticky)
            assert len({r.served_by for r in sticky}) == 1
            explain = sticky[-1].headers["x-prefix-epp-decision"]
            assert explain.startswith(f"endpoint={sticky[0].served_by}") and "matched=27/28" in explain
            assert "cache-aware-scorer=" in explain and "predicted_ttft_ms" not in explain
            rng = random.Random(5)
            prompts = [f"{i} " + "".join(rng.choice("abcdefgh ") for _ in range(400)) for i in range(60)]
            spread = await gather_limited([post(session, url, completion(p)) for p in prompts], 6)
        assert all(r.status == 200 for r in spread)
        counts = Counter(r.served_by for r in spread)  # misses: the least loaded, equal loads drawn at random
        assert set(counts) == set(s.backends), counts
        assert min(counts.values()) >= 8, counts
