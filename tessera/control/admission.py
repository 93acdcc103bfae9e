"""Admission and eviction policies: which units a cache tier retains, and what it gives up for them.

One rule serves both tiers (paper §5.2), one instance per tier fed by its own request
stream. A policy owns the tier's unit table (:mod:`tessera.control.record`) but not the
space: the tier says how many blocks are free and which residents are safe to reclaim, and
carries out the evictions. Callers may read ``records`` (resident iff ``blocks`` > 0); only
the policy writes them.

Contract of :class:`AdmissionPolicy` (register new ones with :func:`register_admission`):

* ``observe(unit_ids)``: one request (distinct ids), before any decision for it; may re-rank.
* ``decide(unit_id, n_blocks, free_blocks, safe)``: the victims to reclaim, in order, to
  admit the unit (``[]``: it fits), or ``None``: not admitted. Pure; ``safe(v)`` is false
  for residents that cannot be reclaimed now (leased, being written, pinned).
* ``wants`` / ``victims``: the two halves ``decide`` composes by default. Pure.
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
from tessera.control.record import NOT_KEYED, UnitTable
from tessera.registry import Registry

Safe = Callable[[str], bool]


class AdmissionPolicy(ABC):
    """Base class: the tier's unit records and resident-set bookkeeping shared by every policy."""

    name: ClassVar[str]

    def __init__(self, control: ControlConfig) -> None:
        self.control = control
        self.records = UnitTable()
        self.used_blocks = 0
        self._n_resident = 0

    @property
    def resident(self) -> Mapping[str, int]:
        """Resident units and their block counts (a snapshot; scans every slot)."""
        ids = self.records.ids
        return {ids[i]: b for i, b in enumerate(self.records.blocks) if b}

    def __contains__(self, unit_id: object) -> bool:
        i = self.records.slots.get(unit_id) if isinstance(unit_id, str) else None
        return i is not None and self.records.blocks[i] > 0

    def __len__(self) -> int:
        return self._n_resident

    def add(self, unit_id: str, n_blocks: int) -> None:
        table = self.records
        i = table.slots.get(unit_id)
        if i is None:
            i = table.slot(unit_id)
        blocks = table.blocks
        assert not blocks[i] and n_blocks > 0, (unit_id, blocks[i], n_blocks)
        blocks[i] = n_blocks
        self.used_blocks += n_blocks
        self._n_resident += 1
        self._on_add(i)

    def discard(self, unit_id: str) -> bool:
        i = self.records.slots.get(unit_id)
        if i is None:
            return False
        blocks = self.records.blocks
        b = blocks[i]
        if not b:
            return False
        self.used_blocks -= b
        self._n_resident -= 1
        blocks[i] = 0
        self._on_discard(i)
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

    def decide(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None:
        """Victims that admit the unit (``[]``: it fits), or None: not admitted. Pure."""
        if not self.wants(unit_id):
            return None
        return self.victims(unit_id, n_blocks, free_blocks, safe)

    def check_invariants(self) -> None:
        table = self.records
        columns = (table.ids, table.recent, table.lifetime, table.blocks, table.keyed)
        assert all(len(c) == len(table.slots) for c in columns), "the unit table's columns differ in length"
        blocks = [b for b in table.blocks if b]
        assert all(b > 0 for b in blocks), "a unit holds a negative block count"
        assert self.used_blocks == sum(blocks), (self.used_blocks, sum(blocks))
        assert self._n_resident == len(blocks), (self._n_resident, len(blocks))
        assert all(table.ids[i] == u for u, i in table.slots.items()), "a slot is filed under another id"

    @abstractmethod
    def _on_add(self, i: int) -> None:
        """Hook: the unit in slot ``i`` became resident (its ``blocks`` is set)."""

    @abstractmethod
    def _on_discard(self, i: int) -> None:
        """Hook: the unit in slot ``i`` stopped being resident (its ``blocks`` is 0)."""


ADMISSIONS: Registry[type[AdmissionPolicy]] = Registry("control.admission")
register_admission = ADMISSIONS.register
admission_names = ADMISSIONS.names


def make_admission(name: str, control: ControlConfig) -> AdmissionPolicy:
    return ADMISSIONS.get(name)(control)


@register_admission("demand")
class DemandAdmission(AdmissionPolicy):
    """Retrieval-aware admission (the paper's rule), which never loses to LRU on free space.

    A unit that fits in free blocks is admitted at first sight: filling free space costs
    nobody anything, while refusing it makes the next identical request compute it again.
    Only when admitting would evict does the score decide: a candidate (s(u) >= θ and, unless
    ``admit_first``, retrieved twice) takes safe residents with *strictly lower* scores,
    lowest first, or is refused.

    Invariant: a resident's key in :class:`ScoreBuckets` never *over*estimates its score.
    Drops (a request leaving the window) are re-keyed at once, rises lazily when a walk
    reaches them, so a walk may stop at the first key >= the candidate's score and popular
    units stay off the hot path.
    """

    def __init__(self, control: ControlConfig) -> None:
        super().__init__(control)
        self.demand = DemandTracker(control.window, control.w_recent, control.w_lifetime, self.records)
        self.theta = control.theta
        self.min_retrievals = 1 if control.admit_first else 2
        self._ranks = ScoreBuckets(self.records)

    def observe(self, unit_ids: tuple[str, ...]) -> None:
        left = self.demand.count(unit_ids)
        ranks = self._ranks
        if not len(ranks):
            return
        demand = self.demand
        w_recent, w_lifetime = demand.w_recent, demand.w_lifetime
        table = self.records
        keyed_of, recent, lifetime = table.keyed, table.recent, table.lifetime
        for i in left:
            keyed = keyed_of[i]
            if keyed != NOT_KEYED:
                now = w_recent * recent[i] + w_lifetime * lifetime[i]  # demand.score_of(i), without the call
                if now < keyed:
                    ranks.put(i, now)

    def score(self, unit_id: str) -> float:
        return self.demand.score(unit_id)

    def decide(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None:
        if n_blocks <= free_blocks:
            return []  # free space: admit at first sight, whatever the score
        # wants() and victims() with one slot lookup: this runs for most units of a plan
        table = self.records
        i = table.slots.get(unit_id)
        demand = self.demand
        if i is None:
            lifetime, score = 0, 0.0
        else:
            lifetime = table.lifetime[i]
            score = demand.w_recent * table.recent[i] + demand.w_lifetime * lifetime
        if lifetime < self.min_retrievals or score < self.theta:
            return None
        return self._victims(unit_id, n_blocks - free_blocks, score, safe)

    def wants(self, unit_id: str) -> bool:
        return self.demand.admissible(unit_id, self.min_retrievals, self.theta)

    def victims(self, unit_id: str, n_blocks: int, free_blocks: int, safe: Safe) -> list[str] | None:
        need = n_blocks - free_blocks
        if need <= 0:
            return []
        return self._victims(unit_id, need, self.demand.score(unit_id), safe)

    def _victims(self, unit_id: str, need: int, score: float, safe: Safe) -> list[str] | None:
        """Safe residents keyed strictly below ``score``, lowest first, until ``need`` blocks are freed."""
        if self._ranks.lowest >= score:
            return None  # nothing is keyed strictly lower, and keys never overestimate
        out: list[str] = []
        table = self.records
        ids, blocks = table.ids, table.blocks
        walk = self._ranks.walk(score, self.demand.score_of)
        try:
            for i in walk:  # strictly lower scores only, lowest first
                v = ids[i]
                if v != unit_id and safe(v):
                    out.append(v)
                    need -= blocks[i]
                    if need <= 0:
                        return out
            return None
        finally:
            walk.close()

    def ranked(self) -> list[tuple[float, str]]:
        """Residents in eviction order with their exact scores (for tests and dumps)."""
        score_of = self.demand.score_of
        for s, i in self._ranks.items():
            if score_of(i) != s:
                self._ranks.put(i, score_of(i))
        ids = self.records.ids
        return [(s, ids[i]) for s, i in self._ranks.items()]

    def _on_add(self, i: int) -> None:
        self._ranks.put(i, self.demand.score_of(i))

    def _on_discard(self, i: int) -> None:
        self._ranks.drop(i)

    def check_invariants(self) -> None:
        super().check_invariants()
        self._ranks.check_invariants()
        assert len(self._ranks) == len(self), "ranking out of step with the resident set"
        table = self.records
        for s, i in self._ranks.items():
            assert table.blocks[i], f"{table.ids[i]} is ranked but not resident"
            now = self.demand.score_of(i)
            assert s <= now, f"key of {table.ids[i]} overestimates its score: {s} > {now}"
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
                need -= self.records.blocks_of(v)
                if need <= 0:
                    return out
        return None

    def _on_add(self, i: int) -> None:
        self._recency[self.records.ids[i]] = self._clock

    def _on_discard(self, i: int) -> None:
        del self._recency[self.records.ids[i]]
