"""`prefix-epp sidecar` as a process: bad inputs refused at start-up in one line, a real process
that serves, logs without prompt text and stops gracefully on SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from extproc.commands.main import main
from testkit.procs import Proc, free_port, prefix_epp, until, wait_for_port
from testkit.sidecar import Recorder, Seen, json_answer

SECRET = "a prompt the logs must never show"


@pytest.fixture(autouse=True)
def root_logger() -> Iterator[None]:
    """`main` sets up the process's logging on the test's captured stderr: undo it afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(("args", "says"), [
    (["--decode-url", "ftp://engine"], "--decode-url must be an http:// or https:// URL"),
    (["--enable-tls", "prefiller,encoder"], "--enable-tls: unknown stage 'encoder'"),
    (["--secure-serving"], "--secure-serving needs --cert-path"),
    (["--port", "0"], "--port must be within 1 to 65535"),
    (["--bind-address", "localhost"], "--bind-address must be an IP address"),
    (["--prefill-timeout", "0"], "--prefill-timeout must be > 0"),
])
def test_a_bad_value_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], args: list[str],
                                                 says: str) -> None:
    assert main(["sidecar", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("prefix-epp sidecar: error: ") and says in err[0], err


def test_a_port_taken_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["sidecar", "--bind-address", "127.0.0.1", "--port", str(port), "--log-level", "error"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"cannot serve on 127.0.0.1:{port}" in err[0], err


async def test_the_process_serves_logs_no_prompt_and_stops_on_sigterm(tmp_path: Path) -> None:
    async def prefilled(seen: Seen) -> web.Response:
        return await json_answer(seen, body={"choices": [], "kv_transfer_params": None})

    async with Recorder(prefilled) as prefill, Recorder() as decode, aiohttp.ClientSession() as session:
        port = free_port()
        proc = Proc(prefix_epp("sidecar", "--bind-address", "127.0.0.1", "--port", str(port),
                               "--decode-url", decode.url, "--kv-connector", "nixlv2"), tmp_path / "sidecar.log")
        try:
            try:
                wait_for_port(port, timeout=30, proc=proc.popen)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{exc}\n{proc.log_text()[-4000:]}") from None
            body = orjson.dumps({"model": "m", "prompt": SECRET, "stream": True})
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                    headers={"x-prefiller-host-port": prefill.host_port}) as resp:
                assert resp.status == 200
            # No kv_transfer_params in the prefill's answer: the decode gets the client's body as it was.
            assert [s.json()["max_tokens"] for s in prefill.seen] == [1] and decode.seen[0].body == body
            proc.popen.send_signal(signal.SIGTERM)
            await until(lambda: not proc.alive(), timeout=20)
            assert proc.popen.returncode == 0
            text = proc.log_text()
            assert "sidecar_prefill" in text and "sidecar_stopped" in text and SECRET not in text
        finally:
            proc.stop()


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sidecar", "--help"])
    out = capsys.readouterr().out
    for flag in ("--port", "--decode-url", "--kv-connector", "--enable-tls", "--metrics-port", "--shutdown-grace"):
        assert flag in out
