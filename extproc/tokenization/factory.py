"""`--tokenizer` -> a tokenizer: `builtin`, `remote` or a tokenizer.json path."""

from __future__ import annotations

from pathlib import Path

from extproc.core.datastore import Datastore
from extproc.tokenization.chunking import BuiltinTokenizer
from extproc.tokenization.local import LocalTokenizer
from extproc.tokenization.remote import RemoteTokenizer
from extproc.tokenization.tokenizer_json import HFTokenizer

Tokenizer = LocalTokenizer | RemoteTokenizer


def make_tokenizer(spec: str, datastore: Datastore, timeout_s: float) -> Tokenizer:
    """`builtin`, `remote` or a tokenizer.json path (extproc/tokenization/__init__.py)."""
    if spec == "builtin":
        return BuiltinTokenizer()
    if spec == "remote":
        return RemoteTokenizer(datastore, timeout_s)
    if not Path(spec).is_file():
        raise ValueError(f"--tokenizer: no such file {spec!r} (or use builtin / remote)")
    return HFTokenizer(spec)
