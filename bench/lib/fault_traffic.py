"""Steady traffic for the fault benchmark: paced closed-loop clients, every answer checked whole.

`Traffic(url, clients, rate, ...)` runs `clients` closed-loop clients (each waits for its answer
before sending again) paced to `rate` requests per second in all: client c sends its k-th request
no earlier than `(k + c / clients) * clients / rate` seconds after the start, at once when it is
late (a slow answer lowers the rate, it never queues requests). Requests are /v1/completions of
`max_tokens` tokens; a prompt is one of `system_prompts` shared system prompts (seeded random words,
`bench.lib.workloads.text`) plus its own question, so prefix-aware routing has something to keep;
every other request streams (`stream_options.include_usage`), the rest are answered in one body.
Everything is timed from `Traffic.t0` (perf_counter seconds).

An answer succeeds only when it is complete (`Outcome.kind`):

- `ok`: HTTP 200 and, streamed, a chunk with a `finish_reason`, then `data: [DONE]` before the end
  of the body; not streamed, a JSON body whose first choice has a `finish_reason`;
- `http_<status>`: any other status (Envoy's own 5xx, or the replica's);
- `truncated`: HTTP 200 whose body ended early (a cut connection, a stream without its final chunk
  or `[DONE]`, a body that is not the whole JSON answer): a generation cut after it was routed;
- `connection`: no response at all (refused, reset before the status line);
- `timeout`: no complete answer within `timeout_s`.

`Outcome.routed_to` is where the request went: the replica's `x-served-by`, else the address
Envoy attempted (`x-gateway-destination-endpoint-served`, which Envoy adds to its own replies too),
else "". `Traffic.open_streams()` counts streams whose 200 has arrived and whose body has not
ended: generations in flight at this instant.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.lib.workloads import text
from extproc.transport.responses import SERVED_HEADER

MODEL = "sim-model"


@dataclass(eq=False)  # identity: in flight, an outcome is a member of a set
class Outcome:
    client: int
    seq: int
    stream: bool
    system: int  # which shared system prompt
    sent_s: float  # seconds after Traffic.t0
    end_s: float = 0.0
    status: int = 0
    kind: str = ""
    routed_to: str = ""
    detail: str = ""
    headers_s: float | None = None  # when the response status arrived

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s


async def wait_routed(url: str, attempts: int = 100, interval_s: float = 0.1) -> None:
    """Wait until a tiny completion through `url` is answered by a replica (`x-served-by`, whatever
    the status: a replica answering 500 on purpose still shows that the path works)."""
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for i in range(attempts):
            payload = orjson.dumps({"model": MODEL, "prompt": f"ping {i}", "max_tokens": 1})
            try:
                async with session.post(url + "/v1/completions", data=payload,
                                        headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    if resp.headers.get("x-served-by"):
                        return
                    last = f"status {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(interval_s)
    raise RuntimeError(f"no replica answered through {url}: {last}")


def _finish(choice_holder: Any) -> bool:
    choices = choice_holder.get("choices") if isinstance(choice_holder, dict) else None
    return bool(isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and choices[0].get("finish_reason"))


@dataclass
class Traffic:
    url: str
    clients: int = 6
    rate: float = 20.0
    max_tokens: int = 128
    system_prompts: int = 4
    system_tokens: int = 400
    question_tokens: int = 24
    timeout_s: float = 60.0
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list, init=False)  # finished, in order of their end
    t0: float = field(default=0.0, init=False)
    _open: set[Outcome] = field(default_factory=set, init=False, repr=False)  # sent, not finished
    _streaming: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._systems = [text(rng, self.system_tokens, f"System prompt {i}.") for i in range(self.system_prompts)]
        self._rng = rng

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def open_streams(self) -> int:
        return self._streaming

    def in_flight(self) -> list[Outcome]:
        return list(self._open)

    def payload(self, outcome: Outcome) -> bytes:
        question = text(self._rng, self.question_tokens, f"Question {outcome.client}.{outcome.seq}.")
        body: dict[str, Any] = {"model": MODEL, "prompt": f"{self._systems[outcome.system]} {question}",
                                "max_tokens": self.max_tokens, "stream": outcome.stream}
        if outcome.stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)

    async def run(self, stop: asyncio.Event) -> list[Outcome]:
        """Send until `stop` is set, then wait for the answers in flight; every outcome, by send time."""
        self.t0 = time.perf_counter()
        period = self.clients / self.rate
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, c, period, stop) for c in range(self.clients)))
        return sorted(self.outcomes, key=lambda o: o.sent_s)

    async def _client(self, session: aiohttp.ClientSession, client: int, period: float,
                      stop: asyncio.Event) -> None:
        seq = 0
        while not stop.is_set():
            due = (seq + client / self.clients) * period
            if due > self.now():
                with_stop = asyncio.create_task(stop.wait())
                await asyncio.wait({with_stop}, timeout=due - self.now())
                with_stop.cancel()
                if stop.is_set():
                    return
            outcome = Outcome(client, seq, stream=(client + seq) % 2 == 0,
                              system=self._rng.randrange(self.system_prompts), sent_s=self.now())
            await self._send(session, outcome)
            seq += 1

    async def _send(self, session: aiohttp.ClientSession, o: Outcome) -> None:
        self._open.add(o)
        streaming = False
        try:
            async with session.post(self.url + "/v1/completions", data=self.payload(o),
                                    headers={"content-type": "application/json"}) as resp:
                o.status, o.headers_s = resp.status, self.now()
                o.routed_to = resp.headers.get("x-served-by", "") or resp.headers.get(SERVED_HEADER, "")
                if resp.status != 200:
                    await resp.read()
                    o.kind = f"http_{resp.status}"
                elif o.stream:
                    streaming = True
                    self._streaming += 1
                    o.kind = await _read_stream(resp)
                else:
                    o.kind = _read_body(await resp.read())
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A 200 already received means the generation was routed and then cut.
            o.kind = "truncated" if o.status == 200 else "connection"
            o.detail = f"{type(exc).__name__}: {exc}"[:160]
        except TimeoutError:
            o.kind = "timeout"
        except aiohttp.ClientError as exc:
            o.kind, o.detail = "connection", f"{type(exc).__name__}: {exc}"[:160]
        finally:
            if streaming:
                self._streaming -= 1
            o.end_s = self.now()
            self._open.discard(o)
            self.outcomes.append(o)



async def _read_stream(resp: aiohttp.ClientResponse) -> str:
    finished = done = False
    async for line in resp.content:
        if done:
            continue
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: "):
            try:
                finished = finished or _finish(orjson.loads(line[6:]))
            except orjson.JSONDecodeError:
                return "truncated"
    return "ok" if finished and done else "truncated"


def _read_body(body: bytes) -> str:
    try:
        return "ok" if _finish(orjson.loads(body)) else "truncated"
    except orjson.JSONDecodeError:
        return "truncated"
