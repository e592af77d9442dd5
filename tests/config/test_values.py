"""Configuration values as written: Go durations, duration flags, Go-style booleans, lists, header names,
endpoints (IP:port, each mistake refused with what to write instead)."""

from __future__ import annotations

import argparse

import pytest

from extproc.config.values import (
    ConfigError,
    comma_list,
    duration,
    endpoint,
    endpoint_list,
    format_duration,
    header_name,
    ip_port,
    parse_bool,
    parse_duration,
)


def test_durations() -> None:
    assert parse_duration("200ms", "x") == pytest.approx(0.2)
    assert parse_duration("1m30s", "x") == 90.0
    assert parse_duration("1.5s", "x") == 1.5
    for bad in ("", "5", "-1s", "0s", "3 s", "1d"):
        with pytest.raises(ConfigError):
            parse_duration(bad, "x")


def test_a_duration_flag_takes_a_go_duration_or_seconds() -> None:
    assert duration("50ms") == pytest.approx(0.05)
    assert duration(" 2s ") == 2.0
    assert duration("0.05") == 0.05 and duration("0") == 0.0
    for bad in ("fast", "0s", "1d"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
            duration(bad)


@pytest.mark.parametrize("seconds", [0.0, 0.05, 0.1, 0.2, 1.0, 2.0, 30.0, 90.0, 3600.0, 0.0005, 1.5e-8])
def test_format_duration_reads_back(seconds: float) -> None:
    text = format_duration(seconds)
    assert duration(text) == pytest.approx(seconds)
    assert format_duration(0.05) == "50ms" and format_duration(2.0) == "2s"


def test_go_style_booleans() -> None:
    for text in ("1", "t", "true", "TRUE", "yes", "on", " True "):
        assert parse_bool(text) is True
    for text in ("0", "f", "false", "no", "off"):
        assert parse_bool(text) is False
    assert parse_bool(True) is True
    with pytest.raises(argparse.ArgumentTypeError, match="not a boolean"):
        parse_bool("maybe")


def test_lists_and_header_names() -> None:
    assert comma_list("a:1, b:2,,") == ("a:1", "b:2")
    assert comma_list("") == ()
    assert header_name(" X-Session-Id ") == "x-session-id" and header_name("") == ""


@pytest.mark.parametrize(("item", "expected"), [
    ("127.0.0.1:8001", ("127.0.0.1", 8001)), (" 10.0.0.1:65535 ", ("10.0.0.1", 65535)),
    ("[::1]:8000", ("::1", 8000)), ("[fd00::0002]:1", ("fd00::2", 1)),
])
def test_an_endpoint_is_an_ip_and_a_port(item: str, expected: tuple[str, int]) -> None:
    assert ip_port(item) == expected


@pytest.mark.parametrize(("item", "says"), [
    ("localhost:8001", "'localhost:8001' is not an IP:port; write 127.0.0.1:8001 (the gateway routes by address)"),
    ("vllm-0.vllm:8000", "write the host's IP address, as IP:8000 (the gateway routes by address)"),
    ("http://127.0.0.1:8001", "'http://127.0.0.1:8001' is a URL, not an IP:port; write 127.0.0.1:8001"),
    ("http://localhost:8000/v1", "is a URL, not an IP:port; write 127.0.0.1:8000"),
    ("a;b", "separate endpoints with commas: a,b"),
    ("127.0.0.1:8001 127.0.0.1:8002", "separate endpoints with commas: 127.0.0.1:8001,127.0.0.1:8002"),
    ("127.0.0.1:80O2", "the port '80O2' is not a number from 1 to 65535; write 127.0.0.1:PORT"),
    ("127.0.0.1:70000", "the port '70000' is not a number from 1 to 65535"),
    ("127.0.0.1:0", "the port '0' is not a number from 1 to 65535"),
    ("127.0.0.1", "'127.0.0.1' has no port; write 127.0.0.1:PORT"),
    (":8000", "has no IP address; write IP:8000"),
    ("::1:8000", "write [::1]:8000"),
    ("[127.0.0.1]:80", "write 127.0.0.1:80"),
    ("[::1]", "write [IPv6]:PORT"),
])
def test_anything_else_is_refused_with_what_to_write(item: str, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        ip_port(item)
    assert says in str(exc.value)


def test_the_endpoints_flag_checks_every_item_and_the_kv_events_addresses() -> None:
    assert endpoint_list("") == () and endpoint_list("  ") == ()
    assert endpoint_list("127.0.0.1:1, [::1]:2@tcp://127.0.0.1:5601@tcp://127.0.0.1:5701") == (
        "127.0.0.1:1", "[::1]:2@tcp://127.0.0.1:5601@tcp://127.0.0.1:5701")
    assert endpoint("127.0.0.1:1@tcp://h:5601") == ("127.0.0.1", 1, "tcp://h:5601")
    for bad, says in (("127.0.0.1:1,,127.0.0.1:2", "an empty item in"), ("127.0.0.1:1,", "an empty item in"),
                      ("127.0.0.1:1,localhost:2", "'localhost:2' is not an IP:port"),
                      ("127.0.0.1:1@5601", "'5601' is not a ZeroMQ address; write it as tcp://IP:PORT")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            endpoint_list(bad)
