"""Drive the ext_proc stream state machine message by message, without gRPC or Envoy.

- `make_app(n, **config)`: an `App` with `n` endpoints 10.0.0.1..n:8000, synced, seed 3;
  keyword arguments are `EppConfig` fields.
- `headers_msg(...)`: a request_headers message (path, method, extra headers, body mode, an
  optional `envoy.lb.subset_hint` subset); `body_msgs(body, chunk)`: the body cut into
  request_body (or response_body) messages, the last one end_of_stream.
- `drive(app, msgs)`: the responses a `StreamProcessor` gives to that message sequence.
- `completion(prompt)`: an OpenAI completion body; `destination(resp)`: the endpoint a response
  routes to (header and dynamic metadata checked to agree); `error_body(imm)`: the OpenAI-style
  error object of an ImmediateResponse, its shape checked.
- `DUPLEX`, `BUFFERED`: the request body modes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import orjson

from extproc.config.settings import EppConfig
from extproc.core.datastore import EndpointSpec
from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.runtime.app import App
from extproc.transport.processor import StreamProcessor

DUPLEX = mode.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = mode.ProcessingMode.BUFFERED


def make_app(n: int = 3, **kw: object) -> App:
    app = App(EppConfig(seed=3, **kw))  # type: ignore[arg-type]
    app.datastore.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    app.datastore.synced = True
    return app


def headers_msg(path: str = "/v1/completions", eos: bool = False, body_mode: int = DUPLEX,
                extra: Sequence[tuple[str, str]] = (), subset: list[str] | None = None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    for k, v in ((":path", path), (":method", "GET" if eos else "POST"), *extra):
        h = msg.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    msg.request_headers.end_of_stream = eos
    msg.protocol_config.request_body_mode = body_mode  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = DUPLEX
    if subset is not None:
        lst = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"].list_value
        for s in subset:
            lst.values.add().string_value = s
    return msg


def body_msgs(body: bytes, chunk: int = 1 << 20, response: bool = False) -> list[pb.ProcessingRequest]:
    out = []
    for start in range(0, max(len(body), 1), chunk):
        msg = pb.ProcessingRequest()
        part = msg.response_body if response else msg.request_body
        part.body = body[start:start + chunk]
        part.end_of_stream = start + chunk >= len(body)
        out.append(msg)
    return out


async def drive(app: App, msgs: Sequence[pb.ProcessingRequest], explain: bool = False) -> list[pb.ProcessingResponse]:
    proc = StreamProcessor(app.director, app.metrics, explain, app.body_budget)

    async def gen() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    out = [r async for r in proc.run(gen())]
    # In memory nothing above yields to the loop, where gRPC's sends would: one turn lets what the
    # picker does after an answer (the index records, extproc/scheduling/scheduler.py) run.
    await asyncio.sleep(0)
    return out


def completion(prompt: str = "hello " * 50) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt})


def destination(resp: pb.ProcessingResponse) -> str:
    common = resp.request_body.response if resp.HasField("request_body") else resp.request_headers.response
    sets = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    md = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    assert sets["x-gateway-destination-endpoint"] == md
    assert common.clear_route_cache
    return str(md)



def error_body(imm: pb.ImmediateResponse) -> dict[str, object]:
    """The OpenAI-style error object of an ImmediateResponse, after checking its content type."""
    sets = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    assert sets["content-type"] == "application/json"
    parsed = orjson.loads(imm.body)
    assert set(parsed) == {"error"}
    err: dict[str, object] = parsed["error"]
    assert err["code"] == imm.status.code and isinstance(err["message"], str) and isinstance(err["type"], str)
    return err
