"""prefix_epp_extproc_streams_total{end, closed_by} over real gRPC (extproc/transport/stream_end.py):
a normal end is `complete` whoever closes the call; `reset` only when the stream ends before the
request was answered, or before the end of a response whose body the picker reads; `error` when
the picker failed. Through real Envoy: tests/e2e/test_response_path.py."""

from __future__ import annotations

import grpc
import pytest

from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.runtime.app import App
from testkit.extproc_grpc import Served, open_stream, serving, wait_until
from testkit.extproc_stream import BUFFERED, body_msgs, completion, headers_msg, make_app

NONE = mode.ProcessingMode.NONE


def ends(app: App) -> dict[tuple[str, str], float]:
    """Every (end, closed_by) count, zeros included: all six series are exported from the start."""
    out = {}
    for fam in app.metrics.registry.collect():
        if fam.name == "prefix_epp_extproc_streams":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["end"], s.labels["closed_by"]] = s.value
    return out


def counted(app: App, end: str, closed_by: str) -> bool:
    nonzero = {k: v for k, v in ends(app).items() if v}
    return nonzero == {(end, closed_by): 1.0}


def request_headers(eos: bool = False) -> pb.ProcessingRequest:
    """BUFFERED request body, no static response body: Envoy as `prefix-epp envoy-config` sets it up."""
    msg = headers_msg(eos=eos, body_mode=BUFFERED)
    msg.protocol_config.response_body_mode = NONE
    return msg


async def routed(served: Served) -> grpc.aio.StreamStreamCall:
    """A stream whose request the picker routed (both replies read)."""
    call = open_stream(served)
    await call.write(request_headers())
    assert (await call.read()).HasField("request_headers")
    await call.write(body_msgs(completion())[0])
    assert (await call.read()).request_body.response.header_mutation.set_headers
    return call


@pytest.fixture
def app() -> App:
    return make_app()


async def test_all_six_series_start_at_zero(app: App) -> None:
    assert ends(app) == {(e, c): 0.0 for e in ("complete", "reset", "error") for c in ("proxy", "picker")}


async def test_a_routed_request_ends_complete_when_the_proxy_resets_the_finished_stream(app: App) -> None:
    async with serving(app) as served:
        call = await routed(served)
        call.cancel()  # Envoy's default end: a half-close, then a reset at once
        await wait_until(lambda: counted(app, "complete", "proxy"))


async def test_a_routed_request_ends_complete_when_the_proxy_closes_gracefully(app: App) -> None:
    async with serving(app) as served:
        call = await routed(served)
        await call.done_writing()  # the half-close; the picker then ends the call with a status
        assert await call.code() == grpc.StatusCode.OK
        await wait_until(lambda: counted(app, "complete", "picker"))


async def test_a_client_gone_during_its_upload_ends_reset(app: App) -> None:
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(request_headers())
        assert (await call.read()).HasField("request_headers")
        part = pb.ProcessingRequest()
        part.request_body.body = completion()[:20]  # the body's first bytes, not its end
        await call.write(part)
        await wait_until(lambda: app.metrics.registry.get_sample_value(
            "prefix_epp_extproc_messages_total", {"kind": "request_body"}) == 1)
        call.cancel()
        await wait_until(lambda: counted(app, "reset", "proxy"))


async def test_a_refused_request_ends_complete(app: App) -> None:
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(request_headers())
        assert (await call.read()).HasField("request_headers")
        await call.write(body_msgs(b'{"model": "m", "prompt": "cut')[0])
        assert (await call.read()).immediate_response.status.code == 400
        call.cancel()
        await wait_until(lambda: counted(app, "complete", "proxy"))


@pytest.mark.parametrize(("response_ends", "end"), [(True, "complete"), (False, "reset")])
async def test_where_the_picker_reads_the_response_body_its_end_decides(response_ends: bool, end: str) -> None:
    app = make_app(usage_sample_rate=1.0)  # every response body is asked for (mode_override)
    async with serving(app) as served:
        call = await routed(served)
        chunk = pb.ProcessingRequest()
        chunk.response_body.body = b'data: {"choices": []}\n\n'
        chunk.response_body.end_of_stream = response_ends
        await call.write(chunk)
        assert (await call.read()).HasField("response_body")
        call.cancel()  # the client went away before the response's end, or Envoy's reset after it
        await wait_until(lambda: counted(app, end, "proxy"))


async def test_a_fault_of_the_picker_ends_error(app: App) -> None:
    def boom(*_a: object) -> None:
        raise RuntimeError("scheduler exploded")

    app.director.scheduler.schedule = boom  # type: ignore[method-assign,assignment]
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(request_headers())
        assert (await call.read()).HasField("request_headers")
        await call.write(body_msgs(completion())[0])
        assert (await call.read()).immediate_response.status.code == 500
        call.cancel()
        await wait_until(lambda: counted(app, "error", "proxy"))
