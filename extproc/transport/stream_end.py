"""How an ext_proc stream ended, as far as the picker can tell: `prefix_epp_extproc_streams_total`.

`end` (what became of the exchange):
- `complete`: the picker answered the request (routed it, or refused it with an immediate
  response: 400, 408, 413, 429, 503 ...) and, where it reads the response body, saw the
  response's end (a body's end_of_stream, end_of_stream response headers, or response trailers);
- `reset`: the stream ended before that: the client went away during its upload, or during a
  response whose body the picker reads, or the proxy cancelled the stream (a timeout);
- `error`: the picker failed (an internal error, answered with a 500).

`closed_by` (how the call itself was closed; both are normal):
- `proxy`: the proxy reset the call. Envoy's default: when the HTTP request is done it
  half-closes the stream and resets it at once (extproc/transport/call.py);
- `picker`: the proxy half-closed and waited, and the picker ended the call with a status
  (Envoy with `ext_proc_graceful_grpc_close`: `--graceful-ext-proc-close`).

What the picker cannot tell (through Envoy 1.40, tests/e2e/test_response_path.py): Envoy ends the
stream the same way whether the response completed or the client left mid-response, and the
half-close often does not reach the handler before the reset does. Only the response messages
tell them apart, so a request whose response body the picker does not read (the default wiring,
for every request the usage sampler did not pick) counts `complete` once the picker answered it,
even if its client left before the answer ended. Envoy's own access log and downstream reset
stats count those.
"""

from __future__ import annotations

from extproc.pb import external_processor_pb2 as pb
from extproc.telemetry.epp import STREAM_ENDS

COMPLETE, RESET, ERROR = STREAM_ENDS

_REQUEST_ENDS = frozenset({"request_trailers", "response_headers", "response_body", "response_trailers"})


class StreamEnd:
    """The facts `end` is made of, set by the stream's processor as its messages pass."""

    __slots__ = ("answered", "failed", "reads_response", "response_ended")

    def __init__(self) -> None:
        self.answered = False  # the request's last message was handled, or the picker refused the request
        self.reads_response = False  # the response body is sent to the picker: its end comes here
        self.response_ended = False
        self.failed = False

    def handled(self, msg: pb.ProcessingRequest) -> None:
        """A message from the proxy the picker has handled: its replies are made. (Not: written. A
        proxy that resets the stream right after the last reply may cut its write short, and that
        is no client going away.)"""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.answered |= msg.request_headers.end_of_stream
        elif kind == "request_body":
            self.answered |= msg.request_body.end_of_stream
        elif kind in _REQUEST_ENDS:
            self.answered = True
            if kind == "response_headers":
                self.response_ended |= msg.response_headers.end_of_stream
            elif kind == "response_body":
                self.response_ended |= msg.response_body.end_of_stream
            elif kind == "response_trailers":
                self.response_ended = True

    def refused(self) -> None:
        """The picker answered the request itself (an immediate response): no response follows."""
        self.answered = True
        self.reads_response = False

    @property
    def end(self) -> str:
        if self.failed:
            return ERROR
        if self.answered and (self.response_ended or not self.reads_response):
            return COMPLETE
        return RESET
