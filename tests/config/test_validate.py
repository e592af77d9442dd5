"""Start-up validation names the offending flag; flags and the config file combine consistently."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from extproc.commands import serve
from extproc.config.settings import EppConfig
from extproc.config.validate import RULES, check

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
PROFILE = HEAD + """plugins:
- type: prefix-cache-scorer
  parameters: {blockSizeTokens: 32}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


def config(*argv: str) -> EppConfig:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.config_from_args(parser.parse_args(["--endpoints", "127.0.0.1:1", *argv]))


@pytest.mark.parametrize(("flag", "value"), [
    ("--prefix-block-size", "0"), ("--prefix-max-blocks", "0"), ("--prefix-lru-capacity", "-1"),
    ("--max-buffered-bytes", "0"), ("--max-request-body-bytes", "0"), ("--max-endpoints", "0"),
    ("--spill-relative", "0.5"), ("--spill-absolute", "-1"), ("--prefix-weight", "nan"),
    ("--inflight-weight", "-2"), ("--grpc-port", "70000"), ("--metrics-staleness-threshold", "0"),
    ("--refresh-metrics-interval", "-1"), ("--kv-events-dp-size", "0"), ("--kv-events-port", "0"),
    ("--tokenizer-timeout", "0"), ("--kv-events-speculative-ttl", "0"),
])
def test_each_invalid_flag_is_refused_by_name(flag: str, value: str) -> None:
    with pytest.raises(SystemExit, match=f"{flag} must be"):
        serve.validate(config(f"{flag}={value}"))


def test_every_rule_names_a_real_flag_and_defaults_pass() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    flags = {a for action in parser._actions for a in action.option_strings}
    assert all(r.flag in flags for r in RULES if r.flag.startswith("--"))
    assert check(EppConfig()) == []


def test_budget_smaller_than_one_body_and_port_clash_are_refused() -> None:
    with pytest.raises(SystemExit, match=r"--max-buffered-bytes .* must be >= --max-request-body-bytes"):
        serve.validate(config("--max-buffered-bytes=1000", "--max-request-body-bytes=2000"))
    with pytest.raises(SystemExit, match="must differ"):
        serve.validate(config("--grpc-port=9100", "--metrics-port=9100"))


def test_config_file_values_are_validated_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + "saturationDetector: {queueDepthThreshold: 5}\n")
    serve.validate(config("--config-file", str(path)))
    # A file may only produce valid values (its own loader checks ranges; check() is the backstop).
    assert check(EppConfig(saturation=EppConfig().saturation.__class__(kv_cache_util_threshold=2.0)))


@pytest.mark.parametrize(("flag", "shown"), [("--prefix-weight=3", "--prefix-weight 3.0"),
                                             ("--inflight-weight=0", "--inflight-weight 0.0"),
                                             ("--prefix-scorer=precise", "--prefix-scorer precise")])
def test_profile_flags_with_a_profile_in_the_file_are_an_error(tmp_path: Path, flag: str, shown: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(PROFILE)
    with pytest.raises(SystemExit, match=f"{shown} cannot apply"):
        serve.validate(config("--config-file", str(path), flag))
    serve.validate(config(flag))  # without a profile in a file they shape the built-in profile


def test_a_flag_the_file_overrides_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(PROFILE)
    with caplog.at_level(logging.WARNING, logger="prefix_epp"):
        serve.validate(config("--config-file", str(path), "--prefix-block-size=256"))
    hits = [r for r in caplog.records if r.getMessage() == "the EndpointPickerConfig overrides a flag"]
    assert len(hits) == 1
    assert (hits[0].flag, hits[0].flag_value, hits[0].config_value) == (  # type: ignore[attr-defined]
        "--prefix-block-size", 256, 128)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefix_epp"):
        serve.validate(config("--config-file", str(path), "--prefix-lru-capacity=500"))  # the file leaves it alone
    assert not caplog.records


def test_affinity_flags_parse_and_the_session_header_is_validated() -> None:
    assert config().affinity == EppConfig().affinity
    cfg = config("--affinity-hints=false", "--session-header", " X-Conversation-Id ")
    assert (cfg.affinity.enabled, cfg.affinity.session_header) == (False, "x-conversation-id")
    serve.validate(cfg)
    assert config("--session-header=").affinity.session_header == ""
    serve.validate(config("--session-header="))
    for bad in ("x session", "x-séance", ":authority"):
        with pytest.raises(SystemExit, match="--session-header must be an HTTP header name"):
            serve.validate(config("--session-header", bad))


def test_sync_tls_needs_a_certificate_peers_can_verify() -> None:
    with pytest.raises(SystemExit, match="--sync-tls needs --cert-path"):
        serve.validate(config("--sync-tls"))
    assert not check(config("--sync-tls", "--cert-path=/etc/tls"))
