"""Prefill/decode disaggregation in the scheduler and the director: the role filters, the deciders,
the decode pick then the prefill pick, both recorded in the prefix index and both in flight
(extproc/scheduling/filters/roles.py, deciders.py, disagg.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import pytest

from extproc.config.settings import DisaggConfig, EppConfig
from extproc.control.director import Director, RequestContext
from extproc.core.datastore import ROLE_LABEL, Datastore, Endpoint, EndpointSpec
from extproc.core.errors import EppError
from extproc.discovery.static import parse_endpoints
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.config_loader import load_text
from extproc.scheduling.deciders import AlwaysDecider, PrefixBasedDecider
from extproc.scheduling.filters.roles import decode_filter, prefill_filter
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Decision, Scheduler
from testkit.pd import LLMD_PD

CFG = EppConfig()
BLOCK = CFG.prefix.block_size_bytes  # 64 bytes, 16 tokens at 4 bytes a token


def spec(i: int, role: str) -> EndpointSpec:
    return EndpointSpec(f"10.0.0.{i}", 8000, labels=((ROLE_LABEL, role),) if role else ())


def pool(*roles: str) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(spec(i, role) for i, role in enumerate(roles, start=1))
    return ds


def decision(ds: Datastore, matched: int, **kw: object) -> Decision:
    return Decision(endpoints=[ds.snapshot()[0]], matched_blocks=matched, total_blocks=10, scores=[], total=0.0,
                    **kw)  # type: ignore[arg-type]


def addresses(eps: Sequence[Endpoint]) -> list[str]:
    return [ep.address for ep in eps]


def test_role_filters_keep_what_llm_d_keeps() -> None:
    ds = pool("prefill", "decode", "prefill-decode", "both", "", "encode")
    req = SchedulingRequest("r", "m")
    assert addresses(prefill_filter().filter(req, ds.snapshot())) == ["10.0.0.1", "10.0.0.3", "10.0.0.4"]
    # Unlabelled endpoints count as decode, as llm-d counts them.
    assert addresses(decode_filter().filter(req, ds.snapshot())) == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]


def test_static_endpoints_take_their_role_from_endpoint_roles() -> None:
    specs = parse_endpoints(["127.0.0.1:8001,127.0.0.1:8002", "[::1]:8003"],
                            ["127.0.0.1:8001=prefill", "[::1]:8003=prefill-decode"])
    assert [(s.key, s.role) for s in specs] == [("127.0.0.1:8001", "prefill"), ("127.0.0.1:8002", ""),
                                                ("[::1]:8003", "prefill-decode")]
    with pytest.raises(ValueError, match="not among --endpoints"):
        parse_endpoints(["127.0.0.1:8001"], ["127.0.0.1:8002=decode"])
    with pytest.raises(ValueError, match="ROLE one of"):
        parse_endpoints(["127.0.0.1:8001"], ["127.0.0.1:8001=encoder"])


def test_prefix_based_decider_counts_the_prompt_tokens_the_decode_endpoint_lacks() -> None:
    ds = pool("decode")
    decider = PrefixBasedDecider(DisaggConfig(non_cached_tokens=80), BLOCK, 4)
    # 640 bytes = 160 tokens; 5 blocks of 64 bytes cached = 80 tokens; 80 uncached.
    req = SchedulingRequest("r", "m", prompt_bytes=640)
    assert decider.decide(req, decision(ds, 5)) == (True, 80)
    assert decider.decide(req, decision(ds, 6)) == (False, 64)
    assert decider.decide(req, decision(ds, 50)) == (False, 0)  # a match beyond the prompt is all of it
    # Tokenized: the exact count, and the share the index matched.
    assert decider.decide(replace(req, prompt_tokens=100), decision(ds, 5)) == (False, 50)
    # The precise index's match where the endpoint's KV events are usable.
    precise = decision(ds, 0, precise_matched=3, precise_total=4, precise_usable=True)
    assert decider.decide(replace(req, prompt_tokens=400), precise) == (True, 100)
    # promptTokens gates on the prompt's length; nonCachedTokens 0 never disaggregates.
    gated = PrefixBasedDecider(DisaggConfig(non_cached_tokens=10, prompt_tokens=161), BLOCK, 4)
    assert gated.decide(req, decision(ds, 0)) == (False, 160)
    assert PrefixBasedDecider(DisaggConfig(), BLOCK, 4).decide(req, decision(ds, 0)) == (False, 160)
    assert AlwaysDecider(BLOCK, 4).decide(req, decision(ds, 10)) == (True, 0)


def pd_scheduler(non_cached: int = 48) -> Scheduler:
    cfg, profile = load_text(LLMD_PD.replace("nonCachedTokens: 48", f"nonCachedTokens: {non_cached}"), CFG)
    return build_scheduler(cfg, PrefixIndex(cfg.prefix.lru_capacity_per_server), profile)


def request(prompt: bytes, rid: str = "r") -> SchedulingRequest:
    hashes = block_hashes([prompt], "m", block_size=BLOCK, max_blocks=CFG.prefix.max_prefix_blocks)
    return SchedulingRequest(rid, "m", block_hashes=hashes, prompt_bytes=len(prompt))


LONG = b"a long shared system prompt, " * 40  # 1,160 bytes: ~290 tokens, 19 blocks (the last partial)
SHORT = b"hi there"


def test_decode_first_then_the_prefill_pick_among_prefill_endpoints_both_recorded() -> None:
    ds = pool("prefill", "decode", "prefill", "decode")
    sched = pd_scheduler()
    req = request(LONG)
    d = sched.schedule(req, ds.snapshot())
    assert d.primary.spec.role == "decode" and len(d.endpoints) == 1
    assert d.pd == "disaggregated" and d.uncached_tokens == 290
    assert d.prefill is not None and d.prefill.primary.spec.role == "prefill"
    assert d.prefiller == d.prefill.primary.key
    held = sched.index.match(req.block_hashes, [ep.key for ep in ds.snapshot()])  # type: ignore[union-attr]
    assert held == {d.primary.key: 19, d.prefill.primary.key: 19}  # the prompt recorded for both
    explained = d.explain()
    assert f"endpoint={d.primary.key}" in explained and f"prefill={d.prefiller} (matched=0/19" in explained
    assert "pd=disaggregated; uncached_tokens=290" in explained

    # The same prompt again: the decode endpoint that holds it is chosen again, and its cache
    # leaves nothing to prefill elsewhere.
    again = sched.schedule(request(LONG, "r2"), ds.snapshot())
    assert again.primary is d.primary and again.pd == "decode-only" and again.prefill is None
    assert again.prefiller is None and again.uncached_tokens == 0
    assert "pd=decode-only" in again.explain() and "prefill=" not in again.explain()
    # A short prompt is never worth it.
    short = sched.schedule(request(SHORT, "r3"), ds.snapshot())
    assert short.pd == "decode-only" and short.prefill is None


def test_a_prefill_decode_endpoint_is_never_its_own_prefiller() -> None:
    ds = pool("prefill-decode")
    d = pd_scheduler().schedule(request(LONG), ds.snapshot())
    assert d.pd == "decode-only" and d.prefill is None  # it prefills itself
    ds = pool("prefill-decode", "prefill-decode")
    d = pd_scheduler().schedule(request(LONG), ds.snapshot())
    assert d.pd == "disaggregated" and d.prefill is not None and d.prefill.primary is not d.primary


def test_no_prefill_endpoint_fails_the_request_and_undoes_the_decode_record() -> None:
    ds = pool("", "decode")  # no role labels beyond decode: nothing can prefill
    sched = pd_scheduler()
    req = request(LONG)
    with pytest.raises(EppError, match="no prefill endpoint") as info:
        sched.schedule(req, ds.snapshot())
    assert info.value.http_status == 503
    assert sched.index.match(req.block_hashes, [ep.key for ep in ds.snapshot()]) == {}  # type: ignore[union-attr]
    assert sched.schedule(request(SHORT), ds.snapshot()).pd == "decode-only"  # short prompts still go


def test_no_decode_endpoint_is_a_503_before_any_decision() -> None:
    with pytest.raises(EppError, match="decode-filter"):
        pd_scheduler().schedule(request(LONG), pool("prefill", "prefill").snapshot())


def route(director: Director, prompt: str, rid: str) -> Decision:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    return director.route(RequestContext(path="/v1/completions", request_id=rid), body)


def test_the_director_counts_a_disaggregated_request_on_both_endpoints_until_it_ends() -> None:
    ds = pool("prefill", "decode")
    sched = pd_scheduler()
    director = Director(CFG, ds, sched)
    prefill, decode = ds.snapshot()
    d = route(director, LONG.decode(), "r1")
    assert d.primary is decode and d.prefill is not None and d.prefill.primary is prefill
    assert (prefill.inflight, decode.inflight) == (1, 1)
    director.complete(decode, d, ok=True)
    assert (prefill.inflight, decode.inflight) == (0, 0)
    short = route(director, "hi", "r2")
    assert short.prefill is None and (prefill.inflight, decode.inflight) == (0, 1)
    director.complete(decode, short, ok=True)
    assert decode.inflight == 0


def test_without_a_pd_handler_roles_change_nothing() -> None:
    labelled, plain = pool("prefill", "decode"), pool("", "")
    for ds in (labelled, plain):
        sched = build_scheduler(CFG, PrefixIndex(CFG.prefix.lru_capacity_per_server))
        assert sched.prefill is None
        d = sched.schedule(request(LONG), ds.snapshot())
        assert d.pd == "" and d.prefill is None and "; pd=" not in d.explain()
