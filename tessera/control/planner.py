"""Step 4 of a request (paper Fig. 10): the per-unit plan against the node's snapshot.

For every distinct unit of a routed request, in prompt order:

* **preparation**: LOCAL only if the node's snapshot holds it; REMOTE under a read lease
  on a READY shared entry's epoch; else COMPUTE;
* **retention**, decided independently of preparation: local admission (the node's view of
  its cache; victims the node must evict ride in ``local_evict``) and shared admission (a
  write grant on a new epoch).

Leases are taken for every remote unit before any retention decision of the same plan, so
no eviction decided later in the plan can reclaim a block the plan reads.

The planner only reads and updates control-plane bookkeeping; it never waits on the network
and never touches tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from tessera.control.directory import Directory
from tessera.control.requests import RoutedRequest
from tessera.control.shared import SharedTier
from tessera.control.stats import PlaneStats
from tessera.messages import Preparation, ReadLease, RequestPlan, Retention, UnitPlan
from tessera.wire import WIRE_VERSION

LOCAL, REMOTE, COMPUTE = Preparation.LOCAL, Preparation.REMOTE, Preparation.COMPUTE
# UnitPlans without a lease or grant are equal across requests for the same unit; they are
# immutable, so the planner interns them instead of building ten dataclasses per plan.
_INTERNED_MAX = 1 << 16  # per kind of plan


class Planner:
    """Finalizes plans; owns the interned plans and the block counts of local admissions."""

    def __init__(self, directory: Directory, shared: SharedTier, stats: PlaneStats,
                 revoked: Container[str] = frozenset()) -> None:
        self.directory = directory
        # deleted or replaced units (owned by the plane): always COMPUTE, retained nowhere
        self.revoked = revoked
        self.shared = shared
        self.stats = stats
        # block counts of units admitted locally: a late ResidencyReport may re-add one the
        # view had already dropped
        self.admitted_blocks: dict[str, int] = {}
        # interned UnitPlans by kind: held (LOCAL, NEITHER), computed and kept (COMPUTE, LOCAL),
        # computed (COMPUTE, NEITHER); keyed by unit
        self._interned: tuple[dict[str, UnitPlan], ...] = ({}, {}, {})

    def forget(self, unit_ids: Collection[str]) -> None:
        """Drop what the planner remembers of these units (revoked: their plans must change)."""
        for u in unit_ids:
            self.admitted_blocks.pop(u, None)
            for interned in self._interned:
                interned.pop(u, None)

    def plan(self, request_id: str, r: RoutedRequest, held: Collection[str], live: Container[str]) -> RequestPlan:
        """Step 4 for a routed request; ``live``: ids of requests still outstanding."""
        node = r.node.name
        gen = r.node
        local = gen.local
        tokens = r.tokens
        pairs = r.pairs
        ids = tuple(tokens)
        held_set = held if isinstance(held, (set, frozenset)) else set(held)
        revoked = self.revoked
        if revoked and not all(u not in revoked for u in held_set):
            held_set = {u for u in held_set if u not in revoked}  # a node that missed the drop order may hold it
        local.reconcile(pairs, held_set, live)
        local.policy.observe(ids)
        shared = self.shared
        shared.observe(ids)
        directory = self.directory
        # preparation first: every lease exists before any eviction of this plan is decided
        leases: list[ReadLease | None] = [None if u in held_set else directory.lease(u, node) for u, _ in pairs]
        # (directory.lease refuses revoked units: their entries are gone or draining)
        plans: list[UnitPlan] = []
        evict: list[str] = []
        held_plans, kept_plans, computed_plans = self._interned
        hits = kept_local = kept_shared = 0
        for (u, b), lease in zip(pairs, leases, strict=True):
            n = tokens[u]
            if u in revoked:
                plans.append(UnitPlan(u, n, COMPUTE, Retention.NEITHER))
                continue
            if u in held_set:
                prep = LOCAL
                keep_local = False
                hits += 1
            else:
                prep = COMPUTE if lease is None else REMOTE
                # None also for a unit the view already holds (planned by another request)
                victims = local.admit(u, b, request_id, tokens)
                keep_local = victims is not None
                if keep_local:
                    kept_local += 1
                    self.admitted_blocks[u] = b
                    if victims:
                        evict += victims
            if lease is None:
                # the shared policy's residents mirror the directory's entries (pending or ready)
                grant = None if shared.resident(u) else shared.admit(u, n, b, node)
                if grant is None:
                    interned = held_plans if prep is LOCAL else kept_plans if keep_local else computed_plans
                    plan = interned.get(u)
                    if plan is None or plan.n_tokens != n:
                        plan = interned[u] = UnitPlan(
                            u, n, prep, Retention.LOCAL if keep_local else Retention.NEITHER)
                    plans.append(plan)
                    continue
                kept_shared += 1
            else:
                grant = None
            plans.append(UnitPlan(u, n, prep, Retention.of(keep_local, grant is not None), lease, grant))
        for interned in self._interned:
            if len(interned) > _INTERNED_MAX:
                interned.clear()
        self.stats.count_plan(len(plans), hits, len(leases) - leases.count(None), kept_local,
                              kept_shared, len(evict))
        return RequestPlan(WIRE_VERSION, request_id, node, tuple(plans), tuple(evict))

