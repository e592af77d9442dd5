"""How configuration values are written, shared by the flags and the EndpointPickerConfig loader.

- `parse_duration`: a Go duration string ("200ms", "1.5s", "1m30s") in seconds, > 0; the
  EndpointPickerConfig's duration parameters (`speculativeTTL`, `metricsStalenessThreshold`).
- `duration`: a duration flag, a Go duration or a plain number of seconds ("50ms", "0.05", "0").
- `parse_bool`: a Go-style boolean flag (`--flag`, `--flag=true`, `--flag=false`, also 1/0, t/f,
  yes/no, on/off).
- `format_duration`: seconds back to the shortest Go duration ("50ms", "2s"), for the CLI reference.
- `ip_port`: a model-server endpoint, `IP:port` or `[IPv6]:port`: the gateway routes each request
  to the picked endpoint's address (ORIGINAL_DST, override_host), so a host name, a URL or a
  missing port would start cleanly and then fail every request; refused with what to write instead.
- `endpoint_roles`: the `--endpoint-roles` flag, comma separated `IP:port=ROLE` items (ROLE one of
  settings.ENDPOINT_ROLES).
- `endpoint_list`: the `--endpoints` flag (`prefix-epp serve`, `prefix-epp envoy-config`), comma
  separated `IP:port` items, each optionally followed by `@tcp://events[@tcp://replay]`.

An invalid EndpointPickerConfig value is a `ConfigError` naming its field; an invalid flag value is
an `argparse.ArgumentTypeError`, which argparse reports with the flag's name.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from typing import Any


class ConfigError(ValueError):
    """The EndpointPickerConfig is invalid; the message names the offending field."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def mapping(v: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A YAML mapping of a config document (None: empty) whose keys are all in `allowed`; else a
    ConfigError naming `where` and the unknown field (with the known ones)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
    for key in v:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown field {key!r} (known: {', '.join(allowed)})")
    return v


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


_ROUTED = "(the gateway routes by address)"
_SEPARATORS = re.compile(r"[;\s|]+")


def ip_port(item: str) -> tuple[str, int]:
    """(IP, port) of `IP:port` or `[IPv6]:port`; a ValueError names the item and what to write instead."""
    text = item.strip()
    if "://" in text:
        bare = text.partition("://")[2].split("/", 1)[0]
        raise ValueError(f"{item!r} is a URL, not an IP:port; write {_suggest(bare)} {_ROUTED}")
    if _SEPARATORS.search(text):
        raise ValueError(f"{item!r} is not an IP:port; separate endpoints with commas: "
                         f"{','.join(p for p in _SEPARATORS.split(text) if p)}")
    bracketed = text.startswith("[")
    host, sep, port = text[1:].partition("]:") if bracketed else text.rpartition(":")
    if bracketed and not sep:
        raise ValueError(f"{item!r} is not an IP:port; write [IPv6]:PORT, e.g. [::1]:8000")
    if not sep:
        raise ValueError(f"{item!r} has no port; write {_host_of(text)}:PORT, e.g. {_host_of(text)}:8000")
    if not host:
        raise ValueError(f"{item!r} has no IP address; write IP:{port}, e.g. 127.0.0.1:{port}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{item!r}: the port {port!r} is not a number from 1 to 65535; write "
                         f"{_host_of(host) if not bracketed else f'[{host}]'}:PORT")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        named = "" if host == "localhost" else "the host's IP address, as "
        raise ValueError(f"{item!r} is not an IP:port; write {named}{_suggest(text)} {_ROUTED}") from None
    if (ip.version == 6) != bracketed:  # "::1:8000" is itself an IPv6 address: the port needs brackets
        raise ValueError(f"{item!r} is not an IP:port; write {_suggest(text)}")
    return str(ip), int(port)


def _host_of(host: str) -> str:
    """`host` as it could stand before :PORT (an IPv6 address bracketed, a name by an IP placeholder)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return "127.0.0.1" if host == "localhost" else "IP"
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _suggest(text: str) -> str:
    """The IP:port `text` most likely meant (a placeholder where no address can be guessed)."""
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
        if ":" in host:  # unbracketed IPv6: its last group is the port
            return f"[{host}]:{port}"
        if not host:
            host, port = text, "PORT"
    return f"{_host_of(host)}:{port if port.isdigit() else 'PORT'}"


def endpoint(item: str) -> tuple[str, int, str]:
    """(IP, port, KV-events address) of one `--endpoints` item `IP:port[@tcp://events[@tcp://replay]]`."""
    address, _, events = item.strip().partition("@")
    host, port = ip_port(address)
    for part in events.split("@") if events else ():
        if "://" not in part:
            raise ValueError(f"{item!r}: {part!r} is not a ZeroMQ address; write it as tcp://IP:PORT")
    return host, port, events.strip()


def endpoint_list(value: str) -> tuple[str, ...]:
    """The `--endpoints` flag: its items stripped, each checked by `endpoint`; "" is no endpoints."""
    if not value.strip():
        return ()
    items = tuple(item.strip() for item in value.split(","))
    for item in items:
        if not item:
            raise argparse.ArgumentTypeError(f"an empty item in {value!r}; separate endpoints with single "
                                             "commas, e.g. 127.0.0.1:8001,127.0.0.1:8002")
        try:
            endpoint(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def endpoint_role(item: str) -> tuple[str, str]:
    """(endpoint key as `ip_port` normalises it, role) of one `--endpoint-roles` item `IP:port=ROLE`."""
    from extproc.config.settings import ENDPOINT_ROLES

    address, sep, role = item.strip().partition("=")
    if not sep or role.strip() not in ENDPOINT_ROLES:
        raise ValueError(f"{item!r}: write IP:PORT=ROLE with ROLE one of {', '.join(ENDPOINT_ROLES)}")
    host, port = ip_port(address)
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), role.strip()


def endpoint_roles(value: str) -> tuple[str, ...]:
    """The `--endpoint-roles` flag: its items stripped, each checked by `endpoint_role`; "" is none."""
    items = tuple(item.strip() for item in value.split(",") if item.strip())
    for item in items:
        try:
            endpoint_role(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items
