"""How configuration values are written, shared by the flags and the EndpointPickerConfig loader.

- `parse_duration`: a Go duration string ("200ms", "1.5s", "1m30s") in seconds, > 0; the
  EndpointPickerConfig's duration parameters (`speculativeTTL`, `metricsStalenessThreshold`).
- `duration`: a duration flag, a Go duration or a plain number of seconds ("50ms", "0.05", "0").
- `parse_bool`: a Go-style boolean flag (`--flag`, `--flag=true`, `--flag=false`, also 1/0, t/f,
  yes/no, on/off).
- `format_duration`: seconds back to the shortest Go duration ("50ms", "2s"), for the CLI reference.

An invalid EndpointPickerConfig value is a `ConfigError` naming its field; an invalid flag value is
an `argparse.ArgumentTypeError`, which argparse reports with the flag's name.
"""

from __future__ import annotations

import argparse
import re
from typing import Any


class ConfigError(ValueError):
    """The EndpointPickerConfig is invalid; the message names the offending field."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(v: Any, where: str) -> float:
    """A Go duration string ("200ms", "1.5s", "1m30s") in seconds, > 0."""
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}: expected a duration such as '200ms', got {v!r}")
    pos, total = 0, 0.0
    while pos < len(v):
        m = _DURATION_PART.match(v, pos)
        if m is None:
            raise ConfigError(f"{where}: expected a duration such as '200ms', got {v!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if total <= 0:
        raise ConfigError(f"{where}: the duration must be positive, got {v!r}")
    return total


def duration(value: str) -> float:
    """Seconds from a Go duration ("50ms", "2s") or a plain number of seconds."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return parse_duration(value.strip(), "duration")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"not a duration: {value!r} (e.g. 50ms, 2s)") from None


def format_duration(seconds: float) -> str:
    """The shortest Go duration of `seconds` in one unit: 0.05 -> "50ms", 2.0 -> "2s", 90 -> "90s";
    0 stays "0" (a duration flag reads it as seconds; a Go duration is positive)."""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        amount = seconds / scale
        if abs(amount) >= 1:
            return f"{round(amount, 6):g}{unit}"
    return f"{round(seconds / 1e-9, 3):g}ns"


def parse_bool(value: str | bool) -> bool:
    """Go-style booleans: `--flag`, `--flag=true`, `--flag=false`."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def comma_list(value: str) -> tuple[str, ...]:
    """"a, b,,c" -> ("a", "b", "c"): items stripped, empty ones dropped."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def header_name(value: str) -> str:
    """An HTTP header name as HTTP/2 and Envoy carry it: stripped and lower-cased ("" stays "")."""
    return value.strip().lower()
