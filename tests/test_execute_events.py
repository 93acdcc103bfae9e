"""The generation node's execute stream: typed, versioned events in one tagged union."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from tessera.errors import DecodeError
from tessera.messages.generation import EXECUTE_EVENTS, DoneEvent, ErrorEvent, RequestStats, TokenEvent, TopLogprob
from tessera.wire import WIRE_VERSION, decode_tagged, encode


@pytest.mark.parametrize("event", [
    TokenEvent(WIRE_VERSION, 42, " the"),
    TokenEvent(WIRE_VERSION, 7, "é", -0.25, (TopLogprob(7, -0.25), TopLogprob(9, -1.5))),
    DoneEvent(WIRE_VERSION, "length", RequestStats(prompt_tokens=30, local_tokens=12, local_units=1,
                                                    completion_tokens=4)),
    ErrorEvent(WIRE_VERSION, "RuntimeError: engine step failed"),
])
def test_every_event_round_trips_through_one_ndjson_line(event: TokenEvent | DoneEvent | ErrorEvent) -> None:
    """Each event encodes to one line that decodes back to an equal event of the same kind."""
    line = encode(event)
    assert b"\n" not in line
    assert decode_tagged(EXECUTE_EVENTS, line) == event


def test_an_unknown_kind_is_a_decode_error_naming_the_kinds() -> None:
    """A line whose kind this version does not know is refused, not misread as a token."""
    with pytest.raises(DecodeError, match="'token', 'done', 'error'"):
        decode_tagged(EXECUTE_EVENTS, orjson.dumps({"version": WIRE_VERSION, "kind": "progress"}))


def test_a_done_event_with_a_mistyped_stat_names_the_field() -> None:
    """A malformed stats field is a DecodeError naming it (stats.local_tokens)."""
    line = orjson.dumps({"version": WIRE_VERSION, "kind": "done", "finish_reason": "stop",
                         "stats": {"local_tokens": "12"}})
    with pytest.raises(DecodeError, match=r"stats\.local_tokens"):
        decode_tagged(EXECUTE_EVENTS, line)


def test_the_tier_mapping_covers_every_prompt_token_field() -> None:
    """tokens_by_source names every per-tier token field of RequestStats exactly once."""
    stats = RequestStats(prefix_cached_tokens=1, local_tokens=2, remote_tokens=3, computed_unit_tokens=4,
                         recomputed_tokens=5, local_units=6, remote_units=7, computed_units=8,
                         coalesced_unit_tokens=9, coalesced_units=10)
    assert dict(stats.tokens_by_source()) == {"prefix": 1, "local": 2, "remote": 3, "computed": 4, "coalesced": 9,
                                              "recomputed": 5}
    assert dict(stats.units_by_preparation()) == {"local": 6, "remote": 7, "computed": 8, "coalesced": 10}
    assert stats.cached_tokens == 1 + 2 + 3
    token_fields = {f.name for f in dataclasses.fields(RequestStats)
                    if f.name.endswith("_tokens") and f.name not in ("prompt_tokens", "completion_tokens")}
    assert len(token_fields) == len(stats.tokens_by_source())
