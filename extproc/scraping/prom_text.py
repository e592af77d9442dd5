"""A fast, narrow reader of Prometheus text exposition: only the lines of the families asked for.

vLLM's /metrics is ~100 KB, mostly histogram buckets the picker never reads; prometheus_client's
parser would tokenise all of it in Python. Here, for each wanted metric name:
1. `bytes.find(b"\\n" + name)` (C speed) jumps to the next line starting with the name; the byte
   after the name must be `{`, a space or a tab (so `vllm:foo` does not match `vllm:foo_total`).
   Comment lines (`# HELP`, `# TYPE`) never match because they start with `#`.
2. Only that line is parsed: the label block `{k="v",...}` (quoted values with the escapes `\\\\`,
   `\\"` and `\\n`), then the value (float, `NaN`, `+Inf`); an optional timestamp is ignored.
   A malformed line is skipped, never fatal.
Everything else in the text is neither split nor decoded.
"""

from __future__ import annotations

import re

Sample = tuple[dict[str, str], float]

_LABEL = re.compile(rb'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(?:,|(?=\}))')
_ESCAPES = {b"\\\\": "\\", b'\\"': '"', b"\\n": "\n"}
_ESCAPE = re.compile(rb'\\[\\"n]')


def _unescape(raw: bytes) -> str:
    if b"\\" not in raw:
        return raw.decode("utf-8", "replace")
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)].encode(), raw).decode("utf-8", "replace")


def _parse_rest(rest: bytes, want_labels: bool) -> Sample | None:
    """Parse what follows the metric name on one line: `{labels} value [timestamp]`."""
    labels: dict[str, str] = {}
    if rest.startswith(b"{"):
        pos = 1
        size = len(rest)
        while True:
            while pos < size and rest[pos] in b" \t":
                pos += 1
            if pos >= size:
                return None
            if rest[pos] == 0x7D:  # "}"
                pos += 1
                break
            m = _LABEL.match(rest, pos)
            if m is None:
                return None
            if want_labels:
                labels[m.group(1).decode()] = _unescape(m.group(2))
            pos = m.end()
        rest = rest[pos:]
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return labels, value


def samples(text: bytes, name: bytes, want_labels: bool = True) -> list[Sample]:
    """Every sample of metric `name` in `text` as (labels, value), in order of appearance."""
    out: list[Sample] = []
    needle = b"\n" + name
    n = len(name)
    if text.startswith(name):
        i = 0
    else:
        i = text.find(needle)
        i = i + 1 if i >= 0 else -1
    while i >= 0:
        j = i + n
        c = text[j:j + 1]
        if c in (b"{", b" ", b"\t"):
            end = text.find(b"\n", j)
            if end < 0:
                end = len(text)
            sample = _parse_rest(text[j:end].rstrip(b"\r"), want_labels)
            if sample is not None:
                out.append(sample)
        i = text.find(needle, j)
        if i >= 0:
            i += 1
    return out
