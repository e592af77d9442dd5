"""`--tokenizer` -> a tokenizer: `builtin`, `remote`, `render` or a tokenizer.json path."""

from __future__ import annotations

from pathlib import Path

from extproc.core.datastore import Datastore
from extproc.tokenization.chunking import BuiltinTokenizer
from extproc.tokenization.local import LocalTokenizer
from extproc.tokenization.remote import RemoteTokenizer
from extproc.tokenization.tokenizer_json import HFTokenizer

Tokenizer = LocalTokenizer | RemoteTokenizer


def make_tokenizer(spec: str, datastore: Datastore, timeout_s: float) -> Tokenizer:
    """`builtin`, `remote`, `render` or a tokenizer.json path (extproc/tokenization/__init__.py)."""
    if spec == "builtin":
        return BuiltinTokenizer()
    if spec in ("remote", "render"):
        return RemoteTokenizer(datastore, timeout_s, render=spec == "render")
    if not Path(spec).is_file():
        raise ValueError(f"--tokenizer: no such file {spec!r} (or use builtin / remote / render)")
    return HFTokenizer(spec)
