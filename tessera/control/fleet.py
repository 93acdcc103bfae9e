"""The routable generation nodes as bitmasks, so that routing never walks the whole fleet.

Node ``i`` is bit ``1 << i``. Sets kept, one int each: ``alive``; ``at(k)``, the alive nodes
with ``k`` requests in flight; ``queued``, those with an expected wait above 0; ``over``,
those above ``control.max_queue_wait_s``. Members report every change (``update``), so a
router finds the least-loaded candidates with a few big-int operations, at any fleet size.

Invariant (``check_invariants``): an alive node is in exactly one ``at(k)``, ``k`` its
in-flight count; ``wait[i]`` is its expected wait now, and it is in ``queued`` / ``over``
iff that wait is above 0 / the bound; a node that is not alive is in no mask.

This module knows nothing of caches, routing policies or what a node's wait is made of.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol


class FleetMember(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def inflight(self) -> int: ...

    def expected_wait_s(self) -> float: ...


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first (touches only the set bits)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def first_after(mask: int, last: int) -> int:
    """The set bit of ``mask`` (nonzero) that comes first cyclically after bit ``last``.

    That is the lowest round-robin rank ``(i - last - 1) % n``: every index above ``last``
    ranks before every index up to it, and within each group the lower index first.
    """
    assert mask, "first_after of an empty set"
    high = mask >> (last + 1)
    if high:
        return last + (high & -high).bit_length()
    return (mask & -mask).bit_length() - 1


class Fleet:
    """Alive generation nodes by in-flight count and expected wait. Verbs: ``join`` / ``leave``
    (liveness), ``update`` (a member's load or wait changed)."""

    __slots__ = ("_at", "_members", "alive", "lowest", "max_wait_s", "over", "queued", "wait")

    def __init__(self, n_nodes: int, max_wait_s: float) -> None:
        self._members: list[FleetMember | None] = [None] * n_nodes  # alive members by index
        self.max_wait_s = max_wait_s  # control.max_queue_wait_s (0: no bound, no node is over it)
        self._at: list[int] = [0]  # in-flight count -> mask of the alive nodes at that count
        self.alive = 0
        self.wait = [0.0] * n_nodes  # expected wait by index, as of the member's last report
        self.queued = 0
        self.over = 0
        self.lowest = 0  # the smallest in-flight count of an alive node (0 when none is alive)

    # --- verbs ---------------------------------------------------------------------------

    def join(self, m: FleetMember) -> None:
        """``m`` became routable."""
        bit = 1 << m.index
        assert not self.alive & bit, f"node {m.index} joined twice"
        self._members[m.index] = m
        was_empty = not self.alive
        self.alive |= bit
        self._file(bit, m.inflight)
        if was_empty or m.inflight < self.lowest:
            self.lowest = m.inflight
        self._note_wait(m, bit)

    def leave(self, m: FleetMember) -> None:
        """``m`` is no longer routable (dead or unreachable)."""
        bit = 1 << m.index
        assert self.alive & bit, f"node {m.index} left without joining"
        self._members[m.index] = None
        self.alive &= ~bit
        self.queued &= ~bit
        self.over &= ~bit
        self._at[m.inflight] &= ~bit
        self.lowest = self._next_filled(self.lowest) if self.alive else 0

    def update(self, m: FleetMember, was: int) -> None:
        """``m``'s in-flight count went from ``was`` to ``m.inflight``, or its expected wait changed."""
        bit = 1 << m.index
        if not self.alive & bit:
            return  # a dead node's requests still complete; it is filed again when it rejoins
        now = m.inflight
        if now != was:
            at = self._at
            at[was] &= ~bit
            self._file(bit, now)
            if now < self.lowest:
                self.lowest = now
            elif was == self.lowest and not at[was]:
                self.lowest = self._next_filled(was)
        self._note_wait(m, bit)

    # --- queries (the router's view: see tessera.control.router.Loads) --------------------

    def at(self, load: int) -> int:
        """The alive nodes with exactly ``load`` requests in flight."""
        at = self._at
        return at[load] if load < len(at) else 0

    def least(self, eligible: int) -> int:
        """The smallest in-flight count among the ``eligible`` nodes (a nonzero subset of ``alive``)."""
        assert eligible and not eligible & ~self.alive, "least() of nodes that are not alive"
        at = self._at
        load = self.lowest
        while not at[load] & eligible:
            load += 1
        return load

    def inflight(self, index: int) -> int:
        m = self._members[index]
        assert m is not None, f"node {index} is not alive"
        return m.inflight

    def member(self, index: int) -> FleetMember:
        m = self._members[index]
        assert m is not None, f"node {index} is not alive"
        return m

    def members(self, mask: int) -> list[FleetMember]:
        """The alive members of ``mask``, in config order."""
        return [self.member(i) for i in bits(mask & self.alive)]

    # --- internals -----------------------------------------------------------------------

    def _file(self, bit: int, load: int) -> None:
        at = self._at
        while len(at) <= load:
            at.append(0)
        at[load] |= bit

    def _next_filled(self, load: int) -> int:
        """The smallest in-flight count >= ``load`` some alive node has (the fleet is not empty)."""
        at = self._at
        while not at[load]:
            load += 1
        return load

    def _note_wait(self, m: FleetMember, bit: int) -> None:
        wait = self.wait[m.index] = m.expected_wait_s()
        self.queued = self.queued | bit if wait > 0 else self.queued & ~bit
        # "not <=" as the queue bound compares: a wait it admits is never marked over
        over = self.max_wait_s > 0 and not wait <= self.max_wait_s
        self.over = self.over | bit if over else self.over & ~bit

    def check_invariants(self) -> None:
        seen = 0
        for load, mask in enumerate(self._at):
            assert not mask & seen, f"a node is filed at two in-flight counts (again at {load})"
            assert not mask & ~self.alive, f"a node that is not alive is filed at in-flight count {load}"
            for i in bits(mask):
                assert self.inflight(i) == load, f"node {i} is filed at {load}, has {self.inflight(i)} in flight"
            seen |= mask
        assert seen == self.alive, "an alive node is filed at no in-flight count"
        assert not (self.over | self.queued) & ~self.alive, "a node that is not alive is marked queued or over"
        for i in bits(self.alive):
            wait = self.member(i).expected_wait_s()
            assert self.wait[i] == wait, f"node {i}'s expected wait is stale: {self.wait[i]} != {wait}"
            assert bool(self.queued >> i & 1) == (wait > 0), f"node {i}'s queued mark is stale"
            over = self.max_wait_s > 0 and not wait <= self.max_wait_s
            assert bool(self.over >> i & 1) == over, f"node {i}'s queue-bound mark is stale"
        if self.alive:
            assert self.lowest == min(m.inflight for m in self.members(self.alive)), self.lowest
