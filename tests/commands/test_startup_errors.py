"""What a new user meets: the real `prefix-epp serve` refuses each bad input at start-up with one
line on stderr naming the flag, exit status 2, no traceback and no usage block; `serve --help`
shows the flags a first deployment sets and `--help-all` every flag."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.commands import preflight
from extproc.commands.main import main
from extproc.config.flags import FLAGS
from extproc.config.settings import EppConfig, SyncConfig
from extproc.config.validate import StartupError
from extproc.transport.tls import check_files
from testkit.certs import Authority
from testkit.procs import REPO_ROOT, free_ports, prefix_epp

TIMEOUT_S = 60  # a refusal comes before anything starts: this bounds a hung process, not a wait


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real `prefix-epp serve` on free ports; it must exit on its own."""
    grpc_port, health_port, metrics_port = free_ports(3)
    ports = {"--grpc-port": grpc_port, "--grpc-health-port": health_port, "--metrics-port": metrics_port}
    argv = ["serve", "--bind-address", "127.0.0.1", "--refresh-metrics-interval=0"]
    argv += [f"{flag}={port}" for flag, port in ports.items() if flag not in args]
    return subprocess.run(prefix_epp(*argv, *args), capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=TIMEOUT_S, check=False)


def assert_refused(result: subprocess.CompletedProcess[str], *says: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, f"more than one line on stderr:\n{result.stderr}"
    assert lines[0].startswith("prefix-epp serve: error: "), lines[0]
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    for text in says:
        assert text in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(("args", "says"), [
    (("--endpoints", "localhost:8001,localhost:8002"),
     ("--endpoints: 'localhost:8001' is not an IP:port; write 127.0.0.1:8001 (the gateway routes by address)",)),
    (("--endpoints", "http://127.0.0.1:8001"), ("--endpoints: 'http://127.0.0.1:8001' is a URL", "127.0.0.1:8001")),
    (("--endpoints", "127.0.0.1:8001;127.0.0.1:8002"), ("--endpoints", "separate endpoints with commas")),
    (("--endpoints", "127.0.0.1:80O2"), ("--endpoints: '127.0.0.1:80O2': the port '80O2' is not a number",)),
    (("--endpoints", "127.0.0.1:8001,"), ("--endpoints: an empty item",)),
    (("--endpoints", "127.0.0.1:8001", "--grpc-port", "abc"), ("--grpc-port: invalid int value: 'abc'",)),
    (("--endpoints", "127.0.0.1:8001", "--grpc-port", "70000"), ("--grpc-port must be >= 1 and <= 65535, got 70000",)),
    (("--endpoints", "127.0.0.1:8001", "--no-such-flag"), ("unrecognized arguments: --no-such-flag",)),
    ((), ("give --endpoints IP:PORT,... (static endpoints) or --pool-name",)),
], ids=["host-name", "url", "semicolon", "letter-in-port", "empty-item", "not-a-number", "out-of-range",
        "unknown-flag", "no-endpoints"])
def test_a_bad_value_is_one_line_naming_the_flag(args: tuple[str, ...], says: tuple[str, ...]) -> None:
    assert_refused(serve(*args), *says)


def test_an_unusable_config_file_or_tls_file_is_one_line(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "epp.yaml"
    bad_yaml.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins: [\n")
    assert_refused(serve("--endpoints", "127.0.0.1:8001", "--config-file", str(tmp_path / "missing.yaml")),
                   "--config-file", "missing.yaml")
    assert_refused(serve("--endpoints", "127.0.0.1:8001", "--config-file", str(bad_yaml)),
                   f"--config-file {bad_yaml}: not valid YAML", "line 4, column 1")
    assert_refused(serve("--endpoints", "127.0.0.1:8001", "--cert-path", str(tmp_path)),
                   f"--cert-path {tmp_path}: cannot read {tmp_path}/tls.crt: No such file or directory")
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    assert_refused(serve("--endpoints", "127.0.0.1:8001", "--client-ca-file", str(ca)),
                   f"--client-ca-file {ca}: not a PEM CA certificate bundle")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("clusters: [\n")
    assert_refused(serve("--pool-name", "vllm", "--kubeconfig", str(kubeconfig)),
                   "--pool-name vllm: no Kubernetes API to watch it", "give --kubeconfig FILE")


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process could hold: bound and listening until the test ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_ports(1)[0]))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("flag", ["--grpc-port", "--grpc-health-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_naming_its_flag(held_port: int, flag: str) -> None:
    assert_refused(serve("--endpoints", "127.0.0.1:8001", flag, str(held_port)),
                   f"{flag} {held_port}: address already in use on 127.0.0.1; choose a free port or stop the process")


def test_every_listener_is_checked_and_an_address_not_of_this_machine_is_named(held_port: int) -> None:
    config = EppConfig(bind_address="127.0.0.1", sync=SyncConfig(port=held_port), metrics_bind_address="127.0.0.2")
    assert [(flag, address_flag) for flag, address_flag, _, _ in preflight.listeners(config)] == [
        ("--grpc-port", "--bind-address"), ("--grpc-health-port", "--bind-address"),
        ("--metrics-port", "--metrics-bind-address"), ("--sync-port", "--bind-address")]
    with pytest.raises(StartupError, match=f"--sync-port {held_port}: address already in use"):
        preflight.check(config)
    problem = preflight.bind_problem("--grpc-port", "--bind-address", "192.0.2.1", 9002)  # TEST-NET-1: not ours
    assert problem is not None and problem.startswith("--bind-address 192.0.2.1: not an address of this machine")


def test_a_port_taken_after_the_check_is_still_named_by_its_flag(held_port: int) -> None:
    # In a child process: gRPC's core started in this test process would keep its threads in this
    # network namespace, and the Envoy Gateway tests that run later in it enter another one.
    code = ("import grpc, sys\n"
            "from extproc.config.validate import StartupError\n"
            "from extproc.transport.grpc_server import add_port\n"
            "server = grpc.server(None)\n"
            "try:\n"
            f"    add_port(server, '--grpc-port', '--bind-address', '127.0.0.1', {held_port}, None)\n"
            "except StartupError as exc:\n"
            "    print(exc)\n"
            "    sys.exit(2)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=TIMEOUT_S, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith(f"--grpc-port {held_port}: cannot listen on 127.0.0.1"), result.stdout


def test_tls_files_are_read_and_matched(tmp_path: Path) -> None:
    ca = Authority.create(tmp_path)
    good, other = ca.issue(tmp_path, "good", ips=("127.0.0.1",)), ca.issue(tmp_path, "other")
    assert check_files(str(good), str(tmp_path / "test-ca.crt")) is None
    (good / "tls.key").write_bytes((other / "tls.key").read_bytes())
    assert check_files(str(good)) == f"--cert-path {good}: tls.key is not the key of tls.crt"
    (good / "tls.key").write_text("garbage")
    assert check_files(str(good)) == f"--cert-path {good}: tls.key is not an unencrypted PEM private key"
    (good / "tls.crt").write_text("garbage")
    assert check_files(str(good)) == f"--cert-path {good}: tls.crt is not a PEM certificate"


def test_serve_help_shows_the_first_deployment_and_help_all_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    short = capsys.readouterr().out
    assert done.value.code == 0
    first = [f.name for f in FLAGS if f.first]
    assert 10 <= len(first) <= 15
    assert all(f"{name} " in short for name in first)
    assert not [f.name for f in FLAGS if not f.first and f"{f.name} " in short]
    assert " ".join(short.split()).endswith("prefix-epp serve --help-all lists all of them, as does docs/cli.md.")
    assert len(short.splitlines()) < 80
    with pytest.raises(SystemExit):
        main(["serve", "--help-all"])
    full = capsys.readouterr().out
    assert all(f"{f.name} " in full for f in FLAGS)


def test_envoy_config_reads_endpoints_with_the_same_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["envoy-config", "--endpoints", "127.0.0.1:8001,localhost:8002"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.splitlines() == ["prefix-epp envoy-config: error: --endpoints: 'localhost:8002' is not an IP:port; "
                                "write 127.0.0.1:8002 (the gateway routes by address) "
                                "(see prefix-epp envoy-config --help)"]
