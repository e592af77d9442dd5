"""Hostile HTTP through real Envoy and the picker, with raw sockets (what aiohttp would refuse to send).

A seeded random mix of requests with non-UTF-8 header bytes, invalid and deeply nested bodies,
huge numbers, chunked bodies, lying content-lengths and clients that vanish mid-request. Every
answered request must get a status the picker or Envoy produce on purpose, every error from the
picker an OpenAI-style JSON body; afterwards the picker is alive, has logged no internal error,
its in-flight gauge is back at zero and a normal request is routed.
"""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.envoy import wait_until
from testkit.stack import stack

pytestmark = pytest.mark.e2e

REQUESTS = 160
BODIES = [
    b'{"model": "m", "prompt": "hello"}',
    b'{"model": "m", "prompt": ',
    b'{"model": 7, "prompt": {"a": [1, 2]}}',
    b'{"model": "m", "prompt": ' + b"[" * 600 + b"]" * 600 + b"}",
    b'{"model": "m", "prompt": "p", "max_tokens": ' + b"9" * 400 + b"}",
    b'{"model": "m\xff\xfe", "prompt": "\xc3\x28"}',
    b"",
    b"[]",
    b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
]


def _request(rng: random.Random, port: int) -> bytes:
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models"])
    body = rng.choice(BODIES) if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(rng.randrange(300)))
    headers = [f"host: 127.0.0.1:{port}".encode(), b"content-type: application/json"]
    for name in rng.sample([b"test-epp-endpoint-selection", b"x-gateway-inference-objective", b"x-request-id",
                            b"x-gateway-destination-endpoint"], rng.randrange(3)):
        value = bytes(rng.choice([*range(0x21, 0x7f), *range(0x80, 0x100)]) for _ in range(rng.randrange(1, 20)))
        headers.append(name + b": " + value)
    method = b"GET" if path == "/v1/models" and rng.random() < 0.5 else b"POST"
    if method == b"GET":
        return b"GET " + path.encode() + b" HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\n\r\n"
    head = b"POST " + path.encode() + b" HTTP/1.1\r\n" + b"\r\n".join(headers)
    if rng.random() < 0.3:  # chunked
        out = head + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        pos = 0
        while pos < len(body):
            n = rng.randrange(1, 64)
            out += f"{len(body[pos:pos + n]):x}\r\n".encode() + body[pos:pos + n] + b"\r\n"
            pos += n
        return out + b"0\r\n\r\n"
    return head + f"\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the headers")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def _inflight(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "prefix_epp_inflight_requests")


def test_hostile_requests_through_envoy(tmp_path: Path) -> None:
    rng = random.Random(12)
    with stack(tmp_path, 2) as st:
        statuses: dict[int, int] = {}
        for _ in range(REQUESTS):
            raw = _request(rng, st.envoy_port)
            with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=10) as sock:
                if rng.random() < 0.15:  # the client vanishes half-way through its request
                    sock.sendall(raw[:rng.randrange(1, max(2, len(raw)))])
                    continue
                sock.sendall(raw)
                status, headers, body = _read_reply(sock)
            statuses[status] = statuses.get(status, 0) + 1
            assert status in (200, 400, 404, 413, 429, 503), (status, body[:200])
            if status != 200 and headers.get("content-type") == "application/json":
                err = json.loads(body)["error"]
                assert err["code"] == status and err["message"]
        print("statuses", statuses)
        assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
        assert st.picker.proc is not None and st.picker.proc.alive()
        wait_until(lambda: _inflight(st.picker.metrics_port) == 0, timeout=15)
        with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         + f"content-length: {len(BODIES[0])}\r\n\r\n".encode() + BODIES[0])
            status, headers, _ = _read_reply(sock)
        assert status == 200 and headers.get("x-served-by") in st.backends
        log = st.picker.log.read_text(errors="replace")
        assert "internal error" not in log
        assert "Traceback" not in log


def _post(port: int, body: bytes, headers: tuple[bytes, ...] = ()) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + b"".join(h + b"\r\n" for h in headers)
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        return _read_reply(sock)


def _counter(metrics_port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_client_who_stalls_its_body_or_names_its_endpoint(tmp_path: Path, mode: str) -> None:
    """Through Envoy: a body that stops half-way gets the picker's 408 (JSON) once
    --request-body-timeout passes, and everything it held is released; without
    --enable-test-endpoint-selection the test-epp-endpoint-selection header moves nothing."""
    with stack(tmp_path, 2, "--request-body-timeout", "1s", request_body_mode=mode) as st:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=20) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 5000\r\n\r\n" + b'{"model": "m", "prompt": "never finished')
                status, headers, body = _read_reply(sock)
            assert status == 408, (status, body[:200])
            assert headers.get("content-type") == "application/json"
            err = json.loads(body)["error"]
            assert err["type"] == "RequestTimeoutError" and err["code"] == 408
        wait_until(lambda: _inflight(st.picker.metrics_port) == 0, timeout=15)
        wait_until(lambda: _counter(st.picker.metrics_port, "prefix_epp_open_streams") == 0, timeout=15)

        # A prompt that lives on one backend stays there whatever endpoint the header names.
        prompt = json.dumps({"model": "m", "prompt": "pinned? " * 200, "max_tokens": 1}).encode()
        status, headers, _ = _post(st.envoy_port, prompt)
        assert status == 200
        home = headers["x-served-by"]
        other = next(b for b in st.backends if b != home)
        for _ in range(5):
            status, headers, _ = _post(st.envoy_port, prompt, (b"test-epp-endpoint-selection: " + other.encode(),))
            assert status == 200 and headers["x-served-by"] == home
        status, _, _ = _post(st.envoy_port, prompt, (b"test-epp-endpoint-selection: 10.255.0.1",))
        assert status == 200  # no 503 that tells a guessed address from a pool member
        assert _counter(st.picker.metrics_port, "prefix_epp_ignored_headers_total",
                        header="test-epp-endpoint-selection") == 6
        log = st.picker.log.read_text(errors="replace")
        assert "internal error" not in log and "Traceback" not in log
