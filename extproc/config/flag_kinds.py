"""What a row of the flag table (extproc/config/flags.py) is: `Flag`, the kinds of value it parses
(`Kind`: int, float, Go-style bool, Go duration, comma list, endpoint list, KV cache tier weights,
choice, text), the numeric `Range` it
is checked against, and `value_at` / `with_value` to read and set the EppConfig field a row names
by its dotted path."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from extproc.config.settings import KV_TIERS, EppConfig
from extproc.config.values import (
    ConfigError,
    comma_list,
    duration,
    endpoint_list,
    endpoint_roles,
    format_duration,
    header_name,
    parse_bool,
)


@dataclass(frozen=True)
class Kind:
    """How a flag's text becomes its value."""

    name: str  # in the CLI reference
    parse: Callable[[str], Any]  # argparse `type`
    value_type: object  # the Python type of the value: the EppConfig field's annotation
    metavar: str | None = None  # None: argparse's (the destination upper-cased, or the choices)
    choices: tuple[str, ...] = ()
    show: Callable[[Any], str] = str  # a value as written on the command line

    @property
    def numeric(self) -> bool:
        return self.value_type in (int, float)


def _show_bool(value: Any) -> str:
    return "true" if value else "false"


def _show_float(value: Any) -> str:
    return f"{value:g}"


def _show_list(value: Any) -> str:
    return ",".join(value)


INT = Kind("int", int, int)
FLOAT = Kind("float", float, float, show=_show_float)
BOOL = Kind("bool", parse_bool, bool, "BOOL", show=_show_bool)  # --flag, --flag=true, --flag=false
DURATION = Kind("duration", duration, float, "DURATION", show=format_duration)  # 50ms, 2s or seconds
TEXT = Kind("text", str, str)
HEADER = Kind("header name", header_name, str, "NAME")  # stripped and lower-cased
LIST = Kind("comma list", comma_list, tuple[str, ...], show=_show_list)  # items stripped, empties dropped
# IP:port items (values.endpoint_list): a host name, URL, empty item or bad port is refused by name.
ENDPOINTS = Kind("endpoint list", endpoint_list, tuple[str, ...], "IP:PORT,...", show=_show_list)
# IP:port=ROLE items (values.endpoint_roles): a bad address or an unknown role is refused by name.
ROLES = Kind("endpoint roles", endpoint_roles, tuple[str, ...], "IP:PORT=ROLE,...", show=_show_list)

def check_tier_weights(pairs: list[tuple[str, float]], where: str) -> tuple[tuple[str, float], ...]:
    """KV cache tier weights: known tier names (settings.KV_TIERS), each once, weights in [0, 1], GPU above 0."""
    seen = set()
    for name, weight in pairs:
        if name not in KV_TIERS:
            raise ConfigError(f"{where}: unknown KV cache tier {name!r} (known: {', '.join(KV_TIERS)})")
        if name in seen:
            raise ConfigError(f"{where}: tier {name!r} given twice")
        seen.add(name)
        if not 0.0 <= weight <= 1.0 or (name == KV_TIERS[0] and weight == 0.0):
            raise ConfigError(f"{where}: the weight of {name!r} must be in [0, 1] (gpu above 0), got {weight:g}")
    return tuple(pairs)


def tier_weights(value: str) -> tuple[tuple[str, float], ...]:
    """The `--kv-tier-weights` flag: "gpu=1,cpu=0.8,storage=0.3" (tiers left out keep their default)."""
    pairs = []
    for item in comma_list(value):
        name, sep, weight = item.partition("=")
        try:
            pairs.append((name.strip().lower(), float(weight)))
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"not a tier weight: {item!r} (e.g. gpu=1,cpu=0.8,storage=0.3)")
    try:
        return check_tier_weights(pairs, "--kv-tier-weights")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_tier_weights(value: tuple[tuple[str, float], ...]) -> str:
    return ",".join(f"{name}={weight:g}" for name, weight in value)


# KV cache tier=weight items (values.tier_weights): an unknown tier or a weight outside [0, 1] is refused.
TIER_WEIGHTS = Kind("tier weights", tier_weights, tuple[tuple[str, float], ...], "TIER=W,...",
                    show=format_tier_weights)

def choice(*options: str) -> Kind:
    return Kind("choice", str, str, choices=options)


@dataclass(frozen=True)
class Range:
    """Valid numbers: lo <= v <= hi (lo < v when lo_open); checked at start-up (validate.py)."""

    lo: float
    hi: float = math.inf
    lo_open: bool = False

    def describe(self) -> str:
        if self.hi == math.inf:
            return f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        return f"> {self.lo:g} and <= {self.hi:g}" if self.lo_open else f"{self.lo:g} to {self.hi:g}"


@dataclass(frozen=True)
class Flag:
    """One flag of `prefix-epp serve`."""

    name: str  # --like-this
    path: str | None  # the dotted EppConfig field it sets; None: read by the command (args.<dest>)
    kind: Kind
    group: str  # its --help group and its section of docs/cli.md
    help: str
    range: Range | None = None  # numbers only
    metavar: str | None = None  # else the kind's
    parameters: tuple[str, ...] = ()  # "plugin-type.parameterName" of the same meaning: the config file wins
    profile_only: bool = False  # shapes the built-in profile: refused with a file that defines one
    default: Any = None  # rows without a path only: every other default is EppConfig's
    first: bool = False  # set by a first deployment: shown by `serve --help` (every row: --help-all)

    def __post_init__(self) -> None:
        if not self.name.startswith("--") or self.name != self.name.lower():
            raise ValueError(f"{self.name!r}: a flag is written --lower-case")
        if not self.help.strip():
            raise ValueError(f"{self.name}: every flag needs help text")
        if self.path is not None and self.default is not None:
            raise ValueError(f"{self.name}: the default of a config field is EppConfig's, not the row's")
        if self.path is None and (self.parameters or self.profile_only or self.range):
            raise ValueError(f"{self.name}: a flag outside EppConfig has no range and nothing in the config file")
        if self.range is not None and not self.kind.numeric:
            raise ValueError(f"{self.name}: only numbers have a range")
        if self.parameters and self.profile_only:
            raise ValueError(f"{self.name}: a plugin parameter or profile-only, not both")

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def default_value(self) -> Any:
        return self.default if self.path is None else value_at(EppConfig(), self.path)


def value_at(config: Any, path: str) -> Any:
    """The field at a dotted path: value_at(cfg, "kv_events.port") is cfg.kv_events.port."""
    for part in path.split("."):
        config = getattr(config, part)
    return config


def with_value(config: Any, path: str, value: Any) -> Any:
    """A copy of the frozen (nested) dataclass `config` with the field at `path` set to `value`."""
    head, _, rest = path.partition(".")
    return replace(config, **{head: with_value(getattr(config, head), rest, value) if rest else value})
