"""Trace token classification (paper §3.1) and answer F1."""

from __future__ import annotations

import pytest

from tessera.benchmark.quality import best_f1, f1, normalize_answer
from tessera.benchmark.trace import StreamState, analyze, classify


def test_first_prompt_is_all_new() -> None:
    """Nothing precedes the first prompt of a stream: every unit token is new."""
    c = classify(StreamState(), [1, 2, 3, 4, 5, 6], [(2, 4), (4, 6)])
    assert (c.prefix, c.repeat, c.new) == (0, 0, 4)


def test_same_unit_after_a_different_lead_is_a_non_prefix_repeat() -> None:
    """A unit seen before but placed after a divergent token is a non-prefix repeat."""
    s = StreamState()
    classify(s, [9, 9, 1, 2, 3], [(2, 5)])
    c = classify(s, [9, 8, 1, 2, 3], [(2, 5)])
    assert (c.prefix, c.repeat, c.new) == (0, 3, 0)


def test_tokens_inside_the_matching_prefix_are_prefix_covered() -> None:
    """The longest prefix shared with any earlier prompt covers unit tokens inside it."""
    s = StreamState()
    classify(s, [7, 1, 2, 3, 4], [(1, 3), (3, 5)])
    c = classify(s, [7, 1, 2, 5, 6], [(1, 3), (3, 5)])
    assert (c.prefix, c.repeat, c.new) == (2, 0, 2)


def test_a_unit_straddling_the_prefix_end_splits() -> None:
    """Unit tokens before the divergence are prefix-covered, the rest classified by recurrence."""
    s = StreamState()
    classify(s, [1, 2, 3, 4], [(0, 4)])
    classify(s, [5, 6], [(0, 2)])
    c = classify(s, [1, 2, 5, 6], [(0, 2), (2, 4)])
    assert (c.prefix, c.repeat, c.new) == (2, 2, 0)


def test_streams_do_not_share_history() -> None:
    """Recurrence is counted within a stream only."""
    out = analyze([
        {"stream": "a", "tokens": [1, 2, 3], "units": [(0, 3)]},
        {"stream": "b", "tokens": [1, 2, 3], "units": [(0, 3)]},
    ])
    assert out["total"]["new"] == 1.0
    assert out["total"]["requests_mostly_repeat"] == 0.0


def test_requests_mostly_repeat_counts_half_or_more() -> None:
    s = StreamState()
    classify(s, [0, 1, 2], [(1, 3)])
    c = classify(s, [5, 1, 2, 8, 9], [(1, 3), (3, 5)])
    assert (c.repeat, c.new, c.requests_mostly_repeat) == (2, 2, 1)


@pytest.mark.parametrize(("pred", "gold", "score"), [
    ("The Eiffel Tower", "eiffel tower", 1.0),
    ("7 May 2023", "7 May, 2023", 1.0),
    ("in Paris", "Paris", 2 / 3),
    ("London", "Paris", 0.0),
])
def test_f1_normalizes_case_punctuation_and_articles(pred: str, gold: str, score: float) -> None:
    assert f1(pred, gold) == pytest.approx(score)


def test_best_f1_takes_the_best_gold() -> None:
    assert best_f1("Exeter College", ["Oxford", "Exeter College"]) == 1.0
    assert best_f1("x", []) == 0.0
    assert normalize_answer("  A  Cat! ") == "cat"
