"""Defaults live in one place: no function of the product keeps a keyword default of its own that
repeats a configured value.

A value configured in extproc/config/settings.py (EppConfig and its sections), in
extproc/config/sidecar.py (SidecarConfig) or in prefix_epp_sim/config.py (SimConfig) must reach a
constructor or function from the config: the parameter is required (the wiring in
extproc/runtime/app.py, extproc/scheduling/build.py or the simulator's server passes the
configured value) or defaults to the config field itself
(`KVEventsConfig().speculative_ttl_s`). A literal such as `max_blocks: int = 256` is what this test
refuses. Only distinctive numbers count (0 and 1 are everybody's defaults).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

from extproc.config import settings
from extproc.config.sidecar import SidecarConfig
from prefix_epp_sim.config import SimConfig

REPO = Path(__file__).resolve().parents[1]


def python_files(top: str) -> list[Path]:
    return sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def configured_numbers(cls: type) -> set[float]:
    """Every number set by default in a config dataclass and the config dataclasses inside it."""
    out: set[float] = set()
    for value in settings.defaults_of(cls).values():
        if dataclasses.is_dataclass(value):
            out |= configured_numbers(type(value))
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, int | float) and not isinstance(v, bool) and v not in (0, 1):
                out.add(v)
    return out


def literal_defaults(path: Path) -> list[tuple[int, str, str, Any]]:
    """(line, function, parameter, value) for each number literal a signature defaults to."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        positional = a.posonlyargs + a.args
        pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
                 *((k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None)]
        for arg, default in pairs:
            try:
                value = ast.literal_eval(default)
            except ValueError:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.append((node.lineno, node.name, arg.arg, value))
    return out


def twins(top: str, configured: set[float]) -> list[str]:
    return [f"{p.relative_to(REPO)}:{line}: {fn}({arg}={value!r})"
            for p in python_files(top) if p.parts[-2:] != ("config", "settings.py") and "pb" not in p.parts
            for line, fn, arg, value in literal_defaults(p) if value in configured]


def test_no_product_signature_repeats_a_configured_value() -> None:
    configured = (configured_numbers(settings.EppConfig) | configured_numbers(settings.ProxyTrafficConfig)
                  | configured_numbers(SidecarConfig))
    bad = twins("extproc", configured)
    assert not bad, ("these defaults repeat a value of extproc/config/settings.py; make the parameter "
                     "required or default it to the config field:\n" + "\n".join(bad))


def test_no_simulator_signature_repeats_a_configured_value() -> None:
    bad = twins("prefix_epp_sim", configured_numbers(SimConfig))
    assert not bad, ("these defaults repeat a value of prefix_epp_sim/config.py; make the parameter "
                     "required or default it to the config field:\n" + "\n".join(bad))


def test_the_check_sees_a_twin(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def block_hashes(segments, *, max_blocks: int = 256, parent: int = 0) -> None: ...\n")
    assert literal_defaults(module) == [(1, "block_hashes", "max_blocks", 256), (1, "block_hashes", "parent", 0)]
    assert 2048 in configured_numbers(settings.EppConfig) and 256 in configured_numbers(SimConfig)
