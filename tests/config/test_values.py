"""Configuration values as written: Go durations, duration flags, Go-style booleans, lists, header names."""

from __future__ import annotations

import argparse

import pytest

from extproc.config.values import (
    ConfigError,
    comma_list,
    duration,
    format_duration,
    header_name,
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
