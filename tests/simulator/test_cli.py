"""`prefix-epp sim`: flags read their defaults from SimConfig; the process serves and stops cleanly."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import urllib.request
from pathlib import Path

from prefix_epp_sim import cli
from prefix_epp_sim.config import SimConfig
from testkit.procs import (
    consecutive_free_ports,
    free_ports,
    prefix_epp,
    python_module,
    running,
    wait_for_port,
)


def test_parser_defaults_are_simconfig_defaults() -> None:
    assert cli.config_from_args(cli.build_parser().parse_args([])) == SimConfig()


def test_sub_command_registration() -> None:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sim", "--replicas", "3", "--base-port", "9000", "--failure-injection-rate", "25",
                              "--kv-cache-size", "100", "--max-model-len", "1600",
                              "--lora-modules", '{"name": "food-review-1"}', "sql=/adapters/sql"])
    assert args.func is cli.run
    config = cli.config_from_args(args)
    assert (config.replicas, config.port, config.failure_rate, config.kv_cache_blocks) == (3, 9000, 0.25, 100)
    assert config.lora_names == ("food-review-1", "sql")


def test_vllm_kv_events_config_json() -> None:
    raw = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
           "topic": "kv@pod@m", "replay_endpoint": "tcp://*:5558", "buffer_steps": 50}
    config = cli.config_from_args(cli.build_parser().parse_args(["--kv-events-config", json.dumps(raw)]))
    assert config.kv_events and not config.kv_events_connect
    assert (config.kv_events_endpoint, config.kv_events_replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert (config.kv_events_topic, config.kv_events_buffer_steps) == ("kv@pod@m", 50)
    central = cli.config_from_args(cli.build_parser().parse_args(
        ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://collector:5557"}']))
    assert central.kv_events_connect
    off = cli.config_from_args(cli.build_parser().parse_args(["--kv-events-config", "{}"]))
    assert not off.kv_events


def test_invalid_config_exits_2() -> None:
    assert cli.main(["--block-size", "0"]) == 2


def get(url: str) -> tuple[int, bytes, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read(), resp.headers.get("x-served-by", "")


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        result: dict[str, object] = json.loads(resp.read())
        return result


def serve_and_stop(argv: list[str], port: int, replicas: int, tmp_path: Path) -> None:
    secret = "do-not-log-this-prompt"
    with running(argv, tmp_path / "sim.log", wait_port=port) as proc:
        for i in range(replicas):
            wait_for_port(port + i, proc=proc.popen)
            status, _, served_by = get(f"http://127.0.0.1:{port + i}/health")
            assert status == 200 and served_by == f"127.0.0.1:{port + i}"
        out = post(f"http://127.0.0.1:{port}/v1/completions", {"model": "sim-model", "prompt": secret})
        assert out["usage"]["completion_tokens"] == 16  # type: ignore[index]
        _, text, _ = get(f"http://127.0.0.1:{port + replicas - 1}/metrics")
        assert b"vllm:num_requests_running" in text
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=10) == 0
        log = proc.log_text()
    assert "sim_replica_started" in log and secret not in log


def test_module_process_serves_many_replicas_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, kv = consecutive_free_ports(2), consecutive_free_ports(2)
    argv = python_module("prefix_epp_sim.cli", "--replicas", "2", "--port", str(port), "--time-scale", "50",
                         "--kv-events-port-base", str(kv))
    serve_and_stop(argv, port, 2, tmp_path)


def test_prefix_epp_sim_sub_command(tmp_path: Path) -> None:
    from extproc.commands.main import build_parser  # an import failure fails the test

    assert "sim" in build_parser().format_help()
    port, kv = free_ports(2)
    argv = prefix_epp("sim", "--port", str(port), "--time-scale", "50", "--kv-events-port-base", str(kv))
    serve_and_stop(argv, port, 1, tmp_path)


def test_port_in_use_exits_nonzero(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = python_module("prefix_epp_sim.cli", "--port", str(port), "--no-kv-events")
        with running(argv, tmp_path / "sim.log") as proc:
            assert proc.popen.wait(timeout=15) == 1
            assert "sim_start_failed" in proc.log_text()
