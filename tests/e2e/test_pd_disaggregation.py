"""Prefill/decode disaggregation through real Envoy configured by `prefix-epp envoy-config`, against
simulated engines given roles with --endpoint-roles and an llm-d-style EndpointPickerConfig
(disagg-profile-handler, prefix-based-pd-decider): the request goes to a decode engine and carries
`x-prefiller-host-port` naming a prefill engine only when the decode engine lacks enough of the
prompt; a client's own copy of the header never reaches an engine.

The simulator echoes the `x-prefiller-host-port` it received as `x-echo-prefiller-host-port`
(prefix_epp_sim/server.py); no sidecar runs here, so the decode engine serves the whole request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import ECHOED_PREFILLER_HEADER, run_replicas
from testkit.envoy import run_envoy
from testkit.pd import LLMD_PD
from testkit.picker import Picker, picker_for, until, value

pytestmark = pytest.mark.e2e

SIM = SimConfig(time_scale=50.0, kv_events=False, max_model_len=4096)
PREFILLER = "x-prefiller-host-port"
FORGED = "10.9.9.9:8000"
EXPLAIN = "x-prefix-epp-decision"
# ~2,000 bytes, ~500 tokens: far above nonCachedTokens 48 on an engine that has not seen it.
LONG = "You are the support desk of a bicycle shop; answer in full sentences. " * 28 + "Which tyre fits?"


@contextlib.asynccontextmanager
async def pd_path(tmp: Path) -> AsyncIterator[tuple[Picker, str, list[str], list[str]]]:
    """Two prefill and two decode engines, the picker with the P/D config, Envoy in front."""
    async with run_replicas(SIM, 4, base_port=0) as reps:
        addresses = [r.address for r in reps]
        prefill, decode = addresses[:2], addresses[2:]
        config = tmp / "pd.yaml"
        config.write_text(LLMD_PD)
        roles = ",".join([f"{a}=prefill" for a in prefill] + [f"{a}=decode" for a in decode])
        picker = picker_for(tmp, addresses, "--config-file", str(config), "--endpoint-roles", roles,
                            "--explain-decisions", "--seed", "3")
        await asyncio.to_thread(picker.start)  # the simulated engines keep running in this loop meanwhile
        try:
            with contextlib.ExitStack() as stack:
                _, listen, _ = await asyncio.to_thread(stack.enter_context, run_envoy(tmp, picker.grpc_port))
                await until(picker, lambda m: all(
                    value(m, "prefix_epp_endpoint_in_rotation", endpoint=a) == 1 for a in addresses))
                yield picker, f"http://127.0.0.1:{listen}/v1/completions", prefill, decode
        finally:
            await asyncio.to_thread(picker.stop)


async def send(s: aiohttp.ClientSession, url: str, prompt: str, forged: bool) -> tuple[str, str | None, str]:
    """(served by, the x-prefiller-host-port the engine received or None, the decision explained)."""
    headers = {PREFILLER: FORGED} if forged else {}
    body = {"model": SIM.model_names[0], "prompt": prompt, "max_tokens": 4}
    async with s.post(url, json=body, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200, resp.headers
        return resp.headers["x-served-by"], resp.headers.get(ECHOED_PREFILLER_HEADER), resp.headers[EXPLAIN]


async def test_a_long_prompt_is_prefilled_elsewhere_once_and_forged_headers_never_arrive(tmp_path: Path) -> None:
    async with pd_path(tmp_path) as (picker, url, prefill, decode), aiohttp.ClientSession() as s:
        # New to every engine: decoded on a decode engine, prefilled on a prefill engine it names.
        served, prefiller, why = await send(s, url, LONG, forged=True)
        assert served in decode and prefiller in prefill, (served, prefiller, why)
        assert "pd=disaggregated" in why and f"prefill={prefiller} " in why and f"endpoint={served};" in why

        # The same prompt again: its decode engine holds it, nothing to prefill elsewhere.
        again, prefiller, why = await send(s, url, LONG, forged=True)
        assert again == served and prefiller is None and "pd=decode-only" in why, why

        # A short prompt is not worth a prefill elsewhere; the forged header is gone all the same.
        short, prefiller, why = await send(s, url, "Hello?", forged=True)
        assert short in decode and prefiller is None and "pd=decode-only" in why, why

        after = await until(picker, lambda m: value(m, "prefix_epp_requests_total", outcome="routed",
                                                    status="200") == 3)
        assert value(after, "prefix_epp_pd_decisions_total", decision="disaggregated") == 1
        assert value(after, "prefix_epp_pd_decisions_total", decision="decode-only") == 2
        # Both endpoints were charged for the disaggregated request, and both released at its end.
        for endpoint in (*prefill, *decode):
            assert value(after, "prefix_epp_inflight_requests", endpoint=endpoint) == 0
