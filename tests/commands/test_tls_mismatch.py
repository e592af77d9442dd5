"""A gateway dialling the TLS picker in plaintext is logged as such (extproc/transport/tls_mismatch.py):
with real Envoy (`envoy-config --epp-tls=false`) in front of `serve --secure-serving=true`, the client's
500 comes with one structured warning in the picker's log naming the flags that fix it; the relay
passes every byte of stderr through unchanged."""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

from extproc.transport.tls_mismatch import EVERY_S, Reporter, relay
from testkit.envoy import run_envoy, wait_until
from testkit.picker import picker_for

GRPC_LINE = (b"I1207 19:41:40.467015   19641 ssl_transport_security.cc:2563] Handshake failed with error "
             b"SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate "
             b"verification context\n")


def warnings(log: str) -> list[dict[str, object]]:
    docs = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [d for d in docs if d.get("kind") == "plaintext-to-tls"]


def test_plaintext_envoy_on_a_tls_picker_is_named_in_the_pickers_log(tmp_path: Path) -> None:
    picker = picker_for(tmp_path, ["127.0.0.1:9"], "--refresh-metrics-interval=0", secure=True)
    picker.start()
    try:
        with run_envoy(tmp_path, picker.grpc_port, epp_tls=False) as (_, listen, _):
            request = urllib.request.Request(f"http://127.0.0.1:{listen}/v1/completions", method="POST",
                                             data=b'{"model":"m","prompt":"hi"}',
                                             headers={"content-type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=10)
                status = 200
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status == 500
            assert picker.proc is not None
            proc = picker.proc
            wait_until(lambda: warnings(proc.log_text()), timeout=10, what="the TLS mismatch warning")
    finally:
        picker.stop()
    log = picker.log.read_text()
    [warning] = warnings(log)  # once, though Envoy's health checks and the request failed several times
    assert warning["level"] == "warning" and warning["handshakes_failed"] == 1
    fix = str(warning["fix"])
    assert "--epp-tls" in fix and "--secure-serving=false" in fix and "tls.enabled" in fix
    assert "WRONG_VERSION_NUMBER" in log  # gRPC's own line is passed on unchanged
    assert "drained" in log  # and the picker's last lines reach the log before it exits


def test_the_first_failure_is_logged_then_one_a_minute_with_the_count() -> None:
    now = [0.0]
    reporter = Reporter(clock=lambda: now[0])
    seen: list[int] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.handshakes_failed)  # type: ignore[attr-defined]

    handler = Keep()
    logging.getLogger("prefix_epp.tls").addHandler(handler)
    try:
        reporter.feed(GRPC_LINE[:50])  # a line split across reads counts once, when it ends
        assert seen == []
        reporter.feed(GRPC_LINE[50:] + GRPC_LINE + b'{"msg":"other"}\n')
        now[0] = EVERY_S - 1
        reporter.feed(GRPC_LINE.replace(b"WRONG_VERSION_NUMBER", b"HTTP_REQUEST"))
        reporter.feed(GRPC_LINE.replace(b"WRONG_VERSION_NUMBER", b"CERTIFICATE_VERIFY_FAILED"))  # another fault
        now[0] = EVERY_S
        reporter.feed(GRPC_LINE)
    finally:
        logging.getLogger("prefix_epp.tls").removeHandler(handler)
    assert seen == [1, 3]


def test_the_relay_passes_every_byte_through() -> None:
    source_r, source_w = os.pipe()
    sink_r, sink_w = os.pipe()
    data = GRPC_LINE + bytes(range(256)) * 1000 + b"no newline at the end"
    copier = threading.Thread(target=relay, args=(source_r, sink_w, Reporter()))
    copier.start()
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(iter_read(sink_r)))
    reader.start()
    write_all(source_w, data)
    os.close(source_w)
    copier.join(timeout=10)
    os.close(sink_w)
    reader.join(timeout=10)
    os.close(source_r)
    os.close(sink_r)
    assert bytes(received) == data


def iter_read(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.read(fd, 65536):
        out += chunk
    return bytes(out)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
