"""Affinity hints: `prompt_cache_key` parsing, the precedence over the session header, the off-switch."""

from __future__ import annotations

import orjson
import pytest

from extproc.config.settings import AffinityConfig
from extproc.config.validate import valid_header_name
from extproc.control.affinity import PROMPT_CACHE_KEY, SESSION_HEADER, affinity_hint, header_to_read
from extproc.core.errors import EppError, ErrorCode
from extproc.prefix.hashing import affinity_hash
from extproc.request.openai import Api, parse_request

ON = AffinityConfig()


def parse(**extra: object) -> str:
    return parse_request(Api.CHAT, orjson.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})).affinity_key


def test_prompt_cache_key_string_empty_and_absent() -> None:
    assert parse(prompt_cache_key="conv-7") == "conv-7"
    assert parse(prompt_cache_key="") == ""
    assert parse() == ""
    assert parse(prompt_cache_key=None) == ""  # JSON null: absent


@pytest.mark.parametrize("value", [7, True, ["a"], {"k": "v"}, 1.5])
def test_prompt_cache_key_of_another_type_is_a_bad_request(value: object) -> None:
    with pytest.raises(EppError) as err:
        parse(prompt_cache_key=value)
    assert err.value.code is ErrorCode.BAD_REQUEST and err.value.http_status == 400
    assert err.value.message == "'prompt_cache_key' must be a string"


def test_prompt_cache_key_wins_over_the_session_header() -> None:
    assert affinity_hint(ON, "m", "", "conv-7", "sess-1") == (affinity_hash("m", "", "conv-7"), PROMPT_CACHE_KEY)
    assert affinity_hint(ON, "m", "", "", "sess-1") == (affinity_hash("m", "", "sess-1"), SESSION_HEADER)
    assert affinity_hint(ON, "m", "salt", "", "sess-1") == (affinity_hash("m", "salt", "sess-1"), SESSION_HEADER)
    assert affinity_hint(ON, "m", "", "", "") == (None, "")


def test_off_switch_and_empty_header_name() -> None:
    off = AffinityConfig(enabled=False)
    assert affinity_hint(off, "m", "", "conv-7", "sess-1") == (None, "")
    assert header_to_read(off) == "" and header_to_read(ON) == "x-session-id"
    no_header = AffinityConfig(session_header="")
    assert affinity_hint(no_header, "m", "", "", "sess-1") == (None, "")
    assert affinity_hint(no_header, "m", "", "conv-7", "")[1] == PROMPT_CACHE_KEY


@pytest.mark.parametrize(("name", "ok"), [("x-session-id", True), ("", True), ("x_conv.id~1", True),
                                          ("X-Session-Id", False), ("x session", False), (":path", False),
                                          ("x-séance", False), ("a\n", False)])
def test_header_names(name: str, ok: bool) -> None:
    assert valid_header_name(name) is ok
