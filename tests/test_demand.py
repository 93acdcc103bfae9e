"""Demand tracking: s(u) = w_recent·f_W(u) + w_lifetime·f_∞(u) over one request stream."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tessera.control.demand import DemandTracker


def test_score_combines_recent_window_and_lifetime() -> None:
    """Two retrievals inside the window score 2·w_recent + 2·w_lifetime."""
    d = DemandTracker(window=4, w_recent=1.0, w_lifetime=0.5)
    d.record(("a", "b"))
    d.record(("a",))
    assert (d.recent("a"), d.lifetime("a")) == (2, 2)
    assert d.score("a") == 2 * 1.0 + 2 * 0.5
    assert d.score("b") == 1.5
    assert d.score("never") == 0.0


def test_a_request_leaving_the_window_decrements_its_units_at_once() -> None:
    """After W more requests, a retrieval counts only in the lifetime part."""
    d = DemandTracker(window=2, w_recent=1.0, w_lifetime=0.5)
    assert d.record(("a",)) == ()
    d.record(("x",))
    assert d.recent("a") == 1
    left = d.record(("y",))
    assert left == ("a",)
    assert (d.recent("a"), d.lifetime("a")) == (0, 1)
    assert d.score("a") == 0.5


def test_the_window_counts_requests_not_units() -> None:
    """A request of many units advances the window clock by one."""
    d = DemandTracker(window=2, w_recent=1.0, w_lifetime=0.0)
    d.record(tuple("abcdefgh"))
    d.record(("z",))
    assert d.requests == 2
    assert all(d.recent(u) == 1 for u in "abcdefgh")


def test_admissible_needs_enough_retrievals_and_the_threshold() -> None:
    """admissible() is f_∞ >= min_retrievals and s >= θ."""
    d = DemandTracker(window=8, w_recent=1.0, w_lifetime=0.5)
    d.record(("a",))
    assert not d.admissible("a", 2, 0.0)
    assert d.admissible("a", 1, 1.5)
    assert not d.admissible("a", 1, 1.6)
    d.record(("a",))
    assert d.admissible("a", 2, 3.0)


@given(
    window=st.integers(1, 6),
    requests=st.lists(st.sets(st.sampled_from("abcdef"), max_size=4), max_size=40),
)
def test_counts_always_match_a_recount_of_the_stream(window: int, requests: list[set[str]]) -> None:
    """f_W is the count over the last W requests and f_∞ over all of them, after any stream."""
    d = DemandTracker(window=window, w_recent=1.0, w_lifetime=0.25)
    for r in requests:
        d.record(tuple(sorted(r)))
    d.check_invariants()
    recent = requests[-window:] if requests else []
    for u in "abcdef":
        assert d.recent(u) == sum(u in r for r in recent)
        assert d.lifetime(u) == sum(u in r for r in requests)
        assert d.score(u) == d.recent(u) + 0.25 * d.lifetime(u)
