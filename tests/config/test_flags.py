"""The flag table: each row names a real EppConfig field of its type, argparse and validation are built
from it, every flag round-trips through config_from_args, and docs/cli.md is what the table renders."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from extproc.commands import serve
from extproc.config import flags
from extproc.config.flags import (
    BOOL,
    DURATION,
    ENDPOINTS,
    FLAGS,
    HEADER,
    INT,
    LIST,
    ROLES,
    TEXT,
    TIER_WEIGHTS,
    Flag,
    Range,
    value_at,
)
from extproc.config.settings import EppConfig
from extproc.config.validate import PARAMETER_FLAGS, PROFILE_FLAGS, RULES, check
from extproc.scheduling.config_loader import PLUGIN_PARAMS

REPO = Path(__file__).resolve().parents[2]
BY_NAME = {f.name: f for f in FLAGS}
CONFIG_ROWS = [f for f in FLAGS if f.path is not None]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def field_type(path: str) -> object:
    """The annotation of the EppConfig field at a dotted path (KeyError/AttributeError if there is none)."""
    cls: Any = EppConfig
    hint: object = None
    for part in path.split("."):
        assert dataclasses.is_dataclass(cls), f"{path}: {part} is not inside a config dataclass"
        hint = typing.get_type_hints(cls)[part]
        cls = hint
    return hint


def test_names_destinations_and_paths_are_unique() -> None:
    assert len(BY_NAME) == len(FLAGS)
    assert len({f.dest for f in FLAGS}) == len(FLAGS)
    paths = [f.path for f in CONFIG_ROWS]
    assert len(set(paths)) == len(paths)


@pytest.mark.parametrize("flag", CONFIG_ROWS, ids=lambda f: f.name)
def test_each_row_sets_an_eppconfig_field_of_its_parsers_type(flag: Flag) -> None:
    assert flag.path is not None
    hint = field_type(flag.path)
    if isinstance(hint, types.UnionType):  # `int | None` (--seed): the parser gives the non-None part
        assert flag.kind.value_type in typing.get_args(hint) and type(None) in typing.get_args(hint)
    else:
        assert hint == flag.kind.value_type, f"{flag.name}: {flag.path} is {hint}, the parser gives " \
                                             f"{flag.kind.value_type}"
    runtime = typing.get_origin(flag.kind.value_type) or flag.kind.value_type
    assert isinstance(runtime, type)
    assert flag.default_value is None or isinstance(flag.default_value, runtime)


def test_only_rows_outside_eppconfig_carry_a_default() -> None:
    outside = [f for f in FLAGS if f.path is None]
    assert [f.name for f in outside] == ["--log-level"]
    assert all(f.default is not None for f in outside)
    with pytest.raises(ValueError, match="EppConfig's"):
        Flag("--grpc-port", "grpc_port", INT, "serving", "ext_proc gRPC port", default=9002)


def test_argparse_defaults_are_eppconfigs() -> None:
    args = parse()
    default = EppConfig()
    for flag in CONFIG_ROWS:
        assert flag.path is not None
        assert getattr(args, flag.dest) == value_at(default, flag.path), flag.name
    assert args.log_level == "info"
    assert serve.config_from_args(args) == default


def test_help_shows_every_flag_with_its_default() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag in FLAGS:
        assert flag.name in text
    assert "gRPC health port" in text and "(default: 9003)" in text and "(default: 0.05)" in text
    assert {g.title for g in parser._action_groups} >= {f.group for f in FLAGS}


def test_a_row_cannot_be_added_without_help_text() -> None:
    for blank in ("", "   "):
        with pytest.raises(ValueError, match="help text"):
            Flag("--new-flag", "grpc_port", INT, "serving", blank)
    with pytest.raises(ValueError, match="only numbers"):
        Flag("--new-flag", "bind_address", TEXT, "serving", "an address", Range(0))
    with pytest.raises(ValueError, match="lower-case"):
        Flag("new-flag", "bind_address", TEXT, "serving", "an address")


def _outside(r: Range) -> float:
    return r.lo if r.lo_open else r.lo - 1


@pytest.mark.parametrize("flag", [f for f in CONFIG_ROWS if f.range is not None], ids=lambda f: f.name)
def test_every_range_is_checked_at_startup(flag: Flag) -> None:
    assert flag.path is not None and flag.range is not None
    r = flag.range
    inside = [r.lo if not r.lo_open else r.lo + 1]
    outside: list[float] = [_outside(r), math.nan]
    if r.hi != math.inf:
        inside.append(r.hi)
        outside.append(r.hi + 1)
    cast = int if flag.kind is INT else float
    for value in outside:
        problems = check(flags.with_value(EppConfig(), flag.path, value if math.isnan(value) else cast(value)))
        assert any(p.startswith(f"{flag.name} must be ") for p in problems), (flag.name, value, problems)
    for value in inside:
        problems = check(flags.with_value(EppConfig(), flag.path, cast(value)))
        assert not any(p.startswith(f"{flag.name} must be ") for p in problems), (flag.name, value, problems)


def test_rules_are_the_tables_ranges_and_the_config_file_fields() -> None:
    ranged = {f.name for f in FLAGS if f.range is not None}
    assert {r.flag for r in RULES if r.flag.startswith("--")} == ranged
    assert {r.flag for r in RULES if not r.flag.startswith("--")} == {
        "saturationDetector.queueDepthThreshold", "saturationDetector.kvCacheUtilThreshold",
        "saturationDetector.metricsStalenessThreshold"}
    assert check(EppConfig()) == []


def test_the_config_file_roles_are_as_before() -> None:
    assert PARAMETER_FLAGS == {
        "--prefix-block-size": "prefix.block_size_bytes", "--prefix-max-blocks": "prefix.max_prefix_blocks",
        "--prefix-lru-capacity": "prefix.lru_capacity_per_server", "--spill-relative": "spill.relative",
        "--spill-absolute": "spill.absolute", "--max-endpoints": "max_endpoints",
        "--balance-factor": "balance.factor", "--balance-slack": "balance.slack",
        "--kv-events-block-size": "kv_events.block_size", "--kv-events-max-blocks": "kv_events.max_blocks",
        "--kv-events-index-capacity": "kv_events.index_capacity",
        "--kv-events-speculative-ttl": "kv_events.speculative_ttl_s", "--kv-tier-weights": "kv_events.tier_weights",
        "--prefill-ms-per-token": "latency.prefill_ms_per_token", "--eviction-weight": "latency.eviction_weight",
        "--decode-step-ms": "latency.decode_step_ms",
        "--affinity-credit": "latency.affinity_credit", "--new-prefix-placement": "latency.new_prefix_placement",
        "--ttft-calibration": "latency.calibrate", "--cache-threshold": "cache_aware.cache_threshold",
        "--balance-abs-threshold": "cache_aware.balance_abs", "--balance-rel-threshold": "cache_aware.balance_rel"}
    assert set(PROFILE_FLAGS) == {("--prefix-weight", "weights.prefix"), ("--inflight-weight", "weights.inflight"),
                                  ("--prefix-scorer", "kv_events.prefix_scorer"), ("--scheduler", "scheduler")}


def _sample(flag: Flag) -> tuple[str, Any]:
    """A command-line value for the flag and the value it must produce, different from the default."""
    kind, default = flag.kind, flag.default_value
    if kind.choices:
        other = next(c for c in kind.choices if c != default)
        return other, other
    if kind is BOOL:
        return ("false", False) if default else ("true", True)
    if kind is DURATION:
        return "1250ms", 1.25
    if kind is INT:
        value = 7 if default is None else default + 3
        return str(value), value
    if kind is LIST:
        return "a:1, b:2,", ("a:1", "b:2")
    if kind is ENDPOINTS:
        return "10.0.0.1:8000, [fd00::2]:8000@tcp://10.0.0.9:5557", ("10.0.0.1:8000", "[fd00::2]:8000@tcp://10.0.0.9:5557")
    if kind is ROLES:
        return "10.0.0.1:8000=prefill, [fd00::2]:8000=decode", ("10.0.0.1:8000=prefill", "[fd00::2]:8000=decode")
    if kind is HEADER:
        return " X-Other-Header ", "x-other-header"
    if kind is TEXT:
        return "some-value", "some-value"
    if kind is TIER_WEIGHTS:
        return "CPU=0.5, storage=0", (("cpu", 0.5), ("storage", 0.0))
    return str(default + 0.25), default + 0.25


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_every_flag_round_trips_through_config_from_args(flag: Flag) -> None:
    text, expected = _sample(flag)
    assert expected != flag.default_value
    args = parse(flag.name, text)
    if flag.path is None:
        assert getattr(args, flag.dest) == expected
        return
    config = serve.config_from_args(args)
    got = value_at(config, flag.path)
    assert got == (pytest.approx(expected) if flag.kind is DURATION else expected)
    assert type(got) is type(expected)
    # ... and nothing else moved.
    assert flags.with_value(config, flag.path, flag.default_value) == EppConfig()


def test_a_bare_boolean_flag_means_true() -> None:
    for flag in (f for f in CONFIG_ROWS if f.kind is BOOL):
        assert flag.path is not None
        assert value_at(serve.config_from_args(parse(flag.name)), flag.path) is True
        assert value_at(serve.config_from_args(parse(f"{flag.name}=false")), flag.path) is False


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.parameters], ids=lambda f: f.name)
def test_each_named_plugin_parameter_exists_and_sets_the_rows_field(flag: Flag) -> None:
    assert flag.path is not None
    _, value = _sample(flag)
    for name in flag.parameters:
        plugin, _, parameter = name.partition(".")
        param = PLUGIN_PARAMS[plugin][parameter]
        loaded = param.apply(EppConfig(), value)
        assert value_at(loaded, flag.path) != flag.default_value, name


def test_docs_cli_md_is_what_the_table_renders() -> None:
    page = REPO / "docs" / "cli.md"
    assert page.is_file() and page.read_text() == flags.render_markdown(), (
        "docs/cli.md differs from the flag table (extproc/config/flags.py); regenerate it with "
        "`python -m extproc.config.flags > docs/cli.md` (or `make docs-cli`)")
    assert sum(line.startswith("| `--") for line in page.read_text().splitlines()) == len(FLAGS)
