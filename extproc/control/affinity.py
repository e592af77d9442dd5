"""Affinity hints: a client-chosen key that groups requests sharing a prefix (a user, a conversation).

Sources, in order of precedence (the first present wins; "" counts as absent):
1. `previous_response_id` of a `/v1/responses` request: the chain's history lives on the server
   that produced that response (vLLM keeps its response store in the engine's process), so it
   points at one endpoint. The picker learns which from the responses themselves
   (extproc/control/response_ids.py): the id a response carries is recorded, under
   `response_key(id)`, on the endpoint that served it;
2. `prompt_cache_key` in the body (OpenAI's field);
3. the session header, `--session-header` (default `x-session-id`; "" reads no header).
`--affinity-hints=false` ignores all three. The key is hashed with the model and cache salt
(`prefix.hashing.affinity_hash`) and the scheduler treats it as a one-block chain of its own
(extproc/scheduling/scheduler.py): endpoints that recorded the hash before are in
`request.affinity_match`. The key itself is never stored, logged or used as a metric label;
metrics count requests by `SOURCES` only.
"""

from __future__ import annotations

from extproc.config.settings import AffinityConfig
from extproc.prefix.hashing import affinity_hash

PREVIOUS_RESPONSE_ID = "previous_response_id"
PROMPT_CACHE_KEY = "prompt_cache_key"
SESSION_HEADER = "session_header"
SOURCES = (PREVIOUS_RESPONSE_ID, PROMPT_CACHE_KEY, SESSION_HEADER)


def response_key(response_id: str) -> str:
    """The affinity key of a response id: a domain of its own, apart from client-chosen keys."""
    return f"\x00response\x00{response_id}"

def header_to_read(config: AffinityConfig) -> str:
    """The request header the processor keeps for this feature ("" when none)."""
    return config.session_header if config.enabled else ""


def affinity_hint(config: AffinityConfig, model: str, cache_salt: str, cache_key: str,
                  header_value: str, previous_response_id: str = "") -> tuple[int | None, str]:
    """(hash of the key, its source), or (None, "") when the request carries no hint."""
    if not config.enabled:
        return None, ""
    if previous_response_id:
        return affinity_hash(model, cache_salt, response_key(previous_response_id)), PREVIOUS_RESPONSE_ID
    if cache_key:
        return affinity_hash(model, cache_salt, cache_key), PROMPT_CACHE_KEY
    if header_value and config.session_header:
        return affinity_hash(model, cache_salt, header_value), SESSION_HEADER
    return None, ""
