"""The committed generated protobuf modules are exactly what protos/generate.py produces now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from testkit.procs import REPO_ROOT


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", REPO_ROOT / "protos" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "extproc" / "pb").iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in (REPO_ROOT / "extproc" / "pb").iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"


def test_upb_backend_is_used() -> None:
    from google.protobuf.internal import api_implementation

    assert api_implementation.Type() == "upb"
