"""Admission and eviction policies: which units a cache tier retains, and what it gives up for them.

One rule serves both tiers (paper §5.2); each tier owns its own policy instance, fed by its
own request stream. A policy owns the tier's demand history and its *resident set*
(unit -> blocks) but not the space itself: the tier tells it how many blocks are free and
which residents are safe to reclaim right now, and carries out the evictions it returns.

Contract of :class:`AdmissionPolicy` (register new ones with :func:`register_admission`):

* ``observe(unit_ids)``: one request of the tier's stream (distinct ids), recorded before
  any decision for that request. May re-rank residents; mutates nothing else.
* ``wants(unit_id)``: is the unit an admission candidate now? Pure.
* ``victims(unit_id, n_blocks, free_blocks, safe)``: the residents to reclaim, in order, so
  that a unit of ``n_blocks`` fits, or ``None`` when it must not be admitted. Pure: the
  caller evicts (``discard``) the victims and then ``add``s the unit. ``safe(v)`` is false
  for residents that cannot be reclaimed now (leased, being written, pinned by the request).
* ``add`` / ``discard``: keep the resident set equal to what the tier holds.

Policies never raise on well-formed input; a broken caller trips an ``assert``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import ClassVar

from tessera.config import ControlConfig
from tessera.control.demand import DemandTracker
from tessera.control.ranking import ScoreBuckets

Safe = Callable[[str], bool]


class AdmissionPolicy(ABC):
    """Base class: resident-set bookkeeping shared by every policy."""

    name: ClassVar[str]

    def __init__(self, control: ControlConfig) -> None:
        self.control = control
        self._blocks: dict[str, int] = {}  # resident unit -> blocks it occupies
        self.used_blocks = 0

    @property
    def resident(self) -> Mapping[str, int]:
        """Resident units and their block counts (read-only view for callers)."""
        return self._blocks

    def __contains__(self, unit_id: object) -> bool:
        return unit_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, unit_id: str, n_blocks: int) -> None:
        assert unit_id not in self._blocks and n_blocks > 0, (unit_id, n_blocks)
        self._blocks[unit_id] = n_blocks
        self.used_blocks += n_blocks
        self._on_add(unit_id)

    def discard(self, unit_id: str) -> bool:
        n = self._blocks.pop(unit_id, None)
        if n is None:
            return False
        self.used_blocks -= n
        self._on_discard(unit_id)
        return True

    @abstractmethod
    def observe(self, unit_ids: tuple[str, ...]) -> None: ...

    @abstractmethod
    def wants(self, unit_id: str) -> bool: ...

    @abstractmethod
    def score(self, unit_id: str) -> float:
        """The ranking value eviction walks in increasing order (for reports and tests)."""

    @abstractmethod
    def victims(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None: ...

    def check_invariants(self) -> None:
        assert self.used_blocks == sum(self._blocks.values()), (self.used_blocks, sum(self._blocks.values()))

    @abstractmethod
    def _on_add(self, unit_id: str) -> None:
        """Hook: a unit became resident."""

    @abstractmethod
    def _on_discard(self, unit_id: str) -> None:
        """Hook: a unit stopped being resident."""


_REGISTRY: dict[str, type[AdmissionPolicy]] = {}


def register_admission(name: str) -> Callable[[type[AdmissionPolicy]], type[AdmissionPolicy]]:
    def deco(cls: type[AdmissionPolicy]) -> type[AdmissionPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def make_admission(name: str, control: ControlConfig) -> AdmissionPolicy:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise KeyError(f"no admission policy named {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return cls(control)


def admission_names() -> list[str]:
    return sorted(_REGISTRY)


@register_admission("demand")
class DemandAdmission(AdmissionPolicy):
    """Retrieval-aware admission (the paper's rule).

    Candidate: s(u) >= θ and, unless ``admit_first``, u retrieved at least twice in this
    tier's stream. If space is short, safe residents with *strictly lower* scores are taken
    from the lowest score up; if they cannot free enough blocks, the candidate is refused.

    Residents are ranked in :class:`ScoreBuckets` by the score they were keyed at; among
    equal scores, the one keyed earliest goes first. Invariant: a key never *over*estimates
    its unit's score. A score only drops when a request leaves the window, and those units
    are re-keyed at once; a score that rose (the unit was retrieved again) is re-keyed
    lazily, when an eviction walk reaches it. The walk may therefore stop at the first key
    >= the candidate's score. Popular units change score on every request; this keeps them
    off the hot path.
    """

    def __init__(self, control: ControlConfig) -> None:
        super().__init__(control)
        self.demand = DemandTracker(control.window, control.w_recent, control.w_lifetime)
        self.theta = control.theta
        self.min_retrievals = 1 if control.admit_first else 2
        self._ranks = ScoreBuckets()

    def observe(self, unit_ids: tuple[str, ...]) -> None:
        demand = self.demand
        left = demand.record(unit_ids)
        ranks = self._ranks
        if not len(ranks):
            return
        for u in left:
            keyed = ranks.keyed(u)
            if keyed is not None:
                now = demand.score(u)
                if now < keyed:
                    ranks.put(u, now)

    def score(self, unit_id: str) -> float:
        return self.demand.score(unit_id)

    def wants(self, unit_id: str) -> bool:
        return self.demand.admissible(unit_id, self.min_retrievals, self.theta)

    def victims(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None:
        need = n_blocks - free_blocks
        if need <= 0:
            return []
        score = self.demand.score
        blocks = self._blocks
        out: list[str] = []
        walk = self._ranks.walk(score(unit_id), lambda v, _: score(v))
        try:
            for v, _ in walk:  # strictly lower scores only, lowest first
                if v != unit_id and safe(v):
                    out.append(v)
                    need -= blocks[v]
                    if need <= 0:
                        return out
            return None
        finally:
            walk.close()

    def ranked(self) -> list[tuple[float, str]]:
        """Residents in eviction order with their exact scores (for tests and dumps)."""
        for s, u in self._ranks.items():
            if self.demand.score(u) != s:
                self._ranks.put(u, self.demand.score(u))
        return self._ranks.items()

    def _on_add(self, unit_id: str) -> None:
        self._ranks.put(unit_id, self.demand.score(unit_id))

    def _on_discard(self, unit_id: str) -> None:
        self._ranks.drop(unit_id)

    def check_invariants(self) -> None:
        super().check_invariants()
        self._ranks.check_invariants()
        assert len(self._ranks) == len(self._blocks), "ranking out of step with the resident set"
        for s, u in self._ranks.items():
            assert s <= self.demand.score(u), f"key of {u} overestimates its score: {s} > {self.score(u)}"
        self.demand.check_invariants()


@register_admission("lru")
class LruAdmission(AdmissionPolicy):
    """Baseline for the ablations C+S and C+S+R: admit everything, evict least recently used."""

    def __init__(self, control: ControlConfig) -> None:
        super().__init__(control)
        self._recency: OrderedDict[str, int] = OrderedDict()  # resident -> stream clock at last use
        self._clock = 0

    def observe(self, unit_ids: tuple[str, ...]) -> None:
        self._clock += 1
        recency = self._recency
        for u in unit_ids:
            if u in recency:
                recency[u] = self._clock
                recency.move_to_end(u)

    def wants(self, unit_id: str) -> bool:
        return True

    def score(self, unit_id: str) -> float:
        return float(self._recency.get(unit_id, self._clock))

    def victims(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None:
        need = n_blocks - free_blocks
        if need <= 0:
            return []
        out: list[str] = []
        for v in self._recency:
            if v != unit_id and safe(v):
                out.append(v)
                need -= self._blocks[v]
                if need <= 0:
                    return out
        return None

    def _on_add(self, unit_id: str) -> None:
        self._recency[unit_id] = self._clock

    def _on_discard(self, unit_id: str) -> None:
        del self._recency[unit_id]
