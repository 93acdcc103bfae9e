"""Admission and eviction policies on a tiny local tier (block size B = 4)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.config import ControlConfig
from tessera.control.admission import (
    ADMISSIONS,
    AdmissionPolicy,
    DemandAdmission,
    LruAdmission,
    admission_names,
    make_admission,
)
from tessera.control.local import LocalTier
from tessera.errors import ConfigError
from tessera.units import blocks_for

B = 4


class Tier:
    """A local tier driven the way the plane drives it: observe a request, then admit its units."""

    def __init__(self, capacity_blocks: int, **control: object) -> None:
        policy = make_admission(str(control.pop("admission", "demand")), ControlConfig(**control))  # type: ignore[arg-type]
        self.local = LocalTier("n", capacity_blocks, policy)
        self.sizes: dict[str, int] = {}
        self.evicted: list[str] = []

    @property
    def policy(self) -> AdmissionPolicy:
        return self.local.policy

    def request(self, units: dict[str, int]) -> dict[str, list[str] | None]:
        """units: id -> tokens. Returns, per unit, the victims of its admission (None = not admitted)."""
        blocks = {u: blocks_for(n, B) for u, n in units.items()}
        self.sizes.update(blocks)
        self.policy.observe(tuple(units))
        out: dict[str, list[str] | None] = {}
        for u, b in blocks.items():
            out[u] = None if self.local.holds(u) else self.local.admit(u, b, "r", pinned=units)
            if out[u] is not None:
                self.evicted += out[u] or []
                self.local.confirm([u], self.sizes)  # the node inserted it
        return out

    def resident(self) -> set[str]:
        return set(self.policy.resident)


# --- demand ------------------------------------------------------------------------------


def test_free_space_is_taken_at_the_first_retrieval() -> None:
    """With room to spare, a unit is admitted at first sight whatever its score or θ."""
    tier = Tier(100, theta=10.0)
    assert tier.request({"a": 8, "b": 4}) == {"a": [], "b": []}
    assert tier.request({"a": 8, "b": 4}) == {"a": None, "b": None}  # held already
    assert tier.resident() == {"a", "b"}


def test_when_full_a_unit_is_not_admitted_at_its_first_retrieval() -> None:
    """A full tier: the first retrieval evicts nothing, even of colder residents; the second may."""
    tier = Tier(1, theta=0.0, window=1)
    tier.request({"x": 4})  # free space: x resident
    assert tier.request({"a": 4}) == {"a": None}  # s(x) fell to 0.5 < s(a) = 1.5, still refused
    assert tier.request({"a": 4}) == {"a": ["x"]}
    assert tier.resident() == {"a"}


def test_admit_first_lets_a_first_retrieval_evict_when_the_score_reaches_theta() -> None:
    """admit_first lifts only the first-retrieval rule of eviction; θ still applies."""
    for theta, admitted in ((1.5, True), (1.6, False)):
        tier = Tier(1, theta=theta, admit_first=True, window=1, w_recent=1.0, w_lifetime=0.5)
        tier.request({"x": 4})  # then s(x) = 0.5 once it leaves the window
        assert tier.request({"a": 4}) == ({"a": ["x"]} if admitted else {"a": None})


def test_a_unit_below_theta_is_not_a_candidate() -> None:
    """Full tier: two retrievals score 3.0 with the default weights; θ = 3.5 needs a third."""
    tier = Tier(1, theta=3.5)
    tier.request({"x": 4})  # free space: x resident with s = 1.5
    tier.request({"a": 4})
    assert tier.request({"a": 4}) == {"a": None}
    assert tier.request({"a": 4}) == {"a": ["x"]}


def test_capacity_is_counted_in_whole_blocks() -> None:
    """A 5-token unit takes ceil(5/4) = 2 blocks; 3 blocks hold one such unit, not two."""
    tier = Tier(3, theta=0.0, admit_first=True)
    tier.request({"a": 5})
    assert tier.local.used_blocks == 2
    tier.request({"a": 5, "b": 5})  # b scores 1.5 < a's 3.0: it cannot displace a
    assert tier.resident() == {"a"}


def test_eviction_takes_strictly_lower_scores_lowest_first() -> None:
    """A hot candidate displaces the coldest residents, whole units, until it fits."""
    tier = Tier(4, theta=0.0, admit_first=True)
    tier.request({"cold": 4})  # 1 block, score 1.5
    tier.request({"warm": 4})
    tier.request({"warm": 4})  # score 3.0
    tier.request({"mid": 8})  # 2 blocks, score 1.5: fills the tier (4 blocks)
    for _ in range(3):
        out = tier.request({"hot": 8})  # needs 2 blocks
    assert tier.evicted == ["cold", "mid"]
    assert tier.resident() == {"warm", "hot"}
    assert out == {"hot": None}  # already resident at the third request


def test_a_candidate_is_refused_when_only_equal_or_higher_scores_could_make_room() -> None:
    """Residents with the candidate's own score are never victims."""
    tier = Tier(2, theta=0.0, admit_first=True)
    tier.request({"a": 8})  # 2 blocks, score 1.5
    assert tier.request({"b": 8}) == {"b": None}  # also 1.5: not strictly lower
    assert tier.resident() == {"a"}


def test_units_whose_demand_faded_lose_to_recently_popular_ones() -> None:
    """Once its retrievals leave the window, an old favourite is displaced by a newly popular unit."""
    tier = Tier(1, theta=0.0, window=3)
    for _ in range(3):
        tier.request({"old": 4})  # f_∞ = 3
    assert tier.resident() == {"old"}
    for filler in ("f1", "f2", "f3"):
        tier.request({filler: 4})  # one-off units push old out of the window: s(old) = 0.5·3 = 1.5
    assert tier.resident() == {"old"}
    tier.request({"new": 4})
    out = tier.request({"new": 4})  # s(new) = 2 + 1 = 3.0 > 1.5
    assert out == {"new": ["old"]}
    assert tier.resident() == {"new"}


def test_pinned_units_are_never_victims() -> None:
    """The request's own units are skipped by the eviction walk."""
    tier = Tier(2, theta=0.0, admit_first=True)
    tier.request({"low": 8})
    tier.request({"hot": 8})
    out = tier.request({"hot": 8, "low": 8})  # hot (3.0) would evict low (3.0 after this request)
    assert out["hot"] is None
    assert tier.resident() == {"low"}


def test_ranked_lists_residents_in_eviction_order_with_exact_scores() -> None:
    """ranked() re-keys stale entries: a unit retrieved again moves up."""
    policy = DemandAdmission(ControlConfig(window=8))
    for u in ("a", "b", "c"):
        policy.observe((u,))
        policy.add(u, 1)
    policy.observe(("a",))
    policy.observe(("a",))
    assert [u for _, u in policy.ranked()] == ["b", "c", "a"]
    assert policy.ranked()[-1] == (policy.score("a"), "a")
    policy.check_invariants()


# --- the two regimes: demand never loses to LRU ------------------------------------------


def _hits(tier: Tier, stream: list[dict[str, int]]) -> int:
    """Units already held when their request arrives (reuse), over the stream."""
    hits = 0
    for request in stream:
        hits += sum(tier.local.holds(u) for u in request)
        tier.request(request)
    return hits


def test_tiers_holding_the_working_set_reuse_as_much_as_lru() -> None:
    """Working set of 6 one-block units, capacity 8: after the first pass both policies hit everything."""
    stream = [{u: 4 for u in "abcdef"[i % 3 * 2:i % 3 * 2 + 2]} for i in range(12)]
    demand, lru = _hits(Tier(8), stream), _hits(Tier(8, admission="lru"), stream)
    assert demand == lru == sum(len(r) for r in stream) - 6


def test_tiers_smaller_than_the_working_set_keep_the_hot_units() -> None:
    """Capacity 2 under a cyclic scan of 3 units: LRU always evicts the next one needed; demand keeps two."""
    stream = [{u: 4} for u in "abc" * 8]
    lru = _hits(Tier(2, admission="lru"), stream)
    demand = _hits(Tier(2), stream)
    assert lru == 0
    assert demand >= 2 * 7 and demand > lru


# --- lru ---------------------------------------------------------------------------------


def test_lru_admits_at_the_first_retrieval_and_evicts_the_least_recently_used() -> None:
    """The ablation baseline: everything is admitted; the stalest resident goes first."""
    tier = Tier(2, admission="lru")
    tier.request({"a": 4})
    tier.request({"b": 4})
    tier.request({"a": 4})  # a is now more recent than b
    assert tier.request({"c": 4}) == {"c": ["b"]}
    assert tier.resident() == {"a", "c"}


def test_lru_skips_units_that_are_not_safe_to_reclaim() -> None:
    """A pinned resident is passed over for the next least recent one."""
    tier = Tier(2, admission="lru")
    tier.request({"a": 4})
    tier.request({"b": 4})
    assert tier.request({"a": 4, "c": 4}) == {"a": None, "c": ["b"]}


# --- registry ----------------------------------------------------------------------------


def test_policies_are_found_by_name_and_new_ones_can_be_registered(register: Any) -> None:
    """The registry knows demand and lru, rejects unknown names, and accepts new policies."""
    assert {"demand", "lru"} <= set(admission_names())
    assert isinstance(make_admission("lru", ControlConfig()), LruAdmission)
    with pytest.raises(ConfigError, match="known: "):
        make_admission("nope", ControlConfig())

    @register(ADMISSIONS, "never")
    class Never(LruAdmission):
        def wants(self, unit_id: str) -> bool:
            return False

    tier = Tier(8, admission="never")
    assert tier.request({"a": 4}) == {"a": None}


# --- properties ----------------------------------------------------------------------------

streams = st.lists(
    st.dictionaries(st.sampled_from("abcdefghij"), st.integers(1, 12), min_size=1, max_size=4),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(stream=streams, capacity=st.integers(1, 8), window=st.integers(1, 6),
       theta=st.sampled_from([0.0, 1.5, 3.0]), admission=st.sampled_from(["demand", "lru"]))
def test_capacity_is_never_exceeded(stream: list[dict[str, int]], capacity: int, window: int,
                                    theta: float, admission: str) -> None:
    """After every admission the tier's blocks fit its capacity, for both policies."""
    tier = Tier(capacity, admission=admission, window=window, theta=theta)
    for request in stream:
        tier.request(request)
        assert tier.local.used_blocks <= capacity
        tier.local.check_invariants()


@settings(max_examples=150, deadline=None)
@given(stream=streams, capacity=st.integers(1, 8), window=st.integers(1, 6))
def test_a_first_retrieval_only_ever_takes_free_space_by_default(stream: list[dict[str, int]], capacity: int,
                                                                 window: int) -> None:
    """Under the demand policy a unit at its first retrieval is admitted only without victims."""
    tier = Tier(capacity, window=window, theta=0.0)
    seen: set[str] = set()
    for request in stream:
        for u, victims in tier.request(request).items():
            if u not in seen:
                assert not victims, f"{u} evicted {victims} at its first retrieval"
        seen.update(request)


@settings(max_examples=200, deadline=None)
@given(stream=streams, capacity=st.integers(1, 8), window=st.integers(1, 6),
       theta=st.sampled_from([0.0, 1.5, 3.0]))
def test_eviction_never_removes_a_unit_scoring_at_least_the_candidate(
        stream: list[dict[str, int]], capacity: int, window: int, theta: float) -> None:
    """Every victim's score is strictly below its candidate's at the moment of eviction."""
    tier = Tier(capacity, window=window, theta=theta)
    policy = tier.policy
    for request in stream:
        blocks = {u: blocks_for(n, B) for u, n in request.items()}
        tier.sizes.update(blocks)
        policy.observe(tuple(request))
        for u, b in blocks.items():
            if tier.local.holds(u):
                continue
            before = {v: policy.score(v) for v in policy.resident}
            victims = tier.local.admit(u, b, "r", pinned=request)
            for v in victims or []:
                assert before[v] < policy.score(u), (v, before[v], u, policy.score(u))
                assert v not in request
            if victims is not None:
                tier.local.confirm([u], tier.sizes)
        assert isinstance(policy, DemandAdmission)
        policy.check_invariants()
