"""Step 4 of a request (paper Fig. 10): the per-unit plan against the node's snapshot.

For every distinct unit of a routed request, in prompt order:

* **preparation**: LOCAL only if the node's snapshot holds it; REMOTE under a read lease
  on a READY shared entry's epoch; else COMPUTE;
* **retention**, decided independently of preparation: local admission (the node's view of
  its cache; victims the node must evict ride in ``local_evict``) and shared admission (a
  write grant on a new epoch) for a unit not read from the shared tier.

Leases are taken for every remote unit before any retention decision of the same plan, so
no eviction decided later in the plan can reclaim a block the plan reads. A revoked unit is
computed and retained nowhere, whatever the node's snapshot says.

**Assists.** Units are prefilled independently of each other, so the units a request must
compute can be prefilled on two nodes at once, which a prompt's causal prefill cannot. When
they hold at least ``control.assist_min_tokens`` tokens and another node is idle, that node
gets a plan of its own (``RequestPlan.assists``) for about half of their tokens, each under a write
grant of its own; the serving node's plan names it as their ``peer`` and fetches them once
published. Only units the shared tier would admit are given away (the serving node must
read them from there).

The planner only reads and updates control-plane bookkeeping through its collaborators'
verbs; it never waits on the network and never touches tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Sequence

from tessera.auth import plan_seal
from tessera.control.directory import Directory
from tessera.control.local import AdmittedBlocks
from tessera.control.membership import GenerationMember
from tessera.control.requests import RequestTable, RoutedRequest
from tessera.control.shared import SharedTier
from tessera.control.stats import PlaneStats
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, Retention, UnitPlan
from tessera.wire import WIRE_VERSION

LOCAL, REMOTE, COMPUTE = Preparation.LOCAL, Preparation.REMOTE, Preparation.COMPUTE


class InternedPlans:
    """UnitPlans without a lease or grant, one per unit and kind, reused across requests.

    Such a plan is equal for every request of the same unit (and token count), and immutable,
    so a plan reuses it instead of building (and validating) ten dataclasses per request.
    Kinds: held (LOCAL, NEITHER), computed and kept (COMPUTE, LOCAL), computed (COMPUTE,
    NEITHER). Each kind holds at most ``max_units`` plans; past that it starts over.
    """

    def __init__(self, max_units: int = 1 << 16) -> None:
        self.max_units = max_units
        self._held: dict[str, UnitPlan] = {}
        self._kept: dict[str, UnitPlan] = {}
        self._computed: dict[str, UnitPlan] = {}

    def kinds(self) -> tuple[dict[str, UnitPlan], dict[str, UnitPlan], dict[str, UnitPlan]]:
        """The held, kept and computed plans by unit: the planner reads them in its loop, and
        calls :meth:`make` on a miss (or when the unit's token count changed)."""
        return self._held, self._kept, self._computed

    def make(self, kind: dict[str, UnitPlan], unit_id: str, n_tokens: int, prep: Preparation,
             keep_local: bool) -> UnitPlan:
        """Build and intern the plan of one kind (``kind``: one of :meth:`kinds`)."""
        assert prep is not REMOTE and not (prep is LOCAL and keep_local), (unit_id, prep, keep_local)
        assert kind is (self._held if prep is LOCAL else self._kept if keep_local else self._computed), unit_id
        if len(kind) >= self.max_units:
            kind.clear()
        retention = Retention.LOCAL if keep_local else Retention.NEITHER
        plan = kind[unit_id] = UnitPlan(unit_id, n_tokens, prep, retention)
        return plan

    def forget(self, unit_ids: Collection[str]) -> None:
        for kind in (self._held, self._kept, self._computed):
            for u in unit_ids:
                kind.pop(u, None)


class Planner:
    """Finalizes the plans of routed requests (verbs ``plan``, ``forget``)."""

    def __init__(self, directory: Directory, shared: SharedTier, requests: RequestTable, admitted: AdmittedBlocks,
                 stats: PlaneStats, revoked: Container[str] = frozenset(), *,
                 helper: Callable[[GenerationMember], GenerationMember | None] | None = None,
                 assist_min_tokens: int = 0) -> None:
        self.directory = directory
        # an idle node other than the given one, to prefill some units (None: never assist)
        self.helper = helper
        self.assist_min_tokens = assist_min_tokens
        self.shared = shared
        self.requests = requests
        self.admitted = admitted  # block counts of local admissions (a late report re-adds one)
        self.stats = stats
        # deleted or replaced units (owned by the plane): always COMPUTE, retained nowhere
        self.revoked = revoked
        self.interned = InternedPlans()

    def forget(self, unit_ids: Collection[str]) -> None:
        """These units were revoked: their plans must change."""
        self.interned.forget(unit_ids)

    def plan(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        """Step 4 for the request routed to ``node``; ``held``: the node's snapshot of its units."""
        r = self.requests.claim_plan(request_id, node)
        local = r.node.local
        held = self._usable(held)
        pairs = r.pairs
        local.reconcile(pairs, held, self.requests)
        ids = tuple(r.tokens)
        local.observe(ids)
        shared = self.shared
        shared.observe(ids)
        # preparation first: every lease exists before any eviction of this plan is decided
        # (the directory refuses revoked units: their entries are gone or draining)
        lease_of = self.directory.lease
        leases = [None if u in held else lease_of(u, node) for u, _ in pairs]
        helper, given = self._assist(r, held, leases)
        peer = "" if helper is None else helper.name
        # the per-unit steps below are written out in the loop (admission, interned plans, the
        # shared tier's residency, the counters): it runs for every unit of every request, and
        # each call costs as much as the step itself
        revoked, tokens, admitted = self.revoked, r.tokens, self.admitted
        interned = self.interned
        held_plans, kept_plans, computed_plans = interned.kinds()
        shared_table = shared.policy.records
        shared_slots, shared_blocks = shared_table.slots, shared_table.blocks
        units: list[UnitPlan] = []
        evict: list[str] = []
        helped: list[UnitPlan] = []
        n_local = n_remote = n_keep_local = n_keep_shared = computed_blocks = helped_blocks = 0
        for (u, b), lease in zip(pairs, leases, strict=True):
            n = tokens[u]
            retain = u not in revoked
            keep_local = False
            if u in held:
                prep = LOCAL
                n_local += 1
            else:
                if lease is None:
                    prep = COMPUTE
                    computed_blocks += b
                else:
                    prep = REMOTE
                    n_remote += 1
                if retain:
                    # local admission; None also for a unit the view already holds (planned by another request)
                    victims = local.admit(u, b, request_id, tokens)
                    if victims is not None:
                        admitted.admitted(u, b)
                        evict += victims
                        keep_local = True
                        n_keep_local += 1
            grant = None
            # shared admission (a write grant) for a unit the shared tier has no entry of (pending
            # or ready: the policy's residents mirror the directory's entries)
            if retain and lease is None:
                i = shared_slots.get(u)
                if i is None or not shared_blocks[i]:
                    if u in given:
                        grant = shared.admit(u, n, b, peer)
                        if grant is not None:  # the helper prefills and publishes it; this node fetches it
                            n_keep_shared += 1
                            helped_blocks += b
                            computed_blocks -= b
                            helped.append(UnitPlan(u, n, COMPUTE, Retention.SHARED, None, grant))
                            units.append(UnitPlan(u, n, COMPUTE, Retention.of(keep_local, False), peer=peer))
                            continue
                    else:
                        grant = shared.admit(u, n, b, node)
            if lease is None and grant is None:
                kind = held_plans if prep is LOCAL else kept_plans if keep_local else computed_plans
                up = kind.get(u)
                if up is None or up.n_tokens != n:
                    up = interned.make(kind, u, n, prep, keep_local)
                units.append(up)
            else:
                if grant is not None:
                    n_keep_shared += 1
                units.append(UnitPlan(u, n, prep, Retention.of(keep_local, grant is not None), lease, grant))
        assists = self._assists(r, request_id, helper, helped, helped_blocks)
        plan = self._issue(request_id, node, units, evict, assists)
        self.stats.add(len(units), n_local, n_remote, n_keep_local, n_keep_shared, len(evict))
        r.node.computes(request_id, computed_blocks)  # its queued prefill, for routing
        return plan

    def plan_reference(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        """What :meth:`plan` decides, written plainly through the collaborators' verbs.

        The specification of ``plan``: the same plan and the same bookkeeping (leases, grants,
        admissions, evictions, counters), without interned plans or inlined steps; a property
        test holds the two together on random clusters and requests.
        """
        r = self.requests.claim_plan(request_id, node)
        local = r.node.local
        held = self._usable(held)
        local.reconcile(r.pairs, held, self.requests)
        local.observe(tuple(r.tokens))
        self.shared.observe(tuple(r.tokens))
        # every lease before any retention decision, so no eviction of this plan frees a block it reads
        leases = [None if u in held else self.directory.lease(u, node) for u, _ in r.pairs]
        helper, given = self._assist(r, held, leases)
        units: list[UnitPlan] = []
        evict: list[str] = []
        helped: list[UnitPlan] = []
        for (u, b), lease in zip(r.pairs, leases, strict=True):
            n = r.tokens[u]
            retain = u not in self.revoked
            prep = LOCAL if u in held else COMPUTE if lease is None else REMOTE
            victims = local.admit(u, b, request_id, r.tokens) if prep is not LOCAL and retain else None
            if victims is not None:
                self.admitted.admitted(u, b)
                evict += victims
            grant = None
            if retain and lease is None and not self.shared.resident(u):
                grant = self.shared.admit(u, n, b, node if helper is None or u not in given else helper.name)
            if helper is not None and grant is not None and grant.writer == helper.name:
                helped.append(UnitPlan(u, n, COMPUTE, Retention.SHARED, None, grant))
                units.append(UnitPlan(u, n, COMPUTE, Retention.of(victims is not None, False), peer=helper.name))
            else:
                units.append(UnitPlan(u, n, prep, Retention.of(victims is not None, grant is not None), lease, grant))
        self.stats.add(len(units), sum(p.preparation is LOCAL for p in units),
                       sum(p.preparation is REMOTE for p in units), sum(p.retention.local for p in units),
                       sum(p.retention.shared for p in units) + len(helped), len(evict))
        r.node.computes(request_id, sum(b for (_, b), p in zip(r.pairs, units, strict=True)
                                        if p.preparation is COMPUTE and not p.peer))
        given_away = {h.unit_id for h in helped}
        helped_blocks = sum(b for u, b in r.pairs if u in given_away)
        assists = self._assists(r, request_id, helper, helped, helped_blocks)
        return self._issue(request_id, node, units, evict, assists)

    def _assist(self, r: RoutedRequest, held: Collection[str],
                leases: Sequence[ReadLease | None]) -> tuple[GenerationMember | None, frozenset[str]]:
        """The idle node that prefills some of the request's units, and which (module docstring).

        Candidates are the units computed here that the shared tier holds no entry of. The
        largest go first, each to whichever side has less to prefill so far (this node
        starts with the units it computes anyway; a tie goes to this node, which needs no
        transfer): both sides then finish about together, and the extend follows.
        """
        if self.helper is None or not self.assist_min_tokens:
            return None, frozenset()
        helper = self.helper(r.node)
        if helper is None:
            return None, frozenset()
        tokens, revoked, resident = r.tokens, self.revoked, self.shared.resident
        computed = [u for (u, _), lease in zip(r.pairs, leases, strict=True) if lease is None and u not in held]
        total = sum(tokens[u] for u in computed)
        if total < self.assist_min_tokens or len(computed) < 2:
            return None, frozenset()
        candidates = sorted((u for u in computed if u not in revoked and not resident(u)),
                            key=lambda u: -tokens[u])
        given: list[str] = []
        share = 0
        own = total - sum(tokens[u] for u in candidates)
        for u in candidates:
            if share < own:
                given.append(u)
                share += tokens[u]
            else:
                own += tokens[u]
        return (helper, frozenset(given)) if given else (None, frozenset())

    def _assists(self, r: RoutedRequest, request_id: str, helper: GenerationMember | None,
                 helped: list[UnitPlan], blocks: int) -> tuple[RequestPlan, ...]:
        """The helper's plan for the units given to it, its prefill counted in its queue."""
        if helper is None or not helped:
            return ()
        helper.assist(request_id, blocks)
        r.helper = helper
        return (self._issue(request_id, helper.name, helped, []),)

    def _issue(self, request_id: str, node: str, units: list[UnitPlan], evict: list[str],
               assists: tuple[RequestPlan, ...] = ()) -> RequestPlan:
        """The plan under this plane's term, sealed with the cluster secret (the one place plans are signed)."""
        directory = self.directory
        term, issuer = directory.term, directory.capabilities
        seal = "" if issuer is None else plan_seal(issuer.secret, node, term, request_id)
        return RequestPlan(WIRE_VERSION, request_id, node, tuple(units), tuple(evict), term, seal, assists)

    def _usable(self, held: Collection[str]) -> Collection[str]:
        """The snapshot as a set, without revoked units (a node that missed the drop order may hold one)."""
        revoked = self.revoked
        if revoked and any(u in revoked for u in held):
            return {u for u in held if u not in revoked}
        return held if isinstance(held, (set, frozenset)) else set(held)
