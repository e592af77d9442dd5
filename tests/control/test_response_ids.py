"""Response ids read from the head of a /v1/responses body, bounded; recorded where the response was served."""

from __future__ import annotations

import orjson

from extproc.control.response_ids import HEAD_BYTES, MAX_ID, ResponseIdReader, ResponseWatch


def test_the_id_of_a_json_answer_and_of_a_stream_split_across_chunks() -> None:
    assert ResponseIdReader().feed(orjson.dumps({"id": "resp_1", "output": [{"id": "msg_2"}]})) == "resp_1"
    stream = (b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, '
              b'"response": {"id": "resp_abc", "status": "in_progress"}}\n\n')
    reader = ResponseIdReader()
    found = [reader.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)]
    assert next(f for f in found if f) == "resp_abc" and found[0] is None


def test_reading_stops_after_the_head() -> None:
    reader = ResponseIdReader()
    assert reader.feed(b" " * HEAD_BYTES) is None
    assert reader.feed(b'{"id": "resp_late"}') is None  # past the first 4 KiB: never inspected
    assert ResponseIdReader().feed(b'{"id": "' + b"x" * (MAX_ID + 1) + b'"}') is None


def test_the_watch_records_once_on_the_endpoint_that_served() -> None:
    learnt: list[tuple[str, str]] = []
    watch = ResponseWatch("10.0.0.1:8000", None, lambda ep, rid: learnt.append((ep, rid)))
    watch.endpoint = "10.0.0.2:8000"  # the proxy reported a fallback
    watch.feed(b'{"id": "resp_9", ')
    watch.feed(b'"output": [{"id": "resp_other"}]}')
    assert watch.finish() is None
    assert learnt == [("10.0.0.2:8000", "resp_9")]
