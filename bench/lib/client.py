"""Open-loop load generator: replays a workload against a router (or several gateways), timing every request.

Each session becomes a task that sleeps until its planned start (workload time divided by
`time_scale`), then sends its turns in order; a conversation's next turn waits for the previous
response plus the planned think time and carries the answer actually received. Arrivals never
wait for earlier responses (open loop), so a slow router builds queues instead of slowing the
offered load. `lag_s` records how late a session started against its plan (a busy client
machine shows up there, not in the router's figures).

Every request streams (`stream: true`, `stream_options.include_usage`), in its API's events
(completions and chat chunks; Anthropic Messages and OpenAI Responses events for /v1/messages and
/v1/responses, as vLLM and the simulator send them):
- TTFT: from sending the request to the first chunk with non-empty content (completion `text`,
  chat `delta.content`, a Messages `text_delta`, a Responses `output_text.delta`), measured here,
  at the client; a stream whose tokens never decode to
  text (a random model's answer of partial UTF-8 bytes, on real vLLM) takes its first chunk
  with a choice instead, which vLLM sends for every token;
- end-to-end latency: to the end of the stream;
- prompt, cached (`usage.prompt_tokens_details.cached_tokens`) and completion tokens: from the
  final usage chunk (a Messages stream's `message_delta`: input + cache-read tokens, cache-read
  tokens, output tokens; a Responses stream's `response.completed`);
- the replica that answered: the `x-served-by` response header (Envoy and sglang-router pass it);
- the picker's explanation of its choice, where it was asked for (`--explain-decisions`: the
  `x-prefix-epp-decision` response header), kept in each request's raw record.
Times are in model seconds: wall seconds x `time_scale` (1 when the replicas run in real time).
A request fails (`ok` false) on a non-200 status, a transport error, or a stream without usage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.lib.workloads import Session, Workload, body
from extproc.transport.processor import EXPLAIN_HEADER as DECISION_HEADER

REQUEST_TIMEOUT_S = 600.0


@dataclass
class RequestResult:
    session: int
    turn: int
    label: str
    sent_s: float  # when it was sent, model seconds after the run began
    lag_s: float  # how late against the plan (first turns only; 0 for later turns)
    status: int = 0  # HTTP status; 0 for a transport error
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    served_by: str = ""
    error: str = ""
    gateway: int = 0  # which of run()'s base URLs it was sent to
    decision: str = ""  # the picker's explanation, where it was asked for (--explain-decisions)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class RunResult:
    requests: list[RequestResult]
    wall_s: float  # first send to last response, model seconds


_DELTAS = ("content_block_delta", "response.output_text.delta")  # Messages' and Responses' text events


def _content(chunk: dict[str, object]) -> str:
    kind, delta = chunk.get("type"), chunk.get("delta")
    if kind == "content_block_delta":
        return str(delta.get("text") or "") if isinstance(delta, dict) else ""
    if kind == "response.output_text.delta":
        return str(delta or "")
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if "text" in choice:
        return str(choice.get("text") or "")
    delta = choice.get("delta")
    return str(delta.get("content") or "") if isinstance(delta, dict) else ""


def _usage(chunk: dict[str, Any]) -> Any:
    """The event's usage in the chat form (prompt, completion and cached tokens), or None: a Messages
    stream's `message_delta` (Anthropic counts cached input apart from `input_tokens`), a Responses
    stream's `response.completed`, a completions or chat stream's usage chunk."""
    kind = chunk.get("type")
    if kind == "message_delta" and isinstance(chunk.get("usage"), dict):
        u = chunk["usage"]
        cached = int(u.get("cache_read_input_tokens") or 0)
        prompt = int(u.get("input_tokens") or 0) + cached + int(u.get("cache_creation_input_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": u.get("output_tokens"),
                "prompt_tokens_details": {"cached_tokens": cached}}
    response = chunk.get("response")
    if kind == "response.completed" and isinstance(response, dict) and isinstance(response.get("usage"), dict):
        u = response["usage"]
        details = u.get("input_tokens_details")
        return {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens"),
                "prompt_tokens_details": details if isinstance(details, dict) else None}
    return chunk.get("usage")


async def send(session: aiohttp.ClientSession, url: str, payload: dict[str, object],
               result: RequestResult, time_scale: float, headers: Mapping[str, str] | None = None) -> str:
    """Send one streaming request (with `headers` beside the content type), fill `result`, return
    the answer text."""
    start = time.perf_counter()
    answer: list[str] = []
    first_choice_s: float | None = None
    try:
        async with session.post(url, data=orjson.dumps(payload),
                                headers={"content-type": "application/json", **(headers or {})}) as resp:
            result.status = resp.status
            result.served_by = resp.headers.get("x-served-by", "")
            result.decision = resp.headers.get(DECISION_HEADER, "")
            if resp.status != 200:
                result.error = (await resp.text())[:200]
                return ""
            usage: Any = None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if first_choice_s is None and (chunk.get("choices") or chunk.get("type") in _DELTAS):
                    first_choice_s = (time.perf_counter() - start) * time_scale
                piece = _content(chunk)
                if piece:
                    if result.ttft_s is None:
                        result.ttft_s = (time.perf_counter() - start) * time_scale
                    answer.append(piece)
                usage = _usage(chunk) or usage
            if not isinstance(usage, dict):
                result.error = "stream ended without usage"
                return ""
            if result.ttft_s is None:
                result.ttft_s = first_choice_s
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            result.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.e2e_s = (time.perf_counter() - start) * time_scale
    return "".join(answer)


async def _session(client: aiohttp.ClientSession, base_urls: Sequence[str], s: Session, t0: float,
                   time_scale: float, out: list[RequestResult]) -> None:
    await asyncio.sleep(max(0.0, t0 + s.start_s / time_scale - time.perf_counter()))
    answers: list[str] = []
    for turn in range(s.turns):
        if turn:
            await asyncio.sleep(s.think_s[turn - 1] / time_scale)
        now = time.perf_counter()
        lag = max(0.0, (now - t0) * time_scale - s.start_s) if turn == 0 else 0.0
        gateway = (s.id + turn) % len(base_urls)
        result = RequestResult(s.id, turn, s.label, (now - t0) * time_scale, lag, gateway=gateway)
        path, payload = body(s, turn, answers)
        answers.append(await send(client, base_urls[gateway] + path, payload, result, time_scale))
        out.append(result)


async def run(base_url: str | Sequence[str], workload: Workload, time_scale: float = 1.0) -> RunResult:
    """Replay `workload` against `base_url` (e.g. http://127.0.0.1:8081); return every request.

    Several base URLs (gateways that each ask their own picker): a session's turn k goes to
    gateway (session id + k) mod n, so every gateway sees every prefix group and a conversation's
    turns move from gateway to gateway, the worst case for pickers that do not share what they
    routed; each result says its gateway.
    """
    urls = (base_url,) if isinstance(base_url, str) else tuple(base_url)
    out: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_session(client, urls, s, t0, time_scale, out) for s in workload.sessions))
        wall = (time.perf_counter() - t0) * time_scale
    out.sort(key=lambda r: (r.sent_s, r.session, r.turn))
    return RunResult(out, wall)


async def probe(base_url: str, attempts: int = 100, interval_s: float = 0.1,
                sampling: Mapping[str, Any] | None = None) -> None:
    """Wait until one tiny completion (under one block: it caches nothing) succeeds end to end;
    `sampling`: the workload's extra body fields (`Session.sampling`), sent with it."""
    payload = {"model": "sim-model", "prompt": "ping", "max_tokens": 1, "stream": True,
               "stream_options": {"include_usage": True}, **(sampling or {})}
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        for _ in range(attempts):
            result = RequestResult(-1, 0, "probe", 0.0, 0.0)
            await send(client, base_url + "/v1/completions", payload, result, 1.0)
            if result.ok:
                return
            last = f"status {result.status} {result.error}"
            await asyncio.sleep(interval_s)
    raise RuntimeError(f"router at {base_url} never answered: {last}")
