"""mixed-shapes: every shape's request is one the picker parses by prefix, and a conversation's
turns extend each other in the picker's segments; the oracle tokenizes them as the simulator does."""

from __future__ import annotations

import orjson

from bench.lib.oracle import workload_oracle
from bench.lib.shapes_workload import SHAPES
from bench.lib.workloads import body, build
from extproc.request.openai import api_from_path, parse_request


def test_every_shape_parses_and_its_turns_extend_each_other() -> None:
    w = build("mixed-shapes", quick=True)
    assert {s.api for s in w.sessions} == set(SHAPES)
    for session in w.sessions[: len(SHAPES)]:
        answers = [f"answer {k}" for k in range(session.turns)]
        earlier: list[bytes] = []
        for turn in range(session.turns):
            path, request = body(session, turn, answers[:turn])
            segments = parse_request(api_from_path(path), orjson.dumps(request)).segments
            assert (segments and segments[: len(earlier)] == earlier) or session.api == "completion_turns", session.api
            earlier = segments
    result = workload_oracle(w)
    assert 0.5 < result.hit_rate < 1.0 and result.working_set_blocks > 0
